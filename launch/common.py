"""What the example trainers share: a small GPT, a learnable synthetic token stream, the
learning-rate schedule, the metrics config from ``--config`` plus ``key=value`` overrides, and
the clean exit. Tests and benchmarks import it as ``launch.common``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import warnings
from typing import Optional

import torch
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


# --- schedule, config, exit -----------------------------------------------------------------

def lr_at(step: int, base: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the base rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def metrics_config(path: Optional[str], overrides: list[str]) -> "dm.MetricsConfig":
    """The metrics config: the YAML file at ``path`` (if any), then ``key=value`` overrides."""
    return dm.MetricsConfig.from_yaml(path, overrides) if path else dm.MetricsConfig.from_dict({}, overrides)


KNOWN_MEGATRON_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # CPU: torch's optimizers and kernels stand in
    "Apex is not installed",  # CPU: torch's norm stands in
    "full scope is deprecated",  # megatron-core's own default cuda_graph_scope
    "When using async grad allreduce it is recommended",  # CUDA_DEVICE_MAX_CONNECTIONS (GPU streams)
)
"""megatron-core's warnings that the example trainer knows and that say nothing about the run."""


def quiet_megatron_warnings() -> None:
    """Hide :data:`KNOWN_MEGATRON_WARNINGS` raised from megatron-core's modules (one per rank and
    import, ~30 lines around 2 lines of metrics). Other warnings, distmetrics' own included, stay."""
    for message in KNOWN_MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning, module=r".*megatron")


class TrainerArgs(argparse.ArgumentParser):
    """The trainers' argument parser: a refused argument is one line (``run_trainer`` prefixes
    the rank), not argparse's usage block from every rank interleaved."""

    def error(self, message: str):
        raise SystemExit(f"{message} (see --help)")


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 1")
    return value


def non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (for options where 0 means off)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 0 (0: off)")
    return value


def gpus_for_ranks() -> bool:
    """Does each of this node's ranks get a GPU of its own? False without CUDA. Fewer GPUs than
    ranks on the node (``LOCAL_WORLD_SIZE``, torchrun's) stop the trainer here, naming both counts:
    NCCL cannot put two ranks on one GPU, and a rank set to a GPU that is not there fails with
    "invalid device ordinal". ``launch/torchrun.sh`` runs such a job on the CPU instead."""
    ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if torch.cuda.is_available() and gpus < ranks:
        raise SystemExit(f"{ranks} ranks on this node but {gpus} GPU{'s' if gpus != 1 else ''}: give each rank a "
                         f"GPU (--nproc-per-node {gpus}), or run on the CPU with CUDA_VISIBLE_DEVICES= set empty")
    return torch.cuda.is_available()


def check_divides(what: str, total: int, parts: int, parts_what: str) -> None:
    """Refuse a layout whose ``parts`` do not divide ``total`` (one line, before any collective)."""
    if total % parts:
        raise SystemExit(f"{what} {total} is not divisible by {parts_what} {parts}")


def run_trainer(main) -> None:
    """``main()``, then :func:`exit_after_teardown`. A config error (``dm.ConfigError``) or the
    trainer's own refusal of its arguments is one line per rank that raised it (``error: ...``,
    with ``[rank N]`` under a launcher: a rank's own problem shows too), exit status 2, as the
    ``distmetrics`` command says it, not a traceback per rank. SIGTERM (how torchrun stops the
    other ranks when one fails, and how Slurm's scancel and time limit stop a job) ends the
    trainer as an exit (status 143), so the open Monitor's exit warning names the steps since
    the last log step that are not written; Python's default ends the process without a word."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        main()
    except (dm.ConfigError, SystemExit) as err:
        message = str(err) if isinstance(err, dm.ConfigError) else err.code
        if not isinstance(message, str):
            raise
        rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else None
        print(f"{f'[rank {rank}] ' if rank is not None else ''}error: {message}", file=sys.stderr)
        _leave(2)
    exit_after_teardown()


def _exit_on_sigterm(signum: int, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    sys.exit(128 + signum)


def exit_after_teardown() -> None:
    """End the process without interpreter finalization (after ``destroy_process_group``).

    A gloo worker thread releases a finished collective's tensors after the caller has moved
    on; releasing a tensor that Python knows takes the GIL, and if the interpreter is already
    finalizing the thread exits mid-destructor and the process aborts ("terminate called
    without an active exception", about 1 run in 25 of this trainer on 2 CPU ranks). Files
    are closed by then (``monitor.close()``); flush the streams and leave."""
    _leave(0)


def _leave(status: int) -> None:
    """Flush both streams, then end the process at once (no interpreter finalization)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
