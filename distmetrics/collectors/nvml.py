"""GPU energy, power, telemetry and identity from NVML (``pip install nvidia-ml-py``: the "nvml" extra).

Each rank opens the NVML handle of *its own* GPU by UUID, taken from
``torch.cuda.get_device_properties``: an index-based lookup would follow NVML's enumeration,
which ignores ``CUDA_VISIBLE_DEVICES`` and may order GPUs differently from CUDA, and so can
read a neighbour's counters. Energy comes from ``nvmlDeviceGetTotalEnergyConsumption``
deltas (millijoules since the driver loaded), not from instantaneous power samples; it is read
on log steps and at ``pause()``/``resume()``, nowhere else. A GPU without the counter or a
machine without NVML gives no energy metrics — never zeros that look measured — and one warning
for the job (:class:`NotOpened`), not one per rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from .base import Alert, LogContext, Sample

__all__ = ["EnergyCollector", "TelemetryCollector", "NotOpened", "cuda_device_uuid", "open_nvml_handle",
           "gpu_model_info"]

logger = logging.getLogger("distmetrics")
_COUNTER_RANGE = 2 ** 64  # the energy counter is an unsigned 64-bit number of mJ
_GPUS = "_energy/gpus"  # an internal lane: how many ranks' GPUs were measured
_POWER = "_energy/power_w"  # another: each measured GPU's mean power over its own interval, summed


def cuda_device_uuid(index: Optional[int] = None) -> str:
    """NVML-style UUID (``GPU-…``) of a CUDA device as CUDA numbers it (after remapping)."""
    index = torch.cuda.current_device() if index is None else index
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def open_nvml_handle(uuid: str) -> tuple[Any, Any]:
    """(pynvml module, handle of the GPU with this UUID); raises if NVML is unusable."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid.encode() if isinstance(uuid, str) else uuid)


def _own_gpu(uuid: Optional[str]) -> tuple[str, tuple[Any, Any]]:
    """(UUID, (pynvml, handle)) of this rank's GPU, or of ``uuid`` when given."""
    if uuid is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device on this rank")
        uuid = cuda_device_uuid()
    return uuid, open_nvml_handle(uuid)


class NotOpened:
    """Why this rank's GPU could not be opened in NVML when its collector was made, said once for the
    job rather than by each rank (1,000 identical lines on 1,000 ranks), while the cause can differ by
    rank (a host without the driver). Each rank concerned sends two lanes with the log step's reduction (no
    collective of its own): ``<lane>/ranks`` counts them (sum), ``<lane>/first`` names the lowest of
    them (max: ties go to the lowest rank), and that rank says it at the first log step with its own
    error. ``says``: what is not measured and what would measure it, ahead of the count."""

    def __init__(self, lane: str, says: str) -> None:
        self.lane, self.says = lane, says
        self.error: Optional[str] = None
        """This rank's failure (``Type: message``), or None where its GPU was opened."""
        self._said = False

    def samples(self) -> list[Sample]:
        """The two lanes, where this rank's GPU was not opened."""
        if self.error is None:
            return []
        return [Sample(f"{self.lane}/ranks", 1.0, "sum"), Sample(f"{self.lane}/first", 1.0, "max")]

    def say(self, metrics: dict[str, Any], ctx: LogContext) -> None:
        """Take the lanes out of the reduced ``metrics``; the first time some rank sent them, the
        lowest such rank says it (the same lanes on every rank: no other rank says it later)."""
        ranks = metrics.pop(f"{self.lane}/ranks", None)
        first = metrics.pop(f"{self.lane}/first/max_rank", None)
        metrics.pop(f"{self.lane}/first", None)
        if ranks is None or self._said:
            return
        self._said = True
        rank, world = (0, 1) if ctx.layout is None else (ctx.layout.rank, ctx.layout.world_size)
        if self.error is not None and first == rank:
            logger.warning("distmetrics: %s on %d of the %d ranks (rank %d, the first of them: %s). Said once, by "
                           "that rank", self.says, int(ranks), world, rank, self.error)

    def say_at_close(self) -> None:
        """Where no log step reduced the lanes (an evaluation-only job, one that ended before its first
        log step), this rank says its own failure as it closes: unsaid, it was never said."""
        if self.error is not None and not self._said:
            self._said = True
            logger.warning("distmetrics: %s on this rank (%s); no log step said it for the job", self.says, self.error)


class EnergyCollector:
    """Energy deltas per log interval → energy/*, power/* samples."""

    name = "energy"
    after = ()
    writes = ("energy/", "power/")

    def __init__(self, world_size: int, uuid: Optional[str] = None) -> None:
        self.world_size = world_size
        self.enabled = False
        self.job_mj = 0.0  # this rank's energy since the start, pauses excluded
        self._written = False  # a record held energy (the same on every rank: read from the reduced metrics)
        self._counted_mj = 0  # this interval's energy up to the last pause (counted span by span)
        self._paused_s = 0.0
        self._pause_start: Optional[float] = None  # when the pause began
        self._reset_said = False
        self.uuid = uuid
        self.not_opened = NotOpened("_energy/not_opened", "GPU energy is not measured (log_energy has no effect "
                                    "there: it needs an NVIDIA GPU with an energy counter, Volta or newer, and "
                                    '`pip install nvidia-ml-py`, the "nvml" extra)')
        try:
            uuid, (self._nvml, self._handle) = _own_gpu(uuid)
            self._last_mj = self._read()
        except Exception as err:  # noqa: BLE001 - every failure means "not measured", said once for the job
            self.not_opened.error = f"{type(err).__name__}: {err}"
            return
        self.uuid = uuid
        self._last_t = time.perf_counter()
        self.enabled = True

    def _read(self) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))

    def _delta(self, now_mj: int, before_mj: int) -> int:
        # Integers: near 2**64 a float would lose the low digits. The counter is unsigned 64-bit:
        # a smaller reading near its top means it wrapped around (2**64 mJ is ~580,000 years at
        # 1 kW); any other smaller reading means it was reset (a driver reload, a GPU reset), and
        # what it counted since the reset is the energy known.
        if now_mj >= before_mj:
            return now_mj - before_mj
        if before_mj >= _COUNTER_RANGE // 2:
            return now_mj + _COUNTER_RANGE - before_mj
        if not self._reset_said:
            self._reset_said = True
            logger.warning("distmetrics: the GPU energy counter of %s went back from %d to %d mJ (reset, e.g. "
                           "by a driver reload): the energy between the reading before it and the reset is not "
                           "counted.",
                           self.uuid, before_mj, now_mj)
        return now_mj

    def _measured(self, read: Any) -> Any:
        """``read()``, or None after turning energy off with one warning where NVML fails mid-run
        (the other ranks go on: their records say how many GPUs were measured)."""
        try:
            return read()
        except Exception as err:  # noqa: BLE001 - an NVML error mid-run must not end the training step
            self.enabled = False
            logger.warning("distmetrics: GPU energy is not measured from here on: reading %s's counter failed "
                           "(%s: %s).", self.uuid, type(err).__name__, err)
            return None

    def start(self) -> None:
        """Count from now (the Monitor calls this at the first ``monitor.step``, as it starts the
        step clock: building the Monitor is no step's energy). A pause before it (an evaluation
        before training) is left behind and ends here, as it does for the step clock and the step
        timer: every clock counts from the first step."""
        if self.enabled:
            self._pause_start = None
            self._measured(self._start_count)

    def _start_count(self) -> bool:
        self._last_mj, self._last_t = self._read(), time.perf_counter()
        self._counted_mj, self._paused_s = 0, 0.0
        return True

    def pause(self) -> None:
        """Stop counting (evaluation, checkpointing), as Megatron's energy monitor does: the span
        since the last reading is counted now, so a counter reset later costs only what follows it."""
        if self.enabled and self._pause_start is None:
            now_mj = self._measured(self._read)
            if now_mj is not None:
                self._counted_mj += self._delta(now_mj, self._last_mj)
                self._pause_start = time.perf_counter()

    def resume(self) -> None:
        """Count again after :meth:`pause` from the counter's reading now: the paused energy and
        time are left out."""
        if self.enabled and self._pause_start is not None:
            now_mj = self._measured(self._read)
            if now_mj is not None:
                self._last_mj = now_mj
                self._paused_s += time.perf_counter() - self._pause_start
            self._pause_start = None

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """This rank's energy since the last log step and its mean power (pauses left out), and
        that it measured (``_energy/gpus``: a rank without the counter sends nothing)."""
        if self.enabled and self._pause_start is not None:
            self.resume()
        now_mj = self._measured(self._read) if self.enabled else None
        if now_mj is None:
            return self.not_opened.samples()
        now_t = time.perf_counter()
        joules = (self._counted_mj + self._delta(now_mj, self._last_mj)) / 1000.0
        seconds = max(1e-9, now_t - self._last_t - self._paused_s)
        self._last_mj, self._last_t, self._counted_mj, self._paused_s = now_mj, now_t, 0, 0.0
        self.job_mj += joules * 1000.0
        return [Sample("energy/total_j", joules, "sum"),
                Sample("energy/job_total_j", self.job_mj / 1000.0, "sum"),
                Sample("power/w", joules / seconds, "minmax"),
                Sample(_POWER, joules / seconds, "sum"),
                Sample(_GPUS, 1.0, "sum")]

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Energy per GPU per step and per token, mean power per GPU (each GPU's over its own
        rank's interval). Per GPU means per GPU measured; where some rank's GPU was not (no
        counter, NVML failed), the totals and the energy per token, which need every GPU's, are
        left out and ``energy/gpus_measured`` says how many were."""
        self.not_opened.say(metrics, ctx)
        gpus, power = metrics.pop(_GPUS, None), metrics.pop(_POWER, None)
        if "energy/total_j" not in metrics:
            if self._written:  # every rank's NVML failed since: none measured, said as where some are not
                metrics["energy/gpus_measured"] = 0
            return []
        self._written = True
        total = metrics["energy/total_j"]
        gpus = int(round(gpus)) if gpus else self.world_size
        if gpus < self.world_size:
            metrics["energy/gpus_measured"] = gpus
            del metrics["energy/total_j"]
            metrics.pop("energy/job_total_j", None)
        if ctx.ended_at is not None:  # close(): the energy counts up to now, the steps' time ended
            return self._rename_power(metrics)  # at the last monitor.step: no ratio of the two
        steps = ctx.steps if ctx.timed_steps is None else ctx.timed_steps  # the steps the clocks measured
        if steps == 0:  # no step timed yet (the first record at log_interval 1): power over ~0 s
            for end in ("max", "min"):
                metrics.pop(f"power/w/{end}", None)
                metrics.pop(f"power/w/{end}_rank", None)
            return []
        tokens = ctx.tokens if ctx.timed_tokens is None else ctx.timed_tokens
        metrics["energy/j_per_gpu_per_step"] = total / gpus / steps
        if tokens and gpus == self.world_size and not ctx.tokenless_steps:  # some steps' tokens not known
            metrics["energy/j_per_token"] = total / tokens
        if power is not None:  # each GPU's energy over its own rank's interval (they differ by the ranks' skew)
            metrics["power/mean_w"] = power / gpus
        return self._rename_power(metrics)

    @staticmethod
    def _rename_power(metrics: dict[str, Any]) -> list[Alert]:
        for end in ("max", "min"):
            if f"power/w/{end}" in metrics:
                metrics[f"power/{end}_w"] = metrics.pop(f"power/w/{end}")
                metrics[f"power/{end}_w_rank"] = metrics.pop(f"power/w/{end}_rank")
        return []

    def close(self) -> None:
        """Nothing to release (NVML stays initialised for the process); a GPU not opened is said here
        where no log step said it."""
        self.not_opened.say_at_close()


class TelemetryCollector:
    """Clocks, temperature, utilisation, PCIe, fan and throttle reasons, min/max with ranks."""

    name = "gpu_telemetry"
    after = ()
    writes = ("gpu/",)

    def __init__(self, uuid: Optional[str] = None) -> None:
        self.enabled = False
        self.not_opened = NotOpened("_gpu/not_opened", "GPU telemetry is not collected (log_gpu_telemetry has no "
                                    "effect there)")
        try:
            _, (self._nvml, self._handle) = _own_gpu(uuid)
        except Exception as err:  # noqa: BLE001 - said once for the job
            self.not_opened.error = f"{type(err).__name__}: {err}"
            return
        self.enabled = True
        self._broken: set[str] = set()
        self._said_failing = False

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """Current readings (a reading this GPU does not support is skipped from then on; one that fails
        otherwise, a GPU lost or an NVML error, is left out of this record, said once by this rank, and
        tried again at the next log step)."""
        if not self.enabled:
            return self.not_opened.samples()
        n, h = self._nvml, self._handle
        readers = {
            "gpu/sm_clock_mhz": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
            "gpu/max_sm_clock_mhz": lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
            "gpu/temperature_c": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
            "gpu/slowdown_temperature_c": lambda: n.nvmlDeviceGetTemperatureThreshold(
                h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            "gpu/utilization_pct": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu,
            "gpu/memory_utilization_pct": lambda: n.nvmlDeviceGetUtilizationRates(h).memory,
            "gpu/pcie_rx_mib_s": lambda: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) / 1024.0,
            "gpu/pcie_tx_mib_s": lambda: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) / 1024.0,
            "gpu/fan_pct": lambda: n.nvmlDeviceGetFanSpeed(h),
            "gpu/throttle_reasons": lambda: _throttle_reasons(n, h),
        }
        out, failed = [], []
        for name, read in readers.items():
            if name in self._broken:
                continue
            try:
                value = read()
                out.append(Sample(name, float(value), "minmax"))
                if name == "gpu/throttle_reasons":  # the max of a bitmask hides other ranks' reasons: count them
                    out += [Sample(f"gpu/throttled_ranks/{reason}", float(bool(value & bits)), "sum")
                            for bits, reason in THROTTLE_REASONS]
            except Exception as err:  # noqa: BLE001 - e.g. no fan on a passively cooled board
                if _unsupported(n, err):
                    self._broken.add(name)  # not supported here: stop asking, report nothing
                else:
                    failed.append((name, err))
        if failed and not self._said_failing:  # this rank's own GPU: the extremes would name another's, unsaid
            self._said_failing = True
            rank = 0 if ctx.layout is None else ctx.layout.rank
            name, err = failed[0]
            logger.warning("distmetrics: rank %d: %d GPU telemetry reading(s) failed at step %d (%s: %s: %s): left "
                           "out of the record (gpu/ min and max are then the other ranks'), and tried again at every "
                           "log step; said once", rank, len(failed), ctx.step, name, type(err).__name__, err)
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Nothing to derive: the ranks whose GPU was not opened are said once."""
        self.not_opened.say(metrics, ctx)
        return []

    def close(self) -> None:
        """Nothing to release; a GPU not opened is said here where no log step said it."""
        self.not_opened.say_at_close()


def _unsupported(n: Any, err: BaseException) -> bool:
    """Whether a reading's error says this GPU or driver has no such reading (NVML's NOT_SUPPORTED or
    FUNCTION_NOT_FOUND, or a pynvml without the function), not that reading it failed this time."""
    if isinstance(err, AttributeError):
        return True
    value = getattr(err, "value", None)
    return value is not None and value in (getattr(n, "NVML_ERROR_NOT_SUPPORTED", 3),
                                           getattr(n, "NVML_ERROR_FUNCTION_NOT_FOUND", 13))


THROTTLE_REASONS = ((0x2, "applications_clocks"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"), (0x10, "sync_boost"),
                    (0x20, "sw_thermal"), (0x40, "hw_thermal"), (0x80, "hw_power_brake"), (0x100, "display_clocks"),
                    (~0x1FF, "other"))
"""NVML's clocks event reason bits (``nvmlClocksEventReason*``; GPU idle, 0x1, is no slowdown) and the name of
each one's ``gpu/throttled_ranks/`` count; ``other``: a bit this table does not know."""


def _throttle_reasons(n: Any, h: Any) -> int:
    """The clock throttle bitmask, without the 'GPU idle' bit (idle is not a slowdown)."""
    getter = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
    idle = getattr(n, "nvmlClocksEventReasonGpuIdle", getattr(n, "nvmlClocksThrottleReasonGpuIdle", 1))
    return int(getter(h)) & ~int(idle)


def gpu_model_info(rank: int) -> dict:
    """This rank's GPU: name, SMs, capability, memory, UUID, driver, CUDA runtime."""
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info = {"rank": rank, "device": index, "name": props.name, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 1024 ** 3,
            "uuid": cuda_device_uuid(index), "cuda_runtime": torch.version.cuda}
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # noqa: BLE001
        info["driver"] = None
    return info
