"""Per-tensor norms and in-place scaling of a list of tensors, per (device, dtype) group: the
tensor-level work of :mod:`distmetrics.grad_norm` (which owns, combines and all-reduces).
``torch._foreach_norm`` where the device has it; bf16/fp16 accumulate in float32, and p other
than 1, 2, ±inf, 0 in float64."""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch

__all__ = ["LOW_PRECISION", "groups_of", "per_tensor_norms", "held_nonfinite", "scale_"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""The dtypes whose norms (and update norms) are accumulated in float32."""
_FOREACH_DEVICES = ("cpu", "cuda", "xpu", "mtia")
_NATIVE_P = (1.0, 2.0, math.inf, -math.inf, 0.0)


def groups_of(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Positions of the tensors by (device, dtype)."""
    if tensors and tensors[0].is_cpu:  # on the host, no device object per tensor to make and compare
        dtypes = list(map(_DTYPE, tensors))
        if dtypes.count(dtypes[0]) == len(dtypes) and all(map(_IS_CPU, tensors)):
            return {(tensors[0].device, dtypes[0]): list(range(len(tensors)))}
    keys = list(zip(map(_DEVICE, tensors), map(_DTYPE, tensors)))
    if keys and keys.count(keys[0]) == len(keys):  # the usual case: one device, one dtype
        return {keys[0]: list(range(len(keys)))}
    out: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return out


_DEVICE, _DTYPE, _IS_CPU = operator.attrgetter("device"), operator.attrgetter("dtype"), operator.attrgetter("is_cpu")


def per_tensor_norms(tensors: list[torch.Tensor], p: float, foreach: Optional[bool],
                     device: torch.device, orders: Optional[dict] = None,
                     groups: Optional[dict] = None) -> torch.Tensor:
    """Every tensor's p-norm (float64, in input order, on ``device``), per (device, dtype) group;
    low-precision groups accumulate in float32. With several groups, the index that restores
    the input order is kept in ``orders`` (a :class:`Route`'s), so it crosses to the device once."""
    groups = groups_of(tensors) if groups is None else groups
    if (p == math.inf or p < 0) and any(t.numel() == 0 for t in tensors):
        tensors = _identities_for_empty(tensors, p)
    parts = []
    for (dev, dtype), positions in groups.items():
        group = tensors if len(positions) == len(tensors) else [tensors[i] for i in positions]  # one group: all
        # float32 accumulation keeps bf16/fp16 norms exact to float32; p other than 1, 2, ±inf, 0
        # raise each element to a power, which float32 rounds too coarsely for 1e-6 of float64
        acc = torch.float64 if p not in _NATIVE_P else (torch.float32 if dtype in LOW_PRECISION else None)
        if _use_foreach(foreach, dev, group):
            norms = torch._foreach_norm(group, p, dtype=acc)
        else:
            norms = [torch.linalg.vector_norm(t, p, dtype=acc) for t in group]
        parts.append(torch.stack(norms).to(device=device, dtype=torch.float64))
    if len(parts) < 2:
        return parts[0] if parts else torch.empty(0, dtype=torch.float64, device=device)
    grouped = tuple(i for positions in groups.values() for i in positions)
    order = orders.get(grouped) if orders is not None else None
    if order is None:
        inverse = [0] * len(grouped)
        for k, i in enumerate(grouped):
            inverse[i] = k
        order = torch.tensor(inverse, dtype=torch.long, device=device)
        if orders is not None:
            if len(orders) >= 4:  # the dtypes of a gradient set rarely change; keep a few
                orders.clear()
            orders[grouped] = order
    return torch.cat(parts)[order]


def held_nonfinite(norms: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``norms`` (per tensor, in order) with each value that is not finite but whose tensor holds
    no NaN or inf made finite: its sum of powers passed the range it was accumulated in (float32
    for bf16 and fp32 tensors: four elements of 3e19, a norm of 6e19, square past 3.4e38). One
    pass over each such tensor, none over the others; the rest of ``norms`` is kept."""
    suspects = torch.isfinite(norms).logical_not().nonzero().flatten().tolist()
    finite = [i for i in suspects if bool(torch.isfinite(tensors[i]).all())]
    if not finite:
        return norms
    out = norms.clone()
    out[finite] = torch.finfo(out.dtype).max  # past the range its sum reached, and finite as its tensor is
    return out


def _identities_for_empty(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Empty tensors (an FSDP2 shard of a parameter with fewer rows than ranks: a 1-element bias on
    rank 1 of 2) as one element whose p-norm changes nothing in the total: 0 for ∞ (the max), ∞
    for -∞ (the min) and p < 0 (|∞|^p = 0: no term). torch has no norm of an empty tensor for
    these p: the rank raised and its peers waited in the clip's all-reduce."""
    fill = 0.0 if p == math.inf else math.inf
    return [torch.full((1,), fill, dtype=t.dtype, device=t.device) if t.numel() == 0 else t for t in tensors]


def _use_foreach(foreach: Optional[bool], device: torch.device, tensors: list) -> bool:
    supported = device.type in _FOREACH_DEVICES
    if foreach and not supported:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return bool(foreach) or (foreach is None and supported)


def scale_(tensors: list[torch.Tensor], coef: torch.Tensor, foreach: Optional[bool],
           groups: Optional[dict] = None) -> None:
    """Multiply every tensor in place by ``coef`` (in its dtype, as torch), per (device, dtype) group."""
    for (dev, dtype), positions in (groups_of(tensors) if groups is None else groups).items():
        group = tensors if len(positions) == len(tensors) else [tensors[i] for i in positions]  # one group: all
        factor = coef.to(device=dev)
        if _use_foreach(foreach, dev, group):
            torch._foreach_mul_(group, factor)
        else:
            for t in group:
                t.mul_(factor)
