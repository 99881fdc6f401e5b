"""Step timers with Megatron-Core's ``Timers`` interface, reduced in one collective per log step.

``timers(name, log_level).start()/.stop()``; a timer above ``timing_log_level`` is a shared
:class:`DummyTimer`, so a disabled timer costs a dictionary lookup and a method call. On CUDA
a timer records events on the current stream and never synchronises on start/stop; the
events are resolved at the log step. On CPU it reads ``time.perf_counter_ns``.

At a log step every timer becomes one sample, ``timers/<name>``: this rank's milliseconds per
step over the interval. The reduce kind comes from ``timing_log_option`` (``max``, ``minmax``,
``all``), so all timers of all ranks travel in the reducer's one MAX pack (or one all-gather).
A rank that never ran a timer sends nothing for it, so it is left out of the minimum instead
of counting as 0.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..reduce import PerRank
from .base import Alert, LogContext, Sample

__all__ = ["Timer", "DummyTimer", "Timers", "TimerCollector"]

_MAX_LOG_LEVEL = 2


class DummyTimer:
    """What a timer above the configured level returns: does nothing, costs nearly nothing."""

    __slots__ = ()
    name = "dummy"

    def start(self, barrier: bool = False) -> None:
        """Nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Nothing."""

    def reset(self) -> None:
        """Nothing."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Not available: a disabled timer measures nothing."""
        raise RuntimeError("elapsed() is not available on a timer above timing_log_level (a DummyTimer)")

    def active_time(self) -> float:
        """Not available: a disabled timer measures nothing."""
        raise RuntimeError("active_time() is not available on a timer above timing_log_level (a DummyTimer)")

    def __enter__(self) -> "DummyTimer":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Timer:
    """One named timer. Times are kept in ns on CPU, as CUDA event pairs on GPU."""

    __slots__ = ("name", "_use_cuda", "_group", "_started", "_start_ns", "_start_event",
                 "_elapsed_ns", "_pending", "_active_ns", "_interval_ns", "_interval_pending", "_used",
                 "spans", "_barriers")

    def __init__(self, name: str, use_cuda: bool = False, barrier_group: Any = None, barriers: bool = True) -> None:
        self.name = name
        self._use_cuda = use_cuda
        self._group = barrier_group
        self._barriers = barriers  # barrier_with_L1_time: False turns barrier=True requests off
        self._started = False
        self._start_ns = 0
        self._start_event = None
        self._elapsed_ns = 0  # since the last reset (Megatron's elapsed)
        self._pending: list = []  # CUDA event pairs not yet resolved (for elapsed)
        self._active_ns = 0  # since creation (Megatron's active_time)
        self._interval_ns = 0  # since the last log step
        self._interval_pending: list = []
        self._used = False  # started at least once this interval
        self.spans = 0  # start/stop pairs completed this interval

    def set_barrier_group(self, barrier_group: Any) -> None:
        """The process group that ``barrier=True`` waits for (default: the world)."""
        self._group = barrier_group

    def start(self, barrier: bool = False) -> None:
        """Start timing. ``barrier=True`` first waits for every rank (a real barrier)."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started; stop() it first")
        if barrier and self._barriers and dist.is_available() and dist.is_initialized():
            dist.barrier(group=self._group)
        if self._use_cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._start_ns = time.perf_counter_ns()
        self._started = True
        self._used = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the span to the interval."""
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started; call start() first")
        if barrier and self._barriers and dist.is_available() and dist.is_initialized():
            dist.barrier(group=self._group)
        if self._use_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            pair = (self._start_event, end)
            self._pending.append(pair)
            self._interval_pending.append(pair)
        else:
            span = time.perf_counter_ns() - self._start_ns
            self._elapsed_ns += span
            self._active_ns += span
            self._interval_ns += span
        self._started = False
        self.spans += 1

    def reset(self) -> None:
        """Forget the time since the last reset (the interval and active time are kept)."""
        self._resolve()
        self._elapsed_ns = 0

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds since the last reset (a running timer is stopped and restarted around it)."""
        running = self._started
        if running:
            self.stop(barrier=barrier)
        self._resolve()
        seconds = self._elapsed_ns / 1e9
        if reset:
            self._elapsed_ns = 0
        if running:
            self.start(barrier=barrier)
        return seconds

    def set_elapsed(self, value: float) -> None:
        """Set the time since the last reset to ``value`` seconds (e.g. a start-up time)."""
        self._pending.clear()
        self._elapsed_ns = int(value * 1e9)

    def active_time(self) -> float:
        """Seconds this timer has been running since it was created."""
        self._resolve()
        return self._active_ns / 1e9

    def take_interval_ms(self) -> Optional[float]:
        """Milliseconds accumulated since the last call; None if the timer did not run."""
        if not self._used:
            return None
        self._resolve_interval()
        ms = self._interval_ns / 1e6
        self._interval_ns = 0
        self.spans = 0
        self._used = self._started  # a timer running across the log step counts in the next one
        return ms

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _resolve(self) -> None:
        if self._pending:
            self._pending[-1][1].synchronize()
            for start, end in self._pending:
                span = int(start.elapsed_time(end) * 1e6)
                self._elapsed_ns += span
                self._active_ns += span
            self._pending.clear()

    def _resolve_interval(self) -> None:
        if self._interval_pending:
            self._interval_pending[-1][1].synchronize()
            self._interval_ns += sum(int(s.elapsed_time(e) * 1e6) for s, e in self._interval_pending)
            self._interval_pending.clear()


class Timers:
    """A drop-in for ``megatron.core.timers.Timers``: ``timers(name, log_level)``."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax", use_cuda: Optional[bool] = None,
                 barrier_with_L1_time: bool = True, barrier_group: Any = None) -> None:
        if log_option not in ("max", "minmax", "all"):
            raise ValueError(f"timing_log_option={log_option!r}: accepted values are 'max', 'minmax', 'all'")
        if log_level not in (-1, 0, 1, 2):
            raise ValueError(f"timing_log_level={log_level!r}: accepted values are -1, 0, 1, 2")
        self._log_level = log_level
        self._log_option = log_option
        self._use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self._barrier_ok = barrier_with_L1_time
        self._group = barrier_group
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy = DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        timer = self._timers.get(name)
        if timer is not None:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(f"timer {name!r} was created with log_level={self._log_levels[name]}, "
                                 f"now asked for with log_level={log_level}")
            return timer
        if log_level is not None and self._log_level < log_level <= _MAX_LOG_LEVEL:
            return self._dummy  # the disabled path: a lookup and two comparisons
        if log_level is None:
            log_level = _MAX_LOG_LEVEL
        if log_level not in (0, 1, 2):
            raise ValueError(f"timer {name!r}: log_level={log_level!r}; accepted values are 0, 1, 2")
        if log_level > self._log_level:
            return self._dummy
        timer = self._timers[name] = Timer(name, self._use_cuda, self._group, self._barrier_ok)
        self._log_levels[name] = log_level
        return timer

    @property
    def names(self) -> list[str]:
        """Names of the enabled timers, in creation order."""
        return list(self._timers)

    # --- Megatron's reporting API, for code written against it -------------------------
    def get_all_timers_string(self, names: Optional[list[str]] = None, normalizer: float = 1.0,
                              reset: bool = True, barrier: bool = False) -> str:
        """Megatron's text block; a collective: every rank must call it."""
        times = self._gather(names, normalizer, reset, barrier)
        if self._log_option == "all":
            lines = ["times across ranks (ms):"]
            for name, per in times.items():
                lines.append(f"  {name}:")
                lines += [f"     rank {r:2d}: {v:.2f}" for r, v in enumerate(per) if v is not None]
            return "\n".join(lines)
        lines = ["(min, max) time across ranks (ms):" if self._log_option == "minmax"
                 else "max time across ranks (ms):"]
        for name, per in times.items():
            present = [v for v in per if v is not None]
            if not present:
                continue
            dots = "." * max(1, 48 - len(name))
            if self._log_option == "minmax":
                lines.append(f"    {name} {dots}: ({min(present):.2f}, {max(present):.2f})")
            else:
                lines.append(f"    {name} {dots}: {max(present):.2f}")
        return "\n".join(lines)

    def log(self, names: Optional[list[str]] = None, rank: Optional[int] = None, normalizer: float = 1.0,
            reset: bool = True, barrier: bool = False) -> None:
        """Print the block on ``rank`` (default: the last rank, as Megatron does)."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        me = dist.get_rank() if world > 1 else 0
        if me == (world - 1 if rank is None else rank):
            print(text, flush=True)

    def write(self, names: Optional[list[str]], writer: Any, iteration: int, normalizer: float = 1.0,
              reset: bool = True, barrier: bool = False) -> None:
        """``writer.add_scalar(name + '-time', max ms, iteration)`` like Megatron's."""
        times = self._gather(names, normalizer, reset, barrier)
        if writer is None:
            return
        for name, per in times.items():
            present = [v for v in per if v is not None]
            if present:
                writer.add_scalar(f"{name}-time", max(present), iteration)

    def _gather(self, names, normalizer, reset, barrier) -> dict[str, list[Optional[float]]]:
        if normalizer <= 0:
            raise ValueError(f"normalizer={normalizer!r}: accepted values are numbers > 0")
        names = list(self._timers) if names is None else list(names)
        local = []
        for name in names:
            timer = self._timers.get(name)
            local.append(None if timer is None else timer.elapsed(reset=reset, barrier=barrier) * 1000.0 / normalizer)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rows: list[Any] = [local]
        if world > 1:
            rows = [None] * world
            dist.all_gather_object(rows, local)
        return {name: [row[i] for row in rows] for i, name in enumerate(names)}


class TimerCollector:
    """Feeds every timer's per-step milliseconds into the log step's one reduction, names the
    straggler, and times whole steps (``timers/step``, from one ``monitor.step`` to the next)."""

    name = "timers"
    after = ("throughput",)  # train/step_time_ms from the step timer only where throughput has none

    def __init__(self, timers: Timers, option: str) -> None:
        self.timers = timers
        self.option = option
        self._step_timer = timers("step", log_level=0) if timers._log_level >= 0 else None

    def mark_step(self) -> None:
        """A step ended and the next begins (called by ``monitor.step``)."""
        if self._step_timer is not None:
            if self._step_timer._started:
                self._step_timer.stop()
            self._step_timer.start()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """``timers/<name>``: this rank's milliseconds per step over the interval."""
        out = []
        kind = self.option
        for name, timer in self.timers._timers.items():
            # The step timer runs from one monitor.step to the next: average over its spans.
            divisor = timer.spans if name == "step" else ctx.steps
            ms = timer.take_interval_ms()
            if ms is None or divisor == 0:
                continue
            per_step = ms / divisor
            out.append(Sample(f"timers/{name}", per_step, kind))
            if kind == "minmax":  # the mean across ranks, for the straggler ratio
                out.append(Sample(f"timers/{name}/mean", per_step, "mean"))
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Megatron's names (``timers/<n>`` = max, ``timers/<n>/min``) and the straggler report."""
        if self.option == "minmax":
            names = [k[len("timers/"):-len("/max")] for k in list(metrics)
                     if k.startswith("timers/") and k.endswith("/max")]
            for name in names:
                base = f"timers/{name}"
                slowest = metrics[base] = metrics.pop(f"{base}/max")
                self._straggler(metrics, ctx, name, slowest, metrics[f"{base}/max_rank"],
                                "max_over_mean", metrics.get(f"{base}/mean"))
        elif self.option == "all":
            for key, value in list(metrics.items()):
                if key.startswith("timers/") and isinstance(value, PerRank) and value.present():
                    slowest, rank = max((v, r) for r, v in enumerate(value) if v is not None)
                    self._straggler(metrics, ctx, key[len("timers/"):], slowest, rank,
                                    "max_over_median", statistics.median(value.present()))
        if "timers/step" in metrics and "train/step_time_ms" not in metrics:
            metrics["train/step_time_ms"] = metrics["timers/step"]
        return []

    def close(self) -> None:
        """Nothing to release."""

    @staticmethod
    def _straggler(metrics: dict[str, Any], ctx: LogContext, name: str, slowest: float, rank: int,
                   ratio_name: str, typical: Optional[float]) -> None:
        prefix = f"stragglers/{name}"
        metrics[f"{prefix}/rank"] = rank
        if rank < len(ctx.hosts):
            metrics[f"{prefix}/host"] = ctx.hosts[rank].hostname
            metrics[f"{prefix}/local_rank"] = ctx.hosts[rank].local_rank
        if typical:
            metrics[f"{prefix}/{ratio_name}"] = slowest / typical
