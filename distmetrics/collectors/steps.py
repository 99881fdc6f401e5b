"""What ``monitor.step`` and ``monitor.record`` are given: loss, tokens, learning rate, extra
scalars, a user's own values; and the interval's wall-time clock.

Between log steps values are only added into device tensors (:class:`IntervalStats`). Two
internal lanes travel with them: the interval's wall time (``max`` across ranks: the job goes at
its slowest rank's pace) and its tokens (``sum``, counted once per data-parallel replica); the
Monitor moves both into :class:`LogContext` after the reduction.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..interval import IntervalClock, IntervalStats
from ..parallel import counts_batch_tokens
from .base import Alert, LogContext, Sample

__all__ = ["StepValues", "INTERVAL_S", "TOKENS"]

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
        self.counts_tokens = counts_batch_tokens(layout)
        self.job_tokens: Number = 0.0  # this rank's share of the tokens since the job started
        self.clock = IntervalClock()

    def record_step(self, loss: Optional[Number], tokens: Optional[Number], lr: Optional[Number],
                    scalars: dict[str, Number]) -> None:
        """One optimizer step's values (already checked by the Monitor)."""
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
        self.stats.record(name, value, reduce, weight=weight)

    def pause(self) -> None:
        """Stop the interval clock (evaluation, checkpointing)."""
        self.clock.pause()

    def resume(self) -> None:
        """Start the interval clock again after :meth:`pause`."""
        self.clock.resume()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The interval's values and its wall time; the clock starts the next interval."""
        return self.stats.take_samples() + [Sample(INTERVAL_S, self.clock.take(), "max")]

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Nothing to derive (the Monitor moves the internal lanes into the context)."""
        return []

    def close(self) -> None:
        """Nothing to release."""


def _as_number(v: Number) -> Number:
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float64)
    return v
