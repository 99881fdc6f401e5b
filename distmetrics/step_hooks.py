"""Hooks around optimizers' ``step()``, for update norms: which optimizer's step runs them, and
when a step of the loop's starts and ends however many optimizers, nested or one after another,
step in it.

torch runs step hooks from the wrapper that ``torch.optim.Optimizer.__init__`` puts on the class's
``step``; an optimizer wrapper that subclasses ``Optimizer`` without calling it (Hugging Face
Accelerate's ``AcceleratedOptimizer``, which keeps the real one in ``.optimizer``) has hook
dictionaries that nothing reads, or none at all. So the hooks go on the first optimizer down the
``.optimizer`` chain whose step runs them, and anything else is refused, naming what was given.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .eager import eager

__all__ = ["StepHooks", "hooked_optimizer"]


def hooked_optimizer(optimizer: Any, call: str) -> torch.optim.Optimizer:
    """``optimizer``, or the first optimizer down its ``.optimizer`` chain (or the one a wrapper hands
    ``register_step_pre_hook`` on to), whose ``step()`` runs step hooks; a ``TypeError`` naming
    ``call`` and what was given otherwise (no collective: the Monitor checks before its first one, and
    every rank passes the same kind of optimizer)."""
    current, seen = optimizer, set()
    while current is not None and id(current) not in seen:
        if _runs_hooks(current):
            return current
        seen.add(id(current))
        # a wrapper that hands its attributes on (__getattr__) to the optimizer it holds: the hook method's owner
        owner = getattr(getattr(current, "register_step_pre_hook", None), "__self__", None)
        if owner is not None and owner is not current and _runs_hooks(owner):
            return owner
        current = getattr(current, "optimizer", None)
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    raise TypeError(f"{call}: got a {kind}, which is no torch.optim.Optimizer whose step() runs step hooks and holds "
                    "none in .optimizer; update norms are measured by hooks on that step. Accepted: a torch.optim."
                    "Optimizer (made with its __init__), a wrapper that keeps one in .optimizer (Accelerate's "
                    "AcceleratedOptimizer), or a Megatron-Core optimizer; or set log_update_norm=False")


def _runs_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` runs its step hooks: ``Optimizer.__init__`` made its hook
    dictionaries and wrapped its class's ``step`` (``hooked``) to run them."""
    return isinstance(optimizer, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(optimizer) \
        and bool(getattr(type(optimizer).step, "hooked", False))


class StepHooks:
    """Calls ``before()`` when an optimizer step starts with none under way, and ``after()`` when
    the outermost one ends (a wrapper stepping an inner optimizer, both attached, is one step).
    A step that raised (an out-of-memory retry: no post-hook runs) is forgotten when its optimizer
    steps again or at :meth:`end_step`, so later steps are measured."""

    def __init__(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        self._before, self._after = before, after
        self._in_flight: list[int] = []  # ids of the optimizers whose step is under way, outermost first
        self._handles: list = []
        self._attached: "weakref.WeakSet" = weakref.WeakSet()  # the optimizers hooked (not by id: a new one
        # may take a freed one's address)
        self._steps: dict[int, int] = {}  # optimizer id -> its steps ended since the last monitor.step

    @property
    def attached(self) -> bool:
        """Whether some optimizer is attached."""
        return bool(self._handles)

    @property
    def in_flight(self) -> bool:
        """Whether an attached optimizer's step is under way (a measurement now is one inside it: LBFGS's
        closure, after some of the step's update)."""
        return bool(self._in_flight)

    @property
    def count(self) -> int:
        """How many optimizers are attached."""
        return len(self._handles) // 2

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer``'s step (see :func:`hooked_optimizer`)."""
        # run eagerly where torch.compile compiles optimizer.step() (torch's compiled-optimizer recipe):
        # traced, they split its one graph into 7 or more
        if optimizer in self._attached:  # given twice (Monitor(optimizer=...), then attached): one step each
            return
        self._attached.add(optimizer)
        self._handles += [optimizer.register_step_pre_hook(eager(self._pre)),
                          optimizer.register_step_post_hook(eager(self._post))]

    def end_step(self) -> tuple[bool, bool]:
        """``monitor.step``: whether some optimizer step ended since the last call, and whether one
        optimizer's did more than once; a step still under way raised."""
        steps, self._steps = self._steps, {}
        self._in_flight.clear()
        return bool(steps), any(n > 1 for n in steps.values())

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._attached = [], weakref.WeakSet()

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._in_flight:  # its last step raised: that step, and any inside it, are over
            del self._in_flight[self._in_flight.index(id(optimizer)):]
        if not self._in_flight:
            self._before()
        self._in_flight.append(id(optimizer))

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if id(optimizer) not in self._in_flight:  # its step already ended here: the outer run of hooks torch
            return  # runs twice (a subclass's step() calling super().step(), both hooked)
        # an inner step that raised and was caught inside it ends with it
        del self._in_flight[self._in_flight.index(id(optimizer)):]
        if not self._in_flight:
            self._steps[id(optimizer)] = self._steps.get(id(optimizer), 0) + 1
            self._after()
