"""Reading a run back from its ``metrics.jsonl``: which file a path names, the file's records
split into jobs (each job starts with a ``run`` record; a restart appends a new one), and the
last step an earlier job logged. No torch: the command line reads runs with this alone.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from .sinks import DASHBOARD_KINDS
from .sinks.appendfile import describe_os_error
from .sinks.jsonl import METRICS_FILE, NONFINITE, decode_line

__all__ = ["METRICS_FILE", "LINE_LIMIT", "TRAINING_KINDS", "end_note", "Job", "Records", "NotAMetricsFile",
           "EmptyMetricsFile", "decode_record", "metrics_files", "read_jobs", "split_jobs", "last_logged_step",
           "last_record", "last_log_step_of_end"]

LINE_LIMIT = 64 * 2**20
"""The longest line read as a record whatever it holds, in bytes (64 MiB; a record of 100,000 names
is a few MB). A longer line is read whole only where it opens as the Monitor's records do
(``{"kind":``: per-rank values of thousands of names on thousands of ranks make lines of 100 MB);
any other (a file that is no metrics.jsonl: a checkpoint without a newline) is skipped unheld and
counted as unreadable, so such a file takes about twice this memory at most."""
RECORD_OPENING = b'{"kind":'
"""How every line the JSONL sink writes begins."""

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
    if path.exists() and not path.is_dir():  # a FIFO or a device too: Records refuses it when read
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if (path / METRICS_FILE).exists():
        return [path / METRICS_FILE]
    found, seen = [], set()
    for folder, subfolders, files in os.walk(path, followlinks=True):  # runs linked in are runs too
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            subfolders.clear()
            continue
        seen.add(real)
        if METRICS_FILE in files:  # a FIFO too: refused when read (Records), said as a run that cannot be read
            found.append(Path(folder) / METRICS_FILE)
            subfolders.clear()  # a run folder: its tensorboard/ and wandb/ hold no runs
        subfolders.sort()
    found.sort()
    if not found:
        raise ValueError(f"{str(path)!r} is a folder without {METRICS_FILE} (nor run folders holding one)")
    return found


class NotAMetricsFile(ValueError):
    """A file of which not one line is a record (not a ``metrics.jsonl``)."""


class EmptyMetricsFile(ValueError):
    """A metrics.jsonl without a record nor an unreadable line: a run that wrote nothing."""


class Records:
    """The records of a metrics.jsonl in file order, each line decoded as the iteration reaches it
    (:func:`decode_record`, the rule ``summary`` and ``report`` both read by): a file of any size is
    read in the memory of one line, a line of at most :data:`LINE_LIMIT` bytes. ``lines``, ``blank``
    and ``unreadable`` count the lines read so far, the blank ones and those that are not records (a
    line cut short by a crash, one over the limit). A file none of whose lines is a record is refused
    at the end of the iteration (:class:`EmptyMetricsFile`, :class:`NotAMetricsFile`), one whose first
    line is over the limit at once."""

    def __init__(self, path: Union[str, Path]):
        self.path = path
        self.lines = self.blank = self.unreadable = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.lines = self.blank = self.unreadable = 0
        found, limit = False, LINE_LIMIT
        if os.path.exists(self.path) and not os.path.isfile(self.path):  # a FIFO's read would wait for a writer
            what = "a folder" if os.path.isdir(self.path) else "a device, a FIFO or a socket"
            raise ValueError(f"{str(self.path)!r} is no regular file ({what})")
        with open(self.path, "rb") as f:  # lines end at \n only, as written
            for whole in _lines(f, limit):
                for line, record in [(None, None)] if whole is None else decode_pieces(whole):
                    self.lines += 1
                    if record is not None:
                        found = True
                        yield record
                    elif line is not None and not line.strip():  # stripped only when not a record
                        self.blank += 1
                    else:
                        self.unreadable += 1
                        if line is None and self.lines == 1:  # not read on: a file of gigabytes without a newline
                            raise NotAMetricsFile(not_a_metrics_file(
                                self.path, f"its first line is over {limit:,} bytes long, where a record is a few "
                                "MB at most"))
        if not found:
            if self.unreadable:
                raise NotAMetricsFile(not_a_metrics_file(self.path, f"none of its {self.unreadable} non-blank line(s) "
                                                                    "is a JSON record with 'kind' and 'step'"))
            what = f"only {self.blank} blank line(s)" if self.blank else "it is empty"
            raise EmptyMetricsFile(f"{str(self.path)!r} holds no record: {what} (a run that wrote nothing: a full disk "
                                   "at start-up, or a crash before its first record)")


def decode_pieces(line: bytes) -> list[tuple[bytes, Optional[dict[str, Any]]]]:
    """A line as it ends at ``\n`` and its record (:func:`decode_record`): itself, or, where it is no
    record whole, holds a ``\r`` before its end and its text up to the first ``\r`` is a record, its
    pieces between ``\r`` (a copy another tool saved with ``\r`` endings; JSON text holds a raw
    ``\r`` only as whitespace between tokens)."""
    record = decode_record(line)
    if record is None and b"\r" in line.rstrip(b"\r\n") and decode_record(line.split(b"\r", 1)[0]) is not None:
        pieces = line.split(b"\r")  # only where it opens with a record: not a progress bar's millions of pieces
        if not pieces[-1].strip(b"\n"):  # the line's own end: no piece
            pieces.pop()
        return [(piece, decode_record(piece)) for piece in pieces]
    return [(line, record)]


def decode_record(line: bytes) -> Optional[dict[str, Any]]:
    """One line as a record: a JSON object with a text ``kind`` and an integer ``step`` (``true`` is
    none; a 64-bit one), as the Monitor writes them; None for any other line. ``summary`` and ``report`` both read
    by this rule. A byte that is not UTF-8 (in a host name) is replaced, the record kept; a byte-order
    mark opening the line (an editor's) is skipped. NaN and ±Inf stay the strings the file holds."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        text = line.decode("utf-8", "replace")
    try:
        record = json.loads(text[1:] if text.startswith("\ufeff") else text)
    except (ValueError, RecursionError):  # RecursionError: brackets nested thousands deep
        return None
    if isinstance(record, dict) and isinstance(record.get("kind"), str) and type(record.get("step")) is int \
            and -_STEP_LIMIT <= record["step"] < _STEP_LIMIT:
        return record
    return None


_STEP_LIMIT = 2 ** 63
"""A step is a 64-bit integer (the Monitor's, and the readers' arrays): one beyond is no record of it."""


def _lines(f, limit: int) -> Iterator[Optional[bytes]]:
    """The lines of a file open in binary: each of at most ``limit`` bytes before its newline, and a
    longer one that opens as the Monitor's records do (:data:`RECORD_OPENING`); None for any other
    longer line, read to its end a MiB at a time and never held whole."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        if line.startswith(RECORD_OPENING):  # one of ours, however long: read on to its newline
            parts = [line]
            while parts[-1] and not parts[-1].endswith(b"\n"):
                parts.append(f.readline(limit))
            yield b"".join(parts)
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(1 << 20)
        yield None


def read_jobs(path: Union[str, Path]) -> tuple[list[Job], int]:
    """The jobs of a metrics.jsonl, every record held (NaN and ±Inf as floats), and the number of
    lines that are not records (a line cut short by a crash). A file none of whose lines is a record
    is refused with ``ValueError``. ``summary`` reads the file through :class:`Records` and keeps
    only what it shows."""
    records = Records(path)
    return split_jobs(map(with_floats, records)), records.unreadable


def with_floats(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the strings that stand for NaN and ±Inf as those floats."""
    return {k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def not_a_metrics_file(path: Union[str, Path], why: str) -> str:
    """What ``summary`` and ``report`` say of a file that is not a metrics.jsonl, and ``why``."""
    return (f"{str(path)!r} is not a distmetrics metrics.jsonl: {why} "
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


def end_note(end: Optional[dict[str, Any]], last: bool, expected: bool = True) -> str:
    """How a job ended, from its ``end`` record (None: it has none; ``last``: the file's last job;
    ``expected``: its ``run`` record says it writes one, as the files of versions before it do not)."""
    if end is None and not expected:
        return "no end record (written by a version without them): how the job ended is not known"
    if end is None:
        return ("no end record: the job was killed (SIGKILL, an out-of-memory kill, a node lost, a SIGTERM with no "
                "handler: Slurm, torchrun)"
                + (" or is still running" if last else ""))
    unwritten, failed = end.get("unwritten_steps"), end.get("lost_in_log_steps")
    failed = failed if isinstance(failed, int) and isinstance(unwritten, int) and 0 < failed <= unwritten else 0
    said = []
    if failed:  # a log step that raised, anywhere in the job (the end record's count holds them)
        said.append(f"the {failed} step(s) of failed log steps")
    if isinstance(unwritten, int) and unwritten > failed:
        said.append(f"the {unwritten - failed} step(s) since its last log step")
    at = "before any monitor.step" if end.get("stepped") is False else f"at step {end['step']}"  # 0: no step's
    return f"ended {at}: {end.get('how')}" + (f", {' and '.join(said)} not written" if said else "")


def last_log_step_of_end(end: dict) -> Any:
    """The step of an end record's job's last log step: its last ``monitor.step`` less the steps
    after that log step, which no sink has (its ``unwritten_steps``, less those of log steps that did
    not complete, ``lost_in_log_steps``: a signal may have cut one short after some sink took it)."""
    step, unwritten, lost = end.get("step"), end.get("unwritten_steps", 0), end.get("lost_in_log_steps", 0)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (step, unwritten, lost)):
        return step
    last = step - max(0, unwritten - lost)
    return last if last >= 0 else None  # a record no Monitor writes: no step of it


def last_logged_step(path: Union[str, Path]) -> Optional[int]:
    """The last step the dashboards show from a metrics.jsonl: the highest step of a train, eval or
    tensor_stats record, of a gap record's lost records (a full disk lost them from metrics.jsonl, not
    from TensorBoard on another) or of the end record's last log step, of the latest job that trained (wrote a train or
    tensor_stats record, or lost one: a job that only evaluated dropped nothing from TensorBoard: the
    steps after its evaluation are still the job before's), or of the last such record where no job
    trained; None (no file, no such record). Read from the end, a block at a time, up to the job's
    train record before its last (an evaluation numbered ahead of training is written before the
    record close() writes) or its start: cheap on a long file."""
    highest: list = [None]  # of the job read so far, from its end
    trains, since = [0], [0]  # train records read; records read since the first
    unstepped = [False]  # the job read so far ended before any monitor.step (its end record says so)

    def latest_training_job(record: dict) -> bool:
        kind, step = record.get("kind"), record.get("step")
        since[0] += trains[0] > 0
        if kind == "run":  # a job's start: of the job that trained, or of one that did not (the one before counts)
            if trains[0]:
                return True
            highest[0], unstepped[0] = None, False
        elif kind in DASHBOARD_KINDS and isinstance(step, int):
            highest[0] = step if highest[0] is None else max(highest[0], step)
            trains[0] += kind in TRAINING_KINDS
            if trains[0] >= 2:
                return True
        elif kind == "end":
            unstepped[0] = record.get("stepped") is False  # an evaluation-only job's: its lost records are no steps
        if kind in ("gap", "end") and not unstepped[0]:  # steps whose records metrics.jsonl lost (a full disk) may be
            last = record.get("last_step") if kind == "gap" else last_log_step_of_end(record)  # on TensorBoard's
            if isinstance(last, int):
                highest[0] = last if highest[0] is None else max(highest[0], last)
                trains[0] += kind == "gap"  # records lost by a job that stepped: it trained
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
