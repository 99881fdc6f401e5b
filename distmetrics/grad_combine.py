"""Per-tensor gradient norms combined into per-module buckets, this rank's total and the global
total, in one all-reduce that also carries the non-finite count (for p < 0 the NaN count too) and
the replica check's lanes (:mod:`distmetrics.replicas`). :mod:`distmetrics.grad_norm` measures and
clips with it."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from .grad_measurement import GradMeasurement
from .packing import collective_device
from .peers import InCollective
from .tensor_norms import held_nonfinite

__all__ = ["combine", "norm_kind", "all_reduce"]


def norm_kind(p: float) -> str:
    """How the per-tensor norms of order ``p`` combine across tensors and ranks: "sum" (of p-th
    powers), "count" (p = 0: tensors with a non-zero element, summed), "max" (inf), "min" (-inf)."""
    if p == math.inf:
        return "max"
    if p == -math.inf:
        return "min"
    return "count" if p == 0 else "sum"


def count_nonfinite(values: torch.Tensor) -> torch.Tensor:
    """How many of ``values`` (real floats) are NaN or ±inf, as a float64 scalar on their device, in
    three kernels: ``x * 0`` is 0 exactly where ``x`` is finite. ``isfinite().logical_not().sum()``
    costs seven (torch builds ``isfinite`` of four), and on a GPU each is a launch of its own at
    every clip: 5–16 µs of the host's time each."""
    return (values * 0).ne(0).sum(dtype=torch.float64)


def combine(norms: torch.Tensor, owned: torch.Tensor, bucket_idx: torch.Tensor, n_buckets: int, p: float,
             group: Any, device: torch.device, sharded: bool = False, every: bool = False,
             finite_check: Optional[torch.Tensor] = None, extra: Optional[torch.Tensor] = None,
             tensors: Optional[list] = None) -> GradMeasurement:
    """Owned per-tensor norms → per-bucket values, this rank's total and the global total
    (``every``: this rank owns every tensor, as a single process does). ``finite_check``:
    per-tensor values that are non-finite where a gradient is (default ``norms``), and where a
    tensor's sum of powers passed its accumulation's range; ``tensors``: the local tensors, given
    where the values are on the host, where those are told apart (:func:`held_nonfinite`).
    ``extra``: lanes that ride the all-reduce (reduced as the total is), kept as ``replicas``."""
    tail = () if extra is None else (extra,)
    kind = norm_kind(p)
    zeros = torch.zeros(n_buckets, dtype=torch.float64, device=device)
    # Every local tensor is checked, owned or not: a NaN on one replica (silent corruption of
    # one GPU) must not hide behind the copy on the owning rank. Its count rides the total's
    # all-reduce (a lane on every rank, whatever it owns): how many ranks' local gradients hold
    # NaN or inf, or the most any rank's do (max, min kinds), the same on every rank.
    check = norms if finite_check is None else finite_check
    local_bad = count_nonfinite(check)
    if tensors is not None and float(local_bad):  # a host read: no device waits; a pass only over those tensors
        check = held_nonfinite(check, tensors)
        local_bad = count_nonfinite(check)
    bad = local_bad.reshape(1)
    nan = None
    if p < 0:  # and how many hold NaN: torch's total of p < 0 is NaN on a rank whose gradients hold one, not
        # where they hold inf alone (|inf|^p is 0, and a min passes it by); a lane of its own beside the count
        bad = torch.cat([bad, torch.isnan(check).sum().to(torch.float64).reshape(1)])
    held = (norms.numel() > 0 if every else owned.any()) if p < 0 else None
    if not every:  # a copy whose norm is NaN or inf counts as if it were the one counted: the total (and so the
        owned = owned | (norms * 0).ne(0)  # clip's coefficient) is the same on every rank, no replica apart
        # (x * 0 is 0 exactly where x is finite: two kernels where ~isfinite takes five)
    if held is not None:  # with no gradient on any rank torch's total is 0: the root of an empty sum of
        held = torch.as_tensor(held, dtype=torch.float64, device=device).reshape(1)  # n^p (p < 0) is inf
    sharded_count = None
    if kind in ("sum", "count"):  # one layout of lanes for every finite p: ranks passing different ones (which the
        # clip's argument lanes name, under gloo) reduce tensors of one size, where gloo ended the process
        if kind == "sum":
            contrib = norms.pow(p) if every else torch.where(owned, norms.pow(p), torch.zeros_like(norms))
        else:  # p = 0: the owned tensors with a non-zero element, and "I hold a shard"
            counted = (norms > 0).to(torch.float64)
            contrib = counted if every else torch.where(owned, counted, torch.zeros_like(norms))
        buckets, local = zeros.index_add(0, bucket_idx, contrib), contrib.sum()
        # [total, non-finite count, NaN count, held, sharded]: p < 0 gives the NaN count and held, p = 0 sharded
        pad = torch.zeros(1 if held is not None else 3, dtype=torch.float64, device=device)  # a kernel, no copy
        if sharded and kind == "count":
            pad[2] = 1.0
        lanes = [local.reshape(1), bad, *(() if held is None else (held,)), pad, *tail]
        reduced = all_reduce(torch.cat(lanes), "sum", group)
        bad, nan, extra = reduced[1], reduced[2] if p < 0 else None, reduced[5:]
        total = reduced[0] if kind == "count" else reduced[0].pow(1.0 / p)
        if held is not None:
            total = torch.where(reduced[3] > 0, total, torch.zeros_like(total))
        if kind == "count":
            kind, sharded_count = "sum", reduced[4]
    else:
        fill = 0.0 if kind == "max" else math.inf  # the identities (norms are >= 0)
        contrib = norms if every else torch.where(owned, norms, torch.full_like(norms, fill))
        reduce = "amax" if kind == "max" else "amin"
        buckets = torch.full_like(zeros, fill).scatter_reduce(0, bucket_idx, contrib, reduce, include_self=True)
        with_identity = torch.cat([contrib, torch.full((1,), fill, dtype=torch.float64, device=device)])
        local = with_identity.max() if kind == "max" else with_identity.min()
        if kind == "max":
            reduced = all_reduce(torch.cat([local.reshape(1), bad, *tail]), kind, group)
            total, bad, extra = reduced[0], reduced[1], reduced[2:]
        else:  # a second lane, −(owns a gradient): no rank owning one gives 0, as torch returns
            reduced = all_reduce(torch.cat([local.reshape(1), -held, -bad, *tail]), kind, group)
            total, none_held, least, extra = reduced[0], reduced[1], reduced[2:4], reduced[4:]
            total, bad, nan = torch.where(none_held < 0, total, torch.zeros_like(total)), -least[0], -least[1]
    measured = GradMeasurement(p, kind, buckets, local, check, bucket_idx, 0.0, None, None)
    measured.on_host = device.type == "cpu"
    measured.total = total
    measured.local_nonfinite, measured.bad_anywhere, measured.nan_anywhere = local_bad, bad, nan
    measured.replicas, measured.held, measured.sharded_count = extra, held, sharded_count
    return measured


def refuse_sharded_count(measured: GradMeasurement) -> None:
    """p = 0 where some rank's gradients are sharded: raised after the clip's step lanes were read (a rank that
    passed another norm type reads its own lanes there, and every rank raises the same error)."""
    if measured.sharded_count is not None and measured.sharded_count > 0:
        raise ValueError("norm_type=0 counts the tensors with a non-zero gradient, which is not defined for tensors "
                         "sharded over ranks (FSDP2, tensor parallel, the distributed optimizer); use a norm_type "
                         "other than 0")


_CALL = "the gradient norm (clip_grad_norm_ or measure_grad_norms)"  # how a lost peer's error names it


def all_reduce(values: torch.Tensor, kind: str, group: Any) -> torch.Tensor:
    """One all-reduce: SUM for sums and counts; MAX (MIN as the max of −v) with a NaN lane, since
    gloo's MAX drops a NaN that arrives from another rank."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return values
    home = values.device
    values = values.to(collective_device(group))
    if kind in ("sum", "count"):
        values = values.clone()
        with InCollective("the SUM all_reduce of the ranks' gradient norms", _CALL):
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
        return values.to(home)
    sign = 1.0 if kind == "max" else -1.0
    nan = torch.isnan(values).to(values.dtype)
    # NaN as the MAX's identity, inf kept (nan_to_num's default makes it float64's largest finite number)
    packed = torch.cat([torch.nan_to_num(values * sign, nan=-math.inf, posinf=math.inf, neginf=-math.inf), nan])
    with InCollective("the MAX all_reduce of the ranks' gradient norms", _CALL):
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    n = values.numel()
    out = torch.where(packed[n:] > 0, torch.full_like(packed[:n], math.nan), packed[:n] * sign)
    return out.to(home)
