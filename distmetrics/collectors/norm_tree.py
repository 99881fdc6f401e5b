"""Subtree norms from the modules that own parameters: every module's value over its subtree
(a sum of p-th powers, or a max or min), and where each family's names sit in a log step's
metrics, worked out once per set of names; the per-module vector samples the
families are sent as, and the p-th roots taken of them."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from ..packing import tuple_getter
from ..plans import Buckets, Plan
from .base import Sample

__all__ = ["Families", "Found", "subtree_values", "roots", "module_vector"]


def subtree_values(leaves: dict[str, float], combine: Callable[[float, float], float]) -> dict[str, float]:
    """Every module's value over its subtree, from the values of the modules that own
    parameters (``leaves``); the root's own parameters (``model``, a name without a dot) keep their own value.
    ``combine``: ``"sum"``, ``max`` or ``min`` (NaN wins a max or a min)."""
    tree = _Leaves("", list(leaves), {})
    kind = {"sum": "sum", max: "max", min: "min"}.get(combine, combine)
    return dict(zip(tree.out_modules, tree.subtrees(list(leaves.values()), kind)))


def _chain(module: str) -> tuple[str, ...]:
    """A module and its ancestors, outermost first (the root's own parameters, a name without a
    dot, alone)."""
    parts = module.split(".")
    return tuple(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))


class _Leaves:
    """One family's leaf values (modules owning parameters) in a log step's metrics, and the
    subtrees they add up into. Subtrees over one leaf come first in ``out_modules`` (the
    usual case: copied in one gather), those over several after them."""

    def __init__(self, family: str, modules: list[str], chains: dict[str, tuple], keys: Optional[list] = None) -> None:
        # the reduction's own key objects where given: a lookup then matches by identity
        self.keys = keys if keys is not None else [f"{family}/{module}" for module in modules]
        ancestry = [chains.get(m) or chains.setdefault(m, _chain(m)) for m in modules]
        under: dict[str, list[int]] = {}  # every subtree → its leaves, in leaf order
        for j, chain in enumerate(ancestry):
            for module in chain:
                under.setdefault(module, []).append(j)
        singles = [m for m, leaves in under.items() if len(leaves) == 1]
        several = [m for m, leaves in under.items() if len(leaves) > 1]
        self.out_modules = singles + several
        own = dict(zip(modules, self.keys))
        self.out_keys = [own.get(m) or f"{family}/{m}" for m in self.out_modules]
        self._singles = tuple_getter([under[m][0] for m in singles])
        self._several = [tuple_getter(under[m]) for m in several]
        position = {module: i for i, module in enumerate(self.out_modules)}
        self._into = [tuple(position[a] for a in chain) for chain in ancestry]
        self.read = tuple_getter(self.keys)
        """The leaf values in a log step's metrics (every key present), as a tuple."""

    def subtrees(self, values: Sequence[float], kind: str) -> list[float]:
        """Every subtree's value (``kind``: sum, max or min) in ``out_modules`` order."""
        if kind == "sum":  # in leaf order from 0, as a running sum
            out = list(self._singles(values))
            out.extend(sum(leaves(values)) for leaves in self._several)
            return out
        pick = max if kind == "max" else min
        best: list = [None] * len(self.out_modules)
        for value, into in zip(values, self._into):
            for i in into:
                old = best[i]
                best[i] = value if old is None or value != value else old if old != old else pick(old, value)
        return best


class Families:
    """Where each family's leaves sit, worked out once per set of names (log steps repeat them)."""

    def __init__(self) -> None:
        self._by_keys: dict[tuple, Found] = {}
        self._chains: dict[str, tuple] = {}
        self._last: tuple = (None, None)

    def of(self, keys: tuple) -> "Found":
        """The :class:`Found` of these metric keys (the same tuple as last time: no lookup)."""
        if keys is self._last[0]:
            return self._last[1]
        found = self._by_keys.get(keys)
        if found is None:
            if len(self._by_keys) >= 8:  # the names rarely change; keep a few sets
                self._by_keys.clear()
            found = self._by_keys[keys] = Found(keys, self._chains)
        self._last = (keys, found)
        return found


class Found:
    """One set of names: the rank keys to drop and each family's :class:`_Leaves`."""

    def __init__(self, keys: tuple, chains: dict[str, tuple]) -> None:
        self.rank_keys = [key for key in keys if key.endswith(("/max_rank", "/min_rank"))]
        modules: dict[str, list[str]] = {}
        own: dict[str, list[str]] = {}  # the keys themselves, per family
        for key in keys:
            if not key.endswith(("/max_rank", "/min_rank")):
                family, _, module = key.partition("/")
                modules.setdefault(family, []).append(module)
                own.setdefault(family, []).append(key)
        self.leaves = {family: _Leaves(family, names, chains, own[family]) for family, names in modules.items()}


def roots(values: list[float], p: float) -> list[float]:
    """The p-th roots of sums of p-th powers (NaN for a negative sum; NaN stays NaN; a zero sum of
    p < 0 powers, every element ±inf, gives inf as torch's norm does)."""
    if p == 2.0:
        try:
            return list(map(math.sqrt, values))
        except ValueError:  # a negative sum
            return [math.sqrt(v) if v >= 0 else math.nan for v in values]
    return [(v ** (1.0 / p) if v or p > 0 else math.inf) if v >= 0 else math.nan for v in values]


def module_vector(plan: Plan, family: str, values: torch.Tensor, kind: str, buckets: Buckets) -> Sample:
    """One vector sample of ``values[buckets]``, named ``<family>/<module>`` (names cached; every
    bucket in order, as on one rank, takes ``values`` as they are)."""
    key = (family, id(buckets))  # routes keep their Buckets: no hash of every id at each log step
    cached = plan.vectors.get(key)
    if cached is None or cached[0] is not buckets:
        if len(plan.vectors) >= 64:  # routes made anew (the gradients present changed): keep a few
            plan.vectors.clear()
        names = tuple(f"{family}/{plan.buckets[i]}" for i in buckets.ids)
        cached = plan.vectors[key] = (buckets, names, buckets.ids == tuple(range(len(plan.buckets))))
    _, names, every = cached
    picked = values if every else values.index_select(0, buckets.index.to(values.device))
    return Sample(family, picked, kind, names=names)
