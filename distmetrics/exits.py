"""How a Monitor ends when it is not closed in order: at the exit of a process that left it open,
on an error inside ``with``, when it is collected, when a collector fails to close; and the one
thread its calls come from."""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

from .sinks.writer import forget_exit_hook

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["open_at_exit", "say_unwritten", "say_log_step_lost", "say_pending", "close_parts", "exit_code_of",
           "closed_code", "OneThread"]

logger = logging.getLogger("distmetrics")


def open_at_exit(ref: "weakref.ref[Monitor]") -> None:
    """At the exit of a process whose Monitor is still open (an uncaught error, or no close()): the
    writer says what is not written (:func:`say_unwritten`), and a process ending on an uncaught
    error leaves the arrival check, so the ranks waiting for it at a guarded call raise now, naming
    it, rather than at ``hang_timeout_s``. Nothing in a process forked from the one that made it (the
    hook is inherited): a child ending on an error would leave the arrival check as its parent's rank."""
    monitor = ref()
    if monitor is None or monitor._closed or monitor._pid != os.getpid():
        return
    error = getattr(sys, "last_value", None)  # set where the interpreter printed an uncaught error
    how = f", on an uncaught {type(error).__name__}" if error is not None else ", never closed"
    say_unwritten(monitor, "the process ends with a Monitor open" + how)  # as the end record says it
    write_end(monitor, "its process ended with the Monitor open" + how)
    if error is not None:  # only then: a close() in an exit hook of the user's may still come, and would
        # meet its own mark (every rank's, where each made one)
        monitor._guard.leave(f"its process ended on an uncaught {type(error).__name__} with the Monitor open")
        monitor.sinks.ended(1)  # before the writer's exit hook closes W&B (which said the job finished)


def write_end(monitor: "Monitor", how: str) -> None:
    """The job's ``end`` record, on the writer rank: ``how`` its Monitor ended, at the last
    ``monitor.step`` (0 before any) and with how many steps since the last log step unwritten. A
    job killed (SIGKILL, an out-of-memory kill, a node lost, a SIGTERM with no handler) writes none,
    which is how ``distmetrics summary`` and ``report`` tell it from one that ended."""
    earlier, monitor._ended = getattr(monitor, "_ended", None), how
    if earlier is not None:  # the exit hook wrote one, and a close() in a later exit hook of the user's came
        how = f"{earlier}; then {how}, in an exit hook"  # the last end record says both
    if monitor.is_writer:
        step = monitor._last_step
        lost = getattr(monitor, "_lost_steps", 0)  # the steps of log steps that did not complete
        fields = {"how": how, "unwritten_steps": monitor._steps_in_interval + lost, "stepped": step is not None}
        if lost:  # said apart: they may be any interval's, not the last
            fields["lost_in_log_steps"] = lost
        monitor.sinks.log_inline(fields, 0 if step is None else step, "end")


def say_unwritten(monitor: "Monitor", when: str,
                   why: str = "monitor.close(), called on every rank, writes them") -> None:
    """Say, once, on the writer rank, what a Monitor not closed leaves unwritten: the steps since the
    last log step (close() writes them, a collective no exit hook, finalizer or error can make)."""
    if getattr(monitor, "_closed", True) or getattr(monitor, "_at_exit", None) is None:
        return
    forget_exit_hook(monitor._at_exit)
    monitor._at_exit = None
    if monitor.is_writer and monitor._steps_in_interval:
        logger.warning("distmetrics: %s: the %d step(s) up to step %s since the last log step are not written (%s)",
                       when, monitor._steps_in_interval, monitor._last_step, why)


def say_log_step_lost(monitor: "Monitor", why: str) -> None:
    """Say, once, on the writer rank, that a log step interrupted after its samples were taken (by
    ``why``: an exception, a signal's too, or a close() from a signal handler) leaves its record unwritten:
    its interval's steps went with the samples, so no close() or exit hook can write them. Not where
    every sink had the record already (close() drains the writer queue); where some have it (a signal
    landing between the JSONL write and the writer queue's put), the sinks with it and those without."""
    held, monitor._unwritten = monitor._unwritten, None
    if held is None or not monitor.is_writer:
        return
    step, steps, closing = held
    have, lack = monitor.sinks.placed(step, "train")
    if not lack:  # handed over whole
        return
    monitor._lost_steps = getattr(monitor, "_lost_steps", 0) + steps  # the end record counts them
    what = "the record close() writes" if closing else "the log step"
    if have:
        logger.warning("distmetrics: %s at step %d did not complete (%s): its record of the %d step(s) "
                       "up to it since the last log step is written to %s, not to %s", what, step, why, steps,
                       ", ".join(have), ", ".join(lack))
    else:
        logger.warning("distmetrics: %s at step %d did not complete (%s): the %d step(s) up to it since "
                       "the last log step are not written", what, step, why, steps)


def say_pending(monitor: "Monitor", writes_record: bool) -> None:
    """Say, at a close(), on the rank that recorded them, the values that no record will hold, and take
    them out of the one close() writes (``writes_record``: of the steps up to the last): what was
    recorded after the last ``monitor.step`` belongs to the interval of the next one, which did not
    come (written into the last step's record, it read as that step's), and ``record_losses``' eval
    samples with no ``log_eval`` after them are written by none."""
    with monitor._records:  # a record from another thread is said or written, not both
        late = [name for name in monitor._by_name["train"].stats.take_back() if name[:1] != "_"]  # ours: not said
        eval_samples = monitor._eval.categories.pending()
    if monitor._by_name["losses"].train.pending():
        late.append("record_losses' samples")
    if late:
        after = ("before any monitor.step" if monitor._last_step is None else
                 f"after the last monitor.step (step {monitor._last_step}, "
                 f"{'whose record close() writes without them' if writes_record else 'logged'})")
        logger.warning("distmetrics: close() on rank %d: %s recorded %s are not written: a record belongs to the "
                       "interval of the next monitor.step; record before the step it belongs to", monitor.rank,
                       ", ".join(map(repr, late[:5])) + (" ..." if len(late) > 5 else ""), after)
    moe = monitor._by_name.get("moe")
    if moe is not None and moe.since_step and monitor._last_step is not None:
        moe.since_step = False
        fate = ("are written into the record close() writes, that step's interval, which they do not belong to"
                if writes_record else "are not written")
        logger.warning("distmetrics: close() on rank %d: record_moe's values recorded after the last monitor.step "
                       "(step %d) %s; record before the step they belong to", monitor.rank, monitor._last_step, fate)
    if eval_samples:
        logger.warning("distmetrics: close() on rank %d: record_losses(split='eval') samples with no "
                       "monitor.log_eval after them are not written: a log_eval writes them; call it before close()",
                       monitor.rank)


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"a thread that has ended (id {ident})"


def exit_code_of(error: Optional[BaseException]) -> int:
    """The exit status a process ending on ``error`` has: ``sys.exit``'s (0 for ``sys.exit()``, 1 for
    a message; a number as the system keeps it, its low 8 bits: 256 is 0, -1 is 255), else 1."""
    if isinstance(error, SystemExit):
        code = error.code
        return 0 if code is None else int(code) & 0xFF if isinstance(code, int) else 1
    return 1


def closed_code() -> int:
    """The exit code a ``close()`` tells the sinks: 1 in an exit hook of a process ending on an
    uncaught error (its traceback printed, ``sys.last_value``; the main thread has ended), else 0."""
    at_exit = not threading.main_thread().is_alive()
    return 1 if at_exit and getattr(sys, "last_value", None) is not None else 0


def close_parts(collectors: list, sinks: Any, quiet: bool, exit_code: Optional[int] = None) -> None:
    """Close every collector, then the sinks, always: a collector that fails to close is said, and
    its error raised once the sinks are closed, unless ``quiet`` (another error is on its way).
    ``exit_code``: how the job ended, where the Monitor knows (the sinks are told first)."""
    failure: Optional[BaseException] = None
    try:
        for collector in collectors:
            try:
                collector.close()
            except Exception as err:  # noqa: BLE001 - the sinks are closed all the same
                logger.warning("distmetrics: the %s collector failed to close: %s: %s", collector.name,
                               type(err).__name__, err)
                failure = failure or err
    finally:
        try:
            if exit_code is not None:
                sinks.ended(exit_code)
        finally:  # an ended() that raised a KeyboardInterrupt: the sinks are closed all the same
            sinks.close()
    if failure is not None and not quiet:
        raise failure


class OneThread:
    """The thread a Monitor's collective calls come from: the first to make one; another raises."""

    def __init__(self) -> None:
        self.ident: Optional[int] = None

    def check(self) -> None:
        thread = threading.get_ident()
        if thread == self.ident:
            return
        if self.ident is not None:
            raise RuntimeError(f"this Monitor's collective calls come from thread {_thread_name(self.ident)!r}, and "
                               f"this one from thread {_thread_name(thread)!r}: its log steps, evaluations, "
                               "checkpoints and clips are collectives every rank makes in one order, so they come "
                               "from one thread; make the call from that one")
        self.ident = thread
