"""What collectors hand the reducer (:class:`Sample`: one rank's value and how it combines
across ranks) and what it hands back (:class:`Reduced`: the result, identical on every rank).
:mod:`distmetrics.reduce` packs the one and makes the other.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from .names import EXACT_KINDS, check_count, check_reduce, check_value, user_tensor
from .packing import PackLayout
from .per_rank import PerRank

__all__ = ["Sample", "Reduced", "check_tensors"]

Number = Union[int, float, torch.Tensor]
_checked_names: dict[int, tuple] = {}  # id → the vector names tuples found to hold only str (kept alive here)


@dataclass
class Sample:
    """One rank's value of one metric (or of several, as a vector) and how it combines across ranks.

    For ``mean``, the cross-rank result is Σ value·weight / Σ weight; a rank with weight 0
    has nothing to contribute (e.g. a pipeline stage without the loss). When ``summed`` is
    true, ``value`` is already Σ value·weight over the interval (the accumulator's form).
    With ``names``, ``value`` is a 1-D tensor holding one value per name (``weight`` and
    ``low`` a number or a tensor of the same length); ``name`` then names the family in
    messages. Pass the same ``names`` tuple at every log step: its layout is cached.
    """

    name: str
    value: Number
    reduce: str = "mean"
    weight: Number = 1.0
    summed: bool = False
    low: Optional[Number] = None
    """For ``minmax``: the value for the min lane when it differs (an interval's minimum)."""
    names: Optional[tuple] = None
    """Element names of a vector sample."""
    writer: str = field(default="", repr=False, compare=False)
    """The user's collector that handed it over ('' for the Monitor's own samples and ``monitor.record``'s),
    set by the log step: ranks that send one name from two writers are refused (:mod:`distmetrics.reduce`)."""

    def __post_init__(self) -> None:
        # Refused here, in the collector's take_samples, not in a pack after some collective:
        # a rank that fails there leaves the others waiting in the next one.
        if not isinstance(self.name, str):
            raise TypeError(f"Sample name: a metric name is a str, got {type(self.name).__name__} {self.name!r}")
        if self.reduce in EXACT_KINDS:  # an internal lane's int (see EXACT_KINDS); refused in a user's collector
            if self.name[:1] != "_" or type(self.value) is not int or not -2**63 < self.value < 2**63 \
                    or self.names is not None:
                raise ValueError(f"Sample {self.name!r}: reduce={self.reduce!r} takes one int64 of an internal "
                                 f"lane (a name starting with '_'), got {type(self.value).__name__} {self.value!r:.40}")
            return
        check_reduce(self.name, self.reduce)
        if self.low is not None and self.reduce != "minmax":  # a min's pack reads low where it is given
            raise ValueError(f"Sample {self.name!r}: low is the min lane of a minmax, not used by {self.reduce!r}; "
                             "give a min the value itself")
        if self.reduce != "mean" and not (type(self.weight) in (float, int) and self.weight == 1):  # the default
            raise ValueError(f"Sample {self.name!r}: a weight is a mean's; reduce={self.reduce!r} would ignore "
                             f"weight={self.weight!r:.100} (leave it out, or reduce as 'mean')")
        if self.names is None:
            check_value(self.value, "Sample %r", self.name)
            check_value(self.weight, "Sample %r weight", self.name)
            check_count(self.weight, "Sample %r weight", self.name)
            if self.low is not None:
                check_value(self.low, "Sample %r low", self.name)
        else:
            if not isinstance(self.names, tuple):
                self.names = tuple(self.names)
            if self.names is not _checked_names.get(id(self.names)):  # collectors pass the same tuple each time
                if not all(isinstance(name, str) for name in self.names):
                    raise TypeError(f"vector sample {self.name!r}: element names are str, got {self.names!r:.300}")
                if len(_checked_names) >= 256:
                    _checked_names.clear()
                _checked_names[id(self.names)] = self.names
            if not isinstance(self.value, torch.Tensor) or self.value.shape != (len(self.names),):
                shape = tuple(self.value.shape) if isinstance(self.value, torch.Tensor) else type(self.value).__name__
                raise ValueError(f"vector sample {self.name!r}: {len(self.names)} names need a 1-D tensor of "
                                 f"{len(self.names)} values, got {shape}")
            for part, given in (("weight", self.weight), ("low", self.low)):
                if given is None:
                    continue
                if not isinstance(given, torch.Tensor):
                    if isinstance(given, bool) or not isinstance(given, numbers.Real):  # a list or an array
                        # failed in the pack, after the log step's first collective
                        raise TypeError(f"vector sample {self.name!r}: {part} is a number or a 1-D tensor of "
                                        f"{len(self.names)} values (one per name), got {type(given).__name__} "
                                        f"{given!r:.100}")
                    check_value(given, "vector sample %r " + part, self.name)
                    if part == "weight":
                        check_count(given, "vector sample %r weight", self.name)
                elif given.dim() != 1 or given.numel() != len(self.names):
                    raise ValueError(f"vector sample {self.name!r}: {part} is a number or a 1-D tensor of "
                                     f"{len(self.names)} values (one per name), got shape {tuple(given.shape)}")


def check_tensors(sample: Sample) -> None:
    """Refuse a sample of a user's collector holding a tensor no pack can read, as ``monitor.record`` refuses
    one (:func:`~distmetrics.names.user_tensor`: on the meta device, sparse, a DTensor whose piece is not the
    value): it failed inside the packs, after the log step's first collective, the other ranks waiting. (The
    Monitor's own measurements may run on the meta device in tests standing in for a GPU: checked at
    :func:`distmetrics.collectors.base.take_samples`, not when a Sample is made.) A Replicate DTensor is
    replaced by this rank's copy (a vector one failed in the packs, every record lost), and a vector of
    complex values is refused as a complex number is (its imaginary part was dropped in the pack)."""
    for part in ("value", "weight", "low"):
        given = getattr(sample, part)
        if isinstance(given, torch.Tensor):
            local = user_tensor(given, f"Sample {sample.name!r} {part}")
            if local.is_complex():
                raise TypeError(f"Sample {sample.name!r} {part}: expected real numbers, got a tensor of {local.dtype} "
                                "(pass .real, .abs() or the values you mean)")
            if local is not given:
                setattr(sample, part, local)


@dataclass
class Reduced:
    """The result of one reduction, identical on every rank."""

    values: dict[str, float] = field(default_factory=dict)
    """``sum`` and ``mean`` results."""
    maxima: dict[str, tuple[float, Optional[int]]] = field(default_factory=dict)
    """``max``/``minmax`` results: (value, global rank holding it); ``imax``: (the int, None)."""
    minima: dict[str, tuple[float, Optional[int]]] = field(default_factory=dict)
    """``min``/``minmax`` results: (value, global rank holding it); ``imin``: (the int, None)."""
    per_rank: dict[str, PerRank] = field(default_factory=dict)
    """``all`` results."""
    kinds: dict[str, str] = field(default_factory=dict)
    """The reduce kind of every name in the agreed layout."""
    layout: Optional[PackLayout] = None
    """The agreed layout (its key index is cached there)."""
    sum_weights: Sequence[float] = ()
    """The SUM pack's weight lanes in the layout's order (a mean's denominator: see :meth:`weight`)."""

    def weight(self, name: str) -> Optional[float]:
        """The total weight behind a ``mean`` result (Σ weight over ranks and steps: the tokens
        that ``train/loss`` averages over), or None where there is none."""
        at = self.layout.sum_index.get(name) if self.layout is not None and self.sum_weights else None
        return None if at is None else self.sum_weights[at // 2]

    def keys_under(self, prefixes: tuple) -> tuple:
        """Every key :meth:`to_metrics` can write for the agreed names that starts with one of
        ``prefixes`` (present this time or not), worked out once per layout."""
        if self.layout is None:
            return tuple(key for key in self.to_metrics() if key.startswith(prefixes))
        return self.layout.metric_keys(prefixes)

    def to_metrics(self, take: bool = False) -> dict[str, Any]:
        """Flat names: ``x`` for sum/mean/max/min, ``x/max``/``x/min`` for minmax, ranks beside;
        for ``all``, ``x`` (every rank's value) and its summary ``x/max``, ``x/min``, ``x/mean``
        over the ranks that sent one (NaN on any of them makes each NaN, as a ``max``'s NaN wins:
        a rank gone bad shows on the dashboards, which get the summary). ``take``: the result is
        built in ``values`` itself, which is left empty (no copy of a large dict)."""
        out: dict[str, Any] = self.values if take else dict(self.values)
        if take:
            self.values = {}
        for name, (value, rank) in self.maxima.items():
            out[name if self.kinds[name] != "minmax" else f"{name}/max"] = value
            if rank is not None:
                out[f"{name}/max_rank"] = rank
        for name, (value, rank) in self.minima.items():
            out[name if self.kinds[name] != "minmax" else f"{name}/min"] = value
            if rank is not None:
                out[f"{name}/min_rank"] = rank
        for name, values in self.per_rank.items():
            out[name] = values
            out.update({f"{name}/{stat}": v for stat, v in _summary(values).items()})
        return out


def _summary(values: PerRank) -> dict[str, float]:
    present = [v for v in values if v is not None]
    if not present:
        return {}
    if any(v != v for v in present):  # NaN
        return {"max": math.nan, "min": math.nan, "mean": math.nan}
    return {"max": max(present), "min": min(present), "mean": sum(present) / len(present)}  # inf - inf: NaN
