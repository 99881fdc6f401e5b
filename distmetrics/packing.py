"""How values sit in the reducer's packs: the agreed layout of names and the assembly of one
pack from scalar and vector samples with one index tensor and one value tensor. The MAX pack's
order-preserving keys are in :mod:`distmetrics.maxkeys`.

:mod:`distmetrics.reduce` issues the collectives; this module only names the gather function
and maps a group's ranks to global ranks for it.
"""

from __future__ import annotations

import hashlib
import json
import operator
import zlib
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["PackLayout", "Pieces", "entries_of", "encode_entries", "decode_entries", "digest",
           "value_device", "mean_parts", "decode_sum", "decode_all", "host_number", "host_values", "tuple_getter",
           "gather_single", "global_rank", "CONTROL_LANES"]

Number = Union[int, float, torch.Tensor]
CONTROL_LANES = 7
"""MAX-pack lanes before the values: stale flag, digest, -digest, step, -step, steps in the
interval, -steps in the interval."""


_METRIC_KEYS = {  # reduce kind → the keys ``Reduced.to_metrics`` writes for a name
    "sum": lambda n: (n,), "mean": lambda n: (n,), "max": lambda n: (n, f"{n}/max_rank"),
    "min": lambda n: (n, f"{n}/min_rank"),
    "minmax": lambda n: (f"{n}/max", f"{n}/max_rank", f"{n}/min", f"{n}/min_rank"),
    "all": lambda n: (n, f"{n}/max", f"{n}/min", f"{n}/mean"), "imax": lambda n: (n,), "imin": lambda n: (n,),
}


class PackLayout:
    """Where every agreed name sits in the three packs (identical on every rank)."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        self.entries = sorted(entries)
        self.kinds = dict(self.entries)
        self.sum_index: dict[str, int] = {}  # two lanes each: value·weight, weight
        self.max_index: dict[str, int] = {}  # one lane (two for minmax)
        self.all_index: dict[str, int] = {}
        self.n_sum = self.n_max = self.n_all = 0
        for name, kind in self.entries:
            if kind in ("sum", "mean"):
                self.sum_index[name] = self.n_sum
                self.n_sum += 2
            elif kind in ("max", "min", "minmax", "imax", "imin"):
                self.max_index[name] = self.n_max
                self.n_max += 2 if kind == "minmax" else 1
            else:
                self.all_index[name] = self.n_all
                self.n_all += 1
        self.digest = digest(encode_entries(self.entries))
        self._vectors: dict[tuple, dict] = {}  # (id(names), reduce) → the names, positions per (offset, device)
        self._indexes: dict[tuple, Any] = {}  # a pack's pieces → (their position tensors, index); sum gathers
        self._metric_keys: dict[tuple, tuple] = {}  # prefixes → the metric keys under them
        self._constants: dict[tuple, torch.Tensor] = {}  # (n, value, dtype, device) → a constant vector
        self.sum_names = list(self.sum_index)  # lane 2i holds value·weight of sum_names[i], 2i+1 its weight
        self.sum_flags = [self.kinds[name] == "sum" for name in self.sum_names]
        self.mean_lanes = [i for i, is_sum in enumerate(self.sum_flags) if not is_sum]
        self.sum_lanes = [i for i, is_sum in enumerate(self.sum_flags) if is_sum]

    def mark(self, call: int) -> int:
        """The MAX pack's digest lanes: the layout's digest with a code of the monitor call folded in
        (ranks in different layouts or different calls disagree there)."""
        return self.digest ^ call

    def vector_base(self, names: tuple, reduce: str) -> Optional[dict]:
        """Cached pack positions of a vector's names (None: not all of them are in this layout
        with this reduce kind)."""
        key = (id(names), reduce)  # collectors pass the same tuple: no hash of every name each time
        cached = self._vectors.get(key)
        if cached is None or cached["names"] is not names:
            if any(self.kinds.get(name) != reduce for name in names):
                return None
            if len(self._vectors) >= 256:  # tuples made anew at each log step: keep a few
                self._vectors.clear()
            table = {"sum": self.sum_index, "mean": self.sum_index, "all": self.all_index}.get(reduce, self.max_index)
            bases = [table[name] for name in names]
            cached = self._vectors[key] = {"names": names, "host": bases,
                                           (0, None): torch.tensor(bases, dtype=torch.long)}
        return cached

    def host_positions(self, names: tuple, reduce: str) -> list[int]:
        """The pack positions of a vector's elements as a list (cached)."""
        return self.vector_base(names, reduce)["host"]

    def metric_keys(self, prefixes: tuple) -> tuple:
        """Every metric key the reduction can write for these names (``to_metrics``) that starts
        with one of ``prefixes``, in name order; cached per ``prefixes``."""
        keys = self._metric_keys.get(prefixes)
        if keys is None:
            keys = self._metric_keys[prefixes] = tuple(
                key for name, kind in self.entries for key in _METRIC_KEYS[kind](name) if key.startswith(prefixes))
        return keys

    def cached_index(self, key: tuple, build: Any, renew: bool = False) -> Any:
        """The index of one pack's pieces (``key``: what decides it), built once by ``build()``
        (again with ``renew``)."""
        index = self._indexes.get(key)
        if index is None or renew:
            if len(self._indexes) >= 64:  # what a run sends rarely varies; keep a few sets
                self._indexes.clear()
            index = self._indexes[key] = build()
        return index

    def constant(self, n: int, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``n`` copies of ``value`` (a vector's weights), cached: never written to."""
        key = (n, value, dtype, device)
        cached = self._constants.get(key)
        if cached is None:
            if len(self._constants) >= 64:
                self._constants.clear()
            cached = self._constants[key] = torch.full((n,), value, dtype=dtype, device=device)
        return cached

    def positions(self, names: tuple, reduce: str, offset: int, device: torch.device) -> torch.Tensor:
        """The pack positions of a vector's elements plus ``offset`` (the second lane of a mean or
        minmax, the mask half of the ALL pack), as an index tensor on ``device``."""
        cache = self.vector_base(names, reduce)
        if (offset, device) not in cache:
            cache[(offset, device)] = (cache[(0, None)] + offset).to(device)
        return cache[(offset, device)]


class Pieces:
    """Positions and values of one pack, gathered from scalars and vectors, assembled into one
    index tensor and one value tensor on the pack's device. Tensors are moved once per pack and
    device; numbers (and 0-d CPU tensors, read on the host: there is no device to wait for) go
    in as one tensor. The index of a log step's pieces and the constant vectors (weights of 1)
    are cached in the layout: log steps repeat them."""

    def __init__(self, layout: PackLayout, device: torch.device, dtype: torch.dtype) -> None:
        self.layout, self.device, self.dtype = layout, device, dtype
        self.number_index: list[int] = []
        self.numbers: list[float] = []
        self.tensor_index: list[int] = []
        self.tensors: list[torch.Tensor] = []
        self.vector_index: list[torch.Tensor] = []
        self.vectors: list[torch.Tensor] = []

    def add_scalar(self, position: int, value: Number, negate: bool = False) -> None:
        """One value (a number or a 0-d tensor) at ``position``."""
        number = host_number(value)
        if number is None:
            self.tensor_index.append(position)  # negated in the pack's dtype: a bool or an int is a number first
            self.tensors.append(-value.detach().to(self.dtype) if negate else value)
        else:
            self.number_index.append(position)
            self.numbers.append(-number if negate else number)

    def add_vector(self, positions: torch.Tensor, values: Number, negate: bool = False) -> None:
        """A tensor of values (or one number for all) at ``positions``."""
        if not isinstance(values, torch.Tensor):
            values = self.layout.constant(positions.numel(), -float(values) if negate else float(values),
                                          self.dtype, self.device)
        else:
            values = values.detach().to(device=self.device, dtype=self.dtype)
            values = -values if negate else values
        self.vector_index.append(positions)
        self.vectors.append(values)

    def assemble(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(index, values) of everything added, on the pack's device; (None, None) if nothing."""
        values = list(self.vectors)
        order: list[int] = []
        if self.numbers:
            values.append(torch.tensor(self.numbers, dtype=self.dtype, device=self.device))
        if self.tensors:
            order, stacked = _stack(self.tensors, self.dtype, self.device)
            values.append(stacked)
        if not values:
            return None, None
        key = (tuple(id(p) for p in self.vector_index), tuple(self.number_index),
               tuple(self.tensor_index[i] for i in order), self.device)
        build = lambda: (tuple(self.vector_index), self._index(key))  # noqa: E731
        # The entry keeps its position tensors: while it exists, no other tensor can take their ids.
        made, index = self.layout.cached_index(key, build)
        if len(made) != len(self.vector_index) or not all(map(operator.is_, made, self.vector_index)):
            made, index = self.layout.cached_index(key, build, renew=True)  # an id of another tensor: build anew
        return index, values[0] if len(values) == 1 else torch.cat(values)

    def _index(self, key: tuple) -> torch.Tensor:
        scalars = [torch.tensor(positions, dtype=torch.long).to(self.device) for positions in key[1:3] if positions]
        parts = self.vector_index + scalars
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def tuple_getter(positions: Sequence) -> Any:
    """``operator.itemgetter`` over ``positions`` that always gives a tuple (of one item, or of
    none), where itemgetter of one position gives the item itself."""
    if len(positions) == 1:
        return lambda items, at=positions[0]: (items[at],)
    return operator.itemgetter(*positions) if positions else (lambda items: ())


def host_number(value: Number) -> Optional[float]:
    """``value`` as a float when it is on the host (a number, a real 0-d CPU tensor: reading it
    waits for no device); None for a tensor on a device."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.is_cpu and not value.dtype.is_complex:
        return float(value)
    return None


def host_values(value: Number, n: int) -> Optional[list[float]]:
    """A vector's ``n`` values (a number for all, or a 1-D CPU tensor) as floats; None for a
    tensor on a device."""
    if not isinstance(value, torch.Tensor):
        return [float(value)] * n
    if value.is_cpu:
        dtype = value.dtype  # one read of the tensor: its dtype tells the rest
        # floating values are exact as Python floats; integers and bools become floats as the
        # tensor packs make them (float64: a count beyond 2**53 rounds alike)
        if dtype.is_floating_point:
            return value.tolist()
        if not dtype.is_complex:
            return value.to(torch.float64).tolist()
    return None


def entries_of(samples: list) -> list[tuple]:
    """(name, reduce) of every element of the samples, and its writer where a user's collector handed it
    over: (name, reduce, writer) — what ranks negotiate."""
    out: list[tuple] = []
    for s in samples:
        tail = (s.writer,) if s.writer else ()
        if s.names is None:
            out.append((s.name, s.reduce, *tail))
        else:
            out.extend((name, s.reduce, *tail) for name in s.names)
    return out


def encode_entries(entries: Sequence[tuple[str, str]]) -> bytes:
    """Sorted (name, reduce) pairs → the bytes ranks exchange while negotiating (compressed:
    module names repeat their prefixes)."""
    return zlib.compress(json.dumps([list(e) for e in entries]).encode(), 1) if entries else b""


def decode_entries(payload: bytes) -> list[tuple[str, str]]:
    """The inverse of :func:`encode_entries`."""
    return [tuple(e) for e in json.loads(zlib.decompress(payload))] if payload else []


def digest(payload: bytes) -> int:
    """A 56-bit digest of a name set (fits an int64 lane with its negation)."""
    return int.from_bytes(hashlib.blake2b(payload, digest_size=7).digest(), "little")


def value_device(samples: list) -> torch.device:
    """Where a single process builds its packs: the device of its first tensor value, so a
    GPU's values are copied to the host once per pack, not once per value."""
    for s in samples:
        if isinstance(s.value, torch.Tensor):
            return s.value.device
    return torch.device("cpu")


def weighted(value: Any, weight: Any) -> Any:
    """``value · weight``, and 0 where the weight is 0: a weight of 0 means no value (a step or a
    rank with no tokens, whose loss is a mean over nothing, NaN), so a NaN or Inf there counts for
    nothing, as the weight says, instead of making every rank's mean NaN (NaN · 0 is NaN). A
    tensor weight costs one ``where`` on its device, no sync; a 0-d weight on the host with a value
    on a device is read as the number it holds (nothing waits for that; a host tensor in the
    ``where`` would be copied to the device, which waits)."""
    if isinstance(weight, torch.Tensor):
        if not (weight.is_cpu and weight.dim() == 0 and isinstance(value, torch.Tensor) and not value.is_cpu):
            return torch.where(weight != 0, value * weight, 0.0)
        weight = float(weight)
    if weight == 0:
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0
    return value * weight


def masked(value: Any, weight: Any) -> Any:
    """``value``, and 0 where ``weight`` is 0 (a summed mean's Σ value·weight: as :func:`weighted`)."""
    if isinstance(weight, torch.Tensor) and not (weight.is_cpu and weight.dim() == 0):
        return torch.where(weight != 0, value, 0.0)  # on the weight's device: no sync
    if float(weight) != 0:  # a number, or a 0-d host tensor (read without waiting for a device)
        return value
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0


def masked_host(values: Sequence[float], weights: Sequence[float]) -> Sequence[float]:
    """:func:`masked` of each host number and its weight."""
    if 0 in weights:
        return [value if weight != 0 else 0.0 for value, weight in zip(values, weights)]
    return values


def weighted_host(values: Sequence[float], weights: Sequence[float]) -> Iterable[float]:
    """:func:`weighted` of each host number and its weight, in one C loop unless a weight is 0
    (a Python call per element costs about 5x the multiplication at hundreds of names)."""
    if 0 in weights:
        return [value * weight if weight != 0 else 0.0 for value, weight in zip(values, weights)]
    return map(operator.mul, values, weights)


def mean_parts(s: Any) -> tuple[Number, Number]:
    """The two SUM-pack lanes of a sum or mean sample: (value·weight, weight)."""
    if s.reduce == "sum":
        return s.value, 1.0
    if s.summed:  # Σ value·weight already: where the weight is 0 it holds nothing, NaN or not
        return masked(s.value, s.weight), s.weight
    value = s.value.to(torch.float64) if isinstance(s.value, torch.Tensor) else s.value  # the product in float64,
    weight = s.weight.to(torch.float64) if isinstance(s.weight, torch.Tensor) else s.weight  # as on the host
    return weighted(value, weight), s.weight


def _stack(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """0-d tensors on any device → (their order in the result, one tensor on ``device``): they
    are stacked where they live and moved once per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    parts = [torch.stack([tensors[i].detach().reshape(()).to(dtype) for i in idx]).to(device)  # no promotion
             for idx in by_device.values()]
    order = [i for idx in by_device.values() for i in idx]
    return order, parts[0] if len(parts) == 1 else torch.cat(parts)


def decode_sum(layout: PackLayout, totals: Sequence[float], weights: Sequence[float], result: Any) -> None:
    """SUM-pack totals (Σ value·weight) and weights, in the layout's order → ``result.values``
    (a name no rank sent, or only with weight 0, is absent) and ``result.sum_weights``."""
    result.sum_weights = weights
    if 0.0 in weights:  # some name is absent (or sent with weight 0 only)
        result.values = {name: total if is_sum else total / weight for name, total, weight, is_sum
                         in zip(layout.sum_names, totals, weights, layout.sum_flags) if weight != 0}
        return
    if len(layout.mean_lanes) > len(layout.sum_lanes):  # mostly means: one C loop, a sum's divisor 1
        divisors = list(weights)
        for i in layout.sum_lanes:
            divisors[i] = 1.0
        totals = map(operator.truediv, totals, divisors)
    elif layout.mean_lanes:
        totals = list(totals)
        for i in layout.mean_lanes:
            totals[i] /= weights[i]
    result.values = dict(zip(layout.sum_names, totals))


def decode_all(layout: PackLayout, rows: list[list[float]]) -> dict[str, list]:
    """Every rank's ALL row (values, then a presence mask; by group rank) → every rank's value by
    group rank (``None`` where a rank sent none), for the names some rank sent."""
    n = layout.n_all
    out = {}
    for name, idx in layout.all_index.items():
        per: list = [None] * len(rows)
        seen = False
        for r, row in enumerate(rows):
            if row[idx + n] > 0:
                per[r] = row[idx]
                seen = True
        if seen:
            out[name] = per
    return out


def gather_single():
    """``all_gather_into_tensor`` (named ``all_gather_single`` in newer torch)."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; same collective.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collective_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives run: the current CUDA device under NCCL, else the CPU."""
    distributed = dist.is_available() and dist.is_initialized()
    backend = str(dist.get_backend(group)).lower() if distributed else "gloo"
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group: Any, rank: int) -> int:
    """A group rank → the global rank."""
    return rank if group is None else dist.get_global_rank(group, rank)
