"""Edge cases of the gradient norm and clip, on real gloo ranks where ranks matter: a rank
without gradients, the routing cache, clipping precision against torch's own
``clip_grad_norm_``. Truth: torch's ``clip_grad_norm_`` or float64 on the full tensors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.dist_utils import run_python, run_ranks

NORM_TYPES = (2.0, 1.5, math.inf, -math.inf, 0.0)
SHARDED_NORM_TYPES = (2.0, 1.5, math.inf, -math.inf, -1.0)  # 0 is refused over shards


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
    # FSDP2 shards of fewer rows than ranks: rank 1 holds empty pieces (3 rows: 2 + 1; 1 row: 1 + 0),
    # which torch has no ∞, -∞ or p < 0 norm of: that rank raised, the other waited in the all-reduce
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 1))
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 8)).pow(2).sum().backward()
    whole = torch.cat([q.grad.full_tensor().reshape(-1).double() for q in model.parameters()])
    out["empty"] = {"pieces": [q.grad.to_local().numel() for q in model.parameters()], "returned": {}, "truth": {}}
    out["empty"]["nonfinite"] = {}
    for p in SHARDED_NORM_TYPES:
        out["empty"]["returned"][p] = float(dm.clip_grad_norm_(model.parameters(), 1e9, norm_type=p).full_tensor())
        out["empty"]["truth"][p] = float(torch.linalg.vector_norm(whole, p))
        with dm.Monitor(dm.MetricsConfig(log_interval=1, json_log=False, console=False, tensorboard=False,
                                         log_progress=False, timing_log_level=-1), model=model) as monitor:
            monitor.clip_grad_norm_(1e9, norm_type=p)
            out["empty"]["nonfinite"][p] = monitor.step(1)["grad_nonfinite"]  # an empty piece is no NaN or inf
    # ranks passing different norm types: 2 against inf reduced a SUM against a MAX (every rank waited
    # without a word); 3 against 4 gave each rank another total
    out["differing"] = {}
    for case, mine in (("function, 3 against 4", 3.0 + rank), ("Monitor, 2 against inf", (2.0, math.inf)[rank])):
        try:
            if case.startswith("function"):
                dm.clip_grad_norm_(model.parameters(), 1e9, norm_type=mine)
            else:
                with dm.Monitor(dm.MetricsConfig(log_interval=1, json_log=False, console=False, tensorboard=False,
                                                 log_progress=False, timing_log_level=-1, hang_timeout_s=60),
                                model=model) as monitor:
                    monitor.clip_grad_norm_(1e9, norm_type=mine)
            out["differing"][case] = "no error"
        except ValueError as err:
            out["differing"][case] = str(err)
    # ranks passing different max_norm: each scaled its gradients by its own coefficient, and weights
    # replicated across ranks drifted apart without a word; refused at the first clip, gradients untouched
    out["max_norm"] = {}
    before = [q.grad.to_local().clone() for q in model.parameters()]
    for case in ("function", "Monitor, after a measurement"):
        try:
            if case == "function":  # a norm type this process group's clips have not used yet
                dm.clip_grad_norm_(model.parameters(), 1e-3 * (1 + rank), norm_type=3.0)
            else:
                with dm.Monitor(dm.MetricsConfig(log_interval=1, json_log=False, console=False, tensorboard=False,
                                                 log_progress=False, timing_log_level=-1, hang_timeout_s=60),
                                model=model) as monitor:
                    monitor.measure_grad_norms()  # the norm type agreed without a max_norm
                    monitor.clip_grad_norm_(1e-3 * (1 + rank))
            out["max_norm"][case] = "no error"
        except ValueError as err:
            out["max_norm"][case] = str(err)
    out["max_norm"]["untouched"] = all(torch.equal(q.grad.to_local(), b) for q, b in zip(model.parameters(), before))
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


@pytest.mark.parametrize("p", SHARDED_NORM_TYPES)
def test_empty_fsdp2_pieces_count_for_nothing_whatever_the_norm(without_gradients, p):
    """A 1-element bias and a 1-row weight sharded over 2 ranks: rank 1's pieces are empty."""
    assert 0 in without_gradients[1]["empty"]["pieces"]
    for rank_result in without_gradients:
        assert rank_result["empty"]["returned"][p] == pytest.approx(rank_result["empty"]["truth"][p], rel=1e-6)
        assert rank_result["empty"]["nonfinite"][p] == 0


def test_a_rank_without_gradients_raises_with_the_others_for_p0_over_shards(without_gradients):
    for rank_result in without_gradients:
        assert "norm_type=0" in rank_result["sharded_p0"] and "sharded" in rank_result["sharded_p0"]


def test_ranks_passing_different_norm_types_raise_together_naming_them(without_gradients):
    expected = {"function, 3 against 4": ("3", "4"), "Monitor, 2 against inf": ("2", "inf")}
    for rank, rank_result in enumerate(without_gradients):
        for case, (low, high) in expected.items():
            message = rank_result["differing"][case]
            assert f"the ranks passed norm types from {low} to {high}" in message, (rank, case, message)


def test_ranks_passing_different_max_norms_raise_together_before_any_gradient_is_scaled(without_gradients):
    for rank, rank_result in enumerate(without_gradients):
        said = rank_result["max_norm"]
        for case, p in (("function", 3), ("Monitor, after a measurement", 2)):
            assert f"the ranks passed max_norm from 0.001 to 0.002 at their first clip with norm_type={p}" in \
                said[case], (rank, case, said[case])
        assert said["untouched"], rank


class _HostToDevice:
    """Records every copy from the host to the device while active. The ``meta`` device stands in
    for an accelerator (it has no data: every op runs on shapes only), so a copy is an op with a
    CPU tensor in and a meta tensor out, seen by a ``TorchDispatchMode``; ``torch.tensor(data,
    device=...)`` copies below the dispatcher, so ``torch.tensor`` is wrapped to see those too."""

    def __enter__(self):
        import torch
        from torch.utils._pytree import tree_leaves
        from torch.utils._python_dispatch import TorchDispatchMode

        self.copies = []
        copies = self.copies

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = [t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                outputs = [t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                if "cpu" in inputs and "meta" in outputs:
                    copies.append(str(func))
                return out

        self._tensor = torch.tensor

        def tensor(*args, __make=self._tensor, **kwargs):
            if "device" in kwargs and torch.device(kwargs["device"]).type != "cpu":
                copies.append("torch.tensor(..., device=%s)" % kwargs["device"])
            return __make(*args, **kwargs)

        torch.tensor = tensor
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        self._mode.__exit__(*exc)
        torch.tensor = self._tensor


def test_steady_state_clip_and_log_steps_copy_nothing_from_host_to_device():
    """Clipping and the log step's norms build their index tensors on the device once; later
    steps only launch kernels (an H2D copy from pageable memory would make the host wait for the
    whole backward). Two dtypes, so the per-tensor norms come from two groups."""
    import torch

    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.norms import NormCollector
    from distmetrics.parallel import detect_layout

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16),
                                torch.nn.Linear(8, 4)).to("meta")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    collector = NormCollector(model, detect_layout(), log_params_norm=True)
    for step in range(3):
        with _HostToDevice() as watch:
            collector.clip(None, 1.0)
            samples = collector.take_samples(LogContext(step=step + 1, steps=1, layout=None))
        assert {s.name for s in samples} >= {"grad_norm", "param_norm"}
        if step:
            assert watch.copies == [], watch.copies


def test_the_routing_of_ever_new_gradient_sets_is_capped_and_stays_exact():
    """A parameter without a gradient on some steps (an expert no token reached) makes a new
    gradient set; a plan keeps the routing of the few most recent sets, not one per set seen."""
    import torch

    from distmetrics.grad_norm import GradientNorms

    torch.manual_seed(5)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    norms = GradientNorms(model)
    params = list(model.parameters())
    for step in range(len(params)):
        for i, p in enumerate(params):
            p.grad = None if i == step else torch.randn_like(p)
        total, _ = norms.measure()
        truth = math.sqrt(sum(float(p.grad.to(torch.float64).pow(2).sum()) for p in params if p.grad is not None))
        assert float(total) == pytest.approx(truth, rel=1e-6)
    assert len(norms.plans.model_plan().routing) <= 8


def test_inf_norms_print_no_warning():
    """torch warns once per process that ``index_reduce`` is in beta; the ±inf norms' per-module
    maxima and minima must not print it into the user's log (a fresh process, so "once" is now)."""
    script = ("import torch\nfrom distmetrics.grad_norm import GradientNorms\n"
              "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
              "for p in m.parameters(): p.grad = torch.randn_like(p)\n"
              "g = GradientNorms(m)\n"
              "g.clip(None, 1.0, float('inf')); g.clip(None, 1.0, float('-inf'))\n")
    done = run_python("-c", script, env={"PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr


def test_torchs_call_shape_follows_a_frozen_parameter_that_gains_a_gradient():
    """``clip_grad_norm_(model.parameters(), ...)`` uses the model's plan while the given list
    holds the same gradients; a frozen parameter with a ``.grad`` counts, as torch counts it."""
    import torch

    from distmetrics.grad_norm import GradientNorms

    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    norms = GradientNorms(model)
    for step in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p) if p.requires_grad or step in (1, 3) else None
        truth = [torch.nn.Parameter(p.detach().double()) for p in model.parameters()]
        for t, p in zip(truth, model.parameters()):
            t.grad = None if p.grad is None else p.grad.double()
        total, measured = norms.measure(model.parameters())
        assert float(total) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(truth, 1e9)), rel=1e-6)
        assert (measured.plan is norms.plans.model_plan()) == (step in (0, 2))



def test_the_short_form_leaves_out_a_frozen_parameters_gradient_which_the_model_parameters_count():
    """A GAN's critic frozen (``requires_grad_(False)``) for the generator's step keeps its last
    gradients: the short form ``clip_grad_norm_(max_norm)`` takes the model's trainable parameters,
    the generator's, and leaves the critic's gradients as they are; given ``model.parameters()`` it
    counts them, as torch's clip of those does (the README's rule)."""
    import copy

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    torch.manual_seed(0)
    gan = torch.nn.ModuleDict({"G": torch.nn.Linear(3, 3), "D": torch.nn.Linear(3, 1)})
    copies = [copy.deepcopy(gan) for _ in range(3)]  # ours (short form), ours (given), torch's
    x = torch.randn(4, 3)
    for model in copies:
        model["D"](model["G"](x)).sum().backward()
        model["D"].requires_grad_(False)  # the generator's step: the critic's gradients stay
    short, given, theirs = copies
    monitors = [dm.Monitor(quiet_config(log_interval=1), model=m) for m in (short, given)]
    critic = [p.grad.clone() for p in short["D"].parameters()]
    generator = torch.nn.utils.get_total_norm([p.grad for p in short["G"].parameters()])
    torch.testing.assert_close(monitors[0].clip_grad_norm_(0.5), generator)
    for p, before in zip(short["D"].parameters(), critic):
        torch.testing.assert_close(p.grad, before)  # not scaled
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    torch.testing.assert_close(monitors[1].clip_grad_norm_(given.parameters(), 0.5), expected)
    for a, b in zip(given.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    for monitor in monitors:
        monitor.close()


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 0.0])
def test_sparse_gradients_clip_as_torch_clips_their_dense_twins(p):
    """``nn.Embedding(sparse=True)``: torch's clip raises NotImplementedError on a sparse gradient
    (naming no parameter), and so did ours; measure_grad_norms gave no grad_norm at all. A sparse
    gradient is measured by its coalesced values (an index seen twice summed first) and scaled as it
    is: the norm and the clipped gradients are torch's clip's on the same model with a dense embedding."""
    import copy

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    class Net(torch.nn.Module):
        def __init__(self, sparse):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 4, sparse=sparse)
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.emb(x)).pow(2).sum()

    torch.manual_seed(0)
    ours = Net(sparse=True)
    theirs = Net(sparse=False)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    for model in (ours, theirs):
        model(torch.tensor([1, 3, 3, 7])).backward()  # index 3 twice: an uncoalesced sparse gradient
    assert ours.emb.weight.grad.is_sparse and not ours.emb.weight.grad.is_coalesced()
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type=p)
    monitor = dm.Monitor(quiet_config(log_interval=1), model=ours)
    total = monitor.clip_grad_norm_(0.5, norm_type=p)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad.to_dense(), b.grad)
    assert monitor.step(1)["grad_norm"] == pytest.approx(float(expected), rel=1e-6)
    monitor.close()

@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 3.0, 0.5, -1.0])
def test_complex_gradients_clip_as_torch_clips_them(p):
    """A complex parameter made the clip raise "clamp is not supported for complex types": the total
    was cast to the gradients' complex dtype, where torch returns a real one. For p other than 1, 2
    and ±inf the norm is accumulated wider, which for a complex tensor was asked in float64: torch
    refuses a real dtype for complex input (complex128 now)."""
    import warnings

    import distmetrics as dm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that complex modules are new
        ours = torch.nn.Linear(3, 2).to(torch.complex64)
    theirs = copy.deepcopy(ours)
    x = torch.randn(4, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    for model in (ours, theirs):
        model(x).abs().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type=p)
    total = dm.clip_grad_norm_(ours.parameters(), 0.5, norm_type=p)
    assert total.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def _clips_at_the_edges(rank: int, world: int) -> dict:
    """Replicas on every rank (plain tensors under a process group), gradients set by hand."""
    import math

    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    out: dict = {}
    # fp16 gradients whose total (69282) passes fp16's 65504 though each tensor's norm (40000) does not
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)) for _ in range(3)]
    for q in params:
        q.grad = torch.full((4,), 20000.0, dtype=torch.float16)
    returned = dm.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    out["fp16"] = {"returned": float(returned), "clipped": [q.grad.double().tolist() for q in params]}
    # a clip that zeroes (max_norm 0) or flips (max_norm -1) the gradients, with update norms on
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(log_interval=1, log_update_norm=True), model=model, optimizer=optimizer)
    for step, max_norm in ((1, 0.0), (2, -1.0)):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        grads = [q.grad.detach().double().clone() for q in model.parameters()]
        before = [q.detach().double().clone() for q in model.parameters()]
        monitor.clip_grad_norm_(max_norm)
        optimizer.step()
        metrics = monitor.step(step) or {}
        after = [q.detach().double() for q in model.parameters()]
        total = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        update = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(after, before)))
        floats = {k: v for k, v in metrics.items() if isinstance(v, float)}
        out[f"max_norm {max_norm:g}"] = {"metrics": floats, "total": total, "update": update}
    # norm types below 0: an inf gradient is non-finite there too, and a module whose every element is inf
    for step, p in ((3, -1.0), (4, -2.0)):  # one family of norm types per Monitor: the sum's
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        for q in model[1].parameters():  # module 1 all inf: its sum of p-th powers is 0
            q.grad.fill_(math.inf)
        monitor.clip_grad_norm_(1e9, norm_type=p)
        metrics = monitor.step(step) or {}
        out[f"p {p:g}"] = {k: metrics.get(k) for k in ("grad_nonfinite", "grad_norm/1", "grad_norm")}
    try:
        monitor.clip_grad_norm_(float("nan"))
        out["nan"] = "no error"
    except ValueError as err:
        out["nan"] = str(err)
    monitor.close()
    out["one replica"] = _one_replica_nonfinite(rank)
    return out


def _one_replica_nonfinite(rank: int) -> dict:
    """Replicas whose copy on rank 1 alone holds a NaN or an inf, clipped with ``error_if_nonfinite`` at
    norm types 0 and below: whether ours raised and left the gradients as they were, and torch's clip
    of this rank's own copies (its total, whether it raised)."""
    import math

    import torch

    import distmetrics as dm

    out = {}
    for p in (-math.inf, -1.0, -0.5, 0.0):
        for bad in (math.nan, math.inf):
            grads = [torch.tensor([0.5, -2.0, 3.0]), torch.tensor([[0.25, 4.0], [-1.5, 0.75]])]
            if rank == 1:
                grads[0][2] = bad
            ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for q, r, g in zip(ours, theirs, grads):
                q.grad, r.grad = g.clone(), g.clone()
            said = {}
            try:
                said["ours"] = float(dm.clip_grad_norm_(ours, 1.0, norm_type=p, error_if_nonfinite=True))
            except RuntimeError as err:
                said["ours"] = str(err)
            said["unchanged"] = all(torch.allclose(q.grad, g, rtol=0, atol=0, equal_nan=True)
                                    for q, g in zip(ours, grads))
            said["torch total"] = float(torch.nn.utils.get_total_norm([r.grad for r in theirs], p))
            try:
                torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=p, error_if_nonfinite=True)
                said["torch raised"] = False
            except RuntimeError:
                said["torch raised"] = True
            out[(p, str(bad))] = said
    return out


@pytest.fixture(scope="module")
def edges():
    return run_ranks(_clips_at_the_edges, 2)


def test_clips_at_the_edges_of_the_gradients_dtype_and_of_max_norm(edges):
    """fp16 gradients of total 69282 (each tensor's norm 40000, within fp16) returned an inf total
    and were all zeroed by a coefficient of 1/inf, with error_if_nonfinite=True not raising, while
    the record said 69282, unclipped; they are now clipped by the finite total. A clip at
    max_norm 0 made the log step raise ZeroDivisionError (effective_lr_ratio over a zero
    gradient), and at max_norm -1 the ratio was negative. Under norm_type -1 an inf gradient was
    (and -2) no grad_nonfinite, and a module all inf raised ZeroDivisionError (0 ** -1). max_norm NaN
    made every gradient NaN without a word. Truth: float64 by hand."""
    for out in edges:
        total = math.sqrt(12 * 20000.0 ** 2)
        assert out["fp16"]["returned"] == math.inf  # fp16 cannot hold the total: torch's dtype kept
        for grad in out["fp16"]["clipped"]:
            assert grad == pytest.approx([20000.0 / total] * 4, rel=2e-3)  # clipped to norm 1, not zeroed
        zeroed, flipped = out["max_norm 0"], out["max_norm -1"]
        assert zeroed["update"] == 0.0 and "effective_lr_ratio" not in zeroed["metrics"]
        assert zeroed["metrics"]["grad_norm"] == pytest.approx(zeroed["total"], rel=1e-6)
        coef = 1.0 / (flipped["total"] + 1e-6)  # |coefficient| of max_norm -1
        assert flipped["metrics"]["effective_lr_ratio"] == pytest.approx(
            flipped["update"] / (flipped["total"] * coef), rel=1e-5) and flipped["metrics"]["effective_lr_ratio"] > 0
        for p in (-1.0, -2.0):
            assert out[f"p {p:g}"]["grad_nonfinite"] >= 1.0, (p, out)  # (counted on each replica)
        assert out["p -1"]["grad_norm/1"] == math.inf  # torch: (Σ |inf|^-1)^-1 = 0^-1 = inf
        assert "max_norm=nan" in out["nan"] and "accepted values" in out["nan"]


@pytest.mark.parametrize("n, value, p", [(60, 3000.0, 2.0), (1000, 6000.0, 2.0), (1500, 30000.0, 2.0),
                                         (60, 3000.0, 1.0)])
def test_fp16_gradients_past_65504_are_clipped_to_max_norm_however_small_the_coefficient(n, value, p):
    """fp16 gradients whose total (1.8e5 .. 4.5e7) fp16 cannot hold are clipped by the float64 total's
    coefficient, which fp16 held in few bits below 2**-14 and not at all below 2**-25: the clipped 2-norm was
    0.998 and 1.07, and 0 (every gradient zeroed, the record's grad_norm finite and no alert). Truth: the
    float64 norm of the gradients after the clip, which is max_norm within fp16's rounding (2**-11) where the
    clipped elements are normal fp16 numbers (each is ±value/total here; a 1-norm's of 1e-6 would be subnormal,
    held by fp16 to a few percent whatever the clip does)."""
    import distmetrics as dm
    from tests.dist_utils import quiet_config

    torch.manual_seed(0)
    model = torch.nn.Linear(n, n, bias=False).half()
    model.weight.grad = (torch.randn(n, n).sign() * value).half()
    total = float(torch.linalg.vector_norm(model.weight.grad.double(), p))
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        returned = monitor.clip_grad_norm_(1.0, p)
        record = monitor.step(1)
    assert returned.dtype == torch.float16 and float(returned) == math.inf  # torch's dtype kept
    assert record["grad_norm"] == pytest.approx(total, rel=1e-5) and record["grad_nonfinite"] == 0  # float32 sums
    assert float(torch.linalg.vector_norm(model.weight.grad.double(), p)) == pytest.approx(1.0, rel=2**-11)


def test_error_if_nonfinite_below_norm_type_0_raises_on_every_rank_where_torch_would_on_one(edges):
    """A NaN in rank 1's copy alone: torch's total of norm type -inf, -1 or -0.5 on that rank is NaN and
    its clip raises, but ours returned rank 0's finite total on both ranks (the NaN stayed in rank 1's
    gradients). Every rank now raises, as for p > 0, before any gradient changes; an inf alone leaves
    torch's total finite (|inf|^p is 0, the min passes it by) and p = 0 counts NaN and inf as non-zero:
    no raise there, and the total is torch's on the rank that counts the replicas (rank 0)."""
    for p in (-math.inf, -1.0, -0.5, 0.0):
        for bad in ("nan", "inf"):
            said = [out["one replica"][(p, bad)] for out in edges]
            torch_raises = said[1]["torch raised"]
            assert torch_raises == (p < 0 and bad == "nan") and not said[0]["torch raised"], (p, bad, said)
            for rank, mine in enumerate(said):
                assert mine["unchanged"] or not torch_raises, (p, bad, rank, mine)
                if torch_raises:
                    said_error = str(mine["ours"])
                    assert said_error.startswith(f"The total norm of order {p} for gradients"), (p, bad, rank, mine)
                else:
                    assert mine["ours"] == pytest.approx(said[0]["torch total"], rel=1e-6), (p, bad, rank, said)


STAGE_DTYPES = (("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float16", "bfloat16"))  # per step, per stage
STAGE_MAX_NORM = 0.3


def _stages_of_changing_dtypes(rank: int, world: int) -> list:
    """A pipeline stage per rank on a ("pp",) mesh, a Linear(6, 4) in this step's dtype of
    :data:`STAGE_DTYPES`, its gradients set from a seed, clipped by a Monitor: per step, the gradients
    before and after the clip, the total as returned and the record's ``grad_norm``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    stage = torch.nn.Linear(6, 4)
    monitor = dm.Monitor(quiet_config(log_interval=1), model=stage, device_mesh=mesh)
    out = []
    for step, dtypes in enumerate(STAGE_DTYPES, start=1):
        dtype = getattr(torch, dtypes[rank])
        stage.to(dtype)
        generator = torch.Generator().manual_seed(10 * step + rank)
        for q in stage.parameters():
            q.grad = (torch.randn(q.shape, generator=generator) * 0.2).to(dtype)
        before = [q.grad.double().tolist() for q in stage.parameters()]
        returned = monitor.clip_grad_norm_(STAGE_MAX_NORM)
        metrics = monitor.step(step)
        out.append({"before": before, "after": [q.grad.double().tolist() for q in stage.parameters()],
                    "returned": float(returned), "dtype": str(returned.dtype), "grad_norm": metrics["grad_norm"]})
    monitor.close()
    return out


def test_stages_of_different_dtypes_return_and_clip_as_torchs_clip_of_the_whole_model():
    """Stage 0 in bf16 beside stage 1 in fp32: stage 0 returned a bf16 total and was scaled by a bf16
    coefficient, stage 1 by a float32 one, two factors for one model. torch's clip of the whole model
    stacks every tensor's norm, promoting bf16 with fp32: one float32 total, one float32 coefficient.
    Every rank now returns the total in the dtype promoted over every rank's gradients, also after the
    stages' dtypes change (both bf16: bf16; fp16 beside bf16: float32), and scales by torch's coefficient
    of it. Truth: the whole model's gradients in one process, float64 by hand, torch's
    ``get_total_norm`` for the dtype and ``clip_grads_with_norm_`` for the clipped gradients (bitwise)."""
    results = run_ranks(_stages_of_changing_dtypes, 2)
    for step, names in enumerate(STAGE_DTYPES):
        said = [rank_result[step] for rank_result in results]
        grads = [[torch.tensor(g, dtype=getattr(torch, names[rank])) for g in mine["before"]]
                 for rank, mine in enumerate(said)]
        whole = [g for stage in grads for g in stage]
        truth = math.sqrt(sum(float(g.double().pow(2).sum()) for g in whole))
        dtype = torch.nn.utils.get_total_norm(whole).dtype  # torch's clip of the whole model returns this
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in whole]
        for q, g in zip(params, whole):
            q.grad = g.clone()
        theirs = float(torch.nn.utils.clip_grad_norm_(params, STAGE_MAX_NORM))
        for rank, mine in enumerate(said):
            assert mine["dtype"] == str(dtype), (step, names, rank, mine["dtype"], str(dtype))
            assert mine["grad_norm"] == pytest.approx(truth, rel=1e-6)
            # the float64 total rounded once (torch's own differs by its bf16 and fp16 per-tensor norms)
            assert mine["returned"] == float(torch.tensor(mine["grad_norm"], dtype=torch.float64).to(dtype))
            assert mine["returned"] == said[0]["returned"] and mine["returned"] == pytest.approx(theirs, rel=2 ** -7)
        total = torch.tensor(said[0]["returned"], dtype=dtype)
        assert float(STAGE_MAX_NORM / (total + 1e-6)) < 1.0, (step, truth)  # a clip that scales
        for q, g in zip(params, whole):
            q.grad = g.clone()
        torch.nn.utils.clip_grads_with_norm_(params, STAGE_MAX_NORM, total)  # torch's coefficient of that total
        expected = iter(params)
        for rank, mine in enumerate(said):
            for k, got in enumerate(mine["after"]):
                want = next(expected).grad.double().tolist()
                assert got == want, (step, names, rank, k)


def test_tensor_statistics_merge_an_inf_mean_across_micro_batches():
    """Micro-batches [inf, 1] then [2, 3] gave mean NaN (inf + (-inf)·n/N), the reverse order inf;
    a pairwise merge now gives the mean of the union as float64 does, as the cross-rank merge did."""
    from distmetrics.tensor_stats.statistics import merge, partials

    for first, second in (([math.inf, 1.0], [2.0, 3.0]), ([2.0, 3.0], [math.inf, 1.0]),
                          ([-math.inf, 1.0], [2.0, 3.0]), ([1.0, 2.0, 3.0], [4.5, 7.0])):
        merged = merge(*(partials(torch.tensor(x, dtype=torch.float64)) for x in (first, second)))
        assert float(merged["mean"]) == float(torch.tensor(first + second, dtype=torch.float64).mean())


def _a_head_then_a_body_where_no_lane_is_read(rank: int, world: int) -> tuple:
    """GradDtypes.carried made False: what a job whose collective runs on a GPU (NCCL) does, which
    this machine cannot run: the dtypes are agreed at the first clip with a norm type only."""
    import distmetrics as dm
    from distmetrics.grad_dtypes import GradDtypes

    GradDtypes.carried = staticmethod(lambda group: False)
    head, body, alone = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(4, 4).bfloat16()
    for param in [*head.parameters(), *body.parameters(), *alone.parameters()]:
        param.grad = torch.full_like(param, 3.0)
    first = dm.clip_grad_norm_(head.parameters(), 1.0)
    second = dm.clip_grad_norm_(body.parameters(), 1.0)
    truth = torch.nn.utils.clip_grad_norm_(alone.parameters(), 1.0)
    return (first.dtype, second.dtype, truth.dtype, torch.equal(body.weight.grad, alone.weight.grad))


def test_a_clip_of_other_parameters_is_not_promoted_with_the_first_clips_dtypes_where_no_lane_is_read():
    """Where a clip reads no dtype lanes (a GPU), the dtypes agreed at the first clip (an fp32 head) were
    promoted into a later clip of other parameters (a bf16 body): float32 total and coefficient where
    torch's clip of those parameters gives bfloat16 (gradients one bf16 step apart). The agreement
    counts for the parameters and dtypes it was made for."""
    for result in run_ranks(_a_head_then_a_body_where_no_lane_is_read, 2, timeout=120):
        assert result == (torch.float32, torch.bfloat16, torch.bfloat16, True), result


def test_a_log_step_that_did_not_clip_has_no_effective_lr_ratio_over_an_earlier_steps_gradient():
    """SGD (lr 0.1): each step's update is 0.1 x its gradient. Steps 1-3 clip (at 100: no change),
    step 4, a log step, does not: its record's grad_norm is step 3's, the last measured (as the README
    says), and effective_lr_ratio divided step 4's update by it, 0.0686 for 0.1. A ratio of one step
    needs its update and its gradient: the record now has none; step 2's is 0.1. Truth: float64."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records, norms = {}, {}
    with dm.Monitor(quiet_config(log_interval=2, log_update_norm=True), model=model, optimizer=optimizer) as monitor:
        for step in (1, 2, 3, 4):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            norms[step] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            if step != 4:
                monitor.clip_grad_norm_(100.0)
            optimizer.step()
            optimizer.zero_grad()
            records[step] = monitor.step(step, loss=1.0)
    assert records[2]["effective_lr_ratio"] == pytest.approx(0.1, rel=1e-6), records[2]
    assert records[4]["grad_norm"] == pytest.approx(norms[3], rel=1e-6)  # the last measured: step 3's
    assert records[4]["update_norm"] == pytest.approx(0.1 * norms[4], rel=1e-6)
    assert "effective_lr_ratio" not in records[4], records[4]


def _negative_norms_of_no_gradient(rank: int, world: int) -> dict:
    """No parameter holds a gradient (no backward); torch's clip, ours and the Monitor's, p < 0."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    out = {}
    for p in (-1.0, -0.5, -math.inf):
        model = torch.nn.Linear(3, 3)
        torch_total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=p))
        ours = float(dm.clip_grad_norm_(model.parameters(), 1.0, norm_type=p))
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            returned = float(monitor.clip_grad_norm_(1.0, norm_type=p))
            record = monitor.step(1, loss=1.0)["grad_norm"]
        out[p] = (torch_total, ours, returned, record)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_negative_norm_type_of_no_gradient_is_torchs_zero(world):
    """With no gradient anywhere torch's total is 0 for every norm type; ours was inf for p = -1 and
    -0.5 (the root of an empty sum of n^p), and the record's grad_norm inf for -inf too (the min's
    identity). A lane of the norms' all-reduce now says whether any rank owns a gradient."""
    results = run_ranks(_negative_norms_of_no_gradient, world) if world > 1 else [_negative_norms_of_no_gradient(0, 1)]
    for out in results:
        for p, values in out.items():
            assert values == (0.0, 0.0, 0.0, 0.0), (p, values)


def _one_corrupt_copy(rank: int, world: int) -> dict:
    """DDP on 2 ranks; after backward, one element of one rank's copy of a gradient is set NaN or inf;
    the Monitor's clip (max_norm 1): what it returns and what each rank's gradients hold after it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    out = {}
    for bad_rank, bad, p in [(r, v, 2.0) for r in (0, 1) for v in (math.nan, math.inf)] + \
            [(1, math.inf, math.inf), (1, math.nan, -math.inf)]:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
        second = torch.cat([g.grad.double().flatten() for g in model.module[1].parameters()])
        clean = torch.linalg.vector_norm(second, p)  # module 1's, before the clip
        if rank == bad_rank:
            model.module[0].weight.grad[0, 0] = bad
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            total = float(monitor.clip_grad_norm_(1.0, norm_type=p))
            record = monitor.step(1, loss=1.0)
        finite = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
        left = sum(float(p.grad[torch.isfinite(p.grad)].abs().sum()) for p in model.parameters())
        modules = (record["grad_norm/0"], record["grad_norm/1"], float(clean), record["grad_nonfinite_modules"])
        out[(bad_rank, str(bad), p)] = (total, record["grad_norm"], record["grad_nonfinite"], finite, left, modules)
    return out


def test_a_nan_or_inf_in_one_replicas_copy_gives_every_rank_the_same_total_and_clip():
    """A NaN in rank 0's copy (the one counted) made the total NaN and every rank's gradients NaN; the
    same NaN in rank 1's copy gave the clean copy's finite total, and rank 1 kept its NaN alone: the
    replicas went apart, which way depending on the rank. A copy whose norm is not finite now counts as
    the counted one: the same total (NaN, or inf for an inf) and the same clip on every rank; and in its
    module's norm, which read the owner's finite copy (p = 2, inf and -inf: the max and min kinds too)."""
    results = run_ranks(_one_corrupt_copy, 2)
    for bad_rank, bad, p in results[0]:
        for rank, out in enumerate(results):
            total, record, nonfinite, finite, left, modules = out[(bad_rank, bad, p)]
            case = (rank, bad_rank, bad, p, out[(bad_rank, bad, p)])
            assert nonfinite == 1.0 and left == 0.0, case  # no gradient left as it was
            if bad == "nan":
                assert math.isnan(total) and math.isnan(record) and not any(finite), case
            else:  # the coefficient max_norm / inf is 0: every gradient zeroed, the inf itself NaN (inf x 0)
                assert total == math.inf and record == math.inf, case
                assert finite == [rank != bad_rank, True, True, True], case
            # the module holding the bad copy has the total's NaN or inf whichever rank holds it (rank 0 owns the
            # replicated weights: rank 1's copy read as finite there); the other module its own norm
            first, second, clean, named = modules
            assert (math.isnan(first) if bad == "nan" else first == math.inf) and named == ["0"], case
            assert second == pytest.approx(clean, rel=1e-6), case


def _clip_before_and_after_a_process_group(rank: int, world: int, store: str) -> tuple:
    """The module-level clip called with no process group (the rank's own gradients), then in a new
    one, twice, then in twelve more made after destroying the last, then in a group of rank 0 alone: replicas
    whose gradients differ by rank (rank r: r + 1 in each of 3 elements)."""
    import gc

    import torch
    import torch.distributed as dist

    import distmetrics as dm

    dist.destroy_process_group()
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), float(rank + 1))
    alone = float(dm.clip_grad_norm_([param], 1e9))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    param.grad = torch.full((3,), float(rank + 1))
    after = [float(dm.clip_grad_norm_([param], 1e9)) for _ in range(2)]
    torchs = float(torch.nn.utils.clip_grad_norm_([param], 1e9))
    for cycle in range(12):  # destroyed and made again (a sweep): a new group's address may be an old one's
        dist.destroy_process_group()
        gc.collect()
        dist.init_process_group("gloo", store=dist.FileStore(f"{store}{cycle}", world), rank=rank, world_size=world)
        param.grad = torch.full((3,), float(rank + 1))
        after.append(float(dm.clip_grad_norm_([param], 1e9)))
    first = dist.new_group([0])  # rank 1 is not in it: its clip measured nothing and returned 0
    try:
        outside = float(dm.clip_grad_norm_([param], 1e9, group=first))
    except ValueError as err:
        outside = str(err)
    return alone, after, torchs, outside


def test_the_module_level_clip_measures_the_process_group_of_the_call_not_of_its_first_call(tmp_path):
    """dm.clip_grad_norm_ kept the layout of its first call: called once before init_process_group (or in a
    job before a destroy and a new init: a sweep, a notebook), it then summed every rank's replica as
    shards (sqrt(15) here, on every rank, and clipped by it) where plain tensors under a process group
    are replicas counted from rank 0 (sqrt(3): torch's clip on rank 0). Keyed by the group's id(), a new
    group at an old one's address on one rank only made the ranks' calls differ (gloo aborted)."""
    results = run_ranks(_clip_before_and_after_a_process_group, 2, str(tmp_path / "store"))
    torch_rank0 = results[0][2]
    assert torch_rank0 == pytest.approx(3 ** 0.5)
    assert results[0][3] == pytest.approx(3 ** 0.5)  # rank 0's group of one: its own gradients
    assert results[1][3].startswith("dm.clip_grad_norm_(group=...): rank 1 is not one of the group's ranks"), results
    for rank, (alone, after, torchs, _) in enumerate(results):
        assert alone == pytest.approx(3 ** 0.5 * (rank + 1)), results  # its own gradients, as torch's on it
        assert after == pytest.approx([torch_rank0] * 14, rel=1e-6), results


def _float64_infinity_norm_of_an_inf(rank: int, world: int) -> list:
    """Replicas of float64 gradients holding an inf (the copy rank 0 counts), clipped at norm type ±inf
    by the Monitor: what it returns, what the record says, the gradients after it; and torch's clip of
    a copy on this rank."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    out = []
    for p in (math.inf, -math.inf):
        model = torch.nn.Linear(2, 1, bias=False).double()
        grad = torch.tensor([[math.inf, 2.0]], dtype=torch.float64) if p > 0 else \
            torch.tensor([[math.inf, math.inf]], dtype=torch.float64)
        copy = torch.nn.Parameter(torch.zeros(1, 2, dtype=torch.float64))
        copy.grad = grad.clone()
        torchs = float(torch.nn.utils.clip_grad_norm_([copy], 1.0, p))
        with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
            model.weight.grad = grad.clone()
            returned = float(monitor.clip_grad_norm_(1.0, p))
            record = monitor.step(1)["grad_norm"]
        out.append((p, returned, record, torchs, model.weight.grad.tolist(), copy.grad.tolist()))
    return out


def test_an_inf_gradient_under_a_float64_infinity_norm_is_an_inf_total_on_every_rank():
    """The MAX all-reduce of the ranks' totals turned an inf into float64's largest finite number
    (torch.nan_to_num's default for inf): float64 gradients holding an inf gave a total of 1.8e308 and a
    coefficient of 5.6e-309, leaving the inf, where torch's clip returns inf and scales by 0. (Float32
    gradients hid it: the total's float32 cast was inf again.)"""
    for rank, out in enumerate(run_ranks(_float64_infinity_norm_of_an_inf, 2)):
        for p, returned, record, torchs, grads, torch_grads in out:
            assert returned == torchs == record == math.inf, (rank, p, returned, record, torchs)
            assert str(grads) == str(torch_grads), (rank, p, grads, torch_grads)  # inf x 0 is NaN: as torch's


def test_the_module_level_clip_keeps_the_last_four_parameter_lists_it_clipped_and_no_more():
    """README, Limitations: dm.clip_grad_norm_ without a Monitor holds the plans, and with them the
    parameters, of the last 4 lists it clipped; a fifth lets the oldest go."""
    import gc
    import weakref

    import distmetrics as dm

    refs = []
    for i in range(6):
        model = torch.nn.Linear(4, 4)
        model(torch.randn(2, 4)).sum().backward()
        dm.clip_grad_norm_(model.parameters(), 1.0)
        refs.append(weakref.ref(model.weight))
        del model
        gc.collect()
        assert [r() is not None for r in refs] == [j > i - 4 for j in range(i + 1)], i


@pytest.mark.parametrize("n", [300_000, 1_000])
def test_a_long_fp32_cpu_tensor_keeps_a_norm_whose_float32_sum_of_squares_overflows(n):
    """The README's CPU claim: over 262,144 elements an fp32 gradient's squares are summed by rows, so four
    values of 1e19 in separate rows give the float64 norm 2e19 and clip to max_norm, where torch's clip returns
    inf and zeroes the gradient; a shorter tensor is torch's (inf, zeroed)."""
    import distmetrics as dm

    grad = torch.zeros(n)
    grad[[0, 300, 600, 900]] = 1e19
    ours, theirs = (torch.nn.Parameter(torch.zeros(n)) for _ in range(2))
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    total = float(dm.clip_grad_norm_([ours], 1.0))
    torch_total = float(torch.nn.utils.clip_grad_norm_([theirs], 1.0))
    assert torch_total == math.inf and float(theirs.grad.double().norm()) == 0.0
    if n > 262_144:
        assert total == pytest.approx(float(grad.double().norm()), rel=1e-6)
        assert float(ours.grad.double().norm()) == pytest.approx(1.0, rel=1e-5)
    else:
        assert total == math.inf and float(ours.grad.double().norm()) == 0.0


def _sharded_overflow(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,))
    full = torch.full((4,), 1.2e19)  # each rank's squares sum to 2.9e38, within float32; the whole to 5.8e38
    out = {}
    for who, clip in (("ours", dm.clip_grad_norm_), ("torch", torch.nn.utils.clip_grad_norm_)):
        param = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        param.grad = distribute_tensor(full.clone(), mesh, [Shard(0)])
        total = clip([param], 1.0)
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        out[who] = (float(total), float(param.grad.full_tensor().double().norm()))
    return out


def test_a_sharded_dtensors_norm_stays_finite_where_torchs_clip_returns_inf():
    """The README's DTensor claim: each shard's sum of squares is finite and they are summed in float64, so
    the total is the float64 norm (2.4e19) and the gradient clips to max_norm, where torch's clip of the same
    DTensor returns inf."""
    truth = float(torch.full((4,), 1.2e19, dtype=torch.float64).norm())
    for out in run_ranks(_sharded_overflow, 2, timeout=120):
        assert out["ours"][0] == pytest.approx(truth, rel=1e-6) and out["ours"][1] == pytest.approx(1.0, rel=1e-5)
        assert out["torch"][0] == math.inf, out
