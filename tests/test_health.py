"""Training health: spikes and trend on scripted sequences, a NaN injected on one rank named at
the writer, loss by category and MoE statistics across real gloo ranks against hand
computations, and the console line checked field by field."""

import itertools
import re
import logging
import math

import pytest

from tests.dist_utils import CollectiveCounter, quiet_config, run_ranks


def _config(tmp, **extra):
    import distmetrics as dm

    cfg = dict(output_dir=str(tmp), log_interval=1, tensorboard=False, timing_log_level=-1, log_progress=False)
    cfg.update(extra)
    return dm.MetricsConfig(**cfg)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.extend(record.getMessage().splitlines())


def _capture():
    handler = _Lines()
    logger = logging.getLogger("distmetrics.console")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _model_with_grad_norm(model, norm):
    """Gradients whose total 2-norm is exactly ``norm``."""
    import torch

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.full_like(p, norm / math.sqrt(total))


@pytest.mark.parametrize("level", [-1.0, 0.0])
def test_a_loss_whose_mean_is_not_positive_has_no_spike_nor_factor(tmp_path, level):
    """The README's spike_factor: where the moving mean is 0 or below (a reward or DPO loss), a value far above
    it is no spike and has no _factor (a ratio to a mean <= 0 means nothing); one process."""
    import distmetrics as dm

    monitor = dm.Monitor(_config(tmp_path, spike_factor=5.0))
    records = [monitor.step(step, loss=level if step <= 11 else 10.0, tokens=10) for step in range(1, 13)]
    monitor.close()
    assert [r["health/loss_spike"] for r in records] == [0] * 12
    assert not any("health/loss_spike_factor" in r for r in records), records[-1]


def test_spikes_and_trend_on_scripted_sequences(tmp_path):
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(4, 4)
    losses = [2.0, 1.9, 1.8, 1.9, 1.7, 1.6, 1.7, 1.5, 1.6, 1.4, 1.5, 9.0, 1.3]
    norms = [1.0] * 10 + [1.2, 1.0, 7.0]
    handler = _capture()
    monitor = dm.Monitor(_config(tmp_path, total_steps=100, spike_factor=5.0), model=model)
    records = []
    for step, (loss, norm) in enumerate(zip(losses, norms), start=1):
        _model_with_grad_norm(model, norm)
        monitor.clip_grad_norm_(math.inf)
        records.append(monitor.step(step, loss=loss, tokens=10))
    monitor.close()
    logging.getLogger("distmetrics.console").removeHandler(handler)
    # loss 9.0 at step 12 is 6× the average of the 11 before it: a spike; before 10 values, none
    assert [r["health/loss_spike"] for r in records] == [0] * 11 + [1, 0]
    average = sum(losses[:11]) / 11
    assert records[11]["health/loss_spike_factor"] == pytest.approx(9.0 / average)
    assert [r["health/grad_spike"] for r in records] == [0] * 12 + [1]
    lines = [line for line in handler.lines if line.startswith(":: step")]
    assert len(lines) == 13
    # trend: '\' fell, '/' rose since the last log step; the first line has none
    assert lines[0].startswith(":: step 1/100 [ 1.0%]   loss 2.0000")
    assert lines[1].startswith(":: step 2/100 [ 2.0%] \\ loss 1.9000")
    assert lines[3].startswith(":: step 4/100 [ 4.0%] / loss 1.9000")
    fields = lines[12].split(" | ")
    assert fields[0] == ":: step 13/100 [13.0%] \\ loss 1.3000"
    assert fields[1] == "norm !7.0000"
    assert fields[2].endswith(" tok/s") and fields[3].endswith(" ms") and fields[4].startswith("eta ")
    assert "norm 1.0000" in lines[11]


def test_skipped_steps_are_counted(tmp_path):
    import distmetrics as dm

    monitor = dm.Monitor(_config(tmp_path, log_interval=4, console=False))
    m = None
    for step in range(1, 5):  # step 3's loss overflowed, the reason it was skipped (as Megatron counts it)
        m = monitor.step(step, loss=math.inf if step == 3 else 1.0, skipped=step in (2, 3))
    assert m["health/skipped_steps"] == 2
    assert "health/skipped_steps/max_rank" not in m
    assert m["train/loss"] == 1.0 and m["health/nonfinite_loss"] == 1  # left out of the loss, counted here


def test_a_loss_that_stays_non_finite_is_one_alert_per_event(tmp_path):
    """The non-finite loss alert was written at every log step while the loss stayed NaN (the
    README says once per event, as the gradient alert is); the count stays in every record."""
    import distmetrics as dm

    losses = {4: math.nan, 7: math.inf, 9: math.nan, 16: math.nan}  # events: step 4, steps 7-10 (two log steps), 16
    with dm.Monitor(_config(tmp_path, log_interval=2, console=False)) as monitor:
        counts = [monitor.step(step, loss=losses.get(step, 1.0)) for step in range(1, 19)][1::2]
    assert [m["health/nonfinite_loss"] for m in counts] == [0, 1, 0, 1, 1, 0, 0, 1, 0]
    alerts = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r.get("alert") == "nonfinite_loss"]
    assert [(a["step"], a["message"]) for a in alerts] == [(4, "non-finite loss in 1 rank-step(s)"),
                                                           (8, "non-finite loss in 1 rank-step(s)"),
                                                           (16, "non-finite loss in 1 rank-step(s)")]


def test_a_log_step_that_raised_after_the_alert_was_decided_does_not_hide_the_event(tmp_path):
    """The loss is NaN from step 3 on; a collector finalizing after health raises at step 4. Once
    per event was decided by what health had seen, not what was written: when that log step wrote
    nothing, no alert was ever written, while every record counted the NaNs. Now the record and
    its alert are written before the error comes out of monitor.step."""
    import distmetrics as dm

    class RaisesOnce:
        name, after, writes = "raises_once", ("health",), ()

        def take_samples(self, ctx):
            return []

        def finalize(self, metrics, ctx):
            if ctx.step == 4:
                raise RuntimeError("a collector's own failure")
            return []

        def close(self):
            pass

    with dm.Monitor(_config(tmp_path, log_interval=2, console=False), collectors=[RaisesOnce()]) as monitor:
        for step in range(1, 9):
            try:
                monitor.step(step, loss=math.nan if step >= 3 else 1.0)
            except RuntimeError:
                assert step == 4
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["health/nonfinite_loss"]) for r in records if r["kind"] == "train"] == [
        (2, 0), (4, 2), (6, 2), (8, 2)]
    assert [r["step"] for r in records if r.get("alert") == "nonfinite_loss"] == [4]


def _nan_scenario(rank: int, world: int, root: str) -> dict:
    import torch

    import distmetrics as dm
    from tests.test_norms import _net

    model = _net()
    handler = _capture()
    monitor = dm.Monitor(_config(f"{root}/r{rank}", console=True), model=model)
    seen = []
    for step in range(1, 6):
        model.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
        if rank == 1 and step in (2, 3, 5):  # one replica goes bad, recovers, goes bad again
            model.blocks[1].fc2.weight.grad[0, 0] = math.nan
            model.blocks[2].fc1.bias.grad[0] = math.inf
        monitor.clip_grad_norm_(1.0)
        with CollectiveCounter() as counter:
            m = monitor.step(step, loss=1.0)
        seen.append({k: m.get(k) for k in ("grad_nonfinite", "grad_nonfinite_modules", "health/first_nonfinite_module")})
        seen[-1]["collectives"] = counter.collectives
    monitor.close()
    return {"seen": seen, "console": [l for l in handler.lines if l.startswith("!!")]}


def _nan_between_log_steps(rank: int, world: int, root: str) -> list:
    import torch

    import distmetrics as dm
    from tests.test_norms import _net

    model = _net()
    out = []
    with dm.Monitor(_config(f"{root}/r{rank}", log_interval=3), model=model) as monitor:
        for step in range(1, 10):
            model.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            if rank == 1 and step in (2, 4, 5):  # one replica's gradient overflows at steps no log step sees
                model.blocks[1].fc2.weight.grad[0, 0] = math.inf
            monitor.clip_grad_norm_(1.0)
            monitor.clip_grad_norm_(1.0)  # twice in one step (counted once)
            m = monitor.step(step, loss=1.0)
            if m is not None:
                out.append((step, m["grad_nonfinite"], m["grad_nonfinite_steps"]))
    return out


def test_non_finite_gradients_between_log_steps_are_counted_and_said(tmp_path):
    """A step whose gradients overflowed between two log steps left no trace: the log step's
    record had grad_nonfinite 0 and no alert (the clip had run, on NaN, unseen). The count rides
    the log step's pack; the alert is said once per event."""
    import distmetrics as dm

    results = run_ranks(_nan_between_log_steps, 2, str(tmp_path))
    assert results[0] == results[1] == [(3, 0, 1), (6, 0, 2), (9, 0, 0)]
    alerts = [r for r in dm.read_jsonl(tmp_path / "r0" / "metrics.jsonl") if r["kind"] == "alert"]
    assert [(a["step"], a["alert"], a["steps"]) for a in alerts] == [(3, "nonfinite_grad", 1)]
    assert "non-finite gradients in 1 step(s) since the last log step" in alerts[0]["message"]


@pytest.mark.parametrize("form", ["ignore_index", "boolean_index", "masked_sum"])
def test_a_micro_batch_without_tokens_as_the_readme_says(tmp_path, form):
    """README, gradient accumulation: a micro-batch whose tokens are all masked runs its backward; its
    gradients are 0 for cross_entropy's ignore_index and a boolean-indexed mean, NaN for a masked sum over
    its count (0 * 0/0), and the nonfinite_grad alert names that step."""
    import torch
    import torch.nn.functional as F

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with dm.Monitor(_config(tmp_path, console=False), model=model) as monitor:
        for step in (1, 2):
            x, labels = torch.randn(2, 5, 4), torch.randint(0, 3, (2, 5))
            labels[1] = -100  # the second micro-batch: every token masked (at step 2 only)
            if step == 1:
                labels[1, 0] = 1
            masks = labels != -100
            tokens = int(masks.sum())
            loss_sum = 0.0
            for mb in range(2):
                logits, mask = model(x[mb]), masks[mb]
                if form == "ignore_index":
                    loss = F.cross_entropy(logits, labels[mb], ignore_index=-100)
                else:
                    per_token = F.cross_entropy(logits, labels[mb].clamp(min=0), reduction="none")
                    loss = per_token[mask].mean() if form == "boolean_index" else \
                        (per_token * mask).sum() / mask.sum()
                (loss * (int(mask.sum()) / max(tokens, 1))).backward()
                if mask.any():
                    loss_sum = loss_sum + loss.detach() * int(mask.sum())
            finite = all(bool(p.grad.isfinite().all()) for p in model.parameters())
            monitor.clip_grad_norm_(1.0)
            model.zero_grad()
            monitor.step(step, loss=loss_sum / max(tokens, 1), tokens=tokens)
            assert finite == (form != "masked_sum" or step == 1), (form, step)
    alerts = [(r["step"], r["alert"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "alert"]
    assert alerts == ([(2, "nonfinite_grad")] if form == "masked_sum" else []), alerts


def _nan_on_one_replica(rank: int, world: int, root: str) -> dict:
    import torch

    import distmetrics as dm
    from tests.test_norms import _net

    model = _net()
    out = {"counts": [], "raised": []}
    with dm.Monitor(_config(f"{root}/r{rank}", log_interval=3), model=model) as monitor:
        for step in range(1, 7):
            model.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            if (step, rank) in ((2, 1), (4, 2), (5, 1)):  # one replica's copy alone (rank 0 owns replicated weights)
                model.blocks[1].fc2.weight.grad[0, 0] = math.nan
            try:
                monitor.clip_grad_norm_(1.0, error_if_nonfinite=step == 5)
            except RuntimeError as err:
                out["raised"].append((step, str(err)[:41]))
            m = monitor.step(step, loss=1.0)
            if m is not None:
                out["counts"].append((step, m["grad_nonfinite_steps"]))
    return out


def test_non_finite_gradients_on_one_replica_are_counted_and_raised_on_every_rank(tmp_path):
    """NaN in one replica's copy only (rank 0 owns the replicated weights): error_if_nonfinite
    raised nowhere and the NaN went on to that rank's optimizer (torch raises on that rank);
    grad_nonfinite_steps was the most steps a rank saw (1 for NaN at step 2 on rank 1 and step 4
    on rank 2), and a step whose clip raised was not counted."""
    results = run_ranks(_nan_on_one_replica, 3, str(tmp_path))
    for out in results:
        assert out["counts"] == [(3, 1), (6, 2)], out
        assert out["raised"] == [(5, "The total norm of order 2.0 for gradients")], out


def test_a_log_steps_clip_that_raised_for_error_if_nonfinite_is_the_records_gradient(tmp_path):
    """torch's use of error_if_nonfinite: the loop skips the step whose clip raised. At a log step, the
    record showed the step before's norm (finite: 0.74 here, not this step's inf), grad_clip_ratio and
    no module, and its alert said the gradients were non-finite "not in this one's". Truth: the inf set
    by hand, float64 norms of the other module's gradient."""
    import torch

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    records = {}
    with dm.Monitor(_config(tmp_path, log_interval=2, console=False), model=model) as monitor:
        for step in range(1, 5):
            model.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            if step == 4:
                model[1].weight.grad[0, 0] = math.inf
            try:
                monitor.clip_grad_norm_(1.0, error_if_nonfinite=True)
                skipped = False
            except RuntimeError:
                skipped = True
            records[step] = monitor.step(step, loss=1.0, skipped=skipped)
    record = records[4]
    assert skipped and record["grad_norm"] == math.inf and record["grad_norm/1"] == math.inf
    module_0 = torch.cat([p.grad.double().flatten() for p in model[0].parameters()])  # unscaled: the clip raised
    assert record["grad_norm/0"] == pytest.approx(float(torch.linalg.vector_norm(module_0)), rel=1e-6)
    assert record["grad_nonfinite_modules"] == ["1"] and "grad_clip_ratio" not in record
    alerts = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "alert"]
    assert [(a["step"], a["alert"], a["modules"]) for a in alerts] == [(4, "nonfinite_grad", ["1"])], alerts
    assert "not in this one's" not in alerts[0]["message"]


def test_a_nan_on_one_rank_names_the_module_at_the_writer(tmp_path):
    import distmetrics as dm

    results = run_ranks(_nan_scenario, 2, str(tmp_path))
    seen = results[0]["seen"]
    assert [s["grad_nonfinite"] for s in seen] == [0, 2, 2, 0, 2]
    # which modules are bad travels only at a log step with a non-finite count: healthy steps pay nothing
    healthy, bad = seen[3]["collectives"], [seen[i]["collectives"] for i in (1, 2, 4)]
    assert all(n > healthy for n in bad) and results[1]["seen"][3]["collectives"] == healthy
    assert seen[1]["grad_nonfinite_modules"] == ["blocks.1.fc2", "blocks.2.fc1"]
    assert seen[1]["health/first_nonfinite_module"] == "blocks.1.fc2"
    assert seen[2]["health/first_nonfinite_module"] is None  # the same event: no new alert
    assert seen[4]["health/first_nonfinite_module"] == "blocks.1.fc2"  # a new event after recovery
    alerts = [r for r in dm.read_jsonl(tmp_path / "r0" / "metrics.jsonl") if r["kind"] == "alert"]
    assert [a["step"] for a in alerts] == [2, 5]
    assert alerts[0]["first_module"] == "blocks.1.fc2" and alerts[0]["modules"] == ["blocks.1.fc2", "blocks.2.fc1"]
    assert len(results[0]["console"]) == 2 and "blocks.1.fc2" in results[0]["console"][0]
    assert not (tmp_path / "r1").exists()


def _finite_gradients_past_the_float32_range(rank: int, world: int, root: str, dtype: str) -> list:
    """Replicas (DDP) whose gradients hold four elements of 3e19 in one tensor: finite, but their
    squares sum past float32's 3.4e38 in that tensor's norm. Steps 1 and 2 (a log step) hold those
    alone; step 4 (a log step) holds them in ``blocks.0.fc1`` and an inf in rank 1's
    ``blocks.1.fc2``. Per log step: the record's counts and modules, whether every gradient was
    finite, and our returned total and clipped gradients against torch's clip of copies."""
    import torch

    import distmetrics as dm
    from tests.test_norms import _net

    model = _net().to(getattr(torch, dtype))
    out = []
    with dm.Monitor(_config(f"{root}/r{rank}", log_interval=2), model=model) as monitor:
        for step in range(1, 5):
            model.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(model.inp.weight.dtype)) \
                .float().sum().backward()
            if step != 3:
                model.blocks[0].fc1.weight.grad[0, :4] = 3e19
            if step == 4 and rank == 1:
                model.blocks[1].fc2.weight.grad[0, 0] = math.inf
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            theirs = [torch.zeros_like(p, requires_grad=True) for p in model.parameters()]
            for p, q in zip(model.parameters(), theirs):
                q.grad = p.grad.clone()
            torch_total = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
            total = monitor.clip_grad_norm_(1.0)
            m = monitor.step(step, loss=1.0)
            if m is not None:
                pairs = [(total, torch_total)] + [(p.grad, q.grad) for p, q in zip(model.parameters(), theirs)]
                out.append({"step": step, "finite": finite, "grad_nonfinite": m["grad_nonfinite"],
                            "modules": m.get("grad_nonfinite_modules"), "steps": m["grad_nonfinite_steps"],
                            "as_torch": all(a.dtype == b.dtype and torch.allclose(a.double(), b.double(), 0, 0, True)
                                            for a, b in pairs)})
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_finite_gradients_whose_norm_passes_the_float32_range_are_not_non_finite(tmp_path, dtype):
    """bf16 and fp32 gradients accumulate their squares in float32: four elements of 3e19 (a
    float64 norm of 6e19) gave an inf norm, counted as a NaN or inf gradient, named, and alerted
    as "non-finite gradient first in module 'blocks.0.fc1'". Now only a gradient that holds NaN or
    inf is counted (the inf beside them at step 4), and the total and the clip stay torch's (inf,
    every gradient zeroed)."""
    import distmetrics as dm

    for out in run_ranks(_finite_gradients_past_the_float32_range, 2, str(tmp_path), dtype):
        assert [(r["step"], r["grad_nonfinite"], r["modules"], r["steps"]) for r in out] == [
            (2, 0, None, 0), (4, 1, ["blocks.1.fc2"], 1)]
        assert out[0]["finite"] and all(r["as_torch"] for r in out)
    alerts = [r for r in dm.read_jsonl(tmp_path / "r0" / "metrics.jsonl") if r["kind"] == "alert"]
    assert [(a["step"], a["alert"], a.get("first_module")) for a in alerts] == [(4, "nonfinite_grad", "blocks.1.fc2")]


def _nan_in_a_module_named_with_a_comma(rank: int, world: int, root: str) -> dict:
    """Rank 1's gradient of the ModuleDict entry ``enc,dec`` holds a NaN; every other gradient is
    finite. Returns the step's metrics and, as truth, the modules whose gradient any rank saw
    non-finite."""
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "enc,dec": torch.nn.Linear(2, 2),
                                 "z": torch.nn.Linear(2, 2)})
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    if rank == 1:
        model["enc,dec"].weight.grad[0, 0] = math.nan
    bad = [name for name, module in model.items()
           if any(not torch.isfinite(p.grad).all() for p in module.parameters())]
    every: list = [None] * world
    dist.all_gather_object(every, bad)
    with dm.Monitor(_config(f"{root}/r{rank}"), model=model) as monitor:
        monitor.clip_grad_norm_(1.0)
        metrics = monitor.step(1, loss=1.0)
    keys = ("grad_nonfinite_modules", "health/first_nonfinite_module")
    return {"truth": sorted(set().union(*every)), "metrics": {k: metrics.get(k) for k in keys}}


def test_a_module_whose_name_holds_a_comma_is_one_module_in_the_alert(tmp_path):
    """grad_nonfinite_modules was the names joined with "," and read back split at ",": the one
    module ``enc,dec`` became two, enc (named first) and dec, in the record and the alert."""
    import distmetrics as dm

    result = run_ranks(_nan_in_a_module_named_with_a_comma, 2, str(tmp_path))[0]
    assert result["truth"] == ["enc,dec"]
    assert result["metrics"] == {"grad_nonfinite_modules": ["enc,dec"], "health/first_nonfinite_module": "enc,dec"}
    records = list(dm.read_jsonl(tmp_path / "r0" / "metrics.jsonl"))
    [train] = [r for r in records if r["kind"] == "train"]
    [alert] = [r for r in records if r["kind"] == "alert"]
    assert train["grad_nonfinite_modules"] == result["truth"]  # a JSON list in the file
    assert alert["first_module"] == "enc,dec" and alert["modules"] == result["truth"]



def _interleaved_stages_with_nans(rank: int, world: int, root: str) -> dict:
    """Two pipeline stages, each a ``ModuleList`` of two virtual chunks as Megatron's interleaved
    schedule lays them out: chunk c of stage s holds global layer 2c + s (Megatron's ``layer_number``
    is one more), stage 0's chunk 0 the embedding, stage 1's chunk 1 the output layer. NaN gradients
    in layer 1 (stage 1, chunk 0) and layer 2 (stage 0, chunk 1): the model runs layer 1 first."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    chunks = torch.nn.ModuleList()
    for chunk in range(2):
        part = torch.nn.Module()
        if rank == 0 and chunk == 0:
            part.embedding = torch.nn.Linear(2, 2)
        part.decoder = torch.nn.Module()
        layer = torch.nn.Linear(2, 2)
        layer.layer_number = 2 * chunk + rank + 1
        part.decoder.layers = torch.nn.ModuleList([layer])
        if rank == 1 and chunk == 1:
            part.output_layer = torch.nn.Linear(2, 2)
        chunks.append(part)
    for p in chunks.parameters():
        p.grad = torch.ones_like(p)
    chunks[1 - rank].decoder.layers[0].weight.grad[0, 0] = math.nan  # layers 2 (stage 0) and 1 (stage 1)
    with dm.Monitor(_config(f"{root}/r{rank}"), model=chunks, device_mesh=mesh) as monitor:
        monitor.clip_grad_norm_(1.0)
        metrics = monitor.step(1, loss=1.0 if rank == 1 else None)
    return {"first": metrics.get("health/first_nonfinite_module"), "modules": metrics.get("grad_nonfinite_modules"),
            "order": [n for n in monitor._module_order if ".layers." in n or n.endswith(("embedding", "output_layer"))]}


def test_an_interleaved_pipelines_modules_are_ordered_chunk_by_chunk_across_stages(tmp_path):
    """Megatron's interleaved schedule runs chunk 0 of every stage, then chunk 1 of every stage. The
    stages' lists were joined stage by stage (layer 2, on stage 0's chunk 1, before layer 1, on stage
    1's chunk 0), so the module named first non-finite was layer 2, and the report's rows were out of
    model order."""
    import distmetrics as dm

    results = run_ranks(_interleaved_stages_with_nans, 2, str(tmp_path))
    assert all(r == results[0] for r in results)
    assert results[0]["order"] == ["0.embedding", "0.decoder.layers.0", "0.decoder.layers.1",
                                   "1.decoder.layers.2", "1.decoder.layers.3", "1.output_layer"]
    assert results[0]["first"] == "0.decoder.layers.1"
    assert results[0]["modules"] == ["0.decoder.layers.1", "1.decoder.layers.2"]
    [run] = [r for r in dm.read_jsonl(tmp_path / "r0" / "metrics.jsonl") if r["kind"] == "run"]
    assert [n for n in run["modules"] if ".layers." in n or n.endswith(("embedding", "output_layer"))] == \
        results[0]["order"]  # the report's rows


def _placeholder_loss_on_the_first_stage(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    with dm.Monitor(_config(f"{root}/r{rank}", console=False), device_mesh=mesh) as monitor:
        metrics = monitor.step(1, loss=math.nan if rank == 0 else 2.0)  # a placeholder on stage 0
    return {k: metrics.get(k) for k in ("train/loss", "health/nonfinite_loss")}


def test_a_placeholder_loss_left_out_of_the_loss_is_left_out_of_the_health_counts(tmp_path):
    """A loss passed on a pipeline stage other than the last is left out of train/loss (said once),
    but the health collector took it in: a NaN placeholder counted as a non-finite loss at every
    step, with an alert, while train/loss was finite."""
    import distmetrics as dm

    for result in run_ranks(_placeholder_loss_on_the_first_stage, 2, str(tmp_path)):
        assert result == {"train/loss": 2.0, "health/nonfinite_loss": 0.0}
    assert not [r for r in dm.read_jsonl(tmp_path / "r0" / "metrics.jsonl") if r["kind"] == "alert"]

def _categories_and_moe(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, log_throughput=True, log_memory=True))
    for step in (1, 2):
        losses, cats, weights = CATEGORY_DATA[(rank, step)]
        monitor.record_losses(torch.tensor(losses), cats, weights=torch.tensor(weights))
        monitor.record_moe(aux_loss=0.1 * (rank + 1), tokens_per_expert=torch.tensor(MOE_COUNTS[(rank, step)]))
        m = monitor.step(step, loss=1.0)
    # eval categories reach log_eval; integer categories with a name map
    monitor.record_losses(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 1, 1]), names=["web", "code"], split="eval")
    ev = monitor.log_eval(2, loss=torch.tensor(2.0), tokens=10)
    monitor.close()
    return {"train": {k: v for k, v in m.items() if isinstance(v, float)}, "eval": ev}


# (rank, step) → per-sample losses, categories, token weights; "math" appears only on rank 2, late
CATEGORY_DATA = {
    (0, 1): ([1.0, 2.0], ["web", "code"], [10, 20]),
    (0, 2): ([3.0], ["web"], [5]),
    (1, 1): ([4.0], ["code"], [10]),
    (1, 2): ([0.5, 1.5], ["web", "web"], [1, 1]),
    (2, 1): ([2.0], ["web"], [2]),
    (2, 2): ([7.0, 1.0], ["math", "code"], [3, 4]),
}
# (rank, step) → tokens per expert [layers=2, experts=4]
MOE_COUNTS = {
    (0, 1): [[5, 0, 3, 0], [1, 1, 1, 1]], (0, 2): [[5, 0, 1, 0], [0, 0, 4, 0]],
    (1, 1): [[0, 0, 2, 0], [2, 2, 0, 0]], (1, 2): [[1, 0, 0, 0], [0, 0, 0, 8]],
    (2, 1): [[0, 0, 0, 0], [0, 0, 0, 0]], (2, 2): [[3, 0, 0, 0], [1, 0, 0, 0]],
}


@pytest.fixture(scope="module")
def category_results():
    return run_ranks(_categories_and_moe, 3)


def test_loss_by_category_is_the_weighted_mean_over_ranks_and_steps(category_results):
    sums, weights = {}, {}
    for (_, _), (losses, cats, ws) in CATEGORY_DATA.items():
        for loss, cat, w in zip(losses, cats, ws):
            sums[cat] = sums.get(cat, 0.0) + loss * w
            weights[cat] = weights.get(cat, 0.0) + w
    m = category_results[0]["train"]
    for cat in ("web", "code", "math"):
        assert m[f"train/loss/{cat}"] == pytest.approx(sums[cat] / weights[cat]), cat


def test_eval_loss_by_category_with_integer_ids(category_results):
    ev = category_results[0]["eval"]
    # every rank recorded web: [1.0], code: [2.0, 4.0]
    assert ev["eval/loss/web"] == pytest.approx(1.0)
    assert ev["eval/loss/code"] == pytest.approx(3.0)
    assert ev["eval/ppl"] == pytest.approx(math.exp(2.0))


# (rank, step) → per-sample losses of category "all", token weights; steps 2 and 4 are skipped (4 is a log step)
SKIPPED_STEP_DATA = {
    (0, 1): ([2.0, 2.0], [1, 3]), (1, 1): ([2.0, 6.0], [2, 2]),
    (0, 2): ([100.0], [4]), (1, 2): ([100.0, 100.0], [1, 1]),
    (0, 3): ([4.0], [2]), (1, 3): ([1.0, 7.0], [1, 1]),
    (0, 4): ([50.0], [1]), (1, 4): ([50.0], [9]),
}
SKIPPED_STEPS = {2, 4}


def _categories_of_skipped_steps(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm

    out = {}
    with dm.Monitor(quiet_config(log_interval=2)) as monitor:
        for step in (1, 2, 3, 4):
            losses, weights = SKIPPED_STEP_DATA[(rank, step)]
            monitor.record_losses(torch.tensor(losses), ["all"] * len(losses), weights=torch.tensor(weights))
            if step == 2:  # an evaluation's samples in a skipped step are the evaluation's
                monitor.record_losses(torch.tensor([3.0 + rank]), ["web"], split="eval")
            metrics = monitor.step(step, loss=losses[0], skipped=step in SKIPPED_STEPS)
            if metrics is not None:
                out[step] = {k: v for k, v in metrics.items() if k.startswith("train/loss")}
        out["eval"] = monitor.log_eval(4, loss=1.0, tokens=1)["eval/loss/web"]
    return out


def test_a_skipped_steps_category_losses_are_left_out_as_its_loss_is():
    """train/loss left a skipped step out (as Megatron does) but train/loss/<category> counted its
    samples: step 1 loss 2.0, step 2 loss 100 skipped gave train/loss 2.0 beside train/loss/all 51.0."""
    results = run_ranks(_categories_of_skipped_steps, 2)
    for log_step, steps in ((2, (1, 2)), (4, (3, 4))):
        kept = [(loss, w) for (_, step), (losses, ws) in SKIPPED_STEP_DATA.items() if step in steps
                and step not in SKIPPED_STEPS for loss, w in zip(losses, ws)]
        truth = sum(loss * w for loss, w in kept) / sum(w for _, w in kept)
        for rank, out in enumerate(results):
            assert out[log_step]["train/loss/all"] == pytest.approx(truth, rel=1e-12), (rank, log_step)
    assert results[0][2]["train/loss"] == pytest.approx(2.0) and results[0][4]["train/loss"] == pytest.approx(2.5)
    assert results[0]["eval"] == pytest.approx(3.5)  # the eval split is not a training step's


def test_moe_utilization_and_imbalance_against_hand_computation(category_results):
    m = category_results[0]["train"]
    totals = [[0] * 4 for _ in range(2)]
    for counts in MOE_COUNTS.values():
        for layer in range(2):
            for expert in range(4):
                totals[layer][expert] += counts[layer][expert]
    used = [sum(1 for c in row if c > 0) / 4 for row in totals]
    imbalance = [max(row) / (sum(row) / 4) for row in totals]
    assert m["moe/expert_utilization"] == pytest.approx(sum(used) / 2)
    assert m["moe/load_imbalance"] == pytest.approx(max(imbalance))
    assert m["moe/load_imbalance/layer0"] == pytest.approx(imbalance[0])
    assert m["moe/aux_loss"] == pytest.approx((0.1 + 0.2 + 0.3) / 3)


def test_moe_counts_given_per_layer_add_up_per_layer_and_a_layer_without_tokens_has_no_imbalance(tmp_path):
    """record_moe once per router (per layer, Megatron's natural hook), and once for two layers
    together: every call's counts add to their layers' (a later layer's call replaced the
    earlier's, so the skewed layer 0 vanished and the record read perfectly balanced). Layer 2
    routed no token: its utilisation and imbalance are undefined (NaN) and the headlines are over the
    others, whatever the order. A layer given another number of experts is refused at the call."""
    import torch

    import distmetrics as dm

    with dm.Monitor(_config(tmp_path, log_interval=2)) as monitor:
        for step in (1, 2):
            monitor.record_moe(tokens_per_expert=torch.tensor([40, 0, 0, 0]), layer_numbers=[0])
            monitor.record_moe(tokens_per_expert=torch.tensor([[10, 10, 10, 10], [0, 0, 0, 0]]),
                               layer_numbers=[1, 2])
            monitor.record_moe(tokens_per_expert=torch.tensor([0, 8, 0, 0]), layer_numbers=[0])
            with pytest.raises(ValueError, match="layer 1 was given counts of 4 experts .* now of 2"):
                monitor.record_moe(aux_loss=100.0, tokens_per_expert=torch.tensor([5, 5]), layer_numbers=[1])
            monitor.record_moe(aux_loss=0.5)  # the refused call's aux_loss was not recorded
            m = monitor.step(step, loss=1.0)
    layer0 = [80, 16, 0, 0]  # two steps of 40 and 8
    assert m["moe/load_imbalance/layer0"] == pytest.approx(max(layer0) / (sum(layer0) / 4))
    assert m["moe/load_imbalance/layer1"] == 1.0 and math.isnan(m["moe/load_imbalance/layer2"])
    assert m["moe/load_imbalance"] == pytest.approx(80 / 24)
    assert m["moe/expert_utilization/layer0"] == 0.5 and math.isnan(m["moe/expert_utilization/layer2"])
    assert m["moe/expert_utilization"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["moe/aux_loss"] == 0.5
    with dm.Monitor(_config(tmp_path / "nan", log_interval=1)) as monitor:  # a NaN count is not "no token"
        monitor.record_moe(tokens_per_expert=torch.tensor([[4.0, 0.0], [math.nan, 1.0]]))
        with pytest.raises(ValueError, match="layer 1 was given a NaN or infinite count on rank 0"):
            monitor.step(1, loss=1.0)


def test_moe_counts_of_no_layer_count_nothing_and_the_record_is_written():
    """A stage or rank with no MoE layer stacking its none ([0, experts] counts, layer_numbers=[]) passed
    the call's checks, then made the log step raise (torch.cat of nothing): the record was lost, and on
    2 ranks the other raised HangError. Such a call counts nothing."""
    import torch

    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        monitor.record_moe(tokens_per_expert=torch.zeros(0, 4, dtype=torch.long), layer_numbers=[])
        monitor.record_moe(tokens_per_expert=torch.zeros(0, 4, dtype=torch.long))
        alone = monitor.step(1, loss=1.0)
        monitor.record_moe(tokens_per_expert=torch.zeros(0, 4, dtype=torch.long), layer_numbers=[])
        monitor.record_moe(tokens_per_expert=torch.tensor([1, 0, 0, 1]), layer_numbers=[0])
        beside = monitor.step(2, loss=1.0)
    assert alone["train/loss"] == 1.0 and not any(k.startswith("moe/") for k in alone), alone
    assert beside["moe/expert_utilization"] == 0.5 and beside["moe/load_imbalance/layer0"] == 2.0, beside


def test_eval_gap_is_to_the_train_loss_since_the_last_eval(tmp_path):
    import distmetrics as dm

    handler = _capture()
    monitor = dm.Monitor(_config(tmp_path, log_interval=2))
    for step, loss in enumerate([3.0, 2.0, 2.0, 1.0], start=1):
        monitor.step(step, loss=loss, tokens=100)
    ev = monitor.log_eval(4, loss=2.5, tokens=50, time_ms=100.0)
    monitor.close()
    logging.getLogger("distmetrics.console").removeHandler(handler)
    assert ev["eval/gap"] == pytest.approx(2.5 - 2.0)  # train mean over steps 1-4 is 2.0
    assert ev["eval/ppl"] == pytest.approx(math.exp(2.5))
    assert ev["eval/tokens_per_sec"] == pytest.approx(500.0)
    line = [l for l in handler.lines if l.startswith(">> eval")][0]
    assert line.split(" | ")[:4] == [">> eval step 4", "loss 2.5000", "gap +0.5000", "ppl 12.18"]


def test_record_losses_input_errors():
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config())
    with pytest.raises(ValueError, match="2 losses but 1 categories"):
        monitor.record_losses(torch.tensor([1.0, 2.0]), ["a"])
    with pytest.raises(ValueError, match="need names="):
        monitor.record_losses(torch.tensor([1.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="split='test'"):
        monitor.record_losses(torch.tensor([1.0]), ["a"], split="test")


def _category_labels(rank: int, world: int) -> dict:
    import numpy as np
    import torch

    import distmetrics as dm

    refused = {}
    losses = torch.tensor([1.0, 2.0, 4.0])
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        for what, categories, names in (("int and str", [1, "1", "a"], None), ("bool", [1, True, "a"], None),
                                        ("None", [None, "None", "a"], None), ("float", [1.0, 2, 2], None),
                                        ("tensor", list(torch.tensor([0, 1, 0])), None),
                                        ("names", [0, 1, 2], ["web", 7, "7"])):
            try:
                monitor.record_losses(losses, categories, names=names)
                refused[what] = None
            except (TypeError, ValueError) as err:
                refused[what] = (type(err).__name__, str(err))
        monitor.record_losses(losses, [3, np.int64(3), "web"])  # 3 and np.int64(3) are one label
        monitor.record_losses(torch.tensor([8.0 + rank]), [3])
        metrics = monitor.step(1)
    return {"refused": refused, "metrics": {k: v for k, v in metrics.items() if k.startswith("train/loss/")}}


def test_a_loss_category_is_a_str_or_an_int_and_two_of_one_name_are_refused():
    """Categories were named with str(): 1 and "1" were one category, True was 1's, None was
    "None" and a tensor's element "tensor(0)". A str or an int is taken; anything else, and two
    labels of one call with one name, is refused at the call, which records nothing."""
    results = run_ranks(_category_labels, 2, timeout=120)
    for out in results:
        refused = out["refused"]
        assert refused["int and str"] == ("ValueError", "record_losses(categories=...): the categories 1 and '1' are "
                                          "both named '1', so their losses would be one category's; give one of them")
        for what, shown in (("bool", "bool True"), ("None", "NoneType None"), ("float", "float 1.0"),
                            ("tensor", "Tensor tensor(0)")):
            assert refused[what] == ("TypeError", "record_losses(categories=...): a category is a str or an int "
                                     f"(not a bool), got {shown}"), refused[what]
        assert refused["names"] == ("ValueError", "record_losses(names=...): the categories 7 and '7' are both "
                                    "named '7', so their losses would be one category's; give one of them")
        # every rank: 1, 2 (label 3) and 4 (web), then rank r's 8 + r (label 3)
        assert out["metrics"] == {"train/loss/3": (1 + 2 + 8 + 1 + 2 + 9) / 6, "train/loss/web": 4.0}


def test_integer_categories_need_not_be_numbered_from_zero():
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=1))
    monitor.record_losses(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3, 7, 3]), names={3: "web", 7: "code"})
    metrics = monitor.step(1)
    monitor.close()
    assert metrics["train/loss/web"] == pytest.approx(2.5) and metrics["train/loss/code"] == pytest.approx(2.0)
    monitor = dm.Monitor(quiet_config())
    with pytest.raises(ValueError, match="got the id -1"):
        monitor.record_losses(torch.tensor([1.0]), torch.tensor([0]), names={-1: "x"})
    monitor.close()


def test_a_names_dict_keyed_by_numpy_integers_is_taken():
    """A dict made from numpy arrays (``dict(zip(np.unique(ids), names))``) was refused: "names= maps
    integer category ids >= 0 ... got the id np.int64(7)", an integer >= 0."""
    import numpy as np
    import torch

    import distmetrics as dm

    ids = np.array([7, 9, 7])
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        monitor.record_losses(torch.tensor([1.0, 2.0, 4.0]), torch.tensor(ids), names=dict(zip(np.unique(ids),
                                                                                               ["a", "b"])))
        monitor.record_losses(torch.tensor([3.0]), [9], names={np.int32(9): "b"})
        metrics = monitor.step(1)
    assert metrics["train/loss/a"] == pytest.approx(2.5) and metrics["train/loss/b"] == pytest.approx(2.5)


# --- the MoE name cache ----------------------------------------------------------------------
# The MoE collector's cache of tokens-per-expert names holds 64 (layers, experts) shapes: a run
# whose shapes outnumber it (a new expert count every log step, then shapes seen before it was
# emptied) still writes the right layers' utilisation and imbalance, and the cache stays bounded.

BOUND = 64


def _shape(step: int) -> tuple:
    """(layer numbers, experts): a new expert count at every step up to 70, then shapes seen before
    the cache was emptied and as many names on other layers."""
    if step <= 70:
        return (0, 2), 2 + step
    if step in (71, 75):  # as step 1's; then its size with other layers
        return ((0, 2) if step == 71 else (1, 4)), 3
    return (5,), 3 + step % 2


def _counts(step: int, layers: tuple, experts: int) -> list:
    return [[(7 * e + 3 * layer + step) % 5 for e in range(experts)] for layer in layers]


def test_more_shapes_than_the_cache_holds_keep_names_and_values_right():
    import torch

    import distmetrics as dm

    steps = 75
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        collector = monitor._by_name["moe"]
        for step in range(1, steps + 1):
            layers, experts = _shape(step)
            counts = _counts(step, layers, experts)
            monitor.record_moe(tokens_per_expert=torch.tensor(counts), layer_numbers=list(layers))
            m = monitor.step(step)
            assert len(collector._names) <= BOUND
            utilization, imbalance = {}, {}
            for layer, row in zip(layers, counts):  # by hand: the fraction of experts used, max / mean
                mean = sum(row) / experts
                utilization[layer] = sum(1 for v in row if v > 0) / experts
                imbalance[layer] = max(row) / mean
            written = {k: v for k, v in m.items() if k.startswith("moe/")}
            assert written == pytest.approx({
                **{f"moe/expert_utilization/layer{layer}": utilization[layer] for layer in layers},
                **{f"moe/load_imbalance/layer{layer}": imbalance[layer] for layer in layers},
                "moe/expert_utilization": sum(utilization.values()) / len(layers),
                "moe/load_imbalance": max(imbalance.values())}, rel=1e-12), step
    # emptied once, when the 65th distinct shape came (step 65): the shapes since then are held
    assert len(collector._names) == len({tuple((layer, _shape(s)[1]) for layer in _shape(s)[0])
                                         for s in range(65, steps + 1)}) == 10


def _moe_expert_counts_differ(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm

    import tempfile

    out = {}
    for when in ("first log step", "after a consistent one"):
        folder = tempfile.mkdtemp() if rank == 0 else ""
        monitor = dm.Monitor(quiet_config(log_interval=1, json_log=True, output_dir=folder or "unused"))
        if when != "first log step":
            monitor.record_moe(tokens_per_expert=torch.tensor([[5.0] * 6]), layer_numbers=[1])
            out["consistent"] = {k: v for k, v in monitor.step(1, loss=1.0).items() if k.startswith("moe/")}
        counts = [5.0] * 4 if rank == 0 else [5.0, 5.0, 5.0, 5.0, 0.0, 30.0]  # rank 0 gives 4 experts, rank 1 6
        monitor.record_moe(tokens_per_expert=torch.tensor([counts]), layer_numbers=[1])
        try:
            monitor.step(2, loss=1.0)
            out[when] = "no error"
        except ValueError as err:
            out[when] = str(err)
        monitor.close()
        if rank == 0:  # the step's record, written before the error was raised
            out[when + " written"] = [(r["step"], "train/loss" in r) for r in dm.read_jsonl(f"{folder}/metrics.jsonl")
                                      if r["kind"] == "train"]
    return out


def test_moe_counts_of_different_expert_numbers_across_ranks_are_refused_on_every_rank():
    """Rank 0 passes layer 1's tokens per expert for 4 experts, rank 1 for 6: the union of names
    read rank 0's missing experts as idle (utilisation 0.83 and imbalance 2.57 on both ranks, no
    error). The SUM pack's weights say how many ranks counted each expert: no extra collective. The
    error is raised once the step's record is written (it was raised in place of it: the interval's
    loss, throughput and the rest were lost)."""
    outs = run_ranks(_moe_expert_counts_differ, 2, timeout=120)
    for out in outs:
        assert out["consistent"]["moe/expert_utilization"] == 1.0 and out["consistent"]["moe/load_imbalance"] == 1.0
        for when in ("first log step", "after a consistent one"):
            assert "ranks gave layer 1 counts of different numbers of experts: experts 4-5 were counted by 1 " \
                   "rank(s), others by 2" in out[when], (when, out[when])
    assert outs[0]["first log step written"] == [(2, True)]
    assert outs[0]["after a consistent one written"] == [(1, True), (2, True)]


# (rank, layer) → tokens per expert at each of two steps: rank 0 holds layers 0 and 2, rank 1 layers 1
# and 2 (a pipeline stage's layers); layer 2 routes no token on either rank
IDLE_LAYER_COUNTS = {(0, 0): [6, 0, 2, 0], (0, 2): [0, 0, 0, 0], (1, 1): [3, 3, 0, 3], (1, 2): [0, 0, 0, 0]}

# case → each rank's counts [layers=2, experts=4]: rank 1's -5 is hidden by rank 0's 5 in the sum (layer 1
# would read [0, 0, 4, 4]: utilisation 0.5, imbalance 2); a NaN on rank 0 alone
BAD_COUNTS = {
    "negative": ([[1, 1, 1, 1], [5, 0, 2, 2]], [[1, 1, 1, 1], [-5, 0, 2, 2]]),
    "nan": ([[1, 1, 1, math.nan], [5, 0, 2, 2]], [[1, 1, 1, 1], [5, 0, 2, 2]]),
}


def _moe_idle_layers_and_bad_counts(rank: int, world: int) -> dict:
    import tempfile

    import torch

    import distmetrics as dm
    from tests.dist_utils import HostReads

    out = {"reads": 0}
    with dm.Monitor(quiet_config(log_interval=2)) as monitor:
        layers = [layer for r, layer in IDLE_LAYER_COUNTS if r == rank]
        for step in (1, 2):
            counts = torch.tensor([IDLE_LAYER_COUNTS[(rank, layer)] for layer in layers])
            with HostReads() as counted:
                monitor.record_moe(tokens_per_expert=counts, layer_numbers=layers)
            out["reads"] += counted.reads
            metrics = monitor.step(step, loss=1.0)
        out["idle layer"] = {k: v for k, v in metrics.items() if k.startswith("moe/")}
        for step in (3, 4):
            monitor.record_moe(tokens_per_expert=torch.zeros(2, 4), layer_numbers=[0, 1])
            metrics = monitor.step(step, loss=1.0)
        out["no token"] = {k: v for k, v in metrics.items() if k.startswith("moe/")}
    for case, counts in BAD_COUNTS.items():
        folder = tempfile.mkdtemp() if rank == 0 else ""
        with dm.Monitor(quiet_config(log_interval=1, json_log=True, output_dir=folder or "unused")) as monitor:
            counts = torch.tensor(counts[rank])
            with HostReads() as counted:
                monitor.record_moe(aux_loss=0.25, tokens_per_expert=counts)
            out["reads"] += counted.reads
            try:
                monitor.step(1, loss=1.0)
                out[case] = "no error"
            except ValueError as err:
                out[case] = str(err)
            monitor.record_moe(tokens_per_expert=torch.tensor([[2.0, 2.0, 0.0, 0.0]]))  # the next interval's own
            out[case + " next"] = monitor.step(2, loss=1.0)["moe/expert_utilization"]
        if rank == 0:  # the step's record, written before the error was raised
            out[case + " written"] = [sorted(k for k in r if k.startswith(("moe/", "train/loss")))
                                      for r in dm.read_jsonl(f"{folder}/metrics.jsonl") if r["kind"] == "train"]
    return out


@pytest.fixture(scope="module")
def idle_and_bad_counts():
    return run_ranks(_moe_idle_layers_and_bad_counts, 2, timeout=120)


def test_moe_utilization_leaves_out_layers_that_routed_no_token(idle_and_bad_counts):
    """Layer 2 routed no token on any rank: its utilisation of 0 was averaged into the headline, which read
    0.42 for layers that used half and three quarters of their experts. It has no utilisation (NaN), as it
    has no imbalance; with no layer routing any, both headlines are NaN. Counts are not read at the call."""
    for out in idle_and_bad_counts:
        # by hand, over two steps: layer 0 [12, 0, 4, 0] (rank 0), layer 1 [6, 6, 0, 6] (rank 1), layer 2 zeros
        assert out["idle layer"] == pytest.approx({
            "moe/expert_utilization/layer0": 2 / 4, "moe/expert_utilization/layer1": 3 / 4,
            "moe/expert_utilization/layer2": math.nan, "moe/expert_utilization": (2 / 4 + 3 / 4) / 2,
            "moe/load_imbalance/layer0": 12 / 4, "moe/load_imbalance/layer1": 6 / 4.5,
            "moe/load_imbalance/layer2": math.nan, "moe/load_imbalance": 12 / 4}, nan_ok=True)
        assert all(math.isnan(v) for v in out["no token"].values()) and len(out["no token"]) == 6
        assert out["reads"] == 0


def test_moe_negative_or_nan_counts_raise_on_every_rank_after_the_record(idle_and_bad_counts):
    """Rank 1 gave layer 1 a count of -5, rank 0 a 5: the sum read 0, and the record said utilisation 0.5,
    imbalance 2, unsaid; a NaN on one rank went unsaid too. Each layer's lowest count rides the MAX pack:
    every rank raises, naming the layer, the count and the rank, once the record (without the utilisation
    and imbalance) is written; the next interval is its own."""
    for out in idle_and_bad_counts:
        assert "layer 1 was given the count -5 on rank 1 in the steps up to step 1;" in out["negative"], out
        assert "layer 0 was given a NaN or infinite count on rank 0" in out["nan"], out
        assert out["negative next"] == out["nan next"] == 0.5
    moe = [f"moe/{name}{layer}" for name in ("expert_utilization", "load_imbalance") for layer in ("", "/layer0")]
    for case in ("negative", "nan"):
        assert idle_and_bad_counts[0][case + " written"] == [["moe/aux_loss", "train/loss"],
                                                             sorted(moe + ["train/loss"])], case


@pytest.mark.parametrize("ids,names,expected", [
    ([0, 1, 2], {0: "web", 2: "code"}, {"web": 1.0, "code": 9.0}),
    ([0, -1, 1], ["web", "code"], {"web": 1.0, "code": 9.0}),
    ([0, -100, 1], ["web", "code"], {"web": 1.0, "code": 9.0}),
    ([0, 1, 7], ["web", "code"], {"web": 1.0, "code": 5.0})], ids=["unnamed id", "-1", "-100", "beyond the names"])
def test_a_category_id_that_names_does_not_name_counts_in_no_category(ids, names, expected):
    """An id without a name was counted under category 0's name (web 3.0 for 1.0), and a negative
    ignore index wrapped around to the last category's. Given as a list of ids: -1 counted in the
    last category, -100 or an id a dict does not name raised a bare IndexError or KeyError."""
    import torch

    import distmetrics as dm

    for categories, weights in itertools.product((torch.tensor(ids), list(ids)), (None, torch.tensor([2.0] * 3))):
        with dm.Monitor(quiet_config(log_interval=1)) as monitor:
            monitor.record_losses(torch.tensor([1.0, 5.0, 9.0]), categories, weights=weights, names=names)
            metrics = monitor.step(1)
        assert {k[len("train/loss/"):]: v for k, v in metrics.items() if k.startswith("train/loss/")} == expected
    with dm.Monitor(quiet_config(log_interval=1)) as monitor, \
            pytest.raises(TypeError, match=r"with names= the categories are integer ids, got str 'web'"):
        monitor.record_losses(torch.tensor([1.0]), ["web"], names=names)


@pytest.mark.parametrize("counts,layers", [
    ("tensor", [1.0, 2.0]), ("tensor", ["1", "2"]), ("tensor", 3), ("tensor", [True, False]), ("tensor", [-1, 2]),
    ([[1, 2], [3, 4]], [0, 1]), ("3-d", None), ("0-d", None)])
def test_record_moe_refuses_bad_arguments_at_the_call(counts, layers):
    """layer_numbers=[1.0, 2.0] was taken, then every rank raised at the log step, after its
    collectives (the interval's train loss lost with it); a list, a 0-d or a 3-d tensor failed
    there too, with an AttributeError or an IndexError."""
    import torch

    import distmetrics as dm

    counts = {"tensor": torch.ones(2, 4), "3-d": torch.ones(2, 2, 4), "0-d": torch.tensor(3.0)}.get(counts, counts) \
        if isinstance(counts, str) else counts
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        with pytest.raises(ValueError, match=r"record_moe\((tokens_per_expert|layer_numbers)=...\): expected"):
            monitor.record_moe(tokens_per_expert=counts, layer_numbers=layers)
        assert monitor.step(1, loss=2.0)["train/loss"] == 2.0 and not any(k.startswith("moe/") for k in monitor.last_metrics)


@pytest.mark.parametrize("counts,layers,said", [
    ("complex", None, "a torch.complex64 tensor; accepted: counts as an integer or real floating tensor"),
    ("bool", None, "a torch.bool tensor; accepted: counts as an integer or real floating tensor"),
    (None, [5], "numbers the layers of tokens_per_expert, which was not given")])
def test_record_moe_refuses_complex_or_bool_counts_and_layer_numbers_alone(counts, layers, said):
    """A complex tensor of counts lost its imaginary part with only torch's ComplexWarning, a bool one was
    counted as 0/1, and layer_numbers without counts were ignored, unsaid."""
    import torch

    import distmetrics as dm

    counts = {"complex": torch.ones(4, dtype=torch.complex64), "bool": torch.ones(4, dtype=torch.bool)}.get(counts)
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        with pytest.raises(ValueError, match=re.escape(said)):
            monitor.record_moe(aux_loss=0.1, tokens_per_expert=counts, layer_numbers=layers)
        assert not any(k.startswith("moe/") for k in monitor.step(1, loss=2.0))  # a refused call records nothing
        monitor.record_moe(aux_loss=0.1, layer_numbers=[])  # a stage with no MoE layer: no layer, no counts
        assert monitor.step(2, loss=2.0)["moe/aux_loss"] == pytest.approx(0.1)


def _losses_and_counts_as_dtensors(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        losses = distribute_tensor(torch.tensor([1.0, 3.0]), mesh, [Replicate()])
        monitor.record_losses(losses, ["web", "code"])
        counts = distribute_tensor(torch.tensor([[4.0, 0.0]]), mesh, [Replicate()])
        monitor.record_moe(tokens_per_expert=counts, layer_numbers=[0])
        for name, call in (("losses", lambda: monitor.record_losses(distribute_tensor(torch.ones(2), mesh, [Shard(0)]),
                                                                      ["web", "code"])),
                           ("meta", lambda: monitor.record_losses(torch.ones(2, device="meta"), ["web", "code"])),
                           ("counts", lambda: monitor.record_moe(tokens_per_expert=distribute_tensor(
                               torch.ones(1, 2), mesh, [Shard(1)])))):
            try:
                call()
            except ValueError as err:
                out[name] = str(err)
        metrics = monitor.step(1)
    out["metrics"] = {k: v for k, v in metrics.items() if k.startswith(("train/loss/", "moe/"))}
    return out


def test_per_sample_losses_and_expert_counts_as_dtensors_or_on_the_meta_device():
    """A Replicate DTensor of counts failed at every log step (.tolist() of a DTensor); per-sample
    losses as a DTensor raised torch's own error, and on the meta device failed inside the
    reduction with the other rank waiting. A Replicate DTensor is this rank's copy; the others
    are refused at the call."""
    for out in run_ranks(_losses_and_counts_as_dtensors, 2, timeout=120):
        assert out["metrics"]["train/loss/web"] == 1.0 * 1 and out["metrics"]["train/loss/code"] == 3.0
        assert out["metrics"]["moe/expert_utilization"] == 0.5
        assert "Shard(dim=0)" in out["losses"] and "meta device" in out["meta"] and "Shard(dim=1)" in out["counts"]


def test_loss_categories_keep_one_names_tuple_between_log_steps():
    """A new tuple of record names at every log step: the pack layout, which knows a vector by its
    names' tuple, rebuilt its positions and copied them to the device at each (host-to-device
    syncs on a GPU)."""
    import torch

    from distmetrics.collectors.losses import CategoryLosses

    losses = CategoryLosses("train/loss")
    made = []
    for categories in (["a", "b"], ["b", "a"], ["a", "c"]):
        losses.record(torch.ones(2), categories)
        made.append(losses.take_samples()[0].names)
    assert made[0] is made[1] and made[0] == ("train/loss/a", "train/loss/b")
    assert made[2] == ("train/loss/a", "train/loss/b", "train/loss/c")


def test_non_finite_gradients_between_log_steps_then_at_one_are_one_event():
    """A record counting steps with non-finite gradients (between log steps), then the next naming the
    modules (at its log step): consecutive records with a count are one event, said once; the second
    still names the first module."""
    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.health import HealthCollector

    health = HealthCollector(spike_factor=5.0)
    first = {"grad_nonfinite_steps": 1.0, "grad_nonfinite": 0.0}
    said = health.finalize(first, LogContext(step=8, steps=4, layout=None, module_order=["a", "b"]))
    second = {"grad_nonfinite_steps": 1.0, "grad_nonfinite": 2.0, "grad_nonfinite_modules": ["b"]}
    said += health.finalize(second, LogContext(step=12, steps=4, layout=None, module_order=["a", "b"],
                                               previous=first))
    assert [alert.alert for alert in said] == ["nonfinite_grad"]
    assert second["health/first_nonfinite_module"] == "b"


def test_a_bool_mask_of_categories_is_the_ids_0_and_1():
    """record_losses(loss, is_code_mask, names=["text", "code"]): a bool tensor is the ids 0 and 1."""
    import torch

    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        monitor.record_losses(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([False, True, True]), names=["text", "code"])
        metrics = monitor.step(1)
    assert (metrics["train/loss/text"], metrics["train/loss/code"]) == (1.0, 4.0)


@pytest.mark.parametrize("logged", [False, True])
def test_record_moe_after_the_last_step_is_said_at_close(caplog, logged):
    """record_moe after the last monitor.step landed in the close record (or in none, after a logged step),
    unsaid; its counts add up in place and are not taken back, so close() says where they went."""
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=3 if logged else 10))
    for step in (1, 2, 3):
        monitor.record_moe(aux_loss=1.0, tokens_per_expert=torch.tensor([1.0, 3.0]))
        monitor.step(step, loss=1.0)
    monitor.record_moe(aux_loss=5.0)
    monitor.close()
    said = [r.getMessage() for r in caplog.records if "record_moe's values" in r.getMessage()]
    fate = "are not written" if logged else "are written into the record close() writes"
    assert len(said) == 1 and fate in said[0], said


# --- sparse category ids ----------------------------------------------------------------------
# Ids of a names= dict may be sparse (hashes, global document ids): an id far beyond the others, and
# negative ignore indices beside them, on 2 gloo ranks over one interval of 2 steps.

FAR = 10**12
SPARSE_NAMES = {FAR: "far", 7: "near"}
# (rank, step) -> per-sample losses, their ids (-100, -1, 3 and FAR + 1 are named by nothing), weights
SPARSE_DATA = {
    (0, 1): ([1.0, 2.0, 4.0, 8.0], [FAR, -100, 7, FAR + 1], [1.0, 5.0, 2.0, 3.0]),
    (0, 2): ([16.0, 32.0], [-1, FAR], [1.0, 4.0]),
    (1, 1): ([3.0, 5.0, 7.0], [7, 7, 3], [1.0, 1.0, 9.0]),
    (1, 2): ([0.5, 9.0, 11.0], [FAR, -100, 7], [2.0, 1.0, 3.0]),
}


def _sparse_category_ids(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=2)) as monitor:
        for step in (1, 2):
            losses, ids, weights = SPARSE_DATA[(rank, step)]
            given = torch.tensor(ids) if step == 1 else ids  # a tensor of ids, then a list of them
            monitor.record_losses(torch.tensor(losses), given, weights=torch.tensor(weights), names=SPARSE_NAMES)
            metrics = monitor.step(step, loss=1.0)
    return {k: v for k, v in metrics.items() if k.startswith("train/loss/")}


def test_sparse_and_negative_category_ids_count_under_their_names():
    """An id of 1e8 in names= cost a table of 1e8 + 1 slots per call (0.6 s, 760 MB); 1e12 raised the
    allocator's error. Named ids count under their names, ids names= does not name (negative ignore
    indices, 3, FAR + 1) in none. Truth: Σ loss·w / Σ w per name over ranks and steps, by hand."""
    sums, weights = {}, {}
    for losses, ids, ws in SPARSE_DATA.values():
        for loss, category, w in zip(losses, ids, ws):
            if category in SPARSE_NAMES:
                name = SPARSE_NAMES[category]
                sums[name] = sums.get(name, 0.0) + loss * w
                weights[name] = weights.get(name, 0.0) + w
    expected = {f"train/loss/{name}": sums[name] / weights[name] for name in sums}
    for metrics in run_ranks(_sparse_category_ids, 2, timeout=120):
        assert metrics.keys() == expected.keys()
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-12), name


def test_the_memory_of_integer_categories_does_not_grow_with_the_largest_id():
    """What record_losses allocates (torch's profiler counts every CPU allocation) is the same for a largest
    id of 10, 1e6 or 1e12: the id → category lookup holds the names, not max(id) + 1 slots (1e6 took 24 MB
    over 3 calls). It is made once per contents of names= (an equal dict made anew is the same), not per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from distmetrics.collectors.losses import CategoryLosses

    allocated = {}
    for largest in (10, 10**6, FAR):
        losses = CategoryLosses("train/loss")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for _ in range(3):
                losses.record(torch.ones(3), torch.tensor([largest, 2, -100]), names={largest: "far", 2: "near"})
        allocated[largest] = sum(event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0)
        assert losses.take_samples()[0].weight.tolist() == [3.0, 3.0]
        made = losses._lookup({largest: "far", 2: "near"}, torch.device("cpu"))
        assert [t.tolist() for t in made] == [[2, largest], [1, 0]]  # the named ids, sorted, and their slots
        assert losses._lookup({largest: "far", 2: "near"}, torch.device("cpu")) is made
    assert allocated[10] == allocated[10**6] == allocated[FAR] < 64 * 1024, allocated


def test_a_few_category_maps_used_in_turn_stay_made_and_the_oldest_unused_goes():
    """The lookups kept are the most recently used (a map growing by an id per call kept sixteen copies):
    three maps used in turn are each made once; a fifth map lets go of the one used longest ago."""
    import torch

    from distmetrics.collectors.losses import CategoryLosses

    losses = CategoryLosses("train/loss")
    maps = [{i: f"c{i}", 100 + i: "other"} for i in range(5)]
    made = [losses._lookup(maps[i], None) for i in range(3)]
    for _ in range(2):
        assert [losses._lookup(maps[i], None) for i in range(3)] == made  # the same objects: not made again
    losses._lookup(maps[3], None)
    losses._lookup(maps[0], None)  # used last: kept
    losses._lookup(maps[4], None)  # four kept: map 1, used longest ago, goes
    assert losses._lookup(maps[0], None) is made[0] and losses._lookup(maps[2], None) is made[2]
    assert losses._lookup(maps[1], None) is not made[1]
    assert torch.equal(losses._lookup(maps[1], None)[0], made[1][0])


def test_a_non_finite_loss_or_norm_is_no_spike_judgement(tmp_path):
    """A NaN train/loss or grad_norm wrote health/*_spike 0: "no spike" for a value never judged."""
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(2, 2)
    records = []
    with dm.Monitor(_config(tmp_path, console=False), model=model) as monitor:
        for step in range(1, 15):
            _model_with_grad_norm(model, math.nan if step == 13 else 1.0)
            monitor.clip_grad_norm_(1.0)
            records.append(monitor.step(step, loss=math.inf if step == 14 else math.nan if step >= 12 else 1.0))
    assert [(r.get("health/loss_spike"), r.get("health/grad_spike")) for r in records[10:]] == [
        (0, 0), (None, 0), (None, None), (None, 0)]
    assert [r["health/nonfinite_loss"] for r in records[10:]] == [0, 1, 1, 1]


def test_loss_categories_that_come_and_go_leave_the_vector_and_come_back_exact():
    """A category per data shard (a new one each step) made every log step's vector hold every
    category the run had named: 2,012 lanes in the SUM pack at step 1,000, and the log step 5x
    slower by step 3,000. Categories with no sample since the last log step now leave it once they
    are more than half (and more than 64). Values against a float64 mean by hand, one rank, the
    Monitor's own calls: 'rare' comes back every 100 steps, 'skipped' only in skipped steps."""
    import torch

    import distmetrics as dm
    from distmetrics.collectors.losses import _SLACK

    monitor = dm.Monitor(quiet_config(log_interval=1))
    sizes = []
    for step in range(1, 301):
        categories = ["a", "b", f"shard{step}"] + (["rare"] if step % 100 == 0 else [])
        losses = torch.arange(1, len(categories) + 1, dtype=torch.float64) * step
        monitor.record_losses(losses, categories, weights=torch.full((len(categories),), 2.0))
        if step % 7 == 0:  # a skipped step's category counts in no record
            monitor.record_losses(torch.tensor([5.0]), ["skipped"])
        metrics = monitor.step(step, loss=1.0, skipped=step % 7 == 0)
        sizes.append(len(monitor._by_name["losses"].train.names))
        written = sorted(name for name in metrics if name.startswith("train/loss/"))
        want = {} if step % 7 == 0 else {f"train/loss/{c}": float((i + 1) * step) for i, c in enumerate(categories)}
        assert written == sorted(want) and all(metrics[k] == want[k] for k in want), (step, metrics)
    monitor.close()
    assert max(sizes) <= _SLACK + 8 and any(b < a for a, b in zip(sizes, sizes[1:])), sizes


def test_loss_category_weights_given_as_python_floats_keep_float64():
    """torch.as_tensor made a list of Python floats float32 before the float64 sums: a relative error
    of about 1e-8 in every weighted category mean. Truth: the float64 weighted mean by hand."""
    import numpy
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=1))
    weights = [1.1, 2.3, 0.7000000001]
    monitor.record_losses(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), ["a", "a", "b"], weights=weights)
    monitor.record_losses(torch.tensor([4.0], dtype=torch.float64), ["a"], weights=numpy.array([0.1]))
    metrics = monitor.step(1, loss=1.0)
    monitor.close()
    want = (1.1 * 1.0 + 2.3 * 2.0 + 0.1 * 4.0) / (1.1 + 2.3 + 0.1)
    assert metrics["train/loss/a"] == pytest.approx(want, rel=1e-15)
    assert metrics["train/loss/b"] == pytest.approx(3.0, rel=1e-15)
