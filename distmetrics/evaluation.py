"""Evaluation records: the eval loss (token-weighted across ranks), perplexity, the gap to the
training loss since the last evaluation, eval throughput and loss by category."""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from .collectors.losses import CategoryLosses
from .reduce import Reducer, Sample

__all__ = ["EvalLog"]

Number = Union[int, float, torch.Tensor]


class EvalLog:
    """Reduces evaluation results on demand (its own reducer: eval names never disturb the train
    layout) and remembers the training loss since the last evaluation."""

    def __init__(self, group: Any, write_ppl: bool, guard: Any = None) -> None:
        self.reducer = Reducer(group, guard=guard, call="monitor.log_eval")
        self.write_ppl = write_ppl
        self.categories = CategoryLosses("eval/loss")
        self._train_losses: list[tuple[float, float]] = []

    def note_train_loss(self, loss: Any, tokens: Any) -> None:
        """A train record's loss and tokens, for ``eval/gap``."""
        if isinstance(loss, float):
            self._train_losses.append((loss, tokens if tokens else 1.0))

    def log(self, step: int, loss: Optional[Number], tokens: Optional[Number],
            scalars: dict[str, Number]) -> dict[str, Any]:
        """Reduce one evaluation (every rank) and return the ``eval`` record's metrics."""
        samples = []
        if loss is not None:
            samples.append(Sample("eval/loss", _as_number(loss), "mean",
                                  weight=1.0 if tokens is None else _as_number(tokens)))
        if tokens is not None:
            samples.append(Sample("_eval/tokens", _as_number(tokens), "sum"))
        for name, value in scalars.items():
            samples.append(Sample(name if "/" in name else f"eval/{name}", _as_number(value), "mean"))
        samples += self.categories.take_samples()
        metrics = self.reducer.reduce(samples, tag=step).to_metrics()
        if metrics.get("_eval/tokens") and metrics.get("eval/time_ms"):
            metrics["eval/tokens_per_sec"] = metrics["_eval/tokens"] / (metrics["eval/time_ms"] / 1000.0)
        metrics = {k: v for k, v in sorted(metrics.items()) if not k.startswith("_")}
        eval_loss = metrics.get("eval/loss")
        if isinstance(eval_loss, float):
            if self.write_ppl:
                metrics["eval/ppl"] = math.exp(min(eval_loss, 700.0))
            total_w = sum(w for _, w in self._train_losses)
            if total_w > 0:
                train_mean = sum(v * w for v, w in self._train_losses) / total_w
                metrics["eval/gap"] = eval_loss - train_mean
        self._train_losses = []
        return metrics


def _as_number(v: Number) -> Number:
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float64)
    return v
