"""One step timer (Megatron-Core's ``Timer`` and ``DummyTimer`` API) and the interval the Monitor
reads from it at each log step. On CUDA it records events on the current stream and never
synchronises on start/stop; the events are resolved when read. On CPU it reads
``time.perf_counter_ns``. The registry that makes them is :class:`~distmetrics.collectors.timers.Timers`."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..eager import eager
from .timer_reports import TimerError

__all__ = ["TimerBase", "Timer", "CudaTimer", "DummyTimer"]

logger = logging.getLogger("distmetrics")


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
    owned: Optional[str] = None
    """Where the Monitor made the timer for itself: why a user's timer of its name is refused."""

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


class CudaTimer(Timer):
    """A user's timer on CUDA: ``start`` and ``stop`` are each one graph break where compiled code
    calls them, run eagerly (:func:`~distmetrics.eager.eager`), as on the host, where the clock they
    read breaks the graph itself. Dynamo traces CUDA events: traced, the events made while tracing
    would stand in the graph for every call's, and the timer's state be guarded on. The check costs
    0.1-0.3 µs a call outside compiled code, beside the event's own record. Its readings
    (``elapsed``, ``active_time``) wait for the device: they are for outside compiled code."""

    __slots__ = ()

    start = eager(Timer.start)
    stop = eager(Timer.stop)
