"""The Monitor's side of the step timers: its step timer (``timers/step``, lapped by every
``monitor.step``) and the collector that turns every timer into ``timers/<name>`` at a log step:
this rank's milliseconds per step over the interval, reduced as ``timing_log_option`` says
(``max``, ``minmax``, ``all``) in the reducer's one MAX pack (or one all-gather), with the
straggler named (with two ranks or more: one rank has no other to be slower than). A rank that
never ran a timer sends nothing for it, so it is left out of the minimum instead of counting as 0.
"""

from __future__ import annotations

import operator
import statistics
from typing import Any, Optional

from ..reduce import PerRank
from .base import Alert, LogContext, Sample
from .stragglers import _host, _local_rank, _place_of, _rank_ids
from .timers import Timer, TimerError, Timers

__all__ = ["StepTimer", "TimerCollector"]


_ORDER = operator.attrgetter("order")


class StepTimer(Timer):
    """The Monitor's step timer (``timers/step``): every ``monitor.step`` laps it. It can be read
    like any timer (``elapsed()``, a report), but starting or stopping it by hand would cut the
    steps it times, so both raise :class:`TimerError` saying so, and ``reset()`` does not stop it.
    ``monitor.pause()`` and ``resume()`` leave evaluation and checkpoint saves out of it, as Megatron stops its
    interval timer around them: a pause ends no step. The log step is left out too, from the
    lap that begins it to the end of its reduction (:meth:`hold`, :meth:`release`): a fast rank
    waits there for the slowest, and that wait is not its own work."""

    __slots__ = ("paused", "held", "_unlapped", "_unlapped_ns")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused = False
        self.held = False  # stopped for the log step, until release()
        self._unlapped = False  # a pause counted time since the last lap, which no step may end
        self._unlapped_ns = 0  # that time (CPU; on CUDA it is inside the event pairs)

    def pause(self) -> None:
        """Stop counting time (the span so far counts; no step ends). A second call does nothing."""
        if self._started:
            spans, before = self.spans, self._interval_ns
            Timer.stop(self)
            self.spans, self.paused = spans, True
            self._unlapped = True
            self._unlapped_ns += self._interval_ns - before

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """As :meth:`Timer.elapsed`: a read splits the running span, and the share before the read
        counts in the interval, but no step ends there: noted as a pause's is, so the close record
        (:meth:`take_interval_ms`) leaves it out as it leaves out what came after."""
        before, running = self._interval_ns, self._started
        seconds = super().elapsed(reset=reset, barrier=barrier)
        if running:
            self._unlapped = True
            self._unlapped_ns += self._interval_ns - before
        return seconds

    def resume(self) -> None:
        """Count again after :meth:`pause`."""
        if self.paused:
            self.paused = False
            Timer.start(self)

    def hold(self) -> None:
        """The log step begins (its step was just lapped): the time up to now counts, no step ends,
        and none counts until :meth:`release`."""
        if self._started:
            spans = self.spans
            Timer.stop(self)
            self.spans, self.held = spans, True

    def release(self) -> None:
        """The log step's reduction is over: count again, after :meth:`hold` or a pause not resumed
        (a pause lasts to the log step at most, as the interval clocks')."""
        if self.held or self.paused:
            self.held = self.paused = False
            if not self._started:
                Timer.start(self)

    def lap(self) -> None:
        """A ``monitor.step``; while paused the step ends, and no time counts until :meth:`resume`."""
        self._unlapped, self._unlapped_ns, self.held = False, 0, False
        if self.paused:
            self.spans += 1
            return
        super().lap()

    def take_interval_ms(self, running: bool = True) -> Optional[float]:
        """As :meth:`Timer.take_interval_ms`; with ``running=False`` (the close record) the time a
        pause counted after the last lap is left out too (on CUDA it cannot be told from the laps
        before it: None, as for unread laps)."""
        (unlapped, unlapped_ns), (self._unlapped, self._unlapped_ns) = (self._unlapped, self._unlapped_ns), (False, 0)
        if not running and unlapped:
            if self._use_cuda:
                return self._drop_interval()
            self._interval_ns -= unlapped_ns
        return super().take_interval_ms(running)

    @property
    def owned(self) -> str:
        """Why a user's timer of this name is refused (any level asked for)."""
        return _OWNED.format(name=self.name, what="started or stopped")

    def reset(self) -> None:
        """Forget the time since the last reset, and keep running: a stop here (Megatron's reset stops a
        timer) would lose the steps it times until the next log step (no ``timers/step`` there)."""
        self.elapsed(reset=True)

    def start(self, barrier: bool = False) -> None:
        raise TimerError(_OWNED.format(name=self.name, what="started"))

    def stop(self, barrier: bool = False) -> None:
        raise TimerError(_OWNED.format(name=self.name, what="stopped"))


_OWNED = ("timer {name!r} is the Monitor's step timer: every monitor.step laps it (timers/{name}, one "
          "monitor.step to the next), so it cannot be {what} by hand; give your timer another name "
          "(e.g. 'train-{name}') or read this one")


class TimerCollector:
    """Feeds every timer's per-step milliseconds into the log step's one reduction, names the
    straggler, and times whole steps (``timers/step``, from one ``monitor.step`` to the next, the
    log step left out: each rank's own time, so its straggler fields name the rank that is slow).
    With ``per_rank``, each timer's per-rank values also travel (in the ALL pack) as
    ``_ranks/timers/<name>`` for collectors that score ranks. ``stragglers=False`` (a Monitor of one
    rank) writes no ``stragglers/<name>/...``: that rank would be named the slowest, at a ratio of
    1.0, at every log step."""

    name = "timers"
    after = ("throughput",)  # train/step_time_ms from the step timer only where throughput has none
    writes = ("timers/", "stragglers/", "train/step_time_ms")

    def __init__(self, timers: Timers, option: str, per_rank: bool = False, stragglers: bool = True) -> None:
        self.timers = timers
        self.option = option
        self.per_rank = per_rank and option != "all"
        self.stragglers = stragglers
        self._step_timer = timers._make("step", 0, StepTimer, own=True) if timers._log_level >= 0 else None

    def use_guard(self, guard: Any) -> None:
        """Guard Megatron's timer reports (each is a collective) with the Monitor's arrival check."""
        self.timers.use_guard(guard)

    def mark_step(self) -> None:
        """A step ended and the next begins (called by ``monitor.step``): a lap of the step
        timer. On CUDA a lap records nothing; the interval is read at the log step, with one event
        where it stops there and one where it counts again. Stopping and starting it here cost two
        CUDA events per step: about 60 us of every step on an H100 machine."""
        if self._step_timer is not None:
            self._step_timer.lap()

    def pause(self) -> None:
        """Leave what follows out of the step timer (``monitor.pause()``)."""
        if self._step_timer is not None:
            self._step_timer.pause()

    def resume(self) -> None:
        """Time steps again after :meth:`pause`."""
        if self._step_timer is not None:
            self._step_timer.resume()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """``timers/<name>``: this rank's milliseconds per step over the interval."""
        out = []
        kind = self.option
        in_use = self.timers.in_use  # the timers started in the interval (or running into it)
        # by creation; a copy: the step timer's release() in finalize notes it in in_use again
        for timer in sorted(in_use, key=_ORDER):
            name = timer.name
            # The step timer runs from one monitor.step to the next: average over its spans; in the
            # record close() writes, up to the last monitor.step (after it comes no step's time).
            step_timer = timer is self._step_timer
            if step_timer and ctx.ended_at is None:
                timer.hold()  # until finalize: the wait for the slowest rank in the reduction is not this rank's
            divisor = timer.spans if step_timer else ctx.steps
            ms = timer.take_interval_ms(running=not (step_timer and ctx.ended_at is not None))
            if ms is None or ms <= 0 or divisor == 0:  # 0 ms: nothing measured, left out as Megatron's reports do
                continue
            per_step = ms / divisor
            out.append(Sample(f"timers/{name}", per_step, kind))
            if kind == "minmax":  # the mean across ranks, for the straggler ratio
                out.append(Sample(f"timers/{name}/mean", per_step, "mean"))
            if self.per_rank:
                out.append(Sample(f"_ranks/timers/{name}", per_step, "all"))
        in_use[:] = [timer for timer in dict.fromkeys(in_use) if timer._used]  # running on: in the next
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Megatron's names (``timers/<n>`` = max, ``timers/<n>/min``) and, with ``stragglers``, the
        straggler report; the step timer counts again (the reduction is over)."""
        if self._step_timer is not None:
            self._step_timer.release()
        if self.option == "minmax":
            names = [k[len("timers/"):-len("/max")] for k in ctx.keys_under(metrics, ("timers/",))
                     if k.endswith("/max") and k in metrics and f"{k[:-4]}/min" in metrics]
            for name in names:
                base = f"timers/{name}"
                slowest = metrics[base] = metrics.pop(f"{base}/max")
                if not self.stragglers:
                    continue
                rank = metrics[f"{base}/max_rank"]  # a global rank (the MAX pack's)
                self._straggler(metrics, ctx, name, slowest, rank, _place_of(rank, ctx.hosts),
                                "max_over_mean", metrics.get(f"{base}/mean"))
        elif self.option == "all" and self.stragglers:
            for key in ctx.keys_under(metrics, ("timers/",)):
                value = metrics.get(key)
                if isinstance(value, PerRank) and value.present():
                    slowest, place = max((v, -r) for r, v in enumerate(value) if v is not None)  # ties: the lowest
                    place = -place  # rank, as the MAX pack names under minmax
                    self._straggler(metrics, ctx, key[len("timers/"):], slowest, _rank_ids(value)[place], place,
                                    "max_over_median", statistics.median(value.present()))
        if "timers/step" in metrics and "train/step_time_ms" not in metrics:
            step = metrics["timers/step"]
            metrics["train/step_time_ms"] = step if not isinstance(step, PerRank) else metrics["timers/step/max"]
        return []

    def close(self) -> None:
        """Nothing to release."""

    @staticmethod
    def _straggler(metrics: dict[str, Any], ctx: LogContext, name: str, slowest: float, rank: int, place: int,
                   ratio_name: str, typical: Optional[float]) -> None:
        """``rank``: the slowest rank's global rank; ``place``: where it is among the Monitor's ranks."""
        prefix = f"stragglers/{name}"
        metrics[f"{prefix}/rank"] = rank
        if place < len(ctx.hosts):
            metrics[f"{prefix}/host"] = _host(place, ctx.hosts)
            metrics[f"{prefix}/local_rank"] = _local_rank(place, ctx.hosts)
        if typical:  # the slowest over a mean or median is >= 1 (the max is float32 in the MAX pack, the mean float64)
            metrics[f"{prefix}/{ratio_name}"] = max(1.0, slowest / typical)

