"""The statistics' hooks on a model that ``torch.compile`` runs.

* Names: ``torch.compile(module)`` returns a wrapper that hands its attributes, nvdlfw-inspect's
  ``name`` included, to the module it wraps, so the two cannot hold different names; the wrapper
  is no layer. The module takes the wrapper's place (``model.layers.0``, not
  ``model.layers.0._orig_mod``): the names ``module.compile()`` and an uncompiled model give, so a
  features file selects the same layers however a block is compiled (:func:`fold_compile_wrappers`).
* Guards: Dynamo does not check a module's hooks before reusing compiled code
  (``torch._dynamo.config.skip_nnmodule_hook_guards``, true by default). Blocks of one class share
  one code object, so the code compiled for a block without hooks ran for the blocks with them, and
  code compiled before the hooks were added (a warm-up forward) ran on without them: no statistic,
  no word. While hooks are on, the setting is false (process-wide; the earlier value comes back
  when the last hooks go), and compiled code held by then is dropped once
  (``torch._dynamo.reset_code_caches()``: the cached code alone).
* ``fullgraph=True``: the hooks run outside the compiled graph (nvdlfw-inspect's calls cannot be
  traced), a graph break that fullgraph refuses (:func:`fullgraph_owner`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

__all__ = ["is_compile_wrapper", "fold_compile_wrappers", "named_layers", "fullgraph_owner", "fullgraph_error",
           "hold_hook_guards", "release_hook_guards"]

logger = logging.getLogger("distmetrics")


class _Held:
    count = 0  # inspectors whose hooks are on
    saved: Optional[bool] = None  # skip_nnmodule_hook_guards before the first of them
    warned = False  # the setting was named in a warning (once per process)


_HELD = _Held()


def is_compile_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile(module)``'s wrapper (Dynamo's ``OptimizedModule``)."""
    wrapper = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def fold_compile_wrappers(model: torch.nn.Module) -> None:
    """After ``infer_and_assign_layer_names``: each compiled module and everything under it named
    without the wrapper's ``_orig_mod`` level (outer wrappers first, so nested ones fold too)."""
    for module in model.modules():
        inner = module._modules.get("_orig_mod") if is_compile_wrapper(module) else None
        name = getattr(inner, "name", None)
        if not isinstance(name, str) or not name.endswith("._orig_mod"):
            continue
        outer = name[:-len("._orig_mod")]
        for sub in inner.modules():
            own = getattr(sub, "name", None)
            if isinstance(own, str) and (own == name or own.startswith(name + ".")):
                sub.name = outer + own[len(name):]


def named_layers(model: torch.nn.Module) -> list:
    """``(module, name)`` of the layers nvdlfw-inspect named (``infer_and_assign_layer_names``), the
    compile wrappers folded away (:func:`fold_compile_wrappers`)."""
    fold_compile_wrappers(model)
    return [(m, m.name) for m in model.modules() if isinstance(getattr(m, "name", None), str)
            and not is_compile_wrapper(m)]


def _compile_context(module: torch.nn.Module) -> Any:
    """The Dynamo context ``module`` was compiled with: ``torch.compile(module)``'s wrapper holds it;
    ``module.compile()`` keeps it in the closure of the compiled ``_call_impl``. None if neither."""
    if is_compile_wrapper(module):
        return getattr(module, "dynamo_ctx", None)
    compiled = module.__dict__.get("_compiled_call_impl")
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "fullgraph") and hasattr(value, "callback"):
            return value
    return None


def fullgraph_owner(model: torch.nn.Module) -> dict[int, str]:
    """``id(module)`` → the path of the module compiled with ``fullgraph=True`` that holds it (itself
    included), for every module inside one; the root's path is ``"model"``."""
    owners: dict[int, str] = {}
    for path, module in model.named_modules():
        if id(module) not in owners and getattr(_compile_context(module), "fullgraph", False):
            for sub in module.modules():
                owners.setdefault(id(sub), path or "model")
    return owners


def fullgraph_error(layer: str, owner: str) -> str:
    """Why a layer inside a module compiled with ``fullgraph=True`` cannot be hooked, and what works."""
    return (f"tensor_inspect.features: layer {layer!r} is inside {owner!r}, compiled with "
            "torch.compile(fullgraph=True): the statistics' hook runs outside the compiled graph, a graph break "
            "that fullgraph refuses (Dynamo raised Unsupported at the first forward); compile it without "
            "fullgraph=True, or select no layer inside it")


def _holds_compiled_code() -> bool:
    """Whether Dynamo holds compiled code for any function (true where its internals moved: a
    needless reset only costs a compile)."""
    try:
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        codes = [ref() for ref in list(input_codes.seen)]
        return any(code is not None and _debug_get_cache_entry_list(code) for code in codes)
    except (ImportError, AttributeError, TypeError):
        return True


def hold_hook_guards(model: torch.nn.Module, says: bool) -> None:
    """Hooks are on: Dynamo guards on modules' hooks until :func:`release_hook_guards` (see the module
    docstring). ``says``: this rank warns (once per job)."""
    import torch._dynamo

    _HELD.count += 1
    config = torch._dynamo.config
    if _HELD.count > 1 or not config.skip_nnmodule_hook_guards:
        return  # already on: code compiled since then checks the hooks
    _HELD.saved, config.skip_nnmodule_hook_guards = True, False
    stale = _holds_compiled_code()
    if stale:  # the cached code alone: not the callbacks other tools registered, compiled autograd, CUDA graphs
        drop = getattr(torch._dynamo, "reset_code_caches", torch._dynamo.reset)
        drop()
    compiled = any(is_compile_wrapper(m) or m.__dict__.get("_compiled_call_impl") is not None for m in model.modules())
    if says and (stale or (compiled and not _HELD.warned)):
        _HELD.warned = True
        logger.warning(
            "distmetrics: tensor statistics set torch._dynamo.config.skip_nnmodule_hook_guards = False while their "
            "hooks are on (process-wide, restored at close): with Dynamo's default, code compiled for a module "
            "without hooks ran for modules with hooks and their statistics were missing%s",
            "; the code Dynamo had compiled was dropped (torch._dynamo.reset_code_caches(): every compiled "
            "function compiles again at its next call)" if stale else "")


def release_hook_guards() -> None:
    """The hooks of one inspector are off; the last one restores Dynamo's setting."""
    if _HELD.count == 0:
        return
    _HELD.count -= 1
    if _HELD.count == 0 and _HELD.saved is not None:
        import torch._dynamo

        torch._dynamo.config.skip_nnmodule_hook_guards, _HELD.saved = _HELD.saved, None
