"""PyTorch's FSDP2 ``clip_grad_norm_`` test, ported to 2 gloo CPU ranks, torch and ours side by side.

Follows pytorch/pytorch ``test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py``
(commit 0f31e612), ``TestClipGradNormWorldSize2.test_clip_grad_norm_1d``: max_norm 1, a reference
model under ``replicate`` (DDP), the same model under ``fully_shard`` per block and at the root,
``model(inp).sum().backward()`` each iteration, norm types 2, 1 and inf (3 added). Upstream needs
2 GPUs and torch's internal test Transformer; here a small CPU model (embedding, blocks, output)
and 3 iterations. Asserted as upstream: FSDP gradients equal the reference's; every gradient's
norm exceeds max_norm before clipping (the test is not vacuous); the returned total equals the
reference's (``full_tensor()`` of the DTensor it returns); after clipping every gradient's norm is
within max_norm and every non-zero gradient changed. Upstream counts torch's functional
all-reduces (one per mesh dimension); ours is counted as one ``all_reduce`` call. The 2-D
(dp × tp, 4 GPUs) case is covered for ours by tests/test_norms.py's FSDP2 + TP layout.
"""

from __future__ import annotations

import copy
import math

import pytest

from tests.dist_utils import CollectiveCounter, quiet_config, run_ranks

WORLD = 2
MAX_NORM = 1.0
NORM_TYPES = (2.0, 1.0, 3.0, math.inf)
ITERS = 3


def _model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self, vocab=32, d=16, n=2):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.out = nn.Linear(d, vocab)

        def forward(self, idx):
            h = self.tok(idx)
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    torch.manual_seed(42)
    return Net()


def _case(rank: int, impl: str, norm_type: float) -> dict:
    import torch
    from torch.distributed._composable import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import distmetrics as dm

    model = _model()
    ref_model = replicate(copy.deepcopy(model))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    monitor = dm.Monitor(quiet_config(), model=model) if impl == "monitor" else None
    norm = lambda g: float(torch.linalg.vector_norm(g, ord=norm_type))  # noqa: E731
    torch.manual_seed(43 + rank)
    inp = torch.randint(0, 32, (3, 16))
    report = {"errors": [], "returned": [], "all_reduces": []}
    for _ in range(ITERS):
        ref_model.zero_grad()
        ref_model(inp).sum().backward()
        model.zero_grad()
        model(inp).sum().backward()
        ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
        local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
        for ref_grad, param in zip(ref_grads, model.parameters()):
            if not torch.allclose(ref_grad, param.grad.full_tensor(), rtol=1e-5, atol=1e-6):
                report["errors"].append("FSDP gradient differs from the reference's")
        if not all(norm(g) > MAX_NORM for g in ref_grads):
            report["errors"].append("vacuous: a reference gradient is within max_norm already")
        ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=MAX_NORM, norm_type=norm_type)
        clip = {"torch": torch.nn.utils.clip_grad_norm_, "distmetrics": dm.clip_grad_norm_}.get(impl)
        with CollectiveCounter() as counter:
            if clip is not None:
                total = clip(model.parameters(), max_norm=MAX_NORM, norm_type=norm_type, foreach=True)
            else:
                total = monitor.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM, norm_type=norm_type)
        report["all_reduces"].append(counter.collectives)
        value = total.full_tensor() if isinstance(total, DTensor) else total
        report["returned"].append((type(total).__name__, str(total.dtype), float(value), float(ref_total)))
        if not math.isclose(float(value), float(ref_total), rel_tol=1e-5):
            report["errors"].append(f"total {float(value)} != reference {float(ref_total)}")
        for param in ref_model.parameters():
            if not norm(param.grad) <= MAX_NORM * (1 + 1e-5):
                report["errors"].append("a reference gradient is above max_norm after clipping")
        for param, before in zip(model.parameters(), local_grads):
            if not norm(param.grad.to_local()) <= MAX_NORM * (1 + 1e-5):
                report["errors"].append("an FSDP gradient is above max_norm after clipping")
            if torch.count_nonzero(before) and torch.equal(param.grad.to_local(), before):
                report["errors"].append("a non-zero FSDP gradient was not scaled")
    if monitor is not None:
        monitor.close()
    return report


def _all_cases(rank: int, world: int) -> dict:
    return {(impl, p): _case(rank, impl, p) for impl in ("torch", "distmetrics", "monitor") for p in NORM_TYPES}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, WORLD, timeout=300)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("impl", ["torch", "distmetrics", "monitor"])
def test_clip_grad_norm_1d(results, impl, norm_type):
    for rank in range(WORLD):
        report = results[rank][(impl, norm_type)]
        assert report["errors"] == [], (rank, report["errors"])
        assert len(report["returned"]) == ITERS


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_ours_returns_what_torch_returns_after_one_all_reduce(results, norm_type):
    """A DTensor of the gradients' dtype, as torch's own call on the FSDP2 model returns; one
    all-reduce a call, and one more at the first call with a norm type (every rank passes it)."""
    for rank in range(WORLD):
        theirs = [r[:2] for r in results[rank][("torch", norm_type)]["returned"]]
        for impl in ("distmetrics", "monitor"):
            report = results[rank][(impl, norm_type)]
            assert [r[:2] for r in report["returned"]] == theirs == [("DTensor", "torch.float32")] * ITERS
            assert report["all_reduces"] == [2] + [1] * (ITERS - 1)
