"""The steps of a log interval whose gradients held NaN or inf (``grad_nonfinite_steps``),
counted at each clip or measurement without a host sync: a step between two log steps whose
gradients overflowed would otherwise leave no trace in the log step's record."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..grad_measurement import GradMeasurement

__all__ = ["NonfiniteSteps"]


class NonfiniteSteps:
    """The interval's count: a number where the gradients are on the CPU, else a 0-d float64
    tensor on their device. Two measurements in one step (a clip per parameter group) count once."""

    def __init__(self) -> None:
        self._steps: Any = None  # earlier steps of the interval with non-finite gradients
        self._now: Any = None  # whether the latest step's were (1.0 or 0.0)

    def measured(self, measured: GradMeasurement, same_step: bool) -> None:
        """Count a measurement's step: NaN or inf on some rank's local tensors (a lane of the
        clip's all-reduce, the same on every rank). A total that is inf only because finite
        gradients' sum of squares passed the float range is no such step."""
        anywhere = measured.bad_anywhere
        if measured.on_host:  # a number: reading a CPU tensor waits for nothing, and is cheaper than ops on it
            bad: Any = float(float(anywhere) > 0)
        else:
            bad = (anywhere > 0).reshape(()).to(torch.float64)
        self.count(bad, same_step)

    def count(self, bad: Any, same_step: bool) -> None:
        """Count one step (``bad``: 1.0 or 0.0, a number or a 0-d tensor); a clip that raised for
        ``error_if_nonfinite`` counts whether some rank's gradients held NaN or inf."""
        now = self._now
        if same_step and now is not None:
            numbers = not isinstance(now, torch.Tensor) and not isinstance(bad, torch.Tensor)
            self._now = max(now, bad) if numbers else torch.maximum(torch.as_tensor(now), torch.as_tensor(bad))
            return
        if now is not None:
            self._steps = now if self._steps is None else self._steps + now
        self._now = bad

    def take(self) -> Optional[Any]:
        """The interval's count (None where no step was measured); then start again."""
        if self._now is None:
            return None
        out = self._now if self._steps is None else self._steps + self._now
        self._steps = self._now = None
        return out
