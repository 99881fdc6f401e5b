"""Exact gradient, parameter and update norms across every parallel layout, per module.

Ownership rule: each parameter's local tensor (``p.to_local()`` for a DTensor, else ``p``; its
gradient ``p.main_grad`` when Megatron set one, else ``p.grad``) gets a weight w ∈ {0, 1} such
that Σ over ranks of w·‖local‖² counts every element of the global tensor exactly once:

* DTensor (FSDP2, HSDP, TP, FSDP2+TP): w = 1 iff the mesh coordinate is 0 on every mesh
  dimension whose placement is ``Replicate``; ``Shard`` dimensions count everywhere;
  ``Partial`` is refused (the tensor is not a finished gradient).
* Megatron-Core: ``tensor_model_parallel`` params count on every TP rank, others on TP rank 0;
  ``shared`` (the last stage's copy of a tied embedding) never; data-parallel replicas once;
  expert params once per expert-data-parallel group.
* Anything else (DDP, no wrapper): replicas count on rank 0 of the reduction group only.

One ``torch._foreach_norm`` over the local tensors, then w·norm² is segment-summed into
per-module buckets with one ``index_add_``; the total and every module travel in the reducer's
one SUM pack at the log step. ``clip_grad_norm_`` needs the total before the optimizer step, so
it all-reduces one number (as any correct clipping must) and reuses the per-tensor norms to
scale in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..reduce import Sample

__all__ = ["NormCollector", "module_name_map", "WRAPPER_PREFIXES"]

WRAPPER_PREFIXES = ("module.", "_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
_WRAPPER_LEVELS = frozenset(prefix[:-1] for prefix in WRAPPER_PREFIXES)


@dataclass
class _Plan:
    params: list[torch.nn.Parameter]
    names: list[str]  # global parameter names
    buckets: list[str]  # module names, one per bucket
    bucket_of: torch.Tensor  # [P] long: bucket index of each param
    signature: tuple
    routing: dict = field(default_factory=dict)  # cached ownership/bucket tensors per grad set
    param_owned: Optional[torch.Tensor] = None  # ownership of the params themselves
    param_owned_buckets: list = field(default_factory=list)
    slots: list = field(default_factory=list)  # (module, key, param, requires_grad) of every param
    generation: int = -1  # _REGISTRATIONS when the slots were read


# Parameters or modules registered anywhere in the process since start: a plan made before
# the last registration is checked again.
_REGISTRATIONS = [0]


def _registered(*args: Any) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


def _param_slots(model: torch.nn.Module) -> list:
    """Where each parameter lives, in ``named_parameters`` order (shared ones once)."""
    seen, slots = set(), []
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                slots.append((module, key, param, param.requires_grad))
    return slots


class NormCollector:
    """Grad/param/update norms for one model; owned by the Monitor."""

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
        self.replans = 0

    # --- gradients ----------------------------------------------------------------------
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
        missing = len(plan.params) - len(index)
        if not grads:
            self._grad = None
            return _all_reduce_total(torch.zeros((), dtype=torch.float64), norm_type, self.group)
        locals_ = [_local(g) for g in grads]
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
                      "missing": float(missing), "max_norm": max_norm, "coef": None,
                      "owned_buckets": owned_buckets, "local_buckets": local_buckets}
        if max_norm is not None and math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self._grad["coef"] = coef
            torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
        return total

    def _grad_routing(self, plan: _Plan, grads: list, index: list[int], device: torch.device):
        """(ownership mask, bucket index) of the params that have gradients, cached per plan."""
        key = (tuple(index), device)
        cached = plan.routing.get(key)
        if cached is None:
            weights = [_weight(g, plan.params[i], plan.names[i], self.layout, self.group) for g, i in zip(grads, index)]
            owned = torch.tensor(weights, dtype=torch.bool, device=device)
            bucket_idx = plan.bucket_of[torch.tensor(index, dtype=torch.long)].to(device)
            # Buckets this rank owns nothing of are not sent: a bucket nobody owns (the last
            # stage's copy of a tied embedding) does not appear at all.
            owned_buckets = sorted({int(plan.bucket_of[i]) for i, w in zip(index, weights) if w})
            local_buckets = sorted({int(plan.bucket_of[i]) for i in index})
            cached = plan.routing[key] = (owned, bucket_idx, owned_buckets, local_buckets)
        return cached

    # --- optimizer hooks for update norms -------------------------------------------------
    def snapshot(self) -> None:
        """Copy the local shards before ``optimizer.step()`` (log steps only)."""
        plan = self._current_plan()
        locals_ = [_local(p.detach()) for p in plan.params]
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
        new = [_local(p.detach()) for p in plan.params]
        if len(new) != len(old):
            return  # the model changed during the step; skip this measurement
        if self.snapshot_device == "cpu":
            new = [t.to("cpu") for t in new]
        torch._foreach_sub_(old, new)
        self._update = {"buckets": self._bucket_squares(plan, old)}

    # --- log step ------------------------------------------------------------------------
    def samples(self) -> list[Sample]:
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
                out += _bucket_samples("grad_norm", plan.buckets, grad["buckets"], kind, grad["owned_buckets"])
            out += _bucket_samples("_grad_bad", plan.buckets, grad["bad_buckets"], "sum", grad["local_buckets"])
        update, self._update = self._update, None
        if (self.log_params_norm or update is not None) and plan is not None:
            sq = self._bucket_squares(plan, [_local(p.detach()) for p in plan.params])
            out.append(Sample("param_norm", sq.sum(), "sum"))
            if self.per_module:
                out += _bucket_samples("param_norm", plan.buckets, sq, "sum", plan.param_owned_buckets)
        if update is not None and plan is not None:
            out.append(Sample("update_norm", update["buckets"].sum(), "sum"))
            if self.per_module:
                out += _bucket_samples("update_norm", plan.buckets, update["buckets"], "sum",
                                       plan.param_owned_buckets)
        return out

    def finalize(self, metrics: dict[str, Any]) -> None:
        """Square roots, ratios, and the names of modules with non-finite gradients."""
        grad = self._last_grad
        rooted = {"param_norm", "update_norm"}
        if grad is not None and grad["norm_type"] == 2.0:
            rooted.add("grad_norm")
        for key in list(metrics):
            root = key.split("/", 1)[0]
            if key.endswith("/max_rank") and root in ("grad_norm", "grad_missing_params"):
                del metrics[key]  # which rank holds a norm's maximum is not news
            elif root in rooted and isinstance(metrics[key], float):
                metrics[key] = math.sqrt(metrics[key]) if metrics[key] >= 0 else math.nan
        bad = sorted(k.split("/", 1)[1] for k, v in metrics.items() if k.startswith("_grad_bad/") and v)
        if bad:
            metrics["grad_nonfinite_modules"] = ",".join(bad)
        if grad is not None and grad["max_norm"] is not None and math.isfinite(grad["max_norm"]) \
                and "grad_norm" in metrics:
            metrics["grad_clip_ratio"] = metrics["grad_norm"] / grad["max_norm"]
        if "update_norm" in metrics:
            self._ratios(metrics, grad)
        if not self.log_params_norm:
            for key in [k for k in metrics if k.split("/", 1)[0] == "param_norm"]:
                del metrics[key]

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

    @property
    def module_order(self) -> list[str]:
        """Module (bucket) names in the model's order."""
        return list(self._plan.buckets) if self._plan is not None else []

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
            name = _global_param_name(raw, rename)
            names.append(name)
            module = name.rsplit(".", 1)[0] if "." in name else "model"
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
            weights = [_weight(p, p, n, self.layout, self.group) for p, n in zip(plan.params, plan.names)]
            plan.param_owned = torch.tensor(weights, dtype=torch.bool, device=device)
            plan.param_owned_buckets = sorted({int(b) for b, w in zip(plan.bucket_of.tolist(), weights) if w})
        weights = plan.param_owned
        norms = torch.stack(torch._foreach_norm(tensors, 2.0)).to(torch.float64)
        contrib = torch.where(weights, norms * norms, torch.zeros_like(norms))
        return torch.zeros(len(plan.buckets), dtype=torch.float64, device=device).index_add_(
            0, plan.bucket_of.to(device), contrib)


# --- naming ---------------------------------------------------------------------------------

def module_name_map(model: torch.nn.Module) -> dict[str, str]:
    """Module path → user-facing name: wrapper levels dropped, Megatron's stage-local layer
    index replaced by the global ``layer_number - 1`` (so names match an unpipelined run), and
    an expert's rank-local index in ``local_experts`` by its global expert index (the MoE
    layer's ``local_expert_indices``), so each expert has one name on every expert-parallel rank."""
    out = {"": ""}
    experts: dict[str, list] = {"": []}  # the nearest MoE layer's global expert indices
    for name, module in model.named_modules():
        if not name:
            continue
        parent, _, leaf = name.rpartition(".")
        base = out.get(parent, strip_wrappers(parent))
        indices = getattr(module, "local_expert_indices", None)
        experts[name] = list(indices) if isinstance(indices, (list, tuple)) else experts.get(parent, [])
        number = getattr(module, "layer_number", None)
        if leaf in _WRAPPER_LEVELS:
            clean = base
        elif isinstance(number, int) and leaf.isdigit() and parent.split(".")[-1] == "layers":
            clean = f"{base}.{number - 1}" if base else str(number - 1)
        elif leaf.isdigit() and parent.split(".")[-1] == "local_experts" and int(leaf) < len(experts[parent]):
            clean = f"{base}.{experts[parent][int(leaf)]}"
        else:
            clean = f"{base}.{leaf}" if base else leaf
        out[name] = clean
    return out


def strip_wrappers(name: str) -> str:
    """Drop wrapper levels (``module.``, ``_fsdp_wrapped_module.``, ...) from a dotted name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


def _global_param_name(raw: str, rename: dict[str, str]) -> str:
    module, _, leaf = raw.rpartition(".")
    base = rename.get(module, strip_wrappers(module))
    return f"{base}.{leaf}" if base else leaf


def _bucket_samples(prefix: str, buckets: list[str], values: torch.Tensor, kind: str,
                    owned: list[int]) -> list[Sample]:
    return [Sample(f"{prefix}/{buckets[i]}", values[i], kind) for i in owned]


# --- ownership ------------------------------------------------------------------------------

def _grad_of(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _local(t: torch.Tensor) -> torch.Tensor:
    if _is_dtensor(t):
        return t.to_local()
    return t


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _weight(t: torch.Tensor, p: torch.nn.Parameter, name: str, layout: Any, group: Any) -> bool:
    """Does this rank's local piece of ``t`` (a param or its grad) count toward the global norm?"""
    if _is_dtensor(t):
        mesh = t.device_mesh
        coords = mesh.get_coordinate()
        if coords is None:  # this rank is not in the tensor's mesh
            return False
        for dim, placement in enumerate(t.placements):
            kind = type(placement).__name__
            if placement.is_replicate():
                if coords[dim] != 0:
                    return False
            elif placement.is_shard() or "Shard" in kind:  # Shard, _StridedShard (FSDP2 over TP)
                continue
            else:
                raise ValueError(
                    f"parameter {name!r} has a {kind} placement on mesh dimension {dim}; norms are defined "
                    "for Shard and Replicate placements only (reduce the gradient before measuring)"
                )
        return _first_copy_outside(mesh)

    return _plain_weight(p, layout, group)


_PIPELINE_DIMS = frozenset({"pp", "pipeline", "pipeline_parallel"})


def _first_copy_outside(mesh: Any) -> bool:
    """A DTensor on a sub-mesh (e.g. FSDP2's dp mesh inside a dp × tp mesh) has copies along the
    root mesh's other dimensions; only coordinate 0 there counts. Pipeline dimensions hold
    different layers, not copies."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if get_root is not None else None
    if root is None or root is mesh or root.mesh.numel() == mesh.mesh.numel():
        return True
    mine = root.get_coordinate()
    if mine is None:
        return False
    positions = torch.isin(root.mesh, mesh.mesh.flatten()).nonzero()  # root coordinates of the sub-mesh
    names = root.mesh_dim_names or ()
    for dim in range(root.mesh.ndim):
        outside = positions[:, dim].unique().numel() == 1
        name = names[dim] if dim < len(names) else ""
        if outside and name not in _PIPELINE_DIMS and mine[dim] != 0:
            return False
    return True


def _plain_weight(p: torch.nn.Parameter, layout: Any, group: Any) -> bool:
    if getattr(layout, "source", None) == "megatron":
        return _megatron_weight(p, layout)
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    return rank == 0


def _megatron_weight(p: torch.nn.Parameter, layout: Any) -> bool:
    from megatron.core import parallel_state as ps

    if getattr(p, "shared", False):
        return False  # the last stage's copy of a tied embedding; the first stage counts it
    tensor_parallel = bool(getattr(p, "tensor_model_parallel", False))
    if not getattr(p, "allreduce", True):  # an expert parameter
        try:
            if ps.get_expert_data_parallel_rank() != 0:
                return False
            return tensor_parallel or ps.get_expert_tensor_parallel_rank() == 0
        except (AttributeError, AssertionError):
            pass
    if ps.get_data_parallel_rank() != 0 or layout.cp_rank != 0:
        return False
    return tensor_parallel or layout.tp_rank == 0


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
