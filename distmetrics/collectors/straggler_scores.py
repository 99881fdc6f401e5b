"""The straggler scores' maths: per-rank medians over a sliding window of log steps and each
rank's score against the fastest (see :mod:`distmetrics.collectors.stragglers`).

Two forms with the same numbers, bit for bit: :class:`Windows` keeps a ``[window, series,
world]`` tensor ring (a few tensor operations whatever the number of series and ranks), and
:class:`HostWindows` Python lists, for small worlds, where a list operation costs less than a
tensor operation's dispatch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = ["Windows", "HostWindows", "window_medians", "window_scores", "relative_scores", "slowest_ranks",
           "fastest_ranks"]


class Windows:
    """Every series' per-rank values (the step time, each timer) over the last ``size`` log steps
    of a ``world``-rank job: one ``[size, series, world]`` float64 ring, NaN where a rank (or the
    series) had no valid value at that log step. A series seen first joins with an empty
    window. Row order does not matter to a median."""

    def __init__(self, size: int, world: int) -> None:
        self.size, self.world = size, world
        self.index: dict[str, int] = {}  # series name -> its row
        self.ring = torch.empty(size, 0, world, dtype=torch.float64)
        self.filled = self._next = 0
        self._times = self._scores = torch.empty(0, world, dtype=torch.float64)
        self._streak = torch.zeros(world, dtype=torch.int64)  # log steps in a row below the threshold
        self._high = torch.zeros(world, dtype=torch.float64)  # the highest step score in that row (0: none)
        self._seen = SeenAt(size)

    def push(self, series: dict[str, Sequence[Optional[float]]]) -> None:
        """This log step's values of each series (every rank's, None: none)."""
        gone = self._seen.push(series)
        if gone:  # absent for a whole window: all NaN, no median; dropped (a timer named once, say)
            self.index, keep = self._seen.without(self.index, gone)
            self.ring = self.ring[:, keep]
        new = [name for name in series if name not in self.index]
        if new:
            self.index.update({name: len(self.index) + i for i, name in enumerate(new)})
            self.ring = torch.cat([self.ring, torch.full((self.size, len(new), self.world), math.nan,
                                                         dtype=torch.float64)], dim=1)
        absent = [math.nan] * self.world
        self._times = _valid(torch.tensor([[math.nan if v is None else v for v in series[name]]
                                           if name in series else absent for name in self.index], dtype=torch.float64))
        self.ring[self._next] = self._times
        self._next = (self._next + 1) % self.size
        self.filled = min(self.filled + 1, self.size)
        self._scores = _relative(self.medians())

    def medians(self) -> torch.Tensor:
        """``[series, world]`` medians over the window (NaN: no valid value in it)."""
        return _medians(self.ring[:self.filled])

    def slowest(self, names: list[str]) -> list[tuple[float, int]]:
        """Per series: the lowest score and its rank (the lowest rank on a tie; inf: no score)."""
        values, ranks = self._scores[[self.index[n] for n in names]].nan_to_num(math.inf).min(dim=1)
        return list(zip(values.tolist(), ranks.tolist()))

    def stuck(self, threshold: float, window: int) -> list[int]:
        """The ranks whose step time was below ``threshold`` of the fastest at each of the last
        ``window`` log steps."""
        scores = _relative(self._times[self.index[""]])
        below = scores < threshold  # NaN: not below
        self._streak = torch.where(below, self._streak + 1, 0)
        self._high = torch.where(below, torch.maximum(self._high, scores), 0.0)
        full = self._streak >= window
        return full.nonzero().flatten().tolist() if bool(full.any()) else []

    def highest_below(self, rank: int) -> float:
        """The highest of ``rank``'s per-interval step scores in its present run below the threshold
        (what :meth:`stuck` judged: every one was at most this; 0.0: not below at the last push)."""
        return self._high[rank].item()

    def score(self, name: str, rank: int) -> float:
        """``rank``'s score in series ``name`` (NaN: none)."""
        return self._scores[self.index[name], rank].item()

    def median(self, name: str, rank: int) -> float:
        """``rank``'s median over the window in series ``name`` (NaN: none)."""
        return self.medians()[self.index[name], rank].item()

    def ranks(self, name: str, n: int, slowest: bool) -> list[int]:
        """The ``n`` slowest (or fastest) ranks of series ``name`` (NaN never; ties: lower rank first)."""
        scores = self._scores[self.index[name]]
        return slowest_ranks(scores, n) if slowest else fastest_ranks(scores, n)


class HostWindows:
    """:class:`Windows` in Python lists, for small worlds (the collector picks it up to 32 ranks),
    where a few list operations cost less than a tensor operation's dispatch. Same numbers, bit
    for bit, and the same methods."""

    def __init__(self, size: int, world: int) -> None:
        self.size, self.world = size, world
        self.index: dict[str, int] = {}
        self.rows: list[list[list[float]]] = []  # the ring: rows[k][series][rank], NaN: no valid value
        self.filled = self._next = 0
        self._times: list[list[float]] = []
        self._medians: list[list[float]] = []
        self._scores: list[list[float]] = []
        self._streak = [0] * world
        self._high = [0.0] * world
        self._seen = SeenAt(size)

    def push(self, series: dict[str, Sequence[Optional[float]]]) -> None:
        """This log step's values of each series (every rank's, None: none)."""
        gone = self._seen.push(series)
        if gone:  # absent for a whole window (see Windows.push)
            self.index, keep = self._seen.without(self.index, gone)
            self.rows = [[row[at] for at in keep] for row in self.rows]
        for name in series:
            if name not in self.index:
                self.index[name] = len(self.index)
                for row in self.rows:
                    row.append([math.nan] * self.world)
        absent = [math.nan] * self.world
        self._times = [[_valid_number(v) for v in series[name]] if name in series else absent
                       for name in self.index]
        if len(self.rows) < self.size:
            self.rows.append(self._times)
        else:
            self.rows[self._next] = self._times
        self._next = (self._next + 1) % self.size
        self.filled = len(self.rows)
        self._medians = [[_median([row[s][r] for row in self.rows]) for r in range(self.world)]
                         for s in range(len(self.index))]
        self._scores = [_relative_list(medians) for medians in self._medians]

    def medians(self) -> torch.Tensor:
        """``[series, world]`` medians over the window (NaN: no valid value in it)."""
        return torch.tensor(self._medians, dtype=torch.float64)

    def slowest(self, names: list[str]) -> list[tuple[float, int]]:
        """Per series: the lowest score and its rank (the lowest rank on a tie; inf: no score)."""
        out = []
        for name in names:
            best, at = math.inf, 0
            for rank, score in enumerate(self._scores[self.index[name]]):
                if score < best:  # NaN never is; the first rank keeps a tie
                    best, at = score, rank
            out.append((best, at))
        return out

    def stuck(self, threshold: float, window: int) -> list[int]:
        """The ranks below ``threshold`` of the fastest at each of the last ``window`` log steps."""
        scores = _relative_list(self._times[self.index[""]])
        below = [score < threshold for score in scores]
        self._streak = [streak + 1 if low else 0 for streak, low in zip(self._streak, below)]
        self._high = [max(high, score) if low else 0.0 for high, score, low in zip(self._high, scores, below)]
        return [rank for rank, streak in enumerate(self._streak) if streak >= window]

    def highest_below(self, rank: int) -> float:
        """As :meth:`Windows.highest_below`."""
        return self._high[rank]

    def score(self, name: str, rank: int) -> float:
        """``rank``'s score in series ``name`` (NaN: none)."""
        return self._scores[self.index[name]][rank]

    def median(self, name: str, rank: int) -> float:
        """``rank``'s median over the window in series ``name`` (NaN: none)."""
        return self._medians[self.index[name]][rank]

    def ranks(self, name: str, n: int, slowest: bool) -> list[int]:
        """The ``n`` slowest (or fastest) ranks of series ``name`` (NaN never; ties: lower rank first)."""
        scores = torch.tensor(self._scores[self.index[name]], dtype=torch.float64)
        return slowest_ranks(scores, n) if slowest else fastest_ranks(scores, n)


class SeenAt:
    """The log step each series was last pushed at, to drop one absent for a whole window (its rows
    all NaN: no median, no score), which a job whose series come and go (a timer per checkpoint, one
    named per step by mistake) kept, and went through at every push, for the rest of the run."""

    def __init__(self, size: int) -> None:
        self.size, self.pushes = size, 0
        self.last: dict[str, int] = {}

    def push(self, series: dict) -> set:
        """Note this push's series; the names, among those seen before, absent for the last ``size``
        pushes (forgotten here too)."""
        self.pushes += 1
        for name in series:
            self.last[name] = self.pushes
        if len(self.last) == len(series):  # every series seen is in this push: none can be gone
            return set()
        gone = {name for name, at in self.last.items() if self.pushes - at >= self.size}
        for name in gone:
            del self.last[name]
        return gone

    @staticmethod
    def without(index: dict[str, int], gone: set) -> tuple[dict[str, int], list[int]]:
        """``index`` (series name -> its row) without the series ``gone``, renumbered in order, and the
        old rows kept, in that order."""
        kept = [(name, at) for name, at in index.items() if name not in gone]
        return {name: k for k, (name, _) in enumerate(kept)}, [at for _, at in kept]


def _valid_number(value: Optional[float]) -> float:
    return value if value is not None and 0 < value < math.inf else math.nan


def _median(values: list[float]) -> float:
    """The median of the values that are not NaN (the mean of the middle two for an even count)."""
    present = sorted(v for v in values if v == v)
    n = len(present)
    return (present[(n - 1) // 2] + present[n // 2]) / 2 if n else math.nan


def _relative_list(times: list[float]) -> list[float]:
    """:func:`_relative` of one row in Python."""
    valid = [t for t in times if t == t]
    best = min(valid) if valid else math.inf
    return [best / t for t in times]


def window_medians(window: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank median over a window of ``[world]`` time vectors (the mean of the two middle
    values for an even count, as numpy's); values that are not finite or not > 0 (a rank
    without the value) are left out; NaN for a rank without any."""
    return _medians(_valid(torch.stack([w.to(torch.float64) for w in window])))


def _medians(rows: torch.Tensor) -> torch.Tensor:
    """Column medians of ``[k, world]`` rows whose missing values are NaN (NaN: a column without
    any): the mean of the lower median and the upper one (the lower median of the negated rows)."""
    if rows.shape[0] == 1:
        return rows[0]
    return (rows.nanmedian(dim=0).values - rows.neg().nanmedian(dim=0).values) / 2


def _valid(times: torch.Tensor) -> torch.Tensor:
    """``times`` with NaN where a value is not finite or not > 0."""
    return times.where((times > 0) & (times < math.inf), math.nan)


def _relative(times: torch.Tensor) -> torch.Tensor:
    """The smallest time of each row (the last dimension) over each time; NaN stays NaN, a row
    without a valid time is all NaN."""
    return times.nan_to_num(math.inf).amin(dim=-1, keepdim=True) / times


def window_scores(window: Sequence[torch.Tensor]) -> torch.Tensor:
    """``score[r] = min_q median(q) / median(r)`` over the window, in (0, 1]; NaN where a rank
    has no valid value."""
    return _relative(window_medians(window))


def relative_scores(times: torch.Tensor) -> torch.Tensor:
    """The fastest (smallest) valid time over each rank's time; NaN for invalid times."""
    return _relative(_valid(times))


def slowest_ranks(scores: torch.Tensor, n: int) -> list[int]:
    """The ``n`` ranks with the lowest scores, slowest first (NaN never; ties: lower rank first)."""
    return _ranked(scores, n, descending=False)


def fastest_ranks(scores: torch.Tensor, n: int) -> list[int]:
    """The ``n`` ranks with the highest scores, fastest first (NaN never; ties: lower rank first)."""
    return _ranked(scores, n, descending=True)


def _ranked(scores: torch.Tensor, n: int, descending: bool) -> list[int]:
    valid = (~torch.isnan(scores)).nonzero().flatten()
    order = torch.sort(scores[valid], descending=descending, stable=True).indices
    return valid[order][:max(int(n), 0)].tolist()
