"""Where the report keeps what it read: bounded numpy arrays, whatever the size of the file.

- :class:`ScalarTable`: every scalar metric at every log step (a records x names matrix, grown
  in chunks; NaN where a record lacks a name).
- :class:`StepGrid`: a family with one value per row — per module (``grad_norm/<module>``), per
  rank (``timers/<name>/rank<r>``) or per layer (``tensor_stats/<layer>/<tensor>/<stat>``) — in
  a fixed number of step bins. A bin holds the mean over the log steps it covers; when the steps
  run past the last bin, neighbouring bins merge pairwise and the bin width doubles, so memory
  stays ``MAX_COLUMNS x rows`` however long the run. Per-rank grids also keep the min, median
  and max over ranks and the slowest rank at every log step (a few numbers per record).
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional, Union

import numpy as np

__all__ = ["ScalarTable", "StepGrid", "MAX_COLUMNS"]

MAX_COLUMNS = 1000
"""Step bins per grid (even: bins merge in pairs)."""

MAX_SPACINGS = 64
"""Distinct spacings of log steps a grid counts (a log interval takes one or a few)."""
HOLE_SPANS = 4
"""A stretch between two logged bins more than this many times as wide as the spacing of the logged bins
either side of it holds no record (a hard kill lost them before a resume): greyed, not filled."""

Rows = Union[slice, np.ndarray]


class ScalarTable:
    """Scalars at every log step: ``values[record, column]`` and ``present[record, column]`` (a
    value may be NaN, written as ``"NaN"``, and must stay visible) with every record's ``steps``
    and ``jobs``; call :meth:`finish` once the file is read."""

    CHUNK = 1024

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        self._done: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._steps: list[int] = []
        self._jobs: list[int] = []
        self._new_chunk(16)

    def column(self, name: str) -> int:
        """The column of ``name`` (added on first sight)."""
        c = self.index.get(name)
        if c is None:
            c = self.index[name] = len(self.names)
            self.names.append(name)
        return c

    def add(self, step: int, job: int, columns: np.ndarray, values: np.ndarray) -> None:
        """One record's scalars: ``values[i]`` goes to column ``columns[i]``."""
        if self._n == self.CHUNK:
            self._done.append((self._values, self._present, self._n))
            self._new_chunk(max(16, len(self.names)))
        if len(self.names) > self._values.shape[1]:
            self._widen(max(2 * self._values.shape[1], len(self.names)))
        self._values[self._n, columns] = values
        self._present[self._n, columns] = True
        self._n += 1
        self._steps.append(step)
        self._jobs.append(job)

    def finish(self) -> None:
        """Join the chunks into ``values``, ``present``, ``steps`` and ``jobs``."""
        chunks = self._done + [(self._values, self._present, self._n)]
        width, rows = len(self.names), sum(n for _, _, n in chunks)
        self.values = np.full((rows, width), np.nan)
        self.present = np.zeros((rows, width), dtype=bool)
        at = 0
        for values, present, n in chunks:
            w = min(width, values.shape[1])
            self.values[at: at + n, :w] = values[:n, :w]
            self.present[at: at + n, :w] = present[:n, :w]
            at += n
        self.steps = np.asarray(self._steps, dtype=np.int64)
        self.jobs = np.asarray(self._jobs, dtype=np.int64)
        del self._done, self._values, self._present

    def has(self, name: str) -> bool:
        """Was ``name`` in any record?"""
        return name in self.index

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, jobs, values) of the records holding ``name``."""
        c = self.index[name]
        held = self.present[:, c]
        return self.steps[held], self.jobs[held], self.values[held, c]

    def _new_chunk(self, width: int) -> None:
        self._values = np.full((self.CHUNK, width), np.nan)
        self._present = np.zeros((self.CHUNK, width), dtype=bool)
        self._n = 0

    def _widen(self, width: int) -> None:
        values = np.full((self.CHUNK, width), np.nan)
        present = np.zeros((self.CHUNK, width), dtype=bool)
        values[:, : self._values.shape[1]] = self._values
        present[:, : self._present.shape[1]] = self._present
        self._values, self._present = values, present


class StepGrid:
    """One value per row (module, rank or layer) per log step, in ``MAX_COLUMNS`` step bins:
    bin b covers steps ``[first + b*width, first + (b+1)*width)``."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name  # kind: module | rank | tensor
        self.bins = MAX_COLUMNS
        self.capacity = 0
        self.rows = 0
        self.total = np.zeros((self.bins, 0))
        self.count = np.zeros((self.bins, 0), dtype=np.int32)
        self.nonfinite = np.zeros((self.bins, 0), dtype=bool)
        self.seen = np.zeros(self.bins, dtype=bool)
        self.first: Optional[int] = None
        self.width = 1
        self.spread: list[tuple] = []  # per-rank grids: (step, job, min, median, max, slowest rank)
        self.spacing: dict[int, int] = {}  # steps between consecutive log steps -> how often (the log interval)
        self._last_step: Optional[int] = None

    def add(self, step: int, job: int, rows: Rows, nrows: int, values: np.ndarray) -> None:
        """One record's values of this family (``rows``: where ``values`` go)."""
        if self._last_step is not None and step > self._last_step and (
                len(self.spacing) < MAX_SPACINGS or step - self._last_step in self.spacing):
            self.spacing[step - self._last_step] = self.spacing.get(step - self._last_step, 0) + 1
        self._last_step = step
        if self.first is None:
            self.first = step
        elif step < self.first:  # a job resumed before the first step seen (a rollback past it)
            self._extend_back(step)
        b = (step - self.first) // self.width
        while b >= self.bins:
            self._halve()
            b = (step - self.first) // self.width
        if nrows > self.capacity:
            self._grow(nrows)
        self.rows = max(self.rows, nrows)
        finite = np.isfinite(values)
        total, count = self.total[b], self.count[b]
        if finite.all():
            total[rows] += values
            count[rows] += 1
        else:
            total[rows] += np.where(finite, values, 0.0)
            count[rows] += finite
            self.nonfinite[b][rows] |= ~finite
        self.seen[b] = True
        if self.kind == "rank":
            self._add_spread(step, job, rows, values, finite)

    def held_rows(self) -> np.ndarray:
        """The rows that hold a value (finite or not) in some bin, ascending: a Monitor on ranks 2 and 3
        of a world of 4 holds rows 2 and 3 of a per-rank grid, whose rows are global ranks."""
        rows = self.count[:, : self.rows].any(axis=0) | self.nonfinite[:, : self.rows].any(axis=0)
        return np.flatnonzero(rows)

    def restart(self, step: int) -> None:
        """A job resumed at ``step``: the bins from there on start over (the new job replaces them),
        the bin holding ``step`` too. That one loses the earlier job's steps before ``step`` (its
        sums cannot be split); kept, it would mix the abandoned steps after them into the new job's."""
        if self.first is None:
            return
        b = max(0, (step - self.first) // self.width)  # the bin holding step
        if b < self.bins:
            self.total[b:] = 0
            self.count[b:] = 0
            self.nonfinite[b:] = False
            self.seen[b:] = False

    def image(self, lost: Iterable[tuple[int, int]] = ()) -> Optional[tuple[np.ndarray, np.ndarray, float, float]]:
        """(bin means [columns x rows], non-finite flags, x0, x1): an image spanning steps x0..x1.
        Log steps are usually further apart than a bin is wide: an empty bin between logged ones is
        drawn with the nearest logged bin's value (the log interval may change: a resumed job's, a
        schedule denser at first), and the first and last logged bins over half the most common
        spacing of log steps beyond them. An empty bin holding a ``lost`` step ((first, last) steps
        of records a ``gap`` record says could not be written) has no value: a neighbour's would
        stand for a record that exists nowhere; nor has one in a stretch with no record more than
        :data:`HOLE_SPANS` times as wide as the spacing of the logged bins either side of it (records a
        hard kill lost before a resume), beyond half that spacing from its ends."""
        used = np.flatnonzero(self.seen)
        if used.size == 0 or self.rows == 0:
            return None
        b0, b1 = int(used[0]), int(used[-1])
        interval = max(self.spacing, key=self.spacing.get) if self.spacing else 1
        half = -(-interval // self.width) // 2  # in bins: a log step's share of the bins up to the next one
        wanted = np.arange(b0 - half, b1 + half + 1)
        if used.size == 1:
            columns = np.full(wanted.size, b0)
        else:
            at = np.clip(np.searchsorted(used, wanted), 1, used.size - 1)
            before, after = used[at - 1], used[at]
            columns = np.where(np.abs(wanted - before) <= np.abs(after - wanted), before, after)
        distance = np.abs(wanted - columns)
        empty = (distance > 0) & self._lost_bins(lost, wanted)
        if used.size > 2:  # a stretch with no record, far wider than the log spacing either side of it
            spans = np.diff(used)
            local = np.maximum(np.concatenate(([0], spans[:-1])), np.concatenate((spans[1:], [0])))
            pair = at - 1  # the logged bins each column lies between
            hole = (spans[pair] > HOLE_SPANS * local[pair]) & (wanted > used[pair]) & (wanted < used[pair + 1])
            empty |= hole & (distance > local[pair] // 2)
        mean = self._means(columns)
        mean[empty] = np.nan
        nonfinite = self.nonfinite[columns, : self.rows] & ~empty[:, None]
        x0 = self.first + (b0 - half) * self.width - 0.5
        x1 = self.first + (b1 + half + 1) * self.width - 0.5
        return mean, nonfinite, float(x0), float(x1)

    def logged(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(the centre step of every bin holding values, bin means [bins x rows]) for line plots."""
        used = np.flatnonzero(self.seen)
        if used.size == 0 or self.rows == 0:
            return None
        return self.first + used * self.width + (self.width - 1) / 2.0, self._means(used)

    def spread_arrays(self) -> dict[str, np.ndarray]:
        """Per-rank grids: step, job, min, median, max and the slowest rank at every log step."""
        if not self.spread:
            return {}
        a = np.array(self.spread, dtype=np.float64)
        return {"step": a[:, 0], "job": a[:, 1].astype(int), "min": a[:, 2], "median": a[:, 3],
                "max": a[:, 4], "slowest": a[:, 5]}

    # --- helpers -------------------------------------------------------------------------
    def _lost_bins(self, lost: Iterable[tuple[int, int]], bins: np.ndarray) -> np.ndarray:
        """Which of ``bins`` (consecutive) hold a step of the ``lost`` (first, last) step ranges."""
        ranges = np.asarray(list(lost), dtype=np.int64).reshape(-1, 2)
        start = int(bins[0])
        marks = np.zeros(bins.size + 1, dtype=np.int64)  # +1 at a range's first bin, -1 past its last
        first = np.clip((ranges[:, 0] - self.first) // self.width - start, 0, bins.size)
        last = np.clip((ranges[:, 1] - self.first) // self.width - start + 1, 0, bins.size)
        np.add.at(marks, first, 1)
        np.add.at(marks, last, -1)
        return np.cumsum(marks[:-1]) > 0

    def _means(self, columns: np.ndarray) -> np.ndarray:
        count = self.count[columns, : self.rows]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = self.total[columns, : self.rows] / count
        mean[count == 0] = np.nan
        return mean

    def _add_spread(self, step: int, job: int, rows: Rows, values: np.ndarray, finite: np.ndarray) -> None:
        if not finite.any():
            self.spread.append((step, job, np.nan, np.nan, np.nan, -1))
            return
        kept = np.where(finite, values, np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            slowest = int(np.nanargmax(kept))
            rank = slowest if isinstance(rows, slice) else int(rows[slowest])
            self.spread.append((step, job, np.nanmin(kept), np.nanmedian(kept), np.nanmax(kept), rank))

    def _grow(self, n: int) -> None:
        capacity = max(n, 2 * self.capacity, 8)
        for attr in ("total", "count", "nonfinite"):
            old = getattr(self, attr)
            new = np.zeros((self.bins, capacity), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, attr, new)
        self.capacity = capacity

    def _extend_back(self, step: int) -> None:
        """Move the bins right (halving them where they would not fit) until bin 0 holds ``step``."""
        while step < self.first:
            k = -((step - self.first) // self.width)  # bins to add in front
            used = np.flatnonzero(self.seen)
            if (int(used[-1]) if used.size else 0) + k >= self.bins:
                self._halve()
                continue
            for attr in ("total", "count", "nonfinite", "seen"):
                array = getattr(self, attr)
                array[k:] = array[:-k].copy()
                array[:k] = 0
            self.first -= k * self.width

    def _halve(self) -> None:
        h = self.bins // 2
        self.total[:h] = self.total[0::2] + self.total[1::2]
        self.count[:h] = self.count[0::2] + self.count[1::2]
        self.nonfinite[:h] = self.nonfinite[0::2] | self.nonfinite[1::2]
        self.seen[:h] = self.seen[0::2] | self.seen[1::2]
        self.total[h:] = 0
        self.count[h:] = 0
        self.nonfinite[h:] = False
        self.seen[h:] = False
        self.width *= 2
