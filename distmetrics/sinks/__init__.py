"""Sinks: where the writer rank sends reduced metrics.

A sink is a small class with one verb and a close: ``log(metrics, step, kind)`` and
``close()``. :class:`SinkSet` fans out to the enabled ones. JSONL and ``progress.txt`` are
written on the training thread (``on_training_thread = True``: a log step that returned has its
line in the file); every other sink — TensorBoard, W&B, the console, your own — runs behind one
bounded queue on one writer thread (:mod:`.writer`), so the training thread never waits for
them. A sink that raises is reported once with the real cause (a missing package: the
``pip install``; an OSError: the path and the errno) and dropped, and the others go on; the
file sinks catch their own write errors, keep trying and say what they lost
(:mod:`.appendfile`), as does the console's stdout handler on a full disk (:mod:`.console`).

Dashboards (TensorBoard, W&B) take numbers only, and ``all`` metrics as a histogram (their
``/max``, ``/min``, ``/mean`` summary is in every record already) rather than one curve per rank:
a sink that defines ``log_view(view, step)`` gets a :class:`ScalarView` instead, made once per
record (train, eval and tensor_stats records; without ``timers/*`` where
``log_timers_to_tensorboard`` is false, and without ``eval/ppl`` where
``log_validation_ppl_to_tensorboard`` is: JSONL and the console keep them).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from ..per_rank import PerRank
from .appendfile import describe_os_error
from .writer import WriterThread

__all__ = ["Sink", "SinkSet", "open_sinks", "numeric_items", "ScalarView", "scalar_view", "DASHBOARD_KINDS"]

_PURGE = "_purge"  # a queued order, not a record: timeline sinks drop steps >= its step

DASHBOARD_KINDS = ("train", "eval", "tensor_stats")
"""Record kinds that dashboards plot."""

logger = logging.getLogger("distmetrics")


class Sink(Protocol):
    """What every sink implements."""

    name: str
    """Short name used in warnings (``jsonl``, ``tensorboard``, ...)."""
    fix: str
    """What to do when it fails (shown with failures other than a missing package or an OSError).
    Optional attributes: ``install`` (the ``pip install`` shown when its package is missing),
    ``on_training_thread`` (True: written before ``monitor.step`` returns; default: on the
    writer thread), ``kinds`` (the record kinds it takes, e.g. ``("progress",)``; default:
    every kind; one kind may be given as a string; the others are not handed to it) and
    ``ended(exit_code)`` (called before ``close`` where the Monitor knows how the job ended: 0
    closed, 1 on an error, ``sys.exit``'s code)."""

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Write one record (``kind``: train, eval, run, alert, tensor_stats, progress, ...)."""

    def close(self) -> None:
        """Flush and release files and connections."""


@dataclass
class ScalarView:
    """A record as dashboards take it: numbers by name, and every rank's values of ``all``
    metrics (summarised in ``scalars`` as ``<name>/max``, ``/min``, ``/mean``)."""

    scalars: dict[str, float]
    histograms: dict[str, list[float]]


def scalar_view(metrics: dict[str, Any], kind: str, left_out: tuple[str, ...] = ()) -> Optional[ScalarView]:
    """The dashboard view of a record, or None for kinds dashboards do not plot; ``left_out``:
    names, and prefixes ending in ``/``, that dashboards do not get."""
    if kind not in DASHBOARD_KINDS:
        return None
    view = ScalarView({}, {})
    prefixes = tuple(p for p in left_out if p.endswith("/"))
    for name, value in numeric_items(metrics):
        if left_out and (name in left_out or name.startswith(prefixes)):
            continue
        if isinstance(value, PerRank):
            finite = [v for v in value.present() if math.isfinite(v)]  # binning needs them (the summary has NaN)
            if finite:
                view.histograms[name] = finite
        else:
            view.scalars[name] = value
    return view


class SinkSet:
    """The writer rank's sinks: those ``on_training_thread`` are written in the call, the others
    queued for the writer thread. A failing sink warns once, naming itself and the cause."""

    def __init__(self, sinks: Iterable[Sink] = (), left_out: tuple[str, ...] = ()) -> None:
        self.inline: list[Sink] = []
        """Sinks written on the training thread (JSONL, progress.txt)."""
        self.queued: list[Sink] = []
        """Sinks written on the writer thread (TensorBoard, W&B, console, your own)."""
        self.failed: dict[str, str] = {}
        """Sinks dropped after a failure: name (``name #2`` for a second sink of one name) -> cause."""
        self._failed_sinks: list = []  # the sink objects dropped: each is said once
        self.left_out = left_out
        """Names, and prefixes ending in ``/``, the dashboards do not get (:func:`scalar_view`)."""
        self.writer: Optional[WriterThread] = None
        self.last_logged_step: Optional[int] = None
        """The last step an earlier job logged in this output_dir (the writer reads it at start)."""
        self._closers: list = []
        self._release_when_queued_closed = False  # close() came on the writer thread, which releases
        self._took: dict[int, tuple] = {}  # id(sink) -> (step, kind) of the last record a training-thread sink took
        self._routes: dict[int, tuple] = {}  # id(sink) -> (sink, kinds or None, takes a view, keeps a timeline)
        self._ended: Optional[int] = None  # the exit code the sinks were told (ended())
        for sink in sinks:
            self.attach(sink)

    def on_close(self, release: Any) -> None:
        """Call ``release()`` once the sinks are closed."""
        self._closers.append(release)

    def purge_from(self, step: Optional[int]) -> None:
        """Have the sinks that keep a timeline (``purge_from(step)``: TensorBoard) drop what an
        earlier job wrote at steps >= ``step`` (in order with the records: through the queue), or,
        with None, know that nothing is dropped. Sent once per job, at its first step."""
        if any(self._route(sink)[3] for sink in self.sinks):
            self.log({}, -1 if step is None else step, _PURGE, keep=True)  # an order, not a record: never dropped

    @property
    def sinks(self) -> list[Sink]:
        """Every sink still on."""
        return self.inline + self.queued

    def attach(self, sink: Sink) -> None:
        """Add a sink that exists already (the writer thread starts with the first queued one)."""
        self._route(sink)
        if getattr(sink, "on_training_thread", False):
            self.inline.append(sink)
            return
        self.queued.append(sink)
        if self.writer is None:
            self.writer = WriterThread(self._write_queued, self._close_queued,
                                       lambda: ", ".join(sink_name(s) for s in self.queued) or "queued")

    def _route(self, sink: Sink) -> tuple:
        """(the sink, the kinds it takes or None for all, takes a view, keeps a timeline), worked
        out once per sink (also for one put on ``inline`` or ``queued`` directly)."""
        route = self._routes.get(id(sink))
        if route is None or route[0] is not sink:
            kinds = getattr(sink, "kinds", None)
            kinds = None if kinds is None else frozenset((kinds,) if isinstance(kinds, str) else kinds) | {_PURGE}
            route = self._routes[id(sink)] = (sink, kinds, hasattr(sink, "log_view"), hasattr(sink, "purge_from"))
        return route

    def add(self, factory, name: str, fix: str, install: Optional[str] = None) -> None:
        """Create a sink; if creating it raises, warn once and go on without it."""
        try:
            self.attach(factory())
        except Exception as err:  # noqa: BLE001 - any failure of an optional sink is survivable
            self._fail(name, err, fix, install)

    def log(self, metrics: dict[str, Any], step: int, kind: str, keep: bool = False) -> None:
        """Write one record to the training-thread sinks and queue it for the others (``keep``: a
        full queue drops other records, never this one)."""
        if self.inline:
            self._deliver(self.inline, metrics, step, kind, took=self._took)
        if self.queued:
            self.writer.put(dict(metrics), step, kind, keep)  # a copy: the caller may change its dict

    def log_inline(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Write one record to the training-thread sinks alone (the ``end`` record: for the files read
        back; the dashboards and the console have no use for it)."""
        if self.inline:
            self._deliver(self.inline, metrics, step, kind)

    def placed(self, step: int, kind: str) -> tuple[list[str], list[str]]:
        """The names of the sinks that have the record of ``step`` and ``kind`` (a training-thread sink
        took it; the writer thread has it, queued or taken), and of those that take such records and do
        not have it (asked of a log step a signal interrupted: it may land between the two)."""
        queued = self.writer is not None and self.writer.holds(step, kind)
        have: list[str] = []
        lack: list[str] = []
        for sinks, inline in ((self.inline, True), (self.queued, False)):
            for sink in sinks:
                kinds = self._route(sink)[1]
                if kinds is None or kind in kinds:
                    held = self._took.get(id(sink)) == (step, kind) if inline else queued
                    (have if held else lack).append(sink_name(sink))
        return have, lack

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until the writer thread has written every queued record (at most ``timeout``
        seconds; True if it has). Training never needs this; a test or a checkpoint may."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def ended(self, exit_code: int) -> None:
        """Tell the sinks with ``ended(exit_code)`` how the job ended, before they close (W&B marks a
        run failed by it): the training-thread sinks now, the others on the writer thread once it has
        written every record queued, as it closes them (no place in a full queue). The first word is
        kept: a ``close()`` in an exit hook after the job ended on an error says nothing more. One that
        raises is said, and closed all the same."""
        if self._ended is not None:
            return
        self._ended = exit_code
        self._tell_ended(self.inline, exit_code, (Exception,))

    def _tell_ended(self, sinks: list, exit_code: int, caught: tuple) -> None:
        for sink in sinks:
            ended = getattr(sink, "ended", None)
            if callable(ended):
                try:
                    ended(exit_code)
                except caught as err:  # its close() comes all the same
                    logger.warning("distmetrics: the %s sink's ended(%d) raised %s: %s; it is closed all the same",
                                   sink_name(sink), exit_code, type(err).__name__, err)

    def close(self) -> None:
        """Close the training-thread sinks; drain the queue and close the others (bounded). Called on
        the writer thread itself (a Monitor collected there), the thread does the rest once its current
        record is written, and lets go of what :meth:`on_close` named after it has closed its sinks."""
        for sink in self.inline:
            self._close(sink)
        self.inline = []
        if self.writer is not None and not self.writer.close():
            self._release_when_queued_closed = True
            return
        self._release()

    def _release(self) -> None:
        for release in self._closers:
            release()
        self._closers = []

    def _deliver(self, sinks: list[Sink], metrics: dict[str, Any], step: int, kind: str,
                 caught: tuple = (Exception,), took: Optional[dict] = None) -> None:
        """Write to ``sinks``; one that raises one of ``caught`` is dropped with one warning; ``took``
        notes, by sink, the record each one took last."""
        view: Any = False  # made on first need, once
        for sink in list(sinks):
            _, kinds, takes_view, keeps_timeline = self._route(sink)
            if kinds is not None and kind not in kinds:
                continue
            try:
                if kind == _PURGE:
                    if keeps_timeline:
                        sink.purge_from(step if step >= 0 else None)
                elif takes_view:
                    if view is False:
                        view = scalar_view(metrics, kind, self.left_out)
                    if view is not None:
                        sink.log_view(view, step)
                else:
                    sink.log(metrics, step, kind)
                if took is not None:
                    took[id(sink)] = (step, kind)
            except caught as err:
                sinks.remove(sink)
                self._fail(sink_name(sink), err, getattr(sink, "fix", ""), getattr(sink, "install", None), sink=sink)

    def _write_queued(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        # on the writer thread any exception a sink raises (sys.exit(), an asyncio CancelledError
        # from its client) would end the thread, and every queued sink with it, without a word: it
        # fails that sink as an error does (the thread gets no KeyboardInterrupt: signals go to the
        # main thread)
        self._deliver(self.queued, metrics, step, kind, caught=(BaseException,))

    def _close_queued(self) -> None:
        if self._ended is not None:
            self._tell_ended(self.queued, self._ended, (BaseException,))
        for sink in self.queued:
            self._close(sink, caught=(BaseException,))
        self.queued = []
        if self._release_when_queued_closed:
            self._release()

    def _close(self, sink: Sink, caught: tuple = (Exception,)) -> None:
        try:
            sink.close()
        except caught as err:
            self._fail(sink_name(sink), err, getattr(sink, "fix", ""), getattr(sink, "install", None), closing=True,
                       sink=sink)

    def _fail(self, name: str, err: BaseException, fix: str, install: Optional[str] = None,
              closing: bool = False, sink: Any = None) -> None:
        """Say once per sink that it failed and is off (``sink``: None where creating it failed).
        Two sinks of one name (two of your HTTP sinks) are each said: the second as ``name #2``."""
        if any(sink is seen for seen in self._failed_sinks) or (sink is None and name in self.failed):
            return
        if sink is not None:
            self._failed_sinks.append(sink)
        key, n = name, 1
        while key in self.failed:
            n += 1
            key = f"{name} #{n}"
        name = key
        self.failed[name] = cause = failure_cause(err)
        advice = install if isinstance(err, ImportError) and install else ("" if isinstance(err, OSError) else fix)
        logger.warning("distmetrics: the %s sink failed %s(%s)%s%s", name, "at close " if closing else "", cause,
                       "" if closing else " and is off for the rest of the run; the other sinks go on",
                       f". Fix: {advice}" if advice else ".")


def sink_name(sink: Any) -> str:
    """A sink's ``name``, or its class's name where it has none (a user's sink)."""
    name = getattr(sink, "name", None)
    return name if isinstance(name, str) and name else type(sink).__name__


def check_sinks(sinks: Any) -> tuple:
    """The user's extra sinks as a tuple; raises naming one without a callable ``log`` (or
    ``log_view``) and ``close``."""
    if sinks is None:
        return ()
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, (list, tuple)):
        raise TypeError(f"Monitor(sinks=...): expected a list or tuple of sink objects, got {type(sinks).__name__} "
                        f"{sinks!r}")
    for sink in sinks:
        if isinstance(sink, type):  # its log and close are functions too: it failed at the first record
            raise TypeError(f"Monitor(sinks=...): {sink.__name__} is a class; pass an instance of it: "
                            f"sinks=[{sink.__name__}(...)]")
        writes = callable(getattr(sink, "log", None)) or callable(getattr(sink, "log_view", None))
        if not writes or not callable(getattr(sink, "close", None)):
            raise TypeError(f"Monitor(sinks=...): {sink!r} is not a sink: a sink has log(metrics, step, kind) (or "
                            "log_view(view, step)) and close()")
    return tuple(sinks)


def failure_cause(err: BaseException) -> str:
    """The cause as a warning says it: an OSError's errno, text and path; else type and message."""
    if isinstance(err, OSError):
        return describe_os_error(err)
    return f"{type(err).__name__}: {err}"


def open_sinks(config: Any, world_size: int, extra: Iterable[Sink] = (), reclaim: Any = None,
               timer_order: Callable[[], Sequence[str]] = tuple) -> SinkSet:
    """The writer rank's sinks for a MetricsConfig (only the writer calls this); ``reclaim``: called
    by a file sink before it makes a removed file again (the writer's lock on output_dir taken again);
    ``timer_order``: the writer's timer names in the order they were made (the console's timer block)."""
    from pathlib import Path

    from .console import ConsoleSink
    from .jsonl import METRICS_FILE, JsonlSink
    from .progress import ProgressSink

    cfg, out = config, Path(config.output_dir)
    sinks = SinkSet(left_out=(() if cfg.log_timers_to_tensorboard else ("timers/",))
                    + (() if cfg.log_validation_ppl_to_tensorboard else ("eval/ppl",)))
    if cfg.json_log:
        sinks.add(lambda: JsonlSink(out / METRICS_FILE, reclaim), JsonlSink.name, JsonlSink.fix)
    if cfg.console:
        sinks.add(lambda: ConsoleSink(cfg.verbosity, cfg.total_steps, timer_order), ConsoleSink.name, ConsoleSink.fix)
    if cfg.log_progress:
        sinks.add(lambda: ProgressSink(out / "progress.txt", world_size, reclaim), ProgressSink.name, ProgressSink.fix)
    if cfg.tensorboard:
        from .tensorboard import TensorBoardSink

        sinks.add(lambda: TensorBoardSink(cfg.resolved_tensorboard_dir, reclaim), TensorBoardSink.name,
                  TensorBoardSink.fix, TensorBoardSink.install)
    if cfg.wandb_project and (cfg.wandb_mode or os.environ.get("WANDB_MODE")) != "disabled":
        from .wandb import WandbSink

        sinks.add(lambda: WandbSink(cfg.wandb_project, cfg.wandb_exp_name, cfg.wandb_entity,
                                    cfg.wandb_save_dir or str(out), cfg.wandb_mode, cfg.to_dict(redact=True)),
                  WandbSink.name, WandbSink.fix, WandbSink.install)
    for sink in extra:
        sinks.attach(sink)
    return sinks


def numeric_items(metrics: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(name, value) for scalar numbers (numpy's, 0-d arrays and tensors a collector's ``finalize``
    set as the numbers they hold, as metrics.jsonl writes them) and :class:`PerRank` vectors;
    strings skipped."""
    for name, value in metrics.items():
        if isinstance(value, bool):
            yield name, float(value)
        elif isinstance(value, (int, float)):
            yield name, value
        elif isinstance(value, PerRank):
            yield name, value
        elif not isinstance(value, str):
            value = python_number(value)
            if isinstance(value, (int, float)):
                yield name, float(value) if isinstance(value, bool) else value


def python_number(value: Any) -> Any:
    """A numpy scalar, 0-d array or 0-d tensor as the Python number it holds; else ``value``."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            return value
    return value
