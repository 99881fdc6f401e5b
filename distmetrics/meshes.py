"""Device meshes by their dimension names: which dimensions are tensor-, context- and pipeline-parallel
(every other one is data parallel), which mesh says who is who for a sub-mesh (the one it was sliced or
flattened from, or itself where it was unflattened from a 1-D world mesh, as torchtitan's are), and which
copy of a DTensor on a sub-mesh counts. Used by :mod:`distmetrics.parallel`, the one place of the
ownership rule."""

from __future__ import annotations

import logging
import re
from typing import Any, Iterator, Optional

import torch

from .names import is_dtensor

logger = logging.getLogger("distmetrics")

__all__ = ["MODEL_DIMS_BY_KIND", "dim_kind", "dim_name", "folds", "borrows", "unknown_names", "say_names",
           "layout_mesh", "spans", "named_mesh_of", "layout_meshes_of", "first_copy_outside"]

MODEL_DIMS_BY_KIND = {"tp": frozenset({"tp", "tensor_parallel", "tensor_model_parallel", "etp",
                                        "expert_tensor_parallel"}),
                       "cp": frozenset({"cp", "context_parallel", "sp", "sequence_parallel", "ulysses"}),
                       "pp": frozenset({"pp", "pipeline", "pipeline_parallel", "pipeline_model_parallel"})}
"""Mesh dimension names (in any case, words joined by ``_``, ``-`` or ``.``) of tensor (``etp``: expert tensor
parallel; Megatron's long names too), context (``sp``, ``sequence_parallel``, ``ulysses``: Ulysses sequence
parallel, whose ranks share a batch too) and pipeline parallelism; every other dimension is data parallel."""
_LONG_ALIASES = tuple(sorted(alias for aliases in MODEL_DIMS_BY_KIND.values() for alias in aliases if "_" in alias))
"""The aliases of more than one word, found whole inside a longer name (``dp_context_parallel``)."""
_DATA_HINTS = ("dp", "data", "replicate", "shard", "fsdp", "ddp", "batch", "world")
"""Parts of the names of data-parallel dimensions (dp, dp_shard, dp_replicate, hsdp, efsdp, torchtitan's batch
and world, ...)."""
_EXPERT_PARTS = frozenset({"ep", "expert", "experts"})
"""Words of an expert-parallel dimension's name (``ep``, ``moe_ep``, ``expert_model_parallel``): where no data-parallel
word is beside them (``efsdp``, ``expert_data_parallel``, ``ep_shard`` are the experts' data parallelism), its
ranks see different batches but may hold context- or tensor-parallel ranks whole (torchtitan's ep borrows all of
cp, and of tp where etp is 1)."""


def _words(name: str) -> list[str]:
    """The lowercase words of a dimension's name, split at ``_``, ``-``, ``.`` and any other non-alphanumeric."""
    return [word for word in re.split(r"[^a-z0-9]+", name.lower()) if word]


def dim_kind(name: str) -> Optional[str]:
    """``tp``, ``cp`` or ``pp`` for a model-parallel mesh dimension's name, else None (data parallel)."""
    low = "_".join(_words(name))
    return next((kind for kind, aliases in MODEL_DIMS_BY_KIND.items() if low in aliases), None)


def borrows(name: str) -> bool:
    """An expert-parallel dimension's name (see :data:`_EXPERT_PARTS`)."""
    words = _words(name)
    return (dim_kind(name) is None and any(word in _EXPERT_PARTS for word in words)
            and not any(hint in word for word in words for hint in _DATA_HINTS))


def folds(name: str) -> bool:
    """A data-parallel name with a model-parallel word (torchtitan's ``dp_shard_cp``, ``dp_cp``, ``dp-cp``,
    ``dp_context_parallel``), or an expert-parallel one (:func:`borrows`): its ranks may share a batch, which
    its one coordinate cannot tell."""
    if dim_kind(name) is not None:
        return False
    words = _words(name)
    joined = "_" + "_".join(words) + "_"
    return (borrows(name) or any(dim_kind(word) for word in words)
            or any(f"_{alias}_" in joined for alias in _LONG_ALIASES))


def _looks_data_parallel(name: str) -> bool:
    """A name of a data-parallel dimension, not to be warned of (see :data:`_DATA_HINTS`)."""
    return any(hint in word for word in _words(name) for hint in _DATA_HINTS)


def unknown_names(names: tuple) -> list:
    """The names taken for data parallel that neither look it nor fold a model-parallel dimension (``model``)."""
    return [name for name in names if dim_kind(name) is None and not folds(name) and not _looks_data_parallel(name)]


def say_names(names: tuple) -> None:
    """Warn of the layout mesh's dimensions taken for data parallel that may not be: an unknown name, or
    one that folds a model-parallel dimension into data parallel (their ranks would each count a batch)."""
    folded = [name for name in names if folds(name)]
    unknown = unknown_names(names)
    if folded:
        logger.warning("distmetrics: DeviceMesh dimension(s) %s may hold context-, tensor- or pipeline-parallel "
                       "ranks (torchtitan's dp_shard_cp holds cp, its ep cp and, where etp is 1, tp): where they do "
                       "(cp or tp above 1), that part cannot be told apart, so each of their ranks counts its "
                       "batch's tokens (tokens/s, consumed tokens and MFU times that part's size); then pass the "
                       "mesh with cp, tp and pp as dimensions of their own (torchtitan: the data mesh, not a compute "
                       "mesh). Norms are exact either way.", ", ".join(map(repr, folded)))
    if unknown:
        logger.warning("distmetrics: DeviceMesh dimension(s) %s are taken for data parallel (their ranks count "
                       "tokens and hold replicas); name tensor-, context- and pipeline-parallel dimensions "
                       "tp, cp and pp (or tensor_parallel, tensor_model_parallel, etp, expert_tensor_parallel, "
                       "context_parallel, sp, sequence_parallel, ulysses, pipeline, pipeline_parallel, "
                       "pipeline_model_parallel).",
                       ", ".join(map(repr, unknown)))


def layout_mesh(mesh: Any) -> Any:
    """The mesh whose dimension names say who is who for ``mesh``: the mesh it was sliced or
    flattened from where that has more dimensions (``mesh["dp"]``, the mesh FSDP2 is given, of a
    dp x tp mesh; a flattened ``dp_shard_cp``: their names alone took tensor- or context-parallel
    ranks for data-parallel ones, multiplying tokens/s and MFU), else ``mesh`` itself (torchtitan's
    meshes, unflattened from a 1-D world mesh whose one dimension names nothing)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    return root if root is not None and root.ndim > mesh.ndim else mesh


def spans(mesh: Any, ranks: tuple) -> bool:
    """Does ``mesh`` hold exactly ``ranks`` (the Monitor's)?"""
    return sorted(mesh.mesh.flatten().tolist()) == sorted(ranks)


def dim_name(names: tuple, dim: int) -> str:
    """The name of mesh dimension ``dim`` ("" where the mesh has no names)."""
    return names[dim] if dim < len(names) else ""


def named_mesh_of(tensors: Any, ranks: tuple) -> tuple[Any, Any]:
    """(the first layout mesh of the DTensors among ``tensors`` that names a tensor-, context- or
    pipeline-parallel dimension and spans ``ranks``, or None; the first that names one but spans
    other ranks, or None). Each distinct mesh is read once."""
    part = None
    for mesh in layout_meshes_of(tensors):
        # an expert mesh's ep alone does not make it the job's (it may borrow cp and tp: see folds)
        names = mesh.mesh_dim_names or ()
        if any(dim_kind(name) or (folds(name) and not borrows(name)) for name in names):
            if spans(mesh, ranks):
                return mesh, part
            if part is None:
                part = mesh
    return None, part


def layout_meshes_of(tensors: Any) -> Iterator[Any]:
    """The layout mesh (:func:`layout_mesh`) of each distinct mesh of the DTensors among ``tensors``."""
    seen = set()
    for tensor in tensors:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is None or id(mesh) in seen or not is_dtensor(tensor):
            continue
        seen.add(id(mesh))
        yield layout_mesh(mesh)


def first_copy_outside(mesh: Any, reference: Any = None) -> bool:
    """Is this rank's copy of a DTensor on sub-mesh ``mesh`` the one that counts? A sub-mesh (FSDP2's
    dp mesh inside a dp x tp mesh) has copies, its translates, along the other dimensions of the job's
    mesh: ``reference`` where it holds ``mesh``'s ranks, else the mesh ``mesh`` was taken from
    (:func:`layout_mesh`). The translate holding the reference's origin counts: the rank at this rank's
    coordinates on pipeline dimensions (they hold different layers, not copies) and 0 on every other
    one, which also picks one of the copies of a sub-mesh that spans a dimension in part (dp_shard
    inside dp)."""
    ranks = mesh.mesh.flatten()
    if reference is None or not bool(torch.isin(ranks, reference.mesh).all()):
        reference = layout_mesh(mesh)
    if reference.mesh.numel() == ranks.numel():
        return True
    mine = reference.get_coordinate()
    if mine is None:
        return False
    names = reference.mesh_dim_names or ()
    origin = tuple(c if dim_kind(dim_name(names, dim)) == "pp" else 0 for dim, c in enumerate(mine))
    return bool((ranks == reference.mesh[origin]).any())
