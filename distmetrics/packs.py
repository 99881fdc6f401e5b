"""Building each of a rank's packs from its samples (see :mod:`distmetrics.reduce`): as a Python
list where every value is on the host (a few list operations cost less than the tensor
operations' dispatch), else as tensors where the values live (a GPU's values), with one copy
per pack. Both give the same lanes; the reducer issues the collectives.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .maxkeys import INT64_MIN, encode_key, encode_keys
from .names import EXACT_KINDS
from .packing import (CONTROL_LANES, PackLayout, Pieces, host_number, host_values, masked, masked_host, mean_parts,
                      tuple_getter, weighted, weighted_host)

__all__ = ["max_lanes_on_host", "max_pack", "sum_lanes_on_host", "interleave", "sum_pack_tensor", "all_row_on_host",
           "all_row_tensor"]


def max_pack(layout: PackLayout, samples: list, tag: int, stale: bool, rank: int, device: torch.device,
             call: int = 0, steps: int = 0) -> torch.Tensor:
    """Control lanes, then every max/min lane's key; numbers are keyed on the host and written
    with the control lanes in one index, tensors keyed where they live. ``stale``: every rank
    renegotiates and sends the pack again, so only the control lanes matter. ``call``: see
    :meth:`PackLayout.mark`."""
    pack = torch.full((CONTROL_LANES + layout.n_max,), INT64_MIN, dtype=torch.int64, device=device)
    keys, positions = control_lanes(layout, tag, stale, call, steps), list(range(CONTROL_LANES))
    pieces = Pieces(layout, device, torch.float32)
    for s in samples if not stale else ():
        if s.reduce in EXACT_KINDS:
            keys.append(s.value if s.reduce == "imax" else -s.value)
            positions.append(CONTROL_LANES + layout.max_index[s.name])
            continue
        if s.reduce not in ("max", "min", "minmax"):
            continue
        low = s.value if s.low is None else s.low
        second = CONTROL_LANES + (1 if s.reduce == "minmax" else 0)
        lanes = [(CONTROL_LANES, s.value, False)] if s.reduce != "min" else []
        lanes += [(second, low, True)] if s.reduce != "max" else []
        for offset, value, negate in lanes:
            if s.names is not None:
                pieces.add_vector(layout.positions(s.names, s.reduce, offset, device), value, negate=negate)
                continue
            number = host_number(value)
            if number is None:
                pieces.add_scalar(layout.max_index[s.name] + offset, value, negate=negate)
            else:
                keys.append(encode_key(-number if negate else number, rank))
                positions.append(layout.max_index[s.name] + offset)
    at = layout.cached_index(("keys", tuple(positions), device),
                             lambda: torch.tensor(positions, dtype=torch.long).to(device))
    pack[at] = torch.tensor(keys, dtype=torch.int64).to(device)
    index, values = pieces.assemble()
    if index is not None:
        pack[index] = encode_keys(values, rank)
    return pack


def control_lanes(layout: PackLayout, tag: int, stale: bool, call: int, steps: int = 0) -> list[int]:
    """The MAX pack's first lanes: stale, the layout's mark (and its negation), the step (and its
    negation), the monitor.step calls of the interval (and their negation): after the MAX
    all-reduce every rank holds the same and the maximum of each and of its negation differ when
    ranks differ."""
    mark = layout.mark(call)
    return [int(stale), mark, -mark, tag, -tag, steps, -steps]


def max_lanes_on_host(layout: PackLayout, samples: list, tag: int, stale: bool, rank: int,
                      call: int = 0, steps: int = 0) -> Optional[list[int]]:
    """:func:`max_pack` as a list of int64 keys when every max/min value is a number on the host
    (None: a vector or a value on a device)."""
    lanes = control_lanes(layout, tag, stale, call, steps) + [INT64_MIN] * layout.n_max
    for s in samples if not stale else ():
        if s.reduce in EXACT_KINDS:
            lanes[CONTROL_LANES + layout.max_index[s.name]] = s.value if s.reduce == "imax" else -s.value
            continue
        if s.reduce not in ("max", "min", "minmax"):
            continue
        if s.names is not None:
            return None
        base = CONTROL_LANES + layout.max_index[s.name]
        if s.reduce != "min":
            value = host_number(s.value)
            if value is None:
                return None
            lanes[base] = encode_key(value, rank)
        if s.reduce != "max":
            low = host_number(s.value if s.low is None else s.low)
            if low is None:
                return None
            lanes[base + (1 if s.reduce == "minmax" else 0)] = encode_key(-low, rank)
    return lanes


def sum_lanes_on_host(layout: PackLayout, samples: list) -> Optional[tuple[Sequence[float], Sequence[float]]]:
    """The SUM pack's two lanes per name, value·weight and weight, as two sequences in the
    layout's order, when every value is on the host (None: some value is on a device). The
    samples' lanes are listed in their own order, then put in the layout's order by one gather
    (:func:`_sum_gather`, cached per set of samples): no Python step per element. A collective
    takes them interleaved (:func:`interleave`)."""
    values: list[float] = []
    weights: list[float] = []
    signature = []
    for s in samples:
        if s.reduce not in ("sum", "mean"):
            continue
        if s.names is None:
            value, weight = host_number(s.value), host_number(s.weight)
            if value is None or weight is None:
                return None
            value, weight = _mean_lanes(s, value, weight)
            values.append(value)
            weights.append(weight)
            signature.append(s.name)
            continue
        n = len(s.names)
        vector = host_values(s.value, n)
        weight = host_values(s.weight, n) if s.reduce == "mean" else [1.0] * n
        if vector is None or weight is None:
            return None
        values.extend(vector if s.reduce == "sum" else masked_host(vector, weight) if s.summed
                      else weighted_host(vector, weight))
        weights.extend(weight)
        signature.append(s.names)
    values.append(0.0)  # the lanes of a name no sample holds
    weights.append(0.0)
    key = ("sum-gather", tuple(entry if type(entry) is str else id(entry) for entry in signature))
    made, gather = layout.cached_index(key, lambda: (signature, _sum_gather(layout, signature)))
    if made != signature:  # the same tuples (compared by identity first), or equal ones; else an id reused
        made, gather = layout.cached_index(key, lambda: (signature, _sum_gather(layout, signature)), renew=True)
    return gather(values), gather(weights)


def interleave(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The SUM pack as one list: value·weight and weight of each name, side by side."""
    lanes = [0.0] * (2 * len(values))
    lanes[0::2], lanes[1::2] = values, weights
    return lanes


def _sum_gather(layout: PackLayout, signature: list) -> Any:
    """A function taking the samples' lanes in their order (a name or a vector's names each, as
    in ``signature``; then the empty lane) to the layout's order of sum and mean names."""
    empty = sum(1 if isinstance(entry, str) else len(entry) for entry in signature)
    source = [empty] * len(layout.sum_index)
    slot = 0
    for entry in signature:
        for name in (entry,) if isinstance(entry, str) else entry:
            source[layout.sum_index[name] // 2] = slot
            slot += 1
    return tuple_getter(source)


def sum_pack_tensor(layout: PackLayout, samples: list, device: torch.device) -> torch.Tensor:
    """The SUM pack as a float64 tensor on ``device``."""
    pieces = Pieces(layout, device, torch.float64)
    for s in samples:
        if s.reduce not in ("sum", "mean"):
            continue
        num, den = mean_parts(s)
        if s.names is None:
            base = layout.sum_index[s.name]
            pieces.add_scalar(base, num)
            pieces.add_scalar(base + 1, den)
        else:
            pieces.add_vector(layout.positions(s.names, s.reduce, 0, device), num)
            pieces.add_vector(layout.positions(s.names, s.reduce, 1, device), den)
    pack = torch.zeros(layout.n_sum, dtype=torch.float64, device=device)
    index, values = pieces.assemble()
    if index is not None:
        pack[index] = values
    return pack


def all_row_on_host(layout: PackLayout, samples: list) -> Optional[list[float]]:
    """This rank's ALL row (values, then a presence mask) as a list when every value is on the
    host (None: some value is on a device)."""
    n = layout.n_all
    row = [0.0] * (2 * n)
    for s in samples:
        if s.reduce != "all":
            continue
        if s.names is None:
            value = host_number(s.value)
            if value is None:
                return None
            row[layout.all_index[s.name]], row[layout.all_index[s.name] + n] = value, 1.0
            continue
        values = host_values(s.value, len(s.names))
        if values is None:
            return None
        for base, value in zip(layout.host_positions(s.names, s.reduce), values):
            row[base], row[base + n] = value, 1.0
    return row


def all_row_tensor(layout: PackLayout, samples: list, device: torch.device) -> torch.Tensor:
    """This rank's ALL row as a float64 tensor on ``device``."""
    n = layout.n_all
    pieces = Pieces(layout, device, torch.float64)
    for s in samples:
        if s.reduce != "all":
            continue
        if s.names is None:
            pieces.add_scalar(layout.all_index[s.name], s.value)
            pieces.add_scalar(layout.all_index[s.name] + n, 1.0)
        else:
            pieces.add_vector(layout.positions(s.names, s.reduce, 0, device), s.value)
            pieces.add_vector(layout.positions(s.names, s.reduce, n, device), 1.0)
    row = torch.zeros(2 * n, dtype=torch.float64, device=device)
    index, values = pieces.assemble()
    if index is not None:
        row[index] = values
    return row


def _mean_lanes(s: Any, value: float, weight: float) -> tuple[float, float]:
    """The two SUM-pack lanes of a sum or mean value (as :func:`~distmetrics.packing.mean_parts`)."""
    if s.reduce == "sum":
        return value, 1.0
    return (masked(value, weight), weight) if s.summed else (weighted(value, weight), weight)
