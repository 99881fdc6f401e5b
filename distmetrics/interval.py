"""Accumulating values over the steps of one log interval, on device, with no host sync.

Between log steps a value is only added into a running tensor (or a Python float when the
user passed numbers): no ``.item()``, no comparison that would force the host to wait for
the device. At the log step :meth:`IntervalStats.take_samples` hands the reducer one
:class:`~distmetrics.reduce.Sample` per name and the interval starts again.

Interval semantics per reduce kind: ``mean`` is Σ value·weight / Σ weight over steps (and then
ranks); ``sum`` is the total; ``max``/``min``/``minmax`` the extremes over steps; ``all`` each
rank's mean over its steps. ``last=True`` keeps only the latest value and its weight (the learning
rate, weighted 1 on the writer rank and 0 elsewhere: the sum across ranks adds only zeros to it).
:class:`IntervalClock` is an interval's wall time on this rank, pauses left out, in integer nanoseconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .names import check_value
from .packing import weighted
from .reduce import Sample, check_reduce

__all__ = ["IntervalStats", "IntervalClock", "as_number", "kept", "now"]

Number = Union[int, float, torch.Tensor]


def now() -> int:
    """``time.perf_counter_ns()`` as the interval clocks read it (the Monitor marks each step's end with it)."""
    return time.perf_counter_ns()


class IntervalClock:
    """This rank's wall time since the interval started, the time between :meth:`pause` and
    :meth:`resume` (evaluation, a checkpoint save) left out. Reads ``time.perf_counter_ns``, as the
    timers do, and converts at the end: float seconds from a reading of 100 s or more lost a
    microsecond's digits, so ranks with equal steps scored 0.9999999999998579 against each other."""

    def __init__(self) -> None:
        self._start = time.perf_counter_ns()
        self._paused_at: Optional[int] = None
        self._pauses: list[tuple[int, int]] = []  # this interval's pauses, (from, to) in ns: a few at most

    def pause(self) -> None:
        """Stop counting (a second call does nothing)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter_ns()

    def resume(self) -> None:
        """Count again after :meth:`pause`."""
        if self._paused_at is not None:
            self._pauses.append((self._paused_at, time.perf_counter_ns()))
            self._paused_at = None

    def take(self, until: Optional[int] = None) -> float:
        """:meth:`take_ns` in seconds."""
        return self.take_ns(until) / 1e9

    def take_ns(self, until: Optional[int] = None) -> int:
        """Nanoseconds counted since the interval started (resuming a paused clock), up to now or to
        ``until``, an earlier reading of :func:`now` (the record ``close()`` writes ends at the last
        ``monitor.step``): the pauses before it are left out, those after it do not matter. The
        next interval starts now."""
        self.resume()
        now = time.perf_counter_ns()
        end = now if until is None else min(max(until, self._start), now)
        paused = sum(min(to, end) - since for since, to in self._pauses if since < end)
        counted, self._start, self._pauses = end - self._start - paused, now, []
        return counted

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` was called and :meth:`resume` not yet."""
        return self._paused_at is not None

    @property
    def started(self) -> int:
        """When the interval started (a reading of :func:`now`)."""
        return self._start

    def restart(self) -> None:
        """Start the interval again now, forgetting what was counted (a pause still open ends: the
        first ``monitor.step`` starts the count, as it starts the energy count and the step timer)."""
        self.resume()
        self._start, self._pauses = time.perf_counter_ns(), []


@dataclass
class _Slot:
    reduce: str
    last: bool
    value: Optional[Number] = None  # Σ v·w (mean/all), Σ v (sum), running max (max/minmax)
    weight: Number = 0.0  # Σ w (mean), count (all)
    low: Optional[Number] = None  # running min (min/minmax)


class IntervalStats:
    """Per-name accumulators for one log interval.

    A log step costs the names recorded since the last one, not every name ever recorded: a
    name's accumulator is kept for the next interval (the same names at every log step make no
    new ones) and dropped at the log step after an interval without it. Its reduce kind and
    ``last`` are kept for good, so a name that comes back keeps them. With ``by_step``, the values
    recorded since the last :meth:`end_step` can be taken back (:meth:`take_back`)."""

    def __init__(self, by_step: bool = False) -> None:
        self._slots: dict[str, _Slot] = {}  # the names recorded in this interval or the last one
        self._kinds: dict[str, tuple[str, bool]] = {}  # every name recorded → (reduce, last) at its first record
        # by_step: each name recorded since the last end_step → its slot's (value, weight, low) before that
        # (references: a record makes new numbers, it never adds in place)
        self._before_step: Optional[dict[str, tuple]] = {} if by_step else None

    def __contains__(self, name: str) -> bool:
        return name in self._slots and self._slots[name].value is not None

    def record(self, name: str, value: Number, reduce: str = "mean", weight: Number = 1.0,
               last: bool = False) -> None:
        """Add one step's value. Tensors are detached and kept on their device."""
        check_reduce(name, reduce)
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = _Slot(*self._kinds.setdefault(name, (reduce, last)))
        if slot.reduce != reduce:
            raise ValueError(
                f"metric {name!r} was recorded with reduce={slot.reduce!r}, now reduce={reduce!r}; "
                "a name keeps one reduce kind"
            )
        check_value(value, "metric %r", name)
        check_value(weight, "metric %r weight", name)
        given, given_weight = value, weight
        value, weight = as_number(value), as_number(weight)
        # the caller's own storage (a float64 tensor): copied where it is kept past the call
        copy, copy_weight = _aliases(value, given), _aliases(weight, given_weight)
        if self._before_step is not None and name not in self._before_step:
            self._before_step[name] = (slot.value, slot.weight, slot.low)
        if slot.last:
            slot.value = value.clone() if copy else value
            slot.weight, slot.low = weight.clone() if copy_weight else weight, slot.value
            return
        if reduce == "mean":
            slot.value = _add(slot.value, weighted(value, weight))
            slot.weight = _add(slot.weight, weight, copy_weight)
        elif reduce == "all":
            slot.value = _add(slot.value, value, copy)
            slot.weight = _add(slot.weight, 1.0)
        elif reduce == "sum":
            slot.value = _add(slot.value, value, copy)
        else:
            if reduce in ("max", "minmax"):
                slot.value = _extreme(slot.value, value, torch.maximum, max, copy)
            if reduce in ("min", "minmax"):
                slot.low = _extreme(slot.low, value, torch.minimum, min, copy)
                if reduce == "min":
                    slot.value = slot.low

    def least(self, name: str) -> Optional[Number]:
        """The least value of ``name`` (a ``min`` or ``minmax``) recorded in this interval, None where none."""
        slot = self._slots.get(name)
        return None if slot is None else slot.low

    def end_step(self) -> None:
        """The step the values recorded since the last call belong to has ended (``by_step``)."""
        if self._before_step:
            self._before_step = {}

    def take_back(self) -> list[str]:
        """Take the values recorded since the last :meth:`end_step` back out of the interval, and
        return their names: they belong to a step that has not come (``by_step``; a log step's
        :meth:`take_samples` took them along: nothing to take back then)."""
        held = self._before_step or {}
        if self._before_step is not None:
            self._before_step = {}
        for name, (value, weight, low) in held.items():
            slot = self._slots.get(name)
            if slot is not None:
                slot.value, slot.weight, slot.low = value, weight, low
        return list(held)

    def take_samples(self) -> list[Sample]:
        """This interval's samples (one per name recorded since the last call); the interval
        starts again."""
        out: list[Sample] = []
        kept: dict[str, _Slot] = {}
        taken = list(self._slots.items())  # a signal handler's record (this thread) may add a name meanwhile
        for name, slot in taken:
            if slot.value is None:
                continue  # not recorded in this interval: no sample, and its slot goes
            if slot.last:
                out.append(Sample(name, slot.value, slot.reduce, weight=slot.weight) if slot.reduce == "mean"
                           else Sample(name, slot.value, slot.reduce))
            elif slot.reduce == "mean":
                out.append(Sample(name, slot.value, "mean", weight=slot.weight, summed=True))
            elif slot.reduce == "all":
                out.append(Sample(name, slot.value / slot.weight, "all"))
            elif slot.reduce == "min":
                out.append(Sample(name, slot.low, "min"))
            elif slot.reduce == "minmax":
                out.append(Sample(name, slot.value, "minmax", low=slot.low))
            else:
                out.append(Sample(name, slot.value, slot.reduce))
            kept[name] = slot
        for slot in kept.values():  # once every Sample is made: one that raised leaves the interval whole
            slot.value, slot.weight, slot.low = None, 0.0, None
        if self._before_step:  # taken with the interval: what they were before is of no record now
            self._before_step = {}
        if len(self._slots) != len(taken):  # names first recorded while these were taken: the next interval's
            seen = dict(taken)
            kept.update((name, slot) for name, slot in self._slots.items() if name not in seen)
        self._slots = kept
        return out


def as_number(v: Number) -> Number:
    """A number or a 1-element tensor (see :func:`distmetrics.names.check_value`) as a float, or
    as a detached 0-d float64 tensor on its device (float64: token counts and long sums stay exact).
    A float64 tensor's is its own storage: one kept past the call is copied (:func:`kept`)."""
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float64)
    return float(v)


def kept(v: Number) -> Number:
    """:func:`as_number` of ``v`` to keep past the call: a copy where that is ``v``'s own storage (a
    float64 tensor; another dtype's conversion is one already), on its device, no sync. A tensor the
    caller changes in place after the call (a token counter zeroed and added to every step) was kept
    as its own storage and read changed at the log step."""
    number = as_number(v)
    return number.clone() if _aliases(number, v) else number


def _aliases(number: Number, given: Number) -> bool:
    """Whether ``number`` (:func:`as_number` of ``given``) is ``given``'s own storage. Sums, products
    and extremes make new tensors: only an interval's first value and a ``last`` one are kept as given."""
    return isinstance(given, torch.Tensor) and number.data_ptr() == given.data_ptr()


def _add(total: Optional[Number], v: Number, copy: bool = False) -> Number:
    if total is None:
        return v.clone() if copy else v
    return total + v


def _extreme(current: Optional[Number], v: Number, tensor_op, number_op, copy: bool = False) -> Number:
    if current is None:
        return v.clone() if copy else v
    if isinstance(current, torch.Tensor) or isinstance(v, torch.Tensor):
        a = current if isinstance(current, torch.Tensor) else torch.full_like(v, current)
        b = v if isinstance(v, torch.Tensor) else torch.full_like(a, v)
        return tensor_op(a, b.to(a.device))
    if math.isnan(current) or math.isnan(v):
        return math.nan  # NaN is never hidden by an extreme
    return number_op(current, v)
