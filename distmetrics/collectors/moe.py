"""Mixture-of-experts router statistics: auxiliary and z losses, tokens per expert, expert
utilisation and load imbalance per layer."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from ..interval import IntervalStats
from .base import Alert, LogContext, Sample

__all__ = ["MoECollector"]

_TOKENS = "_moe/tokens"


class MoECollector:
    """Router statistics: auxiliary and z losses (means), tokens per expert (summed over the
    ranks that see distinct tokens), expert utilisation and load imbalance."""

    name = "moe"
    after = ()
    writes = ("moe/",)

    def __init__(self, counts_tokens: bool) -> None:
        self.counts_tokens = counts_tokens  # False on TP/CP peers that see the same tokens
        self._stats = IntervalStats()
        self._counts: Optional[torch.Tensor] = None
        self._layers: list[int] = []
        self._names: tuple = ()

    def record(self, aux_loss=None, z_loss=None, tokens_per_expert: Optional[torch.Tensor] = None,
               layer_numbers: Optional[Sequence[int]] = None) -> None:
        """One step's router statistics (see ``Monitor.record_moe``)."""
        for name, value in (("moe/aux_loss", aux_loss), ("moe/z_loss", z_loss)):
            if value is not None:
                self._stats.record(name, value, "mean")
        if tokens_per_expert is None:
            return
        counts = tokens_per_expert.detach()
        if counts.dim() == 1:
            counts = counts.unsqueeze(0)
        layers = list(layer_numbers) if layer_numbers is not None else list(range(counts.shape[0]))
        if len(layers) != counts.shape[0]:
            raise ValueError(f"record_moe: {counts.shape[0]} layers of counts but {len(layers)} layer_numbers")
        counts = counts.to(torch.float64) * (1.0 if self.counts_tokens else 0.0)
        if self._counts is None or self._layers != layers or self._counts.shape != counts.shape:
            self._counts, self._layers = counts.clone(), layers
            self._names = tuple(f"{_TOKENS}/{layer}/{expert}" for layer in layers for expert in range(counts.shape[1]))
        else:
            self._counts += counts

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """Interval means of the losses; tokens per (layer, expert) as one vector."""
        out = self._stats.take_samples()
        if self._counts is not None:
            out.append(Sample(_TOKENS, self._counts.reshape(-1), "sum", names=self._names))
            self._counts = None
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """``moe/expert_utilization[/layer<l>]`` and ``moe/load_imbalance[/layer<l>]``."""
        per_layer: dict[str, dict[int, float]] = {}
        for key in ctx.keys_under(metrics, (_TOKENS + "/",)):
            if key in metrics:
                _, _, layer, expert = key.split("/")
                per_layer.setdefault(layer, {})[int(expert)] = metrics.pop(key)
        if not per_layer:
            return []
        utilization, imbalance = [], []
        for layer, counts in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
            values = [counts[e] for e in sorted(counts)]
            mean = sum(values) / len(values)
            used = sum(1 for v in values if v > 0) / len(values)
            ratio = max(values) / mean if mean > 0 else math.nan
            metrics[f"moe/expert_utilization/layer{layer}"] = used
            metrics[f"moe/load_imbalance/layer{layer}"] = ratio
            utilization.append(used)
            imbalance.append(ratio)
        metrics["moe/expert_utilization"] = sum(utilization) / len(utilization)
        metrics["moe/load_imbalance"] = max(imbalance)
        return []

    def close(self) -> None:
        """Nothing to release."""
