"""A small decoder-only transformer trained with FSDP2 (optionally HSDP and tensor parallel),
instrumented by distmetrics. Runs on CPU with gloo and on GPUs with NCCL, same flags.

    torchrun --nproc-per-node 2 launch/train_fsdp.py --steps 40 output_dir=runs/demo
    torchrun --nproc-per-node 4 launch/train_fsdp.py --dp-replicate 2 --dp-shard 2      # HSDP
    torchrun --nproc-per-node 4 launch/train_fsdp.py --dp-shard 2 --tp 2                 # FSDP2 + TP

Positional ``key=value`` arguments override any metrics config key (``--config`` file first).
The data is a synthetic Markov-chain token stream (learnable, so the loss falls), the same for
every parallel layout: the global batch of step s is drawn from seed+s and each data-parallel
rank takes its rows, so an unsharded single-process run sees the same data.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distmetrics as dm
from common import (GPT, MarkovData, TrainerArgs, check_divides, gpus_for_ranks, lr_at, metrics_config, non_negative,
                    positive, run_trainer)


# --- parallelism -------------------------------------------------------------------------------

def setup_distributed() -> tuple[torch.device, int, int]:
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        use_cuda = gpus_for_ranks()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return device, dist.get_rank(), dist.get_world_size()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu"), 0, 1


def parallelize(model: GPT, device: torch.device, world: int, dp_replicate: int, dp_shard: int, tp: int):
    """FSDP2 (+HSDP, +TP) over a DeviceMesh; returns (model, mesh, dp_rank, dp_size)."""
    if dp_replicate * dp_shard * tp != world:
        raise SystemExit(f"--dp-replicate {dp_replicate} × --dp-shard {dp_shard} × --tp {tp} != world size {world}")
    if world == 1:
        return model, None, 0, 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    if dp_replicate * dp_shard > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    dp_rank = mesh.get_local_rank("dp_replicate") * dp_shard + mesh.get_local_rank("dp_shard")
    return model, mesh, dp_rank, dp_replicate * dp_shard


# --- training ----------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = TrainerArgs(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="metrics config YAML (configs/*.yaml)")
    p.add_argument("--steps", type=positive, default=40, help="optimizer steps to train")
    p.add_argument("--dp-shard", type=positive, default=None,
                   help="FSDP2 shard degree (default: world / replicate / tp)")
    p.add_argument("--dp-replicate", type=positive, default=1, help="HSDP replicate degree")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel degree")
    p.add_argument("--micro-batch", type=positive, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=positive, default=1)
    p.add_argument("--seq-len", type=positive, default=32)
    p.add_argument("--vocab", type=positive, default=128)
    p.add_argument("--d-model", type=positive, default=64)
    p.add_argument("--layers", type=positive, default=2)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=non_negative, default=5, help="linear warm-up steps (0: none)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=non_negative, default=20, help="evaluate every N steps (0: never)")
    p.add_argument("--save-every", type=non_negative, default=20,
                   help="'checkpoint' every N steps (progress.txt; 0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="metrics config overrides: key=value")
    return p.parse_intermixed_args(argv)  # key=value overrides may stand between options


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_divides("--d-model", args.d_model, args.heads, "--heads")
    check_divides("--heads", args.heads, args.tp, "--tp")
    device, rank, world = setup_distributed()
    check_divides("the world size", world, args.dp_replicate * args.tp, "--dp-replicate × --tp")
    dp_shard = args.dp_shard or world // (args.dp_replicate * args.tp)
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    # N of 6·N: the matrix multiplies' weights, the output layer's included (Megatron-LM's count:
    # 12·L·h² + V·h here), not the embeddings, norms and biases, which cost no matrix multiply
    n_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    model, mesh, dp_rank, dp_size = parallelize(model, device, world, args.dp_replicate, dp_shard, args.tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    # the model description: the config derives flops_per_token from it (6·N + 6·L·h·s, causal)
    overrides = [f"total_steps={args.steps}", f"num_params={n_params}", f"num_layers={args.layers}",
                 f"hidden_size={args.d_model}", f"seq_length={args.seq_len}"]
    overrides += args.overrides
    config = metrics_config(args.config, overrides)
    # --- the metrics integration: these lines and the monitor calls in the loop ---
    monitor = dm.Monitor(config, model=model, optimizer=optimizer, device_mesh=mesh)
    timers = monitor.timers

    data = MarkovData(args.vocab, args.seed)
    global_rows = args.micro_batch * dp_size
    last = {}
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args.lr, args.warmup, args.steps)
        # the step's loss is this rank's token-weighted mean over its micro-batches, reported once
        # with their summed tokens (a mean of micro-batch means would be wrong for unequal lengths)
        loss_sum = torch.zeros((), device=device)  # Σ over micro-batches of mean loss × tokens
        with timers("forward-backward", log_level=1):
            mine = slice(dp_rank * args.micro_batch, (dp_rank + 1) * args.micro_batch)  # this rank's rows
            batches = [data.batch(step * 1000 + micro, global_rows, args.seq_len)[mine]
                       for micro in range(args.grad_accum)]
            tokens = sum(batch[:, 1:].numel() for batch in batches)  # the targets the loss averages over
            for batch in batches:
                batch = batch.to(device)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), batch[:, 1:].reshape(-1))
                (loss * (batch[:, 1:].numel() / tokens)).backward()  # the gradient of the step's mean
                loss_sum += loss.detach() * batch[:, 1:].numel()
        grad_norm = monitor.clip_grad_norm_(args.max_grad_norm)  # after the last micro-batch's backward
        with timers("optimizer", log_level=1):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        metrics = monitor.step(step, loss=loss_sum / tokens, tokens=tokens, lr=optimizer.param_groups[0]["lr"])
        if metrics is not None:
            last = metrics
        if step == 1:
            last["first_grad_norm"] = float(grad_norm)
        # evaluation and saving are not training: paused, their time stays out of the next
        # interval's step time, tokens/s, MFU and ETA
        if args.eval_every and step % args.eval_every == 0:
            monitor.pause()
            monitor.log_eval(step, **evaluate(model, data, args, dp_rank, device))
            monitor.resume()
        if args.save_every and step % args.save_every == 0:
            monitor.pause()
            monitor.checkpoint_saved(step)  # a real trainer saves here; progress.txt records it
            monitor.resume()
    monitor.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return last


@torch.no_grad()
def evaluate(model: nn.Module, data: MarkovData, args: argparse.Namespace, dp_rank: int, device) -> dict:
    start = time.perf_counter()
    total, count = torch.zeros((), device=device), 0
    for i in range(2):
        rows = data.batch(10_000_000 + i, args.micro_batch * 64, args.seq_len)
        batch = rows[dp_rank * args.micro_batch:(dp_rank + 1) * args.micro_batch].to(device)
        logits = model(batch[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, args.vocab).float(), batch[:, 1:].reshape(-1), reduction="sum")
        count += batch[:, 1:].numel()
    if device.type == "cuda":  # the forwards' time, not the time to queue them
        torch.cuda.synchronize(device)
    return {"loss": total / count, "tokens": count, "time_ms": (time.perf_counter() - start) * 1000}


if __name__ == "__main__":
    run_trainer(main)  # see common.run_trainer
