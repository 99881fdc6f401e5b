"""The Monitor: what a training loop calls once per optimizer step.

::

    monitor = dm.Monitor(dm.MetricsConfig.from_yaml("configs/metrics.yaml"), model=model, optimizer=opt)
    for step in range(1, total_steps + 1):
        loss = train_one_step(...)
        monitor.step(step, loss=loss, tokens=n_tokens, lr=lr)
    monitor.close()

Every rank calls every method. Between log steps the monitor only adds into device tensors:
no ``.item()``, no collective. At a log step (``step % log_interval == 0``) each collector
hands over its samples, the reducer combines all of them in at most one collective per
reduce kind, and the writer rank (first or last) sends the result to the sinks.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import socket
import sys
import time
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .collectors.health import CategoryLosses, HealthCollector, MoECollector
from .collectors.energy import EnergyCollector, TelemetryCollector, gpu_model_info
from .collectors.memory import MemoryCollector
from .collectors.norms import NormCollector
from . import inspect as dm_inspect
from .collectors.throughput import ThroughputCollector, resolve_peak_tflops
from .collectors.timers import TimerCollector, Timers
from .config import MetricsConfig
from .interval import IntervalStats
from .parallel import Layout, RankInfo, detect_layout
from .reduce import Reducer, Sample, check_reduce
from .sinks import SinkSet, open_sinks
from .sinks.progress import checkpoint_record

__all__ = ["Monitor"]

logger = logging.getLogger("distmetrics")
Number = Union[int, float, torch.Tensor]


class Monitor:
    """Collects, reduces and writes the metrics of a (distributed) training run.

    Args:
        config: a :class:`MetricsConfig` (or a mapping of its keys).
        model: the model (for norms); optional. Or a factory: a callable with no arguments
            that builds the model, or a ``(model, optimizer)`` pair. The Monitor then starts
            nvdlfw-inspect *before* calling it, as TransformerEngine layers need; the result is
            ``monitor.model`` (and ``monitor.optimizer``).
        optimizer: the optimizer (for update norms); optional.
        group: process group to reduce over (default: the world).
        device_mesh: the user's ``DeviceMesh``, to read tensor/pipeline coordinates from
            its dimension names when Megatron's ``parallel_state`` is not in use.
        sinks: extra sink objects (``log(metrics, step, kind)``/``close()``, plus ``name`` and
            ``fix`` strings), used on the writer rank beside the configured ones.
    """

    def __init__(self, config: Union[MetricsConfig, dict, None] = None, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, group: Any = None,
                 device_mesh: Any = None, sinks: tuple = ()) -> None:
        if config is None:
            config = MetricsConfig()
        elif isinstance(config, dict):
            config = MetricsConfig.from_dict(config)
        elif not isinstance(config, MetricsConfig):
            raise TypeError(f"config must be a MetricsConfig or a mapping, got {type(config).__name__}")
        self.config = config
        self.layout: Layout = detect_layout(device_mesh)
        if model is not None and not isinstance(model, torch.nn.Module):
            model, optimizer = self._build(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.rank, self.world_size = self.layout.rank, self.layout.world_size
        writer = 0 if config.writer_rank == "first" else self.world_size - 1
        self.writer_rank = writer
        self.is_writer = self.rank == writer
        self._group = group
        self._train_reducer = Reducer(group)
        self._eval_reducer = Reducer(group)
        self._stats = IntervalStats()
        self._steps_in_interval = 0
        self._last_step: Optional[int] = None
        self._closed = False
        self.last_metrics: dict[str, Any] = {}
        self._train_loss_since_eval: list[tuple[float, float]] = []
        self._job_tokens: Number = 0.0  # this rank's share of the tokens since the job started
        self._job_start = time.time()

        self.hosts = self._gather_ranks()
        self.timers = Timers(config.timing_log_level, config.timing_log_option,
                             barrier_with_L1_time=config.barrier_with_L1_time)
        self._timer_collector = TimerCollector(self.timers, config.timing_log_option, self.hosts)
        self._step_timer = self.timers("step", log_level=0) if config.timing_log_level >= 0 else None
        self._throughput = ThroughputCollector(self.world_size, config.resolved_flops_per_token,
                                               resolve_peak_tflops(config, self.rank), config.total_steps,
                                               config.sol_step_time_ms)
        self._memory = MemoryCollector() if config.log_memory else None
        self._energy = EnergyCollector(self.world_size) if config.log_energy else None
        self._telemetry = (TelemetryCollector() if config.log_gpu_telemetry or config.verbosity >= 1
                           and torch.cuda.is_available() else None)
        self._health = HealthCollector(config.spike_factor)
        self._categories = {"train": CategoryLosses("train/loss"), "eval": CategoryLosses("eval/loss")}
        self._moe = MoECollector(counts_tokens=self.layout.tp_rank == 0 and self.layout.cp_rank == 0)
        self._norms: Optional[NormCollector] = None
        if model is not None:
            self._norms = NormCollector(
                model, self.layout, group, depth=config.module_norm_depth,
                per_module=config.log_grad_norm_per_module, log_grad_norm=config.log_grad_norm,
                log_params_norm=config.log_params_norm, log_update_norm=config.log_update_norm,
                snapshot=config.update_norm_snapshot)
        # Before anything attaches to the user's objects: a rejected features file leaves none.
        self._inspector = dm_inspect.start_for_monitor(config, model, self.layout) if config.tensor_inspect.enabled \
            else None
        self._hooks = []
        if optimizer is not None and self._norms is not None and config.log_update_norm:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        self.sinks = SinkSet()
        if self.is_writer:
            self.sinks = open_sinks(config, self.world_size, sinks)
            self.sinks.log(self._run_record(), 0, "run")
            gpus = [h.gpu for h in self.hosts if h.gpu is not None]
            if gpus:
                self.sinks.log({"ranks": gpus}, 0, "gpu_model")

    def _build(self, factory: Any, optimizer: Any) -> tuple:
        """Start tensor inspection (if enabled), then build the model with ``factory``."""
        if not callable(factory):
            raise TypeError(f"model must be a torch.nn.Module or a callable that builds one, got {type(factory).__name__}")
        started = None
        if self.config.tensor_inspect.enabled and dm_inspect.current() is None:
            started = dm_inspect.initialize(self.config, layout=self.layout)
        try:
            built = factory()
            if isinstance(built, tuple) and len(built) == 2:
                built, optimizer = built
            if not isinstance(built, torch.nn.Module):
                raise TypeError(f"the model factory returned {type(built).__name__}; accepted: a torch.nn.Module "
                                "or a (module, optimizer) pair")
        except BaseException:
            if started is not None:
                dm_inspect.shutdown(started)
            raise
        return built, optimizer

    # --- the per-step API ----------------------------------------------------------------
    def step(self, step: int, loss: Optional[Number] = None, tokens: Optional[Number] = None,
             lr: Optional[Number] = None, skipped: bool = False, **scalars: Number) -> Optional[dict[str, Any]]:
        """Record one optimizer step; on a log step reduce and write, returning the metrics.

        ``loss`` is averaged across ranks and the interval's steps weighted by ``tokens``
        (weight 1 when ``tokens`` is None); a rank passing ``loss=None`` (a pipeline stage
        without the loss) does not count. ``tokens`` are the tokens this rank processed in the
        step (its data-parallel share). ``skipped=True`` reports a step the optimizer skipped
        (loss-scale overflow). Extra ``scalars`` are interval means under ``train/``.
        Returns the reduced metrics (on every rank) at a log step, else None.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r}: accepted values are integers >= 0")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step={step} does not increase (the last step was {self._last_step})")
        self._last_step = step
        if loss is not None:
            self._stats.record("train/loss", loss, "mean", weight=1.0 if tokens is None else tokens)
        if tokens is not None and self.layout.is_data_representative:
            self._stats.record("_train/tokens", tokens, "sum")
            self._job_tokens = self._job_tokens + _as_number(tokens)
        if lr is not None:
            self._stats.record("train/lr", lr, "mean", last=True)
        self._health.record_step(loss, skipped)
        for name, value in scalars.items():
            self._stats.record(name if "/" in name else f"train/{name}", value, "mean")
        if self._step_timer is not None:
            if self._step_timer._started:
                self._step_timer.stop()
            self._step_timer.start()
        self._steps_in_interval += 1
        if self._inspector is not None:
            stats = self._inspector.end_step()  # a collective only on steps the features YAML selects
            if stats:
                self._write(stats, step, "tensor_stats")
        if step % self.config.log_interval == 0:
            return self._log(step)
        return None

    def record(self, name: str, value: Number, reduce: str = "mean", weight: Number = 1.0) -> None:
        """Record a value for this interval, reduced across ranks as ``reduce``.

        ``reduce`` is one of sum, mean, max, min, minmax, all. Over the interval's steps a
        mean is averaged (weighted by ``weight``), a sum added, max/min kept extreme, and
        ``all`` averaged per rank. The name is used as given (e.g. ``train/grad_scale``).
        """
        self._check_open()
        check_reduce(name, reduce)
        self._stats.record(name, value, reduce, weight=weight)

    def record_losses(self, per_sample_loss: torch.Tensor, categories, weights: Optional[torch.Tensor] = None,
                      names=None, split: str = "train") -> None:
        """Per-sample losses (``reduction='none'``) with a category per sample.

        ``categories`` is a list of names (or ids mapped by ``names``) or an integer tensor with
        ``names`` (list or dict id → name). Accumulated on device over the interval (``train``)
        or until :meth:`log_eval` (``eval``); written as ``<split>/loss/<category>``, the mean per
        sample, or per token when ``weights`` are token counts. Categories may differ across
        ranks and appear late.
        """
        self._check_open()
        if split not in self._categories:
            raise ValueError(f"record_losses: split={split!r}; accepted values are 'train', 'eval'")
        self._categories[split].record(per_sample_loss, categories, weights, names)

    def record_moe(self, aux_loss: Optional[Number] = None, z_loss: Optional[Number] = None,
                   tokens_per_expert: Optional[torch.Tensor] = None, layer_numbers=None) -> None:
        """MoE router statistics for this step: ``moe/aux_loss``, ``moe/z_loss`` (means) and, from
        ``tokens_per_expert`` (``[layers, experts]``, global expert ids), ``moe/expert_utilization``
        (fraction of experts receiving tokens) and ``moe/load_imbalance`` (max / mean tokens per
        expert, worst layer), summed over the ranks that see distinct tokens."""
        self._check_open()
        self._moe.record(aux_loss, z_loss, tokens_per_expert, layer_numbers, stats=self._stats)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Drop-in for ``torch.nn.utils.clip_grad_norm_``, exact under every parallel layout.

        Returns the pre-clip total norm (a 0-d tensor, the same on every rank) and scales the
        gradients in place by ``min(1, max_norm / norm)``. ``max_norm=inf`` only measures.
        Costs one all-reduce of one number (clipping needs the global norm); the per-module
        norms ride the log step's SUM pack.
        """
        self._check_open()
        if self._norms is None:
            raise ValueError("clip_grad_norm_ needs the model: pass model= to Monitor(...)")
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r}: accepted values are numbers > 0 (inf to only measure)")
        return self._norms.measure(norm_type, max_norm)

    def measure_grad_norms(self, norm_type: float = 2.0, step: Optional[int] = None) -> Optional[torch.Tensor]:
        """Measure gradient norms without clipping (for code that clips elsewhere).

        Does nothing on a step that will not be logged (``step``, default the last step + 1)
        and returns None; on a log step returns the total norm.
        """
        self._check_open()
        if self._norms is None:
            raise ValueError("measure_grad_norms needs the model: pass model= to Monitor(...)")
        if not self._is_log_step(step):
            return None
        return self._norms.measure(norm_type, None)

    def log_eval(self, step: int, loss: Optional[Number] = None, tokens: Optional[Number] = None,
                 **scalars: Number) -> dict[str, Any]:
        """Reduce evaluation results now and write an ``eval`` record (every rank calls this).

        ``loss`` is token-weighted across ranks (ranks with ``loss=None`` don't count);
        ``eval/ppl`` = exp(loss) and ``eval/gap`` = eval loss − train loss since the last eval.
        """
        self._check_open()
        samples = []
        if loss is not None:
            samples.append(Sample("eval/loss", _as_number(loss), "mean",
                                  weight=1.0 if tokens is None else _as_number(tokens)))
        if tokens is not None:
            samples.append(Sample("_eval/tokens", _as_number(tokens), "sum"))
        for name, value in scalars.items():
            samples.append(Sample(name if "/" in name else f"eval/{name}", _as_number(value), "mean"))
        samples += self._categories["eval"].samples()
        reduced = self._eval_reducer.reduce(samples, tag=step)
        metrics = reduced.to_metrics()
        if metrics.get("_eval/tokens") and metrics.get("eval/time_ms"):
            metrics["eval/tokens_per_sec"] = metrics["_eval/tokens"] / (metrics["eval/time_ms"] / 1000.0)
        metrics = {k: v for k, v in sorted(metrics.items()) if not k.startswith("_")}
        eval_loss = metrics.get("eval/loss")
        if isinstance(eval_loss, float):
            if self.config.log_validation_ppl_to_tensorboard:
                metrics["eval/ppl"] = math.exp(min(eval_loss, 700.0))
            total_w = sum(w for _, w in self._train_loss_since_eval)
            if total_w > 0:
                train_mean = sum(v * w for v, w in self._train_loss_since_eval) / total_w
                metrics["eval/gap"] = eval_loss - train_mean
        self._train_loss_since_eval = []
        self._write(metrics, step, "eval")
        return metrics

    def pause(self) -> None:
        """Stop the training clock and the energy count (before evaluation or a checkpoint save),
        so tokens/s, MFU and energy per token describe training alone. Local: no collective."""
        self._throughput.pause()
        if self._energy is not None:
            self._energy.pause()

    def resume(self) -> None:
        """Count again after :meth:`pause`."""
        self._throughput.resume()
        if self._energy is not None:
            self._energy.resume()

    def checkpoint_saved(self, step: int) -> None:
        """Record a saved checkpoint: a Megatron "Saved checkpoint" line in progress.txt with
        job and cumulative TFLOP/s/GPU, floating-point operations and tokens so far (cumulative
        across restarts with the same world size, read back from the file as Megatron does).
        A collective (one all-reduce of the token count): every rank calls it.
        """
        self._check_open()
        tokens = torch.as_tensor(_to_host(self._job_tokens), dtype=torch.float64).reshape(1)
        if self.world_size > 1 and dist.is_initialized():
            tokens = tokens.to(self._train_reducer.device)
            dist.all_reduce(tokens, group=self._group)
        job_tokens = float(tokens.cpu()[0])
        if not self.is_writer:
            return
        progress = next((s for s in self.sinks.sinks if getattr(s, "name", "") == "progress"), None)
        record = checkpoint_record(step, progress.resumed if progress is not None else {}, self._job_start,
                                   job_tokens, self._throughput.flops_per_token or 0.0, self.world_size)
        self.sinks.log(record, step, "progress")

    def close(self) -> None:
        """Write the unfinished interval (a collective: every rank calls it), then close sinks."""
        if self._closed:
            return
        try:
            if self._steps_in_interval > 0 and self._last_step is not None:
                self._log(self._last_step)
        finally:
            self._shutdown()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # another rank may be gone: no collective, just close the files
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._inspector is not None:
            dm_inspect.shutdown(self._inspector)
            self._inspector = None
        self.sinks.close()

    # --- the log step --------------------------------------------------------------------
    def _log(self, step: int) -> dict[str, Any]:
        steps = self._steps_in_interval
        samples = self._stats.samples()
        samples += self._timer_collector.samples(steps)
        if self.config.log_throughput:
            samples += self._throughput.samples(steps)
        if self._norms is not None:
            samples += self._norms.samples()
        for collector in (self._memory, self._telemetry):
            if collector is not None:
                samples += collector.samples()
        if self._energy is not None:
            samples += self._energy.samples(steps)
        samples += self._health.samples() + self._categories["train"].samples() + self._moe.samples()
        if self._inspector is not None:
            samples += self._inspector.take_forwarded()
        reduced = self._train_reducer.reduce(samples, tag=step)
        metrics = reduced.to_metrics()
        self._timer_collector.finalize(metrics)
        if self._norms is not None:
            self._norms.finalize(metrics)
        if self.config.log_throughput:
            self._throughput.finalize(metrics, step)
        if self._energy is not None:
            self._energy.finalize(metrics, metrics.get("_train/tokens"))
        self._moe.finalize(metrics)
        if self._inspector is not None:
            self._inspector.finalize(metrics)
        order = self._norms.module_order if self._norms is not None else []
        alerts = self._health.finalize(metrics, step, order)
        if "timers/step" in metrics and "train/step_time_ms" not in metrics:
            metrics["train/step_time_ms"] = metrics["timers/step"]
        tokens = metrics.get("_train/tokens")
        loss = metrics.get("train/loss")
        if isinstance(loss, float):
            self._train_loss_since_eval.append((loss, tokens if tokens else 1.0))
        metrics = {k: v for k, v in sorted(metrics.items()) if not k.startswith("_")}  # internal lanes
        self._steps_in_interval = 0
        self._write(metrics, step, "train")
        for alert in alerts:
            self._write(alert, step, "alert")
        self.last_metrics = metrics
        return metrics

    def _is_log_step(self, step: Optional[int] = None) -> bool:
        if step is None:
            step = (self._last_step or 0) + 1
        return step % self.config.log_interval == 0

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._norms is not None and self._is_log_step():
            self._norms.snapshot()

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._norms is not None:
            self._norms.diff()

    def _write(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        if self.is_writer:
            self.sinks.log(metrics, step, kind)

    # --- set-up --------------------------------------------------------------------------
    def _gather_ranks(self) -> list[RankInfo]:
        """Every rank's host, local rank and GPU, in one all_gather_object at start."""
        gpu = gpu_model_info(self.rank) if torch.cuda.is_available() else None
        mine = RankInfo(self.rank, socket.gethostname(), self.layout.local_rank, os.getpid(), gpu)
        if self.world_size == 1 or not dist.is_initialized():
            return [mine]
        rows: list[Any] = [None] * self.world_size
        dist.all_gather_object(rows, mine)
        return rows

    def _run_record(self) -> dict[str, Any]:
        from . import __version__

        return {
            "world_size": self.world_size,
            "writer_rank": self.writer_rank,
            "hosts": sorted({h.hostname for h in self.hosts}),
            "ranks": [{"rank": h.rank, "host": h.hostname, "local_rank": h.local_rank} for h in self.hosts],
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
            "layout": self.layout.source,
            "torch_version": torch.__version__,
            "distmetrics_version": __version__,
            "python_version": platform.python_version(),
            "argv": sys.argv,
            "config": self.config.to_dict(redact=True),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Monitor is closed; create a new one to record more")


def _to_host(v: Number) -> float:
    return float(v.detach().cpu()) if isinstance(v, torch.Tensor) else float(v)


def _as_number(v: Number) -> Number:
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float64)
    return v
