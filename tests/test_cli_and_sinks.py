"""The command line, a sink whose package is missing, CPU-staged update-norm snapshots, and the
barrier_with_L1_time switch."""

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "distmetrics.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_check_config_accepts_the_shipped_file_and_names_bad_keys(tmp_path):
    ok = _run("check-config", "configs/metrics.yaml", "log_interval=5")
    assert ok.returncode == 0 and "log_interval=5" in ok.stdout
    bad = _run("check-config", "configs/metrics.yaml", "log_intervall=5")
    assert bad.returncode == 2 and "did you mean 'log_interval'" in bad.stderr


def test_check_features_validates_the_shipped_cpu_file():
    ok = _run("check-features", "configs/tensor_stats_cpu.yaml")
    assert ok.returncode == 0 and "mlp_activations" in ok.stdout


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
    assert len(warnings) == 1 and "pip install distmetrics[tensorboard]" in warnings[0]
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


def _barrier_waits(rank: int, world: int) -> dict:
    import time

    from distmetrics.collectors.timers import Timers

    out = {}
    for honoured in (True, False):
        timers = Timers(1, "minmax", use_cuda=False, barrier_with_L1_time=honoured)
        if rank == 1:
            time.sleep(0.5)  # the slow rank
        t0 = time.perf_counter()
        timers("x", log_level=1).start(barrier=True)  # rank 0 waits here only if barriers are on
        out[honoured] = time.perf_counter() - t0
        timers("x").stop()
        import torch.distributed as dist

        dist.barrier()  # line the ranks up again for the next round
    return out


def test_barrier_with_l1_time_false_turns_timer_barriers_off():
    from tests.dist_utils import run_ranks

    fast = run_ranks(_barrier_waits, 2)[0]
    assert fast[True] >= 0.4  # waited for the slow rank
    assert fast[False] < 0.1
