"""TransformerEngine's (and nvdlfw-inspect's) logged names → ours.

TE logs ``<layer>_<tensor>_<stat>``; we write ``tensor_stats/<layer>/<tensor>/<stat>`` with the
``model.`` prefix that ``infer_and_assign_layer_names`` adds taken off, and the wrapper levels
that norm names leave off too (:func:`distmetrics.naming.is_wrapper_level`). The root module is
``model``, or ``root`` where a top-level child is called ``model`` (a Hugging Face ``*ForCausalLM``
holds ``self.model``), as norm names call it (:func:`distmetrics.naming.root_name`): nvdlfw-inspect
names the two ``model`` and ``model.model``, and both must stay apart in metric names too.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ..naming import is_wrapper_level, root_name, strip_wrappers
from .compiled import is_compile_wrapper

__all__ = ["metric_name", "metric_layers", "strip_model", "shadowed_layers", "TE_TENSORS"]

TE_TENSORS = ("activation", "gradient", "weight", "output", "wgrad", "dgrad", "input")


def metric_name(name: str, layers: Any = (), tensors: Any = ()) -> str:
    """TE's ``<layer>_<tensor>_<stat>`` → ``tensor_stats/<layer>/<tensor>/<stat>``.

    The longest known layer name that prefixes ``name`` wins, so a layer whose own name holds
    ``_weight_`` or ``_input_`` is not split there; after it, the longest tensor name of TE's or of
    ``tensors`` (the features file's) that the rest starts with, so a tensor named ``attn_scores``
    is not split at its own ``_``; else the rest up to its first ``_``. Without a known layer, the
    last ``_<tensor>_`` of those names (stat names hold none). ``layers`` may map each name to the one metrics
    give it (:func:`metric_layers`)."""
    known = sorted({*TE_TENSORS, *tensors}, key=len, reverse=True)
    rename = layers if isinstance(layers, Mapping) else {}
    for layer in sorted(layers, key=len, reverse=True):
        if name.startswith(layer + "_"):
            rest = name[len(layer) + 1:]
            tensor_name = next((t for t in known if rest.startswith(t + "_") and len(rest) > len(t) + 1), None)
            stat = rest[len(tensor_name) + 1:] if tensor_name else None
            if tensor_name is None:
                tensor_name, _, stat = rest.partition("_")
            if stat:
                return f"tensor_stats/{rename.get(layer, strip_model(layer))}/{tensor_name}/{stat}"
    hits = [(name.rfind(f"_{t}_") + len(t), len(t), t) for t in known if f"_{t}_" in name]
    if hits:  # the one ending last; of those, the longest (attn_scores, not scores)
        end, _, tensor_name = max(hits)
        at = end - len(tensor_name)
        return f"tensor_stats/{strip_model(name[:at])}/{tensor_name}/{name[at + len(tensor_name) + 2:]}"
    return f"tensor_stats/{name}"


def metric_layers(model: torch.nn.Module) -> dict[str, str]:
    """nvdlfw-inspect's layer names of ``model`` (``infer_and_assign_layer_names``) → the names
    metrics give them: ``model.`` off, and a wrapper level off only where norm names drop it
    (:func:`~distmetrics.naming.is_wrapper_level`: DDP's ``module``, ``_orig_mod``, ...), so a
    model's own submodule named ``module`` keeps its name and never merges with a sibling; the
    root (and the wrapper levels above it) takes :func:`~distmetrics.naming.root_name`."""
    modules = dict(model.named_modules())
    root = root_name(model)
    out = {}
    for path, module in modules.items():
        name = getattr(module, "name", None)
        if not isinstance(name, str):
            continue
        # nvdlfw-inspect's name: "model", then one part per level of the path (a ModuleList's
        # child its layer_number, which can hold a "." of its own) but torch.compile's _orig_mod
        # (compiled.fold_compile_wrappers)
        levels = path.split(".") if path else []
        named = [at for at, level in enumerate(levels)
                 if not (level == "_orig_mod" and is_compile_wrapper(modules.get(".".join(levels[:at]))))]
        parts = name.split(".")[1:]
        if name.split(".")[0] != "model" or len(parts) != len(named):
            out[name] = strip_model(name)
            continue
        kept = [part for part, at in zip(parts, named)
                if not is_wrapper_level(modules.get(".".join(levels[:at])), levels[at])]
        out[name] = ".".join(kept) if kept else root  # the root (under wrappers)
    return out


def shadowed_layers(hooked: dict[str, list], paths: Mapping[int, str],
                    sections: Optional[Mapping[str, str]] = None) -> tuple[set, str]:
    """The hooked layers whose values are another's, and an error for two that must not share a name.

    ``hooked`` maps a metric layer name to the ``(nvdlfw-inspect name, module)`` pairs hooked under
    it. A wrapper and the layer it wraps through wrapper levels only (DDP's ``module``, ...) give
    the same tensors: the innermost counts, the others are returned as shadowed. Any other two
    modules under one name (a ``ModuleList`` whose children carry one ``layer_number``, which
    nvdlfw-inspect gives them both) would have their values mixed or one dropped: the error
    names both, with their paths in the model (``paths``: ``id(module)`` -> path); "" if none. So does a
    wrapper and the layer it wraps selected by two sections (``sections``: nvdlfw-inspect name -> the
    section that selects it), which may ask for other tensors, statistics or steps: the wrapper's were
    dropped without a word."""
    shadowed: set = set()
    for layer, pairs in hooked.items():
        chain = sorted({id(module): (name, module) for name, module in pairs}.values(), key=lambda pair: len(pair[0]))
        for (outer, outer_module), (inner, inner_module) in zip(chain, chain[1:]):
            if not _wraps_only(outer_module, inner_module):
                one, other = (f"{name!r} (the {type(module).__name__} at {paths.get(id(module), '?')!r})"
                              for name, module in ((outer, outer_module), (inner, inner_module)))
                fix = ("give them distinct layer_number attributes: nvdlfw-inspect names a ModuleList's children by "
                       "them" if outer == inner else "select one of them")
                return shadowed, (
                    f"tensor_inspect.features: layers {one} and {other} are different modules that would both be "
                    f"written as tensor_stats/{layer}/...: one's statistics would be lost or mixed with the other's; "
                    f"{fix}")
            picked = [(sections or {}).get(name) for name in (outer, inner)]
            if picked[0] != picked[1]:
                return shadowed, (
                    f"tensor_inspect.features: sections {picked[0]!r} and {picked[1]!r} select {outer!r} and "
                    f"{inner!r}, a wrapper and the module it wraps, whose statistics are both written as "
                    f"tensor_stats/{layer}/... (the wrapper's would be dropped): select one of them")
            shadowed.add(outer)
    return shadowed, ""


def _wraps_only(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    """Whether ``inner`` is reached from ``outer`` through wrapper levels alone (each the only child)."""
    module = outer
    while module is not inner:
        name, child = next(iter(module._modules.items()), (None, None))
        if child is None or not (is_wrapper_level(module, name) or (len(module._modules) == 1 and
                                                                     is_compile_wrapper(module))):
            return False
        module = child
    return True


def strip_model(layer: str) -> str:
    """``model.module.decoder.layers.1.mlp`` → ``decoder.layers.1.mlp``: nvdlfw-inspect's ``model.``
    and every level named like a wrapper (DDP's ``module.``, ``_orig_mod.``, ...), for a name of
    no layer of the model (:func:`metric_layers` names those)."""
    return strip_wrappers(layer[len("model."):] if layer.startswith("model.") else layer)
