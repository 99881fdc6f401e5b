"""Training health: loss and gradient spikes, non-finite losses and gradients, skipped steps,
loss by category, MoE router statistics.

Everything per step stays on device (sums and counts); spikes and alerts are decided after the
log step's reduction, from values that are the same on every rank.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional, Sequence, Union

import torch

from ..reduce import Sample

__all__ = ["SpikeDetector", "HealthCollector", "CategoryLosses", "MoECollector"]

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


class HealthCollector:
    """Non-finite loss counts, skipped steps, spikes and the alerts they raise."""

    def __init__(self, spike_factor: float) -> None:
        self.loss_spikes = SpikeDetector(spike_factor)
        self.grad_spikes = SpikeDetector(spike_factor)
        self._nonfinite_loss: Union[float, torch.Tensor] = 0.0
        self._skipped = 0
        self._grads_bad = False

    def record_step(self, loss: Any, skipped: bool) -> None:
        if loss is not None:
            bad = (~torch.isfinite(loss.detach())).to(torch.float64).sum() if isinstance(loss, torch.Tensor) \
                else float(not math.isfinite(float(loss)))
            self._nonfinite_loss = self._nonfinite_loss + bad
        if skipped:
            self._skipped += 1

    def samples(self) -> list[Sample]:
        out = [Sample("health/nonfinite_loss", self._nonfinite_loss, "sum"),
               Sample("health/skipped_steps", float(self._skipped), "max")]
        self._nonfinite_loss, self._skipped = 0.0, 0
        return out

    def finalize(self, metrics: dict[str, Any], step: int, module_order: Sequence[str]) -> list[dict]:
        """Spike flags into ``metrics``; returns alert records (at most one per event)."""
        metrics.pop("health/skipped_steps/max_rank", None)
        alerts = []
        for key, detector, name in (("train/loss", self.loss_spikes, "loss"), ("grad_norm", self.grad_spikes, "grad")):
            value = metrics.get(key)
            spike, ratio = detector.update(value if isinstance(value, float) else None)
            if value is not None:
                metrics[f"health/{name}_spike"] = int(spike)
                if ratio is not None:
                    metrics[f"health/{name}_spike_factor"] = ratio
        bad = metrics.get("grad_nonfinite_modules")
        if bad and not self._grads_bad:
            names = bad.split(",")
            ordered = [m for m in module_order if m in names] + [m for m in names if m not in module_order]
            metrics["health/first_nonfinite_module"] = ordered[0]
            alerts.append({"message": f"non-finite gradient first in module {ordered[0]!r} "
                                      f"({len(ordered)} module(s): {', '.join(ordered)})",
                           "alert": "nonfinite_grad", "first_module": ordered[0], "modules": ordered})
        self._grads_bad = bool(bad)
        if metrics.get("health/nonfinite_loss"):
            alerts.append({"message": f"non-finite loss in {int(metrics['health/nonfinite_loss'])} rank-step(s)",
                           "alert": "nonfinite_loss"})
        return alerts


class CategoryLosses:
    """Per-category sums and weights of per-sample losses, on device, for one split."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix  # "train/loss" or "eval/loss"
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self._sums: Optional[torch.Tensor] = None
        self._weights: Optional[torch.Tensor] = None

    def record(self, losses: torch.Tensor, categories: Union[Sequence, torch.Tensor],
               weights: Optional[torch.Tensor] = None, names: Union[None, Sequence[str], dict] = None) -> None:
        losses = losses.detach().reshape(-1).to(torch.float64)
        n = losses.numel()
        w = torch.ones_like(losses) if weights is None else torch.as_tensor(weights).detach().reshape(-1).to(
            device=losses.device, dtype=torch.float64)
        if w.numel() != n:
            raise ValueError(f"record_losses: {n} losses but {w.numel()} weights")
        if isinstance(categories, torch.Tensor):
            if categories.numel() != n:
                raise ValueError(f"record_losses: {n} losses but {categories.numel()} categories")
            if names is None:
                raise ValueError("record_losses: integer category tensors need names= (a list or dict id → name), "
                                 "so the monitor knows every category without reading the tensor")
            table = dict(enumerate(names)) if not isinstance(names, dict) else dict(names)
            ids = torch.tensor([self._slot(table[i]) for i in sorted(table)], dtype=torch.long)
            index = _to_device(ids, losses.device)[categories.reshape(-1).to(device=losses.device, dtype=torch.long)]
        else:
            categories = list(categories)
            if len(categories) != n:
                raise ValueError(f"record_losses: {n} losses but {len(categories)} categories")
            labels = [str(c) if names is None else str(names[c]) for c in categories]
            index = _to_device(torch.tensor([self._slot(c) for c in labels], dtype=torch.long), losses.device)
        self._grow(losses.device)
        self._sums.index_add_(0, index, losses * w)
        self._weights.index_add_(0, index, w)

    def samples(self) -> list[Sample]:
        if self._sums is None:
            return []
        out = [Sample(f"{self.prefix}/{name}", self._sums[i], "mean", weight=self._weights[i], summed=True)
               for i, name in enumerate(self.names)]
        self._sums = self._weights = None
        return out

    def _slot(self, name: str) -> int:
        if name not in self._index:
            if "/" in name:
                raise ValueError(f"record_losses: category {name!r} may not contain '/'")
            self._index[name] = len(self.names)
            self.names.append(name)
        return self._index[name]

    def _grow(self, device: torch.device) -> None:
        size = len(self.names)
        if self._sums is None:
            self._sums = torch.zeros(size, dtype=torch.float64, device=device)
            self._weights = torch.zeros(size, dtype=torch.float64, device=device)
        elif self._sums.numel() < size:
            pad = torch.zeros(size - self._sums.numel(), dtype=torch.float64, device=device)
            self._sums = torch.cat([self._sums, pad])
            self._weights = torch.cat([self._weights, pad])


class MoECollector:
    """Router statistics: auxiliary and z losses (means), tokens per expert (summed over the
    ranks that see distinct tokens), expert utilisation and load imbalance."""

    def __init__(self, counts_tokens: bool) -> None:
        self.counts_tokens = counts_tokens  # False on TP/CP peers that see the same tokens
        self._counts: Optional[torch.Tensor] = None
        self._layers: list[int] = []
        self._aux: list[Sample] = []

    def record(self, aux_loss=None, z_loss=None, tokens_per_expert: Optional[torch.Tensor] = None,
               layer_numbers: Optional[Sequence[int]] = None, stats=None) -> None:
        for name, value in (("moe/aux_loss", aux_loss), ("moe/z_loss", z_loss)):
            if value is not None:
                stats.record(name, value, "mean")
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
        else:
            self._counts += counts

    def samples(self) -> list[Sample]:
        if self._counts is None:
            return []
        out = []
        for row, layer in enumerate(self._layers):
            for expert in range(self._counts.shape[1]):
                out.append(Sample(f"_moe/tokens/{layer}/{expert}", self._counts[row, expert], "sum"))
        self._counts = None
        return out

    @staticmethod
    def finalize(metrics: dict[str, Any]) -> None:
        per_layer: dict[str, dict[int, float]] = {}
        for key, value in metrics.items():
            if key.startswith("_moe/tokens/"):
                _, _, layer, expert = key.split("/")
                per_layer.setdefault(layer, {})[int(expert)] = value
        if not per_layer:
            return
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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host index → device without making the host wait for queued device work."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
