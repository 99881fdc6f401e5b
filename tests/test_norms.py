"""Grad, param and update norms on real gloo ranks, against float64 ground truth computed from
the full, unsharded tensors (DTensor ``full_tensor()``, Megatron TP all-gather along
``partition_dim``), never from the ownership weights under test.

Layouts: DDP, FSDP2, HSDP (replicate × shard), FSDP2 + TP on a 2-D mesh, FSDP2 on the blocks only
beside the root's plain layers (4 ranks, one spawn); current torchtitan's meshes, unflattened from a 1-D
world mesh: FSDP2 + TP, FSDP2 inside a dp dimension, pipeline stages (4 ranks, one spawn);
Megatron-Core TP=2 × DP=2 with ``main_grad``, Megatron PP=2 × TP=2 with a tied embedding, and
mixtures of experts over EP=2 with and without expert tensor parallelism (4 ranks, one spawn); a
model split by hand over PP=2 × DP=2, each stage numbering its own layers (4 ranks, one spawn).
"""

import json
import math
import zlib
from pathlib import Path

import pytest

from tests.dist_utils import quiet_config, run_ranks, squares_by_name, subtree_norms

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-6
MAX_NORM = 0.05  # small, so clipping really scales


# --- a small model for the DTensor layouts -----------------------------------------------------

def _net():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, d=16, n=3):
            super().__init__()
            self.inp = nn.Linear(8, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.out = nn.Linear(d, 3)  # 3 rows over 4 shards: one rank holds an empty shard

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    torch.manual_seed(0)
    return Net()


def _strip(name: str) -> str:
    for prefix in ("module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def _full(t):
    import torch

    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().to(torch.float64).clone()


def _truth(named: dict) -> dict:
    """{"total": ‖·‖, "modules": {module: ‖·‖}} from full float64 tensors keyed by global name:
    every module's whole subtree (the recipe users copy: for each named module, the norm of all
    parameters below it); the root's own parameters are "model"."""
    return subtree_norms({name: float(t.pow(2).sum()) for name, t in named.items()})


def _measure_layout(model, optimizer, data, monitor_group=None, mesh=None, tokens=None):
    """One real step; returns truth and what the monitor reported, for rank 0 to compare."""
    import distmetrics as dm

    cfg = quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True, log_throughput=tokens is not None)
    monitor = dm.Monitor(cfg, model=model, optimizer=optimizer, device_mesh=mesh)
    loss = model(data).pow(2).mean()
    loss.backward()
    grads = {_strip(n): _full(p.grad) for n, p in model.named_parameters()}
    before = {_strip(n): _full(p) for n, p in model.named_parameters()}
    truth_grad = _truth(grads)
    total = monitor.clip_grad_norm_(MAX_NORM)
    coef = min(1.0, MAX_NORM / (truth_grad["total"] + 1e-6))
    clipped = {_strip(n): _full(p.grad) for n, p in model.named_parameters()}
    clip_error = max(float((clipped[n] - grads[n] * coef).abs().max()) for n in grads)
    optimizer.step()
    after = {_strip(n): _full(p) for n, p in model.named_parameters()}
    metrics = monitor.step(1, loss=loss.detach(), tokens=tokens)
    monitor.close()
    return {
        "grad": truth_grad,
        "param": _truth(after),
        "update": _truth({n: after[n] - before[n] for n in after}),
        "returned_total": float(total),
        "clip_error": clip_error,
        "clip_scale": max(float(g.abs().max()) for g in grads.values()) * coef,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))},
    }


def _dtensor_layouts(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    out = {}
    gen = torch.Generator().manual_seed(100 + rank)
    data = torch.randn(6, 8, generator=gen)

    # DDP: replicated gradients, counted once.
    model = DistributedDataParallel(_net())
    out["ddp"] = _measure_layout(model, torch.optim.SGD(model.parameters(), lr=0.1), data)

    def sharded(mesh):
        model = _net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    # FSDP2 on a 1-D mesh of 4; HSDP on replicate × shard.
    for layout, mesh in (("fsdp2", init_device_mesh("cpu", (world,))),
                         ("hsdp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))):
        model = sharded(mesh)
        out[layout] = _measure_layout(model, torch.optim.AdamW(model.parameters(), lr=0.01), data)

    # Between log steps, with every norm and timer on: no collective but the clip's one all-reduce,
    # and no .item() (timers, clip, optimizer step, monitor.step; FSDP2's own collectives in forward
    # and backward are not counted).
    from tests.dist_utils import CollectiveCounter

    model = sharded(init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    monitor = dm.Monitor(quiet_config(log_interval=3, log_params_norm=True, log_update_norm=True,
                                      timing_log_level=2), model=model, optimizer=optimizer)
    counts = []
    for step in range(1, 7):
        with monitor.timers("forward-backward", log_level=1):
            model(data).pow(2).mean().backward()
        with CollectiveCounter() as clip:
            monitor.clip_grad_norm_(MAX_NORM)
        with CollectiveCounter() as rest:
            with monitor.timers("optimizer", log_level=1):
                optimizer.step()
                optimizer.zero_grad()
            monitor.step(step, loss=1.0, tokens=6)
        counts.append((step, clip.collectives, clip.items, rest.collectives, rest.items))
    monitor.close()
    out["counted"] = counts

    # FSDP2 + TP on a dp × tp mesh; LayerNorms are replicated over tp.
    mesh_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _net()
    for block in model.blocks:
        parallelize_module(block, mesh_tp["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(block, mesh=mesh_tp["dp"])
    fully_shard(model, mesh=mesh_tp["dp"])
    dp_rank = mesh_tp.get_local_rank("dp")
    tp_data = torch.randn(6, 8, generator=torch.Generator().manual_seed(200 + dp_rank))
    out["fsdp2_tp"] = _measure_layout(model, torch.optim.AdamW(model.parameters(), lr=0.01), tp_data,
                                      mesh=mesh_tp)

    out.update(_blocks_sharded_root_plain(rank, world, data))

    # Pipeline stages on a pp × dp mesh with plain parameters (torch.distributed.pipelining holds
    # them so), each stage's replicated over dp by DDP: stage s holds layers.s under its global name.

    mesh_pp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh_pp.get_local_rank("pp"), mesh_pp.get_local_rank("dp")
    torch.manual_seed(500 + pp_rank)  # the same stage weights on its dp replicas
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict({str(pp_rank): torch.nn.Linear(8, 8)})
    model = DistributedDataParallel(stage.layers[str(pp_rank)], process_group=mesh_pp.get_group("dp"))
    monitor = dm.Monitor(quiet_config(log_interval=1), model=stage, device_mesh=mesh_pp)
    model(torch.randn(6, 8, generator=torch.Generator().manual_seed(600 + rank))).pow(2).mean().backward()
    squares = {(name, 0): float(p.grad.to(torch.float64).pow(2).sum()) for name, p in stage.named_parameters()}
    truth = subtree_norms(squares_by_name(squares, world))
    returned = float(monitor.clip_grad_norm_(math.inf))
    out["pp_plain"] = {"truth": truth, "returned": returned, "metrics": monitor.step(1)}
    monitor.close()
    dist.barrier()
    return out


def _blocks_sharded_root_plain(rank: int, world: int, data) -> dict:
    """``fully_shard`` on the blocks only: the root's own layers (``inp``, ``out``) stay plain tensors
    on every rank. Where the loop averages their gradients itself (a hook after accumulation), the
    norms are measured without and with the mesh given to ``fully_shard`` (unnamed) as ``device_mesh``,
    and a Monitor's clips counted for host reads; where it does not, or one rank's differ by 1e-4 of one
    tensor, every rank must refuse: under a Monitor at its log step, without one at the call."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def average(param) -> None:  # the loop's own data-parallel mean of a gradient nothing else reduces
        dist.all_reduce(param.grad)
        param.grad.div_(world)

    def blocks_only(averaged: bool):
        model = _net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        for p in model.parameters():
            if averaged and not hasattr(p, "device_mesh"):
                p.register_post_accumulate_grad_hook(average)
        return model

    out = {}
    for case, given in (("blocks_only", None), ("blocks_only_mesh_given", mesh)):
        model = blocks_only(averaged=True)
        out[case] = _measure_layout(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, mesh=given)
    out["blocks_only_refused"] = {case: _refused_under_a_monitor(blocks_only, case, rank, data) for case in _REFUSED}
    out["blocks_only_refused_at_close"] = _refused_at_close(blocks_only(averaged=False), rank, data)
    out["blocks_only_refused_at_the_call"] = {case: _refused_at_the_call(blocks_only, case, rank, data)
                                              for case in _REFUSED}
    out["blocks_only_host_reads"] = _host_reads_at_the_clips(blocks_only(averaged=True), data)
    return out


_REFUSED = ("own gradients, p=2", "own gradients, p=inf", "one tensor 1e-4 off on rank 1, first step only")


def _gradients(model, case: str, rank: int, data, step: int = 1) -> list:
    """Backward on this rank's ``data``, each rank's plain gradients made to differ as ``case`` says
    (its own where ``model`` does not average them, or rank 1's ``out.bias`` 1e-4 off at step 1);
    returns copies of this rank's pieces of the gradients as they are before any clip."""
    model.zero_grad()
    model(data).pow(2).mean().backward()
    if case.startswith("one") and rank == 1 and step == 1:
        model.out.bias.grad.mul_(1 + 1e-4)
    return [_local(p.grad).clone() for p in model.parameters()]


def _local(grad):
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _scaled(model, before: list) -> bool:
    return any(not _local(p.grad).equal(b) for p, b in zip(model.parameters(), before))


def _refused_under_a_monitor(blocks_only, case: str, rank: int, data) -> dict:
    """Two steps at ``log_interval: 2`` under a Monitor: where each step's clip, the log step's
    ``monitor.step``, raised (the error's text), whether each clip scaled, and the record written."""
    import distmetrics as dm

    model = blocks_only(averaged=not case.startswith("own"))
    norm_type = math.inf if case.endswith("inf") else 2.0
    said = {"raised at": None, "scaled": []}
    with dm.Monitor(quiet_config(log_interval=2), model=model) as monitor:
        try:
            for step in (1, 2):
                said["raised at"] = f"clip {step}"
                before = _gradients(model, case, rank, data, step)
                monitor.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
                said["scaled"].append(_scaled(model, before))
                said["raised at"] = f"monitor.step({step})"
                monitor.step(step, loss=1.0)
            said["raised at"] = None
        except ValueError as err:
            said["error"] = str(err)
        said["record"] = dict(monitor.last_metrics)
    return said


def _refused_at_close(model, rank: int, data) -> dict:
    """One step of each rank's own plain gradients before ``close()``, which writes the interval's record."""
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=10), model=model)
    _gradients(model, "own gradients", rank, data)
    monitor.clip_grad_norm_(MAX_NORM)
    monitor.step(1, loss=1.0)
    try:
        monitor.close()
        error = "no error"
    except ValueError as err:
        error = str(err)
    return {"error": error, "record": sorted(monitor.last_metrics)}


def _refused_at_the_call(blocks_only, case: str, rank: int, data) -> dict:
    """``distmetrics.clip_grad_norm_`` (no Monitor) on the same gradients: its error, and whether it scaled."""
    import distmetrics as dm

    model = blocks_only(averaged=not case.startswith("own"))
    before = _gradients(model, case, rank, data)
    try:
        dm.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=math.inf if case.endswith("inf") else 2.0)
        error = "no error"
    except ValueError as err:
        error = str(err)
    return {"error": error, "scaled": _scaled(model, before)}


def _host_reads_at_the_clips(model, data) -> dict:
    """Reads of a tensor's value on the host during each of three Monitor clips of averaged (agreeing)
    plain gradients beside FSDP2 shards, with the measurements taken as on a GPU under NCCL (``on_host``
    False: a CPU measurement may read its values, which waits for nothing; and no lanes of a collective on
    the host, gloo's, which the dtypes' and the steps' ride), and the record ``close()`` writes."""
    from distmetrics import grad_norm
    from distmetrics.grad_dtypes import GradDtypes
    from tests.dist_utils import HostReads

    import distmetrics as dm

    combine, carried = grad_norm._combine, GradDtypes.carried

    def as_on_a_gpu(*args, **kwargs):
        kwargs["tensors"] = None  # given on the CPU only, where reading a count waits for nothing
        measured = combine(*args, **kwargs)
        measured.on_host = False
        return measured

    reads, grad_norm._combine, GradDtypes.carried = [], as_on_a_gpu, staticmethod(lambda group: False)
    try:
        with dm.Monitor(quiet_config(log_interval=10), model=model) as monitor:
            for step in (1, 2, 3):
                model.zero_grad()
                model(data).pow(2).mean().backward()
                with HostReads() as counted:
                    monitor.clip_grad_norm_(MAX_NORM)
                reads.append(counted.reads)
                monitor.step(step, loss=1.0)
        return {"reads": reads, "record": sorted(monitor.last_metrics)}
    except ValueError as err:
        return {"reads": reads, "error": str(err)}
    finally:
        grad_norm._combine, GradDtypes.carried = combine, carried


@pytest.fixture(scope="module")
def dtensor_results():
    return run_ranks(_dtensor_layouts, 4, timeout=300)


def test_pipeline_stages_with_plain_parameters_on_a_mesh_count_every_stage_once(dtensor_results):
    """pp × dp mesh, plain parameters per stage (DDP over dp): every stage's parameters count, on
    its dp rank 0 (before, only global rank 0's stage counted: the norm and the clip were stage 0's
    and layers.1 was missing)."""
    for rank_result in dtensor_results:
        r = rank_result["pp_plain"]
        assert r["returned"] == pytest.approx(r["truth"]["total"], rel=REL)
        assert r["metrics"]["grad_norm"] == pytest.approx(r["truth"]["total"], rel=REL)
        for module, value in r["truth"]["modules"].items():
            assert r["metrics"][f"grad_norm/{module}"] == pytest.approx(value, rel=REL), module


def _hand_split_stages(rank: int, world: int, out: str) -> dict:
    """A model split by hand over 2 pipeline stages × 2 data-parallel ranks, each stage its own module
    with its own ``layers`` ModuleList (``layers.0`` and ``layers.1`` on both stages: different modules of
    one name), the loop averaging each stage's gradients over its dp ranks, one SGD step: given the pp × dp
    mesh, then given no mesh. Truth: float64 norms of every stage's full gradients, parameters after the
    step and updates, gathered from each stage's first dp rank."""
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp_group = mesh.get_local_rank("pp"), mesh.get_group("dp")

    def build() -> torch.nn.Module:
        torch.manual_seed(700 + stage)  # the same weights on the stage's dp ranks
        model = torch.nn.Module()
        if stage == 0:
            model.embed = torch.nn.Linear(4, 8)
        model.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        if stage == 1:
            model.norm = torch.nn.LayerNorm(8)
            model.head = torch.nn.Linear(8, 2)
        return model

    def train(model, monitor, optimizer) -> None:
        h = torch.randn(6, 4 if stage == 0 else 8, generator=torch.Generator().manual_seed(800 + rank))
        for child in model.children():
            h = torch.stack([layer(h) for layer in child]).sum(0) if isinstance(child, torch.nn.ModuleList) \
                else child(h)
        h.pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= 2
        monitor.clip_grad_norm_(1e9)
        optimizer.step()

    heard: list = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    model = build()
    before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True, json_log=True, output_dir=out)
    with dm.Monitor(config, model=model, optimizer=optimizer, device_mesh=mesh) as monitor:
        train(model, monitor, optimizer)
        metrics = monitor.step(1, loss=1.0)
    logging.getLogger("distmetrics").removeHandler(handler)
    mine = {f"stage{stage}.{name}": (p.grad.double(), p.detach().double(), p.detach().double() - before[name])
            for name, p in model.named_parameters()} if mesh.get_local_rank("dp") == 0 else {}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    full = {name: tensors for pieces in gathered for name, tensors in pieces.items()}
    truth = {family: subtree_norms({name: float(tensors[i].pow(2).sum()) for name, tensors in full.items()})
             for i, family in enumerate(("grad_norm", "param_norm", "update_norm"))}

    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with dm.Monitor(quiet_config(log_interval=1), model=model, optimizer=optimizer) as monitor:
            train(model, monitor, optimizer)
            monitor.step(1, loss=1.0)
        error = "no error"
    except ValueError as err:
        error = str(err)
    said = [message for message in heard if "both hold a module named" in message]
    return {"metrics": metrics, "truth": truth, "said": said, "no mesh": error}


def test_modules_of_one_name_on_different_pipeline_stages_are_named_with_their_stage(tmp_path):
    """Stages built by hand each number their own ``layers`` from 0: ``grad_norm/layers.0`` was the
    root-sum-square of stage 0's and stage 1's ``layers.0``, different modules (``param_norm/`` and
    ``update_norm/`` alike, one entry in the run record), unsaid. Every module's name now starts with its
    stage, each equal to float64 truth, and one warning on the job's first rank names an example; given
    no mesh, the refusal says that pipeline stages need ``device_mesh=`` with a ``pp`` dimension or
    Megatron's ``parallel_state``."""
    results = run_ranks(_hand_split_stages, 4, str(tmp_path), timeout=180)
    for rank, result in enumerate(results):
        metrics, truth = result["metrics"], result["truth"]
        for family, expected in truth.items():
            assert metrics[family] == pytest.approx(expected["total"], rel=REL), (rank, family)
            assert {k.split("/", 1)[1] for k in metrics if k.startswith(f"{family}/")} == set(expected["modules"])
            for module, value in expected["modules"].items():
                assert metrics[f"{family}/{module}"] == pytest.approx(value, rel=1e-5), (rank, family, module)
        assert "stage0.layers.0" in truth["grad_norm"]["modules"] and "grad_norm/layers.0" not in metrics
        assert len(result["said"]) == (rank == 0), (rank, result["said"])
        message = result["no mesh"]
        assert "hold gradients of different plain" in message, (rank, message)
        assert "device_mesh=" in message and "'pp'" in message and "parallel_state" in message, (rank, message)
    assert "'layers.0'" in results[0]["said"][0] and "'stage1.layers.0'" in results[0]["said"][0]
    run = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert run["kind"] == "run" and run["modules"] == [
        "stage0", "stage0.model", "stage0.embed", "stage0.layers", "stage0.layers.0", "stage0.layers.1",
        "stage1", "stage1.model", "stage1.layers", "stage1.layers.0", "stage1.layers.1", "stage1.norm", "stage1.head"]


def _whole_model_with_the_other_stage_frozen(rank: int, world: int) -> dict:
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    heard: list = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for name, param in model.named_parameters():  # stage 0 trains modules 0 and 1, stage 1 module 2
        param.requires_grad_(name.startswith(("0.", "1.")) == (rank == 0))
        param.grad = torch.full_like(param, 0.5) if param.requires_grad else None
    with dm.Monitor(quiet_config(log_interval=1), model=model, device_mesh=mesh) as monitor:
        monitor.clip_grad_norm_(1e9)
        metrics = monitor.step(1, loss=1.0)
    return {"names": sorted(k for k in metrics if k.startswith("grad_norm/")),
            "said": [message for message in heard if "both hold" in message]}


def test_stages_holding_the_whole_model_with_the_others_modules_frozen_keep_their_names():
    """Each stage builds the whole model (global names) and freezes the other stage's modules: frozen
    parameters are in no norm, so nothing merges, yet they were counted as held and every name got a
    stage prefix, with a warning of different modules of one name."""
    for result in run_ranks(_whole_model_with_the_other_stage_frozen, 2, timeout=120):
        assert result == {"names": ["grad_norm/0", "grad_norm/1", "grad_norm/2"], "said": []}, result


def test_between_log_steps_nothing_crosses_ranks_and_a_clip_is_one_all_reduce(dtensor_results):
    """The README's claims, with FSDP2 on 4 ranks and per-module, parameter and update norms and
    level-2 timers on: a clip makes one all-reduce and no .item() (the first one more, which checks
    that every rank passes the same norm type); the rest of a step that is not a log step (timers,
    optimizer step, monitor.step) makes none of either."""
    for rank, result in enumerate(dtensor_results):
        counted = result["counted"]
        assert [(c[1], c[2]) for c in counted] == [(2, 0)] + [(1, 0)] * 5, (rank, counted)
        assert [(c[3], c[4]) for c in counted if c[0] % 3] == [(0, 0)] * 4, (rank, counted)
        assert all(c[3] > 0 for c in counted if c[0] % 3 == 0), (rank, counted)  # log steps reduce


def _check(result: dict, per_module_names: set | None = None) -> None:
    m = result["metrics"]
    assert m["grad_norm"] == pytest.approx(result["grad"]["total"], rel=REL)
    assert result["returned_total"] == pytest.approx(result["grad"]["total"], rel=REL)
    for module, value in result["grad"]["modules"].items():
        assert m[f"grad_norm/{module}"] == pytest.approx(value, rel=REL, abs=1e-12), module
    assert m["param_norm"] == pytest.approx(result["param"]["total"], rel=REL)
    for module, value in result["param"]["modules"].items():
        assert m[f"param_norm/{module}"] == pytest.approx(value, rel=REL), module
    assert m["update_norm"] == pytest.approx(result["update"]["total"], rel=REL)
    for module, value in result["update"]["modules"].items():
        assert m[f"update_norm/{module}"] == pytest.approx(value, rel=1e-5, abs=1e-12), module
    assert m["relative_update_norm"] == pytest.approx(result["update"]["total"] / result["param"]["total"], rel=1e-5)
    clipped_total = min(result["grad"]["total"], MAX_NORM)
    assert m["effective_lr_ratio"] == pytest.approx(result["update"]["total"] / clipped_total, rel=1e-4)
    assert m["grad_clip_ratio"] == pytest.approx(result["grad"]["total"] / MAX_NORM, rel=REL)
    assert m["grad_nonfinite"] == 0
    # clipping left the same gradients as clipping the full model (relative to their scale)
    assert result["clip_error"] <= 1e-6 * result["clip_scale"]
    reported = {k.split("/", 1)[1] for k in m if k.startswith("grad_norm/")}
    assert reported == set(result["grad"]["modules"])


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "hsdp", "fsdp2_tp"])
def test_norms_are_exact_under_dtensor_and_ddp_layouts(dtensor_results, layout):
    for rank_result in dtensor_results:
        _check(rank_result[layout])


@pytest.mark.parametrize("layout", ["blocks_only", "blocks_only_mesh_given"])
def test_norms_are_exact_with_fully_shard_on_the_blocks_only_and_the_roots_layers_plain(dtensor_results, layout):
    """Gradient (total, returned, every module), parameter and update norms and the clip equal float64
    truth from the full tensors on every rank, also with the unnamed mesh given as ``device_mesh``
    (before, each rank took itself for data-parallel rank 0 there and counted the plain layers 4 times)."""
    for rank_result in dtensor_results:
        _check(rank_result[layout])


_PLAIN = ("the gradients of the plain (not sharded) parameters 'inp.weight', 'inp.bias', 'out.weight', 'out.bias' "
          "(this rank's; one or more of them) differ across ranks")  # one fingerprint of them all: which is not known


def test_plain_gradients_that_differ_across_ranks_beside_fsdp2_shards_are_refused_on_every_rank(dtensor_results):
    """Gradients of the root's plain layers left as each rank's own (nothing reduces them), or one
    tensor 1e-4 off on one rank at the first of two steps: each rank's true norm differs, so under a
    Monitor every rank raises at the log step (``log_interval: 2``; none waits, the clips waited for no
    device), or at ``close()`` for the interval it writes, naming the plain parameters, once the record
    is written without the gradient norms that would be one rank's (the loss is in it); the clips scaled
    as usual."""
    for rank, rank_result in enumerate(dtensor_results):
        for case in _REFUSED:
            said = rank_result["blocks_only_refused"][case]
            assert said["raised at"] == "monitor.step(2)", (rank, case, said)
            message = said["error"]
            assert message.startswith(f"monitor.clip_grad_norm_: {_PLAIN}"), (rank, case, message)
            assert "all-reduce their gradients over the data-parallel ranks" in message
            assert "Found at the log step of step 2" in message, message
            assert said["scaled"] == [True, True], (rank, case)
            record = said["record"]
            assert record["train/loss"] == 1.0 and record["grad_nonfinite"] == 0, (rank, case, record)
            one_ranks = [k for k in record if k.startswith(("grad_norm", "grad_clip_ratio", "effective_lr_ratio"))]
            assert one_ranks == [], (rank, case, one_ranks)
            assert not [k for k in record if k.startswith("_")], (rank, case, record)
        said = rank_result["blocks_only_refused_at_close"]  # the interval close() writes is checked alike
        assert said["error"].startswith(f"monitor.clip_grad_norm_: {_PLAIN}"), (rank, said)
        assert "Found at the log step of step 1" in said["error"], (rank, said)
        assert "train/loss" in said["record"] and "grad_norm" not in said["record"], (rank, said)


def _plain_models_of_their_own(rank: int, world: int, case: str, out: str) -> dict:
    """A plain model (no DDP, no DTensor) under a Monitor on 2 ranks, clipped at every step, log_interval 2:
    ``own``, each rank's own weights and batches; ``stages``, each rank a pipeline stage of its own, no
    mesh given; ``ddp``, the same model under DDP. Truth: each rank's float64 norm."""
    import torch

    import distmetrics as dm

    torch.manual_seed(rank if case != "ddp" else 0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    if case == "stages":
        model = model[rank]  # stage r holds layer r: names '0.weight' ... differ too
    if case == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    if case == "ddp unfrozen":  # frozen when DDP is made, unfrozen after: DDP does not reduce its gradients
        model[0].requires_grad_(False)
        model = torch.nn.parallel.DistributedDataParallel(model)
        model.module[0].requires_grad_(True)
    returned, truth, error = [], [], None
    try:
        with dm.Monitor(quiet_config(log_interval=2, output_dir=f"{out}/{case}", json_log=True), model=model) as m:
            for step in (1, 2):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).pow(2).mean().backward()
                truth.append(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()) ** 0.5)
                returned.append(float(m.clip_grad_norm_(1e9)))
                m.step(step, loss=1.0)
                model.zero_grad()
    except ValueError as err:
        error = str(err)
    return {"returned": returned, "truth": truth, "error": error}


@pytest.mark.parametrize("case", ["own", "stages", "ddp", "ddp unfrozen"])
def test_plain_gradients_that_differ_across_ranks_of_a_plain_model_are_refused_at_the_log_step(case, tmp_path):
    """Plain gradients with no DTensor beside them were taken for replicas unchecked: a rank training a model
    of its own, or a pipeline stage given no mesh, had rank 0's norm written as the job's and every rank's
    clip scaled by it (rank 1 returned rank 0's norm). Under a Monitor they are checked as beside FSDP2's
    shards: every rank raises at the log step, once the record is written without the gradient norms; DDP's
    replicas pass, exact."""
    results = run_ranks(_plain_models_of_their_own, 2, case, str(tmp_path), timeout=120)
    if case == "ddp":
        for out in results:
            assert out["error"] is None and out["returned"] == pytest.approx(out["truth"], rel=REL), out
        return
    for out in results:
        assert out["error"] is not None and "differ across ranks" in out["error"], out
        assert "Found at the log step of step 2" in out["error"], out
        # the cause, where the model was unfrozen under DDP, is said (the message named fully_shard and hooks)
        assert "one frozen then and unfrozen since keeps each rank's gradient" in out["error"], out
        assert "and so does one of a module added since (an adapter)" in out["error"], out  # a LoRA added after DDP
    record = [json.loads(line) for line in (tmp_path / case / "metrics.jsonl").read_text().splitlines()][-2]
    assert record["step"] == 2 and record["train/loss"] == 1.0 and "grad_norm" not in record, record


def _a_gradient_on_some_ranks_only(rank: int, world: int, out: str) -> dict:
    """Replicas of which rank 0 alone holds no gradient of one plain parameter (its ``.grad`` set to None):
    under a Monitor, a DDP model without ``0.weight``'s, refused at the log step; ``distmetrics.clip_grad_norm_``
    of FSDP2 on the blocks beside the root's plain layers without ``out.bias``'s (the same batch on every
    rank: the plain gradients agree), at norm types 2, inf and -inf, refused at the call."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    said = {}
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    # rank 0 without 0.weight's gradient; then (a tie) as many on both ranks, of different parameters
    for case, without in (("monitor", [0] if rank == 0 else []), ("tie", [rank])):
        folder = "ddp" if case == "monitor" else case
        with dm.Monitor(quiet_config(log_interval=1, output_dir=f"{out}/{folder}", json_log=True), model=model) as m:
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
            for index in without:
                model.module[index].weight.grad = None
            m.clip_grad_norm_(1e9)
            try:
                m.step(1, loss=1.0)
                said[case] = "no error"
            except ValueError as err:
                said[case] = str(err)
    mesh = init_device_mesh("cpu", (world,))
    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(100))
    for p in (2.0, math.inf, -math.inf):
        model = _net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        before = _gradients(model, "same batch", rank, data)
        if rank == 0:
            model.out.bias.grad = None
        try:
            dm.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=p)
            said[p] = "no error"
        except ValueError as err:
            said[p] = str(err)
        said[f"unscaled, p={p}"] = all(q.grad is None or torch.equal(_local(q.grad), g)
                                       for q, g in zip(model.parameters(), before))
    return said


def test_plain_gradients_of_different_parameters_across_ranks_are_refused_saying_which(tmp_path):
    """Rank 0 without one plain parameter's gradient (its ``.grad`` None there alone) was refused as gradients
    that "differ across ranks", naming every plain parameter, with advice on averaging them. A fingerprint of
    which parameters hold a gradient rides the same all-reduce: every rank says the ranks hold gradients of
    different parameters, how many (under a Monitor, which rank holds the most and the fewest), and the rank
    without it names it; ``distmetrics.clip_grad_norm_`` raises at the call, before scaling, for every norm
    family (a sum's lanes, a max's, a min's)."""
    results = run_ranks(_a_gradient_on_some_ranks_only, 2, str(tmp_path), timeout=120)
    opening = "the ranks hold gradients of different plain (not sharded) parameters"
    for rank, said in enumerate(results):
        message = said["monitor"]
        assert message.startswith(f"monitor.clip_grad_norm_: {opening} (rank 1 holds 4 such gradients, rank 0 3)"), \
            (rank, message)
        assert ("this rank (rank 0) has none for '0.weight'" in message) == (rank == 0), (rank, message)
        assert "differ across ranks" not in message and "Found at the log step of step 1" in message, message
        # a tie named rank 0 twice: "rank 0 holds 3 such gradients, rank 0 3"
        assert said["tie"].startswith(f"monitor.clip_grad_norm_: {opening} (its ranks hold 3 such gradients each, "
                                      "of different parameters)"), (rank, said["tie"])
        for p, counts in ((2.0, f"2 ranks hold 7 such gradients in all: the rank that counts them 3, this rank "
                                f"{3 + rank}"),
                          (math.inf, f"the ranks that hold any hold 3 to 4 such gradients, this rank {3 + rank}"),
                          (-math.inf, f"the ranks that hold any hold 3 to 4 such gradients, this rank {3 + rank}")):
            message = said[p]
            assert message.startswith(f"clip_grad_norm_: {opening} ({counts})"), (rank, p, message)
            assert ("this rank (rank 0) has none for 'unnamed.21'" in message) == (rank == 0), (rank, p, message)
            assert "differ across ranks" not in message and said[f"unscaled, p={p}"], (rank, p, said)
    record = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()][-2]
    assert record["step"] == 1 and record["train/loss"] == 1.0 and "grad_norm" not in record, record
    assert not [key for key in record if key.startswith("_")], record


def test_distmetrics_clip_grad_norm_refuses_plain_gradients_that_differ_at_the_call_before_scaling(dtensor_results):
    """Without a Monitor there is no log step: ``distmetrics.clip_grad_norm_`` reads the check at the
    call, and every rank raises there, naming the plain parameters, before any gradient is scaled
    (by their positions among the parameters given, 2 + 3 blocks of 6 before ``out``: it knows no model)."""
    plain = _PLAIN.replace("'inp.weight', 'inp.bias', 'out.weight', 'out.bias'",
                           "'unnamed.0', 'unnamed.1', 'unnamed.20', 'unnamed.21'")
    for rank, rank_result in enumerate(dtensor_results):
        for case in _REFUSED:
            said = rank_result["blocks_only_refused_at_the_call"][case]
            assert said["error"].startswith(f"clip_grad_norm_: {plain}"), (rank, case, said)
            assert "Found at" not in said["error"]
            assert said["scaled"] is False, (rank, case)


def test_a_monitor_clip_of_plain_gradients_beside_fsdp2_shards_reads_nothing_back_from_the_device(dtensor_results):
    """Plain gradients the loop averages, beside FSDP2 shards, measured as on a GPU: after the first
    clip (whose norm-type check reads one small all-reduce), a clip reads no tensor's value on the host
    (before, each read the replica check's lanes: a device sync at every step), and the interval's
    record, written by ``close()``, has the gradient norms (the copies agree)."""
    for rank, rank_result in enumerate(dtensor_results):
        said = rank_result["blocks_only_host_reads"]
        assert "error" not in said, (rank, said)
        assert said["reads"][1:] == [0, 0], (rank, said)
        assert "grad_norm" in said["record"] and "grad_clip_ratio" in said["record"], (rank, said)


def _plain_clips_read_nothing(rank: int, world: int, how: str) -> list:
    """``distmetrics.clip_grad_norm_`` of plain replicated gradients (DDP's) or of FSDP2's DTensors
    (``how``), measured as on a GPU under NCCL (no host lanes: those gloo carries are read on the host): the
    host reads of each of three calls."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm
    from distmetrics import grad_norm
    from distmetrics.grad_dtypes import GradDtypes
    from tests.dist_utils import HostReads

    combine, carried = grad_norm._combine, GradDtypes.carried

    def as_on_a_gpu(*args, **kwargs):
        kwargs["tensors"] = None  # given on the CPU only, where reading a count waits for nothing
        measured = combine(*args, **kwargs)
        measured.on_host = False
        return measured

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if how == "fsdp2":
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    reads, grad_norm._combine, GradDtypes.carried = [], as_on_a_gpu, staticmethod(lambda group: False)
    try:
        for _ in range(3):
            model.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            with HostReads() as counted:
                dm.clip_grad_norm_(model.parameters(), MAX_NORM)
            reads.append(counted.reads)
    finally:
        grad_norm._combine, GradDtypes.carried = combine, carried
    return reads


@pytest.mark.parametrize("how", ["plain", "fsdp2"])
def test_a_module_level_clip_of_ddp_or_fsdp2_gradients_reads_nothing_back_from_the_device(how):
    """The replica check's result is read at the call only where plain gradients sit beside DTensors:
    a DDP or FSDP2 job's ``distmetrics.clip_grad_norm_`` waits for the device at no call after its
    first (the norm-type check), as torch's own clip."""
    for rank, reads in enumerate(run_ranks(_plain_clips_read_nothing, 2, how, timeout=120)):
        assert reads[1:] == [0, 0], (rank, reads)


def _stage_with_plain_layer(mesh, plain_stage: int, rank: int) -> tuple:
    """This rank's pipeline stage of a pp × dp mesh: its block ``layers.<stage>`` under FSDP2 over its dp
    ranks and, on stage ``plain_stage`` only, a plain layer ``emb`` whose gradients the loop averages over
    dp; after a backward, (the stage, {(name, 0): (‖full gradient‖², its largest |element|)} of its
    parameters, in float64 from the full tensors)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    pp = mesh.get_local_rank("pp")
    torch.manual_seed(700 + pp)  # the same stage weights on its dp ranks
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict({str(pp): torch.nn.Linear(8, 8)})
    if pp == plain_stage:
        stage.emb = torch.nn.Linear(8, 8)
    fully_shard(stage.layers[str(pp)], mesh=mesh["dp"])
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(800 + rank))
    stage.layers[str(pp)](stage.emb(data) if pp == plain_stage else data).pow(2).mean().backward()
    for name, param in stage.named_parameters():
        if name.startswith("emb."):  # nothing else reduces it
            dist.all_reduce(param.grad, group=mesh.get_group("dp"))
            param.grad.div_(mesh.size(1))
    full = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).to(torch.float64)
            for name, p in stage.named_parameters()}
    return stage, {(name, 0): (float(g.pow(2).sum()), float(g.abs().max())) for name, g in full.items()}


def _plain_on_some_ranks(rank: int, world: int) -> dict:
    """Plain gradients beside FSDP2 shards held by some ranks only. (1) pp × dp = 2 × 2 with no
    ``device_mesh`` (every rank taken for a replica of one model, counted on rank 0): a plain layer on
    stage 0 alone, averaged over its dp ranks (p = 2 and inf), then on stage 1 alone, which rank 0 does
    not hold; (2) the root's plain layers left as each rank's own under an optimizer with parameter and
    update norms on, and the same averaged; (3) last, as nothing collective may follow it:
    ``distmetrics.clip_grad_norm_`` first over the blocks alone (no rank holds plain gradients at the
    norm type's first call), then with the root's own plain gradients on ranks 0 and 1 only."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    for plain_stage, norm_type in ((0, 2.0), (0, math.inf), (1, 2.0)):
        stage, pieces = _stage_with_plain_layer(mesh, plain_stage, rank)
        squares = squares_by_name({key: value[0] for key, value in pieces.items()}, world)
        largest = squares_by_name({key: value[1] for key, value in pieces.items()}, world)
        said = {"truth": math.sqrt(sum(squares.values())) if norm_type == 2.0 else max(largest.values())}
        try:
            with dm.Monitor(quiet_config(log_interval=1), model=stage) as monitor:
                said["returned"] = float(_local(monitor.clip_grad_norm_(MAX_NORM, norm_type=norm_type)))
                said["metrics"] = monitor.step(1, loss=1.0)
        except ValueError as err:
            said["error"] = str(err)
        if plain_stage == 1:
            try:
                dm.clip_grad_norm_(stage.parameters(), MAX_NORM)
                said["at the call"] = "no error"
            except ValueError as err:
                said["at the call"] = str(err)
        out[f"plain on stage {plain_stage}, p={norm_type:g}"] = said

    flat = init_device_mesh("cpu", (world,))
    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + rank))

    def average(param) -> None:  # the loop's own data-parallel mean of a gradient nothing else reduces
        dist.all_reduce(param.grad)
        param.grad.div_(world)

    def blocks_only(averaged: bool):
        model = _net()
        for block in model.blocks:
            fully_shard(block, mesh=flat)
        for name, param in model.named_parameters():
            if averaged and not name.startswith("blocks."):
                param.register_post_accumulate_grad_hook(average)
        return model

    for averaged in (False, True):
        model = blocks_only(averaged)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        said = {}
        try:
            with dm.Monitor(quiet_config(log_interval=2, log_params_norm=True, log_update_norm=True), model=model,
                            optimizer=optimizer) as monitor:
                for step in (1, 2):
                    _gradients(model, "own gradients", rank, data)
                    monitor.clip_grad_norm_(MAX_NORM)
                    optimizer.step()
                    monitor.step(step, loss=1.0)
        except ValueError as err:
            said["error"] = str(err)
        said["record"] = sorted(monitor.last_metrics)
        said["plain params"] = float(torch.cat([model.inp.weight.flatten(), model.out.weight.flatten()]).norm())
        out[f"with updates, averaged={averaged}"] = said

    group = dist.new_group(list(range(world)))  # a module-level clip of its own: no norm type checked yet
    model = blocks_only(averaged=False)
    _gradients(model, "own gradients", rank, data)
    blocks = list(model.blocks.parameters())
    dm.clip_grad_norm_(blocks, 1e9, group=group)
    try:
        dm.clip_grad_norm_(list(model.parameters()) if rank < 2 else blocks, MAX_NORM, group=group)
        out["later clip"] = "no error"
    except ValueError as err:
        out["later clip"] = str(err)
    return out


@pytest.fixture(scope="module")
def plain_on_some_ranks():
    return run_ranks(_plain_on_some_ranks, 4, timeout=240)


@pytest.mark.parametrize("norm_type", ["2", "inf"])
def test_plain_gradients_on_one_pipeline_stage_without_a_mesh_count_once_and_are_not_refused(plain_on_some_ranks,
                                                                                             norm_type):
    """Pipeline stages without ``device_mesh`` are one model's replicas to the Monitor: stage 0's plain
    layer, averaged over its dp ranks, is counted on rank 0, and stage 1's ranks hold none, which adds
    nothing to the check (before, each added a fingerprint of 0 and every rank raised that the
    gradients differ). The norm equals float64 truth from the full tensors on every rank."""
    for rank, result in enumerate(plain_on_some_ranks):
        said = result[f"plain on stage 0, p={norm_type}"]
        assert "error" not in said, (rank, said)
        assert said["returned"] == pytest.approx(said["truth"], rel=REL), (rank, said)
        assert said["metrics"]["grad_norm"] == pytest.approx(said["truth"], rel=REL), (rank, said)


def test_plain_gradients_that_no_rank_counts_are_refused_saying_to_pass_the_pipeline_mesh(plain_on_some_ranks):
    """The plain layer on stage 1 only, where rank 0, which counts plain tensors without a mesh, holds
    none: they would count for nothing. ``distmetrics.clip_grad_norm_`` (no mesh) raises at the call on
    every rank, saying to pass ``device_mesh`` with a ``pp`` dimension, not that the gradients differ
    (they agree); a Monitor given the model reads the pipeline dimension from the model's mesh and
    counts them on stage 1 (the float64 truth)."""
    for rank, result in enumerate(plain_on_some_ranks):
        said = result["plain on stage 1, p=2"]
        message = said["at the call"]
        assert message.startswith("clip_grad_norm_:"), (rank, said)
        assert "held by ranks none of which counts them" in message, (rank, message)
        assert "device_mesh=" in message and "'pp'" in message, (rank, message)
        assert "differ across ranks" not in message, (rank, message)
        assert "error" not in said, (rank, said)
        assert said["returned"] == pytest.approx(said["truth"], rel=REL), (rank, said)
        assert said["metrics"]["grad_norm"] == pytest.approx(said["truth"], rel=REL), (rank, said)


def test_a_refused_record_keeps_no_parameter_or_update_norm_of_one_rank(plain_on_some_ranks):
    """Plain gradients each rank's own, under an optimizer: its steps make each rank's plain parameters
    differ too (their norms differ by rank), so the refused log step's record is written without the
    parameter and update norms and their ratios, which count the plain parameters on rank 0 alone,
    as without the gradient norms; where the loop averages them, the same record has all of them."""
    one_ranks = ("grad_norm", "grad_clip_ratio", "param_norm", "update_norm", "relative_update_norm",
                 "effective_lr_ratio")
    plain = [result["with updates, averaged=False"]["plain params"] for result in plain_on_some_ranks]
    assert len(set(plain)) == len(plain), plain
    for rank, result in enumerate(plain_on_some_ranks):
        refused, kept = result["with updates, averaged=False"], result["with updates, averaged=True"]
        assert "differ across ranks" in refused["error"] and "error" not in kept, (rank, refused, kept)
        assert "train/loss" in refused["record"], (rank, refused)
        assert [k for k in refused["record"] if k.split("/")[0] in one_ranks] == [], (rank, refused)
        assert set(one_ranks) <= set(kept["record"]), (rank, kept)


def test_a_later_clip_with_plain_gradients_on_some_ranks_only_raises_on_those_ranks(plain_on_some_ranks):
    """``distmetrics.clip_grad_norm_`` whose first call with the norm type held no plain gradients on any
    rank, then plain ones on ranks 0 and 1 only, which differ: those ranks read the reduced check and
    raise at the call; ranks 2 and 3, holding DTensors alone, read nothing at any clip (a read at every
    call, on every FSDP2 rank, would be a device sync at every step), as the README says."""
    for rank, result in enumerate(plain_on_some_ranks):
        message = result["later clip"]
        if rank >= 2:
            assert message == "no error", (rank, message)
            continue
        assert message.startswith("clip_grad_norm_: the gradients of the plain (not sharded) parameters"), rank
        assert "differ across ranks" in message, (rank, message)


# --- Megatron-Core ------------------------------------------------------------------------------

def _megatron_layouts(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt

    import distmetrics as dm
    from distmetrics.parallel import tp_cp_leader

    out = {}
    cfg = quiet_config(log_interval=1, log_params_norm=True)

    def full_megatron(named_params, grads: bool) -> dict:
        """Gather TP-partitioned tensors along partition_dim; keep one copy of the rest."""
        tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        out_ = {}
        for name, p in named_params:
            t = (p.main_grad if grads else p).detach().to(torch.float64)
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=p.partition_dim)
            out_[name] = t
        return out_

    def measure_against(squares: dict, model) -> dict:
        """Truth from every rank's {(global name, partition): ‖piece‖²}, each key counted once
        (replicas and tied copies carry the same key and value); then what the monitor says."""
        truth = subtree_norms(squares_by_name(squares, world))
        monitor = dm.Monitor(cfg, model=model)
        total = monitor.clip_grad_norm_(math.inf)
        metrics = monitor.step(1)
        monitor.close()
        return {"truth": truth, "returned": float(total), "metrics": metrics, "order": monitor._module_order}

    # --- TP=2 × DP=2, a real forward/backward, gradients in main_grad (Megatron DDP's buffer)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    apply_cpu_adaptations()
    model = build_gpt(num_layers=2, tp=2, pp=1, tied=True)
    dp_rank = ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(300 + dp_rank)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
    mask = torch.tril(torch.ones(16, 16, dtype=torch.bool)).logical_not().view(1, 1, 16, 16)
    loss = model(tokens, position_ids, mask, labels=torch.roll(tokens, -1, dims=1)).mean()
    loss.backward()
    for p in model.parameters():  # what Megatron's DDP does: average over DP into main_grad
        grad = p.grad.detach().clone()
        dist.all_reduce(grad, group=ps.get_data_parallel_group())
        p.main_grad = grad / ps.get_data_parallel_world_size()
        p.grad = None
    monitor = dm.Monitor(cfg, model=model)
    truth = _truth(full_megatron(model.named_parameters(), grads=True))
    total = monitor.measure_grad_norms(step=1)
    # MoE counts as Megatron's router makes them: each TP rank routes its own slice of the
    # sequence (sequence parallel), and the counts are summed over the TP x CP group
    # (Megatron's own function); what record_moe is given on every rank
    from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count

    routed = torch.rand(8, 4, generator=torch.Generator().manual_seed(700 + rank)) < torch.tensor([0.9, 0.5, 0.2, 0.05])
    tokens_per_expert, _, _ = get_tokens_per_expert_and_token_count(routed, ps.get_tensor_and_context_parallel_group())
    monitor.record_moe(tokens_per_expert=tokens_per_expert)
    every_rank = [torch.empty_like(routed) for _ in range(world)]
    dist.all_gather(every_rank, routed)  # the truth: every token of every rank counted once
    moe_truth = torch.stack(every_rank).to(torch.float64).sum(dim=(0, 1))
    metrics = monitor.step(1, loss=loss.detach())
    monitor.close()
    out["tp2"] = {"truth": truth, "returned": float(total), "metrics": metrics,
                  "moe_truth": {"moe/load_imbalance": float(moe_truth.max() / moe_truth.mean()),
                                "moe/expert_utilization": float((moe_truth > 0).double().mean())},
                  "layernorm_is_duplicated": not getattr(
                      dict(model.named_parameters())["decoder.layers.0.input_layernorm.weight"],
                      "tensor_model_parallel", False),
                  "tp_cp_leader": tp_cp_leader(monitor.layout)}
    ps.destroy_model_parallel()

    # --- PP=2 × TP=2, a tied embedding across stages, gradients set per layout rules:
    # TP-partitioned pieces differ per TP rank, duplicated params are equal on TP peers, and the
    # two copies of the tied embedding hold the same (all-reduced) gradient, as Megatron leaves them.
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    apply_cpu_adaptations()
    model = build_gpt(num_layers=4, tp=2, pp=2, tied=True)
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    for index, (name, p) in enumerate(model.named_parameters()):
        seed = 1000 * pp_rank + index
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            seed = 999_999  # the tied pair: same gradient on both stages
        if getattr(p, "tensor_model_parallel", False):
            seed += 100_000 * (tp_rank + 1)
        p.main_grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
    layers_per_stage = 2
    named = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:  # global layer index from the stage offset
            parts[2] = str(int(parts[2]) + pp_rank * layers_per_stage)
        if name == "output_layer.weight":
            parts = ["embedding", "word_embeddings", "weight"]  # the same global parameter
        named.append((".".join(parts), p))
    stage_truth = full_megatron(named, grads=True)
    squares = {(n, 0): float(t.pow(2).sum()) for n, t in stage_truth.items()}
    out["pp2"] = measure_against(squares, model)
    ps.destroy_model_parallel()

    # --- mixture of experts: 4 experts per layer over EP=2, (a) TP=1, so each expert has two
    # expert-data-parallel replicas, (b) TP=2 with experts split over expert-TP=2 (no expert
    # replica). Megatron's MoE forward needs patches on CPU, so gradients are set per layout rules: a
    # dense parameter's are equal on its data-parallel replicas, an expert's depend on its
    # global expert index (equal on its expert-data-parallel replicas), and a TP-partitioned
    # piece's on its partition. The truth counts each (global name, partition) once.
    for key, tp, etp in (("ep2", 1, 1), ("ep2_tp2", 2, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=2,
                                     expert_tensor_parallel_size=etp)
        apply_cpu_adaptations()
        model = build_gpt(num_layers=2, tp=tp, pp=1, tied=True, experts=4, ep=2, etp=etp)
        ep_rank = ps.get_expert_model_parallel_rank()
        squares = {}
        for index, (name, p) in enumerate(model.named_parameters()):
            expert = not getattr(p, "allreduce", True)
            parts = name.split(".")
            if expert:  # decoder.layers.L.mlp.experts.local_experts.I.…: global index from the EP rank
                at = parts.index("local_experts") + 1
                parts[at] = str(ep_rank * 2 + int(parts[at]))
            global_name = ".".join(parts)
            partition = 0
            if getattr(p, "tensor_model_parallel", False):
                partition = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            seed = zlib.crc32(f"{global_name}|{partition}".encode())
            p.main_grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            squares[(global_name, partition)] = float(p.main_grad.to(torch.float64).pow(2).sum())
        out[key] = measure_against(squares, model)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def megatron_results():
    return run_ranks(_megatron_layouts, 4, timeout=300)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2", "ep2_tp2"])
def test_norms_are_exact_under_megatron_layouts(megatron_results, layout):
    for rank_result in megatron_results:
        r = rank_result[layout]
        m = r["metrics"]
        assert r["returned"] == pytest.approx(r["truth"]["total"], rel=REL)
        assert m["grad_norm"] == pytest.approx(r["truth"]["total"], rel=REL)
        for module, value in r["truth"]["modules"].items():
            assert m[f"grad_norm/{module}"] == pytest.approx(value, rel=REL), module
        assert {k.split("/", 1)[1] for k in m if k.startswith("grad_norm/")} == set(r["truth"]["modules"])


def test_moe_counts_summed_over_tp_as_megatron_sums_them_count_each_token_once(megatron_results):
    """TP=2 x DP=2: the counts Megatron's router sums over the TP x CP group, given on every rank
    (the README's rule), give the imbalance and utilisation of every token of the job."""
    for rank_result in megatron_results:
        r = rank_result["tp2"]
        for name, value in r["moe_truth"].items():
            assert r["metrics"][name] == pytest.approx(value, rel=1e-12), name


def test_megatron_tensor_parallel_peers_are_told_by_the_first_rank_of_their_group(megatron_results):
    """Tensor statistics tell TP copies apart within a TP x CP group; Megatron's default rank order
    (tp-cp-ep-dp-pp) makes ranks 0-1 and 2-3 the TP groups at TP 2 of 4 ranks."""
    assert [r["tp2"]["tp_cp_leader"] for r in megatron_results] == [0, 0, 2, 2]


def test_megatron_tp_model_has_a_tp_duplicated_layernorm(megatron_results):
    assert megatron_results[0]["tp2"]["layernorm_is_duplicated"]


def test_the_module_order_is_the_whole_models_in_stage_order_on_every_rank(megatron_results):
    """Each rank's order was its stage's modules alone: the run record (the writer's) put the last
    stage's layers first in the report, and health/first_nonfinite_module was ordered differently
    per stage. Now every rank holds the stages' orders in stage order."""
    orders = [r["pp2"]["order"] for r in megatron_results]
    assert all(order == orders[0] for order in orders)
    layers = [name for name in orders[0] if name.count(".") == 2 and name.startswith("decoder.layers.")]
    assert layers == [f"decoder.layers.{i}" for i in range(4)]
    assert orders[0].index("embedding") < orders[0].index("decoder.layers.0")
    assert orders[0].index("decoder.layers.3") < orders[0].index("output_layer")


def test_pipeline_stages_report_global_layer_names(megatron_results):
    names = {k for k in megatron_results[0]["pp2"]["metrics"] if k.startswith("grad_norm/decoder.layers.")}
    layers = {k.split(".")[2] for k in names}
    assert layers == {"0", "1", "2", "3"}


def test_experts_are_named_by_their_global_index(megatron_results):
    for layout in ("ep2", "ep2_tp2"):
        names = {k for k in megatron_results[0][layout]["metrics"] if ".local_experts." in k}
        experts = {k.split(".local_experts.")[1].split(".")[0] for k in names}
        assert experts == {"0", "1", "2", "3"}, layout


# --- single-process behaviour ------------------------------------------------------------------

def _plain_monitor(model, **cfg):
    import distmetrics as dm

    return dm.Monitor(quiet_config(**{"log_interval": 1, **cfg}), model=model)



@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "measured"])
def test_an_inf_gradient_norm_leaves_no_effective_lr_ratio(clip):
    """Finite gradients whose float32 sum of squares passes float32's range (4 x 3e19) give an inf
    total, as torch's: the clip's coefficient is 0, and inf x 0 wrote effective_lr_ratio NaN (and a
    measurement alone wrote update / inf = 0.0), for the total and the module. Neither says anything:
    the ratio is left out there."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = _plain_monitor(model, log_update_norm=True, log_params_norm=True)
    monitor.attach_megatron_optimizer(optimizer)
    model(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        model[0].bias.grad.fill_(3e19)
    assert math.isinf(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))  # torch's
    total = monitor.clip_grad_norm_(1.0) if clip else monitor.measure_grad_norms()
    assert math.isinf(float(total))
    optimizer.step()
    metrics = monitor.step(1)
    assert metrics["update_norm"] >= 0 and "effective_lr_ratio" not in metrics, metrics
    assert "effective_lr_ratio/0" not in metrics  # the module of the inf norm; module 1's is finite where measured
    assert not [k for k, v in metrics.items() if isinstance(v, float) and math.isnan(v)]
    monitor.close()


def test_a_lazy_modules_parameters_before_its_first_forward_count_as_empty():
    """A log step before a lazy module's first forward (``nn.LazyLinear``, its parameters still
    ``UninitializedParameter``s) raised torch's "Attempted to use an uninitialized parameter" from the
    parameter norms, and the record was lost. They hold no value yet: they count as empty, and after
    the forward every norm is float64 truth's."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    monitor = _plain_monitor(model, log_params_norm=True)
    first = monitor.step(0)
    assert first["param_norm/0"] == 0.0
    assert first["param_norm"] == pytest.approx(float(torch.cat([p.detach().double().reshape(-1)
                                                                   for p in model[2].parameters()]).norm()), rel=REL)
    model(torch.randn(5, 7)).sum().backward()
    monitor.clip_grad_norm_(1e9)
    metrics = monitor.step(1)
    assert metrics["param_norm"] == pytest.approx(
        float(torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).norm()), rel=REL)
    assert metrics["grad_norm"] == pytest.approx(
        float(torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]).norm()), rel=REL)
    monitor.close()

def test_inf_norm_is_the_largest_element():
    import torch

    model = _net()
    model(torch.randn(4, 8)).sum().backward()
    truth = max(float(p.grad.abs().max()) for p in model.parameters())
    monitor = _plain_monitor(model)
    assert float(monitor.clip_grad_norm_(math.inf, norm_type=math.inf)) == pytest.approx(truth, rel=REL)
    assert monitor.step(1)["grad_norm"] == pytest.approx(truth, rel=REL)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, 0.5, 1.5, 4.0, -1.0, -math.inf, 0.0])
def test_any_p_norm_equals_float64_truth_for_the_total_and_every_subtree(norm_type):
    import torch

    model = _net()
    model(torch.randn(4, 8)).sum().backward()
    model.blocks[1].fc2.bias.grad.zero_()  # p = 0 counts tensors with a non-zero element
    grads = {n: p.grad.detach().to(torch.float64).reshape(-1) for n, p in model.named_parameters()}

    def p_norm(tensors):
        values = torch.cat(tensors).abs()
        if norm_type == 0:
            return float(sum(bool(t.count_nonzero()) for t in tensors))
        if math.isinf(norm_type):
            return float(values.max() if norm_type > 0 else values.min())
        return float(values.pow(norm_type).sum().pow(1.0 / norm_type))

    monitor = _plain_monitor(model)
    total = monitor.clip_grad_norm_(math.inf, norm_type=norm_type)
    metrics = monitor.step(1)
    assert float(total) == pytest.approx(p_norm(list(grads.values())), rel=REL)
    assert metrics["grad_norm"] == pytest.approx(p_norm(list(grads.values())), rel=REL)
    for module in ("blocks", "blocks.1", "blocks.1.fc2", "inp", "out"):
        below = [g for n, g in grads.items() if n.startswith(module + ".")]
        assert metrics[f"grad_norm/{module}"] == pytest.approx(p_norm(below), rel=REL), module


def test_params_without_grad_are_skipped_and_counted_and_unfreezing_replans():
    import torch

    model = _net()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    model.out.bias.requires_grad_(True)
    monitor = _plain_monitor(model)
    model(torch.randn(4, 8)).sum().backward()
    model.inp.bias.grad = None  # a trainable parameter without a gradient
    monitor.clip_grad_norm_(math.inf)
    m = monitor.step(1)
    assert m["grad_missing_params"] == 1
    assert "grad_norm/blocks.0.fc1" not in m
    for p in model.blocks[0].parameters():
        p.requires_grad_(True)
    model.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    truth = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert float(monitor.clip_grad_norm_(math.inf)) == pytest.approx(truth, rel=REL)
    m = monitor.step(2)
    assert "grad_norm/blocks.0.fc1" in m and monitor._by_name['norms'].replans == 1

    def measured_vs_truth(step):
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        if hasattr(model, "extra"):  # not in forward: its gradient by hand
            model.extra(torch.ones(1, 1)).sum().backward()
        truth = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        return float(monitor.clip_grad_norm_(math.inf)), truth, monitor.step(step)

    # A parameter replaced through setattr, one written straight into _parameters (no hook
    # fires), and a module added after the plan was made: each is seen on the next call.
    model.out.weight = torch.nn.Parameter(torch.randn_like(model.out.weight) * 10)
    got, truth, _ = measured_vs_truth(3)
    assert got == pytest.approx(truth, rel=REL) and monitor._by_name['norms'].replans == 2
    model.out._parameters["bias"] = torch.nn.Parameter(torch.randn_like(model.out.bias) * 10)
    got, truth, _ = measured_vs_truth(4)
    assert got == pytest.approx(truth, rel=REL) and monitor._by_name['norms'].replans == 3
    model.extra = torch.nn.Linear(1, 1)
    got, truth, m = measured_vs_truth(5)
    assert got == pytest.approx(truth, rel=REL) and "grad_norm/extra" in m and monitor._by_name['norms'].replans == 4


def test_nonfinite_gradients_name_their_modules():
    import torch

    model = _net()
    model(torch.randn(4, 8)).sum().backward()
    model.blocks[1].fc2.weight.grad[0, 0] = float("nan")
    monitor = _plain_monitor(model)
    monitor.clip_grad_norm_(1.0)
    m = monitor.step(1)
    assert m["grad_nonfinite"] == 1
    assert m["grad_nonfinite_modules"] == ["blocks.1.fc2"]
    assert math.isnan(m["grad_norm"])


def test_module_norm_depth_groups_by_name_prefix():
    import torch

    model = _net()
    model(torch.randn(4, 8)).sum().backward()
    truth = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.blocks[2].parameters()))
    monitor = _plain_monitor(model, module_norm_depth=2)
    monitor.clip_grad_norm_(math.inf)
    m = monitor.step(1)
    assert m["grad_norm/blocks.2"] == pytest.approx(truth, rel=REL)
    assert not any(k.startswith("grad_norm/blocks.2.") for k in m)


def test_partial_placement_is_refused_naming_the_parameter():
    import torch
    from torch.distributed.tensor import DTensor, Partial

    from distmetrics.parallel import owns_local_piece

    class FakeMesh:
        def get_coordinate(self):
            return [0]

    class FakeGrad:  # the minimal DTensor surface the rule reads; a real Partial needs a mesh
        placements = (Partial(),)
        device_mesh = FakeMesh()

        def to_local(self):
            return torch.zeros(1)

    with pytest.raises(ValueError, match=r"parameter 'blocks.0.fc1.weight' has a Partial placement"):
        owns_local_piece(FakeGrad(), None, "blocks.0.fc1.weight", None, None)
    assert DTensor is not None


def test_measure_grad_norms_does_nothing_on_steps_that_are_not_logged():
    import torch

    model = _net()
    monitor = _plain_monitor(model, log_interval=5)
    model(torch.randn(4, 8)).sum().backward()
    monitor.step(1)
    assert monitor.measure_grad_norms() is None  # next step is 2: not a log step
    assert monitor.measure_grad_norms(step=5) is not None


@pytest.mark.parametrize("change", ["insert", "_modules", "del attribute", "pop", "del item", "_parameters",
                                    "untie"])
def test_a_module_inserted_replaced_or_removed_in_place_is_measured_as_it_now_is(change):
    """ModuleList.insert, ``parent._modules[k] = m`` of a module built earlier, ``del model.a``,
    ``layers.pop()`` and ``del layers[0]`` fire none of torch's registration hooks: the plan kept
    the old parameters, so the short-form clip returned 5.12 for torch's 6.43 and left the new
    module's gradients unclipped, and per-module names and param_norm held removed modules. So did a
    parameter written into a module's ``_parameters`` (a new slot; a tied weight's second slot untied,
    as Accelerate's ``set_module_tensor_to_device`` writes)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    spare = nn.Linear(4, 4)  # built before the change (a pool of layers)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    model.a = nn.Linear(4, 4)
    if change == "untie":
        model.a.weight = model.layers[0].weight  # tied: counted once, under layers.0
    monitor = _plain_monitor(model, log_params_norm=True)

    def step(number):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(number))
        for layer in model.layers:
            x = layer(x)
        scale = model.a._parameters.get("scale") if hasattr(model, "a") else None
        (x.pow(2).sum() + (model.a(x).sum() if hasattr(model, "a") else 0) +
         ((x * scale).sum() if scale is not None else 0)).backward()
        copies = [p.grad.clone() for p in model.parameters()]
        total = float(monitor.clip_grad_norm_(0.1))
        reference = [nn.Parameter(torch.zeros_like(g)) for g in copies]
        for q, g in zip(reference, copies):
            q.grad = g
        assert total == pytest.approx(float(torch.nn.utils.clip_grad_norm_(reference, 0.1)), rel=1e-6)
        for p, q in zip(model.parameters(), reference):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=0), "a gradient torch clips was left unclipped"
        metrics = monitor.step(number)
        model.zero_grad()
        return metrics

    step(1)
    if change == "insert":
        model.layers.insert(0, spare)
    elif change == "_modules":
        model.layers._modules["1"] = spare
    elif change == "del attribute":
        del model.a
    elif change == "pop":
        model.layers.pop(2)
    elif change == "_parameters":
        model.a._parameters["scale"] = nn.Parameter(torch.ones(4))
    elif change == "untie":
        model.a._parameters["weight"] = nn.Parameter(model.layers[0].weight.detach().clone())
    else:
        del model.layers[0]
    metrics = step(2)
    modules = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
    assert {k[len("param_norm/"):] for k in metrics if k.startswith("param_norm/")} >= modules
    assert not [k for k in metrics if k.startswith("param_norm/") and k[len("param_norm/"):] not in modules
                and not any(m.startswith(k[len("param_norm/"):] + ".") for m in modules)], sorted(metrics)
    truth = sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()) ** 0.5
    assert metrics["param_norm"] == pytest.approx(truth, rel=1e-6) and metrics["grad_missing_params"] == 0
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        own = sum(float(q.detach().double().pow(2).sum()) for n, q in model.named_parameters()
                  if n.rsplit(".", 1)[0] == module) ** 0.5
        assert metrics[f"param_norm/{module}"] == pytest.approx(own, rel=1e-6), module


def test_a_submodule_named_module_beside_others_is_not_a_wrapper_level():
    """A model's own child called ``module`` (beside a ``proj``) was dropped as DDP's wrapper level:
    ``module.proj`` and ``proj`` merged into one grad_norm/proj (their hypot). Under DDP and
    torch.compile the wrapper levels still go."""
    import torch
    from torch import nn

    from distmetrics.naming import module_name_map

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, 3, bias=False)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = Inner()
            self.proj = nn.Linear(3, 3, bias=False)

    torch.manual_seed(0)
    model = Model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    monitor = _plain_monitor(model)
    monitor.clip_grad_norm_(1e9)
    metrics = monitor.step(1)
    assert metrics["grad_norm/module.proj"] == pytest.approx(float(model.module.proj.weight.grad.norm()), rel=1e-6)
    assert metrics["grad_norm/proj"] == pytest.approx(float(model.proj.weight.grad.norm()), rel=1e-6)
    wrapped = torch.compile(nn.Sequential(model))  # _orig_mod and the Sequential's one child: no own parameters
    assert module_name_map(wrapped)["_orig_mod.0.module.proj"] == "0.module.proj"


def test_an_optimizers_param_groups_given_as_parameters_are_named_for_what_they_are():
    """clip_grad_norm_(optimizer.param_groups, ...) raised AttributeError: 'dict' object has no
    attribute '__dict__' from inside the plan."""
    import torch

    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    monitor = _plain_monitor(model)
    with pytest.raises(TypeError, match=r"got a dict \(an optimizer's param_groups\?\); pass the parameters"):
        monitor.clip_grad_norm_(optimizer.param_groups, 1.0)


def test_the_last_step_is_measured_for_the_record_close_writes(tmp_path):
    """5 steps at log_interval 2 (Megatron's distributed optimizer clips; the loop measures): the
    record close() writes for steps 4-5 had no grad_norm, step 5 never being a log step."""
    import torch

    import distmetrics as dm

    model = _net()
    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=2, total_steps=5, console=False,
                           tensorboard=False)
    with dm.Monitor(cfg, model=model) as monitor:
        for step in range(1, 6):
            model.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            measured = monitor.measure_grad_norms(step=step)
            assert (measured is None) == (step in (1, 3))
            monitor.step(step)
    truth = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()) ** 0.5
    last = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["step"] == 5 and last["grad_norm"] == pytest.approx(truth, rel=1e-6)


@pytest.mark.parametrize("start", [0, 1000, 3])
def test_the_first_step_is_measured_whatever_its_number_and_kept_only_if_it_is_logged(start):
    """Before the first monitor.step its number is unknown (a job starts at 0, or resumes at a
    checkpoint's step, often a log step): measure_grad_norms() and the update-norm snapshot treat
    it as a log step. Started at 0 or 1000 (log steps at log_interval 5), the first record has
    grad_norm and update_norm, equal to float64 truths; started at 3, what was measured then is
    dropped, and log step 5, where nothing is measured, writes none of it."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = {}
    with dm.Monitor(quiet_config(log_interval=5, log_update_norm=True), model=model, optimizer=opt) as monitor:
        for step in (start, 5) if start == 3 else (start,):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            grad = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()) ** 0.5
            before = [p.detach().double().clone() for p in model.parameters()]
            if step == start:
                assert monitor.measure_grad_norms() is not None
            opt.step()
            update = sum(float((p.detach().double() - b).pow(2).sum()) for p, b in zip(model.parameters(), before))
            records[step] = (monitor.step(step), grad, update ** 0.5)
    if start == 3:
        assert records[3][0] is None
        assert not [k for k in records[5][0] if k.split("/")[0] in ("grad_norm", "update_norm")]
    else:
        metrics, grad, update = records[start]
        assert metrics["grad_norm"] == pytest.approx(grad, rel=1e-6)
        assert metrics["update_norm"] == pytest.approx(update, rel=1e-6)


def test_lightning_fabrics_wrapper_is_a_wrapper_level():
    """A model given as Lightning Fabric's ``setup_module`` returns it (``_FabricModule``: the model as
    ``_forward_module``, or DDP's wrapper of it there, and again as ``_original_module``) was named
    ``grad_norm/_forward_module.0``: two children, so no wrapper. Built here with Fabric's structure
    (lightning 2.6's ``_FabricModule`` registers those two attributes, and nothing else; lightning is
    not installed here), the real module where it is. A second child that is not the first's is no
    wrapper's."""
    import torch
    from torch import nn

    from distmetrics.naming import module_name_map

    def fabric_like(forward, original):
        wrapper = nn.Module()
        wrapper._forward_module, wrapper._original_module = forward, original
        return wrapper

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    ddp_like = nn.Module()
    ddp_like.module = model
    for wrapped in (fabric_like(model, model), fabric_like(ddp_like, model)):  # FSDP2 (in place); DDP
        assert sorted(set(module_name_map(wrapped).values())) == ["", "0", "1", "2"]
        for p in wrapped.parameters():
            p.grad = torch.ones_like(p)
        monitor = _plain_monitor(wrapped)
        monitor.clip_grad_norm_(1e9)
        metrics = monitor.step(1)
        monitor.close()
        assert metrics["grad_norm/2"] == pytest.approx(8 ** 0.5) and "grad_norm/_forward_module.2" not in metrics
    apart = fabric_like(model, nn.Linear(2, 2))  # not the model: a module of its own
    assert module_name_map(apart)["_forward_module.0"] == "_forward_module.0"
    try:
        from lightning.fabric.wrappers import _FabricModule
    except ImportError:
        return
    assert sorted(set(module_name_map(_FabricModule(model, None, original_module=model)).values())) == [
        "", "0", "1", "2"]


def test_wrapper_prefixes_and_megatron_layer_numbers_become_global_names():
    import torch

    from distmetrics.naming import module_name_map

    class Layer(torch.nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number = number
            self.fc = torch.nn.Linear(2, 2)

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(3), Layer(4)])  # a second pipeline stage

    wrapper = torch.nn.Module()
    wrapper.module = torch.nn.Module()
    wrapper.module._orig_mod = Stage()
    names = module_name_map(wrapper)
    assert names["module._orig_mod.layers.0"] == "layers.2"
    assert names["module._orig_mod.layers.1"] == "layers.3"


def _layer_numbers_that_name_no_layer(rank: int, world: int) -> dict:
    """DDP over a ``layers`` list whose blocks carry ``layer_number`` 1, 1, 5 (the model's own
    attribute, not Megatron's numbering): the norms logged, and float64 truth from the gradients."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    class Block(torch.nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number = number
            self.lin = torch.nn.Linear(3, 3)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(1), Block(1), Block(5)])

        def forward(self, x):
            return sum((i + 1) * block.lin(x).pow(2).sum() for i, block in enumerate(self.layers))

    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))).backward()
    squares = {name[len("module."):]: float(p.grad.double().pow(2).sum()) for name, p in model.named_parameters()}
    monitor.clip_grad_norm_(math.inf)
    metrics = monitor.step(1)
    monitor.close()
    return {"truth": subtree_norms(squares)["modules"],
            "logged": {k[len("grad_norm/"):]: v for k, v in metrics.items() if k.startswith("grad_norm/")}}


def test_layer_numbers_that_repeat_keep_the_list_indices(tmp_path):
    """layer_number names a layer only where the list's numbers tell its layers apart: blocks
    numbered 1, 1, 5 were grad_norm/layers.0 (the first two merged, sqrt(2)x) and layers.4."""
    result = run_ranks(_layer_numbers_that_name_no_layer, 2)[0]
    assert set(result["logged"]) == set(result["truth"])  # layers, layers.<i>, layers.<i>.lin for i = 0, 1, 2
    for module, norm in result["truth"].items():
        assert result["logged"][module] == pytest.approx(norm, rel=REL), module


def test_bf16_gradients_are_measured_to_float32_not_bf16_precision():
    import torch

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    for p in model.parameters():
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 0.01).to(torch.bfloat16)
    truth = math.sqrt(sum(float(p.grad.to(torch.float64).pow(2).sum()) for p in model.parameters()))
    monitor = _plain_monitor(model)
    monitor.clip_grad_norm_(math.inf)
    assert monitor.step(1)["grad_norm"] == pytest.approx(truth, rel=REL)  # bf16 rounding would be ~1e-3


def test_mixed_dtypes_are_scaled_each_in_their_own_precision():
    import torch

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16).to(torch.bfloat16), torch.nn.Linear(16, 16))
    for p in model.parameters():
        p.grad = (torch.randn(p.shape) * 3.0).to(p.dtype)
    before = {n: p.grad.to(torch.float64).clone() for n, p in model.named_parameters()}
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in before.values()))
    coef = min(1.0, 0.3 / (total + 1e-6))
    returned = _plain_monitor(model).clip_grad_norm_(model.parameters(), 0.3)
    assert returned.dtype == torch.float32  # bf16 and fp32 promote to fp32, as torch
    for name, p in model.named_parameters():
        if p.dtype == torch.float32:  # the bf16 group's coefficient must not reach these
            assert torch.allclose(p.grad.to(torch.float64), before[name] * coef, rtol=1e-6, atol=0), name


def test_clip_grad_norm_takes_torchs_call_shapes():
    """Every call shape clips as torch does and keeps the per-module norms for the log step
    (the generator ``model.parameters()`` included), against float64 subtree truth."""
    import torch

    model = _net()
    model(torch.randn(4, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    truth = _truth({n: p.grad.double() for n, p in model.named_parameters()})
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.1)  # torch on the same gradients
    monitor = _plain_monitor(model)
    for step, call in enumerate((lambda: monitor.clip_grad_norm_(model.parameters(), 0.1),
                                 lambda: monitor.clip_grad_norm_(model.parameters(), max_norm=0.1, norm_type=2.0,
                                                                 error_if_nonfinite=True, foreach=False),
                                 lambda: monitor.clip_grad_norm_(max_norm=0.1),
                                 lambda: monitor.clip_grad_norm_(0.1)), start=1):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        assert float(call()) == pytest.approx(float(expected), rel=REL)
        assert all(torch.allclose(p.grad, c.grad) for p, c in zip(model.parameters(), copies))
        metrics = monitor.step(step)
        assert metrics["grad_norm"] == pytest.approx(truth["total"], rel=REL)
        for module, norm in truth["modules"].items():
            assert metrics[f"grad_norm/{module}"] == pytest.approx(norm, rel=REL), (step, module)
    with pytest.raises(TypeError, match="max_norm"):
        monitor.clip_grad_norm_(model.parameters())


def _fsdp1(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    import distmetrics as dm

    out = {}
    for orig in (False, True):
        model = FullyShardedDataParallel(_net(), device_id=torch.device("cpu"), use_orig_params=orig)
        model(torch.randn(4, 8)).sum().backward()
        monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
        try:
            monitor.clip_grad_norm_(1.0)
            out[orig] = "no error"
        except ValueError as err:
            out[orig] = str(err)
        finally:
            monitor.close()
        # parameter norms alone, no gradient measured: refused as well (param_norm was each rank's flat
        # shard summed as if replicated, without a word)
        monitor = dm.Monitor(quiet_config(log_interval=1, log_params_norm=True), model=model)
        try:
            monitor.step(1)
            out["params", orig] = "no error"
        except ValueError as err:
            out["params", orig] = str(err)
        with pytest.raises(ValueError, match="FSDP1"):  # the interval's record is still the same layout's
            monitor.close()
    return out


def test_fsdp1_flat_parameters_are_refused_naming_the_parameter():
    """With use_orig_params=True the parameters are views of each rank's flat shard under their own
    names: taken for DDP replicas, rank 0's parts of its shard alone were counted (grad_norm 0.074
    for 0.310, modules missing), without a word. Parameter norms alone (no gradient measured) are
    refused too: the layout was checked at a gradient measurement only."""
    for rank, messages in enumerate(run_ranks(_fsdp1, 2)):  # every rank refuses, so none waits in a collective
        assert "FlatParameter" in messages[False] and "_flat_param" in messages[False], (rank, messages)
        assert "belongs to an FSDP1 module (FullyShardedDataParallel with use_orig_params=True" in messages[True]
        assert "parameter 'inp.weight'" in messages[True], (rank, messages)
        assert "FlatParameter" in messages["params", False], (rank, messages)
        assert "belongs to an FSDP1 module" in messages["params", True], (rank, messages)


def _zero_partitioned(rank: int, world: int) -> dict:
    """A parameter marked as DeepSpeed ZeRO marks its partitioned ones (``ds_id``; ``ds_tensor`` alike, the
    shard it holds): each way the norms are read, with no gradient measured for the parameter norms."""
    import torch

    import distmetrics as dm

    out = {}
    for way, extra in (("clip", {}), ("measure", {}), ("params", {"log_params_norm": True}),
                       ("update", {"log_update_norm": True})):
        model = _net()
        model.inp.weight.ds_id = 3
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = dm.Monitor(quiet_config(log_interval=1, **extra), model=model, optimizer=optimizer)
        model(torch.randn(4, 8)).sum().backward()
        try:
            if way == "clip":
                monitor.clip_grad_norm_(1.0)
            elif way == "measure":
                monitor.measure_grad_norms()
            optimizer.step()
            monitor.step(1)
            out[way] = "no error"
        except ValueError as err:
            out[way] = f"{type(err).__name__}: {err}"
        try:
            monitor.close()
        except ValueError:
            pass  # the interval's record is still the same layout's
    return out


def test_deepspeed_zero_partitioned_parameters_are_refused_naming_the_parameter():
    """The README's refusal of DeepSpeed ZeRO's partitioned parameters (each rank holds a part the ownership
    rule does not describe): a LayoutError naming the parameter on every rank, at the clip, at
    measure_grad_norms, and at the log step that measures param_norm or update_norm."""
    for messages in run_ranks(_zero_partitioned, 2, timeout=120):
        assert sorted(messages) == ["clip", "measure", "params", "update"], messages
        for way, message in messages.items():
            assert message == ("LayoutError: parameter 'inp.weight' is partitioned by DeepSpeed ZeRO, which this "
                               "library's ownership rule does not describe"), (way, message)


def _micro_batches_and_truth(rank: int, world: int) -> tuple:
    """This rank's two micro-batches, and the norm of every rank's accumulated float64 gradients of
    an unwrapped copy, averaged over the ranks."""
    import torch
    import torch.distributed as dist

    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    reference = _net().double()
    for x in data:
        reference(x.double()).pow(2).mean().backward()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {n: p.grad for n, p in reference.named_parameters()})
    return data, math.sqrt(sum(float((sum(g[n] for g in gathered) / world).pow(2).sum()) for n in gathered[0]))



def _fsdp2_parameters_left_unsharded(rank: int, world: int) -> dict:
    """FSDP2 with ``fully_shard`` on the blocks and the root, where parameters are registered unsharded
    at the clip: a forward under ``torch.no_grad()`` between the backward and the clip (the root does
    not reshard after its forward), or ``set_reshard_after_backward(False)``. The clip by the model
    (``clip_grad_norm_(max_norm)``) and by the parameters (``model.parameters()`` read after the
    forward), then an SGD step. Truth: float64 over the optimizer's (sharded) parameters' full tensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for case in ("no_grad forward", "no reshard after backward", "given parameters", "the function"):
        model = _net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if case in ("no reshard after backward", "the function"):
            model.set_reshard_after_backward(False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        held = [p for group in optimizer.param_groups for p in group["params"]]
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        with dm.Monitor(quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True), model=model,
                        optimizer=optimizer) as monitor:
            model(x).pow(2).mean().backward()
            if case in ("no_grad forward", "given parameters"):
                with torch.no_grad():
                    model(x)  # a metrics pass
            grads = [_full(p.grad) for p in held]
            truth = float(torch.cat([g.reshape(-1) for g in grads]).norm())
            stand_ins = sum(type(p) is not type(held[0]) for p in model.parameters())
            torch_reads = [p.grad for p in model.parameters() if p.grad is not None]  # what torch's clip sums
            parameters = list(model.parameters()) if case in ("given parameters", "the function") else None
            if case == "the function":  # no model: the parameters given are all it has
                returned = dm.clip_grad_norm_(parameters, MAX_NORM)
                returned = float(returned.full_tensor() if hasattr(returned, "full_tensor") else returned)
                monitor.measure_grad_norms()  # for the record
            else:
                returned = float(monitor.clip_grad_norm_(parameters, MAX_NORM))
            clipped = float(torch.cat([_full(p.grad).reshape(-1) for p in held]).norm())
            before = [_full(p) for p in held]
            optimizer.step()
            optimizer.zero_grad()
            metrics = monitor.step(1)
            update = float(torch.cat([(_full(p) - b).reshape(-1) for p, b in zip(held, before)]).norm())
            params = float(torch.cat([_full(p).reshape(-1) for p in held]).norm())
        out[case] = {"truth": truth, "returned": returned, "clipped": clipped, "stand_ins": stand_ins,
                     "torch_reads": len(torch_reads),
                     "grad_norm": metrics["grad_norm"], "missing": metrics.get("grad_missing_params"),
                     "update": (metrics["update_norm"], update), "param": (metrics["param_norm"], params)}
    return out


def test_fsdp2_parameters_left_unsharded_at_the_clip_are_read_through_their_sharded_ones():
    """A no_grad forward between the backward and the clip leaves FSDP2's root unsharded: its
    parameters were read as the plain unsharded copies, which hold no gradient (grad_norm 2.63 for
    3.94 on a like model, 8 of 20 gradients left unclipped, update_norm 29x low, param_norm of the
    stale copy); so did every module after a backward with set_reshard_after_backward(False), and
    ``distmetrics.clip_grad_norm_``, which has no model, given ``model.parameters()`` then. The
    sharded parameters FSDP2 reduces gradients into, the optimizer's, are read instead."""
    for result in run_ranks(_fsdp2_parameters_left_unsharded, 2, timeout=240):
        for case, out in result.items():
            assert out["stand_ins"] > 0, case  # the case does leave parameters unsharded
            assert out["returned"] == pytest.approx(out["truth"], rel=REL), case
            assert out["grad_norm"] == pytest.approx(out["truth"] * (MAX_NORM / out["truth"] if case == "the function"
                                                                   else 1.0), rel=REL), case  # measured clipped
            assert out["clipped"] == pytest.approx(MAX_NORM, rel=1e-5), case
            assert not out["missing"], case
            assert out["update"][0] == pytest.approx(out["update"][1], rel=1e-5), case  # the clip's update
            assert out["param"][0] == pytest.approx(out["param"][1], rel=REL), case
        assert result["no reshard after backward"]["torch_reads"] == 0  # torch's clip: a norm of 0


def _sequence_parallel_alone(rank: int, world: int) -> dict:
    """Tensor parallelism alone (no FSDP) with SequenceParallel on a LayerNorm: its gradients are
    Partial DTensors (each rank holds a part of the sum over the sequence). The Monitor's clip and
    ``distmetrics.clip_grad_norm_``; truth: float64 of the gradients' full tensors (the sums)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for how in ("monitor", "function"):
        torch.manual_seed(0)
        model = _net().blocks[0]
        parallelize_module(model, mesh, {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                                         "fc2": RowwiseParallel(output_layouts=Shard(1))})
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)).chunk(world, dim=1)[rank]
        model(x).pow(2).sum().backward()
        full = {n: _full(p.grad) for n, p in model.named_parameters()}
        partial = sorted(n for n, p in model.named_parameters() if p.grad.placements[0].is_partial())
        with dm.Monitor(quiet_config(log_interval=1), model=model, device_mesh=mesh) as monitor:
            if how == "monitor":
                returned = monitor.clip_grad_norm_(MAX_NORM)
            else:
                returned = dm.clip_grad_norm_(model.parameters(), MAX_NORM)
                monitor.measure_grad_norms()
            metrics = monitor.step(1)
        out[how] = {"truth": _truth(full), "partial": partial, "returned": float(returned.full_tensor()),
                    "clipped": {n: _full(p.grad).flatten().tolist() for n, p in model.named_parameters()},
                    "full": {n: t.flatten().tolist() for n, t in full.items()},
                    "metrics": {k: v for k, v in metrics.items() if k.startswith("grad_norm")}}
    return out


def test_partial_gradients_of_sequence_parallel_alone_are_measured_as_their_sums():
    """Under tensor parallelism with no FSDP, SequenceParallel's norm weights have Partial gradients:
    the norms refused them ("reduce the gradient before measuring"), where torch's clip measures
    them. They are measured reduced (one all-reduce each, as torch's), counted once, and the clip
    scales the parts, so the sums scale."""
    for result in run_ranks(_sequence_parallel_alone, 2, timeout=240):
        for how, out in result.items():
            assert out["partial"] == ["norm.bias", "norm.weight"], how  # the case holds Partial gradients
            total = out["truth"]["total"]
            assert out["returned"] == pytest.approx(total, rel=REL), how
            coef = MAX_NORM / (total + 1e-6)
            for name, grad in out["full"].items():
                assert out["clipped"][name] == pytest.approx([g * coef for g in grad], rel=1e-5, abs=1e-9), (how, name)
            if how == "monitor":
                assert out["metrics"]["grad_norm"] == pytest.approx(total, rel=REL)
                for module, value in out["truth"]["modules"].items():
                    assert out["metrics"][f"grad_norm/{module}"] == pytest.approx(value, rel=REL), module


def _ddp_stages_under_torch_pipelining(rank: int, world: int) -> dict:
    """Two pipeline stages (torch.distributed.pipelining, Schedule1F1B, 2 micro-batches), each a DDP
    module over its data-parallel group of one rank: the stage runs every forward inside no_sync()
    and all-reduces at the last micro-batch's backward itself. The Monitor's clip; truth: float64 of
    both stages' gradients, gathered."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(2 * world)]
    part = torch.nn.Sequential(*layers[2 * rank: 2 * rank + 2])
    model = DistributedDataParallel(part, process_group=mesh["dp"].get_group())
    stage = PipelineStage(model, rank, world, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, 2, loss_fn=lambda out, target: (out - target).pow(2).mean())
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 8)
    with dm.Monitor(quiet_config(log_interval=1), model=model, device_mesh=mesh) as monitor:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        squares = sum(float(p.grad.double().pow(2).sum()) for p in part.parameters())
        every = [None] * world
        dist.all_gather_object(every, squares)
        returned = float(monitor.clip_grad_norm_(1e9))
    return {"returned": returned, "truth": sum(every) ** 0.5}


def test_ddp_stages_of_torch_pipelining_are_not_taken_for_an_open_no_sync_window():
    """torch.distributed.pipelining runs a DDP stage's every forward inside no_sync() and readies DDP's
    reducer itself for the last micro-batch's backward, which all-reduces: the clip refused it on every
    rank ("ran its last forward inside no_sync()"), advice no loop on torch's schedules can follow."""
    for result in run_ranks(_ddp_stages_under_torch_pipelining, 2):
        assert result["returned"] == pytest.approx(result["truth"], rel=REL)

def _accumulation_windows(rank: int, world: int) -> dict:
    """Two micro-batches per step under DDP (``no_sync()``), FSDP2 (``set_requires_gradient_sync``)
    and HSDP (``set_requires_all_reduce``, over two replicas and over one): a clip and a measurement
    between them, then after the last backward. Truth: :func:`_micro_batches_and_truth`."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm
    from tests.dist_utils import CollectiveCounter

    data, truth = _micro_batches_and_truth(rank, world)
    out = {}
    for kind in ("ddp", "fsdp2", "hsdp", "hsdp one replica", "hsdp gradient sync"):
        model = _net()
        if kind == "ddp":
            model = DistributedDataParallel(model)
        else:
            shape, names = {"fsdp2": ((world,), ("shard",)), "hsdp": ((world, 1), ("replicate", "shard")),
                            "hsdp one replica": ((1, world), ("replicate", "shard")),
                            "hsdp gradient sync": ((world, 1), ("replicate", "shard"))}[kind]
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        window = {"ddp": lambda on: contextlib.nullcontext() if on else model.no_sync(),
                  "fsdp2": lambda on: model.set_requires_gradient_sync(on) or contextlib.nullcontext(),
                  "hsdp": lambda on: model.set_requires_all_reduce(on) or contextlib.nullcontext(),
                  "hsdp gradient sync": lambda on: model.set_requires_gradient_sync(on) or contextlib.nullcontext(),
                  }[kind if kind == "hsdp gradient sync" else kind.split()[0]]
        said = []
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            with window(False):
                model(data[0]).pow(2).mean().backward()
                grads_inside = sum(p.grad is not None for p in model.parameters())
                with CollectiveCounter() as counter:
                    for call in (lambda: monitor.clip_grad_norm_(MAX_NORM), monitor.measure_grad_norms):
                        try:
                            said.append(f"no error: {float(call()):.4f}")
                        except ValueError as err:
                            said.append(str(err))
            with window(True):
                model(data[1]).pow(2).mean().backward()
                monitor.clip_grad_norm_(1e9)
            metrics = monitor.step(1)
        out[kind] = {"said": said, "collectives": counter.collectives, "grad_norm": metrics["grad_norm"],
                     "truth": truth, "grads_inside": grads_inside}
    return out


def test_a_norm_inside_a_gradient_accumulation_window_is_refused_on_every_rank():
    """Inside DDP's no_sync() the clip measured rank 0's local gradients (grad_norm 0.0952 where the
    synchronised gradients' is 0.2324) and scaled rank 1's by rank 0's coefficient; inside FSDP2's
    set_requires_gradient_sync(False) the sharded .grad is None and the norm read 0, and so inside
    HSDP's set_requires_all_reduce(False), with one replica too (the reduce-scatter's output waits for
    the all-reduce). Each is refused before any collective, naming the state and what to do; after
    the last backward the norm is exact."""
    hsdp = ("set_requires_all_reduce(False)", "made with set_requires_all_reduce(True)")
    expected = {"ddp": ("is inside no_sync()", "outside no_sync()"),
                "fsdp2": ("set_requires_gradient_sync(False)", "made with set_requires_gradient_sync(True)"),
                "hsdp": hsdp, "hsdp one replica": hsdp,
                "hsdp gradient sync": ("HSDP module (the model itself) has gradient sync off",
                                       "made with set_requires_gradient_sync(True)")}
    for rank, result in enumerate(run_ranks(_accumulation_windows, 2, timeout=240)):
        for kind, (state, advice) in expected.items():
            out = result[kind]
            for said, call in zip(out["said"], ("monitor.clip_grad_norm_", "monitor.measure_grad_norms")):
                assert said.startswith(f"{call}: the model's ") and state in said and advice in said, (rank, kind, said)
                assert "after the last micro-batch's backward" in said, (rank, kind, said)
            assert out["collectives"] == 0, (rank, kind)
            assert out["grad_norm"] == pytest.approx(out["truth"], rel=REL), (rank, kind)
            assert out["grads_inside"] == 0 or kind == "ddp", (rank, kind)  # the norm would have read 0


def _flags_left_off_after_the_synced_backward(rank: int, world: int) -> dict:
    """FSDP2 and HSDP: two micro-batches, the first with the flag off, the last synced; the flag set off
    again before the clip, as Lightning Fabric leaves FSDP2's: nothing is held back, .grad is reduced."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    data, truth = _micro_batches_and_truth(rank, world)
    out = {}
    for kind, shape, flag in (("fsdp2", (world,), "set_requires_gradient_sync"),
                              ("hsdp", (world, 1), "set_requires_all_reduce")):
        model = _net()
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("shard",) if len(shape) == 1 else ("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            for micro_batch, on in enumerate((False, True)):
                getattr(model, flag)(on)
                model(data[micro_batch]).pow(2).mean().backward()
            getattr(model, flag)(False)  # left off, the next window's first micro-batch's way
            out[kind] = (float(monitor.measure_grad_norms()), float(monitor.clip_grad_norm_(1e9)), truth)
    return out


def test_a_sync_flag_left_off_after_the_last_synced_backward_is_no_open_window():
    """The flag set off again after the last micro-batch's synced backward (Lightning Fabric leaves FSDP2's
    so) was refused as an open window ("its sharded gradients are not reduced yet"), though .grad held
    the reduced gradients: every clip under such a loop raised. What shows a window is the gradients a
    backward held back; a flag off with none held back is measured, exact."""
    for rank, result in enumerate(run_ranks(_flags_left_off_after_the_synced_backward, 2, timeout=240)):
        for kind, (measured, clipped, truth) in result.items():
            assert measured == pytest.approx(truth, rel=REL) and clipped == pytest.approx(truth, rel=REL), \
                (rank, kind, result)


def _wrapped_after_the_monitor(rank: int, world: int) -> dict:
    """A Monitor given the model before ``fully_shard`` (Accelerate's ``prepare`` shards the module
    object in place): on the blocks and the root, and on each block and layer with the root left a
    plain module (its class unchanged). Two micro-batches, the first inside
    ``set_requires_gradient_sync(False)``: a measurement and a clip there, then a clip after the last
    backward against float64 of the ``full_tensor()`` gradients. Then a DDP module made around a
    model already given to a Monitor, and what the Monitor's ranks said of it."""
    import logging

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm
    from tests.dist_utils import CollectiveCounter

    data, _ = _micro_batches_and_truth(rank, world)
    out: dict = {}
    for case in ("root and blocks", "layers only"):
        model = _net()
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            sharded = [*model.blocks, model] if case == "root and blocks" else [*model.blocks, model.inp, model.out]
            for module in sharded:
                fully_shard(module)
            said, collectives = [], []
            for micro_batch, sync in enumerate((False, True)):
                for module in sharded:
                    module.set_requires_gradient_sync(sync)
                model(data[micro_batch]).pow(2).mean().backward()
                grads = [_full(p.grad) for p in model.parameters()] if sync else []  # inside: no .grad at all
                truth = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
                with CollectiveCounter() as counter:
                    for call in (monitor.measure_grad_norms, lambda: monitor.clip_grad_norm_(1e9)):
                        try:
                            said.append(float(call()))
                        except ValueError as err:
                            said.append(str(err))
                collectives.append(counter.collectives)
            monitor.step(1)
        out[case] = {"said": said, "truth": truth, "collectives": collectives[0]}
    heard: list = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    model = _net()
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        ddp = DistributedDataParallel(model)
        for _ in range(2):
            ddp(data[0]).pow(2).mean().backward()
            monitor.clip_grad_norm_(1e9)
    logging.getLogger("distmetrics").removeHandler(handler)
    out["heard"] = [message for message in heard if "DistributedDataParallel" in message]
    return out


def test_a_monitor_made_before_fully_shard_refuses_a_norm_inside_the_window_and_is_exact_after():
    """Made before fully_shard (as with Accelerate: the Monitor, then prepare), the Monitor looked for
    wrappers only at the last module registration, which fully_shard does not make: inside
    set_requires_gradient_sync(False) the measurement and the clip returned 0.0 on both ranks. Each is
    refused on every rank before any collective, with the root sharded or only the modules below it;
    after the last backward the norm is exact. A DDP module made around a model already given is said once."""
    for rank, result in enumerate(run_ranks(_wrapped_after_the_monitor, 2, timeout=240)):
        for case in ("root and blocks", "layers only"):
            out = result[case]
            for said, call in zip(out["said"][:2], ("monitor.measure_grad_norms", "monitor.clip_grad_norm_")):
                assert isinstance(said, str), (rank, case, said)  # not refused: the norm read 0.0
                assert said.startswith(f"{call}: the model's FSDP2 module"), (rank, case, said)
                assert "set_requires_gradient_sync(False)" in said, (rank, case, said)
            assert out["collectives"] == 0, (rank, case)
            assert out["said"][2:] == [pytest.approx(out["truth"], rel=REL)] * 2, (rank, case, out)
        heard = result["heard"]  # the job's first rank says it, once
        assert len(heard) == (rank == 0) and all("Give the Monitor the DistributedDataParallel module" in message
                                                  for message in heard), (rank, heard)


WINDOW_KINDS = ("ddp", "ddp static graph", "ddp find unused", "ddp in a wrapper", "compiled ddp", "fsdp2",
                "fsdp2 no reshard", "fsdp2 mixed precision", "hsdp", "hsdp one replica")


def _windows_closed_before_or_after_the_last_backward(rank: int, world: int) -> dict:
    """Two micro-batches per step. "closed": the window (DDP's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync``, HSDP's ``set_requires_all_reduce``) holds the first micro-batch
    only; two steps, an SGD step of lr 0 and an evaluation forward under torch.no_grad() between
    them, so both steps' gradients are the truth of :func:`_micro_batches_and_truth`. "late": the
    window holds both micro-batches' backwards and is closed (flags back on) only before the clip."""
    import contextlib

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm
    from tests.dist_utils import CollectiveCounter

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    def build(kind):
        if "ddp" in kind:
            ddp = DistributedDataParallel(_net(), static_graph=kind == "ddp static graph",
                                          find_unused_parameters=kind == "ddp find unused")
            model = {"ddp in a wrapper": Wrapper, "compiled ddp": lambda m: torch.compile(m, backend="eager")}.get(
                kind, lambda m: m)(ddp)
            return model, lambda: ddp.no_sync()
        shape = (1, world) if kind == "hsdp one replica" else (world, 1) if kind == "hsdp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        options = {"mesh": mesh, "reshard_after_forward": kind != "fsdp2 no reshard"}
        if kind == "fsdp2 mixed precision":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = _net()
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
        flag = model.set_requires_all_reduce if "hsdp" in kind else model.set_requires_gradient_sync

        @contextlib.contextmanager
        def window():
            flag(False)
            try:
                yield
            finally:
                flag(True)
        return model, window

    data, truth = _micro_batches_and_truth(rank, world)
    out: dict = {"truth": truth}
    for kind in WINDOW_KINDS:
        for late in (False, True) if kind != "ddp static graph" else (False,):  # torch's static graph: no
            model, window = build(kind)                                         # no_sync() at the first step
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            said = []
            with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
                for step in (1,) if late else (1, 2):
                    with window() if late else contextlib.nullcontext():
                        with contextlib.nullcontext() if late or kind == "ddp static graph" else window():
                            model(data[0]).pow(2).mean().backward()
                        model(data[1]).pow(2).mean().backward()
                    with CollectiveCounter() as counter:
                        try:
                            said.append(float(monitor.clip_grad_norm_(1e9)))
                        except ValueError as err:
                            said.append((str(err), counter.collectives))
                            break
                    optimizer.step()
                    monitor.step(step)
                    with torch.no_grad():
                        model(data[0])
                    optimizer.zero_grad()
            out[kind, late] = said
    return out


def test_a_window_closed_only_after_the_last_backward_is_refused_and_one_closed_before_is_not():
    """Under DDP, a last micro-batch whose backward ran inside no_sync() and a clip after the block
    gave rank 0's own norm (0.3527 for 0.3631) as the global one; under FSDP2 and HSDP, flags set back
    to True after the last backward (it did not reduce) and before the clip gave 0.0 (every .grad
    None). Each is refused on every rank before any collective; with the window closed before the
    last backward (static graph, unused parameters, a wrapper, torch.compile, mixed precision, one
    replica, an evaluation under torch.no_grad() after the optimizer step) the norm is exact."""
    late = {"ddp": "DistributedDataParallel module (the model itself) ran its last forward inside no_sync()",
            "ddp in a wrapper": "DistributedDataParallel module 'inner' ran its last forward inside no_sync()",
            "compiled ddp": "DistributedDataParallel module (the model itself) ran its last forward inside no_sync()",
            "fsdp2": "FSDP2 module (the model itself) holds gradients that its last backward did not reduce",
            "hsdp": "HSDP module (the model itself) holds gradients that its last backward did not reduce"}
    for rank, result in enumerate(run_ranks(_windows_closed_before_or_after_the_last_backward, 2, timeout=400)):
        measured = {kind: result[kind, True] for kind in WINDOW_KINDS
                    if (kind, True) in result and not isinstance(result[kind, True][0], tuple)}
        assert not measured, f"rank {rank}: not refused, norms {measured} (truth {result['truth']:.4f})"
        for kind in WINDOW_KINDS:
            rel = 0.02 if kind == "fsdp2 mixed precision" else REL  # bf16 forward and backward
            assert result[kind, False] == [pytest.approx(result["truth"], rel=rel)] * 2, (rank, kind)
            if kind == "ddp static graph":
                continue
            [(said, collectives)] = result[kind, True]
            expected = late[kind] if kind in late else late[kind.split()[0]]
            assert said.startswith(f"monitor.clip_grad_norm_: the model's {expected}"), (rank, kind, said)
            assert collectives == 0, (rank, kind)


def _monitor_step_per_micro_batch(rank: int, world: int) -> dict:
    """Two micro-batches per optimizer step under DDP (``no_sync()``) and FSDP2
    (``set_requires_gradient_sync``), update norms on: ``monitor.step`` once per optimizer step (the
    README's loop); so, with sync turned off for the next window before ``monitor.step`` (Lightning
    Fabric leaves FSDP2's so); so, then a window opened and ``close()`` (a preemption) with the
    interval's record unwritten; then once per micro-batch. What each rank's Monitor said."""
    import contextlib
    import logging

    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    data, _ = _micro_batches_and_truth(rank, world)
    out: dict = {}
    for kind in ("ddp", "fsdp2"):
        for per in ("optimizer step", "optimizer step, sync off after", "optimizer step, closed in a window",
                    "micro-batch", "micro-batch, Monitor made first", "micro-batch, logged after the last"):
            if kind == "ddp" and ("sync off after" in per or "made first" in per):  # FSDP2's own cases
                continue
            model = _net()
            first = per.endswith("made first")  # as with Accelerate: the Monitor, then the model sharded in place
            monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model) if first else None
            if kind == "ddp":
                model = DistributedDataParallel(model)
            else:
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            window = (lambda on: contextlib.nullcontext() if on else model.no_sync()) if kind == "ddp" else \
                (lambda on: model.set_requires_gradient_sync(on) or contextlib.nullcontext())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            heard: list = []
            handler = logging.Handler()
            handler.emit = lambda record: heard.append(record.getMessage())
            logging.getLogger("distmetrics").addHandler(handler)
            step = 0
            closed = per.endswith("in a window")
            if monitor is None:  # logged after the last: every log step after the synced micro-batch
                every = 3 if closed else 2 if per.endswith("after the last") else 1
                monitor = dm.Monitor(quiet_config(log_interval=every, log_update_norm=True), model=model,
                                     optimizer=optimizer)
            with monitor:
                for _ in range(2):
                    for last in (False, True):
                        with window(last):
                            model(data[last]).pow(2).mean().backward()
                        if last:
                            optimizer.step()
                            optimizer.zero_grad()
                            if per.endswith("sync off after"):
                                window(False)
                        if last or per.startswith("micro-batch"):
                            step += 1
                            monitor.step(step, loss=1.0)
                if closed:
                    with window(False):
                        model(data[0]).pow(2).mean().backward()  # the window open when close() writes step 2
            logging.getLogger("distmetrics").removeHandler(handler)
            out[f"{kind} per {per}"] = heard
    return out


def test_monitor_step_per_micro_batch_is_said_once_naming_the_open_window_not_a_missing_optimizer():
    """monitor.step called after each micro-batch of an accumulation window (inside DDP's no_sync(),
    FSDP2 with gradient sync off) was accepted with one warning only, which blamed a missing or
    skipped optimizer for the record's missing update_norm. The first rank now says, once, that
    monitor.step came inside the window, naming the module and its state, and the update-norm warning
    points to it; the README's loop (one monitor.step per optimizer step) says nothing. Looked for at the
    first monitor.step calls, not at log steps alone: with each log step after the last micro-batch
    (log_interval 2, 2 micro-batches) it went unsaid."""
    states = {"ddp": "DistributedDataParallel module (the model itself) ran its last forward inside no_sync()",
              "fsdp2": "FSDP2 module (the model itself) has gradient sync off (set_requires_gradient_sync(False))"}
    for rank, out in enumerate(run_ranks(_monitor_step_per_micro_batch, 2, timeout=240)):
        for kind, state in states.items():
            for per in ("optimizer step", "optimizer step, sync off after"):
                assert out.get(f"{kind} per {per}", []) == [], (rank, kind, per)
            assert out[f"{kind} per optimizer step, closed in a window"] == ([] if rank else [  # no window named
                "distmetrics: the record of step 2 has no update_norm: it is the record close() writes, of the steps "
                "after the last log step, and its step was not known ahead to be logged (total_steps names the job's "
                "last step). Said once"]), (rank, kind)
            # each log step after the last micro-batch: the window is found at the first monitor.step all the same
            heard = out[f"{kind} per micro-batch, logged after the last"]
            assert len(heard) == (0 if rank else 1) and all(h.startswith(
                "distmetrics: monitor.step(1) came inside a gradient-accumulation window") for h in heard), heard
            heard = out[f"{kind} per micro-batch"]
            if rank == 1:  # the job's warnings are said by its first rank
                assert heard == [], heard
                continue
            assert len(heard) == 2, heard
            assert heard[0].startswith(f"distmetrics: monitor.step(1) came inside a gradient-accumulation window: "
                                       f"the model's {state}"), heard
            assert "monitor.step is called once per optimizer step" in heard[0], heard
            assert "has no update_norm" in heard[1] and "inside a gradient-accumulation window" in heard[1], heard
            assert "No optimizer was given" not in heard[1], heard
        # made before fully_shard (the window found all the same), given no optimizer (said beside the window)
        heard = out["fsdp2 per micro-batch, Monitor made first"]
        assert len(heard) == (0 if rank else 2), heard
        if rank == 0:
            assert heard[0].startswith(f"distmetrics: monitor.step(1) came inside a gradient-accumulation window: "
                                       f"the model's {states['fsdp2']}"), heard
            assert "inside a gradient-accumulation window" in heard[1] and "No optimizer was given" in heard[1], heard


def test_megatrons_decoupled_grad_is_read_when_present():
    import torch

    model = torch.nn.Linear(4, 4)
    for p in model.parameters():  # Megatron's precision-aware optimizer leaves the gradient here
        p.decoupled_grad = torch.full_like(p, 2.0)
    truth = math.sqrt(4.0 * sum(p.numel() for p in model.parameters()))
    assert float(_plain_monitor(model).clip_grad_norm_(math.inf)) == pytest.approx(truth, rel=REL)


def test_a_nan_module_is_never_hidden_in_its_subtrees_max_or_min():
    """p = ±inf: a module whose gradient holds NaN makes every enclosing subtree NaN, whatever
    the order its siblings come in (Python's max(1.0, nan) is 1.0)."""
    import torch

    import distmetrics as dm
    from distmetrics.collectors.norms import subtree_values

    for combine in (max, min):
        out = subtree_values({"a.x": 1.0, "a.y": math.nan, "a.z": 2.0, "b": 3.0}, combine)
        assert math.isnan(out["a"]) and math.isnan(out["a.y"]) and out["a.x"] == 1.0 and out["b"] == 3.0
    assert subtree_values({"a.x": 1.0, "a.z": 2.0, "model": 5.0}, max) == {"a": 2.0, "a.x": 1.0, "a.z": 2.0,
                                                                           "model": 5.0}
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model = torch.nn.Sequential(block, torch.nn.Linear(3, 1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[0][1].weight.grad[0, 0] = math.nan
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    monitor.clip_grad_norm_(1.0, norm_type=math.inf)
    m = monitor.step(1)
    monitor.close()
    assert math.isnan(m["grad_norm/0.1"]) and math.isnan(m["grad_norm/0"]) and m["grad_norm/0.0"] == 1.0
    assert m["grad_norm/1"] == 1.0 and m["grad_nonfinite_modules"] == ["0.1"]
    for p in model.parameters():  # the clip above scaled every gradient by its NaN coefficient
        p.grad = torch.ones_like(p)
    model[0][1].weight.grad[0, 0] = math.inf  # p = 2: an infinite module, and so its block, is inf; the rest finite
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    monitor.clip_grad_norm_(1e9)
    m = monitor.step(1)
    monitor.close()
    assert m["grad_norm/0.1"] == math.inf and m["grad_norm/0"] == math.inf and m["grad_norm"] == math.inf
    assert m["grad_norm/0.0"] == pytest.approx(12 ** 0.5) and m["grad_nonfinite_modules"] == ["0.1"]


def test_the_gradient_that_counts_is_read_from_the_parameter_or_from_its_class():
    """``main_grad`` (Megatron), then ``decoupled_grad``, else ``.grad``; a parameter class that
    defines ``main_grad`` itself (a property) is asked too."""
    import torch

    from distmetrics.plans import grad_of

    class Buffered(torch.nn.Parameter):
        @property
        def main_grad(self):
            return self.grad * 10 if self.grad is not None else None

    plain, megatron, precise = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    buffered = Buffered(torch.ones(2))
    for p in (plain, megatron, precise, buffered):
        p.grad = torch.full((2,), 1.0)
    megatron.main_grad = torch.full((2,), 2.0)
    precise.decoupled_grad = torch.full((2,), 3.0)
    assert [float(grad_of(p)[0]) for p in (plain, megatron, precise, buffered)] == [1.0, 2.0, 3.0, 10.0]
    assert grad_of(torch.nn.Parameter(torch.ones(2))) is None


def test_the_clip_and_the_log_step_make_a_fixed_number_of_tensor_operations():
    """On one process the clip's tensor operations do not grow with the number of parameters
    (no per-parameter dispatch: a promotion, a copy), and a log step of every module's norms
    makes at most a few (its packs are Python lists on the host). Counted at torch's dispatcher."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import clip_and_log_step_ops

    def counts(modules: int) -> tuple:
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(modules)))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
        clip, log_step = clip_and_log_step_ops(monitor, 1.0)
        monitor.close()
        return sum(clip.values()), sum(log_step.values()), clip

    small, large = counts(20), counts(80)
    assert small[0] == large[0] <= 40, large[2]
    assert small[1] <= 6 and large[1] <= 6


def test_a_log_step_without_the_norms_it_had_before_writes_none_of_them_and_hides_param_norms():
    """Log step 1 has clip + update norms (and param norms only for the ratio, not written); log
    step 2 has neither: the names stay in the agreed layout, the values are absent, nothing
    stale or zero is written. relative_update_norm against a float64 truth."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
    model(torch.randn(4, 8)).sum().backward()
    before = [p.detach().clone().double() for p in model.parameters()]
    monitor.clip_grad_norm_(1e9)
    optimizer.step()
    first = monitor.step(1)
    after = [p.detach().double() for p in model.parameters()]
    update = sum(float((a - b).pow(2).sum()) for a, b in zip(after, before)) ** 0.5
    param = sum(float(a.pow(2).sum()) for a in after) ** 0.5
    assert first["update_norm"] == pytest.approx(update, rel=1e-6)
    assert first["relative_update_norm"] == pytest.approx(update / param, rel=1e-6)
    assert not [k for k in first if k.startswith("param_norm")]
    second = monitor.step(2)  # no clip, no optimizer step
    monitor.close()
    assert not [k for k in second if k.split("/", 1)[0] in ("grad_norm", "update_norm", "relative_update_norm",
                                                             "param_norm", "effective_lr_ratio")]


def test_an_update_measured_for_a_step_that_is_not_logged_is_never_written_later():
    """Update norms are snapshotted for the step predicted as the last + the last stride (1 at first).
    With step numbers advancing by 2 and log_interval 3, the optimizer step before step 4 is measured
    (step 3 was predicted, a log step) but step 4 is not logged; step 6 gets its own update, not
    step 4's."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    written = {}
    with dm.Monitor(quiet_config(log_interval=3, log_update_norm=True), model=model, optimizer=opt) as monitor:
        for step in (2, 4, 6, 7, 8, 9):
            opt.zero_grad()
            model(torch.randn(4, 3) * step).sum().backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            truth = sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(model.parameters(), before))
            metrics = monitor.step(step)
            if metrics is not None:
                written[step] = (metrics.get("update_norm"), truth ** 0.5)
    assert written[6][0] == pytest.approx(written[6][1], rel=1e-6)  # 4 -> 6 predicted: its own, not step 4's
    assert written[9][0] == pytest.approx(written[9][1], rel=1e-6)  # 8 -> 9 predicted: measured


def test_step_numbers_that_advance_by_two_get_their_update_and_grad_norms(caplog):
    """Steps 2, 4, 6... with log_interval 4: the next step was predicted as the last + 1, never a log
    step, so every record lacked update_norm (and measure_grad_norms() measured nothing), unsaid. The
    stride of the last two steps predicts it now: only step 4 (one step seen) misses its update, said
    once; the others are the float64 truth."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    written = {}
    with dm.Monitor(quiet_config(log_interval=4, log_update_norm=True), model=model, optimizer=opt) as monitor:
        for step in range(2, 17, 2):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).sum().backward()
            grad = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            measured = monitor.measure_grad_norms()
            before = [p.detach().double().clone() for p in model.parameters()]
            opt.step()
            update = math.sqrt(sum(float((p.detach().double() - b).pow(2).sum()) for p, b in zip(model.parameters(),
                                                                                                  before)))
            metrics = monitor.step(step)
            if metrics is not None:
                written[step] = (metrics.get("update_norm"), update, measured, grad)
    assert sorted(written) == [4, 8, 12, 16]
    assert written[4][0] is None and written[4][2] is None  # steps 2 -> 4: step 3 predicted
    for step in (8, 12, 16):
        got_update, update, got_grad, grad = written[step]
        assert got_update == pytest.approx(update, rel=1e-6) and float(got_grad) == pytest.approx(grad, rel=1e-6)
    said = [r.getMessage() for r in caplog.records if "was not known to be a log step" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("distmetrics: the record of step 4 has no update_norm nor grad_norm "
                                                 "(monitor.measure_grad_norms() measured nothing: pass step=)"), said


@pytest.mark.parametrize("total_steps, given", [(None, False), (None, True), (5, False)],
                         ids=["predicted", "step= given", "total_steps"])
def test_the_record_close_writes_says_what_it_lacks_unless_total_steps_names_its_step(tmp_path, caplog, total_steps,
                                                                                       given):
    """A loop over a dataloader ending between log steps (Accelerate's, with measure_grad_norms()): the record
    close() writes had no grad_norm nor update_norm, without a word. Said once now, also where each call was
    given its step (which only total_steps tells to be logged: that call said nothing); with total_steps the
    step is measured (truth: float64 of the gradients and of the parameters' change)."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = quiet_config(output_dir=str(tmp_path), json_log=True, log_interval=2, log_update_norm=True,
                          total_steps=total_steps)
    with dm.Monitor(config, model=model, optimizer=opt) as monitor:
        for step in range(1, 6):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).sum().backward()
            grad = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            monitor.measure_grad_norms(step=step if given else None)
            before = [p.detach().double().clone() for p in model.parameters()]
            opt.step()
            update = math.sqrt(sum(float((p.detach().double() - b).pow(2).sum())
                                   for p, b in zip(model.parameters(), before)))
            monitor.step(step)
    last = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"][-1]
    said = [r.getMessage() for r in caplog.records if "record of step 5 has no" in r.getMessage()]
    assert last["step"] == 5
    if total_steps is None:
        assert "grad_norm" not in last and "update_norm" not in last, last
        assert said == ["distmetrics: the record of step 5 has no update_norm nor grad_norm ("
                        "monitor.measure_grad_norms() "
                        "measured nothing): it is the record close() writes, of the steps after the last "
                        "log step, and its step was not known ahead to be logged (total_steps names the job's last "
                        "step). Said once"], said
    else:
        assert (last["grad_norm"], last["update_norm"]) == pytest.approx((grad, update), rel=1e-6) and not said


def test_the_record_close_writes_is_said_apart_from_a_change_of_stride_and_not_where_total_steps_named_it(tmp_path,
                                                                                                    caplog):
    """Steps 2, 4, ... 10 with log_interval 4: step 4's record misses its update (the stride changed), said
    once; the record close() writes, step 10, missed its own without a word (one flag for both). And with
    total_steps naming the last step, skipped by the optimizer: only the skipped step is said, not a step
    "not known ahead"."""
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for steps, total, folder in ((range(2, 11, 2), None, "stride"), (range(1, 6), 5, "skipped")):
        with dm.Monitor(quiet_config(output_dir=str(tmp_path / folder), log_interval=4, log_update_norm=True,
                                     total_steps=total), model=model, optimizer=opt) as monitor:
            for step in steps:
                opt.zero_grad()
                model(torch.randn(4, 3)).pow(2).sum().backward()
                skipped = folder == "skipped" and step == 5
                if not skipped:
                    opt.step()
                monitor.step(step, skipped=skipped)
    said = [r.getMessage() for r in caplog.records if "has no update_norm" in r.getMessage()]
    assert [line.split(":")[1] for line in said] == [" the record of step 4 has no update_norm",
                                                     " the record of step 10 has no update_norm",
                                                     " the record of step 5 has no update_norm"], said
    assert "a change of stride" in said[0] and "close() writes" in said[1] and "close()" not in said[2], said


def test_the_roots_own_parameters_beside_a_child_named_model_are_not_merged_with_it():
    """A wrapper with its own parameter and a child ``self.model`` (Hugging Face's layout):
    the child is ``grad_norm/model``, the root's own parameters ``grad_norm/root``, each equal
    to its float64 norm; the module order puts the root first."""
    import torch

    import distmetrics as dm

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logit_scale = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
            self.model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))

    torch.manual_seed(0)
    model = Wrapper()
    (model.model(torch.randn(4, 3)).sum() * model.logit_scale.sum()).backward()
    truth = lambda params: math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))  # noqa: E731
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        monitor.clip_grad_norm_(1e9)
        metrics = monitor.step(1)
    assert metrics["grad_norm/root"] == pytest.approx(truth([model.logit_scale]), rel=1e-6)
    assert metrics["grad_norm/model"] == pytest.approx(truth(model.model.parameters()), rel=1e-6)
    assert metrics["grad_norm/model.0"] == pytest.approx(truth(model.model[0].parameters()), rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(truth(model.parameters()), rel=1e-6)
    assert dm.naming.module_order(model)[:2] == ["root", "model"]


def test_a_norm_type_of_another_family_is_refused_at_the_clip_and_the_run_goes_on():
    """p = 2 then p = 3 is one family (a sum across ranks); inf afterwards would need grad_norm
    reduced as a max: refused at the clip, before any collective and before the gradients are
    scaled, naming both norm types; the monitor goes on with the first family."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        for step, p in enumerate((2.0, 3.0), 1):
            model.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            monitor.clip_grad_norm_(1e9, p)
            truth = sum(float(q.grad.double().abs().pow(p).sum()) for q in model.parameters()) ** (1 / p)
            assert monitor.step(step)["grad_norm"] == pytest.approx(truth, rel=1e-6)
        grads = [q.grad.clone() for q in model.parameters()]
        with pytest.raises(ValueError, match=r"norm_type=inf\).*as a max.*as a sum for norm_type=2 earlier"):
            monitor.clip_grad_norm_(1e-9, math.inf)
        assert all(torch.equal(q.grad, g) for q, g in zip(model.parameters(), grads))  # not scaled
        monitor.clip_grad_norm_(1e9, 2.0)
        assert monitor.step(3)["grad_norm"] > 0


@pytest.mark.parametrize("p", [0.0, 2.0, math.inf])
def test_a_nan_gradient_is_counted_and_named_under_every_norm_type_zero_included(p):
    """A p = 0 norm counts non-zero elements, so it is finite with a NaN in the gradient; the
    non-finite count and the module holding it come from one more pass then."""
    import torch

    import distmetrics as dm

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model(torch.randn(4, 3)).sum().backward()
    model[1].weight.grad[0, 1] = math.nan
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        monitor.clip_grad_norm_(1e9, p)
        metrics = monitor.step(1)
    assert metrics["grad_nonfinite"] == 1 and metrics["grad_nonfinite_modules"] == ["1"]


def test_a_sum_of_squares_past_the_float_range_is_not_a_nonfinite_gradient():
    """The non-finite count is 0 without a pass over the norms where their sum of squares is
    finite; a sum that overflows (a float64 gradient of 1e200: its norm is finite, its square
    is not) is counted exactly, from the norms themselves. Beside it, a gradient holding inf is
    counted."""
    import torch

    import distmetrics as dm

    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(2, 1, bias=False)).double()
    model[0].weight.grad = torch.full((1, 1), 1e200, dtype=torch.float64)
    model[1].weight.grad = torch.ones(1, 2, dtype=torch.float64)
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        monitor.clip_grad_norm_(1e9)
        overflowed = monitor.step(1)
        model[1].weight.grad[0, 1] = math.inf
        monitor.clip_grad_norm_(1e9)
        with_inf = monitor.step(2)
    assert overflowed["grad_nonfinite"] == 0 and "grad_nonfinite_modules" not in overflowed
    assert with_inf["grad_nonfinite"] == 1 and with_inf["grad_nonfinite_modules"] == ["1"]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, 0.5, math.inf, -math.inf, 0.0, 40.0])
def test_norms_of_scaled_gradients_with_their_loss_scale_are_those_of_the_gradients(norm_type):
    """fp16 gradients hold the loss times the loss scale: measured with it (a 0-d tensor, as
    Megatron's get_loss_scale() gives), every norm, bucket and count is the one of the gradients
    divided by it, measured apart. (Where |g·scale|^p overflows float64 inside a tensor's norm,
    p = 40 with Megatron's first dynamic scale of 2**32, the norm is inf either way.)"""
    import torch

    from distmetrics.grad_norm import GradientNorms

    model = _net()
    model(torch.randn(5, 8, generator=torch.Generator().manual_seed(3))).pow(2).mean().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    _, truth = GradientNorms(model).measure(None, norm_type)
    scale = 2.0 ** 16
    for n, p in model.named_parameters():
        p.grad = plain[n] * scale
    returned, measured = GradientNorms(model).measure(None, norm_type, loss_scale=torch.tensor([scale]))
    assert float(measured.total) == pytest.approx(float(truth.total), rel=1e-12)
    assert float(returned) == pytest.approx(float(truth.total), rel=1e-6)  # in the gradients' dtype, as torch's
    assert torch.allclose(measured.buckets, truth.buckets, rtol=1e-12, atol=0)
    assert float(measured.nonfinite) == float(truth.nonfinite) == 0.0


def _part_world_mesh(rank: int, world: int) -> tuple:
    """A (dp, tp) DeviceMesh made on every rank that spans rank 0 alone; the model's weight a DTensor on it there."""
    import logging

    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from distmetrics.parallel import model_parallel_mesh

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    mesh = DeviceMesh("cpu", torch.tensor([[0]]), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Linear(2, 2)
    if mesh.get_coordinate() is not None:
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate(), Replicate()]))
    return model_parallel_mesh(model) is None, said


def test_a_model_mesh_spanning_part_of_the_job_is_named_not_taken():
    """Without device_mesh=, a model's mesh with a tp dimension is taken for the layout only where it spans
    every rank (a part of the job cannot say which ranks are data-parallel); that is said, not skipped."""
    (none, said), (other_none, other_said) = run_ranks(_part_world_mesh, 2, timeout=60)
    assert none and other_none and other_said == []
    assert len(said) == 1 and "spans 1 of the 2 ranks" in said[0] and "pass device_mesh=" in said[0], said


# --- torchtitan's meshes: unflattened from a 1-D world mesh -------------------------------------

def _torchtitan_meshes(pp: int, replicate: int, shard: int, cp: int, tp: int) -> tuple:
    """torchtitan's ``ParallelDims.build_mesh``: a 1-D world mesh unflattened into the data mesh
    (pp, dp, cp, tp) and the dense compute mesh (pp, dp_replicate, dp_shard_cp, tp). Every sub-mesh
    FSDP2 and TP are given has the world mesh for its root, whose one dimension names nothing."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (pp * replicate * shard * cp * tp,), mesh_dim_names=("world",))
    data = world._unflatten(0, (pp, replicate * shard, cp, tp), ("pp", "dp", "cp", "tp"))
    compute = world._unflatten(0, (pp, replicate, shard * cp, tp), ("pp", "dp_replicate", "dp_shard_cp", "tp"))
    return data, compute


def _unflattened_meshes(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import distmetrics as dm

    def fsdp_tp():  # fsdp 2 x tp 2: the LayerNorms, inp and out sit on compute["dp_shard_cp"] alone
        data, compute = _torchtitan_meshes(1, 1, 2, 1, 2)
        model = _net()
        for block in model.blocks:
            parallelize_module(block, compute["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(block, mesh=compute["dp_shard_cp"])
        fully_shard(model, mesh=compute["dp_shard_cp"])
        batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(200 + data.get_local_rank("dp")))
        return model, batch, data

    out = {}
    for given in ("data_mesh", "model_only"):
        model, batch, data = fsdp_tp()
        out[given] = _measure_layout(model, torch.optim.AdamW(model.parameters(), lr=0.01), batch, tokens=6,
                                     mesh=data if given == "data_mesh" else None)

    model, batch, _ = fsdp_tp()  # the module-level clip: no layout but the parameters'
    model(batch).pow(2).mean().backward()
    grads = {_strip(n): _full(p.grad) for n, p in model.named_parameters()}
    truth = _truth(grads)["total"]
    total = float(dm.clip_grad_norm_(model.parameters(), MAX_NORM))
    coef = min(1.0, MAX_NORM / (truth + 1e-6))
    error = max(float((_full(p.grad) - grads[_strip(n)] * coef).abs().max()) for n, p in model.named_parameters())
    out["module_level"] = {"truth": truth, "returned": total, "clip_error": error,
                           "clip_scale": max(float(g.abs().max()) for g in grads.values()) * coef}

    # HSDP's replicate x shard folded into the data mesh's one dp dimension, FSDP2 on the shard ranks
    # only (a sub-mesh covering dp in part): each replica holds a copy, one counts
    data, compute = _torchtitan_meshes(1, 2, 2, 1, 1)
    model = _net()
    for block in model.blocks:
        fully_shard(block, mesh=compute["dp_shard_cp"])
    fully_shard(model, mesh=compute["dp_shard_cp"])
    batch = torch.randn(6, 8, generator=torch.Generator().manual_seed(300 + compute.get_local_rank("dp_shard_cp")))
    out["fsdp_in_dp"] = _measure_layout(model, torch.optim.AdamW(model.parameters(), lr=0.01), batch, mesh=data)

    # pp 2 x dp 2: stage s holds layers.s, sharded over its dp ranks; torchtitan passes -1 as the loss
    # of the stage that has none
    data, compute = _torchtitan_meshes(2, 1, 2, 1, 1)
    stage_index = data.get_local_rank("pp")
    torch.manual_seed(500 + stage_index)
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict({str(stage_index): torch.nn.Linear(8, 8)})
    layer = fully_shard(stage.layers[str(stage_index)], mesh=compute["dp_shard_cp"])
    monitor = dm.Monitor(quiet_config(log_interval=1, log_throughput=True), model=stage, device_mesh=data)
    layer(torch.randn(6, 8, generator=torch.Generator().manual_seed(600 + rank))).pow(2).mean().backward()
    squares = {(name, 0): float(_full(p.grad).pow(2).sum()) for name, p in stage.named_parameters()}
    returned = float(monitor.clip_grad_norm_(math.inf))
    metrics = monitor.step(1, loss=3.0 if stage_index == 1 else -1.0, tokens=10)
    monitor.close()
    out["pp"] = {"truth": subtree_norms(squares_by_name(squares, world)), "returned": returned, "metrics": metrics}
    return out


@pytest.fixture(scope="module")
def unflattened_results():
    return run_ranks(_unflattened_meshes, 4, timeout=300)


@pytest.mark.parametrize("given", ["data_mesh", "model_only", "fsdp_in_dp"])
def test_norms_and_tokens_are_exact_on_torchtitans_unflattened_meshes(unflattened_results, given):
    """fsdp 2 x tp 2 as current torchtitan builds it (its meshes unflattened from a 1-D world mesh),
    given the data mesh or the model only: the clip, total, per-module, parameter and update norms equal
    float64 truth from the full tensors, and each batch's tokens count once (before, every mesh was read
    through its root, which names nothing: the weights outside TP counted on both TP ranks, grad_norm
    1.48 for a truth of 1.22, the clip too strong, and tokens counted twice). FSDP2 on the shard ranks
    of the data mesh's dp dimension: one replica's copy counts."""
    for rank_result in unflattened_results:
        _check(rank_result[given])
        if given != "fsdp_in_dp":
            assert rank_result[given]["metrics"]["train/consumed_tokens"] == 12.0  # 2 replicas of 6


def test_the_module_level_clip_is_exact_on_torchtitans_unflattened_meshes(unflattened_results):
    """``dm.clip_grad_norm_`` has no mesh but the parameters': the TP weights' dp_shard_cp x tp mesh
    says which copies of the other weights count."""
    for rank_result in unflattened_results:
        r = rank_result["module_level"]
        assert r["returned"] == pytest.approx(r["truth"], rel=REL)
        assert r["clip_error"] <= 1e-6 * r["clip_scale"]


def test_an_unflattened_pp_x_dp_mesh_counts_every_stage_once_and_leaves_out_the_placeholder_loss(
        unflattened_results):
    for rank_result in unflattened_results:
        r = rank_result["pp"]
        assert r["returned"] == pytest.approx(r["truth"]["total"], rel=REL)
        assert r["metrics"]["grad_norm"] == pytest.approx(r["truth"]["total"], rel=REL)
        for module, value in r["truth"]["modules"].items():
            assert r["metrics"][f"grad_norm/{module}"] == pytest.approx(value, rel=REL), module
        assert r["metrics"]["train/loss"] == 3.0  # the last stage's, not averaged with stage 0's -1
        assert r["metrics"]["train/consumed_tokens"] == 20.0  # 2 replicas of 10, not 4


# --- fine-tuning: frozen parameters, parameters given to the clip, several clips, update norms ---

def _three_linears():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential()
    for name, (a, b) in (("enc", (4, 4)), ("mid", (4, 4)), ("dec", (4, 2))):
        model.add_module(name, nn.Linear(a, b))
    return model


@pytest.mark.parametrize("change", ["unfreeze", "freeze", "swap"])
def test_parameters_frozen_or_unfrozen_after_the_optimizer_step_keep_its_update_under_their_names(change):
    """Gradual unfreezing at the end of a step (after ``optimizer.step()``, before ``monitor.step``):
    the update, bucketed by the step's parameters, was named by the log step's: mid's update
    written as update_norm/enc (swap), or the log step raised on a vector of the wrong length.
    param_norm was over the log step's set: relative_update_norm the ratio of two sets (35 % low),
    param_norm/enc written for a layer frozen at the step."""
    import torch

    import distmetrics as dm

    model = _three_linears()
    if change in ("unfreeze", "swap"):
        model.enc.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True, log_params_norm=True), model=model,
                         optimizer=optimizer)
    for step in (1, 2, 3):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        trains = {name for name, p in model.named_parameters() if p.requires_grad}  # at the step
        before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
        monitor.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        truth = {}
        for name, p in model.named_parameters():
            module = name.split(".")[0]
            truth[module] = truth.get(module, 0.0) + float((p.detach().double() - before[name]).pow(2).sum())
        if step == 2:  # the callback at the end of step 2: enc trains from now on; mid stops, but for unfreeze
            model.enc.requires_grad_(True)
            model.mid.requires_grad_(change == "unfreeze")
        metrics = monitor.step(step)
        logged = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("update_norm/")}
        assert logged == pytest.approx({m: math.sqrt(v) for m, v in truth.items() if v > 0}, rel=1e-6), (step, change)
        squares = {}
        for name, p in model.named_parameters():
            module = name.split(".")[0]
            if name in trains:
                squares[module] = squares.get(module, 0.0) + float(p.detach().double().pow(2).sum())
        params = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("param_norm/")}
        assert params == pytest.approx({m: math.sqrt(v) for m, v in squares.items()}, rel=1e-6), (step, change)
        relative = math.sqrt(sum(truth.values())) / math.sqrt(sum(squares.values()))
        assert metrics["relative_update_norm"] == pytest.approx(relative, rel=1e-6), (step, change)
    monitor.close()


def test_two_clips_in_one_step_over_different_parameters_are_said_once(caplog):
    """A clip per parameter group: grad_norm is the last group's (0.385 of 0.478, no word)."""
    import torch

    import distmetrics as dm

    model = _three_linears()
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    for step in (1, 2):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        monitor.clip_grad_norm_(model.enc.parameters(), 1.0)
        last = monitor.clip_grad_norm_(list(model.mid.parameters()) + list(model.dec.parameters()), 1.0)
        assert monitor.step(step)["grad_norm"] == pytest.approx(float(last), rel=1e-6)
        monitor.clip_grad_norm_(1.0)  # the model's, twice in a step: the same parameters, nothing said
        monitor.clip_grad_norm_(1.0)
        model.zero_grad()
    monitor.close()
    said = [r.getMessage() for r in caplog.records if "called twice between two monitor.step" in r.getMessage()]
    assert len(said) == 1 and "(2, then 4: one call per parameter group?)" in said[0], said


@pytest.mark.parametrize("child", ["other", "unnamed"])
def test_parameters_not_the_models_are_named_unnamed_apart_from_a_module_of_that_name(child):
    """A loss temperature given to the clip is grad_norm/unnamed (README); beside a top-level module
    named 'unnamed' the two were one value, the norm of both (7.87 for 3.46 and 7.07), without a word.
    Truth: float64 norms of the gradients."""
    import torch
    from torch import nn

    import distmetrics as dm

    model = nn.Module()
    setattr(model, child, nn.Linear(3, 3))
    model.last = nn.Linear(3, 3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # 12 ones a module: sqrt(12)
    temperature = nn.Parameter(torch.ones(2))
    temperature.grad = torch.full((2,), 5.0)  # sqrt(50)
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        monitor.clip_grad_norm_(list(model.parameters()) + [temperature], 1e9)
        metrics = monitor.step(1)
    foreign = "unnamed" if child == "other" else "unnamed_2"
    assert {k: v for k, v in metrics.items() if k.startswith("grad_norm/")} == pytest.approx(
        {f"grad_norm/{child}": math.sqrt(12), "grad_norm/last": math.sqrt(12), f"grad_norm/{foreign}": math.sqrt(50)})


@pytest.mark.parametrize("extra", [False, True], ids=["model's parameters", "and one from the loss"])
def test_a_tied_weight_listed_twice_counts_once_and_is_scaled_once(extra):
    """Parameters listed per module, the tied embedding/head weight twice (torch's clip counts it
    twice and scales it twice). With a parameter from outside the model in the list it was counted
    twice (grad_norm 6.6% high, the tied gradient scaled by coef²); without one, once."""
    import torch
    from torch import nn

    import distmetrics as dm

    torch.manual_seed(0)
    model = nn.Module()
    model.embed, model.mid, model.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    temp = nn.Parameter(torch.ones(()))
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    (model.head(model.mid(model.embed(torch.randint(0, 10, (3,))))) * temp).logsumexp(-1).mean().backward()
    listed = [p for m in (model.embed, model.mid, model.head) for p in m.parameters()] + ([temp] if extra else [])
    unique = list({id(p): p for p in listed}.values())
    grads = {id(p): p.grad.double().clone() for p in unique}
    truth = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    total = monitor.clip_grad_norm_(listed, 0.01)
    assert float(total) == pytest.approx(truth, rel=1e-6)
    coef = 0.01 / (truth + 1e-6)
    for p in unique:
        assert torch.allclose(p.grad.double(), grads[id(p)] * coef, rtol=1e-5), p.shape
    assert monitor.step(1)["grad_norm"] == pytest.approx(truth, rel=1e-6)
    monitor.close()


def test_frozen_parameters_given_to_the_clip_are_not_missing_gradients():
    """A frozen base and its adapters, clipped with a parameter from the loss: the frozen weights
    (which have no gradient, as they should not) were counted in grad_missing_params (6 for 0)."""
    import itertools

    import torch
    from torch import nn

    import distmetrics as dm

    model = _three_linears()
    model.enc.requires_grad_(False)
    temp, unused = nn.Parameter(torch.ones(())), nn.Parameter(torch.ones(()))  # unused: trainable, no gradient
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    (model(torch.randn(3, 4)) * temp).pow(2).mean().backward()
    monitor.clip_grad_norm_(itertools.chain(model.parameters(), [temp, unused]), 1.0)
    assert monitor.step(1)["grad_missing_params"] == 1.0
    monitor.close()


def test_a_step_reported_skipped_has_no_update_norm_without_a_word_and_a_later_lack_is_said(caplog):
    """A step its GradScaler skipped, reported with ``skipped=True`` (Megatron's fp16 runs skip their first
    steps, as the dynamic scale comes down from 2**32), said "measured no update ... No optimizer was given"
    and used up the once-only warning: an optimizer replaced later and not given went unsaid. A step
    reported skipped is said as that, apart; the warning stays for a lack nothing explains."""
    import torch

    import distmetrics as dm

    def said():
        return [r.getMessage() for r in caplog.records if "update_norm" in r.getMessage()]

    model = _three_linears()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
    for step in (1, 2, 3, 4):
        if step == 4:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # rebuilt, not given to the Monitor
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        if step == 2:
            model.enc.weight.grad[0, 0] = float("inf")  # an overflow: the scaler skips the step
        scaler.unscale_(optimizer)
        monitor.measure_grad_norms()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
        assert skipped == (step == 2)
        metrics = monitor.step(step, skipped=skipped)
        assert ("update_norm" in metrics) == (step in (1, 3)), step
        assert len(said()) == {1: 0, 2: 1, 3: 1, 4: 2}[step], (step, said())
        optimizer.zero_grad()
    monitor.close()
    assert said()[0].startswith("distmetrics: the record of step 2 has no update_norm: its monitor.step was given "
                                "skipped=True"), said()
    assert "rank 0 owns trainable parameters but measured no update" in said()[1], said()


def test_update_norms_that_cannot_come_are_said_once(caplog):
    """log_update_norm without an optimizer, or with one replaced by a new one (gradual
    unfreezing rebuilds it): records without update_norm, and no word."""
    import torch

    import distmetrics as dm

    def said():
        return [r.getMessage() for r in caplog.records if "update_norm" in r.getMessage()]

    model = _three_linears()
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model)
    for step in (1, 2):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        assert "update_norm" not in monitor.step(step)
    monitor.close()
    assert len(said()) == 1 and "rank 0 owns trainable parameters but measured no update" in said()[0], said()
    assert "No optimizer was given to its Monitor" in said()[0]
    caplog.clear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
    for step in (1, 2, 3, 4):
        if step == 3:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # rebuilt, not given to the Monitor
        if step == 4:
            monitor.attach_megatron_optimizer(optimizer)  # given: update norms again
        model(torch.randn(3, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert ("update_norm" in monitor.step(step)) == (step != 3)
    monitor.close()
    assert len(said()) == 1 and "the record of step 3 has no update_norm" in said()[0], said()


def _stage_without_optimizer(rank: int, world: int, case: str) -> dict:
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(rank)
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleDict({str(rank): torch.nn.Linear(8, 8)})  # stage s holds layers.s
    frozen = case == "stage 0 frozen" and rank == 0
    stage.requires_grad_(not frozen)
    optimizer = None if frozen else torch.optim.SGD(stage.parameters(), lr=0.1)
    given = None if case == f"rank {rank} not given" or frozen else optimizer
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=stage, optimizer=given,
                         device_mesh=mesh)
    rows = []
    for step in (1, 2):
        before = [p.detach().double().clone() for p in stage.parameters()]
        if not frozen:
            for p in stage.parameters():
                p.grad = torch.full_like(p, float(rank + 1))
            optimizer.step()
        squares = torch.tensor([sum(float((p.detach().double() - b).pow(2).sum())
                                    for p, b in zip(stage.parameters(), before))], dtype=torch.float64)
        dist.all_reduce(squares)
        rows.append((monitor.step(step).get("update_norm"), math.sqrt(float(squares))))
    monitor.close()
    return {"rows": rows, "said": [m for m in said if "update_norm" in m]}


@pytest.mark.parametrize("case", ["rank 0 not given", "rank 1 not given", "stage 0 frozen"])
def test_a_stage_whose_monitor_has_no_optimizer_gives_no_partial_update_norm(case):
    """Pipeline stages each stepping their own optimizer, given to the Monitor on one stage only:
    update_norm was that stage's part (1.2 for 2.68), said nowhere (the check ran on rank 0 alone,
    about rank 0's own optimizer); a frozen stage, rightly without one, was said to lack it."""
    results = run_ranks(_stage_without_optimizer, 2, case, timeout=120)
    if case == "stage 0 frozen":
        for got, truth in results[0]["rows"]:
            assert got == pytest.approx(truth, rel=1e-6)
        assert results[0]["said"] == [] and results[1]["said"] == []
        return
    for result in results:
        assert [got for got, _ in result["rows"]] == [None, None]
    (message,) = results[0]["said"]
    assert f"rank {case[5]} owns trainable parameters but measured no update" in message, message


def test_the_update_ratios_take_the_clip_coefficient_from_the_reduced_total_not_the_device():
    """effective_lr_ratio read the clip's coefficient back from its tensor at every log step with
    update norms on: a device sync on a GPU. The reduced total on the host gives it."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    total = float(monitor.clip_grad_norm_(0.1))
    before = [p.detach().double().clone() for p in model.parameters()]
    optimizer.step()
    update = math.sqrt(sum(float((p.detach().double() - b).pow(2).sum()) for p, b in zip(model.parameters(), before)))
    monitor._by_name["norms"]._grad.coef = torch.empty((), device="meta")  # read back, it raises
    metrics = monitor.step(1)
    assert metrics["effective_lr_ratio"] == pytest.approx(update / (total * min(1.0, 0.1 / (total + 1e-6))), rel=1e-6)
    monitor.close()


def _replica_without_optimizer(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm

    torch.manual_seed(0)  # the same replica on both ranks (plain tensors: rank 0's count)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model,
                         optimizer=optimizer if rank == 0 else None)
    rows = []
    for step in (1, 2):
        before = [p.detach().double().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        moved = [float((p.detach().double() - b).pow(2).sum()) for p, b in zip(model.parameters(), before)]
        truth = math.sqrt(sum(moved))
        if step == 2 and rank == 1:  # where each parameter counts, read on the host: a device tensor is not read
            for route in monitor._by_name["norms"].grads.plans.model_plan().param_routes.values():
                route.owned = torch.empty(route.owned.shape, dtype=torch.bool, device="meta")
        rows.append((monitor.step(step).get("update_norm"), truth))
    monitor.close()
    return rows


def test_a_replica_that_counts_for_nothing_lacks_no_update_and_reads_no_device_value():
    """Plain replicas count on rank 0: rank 1, not given the optimizer, owns no parameter, so the
    update_norm rank 0 measured is the whole (not dropped); whether it owns one was read back from
    a device tensor at each such log step (a sync on a GPU)."""
    for rows in run_ranks(_replica_without_optimizer, 2, timeout=120):
        for got, truth in rows:
            assert got == pytest.approx(truth, rel=1e-6)


def _no_grad_forwards_between(rank: int, world: int) -> dict:
    """Two DDP modules, a GAN's: the discriminator's step runs the generator under torch.no_grad()
    (its last forward), and a reference forward of the discriminator under no_grad comes between
    its backward and the clip (a DPO loop's reference log-probs, a metrics pass)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"G": DDP(torch.nn.Linear(4, 4)), "D": DDP(torch.nn.Linear(4, 1))})
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    out = {}
    for step in (1, 2):
        model.zero_grad()
        with torch.no_grad():
            fake = model["G"](torch.randn(8, 4) + rank)
        model["D"](fake).pow(2).mean().backward()
        with torch.no_grad():
            model["D"](torch.randn(8, 4))  # a reference forward between the backward and the clip
        grads = [p.grad.detach().double().clone() for p in model["D"].parameters()]
        try:
            out[step] = (float(monitor.clip_grad_norm_(model["D"].parameters(), 1e9)),
                         sum(float(g.pow(2).sum()) for g in grads) ** 0.5)
        except ValueError as err:
            out[step] = str(err)
        monitor.step(step)
    monitor.close()
    return out


def test_forwards_under_no_grad_between_the_backward_and_the_clip_are_not_refused():
    """DDP turns require_forward_param_sync False after any forward under torch.no_grad(): reading
    it refused a GAN's discriminator clip (the generator ran under no_grad) and a clip after a
    reference forward, though the backward had all-reduced. The check notes forwards with grad only."""
    for out in run_ranks(_no_grad_forwards_between, 2):
        for step in (1, 2):
            assert isinstance(out[step], tuple), out[step]
            returned, truth = out[step]
            assert returned == pytest.approx(truth, rel=1e-6)  # the all-reduced gradients' norm


# --- low-precision parameters -----------------------------------------------------------

def _low_precision_step(model, optimizer, data, snapshot="device") -> dict:
    """One clipped step of a model whose parameters are bf16 (no mixed-precision policy): float64
    truth from the full tensors before and after, and of the gradients as the clip left them."""
    import torch

    import distmetrics as dm

    cfg = quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True, update_norm_snapshot=snapshot)
    monitor = dm.Monitor(cfg, model=model, optimizer=optimizer)
    model(data.to(torch.bfloat16)).float().pow(2).mean().backward()
    grads = {_strip(n): _full(p.grad) for n, p in model.named_parameters()}
    before = {_strip(n): _full(p) for n, p in model.named_parameters()}
    monitor.clip_grad_norm_(MAX_NORM)
    clipped = {_strip(n): _full(p.grad) for n, p in model.named_parameters()}
    optimizer.step()
    after = {_strip(n): _full(p) for n, p in model.named_parameters()}
    metrics = monitor.step(1)
    monitor.close()
    return {"grad": _truth(grads), "clipped": _truth(clipped)["total"],
            "update": _truth({n: after[n] - before[n] for n in after}),
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}


def _long_cpu_tensors(rank: int) -> dict:
    """One clipped DDP step of a Linear(4096, 4096) (16.8M elements: far past a CPU block) in bf16
    under AdamW (an update of near-equal magnitudes, the worst for a float32 running sum) and in
    fp32 under SGD: float64 truth of the gradient, the clipped gradient, the parameter and the update."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    out = {}
    for dtype, optimizer_of in ((torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                                (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1))):
        torch.manual_seed(0)  # the same weights on both ranks
        model = DistributedDataParallel(torch.nn.Linear(4096, 4096, bias=False).to(dtype))
        optimizer = optimizer_of(model.parameters())
        cfg = quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True, update_norm_snapshot="cpu")
        monitor = dm.Monitor(cfg, model=model, optimizer=optimizer)
        data = torch.randn(2, 4096, generator=torch.Generator().manual_seed(300 + rank)).to(dtype)
        model(data).float().pow(2).mean().backward()
        weight = model.module.weight
        grad = float(_full(weight.grad).norm())
        monitor.clip_grad_norm_(MAX_NORM)
        clipped, before = float(_full(weight.grad).norm()), _full(weight)
        optimizer.step()
        after = _full(weight)
        metrics = monitor.step(1)
        monitor.close()
        out[str(dtype).removeprefix("torch.")] = {
            "grad": grad, "clipped": clipped, "param": float(after.norm()), "update": float((after - before).norm()),
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}
    return out


def _long_equal_cpu_tensors() -> dict:
    """Replicas of one long fp32 CPU gradient whose elements are all of one magnitude (an AdamW update's
    shape, the worst for float32 running sums), clipped at 1-norm and 2-norm: the returned total, its
    float64 truth from the same fp32 elements, and one clipped element against the element scaled by
    the coefficient of that truth."""
    import torch

    import distmetrics as dm

    out = {}
    for name, numel, value in (("16M of 0.01", 1 << 24, 0.01), ("16M of 1/3", 1 << 24, 1 / 3),
                               ("4M of 1e-3", 1 << 22, 1e-3)):
        grad = torch.full((numel,), value)
        grad[1::2].neg_()
        for p in (1.0, 2.0):
            param = torch.nn.Parameter(torch.zeros(numel))
            param.grad = grad.clone()
            truth = float(torch.linalg.vector_norm(grad.double(), p))
            returned = float(dm.clip_grad_norm_([param], MAX_NORM, norm_type=p))
            out[(name, p)] = {"returned": returned, "truth": truth, "clipped": float(param.grad[0]),
                              "expected": float(grad[0].double() * MAX_NORM / (truth + 1e-6))}
    return out


def _low_precision(rank: int, world: int) -> dict:
    """bf16 parameters held as they are under DDP (both snapshot places) and FSDP2; an fp16 update
    past 65504."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    out = {}
    data = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + rank))
    for layout, snapshot in (("ddp_bf16", "device"), ("ddp_bf16_cpu_snapshot", "cpu")):
        model = DistributedDataParallel(_net().to(torch.bfloat16))
        out[layout] = _low_precision_step(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, snapshot)
    model = _net().to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out["fsdp2_bf16"] = _low_precision_step(model, torch.optim.AdamW(model.parameters(), lr=0.01), data)

    class Negate(torch.optim.Optimizer):
        """Every parameter becomes its negative: 40000 and -40000 are fp16 numbers, their difference is not."""

        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.neg_()

    model = DistributedDataParallel(torch.nn.Linear(4, 4).to(torch.float16))
    optimizer = Negate(model.parameters())
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
    with torch.no_grad():
        model.module.weight[0, 0] = 40000.0
    before = {_strip(n): _full(p) for n, p in model.named_parameters()}
    optimizer.step()
    after = {_strip(n): _full(p) for n, p in model.named_parameters()}
    out["fp16_past_65504"] = {"update": _truth({n: after[n] - before[n] for n in after}),
                              "metrics": monitor.step(1)}
    monitor.close()
    out["long"] = _long_cpu_tensors(rank)
    out["long_equal"] = _long_equal_cpu_tensors()

    dist.barrier()
    return out


@pytest.fixture(scope="module")
def low_precision_results():
    return run_ranks(_low_precision, 2, timeout=300)


@pytest.mark.parametrize("layout", ["ddp_bf16", "ddp_bf16_cpu_snapshot", "fsdp2_bf16", "fp16_past_65504"])
def test_updates_of_bf16_and_fp16_parameters_are_their_float64_difference(low_precision_results, layout):
    """The update of a bf16/fp16 parameter is taken in float32: in its own dtype the difference
    rounded each element where old and new differ by more than a factor of 2 (AdamW: 2.4e-5 of
    the total, 4.8e-5 of a module), and an fp16 difference past 65504 was inf."""
    for rank_result in low_precision_results:
        r = rank_result[layout]
        m = r["metrics"]
        assert m["update_norm"] == pytest.approx(r["update"]["total"], rel=REL)
        for module, value in r["update"]["modules"].items():
            assert m[f"update_norm/{module}"] == pytest.approx(value, rel=REL, abs=1e-12), module


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norms_of_cpu_tensors_past_a_block_are_their_float64_truth(low_precision_results, dtype):
    """torch's CPU norm sums in float32 with an error that grows with the length: on 16.8M
    elements the grad norm was 7e-4 off and a bf16 AdamW update norm 2.6e-3. Blocks in float64
    give the float64 truth for the gradient, parameter and update norms, and the clip scales by
    the true total (the clipped gradient's norm is max_norm)."""
    for rank_result in low_precision_results:
        r = rank_result["long"][dtype]
        m = r["metrics"]
        assert r["grad"] > 10 * MAX_NORM  # the step was clipped
        for key in ("grad", "param", "update"):
            assert m[f"{key}_norm"] == pytest.approx(r[key], rel=REL), key
        if dtype == "float32":  # bf16 gradients are rounded to bf16 as the clip scales them
            assert r["clipped"] == pytest.approx(MAX_NORM * r["grad"] / (r["grad"] + 1e-6), rel=REL)


@pytest.mark.parametrize("p", [1.0, 2.0])
@pytest.mark.parametrize("case", ["16M of 0.01", "16M of 1/3", "4M of 1e-3"])
def test_1_and_2_norms_of_long_fp32_cpu_tensors_of_one_magnitude_are_their_float64_truth(low_precision_results,
                                                                                        case, p):
    """fp32 CPU gradients (FSDP2's CPU offload) past 262,144 elements were taken in rows of 1024 whose norms
    torch adds one element (1-norm) or a few lanes (2-norm) at a time in float32: for elements all of one
    magnitude, 1-norms were up to 1.4e-5 off float64 truth (16M of 0.01), 2-norms 8e-7 (16M of 1/3). The
    README's bound, 5e-7, holds for the returned total and the clip's coefficient on every rank."""
    for rank_result in low_precision_results:
        r = rank_result["long_equal"][(case, p)]
        assert r["returned"] == pytest.approx(r["truth"], rel=5e-7, abs=0), (case, p, r)
        assert r["clipped"] == pytest.approx(r["expected"], rel=5e-7, abs=0), (case, p, r)


def test_effective_lr_ratio_under_bf16_gradients_is_over_the_clip_coefficient_times_the_norm(low_precision_results):
    """effective_lr_ratio divides by grad_norm times the clip's coefficient (bf16 here, from the
    bf16 total, as torch's clip computes it): the clipped gradient before its elements are rounded
    to bf16, within bf16's rounding unit 2**-8 of the norm of the gradients the clip stored."""
    import torch

    for rank_result in low_precision_results:
        for layout in ("ddp_bf16", "fsdp2_bf16"):
            r = rank_result[layout]
            m = r["metrics"]
            total = torch.tensor(m["grad_norm"], dtype=torch.bfloat16)
            coef = float(torch.clamp(MAX_NORM / (total + 1e-6), max=1.0))
            assert coef < 1.0  # the step was clipped
            assert m["effective_lr_ratio"] == pytest.approx(r["update"]["total"] / (m["grad_norm"] * coef), rel=REL)
            assert m["effective_lr_ratio"] == pytest.approx(r["update"]["total"] / r["clipped"], rel=2.0 ** -8)



# --- updates of a step with several optimizer steps, steps that raise, wrapped optimizers ------------

def _gan(dtype=None):
    """A generator and a critic in one module whose forward is either one's WGAN loss (so DDP
    averages the gradients of both); ``dtype``: the whole model's, or "mixed" (a bf16 critic)."""
    import torch
    from torch import nn

    class GAN(nn.Module):
        def __init__(self):
            super().__init__()
            self.G = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.D = nn.Linear(8, 1)

        def critic(self, x):
            return self.D(x.to(self.D.weight.dtype)).float().mean()

        def forward(self, who, z, real):
            fake = self.G(z.to(self.G[0].weight.dtype))
            if who == "G":
                return -self.critic(fake)
            unused = sum(p.sum() for p in self.G.parameters()).float()  # DDP: every parameter in the graph
            return self.critic(fake.detach()) - self.critic(real) + 0 * unused

    torch.manual_seed(0)
    model = GAN()
    if dtype == "mixed":
        model.D.to(torch.bfloat16)
    elif dtype is not None:
        model.to(dtype)
    return model


def _gan_step(net, who: str, generator, optimizers: dict, clip=None) -> None:
    """One optimizer step of ``who`` on its loss through ``net`` (the model, or its DDP wrapper)."""
    import torch

    model = getattr(net, "module", net)
    net(who, torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)).backward()
    if clip is not None:  # a clip per network
        clip(getattr(model, who).parameters(), 1e9)
    optimizers[who].step()
    for optimizer in optimizers.values():
        optimizer.zero_grad()


def _full_params(model) -> dict:
    import torch

    return {_strip(name): p.detach().to(torch.float64).clone() for name, p in model.named_parameters()}


def _update_truth(before: dict, after: dict) -> dict:
    """{"total", "modules"}: float64 norms of P_after − P_before on the full tensors."""
    return subtree_norms({name: float((after[name] - before[name]).pow(2).sum()) for name in before})


def _several_optimizer_steps(rank: int, world: int) -> dict:
    """A WGAN under DDP, generator and critic each with its own Adam, both attached: n_critic
    orders G, D, D and D, D, G between two monitor.step calls; then optimizers Monitor() refuses."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distmetrics as dm
    from tests.dist_utils import CollectiveCounter

    out: dict = {"rows": []}
    for order in ("GDD", "DDG"):
        model = _gan()
        ddp = DDP(model)
        optimizers = {"G": torch.optim.Adam(model.G.parameters(), lr=1e-2),
                      "D": torch.optim.Adam(model.D.parameters(), lr=3e-2)}
        monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=ddp, optimizer=optimizers["G"])
        monitor.attach_megatron_optimizer(optimizers["D"])  # any optimizer: every one that moves the model
        generator = torch.Generator().manual_seed(rank)  # each rank its own batches
        for step in (1, 2):
            before = _full_params(ddp)
            for who in order:
                _gan_step(ddp, who, generator, optimizers)
            truth = _update_truth(before, _full_params(ddp))
            metrics = monitor.step(step)
            out["rows"].append((order, step, truth, {k: v for k, v in metrics.items() if k.startswith("update_norm")}))
        monitor.close()

    class Wrapper:  # holds the optimizer, but not in .optimizer: nothing to hook
        def __init__(self, optimizer):
            self.opt, self.param_groups = optimizer, optimizer.param_groups

        def step(self):
            self.opt.step()

    out["refused"] = []
    for given in (Wrapper(torch.optim.SGD(model.parameters(), lr=0.1)), object()):
        with CollectiveCounter() as counter:
            try:
                dm.Monitor(quiet_config(log_update_norm=True), model=ddp, optimizer=given).close()
            except Exception as err:  # noqa: BLE001 - which error, and after how many collectives
                out["refused"].append((f"{type(err).__name__}: {err}", counter.collectives))
    return out


@pytest.fixture(scope="module")
def several_optimizer_steps():
    return run_ranks(_several_optimizer_steps, 2, timeout=180)


def test_an_update_is_the_whole_steps_whatever_optimizers_step_in_it_and_their_order(several_optimizer_steps):
    """A WGAN's generator and critic (n_critic 2), both attached, on 2 DDP ranks: a part stepping
    again replaced the step's whole update, the other optimizer's squares too (G, D, D:
    update_norm 0.018 for 0.095, update_norm/G 0.0 for 0.085). It is P after the step's last
    optimizer step − P before its first, total and per module."""
    for result in several_optimizer_steps:
        assert [row[:2] for row in result["rows"]] == [("GDD", 1), ("GDD", 2), ("DDG", 1), ("DDG", 2)]
        for order, step, truth, got in result["rows"]:
            assert got["update_norm"] == pytest.approx(truth["total"], rel=1e-6), (order, step)
            assert set(got) == {"update_norm"} | {f"update_norm/{module}" for module in truth["modules"]}
            for module, value in truth["modules"].items():
                assert got[f"update_norm/{module}"] == pytest.approx(value, rel=1e-6), (order, step, module)


@pytest.mark.parametrize("dtype", ["fp32", "mixed"])
def test_a_weight_clamp_between_critic_steps_is_left_out_of_fp32_updates_and_counted_in_bf16_ones(dtype):
    """The README's WGAN claim: a clamp of the critic's weights after each of its two steps is left out of an
    fp32 critic's update (the sum of the optimizer steps' moves), counted in a bf16 one's where it comes between
    two steps (P after the last optimizer step - P before the first), and the clamp after the last is in
    neither. Truth in float64 from the parameters around each step; one process."""
    import torch

    import distmetrics as dm

    model = _gan(None if dtype == "fp32" else "mixed")
    optimizers = {"G": torch.optim.Adam(model.G.parameters(), lr=1e-2),
                  "D": torch.optim.Adam(model.D.parameters(), lr=3e-2)}
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizers["G"])
    monitor.attach_megatron_optimizer(optimizers["D"])
    generator = torch.Generator().manual_seed(0)

    def critic() -> torch.Tensor:
        return torch.cat([p.detach().to(torch.float64).reshape(-1) for p in model.D.parameters()])

    for step in (1, 2):
        first, moves = critic(), 0.0
        _gan_step(model, "G", generator, optimizers)
        for _ in range(2):  # n_critic 2, each step clamped as a WGAN clamps
            before = critic()
            _gan_step(model, "D", generator, optimizers)
            last = critic()
            moves = moves + (last - before)
            with torch.no_grad():
                for p in model.D.parameters():
                    p.clamp_(-0.01, 0.01)
        got = monitor.step(step)["update_norm/D"]
        summed, spanned = float(moves.norm()), float((last - first).norm())
        assert abs(summed - spanned) > 0.1 * spanned  # the clamp moved the critic
        assert got == pytest.approx(summed if dtype == "fp32" else spanned, rel=1e-5), (step, got, summed, spanned)
    monitor.close()


def test_an_optimizer_whose_step_runs_no_hooks_is_refused_on_every_rank_before_any_collective(
        several_optimizer_steps):
    """A wrapper that is no torch optimizer and holds none in .optimizer: a bare AttributeError
    (register_step_pre_hook). Now a TypeError naming it and what is accepted, before any collective."""
    for result in several_optimizer_steps:
        (wrapper, wrapper_collectives), (other, other_collectives) = result["refused"]
        assert wrapper.startswith("TypeError: Monitor(optimizer=...): got a tests.test_norms."), wrapper
        assert ".Wrapper, which is no torch.optim.Optimizer" in wrapper, wrapper
        assert "Accepted: a torch.optim.Optimizer" in wrapper, wrapper
        assert other.startswith("TypeError: Monitor(optimizer=...): got a builtins.object,"), other
        assert wrapper_collectives == 0 and other_collectives == 0


@pytest.mark.parametrize("dtype,snapshot", [(None, "cpu"), ("bfloat16", "device"), ("mixed", "device")])
def test_several_optimizer_steps_in_a_step_are_measured_whole_in_every_precision(dtype, snapshot):
    """One rank, G then D twice, a clip per network: the step's update (float64 truth) from bf16
    pieces (kept as copied) and fp32 ones (holding the difference, made the old parameters again
    before the next optimizer step), the copy on the device or the CPU, let go at monitor.step; and no
    total effective_lr_ratio, the step's whole update over the last clip's network's norm."""
    import torch

    import distmetrics as dm

    model = _gan(torch.bfloat16 if dtype == "bfloat16" else dtype)
    optimizers = {"G": torch.optim.SGD(model.G.parameters(), lr=0.1),
                  "D": torch.optim.SGD(model.D.parameters(), lr=0.3)}
    config = quiet_config(log_interval=1, log_update_norm=True, log_params_norm=True, update_norm_snapshot=snapshot)
    monitor = dm.Monitor(config, model=model, optimizer=optimizers["D"])
    monitor.attach_megatron_optimizer(optimizers["G"])
    generator = torch.Generator().manual_seed(0)
    for step in (1, 2):
        before = _full_params(model)
        for who in "GDD":
            _gan_step(model, who, generator, optimizers, clip=monitor.clip_grad_norm_)
        truth = _update_truth(before, _full_params(model))
        metrics = monitor.step(step)
        assert monitor._by_name["norms"]._snapshot is None
        assert metrics["update_norm"] == pytest.approx(truth["total"], rel=1e-6), step
        for module, value in truth["modules"].items():
            assert metrics[f"update_norm/{module}"] == pytest.approx(value, rel=1e-6), (step, module)
        # the update holds two of D's steps, the gradient is the last one's: no ratio of them
        assert not [key for key in metrics if key.startswith("effective_lr_ratio")], metrics
    monitor.close()


def test_one_optimizer_stepping_twice_in_a_step_is_measured_whole_from_the_next_log_step(caplog):
    """One optimizer: its copy goes right after its step (not held through a forward and backward
    before monitor.step). Stepping twice in a step is then seen at the second step: that record has
    no update_norm (said once), the later ones the whole step's (float64 truth), none a
    effective_lr_ratio (two steps' update over the last gradient: 0.206 for an lr of 0.1)."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    written, held = {}, []
    with dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer) as monitor:
        for step in (1, 2, 3):
            before = [p.detach().double().clone() for p in model.parameters()]
            for _ in range(2 if step > 1 else 1):
                optimizer.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                monitor.clip_grad_norm_(1e9)
                optimizer.step()
                held.append(monitor._by_name["norms"]._snapshot is not None)
            truth = math.sqrt(sum(float((p.detach().double() - b).pow(2).sum()) for p, b in zip(model.parameters(),
                                                                                                 before)))
            written[step] = (monitor.step(step), truth)
    assert held == [False, False, False, True, True], held  # kept once a second step was seen (step 3)
    assert written[1][0]["update_norm"] == pytest.approx(written[1][1], rel=1e-6)
    assert "effective_lr_ratio" in written[1][0]
    assert "update_norm" not in written[2][0] and not any("effective_lr" in key for key in written[2][0])
    assert written[3][0]["update_norm"] == pytest.approx(written[3][1], rel=1e-6)
    assert not any("effective_lr" in key for key in written[3][0])
    said = [r.getMessage() for r in caplog.records if "stepped more than once" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("distmetrics: the record of step 2 has no update_norm"), said


def test_a_log_step_whose_own_optimizer_step_did_not_run_never_gets_an_earlier_update():
    """Steps 1, 2, 4, 5, 6 with log_interval 3: after the jump from 2 to 4, the next step was predicted
    as 6 and the optimizer step before step 5 was measured for it; step 6's own optimizer step did not
    run (a skipped step). Step 6's record showed step 5's update; it has none now."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with dm.Monitor(quiet_config(log_interval=3, log_update_norm=True), model=model, optimizer=optimizer) as monitor:
        for step in (1, 2, 4, 5, 6):
            optimizer.zero_grad()
            model(torch.randn(4, 3)).pow(2).sum().backward()
            if step != 6:
                optimizer.step()
            metrics = monitor.step(step)
    assert metrics is not None and "update_norm" not in metrics, metrics


def _flaky_sgd(params, fail_at: set):
    """An SGD whose step raises at the calls numbered in ``fail_at`` (an out-of-memory error the loop catches)."""
    import torch

    class Flaky(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Flaky.calls += 1
            if Flaky.calls in fail_at:
                raise RuntimeError("out of memory (simulated)")
            return super().step(closure)

    return Flaky(params, lr=0.1)


@pytest.mark.parametrize("log_interval,fails,retry", [(1, 2, False), (2, 3, False), (1, 2, True)],
                         ids=["at a log step", "before one", "retried"])
def test_an_optimizer_step_that_raises_does_not_end_update_norms(log_interval, fails, retry, caplog):
    """A step that raised left the hooks' count of steps under way at 1 for good: no update_norm
    for the rest of the run, the snapshot never let go, a "did not step" warning at the next log
    step. Now it is forgotten at its retry (measured from before the failed try) or monitor.step."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = _flaky_sgd(model.parameters(), {fails})
    monitor = dm.Monitor(quiet_config(log_interval=log_interval, log_update_norm=True), model=model,
                         optimizer=optimizer)
    rows = []
    for step in range(1, 7):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        before = _full_params(model)
        try:
            optimizer.step()
        except RuntimeError:
            if retry:
                optimizer.step()
        optimizer.zero_grad()
        truth = _update_truth(before, _full_params(model))["total"]
        metrics = monitor.step(step)
        assert monitor._by_name["norms"]._snapshot is None, step
        if metrics is not None:
            rows.append((step, metrics.get("update_norm"), truth))
    monitor.close()
    raised_at_log_step = log_interval == 1 and not retry
    for step, got, truth in rows:
        if step == fails and raised_at_log_step:  # the step that raised moved nothing: no update, said
            assert got is None
        else:
            assert got == pytest.approx(truth, rel=1e-6), (step, rows)
    said = [r.getMessage() for r in caplog.records if "no update_norm" in r.getMessage()]
    assert len(said) == raised_at_log_step, said


def test_a_wrapper_subclassing_optimizer_without_its_init_is_hooked_through_its_optimizer():
    """Accelerate's AcceleratedOptimizer subclasses torch.optim.Optimizer without calling its
    __init__ and keeps the real one in .optimizer: Monitor() raised AttributeError
    (_optimizer_step_pre_hooks), or, with hook dictionaries of its own, no hook ran."""
    from collections import OrderedDict

    import torch

    import distmetrics as dm

    class Accelerated(torch.optim.Optimizer):
        def __init__(self, optimizer, own_hooks):
            self.optimizer = optimizer
            if own_hooks:
                self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        def step(self, closure=None):
            return self.optimizer.step(closure)

    for own_hooks in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = Accelerated(torch.optim.SGD(model.parameters(), lr=0.1), own_hooks)
        monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
        for step in (1, 2):
            model(torch.randn(2, 4)).sum().backward()
            before = _full_params(model)
            optimizer.step()
            model.zero_grad()
            truth = _update_truth(before, _full_params(model))["total"]
            assert monitor.step(step)["update_norm"] == pytest.approx(truth, rel=1e-6), (own_hooks, step)
        monitor.close()


def test_a_wrapper_handing_its_attributes_on_is_hooked_through_the_optimizer_it_holds():
    """A wrapper that forwards attributes (__getattr__) to an optimizer it keeps under another name
    than .optimizer was measured before hooks went through .optimizer only, then refused."""
    import torch

    import distmetrics as dm

    class Forwarding:
        def __init__(self, optimizer):
            self._inner = optimizer

        def __getattr__(self, name):
            return getattr(self._inner, name)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = Forwarding(torch.optim.SGD(model.parameters(), lr=0.1))
    with dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer) as monitor:
        model(torch.randn(2, 4)).sum().backward()
        before = _full_params(model)
        optimizer.step()
        truth = _update_truth(before, _full_params(model))["total"]
        assert monitor.step(1)["update_norm"] == pytest.approx(truth, rel=1e-6)


def test_a_log_step_whose_step_a_grad_scaler_skipped_after_others_stepped_says_so_once(caplog):
    """log_interval 2, the scaler skipping step 4's optimizer step (an inf gradient) after step 3's
    stepped: the record had no update_norm and no word, where one is said."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = dm.Monitor(quiet_config(log_interval=2, log_update_norm=True), model=model, optimizer=optimizer)
    records = {}
    for step in range(1, 7):
        scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
        if step == 4:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        metrics = monitor.step(step, skipped=step == 4)
        if metrics is not None:
            records[step] = "update_norm" in metrics
    monitor.close()
    assert records == {2: True, 4: False, 6: True}
    said = [r.getMessage() for r in caplog.records if "no update_norm" in r.getMessage()]
    assert len(said) == 1 and "the record of step 4 has no update_norm" in said[0], said
    assert "its monitor.step was given skipped=True" in said[0]


def test_a_tied_weight_counts_once_under_its_first_module():
    """README (Norms): a head tied to the embedding adds nothing to the total twice and has no name of
    its own; the embedding's norm is the tied weight's whole gradient (both uses), in float64."""
    import torch

    import distmetrics as dm

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.mid = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.mid(self.embed(x))).pow(2).mean()

    torch.manual_seed(0)
    model = Tied()
    model(torch.arange(5)).backward()
    norm = lambda params: math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))  # noqa: E731
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        total = float(monitor.clip_grad_norm_(1e9))
        metrics = monitor.step(1)
    assert total == pytest.approx(norm(model.parameters()), rel=1e-6)  # parameters() lists the tied weight once
    assert metrics["grad_norm/embed"] == pytest.approx(norm([model.embed.weight]), rel=1e-6)
    assert "grad_norm/head" not in metrics and metrics["grad_norm"] == pytest.approx(total, rel=1e-6)


def test_hooks_that_run_twice_for_one_step_count_it_once():
    """A subclass whose step() calls super().step() (torch hooks both classes' step once each was
    made), or one optimizer given twice: the hooks ran pre, pre, post, post and the step counted twice,
    which took effective_lr_ratio out of every record (an SGD's is its lr, 0.1) and held the copy."""
    import torch

    import distmetrics as dm

    class Subclassed(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # the parent's step is hooked too
    for case in ("subclass", "given twice"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = (Subclassed if case == "subclass" else torch.optim.SGD)(model.parameters(), lr=0.1)
        with dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model,
                        optimizer=optimizer) as monitor:
            if case == "given twice":
                monitor.attach_megatron_optimizer(optimizer)
            for step in (1, 2):
                optimizer.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                monitor.clip_grad_norm_(1e9)
                optimizer.step()
                held = monitor._by_name["norms"]._snapshot is not None
                metrics = monitor.step(step)
                assert metrics["effective_lr_ratio"] == pytest.approx(0.1, rel=1e-5) and not held, (case, step)


@pytest.mark.parametrize("steps,log_interval", [((1, 2, 3), 1), ((1, 3, 4, 5), 5)])
def test_a_step_left_out_for_a_second_optimizer_step_is_said_and_only_that_step(caplog, steps, log_interval):
    """One optimizer stepping twice, at every step from the first: the first record lost its
    update_norm unsaid (the drop was filed under the placeholder of the first step's number). Or at
    step 4 only, of steps 1, 3, 4, 5: after the jump from 1 to 3 the optimizer steps before step 4 were
    taken for step 5's, the drop was filed under step 5, and step 5's own snapshot was refused, with a
    wrong warning. Now the first is said, and step 5 is measured."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    written = {}
    with dm.Monitor(quiet_config(log_interval=log_interval, log_update_norm=True), model=model,
                    optimizer=optimizer) as monitor:
        for step in steps:
            for _ in range(2 if log_interval == 1 or step == 4 else 1):
                optimizer.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                optimizer.step()
            metrics = monitor.step(step)
            if metrics is not None:
                written[step] = "update_norm" in metrics
    said = [r.getMessage() for r in caplog.records if "stepped more than once" in r.getMessage()]
    if log_interval == 1:
        assert written == {1: False, 2: True, 3: True} and len(said) == 1 and "step 1 " in said[0], (written, said)
    else:
        assert written == {5: True} and not said, (written, said)


def _ddp_made_before_distmetrics(rank: int, world: int) -> dict:
    """A DDP module made before distmetrics' first Monitor (as Trainer and Accelerate wrap the model,
    then a callback makes the Monitor), the Monitor given the module inside it."""
    import logging
    import sys

    import torch
    from torch.nn.parallel import DistributedDataParallel

    loaded_before = "distmetrics.grad_sync" in sys.modules
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    import distmetrics as dm

    heard: list = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        ddp(torch.randn(3, 4)).sum().backward()
        monitor.clip_grad_norm_(1e9)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"loaded before": loaded_before, "heard": [m for m in heard if "DistributedDataParallel" in m]}


def test_a_ddp_module_made_before_distmetrics_was_loaded_is_still_said():
    """The registration hook that notes a DDP module around the model is installed when distmetrics
    loads its Monitor, lazily at the first dm.Monitor: a DDP made before that (Trainer, Accelerate) was
    never seen, and norms inside its no_sync() went unsaid. The objects referring to the model are
    searched once instead."""
    for rank, out in enumerate(run_ranks(_ddp_made_before_distmetrics, 2, timeout=120)):
        assert not out["loaded before"], rank
        assert len(out["heard"]) == (rank == 0), (rank, out["heard"])


def test_an_optimizer_replaced_and_attached_again_is_hooked_even_at_the_old_ones_address():
    """Optimizers attached after the Monitor are not kept alive by it: a new one, attached as the
    lacks-update warning says, may take the freed one's address, and a check of attached optimizers by
    id hooked nothing (no update_norm for the rest of the job). Whatever the address, it is measured."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    with dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model) as monitor:
        monitor.attach_megatron_optimizer(optimizer)
        for step in range(1, 5):
            if step == 3:  # a new phase, a new optimizer
                del optimizer
                optimizer = torch.optim.SGD(params, lr=0.1)
                monitor.attach_megatron_optimizer(optimizer)
            optimizer.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            before = _full_params(model)
            optimizer.step()
            truth = _update_truth(before, _full_params(model))["total"]
            assert monitor.step(step)["update_norm"] == pytest.approx(truth, rel=1e-6), step


def test_an_infinity_norm_of_float64_gradients_is_written_as_the_clip_returns_it():
    """grad_norm for norm_type ±inf travelled the MAX pack as float32: float64 gradients of 1e300 were
    written as an inf grad_norm (no gradient was zeroed: the clip scaled by 1e300), and 1e-42 as
    1.0005e-42. The record now has the clip's float64 total, torch's value."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    for p, values in ((math.inf, [1e300, 2.0]), (math.inf, [1.000000123456789, 0.5]), (-math.inf, [1e-300, 2.0]),
                      (-math.inf, [1e-42, 2.0])):
        model = torch.nn.Linear(2, 1, bias=False).double()
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            model.weight.grad = torch.tensor([values], dtype=torch.float64)
            returned = float(monitor.clip_grad_norm_(1e-3, p))
            record = monitor.step(1)
        truth = float(torch.linalg.vector_norm(torch.tensor(values, dtype=torch.float64), p))
        assert returned == truth and record["grad_norm"] == truth, (p, values, returned, record["grad_norm"])
        assert record["grad_clip_ratio"] == truth / 1e-3


@pytest.mark.parametrize("case", ["per module off", "norm_type 1", "max_norm inf"])
def test_the_ratios_and_per_module_norms_left_out_as_the_readme_says(case):
    """README: log_grad_norm_per_module false leaves out every per-module norm, not grad_norm's alone;
    no effective_lr_ratio for a clip of norm_type other than 2; no grad_clip_ratio for an inf max_norm.
    (These back README sentences: the behaviour did not change.)"""
    import torch

    import distmetrics as dm

    model = _three_linears()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = quiet_config(log_interval=1, log_update_norm=True, log_params_norm=True,
                          log_grad_norm_per_module=case != "per module off")
    with dm.Monitor(config, model=model, optimizer=optimizer) as monitor:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        max_norm = math.inf if case == "max_norm inf" else 0.01
        monitor.clip_grad_norm_(max_norm, norm_type=1 if case == "norm_type 1" else 2)
        optimizer.step()
        metrics = monitor.step(1)
    families = ("grad_norm", "param_norm", "update_norm", "relative_update_norm", "effective_lr_ratio")
    per_module = sorted({key.split("/")[0] for key in metrics if key.split("/")[0] in families and "/" in key})
    totals = sorted(key for key in metrics if key in families + ("grad_clip_ratio",))
    if case == "per module off":
        assert per_module == [] and totals == sorted(families + ("grad_clip_ratio",))
    elif case == "norm_type 1":
        assert "effective_lr_ratio" not in per_module + totals and "grad_clip_ratio" in totals
    else:
        assert "grad_clip_ratio" not in totals and "effective_lr_ratio" in totals


@pytest.mark.parametrize("first, second, call", [(math.inf, -math.inf, "clip_grad_norm_"),
                                                 (-math.inf, 2.0, "clip_grad_norm_"),
                                                 (2.0, math.inf, "measure_grad_norms")])
def test_a_norm_type_of_another_family_is_refused_naming_the_monitors_call(first, second, call):
    """README: one family of norm types per run (p-norms, inf, -inf), refused before the gradients
    change; the message named a bare clip_grad_norm_ for the Monitor's. Truth: the gradients set."""
    import torch
    from torch import nn

    import distmetrics as dm

    model = nn.Linear(3, 3)
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0)
        monitor.clip_grad_norm_(1e9, norm_type=first)
        with pytest.raises(ValueError, match=rf"^monitor\.{call}\(norm_type={second:g}\): grad_norm is reduced"):
            getattr(monitor, call)(*(() if call == "measure_grad_norms" else (1e-3,)), norm_type=second)
        assert all(bool((p.grad == 2.0).all()) for p in model.parameters())


@pytest.mark.parametrize("case", ["a clip per group", "a clip of a part", "lbfgs", "a closure", "log_grad_norm off"])
def test_effective_lr_ratio_only_where_the_gradient_measured_is_the_whole_updates(case):
    """Plain SGD moves each parameter by lr x its clipped gradient: the true ratio is lr (0.1). A
    clip per parameter group (weights, then biases) wrote effective_lr_ratio/enc as enc's whole
    update over its bias's gradient (5x), a clip of enc alone the total over enc's gradient (1.9x),
    LBFGS the update of its 5 inner iterations over the last closure's gradient (15x); each is left
    out. A module the last clip measured whole keeps its ratio, and a clip inside a step(closure) that
    runs it once (Lightning's) is the step's gradient. log_grad_norm off: none (README)."""
    import torch

    import distmetrics as dm

    model = _three_linears()
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    if case == "lbfgs":
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    elif case == "a clip per group":
        optimizer = torch.optim.SGD([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = quiet_config(log_interval=1, log_update_norm=True, log_params_norm=True,
                          log_grad_norm=case != "log_grad_norm off")
    x = torch.randn(8, 4)
    with dm.Monitor(config, model=model, optimizer=optimizer) as monitor:
        def closure():
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            monitor.clip_grad_norm_(1e6)
            return loss

        if case in ("lbfgs", "a closure"):
            optimizer.step(closure)
        else:
            model(x).pow(2).mean().backward()
            if case == "a clip per group":
                monitor.clip_grad_norm_(weights, 1e6)
                monitor.clip_grad_norm_(biases, 1e6)
            elif case == "a clip of a part":
                monitor.clip_grad_norm_(list(model.enc.parameters()) + list(model.mid.parameters()), 1e6)
            else:
                monitor.clip_grad_norm_(1e6)
            optimizer.step()
        metrics = monitor.step(1)
    ratios = {k: v for k, v in metrics.items() if k.startswith("effective_lr_ratio")}
    assert "update_norm" in metrics
    if case == "a clip of a part":
        assert ratios == pytest.approx({"effective_lr_ratio/enc": 0.1, "effective_lr_ratio/mid": 0.1}, rel=1e-5)
    elif case == "a closure":
        assert ratios == pytest.approx({f"effective_lr_ratio{m}": 0.1 for m in ("", "/enc", "/mid", "/dec")}, rel=1e-5)
    else:
        assert ratios == {}, ratios


@pytest.mark.parametrize("fused", [False, True], ids=["AdamW", "fused AdamW"])
def test_a_skipped_log_step_has_no_update_norm_with_a_fused_optimizer_too(fused, caplog):
    """GradScaler steps a fused optimizer on an overflow too (found_inf): its hooks ran and the
    skipped log step wrote update_norm 0.0, where the same loop with AdamW writes none, said as a
    skipped step's (README). Truth: the scaler skipped step 2, the parameters did not move."""
    import torch

    import distmetrics as dm

    model = _three_linears()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with dm.Monitor(quiet_config(log_interval=2, log_update_norm=True), model=model, optimizer=optimizer) as monitor:
        for step in (1, 2, 3, 4):
            loss = model(torch.randn(3, 4)).pow(2).mean() * (math.inf if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = monitor.clip_grad_norm_(1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            metrics = monitor.step(step, loss=loss.detach(), skipped=not bool(norm.isfinite()))
            if step == 2:
                assert "update_norm" not in metrics and metrics["health/skipped_steps"] == 1.0, metrics
    assert metrics["update_norm"] > 0
    assert "the record of step 2 has no update_norm: its monitor.step was given skipped=True" in caplog.text


def _ddp_wrapped_anew(rank: int, world: int) -> dict:
    """A DDP submodule whose last forward ran inside no_sync(), then wrapped anew (an unfrozen layer)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("body", DDP(torch.nn.Linear(4, 4)))
    monitor = dm.Monitor(quiet_config(log_interval=1), model=model)
    out = {}
    with model.body.no_sync():
        model(torch.randn(2, 4) + rank).sum().backward()
    old = model.body
    model.body = DDP(model.body.module)
    model.zero_grad()
    model(torch.randn(2, 4) + rank).sum().backward()  # outside no_sync(): all-reduced
    out["exact"] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    out["clip"] = float(monitor.clip_grad_norm_(1.0))
    out["old hooks"] = len(old._forward_pre_hooks)
    monitor.step(1, loss=1.0)
    with model.body.no_sync():  # the new module's forwards are seen
        model(torch.randn(2, 4) + rank).sum().backward()
    try:
        monitor.clip_grad_norm_(1.0)
    except ValueError as err:
        out["refused"] = str(err)
    monitor.close()
    return out


def test_a_ddp_module_wrapped_anew_leaves_no_window_open_and_its_successor_is_watched():
    """A DDP submodule whose last forward ran in no_sync(), wrapped anew: its id stayed among the open
    windows, and every later clip raised a bare StopIteration on every rank. Truth: float64 norm of
    the all-reduced gradients; the old module's hook is removed, and the new one's window refused."""
    for rank, out in enumerate(run_ranks(_ddp_wrapped_anew, 2)):
        assert out["clip"] == pytest.approx(out["exact"], rel=1e-6) and out["old hooks"] == 0, (rank, out)
        assert "DistributedDataParallel module 'body' ran its last forward inside no_sync()" in out["refused"], out


def test_the_replica_checks_lanes_hold_a_presence_fingerprint_exactly():
    """The lanes were made in float32 before the float64 pack: a presence fingerprint (up to 2**31)
    lost its low bits (2**31 - 3 became 2**31), and two gradient sets whose fingerprints round alike
    could not be told apart; 2**30 - 1 became 2**30. Truth: the numbers themselves."""
    import torch

    from distmetrics.replicas import _COUNTS, _placing

    mark = float(2 ** 31 - 3)
    base, _ = _placing(0, 1, "sum", True, torch.device("cpu"), (mark, 7.0))
    assert base.tolist() == [0.0, 0.0, 1.0, _COUNTS - 1.0, mark, mark, 7.0, 7.0]
    base, _ = _placing(0, 1, "max", True, torch.device("cpu"), (mark, 7.0))
    assert base.tolist() == [0.0, 0.0, 1.0, mark, -mark, 7.0, -7.0]
