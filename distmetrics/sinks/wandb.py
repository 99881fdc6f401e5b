"""W&B sink: one run, created on the writer rank only; ``wandb_mode: offline`` needs no network.

``wandb.init`` runs in the background (it can wait a minute and more for an unreachable
server): the Monitor's constructor returns at once, rows logged meanwhile are kept (up to
:data:`START_BUFFER_ROWS`, then the oldest are dropped and counted) and sent once the run
exists. If it fails, or has not finished within :data:`START_TIMEOUT_S`, the sink warns once
with W&B's error and is off; a ``wandb.init`` still running at exit is waited for (at most
:data:`EXIT_WAIT_S` past that deadline, with a warning). W&B writes its run from a service
process and reports failures there (e.g. a full disk) only in its own log: the sink reads the
errors W&B logs and the free space where the run is written, and warns once with the cause.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Optional

from ..redaction import redact_argv, redact_text
from . import ScalarView
from .writer import exit_hooks_last

__all__ = ["WandbSink", "START_TIMEOUT_S", "START_BUFFER_ROWS"]

STEP_METRIC = "step"
"""Each row's step: the x axis of every chart (a name no metric may take)."""
START_TIMEOUT_S = 45.0
"""How long ``wandb.init`` may take before the sink gives up on W&B."""
START_BUFFER_ROWS = 1000
"""Rows kept while W&B starts."""
EXIT_WAIT_S = 20.0
"""How long past the sinks' deadline the process waits at exit for ``wandb.init`` threads still
running to end. A thread still inside ``wandb.init`` when the interpreter finalizes can abort
the process (SIGABRT, exit status 134, no message): W&B's settings code calls into Python from
pydantic's compiled code, which a thread ended by the interpreter at exit cannot unwind. W&B
bounds its wait for the run (its ``init_timeout``, which the sink sets to
:data:`START_TIMEOUT_S`, plus 10 s), not every step of ``wandb.init``: this bounds the wait, it
does not make ``wandb.init`` end."""

logger = logging.getLogger("distmetrics")


class WandbSink:
    """One W&B row per train, eval and tensor_stats record; ``all`` metrics as histograms."""

    name = "wandb"
    fix = "check the network and W&B's log, or set wandb_mode: offline"
    install = 'pip install wandb (the "wandb" extra), or leave wandb_project unset'

    def __init__(self, project: str, name: Optional[str], entity: Optional[str], save_dir: str,
                 mode: Optional[str], config: dict) -> None:
        import wandb  # optional dependency, imported only when W&B is asked for

        self._wandb = wandb
        self.run: Any = None
        self._start_error: Optional[BaseException] = None
        self._gave_up = False
        self._started = threading.Event()
        self._deadline = time.monotonic() + START_TIMEOUT_S
        self._pending: collections.deque = collections.deque()
        self.unsent = 0
        """Rows dropped because W&B was still starting and the buffer was full."""
        self._problem_reported = False
        self._skipped: set[str] = set()  # histograms W&B could not bin, warned about once each
        self._log_offset = 0
        self._exit_code: Optional[int] = None  # how the Monitor ended, where it knows (ended())
        settings: dict[str, Any] = {"init_timeout": START_TIMEOUT_S}
        argv = redact_argv(sys.argv)
        if argv != sys.argv:
            # W&B copies sys.argv as it is into the run's metadata (its "environment" record) and
            # into jobs; sys.argv is the training thread's and stays as it is: with a secret on it,
            # that metadata is left out and the config holds the redacted command line instead.
            settings.update(x_disable_meta=True, disable_job_creation=True)
            config = dict(config, argv=argv)
            logger.info("distmetrics: the command line holds a secret value: the W&B run gets the redacted "
                        "command line in its config (argv) and no W&B environment metadata.")
        kwargs = dict(project=project, name=name, entity=entity, dir=save_dir, mode=mode, config=config,
                      reinit="create_new", settings=wandb.Settings(**settings))
        theirs = getattr(wandb, "run", None)
        if theirs is not None:  # the user's own run (or a library's: a Trainer's W&B callback) is left alone
            logger.warning("distmetrics: W&B has a run in this process already (%r, made by wandb.init before the "
                           "Monitor): the Monitor writes its metrics to a run of its own beside it, which it "
                           "finishes at close; yours is left as it is. To keep W&B to your run, leave "
                           "wandb_project unset", getattr(theirs, "name", None) or getattr(theirs, "id", "?"))
        thread = threading.Thread(target=self._start, args=(kwargs,), name="distmetrics-wandb-start", daemon=True)
        thread.start()
        _STARTS[:] = [(t, d) for t, d in _STARTS if t.is_alive()] + [(thread, self._deadline)]

    @property
    def starting(self) -> bool:
        """True while ``wandb.init`` has not returned (or raised) yet."""
        return not self._started.is_set()

    def log_view(self, view: ScalarView, step: int) -> None:
        """Log one record's scalars and histograms as one row at ``step`` (kept while W&B starts)."""
        row: dict[str, Any] = dict(view.scalars)
        for name, values in view.histograms.items():
            try:
                row[name] = self._wandb.Histogram(values)
            except (ValueError, TypeError, OverflowError) as err:  # numpy's bins (values around 1e16 and up)
                if name not in self._skipped:
                    self._skipped.add(name)
                    logger.warning("distmetrics: the wandb sink skipped the histogram %s at step %d, which W&B cannot "
                                   "bin (%s: %s); its /max, /min and /mean and the rest of the row are sent, and "
                                   "the sink goes on.", name, step, type(err).__name__, err)
        ready = self._ready(wait_s=0.0)  # a failure says the rows kept before this one: this one is not kept
        self._pending.append((row, step))
        if len(self._pending) > START_BUFFER_ROWS:
            self._pending.popleft()
            self.unsent += 1
        if ready:
            self._send_pending()
            self._check_for_problems(step)

    def ended(self, exit_code: int) -> None:
        """How the Monitor ended: 0 closed, else the job's error (1) or ``sys.exit``'s code. The run
        is finished with it: W&B marks a run whose code is not 0 failed (finished with none, a crashed
        job's run read finished: W&B's own exit hook, which marks a run that ends on an uncaught error
        failed, comes after this sink has finished it)."""
        self._exit_code = exit_code

    def close(self) -> None:
        """Send what is kept, finish the run, and say if W&B reported a failure."""
        while not self._ready(wait_s=max(0.05, self._deadline - time.monotonic())):
            pass  # returns once started; raises on failure or at the deadline
        self._send_pending()
        try:
            self.run.finish(exit_code=self._exit_code)
        except OSError:
            if not self._problem_reported:  # the failure W&B reported is already said: not twice
                raise
        self._check_for_problems(None)

    def _start(self, kwargs: dict) -> None:
        try:
            # W&B's service starts here, and with it the exit hook that shuts it down: exit hooks run last
            # registered first, so the writer thread's is registered again after it, and a process that ends
            # while wandb.init runs, or with rows queued, writes them before W&B goes (it had lost them all);
            # where this runs during the exit itself, the writer's first exit hook writes them
            if hasattr(self._wandb, "setup"):
                self._wandb.setup()
                exit_hooks_last()
            run = self._wandb.init(**kwargs)
            # every chart's x axis is the record's step, a value of each row: W&B's own step
            # (``log(step=)``) must grow, and a row of a lower step than the last was dropped with
            # only W&B's word (the close record after an evaluation numbered ahead of it)
            run.define_metric(STEP_METRIC)
            run.define_metric("*", step_metric=STEP_METRIC)
        except BaseException as err:  # noqa: BLE001 - W&B raises its own types (and SystemExit)
            self._start_error = err
        else:
            if self._gave_up:  # too late: nobody will log to it
                run.finish()
            else:
                self.run = run
        finally:
            self._started.set()

    def _ready(self, wait_s: float) -> bool:
        """Whether the run exists; raises once W&B failed to start or took too long."""
        if not self._started.wait(wait_s):
            if time.monotonic() < self._deadline:
                return False
            self._gave_up = True
            raise TimeoutError(f"wandb.init did not finish within {START_TIMEOUT_S:.0f} s{self._unsent_note()}")
        if self._start_error is not None:
            from . import failure_cause

            raise RuntimeError(f"wandb.init failed: {failure_cause(self._start_error)}{self._unsent_note()}") \
                from self._start_error
        return True

    def _unsent_note(self) -> str:
        rows = len(self._pending) + self.unsent
        return f"; {rows} row{'' if rows == 1 else 's'} logged meanwhile not sent" if rows else ""

    def _send_pending(self) -> None:
        if self.unsent:
            logger.warning("distmetrics: the wandb sink dropped the %d oldest rows logged while W&B was starting "
                           "(it keeps %d).", self.unsent, START_BUFFER_ROWS)
            self.unsent = 0
        while self._pending:
            row, step = self._pending.popleft()
            row[STEP_METRIC] = step
            self.run.log(row)

    def _check_for_problems(self, step: Optional[int]) -> None:
        """Warn once if W&B logged an error (its service writes the run and reports only there),
        or the disk holding the run is full. A disabled run (W&B's settings chose it) writes nothing."""
        if self._problem_reported or getattr(self.run, "disabled", False):
            return
        problem = self._logged_error() or self._disk_full() or self._removed()
        if problem:
            self._problem_reported = True
            when = f"seen at step {step}" if step is not None else "seen at close"
            logger.warning("distmetrics: the wandb sink: W&B reported a failure (%s): %s. Rows from about then on "
                           "may be missing from the W&B run; the other sinks go on.", when, problem)

    def _logged_error(self) -> str:
        path = getattr(self.run.settings, "log_internal", None)
        try:
            size = os.stat(path).st_size if path else 0
        except OSError:
            return ""
        if size <= self._log_offset:
            return ""
        with open(path, "rb") as f:
            f.seek(self._log_offset)
            chunk = f.read(size - self._log_offset)
        chunk = chunk[:chunk.rfind(b"\n") + 1]  # whole lines only; the rest is read next time
        self._log_offset += len(chunk)
        for line in chunk.splitlines():
            if b'"level":"ERROR"' in line:
                try:
                    message = json.loads(line).get("msg", "")
                except ValueError:
                    message = line.decode("utf-8", "replace")
                return f"{redact_text(str(message))!r} (W&B's log: {path})"  # an upload's pre-signed URL, say
        return ""

    def _removed(self) -> str:
        """Whether the run's folder was removed (``rm -r`` of the run folder): W&B writes on into the
        removed files, and its checks above can read neither its log nor its disk there."""
        folder = getattr(self.run, "dir", None)
        if not folder or os.path.isdir(folder):
            return ""
        return (f"its run folder {folder} was removed while the run was writing it; W&B does not make it again, "
                "so its rows are lost from then on (the JSONL file is made again and holds them)")

    def _disk_full(self) -> str:
        folder = getattr(self.run, "dir", None)
        try:
            stat = os.statvfs(folder) if folder else None
        except OSError:
            return ""
        if stat is None or (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) > 0:
            return ""
        return f"the disk holding {folder} is full (0 bytes free), so W&B cannot write its run there"


def _wait_for_starts_at_exit() -> None:
    """At exit, let the ``wandb.init`` threads still running end first: until the latest sink's
    deadline (which ``close()`` waits for too: silently), then at most :data:`EXIT_WAIT_S` more,
    with a warning. Before or after the writer thread's close (atexit runs last-in first-out,
    and the writer thread starts with the first queued sink)."""
    running = [(thread, deadline) for thread, deadline in _STARTS if thread.is_alive()]
    if not running:
        return
    deadline = max(d for _, d in running)
    for thread, _ in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    if not any(thread.is_alive() for thread, _ in running):
        return
    logger.warning("distmetrics: waiting up to %.0f s for wandb.init, still running after the wandb sink's %.0f s, "
                   "to end before the process exits.", EXIT_WAIT_S, START_TIMEOUT_S)
    until = time.monotonic() + EXIT_WAIT_S
    for thread, _ in running:
        thread.join(max(0.0, until - time.monotonic()))
    if any(thread.is_alive() for thread, _ in running):
        logger.warning("distmetrics: wandb.init is still running after %.0f s more; exiting anyway (the exit may "
                       "abort with SIGABRT while W&B's thread is inside it).", EXIT_WAIT_S)


_STARTS: list = []  # (the thread running wandb.init, the sink's deadline), for every sink made
atexit.register(_wait_for_starts_at_exit)
