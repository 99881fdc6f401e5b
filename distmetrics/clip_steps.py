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

The same lanes carry the call's arguments: ranks that pass different norm types (1 on one, 2 on another:
both sums, of different powers) or max_norms at a later call than their first (which
:meth:`~distmetrics.grad_norm.GradientNorms._agree` checks) raise there too.

The lanes hold ``x``, the step modulo :data:`MODULUS`: ``(x, x²)`` summed (p-norms, p = 0), equal on
every rank exactly where the sum is ``world`` times an integer ``m`` and the sum of squares ``world·m²``
(float64 holds both exactly below 2**53); ``(x, −x)`` for a max (inf) or a min (−inf): equal where the
reduced pair sums to 0. Ranks whose steps differ by a multiple of :data:`MODULUS` pass. A second pair
holds ``y``, a CRC-32 of the norm type and max_norm modulo :data:`MODULUS`, alike: two different argument
pairs pass where their ``y`` are equal, about once in 65,536."""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from .guard import HangError
from .peers import InCollective
from .per_rank import some_ranks

__all__ = ["NO_STEP", "step_lanes", "check_steps"]

NO_STEP: Any = object()
"""A measurement made outside a Monitor (``dm.clip_grad_norm_``): it knows no step (its lanes hold 0 on every
rank), only its arguments."""

MODULUS = 2 ** 16
"""``world · MODULUS²`` stays below 2**53 up to 2**21 ranks."""

LANES = 4


def _position(after_step: Any) -> int:
    return 0 if after_step is None or after_step is NO_STEP else (int(after_step) + 1) % MODULUS


def _arguments(p: float, max_norm: Optional[float]) -> int:
    """The call's norm type and max_norm as an integer below :data:`MODULUS` (a measurement: no max_norm)."""
    # + 0.0: -0.0 and 0.0 are one argument (their reprs differ)
    return zlib.crc32(f"{float(p) + 0.0!r} {None if max_norm is None else max_norm + 0.0!r}".encode()) % MODULUS


def step_lanes(after_step: Optional[int], kind: str, device: torch.device, p: float = 2.0,
               max_norm: Optional[float] = None) -> torch.Tensor:
    """This rank's four lanes for an all-reduce of ``kind`` (see the module docstring), on ``device``: its
    step's pair, and its arguments' (``p``, ``max_norm``)."""
    lanes = []
    for x in (float(_position(after_step)), float(_arguments(p, max_norm))):
        lanes += [x, x * x if kind in ("sum", "count") else -x]
    return torch.tensor(lanes, dtype=torch.float64, device=device)


def _same(first: float, second: float, kind: str, world: int) -> bool:
    if kind in ("sum", "count"):
        mean = first / world
        return mean == int(mean) and second == world * mean * mean
    return first + second == 0


def check_steps(reduced: torch.Tensor, kind: str, group: Any, after_step: Any, call: str,
                p: float = 2.0, max_norm: Optional[float] = None) -> None:
    """Raise :class:`HangError` on every rank where the reduced lanes say the ranks' steps, or their norm
    types or max_norms, differ (the same lanes on every rank: every rank raises), after one gather of
    the ranks' steps and arguments for the message."""
    step_sum, step_squares, given_sum, given_squares = reduced.tolist()
    world = dist.get_world_size(group)
    steps_alike = _same(step_sum, step_squares, kind, world)
    if steps_alike and _same(given_sum, given_squares, kind, world):
        return
    mine = torch.tensor([-1.0 if after_step is None or after_step is NO_STEP else float(after_step), float(p),
                         math.nan if max_norm is None else float(max_norm)], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    with InCollective("the gather of the ranks' steps and arguments at a gradient norm whose ranks differ", call):
        dist.all_gather(rows, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    if not steps_alike:
        by_step: dict[int, list[int]] = {}
        for rank, row in zip(ranks, rows):
            by_step.setdefault(int(row[0]), []).append(rank)
        said = "; ".join(f"{some_ranks(held)} " + ("before its first monitor.step" if step < 0 else
                                                     f"after monitor.step(step={step})")
                         for step, held in sorted(by_step.items()))
        raise HangError(f"{call}: the ranks made this gradient norm's all-reduce at different steps ({said}): a "
                        "rank skipped a clip or made one more, so its all-reduce met another step's, and the total "
                        "would mix two steps' gradients (no gradient was scaled). Every rank calls "
                        "monitor.clip_grad_norm_ and monitor.measure_grad_norms at the same steps")
    by_call: dict[str, list[int]] = {}
    who = "dm." if after_step is NO_STEP else "monitor."
    for rank, row in zip(ranks, rows):
        given = row.tolist()
        what = (f"{who}measure_grad_norms(norm_type={given[1]:g})" if math.isnan(given[2]) else
                f"{who}clip_grad_norm_(max_norm={given[2]!r}, norm_type={given[1]:g})")
        by_call.setdefault(what, []).append(rank)
    said = "; ".join(f"{what} on {some_ranks(held)}" for what, held in by_call.items())
    raise HangError(f"{call}: the ranks made this gradient norm's all-reduce with different arguments ({said}): "
                    "the ranks' sums of different powers, or clips to different norms, would be taken as one (no "
                    "gradient was scaled). Every rank passes the same norm_type and max_norm at each call")
