"""Is the model's gradient synchronised? A norm taken inside a gradient-accumulation window reads
gradients that are not yet reduced over the data-parallel ranks: under DDP's ``no_sync()`` each
rank's own (the norm is rank 0's alone, and a clip scales every rank by rank 0's coefficient);
under FSDP2's ``set_requires_gradient_sync(False)`` none at all (a sharded ``.grad`` is set by the
synchronised backward), so the norm reads 0; under HSDP's ``set_requires_all_reduce(False)`` none
either (the reduce-scatter's output waits in the parameter group for a backward that all-reduces,
also with one replica). Each is refused with a ``ValueError`` before the measurement's collectives.
Every rank of a job is in the same window, so every rank raises and none waits.

The window may also have closed too late: the last micro-batch's backward ran inside it and the
flags were set back only before the clip. For DDP a forward pre-hook notes whether each forward
with grad enabled ran inside ``no_sync()`` (one whose backward does not all-reduce); a forward
under ``torch.no_grad()`` changes nothing. FSDP2 still holds the gradients that backward did not
reduce (:func:`_held_back`). Both are refused.

The flags and the held gradients are Python attributes (DDP's ``require_backward_grad_sync``, the
hook's note, each FSDP2 parameter group's ``reduce_grads``, ``all_reduce_grads``
and held tensors): reading them waits for no device. The wrappers that hold them are found when
the Monitor is made, and again once the model may have changed: a module or parameter registered
somewhere (torch's registration hooks), or a change those hooks do not see. ``fully_shard`` applied
after the Monitor was made (Accelerate's ``prepare`` shards the model given in place) swaps each
module's class and sets its parameters in their dicts directly; so each check also compares the
root's class and the number of modules with composable state (FSDP2's) — two reads, no walk over
the modules — and how often the norm plan read the model (:attr:`ParamPlans.reads`: a change in
place, seen by an earlier clip). A DDP module made around the model given cannot be seen from it: that is said once
(:func:`_note_ddp`). Megatron's DDP is not read here: its gradients are final after
``finalize_model_grads`` (README).
"""

from __future__ import annotations

import gc
import logging
import operator
import sys
import weakref
from typing import Any, Optional

import torch

from .fsdp_state import STATES as _STATES, fsdp_groups
from .naming import module_name_map
from .plans import _REGISTRATIONS, ParamPlans


__all__ = ["GradSync"]

logger = logging.getLogger("distmetrics")

_DDP_SYNC = operator.attrgetter("require_backward_grad_sync")
_AFTER = "after the last micro-batch's backward"
WINDOW_CHECKS = 5
"""The job's first ``monitor.step`` calls at which an open accumulation window is looked for (a loop that
steps per micro-batch does so from its first call; log steps alone missed it where each came after the
last micro-batch, ``log_interval`` a multiple of the micro-batches): a pass over every FSDP2 parameter at each."""

_IN_DDP: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()
"""A module → a weak reference to the DistributedDataParallel module made around it."""


def _note_ddp(parent: Any, name: str, child: Any) -> None:
    """torch's module registration hook: ``DistributedDataParallel.__init__`` sets ``self.module``,
    so a model given to the Monitor is known to be inside one, made before or after the Monitor."""
    if name == "module" and isinstance(parent, torch.nn.parallel.DistributedDataParallel):
        _IN_DDP[child] = weakref.ref(parent)


torch.nn.modules.module.register_module_module_registration_hook(_note_ddp)


def _ddp_around(model: Any, search: bool) -> bool:
    """Whether a live DDP module holds ``model``: noted by :func:`_note_ddp` where it was made after
    this module's import; else (``search``: once) found among what refers to the model — its
    ``_modules``, and that dict's owner, DDP's ``__dict__`` known by its keys (``distmetrics`` imports
    this module at the first ``dm.Monitor``, after Trainer or Accelerate wrapped the model). Each step
    is a scan of the objects the collector tracks: 0.01-0.1 s per million objects."""
    noted = _IN_DDP.get(model)
    if noted is not None and noted() is not None:
        return True
    if not search:
        return False
    ddp = torch.nn.parallel.DistributedDataParallel
    for modules in gc.get_referrers(model):
        if type(modules) is dict and modules.get("module") is model:
            for attributes in gc.get_referrers(modules):
                if isinstance(attributes, ddp):  # reached from the object itself (a dict kept inline)
                    return True
                if type(attributes) is dict and attributes.get("_modules") is modules and \
                        "require_backward_grad_sync" in attributes and "reducer" in attributes:  # DDP's __dict__
                    return True
    return False


class GradSync:
    """Checks that no DDP or FSDP2 wrapper in ``model`` (None: nothing to check) is inside a
    gradient-accumulation window, or left gradients of one unreduced. ``plans``, the norm plans of
    ``model``, tell of changes made in place (:attr:`ParamPlans.reads`); ``say``: this rank gives the
    job's once-per-job warnings."""

    def __init__(self, model: Optional[torch.nn.Module], plans: Optional[ParamPlans] = None,
                 say: bool = True) -> None:
        self.model = model
        self.plans = plans
        self._say_ddp = say  # the model's DDP module, not seen from the model, is still to be said
        self._searched = False  # the heap was searched for a DDP module made around the model
        self._found_at: tuple = ()  # what _changes() said when the wrappers were found
        self._ddp: list = []  # DistributedDataParallel modules
        self._groups: list = []  # FSDP2 parameter groups
        self._replicated: list = []  # ... of them, those with a replicate dimension (HSDP)
        self._names: dict[int, str] = {}  # id of a module or group → the model's name for its module
        self._unsynced: set[int] = set()  # DDP modules whose last forward with grad ran inside no_sync()
        self._hooks: dict[int, tuple] = {}  # id of a DDP module → (a weak reference to it, its forward pre-hook)
        self._said_join = False  # a DDP module's forward inside join() was warned about
        self._say_window = say  # a monitor.step inside an accumulation window is still to be said
        self._window_checks = 0  # monitor.step calls checked for it
        self.open_at: Optional[int] = None  # the step it was found at
        if model is not None:  # now: the hooks see the first step's forwards
            self._find()

    def check(self, call: str) -> None:
        """Raise a ``ValueError`` naming the module and what to do where some wrapper's gradients
        are not synchronised; ``call`` names the caller."""
        state = self.open_window()
        if state is not None:
            raise ValueError(f"{call}: the model's {state[0]}: {state[1]}")

    def say_open_window(self, step: int) -> None:
        """At one of the job's first :data:`WINDOW_CHECKS` ``monitor.step`` calls: where this rank's model holds
        gradients a backward left unreduced (DDP's last forward inside ``no_sync()``, FSDP2's or HSDP's
        held back), say so, once: ``monitor.step`` came per micro-batch, so its record and its step count
        are a micro-batch's, and no optimizer stepped. Nothing is refused (a rank may train on its own
        gradients on purpose). A sync flag merely off is no sign (Lightning Fabric leaves FSDP2's off
        after the last micro-batch's synced backward). Called on every rank: each refreshes the wrappers
        as :meth:`check` does (a refresh on one rank alone would hook a DDP module the others do not, and
        their refusals would differ); the rank that says the job's warnings looks and says."""
        if self._window_checks >= WINDOW_CHECKS:
            return
        self._window_checks += 1
        if self.model is not None and self._found_at != self._changes():
            self._find()  # every rank alike, as check() does: a Monitor made before fully_shard finds the groups
        if not self._say_window:
            return
        if not self.held_open():
            return
        self._say_window, self.open_at = False, step
        logger.warning("distmetrics: monitor.step(%s) came inside a gradient-accumulation window: the model's %s. "
                       "monitor.step is called once per optimizer step, after the last micro-batch's backward and "
                       "the optimizer's step, with the loss and tokens of all its micro-batches (README, "
                       "\"Gradient accumulation\"); called per micro-batch, its records, step counts and rates are "
                       "the micro-batches'. Said once (where every rank trains on its own gradients on purpose, as "
                       "in local SGD, ignore it)", step, self._refusal()[0])

    def held_open(self) -> bool:
        """Whether the wrappers found last hold gradients a backward left unreduced now (no refresh: the
        rank that says the job's warnings asks, alone)."""
        return any(id(module) in self._unsynced for module in self._ddp) or any(map(_held_back, self._groups))

    def open_window(self) -> Optional[tuple[str, str]]:
        """None where every wrapper's gradients are synchronised, else (what is not, why that matters
        and what to do), in the words of the first wrapper found so."""
        if self.model is None:
            return None
        if self._found_at != self._changes():
            self._find()
        # FSDP2's and HSDP's flags alone are no sign: set off after the last, synced backward (as Lightning
        # Fabric leaves them), nothing is held back and .grad holds the reduced gradients; a backward with
        # one off holds its gradients back, and that is what shows
        if all(map(_DDP_SYNC, self._ddp)) and not self._unsynced and not any(map(_held_back, self._groups)):
            return None
        return self._refusal()

    def _refusal(self) -> tuple[str, str]:
        """What is not synchronised, in the words of the first wrapper found so (windows still open
        first: they explain the gradients held back too), and what to do."""
        for module in self._ddp:
            if not module.require_backward_grad_sync:
                return (f"DistributedDataParallel module {self._names[id(module)]} is inside no_sync() "
                        "(require_backward_grad_sync is False)", "its gradients are this rank's own, not yet "
                        "all-reduced, so the norm would be this rank's, not the global one. Measure or clip the "
                        f"gradients {_AFTER}, outside no_sync()")
        for module in self._ddp:
            if id(module) in self._unsynced:
                return (f"DistributedDataParallel module {self._names[id(module)]} ran its last forward inside "
                        "no_sync() (its last with grad enabled; one under torch.no_grad() does not count)", "the "
                        "backward of that forward did not all-reduce, so the gradients are this rank's own and the "
                        "norm would be this rank's, not the global one. Run the "
                        f"last micro-batch's forward and backward outside no_sync() and measure or clip the gradients "
                        f"{_AFTER}")
        for group in filter(_held_back, self._groups):
            if not group.reduce_grads:
                kind = "HSDP" if group in self._replicated else "FSDP2"
                return (f"{kind} module {self._names[id(group)]} has gradient sync off "
                        "(set_requires_gradient_sync(False))", "its sharded gradients are not reduced yet (inside "
                        "an accumulation window .grad holds none of them: it is None, or an earlier synced "
                        "backward's), so the norm would leave them out. Measure or clip the "
                        f"gradients {_AFTER}, made with set_requires_gradient_sync(True)")
        for group in filter(_held_back, self._replicated):
            if not group.all_reduce_grads:
                return (f"HSDP module {self._names[id(group)]} has the all-reduce over replicas off "
                        "(set_requires_all_reduce(False))", "its reduce-scattered gradients wait for a backward that "
                        "all-reduces them and are not in .grad yet, so the norm would leave them out. Measure or clip "
                        f"the gradients {_AFTER}, made with set_requires_all_reduce(True)")
        group = next(filter(_held_back, self._groups), None)
        if group is None:  # none of the above: no wrapper of the model's holds its gradients back now
            return ("wrappers changed while gradients were held back", "measure or clip the gradients "
                    f"{_AFTER}")
        kind = "HSDP" if group in self._replicated else "FSDP2"
        return (f"{kind} module {self._names[id(group)]} holds gradients that its last backward did not reduce",
                "that backward ran with set_requires_gradient_sync(False) or set_requires_all_reduce(False), set back "
                "to True only after it, so the sharded .grad leaves them out and the norm would too. Set them to True "
                f"before the last micro-batch's backward and measure or clip the gradients {_AFTER}")

    def _changes(self) -> tuple:
        """What changes where the model's wrappers may have: registrations anywhere, the root's class
        (``fully_shard(model)``), the modules with composable state (``fully_shard`` on some of them
        only), the model's parameters or modules set in place (seen at a clip)."""
        return _REGISTRATIONS[0], type(self.model), len(_STATES), self.plans.reads if self.plans else 0

    def _find(self) -> None:
        """The model's DDP modules and FSDP2 parameter groups, and their names as the norms name them
        (wrapper levels dropped: ``torch.compile(DDP(model))``'s DDP is the model itself, not ``_orig_mod``)."""
        self._ddp, self._groups, self._replicated, self._names = [], [], [], {}
        seen: set = set()
        names = module_name_map(self.model)
        for name, module in self.model.named_modules():
            label = f"'{names[name]}'" if names[name] else "(the model itself)"
            if isinstance(module, torch.nn.parallel.DistributedDataParallel):
                self._ddp.append(module)
                self._names[id(module)] = label
                hooked = self._hooks.get(id(module))
                if hooked is None or hooked[0]() is not module:  # a new module (one at a gone one's address too)
                    self._unsynced.discard(id(module))  # its forwards are yet to be seen
                    hook = module.register_forward_pre_hook(self._note_forward)
                    self._hooks[id(module)] = (weakref.ref(module), hook)
            for group in fsdp_groups(module):  # none found would pass every window: every torch's layout read
                if id(group) in seen or not hasattr(group, "reduce_grads"):  # one state may manage several modules
                    continue
                seen.add(id(group))
                self._groups.append(group)
                self._names[id(group)] = label
                if getattr(getattr(group, "mesh_info", None), "replicate_mesh_dim", None) is not None:
                    self._replicated.append(group)  # all-reduced over replicas (HSDP)
        live = set(map(id, self._ddp))  # a DDP module no longer in the model (wrapped anew after an unfreeze):
        for key in [key for key in self._hooks if key not in live]:  # its window and hook go (its state had
            self._hooks.pop(key)[1].remove()  # refused every later clip, with a bare StopIteration)
        self._unsynced &= live
        self._found_at = self._changes()
        searched, self._searched = self._searched, True
        if self._say_ddp and not self._ddp and _ddp_around(self.model, not searched):
            self._say_ddp = False
            logger.warning("distmetrics: the model given to the Monitor is inside a DistributedDataParallel module, "
                           "which cannot be seen from it: norms measured inside that module's no_sync() (each rank's "
                           "own gradients, not all-reduced) are not refused. Give the Monitor the "
                           "DistributedDataParallel module")

    def _note_forward(self, module: Any, args: Any) -> None:
        """A DDP module's forward: with grad enabled, its backward all-reduces only outside
        ``no_sync()``. A forward under ``torch.no_grad()`` (a reference model's, a GAN's generator
        for the discriminator's step, an evaluation) leaves what the last one with grad said: DDP's
        own ``require_forward_param_sync`` turns False there too, which refused working loops."""
        if not self._said_join and getattr(getattr(module, "_join_config", None), "enable", False):
            self._said_join = True
            logger.warning("distmetrics: DistributedDataParallel module %s runs inside join() (uneven inputs): a rank "
                           "that runs out of inputs first shadows DDP's own collectives, not the Monitor's, so a "
                           "clip or log step on the ranks still training meets DDP's collectives there and the job "
                           "stops (gloo: a size mismatch; NCCL: a hang). Give every rank the same number of steps "
                           "(DistributedSampler(drop_last=True), or stop every rank at the shortest one's end)",
                           self._names.get(id(module), "(the model itself)"))
        if torch.is_grad_enabled():
            if module.require_backward_grad_sync or _from_pipeline_stage():
                self._unsynced.discard(id(module))
            else:
                self._unsynced.add(id(module))

    def close(self) -> None:
        """Remove the forward hooks from the model's DDP modules."""
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()


def _from_pipeline_stage() -> bool:
    """Whether this forward comes from ``torch.distributed.pipelining``'s stage, which runs every
    forward inside ``no_sync()`` and all-reduces at the last micro-batch's backward all the same (it
    readies DDP's reducer itself): not a window left open. Read from the caller frames, only for a
    forward inside ``no_sync()``."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "forward_maybe_with_nosync" and "pipelining" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def _held_back(group: Any) -> bool:
    """Whether an FSDP2 parameter group holds gradients that a backward left unreduced, until a
    backward with sync on reduces them with its own (torch 2.13's ``FSDPParamGroup.post_backward``):
    a parameter's in its ``unsharded_accumulated_grad`` (reduce dtype) or its unsharded parameter's
    ``.grad``, or HSDP's reduce-scattered ones not yet all-reduced in ``_partial_reduce_output``.
    Attribute reads only: this runs at every clip, over every parameter FSDP2 manages."""
    if getattr(group, "_partial_reduce_output", None) is not None:
        return True
    for fsdp_param in group.fsdp_params:
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            return True
        unsharded = getattr(fsdp_param, "_unsharded_param", None)  # made at its first all-gather
        if unsharded is not None and unsharded.grad is not None:
            return True
    return False
