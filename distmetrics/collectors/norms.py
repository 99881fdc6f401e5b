"""Gradient, parameter and update norms for the log step: totals and every module's subtree.

Gradients are measured by :mod:`distmetrics.grad_norm` (exact under every layout, any p) when
the loop calls ``monitor.clip_grad_norm_`` or ``monitor.measure_grad_norms``; parameter and update
norms on log steps only. Each module that owns parameters is a bucket whose value (Σ nᵖ, or the
max for p = inf) travels in the log step's pack as one vector; after the reduction every module
with trainable parameters anywhere below it gets its subtree's norm (``grad_norm/layers.2`` is the
whole block), computed from the buckets on the host: no extra collective, no extra pass. The
root's own parameters are ``grad_norm/model`` (``grad_norm/root`` beside a child module named
``model``). Which modules hold a NaN or inf gradient travels only when the log step's total count
of non-finite tensors is not 0 (one more reduction, then).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import weakref
from typing import Any, Callable, Optional

import torch

from ..grad_measurement import GradMeasurement, note_clip
from ..grad_norm import GradientNorms, NonfiniteNormError, norm_kind
from ..grad_sync import GradSync
from ..plans import Plan
from ..megatron_optimizer import MegatronShards, is_megatron_optimizer
from ..reduce import Reducer
from ..replicas import IntervalCheck
from ..step_hooks import StepHooks, hooked_optimizer
from .base import Alert, LogContext, Sample
from .nonfinite_steps import NonfiniteSteps
from .param_norms import _LACKS_UPDATE, ParamSide
from .norm_tree import Families, module_vector, roots, subtree_values

logger = logging.getLogger("distmetrics")

__all__ = ["NormCollector", "subtree_values", "FIRST_STEP"]

FIRST_STEP = -1
"""What ``log_step_ahead()`` says before the first ``monitor.step``: the step's number is not
known yet, so the update is measured and tagged with the number when it comes (:meth:`NormCollector.first_step`)."""

_FAMILIES = ("grad_norm", "param_norm", "update_norm")
_PREFIXES = ("grad_norm/", "param_norm/", "update_norm/")
_HELD = "_grad_norm_held"
"""Internal lane (p < 0): how many ranks own a gradient; none makes the total 0, as torch's is."""


class NormCollector(ParamSide):
    """Grad/param/update norms of one model (``grad_norm``, ``param_norm``, ``update_norm`` and
    their ``/<module>`` values, ``grad_clip_ratio``, ratios, non-finite module names)."""

    name = "norms"
    after = ()
    writes = ("grad_norm", "grad_norm/", "param_norm", "param_norm/", "update_norm", "update_norm/",
              "relative_update_norm", "relative_update_norm/", "effective_lr_ratio", "effective_lr_ratio/",
              "grad_clip_ratio", "grad_nonfinite", "grad_nonfinite_modules", "grad_missing_params",
              "grad_nonfinite_steps")

    def __init__(self, model: torch.nn.Module, layout: Any, group: Any = None, depth: Optional[int] = None,
                 per_module: bool = True, log_grad_norm: bool = True, log_params_norm: bool = False,
                 log_update_norm: bool = False, snapshot: str = "device") -> None:
        self.grads = GradientNorms(model, layout, group, depth)
        self.grads.defers_replicas = True  # a clip waits for no device: the check is raised at the log step
        self._replicas = IntervalCheck()
        self.sync = GradSync(model, self.grads.plans, layout.says_once)
        """Refuses a measurement inside a gradient-accumulation window (:meth:`GradSync.check`)."""
        self.layout = layout
        self.group = group
        self.per_module = per_module
        self.log_grad_norm = log_grad_norm
        self.log_params_norm = log_params_norm
        self.log_update_norm = log_update_norm
        self.snapshot_device = snapshot
        self._grad: Optional[GradMeasurement] = None  # the latest measurement
        self._grad_plan: Optional[Plan] = None
        self._grad_after: Any = None  # the last monitor.step number before that measurement
        self._nonfinite_steps = NonfiniteSteps()
        self._warned_partial = False  # a second measurement over other parameters in one step was said
        self._steps = StepHooks(self._before_step, self._after_step)  # the attached optimizers' (update norms)
        self._stepped = False  # some attached optimizer stepped between the last two monitor.step calls
        self._skipped_step = False  # the last monitor.step was given skipped=True
        self._repeated = False  # ... one of them more than once (the update then spans several gradients)
        self._coverage: tuple = (None, frozenset())  # (plans' signatures, the modules a measurement left out)
        self._in_step_measured = 0  # measurements made inside the optimizer step under way
        self._repeats_seen = False  # an optimizer stepped twice in one step once: copies are kept until monitor.step
        self._dropped_step: Any = None  # a step whose update was left out (the copy went before its second step)
        self._said_dropped = False
        self._log_step_ahead: Callable[[], Any] = lambda: None  # the Monitor's log_step_ahead, held weakly
        self._warned_update = False  # update_norm missing from a record was said
        self._warned_skipped_update = False  # ... from a step reported skipped was said
        self._unpredicted: Optional[int] = None  # a log step not predicted (its update was not snapshotted)
        self._warned_unpredicted = False
        self._closing = self._warned_closing = False  # the unpredicted record is close()'s (said apart)
        self._skipped_after: Any = False  # measure_grad_norms() measured nothing, not known to be logged: the step
        self._skipped_given = False  # before; and whether that call was given its step
        self._norm_family: Optional[tuple[str, float]] = None  # ("sum" | "max" | "min", the first norm_type)
        self._update: Optional[torch.Tensor] = None
        self._update_plan: Optional[Plan] = None  # the plan the update was bucketed with (the step's)
        self._update_step: Optional[int] = None  # the log step the update was measured for
        self._snapshot_step: Optional[int] = None
        self._snapshot: Optional[list] = None  # the pieces before the step's first optimizer step (:meth:`snapshot`)
        self._snapshot_plan: Optional[Plan] = None  # the parameters they are of
        self._diffed = False  # the snapshot's fp32 pieces hold the step's difference so far (:meth:`diff`)
        self._last_grad: Optional[GradMeasurement] = None
        self._step_before: Any = None  # the monitor.step number before the last one: a measurement of that step's
        self._last_grad_own = False  # whether the last log step's measurement was made in its own step
        self._optimizer_clip = 0.0  # the clip_grad of an attached Megatron optimizer (0: it does not clip)
        self._loss_scale: Optional[Callable[[], torch.Tensor]] = None  # an attached fp16 optimizer's
        self._families = Families()
        self._flags: Optional[Reducer] = None  # reduces per-module non-finite counts, when there are any
        self._guard: Any = None

    @property
    def writes_loss_scale(self) -> bool:
        """Whether ``loss_scale`` is written (an fp16 Megatron optimizer is attached)."""
        return self._loss_scale is not None

    def name_stage(self, prefix: str) -> None:
        """Start every name with this rank's stage (``stage1.``): stages hold modules of one name."""
        self.grads.plans.use_prefix(prefix)

    @property
    def replans(self) -> int:
        """How often the model's parameters changed and the plan was rebuilt."""
        return self.grads.plans.replans

    def skipped_measure(self, last_step: Any, given: bool = False) -> None:
        """``measure_grad_norms()`` measured nothing after ``last_step``: the next step (``given``: the step the
        call named) was not known to be logged."""
        self._skipped_after, self._skipped_given = last_step, given

    def _say_unpredicted(self, step: int, lacks_update: bool, lacks_grad: bool) -> None:
        """A log step that was not predicted lacks what is measured ahead of it: its update norm, and
        ``grad_norm`` where ``measure_grad_norms()`` was left out for it; said once."""
        lacks = ["update_norm"] if lacks_update else []
        if self._skipped_after is not False and lacks_grad:
            lacks.append("grad_norm (monitor.measure_grad_norms() measured nothing" + (
                ")" if self._closing or self._skipped_given else ": pass step=)"))  # close()'s: the why says
        said = self._warned_closing if self._closing else self._warned_unpredicted  # each cause said once
        if not lacks or self._unpredicted != step or said or not self.layout.says_once:
            return
        if self._closing:
            self._warned_closing = True
        else:
            self._warned_unpredicted = True
        why = ("it is the record close() writes, of the steps after the last log step, and its step was not known "
               "ahead to be logged (total_steps names the job's last step)" if self._closing else
               "the step was not known to be a log step (the next step is predicted as the last plus the stride "
               "between the last two, so the first log step after a change of stride misses it)")
        logger.warning("distmetrics: the record of step %d has no %s: %s. Said once", step, " nor ".join(lacks), why)

    def unpredicted(self, step: int, closing: bool = False) -> None:
        """``step``, a log step, is not the step predicted before its optimizer step: its update, if
        one is wanted, was not snapshotted (said once at its record); ``closing``: the record close()
        writes, of a step no log step ended."""
        self._unpredicted, self._closing = step, closing

    def attach_optimizer(self, optimizer: Any, log_step_ahead: Callable[[], Optional[int]]) -> None:
        """Learn from the optimizer: with Megatron's distributed optimizer, which gradient slices
        this rank owns and where its fp32 main parameters live; and, for update norms, snapshot
        the (main) parameters before the first optimizer step of a step that will be logged
        (``log_step_ahead()``: the step it is predicted to be, or None when that is not a log step)
        and diff after each (:meth:`diff`) — around the inner ``torch.optim`` step for Megatron's
        optimizers, else around the optimizer's or the one it wraps (:func:`hooked_optimizer`).
        A Megatron optimizer's ``config.clip_grad`` is the clip its step applies: gradients measured
        with :meth:`measure` count as clipped there (``grad_clip_ratio``, ``effective_lr_ratio``)."""
        if is_megatron_optimizer(optimizer):
            self._optimizer_clip = float(getattr(getattr(optimizer, "config", None), "clip_grad", 0.0) or 0.0)
            parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
            if any(getattr(part, "grad_scaler", None) is not None for part in parts):  # fp16: scaled gradients
                self._loss_scale = optimizer.get_loss_scale
            shards = MegatronShards(optimizer)
            if shards.active:
                self.grads.attach_shards(shards)
            targets = shards.inner
        elif self.log_update_norm:
            targets = [hooked_optimizer(optimizer, "monitor.attach_megatron_optimizer(optimizer)")]
        if not self.log_update_norm:
            return
        # weakly: the optimizer's hooks hold this collector, which held the Monitor, never collected while the
        # optimizer lived (its files and output_dir held, its hooks copying the parameters at every step)
        self._log_step_ahead = weakref.WeakMethod(log_step_ahead) if inspect.ismethod(log_step_ahead) \
            else lambda: log_step_ahead
        for target in targets:
            self._steps.attach(target)

    def _before_step(self) -> None:
        """An optimizer step starts, none under way: snapshot where its step will be logged."""
        self._in_step_measured = 0
        ahead = self._log_step_ahead()
        step = ahead() if ahead is not None else None  # None: the Monitor was collected
        if step is not None:
            self.snapshot(step)

    def _after_step(self) -> None:
        """The optimizer step is over: the step's update so far."""
        self.diff()

    def end_step(self, step: int, previous: Any = None, skipped: bool = False) -> None:
        """``monitor.step(step)``: the step's optimizer steps are over. Its update stays for the log
        step, and only for ``step`` (one measured for a predicted step that this is not is never
        another's); the snapshot is let go, and a step that raised under way is forgotten.
        ``previous``: the ``monitor.step`` number before it (None: none), after which a measurement
        made in this step was made; ``skipped``: the step was reported skipped (no update is expected)."""
        self._step_before, self._skipped_step = previous, skipped
        self.sync.say_open_window(step)  # at the job's first calls (a close() inside a window, a preemption, is none)
        self._stepped, self._repeated = self._steps.end_step()
        self._snapshot = self._snapshot_plan = None
        if self._update is not None and self._update_step != step:
            self._update = None
        if self._dropped_step != step:  # a predicted step that this is not: its own snapshot is not refused later
            self._dropped_step = None

    def first_step(self, step: int, logged: bool) -> None:
        """The job's first ``monitor.step`` is ``step``: the measurements made before it, when its
        number was not known (so made as for a log step), are its own; dropped where it is not
        a log step (``logged``), so no later log step reports them."""
        if self._update_step == FIRST_STEP:
            self._update_step = step
        if self._snapshot_step == FIRST_STEP:
            self._snapshot_step = step
        if self._dropped_step == FIRST_STEP:
            self._dropped_step = step
        if not logged:
            self._grad = self._grad_plan = None

    # --- gradients ----------------------------------------------------------------------
    def clip(self, parameters: Any, max_norm: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False,
             foreach: Optional[bool] = None, after_step: Any = None) -> Any:
        """``torch.nn.utils.clip_grad_norm_`` (see :mod:`distmetrics.grad_norm`), or the short form
        ``clip(max_norm[, norm_type])`` for the model's parameters; the measurement is kept for
        the log step."""
        if _is_number(parameters):
            if max_norm is not None:
                norm_type = max_norm
            parameters, max_norm = None, parameters
        if max_norm is None:
            raise TypeError("clip_grad_norm_() missing 1 required argument: 'max_norm'")
        self._check_norm_type(norm_type, "monitor.clip_grad_norm_")
        try:
            result, measured = self.grads.clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach,
                                               self._scale_now(), "monitor.clip_grad_norm_", after_step)
        except NonfiniteNormError as error:  # every rank: the step's gradients measured, NaN or inf, not clipped;
            # the record shows it as it shows a clip that scaled by it (an earlier step's norm was written)
            self._keep(error.measured, after_step, "monitor.clip_grad_norm_")
            raise
        self._keep(measured, after_step, "monitor.clip_grad_norm_")
        return result

    def measure(self, norm_type: Any = 2.0, after_step: Any = None) -> torch.Tensor:
        """Measure without clipping (an attached Megatron optimizer clips in its step); returns the
        total norm (float64, the same on every rank)."""
        self._check_norm_type(norm_type, "monitor.measure_grad_norms")
        result, measured = self.grads.measure(None, norm_type, loss_scale=self._scale_now(),
                                              call="monitor.measure_grad_norms", after_step=after_step)
        if measured is not None and self._optimizer_clip > 0 and measured.norm_type == 2.0:  # Megatron's is a 2-norm
            note_clip(measured, self._optimizer_clip)
        self._keep(measured, after_step, "monitor.measure_grad_norms")
        return measured.total if measured is not None else result.to(torch.float64)

    def _scale_now(self) -> Optional[torch.Tensor]:
        """The attached fp16 optimizer's loss scale now (a tensor on its device), or None."""
        return self._loss_scale() if self._loss_scale is not None else None

    def _check_norm_type(self, norm_type: Any, caller: str) -> None:
        """One family of norm types per run: ``grad_norm`` is reduced across ranks as a sum for a
        p-norm, a max for inf and a min for -inf, and a name keeps its reduction. Refused here,
        before any collective and before the gradients are touched (every rank passes the same)."""
        p = float(norm_type)
        family = "sum" if norm_kind(p) == "count" else norm_kind(p)  # how grad_norm is reduced (a count is a sum)
        if self._norm_family is None:
            self._norm_family = (family, p)
        elif family != self._norm_family[0]:
            first, first_p = self._norm_family
            raise ValueError(
                f"{caller}(norm_type={p:g}): grad_norm is reduced across ranks as a {family} for this norm type, "
                f"but as a {first} for norm_type={first_p:g} earlier in this run, and a metric keeps one reduction; "
                "use norm types of one family for the whole run (p-norms with p >= 0; or inf; or -inf), or a new "
                "Monitor for the other")

    def _keep(self, measured: Optional[GradMeasurement], after_step: Any = None, caller: str = "") -> None:
        """Keep the latest measurement for the log step. One made in the same step as the one kept
        (``after_step``: the last ``monitor.step`` number before both) over other parameters — a
        clip per parameter group, or per network of a GAN — replaces it: said once (the job's first
        rank), since ``grad_norm`` is then the last call's parameters' norm, not the step's; and the
        record has no total ``effective_lr_ratio`` (the whole step's update over a part's norm)."""
        if measured is not None:
            measured.locals = measured.groups = None
            # a second measurement inside one optimizer step (LBFGS's closure, called again after part of the
            # update): not the step's gradient. The first (Lightning clips inside step(closure)) is
            self._in_step_measured = self._in_step_measured + 1 if self._steps.in_flight else 0
            measured.inside_step = self._in_step_measured > 1
            kept = self._grad
            if kept is not None and self._grad_after == after_step and (kept.plan is not measured.plan or kept.partial):
                measured.partial = True
                if not self._warned_partial:
                    self._warned_partial = True
                    if self.layout.says_once:
                        logger.warning(
                            "distmetrics: %s was called twice between two monitor.step calls, on different "
                            "parameters (%d, then %d: one call per parameter group?); grad_norm, its per-module "
                            "values and grad_clip_ratio are the last call's parameters' only, not the step's, and "
                            "such a record has no effective_lr_ratio (the step's whole update over a part's "
                            "gradient norm) but for the modules the last call measured whole. Measure all "
                            "parameters in one call (monitor.clip_grad_norm_ takes a list), or record each group's "
                            "returned norm with monitor.record(name, norm).", caller,
                            len(kept.plan.params), len(measured.plan.params))
            self._nonfinite_steps.measured(measured, same_step=kept is not None and self._grad_after == after_step)
            self._replicas.note(measured, caller)
        self._grad, self._grad_plan = measured, measured.plan if measured is not None else None
        self._grad_after = after_step

    # --- log step ------------------------------------------------------------------------
    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The latest gradient measurement (then forgotten), param and update norms when asked for."""
        out: list[Sample] = []
        grad, plan, self._grad = self._grad, self._grad_plan, None
        self._last_grad = grad
        # an earlier step's (a log step that did not clip): its grad_norm is the last measured, as documented,
        # but the step's update over it is no ratio of one step
        self._last_grad_own = grad is not None and self._grad_after == self._step_before
        if grad is not None and self.log_grad_norm:
            out.append(Sample("grad_norm", grad.local_value, grad.kind))
            if grad.held is not None:  # p < 0: whether any rank owns a gradient (none: the total is 0, as torch's)
                out.append(Sample(_HELD, grad.held, "sum"))
            out.append(Sample("grad_nonfinite", grad.nonfinite, "sum"))
            out.append(Sample("grad_missing_params", grad.missing, "max"))
            if self.per_module:
                out.append(module_vector(plan, "grad_norm", grad.buckets, grad.kind, grad.owned_buckets))
        # plain gradients beside DTensors were checked: whether they differed, OR-ed, and how many this rank held
        out.extend(self._replicas.take(self.layout.pp_rank))
        bad = self._nonfinite_steps.take()
        if bad is not None and self.log_grad_norm:  # the same on every rank
            out.append(Sample("grad_nonfinite_steps", bad, "max"))
        if self._loss_scale is not None:  # an attached fp16 optimizer's, as Megatron logs it (the same on every rank)
            out.append(Sample("loss_scale", self._scale_now().reshape(()), "mean"))
        update, self._update = self._update, None
        if update is not None and self._update_step != ctx.step:
            update = None  # measured for a predicted log step that was not one (steps skipped numbers)
        if self._skipped_step:  # a fused optimizer steps on an overflow too (GradScaler passes found_inf): its
            update = None  # 0.0 is no update, and another optimizer's skipped step has none: alike, said as skipped
        if self.log_update_norm:  # a rank holding parameters without an update: the sum would be a part
            lacks = self._lacks_update(update is None)
            out.append(Sample(_LACKS_UPDATE, lacks, "max"))
            if self._dropped_step == ctx.step and not self._said_dropped and self.layout.says_once:
                self._said_dropped = True
                logger.warning("distmetrics: the record of step %d has no update_norm: an optimizer stepped more than "
                               "once between two monitor.step calls, and its first step's copy of the parameters was "
                               "let go; from the next log step on the copy is kept until monitor.step and the update "
                               "is the step's whole (such records have no effective_lr_ratio). Said once", ctx.step)
        if self._unpredicted is not None:  # a log step that came unpredicted: what it lacks, said once
            self._say_unpredicted(ctx.step, update is None and self.log_update_norm and self._steps.attached,
                                  grad is None)
        self._skipped_after, self._unpredicted = False, None
        if self.log_params_norm or update is not None:
            # the step's trainable set where an update was measured with it: parameters frozen or unfrozen since
            # made the ratio of two sets (relative_update_norm 35 % low, param_norm/<module> of a frozen layer)
            plan = self._update_plan if update is not None else self.grads.plans.model_plan()
            self.grads.check(plan, grads=False)
            squares = self._bucket_squares(plan, self._param_pieces(plan))
            out.append(Sample("param_norm", squares.sum(), "sum"))
            if self.per_module:
                owned = self._param_route(plan, squares.device).owned_buckets
                out.append(module_vector(plan, "param_norm", squares, "sum", owned))
            if update is not None:
                out.append(Sample("update_norm", update.sum(), "sum"))
                if self.per_module:
                    owned = self._param_route(self._update_plan, update.device).owned_buckets
                    out.append(module_vector(self._update_plan, "update_norm", update, "sum", owned))
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Subtree values, roots (p-th roots of Σ nᵖ), ratios, modules with non-finite gradients.
        Where each family's values sit is worked out once per set of names
        (:class:`~distmetrics.collectors.norm_tree.Families`)."""
        grad = self._last_grad
        p, kind = (grad.norm_type, grad.kind) if grad is not None else (2.0, "sum")
        refused = self._replicas.refused(metrics, self.layout, ctx.step)
        if self.log_update_norm:
            self._drop_partial_update(metrics, ctx.step)
        keys = ctx.keys_under(metrics, _PREFIXES)
        if not all(map(metrics.__contains__, keys)):  # a name the reduction did not send this time
            keys = tuple(key for key in keys if key in metrics)
        found = self._families.of(keys)
        for key in found.rank_keys:  # which rank holds a norm's extreme (max/min kinds) is not news
            del metrics[key]
        if metrics.get("grad_nonfinite"):  # some rank's gradient holds NaN or inf: every rank knows
            bad = self._nonfinite_modules(grad, ctx.step)
            if bad:  # a list: a module's name may hold any character, a "," too
                metrics["grad_nonfinite_modules"] = sorted(bad)
            for module, value in bad.items():  # a replica's NaN or inf, as in the total (the owner's copy is finite)
                key = f"grad_norm/{module}"
                if value != 0 and key in metrics:  # NaN or inf: NaN wins, inf passes a finite sum or max
                    metrics[key] = metrics[key] + value
        metrics.pop("grad_missing_params/max_rank", None)
        metrics.pop("grad_nonfinite_steps/max_rank", None)
        for family in _FAMILIES:
            family_kind, family_p = (kind, p) if family == "grad_norm" else ("sum", 2.0)
            root = family_kind == "sum" and family_p != 0
            leaves = found.leaves.get(family)
            if leaves is not None:
                values = leaves.subtrees(leaves.read(metrics), family_kind)
                metrics.update(zip(leaves.out_keys, roots(values, family_p) if root else values))
            if root and family in metrics:
                metrics[family] = roots([metrics[family]], family_p)[0]
        if metrics.pop(_HELD, None) == 0 and "grad_norm" in metrics:  # p < 0, no gradient on any rank: an empty
            metrics["grad_norm"] = 0.0  # sum's root (inf), or the min's identity (inf), is no norm: torch's 0
        if kind != "sum" and grad is not None and grad.total is not None and "grad_norm" in metrics:
            # p = ±inf: the clip's float64 total, the same on every rank (the MAX pack's float32 wrote 1e300 as inf,
            # and a clip by 1e300 as a clip by inf); one host read, at such a log step only
            metrics["grad_norm"] = float(grad.total)
        if grad is not None and grad.max_norm is not None and grad.max_norm > 0 and math.isfinite(grad.max_norm) \
                and "grad_norm" in metrics:
            metrics["grad_clip_ratio"] = metrics["grad_norm"] / grad.max_norm
        if "update_norm" in metrics:
            updates = found.leaves.get("update_norm")
            self._ratios(metrics, grad, ["update_norm"] + (updates.out_keys if updates is not None else []))
        if not self.log_params_norm:
            params = found.leaves.get("param_norm")
            for key in params.out_keys if params is not None else ():
                del metrics[key]
            metrics.pop("param_norm", None)
        if refused is not None:  # raised by the Monitor once the record is written, without one rank's norms
            _drop_grad_norms(metrics)
            raise refused
        return []

    def use_guard(self, guard: Any) -> None:
        """The Monitor's hang guard, for the reduction that names non-finite modules and the
        check that every rank passes the same norm type."""
        self._guard = self.grads.guard = guard

    def _nonfinite_modules(self, grad: Optional[GradMeasurement], step: int) -> dict[str, float]:
        """The modules whose gradient holds NaN or inf on some rank, each with NaN, inf or 0: what its
        non-finite copies give its value (a copy another rank owns counts in the total, not in the
        owner's module values). Each rank's per-module counts and values, reduced by name (ranks may
        hold different modules) in a reduction of their own, made only at a log step whose total
        count is not 0, on every rank alike."""
        if self._flags is None:
            self._flags = Reducer(self.group, guard=self._guard, call="monitor.step (non-finite modules)")
        samples = []
        if grad is not None:  # per bucket, NaN or inf where its copies' make it so (inf: no min's), else 0
            values = grad.buckets
            blown = torch.isnan(values) if grad.kind == "min" else values.isfinite().logical_not()
            blown = torch.where(blown, values, torch.zeros_like(values))
            samples = [module_vector(grad.plan, "_grad_bad", grad.bad_buckets(), "sum", grad.local_buckets),
                       module_vector(grad.plan, "_grad_blown", blown, "sum", grad.local_buckets)]
        counts = self._flags.reduce(samples, tag=step).values
        return {name[len("_grad_bad/"):]: counts.get("_grad_blown/" + name[len("_grad_bad/"):], 0.0)
                for name, count in counts.items() if name.startswith("_grad_bad/") and count}

    def close(self) -> None:
        """Remove the optimizer hooks, and the accumulation check's forward hooks."""
        self._steps.close()
        self._snapshot = self._snapshot_plan = None
        self.sync.close()


def _drop_grad_norms(metrics: dict[str, Any]) -> None:
    """Take out of a record the values a refused replica check makes one rank's: every gradient norm
    and the clip ratio; and, since the optimizer stepped each rank by its own plain gradients (so their
    parameters differ too, and count on one rank), the parameter and update norms and their ratios."""
    for key in [k for k in metrics if k in _ONE_RANKS or k.startswith(_ONE_RANKS_PREFIXES)]:
        del metrics[key]


_ONE_RANKS = ("grad_norm", "grad_clip_ratio", "param_norm", "update_norm", "relative_update_norm", "effective_lr_ratio")
_ONE_RANKS_PREFIXES = tuple(f"{family}/" for family in _ONE_RANKS if family != "grad_clip_ratio")


def _is_number(value: Any) -> bool:
    """A max_norm: a real number (numpy's too: ``np.float32(1.0)``), or a 0-d tensor that is no parameter."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)) or \
        (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad and value.grad is None)
