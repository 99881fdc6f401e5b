"""Step timers: a drop-in for Megatron-Core's ``Timers``, reduced in one collective per log step.

``timers(name, log_level).start()/.stop()``; a timer above ``timing_log_level`` is a shared
:class:`DummyTimer`, so a disabled timer costs a dictionary lookup and a method call (inside code
``torch.compile`` traces, nothing: see :meth:`Timers._dummy_for`). An enabled timer reads a clock
Dynamo cannot trace: the compiled graph ends there (README, "Under torch.compile"). On CUDA
a timer records events on the current stream and never synchronises on start/stop (Megatron's
synchronises the device twice per timer); the events are resolved when read. On CPU it reads
``time.perf_counter_ns``.

Megatron's reporting API — ``log()``, ``write()``, ``get_all_timers_string()`` — gives what
Megatron-Core's gives for the same timings: seconds to writers, milliseconds in text, the same
text byte for byte, values ≤ 0 left out, ``None`` when there is nothing to report, ``log`` through
``logging`` on the chosen rank, one float32 gather of a ``[world, n]`` table. Misuse raises
:class:`TimerError`, which is an ``AssertionError`` (as Megatron's asserts are) and a
``RuntimeError``, with Megatron's messages.

At a log step the Monitor's :class:`~distmetrics.collectors.timer_collector.TimerCollector`
turns every timer into ``timers/<name>`` (see that module).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..eager import tracing
from .timer_reports import MegatronReports, TimerError

__all__ = ["TimerBase", "Timer", "DummyTimer", "Timers", "TimerError"]

_MAX_LOG_LEVEL = 2
MANY_TIMERS = 1000
"""The user's timer names (of enabled and disabled levels; the Monitor's own step timer is not one)
at which a name made per step is suspected, once."""
logger = logging.getLogger("distmetrics")
_LOG_OPTIONS = ("max", "minmax", "all")


class TimerBase(ABC):
    """What every timer offers (Megatron's ``TimerBase``)."""

    name: str

    @abstractmethod
    def start(self, barrier: bool = False) -> None:
        """Start timing."""

    @abstractmethod
    def stop(self, barrier: bool = False) -> None:
        """Stop timing."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the time since the last reset."""

    @abstractmethod
    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds since the last reset."""


class DummyTimer(TimerBase):
    """What a timer above the configured level returns: does nothing, costs nearly nothing."""

    __slots__ = ()
    name = "dummy timer"

    def start(self, barrier: bool = False) -> None:
        """Nothing."""

    def stop(self, barrier: bool = False) -> None:
        """Nothing."""

    def reset(self) -> None:
        """Nothing."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Not available: a disabled timer measures nothing."""
        raise TimerError("dummy timer should not be used to calculate elapsed time, check if timer's log_level "
                         "<= self._log_level.")

    def active_time(self) -> float:
        """Not available: a disabled timer measures nothing."""
        raise TimerError("active timer should not be used to calculate elapsed time, check if timer's log_level "
                         "<= self._log_level.")

    def __enter__(self) -> "DummyTimer":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Timer(TimerBase):
    """One named timer: seconds since the last reset (Megatron's), since creation (active time),
    and nanoseconds since the last log step (the Monitor's)."""

    __slots__ = ("name", "_use_cuda", "_group", "_started", "_start_ns", "_start_event", "_elapsed", "_active",
                 "_pending", "_interval_ns", "_interval_pending", "_used", "spans", "_barriers", "_interval_start",
                 "_unread_laps", "guard", "in_use", "order")

    def __init__(self, name: str, use_cuda: bool = False, barrier_group: Any = None, barriers: bool = True) -> None:
        self.name = name
        self._use_cuda = use_cuda
        self._group = barrier_group
        self._barriers = barriers  # barrier_with_L1_time: False turns barrier=True requests off
        self._started = False
        self._start_ns = 0
        self._start_event = None
        self._elapsed: Any = 0.0  # seconds since the last reset (set_elapsed stores a value as given)
        self._active = 0.0  # seconds since creation
        self._pending: list = []  # CUDA event pairs not yet read for elapsed/active time
        self._interval_ns = 0  # since the last log step
        self._interval_pending: list = []
        self._used = False  # started at least once this interval
        self.spans = 0  # start/stop pairs completed this interval
        self._interval_start: Any = None  # where a running span's share of this interval begins (ns or event)
        self._unread_laps = False  # CUDA laps counted whose time is read with the running span
        self.guard: Any = None  # the Monitor's CollectiveGuard (set by Timers.use_guard)
        self.in_use: Optional[list] = None  # where its Timers note the timers used in an interval (_used)
        self.order = 0  # its place among its Timers' timers, in creation order

    def set_barrier_group(self, barrier_group: Any) -> None:
        """The process group that ``barrier=True`` waits for (default: the world)."""
        self._group = barrier_group

    def start(self, barrier: bool = False) -> None:
        """Start timing. ``barrier=True`` first waits for every rank (a real barrier)."""
        if self._started:
            raise TimerError(f"timer has already been started (timer {self.name!r}); stop() it first")
        if barrier and self._barriers and dist.is_available() and dist.is_initialized():
            self._barrier("start")
        if self._use_cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
            self._interval_start = self._start_event
        else:
            self._start_ns = self._interval_start = time.perf_counter_ns()
        self._started = True
        if not self._used:
            self._used = True
            if self.in_use is not None:  # the log step reads these only, not every timer ever made
                self.in_use.append(self)

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the span."""
        if not self._started:
            raise TimerError(f"timer is not started (timer {self.name!r}); call start() first")
        if barrier and self._barriers and dist.is_available() and dist.is_initialized():
            self._barrier("stop")
        if self._use_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start_event, end))
            self._interval_pending.append((self._interval_start, end))
            self._unread_laps = False  # the pair just recorded covers them
        else:
            now = time.perf_counter_ns()
            span = now - self._start_ns
            self._elapsed += span / 1e9
            self._active += span / 1e9
            self._interval_ns += now - self._interval_start
        self._started = False
        self.spans += 1

    def _barrier(self, where: str) -> None:
        """A real barrier, not an arrival check (it may come every step: the c10d store would take
        every rank's requests each time). Under a Monitor the call is noted first, urgently (published at
        once where the store holds another call), so where a rank does not come, the ranks that went on
        raise at their next guarded call naming this one's timer barrier as its last call (it waits in
        the barrier until the process group's timeout, publishing nothing more)."""
        if self.guard is not None:
            self.guard.note(f"timers({self.name!r}).{where}(barrier=True)", urgent=True)
        dist.barrier(group=self._group)

    def reset(self) -> None:
        """Forget the time since the last reset; a running timer stops without counting (as
        Megatron's does; CUDA laps already ended do count). Active time and the Monitor's
        interval are kept. On CUDA a timer that laps (the step timer) has no event at its last
        lap, so its running span up to the reset counts in active time and in the interval
        without counting as a span: the next ``timers/step`` is high by at most one step's share."""
        if self._unread_laps and self._started:
            self.elapsed(reset=False)
        self._resolve()
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds since the last reset (a running timer is stopped and restarted around it)."""
        running, spans = self._started, self.spans
        self._unread_laps = False  # the split below reads them
        if running:
            Timer.stop(self, barrier=barrier)
        self._resolve()
        seconds = self._elapsed
        if reset:
            self._elapsed = 0.0
        if running:
            Timer.start(self, barrier=barrier)
            self.spans = spans  # read, not ended: the span goes on (timers/step divides by spans)
        return seconds

    def set_elapsed(self, value: float) -> None:
        """Set the time since the last reset to ``value`` seconds (e.g. a start-up time). A running
        span adds its whole time at its end, as Megatron's does; on CUDA a timer with unread laps
        (the step timer) is split here instead, so only the part after the call is added."""
        if self._unread_laps and self._started:
            self.elapsed(reset=False)  # the laps so far count in active time, not in the value set
        self._resolve()
        self._elapsed = value

    def active_time(self) -> float:
        """Seconds this timer has been running since it was created, up to its last completed
        span as Megatron's counts; on CUDA a timer that laps (the step timer) is read up to now,
        since its laps record no event."""
        if self._unread_laps and self._started:
            self.elapsed(reset=False)  # resolve the laps: split the running span here
        self._resolve()
        return self._active

    def lap(self) -> None:
        """End the running span and begin the next at the same instant (the step timer, at every
        ``monitor.step``); start the timer if it is not running. On CPU one clock read. On CUDA
        nothing is recorded: the span is counted, and its time is read with the running span's
        at the next read (a log step's interval, ``elapsed()``, ``active_time()``)."""
        if not self._started:
            Timer.start(self)
            return
        self.spans += 1
        if self._use_cuda:
            self._unread_laps = True
            return
        now = time.perf_counter_ns()
        span = (now - self._start_ns) / 1e9
        self._elapsed += span
        self._active += span
        self._interval_ns += now - self._interval_start
        self._start_ns = self._interval_start = now

    def take_interval_ms(self, running: bool = True) -> Optional[float]:
        """Milliseconds accumulated since the last call; None if the timer did not run. A span
        still running counts up to now here and from now in the next interval, as Megatron's
        ``elapsed()`` splits it; with ``running=False`` (the step timer in the record ``close()``
        writes) it is left out, so the interval ends with the last span ended (the last lap: the
        last ``monitor.step``). On CUDA laps record no event, so a lapped timer's last lap cannot
        be told from now: None then, with the interval let go."""
        if not self._used:
            return None
        if self._started and not running:
            if self._use_cuda and self._unread_laps:
                return self._drop_interval()
            if self._use_cuda:
                self._interval_start = torch.cuda.Event(enable_timing=True)
                self._interval_start.record()
            else:
                self._interval_start = time.perf_counter_ns()
        elif self._started:  # split the running span at this read
            if self._use_cuda:
                now = torch.cuda.Event(enable_timing=True)
                now.record()
                self._interval_pending.append((self._interval_start, now))
                self._interval_start = now
            else:
                now = time.perf_counter_ns()
                self._interval_ns += now - self._interval_start
                self._interval_start = now
        if self._interval_pending:
            self._interval_pending[-1][1].synchronize()
            self._interval_ns += sum(int(s.elapsed_time(e) * 1e6) for s, e in self._interval_pending)
            self._interval_pending.clear()
            self._resolve()  # the same spans, for elapsed and active time: the event pairs are let go
        ms = self._interval_ns / 1e6
        self._interval_ns = 0
        self.spans = 0
        self._used = self._started  # a timer running across the log step counts in the next one
        return ms

    def _drop_interval(self) -> None:
        """Let this interval go without a value (its end cannot be told on CUDA: see
        :meth:`take_interval_ms`); a timer still running counts in the next one."""
        self._interval_pending.clear()
        self._interval_ns, self.spans, self._used = 0, 0, self._started

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _resolve(self) -> None:
        if self._pending:
            self._pending[-1][1].synchronize()
            seconds = sum(start.elapsed_time(end) for start, end in self._pending) / 1000.0
            self._elapsed += seconds
            self._active += seconds
            self._pending.clear()


def _bad_level(name: str, log_level: Any) -> TimerError:
    return TimerError(f"timers({name!r}, log_level={log_level!r}): accepted values are numbers up to "
                      f"{_MAX_LOG_LEVEL}, compared with timing_log_level as Megatron compares them (True is 1)")


class Timers(MegatronReports):
    """A drop-in for ``megatron.core.timers.Timers``: ``timers(name, log_level)``, plus Megatron's
    ``log``/``write``/``get_all_timers_string`` (see :class:`MegatronReports`)."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax", use_cuda: Optional[bool] = None,
                 barrier_with_L1_time: bool = True, barrier_group: Any = None) -> None:
        if log_option not in _LOG_OPTIONS:
            raise TimerError(f"input log option {log_option} is invalid. It must be one of {list(_LOG_OPTIONS)}")
        super().__init__()
        self._log_level = log_level
        self._log_option = log_option
        self._use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self._barrier_ok = barrier_with_L1_time
        self._group = barrier_group
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._dummy_names: set[str] = set()  # names given to disabled levels, found good
        self._max_log_level = _MAX_LOG_LEVEL
        self._own = 0  # timers the Monitor made for itself (its step timer): not the user's names
        self.in_use: list[Timer] = []  # the timers started since the last log step, or still running

    def __call__(self, name: str, log_level: Optional[float] = None) -> TimerBase:
        """The timer ``name`` (the dummy above the Timers' level). As Megatron's, a level is any number up
        to 2, compared as a number (1.5, -1; True is 1), alike at every level; text and NaN are refused."""
        timer = self._timers.get(name)
        if timer is not None:
            if log_level is not None and log_level != self._log_levels[name]:
                raise TimerError(f"input log level {log_level} does not match already existing log level "
                                 f"{self._log_levels[name]} for {name} timer")
            return timer
        try:
            disabled = log_level is not None and self._log_level < log_level <= _MAX_LOG_LEVEL
        except TypeError:  # text
            raise _bad_level(name, log_level) from None
        if disabled:  # the disabled path: two lookups and two comparisons
            return self._dummy_for(name)
        if log_level is None:
            log_level = _MAX_LOG_LEVEL
        if log_level > _MAX_LOG_LEVEL:
            raise TimerError(f"log level {log_level} is larger than max supported log level {_MAX_LOG_LEVEL} "
                             f"(timer {name!r})")
        if not log_level <= _MAX_LOG_LEVEL:  # NaN: Megatron called it larger than 2
            raise _bad_level(name, log_level)
        if log_level > self._log_level:
            return self._dummy_for(name)
        return self._make(name, log_level, Timer)

    def _dummy_for(self, name: Any) -> TimerBase:
        """The dummy timer of a disabled level, for a name that would be refused at an enabled one
        too (checked once per name): a bad name fails at once, not when the level is raised. Traced by
        ``torch.compile``: a new one, made in the graph's code, which Dynamo enters as a context
        manager (the shared one, made outside, ended the graph at its ``with``), and no set of names
        read or changed (a guard on it recompiled the caller once)."""
        if tracing():
            _check_timer_name(name)
            return DummyTimer()
        if type(name) is not str or name not in self._dummy_names:
            _check_timer_name(name)
            self._dummy_names.add(name)
            self._say_many(name)
        return self._dummy_timer

    def _make(self, name: str, log_level: float, cls: type, own: bool = False) -> Timer:
        """A new enabled timer; ``own``: the Monitor's (its step timer), not counted as the user's."""
        _check_timer_name(name)
        timer = self._timers[name] = cls(name, self._use_cuda, self._group, self._barrier_ok)
        timer.guard = self.guard
        timer.in_use, timer.order = self.in_use, len(self._timers)
        self._log_levels[name] = log_level
        self._own += own
        if not own:
            self._say_many(name)
        return timer

    def _say_many(self, name: str) -> None:
        """Warn once where the user's timer names reach :data:`MANY_TIMERS`: a name made per step or per
        event (``timers(f"fwd_{step}")``) keeps a timer, and a straggler series, per name for the run."""
        if len(self._timers) - self._own + len(self._dummy_names) == MANY_TIMERS:
            logger.warning("distmetrics: %d timer names so far (yours: the Monitor's step timer is not counted; "
                           "the latest %r): is a timer named per step or per event (an f-string)? Each name is a "
                           "timer kept for the run, and a metric of its own; name the work, and record what varies "
                           "with monitor.record", MANY_TIMERS, name)

    def use_guard(self, guard: Any) -> None:
        """The Monitor's arrival check: before each report (a collective), and told of each timer's
        ``barrier=True`` (see :meth:`Timer._barrier`)."""
        self.guard = guard
        for timer in self._timers.values():
            timer.guard = guard

    @property
    def names(self) -> list[str]:
        """Names of the enabled timers, in creation order."""
        return list(self._timers)


_REDUCED_ENDS = ("max", "min", "mean", "max_rank", "min_rank")
"""What a timer's reduction appends to its name (``timers/<name>/min``, ``.../max_rank``)."""


def _check_timer_name(name: Any) -> None:
    """A timer's name is a key of every record (``timers/<name>``): non-empty text that is not
    another timer's reduced key (a timer ``fwd/min`` overwrote ``timers/fwd/min``)."""
    if not isinstance(name, str) or not name or name.startswith(("_", "/")) or name.endswith("/"):
        raise TimerError(f"timer name {name!r} is refused: a timer's name is non-empty text that does not start "
                         "with '_' or start or end with '/'")
    last = name.rsplit("/", 1)[-1]
    if "/" in name and (last in _REDUCED_ENDS or (last.startswith("rank") and last[4:].isdigit())):
        raise TimerError(f"timer name {name!r} is refused: timers/{name} is a key another timer's reduction writes "
                         f"(timers/<name>/{last}); give it another name")
