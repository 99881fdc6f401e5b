"""A Megatron-Core GPTModel trained with tensor and pipeline parallelism, instrumented by
distmetrics; our timers are handed to Megatron code in place of its own.

    torchrun --nproc-per-node 4 launch/train_megatron.py --tp 2 --pp 2 --steps 20

Local layer spec on CPU (gloo, with the adaptations in launch/megatron_cpu.py), the
TransformerEngine spec when TE and a GPU are there (``--te``). Megatron's pipeline schedules
need CUDA, so pipeline stages exchange activations and gradients here with plain
send/recv (one micro-batch per step). Weights are initialised from the *global* parameter
name, so every TP/PP layout starts from the same model as an unsharded run, and the data
is the same Markov stream as launch/train_fsdp.py.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os

import torch
import torch.distributed as dist

import distmetrics as dm
from common import (MarkovData, TrainerArgs, check_divides, gpus_for_ranks, lr_at, metrics_config, non_negative,
                    positive, quiet_megatron_warnings, run_trainer)
from megatron_cpu import apply_cpu_adaptations, build_gpt, cuda_on_cpu, wrap_with_optimizer


def parse_args(argv=None) -> argparse.Namespace:
    p = TrainerArgs(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="metrics config YAML")
    p.add_argument("--tp", type=positive, default=1)
    p.add_argument("--pp", type=positive, default=1)
    p.add_argument("--steps", type=positive, default=20, help="optimizer steps to train")
    p.add_argument("--micro-batch", type=positive, default=4)
    p.add_argument("--seq-len", type=positive, default=16)
    p.add_argument("--vocab", type=positive, default=64)
    p.add_argument("--hidden", type=positive, default=32)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=non_negative, default=3, help="linear warm-up steps (0: none)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--te", action="store_true", help="TransformerEngine layer spec (GPU)")
    p.add_argument("--fp8", choices=("e4m3", "hybrid"), default=None,
                   help="FP8 training with TransformerEngine (needs --te and a GPU); pair with "
                        "tensor_inspect.features=configs/fp8_tensor_stats.yaml for FP8 statistics")
    p.add_argument("--fp8-recipe", choices=("delayed", "tensorwise", "mxfp8", "blockwise"), default="delayed")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's DistributedDataParallel + DistributedOptimizer (gradients reduce-scattered: each "
                        "data-parallel rank owns a shard); Megatron clips, the monitor measures (needs --pp 1)")
    p.add_argument("overrides", nargs="*", help="metrics config overrides: key=value")
    return p.parse_intermixed_args(argv)  # key=value overrides may stand between options


def global_name(name: str, module_offset: int) -> str:
    """Stage-local parameter name → global (layer index + offset; the tied head is the embedding)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + module_offset)
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


@torch.no_grad()
def init_by_global_name(model: torch.nn.Module, seed: int, layer_offset: int) -> None:
    """Every parameter from a generator keyed by its global name; TP ranks take their slice."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        full_shape = list(p.shape)
        partitioned = getattr(p, "tensor_model_parallel", False)
        if partitioned:
            full_shape[p.partition_dim] *= tp
        key = int.from_bytes(hashlib.sha256(f"{seed}:{global_name(name, layer_offset)}".encode()).digest()[:7], "little")
        if name.endswith("layernorm.weight"):
            full = torch.ones(full_shape)
        elif name.endswith("bias"):
            full = torch.zeros(full_shape)
        else:
            full = torch.randn(full_shape, generator=torch.Generator().manual_seed(key)) * 0.02
        if partitioned:
            full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
        p.copy_(full)


def pipeline_forward_backward(model, tokens, labels, position_ids, mask, args, timers):
    """One micro-batch through the stages: activations forward, their gradients back."""
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    shape = (args.seq_len, args.micro_batch, args.hidden)  # Megatron's [s, b, h]
    input_tensor = None
    if not first:
        with timers("forward-recv", log_level=2):
            input_tensor = torch.empty(shape)
            dist.recv(input_tensor, src=ps.get_pipeline_model_parallel_prev_rank())
        input_tensor.requires_grad_(True)
        model.set_input_tensor(input_tensor)
    with timers("forward-compute", log_level=2):
        output = model(tokens, position_ids, mask, labels=labels if last else None)
    loss, grad = None, None
    if not last:  # the exchange is timed apart from the compute, as Megatron's schedules time it
        with timers("forward-send", log_level=2):
            dist.send(output.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty(shape)
        with timers("backward-recv", log_level=2):
            dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
    with timers("backward-compute", log_level=2):
        if last:
            loss = output.float().mean()
            loss.backward()
        else:
            output.backward(grad)
    if not first:
        with timers("backward-send", log_level=2):
            dist.send(input_tensor.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return loss


def finalize_grads(model: torch.nn.Module) -> None:
    """What Megatron's DDP and finalize_model_grads do: average over data parallel into
    ``main_grad``, and sum the two copies of the tied embedding across the first/last stage."""
    from megatron.core import parallel_state as ps

    dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if dp > 1:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp
        p.main_grad = p.grad  # Megatron keeps gradients in main_grad; the optimizer reads .grad
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        shared = model.shared_embedding_or_output_weight()
        if shared is not None and shared.grad is not None:
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())


def distributed_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> tuple:
    """The model under Megatron's DistributedDataParallel and its DistributedOptimizer (Megatron
    clips at ``--max-grad-norm``); on CPU through launch/megatron_cpu.cuda_on_cpu."""
    return wrap_with_optimizer(model, lr=args.lr, clip_grad=args.max_grad_norm)


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_megatron_warnings()  # before megatron-core is imported
    if args.fp8 and not args.te:
        raise SystemExit("--fp8 needs --te (TransformerEngine layers, on a GPU)")
    if args.te and importlib.util.find_spec("transformer_engine") is None:  # megatron-core: a NameError deep inside
        raise SystemExit("--te needs TransformerEngine (and a GPU): install transformer_engine, or leave --te out "
                         "for Megatron's local layers")
    check_divides("--layers", args.layers, args.pp, "--pp")
    check_divides("--heads", args.heads, args.tp, "--tp")
    check_divides("--hidden", args.hidden, args.heads, "--heads")
    if args.use_distributed_optimizer and args.pp > 1:
        raise SystemExit("--use-distributed-optimizer: this trainer's own pipeline send/recv does not run Megatron's "
                         "DDP across stages; use --pp 1")
    use_cuda = gpus_for_ranks()  # megatron_cpu's adaptations follow torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # a single process still needs a (size-1) group
            os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29591"))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    from megatron.core import parallel_state as ps

    check_divides("the world size", dist.get_world_size(), args.tp * args.pp, "--tp × --pp")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    apply_cpu_adaptations(args.seed)
    layer_offset = ps.get_pipeline_model_parallel_rank() * (args.layers // args.pp)

    def build():
        model = build_gpt(args.layers, args.hidden, args.heads, args.vocab, args.seq_len, args.tp, args.pp,
                          tied=True, use_te=args.te, fp8=args.fp8, fp8_recipe=args.fp8_recipe)
        init_by_global_name(model, args.seed, layer_offset)
        if args.use_distributed_optimizer:
            return distributed_optimizer(model, args)
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    n_params = 12 * args.layers * args.hidden ** 2 + args.vocab * args.hidden
    overrides = [f"total_steps={args.steps}", "writer_rank=last", f"num_params={n_params}",  # flops_per_token derived
                 f"num_layers={args.layers}", f"hidden_size={args.hidden}", f"seq_length={args.seq_len}"]
    overrides += args.overrides
    config = metrics_config(args.config, overrides)
    # A factory: tensor inspection (if configured) starts before TE layers are built.
    monitor = dm.Monitor(config, model=build)  # reads Megatron's parallel_state
    model, optimizer = monitor.model, monitor.optimizer
    timers = monitor.timers
    getattr(model, "module", model).config.timers = timers  # Megatron code reading config.timers uses ours

    data = MarkovData(args.vocab, args.seed)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    position_ids = torch.arange(args.seq_len).unsqueeze(0).expand(args.micro_batch, -1)
    mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool), 1).view(1, 1, args.seq_len, args.seq_len)
    last = {}
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args.lr, args.warmup, args.steps)
        rows = data.batch(step * 1000, args.micro_batch * dp, args.seq_len)
        batch = rows[dp_rank * args.micro_batch:(dp_rank + 1) * args.micro_batch]
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        with timers("forward-backward", log_level=1):
            loss = pipeline_forward_backward(model, tokens, labels, position_ids, mask, args, timers)
        extra = {}
        if args.use_distributed_optimizer:
            with timers("all-grads-sync", log_level=1):
                model.finish_grad_sync()  # reduce-scatter: each data-parallel rank owns a shard
            grad_norm = monitor.measure_grad_norms(step=step)  # Megatron clips in its step
            with timers("optimizer", log_level=1), cuda_on_cpu():
                _, megatron_norm, _ = optimizer.step()
            if grad_norm is not None:  # a log step: Megatron's own norm of the same gradients, to compare
                extra["megatron_grad_norm"] = megatron_norm
            model.zero_grad_buffer()
            optimizer.zero_grad()
        else:
            with timers("all-grads-sync", log_level=1):
                finalize_grads(model)
            grad_norm = monitor.clip_grad_norm_(args.max_grad_norm)
            with timers("optimizer", log_level=1):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        metrics = monitor.step(step, loss=None if loss is None else loss.detach(),
                               tokens=args.micro_batch * args.seq_len, lr=optimizer.param_groups[0]["lr"], **extra)
        if metrics is not None:
            last = metrics
        if step == 1 and grad_norm is not None:
            last["first_grad_norm"] = float(grad_norm)
    monitor.close()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return last


if __name__ == "__main__":
    run_trainer(main)  # see common.run_trainer
