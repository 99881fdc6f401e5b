"""Where this rank sits: world, data/tensor/pipeline/context-parallel coordinates.

Read from Megatron-Core's ``parallel_state`` when it is initialised, else from a user's
``DeviceMesh`` (dimension names ``tp``, ``cp``, ``pp``; every other dimension is data
parallel), else everything is data parallel.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["Layout", "detect_layout", "RankInfo"]


@dataclass
class RankInfo:
    """Where a rank runs (gathered once at start for reports)."""

    rank: int
    hostname: str
    local_rank: int
    pid: int
    gpu: Optional[dict] = None
    """The rank's GPU (name, SMs, capability, memory, UUID, driver, CUDA runtime), if any."""


@dataclass
class Layout:
    """This rank's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    hostname: str = field(default_factory=socket.gethostname)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
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

    @property
    def is_data_representative(self) -> bool:
        """True on one rank per data-parallel replica of a batch: the one that counts its tokens.

        Tensor- and context-parallel peers see the same tokens; only their rank 0 counts them.
        Every pipeline stage sees the batch; the last stage (which holds the loss) counts it.
        """
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def detect_layout(device_mesh: Optional[Any] = None) -> Layout:
    """Build the :class:`Layout` of this rank."""
    layout = Layout(local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_available() and dist.is_initialized():
        layout.rank = dist.get_rank()
        layout.world_size = dist.get_world_size()
        layout.dp_rank = layout.rank
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
    elif device_mesh is not None:
        layout.source = "device_mesh"
        layout.device_mesh = device_mesh
        names = tuple(device_mesh.mesh_dim_names or ())
        coords = device_mesh.get_coordinate() or []
        dp_rank = 0
        for dim, name in enumerate(names):  # every dimension that is not tp/cp/pp is data parallel
            if name not in ("tp", "cp", "pp"):
                dp_rank = dp_rank * device_mesh.size(dim) + coords[dim]
        layout.dp_rank = dp_rank
        for dim_name, attr in (("tp", "tp"), ("cp", "cp"), ("pp", "pp")):
            if dim_name in names:
                coordinate = device_mesh.get_local_rank(dim_name)
                setattr(layout, f"{attr}_rank", coordinate)
                if attr in ("tp", "pp"):
                    setattr(layout, f"{attr}_size", device_mesh.size(names.index(dim_name)))
                    setattr(layout, f"{attr}_group", device_mesh.get_group(dim_name))
    return layout


def data_parallel_group(layout: Layout) -> Any:
    """The process group of this rank's data-parallel peers (``None``: the whole world).

    Megatron's comes from ``parallel_state``. A DeviceMesh's is its one data-parallel
    dimension, its data-parallel dimensions flattened (HSDP), or a group of this rank alone
    when every dimension is tp/cp/pp. Made on first use and kept; every rank must ask
    (flattening a mesh creates groups)."""
    if layout.dp_group is not None or layout.device_mesh is None:
        return layout.dp_group
    mesh = layout.device_mesh
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n not in ("tp", "cp", "pp"))
    if not names:
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
