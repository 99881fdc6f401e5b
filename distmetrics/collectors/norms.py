"""Exact gradient, parameter and update norms across every parallel layout, per module.

Each parameter's local tensor (``p.to_local()`` for a DTensor, else ``p``; its gradient
``p.main_grad`` when Megatron set one, else ``p.grad``) gets an ownership weight w ∈ {0, 1}
from :func:`distmetrics.parallel.owns_local_piece`, so that Σ over ranks of w·‖local‖² counts
every element of the global tensor exactly once.

One ``torch._foreach_norm`` over the local tensors, then w·norm² is segment-summed into
per-module buckets with one ``index_add``; the total and every module travel in the reducer's
one SUM pack at the log step, the modules as one vector sample. ``clip_grad_norm_`` needs the
total before the optimizer step, so it all-reduces one number (as any correct clipping must)
and reuses the per-tensor norms to scale in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..naming import ROOT_MODULE, global_param_name, module_name_map
from ..parallel import local_tensor, owns_local_piece
from .base import Alert, LogContext, Sample

__all__ = ["NormCollector"]


@dataclass
class _Plan:
    params: list[torch.nn.Parameter]
    names: list[str]  # global parameter names
    buckets: list[str]  # module names, one per bucket
    bucket_of: torch.Tensor  # [P] long: bucket index of each param
    signature: tuple
    routing: dict = field(default_factory=dict)  # cached ownership/bucket tensors per grad set
    param_owned: Optional[torch.Tensor] = None  # ownership of the params themselves
    param_vector: Optional[tuple] = None  # (bucket index tensor, names per family) of owned buckets
    slots: list = field(default_factory=list)  # (module, key, param, requires_grad) of every param
    generation: int = -1  # _REGISTRATIONS when the slots were read
    vectors: dict = field(default_factory=dict)  # (family, bucket ids) → element names


# Parameters or modules registered anywhere in the process since start: a plan made before
# the last registration is checked again.
_REGISTRATIONS = [0]


def _registered(*args: Any) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


class NormCollector:
    """Grad/param/update norms for one model (``grad_norm``, ``param_norm``, ``update_norm``
    and their ``/<module>`` values, ``grad_clip_ratio``, ratios, non-finite module names)."""

    name = "norms"
    after = ()

    def __init__(self, model: torch.nn.Module, layout: Any, group: Any = None, depth: Optional[int] = None,
                 per_module: bool = True, log_grad_norm: bool = True, log_params_norm: bool = False,
                 log_update_norm: bool = False, snapshot: str = "device") -> None:
        self.model = model
        self.layout = layout
        self.group = group
        self.depth = depth
        self.per_module = per_module
        self.log_grad_norm = log_grad_norm
        self.log_params_norm = log_params_norm
        self.log_update_norm = log_update_norm
        self.snapshot_device = snapshot
        self._plan: Optional[_Plan] = None
        self._grad: Optional[dict] = None  # latest measurement: bucket sums, total, ...
        self._update: Optional[dict] = None
        self._snapshot: Optional[list] = None
        self._last_grad: Optional[dict] = None
        self._hooks: list = []
        self.replans = 0

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, is_log_step: Callable[[], bool]) -> None:
        """Measure update norms: snapshot the local shards before ``optimizer.step()`` when the
        coming step will be logged (``is_log_step()``), diff after it."""
        def before(opt: Any, args: Any, kwargs: Any) -> None:
            if is_log_step():
                self.snapshot()

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            self.diff()

        self._hooks += [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]

    # --- gradients ----------------------------------------------------------------------
    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Measure and scale the gradients by ``min(1, max_norm / total)``; returns the total."""
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r}: accepted values are numbers > 0 (inf to only measure)")
        return self.measure(norm_type, max_norm)

    def measure(self, norm_type: float = 2.0, max_norm: Optional[float] = None) -> torch.Tensor:
        """Per-tensor norms → bucket sums; the global total (one all-reduce); clip if asked.

        Returns the pre-clip total norm as a 0-d float64 tensor, identical on every rank.
        """
        norm_type = _check_norm_type(norm_type)
        plan = self._current_plan()
        grads, index = [], []
        for i, p in enumerate(plan.params):
            g = _grad_of(p)
            if g is not None:
                grads.append(g)
                index.append(i)
        if not grads:
            self._grad = None
            return _all_reduce_total(torch.zeros((), dtype=torch.float64), norm_type, self.group)
        locals_ = [local_tensor(g) for g in grads]
        device = locals_[0].device
        owned, bucket_idx, owned_buckets, local_buckets = self._grad_routing(plan, grads, index, device)
        norms = torch.stack(torch._foreach_norm(locals_, norm_type)).to(torch.float64)
        zeros = torch.zeros(len(plan.buckets), dtype=torch.float64, device=device)
        if norm_type == 2.0:
            contrib = torch.where(owned, norms * norms, torch.zeros_like(norms))
            buckets = zeros.index_add(0, bucket_idx, contrib)
            local_total = contrib.sum()
        else:
            contrib = torch.where(owned, norms, torch.zeros_like(norms))
            buckets = zeros.index_reduce(0, bucket_idx, contrib, "amax", include_self=True)
            local_total = contrib.max()
        # Every local tensor is checked, owned or not: a NaN on one replica (silent corruption
        # of one GPU) must not hide behind the copy on the owning rank.
        nonfinite = (~torch.isfinite(norms)).to(torch.float64)
        total = _all_reduce_total(local_total, norm_type, self.group)
        self._grad = {"norm_type": norm_type, "buckets": buckets, "local_total": local_total,
                      "nonfinite": nonfinite.sum(), "bad_buckets": zeros.index_add(0, bucket_idx, nonfinite),
                      "missing": float(len(plan.params) - len(index)), "max_norm": max_norm, "coef": None,
                      "owned_buckets": owned_buckets, "local_buckets": local_buckets}
        if max_norm is not None and math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self._grad["coef"] = coef
            torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
        return total

    def _grad_routing(self, plan: _Plan, grads: list, index: list[int], device: torch.device):
        """(ownership mask, bucket index, owned buckets, local buckets) of the params that have
        gradients, cached per plan and gradient set."""
        key = (tuple(index), device)
        cached = plan.routing.get(key)
        if cached is None:
            weights = [owns_local_piece(g, plan.params[i], plan.names[i], self.layout, self.group)
                       for g, i in zip(grads, index)]
            owned = torch.tensor(weights, dtype=torch.bool, device=device)
            bucket_idx = plan.bucket_of[torch.tensor(index, dtype=torch.long)].to(device)
            # Buckets this rank owns nothing of are not sent: a bucket nobody owns (the last
            # stage's copy of a tied embedding) does not appear at all.
            owned_buckets = _index(sorted({int(plan.bucket_of[i]) for i, w in zip(index, weights) if w}), device)
            local_buckets = _index(sorted({int(plan.bucket_of[i]) for i in index}), device)
            cached = plan.routing[key] = (owned, bucket_idx, owned_buckets, local_buckets)
        return cached

    # --- optimizer hooks for update norms -------------------------------------------------
    def snapshot(self) -> None:
        """Copy the local shards before ``optimizer.step()`` (log steps only)."""
        plan = self._current_plan()
        locals_ = [local_tensor(p.detach()) for p in plan.params]
        if self.snapshot_device == "cpu":
            self._snapshot = [t.to("cpu", copy=True) for t in locals_]
        else:
            self._snapshot = torch._foreach_mul(locals_, 1.0)

    def diff(self) -> None:
        """After ``optimizer.step()``: per-bucket ‖P_new − P_old‖², then drop the snapshot."""
        if self._snapshot is None:
            return
        plan = self._current_plan()
        old, self._snapshot = self._snapshot, None
        new = [local_tensor(p.detach()) for p in plan.params]
        if len(new) != len(old):
            return  # the model changed during the step; skip this measurement
        if self.snapshot_device == "cpu":
            new = [t.to("cpu") for t in new]
        torch._foreach_sub_(old, new)
        self._update = {"buckets": self._bucket_squares(plan, old)}

    # --- log step ------------------------------------------------------------------------
    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The latest measurement (then forgotten), and param/update norms when asked for."""
        out: list[Sample] = []
        plan = self._plan
        grad, self._grad = self._grad, None
        self._last_grad = grad
        if grad is not None and self.log_grad_norm and plan is not None:
            kind = "sum" if grad["norm_type"] == 2.0 else "max"
            out.append(Sample("grad_norm", grad["local_total"], kind))
            out.append(Sample("grad_nonfinite", grad["nonfinite"], "sum"))
            out.append(Sample("grad_missing_params", grad["missing"], "max"))
            if self.per_module:
                out.append(self._vector(plan, "grad_norm", grad["buckets"], kind, grad["owned_buckets"]))
            out.append(self._vector(plan, "_grad_bad", grad["bad_buckets"], "sum", grad["local_buckets"]))
        update, self._update = self._update, None
        if (self.log_params_norm or update is not None) and plan is not None:
            sq = self._bucket_squares(plan, [local_tensor(p.detach()) for p in plan.params])
            out.append(Sample("param_norm", sq.sum(), "sum"))
            if self.per_module:
                out.append(self._vector(plan, "param_norm", sq, "sum", plan.param_vector))
        if update is not None and plan is not None:
            out.append(Sample("update_norm", update["buckets"].sum(), "sum"))
            if self.per_module:
                out.append(self._vector(plan, "update_norm", update["buckets"], "sum", plan.param_vector))
        return out

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Square roots, ratios, and the names of modules with non-finite gradients."""
        grad = self._last_grad
        rooted = {"param_norm", "update_norm"}
        if grad is not None and grad["norm_type"] == 2.0:
            rooted.add("grad_norm")
        bad = []
        for key in list(metrics):
            root, _, module = key.partition("/")
            if root == "_grad_bad":
                if metrics.pop(key):
                    bad.append(module)
            elif key.endswith("/max_rank") and root in ("grad_norm", "grad_missing_params"):
                del metrics[key]  # which rank holds a norm's maximum is not news
            elif root in rooted and isinstance(metrics[key], float):
                metrics[key] = math.sqrt(metrics[key]) if metrics[key] >= 0 else math.nan
        if bad:
            metrics["grad_nonfinite_modules"] = ",".join(sorted(bad))
        if grad is not None and grad["max_norm"] is not None and math.isfinite(grad["max_norm"]) \
                and "grad_norm" in metrics:
            metrics["grad_clip_ratio"] = metrics["grad_norm"] / grad["max_norm"]
        if "update_norm" in metrics:
            self._ratios(metrics, grad)
        if not self.log_params_norm:
            for key in [k for k in metrics if k.split("/", 1)[0] == "param_norm"]:
                del metrics[key]
        return []

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _ratios(self, metrics: dict[str, Any], grad: Optional[dict]) -> None:
        """relative_update_norm = update/param; effective_lr_ratio = update/‖clipped grad‖."""
        coef = float(grad["coef"]) if grad is not None and grad.get("coef") is not None else 1.0
        for key in [k for k in metrics if k.split("/", 1)[0] == "update_norm" and isinstance(metrics[k], float)]:
            suffix = key[len("update_norm"):]
            param = metrics.get(f"param_norm{suffix}")
            if param:
                metrics[f"relative_update_norm{suffix}"] = metrics[key] / param
            g = metrics.get(f"grad_norm{suffix}")
            if g:
                metrics[f"effective_lr_ratio{suffix}"] = metrics[key] / (g * coef)

    @staticmethod
    def _vector(plan: _Plan, family: str, values: torch.Tensor, kind: str, buckets: "_Buckets") -> Sample:
        """One vector sample of ``values[buckets]``, named ``<family>/<module>`` (names cached)."""
        key = (family, buckets.ids)
        names = plan.vectors.get(key)
        if names is None:
            names = plan.vectors[key] = tuple(f"{family}/{plan.buckets[i]}" for i in buckets.ids)
        return Sample(family, values.index_select(0, buckets.index.to(values.device)), kind, names=names)

    # --- planning ------------------------------------------------------------------------
    def _current_plan(self) -> _Plan:
        """The bucket plan, rebuilt when the model's parameters changed: a parameter registered
        anywhere (torch's global registration hooks), one replaced in its module or frozen or
        unfrozen (a check of each cached slot: far cheaper than walking ``named_parameters``)."""
        plan = self._plan
        if plan is not None and plan.generation == _REGISTRATIONS[0] and all(
                module._parameters.get(key) is param and param.requires_grad == grad
                for module, key, param, grad in plan.slots):
            return plan
        slots = _param_slots(self.model)
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        signature = tuple(id(p) for _, p in params)
        if plan is None or plan.signature != signature:
            plan = self._plan = self._build_plan(params, signature)
        plan.slots, plan.generation = slots, _REGISTRATIONS[0]
        return plan

    def _build_plan(self, params: list, signature: tuple) -> _Plan:
        if self._plan is not None:
            self.replans += 1
        rename = module_name_map(self.model)
        names, buckets, bucket_ids = [], [], []
        index: dict[str, int] = {}
        for raw, _ in params:
            name = global_param_name(raw, rename)
            names.append(name)
            module = name.rsplit(".", 1)[0] if "." in name else ROOT_MODULE
            if self.depth is not None:
                module = ".".join(module.split(".")[: self.depth])
            if module not in index:
                index[module] = len(buckets)
                buckets.append(module)
            bucket_ids.append(index[module])
        return _Plan([p for _, p in params], names, buckets, torch.tensor(bucket_ids, dtype=torch.long), signature)

    def _bucket_squares(self, plan: _Plan, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per-bucket Σ w·‖t‖² for tensors laid out like the params (params or their updates)."""
        device = tensors[0].device if tensors else torch.device("cpu")
        if plan.param_owned is None or plan.param_owned.device != device:
            weights = [owns_local_piece(p, p, n, self.layout, self.group) for p, n in zip(plan.params, plan.names)]
            plan.param_owned = torch.tensor(weights, dtype=torch.bool, device=device)
            plan.param_vector = _index(sorted({int(b) for b, w in zip(plan.bucket_of.tolist(), weights) if w}),
                                       device)
        norms = torch.stack(torch._foreach_norm(tensors, 2.0)).to(torch.float64)
        contrib = torch.where(plan.param_owned, norms * norms, torch.zeros_like(norms))
        return torch.zeros(len(plan.buckets), dtype=torch.float64, device=device).index_add_(
            0, plan.bucket_of.to(device), contrib)


# --- helpers ------------------------------------------------------------------------------

def _param_slots(model: torch.nn.Module) -> list:
    """Where each parameter lives, in ``named_parameters`` order (shared ones once)."""
    seen, slots = set(), []
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                slots.append((module, key, param, param.requires_grad))
    return slots


@dataclass(frozen=True)
class _Buckets:
    """A set of bucket ids and the same as an index tensor on the measuring device."""

    ids: tuple
    index: torch.Tensor = field(compare=False, hash=False)


def _index(ids: list[int], device: torch.device) -> _Buckets:
    return _Buckets(tuple(ids), torch.tensor(ids, dtype=torch.long, device=device))


def _grad_of(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _check_norm_type(norm_type: float) -> float:
    value = float(norm_type)
    if value not in (2.0, math.inf):
        raise ValueError(f"norm_type={norm_type!r}: accepted values are 2 and inf")
    return value


def _all_reduce_total(local_total: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return local_total.sqrt() if norm_type == 2.0 else local_total
    backend = str(dist.get_backend(group)).lower()
    value = local_total
    if "nccl" not in backend and value.device.type != "cpu":
        value = value.cpu()
    value = value.clone()
    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    dist.all_reduce(value, op=op, group=group)
    value = value.to(local_total.device)
    return value.sqrt() if norm_type == 2.0 else value
