"""JSONL sink: ``{output_dir}/metrics.jsonl``, one JSON object per line, flushed per record.

Strict JSON: NaN and ±Inf are written as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` so that every JSON tool parses the file; :func:`read_jsonl` turns them back
into floats. ``all`` metrics are written per rank as ``<name>/rank<r>``. A restart appends;
a line cut short by a crash is closed off before the next record, so only that line is lost.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from ..per_rank import PerRank

__all__ = ["JsonlSink", "read_jsonl", "decode_line", "encode_value"]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class JsonlSink:
    """Every record as one line of strict JSON, flushed when written."""

    name = "jsonl"
    fix = "check that output_dir is writable and the disk has room"

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+", encoding="utf-8")
        self._file.seek(0, os.SEEK_END)
        if self._file.tell() > 0:
            self._file.seek(self._file.tell() - 1)
            last = self._file.read(1)
            self._file.seek(0, os.SEEK_END)
            if last != "\n":  # a crash cut the last record short: keep it on its own line
                self._file.write("\n")

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Append one record (``all`` metrics as ``<name>/rank<r>``)."""
        record: dict[str, Any] = {"kind": kind, "step": step,
                                  "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")}
        for name, value in metrics.items():
            if isinstance(value, PerRank):
                for rank, v in enumerate(value):
                    if v is not None:
                        record[f"{name}/rank{rank}"] = encode_value(v)
            else:
                record[name] = encode_value(value)
        self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


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
    """Records of a metrics.jsonl, with NaN/Inf back as floats; a cut-short line is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = decode_line(line)
            if record is not None:
                yield record


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
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}
