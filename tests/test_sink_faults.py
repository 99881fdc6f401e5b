"""Sinks under real faults: a full disk that empties again (a 128 KiB tmpfs; where mounting is
refused, RLIMIT_FSIZE in the child process), a SIGKILL during a write, a name TensorBoard cannot
store. The full-disk run happens in a child process (the file-size limit and the warnings stay
there) and the tests below read what it left."""

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests import dist_utils

ROOT = Path(__file__).resolve().parents[1]
STEPS = 80
FREED_AT = 40  # the filler file is deleted after this step
SCALARS = 30  # ~0.6 KB per record in each file: a few steps fill what is left, 40 fit once it is freed


@contextmanager
def small_disk(folder: Path, size: str = "128k"):
    """A tmpfs of ``size`` at ``folder``; yields ``"tmpfs"``, or ``"fsize"`` where mounting is
    refused (not root): then the child limits file sizes with RLIMIT_FSIZE instead."""
    folder.mkdir(parents=True)
    mounted = shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        yield "tmpfs" if mounted else "fsize"
    finally:
        if mounted and subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)  # busy (W&B's service): detached


def run_child(function: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``tests.test_sink_faults.<function>(*args)`` in a fresh interpreter."""
    return dist_utils.run_child(f"tests.test_sink_faults.{function}", *args, timeout=timeout)


class Capture(logging.Handler):
    """Every distmetrics warning, as text."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _full_disk_child(folder: str, disk: str, result: str) -> None:
    """JSONL + TensorBoard + progress.txt on a disk that fills up after the first steps and has
    room again after step FREED_AT."""
    import resource
    import threading

    import distmetrics as dm

    out = Path(folder)
    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    thread_errors = []
    threading.excepthook = lambda args: thread_errors.append(repr(args.exc_value))
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, timing_log_level=-1,
                           log_throughput=False, log_memory=False, straggler_window=0)  # train records only
    monitor = dm.Monitor(cfg)
    monitor.sinks.flush()
    leave = 8 * 1024
    if disk == "tmpfs":
        st = os.statvfs(out)
        with open(out / "filler", "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        biggest = max(p.stat().st_size for p in out.rglob("*") if p.is_file())
        resource.setrlimit(resource.RLIMIT_FSIZE, (biggest + leave, hard))
    scalars = {f"x{i:03d}": 1.5 for i in range(SCALARS)}
    while_full = None
    for step in range(1, STEPS + 1):
        monitor.step(step, loss=2.0, lr=0.5, **scalars)
        if step == FREED_AT:
            monitor.sinks.flush()  # every TensorBoard event so far was tried on the full disk
            while_full = (out / "metrics.jsonl").read_text()
            if disk == "tmpfs":
                os.remove(out / "filler")
            else:
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    monitor.close()
    Path(result).write_text(json.dumps({"warnings": capture.messages, "thread_errors": thread_errors,
                                        "while_full": while_full}))


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_disk")
    with small_disk(root / "disk") as disk:
        child = run_child("_full_disk_child", str(root / "disk"), disk, str(root / "result.json"))
        assert child.returncode == 0, child.stderr
        saved = root / "saved"  # read after the tmpfs is gone
        shutil.copytree(root / "disk", saved, ignore=shutil.ignore_patterns("filler"))
    result = json.loads((root / "result.json").read_text())
    return saved, disk, result, child.stderr


def _warnings(result, sink, text):
    return [w for w in result["warnings"] if f"the {sink} sink" in w and text in w]


def test_jsonl_never_ends_in_a_torn_line_while_the_disk_is_full(full_disk):
    _, disk, result, _ = full_disk
    text = result["while_full"]
    assert text.endswith("\n"), f"{disk}: torn last line {text[-80:]!r}"
    for line in text.splitlines():
        json.loads(line)


def test_jsonl_writes_again_when_space_returns_and_marks_the_gap(full_disk):
    saved, disk, _, _ = full_disk
    import distmetrics as dm

    path = saved / "metrics.jsonl"
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON, every line
    assert len(list(dm.read_jsonl(path))) == len(records)
    if shutil.which("jq"):
        jq = subprocess.run(["jq", "-c", ".kind", str(path)], capture_output=True, text=True)
        assert jq.returncode == 0 and len(jq.stdout.splitlines()) == len(records), jq.stderr
    written = {r["step"] for r in records if r["kind"] == "train"}
    missing = set(range(1, STEPS + 1)) - written
    assert missing, f"{disk}: the disk never filled up; the test did not test anything"
    assert set(range(FREED_AT + 1, STEPS + 1)) <= written  # every record after space returned
    # One gap record per outage (a small record, e.g. a stragglers record, may fit in between):
    # together they account for every lost train record.
    gaps = [r for r in records if r["kind"] == "gap"]
    assert gaps
    assert all(any(g["first_step"] <= step <= g["last_step"] for g in gaps) for step in missing)
    assert sum(g["lost_records"] for g in gaps) >= len(missing)
    assert min(g["first_step"] for g in gaps) == min(missing) and max(g["last_step"] for g in gaps) == max(missing)
    for gap in gaps:
        assert gap["error"].startswith("[Errno") and ("ENOSPC" in gap["error"] or "EFBIG" in gap["error"])
        assert records[records.index(gap) + 1]["step"] == gap["step"]  # just before the first record written again


def test_jsonl_warns_when_it_fails_and_when_it_recovers_with_the_count(full_disk):
    saved, disk, result, _ = full_disk
    path = str(saved.parent / "disk" / "metrics.jsonl")
    errno_name = "ENOSPC" if disk == "tmpfs" else "EFBIG"
    failing = _warnings(result, "jsonl", "cannot write")
    assert len(failing) == 1 and path in failing[0] and errno_name in failing[0], failing
    records = [json.loads(line) for line in (saved / "metrics.jsonl").read_text().splitlines()]
    lost = [r for r in records if r["kind"] == "gap"][0]["lost_records"]
    recovered = _warnings(result, "jsonl", "again from step")
    assert len(recovered) == 1 and f"{lost} records" in recovered[0], recovered
    assert not any("pip install" in w for w in result["warnings"])


def test_summary_names_the_records_the_full_disk_lost(full_disk):
    """``distmetrics summary`` of the file the full disk left says which steps were lost and why."""
    saved, _, _, _ = full_disk
    records = [json.loads(line) for line in (saved / "metrics.jsonl").read_text().splitlines()]
    gaps = [r for r in records if r["kind"] == "gap"]
    out = subprocess.run([sys.executable, "-m", "distmetrics.cli", "summary", str(saved)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    for gap in gaps:
        line = (f"lost {gap['lost_records']} record(s), steps {gap['first_step']}-{gap['last_step']}: "
                f"{gap['error']} (written again from step {gap['step']})")
        assert line in out.stdout, out.stdout


def test_tensorboard_survives_the_full_disk_and_writes_again(full_disk):
    saved, disk, result, stderr = full_disk
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert result["thread_errors"] == [] and "Traceback" not in stderr, stderr
    acc = EventAccumulator(str(saved / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == sorted(set(steps))
    missing = set(range(1, STEPS + 1)) - set(steps)
    assert missing, f"{disk}: TensorBoard never hit the full disk"
    assert set(range(FREED_AT + 1, STEPS + 1)) <= set(steps)
    assert len(acc.Scalars("train/x029")) == len(steps)  # every event whole, every scalar in it
    failing = _warnings(result, "tensorboard", "cannot write")
    assert len(failing) == 1 and ("ENOSPC" in failing[0] or "EFBIG" in failing[0]), failing
    recovered = _warnings(result, "tensorboard", "again from step")
    assert len(recovered) == 1 and f"{len(missing)} records" in recovered[0], recovered


def test_tensorboard_writes_one_event_per_log_step(full_disk):
    saved, _, _, _ = full_disk
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    import distmetrics as dm

    (events_file,) = (saved / "tensorboard").iterdir()
    events = [Event.FromString(raw) for raw in RawEventFileLoader(str(events_file)).Load()]
    assert events[0].file_version == "brain.Event:2"
    by_step = {}
    for event in events[1:]:
        by_step.setdefault(event.step, []).append(event)
    assert all(len(v) == 1 for v in by_step.values())  # one event per record, not one per scalar
    train = {r["step"]: r for r in dm.read_jsonl(saved / "metrics.jsonl") if r["kind"] == "train"}
    for step in set(by_step) & set(train):
        tags = {v.tag: v.simple_value for v in by_step[step][0].summary.value}
        numbers = {k: v for k, v in train[step].items()
                   if k not in ("kind", "step", "time") and isinstance(v, (int, float))}
        assert tags == pytest.approx(numbers)  # tags equal the JSONL keys


CONSOLE_STEPS, CONSOLE_FULL_AT, CONSOLE_FREED_AT = 16, 4, 10  # steps 4-10 find the disk full


def _console_on_full_disk(rank: int, world: int, folder: str, disk: str) -> dict:
    """Two ranks log every step (loss ``step + rank``); the writer rank's stdout is a file on a
    small disk (``> out.txt``) that fills before step CONSOLE_FULL_AT with 10 bytes left (less than
    a line: the next one is written in part) and has room again after step CONSOLE_FREED_AT."""
    import resource

    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(Path(folder) / "run"), log_interval=1, json_log=False, tensorboard=False,
                           log_progress=False, timing_log_level=-1, log_throughput=False, log_memory=False,
                           straggler_window=0)
    if rank != 0:
        with dm.Monitor(cfg) as monitor:
            for step in range(1, CONSOLE_STEPS + 1):
                monitor.step(step, loss=float(step + rank))
        return {"steps": CONSOLE_STEPS}
    out = Path(folder) / "out.txt"
    saved_fd, saved_stdout, saved_root = os.dup(1), sys.stdout, logging.getLogger().handlers[:]
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.close(fd)
    sys.stdout = open(1, "w", closefd=False)  # as Python opens a redirected stdout: block-buffered
    logging.getLogger().handlers.clear()  # logging unconfigured: the console sink prints to stdout itself
    capture, printed = Capture(), Capture()
    printed.setLevel(logging.INFO)
    logging.getLogger("distmetrics").addHandler(capture)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    while_full = None
    try:
        with dm.Monitor(cfg) as monitor:
            logging.getLogger("distmetrics.console").addHandler(printed)  # what the sink printed: the truth
            for step in range(1, CONSOLE_STEPS + 1):
                if step == CONSOLE_FULL_AT:
                    monitor.sinks.flush()
                    sys.stdout.flush()
                    size = os.fstat(1).st_size
                    if disk == "tmpfs":  # the file's last page ends 10 bytes on, then no page is free
                        page = os.statvfs(folder).f_frsize
                        pad = (page - 10 - size % page) % page
                        if pad:
                            sys.stdout.write("#" * (pad - 1) + "\n")
                            sys.stdout.flush()
                        with open(Path(folder) / "filler", "wb") as f:
                            try:
                                f.write(b"\0" * (os.statvfs(folder).f_bavail * page))
                                f.flush()
                            except OSError:
                                pass  # full
                    else:
                        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))
                monitor.step(step, loss=float(step + rank))
                if step == CONSOLE_FREED_AT:
                    monitor.sinks.flush()
                    while_full = out.read_text()
                    if disk == "tmpfs":
                        os.remove(Path(folder) / "filler")
                    else:
                        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        logging.getLogger("distmetrics").removeHandler(capture)
        logging.getLogger("distmetrics.console").removeHandler(printed)
        logging.getLogger().handlers[:] = saved_root
        sys.stdout.flush()
        sys.stdout = saved_stdout
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
    return {"warnings": capture.messages, "printed": printed.messages, "while_full": while_full}


def test_console_lines_reach_a_write_replaced_on_stdout_and_a_byte_order_mark_is_written_once(tmp_path):
    """A line written on stdout's descriptor bypassed what replaces ``sys.stdout.write`` on the stream
    (W&B's console capture: no distmetrics line in the run's logs) and the stream's encoder (a
    byte-order mark before every line under ``utf-8-sig``): such streams get each line through
    their own ``write``."""
    import codecs
    import logging

    from distmetrics.sinks.console import _Stdout

    seen: list = []
    with open(tmp_path / "wrapped.txt", "w", encoding="utf-8") as stream:
        real = stream.write
        stream.write = lambda text: (seen.append(text), real(text))[1]
        for n in (1, 2):
            _Stdout(stream).emit(logging.makeLogRecord({"msg": f"line {n}"}))
    assert "".join(seen) == "line 1\nline 2\n" == (tmp_path / "wrapped.txt").read_text()
    with open(tmp_path / "marked.txt", "w", encoding="utf-8-sig") as stream:
        for n in (1, 2):
            _Stdout(stream).emit(logging.makeLogRecord({"msg": f"line {n}"}))
    assert (tmp_path / "marked.txt").read_bytes() == codecs.BOM_UTF8 + b"line 1\nline 2\n"


def test_console_lines_on_a_full_disk_are_whole_or_absent_counted_and_printed_again(tmp_path):
    """stdout redirected to a file on a disk that fills mid-line: logging's buffered stream wrote
    the line's first part and kept the rest for the next write (a half line, then glued to the next
    one), and the sink was turned off for the rest of the run. Now each line is whole or absent,
    the lost lines are counted and said with the errno, and printing resumes when room returns."""
    with small_disk(tmp_path / "disk") as disk:
        writer, other = dist_utils.run_ranks(_console_on_full_disk, 2, str(tmp_path / "disk"), disk)
        text = (tmp_path / "disk" / "out.txt").read_text()
    assert other == {"steps": CONSOLE_STEPS}  # the other rank, and its collectives, went on
    assert writer["while_full"].endswith("\n"), f"{disk}: half a line {writer['while_full'][-60:]!r}"
    lines = [line for line in text.splitlines() if not line.startswith("#")]  # the padding is the test's
    assert all(line in writer["printed"] for line in lines), lines  # whole lines only, none glued to another
    steps = [int(line.split()[2]) for line in lines]
    lost = list(range(CONSOLE_FULL_AT, CONSOLE_FREED_AT + 1))
    assert steps == [s for s in range(1, CONSOLE_STEPS + 1) if s not in lost], lines
    for step, line in zip(steps, lines):  # the mean over the two ranks, computed here
        assert f" loss {(step + step + 1) / 2:.4f} " in f"{line} ", line
    warned = [w for w in writer["warnings"] if "console sink" in w]
    errno_name = "ENOSPC" if disk == "tmpfs" else "EFBIG"
    assert len(warned) == 2, warned
    assert f"cannot write stdout ({tmp_path / 'disk' / 'out.txt'}) at step {CONSOLE_FULL_AT}" in warned[0]
    assert errno_name in warned[0], warned
    assert warned[1].endswith(f"again from step {CONSOLE_FREED_AT + 1}; {len(lost)} records (steps "
                              f"{CONSOLE_FULL_AT}-{CONSOLE_FREED_AT}) could not be written."), warned


# --- a SIGKILL during a write --------------------------------------------------------------

def _full_at_start_child(folder: str, disk: str, result: str) -> None:
    """A Monitor made on a disk that is already full (a restart after the disk filled): steps 1-5,
    room again, steps 6-10."""
    import resource

    import distmetrics as dm

    out = Path(folder)
    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    if disk == "tmpfs":
        st = os.statvfs(out)
        with open(out / "filler", "wb") as f:
            try:
                f.write(b"\0" * (st.f_bavail * st.f_frsize))
                f.flush()
            except OSError:
                pass  # full
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    cfg = dm.MetricsConfig(output_dir=str(out / "run"), log_interval=1, console=False, tensorboard=False,
                           timing_log_level=-1, log_throughput=False, log_memory=False, straggler_window=0)
    error = None
    try:
        monitor = dm.Monitor(cfg)
        for step in range(1, 11):
            monitor.step(step, loss=2.0)
            if step == 5:
                if disk == "tmpfs":
                    os.remove(out / "filler")
                else:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        monitor.close()
    except Exception as err:  # noqa: BLE001 - the test reads it
        error = repr(err)
    Path(result).write_text(json.dumps({"warnings": capture.messages, "error": error}))


def test_a_monitor_made_on_a_full_disk_goes_on_and_writes_when_room_returns(tmp_path):
    """Monitor() wrote who holds output_dir into its lock file outside any error handling: on a
    full disk it raised a bare OSError on the writer rank (no path, no errno name), the job a
    restart after a full disk most needs. Now it warns, and the files recover as mid-run."""
    with small_disk(tmp_path / "disk") as disk:
        child = run_child("_full_at_start_child", str(tmp_path / "disk"), disk, str(tmp_path / "result.json"))
        assert child.returncode == 0, child.stderr
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["error"] is None, result
        assert any("who holds it could not be written" in w for w in result["warnings"]), result["warnings"]
        records = [json.loads(line) for line in (tmp_path / "disk" / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r["step"] for r in records if r["kind"] == "train"]
    assert train[-5:] == [6, 7, 8, 9, 10] and [r for r in records if r["kind"] == "gap"]


def _writer_child(path: str) -> None:
    """Append big records to a JSONL file until killed."""
    from distmetrics.sinks.jsonl import JsonlSink

    sink = JsonlSink(path)
    blob = "x" * (4 << 20)  # 4 MiB lines: a kill lands inside write() often
    step = 0
    while True:
        step += 1
        sink.log({"blob": blob}, step, "train")


def test_a_sigkill_during_a_write_leaves_a_file_that_reads_whole_after_a_restart(tmp_path):
    import distmetrics as dm
    from distmetrics.sinks.jsonl import JsonlSink

    path = tmp_path / "metrics.jsonl"
    code = "import sys; from tests.test_sink_faults import _writer_child as f; f(sys.argv[1])"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rng = random.Random(0)
    torn = False
    for _ in range(60):  # a kill lands inside write() in about one try of seven here
        path.unlink(missing_ok=True)
        child = subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, cwd=ROOT)
        while not path.exists() or path.stat().st_size < (8 << 20):
            time.sleep(0.01)  # a few records in
        time.sleep(rng.uniform(0, 0.05))
        child.send_signal(signal.SIGKILL)
        child.wait()
        torn = not path.read_bytes().endswith(b"\n")
        if torn:
            break
    assert torn, "no kill landed inside a write in 60 tries; the test did not test anything"
    data = path.read_bytes()
    try:  # a kill between a record and its newline (about one torn kill in 4,096: a page boundary) left it whole
        whole = isinstance(json.loads(data[data.rindex(b"\n") + 1:]), dict)
    except ValueError:
        whole = False
    complete = data.count(b"\n") + whole
    sink = JsonlSink(path)  # the restart
    sink.log({"train/loss": 1.0}, 10**6, "train")
    sink.close()
    lines = path.read_text().splitlines()
    assert len(lines) == complete + 1
    assert len(list(dm.read_jsonl(path))) == complete + 1
    if shutil.which("jq"):
        jq = subprocess.run(["jq", "-c", ".step", str(path)], capture_output=True, text=True)
        assert jq.returncode == 0, jq.stderr
        assert jq.stdout.splitlines()[-1] == str(10**6)


def test_a_last_record_without_its_newline_is_kept_by_the_next_job_not_cut_as_torn(tmp_path, caplog):
    """A file whose last line lacks only its newline (copied or edited by another tool): the next
    job cut the whole record off as a torn line, so an end record vanished and summary said the
    job was killed. Truth: the lines read back with json; a torn line is still cut."""
    import distmetrics as dm
    from distmetrics.sinks.jsonl import JsonlSink

    caplog.set_level(logging.WARNING, logger="distmetrics")
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2):
        sink.log({"train/loss": float(step)}, step, "train")
    sink.close()
    path.write_bytes(path.read_bytes()[:-1])  # the newline alone gone
    sink = JsonlSink(path)
    sink.log({"train/loss": 3.0}, 3, "train")
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert [r["step"] for r in dm.read_jsonl(path)] == [1, 2, 3]
    assert "holds records but had no newline" in caplog.text and "torn" not in caplog.text
    path.write_bytes(path.read_bytes()[:-2])  # "}" gone too: torn, cut off
    sink = JsonlSink(path)
    sink.log({"train/loss": 4.0}, 4, "train")
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 4]
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r"))  # a copy saved with \r endings: no \n at all
    sink = JsonlSink(path)  # its whole history was cut off as one torn line
    sink.log({"train/loss": 5.0}, 5, "train")
    sink.close()
    assert [r["step"] for r in dm.read_jsonl(path)] == [1, 2, 4, 5]


def _newline_on_a_full_disk_child(folder: str, result: str) -> None:
    """Two records whose last lacks its newline, on a disk full at the next job's start (no byte
    more may be written: RLIMIT_FSIZE); room comes back after its first record."""
    import resource

    from distmetrics.sinks.jsonl import JsonlSink

    path = Path(folder) / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2):
        sink.log({"train/loss": float(step)}, step, "train")
    sink.close()
    path.write_bytes(path.read_bytes()[:-1])
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size, hard))
    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    sink = JsonlSink(path)
    sink.log({"train/loss": 3.0}, 3, "train")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    sink.log({"train/loss": 4.0}, 4, "train")
    sink.close()
    Path(result).write_text(json.dumps({"warnings": capture.messages, "text": path.read_text()}))


def test_a_last_record_without_its_newline_on_a_full_disk_keeps_the_sink_and_the_record(tmp_path):
    """Where the next job starts on a full disk, adding the newline fails (cutting needed no room):
    the JSONL sink was turned off for the whole job. The newline is written ahead of the first
    record once there is room; the record lost meanwhile is a gap record's. Truth: the file read
    back with json."""
    (tmp_path / "disk").mkdir()  # ulimit -f at the file's size (a tmpfs leaves room in its last page)
    child = run_child("_newline_on_a_full_disk_child", str(tmp_path / "disk"), str(tmp_path / "r.json"))
    assert child.returncode == 0, child.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    records = [json.loads(line) for line in result["text"].splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("gap", 4), ("train", 4)]
    assert records[2]["first_step"] == records[2]["last_step"] == 3
    assert not [w for w in result["warnings"] if "is off" in w or "failed" in w], result["warnings"]


# --- values TensorBoard cannot store ----------------------------------------------------------

def test_tensorboard_skips_a_name_or_step_it_cannot_store_and_goes_on(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from distmetrics.sinks import SinkSet
    from distmetrics.sinks.tensorboard import TensorBoardSink

    caplog.set_level(logging.WARNING, logger="distmetrics")
    sinks = SinkSet([TensorBoardSink(str(tmp_path))])
    for step in (1, 2):
        sinks.log({"train/loss": float(step), "bad\udc80name": 3.0}, step, "train")
    sinks.log({"train/loss": 9.0}, 2**63, "train")  # beyond int64
    sinks.log({"train/loss": 4.0}, 4, "train")
    sinks.close()
    assert sinks.failed == {}
    skipped = [r.getMessage() for r in caplog.records if "tensorboard sink skipped" in r.getMessage()]
    assert len(skipped) == 2 and "bad\\udc80name" in skipped[0] and str(2**63) in skipped[1], skipped
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (4, 4.0)]


def _beyond_float32(rank: int, world: int, root: str) -> list:
    """Two log steps of means over 2 ranks: ``v/big`` (0 and 2e300: 1e300) and ``v/big_negative``
    beyond float32's range, ``v/tiny`` (1e-50) below its smallest, ``v/ok``; the writer's warnings."""
    import distmetrics as dm

    warnings = Capture()
    logging.getLogger("distmetrics").addHandler(warnings)
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, timing_log_level=-1, log_progress=False)
    with dm.Monitor(cfg) as monitor:
        for step in (1, 2):
            monitor.record("v/big", 2e300 * rank)
            monitor.record("v/big_negative", -2e300 * rank)
            monitor.record("v/tiny", 1e-50)
            monitor.record("v/ok", float(step))
            monitor.record("v/float32_max", 3.4028235e38)  # float32's largest, as numpy prints it
            monitor.step(step)
    logging.getLogger("distmetrics").removeHandler(warnings)
    return warnings.messages


def test_a_finite_value_beyond_float32_is_skipped_by_tensorboard_with_one_warning(tmp_path):
    """TensorBoard's scalars are float32: 1e300 was written as inf and -1e300 as -inf without a
    word, while JSONL and W&B had the value. Skipped, with one warning naming it for the run; a
    nonzero value below float32's smallest is written as 0 (float32's rounding, as the README says),
    and 3.4028235e38, which rounds to float32's largest, is written (it was skipped as beyond it)."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    messages = dist_utils.run_ranks(_beyond_float32, 2, str(tmp_path))[0]
    big = (0.0 + 2e300) / 2  # the mean over the two ranks
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["v/big"], r["v/big_negative"], r["v/tiny"]) for r in records] == [(big, -big, 1e-50)] * 2
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "v/big" not in tags and "v/big_negative" not in tags
    assert [(e.step, e.value) for e in acc.Scalars("v/ok")] == [(1, 1.0), (2, 2.0)]
    assert [e.value for e in acc.Scalars("v/tiny")] == [0.0, 0.0]
    assert [e.value for e in acc.Scalars("v/float32_max")] == [float(np.finfo(np.float32).max)] * 2
    skipped = [m for m in messages if "tensorboard sink skipped" in m]
    assert sorted(m.split("skipped ")[1].split(",")[0] for m in skipped) == ["'v/big'", "'v/big_negative'"], skipped
    assert all("beyond float32's range" in m for m in skipped), skipped


def test_an_all_histogram_beyond_the_default_bins_is_skipped_by_tensorboard_with_one_warning(tmp_path, caplog):
    """README: an `all` metric whose every value lies beyond 1e20 (TensorBoard's default bins end there, as
    SummaryWriter's) has no histogram, with one warning naming it; one within them is written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, timing_log_level=-1)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(cfg) as monitor:
        for step in (1, 2):
            monitor.record("u/big", 1e25, "all")
            monitor.record("u/ok", 5.0, "all")
            monitor.step(step, loss=1.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "u/ok" in acc.Tags()["histograms"] and "u/big" not in acc.Tags()["histograms"], acc.Tags()
    said = [r.getMessage() for r in caplog.records if "tensorboard sink skipped 'u/big'" in r.getMessage()]
    assert len(said) == 1 and "The histogram is empty" in said[0], said


@pytest.mark.parametrize("unreadable", ["metrics.jsonl", "progress.txt"])
def test_a_folder_where_a_metrics_file_belongs_turns_that_sink_off_with_a_warning(tmp_path, caplog, unreadable):
    """The writer rank reads metrics.jsonl and progress.txt back at start (a restart's last step,
    its checkpoints); a folder in their place raised a bare IsADirectoryError on the writer rank
    alone, leaving the other ranks waiting. Now: a warning, that sink off, the run goes on."""
    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    (tmp_path / unreadable).mkdir()
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False,
                           flops_per_token=1e9)
    with dm.Monitor(cfg) as monitor:
        for step in (1, 2):
            monitor.step(step, loss=1.0, tokens=10)
        monitor.checkpoint_saved(2)
    sink = "jsonl" if unreadable == "metrics.jsonl" else "progress"
    assert set(monitor.sinks.failed) == {sink} and "EISDIR" in monitor.sinks.failed[sink]
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"cannot read {tmp_path / unreadable} ([Errno 21]" in m for m in messages), messages
    other = tmp_path / ("progress.txt" if sink == "jsonl" else "metrics.jsonl")
    assert "Saved checkpoint" in other.read_text() or '"kind":"progress"' in other.read_text()


def test_an_os_error_names_the_path_and_errno_not_an_install(tmp_path, caplog):
    import distmetrics as dm

    (tmp_path / "file").write_text("not a folder")
    caplog.set_level(logging.WARNING, logger="distmetrics")
    cfg = dm.MetricsConfig(output_dir=str(tmp_path / "out"), console=False, log_interval=1,
                           tensorboard_dir=str(tmp_path / "file" / "tb"))
    with dm.Monitor(cfg) as monitor:
        monitor.step(1, loss=1.0)
    (warning,) = [r.getMessage() for r in caplog.records if "tensorboard sink failed" in r.getMessage()]
    assert "ENOTDIR" in warning and str(tmp_path / "file") in warning and "pip install" not in warning


def test_a_file_system_without_flock_warns_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    # Some NFS and Lustre mounts refuse flock with ENOLCK; that cannot be mounted here, so only the
    # flock call fails, as it does there (the folder stays writable).
    import errno
    import fcntl

    import distmetrics as dm

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False,
                                     log_interval=1)) as monitor:
        monitor.step(1, loss=1.5)
    (warning,) = [r.getMessage() for r in caplog.records if "cannot be locked" in r.getMessage()]
    assert "ENOLCK" in warning and str(tmp_path) in warning
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["run", "train", "end"] and records[1]["train/loss"] == 1.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "progress.txt"]


LOOK_S = 1.2  # longer than the second a file sink waits between looks at its file (appendfile.CHECK_EVERY_S)


def _output_dir_removed(rank: int, world: int, root: str) -> dict:
    """Two ranks log every step; after step 5 the writer's output_dir is removed (``rm -r``) and,
    once the sinks had a second to look, a second Monitor on that path is tried while the first is
    open. Then a second run's folder is renamed mid-run (followed, not made again)."""
    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    out = Path(root) / "run"
    cfg = dm.MetricsConfig(output_dir=str(out), log_interval=1, console=False, timing_log_level=-1,
                           log_throughput=False, log_memory=False, straggler_window=0, flops_per_token=1e6)
    monitor = dm.Monitor(cfg)
    second = None
    for step in range(1, 9):
        if step in (5, 6):  # 5: the sinks look (the file in place); 6: they find it removed
            time.sleep(LOOK_S)
        monitor.step(step, loss=float(step + rank), tokens=10)
        if step == 5 and rank == 0:
            monitor.sinks.flush()  # TensorBoard's event 5 is written before the folder goes
            shutil.rmtree(out)
        if step == 6:
            monitor.sinks.flush()
            try:
                dm.Monitor(cfg).close()
                second = "accepted"
            except ValueError as err:
                second = str(err)
        if step == 7:
            monitor.checkpoint_saved(7)
    monitor.close()
    removed = capture.messages
    capture.messages = []
    moved = Path(root) / "moved"
    with dm.Monitor(cfg.replace(output_dir=str(moved), tensorboard=False)) as other:
        for step in range(1, 5):
            if step == 3:
                if rank == 0:
                    os.rename(moved, Path(root) / "moved.renamed")
                time.sleep(LOOK_S)
            other.step(step, loss=float(step + rank), tokens=10)
    logging.getLogger("distmetrics").removeHandler(capture)
    return {"pid": os.getpid(), "second": second, "removed": removed, "moved": capture.messages}


def test_an_output_dir_removed_mid_run_is_made_again_and_still_refuses_a_second_monitor(tmp_path):
    """``rm -r output_dir`` mid-run: the sinks went on writing into the unlinked files, every later
    record in no file and no word said, and the lock went with the folder, so a second Monitor was
    accepted there. Now each file sink warns once, the folder and files are made again (the run
    record first, then a gap record for what may have gone with the removed file), the lock is taken
    again, and a renamed folder is still followed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    results = dist_utils.run_ranks(_output_dir_removed, 2, str(tmp_path))
    writer, out = results[0], tmp_path / "run"
    for result in results:  # refused on every rank, naming the first Monitor's writer
        assert f"is in use by another Monitor (pid {writer['pid']}" in result["second"], result["second"]
    jsonl = [w for w in writer["removed"] if "jsonl sink's file" in w]
    assert len(jsonl) == 1 and str(out / "metrics.jsonl") in jsonl[0], writer["removed"]
    assert "removed while the run was writing it (found at step 6): up to 1 record (steps 5-5)" in jsonl[0]
    for sink in ("tensorboard", "progress"):
        assert len([w for w in writer["removed"] if f"{sink} sink's file" in w]) == 1, writer["removed"]
    assert not [w for w in writer["removed"] if "cannot write" in w or "failed" in w], writer["removed"]
    records = list(dm.read_jsonl(out / "metrics.jsonl"))
    assert [(r["kind"], r["step"]) for r in records if r["kind"] in ("run", "gap", "train")] == \
        [("run", 0), ("gap", 6), ("train", 6), ("train", 7), ("train", 8)]
    gap = records[1]
    assert (gap["first_step"], gap["last_step"], gap["lost_records"]) == (5, 5, 1)
    assert "removed while the run was writing it" in gap["error"]
    assert [r["train/loss"] for r in records if r["kind"] == "train"] == [6.5, 7.5, 8.5]  # (s + s+1) / 2
    lines = (out / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in lines] == ["Starting job", "Saved checkpoint"], lines
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(6, 6.5), (7, 7.5), (8, 8.5)]
    assert writer["moved"] == []  # renamed: followed without a word, nothing made again
    assert not (tmp_path / "moved").exists()
    moved = [r["step"] for r in dm.read_jsonl(tmp_path / "moved.renamed" / "metrics.jsonl") if r["kind"] == "train"]
    assert moved == [1, 2, 3, 4]


def _wandb_folder_removed_child(folder: str, result: str) -> None:
    """W&B offline in the run folder, removed (``rm -r``) after step 3 of 8."""
    import shutil

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, wandb_project="removed", wandb_mode="offline")
    with dm.Monitor(cfg) as monitor:
        (sink,) = [s for s in monitor.sinks.queued if s.name == "wandb"]
        sink._ready(wait_s=60.0)  # W&B's run exists: the rows before the removal reach it
        for step in range(1, 9):
            if step == 4:
                monitor.sinks.flush()
                shutil.rmtree(folder)
            monitor.step(step, loss=1.0)
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def test_a_wandb_run_folder_removed_mid_run_is_said(tmp_path):
    """JSONL, TensorBoard and progress.txt said the removal and wrote again; W&B, whose checks read
    its log and its disk in the removed folder, said nothing while its rows from then on were lost."""
    pytest.importorskip("wandb")
    child = run_child("_wandb_folder_removed_child", str(tmp_path / "run"), str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    said = [w for w in json.loads((tmp_path / "result.json").read_text())["warnings"] if "wandb sink" in w]
    assert len(said) == 1 and "was removed while the run was writing it; W&B does not make it again" in said[0], said
    assert str(tmp_path / "run" / "wandb") in said[0], said


def test_the_count_of_dropped_records_at_close_names_the_sinks_that_fell_behind(caplog):
    import threading

    from distmetrics.sinks import SinkSet

    class Stuck:
        """A sink stuck until the test lets it go (a network sink waiting on a socket)."""

        name, fix = "tensorboard", "-"
        entered, opened = threading.Event(), threading.Event()

        def log(self, metrics, step, kind):
            self.entered.set()
            self.opened.wait(120)

        def close(self):
            pass

    caplog.set_level(logging.WARNING, logger="distmetrics")
    sinks = SinkSet([Stuck()])
    sinks.log({"x": 0.0}, 0, "train")
    assert Stuck.entered.wait(60)
    for step in range(1, sinks.writer.max_records + 4):
        sinks.log({"x": 1.0}, step, "train")
    Stuck.opened.set()
    sinks.close()
    (count,) = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert "the tensorboard sinks fell behind and 3 records (steps 1-3)" in count


# --- W&B: a full disk, and a server that cannot be reached ------------------------------------

def _wandb_full_disk_child(folder: str, disk: str, out: str, result: str) -> None:
    """W&B offline writing its run on the small disk (the other sinks elsewhere)."""
    import resource

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    if disk == "fsize":  # set before W&B starts its service, which inherits the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cfg = dm.MetricsConfig(output_dir=out, json_log=False, console=False, log_progress=False, tensorboard=False,
                           log_interval=1, timing_log_level=-1, wandb_project="full-disk", wandb_mode="offline",
                           wandb_save_dir=folder)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 401):
            monitor.step(step, loss=2.0, **{f"x{i:02d}": float(i) for i in range(50)})
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def test_wandb_on_a_full_disk_warns_once_with_the_cause(tmp_path):
    pytest.importorskip("wandb")
    with small_disk(tmp_path / "disk", "256k") as disk:
        child = run_child("_wandb_full_disk_child", str(tmp_path / "disk"), disk, str(tmp_path / "out"),
                          str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    warnings = json.loads((tmp_path / "result.json").read_text())["warnings"]
    # one warning with the cause: W&B's call raising, or, where its service met the full disk first (a busy
    # machine), the error W&B logged, read from its log
    reported = [w for w in warnings if "the wandb sink failed" in w or "the wandb sink: W&B reported a failure" in w]
    cause = "no space left on device" if disk == "tmpfs" else "file too large"
    assert len(reported) == 1 and cause in reported[0].lower(), warnings
    assert "pip install" not in reported[0]
    # A W&B client failing on every write may fall behind the steps: the queue then drops its
    # oldest records and says so (once when it starts, the count at close), as designed.
    others = [w for w in warnings if "wandb" in w and w not in reported]
    assert all("sinks are behind" in w or "sinks fell behind" in w for w in others), others


def _wandb_unreachable_child(out: str, result: str, close: str = "1") -> None:
    """W&B online against a port where nothing listens: the Monitor must not wait for it. At exit,
    after the sink's own wait, whether W&B's start thread is still alive is written down. With
    ``close="0"`` the script ends without ``monitor.close()``, the console on: the writer thread
    (started with the console sink, before W&B's) closes the sinks at exit, after W&B's wait."""
    import atexit
    import threading

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)

    def at_exit():  # registered before the W&B sink's module registers its own: runs after it
        alive = [t.name for t in threading.enumerate() if t.name == "distmetrics-wandb-start"]
        Path(result + ".exit").write_text(json.dumps({"alive": alive, "warnings": capture.messages}))

    atexit.register(at_exit)

    import distmetrics as dm
    from distmetrics.sinks import wandb as wandb_sink

    wandb_sink.START_TIMEOUT_S = 3.0  # instead of 45 s, to keep the test short
    cfg = dm.MetricsConfig(output_dir=out, console=close == "0", tensorboard=False, log_interval=1,
                           timing_log_level=-1, wandb_project="unreachable", wandb_mode="online")
    monitor = dm.Monitor(cfg)
    (sink,) = [s for s in monitor.sinks.queued if s.name == "wandb"]
    starting = sink.run is None  # the constructor returned while wandb.init still waits
    for step in range(1, 21):
        monitor.step(step, loss=1.0)
    if close == "1":
        monitor.close()
    records = [r for r in dm.read_jsonl(Path(out) / "metrics.jsonl") if r["kind"] == "train"]
    Path(result).write_text(json.dumps({"starting": starting, "warnings": capture.messages,
                                        "train_records": len(records)}))


def test_wandb_with_no_server_does_not_hold_up_the_monitor_and_warns_once(tmp_path, monkeypatch):
    """Two children, run side by side (each mostly waits on W&B's retries): one closes its
    Monitor, one exits without ``close()``."""
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")  # a well-formed fake
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with ThreadPoolExecutor(2) as pool:
        children = {close: pool.submit(run_child, "_wandb_unreachable_child", str(tmp_path / close / "out"),
                                       str(tmp_path / close / "result.json"), close) for close in ("1", "0")}
    for close, child in children.items():
        child = child.result()
        assert child.returncode == 0, child.stderr
        result = json.loads((tmp_path / close / "result.json").read_text())
        at_exit = json.loads((tmp_path / close / "result.json.exit").read_text())
        assert result["starting"] and result["train_records"] == 20
        reported = [w for w in at_exit["warnings"] if "the wandb sink failed" in w]
        # closed: the sink gave up at its deadline; at exit, the wait came first and W&B's own timeout
        # may have ended wandb.init by then (its error is the one said)
        causes = ("wandb.init did not finish within 3 s",) + (("wandb.init failed",) if close == "0" else ())
        assert len(reported) == 1 and any(c in reported[0] for c in causes), (close, at_exit["warnings"])
        assert "20 rows logged meanwhile not sent" in reported[0]
        # wandb.init was still running when the sink gave up: the exit waited for it (a thread left inside
        # it could abort the exit: SIGABRT, status 134, seen 2 times in 80 runs). Whether it is still running
        # at the sink's deadline, and so said, depends on W&B's own retries: the warning is checked where
        # wandb.init never returns (below)
        assert at_exit["alive"] == [], (close, at_exit)


def _wandb_init_never_returns_child(out: str, result: str) -> None:
    """wandb.init replaced by a call that never returns (a W&B that hangs): the exit waits the
    sink's deadline and EXIT_WAIT_S (1 s each here), says so, and exits."""
    import atexit
    import threading

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    atexit.register(lambda: Path(result).write_text(json.dumps({  # before the sink's module: runs after it
        "alive": [t.name for t in threading.enumerate() if t.name == "distmetrics-wandb-start"],
        "warnings": capture.messages})))

    import wandb

    import distmetrics as dm
    from distmetrics.sinks import wandb as wandb_sink

    wandb_sink.START_TIMEOUT_S = wandb_sink.EXIT_WAIT_S = 1.0
    wandb.init = lambda **kwargs: threading.Event().wait()
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=out, console=False, tensorboard=False, log_interval=1,
                                          timing_log_level=-1, wandb_project="hangs", wandb_mode="offline"))
    for step in range(1, 4):
        monitor.step(step, loss=1.0)
    monitor.close()


def test_a_wandb_init_that_never_returns_is_waited_for_at_exit_for_a_bounded_time(tmp_path):
    pytest.importorskip("wandb")
    child = run_child("_wandb_init_never_returns_child", str(tmp_path / "out"), str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    warnings = result["warnings"]
    assert result["alive"] == ["distmetrics-wandb-start"]  # still inside the never-ending call
    assert any("wandb.init did not finish within 1 s; 3 rows logged meanwhile not sent" in w for w in warnings)
    assert any("waiting up to 1 s for wandb.init, still running after the wandb sink's 1 s" in w for w in warnings)
    assert any("wandb.init is still running after 1 s more; exiting anyway" in w for w in warnings), warnings


def _wandb_argv_child(out: str, result: str, *command_line: str) -> None:
    """W&B offline started while the training thread reads and changes sys.argv (as a parser run
    after Monitor() would); wandb.init is held until the training thread has looked."""
    import threading

    import wandb

    import distmetrics as dm

    real_init, entered, release = wandb.init, threading.Event(), threading.Event()

    def held_init(**kwargs):
        entered.set()
        release.wait(60)
        return real_init(**kwargs)

    wandb.init = held_init
    before = list(sys.argv)
    cfg = dm.MetricsConfig(output_dir=out, console=False, tensorboard=False, log_interval=1, timing_log_level=-1,
                           wandb_project="argv", wandb_mode="offline")
    monitor = dm.Monitor(cfg)
    assert entered.wait(60)
    during = list(sys.argv)
    sys.argv = sys.argv + ["--lr", "0.1"]  # the training thread's own change, while W&B starts
    release.set()
    monitor.step(1, loss=1.0)
    monitor.close()
    Path(result).write_text(json.dumps({"before": before, "during": during, "after": sys.argv}))


def test_wandb_start_leaves_sys_argv_alone_and_no_secret_reaches_its_files(tmp_path):
    pytest.importorskip("wandb")
    from tests.wandb_reader import read_offline_run

    secret = "hf_SECRET4242"
    out = tmp_path / "out"
    child = run_child("_wandb_argv_child", str(out), str(tmp_path / "result.json"), "--hf-token", secret,
                      "--seq-length", "128")
    assert child.returncode == 0, child.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["during"] == result["before"] and result["before"][-4:] == ["--hf-token", secret, "--seq-length",
                                                                             "128"]
    assert result["after"] == result["before"] + ["--lr", "0.1"]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    assert read_offline_run(str(out))["config"]["argv"][-4:] == ["--hf-token", "***", "--seq-length", "128"]


def _restart_on_full_disk_child(folder: str, result: str) -> None:
    """Job A logs steps 1-10; job B restarts from step 5's checkpoint on a disk where no file can
    grow (RLIMIT_FSIZE 0: every append fails with EFBIG) until its step 8 is written."""
    import resource

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, timing_log_level=-1,
                           log_throughput=False, log_memory=False, straggler_window=0)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 11):
            monitor.step(step, loss=1.0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    with dm.Monitor(cfg) as monitor:
        for step in range(6, 16):
            monitor.step(step, loss=2.0)
            if step == 8:
                monitor.sinks.flush()  # TensorBoard tried its steps 6-8 on the full disk
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def test_a_restart_on_a_full_disk_keeps_its_job_header_and_tensorboards_purge_until_written(tmp_path):
    """The purge order, the run and resume records and progress.txt's "Starting job" line of a job
    that starts on a full disk were each written once and lost: TensorBoard showed both jobs'
    values at steps 9 and 10, and summary read the two jobs as one (steps 9 and 10 twice, no
    restart), then missed the restart. Each now goes ahead of the first record written once room
    returns; steps 6-8 are lost and marked."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    child = run_child("_restart_on_full_disk_child", str(tmp_path / "run"), str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(s, 1.0) for s in range(1, 6)] + [(s, 2.0) for s in range(9, 16)]
    records = list(dm.read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    job_b = records[[i for i, r in enumerate(records) if r["kind"] == "run"][1]:]
    gap = next(r for r in job_b if r["kind"] == "gap")
    assert (gap["first_step"], gap["last_step"], gap["lost_records"]) == (6, 8, 3)  # 3 train records
    assert [r["step"] for r in job_b if r["kind"] == "train"] == list(range(9, 16))
    [resume] = [r for r in job_b if r["kind"] == "resume"]  # held with the run record: it was lost too
    assert resume["from_step"] == 6 and resume["last_logged_step"] == 10
    summary = run_python_summary(tmp_path / "run")
    assert "2 job(s)" in summary and "job 2:" in summary and "resumed at step 6 (step 10" in summary, summary
    starts = [line for line in (tmp_path / "run" / "progress.txt").read_text().splitlines() if "Starting job" in line]
    assert len(starts) == 2
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(_warnings(result, "jsonl", "cannot write")) == 1


def test_a_resumed_jobs_event_file_removed_is_made_again_with_its_drop_of_the_earlier_steps(tmp_path, monkeypatch):
    """Job B resumes at step 6 of job A's 10 (TensorBoard drops A's events from 6 on), and B's event file is
    removed at step 8: the file made again began with the file's first event alone, so A's steps 6-10 showed
    again, beside B's at 9 and 10. The drop is written again with it; B's steps 6-8 went with the file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm
    from distmetrics.sinks import appendfile

    monkeypatch.setattr(appendfile, "CHECK_EVERY_S", 0.0)  # each write looks whether its file is in place
    out, board = tmp_path / "run", tmp_path / "run" / "tensorboard"
    cfg = dm.MetricsConfig(output_dir=str(out), log_interval=1, console=False, timing_log_level=-1,
                           log_throughput=False, log_memory=False, straggler_window=0, log_progress=False)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 11):
            monitor.step(step, loss=1.0)
    with dm.Monitor(cfg) as monitor:
        for step in range(6, 13):
            monitor.step(step, loss=2.0)
            if step == 8:
                monitor.sinks.flush()
                os.remove(board / sorted(os.listdir(board))[-1])  # job B's own file
    acc = EventAccumulator(str(board))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(s, 1.0) for s in range(1, 6)] + [(s, 2.0) for s in range(9, 13)]


def _killed_after_resuming_child(folder: str, job: str) -> None:
    """Job "a" logs steps 1-10; job "b" resumes at 6 and is killed as its first monitor.step returns."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, timing_log_level=-1,
                           log_throughput=False, log_memory=False, straggler_window=0, log_progress=False)
    monitor = dm.Monitor(cfg)
    for step in range(1, 11) if job == "a" else (6,):
        monitor.step(step, loss=1.0)
    if job == "b":
        os.kill(os.getpid(), signal.SIGKILL)
    monitor.close()


def test_a_resumed_job_killed_at_its_first_step_has_written_its_drop_of_the_earlier_steps(tmp_path):
    """Killed as its first monitor.step returned, a resumed job had its train record in metrics.jsonl and
    nothing in TensorBoard (the drop was queued for the writer thread): the next job, from a later
    checkpoint, read the last step logged as that record's and dropped nothing, and TensorBoard showed two
    jobs' values at each step. The drop is on disk before that monitor.step returns."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    assert run_child("_killed_after_resuming_child", str(tmp_path), "a").returncode == 0
    assert run_child("_killed_after_resuming_child", str(tmp_path), "b").returncode == -signal.SIGKILL
    board = tmp_path / "tensorboard"
    files = sorted(os.listdir(board))
    drops = [event.step for event in EventFileLoader(str(board / files[-1])).Load() if event.HasField("session_log")]
    assert len(files) == 2 and drops == [6], (files, drops)


@pytest.mark.parametrize("slow", ["run", "resume"])
def test_a_resumed_job_whose_writer_thread_is_slow_says_its_drop_is_not_written_yet(tmp_path, caplog, slow):
    """A sink on the writer thread slower than a second (a slow W&B or network disk) ahead of TensorBoard's drop:
    the first monitor.step waited a second and went on, the drop not on disk, without a word. Slow on the
    resume record, after the drop, it is not waited for (the drop is on disk: nothing to say)."""
    import distmetrics as dm

    class Slow:
        name, fix = "slow", "none"

        def log(self, metrics, step, kind):
            if kind == slow:
                time.sleep(1.5)

        def close(self):
            pass

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, timing_log_level=-1,
                           log_throughput=False, log_memory=False, straggler_window=0, log_progress=False)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 11):
            monitor.step(step, loss=1.0)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(cfg, sinks=[Slow()]) as monitor:
        monitor.step(6, loss=2.0)
    said = [r.getMessage() for r in caplog.records if "has not written TensorBoard's drop" in r.getMessage()]
    assert len(said) == (slow == "run") and all("from step 6 within a second" in line for line in said), said


def run_python_summary(folder: Path) -> str:
    return dist_utils.run_python("-m", "distmetrics.cli", "summary", folder).stdout


def _full_until_close_child(folder: str, recover: str, result: str) -> None:
    """A job on a disk where no file can grow from its start; room returns just before close() or
    never."""
    import resource

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, log_throughput=False, log_memory=False, straggler_window=0)
    monitor = dm.Monitor(cfg)
    for step in range(1, 5):
        monitor.step(step, loss=1.0)
    if recover == "1":
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    monitor.close()
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the test's own result file
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def _long_outage_child(folder: str, evals: str, result: str) -> None:
    """A full disk (a file size limit at the file's size) through ``evals`` log steps with an evaluation
    each (records kept while they cannot be written), then room again for 3 more steps and close()."""
    import resource

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, log_throughput=False, log_memory=False, straggler_window=0)
    monitor = dm.Monitor(cfg)
    monitor.step(1, loss=1.0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(Path(folder) / "metrics.jsonl"), hard))
    last = 1 + int(evals)
    for step in range(2, last + 1):
        monitor.step(step, loss=1.0)
        monitor.log_eval(step, loss=2.0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    for step in range(last + 1, last + 4):
        monitor.step(step, loss=1.0)
    monitor.close()
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def test_the_records_kept_through_a_long_outage_are_written_when_room_returns(tmp_path):
    """Each evaluation record kept while the disk was full went ahead of the next record in the same
    system call, three buffers each: past 341 of them that call took more than Linux's 1,024 (IOV_MAX),
    failed with EINVAL every time, and the file was never written again (no gap record, no end record:
    read as killed). Now they are joined into one buffer there."""
    evals = 400
    child = run_child("_long_outage_child", str(tmp_path / "run"), str(evals), str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    last = 1 + evals
    assert kinds[:2] == ["run", "train"] and kinds[-5:] == ["gap", "train", "train", "train", "end"], kinds[-8:]
    assert [r["step"] for r in records if r["kind"] == "eval"] == list(range(2, last + 1))  # every one kept
    gap = records[-5]
    assert (gap["first_step"], gap["last_step"], gap["lost_records"]) == (2, last, evals), gap
    assert [r["step"] for r in records[-4:-1]] == [last + 1, last + 2, last + 3]
    warnings = json.loads((tmp_path / "result.json").read_text())["warnings"]
    assert not [w for w in warnings if "EINVAL" in w or "not written" in w], warnings


def _nearly_full_child(folder: str, result: str) -> None:
    """A disk so nearly full that each train record (50 values) fails while the evaluation record after
    it fits, at six log steps in a row; then full for four steps (no evaluation), room again for one
    more step, and close()."""
    import resource

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    path = Path(folder) / "metrics.jsonl"
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, log_throughput=False, log_memory=False, straggler_window=0)
    monitor = dm.Monitor(cfg)
    scalars = {f"x{i:02d}": float(i) for i in range(50)}
    monitor.step(1, loss=1.0, **scalars)
    for step in range(2, 8):
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 400, hard))  # an eval and a gap fit
        monitor.step(step, loss=1.0, **scalars)
        monitor.log_eval(step, loss=2.0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))
    for step in range(8, 12):
        monitor.step(step, loss=1.0, **scalars)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    monitor.step(12, loss=1.0, **scalars)
    monitor.close()
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def test_a_disk_failing_and_working_again_at_every_step_is_said_once_and_counted_at_close(tmp_path):
    """Each train record failed and the evaluation after it was written: two warnings at every log step
    ("cannot write", "writes again"). An outage beginning within FLAPPING_S of the last one's end is now
    marked by its gap record only while it loses at most FLAPPING_RECORDS records, and counted in the next
    warning; the outage of steps 8-11 after them is said at its third lost record, as any outage."""
    child = run_child("_nearly_full_child", str(tmp_path / "run"), str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gaps = [(r["first_step"], r["last_step"], r["lost_records"]) for r in records if r["kind"] == "gap"]
    assert gaps == [(step, step, 1) for step in range(2, 8)] + [(8, 11, 4)], gaps
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 12]
    warnings = [w for w in json.loads((tmp_path / "result.json").read_text())["warnings"] if "jsonl sink" in w]
    assert len(warnings) == 4, warnings
    assert "cannot write" in warnings[0] and "at step 2:" in warnings[0], warnings
    assert "writes " in warnings[1] and "again from step 2; 1 record (steps 2-2)" in warnings[1], warnings
    assert "cannot write" in warnings[2] and "at step 8:" in warnings[2], warnings
    assert warnings[2].endswith(
        "; besides, 5 more outages began within 600 s of the one before (the disk nearly full) and lost 5 records, "
        "each marked by a \"gap\" record, not said each time."), warnings
    assert "again from step 12; 4 records (steps 8-11)" in warnings[3], warnings


def _removed_at_the_end_child(folder: str) -> None:
    """The run folder removed (``rm -r``) after step 11's record, then step 12 and close(), with no look at
    the file between (as within the second between two looks)."""
    import shutil

    import distmetrics as dm
    from distmetrics.sinks import appendfile

    appendfile.CHECK_EVERY_S = 3600.0  # no look at the file but close()'s (and, now, the end record's)

    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, log_throughput=False, log_memory=False, straggler_window=0)
    monitor = dm.Monitor(cfg)
    for step in range(1, 12):
        monitor.step(step, loss=1.0)
    shutil.rmtree(folder)
    monitor.step(12, loss=1.0)
    monitor.close()


def test_a_run_folder_removed_in_the_last_second_keeps_the_end_record(tmp_path):
    """The end record was written into the removed file just before close() looked for a removal, then made
    the file again with the run and gap records only: a job that closed its Monitor read as killed."""
    child = run_child("_removed_at_the_end_child", str(tmp_path / "run"))
    assert child.returncode == 0, child.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["run", "gap", "end"], records
    assert (records[1]["first_step"], records[1]["last_step"], records[1]["lost_records"]) == (1, 12, 12), records
    assert records[-1]["how"] == "closed its Monitor" and records[-1]["step"] == 12, records
    out = subprocess.run([sys.executable, "-m", "distmetrics.cli", "summary", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "ended at step 12: closed its Monitor" in out.stdout, out.stdout


@pytest.mark.parametrize("recover", [True, False], ids=["room at close", "never"])
def test_records_lost_until_close_are_counted_and_marked_once_there_is_room(tmp_path, recover):
    """The run record held since the job's start was written alone at close, after a warning that
    a gap record marked the lost records (none did), and was counted among them with its own step
    (3 records, steps 10-5 for 2). Now close() writes the run record and the gap record where
    there is room; the warning counts the 4 train records, steps 1-4."""
    child = run_child("_full_until_close_child", str(tmp_path / "run"), "1" if recover else "0",
                      str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    warnings = json.loads((tmp_path / "result.json").read_text())["warnings"]
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    if recover:
        records = [json.loads(line) for line in text.splitlines()]
        assert [r["kind"] for r in records] == ["run", "gap", "end"]  # the end record last, after the gap
        assert (records[1]["first_step"], records[1]["last_step"], records[1]["lost_records"]) == (1, 4, 4)
        said = [w for w in warnings if "records (steps" in w]  # not "writes ... again from step": it is closing
        assert len(said) == 1 and "the jsonl sink closes " in said[0] and said[0].endswith(
            "; 4 records (steps 1-4) could not be written; a \"gap\" record marks them."), said
        out = subprocess.run([sys.executable, "-m", "distmetrics.cli", "summary", str(tmp_path / "run")],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert (f"lost 4 record(s), steps 1-4: {records[1]['error']} (marked at the end of the job: no record "
                "written after it)") in out.stdout, out.stdout  # not "written again from step 4"
    else:
        assert text == ""
        said = [w for w in warnings if "closed" in w and "not written" in w]
        assert len(said) == 1 and "with 4 records (steps 1-4) not written" in said[0], warnings


class _Refusing:
    """Your own sink posting to a URL that starts refusing at ``from_step`` (and at close)."""

    name = "http"
    fix = "check the URL"

    def __init__(self, url: str, from_step: int) -> None:
        self.url, self.from_step, self.steps = url, from_step, []

    def log(self, metrics, step, kind):
        if step >= self.from_step:
            raise ConnectionError(f"{self.url} refused")
        self.steps.append(step)

    def close(self):
        raise ConnectionError(f"{self.url} refused at close")


def test_two_failing_sinks_of_one_name_are_each_said_once(tmp_path, caplog):
    """Two of your sinks named "http": the second's failure was not said (failures were once per
    name) though it was dropped, so its records stopped without a word."""
    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    a, b = _Refusing("http://a", 3), _Refusing("http://b", 6)
    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, tensorboard=False),
                    sinks=[a, b]) as monitor:
        for step in range(1, 9):
            monitor.step(step, loss=1.0)
    assert a.steps == [0, 1, 2] and b.steps == [0, 1, 2, 3, 4, 5]  # the run record at step 0
    assert monitor.sinks.failed == {"http": "ConnectionError: http://a refused",
                                    "http #2": "ConnectionError: http://b refused"}
    said = [r.getMessage() for r in caplog.records if "sink failed" in r.getMessage()]
    assert len(said) == 2 and "the http sink failed (ConnectionError: http://a refused)" in said[0], said
    assert "the http #2 sink failed (ConnectionError: http://b refused)" in said[1], said


class _SlowSink:
    """A sink on the writer thread that takes 20 ms a record: the queue is still full at exit."""

    name = "slow"

    def log(self, metrics, step, kind):
        time.sleep(0.02)

    def close(self):
        pass


def _wandb_never_closed_child(out: str, result: str) -> None:
    """W&B offline, log_interval 1, a script that never calls close() and ends with records queued
    (behind a slow sink); the exit hooks' order, as registered, is written to ``result``."""
    import atexit

    os.environ.pop("WANDB_SERVICE", None)  # a service of the test process's own W&B runs: this child starts its own
    registered = []
    real_register, real_unregister = atexit.register, atexit.unregister

    def register(func, *args, **kwargs):
        registered.append(func)
        return real_register(func, *args, **kwargs)

    def unregister(func):
        registered[:] = [f for f in registered if f != func]
        return real_unregister(func)

    atexit.register, atexit.unregister = register, unregister
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=out, console=False, tensorboard=False, log_interval=1, timing_log_level=-1,
                           wandb_project="never-closed", wandb_mode="offline")
    monitor = dm.Monitor(cfg, sinks=[_SlowSink()])
    for step in range(1, 6):
        monitor.step(step, loss=float(step))
    wandb_sink = next(sink for sink in monitor.sinks.queued if sink.name == "wandb")
    until = time.monotonic() + 120
    while wandb_sink.starting and time.monotonic() < until:  # wandb.init has returned
        time.sleep(0.05)
    Path(result).write_text(json.dumps([getattr(f, "__qualname__", repr(f)) for f in registered]))
    for step in range(6, 66):
        monitor.step(step, loss=float(step))


def test_a_script_that_never_closes_gets_its_wandb_rows_at_exit(tmp_path):
    """wandb.init registers the shutdown of W&B's service at exit after the writer thread's exit
    hook, and exit hooks run last registered first: W&B could be gone before the queue was written
    through it (0 of 300 rows in 6 of 6 runs of a script ending while wandb.init ran), with a warning
    that blamed the network."""
    pytest.importorskip("wandb")
    from tests.wandb_reader import read_offline_run

    child = run_child("_wandb_never_closed_child", str(tmp_path / "out"), str(tmp_path / "hooks.json"))
    assert child.returncode == 0, child.stderr
    assert "wandb sink failed" not in child.stderr, child.stderr
    hooks = json.loads((tmp_path / "hooks.json").read_text())
    teardown = max(i for i, name in enumerate(hooks) if "teardown_atexit" in name)
    writer = max(i for i, name in enumerate(hooks) if name == "WriterThread.close")
    assert writer > teardown, hooks
    # the Monitor's own (saying what is not written, leaving the arrival check) still runs before the writer's
    assert max(i for i, name in enumerate(hooks) if "open_at_exit" in name) > writer, hooks
    steps = [row["step"] for row in read_offline_run(str(tmp_path / "out"))["history"]]
    assert steps == list(range(1, 66)), steps


def _events_on_full_disk_child(folder: str, recover: str, result: str) -> None:
    """Steps 1-3 written; no file can grow (RLIMIT_FSIZE 0) from step 4, where the loss is NaN (an
    alert, once per event) and an evaluation is logged; room again from step 6 (``recover`` "1") or
    never."""
    import resource

    import distmetrics as dm

    capture = Capture()
    logging.getLogger("distmetrics").addHandler(capture)
    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, timing_log_level=-1, tensorboard=False,
                           log_throughput=False, log_memory=False, straggler_window=0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 9):
            if step == 4:
                resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
            if step == 6 and recover == "1":
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
            monitor.step(step, loss=float("nan") if step in (4, 5) else 1.0)
            if step == 4:
                monitor.log_eval(step, loss=3.0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the result file
    Path(result).write_text(json.dumps({"warnings": capture.messages}))


def test_an_alert_or_eval_record_the_full_disk_refused_is_written_once_room_returns(tmp_path):
    """An alert is said once per event: the non-finite loss of steps 4-5, refused by the full disk,
    was never written (every later record carried the count, no alert), nor the evaluation of
    step 4. Such records are now kept and written ahead of the first record written again; the
    gap counts the train records alone."""
    import distmetrics as dm

    child = run_child("_events_on_full_disk_child", str(tmp_path / "run"), "1", str(tmp_path / "result.json"))
    assert child.returncode == 0, child.stderr
    records = list(dm.read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    kinds = [(r["kind"], r["step"]) for r in records if r["kind"] != "run"]
    assert ("alert", 4) in kinds and ("eval", 4) in kinds, kinds
    [gap] = [r for r in records if r["kind"] == "gap"]
    assert (gap["first_step"], gap["last_step"], gap["lost_records"]) == (4, 5, 2)  # train records 4 and 5
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 6, 7, 8]
    assert [k for k in kinds if k[0] == "alert"] == [("alert", 4)]  # the event's one alert, not again at 6
    warnings = json.loads((tmp_path / "result.json").read_text())["warnings"]
    assert len(_warnings({"warnings": warnings}, "jsonl", "cannot write")) == 1
    # room never returns: the kept records are counted with the lost ones at close
    child = run_child("_events_on_full_disk_child", str(tmp_path / "never"), "0", str(tmp_path / "never.json"))
    assert child.returncode == 0, child.stderr
    assert [r["kind"] for r in dm.read_jsonl(tmp_path / "never" / "metrics.jsonl")] == ["run"] + ["train"] * 3
    warnings = json.loads((tmp_path / "never.json").read_text())["warnings"]
    closed = _warnings({"warnings": warnings}, "jsonl", "closed")
    assert len(closed) == 1 and "7 records (steps 4-8) not written" in closed[0], warnings  # 5 train, alert, eval


def test_a_wandb_start_failure_counts_the_rows_logged_while_it_started(tmp_path, caplog, monkeypatch):
    """The row that found wandb.init failed was counted as logged meanwhile (4 for the 3 before it). W&B's
    start is stood in for by a wandb.init that raises after a while."""
    wandb = pytest.importorskip("wandb")
    import threading

    import distmetrics as dm

    started = threading.Event()

    def failing_init(**kwargs):
        started.wait(60)
        raise RuntimeError("no server")

    monkeypatch.setattr(wandb, "init", failing_init)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False, log_interval=1,
                                          timing_log_level=-1, wandb_project="p", wandb_mode="offline"))
    for step in range(1, 4):
        monitor.step(step, loss=1.0)
    monitor.sinks.writer.flush()
    started.set()
    (sink,) = [s for s in monitor.sinks.queued if s.name == "wandb"]
    while sink.starting:
        time.sleep(0.01)
    monitor.step(4, loss=1.0)
    monitor.close()
    failed = [r.getMessage() for r in caplog.records if "the wandb sink failed" in r.getMessage()]
    assert len(failed) == 1 and "no server; 3 rows logged meanwhile not sent" in failed[0], failed
    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]


def _wandb_job_ending_child(folder: str, how: str) -> None:
    """Three steps logged to W&B, offline by W&B's own switch (WANDB_MODE, no wandb_mode), then the job
    ends: leaving a ``with`` block on ``sys.exit(3)``, or on an uncaught error (closed: 0, as before)."""
    import os

    os.environ["WANDB_MODE"] = "offline"
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=folder, log_interval=1, console=False, tensorboard=False, timing_log_level=-1,
                           straggler_window=0, wandb_project="ending")
    monitor = dm.Monitor(cfg)
    if how == "sys.exit":
        with monitor:
            for step in (1, 2, 3):
                monitor.step(step, loss=1.0)
            sys.exit(3)
    for step in (1, 2, 3):
        monitor.step(step, loss=1.0)
    if how == "uncaught":
        raise KeyError("the data loader died")
    monitor.close()


def test_wandb_takes_wandb_mode_from_the_environment_and_the_way_the_job_ended(tmp_path, monkeypatch):
    """WANDB_MODE=offline was overruled by wandb_mode's default (online): no run at all without an API
    key (with one, rows uploaded from a cluster told to stay offline); WANDB_MODE=disabled made a run
    too. And the run was finished with exit code 0 however the job ended: W&B showed a crashed job
    as finished (its own exit hook, which knows the code, came after the sink had finished it)."""
    pytest.importorskip("wandb")
    import distmetrics as dm
    from tests.wandb_reader import read_offline_run

    for how, code in (("sys.exit", 3), ("uncaught", 1)):
        child = run_child("_wandb_job_ending_child", str(tmp_path / how), how)
        assert child.returncode == code, child.stderr
        assert "wandb sink failed" not in child.stderr, child.stderr
        run = read_offline_run(str(tmp_path / how))
        assert [row["step"] for row in run["history"]] == [1, 2, 3] and run["exit_code"] == code, (how, run)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path / "disabled"), console=False, tensorboard=False,
                                     wandb_project="off")) as monitor:
        assert "wandb" not in [sink.name for sink in monitor.sinks.sinks]


class _Heard:
    """A sink noting, with the thread of each, the records it takes, ``ended`` and ``close``."""

    name, fix = "heard", "nothing"

    def __init__(self, inline=False, broken=False, path=None):
        self.on_training_thread, self.broken, self.path, self.calls = inline, broken, path, []

    def log(self, metrics, step, kind):
        self.calls.append((kind, step, threading.current_thread().name))

    def ended(self, exit_code):
        self.calls.append(("ended", exit_code, threading.current_thread().name))
        if self.broken:
            raise self.broken

    def close(self):
        self.calls.append(("close",))
        if self.path:
            Path(self.path).write_text(json.dumps(self.calls))


def _closed_in_an_exit_hook_child(path: str) -> None:
    """``atexit.register(monitor.close)`` after the Monitor, and an uncaught error."""
    import atexit

    import distmetrics as dm

    monitor = dm.Monitor(dm.MetricsConfig(output_dir=str(Path(path).parent / "out"), console=False, tensorboard=False,
                                          timing_log_level=-1), sinks=[_Heard(path=path)])
    atexit.register(monitor.close)
    monitor.step(1, loss=1.0)
    raise KeyError("the data loader died")


def test_a_sink_of_ones_own_hears_how_the_job_ended_after_its_records_and_before_it_closes(tmp_path, caplog):
    """``ended(exit_code)``: 0 closed, 1 leaving a ``with`` block on an error, ``sys.exit``'s code as the
    process gets it (256 is 0, -1 is 255); on the writer thread after the records queued before it
    (it came from the closing thread while the writer still wrote them); a sink whose ``ended``
    raises, a KeyboardInterrupt too, is said and closed all the same (the interrupt left every sink
    open); a close() in an exit hook after an uncaught error tells 1, not 0."""
    import distmetrics as dm

    cases = [("closed", None, 0), ("error", ValueError("x"), 1), ("exit", SystemExit(4), 4),
             ("wraps", SystemExit(256), 0), ("negative", SystemExit(-1), 255), ("message", SystemExit("m"), 1)]
    for how, error, code in cases:
        sinks = [_Heard(), _Heard(inline=True), _Heard(broken=RuntimeError("no"))]
        caplog.clear()
        try:
            with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path / how), console=False, tensorboard=False,
                                             timing_log_level=-1, log_interval=1), sinks=sinks) as monitor:
                for step in (1, 2, 3):
                    monitor.step(step, loss=1.0)
                if error is not None:
                    raise error
        except (ValueError, SystemExit):
            pass
        queued, inline, broken = (sink.calls for sink in sinks)
        assert queued[-2:] == [("ended", code, "distmetrics-writer"), ("close",)], (how, queued)
        assert [c[:2] for c in queued if c[0] == "train"] == [("train", 1), ("train", 2), ("train", 3)], queued
        assert inline[-2:] == [("ended", code, "MainThread"), ("close",)], (how, inline)
        assert broken[-1] == ("close",), broken
        said = [r.getMessage() for r in caplog.records if "sink's ended" in r.getMessage()]
        assert len(said) == 1 and f"ended({code}) raised RuntimeError: no" in said[0], said
    sinks = [_Heard(inline=True, broken=KeyboardInterrupt()), _Heard()]
    with pytest.raises(KeyboardInterrupt):
        with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path / "interrupt"), console=False, tensorboard=False,
                                         timing_log_level=-1), sinks=sinks) as monitor:
            monitor.step(1, loss=1.0)
    assert [sink.calls[-1] for sink in sinks] == [("close",), ("close",)], [sink.calls for sink in sinks]
    child = run_child("_closed_in_an_exit_hook_child", str(tmp_path / "calls.json"))
    assert child.returncode == 1 and "KeyError" in child.stderr, child.stderr
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert [c for c in calls if c[0] == "ended"] == [["ended", 1, "distmetrics-writer"]], calls


def test_a_wandb_run_made_before_the_monitor_is_said_and_a_disabled_run_reports_no_failure(tmp_path, caplog,
                                                                                           monkeypatch):
    """A job whose own wandb.init (or a Trainer's W&B callback) came first got a second run, unsaid.
    And a run W&B's settings made disabled (a NoopRun, no folder) was reported as a failure at close
    ('its run folder ... was removed'). W&B's run of the user's stands in as ``wandb.run``."""
    wandb = pytest.importorskip("wandb")
    from distmetrics.sinks.wandb import WandbSink

    monkeypatch.setattr(wandb, "run", types.SimpleNamespace(name="theirs"))
    sink = WandbSink("p", None, None, str(tmp_path), "disabled", {})
    sink.close()
    said = [r.getMessage() for r in caplog.records if r.name == "distmetrics"]
    assert len(said) == 1 and "W&B has a run in this process already ('theirs'" in said[0], said
