"""The MAX pack's lanes: order-preserving int64 keys, a float32 value in the high 32 bits and
the rank in the low 32, so that one ``all_reduce(MAX)`` yields each extreme *and* the rank
holding it (a minimum is the maximum of ``-v``; NaN is the largest key, so it wins both).
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any, Union

import torch

if TYPE_CHECKING:
    from .packing import PackLayout

__all__ = ["encode_keys", "encode_key", "decode_max", "INT64_MIN", "HOST_DECODE_LANES"]

INT64_MIN = -(2**63)
"""The empty MAX lane (no rank sent the name)."""
HOST_DECODE_LANES = 256
"""MAX packs up to this many lanes are decoded in Python, larger ones with tensor operations."""
_LOW32 = 2**32 - 1
_FLOAT32, _INT32 = struct.Struct("<f"), struct.Struct("<i")


def decode_max(layout: PackLayout, lanes: Union[torch.Tensor, list[int]], result: Any) -> None:
    """MAX-pack lanes (a tensor, or a list of keys) → ``result.maxima``/``minima`` as (value, rank);
    an ``imax``/``imin`` lane's int as (int, None)."""
    if not isinstance(lanes, list):
        lanes = lanes.cpu()
        if layout.n_max <= HOST_DECODE_LANES:
            lanes = lanes.tolist()
    values, ranks, present = _decode_keys_on_host(lanes) if isinstance(lanes, list) else _decode_keys(lanes)
    for name, base in layout.max_index.items():
        kind = layout.kinds[name]
        if kind in ("imax", "imin"):  # the int itself (names.EXACT_KINDS)
            if present[base]:
                exact = int(lanes[base])
                (result.maxima if kind == "imax" else result.minima)[name] = (exact if kind == "imax" else -exact, None)
            continue
        if kind != "min" and present[base]:
            result.maxima[name] = (values[base], ranks[base])
        low = base + 1 if kind == "minmax" else base
        if kind != "max" and present[low]:
            result.minima[name] = (-values[low] if not math.isnan(values[low]) else values[low], ranks[low])


def encode_keys(values: torch.Tensor, rank: int) -> torch.Tensor:
    """float32 values → int64 keys ordered like the floats, with the rank in the low bits."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(torch.isnan(values), torch.full_like(bits, 0x7FFFFFFF), bits)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key * (2**32) + (_LOW32 - rank)


def _decode_keys(lanes: torch.Tensor) -> tuple[list[float], list[int], list[bool]]:
    present = (lanes != INT64_MIN).tolist()
    key = lanes >> 32
    ranks = (_LOW32 - (lanes & _LOW32)).tolist()
    bits = torch.where(key >= 0, key, key ^ 0x7FFFFFFF).to(torch.int32)
    values = bits.view(torch.float32).tolist()
    return values, ranks, present


def encode_key(value: float, rank: int) -> int:
    """:func:`encode_keys` of one number, on the host (no tensor): the same int64 key."""
    if value != value:
        bits = 0x7FFFFFFF
    else:
        try:
            bits = _INT32.unpack(_FLOAT32.pack(value))[0]
        except OverflowError:  # beyond float32's range: the cast gives ±inf
            bits = _INT32.unpack(_FLOAT32.pack(math.copysign(math.inf, value)))[0]
    key = bits if bits >= 0 else bits ^ 0x7FFFFFFF
    return key * (2**32) + (_LOW32 - rank)


def _decode_keys_on_host(lanes: list[int]) -> tuple[list[float], list[int], list[bool]]:
    """:func:`_decode_keys` of a few lanes in Python (cheaper than a dozen tensor operations)."""
    values, ranks, present = [], [], []
    for lane in lanes:
        key = lane >> 32
        bits = key if key >= 0 else key ^ 0x7FFFFFFF
        values.append(_FLOAT32.unpack(_INT32.pack(bits))[0])
        ranks.append(_LOW32 - (lane & _LOW32))
        present.append(lane != INT64_MIN)
    return values, ranks, present
