"""The writer thread: TensorBoard, W&B, the console and your own sinks behind one bounded queue,
JSONL and progress.txt on the training thread. A sink that blocks (here: one that waits until the
test lets it go) must not hold up training; when the queue is full (records or metric names) the
oldest records are dropped and counted; close() drains the queue, and gives up after a bound.
W&B that is still starting keeps the rows logged meanwhile and sends them once its run exists."""

import logging
import re
import threading

import pytest

import distmetrics as dm
from distmetrics.sinks import writer as writer_module
from tests.dist_utils import run_child, run_python, run_ranks

STEPS = 300


class Gate:
    """A sink whose log() waits until the test opens the gate (a network sink stuck on a socket)."""

    name = "gate"
    fix = "open the gate"

    def __init__(self):
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.records = []
        self.threads = set()

    def log(self, metrics, step, kind):
        self.entered.set()
        self.opened.wait(120)
        self.records.append((kind, step))
        self.threads.add(threading.current_thread().name)

    def close(self):
        self.threads.add(threading.current_thread().name)


def _config(tmp_path, **keys):
    return dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=1,
                            timing_log_level=-1, **{"straggler_window": 0, **keys})  # train records only


def test_a_blocked_sink_does_not_hold_up_training_and_drops_the_oldest_records(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="distmetrics")
    gate = Gate()
    monitor = dm.Monitor(_config(tmp_path), sinks=(gate,))
    assert gate.entered.wait(60)  # the writer thread holds the "run" record, stuck in the sink
    for step in range(1, STEPS + 1):
        monitor.step(step, loss=1.0)
    assert gate.records == []  # training went on while the sink was stuck
    kept = writer_module.MAX_RECORDS
    dropped = STEPS - kept
    assert monitor.sinks.writer.dropped == dropped
    started = [r.getMessage() for r in caplog.records if "oldest records are dropped" in r.getMessage()]
    assert len(started) == 1 and "the gate sinks" in started[0] and "step 1)" in started[0]
    train = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # JSONL: on the training thread
    gate.opened.set()
    monitor.close()
    assert gate.records == [("run", 0)] + [("train", s) for s in range(dropped + 1, STEPS + 1)]  # drained, in order
    assert gate.threads == {"distmetrics-writer"}
    count = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert len(count) == 1 and f"{dropped} records (steps 1-{dropped})" in count[0]


def test_a_full_queue_drops_records_but_never_the_order_to_purge_an_earlier_jobs_steps(caplog):
    """A resumed job's order to drop the earlier job's TensorBoard steps travels through the queue
    in order with the records; when the queue was full it was dropped as the oldest record, and
    TensorBoard kept the abandoned job's values from the resume step on, while the resume record
    said they were dropped."""
    from distmetrics.sinks import SinkSet

    caplog.set_level(logging.WARNING, logger="distmetrics")

    class Timeline(Gate):  # a sink that keeps a timeline, as TensorBoard does
        def purge_from(self, step):
            self.records.append(("purge", step))

    gate = Timeline()
    sinks = SinkSet([gate])
    sinks.writer.max_records = 4
    sinks.log({"x": 1.0}, 0, "run")
    assert gate.entered.wait(60)  # the writer thread holds the run record
    sinks.purge_from(101)
    for step in range(101, 121):
        sinks.log({"x": 2.0}, step, "train")
    assert sinks.writer.dropped == 17
    gate.opened.set()
    sinks.close()
    assert gate.records == [("run", 0), ("purge", 101)] + [("train", s) for s in range(118, 121)]
    # a record larger than the bound on its own is kept, a queued order beside it or not
    lone = writer_module.WriterThread(lambda *record: None, lambda: None, lambda: "lone", max_names=10)
    with lone._lock:  # the thread takes nothing meanwhile
        lone.put({}, 1, "_purge", keep=True)
        lone.put({f"m{i}": 1.0 for i in range(20)}, 2, "train")
        assert lone.dropped == 0
    lone.close()


@pytest.mark.parametrize("raised", ["SystemExit: 3", "CancelledError: 3"])
def test_a_queued_sink_that_calls_sys_exit_fails_alone_with_a_warning(tmp_path, caplog, raised):
    """SystemExit and asyncio's CancelledError (an async client's own timeout) are not
    Exceptions: a queued sink raising one ended the writer thread, and every queued sink after it
    lost the rest of the run, without a word."""
    import asyncio

    caplog.set_level(logging.WARNING, logger="distmetrics")
    error = {"SystemExit": SystemExit, "CancelledError": asyncio.CancelledError}[raised.split(":")[0]]

    class Exits:
        name, fix = "exits", "do not call sys.exit() in a sink"

        def log(self, metrics, step, kind):
            if step == 5:
                raise error(3)

        def close(self):
            raise error(4)

    class Keeps:
        name, fix = "keeps", ""

        def __init__(self):
            self.steps = []

        def log(self, metrics, step, kind):
            if kind == "train":
                self.steps.append(step)

        def close(self):
            pass

    keeps = Keeps()
    with dm.Monitor(_config(tmp_path), sinks=(Exits(), keeps)) as monitor:
        for step in range(1, 31):
            monitor.step(step, loss=1.0)
    assert keeps.steps == list(range(1, 31))
    failed = [r.getMessage() for r in caplog.records if "the exits sink failed" in r.getMessage()]
    assert len(failed) == 1 and raised in failed[0], failed


def test_the_queue_also_holds_at_most_max_names_metric_names(caplog):
    """A record counts 1 + its metric names. Over the bound the oldest records go, one by one,
    until the rest fits; a record larger than the bound on its own is still kept (and written)."""
    caplog.set_level(logging.WARNING, logger="distmetrics")
    gate, written = Gate(), []

    def handle(metrics, step, kind):
        gate.log(metrics, step, kind)
        written.append((step, len(metrics)))

    writer = writer_module.WriterThread(handle, lambda: None, lambda: "gate", max_names=10)
    writer.put({}, 0, "run")
    assert gate.entered.wait(60)  # the thread holds step 0: the queue is empty again
    # metric names per step (1 + names each: 4, 5, 3, 6, 21) and, by hand for a bound of 10, the
    # records dropped so far: queued 1 | 1 2 | 2 3 | 3 4 | 5
    sizes = {1: 3, 2: 4, 3: 2, 4: 5, 5: 20}
    dropped_after = {1: 0, 2: 0, 3: 1, 4: 2, 5: 4}
    for step, names in sizes.items():
        writer.put({f"m{i}": 1.0 for i in range(names)}, step, "train")
        assert writer.dropped == dropped_after[step], step
    gate.opened.set()
    writer.close()
    assert written == [(0, 0), (5, 20)]
    count = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert len(count) == 1 and "4 records (steps 1-4)" in count[0]


def test_close_from_two_threads_at_once_says_the_dropped_records_once(caplog):
    """Both closes passed the "said" check before either had waited, and each said the count."""
    caplog.set_level(logging.WARNING, logger="distmetrics")
    gate = Gate()
    writer = writer_module.WriterThread(gate.log, lambda: None, lambda: "gate", max_records=2)
    writer.put({}, 0, "run")
    assert gate.entered.wait(60)  # the thread holds step 0
    for step in range(1, 6):
        writer.put({"m": 1.0}, step, "train")
    closes = [threading.Thread(target=writer.close) for _ in range(2)]
    for close in closes:
        close.start()
    while not writer._closing:  # the first close is waiting on the queue; the second is at its lock
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)
    gate.opened.set()
    for close in closes:
        close.join(60)
    count = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert len(count) == 1 and "3 records (steps 1-3)" in count[0], count


def test_close_gives_up_on_a_sink_that_never_returns(tmp_path, caplog, monkeypatch):
    """README: a sink whose call blocks holds back the sinks sharing its thread (the other never
    gets a train record), and close() gives up on both after its bound."""
    monkeypatch.setattr(writer_module, "CLOSE_TIMEOUT_S", 0.5)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    gate, other = Gate(), Gate()
    other.name = "other"
    other.opened.set()  # never blocks
    monitor = dm.Monitor(_config(tmp_path), sinks=(gate, other))
    assert gate.entered.wait(60)
    for step in (1, 2, 3):
        monitor.step(step, loss=1.0)
    monitor.close()  # returns although the gate never opens
    late = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(late) == 1 and "the gate, other sinks" in late[0] and "3 queued records and the one a sink is " \
        "writing not written yet: the " \
        "writer thread goes on with them, and what it has not written when the process exits is lost" in late[0]
    assert not [step for kind, step in other.records if kind == "train"], other.records
    gate.opened.set()  # as said: the thread goes on, writes them and closes the sinks
    monitor.sinks.writer._thread.join(60)
    assert [step for kind, step in other.records if kind == "train"] == [1, 2, 3]


def _collected_on_the_writer_thread_child(out: str, store: str) -> None:
    """A Monitor left open in a function that returned sits in a reference cycle, so the cyclic
    garbage collector frees it, on whichever thread allocates at the time: here the writer thread,
    in a sink of the user's (any allocation there, a protobuf or a W&B row, may collect)."""
    import gc
    import json
    import time
    import weakref

    import torch.distributed as dist

    writer_module.CLOSE_TIMEOUT_S = 10.0  # a close that waits for its own thread gives up after this
    warnings = []
    capture = logging.Handler(logging.WARNING)
    capture.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(capture)
    returned, closed, monitors = threading.Event(), threading.Event(), []

    class Collecting:
        name, fix = "collecting", ""

        def __init__(self):
            self.seen = []

        def log(self, metrics, step, kind):
            self.seen.append(f"{kind} {step}")
            if (kind, step) == ("train", 3):
                returned.wait(60)
                open_before = monitors[0]() is not None
                start = time.monotonic()
                gc.collect()
                self.seen.append(f"collected here: {open_before and monitors[0]() is None}, "
                                 f"within 5 s: {time.monotonic() - start < 5}")

        def close(self):
            self.seen.append(f"closed on {threading.current_thread().name}")
            closed.set()

    def train(sink):
        monitor = dm.Monitor(_config(out, log_progress=False), sinks=[sink])
        monitors.append(weakref.ref(monitor))
        held = [monitor]
        held.append(held)  # a reference cycle (a trainer holding its Monitor and a bound method of its own)
        for step in range(1, 6):
            monitor.step(step, loss=float(step))

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    gc.disable()  # only the sink's collect() collects
    sink = Collecting()
    train(sink)
    returned.set()
    closed.wait(60)
    print(json.dumps({"seen": sink.seen, "warnings": warnings}), flush=True)


def test_a_monitor_collected_on_the_writer_thread_closes_it_without_waiting_for_itself(tmp_path):
    """The Monitor's finalizer, run on the writer thread, closed the writer there and waited for
    that thread to end: a stall of CLOSE_TIMEOUT_S (90 s), then a warning of records not written,
    which the thread wrote afterwards all the same. Now the thread writes what is queued and closes
    its sinks once the record it is in is done, and nothing is said: nothing is lost."""
    import json

    child = run_child("tests.test_sink_writer_thread._collected_on_the_writer_thread_child", tmp_path / "out",
                      tmp_path / "store", timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.splitlines()[-1])
    assert result["seen"] == ["run 0", "train 1", "train 2", "train 3", "collected here: True, within 5 s: True",
                              "train 4", "train 5", "closed on distmetrics-writer"], result
    assert result["warnings"] == []


def test_tensorboard_and_the_console_run_on_the_writer_thread(tmp_path):
    threads = set()

    class Where(logging.Handler):
        def emit(self, record):
            threads.add(threading.current_thread().name)

    handler = Where()
    logging.getLogger("distmetrics.console").addHandler(handler)
    try:
        cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, timing_log_level=-1)
        with dm.Monitor(cfg) as monitor:
            names = {s.name for s in monitor.sinks.queued}
            inline = {s.name for s in monitor.sinks.inline}
            monitor.step(1, loss=1.0)
    finally:
        logging.getLogger("distmetrics.console").removeHandler(handler)
    assert names == {"tensorboard", "console"} and inline == {"jsonl", "progress"}
    assert threads == {"distmetrics-writer"}


def test_a_record_is_copied_when_queued():
    """The caller may change the dict it passed (monitor.step returns it) while the writer
    thread has yet to read it."""
    from distmetrics.sinks import SinkSet

    seen = []

    class Reader(Gate):
        def log(self, metrics, step, kind):
            self.opened.wait(120)
            seen.append(len(metrics))

    reader = Reader()
    sinks = SinkSet([reader])
    metrics = {f"m{i}": float(i) for i in range(100)}
    sinks.log(metrics, 1, "train")
    metrics.clear()
    reader.opened.set()
    sinks.close()
    assert seen == [100]


def _write_settings_pipe(settings: str) -> None:
    """Write W&B's settings file, a named pipe W&B blocks on until it is written (within 60 s)."""
    import errno
    import os
    import time

    deadline = time.monotonic() + 60
    while True:  # opening a pipe to write fails (ENXIO) until W&B has opened it to read
        try:
            fd = os.open(settings, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as err:
            if err.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    os.write(fd, b"[default]\n")
    os.close(fd)


def _wandb_slow_start_child(out: str, settings: str, result: str) -> None:
    """30 train rows while ``wandb.init`` waits on its settings file (a named pipe nobody has
    written yet), then the pipe is written and the Monitor closed."""
    import json

    from distmetrics.sinks import wandb as wandb_sink

    wandb_sink.START_BUFFER_ROWS = 10  # instead of 1,000, to keep the test short
    warnings = []
    capture = logging.Handler(logging.WARNING)
    capture.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(capture)
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=out, json_log=False, console=False, log_progress=False,
                                          tensorboard=False, log_interval=1, timing_log_level=-1, straggler_window=0,
                                          wandb_project="slow-start", wandb_mode="offline", wandb_save_dir=out))
    (sink,) = [s for s in monitor.sinks.queued if s.name == "wandb"]
    for step in range(1, 31):
        monitor.step(step, loss=float(step))
    handed = monitor.sinks.writer.flush(60)  # every row has reached the sink
    starting = sink.run is None
    _write_settings_pipe(settings)
    monitor.close()
    with open(result, "w") as f:
        json.dump({"handed": handed, "starting": starting, "warnings": warnings}, f)


def test_rows_logged_while_wandb_starts_are_kept_and_sent_once_the_run_exists(tmp_path):
    """Real W&B (offline), its start-up held up by a real condition: its settings file
    (``$WANDB_CONFIG_DIR/settings``) is a named pipe, so ``wandb.init`` blocks reading it (as on a
    slow network file system) until the child writes it after its 30 steps. The newest rows are
    kept (the buffer cut from 1,000 rows to 10 for the test), the older ones counted, and the kept
    ones reach the run."""
    import json
    import os

    pytest.importorskip("wandb")
    from tests.wandb_reader import read_offline_run

    (tmp_path / "config").mkdir()
    settings = tmp_path / "config" / "settings"
    os.mkfifo(settings)
    child = run_child("tests.test_sink_writer_thread._wandb_slow_start_child", tmp_path / "out", settings,
                      tmp_path / "result.json", timeout=180, env={"WANDB_CONFIG_DIR": str(tmp_path / "config")})
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["handed"] and result["starting"]  # the sink had all 30 rows while W&B was starting
    dropped = [w for w in result["warnings"] if "the wandb sink" in w]
    assert dropped == ["distmetrics: the wandb sink dropped the 20 oldest rows logged while W&B was starting "
                       "(it keeps 10)."]
    rows = [row for row in read_offline_run(str(tmp_path / "out"))["history"] if "train/loss" in row]
    assert [(row["step"], row["train/loss"]) for row in rows] == [(s, float(s)) for s in range(21, 31)]


SLOW_SINK_SCRIPT = """
import sys, time
import distmetrics as dm

class SlowFile:
    name = "slow_file"
    fix = "none"
    def __init__(self, path):
        self.path = path
    def log(self, metrics, step, kind):
        time.sleep(0.2)
        with open(self.path, "a") as f:
            f.write(f"{kind} {step}\\n")
    def close(self):
        pass

monitor = dm.Monitor(dm.MetricsConfig(output_dir=sys.argv[1], console=False, tensorboard=False, log_interval=1,
                                      timing_log_level=-1), sinks=[SlowFile(sys.argv[2])])
for step in range(1, 6):
    monitor.step(step, loss=1.0)
# no close(): the interpreter exits with records still queued
"""


def test_a_script_that_never_closes_still_gets_its_queue_written(tmp_path):
    out = tmp_path / "written.txt"
    child = run_python("-c", SLOW_SINK_SCRIPT, tmp_path / "run", out)
    assert child.returncode == 0, child.stderr
    assert out.read_text().splitlines() == ["run 0"] + [f"train {s}" for s in range(1, 6)]


def _wandb_starting_at_exit_child(out: str, settings: str, store: str, received: str) -> None:
    """A gloo group (one rank), W&B (offline), TensorBoard and a sink of the user's: five steps right
    after ``Monitor()``, and the process ends without close() while W&B's setup waits on its settings
    file (a named pipe); the script's own exit hook, the first to run, writes it: W&B starts while
    the interpreter runs its exit hooks, as when a short job ends before W&B is up."""
    import atexit

    import torch.distributed as dist

    class Received:
        name, fix = "received", ""

        def log(self, metrics, step, kind):
            with open(received, "a") as f:
                f.write(f"{kind} {step}\n")

        def close(self):
            with open(received, "a") as f:
                f.write("closed\n")

    def let_wandb_read_its_settings():
        _write_settings_pipe(settings)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=out, console=False, log_interval=1, timing_log_level=-1,
                                          straggler_window=0, wandb_project="exit", wandb_mode="offline",
                                          wandb_save_dir=out), sinks=[Received()])
    _SCRIPT_GLOBALS.append(monitor)  # open until the exit, as a script's own variable is
    for step in range(1, 6):
        monitor.step(step, loss=float(step))
    atexit.register(let_wandb_read_its_settings)  # registered last: runs first


_SCRIPT_GLOBALS: list = []


def test_a_script_that_ends_while_wandb_starts_still_gets_every_sink_written(tmp_path):
    """README: a script that never calls close() gets its queue written at exit, W&B's rows too.
    W&B's start, ending while the interpreter ran its exit hooks, moved the writer thread's exit hook
    where a hook registered then never runs: the W&B run had no row, the user's sink missed records
    and was never closed, and TensorBoard's file was never closed (no scalar in it)."""
    import os

    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.wandb_reader import read_offline_run

    (tmp_path / "config").mkdir()
    settings, out, received = tmp_path / "config" / "settings", tmp_path / "out", tmp_path / "received.txt"
    os.mkfifo(settings)
    child = run_child("tests.test_sink_writer_thread._wandb_starting_at_exit_child", out, settings,
                      tmp_path / "store", received, timeout=180, env={"WANDB_CONFIG_DIR": str(tmp_path / "config")})
    assert child.returncode == 0, child.stderr[-3000:]
    steps = range(1, 6)
    assert received.read_text().splitlines() == ["run 0"] + [f"train {s}" for s in steps] + ["closed"]
    rows = [row for row in read_offline_run(str(out))["history"] if "train/loss" in row]
    assert [(row["step"], row["train/loss"]) for row in rows] == [(s, float(s)) for s in steps]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(s, float(s)) for s in steps]


@pytest.mark.parametrize("on_training_thread", [True, False])
def test_a_sink_that_names_its_kinds_gets_only_those_records(tmp_path, on_training_thread):
    """``kinds``: the record kinds a sink takes; the others are not handed to it, on either
    thread (progress.txt takes ``progress`` records only). A purge still reaches a sink that
    keeps a timeline."""

    class Kinds:
        name, fix, kinds = "kinds", "", ("eval", "progress")

        def __init__(self):
            self.seen, self.purged = [], []

        def log(self, metrics, step, kind):
            self.seen.append(kind)

        def purge_from(self, step):
            self.purged.append(step)

        def close(self):
            pass

    Kinds.on_training_thread = on_training_thread
    sink, every = Kinds(), Gate()
    every.opened.set()
    with dm.Monitor(_config(tmp_path), sinks=[sink, every]) as monitor:
        for step in range(1, 5):
            monitor.step(step, loss=1.0)
        monitor.log_eval(4, loss=0.5)
        monitor.sinks.purge_from(3)
        monitor.sinks.flush()
    assert sorted(set(sink.seen)) == ["eval"] and sink.purged == [None, 3]  # None: the first step drops nothing
    assert {"train", "eval"} <= {kind for kind, _ in every.records}


def _signalling_queue() -> type:
    """A deque for the writer's queue that sends SIGUSR1 to this process inside the append after
    ``armed`` is set: the moment the training thread is inside put() holding the queue's lock."""
    import collections
    import os
    import signal

    class Records(collections.deque):
        armed = False

        def append(self, item):
            super().append(item)
            if Records.armed:
                Records.armed = False
                os.kill(os.getpid(), signal.SIGUSR1)
                sum(range(10))  # the handler runs between these bytecodes, inside put()'s lock

    return Records


def _flush_from_a_signal_handler_child() -> None:
    """A preemption handler (SIGUSR1 here) that flushes the metrics, arriving while the training
    thread is inside put() holding the queue's lock (the deque stands in for the moment)."""
    import faulthandler
    import signal

    from distmetrics.sinks import SinkSet

    class Quiet:
        name, fix = "quiet", ""

        def log(self, metrics, step, kind):
            pass

        def close(self):
            pass

    sinks = SinkSet([Quiet()])

    Records = _signalling_queue()
    sinks.writer._records = Records(sinks.writer._records)
    signal.signal(signal.SIGUSR1, lambda *_: print("handler flushed:", sinks.flush(timeout=5), flush=True))
    faulthandler.dump_traceback_later(30, exit=True)  # a deadlock ends the child with its stacks
    Records.armed = True
    sinks.log({"a": 1.0}, 1, "train")
    sinks.close()
    print("returned", flush=True)


def test_a_signal_handler_may_flush_while_the_training_thread_queues_a_record():
    child = run_child("tests.test_sink_writer_thread._flush_from_a_signal_handler_child", timeout=120)
    assert child.returncode == 0 and child.stdout.split() == ["handler", "flushed:", "True", "returned"], \
        child.stdout + child.stderr


def _close_from_a_signal_handler_child() -> None:
    """A preemption handler (SIGUSR1 here) that closes the metrics, arriving while the training
    thread is inside put() holding the queue's lock."""
    import signal
    import time

    from distmetrics.sinks import SinkSet

    class Kept:
        name, fix = "kept", ""

        def __init__(self):
            self.seen = []

        def log(self, metrics, step, kind):
            self.seen.append(step)

        def close(self):
            self.seen.append("closed")

    Records = _signalling_queue()
    writer_module.CLOSE_TIMEOUT_S = 10.0  # a close that waits for its own lock gives up after this
    kept = Kept()
    sinks = SinkSet([kept])
    sinks.writer._records = Records(sinks.writer._records)
    waited = []

    def close_metrics(signum, frame):
        start = time.monotonic()
        sinks.close()
        waited.append(time.monotonic() - start)

    signal.signal(signal.SIGUSR1, close_metrics)
    for step in (1, 2, 3, 4):
        sinks.log({"a": 1.0}, step, "train")
    Records.armed = True
    sinks.log({"a": 1.0}, 5, "train")
    print("closed within 5 s:", waited[0] < 5, "seen:", *kept.seen, flush=True)


def test_a_signal_handler_may_close_while_the_training_thread_queues_a_record():
    """The handler's close() re-entered the queue's lock, held by put() on the same thread, then
    joined the writer thread, which waited for that lock: a stall of CLOSE_TIMEOUT_S (90 s), then
    every queued record was dropped."""
    child = run_child("tests.test_sink_writer_thread._close_from_a_signal_handler_child", timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["closed", "within", "5", "s:", "True", "seen:", "1", "2", "3", "4", "5",
                                    "closed"], child.stdout + child.stderr


def _signal_in_close_child(out: str, done: str, name: str) -> None:
    """40 records queued behind a slow sink of the user's; the signal (SIGTERM made sys.exit, as the
    README shows, or Ctrl-C's SIGINT) arrives while close() waits for them to be written."""
    import os
    import signal
    import sys
    import time

    class Slow:
        name, fix = "slow", ""

        def __init__(self):
            self.go = threading.Event()

        def log(self, metrics, step, kind):
            self.go.wait(60)
            time.sleep(0.05)
            if kind == "train":
                with open(done, "a") as f:
                    f.write(f"{step}\n")

        def close(self):
            with open(done, "a") as f:
                f.write("closed\n")

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Ctrl-C's KeyboardInterrupt: Python leaves SIGINT ignored where it started so (a job a shell ran in the
    # background inherits that), and the signal then did nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    slow = Slow()
    monitor = dm.Monitor(_config(out, log_progress=False), sinks=[slow])
    for step in range(1, 41):
        monitor.step(step, loss=1.0)
    threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, name))).start()
    slow.go.set()
    monitor.close()


@pytest.mark.parametrize("name,raised", [("SIGTERM", "SystemExit"), ("SIGINT", "KeyboardInterrupt")])
def test_a_signal_during_close_leaves_the_queue_written_at_exit(tmp_path, name, raised):
    """close() gave up its exit hook before waiting for the writer thread: the exception of a signal
    arriving meanwhile ended the process with the queue unwritten (a sink got 9 of 40 records) and
    never closed, without a word."""
    done = tmp_path / "written.txt"
    child = run_child("tests.test_sink_writer_thread._signal_in_close_child", str(tmp_path / "out"), str(done),
                      name, timeout=120)
    said = re.search(rf"close\(\) of the slow sinks was interrupted \({raised}\) with (\d+) records not written yet: "
                     r"the writer thread goes on with them, and the exit waits for it again", child.stderr)
    assert said and int(said.group(1)) > 0, child.stderr
    assert done.read_text().split() == [str(step) for step in range(1, 41)] + ["closed"]


def test_a_sink_put_on_the_lists_directly_is_written_and_one_kind_may_be_a_string():
    """``inline`` and ``queued`` are lists: a sink appended there without ``attach`` is written
    like any other; ``kinds = "eval"`` means that one kind, not its letters."""
    from distmetrics.sinks import SinkSet

    class Seen:
        name, fix = "seen", ""

        def __init__(self, kinds=None):
            self.kinds, self.seen = kinds, []

        def log(self, metrics, step, kind):
            self.seen.append(kind)

        def close(self):
            pass

    every, evals = Seen(), Seen("eval")
    sinks = SinkSet()
    sinks.inline.append(every)
    sinks.attach(evals)
    for kind in ("train", "eval"):
        sinks.log({"a": 1.0}, 1, kind)
    sinks.close()
    assert every.seen == ["train", "eval"] and evals.seen == ["eval"] and not sinks.failed


@pytest.mark.parametrize("stuck", ["record", "finish"])
def test_close_says_what_a_stuck_sink_holds_when_nothing_is_queued(caplog, stuck):
    """close() said "0 queued records not written yet" for a record a sink was in, and for sinks stuck
    closing after the last record."""
    caplog.set_level(logging.WARNING, logger="distmetrics")
    release = threading.Event()
    writer = writer_module.WriterThread(lambda *record: release.wait(60) if stuck == "record" else None,
                                        lambda: release.wait(60), lambda: "stuck")
    writer.put({"m": 1.0}, 1, "train")
    assert writer.close(timeout=0.3)
    release.set()
    said = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "the record a sink is writing not written yet: the writer thread goes on with it, and what it has not "
        "written when the process exits is lost." if stuck == "record" else
        "every record is written, and the sinks are still closing."), said
    writer._thread.join(60)


def _what_a_users_sink_receives(rank: int, world: int, out: str) -> dict:
    """A sink with ``log`` and one with ``log_view`` on 2 ranks, an ``all`` metric of 1.0 on rank 0
    and 3.0 on rank 1 and a ``mean`` of 5.0 and 7.0."""
    import distmetrics as dm

    class Raw:
        name, got = "raw", []

        def log(self, metrics, step, kind):
            self.got.append((kind, dict(metrics)))

        def close(self):
            pass

    class Viewed(Raw):
        name, got = "viewed", []

        def log_view(self, view, step):
            self.got.append((step, view.scalars, view.histograms))

    raw, viewed = Raw(), Viewed()
    with dm.Monitor(_config(out), sinks=[raw, viewed]) as monitor:
        monitor.record("u/x", 1.0 + 2 * rank, reduce="all")
        monitor.record("u/m", 5.0 + 2 * rank)
        monitor.step(1, loss=1.0)
    if rank != 0:  # the writer's sinks alone are handed records
        return {"raw": raw.got, "viewed": viewed.got}
    (train,) = [metrics for kind, metrics in raw.got if kind == "train"]
    x = train["u/x"]
    return {"x": (type(x).__name__, list(x), list(x.rank_ids())), "summary": [train[f"u/x/{s}"] for s in
            ("max", "min", "mean")], "m": train["u/m"], "view": [(s, h.get("u/x"), "u/x" in v) for s, v, h in
                                                                  viewed.got]}


def test_a_users_sink_receives_every_ranks_values_of_an_all_metric_as_the_readme_says(tmp_path):
    """The README's own-sink paragraph: ``log`` gets ``dm.PerRank`` (a list in rank order, with the
    global ranks) beside ``/max``, ``/min`` and ``/mean``; ``log_view`` gets them as a histogram.
    Truth: what each rank recorded."""
    got, other = run_ranks(_what_a_users_sink_receives, 2, str(tmp_path), timeout=120)
    assert other == {"raw": [], "viewed": []}
    assert got["x"] == ("PerRank", [1.0, 3.0], [0, 1]) and got["summary"] == [3.0, 1.0, 2.0] and got["m"] == 6.0
    assert got["view"] == [(1, [1.0, 3.0], False)]
