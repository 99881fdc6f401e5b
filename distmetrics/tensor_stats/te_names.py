"""TransformerEngine's (and nvdlfw-inspect's) logged names → ours.

TE logs ``<layer>_<tensor>_<stat>``; we write ``tensor_stats/<layer>/<tensor>/<stat>`` with the
``model.`` prefix that ``infer_and_assign_layer_names`` adds taken off, and wrapper levels too.
"""

from __future__ import annotations

from typing import Any

from ..naming import strip_wrappers

__all__ = ["metric_name", "strip_model", "TE_TENSORS"]

TE_TENSORS = ("activation", "gradient", "weight", "output", "wgrad", "dgrad", "input")


def metric_name(name: str, layers: Any = (), tensors: Any = ()) -> str:
    """TE's ``<layer>_<tensor>_<stat>`` → ``tensor_stats/<layer>/<tensor>/<stat>``.

    The longest known layer name that prefixes ``name`` wins, so a layer whose own name holds
    ``_weight_`` or ``_input_`` is not split there; after it, the longest tensor name of TE's or of
    ``tensors`` (the features file's) that the rest starts with, so a tensor named ``attn_scores``
    is not split at its own ``_``; else the rest up to its first ``_``. Without a known layer, the
    last ``_<tensor>_`` (stat names hold none)."""
    known = sorted({*TE_TENSORS, *tensors}, key=len, reverse=True)
    for layer in sorted(layers, key=len, reverse=True):
        if name.startswith(layer + "_"):
            rest = name[len(layer) + 1:]
            tensor_name = next((t for t in known if rest.startswith(t + "_") and len(rest) > len(t) + 1), None)
            stat = rest[len(tensor_name) + 1:] if tensor_name else None
            if tensor_name is None:
                tensor_name, _, stat = rest.partition("_")
            if stat:
                return f"tensor_stats/{strip_model(layer)}/{tensor_name}/{stat}"
    hits = [(name.rfind(f"_{t}_"), t) for t in TE_TENSORS if f"_{t}_" in name]
    if hits:
        at, tensor_name = max(hits)
        return f"tensor_stats/{strip_model(name[:at])}/{tensor_name}/{name[at + len(tensor_name) + 2:]}"
    return f"tensor_stats/{name}"


def strip_model(layer: str) -> str:
    """``model.module.decoder.layers.1.mlp`` → ``decoder.layers.1.mlp``: nvdlfw-inspect's ``model.``
    and the wrapper levels (DDP's ``module.``, ``_orig_mod.``, ...) that norm names drop too."""
    return strip_wrappers(layer[len("model."):] if layer.startswith("model.") else layer)
