"""One measurement of a rank's gradients (:mod:`distmetrics.grad_norm`), kept for the log step:
per-module buckets, this rank's total, the global total and the clip coefficient (as torch's and
Megatron's clips compute it: :func:`clip_coefficient`), and what counts the non-finite gradients
when a log step asks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .plans import Buckets, Plan

__all__ = ["GradMeasurement", "note_clip", "clip_coefficient", "coefficient_value"]


@dataclass
class GradMeasurement:
    """One measurement of this rank's gradients, for the log step."""

    norm_type: float
    # how the values combine across ranks: sum (Σ nᵖ; p=0: the owned tensors with a non-zero
    # element), max (inf), min (-inf)
    kind: str
    buckets: torch.Tensor  # per module bucket
    local_total: torch.Tensor
    checked: torch.Tensor  # per local tensor: a value that is NaN or ±inf exactly where the gradient holds one
    bucket_idx: torch.Tensor  # per local tensor: its bucket
    missing: float
    owned_buckets: Buckets
    local_buckets: Buckets
    max_norm: Optional[float] = None
    coef: Optional[torch.Tensor] = None
    megatron: bool = False  # Megatron's gradients (main_grad, decoupled_grad): its optimizer clips them in float32
    total: Optional[torch.Tensor] = None  # the global total, float64, identical on every rank
    local_nonfinite: Optional[torch.Tensor] = None  # how many local tensors hold NaN or inf (0-d float64)
    bad_anywhere: Optional[torch.Tensor] = None  # > 0 where some rank's local gradients hold NaN or inf (every rank)
    nan_anywhere: Optional[torch.Tensor] = None  # p < 0: > 0 where some rank's hold NaN (every rank; None for p >= 0)
    held: Optional[torch.Tensor] = None  # p < 0: 1.0 where this rank owns a gradient (none anywhere: torch's total 0)
    sharded_count: Optional[torch.Tensor] = None  # p = 0: > 0 where some rank's gradients are sharded (refused)
    plan: Optional[Plan] = None  # the parameters measured
    partial: bool = False  # made after another over other parameters in the same step: not the step's gradient
    inside_step: bool = False  # made while an optimizer step ran (LBFGS's closure): a gradient inside its update
    locals: Optional[list] = None  # the local gradients, until clipping scaled them
    groups: Optional[dict] = None  # their positions by (device, dtype), until then too
    replicas: Optional[torch.Tensor] = None  # the reduced lanes of the replica check (distmetrics.replicas)
    replicas_differ: Optional[torch.Tensor] = None  # per stage, 1.0 where they differ (a Monitor's)
    replica_names: Optional[Callable[[], list]] = None  # this rank's checked parameters' names, for a refusal
    replica_lacking: Optional[Callable[[], list]] = None  # ... its plain ones without a gradient
    replica_held: float = 0.0  # how many plain gradients this rank's check covered

    on_host: bool = False  # the values are on the CPU: reading them waits for no device
    _local_value: Optional[float] = None

    @property
    def local_value(self) -> Union[float, torch.Tensor]:
        """``local_total`` as a number where it is on the host (read once), else the tensor."""
        if not self.on_host:
            return self.local_total
        if self._local_value is None:
            self._local_value = float(self.local_total)
        return self._local_value

    @property
    def nonfinite(self) -> Union[float, torch.Tensor]:
        """How many local tensors hold NaN or ±inf (counted with the measurement, for the lane of
        its all-reduce): a number where the values are on the host, else a tensor on their device
        (no sync)."""
        return float(self.local_nonfinite) if self.on_host else self.local_nonfinite

    def bad_buckets(self) -> torch.Tensor:
        """Per bucket: how many of its local tensors hold NaN or ±inf (made only when asked: a
        log step whose non-finite count is not 0)."""
        bad = torch.isfinite(self.checked).logical_not().to(torch.float64)
        zeros = torch.zeros(self.buckets.numel(), dtype=torch.float64, device=bad.device)
        return zeros.index_add(0, self.bucket_idx, bad)


def note_clip(measured: GradMeasurement, max_norm: float, total: Optional[torch.Tensor] = None) -> None:
    """Record a clip at ``max_norm`` in ``measured``: the coefficient torch's and Megatron's clips
    scale by (:func:`clip_coefficient`) of ``total`` as returned (default: the float64 global
    total), a tensor, with no host sync."""
    measured.max_norm = max_norm
    measured.coef = clip_coefficient(measured.total if total is None else total, measured.total, max_norm,
                                     measured.megatron)


def clip_coefficient(returned: torch.Tensor, exact: torch.Tensor, max_norm: float,
                     megatron: bool = False) -> torch.Tensor:
    """torch's ``min(1, max_norm / (total + 1e-6))`` of the total it returns, in that total's dtype;
    where that total overflowed its dtype (fp16 gradients of total above 65504) but the float64
    ``exact`` total is finite, of the exact one: torch's would be 0, every gradient zeroed while the
    record says the total was finite. fp16 totals give two fp16 factors (a 1-D tensor) whose product
    is the coefficient, applied one after the other (:func:`~distmetrics.tensor_norms.scale_`): one
    fp16 number holds a coefficient below 2**-14 in few bits and one below 2**-25 not at all (a total
    of 4.5e7 clipped at 1 zeroed every gradient), so the exact total's is a power of two times the
    rest; torch's own coefficient (the total not overflowed) is the first factor, the second 1. ``megatron``: Megatron's
    (``clip_grad_by_total_norm_fp32``), of the ``exact`` total in float64, then float32, as its
    Python-float coefficient multiplies its float32 gradients; a coefficient in the bf16 of
    Megatron's default gradient buffers is off by up to 0.4%. Host tensors give the same."""
    if megatron:
        return torch.clamp(max_norm / (exact + 1e-6), max=1.0).to(torch.float32)
    coef = torch.clamp(max_norm / (returned + 1e-6), max=1.0)
    # bf16 and fp32: the returned total is the float64 one rounded, and past their 3.4e38 only where
    # that one is inf too (a sum of squares that passed float32's range inside a tensor's norm, at
    # ~1.8e19, made it inf) or passes 3.4e38 itself (long bf16 CPU tensors summed in float64), so there
    # is nothing finite to clip by: checked for fp16 alone, whose 65504 a real total passes (11
    # device ops per clip less)
    if returned.dtype != torch.float16:
        return coef
    exact = exact.to(device=coef.device, dtype=torch.float64)
    overflowed = torch.isinf(returned) & torch.isfinite(exact)
    wanted = torch.clamp(max_norm / (exact + 1e-6), max=1.0)
    power = torch.exp2(torch.clamp(torch.floor(torch.log2(wanted.abs())) + 14, min=-24, max=0))  # fp16 holds it
    first = torch.where(overflowed, wanted / power, coef.to(torch.float64))
    return torch.stack([first, torch.where(overflowed, power, torch.ones_like(power))]).to(torch.float16)


def coefficient_value(coef: torch.Tensor) -> float:
    """The number a clip's coefficient (:func:`clip_coefficient`) stands for: a pair of factors' product."""
    return float(coef.to(torch.float64).prod())
