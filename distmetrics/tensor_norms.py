"""Per-tensor norms and in-place scaling of a list of tensors, per (device, dtype) group: the
tensor-level work of :mod:`distmetrics.grad_norm` (which owns, combines and all-reduces).
``torch._foreach_norm`` where the device has it; bf16/fp16 accumulate in float32, and p other
than 1, 2, ±inf, 0 in float64. On the CPU, the 1- and 2-norms of tensors longer than
:data:`CPU_WHOLE` are taken in parts (float32: rows, or chunks for the 1-norm; bf16/fp16: blocks, each
in float64), combined in float64."""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch

__all__ = ["CPU_BLOCK", "CPU_CHUNK", "CPU_ROW", "CPU_WHOLE", "LOW_PRECISION", "groups_of", "per_tensor_norms",
           "held_nonfinite", "scale_"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""The dtypes whose norms (and update norms) are accumulated in float32."""
_FOREACH_DEVICES = ("cpu", "cuda", "xpu", "mtia")
CPU_WHOLE = 1 << 18
"""The longest CPU tensor (elements) whose 1- or 2-norm is taken whole, as torch takes it. torch's
CPU reduction adds each element into a few float32 (bf16, fp16: float32) partial sums in turn,
with an error that grows with the length and the evenness of the values where CUDA's tree-shaped
one stays exact to float32: the 2-norm of 16M float32 elements of equal magnitude (an AdamW
update) was 1e-2 off float64 truth, of 16M normal ones 7e-4; of 131,072 normal ones, 1.3e-6 at
worst. Longer ones are taken in parts (:data:`CPU_ROW`, :data:`CPU_CHUNK`), whose per-tensor calls would
cost more than they save below this length (500 tensors of 50,000 elements: 9 ms in rows, 4 ms whole)."""
CPU_ROW = 1 << 8
"""Elements per row of a long float32 CPU tensor's 2-norm: each row's norm in float32 (one call for the
tensor), the rows' combined in float64. torch's row norm adds a row's squares a few lanes at a time, one
after another, so its error grows with the row and with the evenness of the values: rows of 1024 equal
elements were up to 8.8e-7 off float64 truth, of 256 at most 2.2e-7 (random ones 1e-9), as fast
(16M elements: 1.3 ms, torch's whole reduction 2.0 ms here)."""
CPU_CHUNK = 1 << 20
"""Elements per chunk of a long float32 CPU tensor's 1-norm: each chunk's absolute values written into
one buffer and summed there by torch's sum, which adds pairwise, the chunks' sums combined in float64.
torch's 1-norm of a row adds its elements one after another: rows of 1024 equal elements were up to
1.4e-5 off float64 truth; chunks are at most 4.4e-7 off, and faster (16M elements: 2.5 ms against 7 ms
in rows, 5 ms for torch's whole 1-norm, which was 7e-2 off); a buffer the cache holds is reused warm."""
CPU_BLOCK = 1 << 14
"""Elements per block of a long bf16/fp16 CPU tensor: each block's norm accumulated in float64,
the blocks' combined in float64 (a float32 row norm of bf16 elements converts them one call at a
time: 22 ms for 16M). Exact to float64; 16M bf16 elements took 9 ms against torch's 8 to 40 ms."""
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
_NUMEL = torch.Tensor.numel
_BLOCKED = (torch.float32, torch.bfloat16, torch.float16)  # float64 sums are exact enough as they are


def per_tensor_norms(tensors: list[torch.Tensor], p: float, foreach: Optional[bool],
                     device: torch.device, orders: Optional[dict] = None,
                     groups: Optional[dict] = None, whole_up_to: int = CPU_WHOLE,
                     longs: Optional[dict] = None) -> torch.Tensor:
    """Every tensor's p-norm (float64, in input order, on ``device``), per (device, dtype) group;
    low-precision groups accumulate in float32, and long CPU tensors in float64 blocks
    (:func:`_blockwise`). With several groups, the index that restores
    the input order is kept in ``orders`` (a :class:`Route`'s), so it crosses to the device once.
    ``whole_up_to``: the longest CPU tensor taken whole (lower where a call per tensor costs little:
    the update norms of a log step). ``longs``: where a route keeps whether each group holds a long
    CPU tensor (its tensors keep their sizes)."""
    groups = groups_of(tensors) if groups is None else groups
    if (p == math.inf or p < 0) and any(t.numel() == 0 for t in tensors):
        tensors = _identities_for_empty(tensors, p)
    parts = []
    for (dev, dtype), positions in groups.items():
        group = tensors if len(positions) == len(tensors) else [tensors[i] for i in positions]  # one group: all
        # float32 accumulation keeps bf16/fp16 norms exact to float32; p other than 1, 2, ±inf, 0
        # raise each element to a power, which float32 rounds too coarsely for 1e-6 of float64
        # (complex tensors: in complex128, the only wide dtype torch takes for them; the norm is real)
        acc = (torch.complex128 if dtype.is_complex else torch.float64) if p not in _NATIVE_P else \
            (torch.float32 if dtype in LOW_PRECISION else None)
        blocked = dev.type == "cpu" and p in (1.0, 2.0) and dtype in _BLOCKED
        if blocked and _holds_long(group, dev, dtype, longs, whole_up_to):
            norms = _blockwise(group, p, acc, foreach, dev, whole_up_to)
        else:
            norms = _whole(group, p, acc, foreach, dev)
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


def _holds_long(group: list[torch.Tensor], dev: torch.device, dtype: torch.dtype, longs: Optional[dict],
                whole_up_to: int) -> bool:
    """Is some tensor of ``group`` longer than ``whole_up_to``? Kept in ``longs`` (a route's, whose
    tensors keep their sizes): the scan costs 26 µs for 600 tensors, at every clip."""
    key = (dev, dtype, whole_up_to)
    found = longs.get(key) if longs is not None else None
    if found is None:
        found = max(map(_NUMEL, group)) > whole_up_to
        if longs is not None:
            longs[key] = found
    return found


def _blockwise(group: list[torch.Tensor], p: float, acc: Optional[torch.dtype], foreach: Optional[bool],
               device: torch.device, whole_up_to: int = CPU_WHOLE) -> list[torch.Tensor]:
    """The p-norms (p = 1 or 2) of CPU tensors of one dtype: those up to :data:`CPU_WHOLE` elements
    taken whole as torch takes them, the longer ones as the float64 norm of the float64 norms of
    their blocks of :data:`CPU_BLOCK` elements (all blocks in one call)."""
    norms: list = [None] * len(group)
    short = [k for k, t in enumerate(group) if t.numel() <= whole_up_to]
    if short:
        for k, norm in zip(short, _whole([group[k] for k in short], p, acc, foreach, device)):
            norms[k] = norm
    long_ = [k for k, t in enumerate(group) if t.numel() > whole_up_to]
    if group[0].dtype == torch.float32:  # parts in float32, combined in float64: as fast as torch's whole reduction
        buffer = torch.empty(min(CPU_CHUNK, max(group[k].numel() for k in long_)), dtype=torch.float32) \
            if p == 1.0 and long_ else None
        for k in long_:
            norms[k] = _in_rows(group[k], p) if buffer is None else _in_chunks(group[k], buffer)
        return norms
    blocks = [(group[k],) if group[k].numel() <= CPU_BLOCK else group[k].reshape(-1).split(CPU_BLOCK)
              for k in long_]  # views where the tensor is contiguous
    found = torch.stack(_whole([b for bs in blocks for b in bs], p, torch.float64, foreach, device))
    if len(found) > len(long_):  # a tensor in several blocks: the p-norm of its blocks' norms
        segments = torch.tensor([i for i, bs in enumerate(blocks) for _ in bs])
        found = torch.zeros(len(long_), dtype=torch.float64).index_add_(0, segments, found ** p) ** (1 / p)
    for k, norm in zip(long_, found.unbind(0)):
        norms[k] = norm
    return norms


def _in_chunks(t: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The 1-norm of a long float32 CPU tensor: the float64 sum of its chunks' float32 sums of absolute
    values (chunks of :data:`CPU_CHUNK` elements, each's absolute values in ``buffer``, as long)."""
    sums = []
    for chunk in t.reshape(-1).split(CPU_CHUNK):
        sums.append(torch.abs(chunk, out=buffer[:chunk.numel()]).sum())
    return torch.stack(sums).to(torch.float64).sum()


def _in_rows(t: torch.Tensor, p: float) -> torch.Tensor:
    """The p-norm (p = 2: the 1-norm is :func:`_in_chunks`') of a long float32 CPU tensor: of its rows of
    :data:`CPU_ROW` elements (and the rest), each in float32, combined in float64."""
    flat = t.reshape(-1)
    whole = flat.numel() // CPU_ROW * CPU_ROW
    powers = torch.linalg.vector_norm(flat[:whole].view(-1, CPU_ROW), p, dim=1).to(torch.float64).pow(p).sum()
    if whole < flat.numel():
        powers = powers + torch.linalg.vector_norm(flat[whole:], p).to(torch.float64).pow(p)
    return powers.pow(1.0 / p)


def _whole(tensors: list[torch.Tensor], p: float, acc: Optional[torch.dtype], foreach: Optional[bool],
           device: torch.device) -> list[torch.Tensor]:
    """Every tensor's p-norm in one pass over it: ``torch._foreach_norm`` where the device has it."""
    if _use_foreach(foreach, device, tensors):
        return torch._foreach_norm(tensors, p, dtype=acc)
    return [torch.linalg.vector_norm(t, p, dtype=acc) for t in tensors]


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
    """Multiply every tensor in place by ``coef`` (in its dtype, as torch), per (device, dtype) group; a 1-D
    ``coef`` by each of its factors in turn (fp16's: see :func:`~distmetrics.grad_measurement.clip_coefficient`)."""
    for (dev, dtype), positions in (groups_of(tensors) if groups is None else groups).items():
        group = tensors if len(positions) == len(tensors) else [tensors[i] for i in positions]  # one group: all
        on = coef.to(device=dev)
        for factor in on.unbind() if on.dim() else (on,):
            if _use_foreach(foreach, dev, group):
                torch._foreach_mul_(group, factor)
            else:
                for t in group:
                    t.mul_(factor)
