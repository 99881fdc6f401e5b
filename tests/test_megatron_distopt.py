"""Megatron-Core's own DistributedDataParallel + DistributedOptimizer on 4 real gloo ranks (DP=4
and DP=2 × TP=2): our gradient, parameter and update norms against float64 truth from the full
tensors and against the grad norm Megatron's optimizer reports; our clipping against Megatron's;
the clip and effective-lr ratios when Megatron clips. Also Megatron's non-distributed
mixed-precision optimizer (bf16, DP=2 × TP=2), whose update is its fp32 main copies', and (DP=4)
our clip of its bf16 gradient buffers against its own.

Megatron's DDP and optimizer run as they are, with ``launch/megatron_cpu.cuda_on_cpu`` around
building them and ``optimizer.step()`` (it only sends CUDA allocations to the CPU and lets the
``torch.cuda.*Tensor`` type checks pass; see its docstring). The truth: every rank's local
gradient (``main_grad`` before ``finish_grad_sync``, unreduced) summed over the data-parallel
group in float64, counted once per (global name, tensor-parallel partition); parameters from the
full, all-gathered model before and after the step. Also Megatron-Core's interleaved pipeline
schedule itself (``get_forward_backward_func``, PP=2 × virtual 2 × DP=2) under a Monitor.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import quiet_config, run_ranks, squares_by_name, subtree_norms

REL = 1e-6
STEPS = 2
CLIP = 0.05  # small, so every step clips
LOSS_SCALE = 1024.0


def _setup(tp: int, clip_grad: float, attach: bool = True, distributed: bool = True, bf16: bool = False,
           fp16: bool = False, grad_reduce_in_fp32: bool = True):
    """A GPTModel under Megatron's DDP with the distributed optimizer (or, ``distributed=False``,
    the plain one; ``bf16``/``fp16``: in Megatron's ``Float16Module`` with fp32 main copies, fp16
    with a loss scale of LOSS_SCALE; ``grad_reduce_in_fp32=False``: gradient buffers in bf16/fp16,
    Megatron's default), and a Monitor on it."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt, wrap_with_optimizer

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    apply_cpu_adaptations(seed=1234)
    model = build_gpt(num_layers=2, hidden=32, heads=4, vocab=64, seq=16, tp=tp, tied=True)
    if bf16 or fp16:
        model.config.bf16, model.config.fp16 = bf16, fp16
        model = Float16Module(model.config, model)
    ddp, optimizer = wrap_with_optimizer(model, lr=1e-2, clip_grad=clip_grad, distributed=distributed, bf16=bf16,
                                         fp16=fp16, loss_scale=LOSS_SCALE if fp16 else None,
                                         grad_reduce_in_fp32=grad_reduce_in_fp32)
    cfg = quiet_config(log_interval=1, log_params_norm=True, log_update_norm=True)
    monitor = dm.Monitor(cfg, model=ddp, optimizer=optimizer if attach else None)
    torch.manual_seed(0)
    return ddp, optimizer, monitor


def _batch(step: int, dp_rank: int):
    import torch

    rows = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1000 * step + dp_rank))
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1).view(1, 1, 16, 16)
    return rows[:, :-1].contiguous(), position_ids, mask, rows[:, 1:].contiguous()


def _squares(named: dict, world: int) -> dict:
    """{global name: ‖full tensor‖²} of {name: (param, this rank's piece)}."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    return squares_by_name({(n, tp_rank if getattr(p, "tensor_model_parallel", False) else 0): float(t.pow(2).sum())
                            for n, (p, t) in named.items()}, world)


def _norms_run(tp: int, world: int) -> list:
    """Megatron clips; we measure. Per step: ours, Megatron's and the truth."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from launch.megatron_cpu import cuda_on_cpu

    ddp, optimizer, monitor = _setup(tp, clip_grad=CLIP)
    dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    params = {n: p for n, p in ddp.module.named_parameters()}
    out = []
    for step in range(1, STEPS + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, position_ids, mask, labels = _batch(step, ps.get_data_parallel_rank())
        ddp(tokens, position_ids, mask, labels=labels).mean().backward()
        full_grads = {}
        for name, p in params.items():  # the local gradients, summed over data parallel
            g = p.main_grad.detach().to(torch.float64).clone()
            dist.all_reduce(g, group=dp_group)
            full_grads[name] = (p, g / dp)
        before = {name: (p, p.detach().to(torch.float64).clone()) for name, p in params.items()}
        ddp.finish_grad_sync()
        ours_total = float(monitor.measure_grad_norms())
        with cuda_on_cpu():
            _, megatron_norm, _ = optimizer.step()
        metrics = monitor.step(step)
        after = {name: (p, p.detach().to(torch.float64).clone()) for name, p in params.items()}
        update = {name: (p, after[name][1] - before[name][1]) for name, p in params.items()}
        out.append({"ours_total": ours_total, "megatron": float(megatron_norm),
                    "grad": subtree_norms(_squares(full_grads, world)),
                    "param": subtree_norms(_squares(after, world)),
                    "update": subtree_norms(_squares(update, world)),
                    "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}})
    count = _count_nonzero(monitor, optimizer)
    monitor.close()
    return out, count


def _count_nonzero(monitor, optimizer) -> dict:
    """p = 0 (torch: the tensors with a non-zero element), and whether Megatron's range map
    gives this rank part of a tensor but not all of it."""
    split = any(0 < entry["param"].size < param.numel()
                for part in getattr(optimizer, "chained_optimizers", [optimizer])
                for buffers in part.gbuf_ranges for by_dtype in buffers.values() for bucket in by_dtype
                for param, entry in bucket["param_map"].items())
    try:
        return {"split": split, "p0": float(monitor.measure_grad_norms(norm_type=0))}
    except ValueError as err:
        return {"split": split, "p0": str(err)}


def _clip_run(tp: int, monitor_clips: bool) -> dict:
    """One step where Megatron clips, or where we clip and Megatron does not: the parameters."""
    from megatron.core import parallel_state as ps

    from launch.megatron_cpu import cuda_on_cpu

    ddp, optimizer, monitor = _setup(tp, clip_grad=0.0 if monitor_clips else CLIP)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = _batch(1, ps.get_data_parallel_rank())
    ddp(tokens, position_ids, mask, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    if monitor_clips:
        monitor.clip_grad_norm_(CLIP)
    else:
        monitor.measure_grad_norms()
    with cuda_on_cpu():
        optimizer.step()
    monitor.step(1)
    monitor.close()
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _mixed_precision_run(tp: int, world: int) -> dict:
    """Megatron's non-distributed mixed-precision optimizer (bf16 parameters, fp32 main copies
    the inner ``torch.optim`` step updates): Megatron clips, we measure. The truth of the update
    is the fp32 main parameters' before and after the step, in float64."""
    import torch
    from megatron.core import parallel_state as ps

    from launch.megatron_cpu import cuda_on_cpu

    ddp, optimizer, monitor = _setup(tp, clip_grad=CLIP, distributed=False, bf16=True)
    params = dict(ddp.module.module.named_parameters())  # inside the Float16Module
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = _batch(1, ps.get_data_parallel_rank())
    ddp(tokens, position_ids, mask, labels=labels).float().mean().backward()
    ddp.finish_grad_sync()  # all-reduced: every data-parallel rank holds the whole gradient
    grads = {n: (p, p.main_grad.to(torch.float64).clone()) for n, p in params.items()}
    before = {n: (p, p.main_param.to(torch.float64).clone()) for n, p in params.items()}
    monitor.measure_grad_norms()
    with cuda_on_cpu():
        _, megatron_norm, _ = optimizer.step()
    metrics = monitor.step(1)
    after = {n: (p, p.main_param.to(torch.float64).clone()) for n, p in params.items()}
    monitor.close()
    return {"megatron": float(megatron_norm), "grad": subtree_norms(_squares(grads, world)),
            "param": subtree_norms(_squares(after, world)),
            "update": subtree_norms(_squares({n: (p, after[n][1] - before[n][1]) for n, p in params.items()}, world)),
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}


def _fp16_run(distributed: bool, monitor_clips: bool) -> dict:
    """fp16 with a static loss scale: the gradients hold the loss times LOSS_SCALE until Megatron
    divides it out inside ``optimizer.step()``; the loss is scaled as Megatron's schedules scale
    it (``optimizer.scale_loss``). Megatron clips and we measure, or we clip and it does not."""
    from megatron.core import parallel_state as ps

    from launch.megatron_cpu import cuda_on_cpu

    ddp, optimizer, monitor = _setup(1, clip_grad=0.0 if monitor_clips else CLIP, distributed=distributed, fp16=True)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = _batch(1, ps.get_data_parallel_rank())
    optimizer.scale_loss(ddp(tokens, position_ids, mask, labels=labels).float().mean()).backward()
    ddp.finish_grad_sync()
    ours = float(monitor.clip_grad_norm_(CLIP) if monitor_clips else monitor.measure_grad_norms())
    with cuda_on_cpu():
        _, megatron_norm, _ = optimizer.step()
    metrics = monitor.step(1)
    monitor.close()
    return {"ours": ours, "megatron": float(megatron_norm), "logged": metrics["grad_norm"],
            "ratio": metrics.get("grad_clip_ratio"), "scale": float(optimizer.get_loss_scale()),
            "logged_scale": metrics.get("loss_scale")}


def _bf16_buffers_run(monitor_clips: bool) -> dict:
    """bf16 parameters and gradient buffers (``grad_reduce_in_fp32=False``) under Megatron's plain
    mixed-precision optimizer: Megatron clips at CLIP, or we clip and it does not. The norm its
    step reports (before its clip), and that of the fp32 gradients its inner step took (its main
    copies' ``.grad``, after its clip)."""
    import torch
    from megatron.core import parallel_state as ps

    from launch.megatron_cpu import cuda_on_cpu

    ddp, optimizer, monitor = _setup(1, clip_grad=0.0 if monitor_clips else CLIP, distributed=False, bf16=True,
                                     grad_reduce_in_fp32=False)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = _batch(1, ps.get_data_parallel_rank())
    ddp(tokens, position_ids, mask, labels=labels).float().mean().backward()
    ddp.finish_grad_sync()
    dtypes = sorted({str(p.main_grad.dtype) for p in ddp.parameters()})
    if monitor_clips:
        monitor.clip_grad_norm_(CLIP)
    with cuda_on_cpu():
        _, megatron_norm, _ = optimizer.step()
    monitor.step(1)
    monitor.close()
    stepped = [p.grad for part in optimizer.chained_optimizers
               for groups in (part.fp32_from_float16_groups, part.fp32_from_fp32_groups)
               for group in groups for p in group]
    return {"megatron": float(megatron_norm), "dtypes": dtypes,
            "stepped": sum(float(g.to(torch.float64).pow(2).sum()) for g in stepped) ** 0.5}


def _unattached(rank: int) -> tuple:
    """The distributed optimizer's model, the optimizer not given to the Monitor: a log step with no
    gradient measured (its parameters are whole on every rank: param_norm against float64 of them),
    then a gradient measurement (refused)."""
    from megatron.core import parallel_state as ps

    ddp, optimizer, monitor = _setup(1, clip_grad=CLIP, attach=False)
    truth = sum(float(p.detach().double().pow(2).sum()) for p in ddp.parameters()) ** 0.5
    param_norm = monitor.step(1)["param_norm"]
    tokens, position_ids, mask, labels = _batch(2, ps.get_data_parallel_rank())
    ddp(tokens, position_ids, mask, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    try:
        monitor.measure_grad_norms(step=2)
        return "no error", param_norm, truth
    except ValueError as err:
        return str(err), param_norm, truth
    finally:
        monitor.close()


def _scenarios(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as ps

    out = {}
    for tp in (1, 2):
        out[f"norms_tp{tp}"], out[f"count_tp{tp}"] = _norms_run(tp, world)
        ps.destroy_model_parallel()
        megatron_clips = _clip_run(tp, monitor_clips=False)
        ps.destroy_model_parallel()
        ours_clips = _clip_run(tp, monitor_clips=True)
        ps.destroy_model_parallel()
        out[f"clip_tp{tp}"] = max(float((megatron_clips[n] - ours_clips[n]).abs().max()) for n in ours_clips)
        out[f"clip_scale_tp{tp}"] = max(float(p.abs().max()) for p in ours_clips.values())
    out["mixed_precision"] = _mixed_precision_run(2, world)
    ps.destroy_model_parallel()
    for distributed in (False, True):
        for monitor_clips in (False, True):
            out[f"fp16_{distributed}_{monitor_clips}"] = _fp16_run(distributed, monitor_clips)
            ps.destroy_model_parallel()
    for monitor_clips in (False, True):
        out[f"bf16_buffers_{monitor_clips}"] = _bf16_buffers_run(monitor_clips)
        ps.destroy_model_parallel()
    out["unattached"] = _unattached(rank)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios, 4, timeout=420)


@pytest.mark.parametrize("tp", [1, 2])
def test_norms_are_exact_under_the_distributed_optimizer(results, tp):
    for rank_result in results:
        for step in rank_result[f"norms_tp{tp}"]:
            m = step["metrics"]
            assert step["ours_total"] == pytest.approx(step["grad"]["total"], rel=REL)
            assert m["grad_norm"] == pytest.approx(step["grad"]["total"], rel=REL)
            assert m["grad_norm"] == pytest.approx(step["megatron"], rel=REL)  # Megatron's own, fp32
            for family in ("grad", "param", "update"):
                truth = step[family]
                assert m[f"{family}_norm"] == pytest.approx(truth["total"], rel=1e-5 if family == "update" else REL)
                for module, value in truth["modules"].items():
                    assert m[f"{family}_norm/{module}"] == pytest.approx(value, rel=1e-5, abs=1e-12), module


@pytest.mark.parametrize("tp", [1, 2])
def test_our_clip_scales_what_megatrons_clip_would(results, tp):
    for rank_result in results:
        assert rank_result[f"clip_tp{tp}"] <= 1e-6 * rank_result[f"clip_scale_tp{tp}"]


@pytest.mark.parametrize("distributed", [False, True])
def test_fp16_norms_and_clipping_are_of_the_gradients_without_the_loss_scale(results, distributed):
    """Under fp16 the gradients hold the loss times the loss scale until Megatron's step divides
    it out: our norm was Megatron's times 1,024, grad_clip_ratio too, and our clip made every
    update 1,024 times too small. Now: Megatron measures, after our clip at CLIP (Megatron not
    clipping), the norm of the gradients we clipped to CLIP; where Megatron clips, our norm is its."""
    for rank_result in results:
        megatron_clips = rank_result[f"fp16_{distributed}_False"]
        assert megatron_clips["scale"] == LOSS_SCALE == megatron_clips["logged_scale"]
        assert megatron_clips["ours"] == pytest.approx(megatron_clips["megatron"], rel=1e-5)
        assert megatron_clips["logged"] == pytest.approx(megatron_clips["megatron"], rel=1e-5)
        assert megatron_clips["ratio"] == pytest.approx(megatron_clips["megatron"] / CLIP, rel=1e-5)
        ours_clip = rank_result[f"fp16_{distributed}_True"]
        assert ours_clip["ours"] == pytest.approx(megatron_clips["ours"], rel=1e-5)  # the same first step
        assert ours_clip["megatron"] == pytest.approx(CLIP, rel=1e-4)


def test_our_clip_of_bf16_gradient_buffers_is_the_clip_megatron_makes(results):
    """Megatron's default bf16 gradient buffers (``grad_reduce_in_fp32=False``): Megatron scales
    fp32 copies by a float32 coefficient of its total. Ours was torch's, in bf16, from the bf16
    total: Megatron's step measured our clip at 0.05 as 0.04984 here (0.3% off; 0.05006 on 2
    ranks). Now it measures what its own clip gives (0.05 to 1e-6), within 2e-5: the bf16
    rounding of the gradients our clip scales in place (5e-6 here)."""
    for rank_result in results:
        megatron_clips, ours = rank_result["bf16_buffers_False"], rank_result["bf16_buffers_True"]
        assert megatron_clips["dtypes"] == ours["dtypes"] == ["torch.bfloat16"]
        assert megatron_clips["megatron"] > 10 * CLIP  # its step clipped
        assert megatron_clips["stepped"] == pytest.approx(CLIP, rel=1e-6)  # Megatron's own clip, on the same input
        assert ours["megatron"] == pytest.approx(megatron_clips["stepped"], rel=2e-5)
        assert ours["stepped"] == pytest.approx(megatron_clips["stepped"], rel=2e-5)


def test_a_distributed_optimizer_not_attached_is_refused_on_every_rank(results):
    for rank_result in results:
        message, param_norm, truth = rank_result["unattached"]
        assert param_norm == pytest.approx(truth, rel=1e-6)  # parameters alone need no attached optimizer
        assert "use_distributed_optimizer=True" in message and "attach_megatron_optimizer" in message
        assert message.startswith("parameter '")


def test_update_norms_under_megatrons_mixed_precision_optimizer_are_the_main_params_update(results):
    """Float16OptimizerWithFloat16Params steps fp32 main copies and writes the bf16 parameters
    only after its inner step: the update is the main copies' (TP=2 × DP=2)."""
    for rank_result in results:
        run = rank_result["mixed_precision"]
        m, update, param = run["metrics"], run["update"], run["param"]
        assert update["total"] > 0
        assert m["grad_norm"] == pytest.approx(run["grad"]["total"], rel=REL)
        assert m["grad_norm"] == pytest.approx(run["megatron"], rel=REL)
        assert m["update_norm"] == pytest.approx(update["total"], rel=1e-5)
        assert m["param_norm"] == pytest.approx(param["total"], rel=REL)
        assert m["relative_update_norm"] == pytest.approx(update["total"] / param["total"], rel=1e-5)
        for module, value in update["modules"].items():
            assert m[f"update_norm/{module}"] == pytest.approx(value, rel=1e-5, abs=1e-12), module


def test_megatrons_clip_counts_in_the_clip_and_effective_lr_ratios(results):
    """Megatron clips at ``config.clip_grad`` inside ``optimizer.step()``: the update follows
    the clipped gradient, so effective_lr_ratio = ‖update‖ / (‖g‖ · min(1, clip / (‖g‖ + 1e-6)))."""
    runs = [step for r in results for step in r["norms_tp1"] + r["norms_tp2"]] + [r["mixed_precision"] for r in results]
    for run in runs:
        m, grad, update = run["metrics"], run["grad"]["total"], run["update"]["total"]
        coef = min(1.0, CLIP / (grad + 1e-6))
        assert coef < 0.5  # Megatron really clipped
        assert m["grad_clip_ratio"] == pytest.approx(grad / CLIP, rel=REL)
        assert m["effective_lr_ratio"] == pytest.approx(update / (grad * coef), rel=1e-5)


def test_p0_is_refused_on_every_rank_when_the_distributed_optimizer_splits_a_tensor(results):
    """DP=4, no tensor parallelism: only the distributed optimizer's slices split tensors. A
    tensor split between two ranks with non-zero slices would otherwise count twice."""
    assert any(rank_result["count_tp1"]["split"] for rank_result in results)
    for rank_result in results:
        message = rank_result["count_tp1"]["p0"]
        assert isinstance(message, str) and "norm_type=0" in message and "distributed optimizer" in message


def _moe_update(rank: int, world: int, distributed: bool) -> dict:
    """A MoE GPTModel (4 experts over 2 expert-parallel ranks) under Megatron's DDP: its optimizer
    is a ChainedOptimizer of a dense and an expert part. Gradients are written into main_grad (the
    MoE forward needs patches on CPU): the same on both ranks for the dense (replicated) parameters."""
    import zlib

    import torch
    from megatron.core import parallel_state as ps

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt, cuda_on_cpu, wrap_with_optimizer

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    apply_cpu_adaptations(seed=1234)
    model = build_gpt(num_layers=2, experts=4, ep=2)
    ddp, optimizer = wrap_with_optimizer(model, lr=1e-2, clip_grad=0.0, distributed=distributed)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=ddp, optimizer=optimizer)
    ddp.zero_grad_buffer()
    for name, p in model.named_parameters():
        expert = not getattr(p, "allreduce", True)
        seed = zlib.crc32(f"{name}|{rank if expert else ''}".encode())  # an expert's own on each rank
        p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    ddp.finish_grad_sync()
    before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    with cuda_on_cpu():
        optimizer.step()
    metrics = monitor.step(1) or {}
    monitor.close()
    squares = {"dense": 0.0, "expert": 0.0}
    for name, p in model.named_parameters():
        part = "dense" if getattr(p, "allreduce", True) else "expert"
        squares[part] += float((p.detach().double() - before[name]).pow(2).sum())
    return {"parts": len(getattr(optimizer, "chained_optimizers", [])), "squares": squares,
            "update_norm": metrics.get("update_norm")}


@pytest.mark.parametrize("distributed", [False, True], ids=["plain optimizer", "distributed optimizer"])
def test_update_norm_under_megatrons_chained_moe_optimizer_counts_every_part(distributed):
    """A MoE model's Megatron optimizer chains a dense and an expert part, stepped one after the
    other: the update norm was the expert part's alone (2.58 for 2.80; the dense modules' 0).
    Truth: float64 parameter changes, the replicated dense part once, each rank's experts."""
    import math

    out = run_ranks(_moe_update, 2, distributed, timeout=300)
    assert out[0]["parts"] == 2  # a dense and an expert optimizer
    truth = math.sqrt(out[0]["squares"]["dense"] + sum(o["squares"]["expert"] for o in out))
    assert out[0]["squares"]["dense"] > 0 and all(o["squares"]["expert"] > 0 for o in out)
    written = [o["update_norm"] for o in out if o["update_norm"] is not None]
    assert written and written[0] == pytest.approx(truth, rel=1e-6)


def _moe_parts_attached(rank: int, world: int, attach: str) -> dict:
    """The distributed ChainedOptimizer of a MoE GPTModel (4 experts over 2 expert-parallel ranks: a
    dense part sharded over DP=2 and an expert part) attached part by part: ``both`` (the dense part
    given to the Monitor and attached again, then the expert part attached), ``dense`` or ``expert``
    alone. Each rank writes gradients of its own into main_grad (the MoE forward needs patches on CPU). Truth
    in float64: the local gradients summed over the data-parallel (expert: expert-data-parallel)
    group, divided by the data-parallel size, as Megatron's DDP reduces them; and the norm
    Megatron's optimizer reports."""
    import zlib

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt, cuda_on_cpu, wrap_with_optimizer

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    apply_cpu_adaptations(seed=1234)
    model = build_gpt(num_layers=2, experts=4, ep=2)
    ddp, optimizer = wrap_with_optimizer(model, lr=1e-2, clip_grad=1e9)
    dense, expert = optimizer.chained_optimizers
    cfg = quiet_config(log_interval=1, log_update_norm=True)
    monitor = dm.Monitor(cfg, model=ddp, optimizer=expert if attach == "expert" else dense)
    if attach == "both":
        monitor.attach_megatron_optimizer(dense)  # attached twice: counted once
        monitor.attach_megatron_optimizer(expert)
    ddp.zero_grad_buffer()
    squares = {"dense": 0.0, "expert": 0.0, "embedding": 0.0}
    for name, p in model.named_parameters():
        is_expert = not getattr(p, "allreduce", True)
        seed = zlib.crc32(f"{name}|{rank}".encode())  # differs between the data-parallel ranks
        p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        reduced = p.main_grad.detach().double().clone()
        group = ps.get_expert_data_parallel_group() if is_expert else ps.get_data_parallel_group()
        dist.all_reduce(reduced, group=group)
        square = float((reduced / ps.get_data_parallel_world_size()).pow(2).sum())
        squares["expert" if is_expert else "dense"] += square
        squares["embedding"] += square if name.startswith("embedding.") else 0.0
    ddp.finish_grad_sync()
    try:
        ours = float(monitor.measure_grad_norms())
    except dm.megatron_optimizer.LayoutError as err:
        monitor.close()
        ps.destroy_model_parallel()
        return {"refused": str(err)}
    with cuda_on_cpu():
        _, megatron_norm, _ = optimizer.step()
    metrics = monitor.step(1)
    monitor.close()
    ps.destroy_model_parallel()
    return {"ours": ours, "megatron": float(megatron_norm), "squares": squares,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}


def _moe_attachments(rank: int, world: int) -> dict:
    return {attach: _moe_parts_attached(rank, world, attach) for attach in ("both", "dense", "expert")}


def test_a_chained_distributed_optimizer_attached_part_by_part_counts_every_part():
    """A MoE model's ChainedOptimizer holds a dense and an expert DistributedOptimizer. Attached part
    by part (as for several optimizers), only the last part's range map was kept: the dense gradients
    were read whole from reduce-scattered buffers (grad_norm 7% low at 4 ranks, grad_norm/embedding
    half). Now the parts' range maps add up (one attached twice counts once), and one part attached
    without the other is refused on every rank, naming a parameter the other part shards."""
    import math

    out = run_ranks(_moe_attachments, 2, timeout=300)
    # the dense gradients, reduced, are the same on both ranks (counted once); each rank's experts its own
    truth = math.sqrt(out[0]["both"]["squares"]["dense"] + sum(o["both"]["squares"]["expert"] for o in out))
    for rank_result in out:
        run = rank_result["both"]
        assert run["megatron"] == pytest.approx(truth, rel=REL)
        assert run["ours"] == pytest.approx(truth, rel=REL)
        assert run["metrics"]["grad_norm"] == pytest.approx(truth, rel=REL)
        assert run["metrics"]["grad_norm/embedding"] == pytest.approx(math.sqrt(run["squares"]["embedding"]), rel=REL)
        assert run["metrics"]["update_norm/embedding"] > 0
        for attach, other in (("dense", "expert"), ("expert", "dense")):
            message = rank_result[attach]["refused"]
            assert message.startswith("parameter '") and "attach the other optimizer" in message
            assert (".experts." in message.split("'")[1]) == (other == "expert")


def _interleaved_schedule(rank: int, world: int, out: str) -> dict:
    """Megatron-Core's own interleaved 1F1B schedule (``get_forward_backward_func``) on pipeline 2 ×
    virtual 2 × data parallel 2: each rank a ``ModuleList`` of two GPTModel chunks, one layer each
    (chunk c of stage s holds global layer 2c + s), under Megatron's DDP and plain optimizer, which
    clips at a value that does not bind; the Monitor measures between the schedule and the step."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, cpu_model_construction, cuda_on_cpu

    micro_batches, batch, seq, vocab = 4, 2, 16, 64
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    apply_cpu_adaptations(seed=1234)
    # batch_p2p_comm=False: Megatron's batched exchange calls torch.cuda.synchronize() after each one, which
    # CPU-only torch refuses; unbatched isend/irecv between the stages waits on the requests alone.
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0,
                               batch_p2p_comm=False)
    chunks = []
    with cpu_model_construction():
        for vp in range(2):
            chunks.append(GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                                   max_sequence_length=seq, share_embeddings_and_output_weights=True, vp_stage=vp,
                                   pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                                   post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    with cuda_on_cpu():
        ddps = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=c is not chunks[0]) for c in chunks]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1e6), ddps)
    for ddp in ddps:
        ddp.broadcast_params()
    monitor = dm.Monitor(quiet_config(log_interval=1, log_throughput=True, json_log=True, output_dir=out,
                                      writer_rank="last", timing_log_level=1),
                         model=torch.nn.ModuleList(ddps), optimizer=optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [ddp.no_sync for ddp in ddps]
    config.grad_scale_func = optimizer.scale_loss
    config.timers = monitor.timers
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)

        def loss_func(per_token):  # the schedule divides it by the micro-batches for the backward, in place: a
            loss = per_token.float().mean()  # copy is reported (detach() alone shares it: a quarter of the loss)
            return loss, {"lm loss": loss.clone().detach()}

        return model(tokens, position_ids, mask, labels=labels), loss_func

    last_stage = ps.is_pipeline_last_stage()
    steps = []
    for step in (1, 2):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        rows = torch.randint(0, vocab, (micro_batches, batch, seq + 1),
                             generator=torch.Generator().manual_seed(1000 * step + ps.get_data_parallel_rank()))
        # each chunk reads every micro-batch: the first stage takes its tokens, the last its labels
        data = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]
        # The schedule allocates its token count and the stages' receive buffers on "cuda": cuda_on_cpu sends
        # them to the CPU (launch/megatron_cpu.py).
        with cuda_on_cpu():
            losses = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=[iter(data), iter(data)], model=ddps,
                num_microbatches=micro_batches, seq_length=seq, micro_batch_size=batch, forward_only=False)
        ours = float(monitor.measure_grad_norms())
        with cuda_on_cpu():
            _, megatron_norm, _ = optimizer.step()
        loss = torch.stack([x["lm loss"] for x in losses]).mean() if last_stage else None
        metrics = monitor.step(step, loss=loss, tokens=micro_batches * batch * seq, lr=1e-2)
        steps.append({"ours": ours, "megatron": float(megatron_norm),
                      "losses": [float(x["lm loss"]) for x in losses] if last_stage else [],
                      "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, float)}})
    monitor.close()
    ps.destroy_model_parallel()
    return {"steps": steps}


def test_megatrons_interleaved_pipeline_schedule_is_measured_in_model_order(tmp_path):
    """Megatron-Core's interleaved schedule, run as Megatron runs it (PP 2 × VPP 2 × DP 2): the grad
    norm is the one Megatron's optimizer reports; per-layer names are global, each layer once; the
    run record lists the modules chunk by chunk across stages (stage by stage put layer 2, on stage
    0's chunk 1, before layer 1); the loss is the mean of the last stage's micro-batch losses; tokens
    count once per data-parallel replica, not once per stage."""
    import math
    import re

    import distmetrics as dm

    results = run_ranks(_interleaved_schedule, 4, str(tmp_path), timeout=240)
    writer = results[3]["steps"]  # writer_rank: last, a last-stage rank
    for step, record in enumerate(writer, start=1):
        m = record["metrics"]
        for rank_result in results:  # every rank's Megatron step reports the one norm
            assert m["grad_norm"] == pytest.approx(rank_result["steps"][step - 1]["megatron"], rel=REL)
            assert rank_result["steps"][step - 1]["ours"] == pytest.approx(m["grad_norm"], rel=REL)
        layers = {k.split("/", 1)[1] for k in m if re.fullmatch(r"grad_norm/\d+\.decoder\.layers\.\d+", k)}
        assert layers == {"0.decoder.layers.0", "0.decoder.layers.1", "1.decoder.layers.2", "1.decoder.layers.3"}
        micro_losses = [x for rank_result in results for x in rank_result["steps"][step - 1]["losses"]]
        assert len(micro_losses) == 2 * 4  # two last-stage replicas, four micro-batches each
        assert all(abs(x - math.log(64)) < 0.5 for x in micro_losses), micro_losses  # near chance at 64 tokens
        assert m["train/loss"] == pytest.approx(math.fsum(micro_losses) / len(micro_losses), rel=REL)
        assert m["train/consumed_tokens"] == step * 2 * 4 * 2 * 16  # replicas × micro-batches × batch × seq
        assert m["timers/forward-backward"] > 0, m  # the schedule times itself on the timers it was given
    [run] = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "run"]
    top = [n for n in run["modules"] if re.fullmatch(r"\d+\.(embedding|decoder\.layers\.\d+|output_layer)", n)]
    assert top == ["0.embedding", "0.decoder.layers.0", "0.decoder.layers.1", "1.decoder.layers.2",
                   "1.decoder.layers.3", "1.output_layer"]


def _dynamic_loss_scale(rank: int, world: int, distributed: bool) -> list:
    """fp16 under Megatron's dynamic loss scale (from 2**16; hysteresis 2): an inf in rank 0's local
    gradient before the data-parallel reduction at steps 3 and 4, which Megatron's step skips (the
    second halves the scale), each step reported with ``skipped=not update_successful``."""
    import logging

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt, cuda_on_cpu, wrap_with_optimizer

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    apply_cpu_adaptations(seed=1234)
    model = build_gpt(num_layers=2, hidden=32, heads=4, vocab=64, seq=16, tp=1, tied=True)
    model.config.fp16 = True
    ddp, optimizer = wrap_with_optimizer(Float16Module(model.config, model), lr=1e-2, clip_grad=1.0,
                                         distributed=distributed, fp16=True, initial_loss_scale=2.0 ** 16)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=ddp, optimizer=optimizer)
    out = []
    for step in range(1, 7):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, position_ids, mask, labels = _batch(step, ps.get_data_parallel_rank())
        loss = ddp(tokens, position_ids, mask, labels=labels).float().mean()
        optimizer.scale_loss(loss).backward()
        if step in (3, 4) and rank == 0:
            next(ddp.module.parameters()).main_grad.view(-1)[0] = float("inf")
        ddp.finish_grad_sync()
        monitor.measure_grad_norms()
        with cuda_on_cpu():
            stepped, megatron_norm, _ = optimizer.step()
        metrics = monitor.step(step, loss=loss.detach(), tokens=32, skipped=not stepped)
        out.append({"stepped": stepped, "megatron": megatron_norm and float(megatron_norm),
                    "scale": float(optimizer.get_loss_scale()), "loss": float(loss),
                    "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}})
    monitor.close()
    logging.getLogger("distmetrics").removeHandler(handler)
    ps.destroy_model_parallel()
    return [out, [m for m in said if "update_norm" in m]]


@pytest.mark.parametrize("distributed", [False, True], ids=["plain optimizer", "distributed optimizer"])
def test_megatrons_dynamic_loss_scale_and_its_skipped_steps(distributed):
    """``loss_scale`` is the scale Megatron's optimizer holds after each step (as Megatron logs it); a
    skipped step has a non-finite grad_norm (Megatron's is None), no train/loss and no update_norm, and
    counts in health/skipped_steps; the others' norm is Megatron's. The missing update of a step reported
    skipped is said once as that, not as an optimizer left unattached (which used up that warning)."""
    import math

    results = run_ranks(_dynamic_loss_scale, 2, distributed, timeout=240)
    steps, said = results[0]
    assert [s["stepped"] for s in steps] == [True, True, False, False, True, True]
    assert [s["scale"] for s in steps] == [2.0 ** 16] * 3 + [2.0 ** 15] * 3  # hysteresis 2: the second halves
    losses = [s["loss"] for result in results for s in result[0]]
    for n, s in enumerate(steps):
        m = s["metrics"]
        assert m["loss_scale"] == s["scale"]
        assert m["health/skipped_steps"] == (0.0 if s["stepped"] else 1.0)
        if s["stepped"]:
            assert m["grad_norm"] == pytest.approx(s["megatron"], rel=REL)
            assert m["train/loss"] == pytest.approx((losses[n] + losses[6 + n]) / 2, rel=1e-6)
            assert m["update_norm"] > 0
        else:
            assert not math.isfinite(m["grad_norm"]) and m["grad_nonfinite_steps"] == 1.0
            assert "train/loss" not in m and "update_norm" not in m
    assert len(said) == 1 and said[0].startswith("distmetrics: the record of step 3 has no update_norm: its "
                                                 "monitor.step was given skipped=True"), said


def _layer_names(rank: int, world: int, root: str) -> dict:
    """A Megatron-Core GPT with tensor statistics of its MLP layers and per-module norms: the names each
    is written under, the selected layers' weight statistic, and each layer's weight norm in float64."""
    from megatron.core import parallel_state as ps

    import distmetrics as dm
    from launch.megatron_cpu import apply_cpu_adaptations, build_gpt

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    apply_cpu_adaptations(seed=1234)
    model = build_gpt(num_layers=2, hidden=32, heads=4, vocab=64, seq=16, tp=1, tied=True)
    stats = {"enabled": True, "tensors": ["weight"], "stats": ["l2_norm"], "freq": 1}
    features = {"fc1": {"enabled": True, "layers": {"layer_name_regex_pattern": r".*linear_fc1$"},
                        "distmetrics": {"LogTensorStats": stats}},
                "first": {"enabled": True, "layers": {"layer_numbers": [1], "layer_types": ["linear_fc2"]},
                          "distmetrics": {"LogTensorStats": stats}}}
    cfg = quiet_config(output_dir=f"{root}/out", json_log=True, log_interval=1, log_grad_norm_per_module=True,
                       module_norm_depth=6, tensor_inspect={"enabled": True, "features": features})
    monitor = dm.Monitor(cfg, model=model)
    tokens, position_ids, mask, labels = _batch(1, 0)
    model(tokens, position_ids, mask, labels=labels).mean().backward()
    monitor.measure_grad_norms()
    monitor.step(1)
    monitor.close()
    ps.destroy_model_parallel()
    records = list(dm.read_jsonl(f"{root}/out/metrics.jsonl"))
    return {"stats": {k: v for r in records for k, v in r.items() if k.startswith("tensor_stats/")},
            "norms": sorted({k for r in records for k in r if k.startswith("grad_norm/decoder.layers.")
                             and k.endswith(".mlp.linear_fc1")}),
            "weights": {n: float(p.detach().double().norm()) for n, p in model.named_parameters()
                        if n.endswith(("linear_fc1.weight", "linear_fc2.weight"))}}


def test_megatron_layers_are_numbered_from_1_in_tensor_statistics_and_from_0_in_norm_names(tmp_path):
    """The README's naming: Megatron-Core's ``layer_number`` starts at 1 (nvdlfw-inspect's layer names and
    its ``layer_numbers`` selector), its parameter names at 0 (the norms'): the statistics written under
    ``decoder.layers.1`` are those of ``decoder.layers.0``'s weight, in float64 from the model."""
    got = run_ranks(_layer_names, 1, str(tmp_path), timeout=240)[0]
    weights = got["weights"]
    assert got["norms"] == ["grad_norm/decoder.layers.0.mlp.linear_fc1", "grad_norm/decoder.layers.1.mlp.linear_fc1"]
    expected = [f"tensor_stats/decoder.layers.{n}.mlp.linear_fc1/weight/l2_norm" for n in (1, 2)]
    assert sorted(got["stats"]) == sorted(expected + ["tensor_stats/decoder.layers.1.mlp.linear_fc2/weight/l2_norm"])
    for number in (1, 2):
        for layer in ("linear_fc1", "linear_fc2") if number == 1 else ("linear_fc1",):
            assert got["stats"][f"tensor_stats/decoder.layers.{number}.mlp.{layer}/weight/l2_norm"] == \
                pytest.approx(weights[f"decoder.layers.{number - 1}.mlp.{layer}.weight"], rel=1e-6)
