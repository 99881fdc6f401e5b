"""Lightning Fabric (``lightning`` 2.6, installed with the dev extras) on 2 real gloo ranks: the
README's block under its ``DDPStrategy`` and its FSDP2 ``ModelParallelStrategy``, gradient
accumulation as Fabric's docs write it (``fabric.no_backward_sync(model, enabled=accumulating)``),
the Monitor given what ``setup_module`` and ``setup_optimizers`` return. Truth: the same steps in
float64 on one full copy of the model, from every rank's micro-batches."""

from __future__ import annotations

import pytest

from tests.dist_utils import quiet_config, run_ranks

ACCUMULATE = 3
STEPS = 3
LR = 0.1


def _layers():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 2))


def _micro_batches(step: int, rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(4 + i, 8, generator=g) for i in range(ACCUMULATE)]  # unequal, as the loss weighs them


def _truth(world: int) -> list:
    """Per step: the float64 gradient norms (total and per module) and the train loss, then the SGD step."""
    import torch

    torch.manual_seed(0)
    ref = _layers().double()
    out = []
    for step in range(1, STEPS + 1):
        ref.zero_grad()
        loss = sum(ref(x.double()).pow(2).mean() / ACCUMULATE
                   for rank in range(world) for x in _micro_batches(step, rank)) / world
        loss.backward()
        modules = {name: float(torch.cat([p.grad.flatten() for p in m.parameters()]).norm())
                   for name, m in ref.named_children() if any(True for _ in m.parameters())}
        total = float(torch.cat([p.grad.flatten() for p in ref.parameters()]).norm())
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
        out.append({"grad_norm": total, "modules": modules, "loss": float(loss.detach()), "update_norm": LR * total,
                    "param_norm": float(torch.cat([p.detach().flatten() for p in ref.parameters()]).norm())})
    return out


def _fabric_run(rank: int, world: int, root: str) -> dict:
    """The README's Lightning Fabric block, as it stands, under each strategy; its records read back."""
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm
    from tests.test_readme import readme_block

    def parallelize(model, mesh):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    out = {}
    for name in ("ddp", "fsdp2", "fsdp2_early"):  # early: the optimizer made from the parameters before setup
        strategy = (DDPStrategy() if name == "ddp" else
                    ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1))
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = _layers()
        before = list(model.parameters())
        folder = Path(root) / name

        def make_optimizer(parameters):
            return torch.optim.SGD(before if name == "fsdp2_early" else parameters, lr=LR)

        namespace = {"fabric": fabric, "model": model, "make_optimizer": make_optimizer, "dm": dm,
                     "total_steps": STEPS, "max_norm": 1e9,
                     "config": quiet_config(log_interval=1, log_update_norm=True, log_params_norm=True,
                                            json_log=True, output_dir=str(folder)),
                     "loader": iter([_micro_batches(step, rank) for step in range(1, STEPS + 1)]),
                     "compute_loss": lambda model, mb: model(mb).pow(2).mean()}
        exec(compile(readme_block("### Lightning Fabric"), "README.md", "exec"), namespace)
        if rank == 0:
            out[name] = [r for r in dm.read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"]
        model = namespace["model"]  # Fabric's: a measurement after an accumulating micro-batch is refused
        monitor = dm.Monitor(quiet_config(log_interval=1), model=model, optimizer=namespace["optimizer"])
        with fabric.no_backward_sync(model, enabled=True):
            fabric.backward(model(_micro_batches(1, rank)[0]).pow(2).mean())
        try:
            monitor.clip_grad_norm_(1.0)
        except ValueError as err:
            out[f"{name}_refused"] = str(err)
        monitor.close()
    return out


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    return run_ranks(_fabric_run, 2, str(tmp_path_factory.mktemp("fabric")), timeout=240)[0], _truth(2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_fabric_loop_with_accumulation_is_measured_exactly_under_the_models_own_names(fabric_runs, strategy):
    """The names were ``grad_norm/_forward_module.0``: Fabric's wrapper holds the model twice, so it
    was not taken for a wrapper level."""
    runs, truth = fabric_runs
    assert [r["step"] for r in runs[strategy]] == list(range(1, STEPS + 1))
    for record, want in zip(runs[strategy], truth):
        for key in ("grad_norm", "update_norm", "param_norm"):
            assert record[key] == pytest.approx(want[key], rel=1e-6), (record["step"], key)
        assert record["train/loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert {k for k in record if k.startswith("grad_norm/")} == {f"grad_norm/{m}" for m in want["modules"]}
        for module, value in want["modules"].items():
            assert record[f"grad_norm/{module}"] == pytest.approx(value, rel=1e-6), (record["step"], module)


def test_under_fsdp2_an_optimizer_made_before_setup_moves_nothing_and_its_update_norm_says_so(fabric_runs):
    """README: an optimizer made from the parameters FSDP2 replaced steps nothing the model uses."""
    runs, truth = fabric_runs
    records = runs["fsdp2_early"]
    assert [r["update_norm"] for r in records] == [0.0] * STEPS
    assert len({r["param_norm"] for r in records}) == 1  # the model's parameters never moved
    assert records[0]["grad_norm"] == pytest.approx(truth[0]["grad_norm"], rel=1e-6)


def test_a_measurement_inside_fabrics_no_backward_sync_is_refused(fabric_runs):
    runs, _ = fabric_runs
    assert "ran its last forward inside no_sync()" in runs["ddp_refused"], runs.get("ddp_refused")
    assert "holds gradients that its last backward did not reduce" in runs["fsdp2_refused"], runs.get("fsdp2_refused")
