"""``progress.txt`` in Megatron's tab-separated format, so tools that parse Megatron's parse ours:

``YYYY-MM-DD HH:MM:SS<TAB>Job ID: <SLURM_JOB_ID><TAB># GPUs: <world><TAB><message>``
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union

from .appendfile import AppendFile, describe_os_error

__all__ = ["ProgressSink", "progress_line", "read_progress", "no_progress", "checkpoint_message", "Saved"]

logger = logging.getLogger("distmetrics")


class Saved(NamedTuple):
    """A saved checkpoint's numbers, as a "Saved checkpoint" line or a ``progress`` record holds them."""

    iteration: int
    tokens: float
    flops: float
    """Floating-point operations up to it (nan: not known, no model description)."""
    after_step: Optional[int] = None
    """The last ``monitor.step`` before the save (a ``progress`` record's ``after_step``): the checkpoint holds
    that step, whichever number the loop gives it. None in progress.txt (Megatron's format has no such field),
    in a record without the field, and for a save before the job's first step."""


def progress_line(message: str, world_size: int, job_id: str = None, now: _dt.datetime = None) -> str:
    """One progress.txt line (with its newline)."""
    job_id = os.getenv("SLURM_JOB_ID", "") if job_id is None else job_id
    now = now or _dt.datetime.now()
    return f"{now.strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {job_id}\t# GPUs: {world_size}\t{message}\n"


class ProgressSink:
    """Megatron's progress.txt: "Starting job" at start, ``progress`` records' messages after."""

    name = "progress"
    fix = "check that output_dir is writable and the disk has room"
    on_training_thread = True
    """A few lines per job; Megatron's tools read them at once."""
    kinds = ("progress",)
    """It writes ``progress`` records only."""

    def __init__(self, path: Union[str, Path], world_size: int, reclaim: Optional[Callable[[], None]] = None) -> None:
        self.path = Path(path)
        self.world_size = world_size
        self._file = AppendFile(self.path, self.name, lines=True, reclaim=reclaim)  # whole lines only, as for JSONL
        self._step = 0
        # read_progress finds the jobs, and their start, by this line: held until written
        self._file.append_header(self._line("Starting job"), 0)

    def write(self, message: str) -> None:
        """Append one line with ``message``."""
        self._file.append(self._line(message), self._step)

    def _line(self, message: str) -> bytes:
        return progress_line(message, self.world_size).encode("utf-8", "backslashreplace")

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Write ``progress`` records (e.g. "Saved checkpoint" lines); ignore the rest."""
        if kind == "progress":
            self._step = step
            self.write(metrics["message"])

    def close(self) -> None:
        """Close the file, with the "Starting job" line if it is not written yet (a job that saved
        no checkpoint writes no other line); a warning if lines were still failing to be written."""
        self._file.close()


def read_progress(path: Union[str, Path], world_size: int) -> dict:
    """What Megatron reads back from progress.txt on a restart.

    ``start_time``/``start_flops``: when the first run of the current streak of runs with this
    world size started, and the floating-point operations of the checkpoint it loaded (told by its
    first save: :func:`_resumed_from`); a later run of the streak whose first save tells it loaded
    a checkpoint older than that (a rollback past the streak's start, a start from scratch) began
    a streak of its own, as it counted itself (``CheckpointLog.start_at``); ``last_flops``
    and ``last_tokens``: from the latest "Saved checkpoint" line (where a resumed job starts
    unless it rolled back: see ``saved``); ``checkpoints``: how many such lines there are;
    ``saved``: every such line's :class:`Saved` numbers, in file order. A last line without
    its newline (a crash during the write) is left out: its numbers may be cut short. A line
    whose fields do not read is skipped.
    """
    state = no_progress()
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return state
    except OSError as err:  # read on the writer rank alone: raising would leave the other ranks waiting
        logger.warning("distmetrics: cannot read %s (%s): checkpoints count FLOPs and tokens from this job on.",
                       path, describe_os_error(err))
        return state
    lines = text.split("\n")[:-1]  # the part after the last newline is torn (or empty)
    unsaved = False  # the streak's first run has saved nothing yet: its start_flops is the last line's, for now
    job = None  # the latest run of this world size, until its first save: (its start, how many lines came before)
    for line in lines:
        fields = line.strip().split("\t")
        if len(fields) < 4:
            continue
        try:
            world_in_line = int(fields[2].split(": ")[1])
        except (IndexError, ValueError):
            continue
        if fields[3] == "Saved checkpoint" and len(fields) >= 9:
            try:
                saved = Saved(iteration=int(fields[4].split(": ")[1]), flops=float(fields[7].split(": ")[1]),
                              tokens=float(fields[8].split(": ")[1]) * 1e9)
            except (IndexError, ValueError):
                continue
            if job is not None and world_in_line == world_size:
                origin = _resumed_from(state["saved"][:job[1]], saved)
                if unsaved:  # the streak's first save tells which checkpoint its first run loaded
                    state["start_flops"], unsaved = origin, False
                elif origin < state["start_flops"]:  # a run behind the streak's start began one of its own
                    state["start_time"], state["start_flops"] = job[0], origin
                job = None
            state["checkpoints"] += 1
            state["saved"].append(saved)
            state["last_flops"], state["last_tokens"] = saved.flops, saved.tokens
        if world_in_line != world_size:  # a different world size restarts the streak
            state["start_time"] = state["start_flops"] = job = None
            unsaved = False
            continue
        if fields[3] == "Starting job":
            try:
                started = _dt.datetime.strptime(fields[0], "%Y-%m-%d %H:%M:%S")
            except ValueError:
                continue
            job = (started, len(state["saved"]))
            if state["start_time"] is None:
                state["start_time"], state["start_flops"], unsaved = started, state["last_flops"], True
    state["streak_unsaved"] = unsaved  # its first job saved nothing: its start is not known
    return state


def no_progress() -> dict:
    """What :func:`read_progress` reads from a file with no line."""
    return {"start_time": None, "start_flops": None, "last_flops": 0.0, "last_tokens": 0.0, "checkpoints": 0,
            "saved": [], "streak_unsaved": False}


def _resumed_from(earlier: list, first: Saved) -> float:
    """The FLOPs of the checkpoint the first job of a streak resumed from, told by its first save
    (``first``): the latest of the ``earlier`` lines of the highest iteration below it, or one of
    its iteration with its FLOPs (saved again before training), 0 if none (a start from scratch).
    After a rollback that is not the last line before the job (which made the streak's FLOPs,
    and its cumulative throughput, negative)."""
    again = [line for line in earlier
             if line.iteration == first.iteration and f"{line.flops:.2e}" == f"{first.flops:.2e}"]
    if again:
        return again[-1].flops
    base = None
    for line in earlier:
        if line.iteration < first.iteration and (base is None or line.iteration >= base.iteration):
            base = line
    return base.flops if base is not None else 0.0


def checkpoint_message(iteration: int, job_tflops: float, cumulative_tflops: float, flops: float,
                       tokens: float) -> str:
    """Megatron's "Saved checkpoint" message (the fields its tools parse)."""
    return (f"Saved checkpoint\tIteration: {iteration}\t"
            f"Job throughput: {job_tflops:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative_tflops:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}")
