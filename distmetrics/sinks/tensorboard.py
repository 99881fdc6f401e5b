"""TensorBoard sink: one event per log step in a TensorBoard event file. Tags equal JSONL keys;
an ``all`` metric becomes ``<name>/max``, ``/min``, ``/mean`` and one histogram, so 4,096 ranks
do not become 4,096 tags.

The event (one ``Summary`` holding every scalar and histogram of the record, the histograms
binned as ``SummaryWriter.add_histogram`` bins them) is written on the writer thread in one
``write`` — no second queue and thread as inside ``SummaryWriter``, whose failures surface only
as a traceback on its own thread. A write that fails (disk full) is cut back off, so the file
stays readable; later events are tried again and written once there is room (warnings say
when it stops, when it resumes and how many events were lost). A value TensorBoard cannot
store (a name that is not valid UTF-8, a step outside int64, a finite number beyond float32's
range, which its scalars are) is skipped with a warning; the rest of the record is written. A
nonzero number below float32's smallest is written as 0: float32's rounding, as 123456789 is
written as 123456792.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Callable, Optional

from . import ScalarView
from .appendfile import AppendFile

__all__ = ["TensorBoardSink", "DEFAULT_BINS", "masked_crc32c"]

logger = logging.getLogger("distmetrics")


def masked_crc32c():
    """TFRecord's checksum: CRC-32C, masked. google-crc32c computes it in C (installed with the
    tensorboard extra); tensorboard's own copy is pure Python, ~0.1 us per byte — 20 ms for the
    event of a 5,000-name record, holding the GIL on the writer thread."""
    try:
        import google_crc32c
    except ImportError:
        google_crc32c = None
    if google_crc32c is None or google_crc32c.implementation != "c":
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as slow

        return slow

    def masked(data: bytes) -> int:
        """TensorBoard's masked_crc32c, in C."""
        crc = google_crc32c.value(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked


def _default_bins() -> list[float]:
    # SummaryWriter.default_bins (TensorFlow's histogram buckets), so histograms bin as before
    v, buckets = 1e-12, []
    while v < 1e20:
        buckets.append(v)
        v *= 1.1
    return [-b for b in reversed(buckets)] + [0] + buckets


DEFAULT_BINS = _default_bins()
"""The histogram bucket limits ``SummaryWriter.add_histogram`` uses."""
_file_number = itertools.count()
FLOAT32_ROUNDS_TO_INF = 3.4028235677973366e38
"""The largest finite float32 and half its last step (2**103): a scalar at or beyond it (a finite
one) rounds to inf in float32; one below it, 3.4028235e38 included, rounds to the largest finite."""
KEPT_BEFORE_START = 16
"""Events written before a job's first step kept to be written again after a purge (a job
evaluates the checkpoint it restored once or a few times before it steps)."""


class TensorBoardSink:
    """Scalars and per-rank histograms of train, eval and tensor_stats records, one event per record."""

    name = "tensorboard"
    fix = "set tensorboard: false to run without it"
    install = 'pip install tensorboard (the "tensorboard" extra), or set tensorboard: false'

    def __init__(self, log_dir: str, reclaim: Optional[Callable[[], None]] = None) -> None:
        from torch.utils.tensorboard import summary  # needs the tensorboard package

        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event, self._summary, self._crc = event_pb2.Event, summary_pb2.Summary, masked_crc32c()
        self._histogram = summary.make_histogram
        # the file name TensorBoard's own writer uses, so `tensorboard --logdir` finds it; TensorBoard
        # reads a folder's files in name order, and a job's purge drops what it read before: the pid and
        # the counter are zero-padded, so a file made later in the same second sorts after (".10" < ".9")
        self.path = Path(log_dir) / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                     f"{os.getpid():07d}.{next(_file_number):06d}")
        self._file = AppendFile(self.path, self.name, lines=False, reclaim=reclaim)
        version = self._frame(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2",
                                              source_metadata=event_pb2.SourceMetadata(writer="distmetrics"))
                              .SerializeToString())
        self._skipped: set[str] = set()
        self._file.append_header(version, 0)  # the file's first event
        self._before_start: Optional[collections.deque] = collections.deque(maxlen=KEPT_BEFORE_START)
        """(step, event) written before the job's first step: a purge from that step would drop
        those at or above it, so they are written again after it. None once the step is known."""
        self._not_kept: Optional[tuple[int, int, int]] = None
        """(how many, the lowest step, the highest) of the events written before the first step
        that fell out of ``_before_start``: a purge at or below their steps hides them."""

    def purge_from(self, step: Optional[int]) -> None:
        """Have TensorBoard drop the folder's events at steps >= ``step`` (an earlier job's, when a
        job resumes from an earlier checkpoint): a ``SessionLog.START`` event at ``step``, what
        ``SummaryWriter(purge_step=...)`` writes. Events of this job already written at those
        steps (its evaluation of the checkpoint at ``step``, where a loop counts from 0) follow
        it again, so they stay. ``None`` (the job's first step, nothing to drop): they are not
        kept any longer."""
        kept, self._before_start = self._before_start or (), None
        if step is None:
            return
        if self._not_kept is not None and self._not_kept[2] >= step:
            count, first, last = self._not_kept
            logger.warning("distmetrics: the tensorboard sink writes again after the drop from step %d the last %d "
                           "events this job wrote before its first step; up to %d earlier one%s (steps %d-%d) are "
                           "hidden by the drop (metrics.jsonl has them).", step, KEPT_BEFORE_START, count,
                           "" if count == 1 else "s", first, last)
        from tensorboard.compat.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        data = self._frame(self._event(wall_time=time.time(), step=step, session_log=start).SerializeToString())
        # without it TensorBoard shows two jobs' values at one step: held until written
        self._file.append_header([data, *(event for at, event in kept if at >= step)], step)

    def log_view(self, view: ScalarView, step: int) -> None:
        """Write one record's scalars and histograms as one event at ``step``."""
        summary = self._summary()
        add = summary.value.add
        for name, value in view.scalars.items():
            try:
                # two comparisons for a number in float32's range; NaN and inf are stored as they are
                if not -FLOAT32_ROUNDS_TO_INF < value < FLOAT32_ROUNDS_TO_INF and math.isfinite(value):
                    raise OverflowError(f"{value!r} is beyond float32's range (TensorBoard's scalars): it would "
                                        f"be stored as {'inf' if value > 0 else '-inf'} (metrics.jsonl has it)")
                add(tag=name, simple_value=value)
            except (ValueError, TypeError, OverflowError) as err:  # UnicodeEncodeError is a ValueError
                self._skip(name, err)
        if view.histograms:
            import numpy as np

            for name, values in view.histograms.items():
                try:
                    add(tag=name, histo=self._histogram(np.asarray(values, dtype=np.float64), DEFAULT_BINS))
                except (ValueError, TypeError, OverflowError) as err:
                    self._skip(name, err)
        try:
            event = self._event(wall_time=time.time(), step=step, summary=summary)
        except (ValueError, TypeError) as err:
            self._skip(f"step {step}", err)
            return
        data = self._frame(event.SerializeToString())
        if self._file.append(data, step) and self._before_start is not None:
            if len(self._before_start) == KEPT_BEFORE_START:
                at = self._before_start[0][0]
                count, first, last = self._not_kept or (0, at, at)
                self._not_kept = (count + 1, min(first, at), max(last, at))
            self._before_start.append((step, data))

    def close(self) -> None:
        """Close the event file (a warning if events were still failing to be written)."""
        self._file.close()

    def _frame(self, data: bytes) -> bytes:
        """One TFRecord: length, its masked CRC-32C, the data, its masked CRC-32C."""
        header = struct.pack("<Q", len(data))
        return header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data))

    def _skip(self, what: str, err: BaseException) -> None:
        key = what if not what.startswith("step ") else "step"
        if key in self._skipped:
            return
        self._skipped.add(key)
        logger.warning("distmetrics: the tensorboard sink skipped %s, which TensorBoard cannot store (%s: %s); "
                       "the rest is written and the sink goes on.", ascii(what) if key != "step" else what,
                       type(err).__name__, err)
