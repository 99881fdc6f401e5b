"""Straggler scores: how fast each rank is against the fastest, over a sliding window of log steps.

``score[r] = min over ranks q of median(q) / median(r)``, where ``median(r)`` is the median of
rank r's step times (ms per step) over the last ``straggler_window`` log steps: 1.0 is as fast
as the fastest rank, 0.5 takes twice its time. The median makes one slow interval (a
checkpoint, a garbage-collection pause) count for little and a rank that is slow every time
count fully. The same score is kept per timer where every rank's timer values reach the log
step (``timing_log_option: all``, or the ``_ranks/timers/<name>`` lanes a timer collector adds).

Cost: each rank's step time is one ``all`` sample, so it rides the log step's one all-gather
(with the GPU's power and SM clock beside it when NVML is on); where nothing else is gathered
it is that one gather. Between log steps nothing is measured but a clock reading.

A rank's step time is its own wall time from the end of the last log step's reduction to the
start of this one, over the steps in between: the wait inside the log step's collectives (for
the slowest rank) is left out. Collectives inside the training step (gradient all-reduce,
FSDP all-gathers) make the fast ranks wait for the slow one *within* their steps, so in a job
whose steps synchronise the step scores come out close to 1 everywhere; the per-timer scores
(a data-loading timer, a compute timer) are where such a straggler shows.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from ..interval import IntervalClock
from ..reduce import PerRank
from .base import Alert, LogContext, Record, Sample

__all__ = ["StragglerCollector", "window_scores", "relative_scores", "slowest_ranks", "fastest_ranks",
           "STEP_MS", "RANK_TIMERS_PREFIX"]

STEP_MS = "_stragglers/step_ms"
"""Internal lane: this rank's milliseconds per step over the interval (gathered from every rank)."""
POWER_W = "_stragglers/power_w"
SM_CLOCK_MHZ = "_stragglers/sm_clock_mhz"
RANK_TIMERS_PREFIX = "_ranks/timers/"
"""Internal lanes ``_ranks/timers/<name>``: every rank's timer value where timers reduce as max/minmax."""


class StragglerCollector:
    """Per-rank straggler scores over a sliding window, the slowest rank every log step, a
    ``stragglers`` record every ``report_every`` log steps and an alert for a rank that stays
    below ``threshold`` for a whole window."""

    name = "stragglers"
    after = ("timers",)  # reads every rank's timer values from the reduced metrics
    writes = ("stragglers/",)

    def __init__(self, window: int = 10, report_every: int = 10, report_ranks: int = 8, threshold: float = 0.9,
                 nvml: bool = False, uuid: Optional[str] = None) -> None:
        if window < 1:
            raise ValueError(f"straggler_window={window!r}: accepted values are integers >= 1 here (0 turns "
                             "the collector off before it is built)")
        self.window, self.report_every, self.report_ranks = window, report_every, report_ranks
        self.threshold = threshold
        self._windows = _Windows(window)  # "" for the step time, else a timer's name
        self._streak: Optional[torch.Tensor] = None  # per rank: log steps in a row below the threshold
        self._alerted: set[int] = set()
        self._log_steps = 0
        self._gpu = _GpuReadings.open(uuid) if nvml else None
        self.clock = IntervalClock()
        self._untimed = 0  # 1 in the first interval: the step whose call started the clock

    def start(self) -> None:
        """Start this rank's clock at the first ``monitor.step`` (building the Monitor is no step's time)."""
        self.clock.restart()
        self._untimed = 1

    def pause(self) -> None:
        """Stop this rank's clock (``monitor.pause()``: evaluation, a checkpoint save)."""
        self.clock.pause()

    def resume(self) -> None:
        """Start the clock again after :meth:`pause`; the paused time is left out."""
        self.clock.resume()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """This rank's milliseconds per step since the last log step, pauses left out (and its
        GPU's power and SM clock when NVML is on), every rank's value gathered."""
        timed, self._untimed = ctx.steps - self._untimed, 0
        ms = 1000.0 * self.clock.take() / timed if timed > 0 else math.nan  # NaN: no time this interval
        samples = [Sample(STEP_MS, ms, "all")]
        if self._gpu is not None:
            samples += [Sample(name, value, "all") for name, value in self._gpu.read().items()]
        return samples

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Any]:
        """``stragglers/score_min`` and where it runs, per-timer minima, the periodic record and
        the alert; the internal lanes are taken out of ``metrics``. Every series (the step time,
        each timer) is scored in the same few tensor operations."""
        step_ms = metrics.pop(STEP_MS, None)
        gpu = {"power_w": metrics.pop(POWER_W, None), "sm_clock_mhz": metrics.pop(SM_CLOCK_MHZ, None)}
        series = {"": step_ms} if step_ms is not None else {}
        series.update(_every_ranks_timers(metrics))
        out: list[Any] = []
        if series:
            times, scores = self._windows.push(series)
            rows = [self._windows.index[name] for name in series]
            values, ranks = scores[rows].nan_to_num(math.inf).min(dim=1)  # the lowest rank on a tie
            for name, value, rank in zip(series, values.tolist(), ranks.tolist()):
                key = f"stragglers/{name}/score_min" if name else "stragglers/score_min"
                _write_minimum(metrics, key, value, rank, ctx.hosts, with_host=not name)
            if step_ms is not None:
                step = self._windows.index[""]
                out += self._persistent(times[step], scores[step], ctx.hosts)
        self._log_steps += 1
        if step_ms is not None and self.report_every and self._log_steps % self.report_every == 0:
            out.append(Record("stragglers", self._report(list(series), scores, gpu, ctx.hosts)))
        self.clock.restart()  # the next interval starts after this log step's reduction
        return out

    def close(self) -> None:
        """Nothing to release."""

    # --- helpers -------------------------------------------------------------------------
    def _persistent(self, times: torch.Tensor, score: torch.Tensor, hosts: Sequence[Any]) -> list[Alert]:
        """One alert naming the ranks that newly scored below the threshold at every log step of
        a full window (a rank is named again only after it has recovered); ``times``: this log
        step's (valid or NaN), ``score``: the window's."""
        below = _relative(times) < self.threshold  # NaN: not below
        if self._streak is None or self._streak.numel() != below.numel():  # another world size: start over
            self._streak = torch.zeros(below.numel(), dtype=torch.int64)
        self._streak = torch.where(below, self._streak + 1, 0)
        full = self._streak >= self.window
        if not self._alerted and not bool(full.any()):  # the usual case: one check, nothing to name
            return []
        stuck = full.nonzero().flatten().tolist()
        new = [r for r in stuck if r not in self._alerted]
        self._alerted = set(stuck)
        if not new:
            return []
        named = [f"rank {r} ({_where(r, hosts)}, score {score[r].item():.2f})" for r in new[:self.report_ranks]]
        more = f" and {len(new) - len(named)} more" if len(new) > len(named) else ""
        message = (f"straggler: {', '.join(named)}{more} below {self.threshold:g} of the fastest rank's "
                   f"speed at each of the last {self.window} log steps")
        return [Alert("straggler", message, {"ranks": new, "threshold": self.threshold,
                                             "scores": [_finite(score[r].item()) for r in new]})]

    def _report(self, names: list[str], scores: torch.Tensor, gpu: dict, hosts: Sequence[Any]) -> dict:
        """The ``stragglers`` record: the slowest and fastest ranks with their hosts, scores and
        median milliseconds per step (with NVML, their last power and SM clock readings); per
        timer (``names`` after the step time), its slowest ranks."""
        n = self.report_ranks
        medians = self._windows.medians()

        def rows(name: str, ranks: list[int]) -> list[dict]:
            i = self._windows.index[name]
            out = []
            for rank in ranks:
                row = {"rank": rank, "host": _host(rank, hosts), "local_rank": _local_rank(rank, hosts),
                       "score": _finite(scores[i, rank].item()), "ms": _finite(medians[i, rank].item())}
                if not name:
                    row.update({key: _rank_value(values, rank) for key, values in gpu.items() if values is not None})
                out.append(row)
            return out

        step = scores[self._windows.index[""]]
        return {"window": self._windows.filled, "threshold": self.threshold,
                "slowest": rows("", slowest_ranks(step, n)), "fastest": rows("", fastest_ranks(step, n)),
                "timers": {name: rows(name, slowest_ranks(scores[self._windows.index[name]], n))
                           for name in names if name}}


# --- the score maths ---------------------------------------------------------------------

class _Windows:
    """Every series' per-rank values (the step time, each timer) over the last ``size`` log steps:
    one ``[size, series, world]`` float64 ring, NaN where a rank (or the series) had no valid
    value at that log step. A series seen first joins with an empty window; another world size
    starts every window over. Row order does not matter to a median."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.index: dict[str, int] = {}  # series name -> its row
        self.ring: Optional[torch.Tensor] = None
        self.filled = self._next = 0

    def push(self, series: dict[str, Sequence[Optional[float]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This log step's values → (``[series, world]`` valid times or NaN, scores over the window)."""
        world = len(next(iter(series.values())))
        if self.ring is None or self.ring.shape[2] != world:
            self.index, self.filled, self._next = {}, 0, 0
            self.ring = torch.empty(self.size, 0, world, dtype=torch.float64)
        new = [name for name in series if name not in self.index]
        if new:
            self.index.update({name: len(self.index) + i for i, name in enumerate(new)})
            self.ring = torch.cat([self.ring, torch.full((self.size, len(new), world), math.nan,
                                                         dtype=torch.float64)], dim=1)
        absent = [math.nan] * world
        times = _valid(torch.tensor([[math.nan if v is None else v for v in series[name]] if name in series
                                     else absent for name in self.index], dtype=torch.float64))
        self.ring[self._next] = times
        self._next = (self._next + 1) % self.size
        self.filled = min(self.filled + 1, self.size)
        return times, _relative(self.medians())

    def medians(self) -> torch.Tensor:
        """``[series, world]`` medians over the window (NaN: no valid value in it)."""
        return _medians(self.ring[:self.filled])


def window_medians(window: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank median over a window of ``[world]`` time vectors (the mean of the two middle
    values for an even count, as numpy's); values that are not finite or not > 0 (a rank
    without the value) are left out; NaN for a rank without any."""
    return _medians(_valid(torch.stack([w.to(torch.float64) for w in window])))


def _medians(rows: torch.Tensor) -> torch.Tensor:
    """Column medians of ``[k, world]`` rows whose missing values are NaN (NaN: a column without
    any): the mean of the lower median and the upper one (the lower median of the negated rows)."""
    if rows.shape[0] == 1:
        return rows[0]
    return (rows.nanmedian(dim=0).values - rows.neg().nanmedian(dim=0).values) / 2


def _valid(times: torch.Tensor) -> torch.Tensor:
    """``times`` with NaN where a value is not finite or not > 0."""
    return times.where((times > 0) & (times < math.inf), math.nan)


def _relative(times: torch.Tensor) -> torch.Tensor:
    """The smallest time of each row (the last dimension) over each time; NaN stays NaN, a row
    without a valid time is all NaN."""
    return times.nan_to_num(math.inf).amin(dim=-1, keepdim=True) / times


def window_scores(window: Sequence[torch.Tensor]) -> torch.Tensor:
    """``score[r] = min_q median(q) / median(r)`` over the window, in (0, 1]; NaN where a rank
    has no valid value."""
    return _relative(window_medians(window))


def relative_scores(times: torch.Tensor) -> torch.Tensor:
    """The fastest (smallest) valid time over each rank's time; NaN for invalid times."""
    return _relative(_valid(times))


def slowest_ranks(scores: torch.Tensor, n: int) -> list[int]:
    """The ``n`` ranks with the lowest scores, slowest first (NaN never; ties: lower rank first)."""
    return _ranked(scores, n, descending=False)


def fastest_ranks(scores: torch.Tensor, n: int) -> list[int]:
    """The ``n`` ranks with the highest scores, fastest first (NaN never; ties: lower rank first)."""
    return _ranked(scores, n, descending=True)


def _ranked(scores: torch.Tensor, n: int, descending: bool) -> list[int]:
    valid = (~torch.isnan(scores)).nonzero().flatten()
    order = torch.sort(scores[valid], descending=descending, stable=True).indices
    return valid[order][:max(int(n), 0)].tolist()


def _every_ranks_timers(metrics: dict[str, Any]) -> dict[str, PerRank]:
    """Every rank's timer values: ``timers/<name>`` under ``all``, else the ``_ranks/timers/<name>``
    lanes (taken out of ``metrics``); one pass over ``metrics``."""
    per_rank = [(key, value) for key, value in metrics.items() if isinstance(value, PerRank)]
    found: dict[str, PerRank] = {}
    for key, value in per_rank:
        if key.startswith(RANK_TIMERS_PREFIX):
            found[key[len(RANK_TIMERS_PREFIX):]] = metrics.pop(key)
    for key, value in per_rank:
        if key.startswith("timers/"):
            found.setdefault(key[len("timers/"):], value)
    return found  # the lanes' summaries (``/max``...) start with "_": the Monitor leaves them out


def _write_minimum(metrics: dict[str, Any], key: str, value: float, rank: int, hosts: Sequence[Any],
                   with_host: bool) -> None:
    if value == math.inf:  # no rank has a score
        return
    metrics[key] = value
    metrics[f"{key}_rank"] = rank
    if with_host and rank < len(hosts):
        metrics[f"{key}_host"] = _host(rank, hosts)
        metrics[f"{key}_local_rank"] = _local_rank(rank, hosts)


def _rank_value(values: Sequence[Optional[float]], rank: int) -> Optional[float]:
    return _finite(values[rank]) if rank < len(values) else None


def _finite(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def _host(rank: int, hosts: Sequence[Any]) -> Optional[str]:
    return hosts[rank].hostname if rank < len(hosts) else None


def _local_rank(rank: int, hosts: Sequence[Any]) -> Optional[int]:
    return hosts[rank].local_rank if rank < len(hosts) else None


def _where(rank: int, hosts: Sequence[Any]) -> str:
    if rank >= len(hosts):
        return "host unknown"
    return f"{hosts[rank].hostname}, local rank {hosts[rank].local_rank}"


class _GpuReadings:
    """This rank's GPU power (W) and SM clock (MHz) from NVML, read at log steps only."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle
        self._broken: set[str] = set()

    @classmethod
    def open(cls, uuid: Optional[str]) -> Optional["_GpuReadings"]:
        """Readings of this rank's GPU (by UUID), or None where NVML cannot be used: the energy
        and telemetry collectors already say why, once."""
        from .nvml import cuda_device_uuid, open_nvml_handle

        try:
            return cls(*open_nvml_handle(uuid or cuda_device_uuid()))
        except Exception:  # noqa: BLE001 - no GPU, no NVML: the record leaves power and clock out
            return None

    def read(self) -> dict[str, float]:
        """The readings this GPU supports (one that fails is not asked again)."""
        n, h = self._nvml, self._handle
        readers = {POWER_W: lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                   SM_CLOCK_MHZ: lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)}
        out = {}
        for name, read in readers.items():
            if name in self._broken:
                continue
            try:
                out[name] = float(read())
            except Exception:  # noqa: BLE001 - not supported on this board
                self._broken.add(name)
        return out
