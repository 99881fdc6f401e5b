"""The Monitor: what a training loop calls once per optimizer step (see the README's quickstarts).

Every rank calls every method. Between log steps the monitor only adds into device tensors:
no ``.item()``, no collective. At a log step (``step % log_interval == 0``) every collector
hands over its samples, the reducer combines them in at most one collective per reduce kind,
the collectors derive values from the result, and the writer rank sends it to the sinks.
The per-step methods may be called from code ``torch.compile`` compiles: each is one graph break
there, run eagerly (:mod:`distmetrics.eager`).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from functools import partial
from typing import Any, Optional, Union

import torch

from .checkpoints import CheckpointLog
from .collectors import build_collectors, finalize_order, idle_collectors, planned_collectors, telemetry_setting
from .collectors.base import ForeignNames, check_collectors
from .collectors.norms import NormCollector
from .collectors.stragglers import StragglerCollector
from .collectors.weightless import WeightlessSamples
from .collectors.throughput import shared_throughput
from .config import MetricsConfig
from .evaluation import EvalLog
from .exits import (OneThread, close_parts, closed_code, exit_code_of, open_at_exit, say_log_step_lost, say_pending,
                    say_unwritten, write_end)
from .sinks.writer import exit_hook_before_writers, forget_exit_hook
from .guard import CollectiveGuard
from .eager import eager
from .log_step import UnreachedLogSteps, is_log_step, log_step, log_step_ahead
from .megatron_optimizer import is_megatron_optimizer
from .names import check_step, local_value
from .recompute import recomputing
from .naming import module_order, owner_names
from .parallel import Layout, detect_layout, model_parallel_mesh
from .reduce import Reducer
from .runinfo import coerced_config, open_writer_sinks, start_up
from .sinks import SinkSet, check_sinks
from .stage_order import job_module_order
from .step_count import StepCall, count_step, finish_step, step_under_way
from .step_hooks import hooked_optimizer
from .tensor_stats.lifecycle import build_model, check_inspection, collectors_for, planned_for

__all__ = ["Monitor"]

Number = Union[int, float, torch.Tensor]


class Monitor:
    """Collects, reduces and writes the metrics of a (distributed) training run.

    Args:
        config: a :class:`MetricsConfig` (or a mapping of its keys).
        model: the model (for norms); optional. Or a factory (no arguments) returning the model
            or a ``(model, optimizer)`` pair, called after nvdlfw-inspect starts, as
            TransformerEngine layers need (then see ``monitor.model``, ``monitor.optimizer``).
        optimizer: the optimizer (for update norms); optional.
        group: process group to reduce over (default: the world). The Monitor's job is then that
            group's ranks: every collective it makes runs over them and every count and record
            describes them, so independent jobs can share one world; each rank of the group must
            make the Monitor, and a rank outside it is refused.
        device_mesh: the user's ``DeviceMesh`` (tensor/pipeline coordinates from its dimension
            names when Megatron's ``parallel_state`` is not in use).
        sinks: extra sinks (``name``, ``fix``, ``log(metrics, step, kind)``, ``close()``) for the writer.
        collectors: extra collectors (:mod:`distmetrics.collectors.base`), reduced like ours.
    """

    def __init__(self, config: Union[MetricsConfig, dict, None] = None, model: Any = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, group: Any = None,
                 device_mesh: Any = None, sinks: tuple = (), collectors: tuple = ()) -> None:
        self.config = config = coerced_config(config, device_mesh, group)  # a bad one: said on every rank
        self.layout: Layout = detect_layout(device_mesh, group)  # the one place the Monitor's ranks are read
        # the world as None (the layout's): a ProcessGroup object held here would outlive destroy_process_group(),
        # and gloo's threads with it, into the interpreter's exit, where they can abort the process (SIGABRT)
        group = self.layout.group
        # a features file one rank cannot read: said on every rank by the start-up gather, and no
        # model factory runs (it would start the inspector on that rank alone)
        inspection, features = check_inspection(config, self.layout.world_size)
        if model is not None and not isinstance(model, torch.nn.Module) and inspection is None:
            model, optimizer = build_model(config, self.layout, model, optimizer)
        self.model, self.optimizer = model, optimizer
        if optimizer is not None and model is not None and config.log_update_norm \
                and not is_megatron_optimizer(optimizer):  # refused before any collective, on every rank alike
            hooked_optimizer(optimizer, "Monitor(optimizer=...)")
        if self.layout.source == "data-parallel":  # a model parallelized over a named mesh (none given, or one
            # that does not span the Monitor's ranks)
            mesh = model_parallel_mesh(model, self.layout)
            if mesh is not None:
                self.layout = detect_layout(mesh, group)
        self.layout.pp_style = config.pipeline_style  # which pipeline rank holds the last stage
        # the global rank, and how many ranks the Monitor reduces over (its group's)
        self.rank, self.world_size = self.layout.rank, self.layout.world_size
        # the group's first or last rank (a Monitor on a group without global rank 0 writes too)
        self.writer_rank = self.layout.writer(config.writer_rank)
        self.is_writer = self.rank == self.writer_rank
        self._guard = CollectiveGuard(config.hang_timeout_s, group)
        self._reducer = Reducer(group, guard=self._guard, call="monitor.step", world=self.world_size,
                                records="train records (monitor.step, monitor.record)")
        # record* may come from any thread: one at a time, and never while a log step takes the interval
        # (a tensor add releases the GIL: records were lost, and an interval taken mid-add counted twice)
        self._records = threading.RLock()
        self._eval = EvalLog(group, self._guard, self.layout, world=self.world_size, records=self._records)
        # one name in train records on one rank and in eval records on another: refused where the names meet
        self._reducer.shares_tags_with(self._eval.reducer)
        self._one_thread = OneThread()  # the thread of the collective calls
        self._steps_in_interval, self._last_step, self._closed = 0, None, False
        self._closing = False  # close() has begun: a value recorded from then on is refused
        self._counting: Optional[StepCall] = None  # the step monitor.step is counting (:mod:`distmetrics.step_count`)
        self._stride = 1  # the last step's number less the one before: the next is predicted that far on
        self._strided = False  # two steps seen: _stride is the loop's
        self._log_steps_seen = UnreachedLogSteps(config.log_interval, self.layout.says_once)
        self._unwritten: Optional[tuple] = None  # (step, steps, close()'s) of a log step whose record is unwritten
        self._pid = os.getpid()  # a forked child's copy (its hooks, files, the store's socket) never closes
        self._stepped_at: Optional[int] = None  # when the last monitor.step returned (ns)
        self._counts_known = False  # where checkpoints count on from (the job's first call of a step)
        self.last_metrics: dict[str, Any] = {}
        self._record_order: tuple[tuple, list] = ((), [])  # a record's names as made -> as written
        idle: list = []  # the built-in collectors switched off: their names are theirs all the same
        try:  # the built-in collectors' classes: their writes, checked against the user's before any is made
            built_in = [kind for kind, _ in planned_collectors(config, self.layout, model)] + planned_for(config)
            idle = idle_collectors(built_in, collectors)
            sinks, problem = check_sinks(sinks), self.layout.problem
            collectors = check_collectors(collectors, built_in + idle, others=[("monitor.log_eval", EvalLog.writes)],
                                          reserved=(NormCollector, StragglerCollector))
        except (TypeError, ValueError) as err:  # said on every rank by the start-up gather: no rank waits alone
            problem = str(err)
        self.hosts, claim = start_up(config, self.layout, self._guard, self.is_writer, problem or inspection,
                                     config_problem=problem is None and inspection is not None,
                                     derived={"tensor_inspect.features": features, **shared_throughput(config),
                                              "log_gpu_telemetry": telemetry_setting(config)})
        built: list = []  # closed, and output_dir let go, if the Monitor cannot be made
        try:
            built += build_collectors(config, self.layout, model, optimizer, group) + collectors_for(
                config, model, self.layout)
            self.collectors = finalize_order(built + list(collectors))
            self._by_name = {c.name: c for c in self.collectors}
            for collector in (c for c in self.collectors if hasattr(c, "use_guard")):
                collector.use_guard(self._guard)  # their own collectives (timer reports, tensor statistics)
            self._eval.use_names(self._by_name["train"].names.reserve_writers(self.collectors + idle))
            self._foreign = ForeignNames(self._eval.names, collectors, self._reducer)  # the names the user's
            # collectors may send
            self._weightless = WeightlessSamples()  # their means left out for a total weight of 0: said
            self.timers = self._by_name["timers"].timers
            self._module_order, stage = job_module_order(self.layout, module_order(model), self._guard,
                                                         chunked=isinstance(model, torch.nn.ModuleList),
                                                         owners=owner_names(model) if self.layout.pp_size > 1 else ())
            for name in ("norms", "tensor_stats") if stage else ():  # stages' modules of one name: each named
                if name in self._by_name:  # with its stage
                    self._by_name[name].name_stage(stage)
            if optimizer is not None and "norms" in self._by_name:
                self.attach_megatron_optimizer(optimizer)
            self._checkpoints = CheckpointLog(config, self.world_size, self.is_writer)
            opened = (config, self.layout, self.hosts, self.writer_rank, sinks, claim, self._module_order,
                      self.timers.names_in_order)
            self.sinks = open_writer_sinks(*opened) if self.is_writer else SinkSet()
            # at exit with the Monitor open: the writer says what is not written, and every rank leaves, so
            # a rank waiting for this one raises now rather than at hang_timeout_s
            self._at_exit = partial(open_at_exit, weakref.ref(self)) if self.is_writer or self._guard.enabled else None
            if self._at_exit is not None:
                exit_hook_before_writers(self._at_exit)
        except BaseException:
            for collector in built:
                collector.close()
            if claim is not None:
                claim.release()
            raise

    # --- the per-step API ----------------------------------------------------------------
    @eager
    def step(self, step: int, loss: Optional[Number] = None, tokens: Optional[Number] = None,
             lr: Optional[Number] = None, skipped: bool = False, loss_tokens: Optional[Number] = None,
             **scalars: Number) -> Optional[dict[str, Any]]:
        """Record one optimizer step; on a log step reduce and write, and return the metrics
        (the same on every rank; None on other steps).

        ``loss`` is averaged over ranks and steps weighted by ``tokens`` (this rank's tokens in
        the step; weight 1 when None); a rank with ``loss=None`` (a pipeline stage without the
        loss) does not count. ``loss_tokens``: the tokens this rank's ``loss`` is a mean over, where
        they differ from ``tokens`` (context parallelism: ``tokens`` the whole sequences', counted for
        the throughput, ``loss_tokens`` this rank's slice's); it then weighs the loss instead. Under
        gradient accumulation, one call per optimizer step: the rank's token-weighted mean over its
        micro-batches and their summed tokens. ``skipped=True``:
        the optimizer skipped the step (loss-scale overflow); its loss, and the ``record_losses``
        samples since the last call, are left out of ``train/loss`` (and its categories), its tokens
        count. Extra ``scalars`` are interval means under ``train/``."""
        self._check_open(collective=True)
        self._by_name["train"].check_step(step, self._last_step, loss, tokens, lr, skipped, scalars, loss_tokens)
        loss, tokens, lr = local_value(loss), local_value(tokens), local_value(lr)  # a DTensor: this rank's copy
        loss_tokens = local_value(loss_tokens)
        if scalars:
            scalars = {name: local_value(value) for name, value in scalars.items()}
        count_step(self, StepCall(step, loss, tokens, lr, skipped, scalars, loss_tokens))
        if self._closed:  # by a signal handler's close() during the count: its record has this step
            return None
        stats = self._by_name["tensor_stats"].end_step(step) if "tensor_stats" in self._by_name else None
        if stats:  # a collective only on steps the features YAML selects
            self._write(stats, step, "tensor_stats")
        return self._log(step) if step % self.config.log_interval == 0 else None

    @eager
    def record(self, name: str, value: Number, reduce: str = "mean", weight: Optional[Number] = None) -> None:
        """Record a value for this interval under ``name`` as given, reduced across ranks as
        ``reduce`` (sum, mean, max, min, minmax, all). Over the interval's steps a mean is
        averaged (weighted by ``weight``, 1 where None), a sum added, max/min kept extreme, ``all``
        averaged. Only a mean takes a ``weight`` (another kind refuses one); a mean whose weights sum to
        0 over every rank and step of the interval is left out of that record, said once per name."""
        self._check_open()
        if recomputing(self):
            return
        with self._records:
            self._check_closing()
            self._by_name["train"].record(name, value, reduce, weight)

    @eager
    def record_losses(self, per_sample_loss: torch.Tensor, categories, weights: Optional[torch.Tensor] = None,
                      names=None, split: str = "train") -> None:
        """Per-sample losses (``reduction='none'``) with a category per sample: a list of names
        (or ids mapped by ``names``), or an integer tensor with ``names`` (list or dict id → name).
        Written as ``<split>/loss/<category>`` (the mean per sample, or per token when ``weights``
        are token counts) at the log step (``train``) or :meth:`log_eval` (``eval``)."""
        self._check_open()
        if recomputing(self):
            return
        with self._records:
            self._check_closing()
            self._by_name["losses"].split(split, self._eval.categories).record(per_sample_loss, categories, weights,
                                                                               names)

    @eager
    def record_moe(self, aux_loss: Optional[Number] = None, z_loss: Optional[Number] = None,
                   tokens_per_expert: Optional[torch.Tensor] = None, layer_numbers=None) -> None:
        """MoE router statistics for this step: ``moe/aux_loss``, ``moe/z_loss`` (means) and, from
        ``tokens_per_expert`` (``[layers, experts]``, global expert ids), ``moe/expert_utilization``
        (fraction of experts receiving tokens, mean over layers) and ``moe/load_imbalance`` (max / mean
        tokens per expert, worst layer), summed over the ranks that see distinct tokens; a layer that
        routed no token has neither (NaN) and is left out of both. Under sequence or context
        parallelism, pass counts already summed over the TP x CP group (as Megatron's router sums
        them): TP/CP rank 0's are used. Negative, NaN or infinite counts (not read here: that waits
        for the device) raise a ``ValueError`` on every rank at the log step."""
        self._check_open()
        if recomputing(self):
            return
        with self._records:
            self._check_closing()
            self._by_name["moe"].record(aux_loss, z_loss, tokens_per_expert, layer_numbers)

    @eager
    def clip_grad_norm_(self, parameters: Any = None, max_norm: Any = None, norm_type: Union[float, str] = 2.0,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the same arguments and return value, exact under
        every parallel layout; also ``clip_grad_norm_(max_norm)`` for the model's parameters. One
        all-reduce of five numbers (4 for inf, 8 for -inf; and the checks' lanes); per-module norms ride the
        log step's pack.
        Refused inside a gradient-accumulation window (:mod:`distmetrics.grad_sync`)."""
        norms = self._norms("clip_grad_norm_")
        norms.sync.check("monitor.clip_grad_norm_")  # before any collective: not inside no_sync()
        self._guard.note("monitor.clip_grad_norm_")  # a collective not guarded (every step): named if it hangs
        return norms.clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach, self._last_step)

    @eager
    def measure_grad_norms(self, norm_type: float = 2.0, step: Optional[int] = None) -> Optional[torch.Tensor]:
        """Measure gradient norms without clipping (for code that clips elsewhere): the total
        norm on a log step (``step``, default the next step as predicted: the last + the last stride), None
        (and no work) otherwise;
        refused inside a gradient-accumulation window on every step (:mod:`distmetrics.grad_sync`)."""
        norms = self._norms("measure_grad_norms")
        norms.sync.check("monitor.measure_grad_norms")  # on every step: a call inside no_sync() is said at once
        if step is not None:
            check_step(step, "monitor.measure_grad_norms")
        if not self._is_log_step(step):  # not logged as far as is known: said at its record if it is (a change
            norms.skipped_measure(self._last_step, step is not None)  # of stride; close()'s, step= given or not)
            return None
        self._guard.note("monitor.measure_grad_norms")  # a collective not guarded: named if it hangs
        return norms.measure(norm_type, self._last_step)

    def attach_megatron_optimizer(self, optimizer: Any) -> None:
        """Read an optimizer built after the Monitor: Megatron's distributed optimizer's owned
        gradient slices and fp32 main shards; update-norm hooks (``Monitor(optimizer=)`` does this)."""
        norms = self._norms("attach_megatron_optimizer")
        norms.attach_optimizer(optimizer, self._log_step_ahead)
        if norms.writes_loss_scale:  # kept from the user only where written: torch.amp loops record their own
            self._by_name["train"].names.reserve(["loss_scale"], "the 'norms' collector (the fp16 optimizer's)")

    @eager
    def log_eval(self, step: int, loss: Optional[Number] = None, tokens: Optional[Number] = None,
                 loss_tokens: Optional[Number] = None, **scalars: Number) -> dict[str, Any]:
        """Reduce evaluation results now and write an ``eval`` record (every rank calls this):
        ``loss`` token-weighted across ranks (``None`` doesn't count; by ``loss_tokens`` where given,
        as in :meth:`step`), ``eval/ppl`` = exp(loss), ``eval/gap`` = eval loss − train loss since the
        last eval."""
        self._check_open(collective=True)
        metrics = self._eval.log(step, loss, tokens, scalars, loss_tokens)  # an evaluation first (a resumed job's
        # of the checkpoint it loaded) tells not where checkpoints count on from: the checkpoint of this step is
        # the one loaded where steps count from 0, the one before the first step where they count from 1
        self._write(metrics, step, "eval")
        refused, self._eval.refused = self._eval.refused, None
        if refused is not None:  # bad tokens or time_ms in tensors: the record without them is written
            raise refused
        return metrics

    @eager
    def pause(self) -> None:
        """Stop the training clocks, the step timer and the energy count (before evaluation or a
        checkpoint save), so tokens/s, MFU, the step time (``timers/step`` too), energy per token and
        straggler scores describe training alone, and the tensor statistics' hooks, so evaluation's
        forwards are not the step's. Local; until :meth:`resume` (the clocks: or the log step)."""
        for clock in self._pausable():
            clock.pause()

    @eager
    def resume(self) -> None:
        """Count again after :meth:`pause`."""
        for clock in self._pausable():
            clock.resume()

    @eager
    def checkpoint_saved(self, step: int) -> None:
        """A Megatron "Saved checkpoint" line in progress.txt (job and cumulative TFLOP/s/GPU,
        floating-point operations, tokens; cumulative across restarts with the same world size; nan
        where the job's steps counted no token on any rank). A collective (one all-reduce of the token count):
        every rank calls it. ``step`` is the last ``monitor.step``'s number or the next's (steps done); another
        is said once (:meth:`~distmetrics.checkpoints.CheckpointLog.say_number`)."""
        self._check_open(collective=True)
        check_step(step, "monitor.checkpoint_saved")
        self._checkpoints.say_number(step, self._last_step, self._stride if self._strided else None,
                                     self.layout.says_once)
        if self._last_step is None:  # a checkpoint saved first: the one the job loaded (whatever the numbering)
            self._counts_from(step, loaded=True)
        self._reducer.check_world("monitor.checkpoint_saved")
        self._guard.enter("monitor.checkpoint_saved", step)
        train = self._by_name["train"]  # None: its steps counted no token (before any step the job's are 0)
        tokens = train.job_tokens if train.counted_tokens or self._last_step is None else None
        record = self._checkpoints.saved(step, tokens, self.config.resolved_flops_per_token, self._reducer.group,
                                         self._reducer.device, self.is_writer, after_step=self._last_step,
                                         least=train.unchecked_least_tokens)
        if record is not None:
            self.sinks.log(record, step, "progress")

    def close(self) -> None:
        """Write the unfinished interval (a collective: every rank calls it), then close sinks. Nothing
        in a process forked from the one that made the Monitor (a copy: not its job)."""
        if self._closed or self._forked():
            return
        if self._unwritten is not None:  # a signal handler's close() inside a log step: its record is lost
            say_log_step_lost(self, "monitor.close() was called during it")
        if self._guard.inside:  # a signal handler's close() while this rank waits at a guarded call: no collective
            say_unwritten(self, "monitor.close() was called while this rank waited at an arrival check",
                          "no collective can follow it there: the call is marked left, and the other ranks raise")
            self._shutdown(quiet=True)
            return
        if step_under_way(self):  # a signal handler's close() inside monitor.step: the step is counted whole
            finish_step(self)
            self._by_name["train"].stats.end_step()  # what a part it cut short recorded is the step's too
        with self._records:  # a value another thread records from here on is refused, as after close():
            self._closing = True  # taken back below, or taken into the record close() writes, it was neither's
        try:
            writes_record = self._steps_in_interval > 0 and self._last_step is not None
            # values recorded after the last step belong to a step that did not come: said, and not in the record
            say_pending(self, writes_record)
            if writes_record:
                self._reducer.call = "monitor.close"  # a hang report names the call the rank is in
                if "norms" in self._by_name and not self._is_log_step(self._last_step):  # measured ahead only
                    self._by_name["norms"].unpredicted(self._last_step, closing=True)  # where total_steps names it
                self._log(self._last_step, ended_at=self._stepped_at)
        except BaseException as err:
            self._shutdown(f"closed its Monitor, which raised {type(err).__name__}", quiet=True,  # that error is
                           exit_code=exit_code_of(err))  # raised
            raise
        self._shutdown(exit_code=closed_code())

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or self._forked():  # a forked child leaving the block: close() does nothing
            self.close()
        else:  # another rank may be gone: no collective, just close the files (the caller's error goes on)
            how = f"left its Monitor on {exc_type.__name__}"
            say_unwritten(self, how, "no collective is made after an error: another rank may be gone")
            self._shutdown(how, quiet=True, exit_code=exit_code_of(exc))

    # --- the log step (:mod:`distmetrics.log_step`) ------------------------------------------
    _log = log_step
    _log_step_ahead = log_step_ahead
    _is_log_step = is_log_step

    def _counts_from(self, first: int, loaded: bool = False) -> None:
        """The job's own steps start at ``first``, as its first step tells, or after checkpoint ``first``, which
        it saves before its first step (``loaded``), once: checkpoints count on from the one it resumed from.
        Which of an earlier job's
        TensorBoard events this job replaces is known at its first ``monitor.step`` only
        (:func:`~distmetrics.runinfo.resumed_at`): a job that only evaluates replaces none."""
        if not self._counts_known:
            self._counts_known = True
            self._checkpoints.start_at(first, loaded)

    def _write(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        if self.is_writer and not self._closed:  # closed: by a signal handler, inside this log step
            self.sinks.log(metrics, step, kind)

    def _norms(self, caller: str):
        self._check_open(collective=True)
        if "norms" not in self._by_name:
            raise ValueError(f"{caller} needs the model: pass model= to Monitor(...)")
        return self._by_name["norms"]

    def _clocks(self) -> list:
        return [self._by_name[name] for name in ("train", "energy", "stragglers") if name in self._by_name]

    def _pausable(self) -> list:
        """The clocks, the step timer and the tensor statistics' hooks: what ``pause()`` stops."""
        return self._clocks() + [self._by_name[name] for name in ("timers", "tensor_stats") if name in self._by_name]

    def __del__(self) -> None:
        try:  # a Monitor left open in a function or a notebook cell that raised: said, and its files, writer
            # thread and output_dir let go (no collective: the other ranks' Monitors may be gone)
            if not self._closed and not sys.is_finalizing() and not self._forked():  # at the end: the exit hooks did it
                say_unwritten(self, "a Monitor is collected, never closed")
                self._shutdown("its Monitor was collected, never closed", quiet=True)
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    def _forked(self) -> bool:
        return os.getpid() != self._pid  # a forked child (a DataLoader worker, an uploader of yours)

    def _shutdown(self, how: str = "closed its Monitor", quiet: bool = False, exit_code: Optional[int] = None) -> None:
        """Leave the arrival check, close every collector, then the sinks (always: a collector that
        fails to close is said, and its error raised once the sinks are closed, unless ``quiet``:
        another error is on its way). ``exit_code``: how the job ended, where that is known (the
        sinks are told: W&B marks the run failed by it)."""
        if self._closed:
            return
        self._guard.leave(how)  # a rank still waiting for this one says so
        if getattr(self, "_at_exit", None) is not None:
            forget_exit_hook(self._at_exit)
        self._closed = True
        try:
            write_end(self, how)
        finally:  # a signal's exception inside it leaves no part open
            close_parts(self.collectors, self.sinks, quiet, exit_code)

    def _check_closing(self) -> None:
        """Refuse a value that waited for the lock while close() began (it takes the interval)."""
        if self._closing:
            raise RuntimeError("this Monitor is closed; create a new one to record more")

    def _check_open(self, collective: bool = False) -> None:
        """Refuse a call to a closed Monitor, and a ``collective`` one (a log step, an evaluation, a
        checkpoint, a clip) from another thread than the first to make one: those are collectives
        every rank makes in one order. ``record`` and the like may come from any thread (a hook the
        autograd engine runs on its own thread during ``backward()``)."""
        if self._closed:
            raise RuntimeError("this Monitor is closed; create a new one to record more")
        if self._forked():  # its records went into the parent's files, out of step with the ranks
            raise RuntimeError(f"this Monitor belongs to process {self._pid}, and this process ({os.getpid()}) was "
                               "forked from it (a DataLoader worker, a process of yours): it records nothing here. "
                               "Record in the process that made it, or make a Monitor of this process's own")
        if collective:
            self._one_thread.check()
