"""The dtype a gradient norm is returned in, and its clip coefficient computed in: the same on every rank.

torch's clip of a whole model stacks every tensor's norm (in the tensor's real dtype), so its total, and
the coefficient it scales by, are in the dtype promoted over every gradient's. A rank holds some of the
gradients only (a pipeline stage in bf16 beside fp32 stages holds bf16 ones alone): promoted over its
own alone, its total would be bf16 and its coefficient another factor than the other stages'. Which dtypes the ranks
hold rides, as one lane per dtype, all-reduces made anyway: the norm-type check at the first norm with a
norm type (:meth:`distmetrics.grad_norm.GradientNorms._agree`) and, where the collective runs on the
CPU (gloo), each measurement's own all-reduce, whose lanes a measurement on the CPU reads at the call
(no device to wait for): a rank whose dtypes change then changes every rank's at that call, each
reading the same reduced lanes, with no collective of its own. A measurement on a GPU reads nothing
(that would wait for the device): the dtypes are those agreed at the first norm with the norm type,
promoted with the rank's own.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from .packing import collective_device

__all__ = ["LANES", "GradDtypes"]

LANES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The real dtypes agreed across ranks, one lane each (complex gradients count by their norm's real dtype)."""


class GradDtypes:
    """The gradient dtypes every rank holds, as last agreed, and the lanes that agree them."""

    def __init__(self) -> None:
        self.agreed: frozenset = frozenset()
        """The real dtypes some rank's gradients held at the last agreement (empty before one)."""
        self._for: Optional[tuple] = None  # (the plan, this rank's real dtypes) that agreement was made for
        self._lanes: dict = {}  # (this rank's dtypes, sign, device) → its lanes, made once

    @staticmethod
    def flags(dtypes: Iterable[torch.dtype]) -> list[float]:
        """One lane per dtype of :data:`LANES`: 1.0 where this rank holds a gradient of it."""
        held = {dtype.to_real() for dtype in dtypes}
        return [float(dtype in held) for dtype in LANES]

    @staticmethod
    def carried(group: object) -> bool:
        """Does each measurement's all-reduce carry the lanes? Where it runs on the CPU on more than one
        rank: the same on every rank of ``group`` (one backend), so every rank's has as many lanes."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1 and \
            collective_device(group).type == "cpu"

    def beside(self, extra: Optional[torch.Tensor], dtypes: Iterable[torch.dtype], kind: str,
               device: torch.device) -> torch.Tensor:
        """``extra`` (other lanes riding a measurement's all-reduce, or None), then this rank's lanes."""
        held = self.lanes(dtypes, kind, device)
        return held if extra is None else torch.cat([extra, held])

    def take(self, measured: Any, plan: Any, dtypes: Iterable[torch.dtype]) -> None:
        """Split this rank's lanes, reduced, off ``measured.replicas`` (:meth:`beside`); where the measurement
        is on the host (no device to wait for), agree them: every rank's dtypes at this call."""
        measured.replicas, held = measured.replicas[:-len(LANES)], measured.replicas[-len(LANES):]
        if measured.on_host:
            self.agree(held.tolist(), plan, dtypes)

    def lanes(self, dtypes: Iterable[torch.dtype], kind: str, device: torch.device) -> torch.Tensor:
        """This rank's lanes for a measurement's all-reduce of ``kind`` (a MIN reduces −1 for a dtype
        held, so that any rank's shows), made once per set of dtypes and device: no copy to the device
        at later steps."""
        sign = -1.0 if kind == "min" else 1.0
        key = (frozenset(dtypes), sign, device)
        cached = self._lanes.get(key)
        if cached is None:
            cached = torch.tensor([sign * flag for flag in self.flags(key[0])], dtype=torch.float64, device=device)
            while len(self._lanes) >= 8:  # a gradient set's dtypes rarely change; keep a few
                self._lanes.pop(next(iter(self._lanes)))
            self._lanes[key] = cached
        return cached

    def agree(self, reduced: Iterable[float], plan: Any, dtypes: Iterable[torch.dtype]) -> None:
        """Take the reduced lanes (the same on every rank): a dtype some rank holds is not 0 there; made
        for ``plan``'s gradients, this rank's of ``dtypes``."""
        self.agreed = frozenset(dtype for dtype, value in zip(LANES, reduced) if value != 0)
        self._for = (plan, frozenset(dtype.to_real() for dtype in dtypes))

    def returned(self, dtypes: Iterable[torch.dtype], plan: Any) -> Optional[torch.dtype]:
        """The dtype torch's clip of every rank's gradients returns: promoted over the agreed dtypes and
        this rank's own (``dtypes``); None where no rank holds a gradient (torch's zero: the default dtype).
        The agreement counts only for the plan and this rank's dtypes it was made for: a clip of other
        parameters (an fp32 head, then a bf16 body), or gradients cast since, where nothing agreed them
        again (a GPU reads no lanes), are promoted over this rank's own, as every rank of a replica alike."""
        own = frozenset(dtype.to_real() for dtype in dtypes)
        held = self.agreed | own if self._for is not None and self._for[0] is plan and self._for[1] == own else own
        return functools.reduce(torch.promote_types, held) if held else None
