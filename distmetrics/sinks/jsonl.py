"""JSONL sink: ``{output_dir}/metrics.jsonl``, one JSON object per line, written whole per record.

Strict JSON: NaN and ±Inf are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` so that every JSON tool parses the file; :func:`read_jsonl` turns them back
into floats. ``all`` metrics are written per rank as ``<name>/rank<r>`` (``r``: the global rank).

The file always ends with a whole line. It is written on the training thread, one ``write``
per record, so every log step that returned has its line in the file even if the process is
killed right after. A restart appends; a line torn by a crash during a write is cut off
first. When a write fails (disk full), the part written is cut back off, later records are
tried again, and the first record written after the failure is preceded by a ``gap`` record:
``{"kind": "gap", "step": N, "first_step": a, "last_step": b, "lost_records": n, "error": ...}``.
A job's ``run`` record that could not be written goes ahead of the first record written (readers
split the file into jobs at it), and is not counted as lost. So do the records of rare events
(:data:`KEPT_KINDS`: an alert, an evaluation, a checkpoint's progress, a stragglers report), up
to :data:`KEPT_AT_MOST` of them: an alert said once per event was lost for good with its record.
A file removed mid-run (``rm -r`` of the run folder) is made again, starting with the job's ``run``
record, then a ``gap`` record for the records that may have gone with it (:mod:`.appendfile`).

Encoding is the training thread's main cost at thousands of names (a shortest float repr per
value): with ``orjson`` installed (a dependency) a record encodes about 15x faster than with
the standard library, which is the fallback; both write the same values.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import time
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Optional, Union

from ..per_rank import PerRank
from . import python_number
from .appendfile import AppendFile

try:
    import orjson
except ImportError:  # the standard library writes the same values, slower
    orjson = None

__all__ = ["JsonlSink", "read_jsonl", "decode_line", "encode_value", "METRICS_FILE", "NONFINITE"]

logger = logging.getLogger("distmetrics")

KEPT_KINDS = frozenset(("alert", "eval", "progress", "stragglers"))
"""Records kept while the file cannot be written, and written ahead of the next record that can."""
KEPT_AT_MOST = 1000
"""Kept records at most (beyond: lost and counted as a train record is)."""
METRICS_FILE = "metrics.jsonl"
"""The name of the JSONL file in every run folder."""
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""The strings that stand for NaN and ±Inf in the file, and the floats they stand for."""


class JsonlSink:
    """Every record as one line of strict JSON, written whole or not at all."""

    name = "jsonl"
    fix = "check that output_dir is writable and the disk has room"
    on_training_thread = True
    """Written before ``monitor.step`` returns (crash safety)."""

    def __init__(self, path: Union[str, Path], reclaim: Optional[Callable[[], None]] = None) -> None:
        self.path = Path(path)
        self._file = AppendFile(self.path, self.name, lines=True, on_loss='a "gap" record', reclaim=reclaim,
                                whole=_is_record)
        self._finite = FiniteCheck()
        self._end: Optional[tuple[tuple, int]] = None  # the end record, held while records are lost

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Append one record (``all`` metrics as ``<name>/rank<r>``)."""
        if time.monotonic() >= self._file.check_at:  # a removed file's records are counted before the gap is made
            self._file.check(step)
        pieces = _pieces(kind, step, metrics, self._finite)
        if kind == "end":  # how the job ended: the last line, after the gap record where records were lost
            # written to a file removed since the last look, it would go with it: looked at first, as at close
            self._file.check(step, closing=True)
            self._end = (pieces, step)
            self._write_end()  # now: at the exit of a process whose Monitor is open nothing closes this sink
            return
        if kind in ("run", "resume"):  # a job's header (readers split the file into jobs at it, and say where it
            # resumed from the resume record): held until written, ahead of the next record
            self._file.append_header(pieces, step)
            return
        lost = self._file.lost
        gap = (self._gap(step),) if lost is not None and lost.records else ()  # written with this record, or neither
        # a record of a rare event is held where it cannot be written, not lost: written ahead of the next
        # record that can be (or at close); not tried alone: a write that worked would end the gap unmarked
        keep = kind in KEPT_KINDS and (lost is None or lost.held < KEPT_AT_MOST)
        self._file.append((*gap, *pieces), step, keep=pieces if keep else None)

    def close(self) -> None:
        """Close the file, with a gap record where records were lost since the last one written
        (if there is room now), then the end record if it is still held; a warning if records were
        still failing to be written."""
        self._file.check(self._file.last_step, closing=True)  # records may have gone with a file removed meanwhile
        self._write_end()
        self._file.close()

    def _write_end(self) -> None:
        """The gap record where records were lost (else the records held, if any), then the end record
        held, if any: counted as no lost record where it fails, and said, since a job without one reads as
        killed."""
        lost = self._file.lost
        if lost is not None:
            self._file.append(self._gap(lost.last_step) if lost.records else (), lost.last_step, counts=False,
                              closing=True)
        if self._end is None or self._file.lost is not None:  # the gap first: still failing, the end waits
            return
        end, self._end = self._end, None
        if not self._file.append(*end, counts=False, closing=True) and self._file.is_open:
            logger.warning("distmetrics: the jsonl sink could not write the job's end record to %s (a full disk, "
                           "or a file size limit?): distmetrics summary and report will read this job as killed",
                           self.path)

    def _gap(self, step: int) -> bytes:
        lost = self._file.lost
        return _line("gap", step, {"first_step": lost.first_step, "last_step": lost.last_step,
                                   "lost_records": lost.records, "error": lost.error})


def _is_record(head: bytes, complete: bool) -> bool:
    """Whether a last line without its newline (``head``, all of it where ``complete``) holds records
    as ``summary`` and ``report`` read them: one, or, in a copy saved with ``\r`` line endings, the
    first of its pieces (a piece torn after them is skipped by the readers, as any unreadable line)."""
    from ..runlog import decode_pieces, decode_record  # runlog reads this module's files

    if complete:
        return any(record is not None for _, record in decode_pieces(head))
    return b"\r" in head and decode_record(head.split(b"\r", 1)[0]) is not None


def _line(kind: str, step: int, metrics: dict[str, Any]) -> bytes:
    """One record as one line of strict JSON, with its newline."""
    return b"".join(_pieces(kind, step, metrics, FiniteCheck()))


def _pieces(kind: str, step: int, metrics: dict[str, Any], finite: "FiniteCheck") -> tuple:
    """One line as pieces to write one after the other: the head (kind, step, time) and the
    metrics are encoded apart and not joined (at thousands of names a copy of the line, and the
    page faults of a new buffer that large, cost about what encoding it does). The head is
    text made from the kind's encoding, kept per kind (:func:`_kind_head`)."""
    if metrics and type(step) is int and "kind" not in metrics and "step" not in metrics and "time" not in metrics:
        body = _fast(metrics, finite if len(metrics) > FiniteCheck.SEARCH_BELOW else None, kind)
        if body is not None:
            head = _KIND_HEADS.get(kind) or _kind_head(kind)
            return f'{head}{step},"time":"{utc_now()}",'.encode(), memoryview(body)[1:], b"\n"
    head = {"kind": kind, "step": step, "time": utc_now()}
    data = _fast({**head, **metrics})  # no per-value Python work unless a value needs it
    if data is None:
        record = head
        for name, value in metrics.items():
            if isinstance(value, PerRank):
                for rank, v in zip(value.rank_ids(), value):  # by global rank
                    if v is not None:
                        record[f"{name}/rank{rank}"] = v
            else:
                record[name] = value
        data = _fast(record) or _exact(record)
    return data, b"\n"


_KIND_HEADS: dict[str, str] = {}  # kind -> '{"kind":<kind>,"step":'


def _kind_head(kind: str) -> str:
    """The start of a line of ``kind``, up to the step's value (kept for a few kinds)."""
    if len(_KIND_HEADS) >= FiniteCheck.KEEP:
        _KIND_HEADS.clear()
    start = (_fast({"kind": kind}) or _exact({"kind": kind})).decode("utf-8")
    _KIND_HEADS[kind] = head = f'{start[:-1]},"step":'
    return head


def _fast(record: dict[str, Any], finite: Optional["FiniteCheck"] = None, kind: str = "") -> Optional[bytes]:
    """orjson's encoding, or None where it would differ from strict JSON (NaN and Inf, which
    it writes as null; an ``all`` metric; an int beyond 64 bits; text that is not UTF-8).
    Where ``finite`` finds no value NaN, Inf or None, the output needs no search for ``null``
    (which takes longer than the encoding: the search reads every name too)."""
    if orjson is None:
        return None
    try:
        data = orjson.dumps(record, default=_plain, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:
        return None
    return data if (finite is not None and finite(kind, record.values())) or b"null" not in data else None


_second: tuple[Optional[int], str] = (None, "")  # the last whole second formatted, and its text


def utc_now(now: Optional[float] = None) -> str:
    """``now`` (default: the time now) as ``datetime.isoformat(timespec="milliseconds")`` writes
    it in UTC (``2026-11-22T06:09:24.123+00:00``); the part up to the second is formatted once
    per second."""
    global _second
    if now is None:  # the clock in integer nanoseconds, rounded to the microsecond
        second, micro = divmod((time.time_ns() + 500) // 1000, 1_000_000)
    else:
        second = math.floor(now)
        micro = round((now - second) * 1e6)  # as datetime rounds a timestamp: to the microsecond, half to even
        if micro >= 1_000_000:
            second, micro = second + 1, micro - 1_000_000
    cached, text = _second
    if second != cached:
        text = _dt.datetime.fromtimestamp(second, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        _second = (second, text)
    return f"{text}.{micro // 1000:03d}+00:00"


class FiniteCheck:
    """Whether a record's values are all finite Python numbers, save for text (a host name), at
    the speed of ``sum``: the numbers between the other values are summed in C, and a finite sum
    means none is NaN or Inf (either makes the sum non-finite). Where the values that are not
    ``float``, ``int`` or ``bool`` sit is found by a pass over the record the first time a
    record of its kind and size is seen, then remembered, so ``sum`` never does another type's
    arithmetic (a numpy array's, a tensor's) and a record laid out as the last one of its kind
    costs no Python work per value. Any value other than text (None, a numpy scalar, a tensor)
    means the output is searched for ``null`` as it always was."""

    KEEP = 64
    """Layouts remembered at most (a run has a few kinds of record, each of a few sizes)."""
    SEARCH_BELOW = 32
    """A record of fewer values is searched for ``null`` instead (a few hundred bytes)."""

    def __init__(self) -> None:
        self._others_at: dict[tuple[str, int], tuple[int, ...]] = {}

    def __call__(self, kind: str, values: Collection[Any]) -> bool:
        """True: every value is a float, int or bool, with a finite sum, or text."""
        key = (kind, len(values))
        others_at = self._others_at.get(key)
        finite = None if others_at is None else _finite_between(values, others_at)
        if finite is None:  # a new layout, or another type where a number was: find them, then sum
            if len(self._others_at) >= self.KEEP:
                self._others_at.clear()
            self._others_at[key] = others_at = tuple(i for i, v in enumerate(values) if v.__class__ not in _NUMBERS)
            finite = _finite_between(values, others_at)
        return bool(finite)


_NUMBERS = frozenset((float, int, bool))  # the classes sum() adds without calling a method


def _finite_between(values: Collection[Any], others_at: tuple[int, ...]) -> Optional[bool]:
    """The values but those at ``others_at`` summed. True: the sum is finite and every value at
    ``others_at`` is text. False: the sum is not finite, or a value at ``others_at`` is neither
    text nor a number (the output must be searched). None: the layout is not the one given (a
    number at ``others_at``, or something that is not a number between them)."""
    it, total, done = iter(values), 0, 0
    try:
        for at in others_at:
            total += sum(islice(it, at - done))
            other = next(it).__class__
            if other is not str:
                return None if other in _NUMBERS else False
            done = at + 1
        total += sum(it)
    except Exception:  # noqa: BLE001 - a value's own arithmetic (not a number where one was): look again
        return None
    if type(total) is float:
        return math.isfinite(total)
    return True if type(total) is int else None


def _exact(record: dict[str, Any]) -> bytes:
    """The standard library's encoding, NaN and Inf as strings."""
    try:
        text = json.dumps(record, allow_nan=False, default=_exact_default, separators=(",", ":"))
    except ValueError:
        text = json.dumps(encode_value(record), allow_nan=False, default=_exact_default, separators=(",", ":"))
    return text.encode("utf-8")


def _plain(value: Any) -> Any:
    """What orjson hands back: numbers of other types (float and int subclasses, numpy scalars
    such as ``np.float32`` and ``np.int64``, 0-d arrays and tensors) as Python numbers, other
    types as text; a PerRank (written per rank) raises, so the record takes the general path."""
    if isinstance(value, PerRank):
        raise TypeError("per-rank values")
    value = python_number(value)
    if isinstance(value, (float, int)):
        return value if isinstance(value, bool) else float(value) if isinstance(value, float) else int(value)
    return str(value)


def _exact_default(value: Any) -> Any:
    """The standard library's fallback for types it does not know: as :func:`_plain`, with
    non-finite numbers as strings."""
    value = python_number(value)
    return encode_value(value) if isinstance(value, (float, int)) else str(value)


def encode_value(value: Any) -> Any:
    """Make a value strict-JSON safe (non-finite floats become strings)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: encode_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    return value


def read_jsonl(path: Union[str, Path]) -> Iterator[dict[str, Any]]:
    """Records of a metrics.jsonl, with NaN/Inf back as floats, each line read by the rule ``summary``
    and ``report`` read by (:func:`distmetrics.runlog.decode_record`: a JSON object with a ``kind`` and
    a ``step``; a byte-order mark opening it skipped, a byte that is not UTF-8 replaced). Any other line
    is skipped: one cut short by a crash (a SIGKILL during the write); the file is read on, and the
    lines skipped are counted in one warning once it is read (a blank line is not counted). Lines end
    at ``\n`` as written; a copy another tool saved with ``\r`` endings reads the same (a line that is
    no record whole is split at ``\r``: JSON text holds none but as whitespace between tokens)."""
    from ..runlog import decode_pieces, with_floats  # runlog reads this module's names at its import

    skipped = 0
    with open(path, "rb") as f:
        for line in f:
            for piece, record in decode_pieces(line):
                if record is not None:
                    yield with_floats(record)
                elif piece.strip():
                    skipped += 1
    if skipped:
        logger.warning("distmetrics: read_jsonl skipped %d line(s) of %s that are no record (cut short by a "
                       "crash).", skipped, path)


def decode_line(line: str) -> Optional[dict[str, Any]]:
    """One line as a record (NaN/Inf back as floats), or None for a blank line or one that is
    not a JSON object (e.g. cut short by a crash)."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    return {k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}
