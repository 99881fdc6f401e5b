"""Plain gradients beside sharded ones, counted once as copies of each other: the check that they
are copies.

With ``fully_shard`` on some submodules only, the parameters outside them (the root's embedding or
head, say) stay plain tensors, which the ownership rule (:func:`distmetrics.parallel.owns_local_piece`)
counts on one rank of their replicas. Nothing in torch reduces their gradients: they are the same on
every rank only where the loop all-reduces them itself (or wraps their module in DDP). Where they
differ, each rank's true norm is another, one rank's would be written as the job's, and a clip would
scale every rank by it. So a measurement over such gradients carries a fingerprint of their
per-tensor norms in lanes of its one all-reduce (a set of lanes per pipeline stage: stages hold
different parameters); the reduced lanes are the same on every rank, so every rank raises together
where the ranks of a stage disagree. :func:`distmetrics.clip_grad_norm_` reads them at once (:func:`check`),
before any gradient is scaled and before any other collective. A Monitor's clip must not wait for the
device at every step to read them (the library never does between log steps), so it keeps a flag on
the device instead (:func:`differing`), OR-ed over the interval's measurements by :class:`IntervalCheck`,
which rides the log step's MAX pack and is raised once that step's record is written.

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

from .samples import Sample

__all__ = ["carried", "position_weights", "lanes", "check", "differing", "IntervalCheck", "refusal", "LANES"]

_CELLS = 2.0 ** 20  # grid cells per unit of log-norm
_MODULUS = 2.0 ** 31
_ZERO, _INF, _NAN = -1000.0, 1000.0, 2000.0  # outside any finite norm's log (|log| < 745): a 0, an inf, a NaN norm
LANES = "_norms/replicas_differ"
"""The internal lanes of :class:`IntervalCheck` in a Monitor's log step, ``<LANES>/stage<s>`` per pipeline stage."""


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
    reduced lanes of ``measured`` (one read on the host: a device sync on a GPU, made only by
    :func:`distmetrics.clip_grad_norm_`, in a job where some rank measures such gradients). A NaN or
    inf in some rank's gradients is left to the non-finite count and its alert. ``names()``: this
    rank's checked parameters, for the message."""
    bad = [stage for stage, differ in enumerate(differing(measured, kind).tolist()) if differ]
    if bad:
        raise ValueError(refusal(call, names(), bad, layout.pp_rank, layout.pp_size))


def differing(measured: Any, kind: str) -> torch.Tensor:
    """Per pipeline stage, 1.0 where its ranks' fingerprints differ and no rank's gradients held NaN
    or inf, else 0.0: a float64 tensor on the device of the reduced lanes of ``measured``, made with
    device ops alone (no host read)."""
    if kind in ("sum", "count"):  # (Σ fingerprints, Σ the owners' fingerprints, ranks): all equal the owner's
        lanes = measured.replicas.reshape(-1, 3)
        differ = lanes[:, 0] != lanes[:, 1] * lanes[:, 2]
    else:  # (the most, −the least) of the fingerprints: the same where their sum is 0
        lanes = measured.replicas.reshape(-1, 2)
        differ = lanes[:, 0] + lanes[:, 1] != 0
    return (differ & (measured.bad_anywhere == 0)).to(torch.float64)


class IntervalCheck:
    """A Monitor's check, made at its log step: the flags of :func:`differing` OR-ed (a max) over the
    interval's measurements on the device, handed to the log step as a vector sample reduced as a max
    (:data:`LANES`), and the ``ValueError`` every rank raises once the record is written, from the
    reduced flags (the same on every rank: so is each measurement's). A clip goes on meanwhile: its
    gradients are scaled by a norm that counts one rank's copies, until the log step says so."""

    def __init__(self) -> None:
        self._differ: Optional[torch.Tensor] = None  # per stage: 1.0 where some measurement of the interval differed
        self._call = "monitor.clip_grad_norm_"  # the caller of the latest checked measurement, and its plain
        # parameters' names (none on a rank that checked none: the reduced flags still say its stage's)
        self._names: Optional[Callable[[], list[str]]] = None
        self._lanes: tuple = ()  # the vector's element names, for the number of stages

    def note(self, measured: Any, call: str) -> None:
        """Add a measurement's flags (none where it was not checked) to the interval's, on the device."""
        differ = getattr(measured, "replicas_differ", None)
        if differ is None:
            return
        kept = self._differ
        self._differ = differ if kept is None or kept.shape != differ.shape else torch.maximum(kept, differ)
        self._call, self._names = call, measured.replica_names

    def take(self) -> Optional[Sample]:
        """The interval's flags as a vector sample (None where no measurement was checked); then start again."""
        differ, self._differ = self._differ, None
        if differ is None:
            return None
        return Sample(LANES, differ, "max", names=self._names_for(differ.numel()))

    def refused(self, metrics: dict, layout: Any, step: int) -> Optional[ValueError]:
        """The error of a log step whose reduced flags say some stage's ranks differed (None where
        none did), the lanes taken out of ``metrics``: read on the host, where the reduction put them."""
        bad = []
        for stage, name in enumerate(self._names_for(layout.pp_size)):
            if metrics.pop(name, 0) > 0:
                bad.append(stage)
            metrics.pop(f"{name}/max_rank", None)
        if not bad:
            return None
        names = self._names() if self._names is not None else []
        found = (f"Found at the log step of step {step}, from the measurements since the last one (their gradients "
                 "were scaled all the same): its record is written without grad_norm, its per-module values, "
                 "grad_clip_ratio and effective_lr_ratio, which would be one rank's")
        return ValueError(refusal(self._call, names, bad, layout.pp_rank, layout.pp_size, found))

    def _names_for(self, stages: int) -> tuple:
        if len(self._lanes) != stages:
            self._lanes = tuple(f"{LANES}/stage{stage}" for stage in range(stages))
        return self._lanes


def refusal(call: str, names: list[str], bad: list[int], stage: int, stages: int, found: str = "") -> str:
    """The error every rank raises: the plain parameters (this rank's, where its stage is one that
    disagrees), and what to do; ``found``: when it was found, where that was not at the call."""
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
            "before measuring or clipping, or shard them too (fully_shard(model) on the root, after its submodules)"
            + (f". {found}" if found else ""))
