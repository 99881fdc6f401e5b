"""Edge cases of the gradient norm and clip, on real gloo ranks where ranks matter: a rank
without gradients, the routing cache, clipping precision against torch's own
``clip_grad_norm_``. Truth: torch's ``clip_grad_norm_`` or float64 on the full tensors."""

from __future__ import annotations

import math

import pytest

from tests.dist_utils import run_ranks

NORM_TYPES = (2.0, 1.5, math.inf, -math.inf, 0.0)


def _one_rank_without_gradients(rank: int, world: int) -> dict:
    """Rank 0 holds the gradients (plain tensors: data-parallel replicas, counted on rank 0);
    the other ranks' parameters have none. Every rank returns the global total."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import distmetrics as dm

    torch.manual_seed(0)
    grads = [torch.randn(5, 3) + 0.5, torch.randn(4) - 2.0]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    if rank == 0:
        for p, g in zip(params, grads):
            p.grad = g.clone()
    out = {"returned": {}, "truth": {}}
    for p in NORM_TYPES:
        out["returned"][p] = float(dm.clip_grad_norm_(params, 1e9, norm_type=p))
        copies = [torch.nn.Parameter(g.to(torch.float64)) for g in grads]
        for c, g in zip(copies, grads):
            c.grad = g.to(torch.float64)
        out["truth"][p] = float(torch.nn.utils.clip_grad_norm_(copies, 1e9, norm_type=p))
    # p = 0 over a tensor sharded over the ranks: every rank raises, the one without gradients too
    mesh = init_device_mesh("cpu", (world,))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False))
    if rank == 0:
        sharded.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=False)
    try:
        dm.clip_grad_norm_([sharded], 1.0, norm_type=0)
        out["sharded_p0"] = "no error"
    except ValueError as err:
        out["sharded_p0"] = str(err)
    return out


@pytest.fixture(scope="module")
def without_gradients():
    return run_ranks(_one_rank_without_gradients, 2)


@pytest.mark.parametrize("p", NORM_TYPES)
def test_a_rank_without_gradients_returns_the_global_total(without_gradients, p):
    truth = without_gradients[0]["truth"][p]
    assert truth > 0
    for rank_result in without_gradients:
        assert rank_result["returned"][p] == pytest.approx(truth, rel=1e-6)


def test_a_rank_without_gradients_raises_with_the_others_for_p0_over_shards(without_gradients):
    for rank_result in without_gradients:
        assert "norm_type=0" in rank_result["sharded_p0"] and "sharded" in rank_result["sharded_p0"]
