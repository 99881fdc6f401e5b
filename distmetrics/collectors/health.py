"""Training health: loss and gradient spikes, non-finite losses and gradients, skipped steps.

Everything per step stays on device (sums and counts); spikes and alerts are decided after the
log step's reduction, from values that are the same on every rank.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional, Union

import torch

from .base import Alert, LogContext, Sample

__all__ = ["SpikeDetector", "HealthCollector", "WARMUP", "WINDOW"]

WARMUP = 10  # values seen before a spike can be called
WINDOW = 50  # values in the moving average


class SpikeDetector:
    """A value above ``factor`` × the moving average of the values before it is a spike."""

    def __init__(self, factor: float, warmup: int = WARMUP, window: int = WINDOW) -> None:
        self.factor = factor
        self.warmup = warmup
        self._values: deque = deque(maxlen=window)

    def update(self, value: Optional[float]) -> tuple[bool, Optional[float]]:
        """(is_spike, value / moving average); non-finite values are not averaged in."""
        if value is None or not math.isfinite(value):
            return False, None
        ratio = None
        if len(self._values) >= self.warmup:
            average = sum(self._values) / len(self._values)
            ratio = value / average if average > 0 else None
        spike = ratio is not None and ratio > self.factor
        if not spike:  # a spike would inflate the average it is judged against
            self._values.append(value)
        return spike, ratio


def _nonfinite(loss: Any) -> Union[float, torch.Tensor]:
    """1 if ``loss`` is NaN or Inf, else 0: a number for a number or a host tensor, a float64
    tensor on the loss's device otherwise (no sync)."""
    if isinstance(loss, torch.Tensor):
        loss = loss.detach()  # a loss that still requires grad: torch warns when it is read
        if not loss.is_cpu:
            return (~torch.isfinite(loss)).to(torch.float64).sum()
    return float(not math.isfinite(float(loss)))


class HealthCollector:
    """Non-finite loss counts, skipped steps, spikes and the alerts they raise. Reads the norms
    collector's ``grad_norm`` and ``grad_nonfinite_modules``."""

    name = "health"
    after = ("norms",)
    writes = ("health/",)

    def __init__(self, spike_factor: float) -> None:
        self.loss_spikes = SpikeDetector(spike_factor)
        self.grad_spikes = SpikeDetector(spike_factor)
        self._nonfinite_loss: Union[float, torch.Tensor] = 0.0
        self._skipped = 0

    def record_step(self, loss: Any, skipped: bool, tokens: Any = None) -> None:
        """One step's loss (counted if non-finite, on device) and whether the optimizer skipped it.
        A loss with ``tokens`` 0 is a mean over nothing (NaN where the batch was all masked): not
        counted, as ``train/loss`` leaves it out."""
        if loss is None:
            pass
        elif not isinstance(tokens, torch.Tensor) or tokens.is_cpu:  # read on the host: nothing waits
            if tokens is None or float(tokens) != 0:
                self._nonfinite_loss = self._nonfinite_loss + _nonfinite(loss)
        else:  # tokens on a device: masked there, no sync
            bad = _nonfinite(loss)
            mask = tokens.detach().reshape(()) != 0
            if isinstance(bad, torch.Tensor) and bad.device != mask.device:
                bad = bad.to(mask.device, non_blocking=True)
            self._nonfinite_loss = self._nonfinite_loss + bad * mask
        if skipped:
            self._skipped += 1

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """Non-finite losses (summed over ranks) and skipped steps (the worst rank's count)."""
        out = [Sample("health/nonfinite_loss", self._nonfinite_loss, "sum"),
               Sample("health/skipped_steps", float(self._skipped), "max")]
        self._nonfinite_loss, self._skipped = 0.0, 0
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Spike flags into ``metrics``; returns alerts (at most one per event)."""
        metrics.pop("health/skipped_steps/max_rank", None)
        alerts = []
        for key, detector, name in (("train/loss", self.loss_spikes, "loss"), ("grad_norm", self.grad_spikes, "grad")):
            value = metrics.get(key)
            value = float(value) if isinstance(value, (int, float)) else None
            spike, ratio = detector.update(value)
            if value is not None and math.isfinite(value):  # NaN or inf is no judgement: nonfinite_* count it
                metrics[f"health/{name}_spike"] = int(spike)
                if ratio is not None:
                    metrics[f"health/{name}_spike_factor"] = ratio
        bad = metrics.get("grad_nonfinite_modules")
        if bad and not ctx.previous.get("grad_nonfinite_modules"):  # once per event: the last record had none
            names = list(bad)
            order = list(ctx.module_order)
            ordered = [m for m in order if m in names] + [m for m in names if m not in order]
            metrics["health/first_nonfinite_module"] = ordered[0]
        if bad and not ctx.previous.get("grad_nonfinite_modules") and not ctx.previous.get("grad_nonfinite_steps"):
            # the last record's count of steps with non-finite gradients is this event's start: said there
            alerts.append(Alert("nonfinite_grad", f"non-finite gradient first in module {ordered[0]!r} "
                                                  f"({len(ordered)} module(s): {', '.join(ordered)})",
                                {"first_module": ordered[0], "modules": ordered}))
        steps = metrics.get("grad_nonfinite_steps")
        if steps and not metrics.get("grad_nonfinite") and not ctx.previous.get("grad_nonfinite_steps"):
            alerts.append(Alert("nonfinite_grad", f"non-finite gradients in {int(steps)} step(s) since the last log "
                                                  "step, not in this one's", {"steps": int(steps)}))
        bad = metrics.get("health/nonfinite_loss")
        if bad and not ctx.previous.get("health/nonfinite_loss"):  # once per event; the count is in every record
            alerts.append(Alert("nonfinite_loss", f"non-finite loss in {int(bad)} rank-step(s)"))
        return alerts

    def close(self) -> None:
        """Nothing to release."""
