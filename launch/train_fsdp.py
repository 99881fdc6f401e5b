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
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distmetrics as dm


# --- model -------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # under tensor parallelism q/k/v hold this rank's heads only
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp_norm = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(d, 4 * d), "fc2": nn.Linear(4 * d, d)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.mlp_norm(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def flops_per_token(n_params: int, layers: int, d: int, seq: int) -> float:
    """Training FLOPs per token: 6N + the attention term 12·L·d·s (forward+backward)."""
    return 6.0 * n_params + 12.0 * layers * d * seq


# --- data --------------------------------------------------------------------------------------

class MarkovData:
    """Tokens from a fixed random transition table: a stream with structure to learn."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.probs = torch.softmax(logits, dim=-1)
        self.vocab = vocab
        self.seed = seed

    def batch(self, key: int, rows: int, seq: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        out = torch.empty(rows, seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (rows,), generator=g)
        for t in range(seq):
            out[:, t + 1] = torch.multinomial(self.probs[out[:, t]], 1, generator=g).squeeze(1)
        return out


# --- parallelism -------------------------------------------------------------------------------

def setup_distributed() -> tuple[torch.device, int, int]:
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        use_cuda = torch.cuda.is_available()
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

def lr_at(step: int, base: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the base rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="metrics config YAML (configs/*.yaml)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dp-shard", type=int, default=None, help="FSDP2 shard degree (default: world / replicate / tp)")
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicate degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--save-every", type=int, default=20, help="'checkpoint' every N steps (progress.txt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="metrics config overrides: key=value")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, rank, world = setup_distributed()
    dp_shard = args.dp_shard or world // (args.dp_replicate * args.tp)
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model, mesh, dp_rank, dp_size = parallelize(model, device, world, args.dp_replicate, dp_shard, args.tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    overrides = [f"total_steps={args.steps}",
                 f"flops_per_token={flops_per_token(n_params, args.layers, args.d_model, args.seq_len)}"]
    overrides += args.overrides
    config = (dm.MetricsConfig.from_yaml(args.config, overrides) if args.config
              else dm.MetricsConfig.from_dict({}, overrides))
    # --- the metrics integration: these lines and the monitor calls in the loop ---
    monitor = dm.Monitor(config, model=model, optimizer=optimizer, device_mesh=mesh)
    timers = monitor.timers

    data = MarkovData(args.vocab, args.seed)
    global_rows = args.micro_batch * dp_size
    last = {}
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args.lr, args.warmup, args.steps)
        loss_sum = torch.zeros((), device=device)
        with timers("forward-backward", log_level=1):
            for micro in range(args.grad_accum):
                rows = data.batch(step * 1000 + micro, global_rows, args.seq_len)
                batch = rows[dp_rank * args.micro_batch:(dp_rank + 1) * args.micro_batch].to(device)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), batch[:, 1:].reshape(-1))
                (loss / args.grad_accum).backward()
                loss_sum += loss.detach()
        grad_norm = monitor.clip_grad_norm_(args.max_grad_norm)
        with timers("optimizer", log_level=1):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tokens = args.micro_batch * args.seq_len * args.grad_accum
        metrics = monitor.step(step, loss=loss_sum / args.grad_accum, tokens=tokens,
                               lr=optimizer.param_groups[0]["lr"])
        if metrics is not None:
            last = metrics
        if step == 1:
            last["first_grad_norm"] = float(grad_norm)
        if args.eval_every and step % args.eval_every == 0:
            monitor.log_eval(step, **evaluate(model, data, args, dp_rank, device))
        if args.save_every and step % args.save_every == 0:
            monitor.checkpoint_saved(step)  # a real trainer saves here; progress.txt records it
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
    return {"loss": total / count, "tokens": count, "time_ms": (time.perf_counter() - start) * 1000}


def exit_after_teardown() -> None:
    """End the process without interpreter finalization (after ``destroy_process_group``).

    A gloo worker thread releases a finished collective's tensors after the caller has moved
    on; releasing a tensor that Python knows takes the GIL, and if the interpreter is already
    finalizing the thread exits mid-destructor and the process aborts ("terminate called
    without an active exception", about 1 run in 25 of this trainer on 2 CPU ranks). Files
    are closed by then (``monitor.close()``); flush the streams and leave."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_after_teardown()
