"""User-facing module and parameter names, the same on every rank and every layout.

Wrapper levels (DDP's ``module.``, FSDP1's ``_fsdp_wrapped_module.``, ``torch.compile``'s
``_orig_mod.``, activation checkpointing's wrapper, Lightning Fabric's ``_forward_module.``) are
dropped; Megatron's stage-local layer index becomes the global ``layer_number - 1`` (so names
match an unpipelined run) where the ``layers`` list's numbers tell its layers apart, and an
expert's rank-local index in ``local_experts`` its global expert index.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

__all__ = ["WRAPPER_PREFIXES", "module_name_map", "module_order", "strip_wrappers", "global_param_name",
           "ROOT_MODULE", "root_name", "free_name", "is_wrapper_level", "owner_names", "merged_across_stages"]

WRAPPER_PREFIXES = ("module.", "_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_forward_module.")
_WRAPPER_LEVELS = frozenset(prefix[:-1] for prefix in WRAPPER_PREFIXES)
ROOT_MODULE = "model"
"""The name of the root module's own parameters (``grad_norm/model``)."""


def module_name_map(model: torch.nn.Module) -> dict[str, str]:
    """Module path → user-facing name (see the module docstring); the root maps to ``""``."""
    out = {"": ""}
    experts: dict[str, list] = {"": []}  # the nearest MoE layer's global expert indices
    modules = {"": model}
    numbered: dict[str, bool] = {}  # a `layers` list -> whether its layer numbers name its layers
    for name, module in model.named_modules():
        if not name:
            continue
        modules[name] = module
        parent, _, leaf = name.rpartition(".")
        base = out.get(parent, strip_wrappers(parent))
        indices = getattr(module, "local_expert_indices", None)
        experts[name] = list(indices) if isinstance(indices, (list, tuple)) else experts.get(parent, [])
        number = getattr(module, "layer_number", None)
        if is_wrapper_level(modules.get(parent), leaf):
            clean = base
        elif leaf.isdigit() and parent.split(".")[-1] == "layers" and (
                numbered[parent] if parent in numbered else  # once per list: a scan of every child
                numbered.setdefault(parent, _distinct_layer_numbers(modules.get(parent)))):
            clean = f"{base}.{number - 1}" if base else str(number - 1)
        elif leaf.isdigit() and parent.split(".")[-1] == "local_experts" and int(leaf) < len(experts[parent]):
            clean = f"{base}.{experts[parent][int(leaf)]}"
        else:
            clean = f"{base}.{leaf}" if base else leaf
        out[name] = clean
    return out


def is_wrapper_level(parent: Optional[torch.nn.Module], leaf: str) -> bool:
    """Whether child ``leaf`` of ``parent`` is a wrapper level whose name is left out of names: it
    has a wrapper's name (``module``, ``_orig_mod``, ...) and ``parent`` only wraps it."""
    return leaf in _WRAPPER_LEVELS and _wraps(parent)


def _distinct_layer_numbers(layers: Optional[torch.nn.Module]) -> bool:
    """Whether every child of ``layers`` carries a whole ``layer_number`` >= 1 and no two the same:
    only then do the numbers name the layers (Megatron's). A model whose blocks carry some other
    number (1, 1, 5) keeps the list's indices: the numbers merged two blocks into one name."""
    children = list(layers._modules.values()) if layers is not None else []
    numbers = [getattr(child, "layer_number", None) for child in children]
    return bool(numbers) and all(type(n) is int and n >= 1 for n in numbers) and len(set(numbers)) == len(numbers)


def _wraps(parent: Optional[torch.nn.Module]) -> bool:
    """Whether ``parent`` is a wrapper level (DDP, ``torch.compile``'s, activation checkpointing's,
    Megatron's Float16Module, Lightning Fabric's ``_FabricModule``): its one child module is the
    model and it holds no parameter of its own. A model's own submodule named ``module`` beside
    others is not one: dropping its name merged ``module.proj`` with a sibling ``proj``. Fabric's
    wrapper holds the model twice, as ``_forward_module`` (itself, or DDP's wrapper of it) and
    ``_original_module``: a second child that is the first or inside it adds no module."""
    if parent is None or any(q is not None for q in parent._parameters.values()):
        return False
    children = list({id(c): c for c in parent._modules.values() if c is not None}.values())
    if len(children) <= 1:
        return len(children) == 1
    inside = {id(m) for m in children[0].modules()}
    return all(id(c) in inside for c in children[1:])


def strip_wrappers(name: str) -> str:
    """Drop wrapper levels (``module.``, ``_fsdp_wrapped_module.``, ...) from a dotted name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_LEVELS)


def global_param_name(raw: str, rename: dict[str, str]) -> str:
    """A parameter's name from ``named_parameters`` → its global, wrapper-free name."""
    module, _, leaf = raw.rpartition(".")
    base = rename.get(module, strip_wrappers(module))
    return f"{base}.{leaf}" if base else leaf


def root_name(model: Optional[torch.nn.Module], rename: Optional[dict] = None) -> str:
    """What the root module's own parameters are called: :data:`ROOT_MODULE` (``model``), or
    ``root`` (``root_2``, ...) when a top-level child module has that name already (a wrapper
    holding ``self.model``, as Hugging Face's ``*ForCausalLM`` do): the two are never merged.
    ``rename``: the model's :func:`module_name_map`, where made already."""
    if model is None:
        return ROOT_MODULE
    rename = module_name_map(model) if rename is None else rename
    return free_name({name.split(".", 1)[0] for name in rename.values() if name}, ROOT_MODULE, "root")


def free_name(taken: set, first: str, stem: str) -> str:
    """``first``, else ``stem``, ``stem_2``, ``stem_3``, ...: the first not ``taken`` (a top-level
    module's name), so a label of the Monitor's is never merged with a module of that name."""
    candidates = itertools.chain((first, stem), (f"{stem}_{n}" for n in itertools.count(2)))
    return next(name for name in candidates if name not in taken)


def module_order(model: Optional[torch.nn.Module]) -> list[str]:
    """The model's module names in model order (nearest the input first), the root's own
    parameters (:func:`root_name`) before all."""
    if model is None:
        return []
    rename = module_name_map(model)
    return [root_name(model, rename)] + list(dict.fromkeys(name for name in rename.values() if name))


def owner_names(model: Optional[torch.nn.Module]) -> list[str]:
    """The names of the modules that hold trainable parameters themselves (a norm's buckets; the
    root's own as :func:`root_name`). Frozen parameters are in no norm, and a tied copy that Megatron
    marks ``shared`` counts on no rank (the first stage's counts): their names merge nothing."""
    if model is None:
        return []
    rename, out = module_name_map(model), {}
    root = root_name(model, rename)
    for name, module in model.named_modules():
        if any(q is not None and q.requires_grad and not getattr(q, "shared", False)
               for q in module._parameters.values()):
            out[rename[name] or root] = None
    return list(out)


def merged_across_stages(owners: Sequence[Sequence[str]]) -> Optional[tuple[str, int, int]]:
    """The first name (and the two stages, by position in ``owners``) under which the subtree norms of
    pipeline stages would merge different modules: a module holding parameters on one stage whose name
    is, on another, that of a module holding parameters or of one above them. Stage-local names do
    that (every stage's own ``ModuleList`` holds a ``layers.0``); a name above modules on several
    stages alone (``decoder`` over each stage's layers) is the one model's and sums them, as meant."""
    covered = [{".".join(name.split(".")[:depth]) for name in names for depth in range(1, name.count(".") + 2)}
               for names in owners]
    for a, names in enumerate(owners):
        for name in names:
            other = next((b for b, under in enumerate(covered) if b != a and name in under), None)
            if other is not None:
                return name, min(a, other), max(a, other)
    return None
