"""Calls from code that ``torch.compile`` compiles run the library's code as it is, never traced.

A training step compiled whole, or a compiled forward that records its MoE auxiliary loss, calls
``monitor.record``, ``monitor.clip_grad_norm_`` and the like from inside the compiled region.
Traced, the library's code failed (the clip's parameter lookup), or Dynamo broke the graph inside
it and compiled the rest with guards on the interval's running Python floats: a recompile at
every call until Dynamo's limit. :func:`eager` makes each public entry point one graph break at
the call: the compiled code before it runs, the call runs eagerly on the values computed so far,
and the code after it goes on in the next graph, with nothing of ours in any graph and no guard
on our state. Where Dynamo gives up on the caller's frame instead (an argument it cannot pass
across a graph break, such as ``model.parameters()``'s generator), the frame runs eagerly with
Dynamo still watching every call: the entry point then turns Dynamo off for its own frames too.

Outside compiled code the wrapper costs 0.1-0.3 µs a call (one more Python call,
``torch.compiler.is_dynamo_compiling()`` and a read of Dynamo's frame callback);
``torch.compiler.disable`` alone costs 0.25 µs at every eager call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
"""True while Dynamo traces the caller (it reads the call as a constant); outside, a function that returns False."""
try:  # the callback Dynamo runs on each new frame: None outside compiled code
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # not in this torch: every call goes through torch.compiler.disable
    def _dynamo_callback() -> Any:
        return True

__all__ = ["eager", "tracing"]

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn``, run eagerly with Dynamo off for its frames (``torch.compiler.disable``: a graph break
    at the call) where the call comes from compiled code, and called directly otherwise."""
    disabled: list = []  # made at the first call from compiled code: torch.compiler.disable imports
    # torch._dynamo (0.8 s a process, every rank's and every DataLoader worker's that imports the script)
    said = (f"distmetrics: {fn.__qualname__.replace('Monitor.', 'monitor.')} runs eagerly, at a graph break where "
            "compiled code calls it; under torch.compile(fullgraph=True), which allows none, call it outside the "
            "compiled function")

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # traced, tracing() is True and the callback is never read (Dynamo cannot trace the read)
        traced = tracing()
        if traced:  # a graph break here, which says what it is (fullgraph=True refuses any, naming this)
            torch._dynamo.graph_break(msg=said)
        if traced or _dynamo_callback() is not None:
            if not disabled:
                disabled.append(_disable(fn, call.__code__))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


_SKIPPED: set = set()  # the wrapper code objects Dynamo is told to leave alone


def _disable(fn: Callable[..., Any], wrapper: Any) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``; and, once, Dynamo told to run frames of the ``wrapper`` code
    (every wrapper's: they share it) as they are. Compiled, that small frame guarded on each method
    it wraps and on the state of its own list: a recompile per method, and past 8 Dynamo's
    recompile-limit warning, pointing here."""
    if wrapper not in _SKIPPED:
        _SKIPPED.add(wrapper)
        try:
            from torch._dynamo.eval_frame import skip_code

            skip_code(wrapper)
        except (ImportError, AttributeError):  # another torch: the frames are compiled, and work
            pass
    return torch.compiler.disable(fn)
