"""FSDP2's parameter groups, read from each module's composable state, and the sharded parameter
behind a parameter FSDP2 has registered in its place for now.

FSDP2 registers a module's unsharded parameters from its all-gather until it reshards: the
root's after its forward (by default the root does not reshard after forward, as its backward
comes next), every module's after a backward where ``set_reshard_after_backward(False)``, and,
with ``reshard_after_forward`` an int, parameters on a smaller mesh after forward. A forward
under ``torch.no_grad()`` between the backward and the clip (a metrics pass) leaves them so.
Those parameters hold no gradient: FSDP2 reduces gradients into the sharded parameters, the
ones the optimizer steps. Norms read the sharded ones (:func:`sharded_params`)."""

from __future__ import annotations

from typing import Any, Optional

import torch

try:  # each module's composable state: FSDP2 keeps its parameter groups there
    from torch.distributed._composable_state import _get_module_state, _module_state_mapping as STATES
except ImportError:  # torch.distributed lacks it: no FSDP2
    _get_module_state, STATES = None, {}

__all__ = ["fsdp_groups", "sharded_params", "STATES"]

_STAND_INS = ("_unsharded_param", "_sharded_post_forward_param")
"""What FSDP2 registers in place of a parameter between its all-gather and its reshard."""


def fsdp_groups(module: torch.nn.Module) -> tuple:
    """The FSDP2 parameter groups of ``module``'s state (none where ``fully_shard`` was not applied
    to it). torch 2.13 keeps a list; earlier versions one group or None."""
    state = _get_module_state(module) if _get_module_state is not None else None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        single = getattr(state, "_fsdp_param_group", None)
        groups = [single] if single is not None else ()
    return tuple(groups)


def sharded_params(model: Optional[torch.nn.Module]) -> dict[int, torch.nn.Parameter]:
    """The id of each parameter FSDP2 has registered in place of a sharded one for now (a group not
    resharded: see the module docstring) → that sharded parameter: of ``model``'s modules, or with no
    model (``distmetrics.clip_grad_norm_``, given parameters alone) of every module with composable
    state in the process. Empty where every group is sharded, or no module is FSDP2's (one lookup per
    module: read where the parameters changed, or a parameter list is new)."""
    if not STATES:
        return {}
    out: dict[int, torch.nn.Parameter] = {}
    seen: set = set()
    for module in model.modules() if model is not None else list(STATES):
        for group in fsdp_groups(module):
            if id(group) in seen or getattr(group, "is_sharded", True):
                continue
            seen.add(id(group))
            for fsdp_param in getattr(group, "fsdp_params", ()):
                sharded = getattr(fsdp_param, "sharded_param", None)
                for name in _STAND_INS:
                    stand_in: Any = getattr(fsdp_param, name, None)
                    if sharded is not None and stand_in is not None and stand_in is not sharded:
                        out[id(stand_in)] = sharded
    return out
