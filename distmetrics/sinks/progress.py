"""``progress.txt`` in Megatron's tab-separated format, so tools that parse Megatron's parse ours:

``YYYY-MM-DD HH:MM:SS<TAB>Job ID: <SLURM_JOB_ID><TAB># GPUs: <world><TAB><message>``
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path
from typing import Any, Union

__all__ = ["ProgressSink", "progress_line", "read_progress", "checkpoint_message", "checkpoint_record"]


def progress_line(message: str, world_size: int, job_id: str = None, now: _dt.datetime = None) -> str:
    """One progress.txt line (with its newline)."""
    job_id = os.getenv("SLURM_JOB_ID", "") if job_id is None else job_id
    now = now or _dt.datetime.now()
    return f"{now.strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {job_id}\t# GPUs: {world_size}\t{message}\n"


class ProgressSink:
    name = "progress"
    fix = "check that output_dir is writable and the disk has room"

    def __init__(self, path: Union[str, Path], world_size: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        self.resumed = read_progress(self.path, world_size)  # before our own "Starting job"
        self.write("Starting job")

    def write(self, message: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(progress_line(message, self.world_size))

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        if kind == "progress":
            self.write(metrics["message"])

    def close(self) -> None:
        pass


def read_progress(path: Union[str, Path], world_size: int) -> dict:
    """What Megatron reads back from progress.txt on a restart.

    ``start_time``/``start_flops``: when the earliest run of the current streak of runs with
    this world size started, and the floating-point operations done by then; ``last_flops``
    and ``last_tokens``: from the latest "Saved checkpoint" line (where a resumed job starts).
    """
    state = {"start_time": None, "start_flops": None, "last_flops": 0.0, "last_tokens": 0.0}
    path = Path(path)
    if not path.exists():
        return state
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.strip().split("\t")
        if len(fields) < 4:
            continue
        try:
            world_in_line = int(fields[2].split(": ")[1])
        except (IndexError, ValueError):
            continue
        if fields[3] == "Saved checkpoint" and len(fields) >= 9:
            state["last_flops"] = float(fields[7].split(": ")[1])
            state["last_tokens"] = float(fields[8].split(": ")[1]) * 1e9
        if world_in_line != world_size:  # a different world size restarts the streak
            state["start_time"] = state["start_flops"] = None
            continue
        if fields[3] == "Starting job" and state["start_time"] is None:
            state["start_time"] = _dt.datetime.strptime(fields[0], "%Y-%m-%d %H:%M:%S")
            state["start_flops"] = state["last_flops"]
    return state


def checkpoint_message(iteration: int, job_tflops: float, cumulative_tflops: float, flops: float,
                       tokens: float) -> str:
    """Megatron's "Saved checkpoint" message (the fields its tools parse)."""
    return (f"Saved checkpoint\tIteration: {iteration}\t"
            f"Job throughput: {job_tflops:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative_tflops:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}")


def checkpoint_record(step: int, resumed: dict, job_start: float, job_tokens: float, flops_per_token: float,
                      world_size: int) -> dict:
    """The "Saved checkpoint" message and its numbers, as Megatron computes them.

    Job throughput counts this job's FLOPs over its own time; cumulative throughput counts the
    FLOPs since the first run of the current same-world-size streak (``resumed``, read back
    from progress.txt) over the time since that run started.
    """
    start_flops = resumed.get("last_flops", 0.0)
    flops = start_flops + job_tokens * flops_per_token
    job_tflops = (flops - start_flops) / max(time.time() - job_start, 1e-9) / 1e12 / world_size
    first_start, first_flops = resumed.get("start_time"), resumed.get("start_flops")
    if first_start is None:
        first_start, first_flops = _dt.datetime.fromtimestamp(job_start), start_flops
    elapsed = max((_dt.datetime.now() - first_start).total_seconds(), 1e-9)
    cumulative_tflops = (flops - first_flops) / elapsed / 1e12 / world_size
    tokens = resumed.get("last_tokens", 0.0) + job_tokens
    return {"message": checkpoint_message(step, job_tflops, cumulative_tflops, flops, tokens),
            "checkpoint/job_tflops_per_gpu": job_tflops, "checkpoint/cumulative_tflops_per_gpu": cumulative_tflops,
            "checkpoint/floating_point_operations": flops, "checkpoint/tokens": tokens}
