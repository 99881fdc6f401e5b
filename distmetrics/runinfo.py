"""Who runs the job: every rank's host, local rank and GPU (gathered once at start), and the
``run`` record that opens each job in ``metrics.jsonl``."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .parallel import Layout, RankInfo
from .sinks import SinkSet, open_sinks

__all__ = ["gather_rank_info", "run_record", "open_writer_sinks"]


def gather_rank_info(layout: Layout) -> list[RankInfo]:
    """Every rank's host, local rank and GPU, in one ``all_gather_object`` at start."""
    gpu = None
    if torch.cuda.is_available():
        from .collectors.nvml import gpu_model_info

        gpu = gpu_model_info(layout.rank)
    mine = RankInfo(layout.rank, socket.gethostname(), layout.local_rank, os.getpid(), gpu)
    if layout.world_size == 1 or not dist.is_initialized():
        return [mine]
    rows: list[Any] = [None] * layout.world_size
    dist.all_gather_object(rows, mine)
    return rows


def run_record(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int,
               modules: Sequence[str] = ()) -> dict[str, Any]:
    """The fields of the ``run`` record: world, ranks and hosts, the model's module names in model
    order (nearest the input first; a report draws per-module norms in this order, the metric
    records hold them sorted by name), versions, argv, the config."""
    from . import __version__

    return {
        "world_size": layout.world_size,
        "writer_rank": writer_rank,
        "hosts": sorted({h.hostname for h in hosts}),
        "ranks": [{"rank": h.rank, "host": h.hostname, "local_rank": h.local_rank} for h in hosts],
        "modules": list(modules),
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "layout": layout.source,
        "torch_version": torch.__version__,
        "distmetrics_version": __version__,
        "python_version": platform.python_version(),
        "argv": sys.argv,
        "config": config.to_dict(redact=True),
    }


def open_writer_sinks(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int, extra: tuple,
                      modules: Sequence[str] = ()) -> SinkSet:
    """The writer rank's sinks, opened with the job's ``run`` record (and ``gpu_model`` on GPUs)."""
    sinks = open_sinks(config, layout.world_size, extra)
    sinks.log(run_record(config, layout, hosts, writer_rank, modules), 0, "run")
    gpus = [h.gpu for h in hosts if h.gpu is not None]
    if gpus:
        sinks.log({"ranks": gpus}, 0, "gpu_model")
    return sinks
