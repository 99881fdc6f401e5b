"""The command line, a sink whose package is missing, CPU-staged update-norm snapshots, and the
barrier_with_L1_time switch."""

import contextlib
import logging
import math
import os
import sys

import pytest

from tests.dist_utils import ROOT, run_python


def _run(*args):
    return run_python("-m", "distmetrics.cli", *args)


def test_check_config_accepts_the_shipped_file_and_names_bad_keys(tmp_path):
    ok = _run("check-config", "configs/metrics.yaml", "log_interval=5")
    assert ok.returncode == 0 and "log_interval=5" in ok.stdout
    bad = _run("check-config", "configs/metrics.yaml", "log_intervall=5")
    assert bad.returncode == 2 and "did you mean 'log_interval'" in bad.stderr


def test_check_features_validates_the_shipped_cpu_file():
    ok = _run("check-features", "configs/tensor_stats_cpu.yaml")
    assert ok.returncode == 0 and "mlp_activations" in ok.stdout


def test_check_features_runs_nvdlfw_validation_with_the_given_folders(tmp_path):
    """The shipped TE file: refused without TE or a folder (naming the option that gives one); accepted with a folder that
    registers the namespace (the CPU stand-in for TE's features, tests/te_cpu_features); a TE
    feature that folder does not register is refused by nvdlfw-inspect's own check, as a
    clear error and exit status 2."""
    folder = str(ROOT / "tests" / "te_cpu_features")
    bare = _run("check-features", "configs/fp8_tensor_stats.yaml")
    assert bare.returncode == 2 and "needs TransformerEngine" in bare.stderr
    assert "given with --feature-dir" in bare.stderr  # the command's option, not the config key
    ok = _run("check-features", "configs/fp8_tensor_stats.yaml", "--feature-dir", folder)
    assert ok.returncode == 0 and "fp8_linear_stats" in ok.stdout, ok.stderr
    unknown = tmp_path / "nvfp4.yaml"
    unknown.write_text("s:\n  enabled: true\n  layers: {layer_name_regex_pattern: fc1}\n  transformer_engine:\n"
                       "    LogNvfp4TensorStats: {enabled: true, tensors: [activation], stats: [underflows%]}\n")
    bad = _run("check-features", str(unknown), "--feature-dir", folder)
    assert bad.returncode == 2 and "nvdlfw-inspect rejected the features" in bad.stderr
    assert "LogNvfp4TensorStats" in bad.stderr


def test_an_ok_says_when_nvdlfw_inspects_own_check_did_not_run(tmp_path):
    """Without nvdlfw-inspect (its import blocked in the child, as a missing package is), the
    file passes our checks, and the "ok" says that nvdlfw-inspect's own check did not run."""
    features = tmp_path / "stats.yaml"
    features.write_text("s:\n  enabled: true\n  layers: {layer_name_regex_pattern: fc1}\n"
                        "  distmetrics:\n    LogTensorStats: {enabled: true, stats: [max], tensors: [weight]}\n")
    blocked = "import sys; sys.modules['nvdlfw_inspect'] = None; from distmetrics.cli import main; sys.exit(main())"
    for argv in (["check-features", str(features)],
                 ["check-config", "configs/metrics.yaml", "tensor_inspect.enabled=true",
                  f"tensor_inspect.features={features}"]):
        out = run_python("-c", blocked, *argv)
        assert out.returncode == 0 and out.stdout.startswith("ok: "), out.stderr
        assert "nvdlfw-inspect is not installed" in out.stdout and "did not run" in out.stdout, out.stdout
        installed = _run(*argv)  # with it installed, the ok line has no such note
        assert installed.returncode == 0 and "not installed" not in installed.stdout, installed.stderr


def test_summary_reads_a_run_back(tmp_path):
    import distmetrics as dm

    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, console=False, tensorboard=False)) as m:
        for step, loss in enumerate([3.0, 2.0, math.nan, 1.0], start=1):
            m.step(step, loss=loss, tokens=10)
    out = _run("summary", str(tmp_path / "metrics.jsonl"))
    assert out.returncode == 0
    assert "2 train" in out.stdout and "first step 2: loss=2.5" in out.stdout and "last step 4: loss=nan" in out.stdout
    assert "alert step 4: non-finite loss" in out.stdout


def test_a_missing_sink_package_warns_once_with_the_fix(tmp_path, monkeypatch, caplog):
    import distmetrics as dm

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False)) as monitor:
        for step in (1, 2):
            monitor.step(step, loss=1.0)
    warnings = [r.getMessage() for r in caplog.records if "tensorboard sink failed" in r.getMessage()]
    assert len(warnings) == 1 and "pip install tensorboard" in warnings[0]
    assert len([r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]) == 2


def test_update_norms_with_cpu_staged_snapshots_match_the_device_ones(tmp_path):
    import torch

    import distmetrics as dm

    results = {}
    for where in ("device", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        cfg = dm.MetricsConfig(output_dir=str(tmp_path), json_log=False, console=False, log_progress=False,
                               tensorboard=False, log_interval=1, log_update_norm=True, update_norm_snapshot=where)
        monitor = dm.Monitor(cfg, model=model, optimizer=opt)
        model(torch.ones(3, 8)).sum().backward()
        before = [p.detach().clone().double() for p in model.parameters()]
        monitor.clip_grad_norm_(math.inf)
        opt.step()
        truth = math.sqrt(sum(float((p.detach().double() - b).pow(2).sum()) for p, b in zip(model.parameters(), before)))
        results[where] = monitor.step(1)["update_norm"]
        assert results[where] == pytest.approx(truth, rel=1e-6)
        monitor.close()


def _barriers(rank: int, world: int) -> dict:
    from distmetrics.collectors.timers import Timers
    from tests.dist_utils import CollectiveCounter

    out = {}
    for honoured in (True, False):
        timers = Timers(1, "minmax", use_cuda=False, barrier_with_L1_time=honoured)
        with CollectiveCounter() as counter:
            timers("x", log_level=1).start(barrier=True)
            timers("x").stop(barrier=True)
        out[honoured] = counter.collectives
    return out


def test_barrier_with_l1_time_false_turns_timer_barriers_off():
    """Counted, not timed: ``start``/``stop(barrier=True)`` call a real ``dist.barrier`` each
    (every rank, so none waits forever), and none with ``barrier_with_L1_time=False``."""
    from tests.dist_utils import run_ranks

    for counts in run_ranks(_barriers, 2):
        assert counts == {True: 2, False: 0}


def _all_timers_to_tensorboard(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm
    from tests.dist_utils import FakeClock

    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, timing_log_level=1,
                           timing_log_option="all")
    with FakeClock() as clock, dm.Monitor(cfg) as monitor:
        with monitor.timers("fwd", log_level=1):
            clock.advance(10.0 * (rank + 1))
        monitor.step(1)
    return {}


def _histograms(folder, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"histograms": 0})
    acc.Reload()
    return [event.histogram_value for event in acc.Histograms(tag)]


def test_all_option_timers_reach_tensorboard_as_summary_and_histogram(tmp_path):
    """4,096 ranks must not become 4,096 tags: TensorBoard gets max/min/mean and a histogram,
    JSONL every rank's value. The histogram is binned as ``SummaryWriter.add_histogram`` bins the
    same values (written by a real SummaryWriter and read back). Rank r's timer runs 10·(r+1) ms on
    a :class:`~tests.dist_utils.FakeClock` read in place of ``time.perf_counter_ns``."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    import distmetrics as dm
    from tests.dist_utils import run_ranks

    run_ranks(_all_timers_to_tensorboard, 3, str(tmp_path))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"timers/fwd/max", "timers/fwd/min", "timers/fwd/mean"} <= scalars
    assert not any("rank1" in tag for tag in scalars)
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"][0]
    values = [record[f"timers/fwd/rank{r}"] for r in range(3)]
    assert values == [10.0, 20.0, 30.0]
    with SummaryWriter(str(tmp_path / "truth")) as truth_writer:
        truth_writer.add_histogram("timers/fwd", np.array(values), 1)
    (ours,) = _histograms(tmp_path / "tensorboard", "timers/fwd")
    (truth,) = _histograms(tmp_path / "truth", "timers/fwd")
    assert (ours.num, ours.min, ours.max, ours.sum, ours.sum_squares) == (3, 10.0, 30.0, 60.0, 1400.0)
    assert list(ours.bucket_limit) == list(truth.bucket_limit) and list(ours.bucket) == list(truth.bucket)
    assert (ours.num, ours.min, ours.max, ours.sum, ours.sum_squares) == \
        (truth.num, truth.min, truth.max, truth.sum, truth.sum_squares)


@contextlib.contextmanager
def console_lines():
    """The console sink's lines, as a list filled while the context is open."""
    lines = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Capture()
    logging.getLogger("distmetrics.console").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("distmetrics.console").removeHandler(handler)


@pytest.mark.parametrize("to_dashboards", [True, False])
def test_timers_and_ppl_leave_the_dashboards_only_when_switched_off(tmp_path, to_dashboards):
    """log_timers_to_tensorboard and log_validation_ppl_to_tensorboard decide what TensorBoard
    (and W&B, through the same view) gets, as Megatron's flags do; JSONL and the console keep
    both. log_validation_ppl_to_tensorboard: false took eval/ppl out of every sink."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, timing_log_level=0,
                           log_timers_to_tensorboard=to_dashboards, log_validation_ppl_to_tensorboard=to_dashboards)
    with console_lines() as lines, dm.Monitor(cfg) as monitor:
        monitor.step(1, loss=2.0)
        monitor.step(2, loss=2.0)
        monitor.log_eval(2, loss=math.log(8.0))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert ("timers/step" in tags, "eval/ppl" in tags) == (to_dashboards, to_dashboards)
    assert {"train/loss", "eval/loss"} <= tags
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    assert "timers/step" in [r for r in records if r["kind"] == "train"][-1]
    assert [round(r["eval/ppl"], 9) for r in records if r["kind"] == "eval"] == [8.0]
    assert [line for line in lines if line.startswith(">> eval")][0].count("| ppl 8.00") == 1


def test_verbosity_minus_one_prints_eval_lines_and_alerts_only(tmp_path):
    """Alerts (a non-finite loss here) are printed at every verbosity: never silent."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, verbosity=-1, tensorboard=False,
                           timing_log_level=1)
    with console_lines() as lines, dm.Monitor(cfg) as monitor:
        monitor.step(1, loss=2.0)
        monitor.log_eval(1, loss=1.5)
        monitor.step(2, loss=math.nan)
    assert len(lines) == 2 and lines[0].startswith(">> eval step 1 | loss 1.5000")
    assert lines[1] == "!! step 2: non-finite loss in 1 rank-step(s)"


def test_the_console_on_a_closed_stdout_is_turned_off_with_one_warning(tmp_path):
    """stdout a pipe its reader closed (``| head -1``): logging's StreamHandler printed a
    "Logging error" traceback per line and the sink stayed on, with no distmetrics warning."""
    import subprocess

    from distmetrics import read_jsonl

    code = ("import logging, distmetrics as dm\n"
            "cfg = dm.MetricsConfig(output_dir=%r, log_interval=1, tensorboard=False, timing_log_level=-1)\n"
            "with dm.Monitor(cfg) as monitor:\n"
            "    for step in range(1, 21):\n"
            "        monitor.step(step, loss=2.0)\n" % str(tmp_path))
    read, write = os.pipe()
    os.close(read)  # every write to stdout fails with EPIPE
    try:
        child = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    finally:
        os.close(write)
    assert child.returncode == 0, child.stderr
    assert "Logging error" not in child.stderr, child.stderr
    warned = [line for line in child.stderr.splitlines() if "the console sink failed" in line]
    assert len(warned) == 1 and "Broken pipe" in warned[0], child.stderr
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == list(range(1, 21))
    # a handler of the user's added after the Monitor still gets every line; the stdout handler goes
    code = code.replace("with dm.Monitor(cfg) as monitor:\n", "with dm.Monitor(cfg) as monitor:\n"
                        "    logging.getLogger().addHandler(logging.FileHandler(%r))\n" % str(tmp_path / "user.log"))
    read, write = os.pipe()
    os.close(read)
    try:
        child = subprocess.run([sys.executable, "-c", code.replace(str(tmp_path), str(tmp_path / "again"))],
                               stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    finally:
        os.close(write)
    assert child.returncode == 0 and "Logging error" not in child.stderr, child.stderr
    logged = (tmp_path / "again" / "user.log").read_text().splitlines()  # the paths above moved to again/
    assert len([line for line in logged if line.startswith(":: step")]) == 20, logged
    assert len([line for line in logged if "stdout handler cannot write ([Errno 32] Broken pipe (EPIPE))" in line]) == 1
    # sys.stdout closed by the script: a ValueError, not an OSError, from the same write
    closed = subprocess.run([sys.executable, "-c", "import sys; sys.stdout.close()\n" + code.replace(
        str(tmp_path), str(tmp_path / "closed"))], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert closed.returncode == 0 and "Logging error" not in closed.stderr, closed.stderr


def test_a_record_is_written_sorted_when_its_names_change_between_log_steps(tmp_path):
    """The record's names are sorted once and reused while they stay the same: a name that
    appears at a later log step, or goes away, still gives a sorted record without internal
    lanes, in the file and as returned."""
    import distmetrics as dm
    from tests.dist_utils import quiet_config

    cfg = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True)
    names = {1: ["b"], 2: ["b"], 3: ["a", "b", "zz"], 4: ["b", "zz"], 5: ["b", "zz"]}
    with dm.Monitor(cfg) as monitor:
        returned = []
        for step, extra in names.items():
            for name in extra:
                monitor.record(f"x/{name}", 1.0)
            returned.append(list(monitor.step(step, loss=1.0)))
    written = [list(r) for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    for step, keys, line in zip(names, returned, written):
        assert keys == sorted(keys) and not any(k.startswith("_") for k in keys), step
        assert {f"x/{n}" for n in names[step]} <= set(keys), step
        assert line[3:] == keys, step  # the head (kind, step, time), then the record as returned
    assert "x/a" not in returned[3] and "x/a" in returned[2]


def test_eval_gap_covers_the_log_intervals_written_since_the_last_evaluation(tmp_path):
    """Evaluations every 5 steps, log steps every 10: an evaluation with no log step since the
    last one has no gap; the next one's gap is against the train loss of the whole interval."""
    import distmetrics as dm
    from tests.dist_utils import quiet_config

    with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=10)) as monitor:
        gaps = {}
        for step in range(1, 21):
            monitor.step(step, loss=float(step), tokens=1)
            if step % 5 == 0:
                gaps[step] = monitor.log_eval(step, loss=30.0, tokens=1).get("eval/gap")
    assert gaps[5] is None and gaps[15] is None
    assert gaps[10] == pytest.approx(30.0 - 5.5) and gaps[20] == pytest.approx(30.0 - 15.5)


def test_a_skipped_steps_loss_is_left_out_of_train_loss_and_its_tokens_count(tmp_path):
    """As Megatron's loss average leaves skipped iterations out (a loss-scale overflow): steps
    1-4 with losses 1, 2, 30, 4 and step 3 skipped give (1·10 + 2·20 + 4·40) / 70."""
    import distmetrics as dm
    from tests.dist_utils import quiet_config

    with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=4, log_throughput=True)) as monitor:
        for step, loss in zip(range(1, 5), (1.0, 2.0, 30.0, 4.0)):
            metrics = monitor.step(step, loss=loss, tokens=10 * step, skipped=step == 3)
    assert metrics["train/loss"] == pytest.approx((1 * 10 + 2 * 20 + 4 * 40) / 70)
    assert metrics["health/skipped_steps"] == 1 and metrics["train/consumed_tokens"] == 100


class _LineSink:
    def log(self, metrics, step, kind):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("sinks, message", [
    ([_LineSink], r"_LineSink is a class; pass an instance of it: sinks=\[_LineSink\(...\)\]"),
    (_LineSink(), r"expected a list or tuple of sink objects, got _LineSink"),
    ([print], r"is not a sink: a sink has log\(metrics, step, kind\)")], ids=["class", "not a list", "no log"])
def test_a_sink_that_cannot_be_one_is_refused_when_the_monitor_is_built(tmp_path, sinks, message):
    """A sink class given where an instance belongs passed the check (its log and close are
    functions) and failed at the first record with "the type sink failed (TypeError ...)"."""
    import distmetrics as dm

    with pytest.raises(ValueError, match=r"^distmetrics cannot start: rank 0: Monitor\(sinks=...\): .*" + message):
        dm.Monitor(dm.MetricsConfig(output_dir=str(tmp_path), console=False), sinks=sinks)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_each_monitor_prints_to_the_stdout_of_its_own_time(tmp_path):
    """The console's stdout handler outlived its Monitor: a second Monitor (a notebook's next cell,
    a capture) printed through the first one's stream, a closed file: nothing, and no warning. Of
    two Monitors open together, the one closed first takes the handler with it only when the other
    has closed too."""
    import subprocess

    code = ("import contextlib, io, distmetrics as dm\n"
            "cfg = dm.MetricsConfig(output_dir=%r, log_interval=1, tensorboard=False, json_log=False, "
            "timing_log_level=-1)\n"
            "captured = []\n"
            "for run in range(2):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        with dm.Monitor(cfg) as monitor:\n"
            "            for step in range(1, 4):\n"
            "                monitor.step(step, loss=2.0)\n"
            "    captured.append(sum(line.startswith(':: step') for line in out.getvalue().splitlines()))\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"  # two open together: one closes first
            "    a, b = dm.Monitor(cfg.replace(output_dir=%r)), dm.Monitor(cfg.replace(output_dir=%r))\n"
            "    a.step(1, loss=2.0)\n"
            "    a.close()\n"
            "    b.step(1, loss=2.0)\n"
            "    b.close()\n"
            "captured.append(sum(line.startswith(':: step') for line in out.getvalue().splitlines()))\n"
            "print(captured)\n" % (str(tmp_path), str(tmp_path / "a"), str(tmp_path / "b")))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "[3, 3, 2]", (child.stdout, child.stderr)
