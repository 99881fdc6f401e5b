"""Records made in a forward that activation checkpointing runs again inside backward.

``torch.utils.checkpoint`` (both kinds), ``checkpoint_wrapper`` and Megatron's recompute run a block's
forward a second time during backward, with grad enabled, to remake what it saved: a
``monitor.record`` or ``record_moe`` in that forward (a router's aux loss) was counted twice (a
sum doubled; a mean weighing the checkpointed layers twice against the others). Backward itself runs
with grad disabled (but under ``create_graph=True``), so a call made while a backward runs with grad
enabled is a recomputation's, left out: the forward's own call counted it (Megatron's reentrant
recompute runs the first forward without grad: that one is counted, as no backward runs then).
Said once per Monitor. Two C calls per record."""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["recomputing"]

logger = logging.getLogger("distmetrics")


def recomputing(monitor: Any) -> bool:
    """Whether this call comes from a forward recomputed inside backward (left out, said once)."""
    if torch._C._current_graph_task_id() == -1 or not torch.is_grad_enabled():
        return False
    if not getattr(monitor, "_said_recompute", False):
        monitor._said_recompute = True
        logger.warning("distmetrics: a monitor.record, record_losses or record_moe call came from a forward that "
                       "activation checkpointing runs again inside backward: it is left out (the forward's own call "
                       "counted it), here and from now on. A call made in a backward run with create_graph=True "
                       "is taken for one too. Said once")
    return True
