"""Sinks: where the writer rank sends reduced metrics.

A sink is a small class with one verb and a close: ``log(metrics, step, kind)`` and
``close()``. :class:`SinkSet` fans out to the enabled ones; a sink that raises (package
missing, network down, disk full) is reported once with the fix and dropped, and the others
go on.

Dashboards (TensorBoard, W&B) take numbers only, and ``all`` metrics as a histogram (their
``/max``, ``/min``, ``/mean`` summary is in every record already) rather than one curve per rank:
a sink that defines ``log_view(view, step)`` gets a :class:`ScalarView` instead, made once per
record by the SinkSet (train, eval and tensor_stats records; timers unless
``log_timers_to_tensorboard`` is false).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol

from ..per_rank import PerRank

__all__ = ["Sink", "SinkSet", "open_sinks", "numeric_items", "ScalarView", "scalar_view", "DASHBOARD_KINDS"]

DASHBOARD_KINDS = ("train", "eval", "tensor_stats")
"""Record kinds that dashboards plot."""

logger = logging.getLogger("distmetrics")


class Sink(Protocol):
    """What every sink implements."""

    name: str
    """Short name used in warnings (``jsonl``, ``tensorboard``, ...)."""
    fix: str
    """What to do when it fails, e.g. ``pip install "torch-distmetrics[wandb]"``."""

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Write one record (``kind``: train, eval, run, alert, tensor_stats, progress, ...)."""

    def close(self) -> None:
        """Flush and release files and connections."""


@dataclass
class ScalarView:
    """A record as dashboards take it: numbers by name, and every rank's values of ``all`` metrics."""

    scalars: dict[str, float]
    histograms: dict[str, list[float]]


def scalar_view(metrics: dict[str, Any], kind: str, include_timers: bool = True) -> Optional[ScalarView]:
    """The dashboard view of a record, or None for kinds dashboards do not plot."""
    if kind not in DASHBOARD_KINDS:
        return None
    view = ScalarView({}, {})
    for name, value in numeric_items(metrics):
        if not include_timers and name.startswith("timers/"):
            continue
        if isinstance(value, PerRank):
            if value.present():
                view.histograms[name] = value.present()
        else:
            view.scalars[name] = value
    return view


class SinkSet:
    """The writer rank's sinks. A failing sink warns once, naming itself and the fix."""

    def __init__(self, sinks: Iterable[Sink] = (), include_timers: bool = True) -> None:
        self.sinks: list[Sink] = list(sinks)
        self.failed: dict[str, str] = {}
        self.include_timers = include_timers
        self._closers: list = []
        self.last_logged_step: Optional[int] = None
        """The last step an earlier job logged in this output_dir (the writer reads it at start)."""

    def on_close(self, release: Any) -> None:
        """Call ``release()`` after the sinks are closed."""
        self._closers.append(release)

    def add(self, factory, name: str, fix: str) -> None:
        """Create a sink; if creating it raises, warn once and go on without it."""
        try:
            self.sinks.append(factory())
        except Exception as err:  # noqa: BLE001 - any failure of an optional sink is survivable
            self._fail(name, fix, err)

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Hand one record to every sink (dashboards get its :class:`ScalarView`)."""
        view: Any = False  # made on first need, once
        for sink in list(self.sinks):
            try:
                if hasattr(sink, "log_view"):
                    if view is False:
                        view = scalar_view(metrics, kind, self.include_timers)
                    if view is not None:
                        sink.log_view(view, step)
                else:
                    sink.log(metrics, step, kind)
            except Exception as err:  # noqa: BLE001
                self.sinks.remove(sink)
                self._fail(sink.name, sink.fix, err)

    def purge_from(self, step: int) -> None:
        """Have the sinks that keep a timeline (``purge_from(step)``: TensorBoard) drop what an
        earlier job wrote at steps >= ``step``."""
        for sink in list(self.sinks):
            try:
                if hasattr(sink, "purge_from"):
                    sink.purge_from(step)
            except Exception as err:  # noqa: BLE001
                self.sinks.remove(sink)
                self._fail(sink.name, sink.fix, err)

    def close(self) -> None:
        """Close every sink (a failure warns once)."""
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001
                self._fail(sink.name, sink.fix, err)
        self.sinks = []
        for release in self._closers:
            release()
        self._closers = []

    def _fail(self, name: str, fix: str, err: BaseException) -> None:
        if name in self.failed:
            return
        self.failed[name] = f"{type(err).__name__}: {err}"
        logger.warning("distmetrics: the %s sink failed (%s: %s) and is off for the rest of the run; "
                       "the other sinks go on. Fix: %s", name, type(err).__name__, err, fix)


def open_sinks(config: Any, world_size: int, extra: Iterable[Sink] = ()) -> SinkSet:
    """The writer rank's sinks for a MetricsConfig (only the writer calls this)."""
    from pathlib import Path

    from .console import ConsoleSink
    from .jsonl import JsonlSink
    from .progress import ProgressSink

    cfg, out = config, Path(config.output_dir)
    sinks = SinkSet(include_timers=cfg.log_timers_to_tensorboard)
    if cfg.json_log:
        sinks.add(lambda: JsonlSink(out / "metrics.jsonl"), "jsonl", JsonlSink.fix)
    if cfg.console:
        sinks.add(lambda: ConsoleSink(cfg.verbosity, cfg.total_steps), "console", ConsoleSink.fix)
    if cfg.log_progress:
        sinks.add(lambda: ProgressSink(out / "progress.txt", world_size), "progress", ProgressSink.fix)
    if cfg.tensorboard:
        from .tensorboard import TensorBoardSink

        sinks.add(lambda: TensorBoardSink(cfg.resolved_tensorboard_dir), "tensorboard", TensorBoardSink.fix)
    if cfg.wandb_project and cfg.wandb_mode != "disabled":
        from .wandb import WandbSink

        sinks.add(lambda: WandbSink(cfg.wandb_project, cfg.wandb_exp_name, cfg.wandb_entity,
                                    cfg.wandb_save_dir or str(out), cfg.wandb_mode, cfg.to_dict(redact=True)),
                  "wandb", WandbSink.fix)
    sinks.sinks.extend(extra)
    return sinks


def numeric_items(metrics: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(name, value) for scalar numbers and :class:`PerRank` vectors; strings and flags skipped."""
    for name, value in metrics.items():
        if isinstance(value, bool):
            yield name, float(value)
        elif isinstance(value, (int, float)):
            yield name, value
        elif isinstance(value, PerRank):
            yield name, value
