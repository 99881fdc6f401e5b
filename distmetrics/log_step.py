"""The log step: every collector's samples taken, reduced in one pack per reduce kind, finalized in
order and written (:func:`log_step`); and which step the next ``monitor.step`` is predicted to be, so
that what must be measured before it (gradient norms, an update's snapshot) is measured only there.

Functions of the :class:`~distmetrics.monitor.Monitor` they serve, kept here so the front object
reads as its API."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Optional

from .collectors import LogContext
from .collectors.base import Alert, Record, bad_weights, left_out_failed, misnamed_elsewhere, of_ours, take_samples
from .collectors.norms import FIRST_STEP
from .exits import say_log_step_lost
from .names import RECORD_KEYS

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["log_step", "log_step_ahead", "is_log_step", "UnreachedLogSteps"]

logger = logging.getLogger("distmetrics")


def log_step(monitor: "Monitor", step: int, ended_at: Optional[int] = None) -> dict[str, Any]:
    """Take samples from every collector → one reduction → finalize in order → write
    (``ended_at``: see :attr:`LogContext.ended_at`)."""
    ctx = LogContext(step=step, steps=monitor._steps_in_interval, layout=monitor.layout, hosts=monitor.hosts,
                     module_order=monitor._module_order, ended_at=ended_at, previous=monitor.last_metrics,
                     stride=max(1, monitor._stride))
    with monitor._records:  # no record lands in the interval while it is taken
        # misnamed (a record key's or another writer's name): raised once the record is written
        samples, misnamed = take_samples(monitor.collectors, ctx, monitor._foreign, monitor._reducer.kinds)
    steps, monitor._steps_in_interval = monitor._steps_in_interval, 0  # the collectors started a new interval
    # the samples are taken: until the record is written, an exception (a signal's, anywhere up to the
    # write) or a close() from a signal handler says it is lost, as nothing else will write it
    monitor._unwritten = (step, steps, ended_at is not None)  # close()'s record: ended_at is its last step
    try:
        ctx.reduced = monitor._reducer.reduce(samples, tag=step, steps=steps)
        metrics = ctx.reduced.to_metrics(take=True)  # the Monitor's own dict from here on
        weighted, weights_refused = bad_weights(metrics, ctx.reduced, step)
        failed = left_out_failed(metrics, ctx.reduced, monitor.collectors, monitor._foreign.checked,
                                 monitor._reducer.writers, weighted)
        misnamed = misnamed_elsewhere(metrics, misnamed, failed)
        monitor._weightless.say(samples, metrics, ctx.reduced, step, failed)
        train = monitor._by_name["train"]
        train.to_context(metrics, ctx)  # wall time and tokens move into ctx
        # raised once the record is written: tokens found bad, names the ranks disagree on, a misnamed sample
        failure, *said = [e for e in (train.refused, monitor._reducer.refused, misnamed, weights_refused)
                          if e is not None] or [None]
        train.refused = monitor._reducer.refused = None
        for other in said:  # one error is raised: the others are said
            logger.warning("distmetrics: step %d: %s", step, other)
        alerts = []
        for collector in monitor.collectors:
            if failed and collector.name in failed:  # its values are out: nothing to finalize, on any rank
                continue
            before = monitor._foreign.before_finalize(collector, metrics)  # a user's: kept to its own names
            try:
                got = collector.finalize(metrics, ctx) or ()  # None: no alert (a finalize that returns nothing)
                got = [got] if isinstance(got, (Alert, Record)) else list(got)  # one, not in a list: taken as it is
                if before is not None and not of_ours(collector):  # a user's: Records of its own kinds (said, not
                    got = _own_kinds(collector, got, monitor)  # raised: what finalize returns may differ by rank)
                alerts += got
            except Exception as err:  # noqa: BLE001 - raised below, once the record is written
                if failure is not None:  # one error is raised: the others are said
                    logger.warning("distmetrics: the %s collector's finalize also failed at step %d: %s: %s",
                                   collector.name, step, type(err).__name__, err)
                failure = failure or err
            unfit, said = monitor._foreign.after_finalize(collector, before, metrics, monitor._reducer.writers,
                                                          ctx.reduced.kinds) if before is not None else ((), ())
            if unfit:  # every rank's finalize reads the same values: every rank raises this
                refused = ValueError(f"the {collector.name!r} collector's finalize set {'; '.join(unfit)}. A value "
                                     "finalize sets is a number or a 0-d tensor, under a name every sink can store: "
                                     "the record was written without them")
                if failure is not None:
                    logger.warning("distmetrics: step %d: %s", step, refused)
                failure = failure or refused
            if said:  # the same on every rank, as above
                refused = ValueError(
                    f"the {collector.name!r} collector's finalize wrote {'; '.join(said)}: a collector writes the "
                    "names it declares in its writes, or names no other writer declares, and one that derives values "
                    "from another's may share its names by naming it in its after. The record was written with "
                    "those names as their writers gave them")
                if failure is not None:
                    logger.warning("distmetrics: step %d: %s", step, refused)
                failure = failure or refused
        pooled = train.pooled_loss if "train/loss" in metrics else None  # token-weighted, whatever loss_average
        monitor._eval.note_train_loss(pooled, ctx.reduced.weight("train/loss"), train.mixed.by)
        written = _written_order(monitor, metrics)
        metrics = dict(zip(written, map(metrics.__getitem__, written)))
        monitor._write(metrics, step, "train")
        monitor._unwritten = None
    except BaseException as err:
        say_log_step_lost(monitor, type(err).__name__)
        raise
    for alert in alerts:
        monitor._write(alert.to_record(), step, alert.kind)  # alerts, and records such as stragglers
    monitor.last_metrics = metrics
    if failure is not None:  # from the reduced values, the same on every rank: every rank raises it
        raise failure
    return metrics


WRITERS_KINDS = frozenset(("run", "resume", "train", "eval", "tensor_stats", "progress", "stragglers", "gap",
                           "end", "alert"))
"""Record kinds the Monitor writes: a user's collector's ``Record`` of one (a second train record at a
step, an ``end`` mid-file that readers take for the job's end) is refused (an ``Alert`` is an alert)."""


def _own_kinds(collector: Any, got: list, monitor: "Monitor") -> list:
    """What a user's collector's ``finalize`` returned, less any ``Record`` of the Monitor's kinds or
    anything neither an Alert nor a Record, which are said once per collector and kind by the rank."""
    bad = [item for item in got if not isinstance(item, (Alert, Record)) or
           isinstance(item, Record) and (not isinstance(item.kind, str) or item.kind in WRITERS_KINDS) or
           isinstance(item, Alert) and item.kind != "alert" and  # a subclass's kind "train": a second train record
           (not isinstance(item.kind, str) or item.kind in WRITERS_KINDS)]
    keyed = [item for item in got if not any(item is b for b in bad) and _record_keys_in(item)]
    if not bad and not keyed:
        return got
    said = monitor._foreign.said
    shown = ", ".join(f"Record({item.kind!r}, ...)" if isinstance(item, Record) else f"a {type(item).__name__}"
                      for item in bad[:3])
    if bad and (collector.name, shown) not in said:
        said.add((collector.name, shown))
        logger.warning("distmetrics: rank %d: the %r collector's finalize returned %s, which are not written: it "
                       "returns Alerts, and Records of kinds of its own, not %s (the Monitor's); the rest of what it "
                       "returned is written. Said once", monitor.rank, collector.name, shown,
                       ", ".join(sorted(WRITERS_KINDS)))
    keys = sorted({key for item in keyed for key in _record_keys_in(item)})
    if keyed and (collector.name, tuple(keys)) not in said:  # written, they replaced the line's own keys: a train
        said.add((collector.name, tuple(keys)))  # record at a step never logged, a line readers skip
        logger.warning("distmetrics: rank %d: the %r collector's finalize returned a Record or Alert with the "
                       "field(s) %s, which every record holds already (%s): not written. Said once", monitor.rank,
                       collector.name, ", ".join(map(repr, keys)), ", ".join(RECORD_KEYS))
    return [item for item in got if not any(item is b for b in bad) and not any(item is k for k in keyed)]


def _record_keys_in(item: Any) -> list:
    """The keys of every record (kind, step, time) among an Alert's details or a Record's fields."""
    fields = item.details if hasattr(item, "details") else getattr(item, "fields", None)
    return [key for key in RECORD_KEYS if isinstance(fields, dict) and key in fields]


def _written_order(monitor: "Monitor", metrics: dict[str, Any]) -> list[str]:
    """The record's names sorted, without internal lanes ("_..."); sorted again only when the
    names differ from the last log step's."""
    made, written = monitor._record_order
    names = tuple(metrics)
    if names != made:
        written = [k for k in sorted(names) if k[:1] != "_"]
        monitor._record_order = (names, written)
    return written


def log_step_ahead(monitor: "Monitor") -> Optional[int]:
    """The step the next ``monitor.step`` is predicted to be (the last + the last stride between two
    steps, 1 at first), if it is a log step;
    before the first, ``FIRST_STEP``: its number is not known (a job may start or resume at any
    step), so it is treated as a log step."""
    if monitor._last_step is None:
        return FIRST_STEP
    step = monitor._last_step + monitor._stride
    return step if is_log_step(monitor, step) else None


def is_log_step(monitor: "Monitor", step: Optional[int] = None) -> bool:
    """Whether ``step`` (default: the next, predicted as in :func:`log_step_ahead`) is a log step, or the
    job's last (``total_steps``: ``close()`` writes its record); before the first
    ``monitor.step``, with no ``step``, True (see :func:`log_step_ahead`)."""
    if step is None:
        if monitor._last_step is None:
            return True
        step = monitor._last_step + monitor._stride
    return step % monitor.config.log_interval == 0 or step == monitor.config.total_steps


class UnreachedLogSteps:
    """Says once where ``monitor.step`` calls went by one stride s from a step a that is no multiple of
    gcd(s, L), ``log_interval`` + 1 calls or more without a log step: steps a + k·s never reach a multiple of L
    (odd steps with an even L), so every record waits for ``close()``. A stride that changes (a ramp-up of
    steps counted in samples, a step number left out) starts a new run from the step before; a log step ends
    the run."""

    def __init__(self, log_interval: int, says: bool) -> None:
        self.log_interval, self.says = log_interval, says
        self.first, self.stride, self.calls = 0, 0, 0  # the run: its first step, its stride, its calls (0: none)

    def see(self, step: int, previous: Optional[int]) -> None:
        """``step``, the call's, after ``previous`` (None: the job's first)."""
        interval = self.log_interval
        if step % interval == 0:
            self.calls = 0
            return
        if previous is None or self.calls == 0:
            self.first, self.stride, self.calls = step, 0, 1
            return
        if self.calls == 1 or step - previous != self.stride:
            self.first, self.stride, self.calls = previous, step - previous, 1
        self.calls += 1
        every = math.gcd(self.stride, interval)
        if self.calls <= interval or self.first % every == 0 or not self.says:
            return
        self.says = False
        logger.warning(
            "distmetrics: %d monitor.step calls by a stride of %d from step %d (to step %d) and no log step: a log "
            "step is a step whose number is a multiple of log_interval (%d), and steps %d + k·%d never reach one "
            "(%d is no multiple of %d), so every record waits for close(). Number the steps 1, 2, 3, ..., or from "
            "a multiple of %d. Said once.", self.calls, self.stride, self.first, step, interval, self.first,
            self.stride, self.first, every, every)
