"""The job's module names in model order across pipeline stages, the same on every rank: each
stage holds its own modules only, so the stages' lists are gathered once at start over the pipeline
group (what a rank receives grows with the model, not the world), ordered by stage (virtual pipeline
chunks by the stage each chunk is), and named apart where two stages' names collide."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.distributed as dist

from .naming import merged_across_stages
from .parallel import Layout
from .peers import InCollective

__all__ = ["job_module_order"]

logger = logging.getLogger("distmetrics")


def job_module_order(layout: Layout, local: Sequence[str], guard: Any = None, chunked: bool = False,
                     owners: Sequence[str] = ()) -> tuple[list[str], str]:
    """The job's module names in model order, the same on every rank, and what this rank's module
    names start with (``""``, or ``stage<k>.`` where stages' names collide): with pipeline stages,
    each stage's in stage order, gathered over this rank's pipeline group (the stages' lists: what it
    receives grows with the model, not the world; a rank holds its stage's modules only: the
    writer's alone put the last stage first in the report, and each stage named a different
    module as the first non-finite one); else this rank's (``local``). ``chunked``: the model is a
    ``ModuleList`` of virtual pipeline chunks (names start with the chunk's index) on every rank of the
    group, ordered by the stage each chunk is (:func:`_stage_of`): chunk 0 of every rank, then chunk 1
    of every rank (in reverse rank order under ``pipeline_style="v"``). ``owners``: this rank's names
    of modules holding parameters (:func:`~distmetrics.naming.owner_names`); where a name of one stage's
    is another's too (stage-local names: each stage's own ``ModuleList`` numbers from 0), their norms
    would sum different modules under it, so every module of the job is named with its pipeline rank
    (``stage1.layers.0``), said once. Every pipeline group decides alike: its stages' names are the
    same whatever the data- or tensor-parallel coordinate."""
    group = layout.pp_group
    if layout.pp_size <= 1 or group is None or not (dist.is_available() and dist.is_initialized()):
        return list(local), ""
    if guard is not None:
        guard.enter("Monitor()")
    stages: list[Any] = [None] * layout.pp_size
    with InCollective("the start-up gather of the pipeline stages' module names", "Monitor()"):
        dist.all_gather_object(stages, (layout.pp_rank, tuple(local), chunked, tuple(owners)), group=group)
    stages.sort(key=lambda s: s[0])
    merged = merged_across_stages([held for *_, held in stages])
    if merged is not None and layout.says_once:
        name, a, b = merged
        logger.warning("distmetrics: pipeline stages %d and %d both hold a module named %r (different modules: each "
                       "stage names its own from its root, and a ModuleList made per stage numbers its layers from 0 "
                       "on every stage), so every module's name starts with its pipeline stage ('stage%d.%s', "
                       "'stage%d.%s') in grad_norm/, param_norm/, update_norm/, tensor_stats/ and the run record's "
                       "modules. Name the stages' modules apart (Megatron's layer_number gives a layer its global "
                       "index) to keep them unprefixed", a, b, name, a, name, b, name)
    named = [(rank, ([""] if merged else []) + list(names)) for rank, names, _, _ in stages]
    if all(chunks for _, _, chunks, _ in stages):
        keyed = sorted((_stage_of(_chunk_index(name), rank, layout), rank, at, name)
                       for rank, names in named for at, name in enumerate(names))
    else:
        keyed = [(rank, rank, at, name) for rank, names in named for at, name in enumerate(names)]
    if merged is None:
        return list(dict.fromkeys(name for *_, name in keyed)), ""
    return [f"stage{rank}.{name}".rstrip(".") for _, rank, _, name in keyed], f"stage{layout.pp_rank}."


def _stage_of(chunk: int, pp_rank: int, layout: Layout) -> int:
    """The pipeline stage that chunk ``chunk`` of pipeline rank ``pp_rank`` is: ``chunk·pp + pp_rank``
    (``loop``); under ``v`` the odd chunks run back down the ranks (rank r holds stages r and
    2·pp − 1 − r). The root's own name (chunk -1) comes first."""
    if chunk < 0:
        return -1
    pp = layout.pp_size
    return chunk * pp + (pp - 1 - pp_rank if layout.pp_style == "v" and chunk % 2 else pp_rank)


def _chunk_index(name: str) -> int:
    """The virtual pipeline chunk a module of a ``ModuleList`` of chunks belongs to (its name's first
    part); -1 for the root's own name, which comes first."""
    first = name.split(".", 1)[0]
    return int(first) if first.isdigit() else -1
