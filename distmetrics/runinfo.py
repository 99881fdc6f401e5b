"""Who runs the job: every rank's host, local rank and GPU (gathered once at start), and the
``run`` record that opens each job in ``metrics.jsonl``."""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

from .parallel import Layout, RankInfo
from .redaction import redact_argv
from .runlog import METRICS_FILE, last_logged_step
from .sinks import SinkSet, open_sinks

__all__ = ["gather_rank_info", "run_record", "open_writer_sinks", "first_step"]

logger = logging.getLogger("distmetrics")


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


def run_record(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int) -> dict[str, Any]:
    """The fields of the ``run`` record: world, ranks and hosts, versions, the command line and
    the config, with secret values hidden (:mod:`distmetrics.redaction`)."""
    from . import __version__

    return {
        "world_size": layout.world_size,
        "writer_rank": writer_rank,
        "hosts": sorted({h.hostname for h in hosts}),
        "ranks": [{"rank": h.rank, "host": h.hostname, "local_rank": h.local_rank} for h in hosts],
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "layout": layout.source,
        "torch_version": torch.__version__,
        "distmetrics_version": __version__,
        "python_version": platform.python_version(),
        "argv": redact_argv(sys.argv),
        "config": config.to_dict(redact=True),
    }


def open_writer_sinks(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int, extra: tuple) -> SinkSet:
    """The writer rank's sinks, opened with the job's ``run`` record (and ``gpu_model`` on GPUs);
    they remember the last step an earlier job logged in ``output_dir`` (from its metrics.jsonl)."""
    last_logged = last_logged_step(os.path.join(config.output_dir, METRICS_FILE)) if config.json_log else None
    sinks = open_sinks(config, layout.world_size, extra)
    sinks.last_logged_step = last_logged
    sinks.log(run_record(config, layout, hosts, writer_rank), 0, "run")
    gpus = [h.gpu for h in hosts if h.gpu is not None]
    if gpus:
        sinks.log({"ranks": gpus}, 0, "gpu_model")
    return sinks


def first_step(step: int, clocks: list, sinks: SinkSet) -> None:
    """The job's first ``monitor.step``: the clocks start (building the Monitor is no step's time
    or energy). On the writer, a job that starts at or before the last step logged in its
    output_dir (a restart from an earlier checkpoint) has TensorBoard drop the earlier job's
    events from this step on (``purge_step``), and says so: a warning and a ``resume`` record."""
    for clock in clocks:
        clock.start()
    last = sinks.last_logged_step
    if last is None or step > last:
        return
    message = (f"this job starts at step {step}, at or before step {last}, the last step an earlier job logged "
               f"here: TensorBoard drops the earlier events from step {step} on; metrics.jsonl keeps both "
               "jobs' records (each job starts with a run record)")
    logger.warning("distmetrics: %s", message)
    sinks.purge_from(step)
    sinks.log({"message": message, "last_logged_step": last}, step, "resume")
