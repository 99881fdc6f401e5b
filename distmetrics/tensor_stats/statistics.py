"""Tensor statistics as mergeable partials, exact across micro-batches and ranks.

A tensor becomes on-device partials — count, mean, M2 (Σ(x−mean)²), min, max, Σ|x|, Σx² and
the smallest non-zero |x| — and partials merge pairwise (Chan et al.), so the variance of the
union is exact; TransformerEngine's cross-rank ``std`` subtracts the between-group term, ours
adds it. Every statistic a features file may ask for is a function of the partials.
``dynamic_range`` is TransformerEngine's definition applied to the union of every rank's values:
TE's cross-rank combination (the largest of the ranks' log2 amax less the smallest of their log2
amin) reads a rank holding only zeros as inf, whatever the other ranks hold.
"""

from __future__ import annotations

import math

import torch

__all__ = ["PARTS", "SUPPORTED_STATS", "partials", "merge", "merge_ranks", "stat_value"]

PARTS = ("n", "mean", "m2", "min", "max", "l1", "sumsq", "minabs")
SUPPORTED_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")


def partials(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The partials of a float64 vector, as 0-d tensors on its device.

    torch.where/amin and full(): no boolean-mask indexing or host scalar copy, so the host never
    waits for the device (this runs inside forward and backward hooks). An empty vector gives
    count 0 and the identity of every merge (so it travels, and says that the tensor was empty)."""
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return {"n": zero, "mean": zero, "m2": zero, "min": zero + math.inf, "max": zero - math.inf, "l1": zero,
                "sumsq": zero, "minabs": zero + math.inf}
    mean = x.mean()
    magnitude = x.abs()
    return {"n": torch.full((), float(x.numel()), dtype=torch.float64, device=x.device), "mean": mean,
            "m2": (x - mean).pow(2).sum(), "min": x.min(), "max": x.max(), "l1": magnitude.sum(),
            "sumsq": x.pow(2).sum(),
            "minabs": torch.where(x != 0, magnitude, torch.full_like(magnitude, math.inf)).amin()}


def merge(a: dict, b: dict) -> dict:
    """Chan et al.'s pairwise combination of (n, mean, M2) plus extremes and sums; the mean as the
    weighted sum, as :func:`merge_ranks` (``a.mean + delta·n_b/n`` is NaN for an inf mean: inf − inf).
    Two empty tensors' (n = 0) merge to an empty one, not to 0/0."""
    n = a["n"] + b["n"]
    delta = b["mean"] - a["mean"]
    divisor = n.clamp_min(1)  # counts are whole: n itself wherever n > 0
    return {"n": n, "mean": (a["mean"] * a["n"] + b["mean"] * b["n"]) / divisor,
            "m2": a["m2"] + b["m2"] + delta * delta * a["n"] * b["n"] / divisor,
            "min": torch.minimum(a["min"], b["min"]), "max": torch.maximum(a["max"], b["max"]),
            "l1": a["l1"] + b["l1"], "sumsq": a["sumsq"] + b["sumsq"],
            "minabs": torch.minimum(a["minabs"], b["minabs"])}


def merge_ranks(table: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every rank's partials merged at once: ``table[..., part, rank]`` (parts in :data:`PARTS`
    order; a rank without values has NaN there) → each part over the ranks, shape ``table[..., 0, 0]``.
    The same union as :func:`merge` applied rank after rank, in one pass:
    N = Σn, mean = Σ n·mean / N, M2 = Σ M2 + Σ n·(mean − mean_all)²."""
    present = ~torch.isnan(table[..., 0, :])

    def part(name: str, missing: float) -> torch.Tensor:
        return torch.where(present, table[..., PARTS.index(name), :], missing)

    n, means = part("n", 0.0), part("mean", 0.0)
    total = n.sum(-1)
    mean = (n * means).sum(-1) / total
    spread = torch.where(present, n * (means - mean.unsqueeze(-1)).pow(2), 0.0).sum(-1)
    return {"n": total, "mean": mean, "m2": part("m2", 0.0).sum(-1) + spread,
            "min": part("min", math.inf).amin(-1), "max": part("max", -math.inf).amax(-1),
            "l1": part("l1", 0.0).sum(-1), "sumsq": part("sumsq", 0.0).sum(-1),
            "minabs": part("minabs", math.inf).amin(-1)}


def stat_value(stat: str, v: dict) -> float:
    """One statistic from merged partials (plain floats)."""
    amax = max(abs(v["min"]), abs(v["max"]))
    if stat == "std":
        return math.sqrt(v["m2"] / (v["n"] - 1)) if v["n"] > 1 else math.nan  # torch.std's correction
    if stat == "l2_norm":
        return math.sqrt(v["sumsq"])
    if stat == "l1_norm":
        return v["l1"]
    if stat == "cur_amax":
        return amax
    if stat == "dynamic_range":  # TransformerEngine's: log2 of the largest non-zero |x| less log2 of the smallest
        if amax == 0:  # no non-zero value: TE takes its log2 of the largest as inf (and of the smallest as 0)
            return math.inf
        # a NaN gives NaN, and every non-zero value ±inf log2(inf) - log2(inf), NaN too (both read 0.0)
        return math.log2(amax) - math.log2(v["minabs"])
    return v[stat]  # min, max, mean
