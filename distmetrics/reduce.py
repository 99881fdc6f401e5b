"""Packing samples and reducing them across ranks: at most one collective per reduce kind.

A :class:`Sample` is ``(name, value, reduce)``. At a log step :meth:`Reducer.reduce` packs

* every ``sum`` and ``mean`` sample into one float64 tensor → one ``all_reduce(SUM)``
  (a mean is two lanes, value·weight and weight);
* every ``max``, ``min`` and ``minmax`` sample into one int64 tensor → one ``all_reduce(MAX)``.
  Each lane holds an order-preserving key of the float32 value in its high 32 bits and the
  rank in its low 32 bits, so the maximum yields the extreme *and* the rank that holds it;
  a minimum is the maximum of ``-v``. NaN wins both, so a NaN on any rank is never hidden;
* every ``all`` sample into one ``[world, 2n]`` float64 tensor (values and a presence mask)
  → one ``all_gather_into_tensor``.

Ranks may hold different names (pipeline stages own different layers). The packed layout is
the union of names, agreed once with ``all_gather_object`` and cached. The MAX pack always goes
first and carries control lanes: "my names are not all in the cached layout", a hash of the
layout, and the step (ranks out of step raise instead of mixing steps). When any rank raises the flag, every rank learns it from the same collective,
renegotiates and repeats the MAX pack; in steady state no extra collective is issued. Absent
names are filled with the identity of their reduction (0 value and 0 weight for sum/mean, the
lowest key for max, a cleared mask for all), so a missing metric never hangs nor mixes values.

This module knows tensors and process groups, not what the metrics mean.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["Sample", "Reduced", "Reducer", "REDUCE_KINDS", "PerRank", "check_reduce"]

REDUCE_KINDS = ("sum", "mean", "max", "min", "minmax", "all")
Number = Union[int, float, torch.Tensor]

_INT64_MIN = -(2**63)
_LOW32 = 2**32 - 1


def check_reduce(name: str, reduce: str) -> None:
    """Raise a clear error for an unknown reduce kind (before any collective)."""
    if reduce not in REDUCE_KINDS:
        raise ValueError(f"metric {name!r}: reduce={reduce!r} is not one of {', '.join(REDUCE_KINDS)}")


@dataclass
class Sample:
    """One rank's value of one metric and how it combines across ranks.

    For ``mean``, the cross-rank result is Σ value·weight / Σ weight; a rank with weight 0
    has nothing to contribute (e.g. a pipeline stage without the loss). When ``summed`` is
    true, ``value`` is already Σ value·weight over the interval (the accumulator's form).
    """

    name: str
    value: Number
    reduce: str = "mean"
    weight: Number = 1.0
    summed: bool = False
    low: Optional[Number] = None
    """For ``minmax``: the value for the min lane when it differs (an interval's minimum)."""

    def __post_init__(self) -> None:
        check_reduce(self.name, self.reduce)


class PerRank(list):
    """Every rank's value of an ``all`` metric, indexed by rank; ``None`` where a rank had none."""

    def present(self) -> list[float]:
        return [v for v in self if v is not None]


@dataclass
class Reduced:
    """The result of one reduction, identical on every rank."""

    values: dict[str, float] = field(default_factory=dict)
    """``sum`` and ``mean`` results."""
    maxima: dict[str, tuple[float, int]] = field(default_factory=dict)
    """``max``/``minmax`` results: (value, global rank holding it)."""
    minima: dict[str, tuple[float, int]] = field(default_factory=dict)
    """``min``/``minmax`` results: (value, global rank holding it)."""
    per_rank: dict[str, PerRank] = field(default_factory=dict)
    """``all`` results."""
    kinds: dict[str, str] = field(default_factory=dict)
    """The reduce kind of every name in the agreed layout."""

    def to_metrics(self) -> dict[str, Any]:
        """Flat names: ``x`` for sum/mean/max/min, ``x/max``/``x/min`` for minmax, ranks beside."""
        out: dict[str, Any] = {}
        for name, kind in self.kinds.items():
            if kind in ("sum", "mean") and name in self.values:
                out[name] = self.values[name]
            elif kind == "max" and name in self.maxima:
                out[name], out[f"{name}/max_rank"] = self.maxima[name]
            elif kind == "min" and name in self.minima:
                out[name], out[f"{name}/min_rank"] = self.minima[name]
            elif kind == "minmax" and name in self.maxima:
                out[f"{name}/max"], out[f"{name}/max_rank"] = self.maxima[name]
                out[f"{name}/min"], out[f"{name}/min_rank"] = self.minima[name]
            elif kind == "all" and name in self.per_rank:
                out[name] = self.per_rank[name]
        return out


@dataclass
class _Layout:
    entries: list[tuple[str, str]]  # sorted (name, reduce)
    sum_index: dict[str, int] = field(default_factory=dict)
    max_index: dict[str, int] = field(default_factory=dict)
    all_index: dict[str, int] = field(default_factory=dict)
    n_sum: int = 0
    n_max: int = 0
    n_all: int = 0
    digest: int = 0

    def __post_init__(self) -> None:
        for name, kind in self.entries:
            if kind in ("sum", "mean"):
                self.sum_index[name] = self.n_sum
                self.n_sum += 2 if kind == "mean" else 1
            elif kind in ("max", "min", "minmax"):
                self.max_index[name] = self.n_max
                self.n_max += 2 if kind == "minmax" else 1
            else:
                self.all_index[name] = self.n_all
                self.n_all += 1
        text = "\n".join(f"{n}\t{k}" for n, k in self.entries).encode()
        self.digest = int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


class Reducer:
    """Reduces lists of samples across a process group with ≤ 1 collective per kind.

    ``group`` is the process group (default: the world); with no initialised process group
    the reduction is local. ``collectives`` counts the collectives issued (tests and benchmarks
    read it).
    """

    def __init__(self, group: Optional[Any] = None, device: Optional[torch.device] = None) -> None:
        self.group = group
        self._device = device
        self._layout: Optional[_Layout] = None
        self._kinds: dict[str, str] = {}
        self.collectives = 0
        self.negotiations = 0

    # --- public --------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    @property
    def device(self) -> torch.device:
        """Where packs live: CUDA for NCCL, else CPU."""
        if self._device is None:
            backend = str(dist.get_backend(self.group)).lower() if self.distributed else "gloo"
            if "nccl" in backend and torch.cuda.is_available():
                self._device = torch.device("cuda", torch.cuda.current_device())
            else:
                self._device = torch.device("cpu")
        return self._device

    def reduce(self, samples: Sequence[Sample], tag: int = 0) -> Reduced:
        """Reduce this rank's samples with every other rank's; all ranks must call it together.

        ``tag`` (the step number) must be equal on every rank: it travels in the MAX pack's
        control lanes, and a mismatch (ranks out of step) raises on every rank instead of
        mixing values of different steps.
        """
        local = self._check(samples)
        if not self.distributed:
            return self._reduce_local(local)
        if self._layout is None:
            self._negotiate(local)
        max_lanes = self._all_reduce_max(local, tag)
        if max_lanes is None:  # some rank holds a name the cached layout lacks
            self._negotiate(local)
            max_lanes = self._all_reduce_max(local, tag)
            assert max_lanes is not None
        result = Reduced(kinds=dict(self._layout.entries))
        self._decode_max(max_lanes, result)
        self._all_reduce_sum(local, result)
        self._all_gather(local, result)
        return result

    # --- checks --------------------------------------------------------------------------
    def _check(self, samples: Sequence[Sample]) -> dict[str, Sample]:
        local: dict[str, Sample] = {}
        for s in samples:
            if not isinstance(s, Sample):
                raise TypeError(f"expected Sample, got {type(s).__name__}: {s!r}")
            known = self._kinds.get(s.name)
            if known is not None and known != s.reduce:
                raise ValueError(
                    f"metric {s.name!r} was reduced as {known!r} before and now as {s.reduce!r}; "
                    "a name keeps one reduce kind for the whole run"
                )
            if s.name in local:
                raise ValueError(f"metric {s.name!r} appears twice in one reduction")
            local[s.name] = s
        for name, s in local.items():
            self._kinds[name] = s.reduce
        return local

    # --- local (no process group) --------------------------------------------------------
    def _reduce_local(self, local: dict[str, Sample]) -> Reduced:
        result = Reduced(kinds={name: s.reduce for name, s in local.items()})
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        for name, s in local.items():
            if s.reduce == "sum":
                result.values[name] = _to_float(s.value)
            elif s.reduce == "mean":
                num, den = _mean_parts(s)
                num, den = _to_float(num), _to_float(den)
                if den != 0:
                    result.values[name] = num / den
            elif s.reduce == "all":
                result.per_rank[name] = PerRank([_to_float(s.value)])
            else:
                high = _round_f32(_to_float(s.value))
                low = high if s.low is None else _round_f32(_to_float(s.low))
                if s.reduce in ("max", "minmax"):
                    result.maxima[name] = (high, rank)
                if s.reduce in ("min", "minmax"):
                    result.minima[name] = (low, rank)
        return result

    # --- negotiation ---------------------------------------------------------------------
    def _negotiate(self, local: dict[str, Sample]) -> None:
        mine = sorted((name, s.reduce) for name, s in local.items())
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        self.collectives += 1
        self.negotiations += 1
        union: dict[str, str] = {}
        for rank_entries in gathered:
            for name, kind in rank_entries:
                if union.setdefault(name, kind) != kind:
                    # Every rank sees the same gathered lists, so every rank raises: no hang.
                    raise ValueError(
                        f"metric {name!r} is reduced as {union[name]!r} on one rank and {kind!r} "
                        "on another; every rank must use the same reduce kind for a name"
                    )
        self._layout = _Layout(sorted(union.items()))

    # --- MAX pack (+ control lanes) -----------------------------------------------------
    def _all_reduce_max(self, local: dict[str, Sample], tag: int = 0) -> Optional[torch.Tensor]:
        layout = self._layout
        assert layout is not None
        rank = dist.get_rank()
        stale = not _subset(local, layout)
        device = self.device
        control = torch.tensor([int(stale), layout.digest, -layout.digest, tag, -tag], dtype=torch.int64).to(device)
        names, values, negate = [], [], []
        for name, s in local.items():
            if s.reduce in ("max", "minmax", "min") and name in layout.max_index:
                base = layout.max_index[name]
                if s.reduce in ("max", "minmax"):
                    names.append(base); values.append(s.value); negate.append(False)
                if s.reduce in ("min", "minmax"):
                    names.append(base + (1 if s.reduce == "minmax" else 0))
                    values.append(s.value if s.low is None else s.low); negate.append(True)
        lanes = torch.full((layout.n_max,), _INT64_MIN, dtype=torch.int64, device=device)
        if names:
            v = _stack(values, torch.float32, device)
            sign = torch.tensor([-1.0 if n else 1.0 for n in negate], dtype=torch.float32).to(device)
            lanes[torch.tensor(names, device=device)] = _encode(v * sign, rank)
        pack = torch.cat([control, lanes])
        dist.all_reduce(pack, op=dist.ReduceOp.MAX, group=self.group)
        self.collectives += 1
        pack = pack.cpu()
        if int(pack[0]) != 0:
            return None
        if int(pack[1]) != layout.digest or int(pack[2]) != -layout.digest:
            raise RuntimeError(
                "distmetrics: ranks reduced with different metric layouts; this is a bug, "
                "please report it with the metric names in use"
            )
        if int(pack[3]) != tag or int(pack[4]) != -tag:
            raise RuntimeError(
                f"distmetrics: ranks are out of step: this reduction was called at steps "
                f"{-int(pack[4])}..{int(pack[3])} on different ranks; every rank must call "
                "monitor.step with the same step numbers"
            )
        return pack[5:]

    def _decode_max(self, lanes: torch.Tensor, result: Reduced) -> None:
        layout = self._layout
        assert layout is not None
        values, ranks, present = _decode(lanes)
        for name, kind in layout.entries:
            if name not in layout.max_index:
                continue
            base = layout.max_index[name]
            if kind in ("max", "minmax") and present[base]:
                result.maxima[name] = (values[base], ranks[base])
            low = base + 1 if kind == "minmax" else base
            if kind in ("min", "minmax") and present[low]:
                result.minima[name] = (-values[low] if not math.isnan(values[low]) else values[low], ranks[low])

    # --- SUM pack ------------------------------------------------------------------------
    def _all_reduce_sum(self, local: dict[str, Sample], result: Reduced) -> None:
        layout = self._layout
        assert layout is not None
        if layout.n_sum == 0:
            return
        index, values = [], []
        for name, s in local.items():
            if s.reduce == "sum":
                index.append(layout.sum_index[name]); values.append(s.value)
            elif s.reduce == "mean":
                num, den = _mean_parts(s)
                base = layout.sum_index[name]
                index += [base, base + 1]; values += [num, den]
        pack = torch.zeros(layout.n_sum, dtype=torch.float64, device=self.device)
        if index:
            pack[torch.tensor(index, device=self.device)] = _stack(values, torch.float64, self.device)
        dist.all_reduce(pack, op=dist.ReduceOp.SUM, group=self.group)
        self.collectives += 1
        totals = pack.cpu().tolist()
        for name, kind in layout.entries:
            if name not in layout.sum_index:
                continue
            base = layout.sum_index[name]
            if kind == "sum":
                result.values[name] = totals[base]
            elif totals[base + 1] != 0:
                result.values[name] = totals[base] / totals[base + 1]

    # --- ALL pack ------------------------------------------------------------------------
    def _all_gather(self, local: dict[str, Sample], result: Reduced) -> None:
        layout = self._layout
        assert layout is not None
        n = layout.n_all
        if n == 0:
            return
        row = torch.zeros(2 * n, dtype=torch.float64, device=self.device)
        index, values = [], []
        for name, s in local.items():
            if s.reduce == "all":
                index.append(layout.all_index[name]); values.append(s.value)
        if index:
            idx = torch.tensor(index, device=self.device)
            row[idx] = _stack(values, torch.float64, self.device)
            row[idx + n] = 1.0
        world = dist.get_world_size(self.group)
        out = torch.empty(world * 2 * n, dtype=torch.float64, device=self.device)
        _gather_single()(out, row, group=self.group)
        self.collectives += 1
        table = out.view(world, 2 * n).cpu()
        global_ranks = _global_ranks(self.group, world)
        vals, mask = table[:, :n].tolist(), table[:, n:].tolist()
        for name, idx in layout.all_index.items():
            per = PerRank([None] * dist.get_world_size())
            seen = False
            for r in range(world):
                if mask[r][idx] > 0:
                    per[global_ranks[r]] = vals[r][idx]
                    seen = True
            if seen:
                result.per_rank[name] = per


# --- helpers ------------------------------------------------------------------------------

def _subset(local: dict[str, Sample], layout: _Layout) -> bool:
    kinds = dict(layout.entries)
    return all(kinds.get(name) == s.reduce for name, s in local.items())


def _mean_parts(s: Sample) -> tuple[Number, Number]:
    if s.summed:
        return s.value, s.weight
    return s.value * s.weight, s.weight


def _to_float(v: Number) -> float:
    return float(v.detach().reshape(()).item()) if isinstance(v, torch.Tensor) else float(v)


def _round_f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _stack(values: list[Number], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values (numbers and 0-d tensors on any device) → one tensor on ``device``; tensors are
    stacked where they live and moved once, so device values never round-trip through the host
    when the pack lives on the same device (NCCL)."""
    out = torch.empty(len(values), dtype=dtype, device=device)
    numbers = [(i, float(v)) for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    if numbers:
        index = torch.tensor([i for i, _ in numbers], device=device)
        out[index] = torch.tensor([v for _, v in numbers], dtype=dtype).to(device)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for _, idx in by_device.items():
        stacked = torch.stack([values[i].detach().reshape(()).to(dtype) for i in idx])
        out[torch.tensor(idx, device=device)] = stacked.to(device)
    return out


def _encode(values: torch.Tensor, rank: int) -> torch.Tensor:
    """float32 values → int64 keys ordered like the floats, with the rank in the low bits."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(torch.isnan(values), torch.full_like(bits, 0x7FFFFFFF), bits)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key * (2**32) + (_LOW32 - rank)


def _decode(lanes: torch.Tensor) -> tuple[list[float], list[int], list[bool]]:
    present = (lanes != _INT64_MIN).tolist()
    key = lanes >> 32
    ranks = (_LOW32 - (lanes & _LOW32)).tolist()
    bits = torch.where(key >= 0, key, key ^ 0x7FFFFFFF).to(torch.int32)
    values = bits.view(torch.float32).tolist()
    return values, ranks, present


def _gather_single():
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; same collective.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _global_ranks(group: Any, world: int) -> list[int]:
    if group is None:
        return list(range(world))
    return [dist.get_global_rank(group, r) for r in range(world)]
