"""The forward hook a selected layer runs, and whose forwards it counts.

The hook measures the tensors a ``LogTensorStats`` section names (activation, input, weight,
gradient) on the steps the YAML selects, in training forwards only: not an evaluation's (the
Monitor paused, or the module in eval mode), not activation recomputation inside backward (save a
gradient that reentrant checkpointing owes), and not a copy's. ``copy.deepcopy`` of a model copies
its hooks, so an EMA or teacher model made after the Monitor would feed its forwards into the
original's statistics; a module swapped in with the hooks copied (``prepare_qat``) stands in the
hooked layer's place and counts (:class:`StandIns`)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from .features import _tensor_entries
from .schedule import logs_at
from .layer_tensors import first_tensor_argument, output_kind, output_tensor

__all__ = ["StandIns", "base_feature", "forward_hook"]


class StandIns:
    """Whether a module running a hook made for another stands where that one stood in the model:
    swapped in, as ``prepare_qat`` swaps a Linear for its QAT version, hooks and all; not a copy
    (an EMA or teacher beside the model, or kept inside it as ``model.ema``). Found once per module."""

    def __init__(self) -> None:
        self._known: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()

    def __call__(self, module: torch.nn.Module, model: Any, path: Optional[str]) -> bool:
        known = self._known.get(module)
        if known is None:
            try:
                known = model is not None and path is not None and model.get_submodule(path) is module
            except AttributeError:  # the path is gone from the model
                known = False
            self._known[module] = known
        return known


def base_feature(inspector: Any, name: str, feature: dict) -> Callable[[str, torch.Tensor], None]:
    """nvdlfw-inspect's base ``LogTensorStats`` of layer ``name`` through our hooks: its schedule and
    statistics (any case), measured with the inspector's partials. Called, the feature gathers the
    tensor along its first dimension inside the hook, a collective per tensor and micro-batch: ranks
    with batches of unequal size got statistics of zero-padded tensors (or gloo aborted), a layer run
    on some ranks only hung its peers in the hook, and the last micro-batch's value replaced the others'."""
    entries: dict = {}
    for entry in _tensor_entries(name, feature, "LogTensorStats"):
        entries.setdefault(entry["tensor"], dict(feature, **entry))  # as nvdlfw-inspect: a tensor's first entry

    def call(tensor_name: str, tensor: torch.Tensor) -> None:
        entry = entries.get(tensor_name)
        if entry is not None and logs_at("base", entry, inspector.iteration):
            inspector.add(name, tensor_name, tensor, [str(stat).lower() for stat in entry.get("stats", ())])

    return call


def forward_hook(inspector: Any, module: torch.nn.Module, name: str, tensors: list, namespace: str, feature: dict,
                 call: Callable[[str, torch.Tensor], None], place: tuple) -> Callable:
    """The hook (registered ``with_kwargs=True``) that hands ``module``'s selected ``tensors`` to ``call``.
    ``place``: the model and the module's path in it (where a module swapped in stands)."""
    gradient = next((dict(feature, **entry) for entry in _tensor_entries(name, feature, "LogTensorStats")
                     if entry["tensor"] == "gradient"), None)  # its first entry, as nvdlfw-inspect reads it

    def hook(mod, args, *kwargs_output):  # (kwargs, output), or (output,) where a module swap
        # (torch.ao.quantization's prepare_qat) copied the hook without with_kwargs
        if not inspector.active or not mod.training or (
                mod is not module and mod._forward_hooks_with_kwargs is not module._forward_hooks_with_kwargs
                and not inspector.stand_ins(mod, *place)):
            return  # (a DataParallel replica shares the module's hook dicts, and is the module's forward)
        if inspector.paused:  # an evaluation's forward; a section that then gets nothing names the pause
            inspector.paused_forwards = True
            return
        kwargs, output = kwargs_output if len(kwargs_output) == 2 else ({}, kwargs_output[0])
        out = output_tensor(output)
        owed = inspector.gradient_owed
        if torch._C._current_graph_task_id() != -1:  # recomputation inside backward
            if owed.get(name) and out is not None and out.requires_grad:
                owed[name] -= 1
                out.register_hook(lambda grad: call("gradient", grad))
            return
        unreadable = inspector.unreadable
        if out is None:
            for tensor_name in [t for t in ("activation", "gradient") if t in tensors]:
                unreadable(name, tensor_name, f"its output is {output_kind(output)}, not a tensor "
                           "or a tuple or list whose first item is one")
        if "activation" in tensors and out is not None:
            call("activation", out)
        if "input" in tensors:
            inputs = first_tensor_argument(args, kwargs)
            if inputs is None:
                unreadable(name, "input", "no argument of its call is a tensor")
            else:
                call("input", inputs)
        if "weight" in tensors and (name, namespace) not in inspector.weights_done:
            inspector.weights_done.add((name, namespace))  # once per step, not per micro-batch
            weight = getattr(mod, "weight", None)
            if isinstance(weight, torch.Tensor):
                call("weight", inspector.optimizer_weights(weight))
            else:
                inside = " (select the layers inside it)" if next(mod.children(), None) is not None else ""
                unreadable(name, "weight", f"a {type(mod).__name__} has no 'weight' tensor{inside}")
        if "gradient" in tensors and out is not None:
            if out.requires_grad:
                out.register_hook(lambda grad: call("gradient", grad))
            elif not torch.is_grad_enabled():  # reentrant checkpointing: its recomputation is backpropagated
                owed[name] = owed.get(name, 0) + 1
            elif logs_at("base", gradient, inspector.iteration):  # backward never comes: frozen, or not differentiable
                inspector.no_gradient[name] = any(p.requires_grad for p in mod.parameters())

    return hook
