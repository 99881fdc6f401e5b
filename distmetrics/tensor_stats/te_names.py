"""TransformerEngine's (and nvdlfw-inspect's) logged names → ours.

TE logs ``<layer>_<tensor>_<stat>``; we write ``tensor_stats/<layer>/<tensor>/<stat>`` with the
``model.`` prefix that ``infer_and_assign_layer_names`` adds taken off, and the wrapper levels
that norm names leave off too (:func:`distmetrics.naming.is_wrapper_level`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..naming import is_wrapper_level, strip_wrappers
from .compiled import is_compile_wrapper

__all__ = ["metric_name", "metric_layers", "strip_model", "TE_TENSORS"]

TE_TENSORS = ("activation", "gradient", "weight", "output", "wgrad", "dgrad", "input")


def metric_name(name: str, layers: Any = (), tensors: Any = ()) -> str:
    """TE's ``<layer>_<tensor>_<stat>`` → ``tensor_stats/<layer>/<tensor>/<stat>``.

    The longest known layer name that prefixes ``name`` wins, so a layer whose own name holds
    ``_weight_`` or ``_input_`` is not split there; after it, the longest tensor name of TE's or of
    ``tensors`` (the features file's) that the rest starts with, so a tensor named ``attn_scores``
    is not split at its own ``_``; else the rest up to its first ``_``. Without a known layer, the
    last ``_<tensor>_`` (stat names hold none). ``layers`` may map each name to the one metrics
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
    hits = [(name.rfind(f"_{t}_"), t) for t in TE_TENSORS if f"_{t}_" in name]
    if hits:
        at, tensor_name = max(hits)
        return f"tensor_stats/{strip_model(name[:at])}/{tensor_name}/{name[at + len(tensor_name) + 2:]}"
    return f"tensor_stats/{name}"


def metric_layers(model: torch.nn.Module) -> dict[str, str]:
    """nvdlfw-inspect's layer names of ``model`` (``infer_and_assign_layer_names``) → the names
    metrics give them: ``model.`` off, and a wrapper level off only where norm names drop it
    (:func:`~distmetrics.naming.is_wrapper_level`: DDP's ``module``, ``_orig_mod``, ...), so a
    model's own submodule named ``module`` keeps its name and never merges with a sibling."""
    modules = dict(model.named_modules())
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
        out[name] = ".".join(kept) if kept else strip_model(name)  # the root (under wrappers): "model"
    return out


def strip_model(layer: str) -> str:
    """``model.module.decoder.layers.1.mlp`` → ``decoder.layers.1.mlp``: nvdlfw-inspect's ``model.``
    and every level named like a wrapper (DDP's ``module.``, ``_orig_mod.``, ...), for a name of
    no layer of the model (:func:`metric_layers` names those)."""
    return strip_wrappers(layer[len("model."):] if layer.startswith("model.") else layer)
