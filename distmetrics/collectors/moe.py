"""Mixture-of-experts router statistics: auxiliary and z losses, tokens per expert, expert
utilisation and load imbalance per layer.

Counts are not read at ``record_moe`` (a device sync per call). Each layer's lowest count rides the log
step's MAX pack as a ``min``, so a negative count that the sum over ranks would hide, or a NaN, is seen
there, on every rank alike."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Optional, Sequence

import torch

from ..interval import IntervalStats
from ..names import check_user_value, local_value, outside_inference, user_tensor
from .base import Alert, LogContext, Sample

__all__ = ["MoECollector"]

_TOKENS = "_moe/tokens"
_LOWEST = "_moe/lowest_count"  # per layer: the lowest count any call gave (NaN for a NaN or +inf one)


class MoECollector:
    """Router statistics: auxiliary and z losses (means), tokens per expert (summed over the
    ranks that see distinct tokens), expert utilisation and load imbalance."""

    name = "moe"
    after = ()
    writes = ("moe/",)

    def __init__(self, counts_tokens: bool) -> None:
        self.counts_tokens = counts_tokens  # False on TP/CP peers that see the same tokens
        self._stats = IntervalStats()
        self._counts: dict[tuple, torch.Tensor] = {}  # the layers of a call → their counts this interval
        self._lowest: dict[tuple, torch.Tensor] = {}  # ... and each layer's lowest count in any call
        self._names: dict[tuple, tuple] = {}  # (layer, experts) pairs → the vectors' names (kept: one tuple each)
        self.since_step = False  # recorded since the last monitor.step (said at close(): see end_step)

    @outside_inference
    def record(self, aux_loss=None, z_loss=None, tokens_per_expert: Optional[torch.Tensor] = None,
               layer_numbers: Optional[Sequence[int]] = None) -> None:
        """One step's router statistics (see ``Monitor.record_moe``); a refused call records nothing."""
        for what, value in (("aux_loss", aux_loss), ("z_loss", z_loss)):
            if value is not None:
                check_user_value(value, "record_moe(%s=...)", what)
        if tokens_per_expert is not None:
            self._record_counts(tokens_per_expert, layer_numbers)
        elif layer_numbers is not None and len(layer_numbers):  # a stage with no MoE layer may pass []
            raise ValueError("record_moe(layer_numbers=...) numbers the layers of tokens_per_expert, which was not "
                             "given; pass them together")
        for name, value in (("moe/aux_loss", aux_loss), ("moe/z_loss", z_loss)):
            if value is not None:
                self._stats.record(name, local_value(value), "mean")
        self.since_step = True

    def end_step(self) -> None:
        """A ``monitor.step`` counted what was recorded before it. What comes after the last step is not
        taken back out of the record ``close()`` writes (its counts add up on the device, in place): it
        lands there, and close() says so."""
        self.since_step = False

    def _record_counts(self, tokens_per_expert: torch.Tensor, layer_numbers: Optional[Sequence[int]]) -> None:
        tokens_per_expert = user_tensor(tokens_per_expert, "record_moe(tokens_per_expert=...)")
        if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.dim() not in (1, 2) \
                or tokens_per_expert.shape[-1] == 0 or tokens_per_expert.is_meta:
            what = (f"a tensor of shape {tuple(tokens_per_expert.shape)}" if isinstance(tokens_per_expert, torch.Tensor)
                    else f"{type(tokens_per_expert).__name__} {tokens_per_expert!r}")
            raise ValueError(f"record_moe(tokens_per_expert=...): expected a tensor [layers, experts] or one layer's "
                             f"[experts] (at least one expert), got {what}")
        if tokens_per_expert.is_complex() or tokens_per_expert.dtype == torch.bool:
            raise ValueError(f"record_moe(tokens_per_expert=...): a {tokens_per_expert.dtype} tensor; accepted: counts "
                             "as an integer or real floating tensor")
        counts = tokens_per_expert.detach()
        if counts.dim() == 1:
            counts = counts.unsqueeze(0)
        layers = _layer_numbers(layer_numbers) if layer_numbers is not None else list(range(counts.shape[0]))
        if len(layers) != counts.shape[0]:
            raise ValueError(f"record_moe: {counts.shape[0]} layers of counts but {len(layers)} layer_numbers")
        if not layers:  # [0, experts]: a stage or rank with no MoE layer stacked its none; nothing to count
            return
        counts = counts.to(torch.float64)
        # per call, not of the interval's sums: a negative count hides in a sum as well as in another rank's.
        # Checked on TP/CP peers too (they pass the same counts as TP/CP rank 0)
        lowest = torch.where(counts == math.inf, math.nan, counts).amin(dim=1)
        counts = counts * (1.0 if self.counts_tokens else 0.0)
        key = (tuple(layers), counts.shape[1])
        total = self._counts.get(key)  # calls per layer, or for all layers at once: each adds to its own
        if total is None:
            for other, n in self._counts:
                if n != key[1] and not set(other).isdisjoint(key[0]):
                    layer = min(set(other) & set(key[0]))
                    raise ValueError(f"record_moe: layer {layer} was given counts of {n} experts earlier in this "
                                     f"interval and now of {key[1]}; a layer keeps its number of experts")
            self._counts[key] = counts.clone()
            self._lowest[key] = lowest
        else:
            total.add_(counts)
            torch.minimum(self._lowest[key], lowest, out=self._lowest[key])  # NaN stays NaN

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """Interval means of the losses; tokens per (layer, expert) as one vector, and each layer's
        lowest count as another."""
        out = self._stats.take_samples()
        if not self._counts:
            return out
        rows: dict[int, list] = {}
        lows: dict[int, list] = {}
        experts: dict[int, int] = {}
        for (layers, n), counts in self._counts.items():  # a layer's experts agree (checked at record)
            for layer, row, low in zip(layers, counts, self._lowest[(layers, n)]):
                experts[layer] = n
                rows.setdefault(layer, []).append(row)
                lows.setdefault(layer, []).append(low)
        self._counts, self._lowest = {}, {}
        order = tuple(sorted(rows))
        shape = tuple((layer, experts[layer]) for layer in order)
        names = self._names.get(shape)
        if names is None:
            if len(self._names) >= 64:
                self._names.clear()
            names = self._names[shape] = (tuple(f"{_TOKENS}/{layer}/{e}" for layer, n in shape for e in range(n)),
                                          tuple(f"{_LOWEST}/{layer}" for layer in order))
        vector = torch.cat([sum(rows[layer][1:], rows[layer][0]) for layer in order])  # a layer's calls added
        lowest = torch.stack([functools.reduce(torch.minimum, lows[layer]) for layer in order])
        out.append(Sample(_TOKENS, vector, "sum", names=names[0]))
        out.append(Sample(_LOWEST, lowest, "min", names=names[1]))  # in the MAX pack, which every log step sends
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """``moe/expert_utilization[/layer<l>]`` and ``moe/load_imbalance[/layer<l>]``. A layer that routed
        no token (on any rank) has neither (NaN) and the headlines are over the others (its 0 would read as
        idle experts). Negative, NaN or infinite counts leave both out and raise once the record is written."""
        per_layer: dict[str, dict[int, float]] = {}
        senders: dict[str, dict[int, Optional[float]]] = {}  # layer -> expert -> ranks that sent its count
        weight = getattr(ctx.reduced, "weight", lambda name: None)
        for key in ctx.keys_under(metrics, (_TOKENS + "/",)):
            if key in metrics:
                _, _, layer, expert = key.split("/")
                per_layer.setdefault(layer, {})[int(expert)] = metrics.pop(key)
                senders.setdefault(layer, {})[int(expert)] = weight(key)
        lowest = {}  # layer -> (lowest count on any rank, the rank that gave it)
        for key in ctx.keys_under(metrics, (_LOWEST + "/",)):
            if key in metrics and not key.endswith("/min_rank"):
                lowest[int(key.split("/")[2])] = (metrics.pop(key), metrics.pop(f"{key}/min_rank", None))
        if not per_layer:
            return []
        for layer, by_expert in senders.items():
            if len(set(by_expert.values())) > 1:  # some rank gave this layer fewer experts than another
                fewest = min(by_expert.values())
                short = sorted(e for e, n in by_expert.items() if n == fewest)
                raise ValueError(f"record_moe: ranks gave layer {layer} counts of different numbers of experts: "
                                 f"experts {short[0]}-{short[-1]} were counted by {fewest:g} rank(s), others by "
                                 f"{max(by_expert.values()):g}; every rank passes one count per expert of the layer "
                                 "(the missing ones were read as idle experts)")
        bad = sorted((layer, low, rank) for layer, (low, rank) in lowest.items() if not low >= 0)  # NaN too
        if bad:
            raise _bad_counts(bad, ctx.step)
        utilization, imbalance = {}, {}
        for layer, counts in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
            values = [counts[e] for e in sorted(counts)]
            mean = sum(values) / len(values)
            routed = mean > 0
            utilization[layer] = sum(1 for v in values if v > 0) / len(values) if routed else math.nan
            imbalance[layer] = max(values) / mean if routed else math.nan
            metrics[f"moe/expert_utilization/layer{layer}"] = utilization[layer]
            metrics[f"moe/load_imbalance/layer{layer}"] = imbalance[layer]
        used = [u for u in utilization.values() if not math.isnan(u)]  # the layers that routed tokens
        metrics["moe/expert_utilization"] = sum(used) / len(used) if used else math.nan
        metrics["moe/load_imbalance"] = max(r for r in imbalance.values() if not math.isnan(r)) if used else math.nan
        return []

    def close(self) -> None:
        """Nothing to release."""


def _layer_numbers(layer_numbers: Any) -> list[int]:
    """``layer_numbers`` as whole numbers >= 0 (they name metrics: ``moe/load_imbalance/layer<l>``)."""
    try:
        layers = [operator.index(layer) for layer in layer_numbers]
    except TypeError:
        layers = None
    if layers is None or any(layer < 0 for layer in layers) or any(isinstance(x, bool) for x in layer_numbers):
        raise ValueError(f"record_moe(layer_numbers=...): expected a sequence of whole numbers >= 0 (one per row of "
                         f"tokens_per_expert), got {layer_numbers!r}")
    return layers


def _bad_counts(bad: list, step: int) -> ValueError:
    """The error for layers whose lowest count (over ranks and calls) was negative or NaN (NaN also for
    +inf): ``bad`` holds (layer, that count, the rank that gave it), lowest layer first."""
    layer, low, rank = bad[0]
    held = "a NaN or infinite count" if math.isnan(low) else f"the count {low:g}"
    others = f" (and {len(bad) - 1} other layer(s))" if len(bad) > 1 else ""
    return ValueError(f"record_moe(tokens_per_expert=...): layer {layer} was given {held} on rank {rank} in the steps "
                      f"up to step {step}{others}; accepted counts are finite numbers >= 0 (a negative one hides in "
                      "the sum over ranks). The record was written without moe/expert_utilization and "
                      "moe/load_imbalance")
