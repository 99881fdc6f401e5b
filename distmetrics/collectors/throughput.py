"""Throughput: tokens/s, step time, TFLOP/s per GPU, MFU and ETA, from the log interval.

The interval's wall time is measured between log steps on every rank (no device sync: the
log step's reduction already waits for the device, so log-to-log time covers all the work
queued in between) and reduced as a max across ranks: the job goes at its slowest rank's pace.
Tokens are counted on one rank per data-parallel replica (see ``Layout.is_data_representative``)
and summed, so tensor- and pipeline-parallel peers do not count a batch twice.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

from ..reduce import Sample

__all__ = ["ThroughputCollector", "mfu_pct", "peak_tflops_for", "resolve_peak_tflops", "model_flops_per_token",
           "PEAK_TFLOPS"]

# Dense peak TFLOP/s of one GPU by math precision (no structured sparsity), from the vendors'
# data sheets. Matched against torch.cuda.get_device_name() in order: the first key contained
# in the name wins, so the more specific names come first.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0, "fp8": 4500.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6, "fp8": 733.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_tflops_for(device_name: str, dtype: str) -> Optional[float]:
    """The peak for a GPU name and precision, or None when the table does not know it."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(dtype)
    return None


def resolve_peak_tflops(config: Any, rank: int = 0) -> Optional[float]:
    """``peak_tflops`` from the config, else the table's value for this GPU and ``dtype``."""
    import torch

    if config.peak_tflops is not None:
        return config.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    peak = peak_tflops_for(name, config.dtype)
    if peak is None and rank == 0 and config.resolved_flops_per_token:
        logging.getLogger("distmetrics").warning(
            "distmetrics: no peak TFLOP/s known for %r in %s; set peak_tflops for MFU", name, config.dtype)
    return peak


def model_flops_per_token(num_params: float, num_layers: Optional[int] = None, hidden_size: Optional[int] = None,
                          seq_length: Optional[int] = None, num_active_params: Optional[float] = None) -> float:
    """Training FLOPs per token: 6·N (N = parameters active per token, for MoE the routed
    subset) plus attention's 12·L·h·s (QKᵀ and AV, forward and backward)."""
    active = num_active_params if num_active_params else num_params
    attention = 12.0 * num_layers * hidden_size * seq_length if num_layers and hidden_size and seq_length else 0.0
    return 6.0 * active + attention


class ThroughputCollector:
    """Interval time and token counts → throughput metrics."""

    def __init__(self, world_size: int, flops_per_token: Optional[float] = None,
                 peak_tflops: Optional[float] = None, total_steps: Optional[int] = None,
                 sol_step_time_ms: Optional[float] = None) -> None:
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.total_steps = total_steps
        self.sol_step_time_ms = sol_step_time_ms
        self._t0 = time.perf_counter()
        self._paused_at: Optional[float] = None
        self._paused_s = 0.0
        self.consumed_tokens = 0.0
        self.total_flops = 0.0
        self._steps = 0
        self._mfu_warned = False

    def pause(self) -> None:
        """Stop the training clock (evaluation, checkpointing)."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def samples(self, steps: int) -> list[Sample]:
        self.resume()
        now = time.perf_counter()
        seconds, self._t0 = now - self._t0 - self._paused_s, now
        self._paused_s = 0.0
        self._steps = steps
        return [Sample("_train/interval_s", seconds, "max")]

    def finalize(self, metrics: dict[str, Any], step: int) -> None:
        seconds = metrics.get("_train/interval_s")
        tokens = metrics.get("_train/tokens")
        if not seconds or seconds <= 0 or self._steps <= 0:
            return
        step_s = seconds / self._steps
        metrics["train/step_time_ms"] = step_s * 1000.0
        if self.sol_step_time_ms:
            metrics["train/sol_pct"] = 100.0 * self.sol_step_time_ms / (step_s * 1000.0)
        if self.total_steps:
            metrics["train/eta_s"] = max(0, self.total_steps - step) * step_s
        if tokens is None:
            return
        self.consumed_tokens += tokens
        metrics["train/consumed_tokens"] = self.consumed_tokens
        metrics["train/tokens_per_sec"] = tokens / seconds
        metrics["train/tokens_per_sec_per_gpu"] = tokens / seconds / self.world_size
        if self.flops_per_token:
            flops = tokens * self.flops_per_token
            self.total_flops += flops
            tflops = flops / seconds / self.world_size / 1e12
            metrics["train/tflops_per_gpu"] = tflops
            if self.peak_tflops:
                mfu = mfu_pct(tflops, self.peak_tflops)
                metrics["train/mfu_pct"] = mfu
                if mfu > 100.0 and not self._mfu_warned:
                    self._mfu_warned = True
                    logging.getLogger("distmetrics").warning(
                        "distmetrics: MFU %.1f%% is above 100%%: peak_tflops=%.1f or flops_per_token=%.3g "
                        "is wrong for this GPU and model", mfu, self.peak_tflops, self.flops_per_token)


def mfu_pct(tflops_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in percent."""
    return 100.0 * tflops_per_gpu / peak_tflops if peak_tflops > 0 else math.nan
