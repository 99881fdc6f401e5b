"""Which layers a features file selects, through nvdlfw-inspect's own lookup, with the cases where
nvdlfw-inspect 0.2.2 raises for a lookup that should simply not select: a ``layer_numbers``
section asked about a layer whose name holds no single layer number."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["config_for_layer", "numbered", "example_names"]


def config_for_layer(manager: Any, is_layer_in_cfg: Any, name: str, sections: Any = ()) -> dict:
    """nvdlfw-inspect's ``ConfigManager.get_config_for_layer`` with each section asked on its own
    (:func:`numbered`): a ``layer_numbers`` section that cannot read a number from ``name`` does
    not select it, and the other sections still may (nvdlfw-inspect 0.2.2 raises for the whole
    lookup). The answer goes into nvdlfw-inspect's cache, where its own feature calls look.
    ``sections``: the names of ``manager.configs`` in order, for the error of two selecting ``name``."""
    found: dict = {}
    first = None
    for index, spec in enumerate(manager.configs):
        if numbered(is_layer_in_cfg, name, spec):
            if first is not None:
                names = [repr(sections[i]) if i < len(sections) else f"#{i + 1}" for i in (first, index)]
                raise ValueError(f"sections {names[0]} and {names[1]} both select layer {name!r}, and nvdlfw-inspect "
                                 "takes one section per layer: narrow a selector, or merge the two sections")
            found, first = spec.extension_config, index
    manager.layer_name_to_config_cache[name] = found
    return found


def numbered(select: Any, name: str, *args: Any) -> Any:
    """``select(name, *args)`` (nvdlfw-inspect's layer lookup), or None for a layer whose name holds
    no single layer number where a section selects ``layer_numbers``: nvdlfw-inspect 0.2.2 raises
    IndexError for a name without a number (the root module, ``model``) and ValueError for one with
    several; neither is a layer those numbers select."""
    try:
        return select(name, *args)
    except IndexError:
        return None
    except ValueError as err:
        if "Could not extract layer number" in str(err):
            return None
        raise


def example_names(model: torch.nn.Module) -> list:
    """The first few layer names nvdlfw-inspect gave the model's modules (for an error message), each
    once: ``torch.compile``'s wrapper is no layer (it answers with the name of the module it wraps)."""
    from .compiled import is_compile_wrapper

    names = [getattr(m, "name", None) for m in model.modules() if not is_compile_wrapper(m)]
    return list(dict.fromkeys(n for n in names if isinstance(n, str)))[:4]
