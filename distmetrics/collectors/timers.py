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
from typing import Any, Optional

import torch

from ..eager import tracing
from ..names import name_problem
from .timer import CudaTimer, DummyTimer, Timer, TimerBase
from .timer_reports import MegatronReports, TimerError

__all__ = ["TimerBase", "Timer", "DummyTimer", "Timers", "TimerError"]

_MAX_LOG_LEVEL = 2
MANY_TIMERS = 1000
"""The user's timer names (of enabled and disabled levels; the Monitor's own step timer is not one)
at which a name made per step is suspected, once."""
logger = logging.getLogger("distmetrics")
_LOG_OPTIONS = ("max", "minmax", "all")


def _bad_level(name: str, log_level: Any) -> TimerError:
    return TimerError(f"timers({name!r}, log_level={log_level!r}): accepted values are numbers up to "
                      f"{_MAX_LOG_LEVEL}, compared with timing_log_level as Megatron compares them (True is 1)")


class Timers(MegatronReports):
    """A drop-in for ``megatron.core.timers.Timers``: ``timers(name, log_level)``, plus Megatron's
    ``log``/``write``/``get_all_timers_string`` (see :class:`MegatronReports`)."""

    def __init__(self, log_level: int = 0, log_option: str = "minmax", use_cuda: Optional[bool] = None,
                 barrier_with_L1_time: bool = True, barrier_group: Any = None, off: bool = False) -> None:
        if log_option not in _LOG_OPTIONS:
            raise TimerError(f"input log option {log_option} is invalid. It must be one of {list(_LOG_OPTIONS)}")
        super().__init__()
        self._log_level = log_level
        self._off = off  # every timer the dummy (the Monitor's timing_log_level -1; Megatron's Timers(-1) times
        # a timer of a level up to -1, as this class does without it)
        self._log_option = log_option
        self._use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self._barrier_ok = barrier_with_L1_time
        self._group = barrier_group
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._dummy_names: set[str] = set()  # names given to disabled levels, found good (no timer's)
        self._said_many = False
        self._max_log_level = _MAX_LOG_LEVEL
        self._own = 0  # timers the Monitor made for itself (its step timer): not the user's names
        self.in_use: list[Timer] = []  # the timers started since the last log step, or still running

    def names_in_order(self) -> tuple:
        """The timers' names in the order they were made (the console's timer block lists them so, as
        Megatron's training log lists its timers in its loop's order, not alphabetically). A copy made
        without releasing the GIL: safe to call from the writer thread."""
        return tuple(self._timers)

    def __call__(self, name: str, log_level: Optional[float] = None) -> TimerBase:
        """The timer ``name`` (the dummy above the Timers' level). As Megatron's, a level is any number up
        to 2, compared as a number (1.5, -1; True is 1), alike at every level; text and NaN are refused."""
        timer = self._timers.get(name)
        if timer is not None:
            if log_level is not None and log_level != self._log_levels[name]:
                if timer.owned is not None:  # the Monitor's own (its step timer), at any level asked: named so
                    raise TimerError(timer.owned)
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
        if log_level > self._log_level or self._off:  # off: a timer of a level below 0 too (it filled timers/...,
            return self._dummy_for(name)  # and a 'step' of the user's train/step_time_ms)
        return self._make(name, log_level, CudaTimer if self._use_cuda else Timer)

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
        self._dummy_names.discard(name)  # asked at a disabled level before: one name, counted once
        if not own:
            self._say_many(name)
        return timer

    def _say_many(self, name: str) -> None:
        """Warn once where the user's timer names reach :data:`MANY_TIMERS`: a name made per step or per
        event (``timers(f"fwd_{step}")``) keeps a timer, and a straggler series, per name for the run."""
        if len(self._timers) - self._own + len(self._dummy_names) >= MANY_TIMERS and not self._said_many:
            self._said_many = True
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
    odd = name_problem(name)
    if odd:
        raise TimerError(f"timer name {name!r} is refused: {odd}")
    last = name.rsplit("/", 1)[-1]
    if "/" in name and (last in _REDUCED_ENDS or (last.startswith("rank") and last[4:].isdigit())):
        raise TimerError(f"timer name {name!r} is refused: timers/{name} is a key another timer's reduction writes "
                         f"(timers/<name>/{last}); give it another name")
