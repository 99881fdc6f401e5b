"""Gradient, parameter and update norms for the log step: totals and every module's subtree.

Gradients are measured by :mod:`distmetrics.grad_norm` (exact under every layout, any p) when
the loop calls ``monitor.clip_grad_norm_`` or ``monitor.measure_grad_norms``; parameter and update
norms on log steps only. Each module that owns parameters is a bucket whose value (Σ nᵖ, or the
max for p = inf) travels in the log step's pack as one vector; after the reduction every module
with trainable parameters anywhere below it gets its subtree's norm (``grad_norm/layers.2`` is the
whole block), computed from the buckets on the host: no extra collective, no extra pass. The
root's own parameters are ``grad_norm/model``. Which modules hold a NaN or inf gradient travels
only when the log step's total count of non-finite tensors is not 0 (one more reduction, then).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from ..grad_norm import GradientNorms, GradMeasurement, note_clip, per_tensor_norms
from ..plans import Buckets, Plan, route_of
from ..naming import ROOT_MODULE
from ..megatron_optimizer import MegatronShards, is_megatron_optimizer
from ..parallel import local_tensor
from ..reduce import Reducer
from .base import Alert, LogContext, Sample

__all__ = ["NormCollector", "subtree_values"]

_FAMILIES = ("grad_norm", "param_norm", "update_norm")
_PREFIXES = ("grad_norm/", "param_norm/", "update_norm/")


class NormCollector:
    """Grad/param/update norms of one model (``grad_norm``, ``param_norm``, ``update_norm`` and
    their ``/<module>`` values, ``grad_clip_ratio``, ratios, non-finite module names)."""

    name = "norms"
    after = ()
    writes = ("grad_norm", "grad_norm/", "param_norm", "param_norm/", "update_norm", "update_norm/",
              "relative_update_norm", "relative_update_norm/", "effective_lr_ratio", "effective_lr_ratio/",
              "grad_clip_ratio", "grad_nonfinite", "grad_nonfinite_modules", "grad_missing_params")

    def __init__(self, model: torch.nn.Module, layout: Any, group: Any = None, depth: Optional[int] = None,
                 per_module: bool = True, log_grad_norm: bool = True, log_params_norm: bool = False,
                 log_update_norm: bool = False, snapshot: str = "device") -> None:
        self.grads = GradientNorms(model, layout, group, depth)
        self.layout = layout
        self.group = group
        self.per_module = per_module
        self.log_grad_norm = log_grad_norm
        self.log_params_norm = log_params_norm
        self.log_update_norm = log_update_norm
        self.snapshot_device = snapshot
        self._grad: Optional[GradMeasurement] = None  # the latest measurement
        self._grad_plan: Optional[Plan] = None
        self._update: Optional[torch.Tensor] = None
        self._snapshot: Optional[list] = None
        self._last_grad: Optional[GradMeasurement] = None
        self._hooks: list = []
        self._stepping = 0  # inner optimizer steps under way
        self._optimizer_clip = 0.0  # the clip_grad of an attached Megatron optimizer (0: it does not clip)
        self._families = _Families()
        self._flags: Optional[Reducer] = None  # reduces per-module non-finite counts, when there are any
        self._guard: Any = None

    @property
    def replans(self) -> int:
        """How often the model's parameters changed and the plan was rebuilt."""
        return self.grads.plans.replans

    def attach_optimizer(self, optimizer: Any, is_log_step: Callable[[], bool]) -> None:
        """Learn from the optimizer: with Megatron's distributed optimizer, which gradient slices
        this rank owns and where its fp32 main parameters live; and, for update norms, snapshot
        the (main) parameters before the step when it will be logged (``is_log_step()``) and
        diff after it — around the inner ``torch.optim`` step for Megatron's optimizers. A
        Megatron optimizer's ``config.clip_grad`` is the clip its step applies: gradients measured
        with :meth:`measure` count as clipped there (``grad_clip_ratio``, ``effective_lr_ratio``)."""
        targets = [optimizer]
        if is_megatron_optimizer(optimizer):
            self._optimizer_clip = float(getattr(getattr(optimizer, "config", None), "clip_grad", 0.0) or 0.0)
            shards = MegatronShards(optimizer)
            if shards.active:
                self.grads.attach_shards(shards)
            targets = shards.inner
        if not self.log_update_norm:
            return

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            if self._stepping == 0 and is_log_step():
                self.snapshot()
            self._stepping += 1

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            self._stepping -= 1
            if self._stepping == 0:  # after the last of a chained optimizer's inner steps
                self.diff()

        for target in targets:
            self._hooks += [target.register_step_pre_hook(before), target.register_step_post_hook(after)]

    # --- gradients ----------------------------------------------------------------------
    def clip(self, parameters: Any, max_norm: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False,
             foreach: Optional[bool] = None) -> Any:
        """``torch.nn.utils.clip_grad_norm_`` (see :mod:`distmetrics.grad_norm`), or the short form
        ``clip(max_norm[, norm_type])`` for the model's parameters; the measurement is kept for
        the log step."""
        if _is_number(parameters):
            if max_norm is not None:
                norm_type = max_norm
            parameters, max_norm = None, parameters
        if max_norm is None:
            raise TypeError("clip_grad_norm_() missing 1 required argument: 'max_norm'")
        result, measured = self.grads.clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        self._keep(measured)
        return result

    def measure(self, norm_type: Any = 2.0) -> torch.Tensor:
        """Measure without clipping (an attached Megatron optimizer clips in its step); returns the
        total norm (float64, the same on every rank)."""
        result, measured = self.grads.measure(None, norm_type)
        if measured is not None and self._optimizer_clip > 0 and measured.norm_type == 2.0:  # Megatron's is a 2-norm
            note_clip(measured, self._optimizer_clip)
        self._keep(measured)
        return measured.total if measured is not None else result.to(torch.float64)

    def _keep(self, measured: Optional[GradMeasurement]) -> None:
        if measured is not None:
            measured.locals = measured.groups = None
        self._grad, self._grad_plan = measured, measured.plan if measured is not None else None

    # --- optimizer hooks for update norms -------------------------------------------------
    def snapshot(self) -> None:
        """Copy the local shards before ``optimizer.step()`` (log steps only)."""
        plan = self.grads.plans.model_plan()
        locals_ = self._param_pieces(plan)
        if self.snapshot_device == "cpu":
            self._snapshot = [t.to("cpu", copy=True) for t in locals_]
        else:
            self._snapshot = torch._foreach_mul(locals_, 1.0)

    def diff(self) -> None:
        """After ``optimizer.step()``: per-bucket ‖P_new − P_old‖², then drop the snapshot."""
        if self._snapshot is None:
            return
        plan = self.grads.plans.model_plan()
        old, self._snapshot = self._snapshot, None
        new = self._param_pieces(plan)
        if len(new) != len(old):
            return  # the model changed during the step; skip this measurement
        if self.snapshot_device == "cpu":
            new = [t.to("cpu") for t in new]
        torch._foreach_sub_(old, new)
        self._update = self._bucket_squares(plan, old)

    # --- log step ------------------------------------------------------------------------
    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The latest gradient measurement (then forgotten), param and update norms when asked for."""
        out: list[Sample] = []
        grad, plan, self._grad = self._grad, self._grad_plan, None
        self._last_grad = grad
        if grad is not None and self.log_grad_norm:
            out.append(Sample("grad_norm", grad.local_total, grad.kind))
            out.append(Sample("grad_nonfinite", grad.nonfinite, "sum"))
            out.append(Sample("grad_missing_params", grad.missing, "max"))
            if self.per_module:
                out.append(_vector(plan, "grad_norm", grad.buckets, grad.kind, grad.owned_buckets))
        update, self._update = self._update, None
        if self.log_params_norm or update is not None:
            plan = self.grads.plans.model_plan()
            squares = self._bucket_squares(plan, self._param_pieces(plan))
            out.append(Sample("param_norm", squares.sum(), "sum"))
            if self.per_module:
                owned = self._param_route(plan, squares.device).owned_buckets
                out.append(_vector(plan, "param_norm", squares, "sum", owned))
            if update is not None:
                out.append(Sample("update_norm", update.sum(), "sum"))
                if self.per_module:
                    owned = self._param_route(plan, update.device).owned_buckets
                    out.append(_vector(plan, "update_norm", update, "sum", owned))
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Subtree values, roots (p-th roots of Σ nᵖ), ratios, modules with non-finite gradients.
        Where each family's values sit is worked out once per set of names (:class:`_Families`)."""
        grad = self._last_grad
        p, kind = (grad.norm_type, grad.kind) if grad is not None else (2.0, "sum")
        keys = ctx.keys_under(metrics, _PREFIXES)
        if not all(map(metrics.__contains__, keys)):  # a name the reduction did not send this time
            keys = tuple(key for key in keys if key in metrics)
        found = self._families.of(keys)
        for key in found.rank_keys:  # which rank holds a norm's extreme (max/min kinds) is not news
            del metrics[key]
        if metrics.get("grad_nonfinite"):  # some rank's gradient holds NaN or inf: every rank knows
            bad = self._nonfinite_modules(grad, ctx.step)
            if bad:
                metrics["grad_nonfinite_modules"] = ",".join(sorted(bad))
        metrics.pop("grad_missing_params/max_rank", None)
        for family in _FAMILIES:
            family_kind, family_p = (kind, p) if family == "grad_norm" else ("sum", 2.0)
            root = family_kind == "sum" and family_p != 0
            leaves = found.leaves.get(family)
            if leaves is not None:
                values = leaves.subtrees([metrics[key] for key in leaves.keys], family_kind)
                metrics.update(zip(leaves.out_keys, _roots(values, family_p) if root else values))
            if root and family in metrics:
                metrics[family] = _roots([metrics[family]], family_p)[0]
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
        return []

    def use_guard(self, guard: Any) -> None:
        """The Monitor's hang guard, for the reduction that names non-finite modules."""
        self._guard = guard

    def _nonfinite_modules(self, grad: Optional[GradMeasurement], step: int) -> list[str]:
        """The modules whose gradient holds NaN or inf on some rank: each rank's per-module counts,
        reduced by name (ranks may hold different modules) in a reduction of their own, made only
        at a log step whose total count is not 0, on every rank alike."""
        if self._flags is None:
            self._flags = Reducer(self.group, guard=self._guard, call="monitor.step (non-finite modules)")
        samples = [] if grad is None else [
            _vector(grad.plan, "_grad_bad", grad.bad_buckets(), "sum", grad.local_buckets)]
        counts = self._flags.reduce(samples, tag=step).values
        return [name[len("_grad_bad/"):] for name, count in counts.items() if count]

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _ratios(self, metrics: dict[str, Any], grad: Optional[GradMeasurement], keys: list[str]) -> None:
        """relative_update_norm = update/param; effective_lr_ratio = update/‖clipped grad‖ (p = 2),
        for the update-norm ``keys`` (the total and every subtree)."""
        coef = float(grad.coef) if grad is not None and grad.coef is not None else 1.0
        same_norm = grad is None or grad.norm_type == 2.0
        for key in keys:
            suffix = key[len("update_norm"):]
            param = metrics.get(f"param_norm{suffix}")
            if param:
                metrics[f"relative_update_norm{suffix}"] = metrics[key] / param
            g = metrics.get(f"grad_norm{suffix}")
            if g and same_norm:
                metrics[f"effective_lr_ratio{suffix}"] = metrics[key] / (g * coef)

    def _param_pieces(self, plan: Plan) -> list[torch.Tensor]:
        """This rank's piece of every parameter: the distributed optimizer's fp32 main shard,
        the fp32 main copy Megatron's mixed-precision optimizer updates (``main_param``: it
        copies it into the 16-bit parameter only after the inner step), a DTensor's local
        shard, or the parameter."""
        shards = self.grads.shards
        out = []
        for p in plan.params:
            main = shards.main_shard(p) if shards is not None else None
            if main is None and not getattr(p, "main_param_sharded", False):
                main = getattr(p, "main_param", None)
            out.append(main.detach() if main is not None else local_tensor(p.detach()))
        return out

    def _param_route(self, plan: Plan, device: torch.device) -> Any:
        """The params' :class:`~distmetrics.plans.Route` on ``device`` (cached)."""
        route = plan.param_routes.get(device)
        if route is None:
            weights = [self.grads.owns(p, n, p) for p, n in zip(plan.params, plan.names)]
            route = plan.param_routes[device] = route_of(plan, list(range(len(plan.params))), weights, device)
        return route

    def _bucket_squares(self, plan: Plan, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per-bucket Σ w·‖t‖² for tensors laid out like the params (params or their updates)."""
        device = tensors[0].device if tensors else torch.device("cpu")
        route = self._param_route(plan, device)
        norms = per_tensor_norms(tensors, 2.0, None, device, route.orders)
        squares = norms * norms
        contrib = squares if route.every else torch.where(route.owned, squares, torch.zeros_like(squares))
        return torch.zeros(len(plan.buckets), dtype=torch.float64, device=device).index_add_(
            0, route.bucket_idx, contrib)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or \
        (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad and value.grad is None)


def subtree_values(leaves: dict[str, float], combine: Callable[[float, float], float]) -> dict[str, float]:
    """Every module's value over its subtree, from the values of the modules that own
    parameters (``leaves``); the root's own parameters (``model``) keep their own value.
    ``combine``: ``"sum"``, ``max`` or ``min`` (NaN wins a max or a min)."""
    tree = _Leaves("", list(leaves), {})
    kind = {"sum": "sum", max: "max", min: "min"}.get(combine, combine)
    return dict(zip(tree.out_modules, tree.subtrees(list(leaves.values()), kind)))


def _chain(module: str) -> tuple[str, ...]:
    """A module and its ancestors, outermost first (``model``, the root's own parameters, alone)."""
    if module == ROOT_MODULE:
        return (module,)
    parts = module.split(".")
    return tuple(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))


class _Leaves:
    """One family's leaf values (modules owning parameters) in a log step's metrics, and the
    subtrees they add up into."""

    def __init__(self, family: str, modules: list[str], chains: dict[str, tuple]) -> None:
        self.keys = [f"{family}/{module}" for module in modules]
        ancestry = [chains.get(m) or chains.setdefault(m, _chain(m)) for m in modules]
        self.out_modules = list(dict.fromkeys(a for chain in ancestry for a in chain))
        self.out_keys = [f"{family}/{module}" for module in self.out_modules]
        position = {module: i for i, module in enumerate(self.out_modules)}
        self._into = [tuple(position[a] for a in chain) for chain in ancestry]

    def subtrees(self, values: list[float], kind: str) -> list[float]:
        """Every subtree's value (``kind``: sum, max or min) in ``out_modules`` order."""
        if kind == "sum":
            out = [0.0] * len(self.out_modules)
            for value, into in zip(values, self._into):
                for i in into:
                    out[i] += value
            return out
        pick = max if kind == "max" else min
        best: list = [None] * len(self.out_modules)
        for value, into in zip(values, self._into):
            for i in into:
                old = best[i]
                best[i] = value if old is None or value != value else old if old != old else pick(old, value)
        return best


class _Families:
    """Where each family's leaves sit, worked out once per set of names (log steps repeat them)."""

    def __init__(self) -> None:
        self._by_keys: dict[tuple, _Found] = {}
        self._chains: dict[str, tuple] = {}
        self._last: tuple = (None, None)

    def of(self, keys: tuple) -> "_Found":
        """The :class:`_Found` of these metric keys (the same tuple as last time: no lookup)."""
        if keys is self._last[0]:
            return self._last[1]
        found = self._by_keys.get(keys)
        if found is None:
            if len(self._by_keys) >= 8:  # the names rarely change; keep a few sets
                self._by_keys.clear()
            found = self._by_keys[keys] = _Found(keys, self._chains)
        self._last = (keys, found)
        return found


class _Found:
    """One set of names: the rank keys to drop and each family's :class:`_Leaves`."""

    def __init__(self, keys: tuple, chains: dict[str, tuple]) -> None:
        self.rank_keys = [key for key in keys if key.endswith(("/max_rank", "/min_rank"))]
        modules: dict[str, list[str]] = {}
        for key in keys:
            if not key.endswith(("/max_rank", "/min_rank")):
                family, _, module = key.partition("/")
                modules.setdefault(family, []).append(module)
        self.leaves = {family: _Leaves(family, names, chains) for family, names in modules.items()}


def _roots(values: list[float], p: float) -> list[float]:
    """The p-th roots of sums of p-th powers (NaN for a negative sum; NaN stays NaN)."""
    if p == 2.0:
        return [math.sqrt(v) if v >= 0 else math.nan for v in values]
    return [v ** (1.0 / p) if v >= 0 else math.nan for v in values]


def _vector(plan: Plan, family: str, values: torch.Tensor, kind: str, buckets: Buckets) -> Sample:
    """One vector sample of ``values[buckets]``, named ``<family>/<module>`` (names cached; every
    bucket in order, as on one rank, takes ``values`` as they are)."""
    key = (family, buckets.ids)
    cached = plan.vectors.get(key)
    if cached is None:
        names = tuple(f"{family}/{plan.buckets[i]}" for i in buckets.ids)
        cached = plan.vectors[key] = (names, buckets.ids == tuple(range(len(plan.buckets))))
    names, every = cached
    picked = values if every else values.index_select(0, buckets.index.to(values.device))
    return Sample(family, picked, kind, names=names)
