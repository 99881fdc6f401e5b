"""The writer thread: TensorBoard, W&B, the console and your own sinks behind one bounded queue,
JSONL and progress.txt on the training thread. A sink that blocks (here: one that waits until the
test lets it go) must not hold up training; when the queue is full the oldest records are
dropped and counted; close() drains the queue, and gives up after a bound."""

import logging
import threading

import distmetrics as dm
from distmetrics.sinks import writer as writer_module

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


def test_close_gives_up_on_a_sink_that_never_returns(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(writer_module, "CLOSE_TIMEOUT_S", 0.5)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    gate = Gate()
    monitor = dm.Monitor(_config(tmp_path), sinks=(gate,))
    assert gate.entered.wait(60)
    for step in (1, 2, 3):
        monitor.step(step, loss=1.0)
    monitor.close()  # returns although the gate never opens
    late = [r.getMessage() for r in caplog.records if "did not finish within" in r.getMessage()]
    assert len(late) == 1 and "the gate sinks" in late[0] and "3 queued records not written" in late[0]
    gate.opened.set()


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
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "written.txt"
    child = subprocess.run([sys.executable, "-c", SLOW_SINK_SCRIPT, str(tmp_path / "run"), str(out)],
                           env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert out.read_text().splitlines() == ["run 0"] + [f"train {s}" for s in range(1, 6)]
