"""Throughput: tokens/s, step time, TFLOP/s per GPU, MFU, SOL and ETA, from the log interval.

The interval's wall time (``LogContext.interval_s``) is measured between log steps on every
rank, from the first ``monitor.step`` on (the first interval times the steps after the first:
``LogContext.timed_steps`` and ``timed_tokens``), with no device sync (the log step's reduction
already waits for the device, so log-to-log time covers all the work queued in between), and
reduced as a max across ranks: the job goes at its slowest rank's pace. Tokens
(``LogContext.tokens``) are counted on one rank per data-parallel replica
(:func:`distmetrics.parallel.counts_batch_tokens`) and summed, so tensor- and pipeline-parallel
peers do not count a batch twice. Where a rank that counts them is given ``tokens=None`` at some
timed step while tokens are given in the interval (``LogContext.tokenless_steps``), those steps'
tokens are not known: the known ones over every step's time would read too low, so the record has
no tokens/s, TFLOP/s or MFU, said once.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..flops import PEAK_TFLOPS, is_mig, mfu_pct, model_flops_per_token, peak_tflops_for
from .base import Alert, LogContext, Sample

__all__ = ["ThroughputCollector", "resolve_peak_tflops", "shared_throughput", "mfu_pct", "peak_tflops_for",
           "model_flops_per_token", "PEAK_TFLOPS"]

logger = logging.getLogger("distmetrics")


def resolve_peak_tflops(config: Any, warns: bool = True) -> Optional[float]:
    """``peak_tflops`` from the config, else the table's value for this GPU and ``dtype``;
    ``warns``: say when there is none (on one rank of the job: every rank would say it)."""
    import torch

    if config.peak_tflops is not None:
        return config.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    peak = peak_tflops_for(name, config.dtype)
    if peak is None and warns and config.resolved_flops_per_token:
        why = " (a MIG instance: a slice of the GPU's peak)" if is_mig(name) else ""
        logger.warning("distmetrics: no peak TFLOP/s known for %r%s in %s; set peak_tflops for MFU", name, why,
                       config.dtype)
    return peak


def shared_throughput(config: Any) -> dict:
    """What start-up compares between ranks of the numbers each rank derives from its own config after
    the reduction (``monitor.step`` returns the same dict on every rank only where they agree): the FLOPs
    per token as a float (from ``flops_per_token`` or the model description: ``6000000`` and ``6e6`` agree,
    a ``num_params`` that ``flops_per_token`` overrides is not compared), the peak MFU is computed over
    (the config's, or the one looked up for this rank's GPU and ``dtype``: ranks of GPU models with other
    peaks would each compute another MFU), and ``sol_step_time_ms``; None for what is not computed
    (``log_throughput`` off, no FLOPs for MFU)."""
    import torch

    if not config.log_throughput:
        return dict.fromkeys(("flops_per_token", "peak_tflops", "sol_step_time_ms"))
    flops = config.resolved_flops_per_token
    peak = None
    if flops and config.peak_tflops is not None:
        peak = float(config.peak_tflops)
    elif flops and torch.cuda.is_available():
        peak = f"{resolve_peak_tflops(config, warns=False)!r} looked up for this rank's GPU in {config.dtype}"
    sol = config.sol_step_time_ms
    return {"flops_per_token": float(flops) if flops else None, "peak_tflops": peak,
            "sol_step_time_ms": None if sol is None else float(sol)}


class ThroughputCollector:
    """Interval time and token counts → throughput metrics (derived only: no samples of its own)."""

    name = "throughput"
    after = ()
    writes = ("train/step_time_ms", "train/tokens_per_sec", "train/tokens_per_sec_per_gpu", "train/consumed_tokens",
              "train/tflops_per_gpu", "train/mfu_pct", "train/sol_pct", "train/eta_s")

    def __init__(self, world_size: int, flops_per_token: Optional[float] = None,
                 peak_tflops: Optional[float] = None, total_steps: Optional[int] = None,
                 sol_step_time_ms: Optional[float] = None, warns: bool = True) -> None:
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.total_steps = total_steps
        self.sol_step_time_ms = sol_step_time_ms
        self.consumed_tokens = 0.0
        self._mfu_warned = not warns  # the values are the same on every rank: one rank says it
        self._tokenless_said = not warns

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """None: the interval's time and tokens come in the context."""
        return []

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """``train/consumed_tokens``; over the steps the clock measured ``train/step_time_ms``,
        ``train/tokens_per_sec[_per_gpu]``, TFLOP/s, MFU, SOL, ETA (up to ``total_steps``)."""
        if ctx.tokens is not None:
            self.consumed_tokens += ctx.tokens
            metrics["train/consumed_tokens"] = self.consumed_tokens
        seconds = ctx.interval_s
        steps = ctx.steps if ctx.timed_steps is None else ctx.timed_steps
        tokens = ctx.tokens if ctx.timed_tokens is None else ctx.timed_tokens
        if not seconds or seconds <= 0 or steps <= 0:
            return []
        step_s = seconds / steps
        metrics["train/step_time_ms"] = step_s * 1000.0
        if self.sol_step_time_ms:
            metrics["train/sol_pct"] = 100.0 * self.sol_step_time_ms / (step_s * 1000.0)
        if self.total_steps and ctx.step <= self.total_steps:  # past it the end is not known: no ETA
            metrics["train/eta_s"] = -(-max(0, self.total_steps - ctx.step) // ctx.stride) * step_s  # calls left
        if tokens is None:
            return []
        if ctx.tokenless_steps:
            self._say_tokenless(ctx, steps)
            return []
        metrics["train/tokens_per_sec"] = tokens / seconds
        metrics["train/tokens_per_sec_per_gpu"] = tokens / seconds / self.world_size
        if self.flops_per_token:
            tflops = tokens * self.flops_per_token / seconds / self.world_size / 1e12
            metrics["train/tflops_per_gpu"] = tflops
            if self.peak_tflops:
                self._mfu(metrics, tflops)
        return []

    def close(self) -> None:
        """Nothing to release."""

    def _say_tokenless(self, ctx: LogContext, steps: int) -> None:
        if self._tokenless_said:
            return
        self._tokenless_said = True
        logger.warning("distmetrics: train/tokens_per_sec, train/tokens_per_sec_per_gpu, train/tflops_per_gpu and "
                       "train/mfu_pct (and energy/j_per_token, with log_energy) are left out of the record of step "
                       "%d, and of every record where this recurs: rank %d passed tokens=None at %d of the %d steps "
                       "timed in it, so their tokens are not known, and the tokens given over every step's time "
                       "would read too low. Pass tokens at every step (tokens=0 for a step with none). Said once",
                       ctx.step, ctx.tokenless_rank, ctx.tokenless_steps, steps)

    def _mfu(self, metrics: dict[str, Any], tflops: float) -> None:
        mfu = mfu_pct(tflops, self.peak_tflops)
        metrics["train/mfu_pct"] = mfu
        if mfu > 100.0 and not self._mfu_warned:
            self._mfu_warned = True
            logger.warning("distmetrics: MFU %.1f%% is above 100%%: peak_tflops=%.4g or flops_per_token=%.3g "
                           "is wrong for this GPU and model", mfu, self.peak_tflops, self.flops_per_token)
