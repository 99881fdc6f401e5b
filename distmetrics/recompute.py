"""Records made in a forward that activation checkpointing runs again inside backward.

``torch.utils.checkpoint`` (both kinds), ``checkpoint_wrapper`` and Megatron's recompute run a block's
forward a second time during backward to remake what it saved: a ``monitor.record`` or ``record_moe``
in that forward (a router's aux loss) was counted twice (a sum doubled; a mean weighing the
checkpointed layers twice against the others). Such a call is left out: the forward's own call
counted it. Told apart from a call a backward hook makes, only while a backward runs (a graph task
is under way): the non-reentrant kind recomputes under its own saved-tensor hooks (the top ones are
``torch.utils.checkpoint``'s ``_recomputation_hook``'s), the reentrant kind (torch's, Megatron's
``CheckpointFunction``) inside the ``backward`` of a Function whose context holds the
``run_function`` it runs again (a frame of the stack; nested checkpoints too), and Megatron's
``CheckpointWithoutOutput`` in its ``_recompute`` hook. A reentrant checkpoint's ``backward`` also runs
the backward of the graph it remade (``torch.autograd.backward`` inside it): a hook that backward
calls has autograd's entry below it on the stack before the checkpoint's ``backward``, and counts
(the first forward ran without grad, so that is the hooks' only call). A forward's own call
(no backward under way) costs one C call. Megatron's reentrant recompute runs the first forward without
grad: that one is counted, the one inside backward left out. Said once per Monitor."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

__all__ = ["recomputing"]

logger = logging.getLogger("distmetrics")

_RERUNS = {"backward": "ctx", "_recompute": "self"}
"""Functions that run a forward again, by name, and the local holding its ``run_function``: a reentrant
checkpoint's ``backward``, Megatron's ``CheckpointWithoutOutput._recompute`` (a gradient hook)."""


def recomputing(monitor: Any) -> bool:
    """Whether this call comes from a forward recomputed inside backward (left out, said once)."""
    if torch._C._current_graph_task_id() == -1:
        return False
    if not (_under_recomputation_hooks() or _in_reentrant_backward()):
        return False
    if not getattr(monitor, "_said_recompute", False):
        monitor._said_recompute = True
        logger.warning("distmetrics: a monitor.record, record_losses or record_moe call came from a forward that "
                       "activation checkpointing runs again inside backward: left out, as every such call is (the "
                       "forward's own call counted it). Said once")
    return True


def _under_recomputation_hooks() -> bool:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return bool(hooks) and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook.")


_ENGINE = frozenset(f.__code__ for f in (torch.autograd.backward, torch.autograd.grad,
                                          *filter(None, [getattr(torch.autograd.graph, "_engine_run_backward", None)])))
"""Autograd's entries: a backward hook runs above one, a recomputed forward above a checkpoint's ``backward``."""


def _in_reentrant_backward() -> bool:
    frame = sys._getframe(2)
    while frame is not None:  # the whole stack: a record made 100 modules deep in a checkpointed block
        code = frame.f_code
        if code in _ENGINE:  # a hook of a backward (a checkpoint's own included), not a forward run again
            return False
        name = code.co_name
        if name in _RERUNS and hasattr(frame.f_locals.get(_RERUNS[name]), "run_function"):
            return True
        frame = frame.f_back
    return False
