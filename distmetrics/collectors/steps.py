"""What ``monitor.step`` and ``monitor.record`` are given: loss, tokens, learning rate, extra
scalars, a user's own values; and the interval's wall-time clock.

Between log steps values are only added into device tensors (:class:`IntervalStats`). Two
internal lanes travel with them: the interval's wall time (``max`` across ranks: the job goes at
its slowest rank's pace) and its tokens (``sum``, counted once per data-parallel replica); the
Monitor moves both into :class:`LogContext` after the reduction.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import torch

from ..interval import IntervalStats
from ..names import NameRegistry, check_value
from ..parallel import counts_batch_tokens
from .base import Alert, LogContext, Sample

__all__ = ["StepValues", "INTERVAL_S", "TOKENS", "pop_interval"]

INTERVAL_S = "_train/interval_s"
"""Internal lane: the interval's wall time in seconds (max across ranks)."""
TOKENS = "_train/tokens"
"""Internal lane: the interval's tokens (sum over the ranks that count them)."""
Number = Union[int, float, torch.Tensor]


class StepValues:
    """``train/loss`` (token-weighted), ``train/lr`` (last value), extra scalars, recorded values,
    the interval's tokens and wall time."""

    name = "train"
    after = ()

    def __init__(self, layout: Any) -> None:
        self.stats = IntervalStats()
        self.names = NameRegistry()
        self.counts_tokens = counts_batch_tokens(layout)
        self.job_tokens: Number = 0.0  # this rank's share of the tokens since the job started
        self._t0 = time.perf_counter()
        self._paused_at: Optional[float] = None
        self._paused_s = 0.0

    def check_step(self, loss: Any, tokens: Any, lr: Any, skipped: Any, scalars: dict[str, Any]) -> None:
        """Refuse a step's arguments before anything is recorded (a refused call changes nothing)."""
        for what, value in (("loss", loss), ("tokens", tokens), ("lr", lr), *scalars.items()):
            if value is not None:
                check_value(value, f"monitor.step({what}=...)")
        if not isinstance(skipped, bool):
            raise TypeError(f"monitor.step(skipped={skipped!r}): accepted values are True and False")
        for name in scalars:
            self.names.claim(name if "/" in name else f"train/{name}", "mean", f"monitor.step({name}=...)")

    def record_step(self, loss: Optional[Number], tokens: Optional[Number], lr: Optional[Number],
                    scalars: dict[str, Number]) -> None:
        """One optimizer step's values (checked by :meth:`check_step` first)."""
        if loss is not None:
            self.stats.record("train/loss", loss, "mean", weight=1.0 if tokens is None else tokens)
        if tokens is not None and self.counts_tokens:
            self.stats.record(TOKENS, tokens, "sum")
            self.job_tokens = self.job_tokens + _as_number(tokens)
        if lr is not None:
            self.stats.record("train/lr", lr, "mean", last=True)
        for name, value in scalars.items():
            self.stats.record(name if "/" in name else f"train/{name}", value, "mean")

    def record(self, name: str, value: Number, reduce: str = "mean", weight: Number = 1.0) -> None:
        """A user's own value for this interval (see ``Monitor.record``)."""
        self.names.claim(name, reduce, "monitor.record")
        check_value(value, f"monitor.record({name!r})")
        check_value(weight, f"monitor.record({name!r}, weight=...)")
        self.stats.record(name, value, reduce, weight=weight)

    def pause(self) -> None:
        """Stop the interval clock (evaluation, checkpointing)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Start the interval clock again after :meth:`pause`."""
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The interval's values and its wall time; the clock starts the next interval."""
        self.resume()
        now = time.perf_counter()
        seconds, self._t0 = now - self._t0 - self._paused_s, now
        self._paused_s = 0.0
        return self.stats.take_samples() + [Sample(INTERVAL_S, seconds, "max")]

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Nothing to derive (the Monitor moves the internal lanes into the context)."""
        return []

    def close(self) -> None:
        """Nothing to release."""


def pop_interval(metrics: dict[str, Any]) -> tuple[Optional[float], Optional[float]]:
    """Take the internal lanes out of reduced metrics: (interval seconds, interval tokens)."""
    metrics.pop(INTERVAL_S + "/max_rank", None)
    return metrics.pop(INTERVAL_S, None), metrics.pop(TOKENS, None)


def _as_number(v: Number) -> Number:
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float64)
    return v
