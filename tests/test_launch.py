"""The launchers and trainers as a user runs them: real torchrun processes on CPU (gloo).

Each parallel layout's grad norms and losses are compared with an unsharded single-process
run of the same trainer on the same seed and data (the independent ground truth here).
The SLURM script is checked with ``bash -n`` and a dry run whose ``srun`` is a stub that
prints what it would run: SLURM cannot run on this machine, and that stub is the only one.
"""

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distmetrics as dm
from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("SLURM_JOB_ID", None)
    env.update(extra)
    return env


def _torchrun(script: str, nproc: int, args: list, env: dict | None = None, timeout: int = 240) -> None:
    env = env or _env()
    env.update({"NPROC_PER_NODE": str(nproc), "MASTER_PORT": str(free_port())})
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), str(ROOT / "launch" / script), *args],
                         env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


def _single(script: str, args: list, timeout: int = 240) -> str:
    env = _env()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    env["MASTER_PORT"] = str(free_port())
    run = subprocess.run([sys.executable, str(ROOT / "launch" / script), *args], env=env,
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout + run.stderr


def _train_records(out: Path) -> list[dict]:
    return [r for r in dm.read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]


COMMON = ["--steps", str(STEPS), "--eval-every", "0", "--save-every", "0"]
METRICS = ["log_interval=1", "console=false", "tensorboard=false"]


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_ref")
    _single("train_fsdp.py", COMMON + ["--micro-batch", "8"] + METRICS + [f"output_dir={out}"])
    return _train_records(out)


@pytest.mark.parametrize("layout,nproc,flags", [
    ("fsdp2", 2, ["--micro-batch", "4"]),
    ("hsdp", 4, ["--dp-replicate", "2", "--dp-shard", "2", "--micro-batch", "2"]),
    ("fsdp2_tp", 4, ["--dp-shard", "2", "--tp", "2", "--micro-batch", "4"]),
])
def test_fsdp_trainer_norms_match_an_unsharded_run(fsdp_reference, tmp_path, layout, nproc, flags):
    # The global batch is 8 sequences in every layout (micro-batch × data-parallel ranks).
    _torchrun("train_fsdp.py", nproc, COMMON + flags + METRICS + [f"output_dir={tmp_path}"])
    records = _train_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    for ours, ref in zip(records, fsdp_reference):
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), layout
        assert ours["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-5), layout
    per_module = {k for k in records[0] if k.startswith("grad_norm/")}
    assert per_module == {k for k in fsdp_reference[0] if k.startswith("grad_norm/")}
    for key in per_module:
        assert records[0][key] == pytest.approx(fsdp_reference[0][key], rel=1e-4), key


def test_megatron_trainer_tp2_pp2_matches_an_unsharded_run(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "tp2pp2"
    # log_energy on a CPU machine: the library's own warning, which must stay visible
    output = _single("train_megatron.py", ["--steps", str(STEPS)] + METRICS + [f"output_dir={ref}", "log_energy=true"])
    assert "UserWarning" not in output and "megatron/core" not in output, output  # known ones are quiet
    assert "distmetrics: GPU energy is not measured" in output
    _torchrun("train_megatron.py", 4, ["--tp", "2", "--pp", "2", "--steps", str(STEPS)] + METRICS
              + [f"output_dir={out}", "timing_log_level=2"])
    reference, records = _train_records(ref), _train_records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for ours, theirs in zip(records, reference):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert ours["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5)
    layers = {k for k in records[0] if k.startswith("grad_norm/decoder.layers.")}
    assert layers == {k for k in reference[0] if k.startswith("grad_norm/decoder.layers.")}
    assert "timers/forward-recv" in records[0]  # our timers ran inside the pipeline code
    run = next(dm.read_jsonl(out / "metrics.jsonl"))
    assert run["layout"] == "megatron" and run["writer_rank"] == 3


def test_megatron_trainer_with_the_distributed_optimizer_reports_megatrons_own_grad_norm(tmp_path):
    """The trainer's --use-distributed-optimizer: Megatron's DDP + DistributedOptimizer (DP=2), our norm
    of the sharded gradients is the one Megatron's optimizer computes for its clipping, at every log step.
    2 ranks: DP=2 × TP=2 is tests/test_megatron_distopt.py's, against float64 truth too."""
    _torchrun("train_megatron.py", 2, ["--steps", "4", "--use-distributed-optimizer"] + METRICS
              + ["log_interval=2", f"output_dir={tmp_path}"])
    records = _train_records(tmp_path)
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["grad_norm"] == pytest.approx(record["train/megatron_grad_norm"], rel=1e-6)


def test_two_simulated_nodes_write_one_set_of_files(tmp_path):
    """Two torchrun agents (2 ranks each) meet on loopback through c10d rendezvous."""
    port = str(free_port())
    out = tmp_path / "run"
    procs = []
    for node in (0, 1):
        env = _env(NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="2", MASTER_PORT=port,
                   RDZV_ID=f"test-{port}", SLURM_JOB_ID="777")
        procs.append(subprocess.Popen(
            ["bash", str(ROOT / "launch" / "torchrun.sh"), str(ROOT / "launch" / "train_fsdp.py"),
             "--steps", "4", "--eval-every", "0", "--save-every", "4", "log_interval=2", "console=false",
             f"output_dir={out}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    for p in procs:
        output, _ = p.communicate(timeout=240)
        assert p.returncode == 0, output[-5000:]
    records = list(dm.read_jsonl(out / "metrics.jsonl"))
    assert [r["kind"] for r in records] == ["run", "train", "train", "progress", "end"]
    assert records[-2]["checkpoint/tokens"] == 4 * 4 * 4 * 32  # steps × ranks × micro-batch × seq
    assert records[0]["world_size"] == 4
    assert sorted(r["local_rank"] for r in records[0]["ranks"]) == [0, 0, 1, 1]
    lines = (out / "progress.txt").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.split("\t")[1:3] == ["Job ID: 777", "# GPUs: 4"]
    assert lines[0].endswith("Starting job") and "\tSaved checkpoint\tIteration: 4\t" in lines[1]
    assert len(list((out / "tensorboard").iterdir())) == 1
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "progress.txt", "tensorboard"]


@pytest.mark.parametrize("nodes, first", [("gpu[07-10]", "gpu07"), ("gpu[07-08,11],cpu3", "gpu07"), ("gpu05", "gpu05"),
                                          ("login1,gpu[01-04]", "login1"), ("node-a,node-b[1-3]", "node-a"),
                                          ("rack[1-2]-node[01-02]", "rack1-node01"), ("gpu[01-02]-ib", "gpu01-ib"),
                                          ("scontrol:gpu[1-2]", "from-scontrol")])
def test_slurm_script_parses_and_runs_one_torchrun_agent_per_node(tmp_path, nodes, first):
    """One srun of torchrun per node, rendezvous on the allocation's first node: a plain first
    name before a bracketed range (``login1,gpu[01-04]``) was read as ``login1,gpu01``, and a name
    with text after its range (``gpu[01-02]-ib``) or two ranges lost the rest. Where scontrol
    is installed, its first host name is taken."""
    script = ROOT / "launch" / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/usr/bin/env bash\necho "srun $*"\n')
    (stub / "srun").chmod(0o755)
    if nodes.startswith("scontrol:"):
        nodes = nodes.split(":", 1)[1]
        (stub / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && printf '
                                       '"from-scontrol\\nsecond\\n"\n')
        (stub / "scontrol").chmod(0o755)
    env = _env(PATH=f"{stub}:{os.environ['PATH']}", SLURM_JOB_ID="9001", SLURM_JOB_NUM_NODES="4",
               SLURM_JOB_NODELIST=nodes, SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(ROOT),
               PYTHON="python3")
    run = subprocess.run(["bash", str(script), "launch/train_fsdp.py", "--steps", "10"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    line = run.stdout.strip()
    assert line.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 python3 -m torch.distributed.run")
    assert "--nnodes 4 --nproc-per-node 8" in line
    assert f"--rdzv-backend c10d --rdzv-endpoint {first}:29500 --rdzv-id 9001" in line
    assert line.endswith("launch/train_fsdp.py --steps 10")


def test_slurm_script_outside_an_allocation_or_with_a_bad_venv_stops_with_one_message(tmp_path):
    """Without SLURM_JOB_NODELIST the message was printed and the script went on (inside
    ``export MASTER_ADDR=$(...)``), to srun with ``--rdzv-endpoint :29500`` and exit 0; a
    DISTMETRICS_VENV without bin/python fell back to python3 without a word."""
    script = ROOT / "launch" / "slurm.sbatch"
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/usr/bin/env bash\necho "srun $*"\n')
    (stub / "srun").chmod(0o755)
    base = _env(PATH=f"{stub}:{os.environ['PATH']}", SLURM_JOB_ID="9001", SLURM_JOB_NUM_NODES="2",
                SLURM_JOB_NODELIST="gpu[1-2]", SLURM_SUBMIT_DIR=str(tmp_path))
    base.pop("PYTHON", None)
    for drop in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"):
        env = {k: v for k, v in base.items() if k != drop}
        run = subprocess.run(["bash", str(script), "x.py"], env=env, capture_output=True, text=True, timeout=30)
        assert run.returncode != 0 and "srun" not in run.stdout
        assert run.stderr.count("not inside a SLURM allocation") == 1, run.stderr
    run = subprocess.run(["bash", str(script), "x.py"], env=dict(base, DISTMETRICS_VENV="nowhere"), capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 2 and "DISTMETRICS_VENV=nowhere has no bin/python" in run.stderr and not run.stdout
    run = subprocess.run(["bash", str(script), "x.py"], capture_output=True, text=True, timeout=30,  # as README says
                         env=dict(base, MASTER_ADDR="head7", MASTER_PORT="29611", NPROC_PER_NODE="3", PYTHON="py"))
    assert "--nproc-per-node 3 " in run.stdout and "--rdzv-endpoint head7:29611 " in run.stdout, run.stderr


def test_a_trainer_stopped_by_sigterm_says_which_steps_are_not_written(tmp_path):
    """torchrun stops the other ranks with SIGTERM when one fails, Slurm stops a job with it: the
    steps since the last log step were lost without the exit warning SIGINT gives."""
    import signal
    import time

    env = _env()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    env["MASTER_PORT"] = str(free_port())
    out = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, str(ROOT / "launch" / "train_fsdp.py"), "--steps", "100000",
                                "--eval-every", "0", "--save-every", "1", f"output_dir={out}", "log_interval=100000",
                                "tensorboard=false", "console=false"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        progress = out / "progress.txt"  # a "checkpoint" each step: steps were made, none of them a log step
        while (progress.read_text() if progress.exists() else "").count("Saved checkpoint") < 3:
            assert time.monotonic() < deadline and trainer.poll() is None, "no steps"
            time.sleep(0.2)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=60) == 143
    finally:
        trainer.kill()
    said = trainer.stderr.read()
    assert "since the last log step" in said and "not written" in said, said[-2000:]


def test_demo_config_loads():
    cfg = dm.MetricsConfig.from_yaml(ROOT / "configs" / "demo.yaml")
    assert cfg.timing_log_level == 1 and cfg.output_dir == "runs/demo"
    assert math.isfinite(cfg.spike_factor)


def _stub_python(folder: Path) -> Path:
    """A stand-in interpreter that prints how it was called (only its path is under test)."""
    (folder / "bin").mkdir(parents=True)
    stub = folder / "bin" / "python"
    stub.write_text('#!/usr/bin/env bash\necho "venv python $*"\n')
    stub.chmod(0o755)
    return stub


def test_torchrun_sh_uses_the_projects_venv_when_python_is_not_set(tmp_path):
    """As the README runs it, without an activated venv: the project's .venv, or DISTMETRICS_VENV."""
    project = tmp_path / "project"
    (project / "launch").mkdir(parents=True)
    shutil.copy(ROOT / "launch" / "torchrun.sh", project / "launch" / "torchrun.sh")
    _stub_python(project / ".venv")
    env = _env(NPROC_PER_NODE="2")
    for key in ("PYTHON", "DISTMETRICS_VENV"):
        env.pop(key, None)
    run = subprocess.run(["bash", "launch/torchrun.sh", "launch/train_fsdp.py"], env=env, cwd=project,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.startswith("venv python -m torch.distributed.run"), run.stderr
    _stub_python(tmp_path / "elsewhere")
    run = subprocess.run(["bash", str(project / "launch" / "torchrun.sh"), "x.py"], cwd=tmp_path,
                         env=dict(env, DISTMETRICS_VENV=str(tmp_path / "elsewhere")),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.startswith("venv python -m torch.distributed.run"), run.stderr
    missing = subprocess.run(["bash", str(project / "launch" / "torchrun.sh"), "x.py"], cwd=tmp_path,
                             env=dict(env, DISTMETRICS_VENV=str(tmp_path / "none")),
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "has no bin/python" in missing.stderr


def test_setup_sh_installs_again_where_the_torch_spec_or_pyproject_changed(tmp_path):
    """setup.sh checked only that the modules exist: DISTMETRICS_TORCH set on an existing .venv kept the
    old torch, and a dependency a pull added to pyproject.toml was never installed. Now it installs the
    project again where pyproject.toml changed, and torch where DISTMETRICS_TORCH names another spec than
    the one it installed; unset, the torch present is kept (a GPU build installed with the variable is not
    swapped for the CPU pin by a later run without it). ``--check`` says what a run would install and
    installs nothing. The venv's interpreter is a stand-in that runs the real one but records its pip
    calls instead of making them, and finds every module but the one ``MISSING`` names."""
    project = tmp_path / "project"
    (project / "launch").mkdir(parents=True)
    shutil.copy(ROOT / "launch" / "setup.sh", project / "launch" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    calls = tmp_path / "pip-calls"
    stub = project / "a venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m pip" ]; then echo "$*" >> "{calls}"; exit 0; fi\n'
                    'case "$2" in\n'
                    '  *"import torch, distmetrics"*) echo "distmetrics, torch"; exit 0;;\n'
                    '  *find_spec*) for m in "${@:3}"; do [ "$m" = "${MISSING:-}" ] && exit 1; done; exit 0;;\n'
                    'esac\n'
                    f'exec "{sys.executable}" "$@"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DISTMETRICS_TORCH", "MISSING")}
    env["DISTMETRICS_VENV"] = str(project / "a venv")

    def setup(*args, status=0, **extra) -> tuple:
        calls.write_text("")
        run = subprocess.run(["bash", "launch/setup.sh", *args], cwd=project, env=dict(env, **extra),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == status and not run.stderr, run.stdout + run.stderr  # no stamp yet: said nothing
        return calls.read_text().splitlines(), run.stdout.strip()

    pip, project_install = "-m pip install -q --upgrade pip", '-m pip install -q -e .[all,dev]'
    assert setup("--check", status=1)[1].endswith("the project (pyproject.toml is not the one it installed)")
    assert setup("--check", status=1)[0] == []
    assert setup() == ([pip, project_install], "distmetrics, torch")  # a venv from before: torch kept
    assert setup() == ([], "distmetrics, torch")  # nothing changed: only checked
    assert setup("--check")[1].startswith("setup has nothing to install into ")
    assert setup(DISTMETRICS_TORCH="torch==2.4.0")[0] == [pip, "-m pip install -q torch==2.4.0"]
    assert setup(DISTMETRICS_TORCH="torch==2.4.0")[0] == []
    assert setup()[0] == []  # the variable unset on a later run: the torch it installed is kept
    with open(project / "pyproject.toml", "a") as f:
        f.write("\n# a dependency added\n")
    assert setup()[0] == [pip, project_install]
    assert setup()[0] == []
    assert setup(MISSING="torch")[0] == [pip, "-m pip install -q torch==2.13.0"]
    assert setup(MISSING="wandb")[0] == [pip, project_install]
    said = setup("--check", status=1, MISSING="torch", DISTMETRICS_TORCH="torch==2.5.0")[1]
    assert said.endswith("install into " + env["DISTMETRICS_VENV"] + ": torch==2.5.0 (torch is missing)"), said
    stamp = project / "a venv" / ".distmetrics-setup"  # the one line "spec sha" an earlier version wrote
    stamp.write_text(f"torch==2.13.0 {stamp.read_text().splitlines()[1]}\n")
    assert setup()[0] == [pip, project_install]  # the torch spec it holds is not known: the torch present kept
    assert setup(DISTMETRICS_TORCH="torch==2.13.0")[0] == [pip, "-m pip install -q torch==2.13.0"]
    assert setup(DISTMETRICS_TORCH="torch==2.13.0")[0] == []


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock(1) here: set-ups of one venv are not serialised")
def test_two_set_ups_of_a_new_venv_at_once_install_once_after_the_venv_is_whole(tmp_path):
    """A demo started beside the tests on a fresh machine: the second set-up found bin/python in place
    (the venv's interpreter comes seconds before its pip) and ran pip before pip was there. The lock is
    taken before the venv is made: the second waits, then finds everything installed. ``python3 -m venv``
    is a stand-in that puts the recording interpreter in place, then its pip 2 s later."""
    project = tmp_path / "project"
    (project / "launch").mkdir(parents=True)
    shutil.copy(ROOT / "launch" / "setup.sh", project / "launch" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    calls, venv, tools = tmp_path / "pip-calls", project / ".venv", tmp_path / "bin"
    tools.mkdir()
    interpreter = (f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m pip" ]; then [ -e "{venv}/pip-ready" ] || exit 7\n'
                   f'  echo "$*" >> "{calls}"; touch "{venv}/installed"; exit 0; fi\n'
                   'case "$2" in *"import torch, distmetrics"*) echo ok; exit 0;;\n'
                   f'  *find_spec*) [ -e "{venv}/installed" ]; exit;; esac\n'
                   f'exec "{sys.executable}" "$@"\n')
    (tools / "interpreter").write_text(interpreter)
    (tools / "python3").write_text(f'#!/usr/bin/env bash\nmkdir -p "$3/bin"; cp "{tools}/interpreter" "$3/bin/python"\n'
                                   'chmod +x "$3/bin/python"; sleep 2; touch "$3/pip-ready"\n')
    (tools / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DISTMETRICS_TORCH", "DISTMETRICS_VENV")}
    env["PATH"] = f"{tools}:{env['PATH']}"
    first = subprocess.Popen(["bash", "launch/setup.sh"], cwd=project, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (venv / "bin" / "python").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run(["bash", "launch/setup.sh"], cwd=project, env=env, capture_output=True, text=True,
                            timeout=60)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, (out, err, second.stdout, second.stderr)
    assert calls.read_text().splitlines() == ["-m pip install -q --upgrade pip", "-m pip install -q torch==2.13.0",
                                              "-m pip install -q -e .[all,dev]"]  # once, by the first


@pytest.mark.parametrize("extra, expected", [
    ({}, "--nproc-per-node 8 --standalone x.py"),
    ({"MASTER_PORT": "1234"}, "--nproc-per-node 8 --master-addr 127.0.0.1 --master-port 1234 x.py"),
    ({"NNODES": "2", "MASTER_ADDR": "n0"}, "8 --rdzv-backend c10d --rdzv-endpoint n0:29500 --rdzv-id distmetrics x.py"),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, "--nproc-per-node 3 --standalone x.py"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "--nproc-per-node 2 --standalone x.py"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, "--nproc-per-node 2 --standalone x.py"),  # CUDA: no device
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, "--nproc-per-node 2 --standalone x.py"),  # Slurm's: no GPU
    ({"CUDA_VISIBLE_DEVICES": "0,1,-1,3"}, "--nproc-per-node 2 --standalone x.py"),  # CUDA stops at -1
    ({"CUDA_VISIBLE_DEVICES": "GPU-8f6e,MIG-1a2b,4"}, "--nproc-per-node 3 --standalone x.py")])
def test_torchrun_sh_command_lines(tmp_path, extra, expected):
    """One node: its own rendezvous on a free port, or on MASTER_PORT alone (a c10d rendezvous with a
    fixed id made a second job on the node wait, silent, as the first's spare until it ended);
    the GPUs CUDA_VISIBLE_DEVICES lists, not every GPU nvidia-smi sees (8 here)."""
    stub = _stub_python(tmp_path / "venv")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/usr/bin/env bash\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: H100 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    env = _env(PYTHON=str(stub), PATH=f"{smi.parent}:{os.environ['PATH']}", **extra)
    for key in {"NPROC_PER_NODE", "MASTER_PORT", "NNODES", "RDZV_ID", "CUDA_VISIBLE_DEVICES"} - set(extra):
        env.pop(key, None)
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "x.py"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip().endswith(expected), run.stdout + run.stderr


@pytest.mark.parametrize("gpus, nproc, cpu, nodes", [(1, 2, True, 1), (8, 16, True, 1), (8, 8, False, 1),
                                                    (8, 2, False, 1), (1, 2, False, 2), (1, "gpu", False, 1)])
def test_torchrun_sh_runs_more_ranks_than_gpus_on_the_cpu_and_says_so(tmp_path, gpus, nproc, cpu, nodes):
    """The demo's 2 ranks on a one-GPU machine failed in the trainer: rank 1 set to a GPU that is not
    there ("invalid device ordinal"), and NCCL cannot put two ranks on one GPU anyway. Now the GPUs
    are hidden (CUDA_VISIBLE_DEVICES empty, so the trainers choose gloo) and it is said, once. Not on
    a node of several (its gloo beside the other nodes' NCCL would wait), nor for torchrun's "gpu"."""
    shown = tmp_path / "python"
    shown.write_text('#!/usr/bin/env bash\necho "CUDA_VISIBLE_DEVICES=[${CUDA_VISIBLE_DEVICES-unset}] $*"\n')
    shown.chmod(0o755)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/usr/bin/env bash\n" + "".join(f"echo 'GPU {i}: H100 (UUID: GPU-{i})'\n" for i in range(gpus)))
    smi.chmod(0o755)
    env = _env(PYTHON=str(shown), PATH=f"{smi.parent}:{os.environ['PATH']}", NPROC_PER_NODE=str(nproc),
               NNODES=str(nodes))
    for key in ("MASTER_PORT", "RDZV_ID", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "x.py"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert f"--nproc-per-node {nproc} " in run.stdout
    if cpu:
        assert run.stdout.startswith("CUDA_VISIBLE_DEVICES=[] "), run.stdout
        assert run.stderr.strip() == (f"launch/torchrun.sh: {nproc} ranks per node but {gpus} GPU(s): running on the "
                                      f"CPU (gloo); NPROC_PER_NODE={gpus} runs on the GPUs")
    else:
        assert run.stdout.startswith("CUDA_VISIBLE_DEVICES=[unset] ") and run.stderr == "", run.stdout + run.stderr


def test_a_trainer_started_with_more_ranks_than_gpus_stops_naming_both(monkeypatch):
    """Started by torchrun directly, the same job stops at once with one line. No GPU here: torch's
    answers to "is there CUDA" and "how many GPUs" are set for the call (the narrowest boundary)."""
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "launch"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"^2 ranks on this node but 1 GPU: give each rank a GPU \(--nproc-per-node "
                                         r"1\), or run on the CPU with CUDA_VISIBLE_DEVICES= set empty$"):
        common.gpus_for_ranks()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert common.gpus_for_ranks() is True


def test_a_second_job_on_a_node_starts_on_its_own_port_or_fails_at_once(tmp_path):
    """Real torchrun: a second job started while the first runs waited, silent, as the first one's
    spare until it ended (one c10d rendezvous, one id, port 29500). Without MASTER_PORT each job
    takes a free port; with a port another process holds a job exits with an error at once."""
    import socket

    script = tmp_path / "hello.py"
    script.write_text("import sys, time\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "sys.stdout.write(f'world {dist.get_world_size()}\\n')\nsys.stdout.flush()\n"
                      "time.sleep(float(sys.argv[1]))\ndist.destroy_process_group()\n")
    env = _env(NPROC_PER_NODE="2")
    env.pop("MASTER_PORT", None)
    first = subprocess.Popen(["bash", str(ROOT / "launch" / "torchrun.sh"), str(script), "60"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert first.stdout.readline().startswith("world 2")  # the first job runs
        run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), str(script), "0"], env=env,
                             capture_output=True, text=True, timeout=50)
        assert run.returncode == 0 and run.stdout.count("world 2") == 2, run.stdout + run.stderr[-3000:]
        assert first.poll() is None  # the second ran beside it, not after it
    finally:
        first.kill()
        first.wait()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env["MASTER_PORT"] = str(held.getsockname()[1])
        run = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), str(script)], env=env,
                             capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "world" not in run.stdout, run.stdout


def test_test_sh_runs_the_gpu_suite_only_when_given_no_arguments(tmp_path):
    """launch/test.sh on a machine where torch sees a GPU (the stand-in interpreter answers yes to
    every check): with no argument the whole suite (its files shared out over one pytest worker per core, at
    most 4, or DISTMETRICS_TEST_WORKERS), then tests/test_cuda.py alone; given a test
    file, only that file (not the whole suite as well) and the command for the GPU tests (passed the file too, the conftest hid
    the GPU and the GPU tests skipped without a word)."""
    project = tmp_path / "project"
    (project / "launch").mkdir(parents=True)
    for script in ("test.sh", "setup.sh"):
        shutil.copy(ROOT / "launch" / script, project / "launch" / script)
    _stub_python(project / ".venv")
    env = _env()
    env.pop("DISTMETRICS_VENV", None)
    calls = {}
    for args in ((), ("tests/test_timers.py",), ("-x",)):
        run = subprocess.run(["bash", "launch/test.sh", *args], env=env, cwd=project, capture_output=True,
                             text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        calls[args] = [line for line in run.stdout.splitlines() if line.startswith(("venv python -m pytest", "GPU"))]
    workers = min(len(os.sched_getaffinity(0)), 4)  # the cores this process may run on, as nproc counts them
    assert calls[()] == [f"venv python -m pytest tests -q -n {workers} --dist loadfile --durations=20",
                         "venv python -m pytest tests/test_cuda.py -q"]
    assert calls[("tests/test_timers.py",)] == [
        "venv python -m pytest -q tests/test_timers.py",
        "GPU tests not run with arguments; run them on their own: .venv/bin/python -m pytest tests/test_cuda.py"]
    assert calls[("-x",)][0] == "venv python -m pytest -q -x"  # pytest's testpaths (tests) then
    run = subprocess.run(["bash", "launch/test.sh"], env=dict(env, DISTMETRICS_TEST_WORKERS="3", OMP_NUM_THREADS="1"),
                         cwd=project, capture_output=True, text=True, timeout=30)
    assert "venv python -m pytest tests -q -n 3 --dist loadfile --durations=20" in run.stdout.splitlines()


def test_the_suites_rendezvous_ports_are_below_the_ephemeral_range_one_slice_per_worker(monkeypatch):
    """``free_port`` took a port from the kernel's ephemeral range, which another socket (an outgoing
    connection, another worker's gloo listener) could be handed before rank 0's store bound it: EADDRINUSE
    on rank 0, the other ranks connected to a stranger's store, a 180 s timeout and a module's tests in
    error (seen with 3 pytest workers). Truth: the kernel's range as /proc gives it."""
    import socket

    from tests import dist_utils

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    seen = {}
    for worker in ("gw0", "gw1", "gw7"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        seen[worker] = {dist_utils.free_port() for _ in range(3)}
        assert len(seen[worker]) == 3 and max(seen[worker]) < low, (worker, seen[worker], low)
    assert not (seen["gw0"] & seen["gw1"]) and not (seen["gw1"] & seen["gw7"]) and not (seen["gw0"] & seen["gw7"])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    with socket.socket() as held:  # a port some process listens on is skipped
        port = dist_utils.free_port()  # free now (this worker's earlier runs may hold its neighbours)
        held.bind(("127.0.0.1", port))
        held.listen()
        dist_utils._PORTS[0] -= 1  # the next call tries that port first
        assert dist_utils.free_port() > port


def _intra_op_threads(rank: int, world: int) -> int:
    import torch

    return torch.get_num_threads()


def test_the_suites_ranks_compute_on_as_many_threads_as_torchrun_gives_its_workers(monkeypatch):
    """The suite's ranks (``tests/dist_utils.run_ranks``) stand in for torchrun's workers, but kept the
    thread count of the server they fork from, one per core: 2-4 ranks of 2 OpenMP threads each on 2
    cores spent most of a small model's step spin-waiting. Truth: what torchrun's own launch config sets
    for 2 workers where the environment says nothing."""
    from torch.distributed.run import config_from_args, parse_args

    from tests.dist_utils import run_ranks

    monkeypatch.setenv("OMP_NUM_THREADS", "")  # restored as it was after the test
    monkeypatch.delenv("OMP_NUM_THREADS")
    config_from_args(parse_args(["--nproc-per-node", "2", "--standalone", "x.py"]))
    torchrun = int(os.environ.pop("OMP_NUM_THREADS"))
    assert run_ranks(_intra_op_threads, 2) == [torchrun, torchrun]


def test_the_suites_objects_are_out_of_the_collectors_reach_once_collected():
    """A Monitor looks once through the objects the garbage collector tracks for a DDP module around its
    model; in the suite's process those were every collected test and imported module (PyTorch's ported
    clip tests, 700 Monitors, spent some 20 s there). ``tests/conftest.py`` freezes them."""
    import gc

    assert gc.get_freeze_count() > 0


def test_the_demo_writes_a_fresh_run_folder_each_time(tmp_path):
    """launch/demo.sh as the README runs it (set-up check included; the venv is this one, skipped
    where set-up would install into it: never into the suite's running environment), two steps: a new
    folder beside an earlier demo's."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the demo's set-up needs a virtual environment to check")
    check = subprocess.run(["bash", str(ROOT / "launch" / "setup.sh"), "--check"], capture_output=True, text=True,
                           env=dict(_env(DISTMETRICS_VENV=sys.prefix)), timeout=60)
    if check.returncode == 1 and check.stdout.startswith("setup would "):
        pytest.skip(check.stdout.strip())
    assert check.returncode == 0, check.stdout + check.stderr  # a broken set-up fails here, not skipped
    earlier = tmp_path / "demo" / "20250101-000000"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text('{"kind": "run", "step": 0}\n')
    env = _env(DISTMETRICS_VENV=sys.prefix, DEMO_RUNS=str(tmp_path / "demo"), MASTER_PORT=str(free_port()))
    env.pop("PYTHON")
    run = subprocess.run(["bash", str(ROOT / "launch" / "demo.sh"), "--steps", "2", "--eval-every", "0",
                          "--save-every", "0", "log_interval=1", "console=false"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    folders = sorted(p.name for p in (tmp_path / "demo").iterdir())
    assert len(folders) == 2 and folders[0] == earlier.name
    fresh = tmp_path / "demo" / folders[1]
    assert f"demo run folder: {fresh}" in run.stdout
    records = list(dm.read_jsonl(fresh / "metrics.jsonl"))
    assert [r["kind"] for r in records] == ["run", "train", "train", "end"]
    assert (earlier / "metrics.jsonl").read_text() == '{"kind": "run", "step": 0}\n'
    # the README's list of what the folder holds
    assert sorted(p.name for p in fresh.iterdir()) == ["metrics.jsonl", "progress.txt", "report.html", "tensorboard"]
    assert list((fresh / "tensorboard").glob("events.out.tfevents.*")) and (fresh / "progress.txt").read_text()
    assert (fresh / "report.html").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("script,args,said", [
    ("train_fsdp.py", ["log_intervall=5"], "error: override 'log_intervall=5': unknown config key 'log_intervall'"),
    ("train_megatron.py", ["--te"], "error: --te needs TransformerEngine (and a GPU)"),
    ("train_fsdp.py", ["--stepz", "5"], "error: unrecognized arguments: --stepz (see --help)"),
    ("train_fsdp.py", ["--tp", "0"], "error: argument --tp: 0 is not a whole number >= 1 (see --help)"),
    ("train_fsdp.py", ["--grad-accum", "0"], "error: argument --grad-accum: 0 is not a whole number >= 1"),
    ("train_fsdp.py", ["--heads", "3"], "error: --d-model 64 is not divisible by --heads 3"),
    ("train_fsdp.py", ["--tp", "2"], "error: the world size 1 is not divisible by --dp-replicate × --tp 2"),
    ("train_megatron.py", ["--layers", "3", "--pp", "2"], "error: --layers 3 is not divisible by --pp 2"),
    ("train_fsdp.py", ["--steps", "0"], "error: argument --steps: 0 is not a whole number >= 1 (see --help)"),
    ("train_megatron.py", ["--steps", "0"], "error: argument --steps: 0 is not a whole number >= 1 (see --help)"),
    ("train_fsdp.py", ["--eval-every", "-1"], "error: argument --eval-every: -1 is not a whole number >= 0 (0: off)"),
    ("train_fsdp.py", ["--save-every", "-2"], "error: argument --save-every: -2 is not a whole number >= 0 (0: off)"),
    ("train_megatron.py", ["--warmup", "-1"], "error: argument --warmup: -1 is not a whole number >= 0 (0: off)"),
], ids=["config key", "--te", "unknown option", "--tp 0", "--grad-accum 0", "heads", "layout", "megatron layers",
        "--steps 0", "megatron --steps 0", "--eval-every -1", "--save-every -2", "--warmup -1"])
def test_a_trainer_refusing_its_arguments_says_it_in_one_line(tmp_path, script, args, said):
    """A config typo printed a traceback per rank with the message in the middle; --te without
    TransformerEngine a NameError from inside megatron-core; an unknown option argparse's usage
    block per rank; --tp 0 a ZeroDivisionError, --heads 3 a reshape error, --grad-accum 0 a run
    that trained on nothing, --steps 0 an error about an override 'total_steps=0' the user never wrote,
    --eval-every -1 an evaluation every step. One line on rank 0, exit status 2."""
    from tests.dist_utils import run_python

    run = run_python(f"launch/{script}", "--steps", "2", *args, f"output_dir={tmp_path}", timeout=180)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(said), run.stderr[-2000:]
    assert len([line for line in run.stderr.splitlines() if "error: " in line]) == 1  # one process, one line
    assert "Traceback" not in run.stderr


def test_the_fsdp_trainer_keeps_evaluation_out_of_the_step_time_and_counts_megatrons_n(tmp_path):
    """The trainer logged an evaluation's wall time as training (no monitor.pause()): an interval
    holding a 1 s evaluation read a step time of ~500 ms for 20 ms steps, tokens/s and MFU low by as
    much. And it gave num_params every parameter (embeddings, norms, biases): FLOPs per token 11 %
    above Megatron-LM's count, N = the matrix multiplies' weights, the output layer's included."""
    code = ("import sys, time; sys.path.insert(0, sys.argv.pop(1)); import train_fsdp as t; "
            "real = t.evaluate; t.evaluate = lambda *a: (time.sleep(1.0), real(*a))[1]; t.main()")
    args = ["--steps", "4", "--eval-every", "2", "--save-every", "0", "--layers", "2", "--d-model", "32",
            "--vocab", "128", "log_interval=2", "console=false", "tensorboard=false", f"output_dir={tmp_path}"]
    env = _env()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "launch"), *args], env=env, capture_output=True,
                         text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    (after_eval,) = [r for r in records if r["kind"] == "train" and r["step"] == 4]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]
    assert after_eval["train/step_time_ms"] < 450, after_eval  # 500 ms more with the evaluation counted
    layers, d, vocab = 2, 32, 128
    run_record = next(r for r in records if r["kind"] == "run")
    assert run_record["config"]["num_params"] == 12 * layers * d * d + vocab * d, run_record["config"]
