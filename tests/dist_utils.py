"""Helpers shared by the tests and the benchmarks: run a function on N real gloo ranks
(processes forked from a server that imported torch once) and collect what each returns; run a
fresh interpreter on this checkout; count collectives and host syncs; a clock the test advances
by hand; a config with every sink off.

Every scenario of a test module runs inside one run of ranks where it can (2 cores here), and
the parent kills the workers after a timeout, so a hang fails a test instead of stalling CI.
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
"""The project folder (what a child interpreter imports ``distmetrics`` and ``tests`` from)."""


_PORTS: list = []


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to a socket bound to port 0 or connecting out."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # IANA's dynamic range, as macOS and Windows use


def free_port() -> int:
    """A free TCP port for a rendezvous (``MASTER_PORT``), below the kernel's ephemeral range.

    A port taken from that range (bind to port 0, then closed) could be handed to another socket,
    an outgoing connection or gloo's listener in another test worker's ranks, before rank 0's store
    bound it: rank 0 failed with EADDRINUSE and the other ranks connected to that stranger and waited
    (a 180 s timeout and every test of a module in error, with 3 pytest workers on 2 cores). Below the
    range only a process that names a port takes it; each pytest worker walks a slice of its own, so
    two workers never pick the same port, and a port in use (or held in TIME_WAIT) is skipped."""
    low = _ephemeral_low()
    first, span = 20000, low - 20000
    if span < 800:  # a machine whose ephemeral range starts low: take one from it, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    slices = 8
    width = span // slices
    index = int(worker[2:]) % slices if worker[2:].isdigit() else 0
    if not _PORTS:
        _PORTS.append(os.getpid() % width)  # where this process starts in its slice: runs of the suite apart
    for _ in range(width):
        port = first + index * width + _PORTS[0] % width
        _PORTS[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first + index * width}-{first + (index + 1) * width - 1}")


_CONTEXT: list = []


def _context() -> Any:
    """A forkserver that has imported torch, torch.distributed, distmetrics and megatron.core
    (where installed) once: each rank forks from it instead of importing them again in a fresh
    interpreter (1.5 s of CPU per rank on this machine for torch, 5 s more for megatron.core:
    most of a short scenario). The server is the suite's, started by the first run; a rank takes
    the parent's environment as it is at the call (:func:`_entry`), not the server's."""
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "distmetrics", "tests.dist_utils", "megatron.core"])
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _entry(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple, env: dict,
           threads: int | None) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    try:
        if threads is not None:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 180.0, env: dict | None = None,
              may_die: tuple = (), threads: int | None = 1) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; returns results by rank (None for a
    rank in ``may_die`` that never reported, e.g. one the test killed).

    Each rank computes on ``threads`` intra-op threads: 1, as torchrun starts several workers
    (``OMP_NUM_THREADS`` in the environment wins, as there); None keeps the server's, one per core.
    2-4 ranks of 2 threads each on 2 cores spent most of a small model's step in OpenMP's spin-waits
    (the FSDP2 layouts of ``tests/test_norms.py`` took 4 times as long).

    Results travel through a multiprocessing queue: return plain Python values, not tensors."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, env, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world - len(may_die)):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
    except Exception as err:  # queue.Empty: some rank hung
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(err).__name__}); "
                      f"finished: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(world)]


def run_python(*args: Any, timeout: float = 120, cwd: Any = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python *args`` (``-c CODE ...``, ``-m distmetrics.cli ...``) in a fresh interpreter that
    imports this checkout's ``distmetrics`` and ``tests`` (``PYTHONPATH``), ``env`` added to the
    environment; stdout and stderr captured as text."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # ours first, kept
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def run_child(function: str, *args: Any, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """``function(*args)`` in a fresh interpreter, ``function`` named as ``"tests.test_x._child"``."""
    module, name = function.rsplit(".", 1)
    code = f"import sys; from {module} import {name} as f; f(*sys.argv[1:])"
    return run_python("-c", code, *args, timeout=timeout, env=env)


def count_ops(call: Callable[[], Any]) -> collections.Counter:
    """The tensor operations ``call()`` dispatches, by name (counted at torch's dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        call()
    return counter.ops


def clip_and_log_step_ops(monitor: Any, max_norm: float) -> tuple:
    """After two steps (plans and layouts made): the tensor operations of one
    ``monitor.clip_grad_norm_(max_norm)`` and of the log step after it (``log_interval: 1``)."""
    for step in (1, 2):
        monitor.clip_grad_norm_(max_norm)
        monitor.step(step)
    clip = count_ops(lambda: monitor.clip_grad_norm_(max_norm))
    return clip, count_ops(lambda: monitor.step(3))


class CollectiveCounter:
    """Counts torch.distributed collectives and Tensor.item() calls (patched at the module
    boundary the library calls through)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
             "all_gather_single", "broadcast", "barrier", "reduce_scatter_tensor", "gather", "scatter",
             "all_to_all", "reduce", "broadcast_object_list", "gather_object")

    def __init__(self) -> None:
        self.collectives = 0
        self.items = 0
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveCounter":
        import torch
        import torch.distributed as dist

        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def wrapper(*a, __orig=original, **k):
                self.collectives += 1
                return __orig(*a, **k)

            setattr(dist, name, wrapper)
        original_item = torch.Tensor.item
        self._saved["item"] = original_item

        def item(t, __orig=original_item):
            self.items += 1
            return __orig(t)

        torch.Tensor.item = item
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch
        import torch.distributed as dist

        for name, original in self._saved.items():
            if name == "item":
                torch.Tensor.item = original
            else:
                setattr(dist, name, original)


class HostReads:
    """Counts what would wait for the device on a GPU: reads of a tensor's value on the host
    (``item``, ``tolist``, ``numpy``, ``float()``, ``int()``, ``bool()``, patched on ``torch.Tensor``:
    on the CPU some never reach the dispatcher) and the operators whose result's size or value the
    host needs (``nonzero``, a boolean mask's index, ``masked_select``, ``unique``, ``equal``,
    ``allclose``, ``bincount``, ``repeat_interleave`` by a tensor, a scalar read: counted by a dispatch
    mode, on this thread) while entered."""

    NAMES = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__")
    SYNCING = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "equal", "allclose",
               "_local_scalar_dense", "is_nonzero", "bincount", "_assert_async")

    def __init__(self) -> None:
        self.reads = 0
        self.seen: list = []  # what was counted, in order
        self._saved: dict = {}
        self._mode: Any = None

    def __enter__(self) -> "HostReads":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Syncing(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in HostReads.SYNCING or (name == "repeat_interleave" and func._overloadname == "Tensor") or (
                        name in ("index", "index_put", "index_put_") and any(
                        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                        for i in (args[1] if len(args) > 1 else ()) if i is not None)):  # a mask: its size
                    counter._count(name)
                return func(*args, **(kwargs or {}))

        for name in self.NAMES:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            original = getattr(torch.Tensor, name)

            def read(t, *a, __orig=original, __name=name, **k):
                counter._count(__name)
                return __orig(t, *a, **k)

            setattr(torch.Tensor, name, read)
        self._mode = Syncing()
        self._mode.__enter__()
        return self

    def _count(self, what: str) -> None:
        if self.seen and self.seen[-1] in self.NAMES and what == "_local_scalar_dense":
            return  # item() and the like reach the dispatcher too: one read
        self.reads += 1
        self.seen.append(what)

    def __exit__(self, *exc: Any) -> None:
        import torch

        self._mode.__exit__(*exc)
        for name, own in self._saved.items():
            if own is None:  # inherited from torch's C base class: our wrapper goes, the base's shows again
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)


class FakeClock:
    """A clock that moves only when the test calls :meth:`advance`, so a duration the library
    measures is a number the test chose, not a sleep's wall time.

    As a context manager it replaces the ``time`` name of the library modules that read step and
    timer durations (:attr:`MODULES`: the interval clock of the step time and the straggler
    scores, the timers) with this object: their ``time.perf_counter()`` and ``time.perf_counter_ns()`` read the fake, every other
    ``time`` function stays real, and the ``time`` module itself and everyone else's reads of it
    are untouched. On exit the modules get ``time`` back."""

    MODULES = ("distmetrics.collectors.timer", "distmetrics.interval")

    def __init__(self, start_s: float = 100.0) -> None:
        self.ns = round(start_s * 1e9)
        self._saved: dict = {}

    def advance(self, ms: float) -> None:
        """Let ``ms`` milliseconds pass."""
        self.ns += round(ms * 1e6)

    def perf_counter(self) -> float:
        """The fake reading in seconds."""
        return self.ns / 1e9

    def perf_counter_ns(self) -> int:
        """The fake reading in nanoseconds."""
        return self.ns

    def __getattr__(self, name: str) -> Any:
        import time

        return getattr(time, name)

    def __enter__(self) -> "FakeClock":
        import importlib

        for name in self.MODULES:
            module = importlib.import_module(name)
            self._saved[name] = module.time
            module.time = self
        return self

    def __exit__(self, *exc: Any) -> None:
        import importlib

        for name, saved in self._saved.items():
            importlib.import_module(name).time = saved
        self._saved.clear()


def quiet_config(**extra: Any):
    """A MetricsConfig with every sink, timer and host-side collector off; ``extra`` turns
    things back on (e.g. ``log_interval=1, json_log=True``)."""
    import distmetrics as dm

    cfg = dict(output_dir="unused", json_log=False, console=False, log_progress=False, tensorboard=False,
               timing_log_level=-1, log_throughput=False, log_memory=False, straggler_window=0)
    cfg.update(extra)
    return dm.MetricsConfig(**cfg)


def squares_by_name(pieces: dict, world: int) -> dict:
    """Float64 ground truth of sharded tensors: every rank's ``{(global name, partition): ‖piece‖²}``
    gathered, each key counted once (replicas and tied copies carry the same key and value),
    summed per global name."""
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, pieces)
    merged: dict = {}
    for rank_pieces in gathered:
        merged.update(rank_pieces)
    out: dict = {}
    for (name, _), square in merged.items():
        out[name] = out.get(name, 0.0) + square
    return out


def subtree_norms(squares: dict) -> dict:
    """Per-parameter ‖·‖² keyed by global name → ``{"total": ‖·‖, "modules": {module: ‖·‖}}``, a
    module's norm taken over every parameter below it; the root's own parameters are ``"model"``."""
    import math

    modules: dict = {}
    for name, square in squares.items():
        parts = name.split(".")[:-1]
        for module in [".".join(parts[:i]) for i in range(1, len(parts) + 1)] or ["model"]:
            modules[module] = modules.get(module, 0.0) + square
    return {"total": math.sqrt(sum(squares.values())), "modules": {m: math.sqrt(v) for m, v in modules.items()}}
