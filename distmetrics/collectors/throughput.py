"""Throughput: tokens/s, step time, TFLOP/s per GPU, MFU and ETA, from the log interval.

The interval's wall time is measured between log steps on every rank (no device sync: the
log step's reduction already waits for the device, so log-to-log time covers all the work
queued in between) and reduced as a max across ranks: the job goes at its slowest rank's pace.
Tokens are counted on one rank per data-parallel replica (see ``Layout.is_data_representative``)
and summed, so tensor- and pipeline-parallel peers do not count a batch twice.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from ..reduce import Sample

__all__ = ["ThroughputCollector", "mfu_pct"]


class ThroughputCollector:
    """Interval time and token counts → throughput metrics."""

    def __init__(self, world_size: int, flops_per_token: Optional[float] = None,
                 peak_tflops: Optional[float] = None, total_steps: Optional[int] = None) -> None:
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.total_steps = total_steps
        self._t0 = time.perf_counter()
        self.consumed_tokens = 0.0
        self.total_flops = 0.0
        self._steps = 0
        self._mfu_warned = False

    def restart_clock(self) -> None:
        """Start the interval now (after a pause such as evaluation or a checkpoint)."""
        self._t0 = time.perf_counter()

    def samples(self, steps: int) -> list[Sample]:
        now = time.perf_counter()
        seconds, self._t0 = now - self._t0, now
        self._steps = steps
        return [Sample("_train/interval_s", seconds, "max")]

    def finalize(self, metrics: dict[str, Any], step: int) -> None:
        seconds = metrics.get("_train/interval_s")
        tokens = metrics.get("_train/tokens")
        if not seconds or seconds <= 0 or self._steps <= 0:
            return
        step_s = seconds / self._steps
        metrics["train/step_time_ms"] = step_s * 1000.0
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
                    import logging

                    self._mfu_warned = True
                    logging.getLogger("distmetrics").warning(
                        "distmetrics: MFU %.1f%% is above 100%%: peak_tflops=%.1f or flops_per_token=%.3g "
                        "is wrong for this GPU and model", mfu, self.peak_tflops, self.flops_per_token)


def mfu_pct(tflops_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in percent."""
    return 100.0 * tflops_per_gpu / peak_tflops if peak_tflops > 0 else math.nan
