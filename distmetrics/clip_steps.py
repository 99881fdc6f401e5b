"""Are the ranks at the same step when a Monitor's gradient norm is all-reduced?

``monitor.clip_grad_norm_`` and ``monitor.measure_grad_norms`` make their all-reduce at every step
without the arrival check (its store round trips would cost every step). A rank that skips one clip
(a condition on a rank's own data) meets the others' next clip with its own, and the total mixes two
steps' gradients. Where the all-reduce runs on the host (gloo: decided by the process group, the same on
every rank), two lanes ride it carrying the Monitor's step on each rank, and every rank raises
:class:`~distmetrics.guard.HangError` at the first all-reduce the ranks made at different steps, naming
each rank's step, before any gradient is scaled. Under NCCL the lanes would cost a copy to the device
and a device sync per call: there the next log step's arrival check names the rank (see the README's
Limitations).

The lanes hold ``x``, the step modulo :data:`MODULUS`: ``(x, x²)`` summed (p-norms, p = 0), equal on
every rank exactly where the sum is ``world`` times an integer ``m`` and the sum of squares ``world·m²``
(float64 holds both exactly below 2**53); ``(x, −x)`` for a max (inf) or a min (−inf): equal where the
reduced pair sums to 0. Ranks whose steps differ by a multiple of :data:`MODULUS` pass."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .guard import HangError
from .peers import InCollective
from .per_rank import some_ranks

__all__ = ["NO_STEP", "step_lanes", "check_steps"]

NO_STEP: Any = object()
"""A measurement made outside a Monitor (``dm.clip_grad_norm_``): it knows no step, carries no lanes."""

MODULUS = 2 ** 16
"""``world · MODULUS²`` stays below 2**53 up to 2**21 ranks."""

LANES = 2


def _position(after_step: Optional[int]) -> int:
    return 0 if after_step is None else (int(after_step) + 1) % MODULUS


def step_lanes(after_step: Optional[int], kind: str, device: torch.device) -> torch.Tensor:
    """This rank's two lanes for an all-reduce of ``kind`` (see the module docstring), on ``device``."""
    x = float(_position(after_step))
    second = x * x if kind in ("sum", "count") else -x
    return torch.tensor([x, second], dtype=torch.float64, device=device)


def check_steps(reduced: torch.Tensor, kind: str, group: Any, after_step: Optional[int], call: str) -> None:
    """Raise :class:`HangError` on every rank where the reduced lanes say the ranks' steps differ (the
    same lanes on every rank: every rank raises), after one gather of the ranks' steps for the message."""
    first, second = reduced.tolist()
    world = dist.get_world_size(group)
    if kind in ("sum", "count"):
        mean = first / world
        same = mean == int(mean) and second == world * mean * mean
    else:
        same = first + second == 0
    if same:
        return
    mine = torch.tensor([-1 if after_step is None else int(after_step)], dtype=torch.int64)
    steps = [torch.empty_like(mine) for _ in range(world)]
    with InCollective("the gather of the ranks' steps at a gradient norm made at different steps", call):
        dist.all_gather(steps, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    by_step: dict[int, list[int]] = {}
    for rank, step in zip(ranks, (int(s) for s in steps)):
        by_step.setdefault(step, []).append(rank)
    said = "; ".join(f"{some_ranks(held)} " + ("before its first monitor.step" if step < 0 else
                                                 f"after monitor.step(step={step})")
                     for step, held in sorted(by_step.items()))
    raise HangError(f"{call}: the ranks made this gradient norm's all-reduce at different steps ({said}): a rank "
                    "skipped a clip or made one more, so its all-reduce met another step's, and the total would mix "
                    "two steps' gradients (no gradient was scaled). Every rank calls monitor.clip_grad_norm_ and "
                    "monitor.measure_grad_norms at the same steps")

