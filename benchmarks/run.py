"""The overhead budget, measured against baselines in the same run.

    python -m benchmarks                 # full (several minutes on 2 CPU cores)
    python -m benchmarks --quick         # fewer repeats and sizes
    python -m benchmarks --out runs/benchmarks.json

Every figure is the median of repeated runs with baseline and candidate interleaved in the same
process, printed as a ratio. Wall-clock numbers are for reading, not for asserting: the tests
never time anything.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from distmetrics.packing import CONTROL_LANES
from tests.dist_utils import CollectiveCounter, quiet_config, run_ranks


def median_pair(baseline: Callable, candidate: Callable, repeats: int, warmup: int = 2,
                sync: Callable = lambda: None) -> tuple[float, float]:
    """Median seconds of baseline and candidate, run alternately; ``sync`` waits for the
    device after each call (``torch.cuda.synchronize`` on a GPU), so queued work counts."""
    for _ in range(warmup):
        baseline()
        candidate()
    sync()
    base, cand = [], []
    for _ in range(repeats):
        t = time.perf_counter(); baseline(); sync(); base.append(time.perf_counter() - t)
        t = time.perf_counter(); candidate(); sync(); cand.append(time.perf_counter() - t)
    return statistics.median(base), statistics.median(cand)


# --- 1. per-module grad norms + clipping ---------------------------------------------------------

def stack_model(modules: int, params: float, device: str = "cpu") -> torch.nn.Module:
    d = int(math.sqrt(params / modules))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(modules)]).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def naive_per_module(model: torch.nn.Module) -> dict:
    """The common recipe: a norm per parameter, .item() each, summed per module in Python."""
    sums: dict = {}
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        sums[module] = sums.get(module, 0.0) + p.grad.norm().item() ** 2
    return {m: math.sqrt(v) for m, v in sums.items()}


def bench_norms(sizes, repeats: int, device: str = "cpu") -> list[dict]:
    import distmetrics as dm

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for modules, params in sizes:
        model = stack_model(modules, params, device)
        grads = [p.grad.clone() for p in model.parameters()]
        plist = list(model.parameters())
        monitor = dm.Monitor(quiet_config(log_interval=10**9), model=model)
        huge = 1e9  # clipping math runs, scaling is by 1.0: repeats see the same gradients

        def torch_clip():
            torch.nn.utils.clip_grad_norm_(plist, huge)

        def ours():
            monitor.clip_grad_norm_(huge)

        def naive():
            naive_per_module(model)
            torch.nn.utils.clip_grad_norm_(plist, huge)

        def naive_loop_only():
            naive_per_module(model)

        base, cand = median_pair(torch_clip, ours, repeats, sync=sync)
        naive_t, cand2 = median_pair(naive, ours, repeats, sync=sync)
        _, naive_loop_t = median_pair(torch_clip, naive_loop_only, repeats, sync=sync)
        monitor.close()
        for p, g in zip(plist, grads):
            p.grad = g
        n_params = sum(p.numel() for p in plist)
        rows.append({"modules": modules, "params_m": round(n_params / 1e6, 1), "torch_clip_ms": base * 1e3,
                     "ours_ms": cand * 1e3, "ours_vs_torch_clip": cand / base,
                     "naive_ms": naive_t * 1e3, "naive_vs_ours": naive_t / cand2,
                     "naive_loop_only_ms": naive_loop_t * 1e3})
    return rows


# --- 2 and 4b. collectives per log step, on 4 gloo ranks ---------------------------------------

def _reducer_worker(rank: int, world: int, sizes, repeats: int) -> dict:
    import torch.distributed as dist

    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.timer_collector import TimerCollector
    from distmetrics.collectors.timers import Timers
    from distmetrics.reduce import Reducer, Sample

    out = {"reduce": [], "timers": []}
    for n in sizes:
        samples = [Sample(f"m{i}", torch.tensor(float(rank + i)), "mean") for i in range(n)]
        reducer = Reducer()
        reducer.reduce(samples)  # negotiation, once

        def packed():
            reducer.reduce(samples)

        def per_key():
            for s in samples:
                t = torch.tensor([float(s.value) * 1.0, 1.0], dtype=torch.float64)
                dist.all_reduce(t)

        before = reducer.collectives
        base, cand = median_pair(per_key, packed, repeats)
        per_log = (reducer.collectives - before) / (repeats + 2)
        layout = reducer._layout
        packed_bytes = 8 * (layout.n_sum + layout.n_max + CONTROL_LANES)
        out["reduce"].append({"names": n, "collectives_ours": per_log, "collectives_per_key": n,
                              "bytes_ours": packed_bytes, "bytes_per_key": 16 * n,
                              "per_key_ms": base * 1e3, "ours_ms": cand * 1e3, "per_key_vs_ours": base / cand})
    for n_timers in (10, 200):
        timers = Timers(2, "minmax", use_cuda=False)
        collector = TimerCollector(timers, "minmax")
        reducer = Reducer()
        ctx = LogContext(step=1, steps=1, layout=None)

        def log_step():
            for i in range(n_timers):
                t = timers(f"t{i}", log_level=1)
                t.start(); t.stop()
            samples = collector.take_samples(ctx)
            reducer.reduce(samples)

        log_step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter(); log_step(); times.append(time.perf_counter() - t0)
        out["timers"].append({"timers": n_timers, "log_step_ms": statistics.median(times) * 1e3,
                              "collectives": reducer.collectives})
    dist.barrier()
    return out


def bench_collectives(sizes, repeats: int, world: int = 4) -> dict:
    return run_ranks(_reducer_worker, world, sizes, repeats, timeout=900, threads=None)[0]  # as in the README's rows


# --- 3. non-log-step overhead of a small FSDP2 training step (2 ranks) -------------------------

def _training_worker(rank: int, world: int, steps: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm
    from launch.common import GPT, MarkovData

    torch.manual_seed(0)
    model = GPT(128, 128, 2, 4, 64)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = dm.Monitor(quiet_config(log_interval=10, timing_log_level=1, log_throughput=True, log_memory=True),
                         model=model, optimizer=opt)
    data = MarkovData(128, 0)
    batch = data.batch(rank, 8, 64)
    step_no = [0]

    def train_step(with_monitor: bool):
        timers = monitor.timers
        if with_monitor:
            timers("forward-backward", log_level=1).start()
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, 128), batch[:, 1:].reshape(-1))
        loss.backward()
        if with_monitor:
            timers("forward-backward").stop()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        if with_monitor:
            step_no[0] += 1
            if step_no[0] % 10 == 0:  # keep the measured steps non-log steps
                step_no[0] += 1
            monitor.step(step_no[0], loss=loss.detach(), tokens=8 * 64, lr=1e-3)

    off, on = [], []
    counts = {"collectives": 0, "items": 0}
    for i in range(steps + 3):
        dist.barrier()
        t = time.perf_counter(); train_step(False); a = time.perf_counter() - t
        dist.barrier()
        # count what the monitor itself does on a non-log step: only its own calls
        t = time.perf_counter()
        with CollectiveCounter() as counter:
            timers = monitor.timers
            timers("probe", log_level=1).start(); timers("probe").stop()
            step_no[0] += 1
            if step_no[0] % 10 == 0:
                step_no[0] += 1
            monitor.step(step_no[0], loss=torch.tensor(1.0), tokens=512, lr=1e-3)
        counts["collectives"] += counter.collectives
        counts["items"] += counter.items
        dist.barrier()
        t = time.perf_counter(); train_step(True); b = time.perf_counter() - t
        if i >= 3:
            off.append(a); on.append(b)
    monitor.close()
    return {"step_off_ms": statistics.median(off) * 1e3, "step_on_ms": statistics.median(on) * 1e3,
            "overhead_pct": 100 * (statistics.median(on) / statistics.median(off) - 1),
            "non_log_collectives": counts["collectives"], "non_log_items": counts["items"],
            "non_log_steps_counted": steps + 3}


def bench_training(steps: int, world: int = 2) -> dict:
    return run_ranks(_training_worker, world, steps, timeout=900, threads=None)[0]  # as in the README's rows


# --- 4a. timer start/stop cost ----------------------------------------------------------------

def bench_timer_pairs(pairs: int, repeats: int) -> dict:
    from distmetrics.collectors.timers import Timers

    timers = Timers(1, "minmax", use_cuda=False)

    def enabled():
        for _ in range(pairs):
            t = timers("fwd", log_level=1)
            t.start(); t.stop()

    def disabled():
        for _ in range(pairs):
            t = timers("fine", log_level=2)
            t.start(); t.stop()

    def empty():
        for _ in range(pairs):
            pass

    base, on = median_pair(empty, enabled, repeats)
    _, off = median_pair(empty, disabled, repeats)
    return {"enabled_pair_us": (on - base) / pairs * 1e6, "disabled_pair_us": (off - base) / pairs * 1e6}


# --- 4c. a tensor-statistics hook on a step the features file does not select ------------------

def bench_inspect_hook(forwards: int, repeats: int) -> dict:
    """A forward of a hooked layer (``nn.Identity``, so the hook's cost is not hidden in the layer's)
    on a step the YAML does not select, against the same layer unhooked (another module of one
    model, not selected): what the hook adds to every forward outside ``torch.compile``; and what a
    hook that does nothing adds, torch's own share of it (a module with a forward hook takes
    ``Module.__call__``'s slower path)."""
    import tempfile

    import distmetrics as dm

    model = torch.nn.Sequential()
    model.add_module("hooked", torch.nn.Identity())
    model.add_module("plain", torch.nn.Identity())
    model.add_module("noop", torch.nn.Identity())
    model.noop.register_forward_hook(lambda module, args, kwargs, output: None, with_kwargs=True)
    x = torch.randn(2, 2)
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": r"hooked$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                         "stats": ["max"], "freq": 10 ** 6, "start_step": 10 ** 6}}}}

    def forwards_of(layer):
        def run():
            for _ in range(forwards):
                layer(x)
        return run

    with tempfile.TemporaryDirectory() as out:
        config = dm.MetricsConfig(output_dir=out, log_interval=1, console=False, tensorboard=False,
                                  timing_log_level=-1, tensor_inspect={"enabled": True, "features": features})
        with dm.Monitor(config, model=model) as monitor:
            monitor.step(1)
            base, hooked = median_pair(forwards_of(model.plain), forwards_of(model.hooked), repeats)
            base_noop, noop = median_pair(forwards_of(model.plain), forwards_of(model.noop), repeats)
    return {"unhooked_forward_us": base / forwards * 1e6, "hooked_forward_us": hooked / forwards * 1e6,
            "hook_us": (hooked - base) / forwards * 1e6, "noop_hook_us": (noop - base_noop) / forwards * 1e6}


# --- 5. update norms --------------------------------------------------------------------------

def bench_update_norms(params: float, repeats: int) -> dict:
    """optimizer.step() on log steps (snapshot before, diff after) vs non-log steps (nothing)."""
    import distmetrics as dm

    model = stack_model(50, params)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = dm.Monitor(quiet_config(log_interval=2, log_update_norm=True), model=model, optimizer=opt)
    times = {True: [], False: []}
    for step in range(1, 2 * (repeats + 2) + 1):
        t = time.perf_counter()
        opt.step()  # the pre/post hooks snapshot and diff only when `step` will be logged
        if step > 4:
            times[step % 2 == 0].append(time.perf_counter() - t)
        monitor.step(step)  # untimed: on log steps it reduces and writes
    snapshot_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    monitor.close()
    base, cand = statistics.median(times[False]), statistics.median(times[True])
    return {"params_m": round(snapshot_bytes / 4 / 1e6, 1), "non_log_step_ms": base * 1e3, "log_step_ms": cand * 1e3,
            "log_vs_non_log": cand / base, "snapshot_mib": snapshot_bytes / 2**20}


# --- 6. every-step logging with sinks, and the log step with all sinks vs none -----------------

class _NamedValues:
    """A collector of ``names`` metrics in one vector sample (per-layer statistics, say)."""

    name = "named_values"
    after = ()

    def __init__(self, names: int):
        self.names = tuple(f"layer_stats/block.{i}/value" for i in range(names))
        self.values = torch.rand(names, dtype=torch.float64)

    def take_samples(self, ctx):
        from distmetrics.reduce import Sample

        return [Sample("layer_stats", self.values, "mean", names=self.names)]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


def _console_to_devnull():
    """The console sink formats and writes its lines as in a run, to /dev/null."""
    import logging

    logger = logging.getLogger("distmetrics.console")
    logger.handlers = [logging.StreamHandler(open(os.devnull, "w"))]
    logger.propagate = False


def _timed_log_steps(baseline: str, calls: dict, repeats: int, warmup: int = 3, least_s: float = 0.0,
                     sync: Callable = lambda: None) -> dict:
    """``calls``: name -> (call(step), drain()). For each call: the median seconds, the median of
    its ``drain`` (the writer thread finishing what the call queued: waited for after each call
    and timed apart, so no writer work lands inside another call's figure), and the median of
    its ratio to the ``baseline`` call of the same round. The calls of a round run back to
    back, in alternating order, so load from other processes that comes and goes weighs on
    both sides of each ratio alike. Rounds go on past ``repeats`` until ``least_s`` seconds
    have passed, so that short calls are sampled over more than one burst of other load.
    ``sync`` waits for the device inside each call's time (queued GPU work counts)."""
    times = {name: ([], []) for name in calls}
    until = time.perf_counter() + least_s
    i = 0
    while i < warmup + repeats or time.perf_counter() < until:
        order = list(calls) if i % 2 == 0 else list(reversed(calls))  # neither always goes first
        for name in order:
            call, drain = calls[name]
            t = time.perf_counter(); call(i + 1); sync(); took = time.perf_counter() - t
            t = time.perf_counter(); drain(); drained = time.perf_counter() - t
            if i >= warmup:
                times[name][0].append(took)
                times[name][1].append(drained)
        i += 1
    base = times[baseline][0]
    return {name: (statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, base)))
            for name, (a, b) in times.items()}


def bench_every_step_logging(repeats: int, modules: int = 300, params: float = 20e6, device: str = "cpu") -> dict:
    """(a) per-module norms + clip + the log step at log_interval 1 with JSONL, TensorBoard and
    the console on, against torch.nn.utils.clip_grad_norm_ alone (and the same with no sink, to
    show what the sinks add)."""
    import tempfile

    import distmetrics as dm

    _console_to_devnull()
    model = stack_model(modules, params, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    plist = list(model.parameters())
    huge = 1e9  # clipping math runs, scaling is by 1.0: repeats see the same gradients
    with tempfile.TemporaryDirectory() as out:
        cfg = dm.MetricsConfig(output_dir=out, log_interval=1, json_log=True, tensorboard=True, console=True,
                               log_progress=False)
        sinks = dm.Monitor(cfg, model=model)
        bare = dm.Monitor(cfg.replace(json_log=False, tensorboard=False, console=False), model=model)
        calls = {"torch": (lambda step: torch.nn.utils.clip_grad_norm_(plist, huge), lambda: None)}
        for name, monitor in (("sinks", sinks), ("bare", bare)):
            calls[name] = (lambda step, m=monitor: (m.clip_grad_norm_(huge), m.step(step)), monitor.sinks.flush)
        timed = _timed_log_steps("torch", calls, repeats, sync=sync)
        names = len(sinks.last_metrics)
        sinks.close()
        bare.close()
    (base, _, _), (ours, writer, ratio) = timed["torch"], timed["sinks"]
    return {"modules": modules, "params_m": round(sum(p.numel() for p in plist) / 1e6, 1), "names": names,
            "torch_clip_ms": base * 1e3, "ours_ms": ours * 1e3, "writer_ms": writer * 1e3,
            "ours_vs_torch_clip": ratio, "with_writer_vs_torch_clip": ratio + writer / base,
            "no_sinks_ms": timed["bare"][0] * 1e3, "no_sinks_vs_torch_clip": timed["bare"][2]}


def _wait_for_wandb(monitor, most_s: float = 120.0) -> None:
    """Wait until the W&B sink's run exists: ``wandb.init`` is seconds of work on a thread of its
    own, once per job, and would otherwise compete with every timed call of a short benchmark.
    The figures are a running job's."""
    deadline = time.monotonic() + most_s
    for sink in monitor.sinks.queued:
        while getattr(sink, "starting", False) and time.monotonic() < deadline:
            time.sleep(0.05)


SINKS_LEAST_S = 2.0
"""Seconds each size of 6b is sampled at least: at 10 names a round takes half a millisecond,
and the background work of W&B's client and service comes in bursts longer than 150 rounds."""


def bench_sinks_log_step(sizes, repeats: int) -> list[dict]:
    """(b) the log step on the training thread with every sink on (JSONL, progress.txt, console,
    TensorBoard, W&B offline) against no sink, at ``sizes`` metric names, once W&B's run exists
    (:func:`_wait_for_wandb`); then the JSONL sink alone against no sink, to show how much of
    what every sink adds is the line written on the training thread; then the least a line on the
    training thread can cost (:class:`_BareLine`: the record encoded by orjson and written, nothing
    else) against no sink, the floor under the JSONL sink's figure. Each pair is timed in rounds
    of its own: a third call in the same rounds changes which call follows the writer thread's
    and W&B's work, and with it both ratios (all against none read 1.03-1.15x that way)."""
    import importlib.util
    import tempfile

    import distmetrics as dm

    _console_to_devnull()
    os.environ.setdefault("WANDB_SILENT", "true")  # W&B's banner and run summary are not the benchmark's output
    wandb = importlib.util.find_spec("wandb") is not None
    rows = []
    for names in sizes:
        with tempfile.TemporaryDirectory() as out:
            every = dm.MetricsConfig(output_dir=out, log_interval=1, wandb_project="benchmark" if wandb else None,
                                     wandb_mode="offline")
            none = every.replace(json_log=False, console=False, log_progress=False, tensorboard=False,
                                 wandb_project=None)
            monitors = {"none": dm.Monitor(none, collectors=[_NamedValues(names)]),
                        "all": dm.Monitor(every, collectors=[_NamedValues(names)]),
                        "jsonl": dm.Monitor(none.replace(json_log=True, output_dir=os.path.join(out, "jsonl")),
                                            collectors=[_NamedValues(names)]),
                        "bare": dm.Monitor(none.replace(output_dir=os.path.join(out, "bare")),
                                           sinks=[_BareLine(os.path.join(out, "bare.jsonl"))],
                                           collectors=[_NamedValues(names)])}
            _wait_for_wandb(monitors["all"])
            calls = {name: (lambda _, m=m, steps=itertools.count(1): m.step(next(steps), loss=1.0), m.sinks.flush)
                     for name, m in monitors.items()}  # each monitor counts its own steps over both pairs
            timed = _timed_log_steps("none", {k: calls[k] for k in ("none", "all")}, repeats, least_s=SINKS_LEAST_S)
            alone = _timed_log_steps("none", {k: calls[k] for k in ("none", "jsonl")}, repeats, least_s=SINKS_LEAST_S)
            floor = _timed_log_steps("none", {k: calls[k] for k in ("none", "bare")}, repeats, least_s=SINKS_LEAST_S)
            for monitor in monitors.values():
                monitor.close()
        (base, _, _), (ours, writer, ratio) = timed["none"], timed["all"]
        (base_alone, _, _), (jsonl, _, jsonl_ratio) = alone["none"], alone["jsonl"]
        (base_floor, _, _), (bare, _, bare_ratio) = floor["none"], floor["bare"]
        rows.append({"names": names, "wandb": wandb, "no_sinks_ms": base * 1e3, "all_sinks_ms": ours * 1e3,
                     "writer_ms": writer * 1e3, "all_vs_none": ratio, "jsonl_pair_no_sinks_ms": base_alone * 1e3,
                     "jsonl_only_ms": jsonl * 1e3, "jsonl_vs_none": jsonl_ratio,
                     "bare_pair_no_sinks_ms": base_floor * 1e3, "bare_line_ms": bare * 1e3,
                     "bare_line_vs_none": bare_ratio})
    return rows


class _BareLine:
    """The least a line written on the training thread costs: the record as orjson encodes it
    (NaN as null, no check, no kind, step or time) and one ``write``. Not a sink to use: it
    measures the floor that encoding and writing a line put under any such sink."""

    name = "bare_line"
    fix = ""
    on_training_thread = True

    def __init__(self, path: str) -> None:
        import orjson

        self._dumps, self._newline = orjson.dumps, orjson.OPT_APPEND_NEWLINE
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(self, metrics: dict, step: int, kind: str) -> None:
        os.write(self._fd, self._dumps(metrics, option=self._newline))

    def close(self) -> None:
        os.close(self._fd)



# --- 7. command-line start-up --------------------------------------------------------------------

def bench_cli(repeats: int) -> dict:
    """Wall time of ``distmetrics summary`` on a small run, a whole process as a user runs it,
    against a process that imports the package's torch-using modules (what every command paid
    while the package imported torch at once)."""
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        records = [{"kind": "run", "step": 0, "world_size": 2}] + \
                  [{"kind": "train", "step": s, "train/loss": 1.0 / s} for s in range(10, 90, 10)]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

        def run(*args: str) -> None:
            subprocess.run([sys.executable, *args], check=True, capture_output=True, cwd=root)

        base, cand = median_pair(lambda: run("-c", "import distmetrics.monitor"),
                                 lambda: run("-m", "distmetrics.cli", "summary", str(path)), repeats, warmup=1)
    return {"summary_ms": cand * 1000, "torch_modules_import_ms": base * 1000, "faster": base / cand}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    p.add_argument("--out", default="runs/benchmarks.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the norm benchmark's model and gradients live (default: cuda when there is one)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    repeats = 5 if args.quick else 15
    norm_sizes = [(50, 20e6), (200, 20e6), (1000, 20e6)] + ([] if args.quick else [(200, 100e6)])
    results = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "cpus": os.cpu_count(), "cuda": torch.cuda.is_available(), "norms_device": args.device}}
    print(f"1. clip_grad_norm_ with per-module norms ({args.device})", flush=True)
    results["norms"] = bench_norms(norm_sizes, repeats, args.device)
    for r in results["norms"]:
        print(f"   {r['modules']:5d} modules {r['params_m']:6.1f}M params: torch clip {r['torch_clip_ms']:8.2f} ms | "
              f"ours {r['ours_ms']:8.2f} ms = {r['ours_vs_torch_clip']:.3f}x (target <= 1.10) | "
              f"naive loop {r['naive_ms']:8.2f} ms = {r['naive_vs_ours']:.2f}x ours (target >= 20 at 200)", flush=True)
        print(f"         what per-module norms add: ours {r['ours_ms'] - r['torch_clip_ms']:+.2f} ms over torch clip | "
              f"the naive loop alone {r['naive_loop_only_ms']:.2f} ms", flush=True)
    print("2. collectives per log step, 4 gloo ranks (and 4b. timers at a log step)", flush=True)
    coll = bench_collectives([10, 200, 1000] if not args.quick else [10, 200], repeats)
    results["collectives"] = coll["reduce"]
    results["timer_log_step"] = coll["timers"]
    for r in coll["reduce"]:
        print(f"   {r['names']:5d} names: ours {r['collectives_ours']:.0f} collectives, {r['bytes_ours']} B | "
              f"per-key {r['collectives_per_key']} collectives, {r['bytes_per_key']} B | "
              f"per-key {r['per_key_ms']:.2f} ms vs ours {r['ours_ms']:.2f} ms = {r['per_key_vs_ours']:.1f}x", flush=True)
    for r in coll["timers"]:
        print(f"   log step with {r['timers']:4d} timers: {r['log_step_ms']:.2f} ms", flush=True)
    print("3. non-log-step overhead, FSDP2 step on 2 ranks, log_interval=10", flush=True)
    results["training"] = bench_training(20 if args.quick else 60)
    t = results["training"]
    print(f"   off {t['step_off_ms']:.2f} ms | on {t['step_on_ms']:.2f} ms = {t['overhead_pct']:+.2f}% (target <= 1%) | "
          f"{t['non_log_collectives']} collectives, {t['non_log_items']} .item() in {t['non_log_steps_counted']} "
          "non-log monitor steps", flush=True)
    print("4. timers", flush=True)
    results["timers"] = bench_timer_pairs(20000 if args.quick else 100000, repeats)
    print(f"   start+stop: enabled {results['timers']['enabled_pair_us']:.2f} us (target <= 2) | "
          f"disabled {results['timers']['disabled_pair_us']:.3f} us (target <= 0.3)", flush=True)
    print("4c. a tensor-statistics hook on a step the features file does not select", flush=True)
    results["inspect_hook"] = h = bench_inspect_hook(20000 if args.quick else 100000, repeats)
    print(f"   nn.Identity forward: unhooked {h['unhooked_forward_us']:.2f} us | hooked "
          f"{h['hooked_forward_us']:.2f} us = +{h['hook_us']:.2f} us a forward (a hook that does nothing: "
          f"+{h['noop_hook_us']:.2f} us)", flush=True)
    print("5. update norms", flush=True)
    results["update_norms"] = bench_update_norms(20e6, repeats)
    u = results["update_norms"]
    print(f"   optimizer.step on a log step {u['log_step_ms']:.2f} ms vs non-log {u['non_log_step_ms']:.2f} ms = "
          f"{u['log_vs_non_log']:.2f}x; snapshot {u['snapshot_mib']:.0f} MiB on log steps only", flush=True)
    print(f"6a. every-step logging: clip + log step, JSONL + TensorBoard + console, log_interval=1 ({args.device})",
          flush=True)
    results["every_step_logging"] = e = bench_every_step_logging(3 * repeats, device=args.device)  # more rounds
    print(f"   {e['modules']} modules {e['params_m']}M params ({e['names']} names): torch clip {e['torch_clip_ms']:.2f} ms | "
          f"ours {e['ours_ms']:.2f} ms = {e['ours_vs_torch_clip']:.3f}x (target <= 1.10) | with no sink "
          f"{e['no_sinks_ms']:.2f} ms = {e['no_sinks_vs_torch_clip']:.3f}x | writer thread {e['writer_ms']:.2f} ms "
          f"per record, off the training thread ({e['with_writer_vs_torch_clip']:.3f}x if it were on it)", flush=True)
    print("6b. log step on the training thread: every sink (JSONL, progress, console, TensorBoard, W&B offline) "
          "vs none", flush=True)
    results["sinks_log_step"] = bench_sinks_log_step([10, 200, 1000, 5000], 10 * repeats)
    for r in results["sinks_log_step"]:
        print(f"   {r['names']:5d} names: no sinks {r['no_sinks_ms']:.2f} ms | all sinks {r['all_sinks_ms']:.2f} ms = "
              f"{r['all_vs_none']:.3f}x (target <= 1.2){'' if r['wandb'] else ' (W&B not installed)'} | writer "
              f"thread {r['writer_ms']:.2f} ms per record", flush=True)
        print(f"         JSONL alone: no sinks {r['jsonl_pair_no_sinks_ms']:.2f} ms | JSONL {r['jsonl_only_ms']:.2f} ms = "
              f"{r['jsonl_vs_none']:.3f}x", flush=True)
        print(f"         a bare line (orjson + write, nothing else): no sinks {r['bare_pair_no_sinks_ms']:.2f} ms | "
              f"bare line {r['bare_line_ms']:.2f} ms = {r['bare_line_vs_none']:.3f}x", flush=True)
    from benchmarks import cold

    results.update(cold.main(4 * repeats))
    print("7. command-line start-up (whole process)", flush=True)
    results["cli"] = bench_cli(repeats)
    c = results["cli"]
    print(f"   distmetrics summary {c['summary_ms']:.0f} ms | a process importing the torch-using modules "
          f"{c['torch_modules_import_ms']:.0f} ms = {c['faster']:.0f}x faster (target < 1 s)", flush=True)
    from benchmarks import scale

    results.update(scale.main())  # sections 8 and up: what grows with the world size
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"written: {out}")
    return results


if __name__ == "__main__":
    main()
