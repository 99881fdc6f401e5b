"""The README's examples, run as they stand there (extracted from README.md, not copied)."""

import math
import os
import re
from pathlib import Path

import pytest

from tests.dist_utils import FakeClock, quiet_config, run_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
SLOW_MS = 20.0  # rank 1's loader takes this long per batch (on a fake clock); rank 0's returns at once


def readme_block(heading: str) -> str:
    """The first ```python block under a README heading."""
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_adding_a_metric(rank: int, world: int, root: str) -> dict:
    """The example reads ``time.perf_counter`` itself: in this rank's process that function is a
    :class:`FakeClock`'s, which only rank 1's loader advances (by ``SLOW_MS`` per batch)."""
    import time

    import distmetrics as dm

    clock = FakeClock()

    def loader():
        while True:
            if rank == 1:
                clock.advance(SLOW_MS)
            yield rank

    os.chdir(root)  # the example writes runs/data_wait/ relative to the working directory
    namespace = {"loader": loader()}
    real, time.perf_counter = time.perf_counter, clock.perf_counter
    try:
        exec(compile(readme_block("## Adding a metric"), "README.md", "exec"), namespace)
    finally:
        time.perf_counter = real
    records = [r for r in dm.read_jsonl(Path(root) / "runs/data_wait/metrics.jsonl") if r["kind"] == "train"]
    return {"records": records} if rank == 0 else {}


def test_the_adding_a_metric_example_runs_on_two_ranks_and_names_the_slow_rank(tmp_path):
    results = run_ranks(_run_adding_a_metric, 2, str(tmp_path))
    records = results[0]["records"]
    assert [r["step"] for r in records] == [10, 20]
    for record in records:
        assert record["data/wait_ms/max_rank"] == 1
        assert record["data/wait_ms"] == pytest.approx(SLOW_MS)  # per step, not per interval


ACCUMULATION_STEPS = 4


def _micro_batch_tokens(rank: int, step: int) -> list[int]:
    """Tokens of each of a rank's three micro-batches in a step: unequal within a step, across ranks and steps; a
    micro-batch without tokens (rank 0, step 2: its mean is NaN) and a rank's whole step without (rank 1, step 3)."""
    tokens = [0 if (rank, step, i) == (0, 2, 1) else 1 + (3 * rank + 5 * step + 7 * i) % 6 for i in range(3)]
    return [0, 0, 0] if (rank, step) == (1, 3) else tokens


def _run_gradient_accumulation(rank: int, world: int, root: str) -> dict:
    """The README's gradient-accumulation loop under DDP. Truth: each step's per-token losses in
    float64 from the weights the step starts with (read by the loader), gathered from every rank."""
    import types

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 1)

        def forward(self, mb):
            return types.SimpleNamespace(loss=self.proj(mb.x).pow(2).mean())

    torch.manual_seed(0)
    model = DistributedDataParallel(Model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sums = {}  # step → (Σ per-token loss, Σ tokens) of this rank

    def loader():
        for step in range(1, ACCUMULATION_STEPS + 1):
            g = torch.Generator().manual_seed(100 * rank + step)
            batches = [types.SimpleNamespace(x=torch.randn(n, 4, generator=g), n_tokens=n)
                       for n in _micro_batch_tokens(rank, step)]
            w, b = model.module.proj.weight.detach().double(), model.module.proj.bias.detach().double()
            sums[step] = (sum(float((mb.x.double() @ w.T + b).pow(2).sum()) for mb in batches),
                          sum(mb.n_tokens for mb in batches))
            yield batches

    config = quiet_config(log_interval=2, json_log=True, output_dir=root)
    namespace = {"model": model, "optimizer": optimizer, "loader": loader(), "total_steps": ACCUMULATION_STEPS,
                 "monitor": dm.Monitor(config, model=model, optimizer=optimizer)}
    exec(compile(readme_block("### Gradient accumulation"), "README.md", "exec"), namespace)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, sums)
    records = [r for r in dm.read_jsonl(Path(root) / "metrics.jsonl") if r["kind"] == "train"] if rank == 0 else []
    return {"sums": gathered, "records": records}


def test_the_gradient_accumulation_example_reports_the_token_weighted_mean_over_every_micro_batch(tmp_path):
    """The README said nothing of gradient accumulation, and the FSDP trainer reported the mean of its
    micro-batch means, which weighs a short micro-batch's tokens more."""
    result = run_ranks(_run_gradient_accumulation, 2, str(tmp_path))[0]
    records = result["records"]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        steps = (record["step"] - 1, record["step"])
        loss = sum(sums[step][0] for sums in result["sums"] for step in steps)
        tokens = sum(sums[step][1] for sums in result["sums"] for step in steps)
        assert record["train/loss"] == pytest.approx(loss / tokens, rel=1e-6), record["step"]
        assert "grad_norm" in record  # the clip after the last backward, outside no_sync(), is taken


_QUICKSTART_PRELUDE = """
import types
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 1)

    def forward(self, batch):
        return types.SimpleNamespace(loss=self.proj(batch).pow(2).mean())

torch.manual_seed(0)
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batch, total_steps, n_tokens_this_rank = torch.ones(2, 4), 20, 8
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
"""


def test_the_quickstart_runs_under_torchrun_with_the_shipped_config_and_writes_its_timers(tmp_path):
    """The quickstart's loop as it stands, under torchrun on 2 ranks, with the shipped
    configs/metrics.yaml: the level-1 timers it starts reach the records (with the shipped file's
    timing_log_level they would not), and the tokens of both ranks count."""
    import shutil
    import subprocess
    import sys

    import distmetrics as dm
    from tests.dist_utils import ROOT, free_port

    shutil.copytree(README.parent / "configs", tmp_path / "configs")
    script = tmp_path / "quickstart.py"
    script.write_text(_QUICKSTART_PRELUDE + readme_block("### Any training loop"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ":: step 20/20 [100.0%]" in run.stdout, run.stdout[-2000:]  # total_steps reaches the config: progress
    records = list(dm.read_jsonl(tmp_path / "runs/default/metrics.jsonl"))  # relative to the working directory
    assert records[0]["kind"] == "run" and records[0]["world_size"] == 2
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20]
    for record in train:
        assert {"timers/forward-backward", "timers/optimizer", "train/lr", "grad_norm"} <= set(record)
        assert record["train/consumed_tokens"] == 2 * 8 * record["step"]


def test_the_readme_console_line_is_what_the_console_sink_prints():
    from distmetrics.sinks.console import format_eval_line, format_timer_block, format_train_line

    text = README.read_text()
    train_line = next(line for line in text.splitlines() if line.startswith(":: step 20/40"))
    eval_line = next(line for line in text.splitlines() if line.startswith(">> eval step 20"))
    metrics = {"train/loss": 3.7944, "grad_norm": 0.6704, "train/lr": 2.07e-3, "train/tokens_per_sec": 13.6e3,
               "train/step_time_ms": 19.0, "train/eta_s": 0.38}
    assert format_train_line(metrics, 20, 40, last_loss=4.6349) == train_line
    block = text.splitlines()[text.splitlines().index(train_line) + 1:][:4]
    record = {"timers/forward-backward": 11.96, "timers/forward-backward/min": 11.93, "timers/optimizer": 3.95,
              "timers/optimizer/min": 3.53, "timers/step": 18.87, "timers/step/min": 18.50}  # the record's order
    # the demo's timers in the order made: the Monitor's step timer, then launch/train_fsdp.py's
    assert "\n".join(block) == format_timer_block(record, ("step", "forward-backward", "optimizer"))
    assert format_eval_line({"eval/loss": 3.5527, "eval/gap": -0.6620, "eval/ppl": 34.91,
                             "eval/tokens_per_sec": 13.2e3, "eval/time_ms": 39.0}, 20) == eval_line


def test_grad_norm_model_is_the_root_modules_own_parameters():
    """README, metric names: ``grad_norm/model`` covers the parameters registered on the model
    itself (here a positional embedding), not those of its children."""
    import torch

    import distmetrics as dm

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(3, 4))
            self.proj = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.proj(x + self.pos).sum()

    torch.manual_seed(0)
    model = Net()
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        model(torch.randn(3, 4)).backward()
        monitor.clip_grad_norm_(float("inf"))
        metrics = monitor.step(1)
    assert metrics["grad_norm/model"] == pytest.approx(float(model.pos.grad.double().norm()), rel=1e-6)
    children = (model.proj.weight.grad.double().pow(2).sum() + model.proj.bias.grad.double().pow(2).sum()).sqrt()
    assert metrics["grad_norm/proj"] == pytest.approx(float(children), rel=1e-6)


def _run_grad_scaler(rank: int, world: int, root: str) -> dict:
    """The README's torch.amp.GradScaler block under DDP with fp16 autocast, two steps. Truth: the
    scaled gradients in float64, read as ``unscale_`` is called, over the scale (its first, 65536)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm
    from tests.dist_utils import subtree_norms

    truths = []

    class Scaler(torch.amp.GradScaler):
        def unscale_(self, optimizer):
            squares = {n.removeprefix("module."): float(p.grad.double().pow(2).sum()) / self.get_scale() ** 2
                       for n, p in model.named_parameters()}
            truths.append(subtree_norms(squares))
            super().unscale_(optimizer)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                        torch.nn.Linear(16, 3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = quiet_config(log_interval=1, json_log=True, output_dir=root, log_update_norm=True)
    namespace = {"scaler": Scaler("cpu"), "optimizer": optimizer, "config": config,
                 "monitor": dm.Monitor(config, model=model, optimizer=optimizer)}
    for step in (1, 2, 3):
        data = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        with torch.autocast("cpu", dtype=torch.float16):  # step 3: the scaled gradients overflow fp16
            loss = model(data * (1e4 if step == 3 else 1.0)).float().pow(2).mean()
        namespace.update(step=step, loss=loss)
        exec(compile(readme_block("With torch's `torch.amp.GradScaler`"), "README.md", "exec"), namespace)
    namespace["monitor"].close()
    records = [r for r in dm.read_jsonl(Path(root) / "metrics.jsonl") if r["kind"] == "train"] if rank == 0 else []
    return {"truths": truths, "records": records}


def test_the_grad_scaler_example_measures_the_gradients_without_the_loss_scale(tmp_path):
    """torch.amp.GradScaler keeps the loss scale in the gradients until unscale_: measured before
    it, grad_norm is the scaled gradients' (65536 times too large). The README's order (unscale_,
    then the clip) gives every norm of the gradients without it, and the scale it records."""
    results = run_ranks(_run_grad_scaler, 2, str(tmp_path))
    *records, overflow = results[0]["records"]
    assert [r["step"] for r in records] == [1, 2] and overflow["step"] == 3
    # the scaler skipped step 3: its loss is not train/loss (it counted there, where skipped= was not given)
    assert overflow["loss_scale"] == 2.0 ** 15 and not math.isfinite(overflow["grad_norm"]), overflow
    assert "train/loss" not in overflow and overflow["health/skipped_steps"] == 1, overflow
    for record, truth, other in zip(records, results[0]["truths"], results[1]["truths"]):
        assert truth["total"] == pytest.approx(other["total"], rel=1e-12)  # DDP: the ranks hold one gradient
        assert record["grad_norm"] == pytest.approx(truth["total"], rel=1e-6)
        for module, value in truth["modules"].items():
            assert record[f"grad_norm/{module}"] == pytest.approx(value, rel=1e-6), module
        assert record["loss_scale"] == 2.0 ** 16 and record["update_norm"] > 0  # no step skipped


def test_without_a_clip_the_scalers_scale_says_which_steps_it_skipped(tmp_path):
    """README (GradScaler): measure_grad_norms() returns None at steps it does not log, so its norm cannot
    say skipped= there; the scale dropping at scaler.update() can. Step 3 (not logged at log_interval 2)
    overflows; truth: its loss left out of train/loss (steps 3 and 4's mean would hold 1e8 times more)."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    losses, norms = {}, {}
    with dm.Monitor(quiet_config(log_interval=2, json_log=True, output_dir=str(tmp_path)), model=model) as monitor:
        for step in range(1, 5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(6, 8) * (1e4 if step == 3 else 1.0)).float().pow(2).mean()
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norms[step] = monitor.measure_grad_norms()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            losses[step] = float(loss)
            monitor.step(step, loss=loss.detach(), skipped=scaler.get_scale() < before)
    assert norms[3] is None and norms[4] is not None  # no norm at step 3 to read the skip from
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert record["step"] == 4 and record["health/skipped_steps"] == 1
    assert record["train/loss"] == pytest.approx(losses[4], rel=1e-6)


def test_the_config_reference_has_one_one_line_row_per_key_with_the_configs_default():
    """The README's config table against ``MetricsConfig``'s own fields: each row one line (a row's text
    broken over two lines renders as two rows, the second a key that does not exist), every field named,
    no key the config lacks, each default as the dataclass gives it."""
    import dataclasses

    from distmetrics.config import MetricsConfig

    text = README.read_text()
    section = text[text.index("## Configuration reference"):text.index("## Metric names")]
    table = section[section.index("| key | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    assert table and all(line.startswith("| `") and line.endswith(" |") for line in table), [
        line[:80] for line in table if not (line.startswith("| `") and line.endswith(" |"))]
    documented = {}
    for line in table:
        keys, default = (cell.strip() for cell in line.split(" | ")[:2])
        for key in re.findall(r"`([^`]+)`", keys):
            documented[key] = default.strip("`")
    fields = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
              for f in dataclasses.fields(MetricsConfig)}
    assert set(documented) - {"tensor_inspect.*"} == set(fields) - {"tensor_inspect"}
    for key, default in documented.items():
        if key != "tensor_inspect.*":
            given = fields[key]
            expected = {None: "null", True: "true", False: "false"}.get(given, given) if not isinstance(
                given, (int, float)) or isinstance(given, bool) else given
            written = default if isinstance(expected, str) else float(default)
            assert written == expected, (key, default, given)
