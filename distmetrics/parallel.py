"""Where this rank sits, and what it counts: the one place of the ownership rule.

The layout is read from Megatron-Core's ``parallel_state`` when it is initialised, else from a
user's ``DeviceMesh`` (dimension names ``tp``, ``cp``, ``pp`` in any case; every other dimension is
data parallel), else everything is data parallel.

Every metric that sums over ranks must count each token, activation or tensor element once.
Who does is decided here and nowhere else:

* :func:`sees_distinct_tokens` — tensor- and context-parallel peers see the same tokens and
  activations; their rank 0 counts them (MoE routing counts, activation statistics);
* :func:`counts_batch_tokens` — that, on the last pipeline stage (throughput's tokens);
* :func:`holds_first_replica` — that, on data-parallel rank 0 (weight statistics);
* :func:`owns_local_piece` — the norm rule: does this rank's local piece of a parameter (or of
  its gradient) count, so that Σ over ranks of w·‖local‖² counts every element once;
  :func:`owns_shard_piece` — the same for a slice that Megatron's distributed optimizer gave
  this rank (data-parallel ranks hold different slices: only the tensor-parallel rule remains);
* :func:`plain_replica` — a plain tensor every rank holds a copy of, which weight statistics take
  from the lowest rank that ran its layer (:data:`~distmetrics.tensor_stats.rank_merge.REPLICA`),
  not from a rank decided in advance, which may have skipped the layer in the step.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from .meshes import (MODEL_DIMS_BY_KIND, dim_kind, dim_name, first_copy_outside, layout_mesh, layout_meshes_of,
                     named_mesh_of, say_names, spans, unknown_names)
from .names import is_dtensor, local_value as local_tensor  # local_tensor: this rank's piece of a DTensor

__all__ = ["Layout", "detect_layout", "monitor_ranks", "RankInfo", "data_parallel_group", "sees_distinct_tokens",
           "tp_cp_leader", "model_parallel_mesh", "named_mesh_of",
           "counts_batch_tokens", "holds_first_replica", "owns_local_piece", "owns_shard_piece", "local_tensor",
           "is_dtensor", "plain_replica"]

logger = logging.getLogger("distmetrics")


@dataclass
class RankInfo:
    """Where a rank runs (gathered once at start for reports)."""

    rank: int
    hostname: str
    local_rank: Optional[int]
    """From the launcher's variable, or its place among its host's ranks (filled in by the gather)."""
    pid: int
    gpu: Optional[dict] = None
    """The rank's GPU (name, SMs, capability, memory, UUID, driver, CUDA runtime), if any."""
    problem: Optional[str] = None
    """Why this rank cannot start (e.g. the writer cannot write ``output_dir``); every rank raises it."""
    settings: tuple = ()
    """The config values every rank must share (``runinfo.SHARED_KEYS``), compared at start-up."""
    config_problem: bool = False
    """``problem`` is a config error (the features file, say): raised as a ConfigError where every
    rank's problem is one."""
    claim_problem: bool = False
    """``problem`` is the writer's claim on ``output_dir`` refused (left out where writer_rank differs)."""


@dataclass
class Layout:
    """This rank's place in the job."""

    rank: int = 0
    """This rank's global rank (the world's numbering, also under ``Monitor(group=...)``)."""
    world_size: int = 1
    """How many ranks the Monitor reduces over: its process group's (the world's by default)."""
    ranks: tuple = (0,)
    """The global ranks of the Monitor's process group in its rank order: every collective the
    Monitor makes runs over them, and its records hold their values."""
    group: Any = None
    """The Monitor's process group (None: the world)."""
    local_rank: int = 0
    hostname: str = field(default_factory=socket.gethostname)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pp_style: str = "loop"
    """The config's ``pipeline_style``: ``loop`` (the last stage on the last pipeline rank) or ``v``
    (on pipeline rank 0)."""
    cp_rank: int = 0
    dp_rank: int = 0
    """Data-parallel rank within this model-parallel slice (Megatron: within the stage)."""
    source: str = "data-parallel"
    """``megatron``, ``device_mesh`` or ``data-parallel``."""
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    expert_group: Any = None
    device_mesh: Any = None
    problem: Optional[str] = None
    """Why the Monitor cannot use this layout (said on every rank by the start-up gather), or None."""

    @property
    def says_once(self) -> bool:
        """True on the first of the Monitor's ranks, which gives a job's once-per-job warnings (under
        ``Monitor(group=...)`` global rank 0 may be another job's: this job heard nothing)."""
        return self.rank == self.ranks[0]

    def writer(self, which: str) -> int:
        """The global rank that writes the records: the first or the last (``which``, the config's
        ``writer_rank``) of the Monitor's ranks."""
        return self.ranks[0 if which == "first" else -1]

    @property
    def is_last_stage(self) -> bool:
        """True on the rank holding the last pipeline stage (the one computing the loss): the last
        pipeline rank, or the first under ``pipeline_style="v"``."""
        return self.pp_rank == (0 if self.pp_style == "v" else self.pp_size - 1)


def detect_layout(device_mesh: Optional[Any] = None, group: Any = None) -> Layout:
    """Build the :class:`Layout` of this rank in a Monitor reducing over ``group`` (None: the
    world); a rank outside ``group`` is refused (:func:`monitor_ranks`)."""
    layout = Layout(local_rank=local_rank_from_env() or 0)
    layout.ranks = monitor_ranks(group)
    if dist.is_available() and dist.is_initialized():
        layout.rank = dist.get_rank()
    layout.group = None if group is None or group is dist.group.WORLD else group
    layout.world_size = len(layout.ranks)
    layout.dp_rank = layout.ranks.index(layout.rank)
    ps = _megatron_parallel_state()
    if ps is not None:
        layout.source = "megatron"
        layout.tp_rank = ps.get_tensor_model_parallel_rank()
        layout.tp_size = ps.get_tensor_model_parallel_world_size()
        layout.pp_rank = ps.get_pipeline_model_parallel_rank()
        layout.pp_size = ps.get_pipeline_model_parallel_world_size()
        layout.cp_rank = ps.get_context_parallel_rank()
        layout.dp_rank = ps.get_data_parallel_rank()
        layout.tp_group = ps.get_tensor_model_parallel_group()
        layout.pp_group = ps.get_pipeline_model_parallel_group()
        layout.dp_group = ps.get_data_parallel_group()
        try:
            layout.expert_group = ps.get_expert_model_parallel_group()
        except (AssertionError, AttributeError, RuntimeError):
            layout.expert_group = None
        if layout.group is not None:  # Megatron's groups span the world it was initialised over
            layout.problem = _outside(layout, {"tensor": layout.tp_group, "pipeline": layout.pp_group,
                                               "data": layout.dp_group, "expert": layout.expert_group})
    elif device_mesh is not None:
        _read_mesh(layout, device_mesh)
    if layout.source == "data-parallel":  # over the Monitor's ranks: nvdlfw-inspect's reduction group is theirs
        layout.dp_group = layout.group
    return layout


def _read_mesh(layout: Layout, given: Any) -> None:
    """Fill ``layout`` from the mesh whose dimension names say who is who (:func:`layout_mesh`) where
    it spans the Monitor's ranks; else say so and leave the layout data parallel (a part of the job
    cannot say which of its ranks are data-parallel peers)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(given, DeviceMesh):
        raise TypeError(f"device_mesh: expected a torch DeviceMesh (init_device_mesh(...)), got "
                        f"{type(given).__name__} {given!r:.80}")
    mesh = layout_mesh(given)
    names = tuple(mesh.mesh_dim_names or ())
    if not spans(mesh, layout.ranks):
        if layout.says_once:
            held, ranks = set(mesh.mesh.flatten().tolist()), set(layout.ranks)
            logger.warning("distmetrics: device_mesh (dimensions %s) spans %d of the Monitor's %d ranks%s, so it "
                           "cannot say which ranks are data-parallel (a mesh sliced or unflattened from a 1-D world "
                           "mesh, as torchtitan's are, is read as it is) and is not read: pass the whole job's mesh "
                           "(torchtitan: the data mesh, with its pp, dp, cp and tp dimensions)", names,
                           len(held & ranks), len(ranks), f" and {len(held - ranks)} others" if held - ranks else "")
        return
    layout.source = "device_mesh"
    layout.device_mesh = mesh
    dp_rank = 0
    for dim, coordinate in enumerate(mesh.get_coordinate() or []):  # every dimension that is not tp/cp/pp is
        if dim_kind(dim_name(names, dim)) is None:  # data parallel, an unnamed one too (else each rank took itself
            dp_rank = dp_rank * mesh.size(dim) + coordinate  # for rank 0)
    layout.dp_rank = dp_rank
    if layout.says_once:
        say_names(names)
    for attr in MODEL_DIMS_BY_KIND:
        named = [name for name in names if dim_kind(name) == attr]  # two of one kind: ring cp x Ulysses sp, tp x etp
        if attr == "pp" and len(named) > 1:  # stages are ordered and named over one pipeline group
            raise ValueError(f"device_mesh: dimensions {tuple(named)} are each a pipeline-parallel dimension; a "
                             "pipeline has one: give the mesh one pp dimension (flatten the two)")
        if named:  # a rank's place over all of them (0 only where every one is 0), their sizes' product
            rank, size = 0, 1
            for name in named:
                dim = names.index(name)
                rank, size = rank * mesh.size(dim) + mesh.get_local_rank(name), size * mesh.size(dim)
            setattr(layout, f"{attr}_rank", rank)
            if attr in ("tp", "pp"):  # two tp dimensions have no group of their own (only Megatron's is read)
                setattr(layout, f"{attr}_size", size)
                setattr(layout, f"{attr}_group", mesh.get_group(named[0]) if len(named) == 1 else None)


def _outside(layout: Layout, groups: dict) -> Optional[str]:
    """Why a Monitor on a group cannot use the parallel groups the layout came with (Megatron
    initialised over the world under ``Monitor(group=...)``: their collectives would wait for
    another job's ranks, and stages, tokens and replicas be misread), or None. A rank's own groups
    may lie inside while another's do not: the start-up gather says it on every rank together."""
    for what, group in groups.items():
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        outside = sorted(set(ranks) - set(layout.ranks))
        if outside:
            return (f"Monitor(group=...): Megatron's {what}-parallel group of rank {layout.rank} holds ranks "
                    f"{outside} outside the Monitor's group {list(layout.ranks)}: initialise parallel_state over the "
                    "job's ranks (its groups inside the Monitor's), or leave group= out")
    return None


def monitor_ranks(group: Any = None, call: str = "Monitor") -> tuple[int, ...]:
    """The global ranks a Monitor on ``group`` reduces over, in the group's rank order (the world's
    for None or ``dist.group.WORLD``; ``(0,)`` without torch.distributed). A rank outside ``group``
    is refused here, before the Monitor's first collective: the group's ranks go on without it.
    ``call``: what was given the group, for messages (``dm.clip_grad_norm_``)."""
    initialised = dist.is_available() and dist.is_initialized()
    if group is None or (initialised and group is dist.group.WORLD):
        return tuple(range(dist.get_world_size())) if initialised else (0,)
    what = "Monitor" if call == "Monitor" else "clip"
    if not initialised:
        raise ValueError(f"{call}(group={group!r}): torch.distributed is not initialised; call "
                         f"init_process_group(...) before making the group and the {what}, or leave group= out")
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{call}(group=...): rank {dist.get_rank()} is not one of the group's ranks (on a rank "
                         "outside it dist.new_group(ranks) returns a placeholder, not a group, so its ranks are not "
                         f"known here): make that group's {what} on its ranks only, and give this rank a {what} "
                         "on a group that holds it, or none")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{call}(group=...): expected a torch.distributed process group (dist.new_group(ranks)) "
                        f"or None for the world, got {type(group).__name__} {group!r:.80}")
    ranks = tuple(dist.get_process_group_ranks(group))
    if dist.get_rank() not in ranks:
        raise ValueError(f"{call}(group=...): rank {dist.get_rank()} is not one of the group's ranks {list(ranks)}: "
                         f"make the {what} on the group's ranks only")
    return ranks


LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""Where launchers put a process's rank on its node: torchrun, srun, Open MPI, MPICH/Intel MPI."""


def local_rank_from_env() -> Optional[int]:
    """This process's rank on its node as its launcher says, or None (no launcher variable: the
    start-up gather then counts it among the ranks on its host)."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def data_parallel_group(layout: Layout) -> Any:
    """The process group of this rank's data-parallel peers (``None``: the whole world).

    Megatron's comes from ``parallel_state``. A DeviceMesh's is its one data-parallel
    dimension, its data-parallel dimensions flattened (HSDP), the whole mesh where its
    dimensions are unnamed, or a group of this rank alone when every dimension is tp/cp/pp.
    Made on first use and kept; every rank must ask (flattening a mesh creates groups)."""
    if layout.dp_group is not None or layout.device_mesh is None:
        return layout.dp_group
    mesh = layout.device_mesh
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if dim_kind(n) is None)
    if not mesh.mesh_dim_names:  # unnamed dimensions are data parallel: the whole mesh
        layout.dp_group = mesh.get_group() if mesh.ndim == 1 else \
            dist.new_group(mesh.mesh.flatten().tolist(), use_local_synchronization=True)  # the mesh's ranks ask
    elif not names:
        layout.dp_group = dist.new_group([layout.rank], use_local_synchronization=True)
    elif len(names) == 1:
        layout.dp_group = mesh.get_group(names[0])
    else:
        layout.dp_group = mesh[names]._flatten().get_group()
    return layout.dp_group


def _megatron_parallel_state():
    """Megatron's parallel_state if the program imported it and initialised model parallelism."""
    if "megatron.core" not in sys.modules:
        return None  # don't pay Megatron's import time for programs that don't use it
    try:
        from megatron.core import parallel_state as ps
    except Exception:  # noqa: BLE001 - a broken optional install means "not Megatron"
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


# --- the ownership rule -----------------------------------------------------------------------

def sees_distinct_tokens(layout: Layout) -> bool:
    """False on tensor- and context-parallel peers other than rank 0: they see the same tokens."""
    return layout.tp_rank == 0 and layout.cp_rank == 0


def tp_cp_leader(layout: Layout) -> int:
    """The global rank of the first rank of this rank's tensor- x context-parallel group (the
    ranks that see the same tokens): Megatron's group, the DeviceMesh ranks that differ from this
    one in tp/cp coordinates only, or this rank alone."""
    if layout.source == "megatron":
        ps = _megatron_parallel_state()
        if ps is not None:
            return min(dist.get_process_group_ranks(ps.get_tensor_and_context_parallel_group()))
    mesh = layout.device_mesh
    if layout.source == "device_mesh" and mesh is not None and mesh.get_coordinate() is not None:
        names = tuple(mesh.mesh_dim_names or ())
        at = tuple(0 if dim_kind(dim_name(names, i)) in ("tp", "cp") else c
                   for i, c in enumerate(mesh.get_coordinate()))
        return int(mesh.mesh[at])
    return layout.rank


def counts_batch_tokens(layout: Layout) -> bool:
    """True on one rank per data-parallel replica of a batch: the one that counts its tokens.
    Every pipeline stage sees the batch; the last stage (which holds the loss) counts it."""
    return sees_distinct_tokens(layout) and layout.is_last_stage


def holds_first_replica(layout: Layout) -> bool:
    """True where this rank's weights are the copy that counts (data-parallel rank 0, TP/CP rank 0)."""
    return sees_distinct_tokens(layout) and layout.dp_rank == 0


def owns_local_piece(t: torch.Tensor, param: Any, name: str, layout: Layout, group: Any = None,
                     reference: Any = None, summed: bool = False) -> bool:
    """Does this rank's local piece of ``t`` (a parameter or its gradient) count toward a norm?

    * DTensor (FSDP2, HSDP, TP, FSDP2+TP): yes iff the mesh coordinate is 0 on every mesh
      dimension whose placement is ``Replicate`` (``Shard`` dimensions count everywhere), and
      its mesh is the copy that counts among those of the job's mesh (:func:`~distmetrics.meshes.first_copy_outside`:
      ``reference``, else the layout's mesh); ``Partial`` is refused, unless ``summed``: the caller
      measures the reduced tensor, the same on every rank of that dimension, a copy as ``Replicate``.
    * Megatron-Core: ``tensor_model_parallel`` params count on every TP rank, others on TP rank 0;
      ``shared`` (the last stage's copy of a tied embedding) never; data-parallel replicas once;
      expert params once per expert-data-parallel group.
    * A plain tensor on a DeviceMesh (``torch.distributed.pipelining`` stages, DDP over a mesh
      dimension): each pipeline stage holds its own, copied over the other dimensions, so it
      counts where the mesh coordinate is 0 on every dimension but the pipeline's (``pp``,
      ``pipeline`` or ``pipeline_parallel``).
    * Anything else (DDP, no wrapper): replicas count on rank 0 of ``group`` only.
    """
    if is_dtensor(t):
        if reference is None and layout is not None:
            reference = layout.device_mesh
        return _owns_dtensor_piece(t, name, reference, summed)
    if layout.source == "megatron":
        return _megatron_owns(param, layout)
    if layout.source == "device_mesh":
        return holds_first_replica(layout)
    return (dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0) == 0


def plain_replica(t: torch.Tensor, layout: Optional[Layout]) -> bool:
    """Is ``t`` a plain tensor copied on every rank that holds its layer (DDP, no wrapper, a plain
    tensor on a DeviceMesh: the last two rules of :func:`owns_local_piece`), not a DTensor or a
    Megatron-Core parameter (whose tensor-parallel pieces differ)? On a mesh with pipeline stages
    each stage holds its own layers, named apart, so the lowest rank sending one is of its stage."""
    return not is_dtensor(t) and (layout is None or layout.source != "megatron")


def owns_shard_piece(param: Any, layout: Layout) -> bool:
    """Does this rank's slice of ``param`` from Megatron's distributed optimizer count? Every
    data-parallel (and context-parallel) rank owns a different slice, so only the tensor-parallel
    rule applies: ``tensor_model_parallel`` params on every TP rank, others on TP rank 0 (expert
    params: expert-TP rank 0); ``shared`` (the last stage's tied embedding) never."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True):  # an expert parameter
        from megatron.core import parallel_state as ps

        try:
            return ps.get_expert_tensor_parallel_rank() == 0
        except (AttributeError, AssertionError):
            pass
    return layout.tp_rank == 0


def _owns_dtensor_piece(t: Any, name: str, reference: Any = None, summed: bool = False) -> bool:
    mesh = t.device_mesh
    coords = mesh.get_coordinate()
    if coords is None:  # this rank is not in the tensor's mesh
        return False
    for dim, placement in enumerate(t.placements):
        kind = type(placement).__name__
        if placement.is_replicate() or summed and placement.is_partial():
            if coords[dim] != 0:
                return False
        elif placement.is_shard() or "Shard" in kind:  # Shard, _StridedShard (FSDP2 over TP)
            continue
        else:
            raise ValueError(
                f"parameter {name!r} has a {kind} placement on mesh dimension {dim}; norms are defined "
                "for Shard and Replicate placements only (reduce the gradient before measuring)"
            )
    return first_copy_outside(mesh, reference)


def model_parallel_mesh(model: Any, layout: Optional[Layout] = None) -> Any:
    """The mesh that says ``model``'s layout (:func:`layout_mesh` of a DTensor parameter's mesh)
    where one has a tensor-, context- or pipeline-parallel dimension (or a name folding one, as
    ``dp_shard_cp``) and spans the Monitor's ranks (``layout``'s; the world's without it): a model
    parallelized over a named mesh, given to the Monitor without ``device_mesh`` (torchtitan's TP
    weights sit on its compute mesh's ``dp_shard_cp`` x ``tp``, its other weights on
    ``dp_shard_cp`` alone); else None: without it every TP rank counted its batch's tokens and its
    copy of a replicated activation's statistics, and every pipeline stage its batch's tokens."""
    if not isinstance(model, torch.nn.Module):
        return None
    layout = layout or detect_layout()
    mesh, part = named_mesh_of(model.parameters(), layout.ranks)
    if mesh is None and part is not None and layout.says_once:
        logger.warning("distmetrics: the model's DeviceMesh has dimensions %s but spans %d of the %d ranks, so it "
                       "cannot say which ranks are data-parallel: pass device_mesh= (the whole job's mesh), or every "
                       "tensor-parallel rank and pipeline stage counts its batch's tokens (and a loss passed on a "
                       "stage other than the last is averaged in)",
                       part.mesh_dim_names, part.size(), layout.world_size)
    elif mesh is None and part is None and layout.says_once:
        meshes = list(layout_meshes_of(model.parameters()))
        loose = next((m for m in meshes if not spans(m, layout.ranks)), None)
        unknown = sorted({name for m in meshes for name in unknown_names(tuple(m.mesh_dim_names or ()))})
        if loose is None and unknown:  # a model parallelized over ("dp", "model"): said as with device_mesh=
            say_names(tuple(unknown))
        if loose is not None:
            logger.warning("distmetrics: the model's DTensors sit on a DeviceMesh of %d of the %d ranks (dimensions "
                           "%s) and no mesh names a tensor-, context- or pipeline-parallel dimension, so which of the "
                           "other ranks are data-parallel copies and which pipeline stages or tensor-parallel peers "
                           "cannot be told: every rank counts its batch's tokens (a mesh unflattened from a 1-D world "
                           "mesh names nothing above its own dimensions), and where ranks outside that mesh hold "
                           "copies of its parameters (experts sharded over an ep mesh alone) the gradient, parameter "
                           "and update norms count every copy. Pass device_mesh= (the whole job's mesh)",
                           loose.size(), layout.world_size, loose.mesh_dim_names)
    return mesh


def _megatron_owns(p: Any, layout: Layout) -> bool:
    from megatron.core import parallel_state as ps

    if getattr(p, "shared", False):
        return False  # the last stage's copy of a tied embedding; the first stage counts it
    tensor_parallel = bool(getattr(p, "tensor_model_parallel", False))
    if not getattr(p, "allreduce", True):  # an expert parameter
        try:
            if ps.get_expert_data_parallel_rank() != 0:
                return False
            return tensor_parallel or ps.get_expert_tensor_parallel_rank() == 0
        except (AttributeError, AssertionError):
            pass
    if ps.get_data_parallel_rank() != 0 or layout.cp_rank != 0:
        return False
    return tensor_parallel or layout.tp_rank == 0
