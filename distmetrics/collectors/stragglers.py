"""Straggler scores: how fast each rank is against the fastest, over a sliding window of log steps.

``score[r] = min over ranks q of median(q) / median(r)``, where ``median(r)`` is the median of
rank r's step times (ms per step) over the last ``straggler_window`` log steps: 1.0 is as fast
as the fastest rank, 0.5 takes twice its time. The median makes one slow interval (a
checkpoint, a garbage-collection pause) count for little and a rank that is slow every time
count fully. The same score is kept per timer where every rank's timer values reach the log
step (``timing_log_option: all``, or the ``_ranks/timers/<name>`` lanes a timer collector adds).
The Monitor builds this collector only for a job of two ranks or more (one rank has no other
to compare with).

Cost: each rank's step time is one ``all`` sample, so it rides the log step's one all-gather
(with the GPU's power and SM clock beside it when NVML is on); where nothing else is gathered
it is that one gather. Between log steps nothing is measured but a clock reading. At a log step
every series' median is taken over its whole window again: the work grows with the window
(``straggler_window`` is at most 100), the ranks and the timers (``python -m benchmarks.scale``).

A rank's step time is its own wall time from the end of the last log step's reduction to the
start of this one, over the steps in between: the wait inside the log step's collectives (for
the slowest rank) is left out. Collectives inside the training step (gradient all-reduce,
FSDP all-gathers) make the fast ranks wait for the slow one *within* their steps, so in a job
whose steps synchronise the step scores come out close to 1 everywhere; the per-timer scores
(a data-loading timer, a compute timer) are where such a straggler shows.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence

from ..interval import IntervalClock
from ..reduce import PerRank
from .base import Alert, LogContext, Record, Sample
from .straggler_scores import (HostWindows, Windows, fastest_ranks, relative_scores, slowest_ranks, window_medians,
                               window_scores)

__all__ = ["StragglerCollector", "window_medians", "window_scores", "relative_scores", "slowest_ranks", "fastest_ranks",
           "STEP_MS", "RANK_TIMERS_PREFIX"]

logger = logging.getLogger("distmetrics")

STEP_MS = "_stragglers/step_ms"
"""Internal lane: this rank's milliseconds per step over the interval (gathered from every rank)."""
POWER_W = "_stragglers/power_w"
SM_CLOCK_MHZ = "_stragglers/sm_clock_mhz"
_HOST_WORLD = 32
"""Worlds of up to this many ranks are scored in Python lists (cheaper there than tensors)."""
RANK_TIMERS_PREFIX = "_ranks/timers/"
"""Internal lanes ``_ranks/timers/<name>``: every rank's timer value where timers reduce as max/minmax."""


class StragglerCollector:
    """Per-rank straggler scores over a sliding window, the slowest rank every log step, a
    ``stragglers`` record every ``report_every`` log steps and an alert for a rank that stays
    below ``threshold`` for a whole window."""

    name = "stragglers"
    after = ("timers",)  # reads every rank's timer values from the reduced metrics
    writes = ("stragglers/",)

    def __init__(self, window: int = 10, report_every: int = 10, report_ranks: int = 8, threshold: float = 0.9,
                 nvml: bool = False, uuid: Optional[str] = None) -> None:
        if window < 1:
            raise ValueError(f"straggler_window={window!r}: accepted values are integers >= 1 here (0 turns "
                             "the collector off before it is built)")
        self.window, self.report_every, self.report_ranks = window, report_every, report_ranks
        self.threshold = threshold
        self._windows: Any = None  # Windows or HostWindows: "" is the step time, else a timer's name
        self._alerted: set[int] = set()  # places among the Monitor's ranks (as the windows index them)
        self._ids: list[int] = []  # the global rank of each place (what records and alerts name)
        self._log_steps = 0
        self._gpu = _GpuReadings.open(uuid) if nvml else None
        self.clock = IntervalClock()
        self._untimed = 0  # 1 in the first interval: the step whose call started the clock

    def start(self) -> None:
        """Start this rank's clock at the first ``monitor.step`` (building the Monitor is no step's time)."""
        self.clock.restart()
        self._untimed = 1

    def pause(self) -> None:
        """Stop this rank's clock (``monitor.pause()``: evaluation, a checkpoint save)."""
        self.clock.pause()

    def resume(self) -> None:
        """Start the clock again after :meth:`pause`; the paused time is left out."""
        self.clock.resume()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """This rank's milliseconds per step since the last log step, pauses left out (and its
        GPU's power and SM clock when NVML is on), every rank's value gathered."""
        timed, self._untimed = ctx.steps - self._untimed, 0
        # ns to ms as the timers convert (equal steps give equal numbers); NaN: no time this interval
        ms = self.clock.take_ns(until=ctx.ended_at) / 1e6 / timed if timed > 0 else math.nan
        samples = [Sample(STEP_MS, ms, "all")]
        if self._gpu is not None:
            samples += [Sample(name, value, "all") for name, value in self._gpu.read(ctx.step).items()]
        return samples

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Any]:
        """``stragglers/score_min`` and where it runs, per-timer minima, the periodic record and
        the alert; the internal lanes are taken out of ``metrics``. Every series (the step time,
        each timer) is scored together: a few tensor operations, or a few list operations in a
        world of up to 32 ranks."""
        step_ms = metrics.pop(STEP_MS, None)
        gpu = {"power_w": metrics.pop(POWER_W, None), "sm_clock_mhz": metrics.pop(SM_CLOCK_MHZ, None)}
        series = {"": step_ms} if step_ms is not None else {}
        series.update(_every_ranks_timers(metrics, ctx))
        out: list[Any] = []
        if series:
            world = len(next(iter(series.values())))
            if self._windows is None or self._windows.world != world:  # another world size: start over
                self._windows = (HostWindows if world <= _HOST_WORLD else Windows)(self.window, world)
                self._alerted = set()  # the old world's places: an alert there says nothing of the new one
            self._windows.push(series)
            self._ids = list(_rank_ids(next(iter(series.values()))))
            for name, (value, place) in zip(series, self._windows.slowest(list(series))):
                key = f"stragglers/{name}/score_min" if name else "stragglers/score_min"
                _write_minimum(metrics, key, value, place, self._ids, ctx.hosts, with_host=not name)
            if step_ms is not None:
                out += self._persistent(ctx.hosts)
        self._log_steps += 1
        if step_ms is not None and self.report_every and self._log_steps % self.report_every == 0:
            report = self._report(list(series), gpu, ctx.hosts)
            if report["fastest"]:  # else no rank has a step time yet (log_interval 1: the first log step)
                out.append(Record("stragglers", report))
        self.clock.restart()  # the next interval starts after this log step's reduction
        return out

    def close(self) -> None:
        """Nothing to release."""

    # --- helpers -------------------------------------------------------------------------
    def _persistent(self, hosts: Sequence[Any]) -> list[Alert]:
        """One alert naming the ranks that newly scored below the threshold at every log step of
        a full window (a rank is named again only after it has recovered), with the highest of
        those per-interval scores: what decided it (the window's median score may be 1.0)."""
        stuck = self._windows.stuck(self.threshold, self.window)
        if not self._alerted and not stuck:  # the usual case
            return []
        new = [r for r in stuck if r not in self._alerted]
        self._alerted = set(stuck)
        if not new:
            return []
        scores = {r: self._windows.highest_below(r) for r in new}
        named = [f"rank {self._ids[r]} ({_where(r, hosts)}, score at most {_below(scores[r], self.threshold)})"
                 for r in new[:self.report_ranks]]
        more = f" and {len(new) - len(named)} more" if len(new) > len(named) else ""
        message = (f"straggler: {', '.join(named)}{more} below {self.threshold:g} of the fastest rank's "
                   f"speed at each of the last {self.window} log steps")
        return [Alert("straggler", message, {"ranks": [self._ids[r] for r in new], "threshold": self.threshold,
                                             "scores": [_finite(scores[r]) for r in new]})]

    def _report(self, names: list[str], gpu: dict, hosts: Sequence[Any]) -> dict:
        """The ``stragglers`` record: the slowest ranks (those below the fastest only) and the
        fastest (the others: no rank in both) with their hosts, scores and median milliseconds per
        step (with NVML, their last power and SM clock readings); per timer (``names`` after the
        step time), its slowest ranks."""
        n, windows = self.report_ranks, self._windows

        def slowest(name: str) -> list[int]:  # the fastest scores exactly 1.0 (its median over itself)
            return [rank for rank in windows.ranks(name, n, slowest=True) if windows.score(name, rank) < 1.0]

        def rows(name: str, ranks: list[int]) -> list[dict]:
            out = []
            for rank in ranks:  # a place among the Monitor's ranks; the row names its global rank
                row = {"rank": self._ids[rank], "host": _host(rank, hosts), "local_rank": _local_rank(rank, hosts),
                       "score": _finite(windows.score(name, rank)), "ms": _finite(windows.median(name, rank))}
                if not name:
                    row.update({key: _rank_value(values, rank) for key, values in gpu.items() if values is not None})
                out.append(row)
            return out

        below = slowest("")
        fastest = [rank for rank in windows.ranks("", n + len(below), slowest=False) if rank not in below][:n]
        return {"window": windows.filled, "threshold": self.threshold, "slowest": rows("", below),
                "fastest": rows("", fastest), "timers": {name: rows(name, slowest(name)) for name in names if name}}


def _every_ranks_timers(metrics: dict[str, Any], ctx: LogContext) -> dict[str, PerRank]:
    """Every rank's timer values: ``timers/<name>`` under ``all``, else the ``_ranks/timers/<name>``
    lanes (taken out of ``metrics``)."""
    keys = ctx.keys_under(metrics, (RANK_TIMERS_PREFIX, "timers/"))
    found: dict[str, PerRank] = {}
    for key in keys:
        if key.startswith(RANK_TIMERS_PREFIX) and isinstance(metrics.get(key), PerRank):
            found[key[len(RANK_TIMERS_PREFIX):]] = metrics.pop(key)
    for key in keys:
        if key.startswith("timers/") and isinstance(metrics.get(key), PerRank):
            found.setdefault(key[len("timers/"):], metrics[key])
    return found  # the lanes' summaries (``/max``...) start with "_": the Monitor leaves them out


def _write_minimum(metrics: dict[str, Any], key: str, value: float, place: int, ids: Sequence[int],
                   hosts: Sequence[Any], with_host: bool) -> None:
    if value == math.inf:  # no rank has a score
        return
    metrics[key] = value
    metrics[f"{key}_rank"] = ids[place]
    if with_host and place < len(hosts):
        metrics[f"{key}_host"] = _host(place, hosts)
        metrics[f"{key}_local_rank"] = _local_rank(place, hosts)


def _rank_value(values: Sequence[Optional[float]], rank: int) -> Optional[float]:
    return _finite(values[rank]) if rank < len(values) else None


def _finite(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def _rank_ids(values: Sequence[Any]) -> Sequence[int]:
    """The global rank of each place of a per-rank series (a :class:`PerRank` of a Monitor on a
    group other than the world knows them; else places are ranks)."""
    return values.rank_ids() if isinstance(values, PerRank) else range(len(values))


def _place_of(rank: int, hosts: Sequence[Any]) -> int:
    """Where global ``rank`` is among the Monitor's ranks (``hosts``, in their group's order)."""
    return next((place for place, h in enumerate(hosts) if getattr(h, "rank", place) == rank), rank)


def _host(rank: int, hosts: Sequence[Any]) -> Optional[str]:
    return hosts[rank].hostname if rank < len(hosts) else None


def _local_rank(rank: int, hosts: Sequence[Any]) -> Optional[int]:
    return hosts[rank].local_rank if rank < len(hosts) else None


def _where(rank: int, hosts: Sequence[Any]) -> str:
    if rank >= len(hosts):
        return "host unknown"
    return f"{hosts[rank].hostname}, local rank {hosts[rank].local_rank}"


class _GpuReadings:
    """This rank's GPU power (W) and SM clock (MHz) from NVML, read at log steps only."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle
        self._broken: set[str] = set()  # readings the GPU does not support
        self._said = False

    @classmethod
    def open(cls, uuid: Optional[str]) -> Optional["_GpuReadings"]:
        """Readings of this rank's GPU (by UUID), or None where NVML cannot be used: the energy
        and telemetry collectors already say why, once."""
        from .nvml import cuda_device_uuid, open_nvml_handle

        try:
            return cls(*open_nvml_handle(uuid or cuda_device_uuid()))
        except Exception:  # noqa: BLE001 - no GPU, no NVML: the record leaves power and clock out
            return None

    def read(self, step: int) -> dict[str, float]:
        """The readings this GPU supports: one it does not support is not asked again; one that fails
        otherwise (an NVML error, a GPU lost) is left out of this record, said once, and read again
        at the next log step (as the telemetry collector does)."""
        from .nvml import _unsupported

        n, h = self._nvml, self._handle
        readers = {POWER_W: lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                   SM_CLOCK_MHZ: lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)}
        out = {}
        for name, read in readers.items():
            if name in self._broken:
                continue
            try:
                out[name] = float(read())
            except Exception as err:  # noqa: BLE001 - the record leaves it out
                if _unsupported(n, err):
                    self._broken.add(name)
                elif not self._said:
                    self._said = True
                    logger.warning("distmetrics: the stragglers record's %s of this rank's GPU failed at step %d "
                                   "(%s: %s): left out of that record, read again at every log step; said once",
                                   name, step, type(err).__name__, err)
        return out


def _below(score: float, threshold: float) -> str:
    """A score as the alert says it: two places, or as many more as show it below ``threshold``
    (0.89997 was said as 0.90 beside "below 0.9")."""
    places = 2
    while places < 15 and math.isfinite(score) and float(f"{score:.{places}f}") >= threshold:
        places += 1
    return f"{score:.{places}f}"
