"""Plain gradients beside sharded ones, counted once as copies of each other: the check that they
are copies.

With ``fully_shard`` on some submodules only, the parameters outside them (the root's embedding or
head, say) stay plain tensors, which the ownership rule (:func:`distmetrics.parallel.owns_local_piece`)
counts on one rank of their replicas. Nothing in torch reduces their gradients: they are the same on
every rank only where the loop all-reduces them itself (or wraps their module in DDP). Where they
differ, each rank's true norm is another, one rank's would be written as the job's, and a clip would
scale every rank by it. So a measurement over such gradients carries a fingerprint of their
per-tensor norms in lanes of its one all-reduce (a set of lanes per pipeline stage: stages hold
different parameters), beside how many ranks hold such gradients and how many of those count them.
A rank that holds none adds nothing (a pipeline stage without plain parameters, where no mesh says
the stages apart). The reduced lanes are the same on every rank, so every rank raises together
where the ranks of a stage that hold such gradients disagree, or where none of them counts them (the
rank that counts plain tensors, rank 0 without a mesh, holds none: they would count for nothing).
:func:`distmetrics.clip_grad_norm_` reads them at once (:func:`check`) on every rank, before any
gradient is scaled and before any other collective: a rank cannot know that another holds such
gradients, nor can it raise alone. A Monitor's clip must not wait for the device at every step to
read them (the library never does between log steps), so it keeps a flag on the device instead
(:func:`differing`), OR-ed over the interval's measurements by :class:`IntervalCheck`, which rides the
log step's MAX pack (where a rank noted none, the others' arrive) and is raised once that step's
record is written.

A fingerprint is an integer: each norm's natural logarithm on a grid of 2**-20 (norms about 1e-6
apart, relatively, fall in different cells whatever their size), times a weight from the tensor's
position, summed modulo 2**31. Integers below 2**53 are exact in float64, also summed over 2**22
ranks: copies (the same bits) agree exactly, and no tolerance is needed. Beside it ride a second
fingerprint, of which positions hold a gradient (:func:`presence`, made once per gradient set), and
their count: ranks holding gradients of different parameters (a ``.grad`` None on one rank) are told
apart from ranks whose gradients differ, and the refusal says so, with the counts (at a Monitor's log
step, which ranks hold the most and the fewest) and the parameters this rank holds none of.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .samples import Sample

__all__ = ["carried", "position_weights", "presence", "lanes", "check", "differing", "IntervalCheck", "refusal",
           "LANES", "width", "DIFFER", "SETS", "UNCOUNTED"]

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


def presence(positions: tuple) -> tuple[float, float]:
    """(fingerprint, count) of the plan positions whose plain gradients a rank holds, whatever they hold:
    each position's term (i + 1)·2654435761 mod 2**31 (an odd factor: distinct positions, distinct terms),
    summed mod 2**31. Made once per gradient set."""
    total = 0
    for i in positions:
        total = (total + (i + 1) * 2654435761) % (1 << 31)
    return float(total), float(len(positions))


def lanes(norms: torch.Tensor, weights: Optional[torch.Tensor], owner: bool, layout: Any, kind: str,
          held: tuple = (0.0, 0.0)) -> torch.Tensor:
    """This rank's lanes for the measurement's all-reduce, :func:`width` per pipeline stage of ``layout``:
    in its own stage's, for a SUM (``kind`` sum or count), (fingerprint, counts × fingerprint, 1,
    counts × 2**30 − 1, presence, counts × presence, n, counts × n), whose fourth reduced lane is negative
    exactly where ranks hold checked tensors and none counts them; for a MAX (fingerprint, −fingerprint,
    counts, presence, −presence, n, −n), for a MIN the same with −counts, whose third is 0 exactly there
    (``counts``: 1 where the checked tensors count on this rank, ``owner``; ``held``: (presence, n) of
    :func:`presence`). The identity in every other lane, and in all of them where this rank checks nothing
    (``weights`` None, see :func:`position_weights`): a rank without plain gradients adds nothing."""
    stage, stages = layout.pp_rank, layout.pp_size
    if weights is None:  # the same lanes at every measurement
        return _placing(stage, stages, kind, None, norms.device)[0]
    logs = torch.nan_to_num(torch.log(norms), nan=_NAN, posinf=_INF, neginf=_ZERO)
    terms = torch.remainder(torch.round(logs * _CELLS) * weights, _MODULUS)
    base, scale = _placing(stage, stages, kind, owner, norms.device, held)
    return torch.addcmul(base, scale, torch.remainder(terms.sum(), _MODULUS))


def width(kind: str) -> int:
    """Lanes per pipeline stage: two of the fingerprints, then (for a SUM) the ranks that hold checked
    tensors, and the ranks that count them (for a MAX or MIN: whether one counts them), then two of the
    presence fingerprints and two of the count of checked tensors."""
    return 8 if kind in ("sum", "count") else 7


_COUNTS = 2.0 ** 30  # more than any number of ranks: the counting ranks' weight in a SUM's last lane
_PLACINGS: dict = {}  # (stage, stages, kind, owner, device, held) → (base, scale), made once


def _placing(stage: int, stages: int, kind: str, owner: Optional[bool], device: torch.device,
             held: tuple = (0.0, 0.0)) -> tuple:
    """(base, scale) on ``device``: a rank's lanes are ``base + fingerprint * scale``, one device op
    (``owner`` None: a rank that checks nothing, whose lanes are ``base``, the identities)."""
    key = (stage, stages, kind, owner, device, held)
    cached = _PLACINGS.get(key)
    if cached is None:
        if len(_PLACINGS) >= 64:  # a key per gradient set: routes keep a few
            _PLACINGS.clear()
        summed, counts = kind in ("sum", "count"), float(bool(owner))
        base = torch.full((stages, width(kind)), 0.0 if summed else -math.inf if kind == "max" else math.inf,
                          dtype=torch.float64)
        scale = torch.zeros_like(base)
        if owner is not None:
            mark, n = held
            base[stage] = torch.tensor([0.0, 0.0, 1.0, counts * _COUNTS - 1.0, mark, counts * mark, n, counts * n]
                                       if summed else [0.0, 0.0, -counts if kind == "min" else counts, mark, -mark, n,
                                                       -n], dtype=torch.float64)  # float32 rounded a presence of 2**31
            scale[stage, :2] = torch.tensor([1.0, counts if summed else -1.0], dtype=torch.float64)
        cached = _PLACINGS[key] = (base.reshape(-1).to(device), scale.reshape(-1).to(device))
    return cached


def check(measured: Any, kind: str, call: str, layout: Any, names: Callable[[], list[str]],
          lacking: Callable[[], list[str]] = list) -> None:
    """Raise a ``ValueError`` where the ranks of some stage hold different plain gradients, or ones
    none of them counts, from the reduced lanes of ``measured`` (one read on the host: a device sync
    on a GPU, made by :func:`distmetrics.clip_grad_norm_` where such gradients are held).
    A NaN or inf in some rank's gradients is left to the non-finite count and its alert. ``names()``:
    this rank's checked parameters, ``lacking()``: its plain ones without a gradient, for the message."""
    codes = differing(measured, kind).tolist()
    if any(codes):
        held = names()
        counts = _reduced_counts(measured.replicas, kind, layout.pp_rank, len(held))
        raise ValueError(refusal(call, held, codes, layout.pp_rank, layout.pp_size, lacking=lacking(),
                                 counts=counts, rank=layout.rank))


def _reduced_counts(reduced: torch.Tensor, kind: str, stage: int, mine: int) -> str:
    """What the reduced count lanes of ``stage`` say of the gradients each rank holds, for a refusal."""
    lanes = reduced.view(-1, width(kind))[stage].tolist()
    if kind in ("sum", "count"):
        return f"{lanes[2]:g} ranks hold {lanes[6]:g} such gradients in all: the rank that counts them {lanes[7]:g}, " \
            f"this rank {mine}"
    most, least = (lanes[5], -lanes[6]) if kind == "max" else (-lanes[6], lanes[5])
    return f"the ranks that hold any hold {least:g} to {most:g} such gradients, this rank {mine}"


def differing(measured: Any, kind: str) -> torch.Tensor:
    """Per pipeline stage, :data:`UNCOUNTED` where some of its ranks hold checked gradients but none of
    those counts them, :data:`SETS` where those ranks hold gradients of different parameters (their presence
    fingerprints differ), :data:`DIFFER` where their fingerprints differ and no rank's gradients held NaN or
    inf, else 0.0 (a stage where no rank holds any too): a float64 tensor on the device of the reduced lanes
    of ``measured``, made with device ops alone (no host read)."""
    lanes = measured.replicas.view(-1, width(kind)).unbind(1)
    if kind in ("sum", "count"):  # (Σ fingerprints, the counting rank's, ranks holding, 2**30 × counting − holding,
        # Σ presence, the counting rank's, ...): every holder's fingerprints equal the counting one's
        first, second, held, counted, present, present_counted = lanes[:6]
        differ, sets, uncounted = first != second * held, present != present_counted * held, counted < 0
    else:  # (the most, −the least) of the holders' fingerprints: a sum of 0 where they agree, ±inf where none holds;
        first, second, counted, present, absent = lanes[:5]  # whether one counts them: ±1, 0 where none does
        differ = torch.nan_to_num(first + second, posinf=0.0, neginf=0.0) != 0
        sets, uncounted = torch.nan_to_num(present + absent, posinf=0.0, neginf=0.0) != 0, counted == 0
    code = (differ & (measured.bad_anywhere == 0)).to(torch.float64)
    return torch.where(uncounted, UNCOUNTED, torch.where(sets, SETS, code))


DIFFER, SETS, UNCOUNTED = 1.0, 2.0, 3.0
"""A stage's flag where its ranks' plain gradients differ, where they are of different parameters, and where none of
the ranks that hold them counts them (the larger first: the interval's flags are OR-ed as a max)."""


class IntervalCheck:
    """A Monitor's check, made at its log step: the flags of :func:`differing` OR-ed (a max) over the
    interval's measurements on the device, handed to the log step as a vector sample reduced as a max
    (:data:`LANES`), and the ``ValueError`` every rank raises once the record is written, from the
    reduced flags (the same on every rank: so is each measurement's). A clip goes on meanwhile: its
    gradients are scaled by a norm that counts one rank's copies, until the log step says so. Beside the
    flags ride the most and the fewest plain gradients this rank held in the interval (host numbers), so
    the log step's maxima say which ranks held the most and the fewest."""

    def __init__(self) -> None:
        self._differ: Optional[torch.Tensor] = None  # per stage: the largest flag of the interval's measurements
        self._held: Optional[tuple] = None  # (most, fewest) plain gradients this rank held in the interval
        self._call = "monitor.clip_grad_norm_"  # the caller of the latest checked measurement, and its plain
        # parameters' names, with and without a gradient (none on a rank that checked none: the reduced flags
        # still say its stage's)
        self._names: Optional[Callable[[], list[str]]] = None
        self._lacking: Callable[[], list[str]] = list
        self._lanes: tuple = ()  # the vector's element names, for the number of stages
        self._counts: tuple = ()  # per stage, the names of the most and the fewest held

    def note(self, measured: Any, call: str) -> None:
        """Add a measurement's flags (none where it was not checked) to the interval's, on the device."""
        differ = getattr(measured, "replicas_differ", None)
        if differ is None:
            return
        kept = self._differ
        self._differ = differ if kept is None or kept.shape != differ.shape else torch.maximum(kept, differ)
        n = measured.replica_held
        if n:  # a rank that holds none adds nothing to the counts
            self._held = (n, n) if self._held is None else (max(self._held[0], n), min(self._held[1], n))
        self._call, self._names, self._lacking = call, measured.replica_names, measured.replica_lacking

    def take(self, stage: int) -> list[Sample]:
        """The interval's flags as a vector sample, and the counts of this rank's ``stage`` (none where no
        measurement was checked); then start again."""
        differ, self._differ = self._differ, None
        held, self._held = self._held, None
        if differ is None:
            return []
        names, counts = self._names_for(differ.numel())
        most, fewest = (-math.inf, -math.inf) if held is None else (held[0], -held[1])
        out = [Sample(LANES, differ, "max", names=names)]
        for s, (most_name, fewest_name) in enumerate(counts):
            out.append(Sample(most_name, most if s == stage else -math.inf, "max"))
            out.append(Sample(fewest_name, fewest if s == stage else -math.inf, "max"))
        return out

    def refused(self, metrics: dict, layout: Any, step: int) -> Optional[ValueError]:
        """The error of a log step whose reduced flags say some stage's plain gradients differed or
        counted nowhere (None where none did), the lanes taken out of ``metrics``: read on the host,
        where the reduction put them."""
        names, counts = self._names_for(layout.pp_size)
        codes, held = [], []
        for name, (most, fewest) in zip(names, counts):
            codes.append(metrics.pop(name, 0.0))
            held.append([(metrics.pop(key, -math.inf), metrics.pop(f"{key}/max_rank", None)) for key in (most, fewest)])
            metrics.pop(f"{name}/max_rank", None)
        if not any(code > 0 for code in codes):
            return None
        found = (f"Found at the log step of step {step}, from the measurements since the last one (their gradients "
                 "were scaled all the same): its record is written without grad_norm, param_norm and update_norm, "
                 "their per-module values, grad_clip_ratio, relative_update_norm and effective_lr_ratio, which "
                 "would be one rank's")
        said = []
        for s, ((most, most_rank), (fewest, fewest_rank)) in enumerate(held):
            if SETS <= codes[s] < UNCOUNTED and most > -math.inf:
                where = f"stage {s}: " if layout.pp_size > 1 else ""
                said.append(f"{where}rank {most_rank} holds {most:g} such gradients, rank {fewest_rank} {-fewest:g}"
                            if most != -fewest else  # a tie names one rank twice: the counts are alike, the sets not
                            f"{where}its ranks hold {most:g} such gradients each, of different parameters")
        return ValueError(refusal(self._call, self._names() if self._names is not None else [], codes,
                                  layout.pp_rank, layout.pp_size, found, self._lacking(), "; ".join(said),
                                  layout.rank))

    def _names_for(self, stages: int) -> tuple:
        if len(self._lanes) != stages:
            self._lanes = tuple(f"{LANES}/stage{stage}" for stage in range(stages))
            self._counts = tuple((f"{name}/held_most", f"{name}/held_fewest") for name in self._lanes)
        return self._lanes, self._counts


def refusal(call: str, names: list[str], codes: list[float], stage: int, stages: int, found: str = "",
            lacking: list[str] = (), counts: str = "", rank: Optional[int] = None) -> str:
    """The error every rank raises, from each stage's flag (``codes``, see :func:`differing`): the plain
    parameters (this rank's, where its stage is one refused), and what to do; ``found``: when it was
    found, where that was not at the call. Gradients no rank counts are said first: they are where
    the count of copies is wrong whatever the gradients hold; then gradients of different parameters
    (``counts``: what is known of who holds how many; ``lacking``: this rank's plain parameters without
    one; ``rank``: this rank's number, where known), which make the fingerprints differ too."""
    uncounted = [s for s, code in enumerate(codes) if code >= UNCOUNTED]
    sets = [s for s, code in enumerate(codes) if SETS <= code < UNCOUNTED]
    bad = uncounted or sets or [s for s, code in enumerate(codes) if code > 0]
    if stage in bad and names:
        what = f"the plain (not sharded) parameters {_shown(names)}"
    else:
        what = "the plain (not sharded) parameters"
    where = f" of pipeline stage(s) {bad}" if stages > 1 else ""
    tail = f". {found}" if found else ""
    if uncounted:
        return (f"{call}: the gradients of {what}{where} are held by ranks none of which counts them, so they would "
                "count for nothing: beside FSDP2's sharded (DTensor) gradients a plain gradient counts once, on the "
                "first data-parallel rank of its pipeline stage (the job's rank 0 where no mesh names a pipeline "
                "dimension: every rank is then taken for a replica of one model), and that rank holds none of them "
                "(a pipeline stage of its own?). Under pipeline parallelism, pass the DeviceMesh as the Monitor's "
                "device_mesh= with its pipeline dimension named 'pp' (or 'pipeline', 'pipeline_parallel') and clip "
                "with monitor.clip_grad_norm_ (distmetrics.clip_grad_norm_ takes no mesh)" + tail)
    if sets:
        this = "this rank" if rank is None else f"this rank (rank {rank})"
        mine = f"; {this} has none for {_shown(lacking)}" if stage in sets and lacking else ""
        return (f"{call}: the ranks{where} hold gradients of different plain (not sharded) parameters"
                f"{f' ({counts})' if counts else ''}{mine}. A plain (not DTensor) gradient is counted once, as the "
                "copy every data-parallel rank holds (DDP's, or the loop's own beside FSDP2's sharded gradients), so "
                "each rank must hold one for the same parameters: the norm would be one rank's, and a clip would "
                "scale every rank by it. A parameter whose .grad is None on some ranks only (set to None there, or "
                "left out of that rank's backward where nothing reduces it) has no copy there: give it a gradient on "
                "every rank (p.grad = torch.zeros_like(p) where a rank has none), or on none. Where ranks hold "
                "different modules (pipeline stages), pass the DeviceMesh as the Monitor's device_mesh= with its "
                "pipeline dimension named 'pp' (or 'pipeline', 'pipeline_parallel'), or initialise Megatron's "
                "parallel_state: without either, every rank is taken for a replica of one model" + tail)
    if stage in bad and names:  # one fingerprint of them all is compared: which of them differ is not known
        what += " (this rank's; one or more of them)" if len(names) > 1 else " (this rank's)"
    return (f"{call}: the gradients of {what}{where} differ across ranks: a plain (not DTensor) gradient is counted "
            "once, as the copy every data-parallel rank holds (DDP's, or the loop's own beside FSDP2's sharded "
            "gradients; and every tensor-parallel rank: a LayerNorm a tensor-parallel plan leaves plain), so the norm "
            "would be one rank's, not each rank's, and a clip would scale every rank by it. "
            "Nothing reduces a parameter outside fully_shard and DDP: all-reduce their gradients over the "
            "data-parallel ranks (sum, then divide by their number) before measuring or clipping, or shard them too "
            "(fully_shard(model) on the root, after its submodules). Where ranks hold different layers (pipeline "
            "stages), pass the DeviceMesh as the Monitor's device_mesh= with its pipeline dimension named 'pp': "
            "without one, every rank is taken for a replica of one model; where each rank trains a model of its "
            "own, give each rank a Monitor of its own (Monitor(group=...)). DDP all-reduces only the parameters that "
            "required a gradient when it was made: one frozen then and unfrozen since keeps each rank's gradient "
            "(wrap the model in DDP again after unfreezing it), and so does one of a module added since (an "
            "adapter). A DDP communication hook that does not "
            "all-reduce every step (post-local SGD averages parameters now and then) leaves each rank's gradients "
            "its own: their norm is each rank's, which no one number of the job is" + tail)


def _shown(names: list[str]) -> str:
    """The first four names, quoted, and how many more."""
    return ", ".join(map(repr, names[:4])) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
