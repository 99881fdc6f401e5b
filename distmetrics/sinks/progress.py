"""``progress.txt`` in Megatron's tab-separated format, so tools that parse Megatron's parse ours:

``YYYY-MM-DD HH:MM:SS<TAB>Job ID: <SLURM_JOB_ID><TAB># GPUs: <world><TAB><message>``
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any, Union

__all__ = ["ProgressSink", "progress_line"]


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
        self.write("Starting job")

    def write(self, message: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(progress_line(message, self.world_size))

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        if kind == "progress":
            self.write(metrics["message"])

    def close(self) -> None:
        pass
