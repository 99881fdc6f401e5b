"""How ``monitor.step`` counts a step, in parts that a ``close()`` from a signal handler finishes.

A Python signal handler runs on the training thread between two bytecodes of whatever it interrupts,
``monitor.step`` too, so a handler calling ``monitor.close()`` (the README's SIGTERM handler) could find a
step half counted: the train collector held the step's tokens while the Monitor had not counted the step
(the close record put 4 steps' tokens over 3 steps' time), or, landing just after a log step, the step's
values were recorded while its interval held no step, so close() wrote nothing and blamed the user.

So a step is counted part by part (:data:`PARTS`), each noted as begun before it runs, and a ``close()`` on
the thread of the step under way runs the parts not begun (:func:`finish_step`) before it writes: its
record counts that step whole, as on a rank whose signal came after the step. Functions of the
:class:`~distmetrics.monitor.Monitor` they serve, kept here so the front object reads as its API.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional

from .interval import now
from .runinfo import first_step, resumed_at

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["StepCall", "count_step", "finish_step", "step_under_way"]


class StepCall:
    """One ``monitor.step`` call's arguments, checked and made local, and how many parts have begun."""

    __slots__ = ("step", "loss", "tokens", "lr", "skipped", "scalars", "loss_tokens", "begun")

    def __init__(self, step: int, loss: Any, tokens: Any, lr: Any, skipped: bool, scalars: dict,
                 loss_tokens: Any) -> None:
        self.step, self.loss, self.tokens, self.lr = step, loss, tokens, lr
        self.skipped, self.scalars, self.loss_tokens = skipped, scalars, loss_tokens
        self.begun = 0


def count_step(monitor: "Monitor", call: StepCall) -> None:
    """Count ``call``'s step: every part in order (a close() from a signal handler may finish them).
    A part that raises leaves the rest undone: a later close() does not run them."""
    monitor._counting = call
    try:
        finish_step(monitor)
    except BaseException:
        monitor._counting = None
        raise


def finish_step(monitor: "Monitor") -> None:
    """Run the parts of the step under way that have not begun: from :func:`count_step`, or from a
    close() that interrupted it (the interrupted ``count_step`` then finds none left)."""
    call: Optional[StepCall] = monitor._counting
    while call is not None and call.begun < len(PARTS):
        part = PARTS[call.begun]
        call.begun += 1  # begun before it runs: a close() landing inside it does not run it twice
        part(monitor, call)
    monitor._counting = None


def step_under_way(monitor: "Monitor") -> bool:
    """Whether a step is being counted on this thread (a close() here comes from a signal handler)."""
    return monitor._counting is not None and monitor._one_thread.ident == threading.get_ident()


def _start(monitor: "Monitor", call: StepCall) -> None:
    """The clocks start at the job's first step; the stride to the next step (and steps that reach no log step);
    the norms' step ends."""
    step, norms = call.step, monitor._by_name.get("norms")
    if monitor._last_step is None:  # the clocks start; a job resuming at a step logged before says so
        monitor._counts_from(step)  # reads the earlier job's files back: not this step's time
        resumed_at(step, monitor.sinks)
        first_step(monitor._clocks())
        if norms is not None:  # what was measured before the step's number was known
            norms.first_step(step, step % monitor.config.log_interval == 0)
    else:
        if step != monitor._last_step + monitor._stride and norms is not None and monitor._is_log_step(step):
            norms.unpredicted(step)  # its optimizer step was not snapshotted: said
        monitor._stride, monitor._strided = step - monitor._last_step, True  # steps 2, 4, 6...: the next is predicted
    monitor._log_steps_seen.see(step, monitor._last_step)  # a loop whose steps never reach a log step: said
    if norms is not None:  # the step's optimizer steps are over: their update is the step's
        norms.end_step(step, monitor._last_step, bool(call.skipped))
    monitor._last_step = step
    monitor._guard.note("monitor.step", step)


def _record_train(monitor: "Monitor", call: StepCall) -> None:
    # a skipped step's loss is left out of train/loss, as Megatron leaves skipped iterations out
    with monitor._records:
        monitor._by_name["train"].record_step(None if call.skipped else call.loss, call.tokens, call.lr,
                                              call.scalars, call.loss_tokens, monitor._steps_in_interval)


def _record_health(monitor: "Monitor", call: StepCall) -> None:
    counted = call.loss if monitor._by_name["train"].stage_loss.counts else None  # a placeholder is no loss
    with monitor._records:
        monitor._by_name["health"].record_step(counted, call.skipped,
                                               call.tokens if call.loss_tokens is None else call.loss_tokens)


def _end_losses(monitor: "Monitor", call: StepCall) -> None:
    with monitor._records:
        monitor._by_name["losses"].end_step(call.skipped)  # its record_losses samples: left out with it where skipped
        if "moe" in monitor._by_name:
            monitor._by_name["moe"].end_step()


def _lap(monitor: "Monitor", call: StepCall) -> None:
    monitor._by_name["timers"].mark_step()


def _count(monitor: "Monitor", call: StepCall) -> None:
    ended = now()  # where the close record's interval ends
    monitor._stepped_at, monitor._steps_in_interval = ended, monitor._steps_in_interval + 1


PARTS = (_start, _record_train, _record_health, _end_losses, _lap, _count)
"""A step's bookkeeping, in order; each part runs once, from the step or from a close() that interrupted it."""
