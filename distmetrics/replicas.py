"""Plain gradients beside sharded ones, counted once as copies of each other: the check that they
are copies.

With ``fully_shard`` on some submodules only, the parameters outside them (the root's embedding or
head, say) stay plain tensors, which the ownership rule (:func:`distmetrics.parallel.owns_local_piece`)
counts on one rank of their replicas. Nothing in torch reduces their gradients: they are the same on
every rank only where the loop all-reduces them itself (or wraps their module in DDP). Where they
differ, each rank's true norm is another, one rank's would be written as the job's, and a clip would
scale every rank by it. So a measurement over such gradients carries a fingerprint of their
per-tensor norms in lanes of its one all-reduce (a set of lanes per pipeline stage: stages hold
different parameters), and every rank reads the result and raises together where the ranks of a
stage disagree, before any gradient is scaled and before any other collective.

A fingerprint is an integer: each norm's natural logarithm on a grid of 2**-20 (norms about 1e-6
apart, relatively, fall in different cells whatever their size), times a weight from the tensor's
position, summed modulo 2**31. Integers below 2**53 are exact in float64, also summed over 2**22
ranks: copies (the same bits) agree exactly, and no tolerance is needed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["carried", "position_weights", "lanes", "check", "disagreeing_stages", "refusal"]

_CELLS = 2.0 ** 20  # grid cells per unit of log-norm
_MODULUS = 2.0 ** 31
_ZERO, _INF, _NAN = -1000.0, 1000.0, 2000.0  # outside any finite norm's log (|log| < 745): a 0, an inf, a NaN norm


def carried(layout: Any, group: Any) -> bool:
    """Does a measurement carry the check's lanes? Outside Megatron (whose plain parameters have
    rules of their own) on more than one rank: the same on every rank whatever its parameters, so
    every rank's all-reduce has as many lanes."""
    return layout.source != "megatron" and dist.is_available() and dist.is_initialized() and \
        dist.get_world_size(group) > 1


def position_weights(positions: list[int], checked: list[bool], device: torch.device) -> Optional[torch.Tensor]:
    """Per local tensor: a weight in [1, 1021] from its position in the plan where it is checked,
    else 0 (a norm moved to another tensor changes the sum); None where none is checked."""
    if not any(checked):
        return None
    weights = [float(1 + (i * 40503) % 1021) if c else 0.0 for i, c in zip(positions, checked)]
    return torch.tensor(weights, dtype=torch.float64, device=device)


def lanes(norms: torch.Tensor, weights: Optional[torch.Tensor], owner: bool, layout: Any, kind: str) -> torch.Tensor:
    """This rank's lanes for the measurement's all-reduce: per pipeline stage of ``layout``,
    (fingerprint, the owner's fingerprint, 1) for a SUM (``kind`` sum or count), (fingerprint,
    −fingerprint) for a MAX or MIN; the identity in the other stages' lanes. ``weights``: see
    :func:`position_weights`; ``owner``: the checked tensors count on this rank."""
    stage, stages = layout.pp_rank, layout.pp_size
    if weights is None:  # nothing checked here (a fingerprint of 0): the same lanes at every measurement
        key = (stage, stages, kind, norms.device)
        constant = _UNCHECKED.get(key)
        if constant is None:
            constant = _UNCHECKED[key] = _place(torch.zeros((), dtype=torch.float64, device=norms.device), False,
                                                stage, stages, kind)
        return constant
    logs = torch.nan_to_num(torch.log(norms), nan=_NAN, posinf=_INF, neginf=_ZERO)
    terms = torch.remainder(torch.round(logs * _CELLS) * weights, _MODULUS)
    return _place(torch.remainder(terms.sum(), _MODULUS), owner, stage, stages, kind)


_UNCHECKED: dict = {}  # (stage, stages, kind, device) → the lanes of a rank that checks nothing


def _place(fingerprint: torch.Tensor, owner: bool, stage: int, stages: int, kind: str) -> torch.Tensor:
    """The lanes of every stage, this rank's fingerprint in its own stage's."""
    if kind in ("sum", "count"):
        mine = torch.stack([fingerprint, fingerprint * float(owner), torch.ones_like(fingerprint)])
        return F.pad(mine, (3 * stage, 3 * (stages - stage - 1)))
    fill = float("-inf") if kind == "max" else float("inf")
    return F.pad(torch.stack([fingerprint, -fingerprint]), (2 * stage, 2 * (stages - stage - 1)), value=fill)


def check(measured: Any, kind: str, call: str, layout: Any, names: Callable[[], list[str]]) -> None:
    """Raise a ``ValueError`` where the ranks of some stage hold different plain gradients, from the
    reduced lanes of ``measured`` (read on the host: a device sync on a GPU, made only in a job where
    some rank measures such gradients). A NaN or inf in some rank's gradients is left to the
    non-finite count and its alert. ``names()``: this rank's checked parameters, for the message."""
    if float(measured.bad_anywhere) != 0:
        return
    bad = disagreeing_stages(measured.replicas, kind)
    if bad:
        raise ValueError(refusal(call, names(), bad, layout.pp_rank, layout.pp_size))


def disagreeing_stages(reduced: torch.Tensor, kind: str) -> list[int]:
    """The stages whose ranks' fingerprints differ, from the reduced lanes (read on the host)."""
    values = reduced.tolist()
    if kind in ("sum", "count"):
        return [s for s in range(len(values) // 3) if values[3 * s] != values[3 * s + 1] * values[3 * s + 2]]
    return [s for s in range(len(values) // 2) if values[2 * s] + values[2 * s + 1] != 0]


def refusal(call: str, names: list[str], bad: list[int], stage: int, stages: int) -> str:
    """The error every rank raises: the plain parameters (this rank's, where its stage is one that
    disagrees), and what to do."""
    if stage in bad and names:
        shown = ", ".join(map(repr, names[:4])) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = f"the plain (not sharded) parameters {shown}"
    else:
        what = "the plain (not sharded) parameters"
    where = f" of pipeline stage(s) {bad}" if stages > 1 else ""
    return (f"{call}: the gradients of {what}{where} differ across ranks: beside FSDP2's sharded (DTensor) gradients "
            "a plain gradient is counted once, as the copy every rank holds, so the norm would be one rank's, not "
            "each rank's, and a clip would scale every rank by it. Nothing reduces a parameter outside fully_shard "
            "and DDP: all-reduce their gradients over the data-parallel ranks (sum, then divide by their number) "
            "before measuring or clipping, or shard them too (fully_shard(model) on the root, after its submodules)")
