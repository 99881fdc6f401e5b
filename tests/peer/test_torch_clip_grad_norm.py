"""PyTorch's own ``clip_grad_norm_`` tests, ported, run against torch and ours side by side.

Follows pytorch/pytorch ``test/test_nn.py`` (commit 74f2fa66), class ``TestNNDeviceType``:
``test_clip_grad_norm`` (norm_type in 0.5, 1.5, 2, 4, 'inf' × foreach False/True),
``test_clip_grad_norm_error_if_nonfinite`` and ``test_clip_grad_norm_multi_device`` (2 GPUs:
skipped on machines without them). Single process, CPU. ``clip`` is torch's
``torch.nn.utils.clip_grad_norm_`` (the reference: every test passes there), our module-level
``distmetrics.clip_grad_norm_``, or ``Monitor.clip_grad_norm_`` of a Monitor built on a module
that holds the parameters. Upstream's ``assertEqual`` checks dtypes: so does this port.
The last tests pin behaviour of torch's ``clip_grad.py`` that has no upstream test.
"""

from __future__ import annotations

import math
import warnings
from itertools import product

import pytest
import torch
from torch import inf, nan, nn

from tests.dist_utils import quiet_config


def _monitor_clip(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    import distmetrics as dm

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    holder = nn.Module()
    for i, p in enumerate(params):
        if isinstance(p, nn.Parameter):
            holder.register_parameter(f"p{i}", p)
    monitor = dm.Monitor(quiet_config(log_interval=1), model=holder)
    try:
        # the list we read (a generator is used up by then), or what was given: a tensor, or an
        # exhausted generator (which must warn)
        argument = params if params and not isinstance(parameters, torch.Tensor) else parameters
        return monitor.clip_grad_norm_(argument, max_norm, norm_type=norm_type,
                                       error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    finally:
        monitor.close()


@pytest.fixture(params=["torch", "distmetrics", "monitor"])
def clip(request):
    import distmetrics as dm

    return {"torch": torch.nn.utils.clip_grad_norm_, "distmetrics": dm.clip_grad_norm_,
            "monitor": _monitor_clip}[request.param]


@pytest.mark.parametrize("foreach", (False, True))
@pytest.mark.parametrize("norm_type", (0.5, 1.5, 2, 4, "inf"))
def test_clip_grad_norm(clip, norm_type, foreach):
    layer = nn.Linear(10, 10)
    max_norm = 2

    def compute_norm(norm_type):
        norm_type = float(norm_type)
        if norm_type != inf:
            total = 0
            for p in layer.parameters():
                total += p.grad.data.abs().pow(norm_type).sum()
            return pow(total, 1.0 / norm_type)
        return max(p.grad.data.abs().max() for p in layer.parameters())

    def compare_scaling(grads):
        scale = torch.cat([p.grad.data.div(g).view(-1) for p, g in zip(layer.parameters(), grads)])
        torch.testing.assert_close(scale.std(), torch.tensor(0.0), atol=1e-5, rtol=0)
        return scale[0]

    grads = torch.arange(1.0, 101).view(10, 10), torch.ones(10).div(1000)
    for p, g in zip(layer.parameters(), grads):
        p._grad = g.clone().view_as(p.data)
    norm_before = compute_norm(norm_type)
    norm = clip(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)  # dtype included, as upstream's assertEqual
    torch.testing.assert_close(norm_after, torch.tensor(float(max_norm)))
    assert norm_after <= norm_before
    compare_scaling(grads)

    # small gradients are left unchanged
    grads = torch.rand(10, 10).div(10000), torch.ones(10).div(500)
    for p, g in zip(layer.parameters(), grads):
        p.grad.data.copy_(g)
    norm_before = compute_norm(norm_type)
    norm = clip(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    torch.testing.assert_close(norm, norm_before)
    torch.testing.assert_close(norm_before, norm_after)
    assert norm_after <= max_norm
    torch.testing.assert_close(compare_scaling(grads), torch.tensor(1.0))

    # a single Tensor is accepted
    p1, p2 = torch.randn(10, 10), torch.randn(10, 10)
    g = torch.arange(1.0, 101).view(10, 10)
    p1._grad, p2._grad = g.clone(), g.clone()
    clip(p1, max_norm, norm_type=norm_type, foreach=foreach)
    clip([p2], max_norm, norm_type=norm_type, foreach=foreach)
    torch.testing.assert_close(p1.grad, p2.grad)

    # an exhausted generator warns
    params = layer.parameters()
    for _ in params:
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clip(params, max_norm, norm_type=norm_type, foreach=foreach)
    assert [str(w.message) for w in caught] == ["`parameters` is an empty generator, no gradient clipping will occur."]


def test_clip_grad_norm_error_if_nonfinite(clip):
    norms_pos = [0.1, 1, 2, 3.5, inf]
    norms_neg = [-0.1, -1, -2, -3.5]
    norms_except_0 = norms_pos + norms_neg
    norms_all = norms_except_0 + [0]
    # (grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite)
    cases = [
        (False, False, [inf, -inf], norms_except_0, [0]),
        (False, True, [inf, -inf], norms_pos, norms_neg + [0]),
        (True, False, [inf, -inf], norms_pos, norms_neg + [0]),
        (True, True, [inf, -inf], norms_pos, norms_neg + [0]),
        (False, False, [nan], norms_except_0, [0]),
        (False, True, [nan], norms_except_0, [0]),
        (True, False, [nan], norms_except_0, [0]),
        (True, True, [nan], norms_except_0, [0]),
        (False, False, [2e22, -2e22], [], norms_all),
        (False, True, [2e22, -2e22], [], norms_all),
        (True, False, [2e22, -2e22], [], norms_all),
        (True, True, [2e22, -2e22], [], norms_all),
        (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [inf, 1, 0.1, 0, -1, -0.1]),
        (False, True, [2e200, -2e200], [3.5, 2], norms_neg + [inf, 1, 0.1, 0]),
        (True, False, [2e200, -2e200], [3.5, 2], norms_neg + [inf, 1, 0.1, 0]),
        (True, True, [2e200, -2e200], [3.5, 2], norms_neg + [inf, 1, 0.1, 0]),
    ]

    def parameters(scalar, one_elem, prefix):
        param = torch.ones(10, dtype=torch.float64, requires_grad=True)
        (param[1] if one_elem else param).mul(scalar).sum().backward()
        if prefix:
            first = torch.ones(1, dtype=torch.float64, requires_grad=True)
            first.mul(1).sum().backward()
            return [first, param]
        return [param]

    def run(norm_type, error_if_nonfinite, scalar, one_elem, prefix, nonfinite):
        params = parameters(scalar, one_elem, prefix)
        if nonfinite and error_if_nonfinite:
            before = [p.grad.clone() for p in params]
            with pytest.raises(RuntimeError, match=f"The total norm of order {float(norm_type)} for gradients"):
                clip(params, 1, norm_type=norm_type, error_if_nonfinite=True)
            for b, p in zip(before, params):
                torch.testing.assert_close(b, p.grad, equal_nan=True)  # nothing was scaled
        else:
            clip(params, 1, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    for one_elem, prefix, scalars, nonfinite_norms, finite_norms in cases:
        for error_if_nonfinite in (False, True):
            for norm_type, scalar in product(nonfinite_norms, scalars):
                run(norm_type, error_if_nonfinite, scalar, one_elem, prefix, True)
            for norm_type, scalar in product(finite_norms, scalars):
                run(norm_type, error_if_nonfinite, scalar, one_elem, prefix, False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="upstream is @onlyCUDA @deviceCountAtLeast(2)")
@pytest.mark.parametrize("foreach", (False, True))
def test_clip_grad_norm_multi_device(clip, foreach):
    class TestModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1, self.layer2 = nn.Linear(10, 10), nn.Linear(10, 10)

    test_model, ref_model = TestModel(), TestModel().to("cuda:0")
    test_model.layer1.to("cuda:0")
    test_model.layer2.to("cuda:1")
    for norm_type in (2.0, math.inf):
        for p in list(test_model.parameters()) + list(ref_model.parameters()):
            p.grad = torch.ones_like(p)
        norm = clip(test_model.parameters(), 0.5, norm_type=norm_type, foreach=foreach)
        expected = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, norm_type=norm_type, foreach=foreach)
        torch.testing.assert_close(norm, expected)
        for p, pe in zip(test_model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad.to("cuda:0"), pe.grad)


# --- torch's clip_grad.py, no upstream test ------------------------------------------------------

def test_no_gradients_give_a_float32_zero(clip):
    out = clip([nn.Parameter(torch.ones(3))], 1.0)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and float(out) == 0.0


def test_the_norm_comes_back_in_the_gradients_dtype(clip):
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        p = nn.Parameter(torch.ones(4, dtype=dtype))
        p.grad = torch.full((4,), 3.0, dtype=dtype)
        assert clip([p], 1.0).dtype == dtype


def test_max_norm_zero_zeroes_and_negative_flips_the_gradients(clip):
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip([p], 0.0)
    assert torch.equal(p.grad, torch.zeros(4))
    p.grad = torch.full((4,), 3.0)
    clip([p], -1.0)
    assert (p.grad < 0).all()


def test_max_norm_inf_with_a_nan_total_scales_by_nan(clip):
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("nan")])
    clip([p], math.inf)
    assert torch.isnan(p.grad).all()


def test_a_frozen_parameter_with_a_gradient_is_clipped_too(clip):
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    a.grad, b.grad = torch.full((4,), 3.0), torch.full((4,), 4.0)
    b.requires_grad_(False)
    torch.testing.assert_close(clip([a, b], 1.0), torch.tensor(10.0))
    torch.testing.assert_close(b.grad, torch.full((4,), 4.0 / (10.0 + 1e-6)))


def test_gradients_that_require_grad_are_clipped_without_autograd(clip):
    p = nn.Parameter(torch.ones(3))
    p.pow(2).sum().backward(create_graph=True)  # p.grad requires grad
    clip([p], 1.0)  # in place on a tensor that requires grad: only under no_grad
    torch.testing.assert_close(p.grad.detach(), torch.full((3,), 2.0 / (12 ** 0.5 + 1e-6)))


def test_bf16_gradients_are_scaled_by_a_coefficient_in_bf16_as_torch_does(clip):
    """torch computes the coefficient from the total it returns, in the gradients' dtype: torch's
    own scaling (``clip_grads_with_norm_``) given the returned total is the truth, bit for bit."""
    for seed in range(5):
        torch.manual_seed(seed)
        grads = [(torch.randn(64, 64) * 0.3).bfloat16(), (torch.randn(64) * 2).bfloat16(), torch.randn(8, 64).bfloat16()]
        ours = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        truth = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for a, b, g in zip(ours, truth, grads):
            a.grad, b.grad = g.clone(), g.clone()
        total = clip(ours, 1.0)
        assert total.dtype == torch.bfloat16
        torch.nn.utils.clip_grads_with_norm_(truth, 1.0, total)
        for a, b in zip(ours, truth):
            assert torch.equal(a.grad, b.grad)
