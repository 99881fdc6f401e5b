"""Which parameters a norm is taken over: their global names, their module buckets, and the
cached plan that is rebuilt only when the model's parameters change."""

from __future__ import annotations

import functools
import operator
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .fsdp_state import sharded_params
from .naming import free_name, global_param_name, module_name_map, root_name
from .parallel import is_dtensor

__all__ = ["Plan", "Buckets", "Route", "ParamPlans", "buckets_of", "route_of", "grad_of", "UNNAMED"]

UNNAMED = "unnamed"
"""The bucket of parameters that are not in the model (e.g. passed to the module-level clip)."""


@dataclass(frozen=True)
class Buckets:
    """A set of bucket ids, and the same as an index tensor on the measuring device."""

    ids: tuple
    index: torch.Tensor = field(compare=False, hash=False)


@dataclass
class Route:
    """Where a set of a plan's local tensors (its params, or the gradients present) goes, as
    tensors on the measuring device: built once per set and device, so later steps copy nothing
    from the host to the device."""

    owned: torch.Tensor  # [n] bool: the tensor counts on this rank
    bucket_idx: torch.Tensor  # [n] long: its bucket
    owned_buckets: Buckets  # buckets this rank owns a tensor of
    local_buckets: Buckets  # buckets this rank holds a tensor of
    partial: bool = False  # some local piece is part of a tensor split over ranks
    orders: dict = field(default_factory=dict)  # grouping by (device, dtype) → index restoring input order
    longs: dict = field(default_factory=dict)  # (device, dtype, whole_up_to) → a tensor of that group is long
    every: bool = False  # every tensor counts on this rank
    replica_weights: Optional[torch.Tensor] = None  # plain tensors beside DTensors: see distmetrics.replicas
    replica_owner: bool = False  # they count on this rank
    replica_positions: tuple = ()  # their positions in the plan
    replica_presence: tuple = (0.0, 0.0)  # (fingerprint, count) of those positions (distmetrics.replicas.presence)
    summed: tuple = ()  # positions (among the gradients) of Partial DTensor gradients: measured reduced
    sparse: tuple = ()  # ... of sparse (COO) gradients: measured by their coalesced values


@dataclass
class Plan:
    """Which parameters are measured, their global names and module buckets, cached routing."""

    params: list
    names: list[str]  # global parameter names
    buckets: list[str]  # module names, one per bucket
    bucket_of: torch.Tensor  # [P] long: bucket index of each param
    signature: tuple
    routing: OrderedDict = field(default_factory=OrderedDict)  # (gradient set, device) → Route, LRU
    param_routes: dict = field(default_factory=dict)  # device → the Route of the params themselves
    slots: Optional["Slots"] = None  # where every param of the model lives
    checked: bool = False  # the layout check ran for this plan's gradients
    params_checked: bool = False  # ... for its parameters (a gradient's check covers theirs)
    generation: int = -1  # _REGISTRATIONS when the slots were read
    vectors: dict = field(default_factory=dict)  # (family, id of the Buckets) → (Buckets, element names, every)
    plain: bool = False  # no parameter is a DTensor: each gradient is this rank's piece as it is
    mixed: bool = False  # DTensors and plain tensors side by side (fully_shard on some submodules only)
    given: bool = False  # the parameters a clip was given (not the model's trainable ones): frozen ones too
    reference: Optional[tuple] = None  # (the mesh its DTensors' copies are told apart on, or None), once found

    @functools.cached_property
    def every_index(self) -> tuple:
        """The positions of every parameter (the gradient set where each has a gradient)."""
        return tuple(range(len(self.params)))


# Parameters or modules registered anywhere in the process since start: a plan made before
# the last registration is checked again.
_REGISTRATIONS = [0]


def _registered(*args: Any) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


class ParamPlans:
    """The plan of a model's trainable parameters (cached), and of other parameter lists."""

    def __init__(self, model: Optional[torch.nn.Module], depth: Optional[int] = None) -> None:
        self.model = model
        self.depth = depth
        self.root = root_name(model)
        """What the root module's own parameters are called (``model``, or ``root`` beside a child ``model``)."""
        self.prefix = ""
        """What every name starts with: ``stage<k>.`` where pipeline stages' names collide (:meth:`use_prefix`)."""
        self.plan: Optional[Plan] = None
        self._custom: "OrderedDict[tuple, Plan]" = OrderedDict()
        self._outside: "OrderedDict[tuple, tuple]" = OrderedDict()  # signature → (model plan, params in one only)
        self.replans = 0
        self.reads = 0
        """How often the model's parameters and modules were read (:class:`Slots`): for the first plan,
        and again after a change, also one that torch's registration hooks do not see (a parameter or
        module set in its dict directly, as ``fully_shard`` does); :class:`~distmetrics.grad_sync.GradSync`
        looks for wrappers again then."""

    def use_prefix(self, prefix: str) -> None:
        """Start every parameter and module name with ``prefix`` (``stage1.``: this rank's pipeline
        stage, where stages hold modules of one name, :func:`~distmetrics.stage_order.job_module_order`);
        plans made before are named anew."""
        self.prefix, self.plan = prefix, None
        self._custom.clear()
        self._outside.clear()

    def for_parameters(self, parameters: Any = None) -> Plan:
        """The plan of the model's trainable parameters, or of the parameters given (the
        model's plan when they are the same gradients)."""
        if parameters is None:
            return self.model_plan()
        if isinstance(parameters, torch.Tensor):
            params = [parameters]
        else:
            params = list(parameters)
            if dict in set(map(type, params)):  # an optimizer's param_groups
                raise TypeError("clip_grad_norm_(parameters=...): got a dict (an optimizer's param_groups?); pass "
                                "the parameters: [p for group in optimizer.param_groups for p in group['params']]")
            if not params and not isinstance(parameters, (list, tuple)):
                warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=4)
        signature = tuple(id(q) for q in params)
        if self.model is not None:
            plan = self.model_plan()
            if all(grad_of(q) is None for q in self._only_in_one(signature, params, plan)):
                return plan  # the same gradients as the model's trainable parameters
        plan = self._custom.get(signature)
        if plan is None:
            sharded = sharded_params(self.model)  # FSDP2's unsharded stand-ins (model.parameters() after a forward)
            unique = list({id(q): q for q in params}.values())  # a parameter listed twice (a tied weight) counts once
            names = self._names(unique)
            unique = [sharded.get(id(q), q) for q in unique]
            plan = self._custom[signature] = self._build(list(zip(names, unique)), signature)
            plan.given = True
            while len(self._custom) > 4:
                self._custom.popitem(last=False)
        return plan

    def _only_in_one(self, signature: tuple, params: list, plan: Plan) -> list:
        """The parameters in ``params`` or in ``plan`` but not in both (frozen ones, usually
        few), remembered per signature: the two hold the same gradients when none has one."""
        cached = self._outside.get(signature)
        if cached is None or cached[0] is not plan:
            in_plan, given = {id(q) for q in plan.params}, set(signature)
            others = [q for q in params if id(q) not in in_plan] + [q for q in plan.params if id(q) not in given]
            cached = self._outside[signature] = (plan, others)
            while len(self._outside) > 4:
                self._outside.popitem(last=False)
        return cached[1]

    def model_plan(self) -> Plan:
        """The plan of the model's trainable parameters, rebuilt when they changed: a parameter
        registered anywhere (torch's global registration hooks), one replaced in its module,
        frozen or unfrozen, a module inserted, replaced or removed in place (a check of each
        cached slot, far cheaper than ``named_parameters``: :class:`Slots`)."""
        plan = self.plan
        if plan is not None and plan.generation == _REGISTRATIONS[0] and plan.slots.intact():
            return plan
        self.reads += 1
        slots = Slots(self.model)
        rename = module_name_map(self.model)
        sharded = sharded_params(self.model)  # FSDP2's unsharded stand-ins: their sharded parameters hold the grads
        named = [(global_param_name(n, rename), sharded.get(id(q), q)) for n, q in self.model.named_parameters()
                 if q.requires_grad]
        signature = tuple((n, id(q)) for n, q in named)  # a module moved renames its parameters
        if plan is None or plan.signature != signature:
            if plan is not None:
                self.replans += 1
                self._custom.clear()  # named after the model as it was
            plan = self.plan = self._build(named, signature)
        plan.slots, plan.generation = slots, _REGISTRATIONS[0]
        return plan

    def _names(self, params: list) -> list[str]:
        if self.model is None:
            return [f"{UNNAMED}.{i}" for i in range(len(params))]
        rename = module_name_map(self.model)
        known = {id(q): global_param_name(n, rename) for n, q in self.model.named_parameters()}
        if all(id(q) in known for q in params):
            return [known[id(q)] for q in params]
        # not the model's: under "unnamed", or "unnamed_2", ... where a top-level module has that name (its
        # norm and theirs were merged into one, without a word)
        label = free_name({name.split(".", 1)[0] for name in known.values()}, UNNAMED, UNNAMED)
        return [known.get(id(q), f"{label}.{i}") for i, q in enumerate(params)]

    def _build(self, named: list, signature: tuple) -> Plan:
        names, buckets, bucket_ids = [], [], []
        index: dict[str, int] = {}
        for name, _ in named:
            names.append(self.prefix + name)
            module = self.prefix + (name.rsplit(".", 1)[0] if "." in name else self.root)
            if self.depth is not None:
                module = ".".join(module.split(".")[: self.depth])
            if module not in index:
                index[module] = len(buckets)
                buckets.append(module)
            bucket_ids.append(index[module])
        params = [q for _, q in named]
        dtensors = sum(map(is_dtensor, params))
        return Plan(params, names, buckets, torch.tensor(bucket_ids, dtype=torch.long), signature,
                    plain=not dtensors, mixed=0 < dtensors < len(params))

def buckets_of(ids: list[int], device: torch.device) -> Buckets:
    """A :class:`Buckets` of these ids on ``device``."""
    return Buckets(tuple(ids), torch.tensor(ids, dtype=torch.long, device=device))


def route_of(plan: Plan, index: list[int], weights: list[bool], device: torch.device) -> Route:
    """The :class:`Route` of the plan's tensors at positions ``index``, ``weights`` saying which
    count on this rank. Buckets this rank owns nothing of are not sent: a bucket nobody owns (the
    last stage's copy of a tied embedding) does not appear at all."""
    ids = plan.bucket_of.tolist()
    return Route(torch.tensor(weights, dtype=torch.bool, device=device),
                 plan.bucket_of[torch.tensor(index, dtype=torch.long)].to(device),
                 buckets_of(sorted({ids[i] for i, w in zip(index, weights) if w}), device),
                 buckets_of(sorted({ids[i] for i in index}), device), every=all(weights))


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient that counts: Megatron's ``main_grad`` when set, then ``decoupled_grad`` (its
    precision-aware optimizer's), else ``.grad``. Those are set as attributes of the parameter
    object and read from its ``__dict__`` (a missing one would cost a failed lookup through the
    class); a parameter class that defines them itself is asked by ``getattr``."""
    cls = type(p)
    by_class = _CLASS_GRADS.get(cls)
    if by_class is None:
        by_class = _CLASS_GRADS[cls] = any(hasattr(cls, name) for name in _OTHER_GRADS)
    extra = p if by_class else p.__dict__
    if by_class or extra:
        for name in _OTHER_GRADS:
            grad = getattr(extra, name, None) if by_class else extra.get(name)
            if grad is not None:
                return grad
    return p.grad


_OTHER_GRADS = ("main_grad", "decoupled_grad")
_CLASS_GRADS: dict[type, bool] = {}  # parameter class → it defines main_grad or decoupled_grad itself


class Slots:
    """Where each parameter of a model lives (every slot of every module's ``_parameters`` dict: a
    shared parameter's each, and the empty ones) and whether it requires a gradient (each parameter
    once), and where each module lives (its parent's ``_modules`` dict and key), checked at every
    clip in a few C-level passes (no Python step per parameter or module). A parameter replaced or
    set to None in its module, frozen or unfrozen, is seen; so is a module inserted, replaced or
    removed in place (``ModuleList.insert``, ``del model.layers[0]``, ``parent._modules[k] = m``:
    torch's registration hooks do not fire for those), a parameter written into a module's
    ``_parameters`` (a new slot, or a tied weight's second slot untied, as Accelerate's
    ``set_module_tensor_to_device`` writes: missed, it was in no norm and no clip), and a parameter
    registered anywhere, by torch's registration hooks (:data:`_REGISTRATIONS`). A module's ``_parameters``
    dict replaced whole by another of as many slots is not (the old dict's slots are checked)."""

    def __init__(self, model: torch.nn.Module) -> None:
        seen: set = set()
        self.dicts, self.keys, self.values, self.params = [], [], [], []
        self.parents: list = []  # one per module edge (parent, key, child), in three lists
        self.edge_keys: list = []
        self.children: list = []
        self.modules = list(model.modules())
        for module in self.modules:
            for key, child in module._modules.items():
                self.parents.append(module)
                self.edge_keys.append(key)
                self.children.append(child)
            for key, param in module._parameters.items():
                self.dicts.append(module._parameters)
                self.keys.append(key)
                self.values.append(param)
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    self.params.append(param)
        # how many child and parameter slots there are in all: one added anywhere shows (one taken away
        # shows in its own slot's check)
        self.sizes = sum(map(len, map(_MODULES, self.modules))), sum(map(len, map(_PARAMETERS, self.modules)))
        self.requires_grad = list(map(_REQUIRES_GRAD, self.params))

    def intact(self) -> bool:
        """Is every parameter slot as it was, every parameter with the same ``requires_grad``, and every
        module in its place in its parent's ``_modules`` now, none added to one or to a ``_parameters``?"""
        return all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.values)) and \
            list(map(_REQUIRES_GRAD, self.params)) == self.requires_grad and \
            all(map(operator.is_, map(dict.get, map(_MODULES, self.parents), self.edge_keys), self.children)) and \
            (sum(map(len, map(_MODULES, self.modules))), sum(map(len, map(_PARAMETERS, self.modules)))) == self.sizes


_MODULES = operator.attrgetter("_modules")
_PARAMETERS = operator.attrgetter("_parameters")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
