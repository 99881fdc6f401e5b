"""The writer thread: the sinks that must not hold up training (TensorBoard, W&B, the console,
and your own unless they say ``on_training_thread = True``) run behind one bounded queue on one
thread.

The training thread only appends a record to the queue and returns: it does not even wake the
writer thread (waking a thread is a system call and, on a busy machine, a context switch the
caller pays for: up to milliseconds). The writer thread looks at the queue every
:data:`POLL_S` seconds when it has nothing to do. When the sinks fall behind
so far that the queue is full (:data:`MAX_RECORDS` records or :data:`MAX_NAMES` metric names),
the oldest record is dropped and counted — training never waits — with one warning when it
starts and one at close with the count and the steps. ``close()`` drains the queue (bounded by
:data:`CLOSE_TIMEOUT_S`), then closes those sinks on the thread. The thread and its exit hook belong to
the process that started them: in a process forked from it they do nothing.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import weakref
from typing import Any, Callable, Optional

__all__ = ["WriterThread", "MAX_RECORDS", "MAX_NAMES", "POLL_S", "CLOSE_TIMEOUT_S", "exit_hooks_last",
           "exit_hook_before_writers", "forget_exit_hook"]

MAX_RECORDS = 256
"""Records the queue holds at most (at log_interval 1 and 1 s per step: four minutes behind)."""
MAX_NAMES = 1_000_000
"""Metric names the queued records hold at most (bounds memory at thousands of names)."""
POLL_S = 0.05
"""How often the idle writer thread looks for new records (console lines lag by at most this)."""
CLOSE_TIMEOUT_S = 90.0
"""How long ``close()`` waits for the writer thread to write what is queued and close its sinks."""

logger = logging.getLogger("distmetrics")


class WriterThread:
    """One bounded queue and one daemon thread. ``handle(metrics, step, kind)`` writes one record
    (on the thread; it must not raise), ``finish()`` closes the sinks (on the thread, after the
    last record), ``sinks()`` names them in warnings."""

    def __init__(self, handle: Callable[[dict, int, str], None], finish: Callable[[], None],
                 sinks: Callable[[], str], max_records: int = MAX_RECORDS, max_names: int = MAX_NAMES) -> None:
        self._handle, self._finish, self._sinks = handle, finish, sinks
        self.max_records, self.max_names = max_records, max_names
        self.dropped = 0
        """Records dropped because the queue was full."""
        self._dropped_steps: Optional[list[int]] = None  # [first, last]
        self._dropped_for = ""  # the sinks named when dropping started (close() has closed them since)
        self._records: collections.deque = collections.deque()
        self._names = 0
        self._keeps = 0  # queued keep entries (never dropped)
        self._busy = False
        self._taken: Optional[tuple] = None  # (step, kind) of the last record the thread took
        self._closing = False
        self._finished = False  # the thread has closed the sinks and is ending
        self._said = False  # close() has said what it had to (once)
        self._closed_on_thread = False  # close() was called on the writer thread itself: it ends alone
        self._interrupted = False  # a close() was interrupted (a signal's exception) before the thread ended
        self._pid = os.getpid()  # a forked child inherits this object, not the thread: its close does nothing
        # put() takes the lock alone (no Python-level Condition call on the training thread). It is
        # re-entrant: a signal handler that flushes or closes runs on the thread that may hold it.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="distmetrics-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a script that never calls close() still gets its records
        _LIVE.add(self)

    def put(self, metrics: dict[str, Any], step: int, kind: str, keep: bool = False) -> None:
        """Queue one record; never waits for the sinks (drops the oldest record when full). A
        ``keep`` entry (an order such as TensorBoard's purge, not a record) is never dropped."""
        size = 1 + len(metrics)
        first_drop = None
        with self._lock:
            if self._closing:  # nothing would write it (a close() from a signal handler came first)
                return
            self._records.append((metrics, step, kind, size, keep))
            self._names += size
            self._keeps += keep
            while len(self._records) > self.max_records or \
                    (self._names > self.max_names and len(self._records) - self._keeps > 1):
                dropped = self._drop_oldest()
                if dropped is None:
                    break
                if self._dropped_steps is None:
                    self._dropped_steps = [dropped, dropped]
                    first_drop = dropped
                self._dropped_steps[1] = dropped
        if first_drop is not None:
            self._dropped_for = self._sinks()
            logger.warning("distmetrics: the %s sinks are behind: their queue is full (%d records or %s names), "
                           "so the oldest records are dropped and counted (the first: step %d); training does not "
                           "wait. The count comes at close.", self._dropped_for, self.max_records,
                           f"{self.max_names:,}", first_drop)

    def _drop_oldest(self) -> Optional[int]:
        """Drop the oldest record (not a ``keep`` entry: the ones before it stay, in order); its
        step, or None when only ``keep`` entries are queued."""
        for i, (_, step, _, size, keep) in enumerate(self._records):
            if not keep:
                del self._records[i]
                self._names -= size
                self.dropped += 1
                return step
        return None

    def holds(self, step: int, kind: str) -> bool:
        """Whether the record of ``step`` and ``kind`` is queued, or the last the thread took."""
        with self._cond:
            return self._taken == (step, kind) or any(r[1:3] == (step, kind) for r in self._records)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued record is written (at most ``timeout`` seconds, default
        :data:`CLOSE_TIMEOUT_S`); True if so (at once in a process forked from its own, which has no
        writer thread: what is queued there is the parent's to write)."""
        if os.getpid() != self._pid:
            return True
        with self._cond:
            self._cond.notify_all()  # no need to wait for the next look at the queue
            return self._cond.wait_for(lambda: not self._records and not self._busy,
                                       CLOSE_TIMEOUT_S if timeout is None else timeout)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Write what is queued, close the sinks (on the thread), wait at most ``timeout`` seconds
        (default :data:`CLOSE_TIMEOUT_S`). The wait is on the queue's condition, which lets go of the
        lock at every level: a signal handler that closes, landing in :meth:`put` on this thread, does
        not wait for a lock its own thread holds. The exit hook stays until the wait is over: a close
        interrupted by a signal's exception (Ctrl-C, SIGTERM made ``sys.exit``) says what is not written
        yet, and the exit waits for the thread again. In a forked child (no thread) it does nothing.

        Called on the writer thread itself (a Monitor's finalizer, run there by the cyclic garbage
        collector during a sink's call), it cannot wait for that thread: it marks the queue closing and
        returns False; the thread finishes the record it is in, writes the rest, closes the sinks and
        says what it has to. True otherwise."""
        if os.getpid() != self._pid or self._said:
            return True
        if threading.get_ident() == self._thread.ident:
            with self._cond:
                self._closing = self._closed_on_thread = True
            return False
        timeout = CLOSE_TIMEOUT_S if timeout is None else timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            try:
                finished = self._cond.wait_for(lambda: self._finished, timeout)
            except BaseException as err:
                self._say_interrupted(err)
                raise
            left, busy = len(self._records), self._busy
            if self._said:  # another thread's close() returned from this wait first, and says it
                return True
            self._said = True
        atexit.unregister(self.close)
        if finished:
            self._thread.join()  # it only returns now: no lock needed
        else:
            unwritten = f"{left} queued record{'' if left == 1 else 's'}" if left else ""
            if busy:
                unwritten += " and the one a sink is writing" if left else "the record a sink is writing"
            said = (f"{unwritten} not written yet: the writer thread goes on with {'them' if left else 'it'}, and what "
                    "it has not written when the process exits is lost") if unwritten else \
                "every record is written, and the sinks are still closing"
            logger.warning("distmetrics: the %s sinks did not finish within %.0f s of close(); %s.", self._sinks(),
                           timeout, said)
        self._say_dropped()
        return True

    def _say_dropped(self) -> None:
        """Say, once closed, how many records a full queue dropped."""
        if self.dropped:
            first, last = self._dropped_steps
            logger.warning("distmetrics: the %s sinks fell behind and %d record%s (steps %d-%d) were dropped "
                           "for them.", self._dropped_for, self.dropped,
                           "" if self.dropped == 1 else "s", first, last)

    def _say_interrupted(self, err: BaseException) -> None:
        """Say how many records a close() interrupted by ``err`` leaves unwritten (held: the lock)."""
        left = len(self._records)
        if left:
            later = ("they are not written" if self._interrupted else "the writer thread goes on with them, and "
                     f"the exit waits for it again (at most {CLOSE_TIMEOUT_S:.0f} s)")
            logger.warning("distmetrics: close() of the %s sinks was interrupted (%s) with %d record%s not written "
                           "yet: %s.", self._sinks(), type(err).__name__, left, "" if left == 1 else "s", later)
        self._interrupted = True

    def _run(self) -> None:
        try:
            self._write_all()
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
                says = self._closed_on_thread and not self._said  # no close() elsewhere waits to say it
                self._said = self._said or says
            if says:
                atexit.unregister(self.close)
                self._say_dropped()

    def _write_all(self) -> None:
        """Write records until close() and the queue is empty, then close the sinks."""
        while True:
            with self._cond:
                while not self._records and not self._closing:
                    self._cond.notify_all()  # idle: a flush() waiting may return
                    self._cond.wait(POLL_S)
                if not self._records:
                    break
                metrics, step, kind, size, keep = self._records.popleft()
                self._taken = (step, kind)
                self._names -= size
                self._keeps -= keep
                self._busy = True
            try:
                self._handle(metrics, step, kind)
            except BaseException:  # noqa: BLE001 - the thread must outlive any record (a CancelledError too)
                logger.exception("distmetrics: the writer thread could not write the %s record of step %d",
                                 kind, step)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        try:
            self._finish()
        except BaseException:  # noqa: BLE001
            logger.exception("distmetrics: the writer thread could not close its sinks")


_LIVE: "weakref.WeakSet[WriterThread]" = weakref.WeakSet()  # writer threads not closed yet


_BEFORE_WRITERS: "weakref.WeakSet[Callable[[], None]]" = weakref.WeakSet()  # exit hooks run ahead of the writers'


def exit_hook_before_writers(hook: Callable[[], None]) -> None:
    """Register ``hook`` to run at exit before the writer threads' exit hooks, even after
    :func:`exit_hooks_last` registered those again (a Monitor's: saying what is not written, and leaving the
    arrival check, take no time; a writer's close may take long)."""
    _BEFORE_WRITERS.add(hook)
    atexit.register(hook)


def forget_exit_hook(hook: Callable[[], None]) -> None:
    """Unregister a hook of :func:`exit_hook_before_writers`."""
    _BEFORE_WRITERS.discard(hook)
    atexit.unregister(hook)


def exit_hooks_last() -> None:
    """Register the exit hooks of the writer threads still open again, after every hook registered
    so far: exit hooks run last registered first, and a library started after the writer
    (``wandb.init``, which registers the shutdown of W&B's service) would otherwise end before the
    writer has written its queue through it. The hooks of :func:`exit_hook_before_writers` follow.

    The first registrations stay: called while the interpreter already runs its exit hooks (a
    W&B start still under way when the process ended), a hook registered now never runs, and one
    taken out would not run either, so the queue would never be written. Each hook does its work
    once, whichever of its registrations runs first."""
    for writer in list(_LIVE):
        if not writer._said:  # also one whose close() was interrupted: its exit hook waits for it again
            atexit.register(writer.close)
    for hook in list(_BEFORE_WRITERS):
        atexit.register(hook)
