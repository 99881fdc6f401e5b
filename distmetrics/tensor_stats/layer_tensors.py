"""What a hooked layer's tensors are, read the same way however the layer is called or wrapped,
and why one cannot be read where that happens.

* ``input``: the first tensor among the call's arguments, positional or keyword
  (``fc1(input=x)`` passes no positional argument at all).
* ``activation`` and ``gradient``: the output, or the first item of a tuple or list output.
* ``weight``: the parameter the optimizer steps (:class:`OptimizerWeights`). FSDP2 registers an
  unsharded stand-in in the module from its all-gather until it reshards, so what the module
  holds at the hook depends on the wrapping: a layer that is its own unit, resharded after
  forward, holds the sharded parameter; one nested in a unit, in the root's, or under
  ``reshard_after_forward=False`` the stand-in, which under a ``MixedPrecisionPolicy`` is the
  compute copy (bf16), not the fp32 parameter. Norms read the sharded one (``param_norm``), and so
  do the statistics.

A tensor the YAML selects on a layer that cannot be read there (a dict output, a container with no
``weight``) is named once per (layer, tensor) with the reason (:class:`Unreadable`), not dropped
without a word.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch

from ..fsdp_state import STATES, sharded_params

__all__ = ["first_tensor_argument", "output_tensor", "OptimizerWeights", "Unreadable"]

logger = logging.getLogger("distmetrics")


def first_tensor_argument(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The first tensor among a call's positional arguments, then its keyword arguments in the
    order given; None where no argument is a tensor."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def output_tensor(output: Any) -> Optional[torch.Tensor]:
    """A module's output as the statistics read it: a tensor, or the first item of a tuple or list
    (a layer that also returns its bias or attention weights); None for anything else."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def output_kind(output: Any) -> str:
    """What a module returned, in words, for a warning (``a dict``, ``a tuple whose first item is a NoneType``)."""
    if isinstance(output, (tuple, list)):
        if not output:
            return f"an empty {type(output).__name__}"
        return f"a {type(output).__name__} whose first item is a {type(output[0]).__name__}"
    return f"a {type(output).__name__}"


class OptimizerWeights:
    """A layer's weight → the parameter the optimizer steps: FSDP2's sharded parameter behind the
    unsharded stand-in the module holds for now (see the module docstring), else the weight itself.

    Each weight is looked up once (:func:`~distmetrics.fsdp_state.sharded_params` walks the model's
    modules) and remembered while it lives: FSDP2 keeps one unsharded stand-in per parameter across
    steps; a stand-in made per forward (``reshard_after_forward`` an int) is looked up again."""

    def __init__(self) -> None:
        self.models: list = []
        self._known: dict[int, tuple] = {}  # id(weight) -> (weak reference to it, its sharded parameter or None)
        self._prune_at = 64

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        known = self._known.get(id(weight))
        if known is not None and known[0]() is weight:
            return weight if known[1] is None else known[1]
        if not STATES:  # no module of the process is FSDP2's
            return weight
        sharded = None
        for model in self.models:
            sharded = sharded_params(model).get(id(weight))
            if sharded is not None:
                break
        if len(self._known) >= self._prune_at:  # forget weights gone (stand-ins made per forward)
            self._known = {key: value for key, value in self._known.items() if value[0]() is not None}
            self._prune_at = 2 * len(self._known) + 64
        self._known[id(weight)] = (weakref.ref(weight), sharded)
        return weight if sharded is None else sharded


class Unreadable:
    """Names once per (layer, tensor) a selected tensor a layer's hook cannot read, and why; said
    where ``says`` is true (data-, tensor- and context-parallel rank 0 of each pipeline stage: the
    layers differ between stages, not between replicas or their peers)."""

    def __init__(self) -> None:
        self.said: set = set()
        self.says = True

    def __call__(self, layer: str, tensor: str, why: str) -> None:
        if (layer, tensor) in self.said:
            return
        self.said.add((layer, tensor))
        if self.says:
            logger.warning("distmetrics: tensor_inspect.features selects tensor %r on layer %r, which has none to "
                           "measure: %s; its %s statistics are not written", tensor, layer, why, tensor)
