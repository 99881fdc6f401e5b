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
and held tensors): reading them waits for no device. The wrappers that hold them are found once,
and again only after a module or parameter is registered somewhere. Megatron's DDP is not read
here: its gradients are ready after ``finish_grad_sync()`` (README).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from .naming import module_name_map
from .plans import _REGISTRATIONS

__all__ = ["GradSync"]

_DDP_SYNC = operator.attrgetter("require_backward_grad_sync")
_REDUCES = operator.attrgetter("reduce_grads")
_ALL_REDUCES = operator.attrgetter("all_reduce_grads")
_AFTER = "after the last micro-batch's backward"


class GradSync:
    """Checks that no DDP or FSDP2 wrapper in ``model`` (None: nothing to check) is inside a
    gradient-accumulation window, or left gradients of one unreduced."""

    def __init__(self, model: Optional[torch.nn.Module]) -> None:
        self.model = model
        self._found_at: Optional[int] = None  # _REGISTRATIONS when the wrappers were found
        self._ddp: list = []  # DistributedDataParallel modules
        self._groups: list = []  # FSDP2 parameter groups
        self._replicated: list = []  # ... of them, those with a replicate dimension (HSDP)
        self._names: dict[int, str] = {}  # id of a module or group → the model's name for its module
        self._unsynced: set[int] = set()  # DDP modules whose last forward with grad ran inside no_sync()
        self._hooks: dict[int, Any] = {}  # id of a DDP module → its forward pre-hook's handle
        if model is not None:  # now: the hooks see the first step's forwards
            self._find()

    def check(self, call: str) -> None:
        """Raise a ``ValueError`` naming the module and what to do where some wrapper's gradients
        are not synchronised; ``call`` names the caller."""
        if self.model is None:
            return
        if self._found_at != _REGISTRATIONS[0]:
            self._find()
        if all(map(_DDP_SYNC, self._ddp)) and not self._unsynced and \
                all(map(_REDUCES, self._groups)) and all(map(_ALL_REDUCES, self._replicated)) and \
                not any(map(_held_back, self._groups)):
            return
        raise ValueError(f"{call}: the model's {self._refusal()}")

    def _refusal(self) -> str:
        """What is not synchronised, in the words of the first wrapper found so (windows still open
        first: they explain the gradients held back too), and what to do."""
        for module in self._ddp:
            if not module.require_backward_grad_sync:
                return (f"DistributedDataParallel module {self._names[id(module)]} is inside no_sync() "
                        "(require_backward_grad_sync is False): its gradients are this rank's own, not yet "
                        "all-reduced, so the norm would be this rank's, not the global one. Measure or clip the "
                        f"gradients {_AFTER}, outside no_sync()")
        for module in self._ddp:
            if id(module) in self._unsynced:
                return (f"DistributedDataParallel module {self._names[id(module)]} ran its last forward inside "
                        "no_sync() (its last with grad enabled; one under torch.no_grad() does not count): the "
                        "backward of that forward did not all-reduce, so the gradients are this rank's own and the "
                        "norm would be this rank's, not the global one. Run the "
                        f"last micro-batch's forward and backward outside no_sync() and measure or clip the gradients "
                        f"{_AFTER}")
        for group in self._groups:
            if not group.reduce_grads:
                return (f"FSDP2 module {self._names[id(group)]} has gradient sync off "
                        "(set_requires_gradient_sync(False)): its sharded gradients are not reduced yet (.grad is None "
                        "inside an accumulation window), so the norm would leave them out. Measure or clip the "
                        f"gradients {_AFTER}, made with set_requires_gradient_sync(True)")
        for group in self._replicated:
            if not group.all_reduce_grads:
                return (f"HSDP module {self._names[id(group)]} has the all-reduce over replicas off "
                        "(set_requires_all_reduce(False)): its reduce-scattered gradients wait for a backward that "
                        "all-reduces them and are not in .grad yet, so the norm would leave them out. Measure or clip "
                        f"the gradients {_AFTER}, made with set_requires_all_reduce(True)")
        group = next(filter(_held_back, self._groups))
        kind = "HSDP" if group in self._replicated else "FSDP2"
        return (f"{kind} module {self._names[id(group)]} holds gradients that its last backward did not reduce: "
                "that backward ran with set_requires_gradient_sync(False) or set_requires_all_reduce(False), set back "
                "to True only after it, so the sharded .grad leaves them out and the norm would too. Set them to True "
                f"before the last micro-batch's backward and measure or clip the gradients {_AFTER}")

    def _find(self) -> None:
        """The model's DDP modules and FSDP2 parameter groups, and their names as the norms name them
        (wrapper levels dropped: ``torch.compile(DDP(model))``'s DDP is the model itself, not ``_orig_mod``)."""
        state_of = _state_getter()
        self._ddp, self._groups, self._replicated, self._names = [], [], [], {}
        seen: set = set()
        names = module_name_map(self.model)
        for name, module in self.model.named_modules():
            label = f"'{names[name]}'" if names[name] else "(the model itself)"
            if isinstance(module, torch.nn.parallel.DistributedDataParallel):
                self._ddp.append(module)
                self._names[id(module)] = label
                if id(module) not in self._hooks:
                    self._hooks[id(module)] = module.register_forward_pre_hook(self._note_forward)
            state = state_of(module) if state_of is not None else None
            groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; before, one group or None:
            if groups is None:  # a check that found no group would pass every window
                single = getattr(state, "_fsdp_param_group", None)
                groups = [single] if single is not None else ()
            for group in groups:
                if id(group) in seen or not hasattr(group, "reduce_grads"):  # one state may manage several modules
                    continue
                seen.add(id(group))
                self._groups.append(group)
                self._names[id(group)] = label
                if getattr(getattr(group, "mesh_info", None), "replicate_mesh_dim", None) is not None:
                    self._replicated.append(group)  # all-reduced over replicas (HSDP)
        self._found_at = _REGISTRATIONS[0]

    def _note_forward(self, module: Any, args: Any) -> None:
        """A DDP module's forward: with grad enabled, its backward all-reduces only outside
        ``no_sync()``. A forward under ``torch.no_grad()`` (a reference model's, a GAN's generator
        for the discriminator's step, an evaluation) leaves what the last one with grad said: DDP's
        own ``require_forward_param_sync`` turns False there too, which refused working loops."""
        if torch.is_grad_enabled():
            if module.require_backward_grad_sync:
                self._unsynced.discard(id(module))
            else:
                self._unsynced.add(id(module))

    def close(self) -> None:
        """Remove the forward hooks from the model's DDP modules."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()


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


def _state_getter() -> Any:
    """torch's lookup of a module's composable state (FSDP2 keeps its parameter groups there), or
    None where torch.distributed lacks it."""
    try:
        from torch.distributed._composable_state import _get_module_state
    except ImportError:
        return None
    return _get_module_state
