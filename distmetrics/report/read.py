"""Reading a ``metrics.jsonl`` into what the report draws, line by line, in bounded memory.

Records with the same kind and keys (every train record of a job) share one parse plan: their
values come out with one ``operator.itemgetter`` call and one ``np.array``, not a Python loop per
key; ``json.loads`` is most of the time. Families with one value per module, per rank or per
layer go to :class:`~.store.StepGrid` bins, scalars to a :class:`~.store.ScalarTable`.

Jobs: a ``run`` record starts a job; all jobs share one step axis. A job resuming at a step at
or before the last one logged takes the grids' bins over from there (its steps replace the old
ones); line plots show both jobs there, one line per job. Module rows follow the ``modules`` of
the last ``run`` record (the model's order); modules it does not name, or a file without it,
follow in "natural" order (``layers.2`` before ``layers.10``).
"""

from __future__ import annotations

import math
import operator
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ..runlog import TRAINING_KINDS as _TRAINING_KINDS, Records, last_log_step_of_end, metrics_files
from ..sinks import DASHBOARD_KINDS
from ..sinks.jsonl import NONFINITE
from .store import ScalarTable, StepGrid

__all__ = ["RunData", "load_metrics", "metrics_path", "MODULE_FAMILIES", "EVENT_KINDS"]

MODULE_FAMILIES = ("grad_norm", "update_norm", "param_norm", "relative_update_norm", "effective_lr_ratio")
"""Metric families with one value per module (``<family>/<module>``)."""
STRAGGLER_REPORTS_KEPT = 20
EVENT_KINDS = ("gap", "resume")
"""Record kinds that say what happened to the file, not what was measured: listed with the
alerts and marked on the plots, never drawn as curves nor counted as metric records."""
_PER_RANK = re.compile(r"^(.+)/rank(0|[1-9]\d{0,8})$")
_ALL_SUMMARY = ("max", "min", "mean")
"""What an ``all`` metric writes beside its ``<name>/rank<r>`` values: ``<name>/max``, ``/min``, ``/mean``."""


class RunData:
    """Everything the report draws, read from one ``metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.scalars = ScalarTable()
        self.grids: dict[tuple[str, str], StepGrid] = {}
        self.modules: list[str] = []
        self.layers: list[str] = []
        self._rows: dict[str, dict[str, int]] = {"module": {}, "layer": {}}
        self.model_order: list[str] = []  # the modules of the last run record, in model order
        self.jobs: list[dict] = []
        self.alerts: list[dict] = []
        self.events: list[dict] = []  # gap and resume records (EVENT_KINDS)
        self.lost: list[tuple[int, int]] = []  # (first, last) steps of records lost (gap records) no job logged again
        self.kinds: dict[str, int] = {}  # the records drawn as metrics, by kind (train, eval, progress, ...)
        self.first_nonfinite: list[dict] = []  # health/first_nonfinite_module beside the metrics
        self.last_text: dict[str, Any] = {}
        self.straggler_reports: deque = deque(maxlen=STRAGGLER_REPORTS_KEPT)
        self.gpu_models: dict[str, int] = {}
        self.rank_hosts: dict[int, str] = {}
        self._job_ranks: Optional[frozenset] = None  # the job's global ranks (its run record's)
        self.lines = self.blank_lines = self.bad_lines = self.records = 0
        self.step_min: Optional[int] = None
        self.step_max: Optional[int] = None
        self.read_s = 0.0
        self._plans: dict[tuple, _Plan] = {}
        self._job = -1
        self._job_started = False
        # the last step logged before a job whose first step is not seen yet
        self._restart_pending: Optional[int] = None

    def read(self) -> "RunData":
        """Read the file by the rule ``summary`` reads it (:class:`~distmetrics.runlog.Records`: a
        line cut short by a crash is counted in ``bad_lines`` and skipped); a file with no record is
        refused (:class:`~distmetrics.runlog.EmptyMetricsFile`, :class:`~distmetrics.runlog.NotAMetricsFile`)."""
        t0 = time.perf_counter()
        records = Records(self.path)
        try:
            for record in records:
                if record["kind"] == "run":
                    self._start_job(record)
                else:
                    self._take(record)
        finally:
            self.lines, self.blank_lines, self.bad_lines = records.lines, records.blank, records.unreadable
        self.scalars.finish()
        self._plans.clear()
        self.module_rows = _row_order(self.modules, self.model_order)
        self.layer_rows = _row_order(self.layers, [])
        self.read_s = time.perf_counter() - t0
        return self

    # --- records -------------------------------------------------------------------------
    def _start_job(self, record: dict) -> None:
        self.jobs.append(_job_meta(record, len(self.jobs)))
        ranks = record.get("ranks")
        self._job_ranks = None  # the job's global ranks, where its run record lists them
        if isinstance(ranks, list) and ranks:
            self.rank_hosts = {int(r["rank"]): str(r.get("host", "")) for r in ranks
                               if isinstance(r, dict) and isinstance(r.get("rank"), int)}
            self._job_ranks = frozenset(self.rank_hosts)
        modules = record.get("modules")
        if isinstance(modules, list) and modules:
            self.model_order = [str(m) for m in modules]
        self._job, self._job_started, self._restart_pending = len(self.jobs) - 1, False, None
        self._plans.clear()  # which names are per rank depends on the job's world size

    def _take(self, record: dict) -> None:
        kind, step = record["kind"], record["step"]
        if kind == "end":  # how the job ended: in the jobs table, not on the step axis
            if self._job < 0:  # a file whose head was lost: the records before any run record are a job,
                self.jobs.append(_job_meta({}, 0))  # as summary numbers them (a job 1 here is its job 1)
                self._job = 0
            self.jobs[self._job]["end"] = record
            if record.get("stepped") is not False:  # its last log step: logged, as runlog.last_logged_step reads it
                self._logged(last_log_step_of_end(record))
            return
        if kind == "gpu_model":  # once per job at start: not on the step axis
            for gpu in record.get("ranks", [record]):
                name = str(gpu.get("name", "?")) if isinstance(gpu, dict) else "?"
                self.gpu_models[name] = self.gpu_models.get(name, 0) + 1
            return
        self._count_step(step, kind, record)
        if kind == "alert":
            self.alerts.append({"step": step, "job": self._job, "type": str(record.get("alert", "alert")),
                                "message": str(record.get("message", "")), "first_module": record.get("first_module")})
        elif kind == "stragglers":  # drawn as a table, and named in the summary as the other kinds drawn
            self.straggler_reports.append((step, self._job, record))
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        elif kind in EVENT_KINDS:
            self.events.append({"step": step, "job": self._job, "type": kind, "message": _event_message(record),
                                "first_module": None})
            lost = _lost_steps(record) if kind == "gap" else None
            if lost is not None:
                self.lost.append(lost)
                self._logged(lost[1])  # lost from this file, not from TensorBoard: logged, as the Monitor reads it
        else:
            self.records += kind in DASHBOARD_KINDS
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            self._take_values(record, step)

    def _logged(self, step: Any) -> None:
        """``step`` was logged by the current job (a record, or one a full disk lost from this file only)."""
        if isinstance(step, int) and not isinstance(step, bool) and self._job >= 0:
            meta = self.jobs[self._job]
            meta["last_logged"] = step if meta.get("last_logged") is None else max(meta["last_logged"], step)

    def _count_step(self, step: int, kind: Any = None, record: Optional[dict] = None) -> None:
        if self._job < 0:  # a file without a run record
            self.jobs.append(_job_meta({}, 0))
            self._job = 0
        meta = self.jobs[self._job]
        if not self._job_started:
            self._job_started = True
            meta["first_step"] = step
            # the last step logged before this job (as the Monitor reads it at a restart: the
            # latest job's, not the highest of all: after a rollback that one was abandoned)
            before = next((job["last_logged"] for job in reversed(self.jobs[:self._job])
                           if job.get("last_logged") is not None and job.get("trained")), None)
            if before is not None:
                meta["previous_last_step"] = before
                self._restart_pending = before
        if self._restart_pending is not None and kind in ("resume", *_TRAINING_KINDS):
            # the earlier job's records are dropped from this job's first step on, as TensorBoard
            # drops them: where its resume record says, or its first train record, when that is at
            # or before the last step logged. Records before it (an evaluation of the restored
            # checkpoint) drop nothing; an evaluation-only job, or one that continues, drops nothing.
            start = record["from_step"] if kind == "resume" and isinstance(record.get("from_step"), int) else step
            meta["resumed_at_or_before_last"] = start <= self._restart_pending
            if start <= self._restart_pending:
                meta["resumed_at"] = start
                for grid in self.grids.values():
                    grid.restart(start)
                # steps lost before are this job's to log again: only the part before it stays lost
                self.lost = [(a, min(b, start - 1)) for a, b in self.lost if a < start]
            self._restart_pending = None
        meta["last_step"] = step if meta["last_step"] is None else max(meta["last_step"], step)
        if kind in DASHBOARD_KINDS:  # what the Monitor reads as the last step logged (runlog.last_logged_step)
            self._logged(step)
        if kind == "train":  # the job's first and last train record, as summary shows them
            if meta["first_train_step"] is None:
                meta["first_train_step"] = step
            meta["last_train_step"] = step
        if kind in _TRAINING_KINDS:
            meta["trained"] = True  # a job that only evaluated dropped nothing: the one before it counts
        meta["records"] += 1
        self.step_min = step if self.step_min is None else min(self.step_min, step)
        self.step_max = step if self.step_max is None else max(self.step_max, step)

    def _take_values(self, record: dict, step: int) -> None:
        signature = (record.get("kind"), len(record), hash(tuple(record)))
        plan = self._plans.get(signature)
        if plan is None:
            plan = self._plans[signature] = self._plan(record)
        if plan.getter is not None:
            values = plan.getter(record)
            try:
                array = np.array(values, dtype=np.float64)
            except (TypeError, ValueError, OverflowError):  # "NaN", "Infinity" among the numbers; an int past float64
                array = np.array([_number(v) for v in values], dtype=np.float64)
            if plan.scalar_positions.size:
                self.scalars.add(step, self._job, plan.scalar_columns, array[plan.scalar_positions])
            for grid, positions, rows, nrows in plan.grids:
                grid.add(step, self._job, rows, nrows, array[positions])
        for key in plan.text:
            value = self.last_text[key] = record.get(key)
            if key == "health/first_nonfinite_module" and isinstance(value, str) and value not in NONFINITE:
                self.first_nonfinite.append({"step": step, "job": self._job, "module": value})

    # --- parse plans ---------------------------------------------------------------------
    def _plan(self, record: dict) -> "_Plan":
        """How to take records with these keys apart."""
        plan = _Plan()
        numeric: list[str] = []
        scalar_positions, scalar_columns = [], []
        families: dict[tuple[str, str], tuple[list, list]] = {}
        for key, value in record.items():
            if key in ("kind", "step", "time") or isinstance(value, (dict, list)) or \
                    (key == "after_step" and record.get("kind") == "progress"):  # a checkpoint's step: no metric
                continue
            if isinstance(value, str) and value not in NONFINITE:
                plan.text.append(key)
                continue
            position = len(numeric)
            numeric.append(key)
            family = self._family_of(key, record)
            if family is None:
                scalar_positions.append(position)
                scalar_columns.append(self.scalars.column(key))
            else:
                kind, name, row = family
                positions, rows = families.setdefault((kind, name), ([], []))
                positions.append(position)
                rows.append(row)
        if numeric:
            plan.getter = operator.itemgetter(*numeric) if len(numeric) > 1 else (lambda r, k=numeric[0]: (r[k],))
        plan.scalar_positions = np.asarray(scalar_positions, dtype=np.intp)
        plan.scalar_columns = np.asarray(scalar_columns, dtype=np.intp)
        plan.grids = [(self._grid(kind, name), *_slots(positions, rows))
                      for (kind, name), (positions, rows) in families.items()]
        return plan

    def _family_of(self, key: str, record: dict) -> Optional[tuple[str, str, int]]:
        """(grid kind, family name, row) of a per-rank, per-module or per-layer key; None for a scalar."""
        match = _PER_RANK.match(key)
        if match and self._is_per_rank(match.group(1), int(match.group(2)), record):
            return "rank", match.group(1), int(match.group(2))
        head, _, rest = key.partition("/")
        if rest and head in MODULE_FAMILIES:
            return "module", head, self._row("module", self.modules, rest)
        if head == "tensor_stats" and rest.count("/") >= 2:
            layer, tensor, stat = rest.rsplit("/", 2)
            return "tensor", f"{tensor}/{stat}", self._row("layer", self.layers, layer)
        return None

    def _is_per_rank(self, name: str, rank: int, record: dict) -> bool:
        """Whether ``<name>/rank<rank>`` is a rank's value of an ``all`` metric, as the Monitor writes
        them: beside ``<name>/max``, ``/min`` and ``/mean``, for one of the job's ranks (its run
        record's global ranks: a Monitor on ranks 2 and 3 writes ``/rank2``, ``/rank3``; else a
        rank below its world size). Any other (a metric of yours named ``u/rank0``, a module
        ``rank0``, ``data/rank2000000000``) is a scalar, or a module's row: taken for a rank, it got
        a heatmap row per rank up to it."""
        if self._job_ranks is not None:
            in_world = rank in self._job_ranks
        else:
            world = self.jobs[self._job].get("world_size") if self._job >= 0 else None
            in_world = rank < world if isinstance(world, int) and not isinstance(world, bool) else True
        return in_world and all(f"{name}/{summary}" in record for summary in _ALL_SUMMARY)

    def _row(self, kind: str, names: list[str], name: str) -> int:
        rows = self._rows[kind]
        row = rows.get(name)
        if row is None:
            row = rows[name] = len(names)
            names.append(name)
        return row

    def _grid(self, kind: str, name: str) -> StepGrid:
        grid = self.grids.get((kind, name))
        if grid is None:
            grid = self.grids[(kind, name)] = StepGrid(kind, name)
        return grid


class _Plan:
    """How to take one record schema apart: one itemgetter, index arrays per destination."""

    __slots__ = ("getter", "scalar_positions", "scalar_columns", "grids", "text")

    def __init__(self) -> None:
        self.getter = None
        self.scalar_positions = self.scalar_columns = np.empty(0, dtype=np.intp)
        self.grids: list[tuple] = []  # (grid, positions, rows (slice | array), number of rows)
        self.text: list[str] = []


def metrics_path(run: Union[str, os.PathLike]) -> Path:
    """The one ``metrics.jsonl`` a path names (the file, a run folder's file, or a folder of run
    folders that holds one run; :func:`~distmetrics.runlog.metrics_files`); a clear error when it
    names none or several."""
    found = metrics_files(run)
    if len(found) > 1:
        raise ValueError(f"{str(run)!r} holds {len(found)} runs ({found[0].parent.name} ... "
                         f"{found[-1].parent.name}): give one run folder, or `distmetrics report {run}` "
                         "for one report beside each run's metrics.jsonl")
    return found[0]


def load_metrics(run: Union[str, os.PathLike]) -> RunData:
    """Read a run's ``metrics.jsonl`` (the file, or the run directory holding it)."""
    return RunData(metrics_path(run)).read()


def _slots(positions: list, rows: list) -> tuple:
    """(positions, rows as a slice when they are 0..n-1, number of rows), sorted by row."""
    positions_a, rows_a = np.asarray(positions, dtype=np.intp), np.asarray(rows, dtype=np.intp)
    order = np.argsort(rows_a, kind="stable")
    positions_a, rows_a = positions_a[order], rows_a[order]
    nrows = int(rows_a.max()) + 1
    if rows_a.size == nrows:  # every row once: a slice, no fancy indexing
        return positions_a, slice(0, nrows), nrows
    keep = np.concatenate([[True], np.diff(rows_a) != 0])  # the same row twice: the first
    return positions_a[keep], rows_a[keep], nrows


def _row_order(names: list[str], model_order: list[str]) -> np.ndarray:
    """Rows in model order where the run record names them, then the rest in natural order."""
    rank = {name: i for i, name in enumerate(model_order)}
    known = sorted((i for i, n in enumerate(names) if n in rank), key=lambda i: rank[names[i]])
    rest = sorted((i for i, n in enumerate(names) if n not in rank), key=lambda i: _natural_key(names[i]))
    return np.asarray(known + rest, dtype=np.intp)


def _natural_key(text: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t]


def _number(value: Any) -> float:
    if isinstance(value, str):
        return NONFINITE.get(value, math.nan)
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
    except OverflowError:  # an integer beyond float64's range (a count of 400 digits): as the float it passes
        return math.inf if value > 0 else -math.inf


def _event_message(record: dict) -> str:
    if record.get("kind") == "gap":
        return (f"{record.get('lost_records')} record(s), steps {record.get('first_step')}-{record.get('last_step')}, "
                f"could not be written: {record.get('error', '')}")
    return str(record.get("message", ""))


def _lost_steps(record: dict) -> Optional[tuple[int, int]]:
    """The (first, last) steps of the records a ``gap`` record says were lost; None where it names
    no such steps (integers, first <= last)."""
    first, last = record.get("first_step"), record.get("last_step")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, last)) or first > last:
        return None
    return first, last


def _job_meta(record: dict, index: int) -> dict:
    hosts = record.get("hosts")
    return {"index": index, "time": record.get("time"), "world_size": record.get("world_size"),
            "hosts": len(hosts) if isinstance(hosts, list) else None, "job_id": record.get("job_id"),
            "layout": record.get("layout"), "torch": record.get("torch_version"),
            "distmetrics": record.get("distmetrics_version"), "end_record": record.get("end_record") is True,
            "first_step": None, "last_step": None,
            "first_train_step": None, "last_train_step": None, "records": 0}
