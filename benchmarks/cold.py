"""Section 6c: what a log step costs right after a CPU clip, and why.

Torch's clip of 20M parameters sweeps about 160 MB through the caches; the code that runs next
finds neither its instructions nor its data there. This section measures that effect on one
small tensor operation and counts, at torch's dispatcher, the tensor operations that the clip
and the log step make, since on a CPU run each one costs about what its first touch costs.

    python -m benchmarks.cold
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from tests.dist_utils import clip_and_log_step_ops, count_ops


def _median_us(call, before, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def op_after_sweep(repeats: int) -> dict:
    """One small tensor operation (``torch.zeros(605)``) back to back, and right after a sweep of
    20M floats (``big.mul_(1.0)``, the clip's memory traffic)."""
    big = torch.randn(20_000_000)
    op = lambda: torch.zeros(605, dtype=torch.float64)  # noqa: E731
    warm = _median_us(op, lambda: None, repeats)
    cold = _median_us(op, lambda: big.mul_(1.0), repeats)
    return {"warm_us": warm, "after_sweep_us": cold, "ratio": cold / warm}


def operations(modules: int = 300, params: float = 20e6) -> dict:
    """Tensor operations of one clip and of one log step (one process, every module's norms), beside
    those of one ``torch.nn.utils.clip_grad_norm_`` of the same gradients (its ``to`` per parameter
    onto the device it is already on dispatches nothing, so it is not counted)."""
    import distmetrics as dm
    from benchmarks.run import stack_model

    model = stack_model(modules, params)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with tempfile.TemporaryDirectory() as out:
        cfg = dm.MetricsConfig(output_dir=out, log_interval=1, json_log=False, tensorboard=False, console=False,
                               log_progress=False)
        monitor = dm.Monitor(cfg, model=model)
        clip, log_step = clip_and_log_step_ops(monitor, 1e9)
        after_clip = []
        for step in range(4, 34):
            monitor.clip_grad_norm_(1e9)
            start = time.perf_counter()
            monitor.step(step)
            after_clip.append(time.perf_counter() - start)
        monitor.close()
    torch_clip = count_ops(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    return {"modules": modules, "clip_ops": sum(clip.values()), "log_step_ops": sum(log_step.values()),
            "torch_clip_ops": sum(torch_clip.values()), "log_step_after_clip_ms": statistics.median(after_clip) * 1e3}


def main(repeats: int = 60) -> dict:
    """Print and return section 6c."""
    print("6c. a log step right after a CPU clip (one process, no sink)", flush=True)
    op = op_after_sweep(repeats)
    print(f"   torch.zeros(605): back to back {op['warm_us']:.1f} us | right after a 20M-float sweep "
          f"{op['after_sweep_us']:.1f} us = {op['ratio']:.0f}x", flush=True)
    ops = operations()
    print(f"   {ops['modules']} modules: the clip makes {ops['clip_ops']} tensor operations, the log step "
          f"{ops['log_step_ops']} (torch's clip {ops['torch_clip_ops']}); the log step right after the clip "
          f"{ops['log_step_after_clip_ms']:.2f} ms",
          flush=True)
    return {"cold": {"op": op, "operations": ops}}


if __name__ == "__main__":
    main()
