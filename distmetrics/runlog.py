"""Reading a run back from its ``metrics.jsonl``: which file a path names, the file's records
split into jobs (each job starts with a ``run`` record; a restart appends a new one), and the
last step an earlier job logged. No torch: the command line reads runs with this alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from .sinks import DASHBOARD_KINDS
from .sinks.appendfile import describe_os_error
from .sinks.jsonl import METRICS_FILE, decode_line

__all__ = ["METRICS_FILE", "TRAINING_KINDS", "Job", "Records", "metrics_files", "read_jobs", "split_jobs",
           "last_logged_step", "last_record"]

logger = logging.getLogger("distmetrics")


@dataclass
class Job:
    """One job's records, from its ``run`` record to the next one."""

    run: Optional[dict[str, Any]]
    """The job's ``run`` record (world size, hosts, versions, config); None for records that
    precede every run record."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """The job's other records, in file order."""

    def add(self, record: dict[str, Any]) -> None:
        """Keep one more of the job's records (:func:`split_jobs` calls it in file order)."""
        self.records.append(record)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """The job's records of one kind (``train``, ``eval``, ``alert``, ``resume``, ...)."""
        return [r for r in self.records if r.get("kind") == kind]

    def logged_steps(self) -> list[int]:
        """Steps of the records that dashboards plot (train, eval, tensor_stats), in order."""
        return [r["step"] for r in self.records if r.get("kind") in DASHBOARD_KINDS]


def metrics_files(path: Union[str, Path]) -> list[Path]:
    """The metrics.jsonl files a path names: the file itself, a run folder's file, or each run
    folder's file in a folder of run folders at any depth (``runs/`` holding ``runs/fsdp/`` and
    ``runs/demo/<time>/``; a run folder's own subfolders are not searched), in name order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if (path / METRICS_FILE).is_file():
        return [path / METRICS_FILE]
    found, seen = [], set()
    for folder, subfolders, files in os.walk(path, followlinks=True):  # runs linked in are runs too
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            subfolders.clear()
            continue
        seen.add(real)
        if METRICS_FILE in files:
            found.append(Path(folder) / METRICS_FILE)
            subfolders.clear()  # a run folder: its tensorboard/ and wandb/ hold no runs
        subfolders.sort()
    found.sort()
    if not found:
        raise ValueError(f"{str(path)!r} is a folder without {METRICS_FILE} (nor run folders holding one)")
    return found


class Records:
    """The records of a metrics.jsonl in file order, each line decoded as the iteration reaches it:
    a file of any size is read in the memory of one line. ``unreadable`` counts the lines read so
    far that are not records (a line cut short by a crash); a file none of whose lines is a record
    is refused with ``ValueError`` at the end of the iteration."""

    def __init__(self, path: Union[str, Path]):
        self.path = path
        self.unreadable = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.unreadable, found = 0, False
        with open(self.path, encoding="utf-8", errors="replace", newline="\n") as f:  # lines end at \n only, as written
            for line in f:
                if not line.strip():
                    continue
                record = decode_line(line)
                if record is not None and isinstance(record.get("kind"), str) and isinstance(record.get("step"), int):
                    found = True
                    yield record
                else:
                    self.unreadable += 1
        if not found:
            raise ValueError(not_a_metrics_file(self.path, self.unreadable))


def read_jobs(path: Union[str, Path]) -> tuple[list[Job], int]:
    """The jobs of a metrics.jsonl, every record held, and the number of lines that are not records
    (a line cut short by a crash). A file none of whose lines is a record is refused with
    ``ValueError``. ``summary`` reads the file through :class:`Records` and keeps only what it shows."""
    records = Records(path)
    return split_jobs(records), records.unreadable


def not_a_metrics_file(path: Union[str, Path], lines: int) -> str:
    """What ``summary`` and ``report`` say of a file none of whose ``lines`` (not counting blank
    ones) is a record."""
    what = f"none of its {lines} non-blank line(s) is a JSON record" if lines else "it is empty, no JSON record"
    return (f"{str(path)!r} is not a distmetrics metrics.jsonl: {what} with 'kind' and 'step' "
            "(give a run directory or the metrics.jsonl distmetrics wrote)")


def split_jobs(records: Iterable[dict[str, Any]], job: Callable[[Optional[dict[str, Any]]], Any] = Job) -> list:
    """Records in file order → jobs (a ``run`` record starts each): ``job(run)`` makes each one (run
    None for records that precede every run record) and its ``add`` takes the job's other records
    as they come; a :class:`Job` keeps them all."""
    jobs: list = []
    for record in records:
        if record.get("kind") == "run":
            jobs.append(job(record))
        else:
            if not jobs:
                jobs.append(job(None))
            jobs[-1].add(record)
    return jobs


TRAINING_KINDS = ("train", "tensor_stats")
"""Records only a job that trained writes (tensor statistics come at training steps, before a log
step: a job that crashed after one and before its first log step trained all the same)."""
_READ_PAST_LAST_TRAIN = 10_000
"""Records read back past a job's last train record for the one before it (an interval's
evaluations and statistics are far fewer)."""


def last_logged_step(path: Union[str, Path]) -> Optional[int]:
    """The last step the dashboards show from a metrics.jsonl: the highest step of a train, eval or
    tensor_stats record of the latest job that trained (wrote a train or tensor_stats record: a job
    that only evaluated dropped nothing from TensorBoard: the steps after its evaluation are still
    the job before's), or of the last
    such record where no job trained; None (no file, no such record). Read from the end, a block
    at a time, up to the job's train record before its last (an evaluation numbered ahead of
    training is written before the record close() writes) or its start: cheap on a long file."""
    highest: list = [None]  # of the job read so far, from its end
    trains, since = [0], [0]  # train records read; records read since the first

    def latest_training_job(record: dict) -> bool:
        kind, step = record.get("kind"), record.get("step")
        since[0] += trains[0] > 0
        if kind == "run":  # a job's start: of the job that trained, or of one that did not (the one before counts)
            if trains[0]:
                return True
            highest[0] = None
        elif kind in DASHBOARD_KINDS and isinstance(step, int):
            highest[0] = step if highest[0] is None else max(highest[0], step)
            trains[0] += kind in TRAINING_KINDS
            if trains[0] == 2:
                return True
        return since[0] >= _READ_PAST_LAST_TRAIN  # a job of one train record: not the whole of a long one

    if last_record(path, latest_training_job) is not None or trains[0]:  # or a file that starts in that job
        return highest[0]
    record = last_record(path, lambda r: r.get("kind") in DASHBOARD_KINDS and isinstance(r.get("step"), int))
    return None if record is None else record["step"]


def last_record(path: Union[str, Path], accept: Callable[[dict], bool], starts: bytes = b"",
                within: Optional[int] = None) -> Optional[dict]:
    """The last record of a metrics.jsonl that ``accept`` takes (lines not starting with
    ``starts`` are skipped undecoded), or None. Read from the end, a block at a time (``within``:
    the last so many bytes at most; a file of many gigabytes takes seconds to read whole). A file
    that cannot be read (a folder in its place, no permission, an I/O error) is None, with a
    warning: the writer rank alone reads it, so raising would leave the other ranks waiting."""
    try:
        return _last_record(path, accept, starts, within)
    except FileNotFoundError:
        return None
    except OSError as err:
        if str(path) not in _UNREADABLE:  # read up to a few times at start: one warning
            _UNREADABLE.add(str(path))
            logger.warning("distmetrics: cannot read %s (%s): what an earlier job wrote there is not known (a "
                           "restart is not recognised as one).", path, describe_os_error(err))
        return None


_UNREADABLE: set = set()  # metrics files warned about


def _last_record(path: Union[str, Path], accept: Callable[[dict], bool], starts: bytes,
                 within: Optional[int]) -> Optional[dict]:
    with open(path, "rb") as f:
        position, block, carry = f.seek(0, 2), 1 << 16, b""
        floor = 0 if within is None else max(0, position - within)
        while position > floor:
            start = max(floor, position - block)
            f.seek(start)
            lines = (f.read(position - start) + carry).split(b"\n")
            carry = lines.pop(0) if start > 0 else b""  # maybe the end of a line that began earlier (or cut at floor)
            for raw in reversed(lines):
                if not raw.startswith(starts):
                    continue
                record = decode_line(raw.decode("utf-8", "replace"))
                if record is not None and accept(record):
                    return record
            position, block = start, min(block * 2, 1 << 24)
    return None
