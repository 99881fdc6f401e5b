"""The Monitor's API called from code ``torch.compile`` compiles (backend aot_eager), on 2 real gloo
ranks: a compiled train step's clip, a compiled forward's MoE auxiliary loss, timers inside a
compiled block, a compiled optimizer step with update norms. Graphs are counted by a backend that
counts what Dynamo hands it (a recompile hands it a graph again); values are checked against
torch's own clip and float64 sums computed here."""

import math

import pytest

from tests.dist_utils import quiet_config, run_ranks

WORLD = 2
MAX_NORM = 0.05  # small enough that every step clips


def _counting_backend() -> tuple:
    """aot_eager, and the list of the graphs it was handed (their number of operations)."""
    from torch._dynamo import lookup_backend

    aot_eager, graphs = lookup_backend("aot_eager"), []

    def backend(gm, example_inputs):
        graphs.append(sum(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes))
        return aot_eager(gm, example_inputs)
    return backend, graphs


def _net():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _clip(rank: int, world: int) -> dict:
    """A DDP model's gradients clipped inside compiled functions, the Monitor's and the module-level
    clip (given ``model.parameters()``: a generator, which Dynamo cannot hand across a graph break),
    beside torch's clip of copies of the same gradients."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DistributedDataParallel(_net())
    monitor = dm.Monitor(quiet_config(log_interval=2), model=model)
    backend, _ = _counting_backend()
    clip_monitor = torch.compile(lambda: monitor.clip_grad_norm_(MAX_NORM), backend=backend)
    clip_module = torch.compile(lambda: dm.clip_grad_norm_(model.parameters(), MAX_NORM), backend=backend)
    out: dict = {"totals": [], "clipped_apart": [], "grad_norm": []}
    for step in range(1, 5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for copy, p in zip(copies, model.parameters()):
            copy.grad = p.grad.clone()
        exact = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
        want = float(torch.nn.utils.clip_grad_norm_(copies, MAX_NORM))
        got = float((clip_monitor if step % 2 == 0 else clip_module)())  # the Monitor's on its log steps
        out["totals"].append((got, want, exact))
        apart = [float((c.grad - p.grad).abs().max()) for c, p in zip(copies, model.parameters())]
        out["clipped_apart"].append(max(apart))
        model.zero_grad()
        metrics = monitor.step(step)
        if metrics is not None:
            out["grad_norm"].append((metrics["grad_norm"], exact))
    monitor.close()
    return out


def _record(rank: int, world: int) -> dict:
    """A compiled forward records its auxiliary loss (``record`` and ``record_moe``) every step."""
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    class Router(torch.nn.Module):
        def __init__(self, monitor):
            super().__init__()
            self.monitor, self.fc = monitor, torch.nn.Linear(8, 4)

        def forward(self, x):
            y = self.fc(x)
            aux = y.pow(2).mean()
            self.monitor.record("aux", aux.detach())
            self.monitor.record_moe(aux_loss=aux.detach())
            return y.sum() + aux

    torch._dynamo.reset()
    torch.manual_seed(0)
    monitor = dm.Monitor(quiet_config(log_interval=4))
    router = Router(monitor)
    backend, graphs = _counting_backend()
    compiled = torch.compile(router, backend=backend)
    out: dict = {"logged": {}, "graphs": []}
    mine = {}
    for step in range(1, 13):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        compiled(x).backward()
        with torch.no_grad():
            mine[step] = float(router.fc(x).double().pow(2).mean())
        metrics = monitor.step(step)
        out["graphs"].append(len(graphs))
        if metrics is not None:
            out["logged"][step] = (metrics["aux"], metrics["moe/aux_loss"])
    monitor.close()
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    out["truth"] = {step: sum(ranks[s] for ranks in every for s in range(step - 3, step + 1)) / (4 * world)
                    for step in out["logged"]}
    return out


def _timers(rank: int, world: int) -> dict:
    """A block timed inside a compiled forward, at a disabled level and an enabled one."""
    import torch

    import distmetrics as dm

    class Block(torch.nn.Module):
        def __init__(self, monitor, how):
            super().__init__()
            self.monitor, self.how = monitor, how
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            x = torch.relu(self.a(x))
            if self.how == "with":
                with self.monitor.timers("attn", log_level=1):
                    x = torch.relu(self.b(x))
            elif self.how == "start/stop":
                self.monitor.timers("attn", log_level=1).start()
                x = torch.relu(self.b(x))
                self.monitor.timers("attn", log_level=1).stop()
            else:
                x = torch.relu(self.b(x))
            return x.sum()

    out = {}
    for level, how in ((0, None), (0, "with"), (0, "start/stop"), (1, "with")):
        torch._dynamo.reset()
        monitor = dm.Monitor(quiet_config(log_interval=3, timing_log_level=level))
        backend, graphs = _counting_backend()
        block = torch.compile(Block(monitor, how), backend=backend)
        for step in range(1, 7):
            block(torch.randn(4, 16)).backward()
            metrics = monitor.step(step)
        monitor.close()
        out[level, how] = {"graphs": list(graphs), "attn": metrics.get("timers/attn")}
    return out


def _optimizer(rank: int, world: int) -> dict:
    """A compiled ``optimizer.step()`` (torch's compiled-optimizer recipe: lr a tensor) with and
    without a Monitor measuring update norms around it; every rank trains on the same batches."""
    import torch

    import distmetrics as dm

    out = {}
    for monitored in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        monitor = dm.Monitor(quiet_config(log_interval=3, log_update_norm=True), model=model,
                             optimizer=optimizer) if monitored else None
        backend, graphs = _counting_backend()
        step_fn = torch.compile(optimizer.step, backend=backend)
        logged = []
        for step in range(1, 7):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            before = [p.detach().double().clone() for p in model.parameters()]
            step_fn()
            optimizer.zero_grad()
            after = [p.detach().double() for p in model.parameters()]
            update = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(after, before)))
            metrics = monitor.step(step) if monitor is not None else None
            if metrics is not None:
                logged.append((metrics["update_norm"], update))
        if monitor is not None:
            monitor.close()
        out[monitored] = {"graphs": list(graphs), "logged": logged}
    return out


def _scenarios(rank: int, world: int) -> dict:
    return {"clip": _clip(rank, world), "record": _record(rank, world), "timers": _timers(rank, world),
            "optimizer": _optimizer(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios, WORLD, timeout=400)


def test_clip_inside_compiled_code_returns_and_clips_as_torchs(results):
    """It raised InternalTorchDynamoError (Dynamo traced the parameter lookup); now it is one graph
    break at the call, run eagerly: torch's total and clipped gradients, also when given a generator."""
    for rank, result in enumerate(results):
        out = result["clip"]
        for got, want, exact in out["totals"]:
            assert got == pytest.approx(want, rel=1e-6) and got == pytest.approx(exact, rel=1e-5), rank
        assert max(out["clipped_apart"]) <= 1e-7, rank
        assert [metric == pytest.approx(exact, rel=1e-6) for metric, exact in out["grad_norm"]] == [True, True], rank


def test_record_in_a_compiled_forward_never_recompiles_and_logs_the_mean(results):
    """Dynamo compiled the library's own record code, guarding on the interval's running float
    weight: a recompile at every call up to its limit. Now no graph is compiled after the first step."""
    for rank, result in enumerate(results):
        out = result["record"]
        first, *later = out["graphs"]
        assert 1 <= first <= 3 and set(later) == {first}, (rank, out["graphs"])
        assert sorted(out["logged"]) == [4, 8, 12]
        for step, (aux, moe_aux) in out["logged"].items():
            assert aux == pytest.approx(out["truth"][step], rel=1e-6), (rank, step)
            assert moe_aux == pytest.approx(out["truth"][step], rel=1e-6), (rank, step)


def test_a_disabled_timer_inside_compiled_code_leaves_the_graph_as_without_it(results):
    """A disabled level's ``with`` ended the graph (Dynamo could not enter the shared DummyTimer) and
    its start/stop recompiled once; now both compile the one graph the block has without a timer."""
    for rank, result in enumerate(results):
        out = result["timers"]
        without = out[0, None]["graphs"]
        assert len(without) == 1, without
        assert out[0, "with"]["graphs"] == without and out[0, "start/stop"]["graphs"] == without, (rank, out)
        assert out[0, "with"]["attn"] is None
        assert out[1, "with"]["attn"] > 0, rank  # an enabled one breaks the graph (README) and still times


def test_update_norm_hooks_leave_a_compiled_optimizer_step_one_graph(results):
    """The update-norm hooks were traced into the compiled step and broke it into 7 graphs; they run
    outside it now: the same graphs as without a Monitor, and the exact update norm."""
    for rank, result in enumerate(results):
        out = result["optimizer"]
        assert out[True]["graphs"] == out[False]["graphs"] and len(out[False]["graphs"]) == 1, (rank, out)
        assert len(out[True]["logged"]) == 2
        for metric, exact in out[True]["logged"]:
            assert metric == pytest.approx(exact, rel=1e-5), rank


def test_the_wrapper_frame_is_compiled_once_not_once_per_method():
    """Dynamo compiled the small frame around each Monitor method called from compiled code, guarding on
    the method and on the wrapper's own state: a recompile per method (seven cache entries for four
    methods here) and, past 8, Dynamo's recompile-limit warning pointing into the library. The frame is
    now left to run as it is after the first: one entry."""
    import torch
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    import distmetrics as dm

    torch._dynamo.reset()
    monitor = dm.Monitor(quiet_config(log_interval=4))

    def forward(x):
        y = x * 2
        monitor.record("r", y.sum().detach())
        monitor.record_moe(aux_loss=y.sum().detach())
        monitor.pause()
        monitor.resume()
        return y

    compiled = torch.compile(forward, backend="eager")
    for step in range(1, 9):
        compiled(torch.randn(3))
        monitor.step(step)
    monitor.close()
    assert len(_debug_get_cache_entry_list(dm.Monitor.record.__code__)) <= 1


def test_a_call_inside_a_fullgraph_function_is_refused_naming_the_call():
    """Dynamo's error under fullgraph=True named torch's skip_code ("Attempted to call function marked as
    skipped"), which the wrapper's first call made, not the monitor call or what to do."""
    import torch

    import distmetrics as dm

    torch._dynamo.reset()
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        def forward(x):
            y = x * 2
            monitor.record("r", y.sum().detach())
            return y

        with pytest.raises(torch._dynamo.exc.Unsupported, match="distmetrics: monitor.record runs eagerly, at a "
                           "graph break where compiled code calls it; under torch.compile\\(fullgraph=True\\), which "
                           "allows none, call it outside the compiled function"):
            torch.compile(forward, backend="eager", fullgraph=True)(torch.randn(3))


def _timed_block(cls: type, form: str) -> tuple:
    """(a block timed by a timer of class ``cls`` on the host clock, the timer)."""
    from distmetrics.collectors.timers import Timers

    timers = Timers(log_level=2, log_option="minmax", use_cuda=False)
    timer = timers._make("attn", 1, cls)

    def block(x):
        y = x.sin()
        if form == "with":
            with timers("attn", log_level=1):
                y = y @ y.T
        else:
            timers("attn", log_level=1).start()
            y = y @ y.T
            timers("attn").stop()
        return y.cos()
    return block, timer


@pytest.mark.parametrize("form", ["with", "start/stop"])
def test_a_cuda_timer_runs_its_start_and_stop_eagerly_inside_compiled_code(form):
    """On CUDA a timer records events, which Dynamo traces: traced into the graph, the events made while
    tracing would stand for every call's and the timer's state be guarded on. The CUDA timer's start
    and stop are each a graph break of their own, run eagerly (tests/test_cuda.py times it on a GPU).
    Here its class times with the host clock: its breaks are the library's (the host timer's are its
    clock's), it compiles the graphs the host timer does, each once for 6 calls, and counts every
    span; a ``with`` block of it, which Dynamo cannot resume in, runs the function's own code eagerly."""
    import torch

    from distmetrics.collectors.timer import CudaTimer, Timer

    runs = {}
    for cls in (Timer, CudaTimer):
        torch._dynamo.reset()
        block, timer = _timed_block(cls, form)
        backend, graphs = _counting_backend()
        compiled = torch.compile(block, backend=backend)
        for _ in range(6):
            compiled(torch.randn(64, 64))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(_timed_block(cls, form)[0])(torch.randn(4, 4))
        reasons = [str(b.reason) for b in explained.break_reasons]
        runs[cls] = graphs, timer.spans, reasons
    (host, host_spans, _), (cuda, cuda_spans, reasons) = runs[Timer], runs[CudaTimer]
    assert cuda == host and len(cuda) <= 3 and cuda_spans == host_spans == 6, runs
    if form == "with":
        assert cuda == [], cuda
    else:
        assert [("Timer.start" in r, "Timer.stop" in r, "runs eagerly" in r) for r in reasons] == \
            [(True, False, True), (False, True, True)], reasons
