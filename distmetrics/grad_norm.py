"""Gradient norms and clipping, exact under every parallel layout: a drop-in for
``torch.nn.utils.clip_grad_norm_``.

Each parameter's local gradient (``p.main_grad`` when Megatron set one, else ``p.grad``; the
local shard of a DTensor) gets an ownership weight w ∈ {0, 1}
(:func:`distmetrics.parallel.owns_local_piece`) so that every element of the global gradient
counts once over all ranks. For a p-norm (any p torch accepts), each rank's owned pieces give
Σ‖g‖ₚᵖ (inf: the max, −inf: the min), one all-reduce combines the ranks, and the same
per-tensor norms are segment-summed into per-module buckets for the log step. Per-tensor norms
are taken per (device, dtype) group with ``torch._foreach_norm``, accumulated in float32 for
bf16/fp16 gradients (float64 for p other than 1, 2, ±inf, 0; on the CPU, 1- and 2-norms of long
tensors in parts combined in float64: :mod:`distmetrics.tensor_norms`) and combined in float64. Clipping
scales every gradient by ``min(1, max_norm / (total + 1e-6))`` computed, as torch does, from the
total it returns, in the dtype promoted over every rank's gradients as torch's clip of the whole model
(:mod:`distmetrics.grad_dtypes`): bf16 gradients get a bf16 coefficient, a bf16 stage beside fp32 ones float32.
Megatron's gradients (``main_grad``) get the coefficient Megatron's own clip computes, in
float32 from the float64 total: its optimizer measures the clipped gradients in float32, and a
bf16 coefficient is off by up to 0.4% (a clip at 0.05 read back as 0.05006).

Plain gradients beside DTensor ones (``fully_shard`` on some submodules only) count once, as
copies of each other: every measurement checks that they are, in lanes of its one all-reduce, and
every rank raises a ``ValueError`` together where they are not, or where no rank that holds them counts
them (:mod:`distmetrics.replicas`): at the call without a Monitor (read there where such gradients are
held),
at the Monitor's log step with one (its clip reads nothing back to the host).

``p = 0`` follows torch: the total counts the tensors with any non-zero element. That is
defined across ranks only for tensors held whole by their owner: a tensor sharded over ranks
(FSDP2, tensor parallel, split by the distributed optimizer) raises a ``ValueError`` on every
rank (the all-reduce carries the flag).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections import OrderedDict
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

from .clip_steps import LANES as STEP_LANES, NO_STEP, check_steps, step_lanes
from .grad_combine import combine as _combine, norm_kind, refuse_sharded_count
from .grad_dtypes import GradDtypes
from .eager import eager
from .grad_measurement import GradMeasurement, clip_coefficient, note_clip
from .megatron_optimizer import MegatronShards, check_layout
from .parallel import (Layout, detect_layout, is_dtensor, local_tensor, monitor_ranks, named_mesh_of, owns_local_piece,
                       owns_shard_piece)
from .packing import collective_device
from .peers import InCollective
from .plans import ParamPlans, Plan, Route, grad_of, route_of
from . import replicas
from .tensor_norms import groups_of, per_tensor_norms, scale_

__all__ = ["clip_grad_norm_", "GradientNorms", "GradMeasurement", "note_clip", "clip_coefficient", "norm_kind"]

_ROUTES_KEPT = 8  # gradient sets whose routing a plan keeps (the most recently used)


@eager
def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: Union[float, str] = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None, group: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the global norm under any parallel layout.

    The same call, arguments and return value (the pre-clip total norm, in the dtype promoted
    over every rank's gradients; a replicated DTensor when the gradients are DTensors). Gradients that are
    DTensors (FSDP2, HSDP, TP) count by their placements; plain tensors under an initialised
    process group are treated as data-parallel replicas (DDP) and counted once, Megatron's
    parameters by ``parallel_state``. One all-reduce over ``group`` (default: the world), and one
    more at the first call with a norm type (:meth:`GradientNorms._agree`). Where plain gradients
    sit beside DTensors (on this rank, or on some rank at the first call with the norm type), each
    call reads their check on the host (:func:`distmetrics.replicas.check`; a device sync on a GPU).
    """
    # one measurer per process group object, which every rank makes and finds alike: a call before
    # init_process_group, or in a world since destroyed (a sweep, a notebook), measured the layout of then (each
    # rank's plain tensors summed as shards); an id() may be reused by a new group on one rank and not on another,
    # whose first call's agreement then met nothing
    if group is not None:  # its measurer holds it (its collectives): the last few are kept, as objects
        measurer = _GROUPS.get(group)
        if measurer is None:
            monitor_ranks(group, "dm.clip_grad_norm_")  # a rank outside it: refused, not a silent 0
            measurer = _GROUPS[group] = GradientNorms(None, detect_layout(), group)
            while len(_GROUPS) > 4:
                _GROUPS.popitem(last=False)
        return measurer.clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach)[0]
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    measurer = _WORLDS.get(world) if world is not None else _ALONE[0]  # not held: the world's lifetime
    if measurer is None:
        measurer = GradientNorms(None, detect_layout(), None)
        if world is None:
            _ALONE[0] = measurer
        else:
            _WORLDS[world] = measurer
    return measurer.clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach)[0]


_WORLDS: "weakref.WeakKeyDictionary[Any, GradientNorms]" = weakref.WeakKeyDictionary()
_GROUPS: "OrderedDict[Any, GradientNorms]" = OrderedDict()
_ALONE: list = [None]  # the measurer of calls with no process group


class NonfiniteNormError(RuntimeError):
    """``error_if_nonfinite=True`` and the total is not finite (torch raises a RuntimeError with
    this message; every rank raises this one, none waits). ``held``: some rank's gradients hold
    NaN or inf; False where finite gradients gave a total past the float range. ``measured``: the
    measurement that found it (its gradients unscaled), which the Monitor's record shows."""

    held = True
    measured: Optional[GradMeasurement] = None


class GradientNorms:
    """Measures (and clips) the gradients of a model's parameters, or of any parameters given."""

    def __init__(self, model: Optional[torch.nn.Module], layout: Optional[Layout] = None, group: Any = None,
                 depth: Optional[int] = None) -> None:
        self.plans = ParamPlans(model, depth)
        self.layout = layout or detect_layout()
        self.group = group
        self.model = model
        self.shards: Optional[MegatronShards] = None
        self.guard: Any = None
        """The Monitor's arrival check, made before the norm-type check (:meth:`_agree`)."""
        self._agreed: set = set()  # norm types every rank was found to pass; (type, "clip"): with one max_norm
        self._replicas_anywhere = False  # some rank's first plan held plain gradients beside DTensors (_agree)
        self.dtypes = GradDtypes()  # every rank's gradient dtypes: the total's and the coefficient's dtype
        self.defers_replicas = False
        """Leave the replica check's result on the device (``replicas_differ`` of a measurement), for a
        Monitor's log step to raise (:class:`distmetrics.replicas.IntervalCheck`), instead of reading it
        at each measurement (a device sync on a GPU)."""

    def attach_shards(self, shards: MegatronShards) -> None:
        """Count the slices Megatron's distributed optimizer gives this rank (see
        :mod:`distmetrics.megatron_optimizer`), beside those of the optimizers attached before (a
        chained optimizer's parts attached one by one); cached ownership and layout checks are redone."""
        if self.shards is None:
            self.shards = shards
        else:
            self.shards.merge(shards)
        for plan in [self.plans.plan, *self.plans._custom.values()]:
            if plan is not None:
                plan.routing.clear()
                plan.param_routes.clear()
                plan.checked = False

    def clip(self, parameters: Any, max_norm: Any, norm_type: Union[float, str] = 2.0,
             error_if_nonfinite: bool = False, foreach: Optional[bool] = None,
             loss_scale: Optional[torch.Tensor] = None, call: str = "clip_grad_norm_",
             after_step: Any = NO_STEP) -> tuple[Any, GradMeasurement]:
        """Measure, then scale every gradient by ``min(1, max_norm / (total + 1e-6))`` (torch's
        formula, also for ``max_norm`` ≤ 0 or inf); returns (what torch returns, measurement).
        ``loss_scale``, ``after_step``: see :meth:`measure`; the coefficient is the unscaled total's."""
        max_norm = float(max_norm)
        if max_norm != max_norm:  # torch multiplies every gradient by NaN; refused before the collective
            raise ValueError(f"{call}(max_norm=nan): accepted values are numbers (0, negative and inf included)")
        with torch.no_grad():
            result, measured = self.measure(parameters, norm_type, error_if_nonfinite, foreach, loss_scale, call,
                                            max_norm, after_step)
            if measured is not None:
                # torch's coefficient: from the total it returns, in the gradients' (promoted) dtype
                # (Megatron's for its gradients: see clip_coefficient)
                note_clip(measured, max_norm, local_tensor(result))
                scale_(measured.locals, measured.coef, foreach, measured.groups)
                measured.locals = measured.groups = None
        return result, measured

    def check(self, plan: Plan, grads: bool = True) -> None:
        """Raise :class:`~distmetrics.megatron_optimizer.LayoutError` for a layout no ownership rule
        describes, once per plan: at the first measurement of its gradients (FSDP1, DeepSpeed ZeRO, an
        unattached distributed optimizer's reduce-scattered buffers) or, ``grads`` false, of its
        parameters or update (FSDP1, ZeRO: Megatron's parameters are whole on every data-parallel
        rank); the same on every rank, before any collective. A ``param_norm`` of ZeRO-3's empty
        stand-ins was 0.0 where no gradient was measured."""
        if not plan.checked and (grads or not plan.params_checked):
            check_layout(self.model, plan.params, plan.names, self.shards, grads)
            plan.checked = plan.checked or grads
            plan.params_checked = True

    def measure(self, parameters: Any = None, norm_type: Union[float, str] = 2.0, error_if_nonfinite: bool = False,
                foreach: Optional[bool] = None, loss_scale: Optional[torch.Tensor] = None,
                call: str = "measure", max_norm: Optional[float] = None,
                after_step: Any = NO_STEP) -> tuple[Any, Optional[GradMeasurement]]:
        """(the total norm as torch returns it, the measurement); one all-reduce. ``loss_scale``
        (a tensor, read on its device: no host sync): the gradients hold the loss times it (fp16
        training under Megatron, which divides it out inside ``optimizer.step()``); every norm
        is of the gradients divided by it. ``call`` names the caller in errors and the arrival check;
        ``max_norm``, a clip's (checked with the norm type at the first clip); ``after_step``, a Monitor's last
        step (None before its first), checked to be every rank's where the all-reduce runs on the host
        (:mod:`distmetrics.clip_steps`)."""
        p = float(norm_type)
        plan = self.plans.for_parameters(parameters)
        grads = list(map(grad_of, plan.params))
        if p not in self._agreed or (max_norm is not None and (p, "clip") not in self._agreed):
            self._agree(p, call, plan, {g.dtype for g in grads if g is not None}, max_norm)
        if all(map(operator.is_not, grads, itertools.repeat(None))):  # the usual case: every one has a gradient
            index = plan.every_index
        else:
            index = tuple(i for i, g in enumerate(grads) if g is not None)
            grads = [g for g in grads if g is not None]
        self.check(plan)
        plain = plan.plain and self.shards is None  # each gradient is this rank's piece as it is
        locals_ = grads if plain else [self.piece(plan.params[i], g) for g, i in zip(grads, index)]
        groups = groups_of(locals_)
        # A rank without gradients still joins the all-reduce with the identity of every lane,
        # on the device the collective needs, and returns the same total as every other rank.
        device = locals_[0].device if locals_ else collective_device(self.group)
        route = self._routing(plan, grads, index, device)
        # as measured (Partial DTensors summed, sparse ones' values); scaled by a clip: locals_
        measured_locals = _measured(locals_, grads, route) if route.summed or route.sparse else locals_
        norms = per_tensor_norms(measured_locals, p, foreach, device, route.orders, groups, longs=route.longs)
        if loss_scale is not None and p != 0:  # each norm of the gradients without it (before any p-th power)
            norms = norms * loss_scale.reshape(()).to(norms.device, torch.float64).reciprocal()
        # a p = 0 norm counts non-zero elements and cannot see a NaN, nor a p < 0 norm an inf (and an empty
        # piece's is inf): one more pass finds them (a 1-norm: defined on an empty slice; NaN or inf where a
        # gradient holds one, or sums past the float range)
        finite_check = per_tensor_norms(measured_locals, 1.0, foreach, device, route.orders, groups,
                                        longs=route.longs) if p <= 0 else norms
        kind = norm_kind(p)
        extra = replicas.lanes(norms, route.replica_weights, route.replica_owner, self.layout, kind,
                               route.replica_presence) if replicas.carried(self.layout, self.group) else None
        dtypes, carried = {dtype for _, dtype in groups}, GradDtypes.carried(self.group)
        # where the collective runs on the host (gloo: decided by the group alone, so every rank carries the lanes and
        # reads them; gradients on a GPU are copied to the host for it already): the dtypes' lanes after the replica
        # check's, then a Monitor's step and the call's arguments (dm.clip_grad_norm_: its arguments alone)
        lanes = torch.cat([self.dtypes.beside(extra, dtypes, kind, device),
                           step_lanes(after_step, kind, device, p, max_norm)]) if carried else extra
        measured = _combine(norms, route.owned, route.bucket_idx, len(plan.buckets), p, self.group, device,
                            p == 0 and route.partial, route.every, finite_check, lanes,
                            tensors=measured_locals if device.type == "cpu" else None)
        if carried:  # before any gradient is scaled: every rank raises
            measured.replicas, reduced = measured.replicas[:-STEP_LANES], measured.replicas[-STEP_LANES:]
            check_steps(reduced, kind, self.group, after_step, call, p, max_norm)
        refuse_sharded_count(measured)
        if carried:
            self.dtypes.take(measured, plan, dtypes)
        if extra is not None:
            positions = route.replica_positions  # their names are looked up on a refusal only

            def names() -> list[str]:
                return [plan.names[i] for i in positions]

            def lacking() -> list[str]:  # this rank's plain parameters that train and have no gradient
                held = set(index)
                return [name for i, (name, q) in enumerate(zip(plan.names, plan.params))
                        if i not in held and q.requires_grad and not is_dtensor(q)]

            # Read at the call (a device sync on a GPU) where this rank, or some rank at the first call with the
            # norm type, held plain gradients beside DTensors: an FSDP2 or DDP job's clip reads nothing
            if not self.defers_replicas:
                if self._checks_replicas(plan) or self._replicas_anywhere:
                    replicas.check(measured, kind, call, self.layout, names, lacking)
            elif self._checks_replicas(plan) or self._replicas_anywhere:  # raised at the log step, from the reduced
                # flags on every rank (where a rank noted none, the others' arrive)
                measured.replicas_differ, measured.replica_names = replicas.differing(measured, kind), names
                measured.replica_lacking, measured.replica_held = lacking, float(len(positions))
        # main_grad (or decoupled_grad) in place of .grad: Megatron's gradients, which its optimizer clips
        measured.megatron = bool(grads) and grads[0] is not plan.params[index[0]].grad
        missing = len(plan.params) - len(index)  # the model's trainable parameters without a gradient
        if missing and plan.given:  # the parameters a clip was given may include frozen ones: not missing
            with_grad = set(index)
            missing = sum(q.requires_grad and i not in with_grad for i, q in enumerate(plan.params))
        measured.missing = float(missing)
        measured.plan = plan
        measured.owned_buckets, measured.local_buckets = route.owned_buckets, route.local_buckets
        # as torch raises where its total is not finite: on a rank whose replica alone holds NaN or inf that is
        # the rank's own total, for p > 0; for p < 0 only a NaN makes it so (|inf|^p is 0, and the min passes an
        # inf by); for p = 0 neither does (both count as non-zero)
        held = measured.bad_anywhere if p > 0 else measured.nan_anywhere if p < 0 else None
        if error_if_nonfinite and not bool(torch.isfinite(measured.total) & (True if held is None else held == 0)):
            error = NonfiniteNormError(
                f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
            error.held, error.measured = bool(measured.bad_anywhere > 0), measured
            raise error
        measured.locals, measured.groups = locals_, groups
        return _as_torch_returns(measured.total, grads, self.dtypes.returned(dtypes, plan)), measured

    def _agree(self, p: float, call: str, plan: Plan, dtypes: set, max_norm: Optional[float] = None) -> None:
        """Check that every rank passes ``p``, once per norm type, at each rank's first call with it:
        one small all-reduce (after the Monitor's arrival check, where there is one). A rank passing
        another norm type reduced lanes of another kind or number (2 against inf: a SUM against a
        MAX, in which every rank waited without a word) or took another root (1 against 2: a
        total that differed between ranks). A third lane says whether some rank's ``plan`` holds plain
        gradients beside DTensors: then every rank of a Monitor notes the replica check's flags, so the log step's
        names are the same on every rank from the first (a rank that holds none notes the others'). One lane per
        dtype says which ``dtypes`` the ranks' gradients hold (:mod:`distmetrics.grad_dtypes`). At a clip's
        first call with it (``max_norm`` given) two more lanes check that every rank passes one ``max_norm``:
        each rank scaled its gradients by its own coefficient, and weights replicated across ranks (a
        tensor-parallel LayerNorm's) drifted apart without a word."""
        if p != p:
            raise ValueError(f"{call}(norm_type=nan): accepted values are numbers (inf and -inf included) and 'inf'")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if self.guard is not None:
                self.guard.enter(f"{call}(norm_type check)")
            clip, flags = ([] if max_norm is None else [max_norm, -max_norm]), GradDtypes.flags(dtypes)
            lanes = torch.tensor([p, -p, *clip, float(self._checks_replicas(plan)), *flags],
                                 dtype=torch.float64, device=collective_device(self.group))
            with InCollective("the MAX all_reduce checking every rank's norm_type", call):
                dist.all_reduce(lanes, op=dist.ReduceOp.MAX, group=self.group)
            values = lanes.tolist()
            (high, low, *clip, mixed), held = values[:len(values) - len(flags)], values[len(values) - len(flags):]
            self.dtypes.agree(held, plan, dtypes)
            self._replicas_anywhere = self._replicas_anywhere or mixed > 0
            if high != -low:
                raise ValueError(f"{call}(norm_type={p:g}) on this rank, but the ranks passed norm types from "
                                 f"{-low:g} to {high:g} at their first gradient norm with it: every rank must pass "
                                 "the same norm_type (ranks reducing different norms wait for each other or disagree)")
            if clip and clip[0] != -clip[1]:
                raise ValueError(f"{call}(max_norm={max_norm!r}) on this rank, but the ranks passed max_norm from "
                                 f"{-clip[1]!r} to {clip[0]!r} at their first clip with norm_type={p:g}: every rank "
                                 "must pass the same max_norm (each rank would scale its gradients by its own "
                                 "coefficient, and weights replicated across ranks drift apart)")
        self._agreed.add(p)
        if max_norm is not None:
            self._agreed.add((p, "clip"))

    def piece(self, param: Any, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``tensor`` (``param`` or laid out like it): the distributed
        optimizer's owned slice, the local shard of a DTensor, or the tensor."""
        if self.shards is not None:
            owned = self.shards.owned_slice(param, tensor)
            if owned is not None:
                return owned
        return local_tensor(tensor)

    def owns(self, param: Any, name: str, tensor: torch.Tensor, plan: Optional[Plan] = None) -> bool:
        """Does this rank's piece of ``tensor`` (one of ``plan``'s) count (:mod:`distmetrics.parallel`)?"""
        if self.shards is not None and id(param) in self.shards.params:
            return owns_shard_piece(param, self.layout)
        reference = self._reference(plan) if plan is not None and is_dtensor(tensor) else None
        return owns_local_piece(tensor, param, name, self.layout, self.group, reference, summed=True)

    def _reference(self, plan: Plan) -> Any:
        """The mesh a DTensor's copies are told apart on where the layout has none (the module-level
        clip, a pipeline stage's model): the layout mesh of ``plan``'s DTensors that names tp, cp or pp
        and spans the ranks, else one that names them (torchtitan's TP weights' ``dp_shard_cp`` x ``tp``,
        a stage's), found once per plan; None where none does."""
        if self.layout.device_mesh is not None:
            return None
        if plan.reference is None:
            ranks = self.layout.ranks if self.group in (None, self.layout.group) else monitor_ranks(self.group)
            spanning, part = named_mesh_of(plan.params, ranks)
            plan.reference = (spanning if spanning is not None else part,)
        return plan.reference[0]

    def _routing(self, plan: Plan, grads: list, index: list[int], device: torch.device) -> Route:
        """The :class:`Route` of the params that have gradients, cached per plan and gradient set."""
        key = (index, device)
        cached = plan.routing.get(key)
        if cached is None:
            weights = [self.owns(plan.params[i], plan.names[i], g, plan) for g, i in zip(grads, index)]
            cached = plan.routing[key] = route_of(plan, index, weights, device)
            cached.partial = any(self._is_partial(plan.params[i], g) for g, i in zip(grads, index))
            cached.summed = tuple(k for k, g in enumerate(grads) if is_dtensor(g) and
                                  any(placement.is_partial() for placement in g.placements))
            cached.sparse = tuple(k for k, g in enumerate(grads) if g.layout is torch.sparse_coo)
            if self._checks_replicas(plan):
                checked = [not is_dtensor(g) for g in grads]
                cached.replica_weights = replicas.position_weights(index, checked, device)
                cached.replica_owner = any(w for w, c in zip(weights, checked) if c)
                cached.replica_positions = tuple(i for i, c in zip(index, checked) if c)
                cached.replica_presence = replicas.presence(cached.replica_positions)
            while len(plan.routing) > _ROUTES_KEPT:
                plan.routing.popitem(last=False)
        else:
            plan.routing.move_to_end(key)
        return cached

    def _checks_replicas(self, plan: Plan) -> bool:
        """Does ``plan`` hold plain gradients that count once as copies (:mod:`distmetrics.replicas`):
        beside DTensors, or, under a Monitor (whose log step reads the check: no device sync), a model
        of plain tensors only (DDP's replicas, or the loop's own, which a pipeline stage of its own or a
        rank training a model of its own is not)? Megatron's plain parameters have rules of their own."""
        return (plan.mixed or (plan.plain and self.defers_replicas)) and self.layout.source != "megatron" \
            and self.shards is None

    def _is_partial(self, param: Any, grad: torch.Tensor) -> bool:
        """Is this rank's piece of ``grad`` part of a tensor split over ranks: a tensor-parallel
        partition, a DTensor shard, or a slice from the distributed optimizer that is not the
        whole tensor?"""
        if getattr(param, "tensor_model_parallel", False) and self.layout.tp_size > 1:
            return True
        if is_dtensor(grad):  # a Partial one is measured reduced, whole (_measured)
            return any(not (placement.is_replicate() or placement.is_partial()) for placement in grad.placements)
        return self.shards is not None and self.shards.splits(param)


def _measured(locals_: list, grads: list, route: Route) -> list:
    """``locals_`` as their norms are taken: Partial DTensor gradients (SequenceParallel's norm weights
    under tensor parallelism alone: each rank holds a part of a sum) as this rank's piece of their sum,
    one all-reduce each over the mesh dimensions they are Partial on, as torch's clip of DTensors makes;
    sparse ones (``nn.Embedding(sparse=True)``) as their coalesced values, duplicate indices summed
    (torch's clip has no norm of a sparse tensor). The clip scales ``locals_``: sums and values scale
    with them."""
    out = list(locals_)
    if route.summed:
        from torch.distributed.tensor import Replicate

        for k in route.summed:
            grad = grads[k]
            if not is_dtensor(grad):  # the route is kept per gradient set, not per layout: as found now
                continue
            whole = [Replicate() if placement.is_partial() else placement for placement in grad.placements]
            out[k] = local_tensor(grad.redistribute(grad.device_mesh, whole))
    for k in route.sparse:
        if locals_[k].layout is torch.sparse_coo:
            out[k] = locals_[k].coalesce().values()
    return out


# --- helpers ------------------------------------------------------------------------------

def _as_torch_returns(total: torch.Tensor, grads: list, dtype: Optional[torch.dtype]) -> Any:
    """The total as torch's clip of every rank's gradients returns it, in ``dtype`` (:meth:`GradDtypes.returned`),
    on the first gradient's device; a replicated DTensor on the first gradient's mesh when the gradients are."""
    if not grads:  # every rank's total; torch's zero where no rank has a gradient (dtype None) is the default dtype
        return total.to(torch.get_default_dtype() if dtype is None else dtype)
    first = grads[0]
    value = total.to(device=local_tensor(first).device, dtype=dtype)
    if is_dtensor(first):
        from torch.distributed.tensor import DTensor, Replicate

        mesh = first.device_mesh
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value
