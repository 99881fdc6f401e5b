"""Megatron-Core's timer reports — ``get_all_timers_string``, ``log``, ``write`` — with Megatron's
output for the same timings, and one float32 gather per call.

Every rank's times of the asked-for timers travel as one ``[world, n]`` float32 table (Megatron's
layout; values ≤ 0 — a timer that is missing or measured nothing — are left out of every
report). Megatron requires every rank to ask for the same names (or it hangs); here the names
are agreed across ranks once (one ``all_gather_object``) and cached, and a flag lane in the
table tells every rank in the same gather when some rank's names changed, so all renegotiate
together. Every rank's report holds the union of the names asked for this time: its own, in its
order, then those only other ranks asked for. In steady state a report costs one
``all_gather_into_tensor``.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..megatron_text import time_block
from ..packing import collective_device, gather_single

__all__ = ["MegatronReports", "TimerError"]

logger = logging.getLogger("distmetrics.timers")
_warned_writers: set = set()


class TimerError(RuntimeError, AssertionError):
    """Timer misuse; an ``AssertionError`` as Megatron's asserts are, so code that catches
    Megatron's errors catches ours, and a ``RuntimeError``."""


class MegatronReports:
    """Megatron's reporting methods, mixed into :class:`~distmetrics.collectors.timers.Timers`."""

    _timers: dict
    _log_option: str
    _group: Any  # the ranks a report gathers over (the Monitor's group; None: the world)

    def __init__(self) -> None:
        self._agreed: Optional[list[str]] = None  # the union of names the ranks asked for
        self.guard: Any = None  # a CollectiveGuard, set by the Monitor

    def get_all_timers_string(self, names: Optional[list] = None, normalizer: float = 1.0, reset: bool = True,
                              barrier: bool = False) -> Optional[str]:
        """Megatron's text block (milliseconds), or None when no timer has a time to report: of
        ``names`` and the names other ranks asked for (the union; see :meth:`_elapsed_of_union`).
        A collective: every rank calls it."""
        names, normalizer = self._names_of(names, normalizer)
        if self._log_option in ("max", "minmax"):
            return self._get_global_min_max_time_string(names, reset, barrier, normalizer / 1000.0,
                                                        self._log_option == "max")
        return self._get_all_ranks_time_string(names, reset, barrier, normalizer / 1000.0)

    def _names_of(self, names: Optional[list], normalizer: Any) -> tuple[list[str], float]:
        """The timer names a report is of and the normalizer as a float; a text name or a normalizer
        that is no number > 0 refused (before any collective)."""
        number = isinstance(normalizer, numbers.Real) or isinstance(normalizer, torch.Tensor) and \
            normalizer.numel() == 1 and not normalizer.is_complex()  # a 0-d tensor, as Megatron's assert takes
        if isinstance(normalizer, bool) or not number or not normalizer > 0.0:
            raise TimerError(f"normalizer={normalizer!r}: accepted values are numbers > 0")
        if isinstance(names, str):  # list("fwd") would be three names
            raise TimerError(f"names={names!r}: accepted values are a list of timer names, e.g. [{names!r}], or None")
        # a tensor of one element (shape () or [1]) read once: a [1] one left the text unformattable after the
        # timers were read and reset
        return list(self._timers) if names is None else list(names), float(normalizer)

    def log(self, names: Optional[list] = None, rank: Optional[int] = None, normalizer: float = 1.0,
            reset: bool = True, barrier: bool = False) -> None:
        """The text block through ``logging`` (logger ``distmetrics.timers``, INFO) on ``rank``
        (a global rank; default: the last of the timers' ranks, as Megatron); nothing when there is
        nothing to report. It holds every name some rank asked for, not only ``rank``'s."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        ranks, me = _ranks(self._group)
        if (ranks[-1] if rank is None else rank) == me and text is not None:
            logger.info(text)

    def write(self, names: Optional[list], writer: Any, iteration: int, normalizer: float = 1.0,
              reset: bool = True, barrier: bool = False) -> None:
        """Each timer's slowest rank's **seconds** / ``normalizer`` as ``<name>-time`` at
        ``iteration`` (of the names some rank asked for): ``writer.add_scalar`` for a TensorBoard
        writer, ``writer.log`` for the ``wandb`` module (or a W&B run), as Megatron's. A collective:
        every rank calls it."""
        names, normalizer = self._names_of(names, normalizer)
        times = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, slowest) in times.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", slowest, iteration)
            elif hasattr(writer, "log"):
                writer.log({name + "-time": slowest}, iteration)
            elif type(writer) not in _warned_writers:
                _warned_writers.add(type(writer))
                logger.warning("distmetrics: timers.write got a %s, which has neither add_scalar (TensorBoard) nor "
                               "log (W&B); timer values were not written", type(writer).__name__)

    # --- Megatron's helpers (some Megatron-LM code calls them) -----------------------------------
    def _get_elapsed_time_all_ranks(self, names: list, reset: bool, barrier: bool) -> Optional[torch.Tensor]:
        """``[world, len(names)]`` float32 seconds of every rank of the timers' group (0 where a rank
        has no time)."""
        table = self._elapsed_of_union(names, reset, barrier)[1]
        return None if table is None else table[:, :len(names)]

    def _elapsed_of_union(self, names: list, reset: bool, barrier: bool) -> tuple[list, Optional[torch.Tensor]]:
        """The names some rank asked for — ``names``, then those only other ranks asked for — and
        their ``[world, n]`` float32 seconds: what every rank's report holds, so the text ``log``
        prints on one rank has a name asked for on another (it is read, and reset, everywhere)."""
        world, _ = _world(self._group)
        names = list(names)
        if len(names) == 0 and world == 1:  # a rank asking for none still joins the gather
            return names, None
        if world > 1 and self.guard is not None:  # before the barrier: a rank that does not come is named
            self.guard.enter("timers report (log, write or get_all_timers_string)")
        if barrier and world > 1:
            dist.barrier(group=self._group)
        seconds = {}
        for name in names:
            timer = self._timers.get(name)
            if timer is not None and name not in seconds:  # a name listed again: read once, below
                seconds[name] = timer.elapsed(reset=reset)
        table, others = self._gather(names, seconds, reset)
        column = {name: i for i, name in enumerate(self._agreed or names)}
        picked = table[:, [column[name] for name in names + others]]
        if reset:  # as Megatron reads a name listed again: after the reset of its first reading, 0
            for i in [i for i, name in enumerate(names) if name in names[:i]]:
                picked[:, i] = 0.0
        return names + others, picked

    def _get_global_min_max_time(self, names: list, reset: bool, barrier: bool,
                                 normalizer: float) -> dict[str, tuple[float, float]]:
        """Each name's (fastest, slowest) rank's seconds / ``normalizer``, for the union of the
        names the ranks asked for (see :meth:`_elapsed_of_union`)."""
        names, table = self._elapsed_of_union(names, reset, barrier)
        out: dict[str, tuple[float, float]] = {}
        if table is None:
            return out
        for i, name in enumerate(names):
            column = table[:, i]
            column = column[column > 0.0]
            if column.numel() > 0:
                out[name] = (column.min().item() / normalizer, column.max().item() / normalizer)
        return out

    def _get_global_min_max_time_string(self, names: list, reset: bool, barrier: bool, normalizer: float,
                                        max_only: bool) -> Optional[str]:
        return time_block(self._get_global_min_max_time(names, reset, barrier, normalizer), max_only) or None

    def _get_all_ranks_time_string(self, names: list, reset: bool, barrier: bool,
                                   normalizer: float) -> Optional[str]:
        names, table = self._elapsed_of_union(names, reset, barrier)
        if table is None:
            return None
        text, reported = "times across ranks (ms):", False
        ranks = _ranks(self._group)[0]  # a row's global rank
        for i, name in enumerate(names):
            first = True
            for rank in range(table.shape[0]):
                if table[rank, i] > 0:
                    reported = True
                    if first:
                        first = False
                        text += f"\n  {name}:"
                    text += "\n     rank {:2d}: {:.2f}".format(ranks[rank], table[rank, i] / normalizer)
        return text if reported else None

    # --- the gather ----------------------------------------------------------------------------
    def _gather(self, names: list, seconds: dict[str, float], reset: bool) -> tuple[torch.Tensor, list]:
        """One all-gather of a float32 row: a "my names changed" flag, which of the agreed names
        this rank asked for, then their seconds; renegotiates (every rank, told by the same
        gather) when a flag is up. A timer this rank has but did not ask for, which another rank
        asked for (the union), is sent too, and reset (``reset``) as its report reads it. Returns
        the agreed names' seconds and the names only other ranks asked for, in agreed order."""
        world, _ = _world(self._group)
        if world == 1:
            self._agreed = list(names)
            return torch.tensor([[float(seconds.get(n, 0.0)) for n in names]], dtype=torch.float32), []
        if self._agreed is None:
            self._negotiate(names)
        asked = set(names)
        while True:
            agreed = self._agreed
            flag = 0.0 if asked <= set(agreed) else 1.0
            mine = [float(n in asked) for n in agreed]
            peeked = {n: self._peek(n) for n in agreed if n not in seconds}
            values = [float(seconds[n] if n in seconds else peeked[n]) for n in agreed]
            table = _all_gather_rows(torch.tensor([flag] + mine + values, dtype=torch.float32), world, self._group)
            if not bool((table[:, 0] > 0).any()):
                break
            self._negotiate(names)
        wanted = (table[:, 1:1 + len(agreed)].amax(0) > 0).tolist()
        others = [n for i, n in enumerate(agreed) if wanted[i] and n not in asked]
        if reset:  # reset as read: the time a running one ran since (the gather's wait too) goes to the next report
            for name in others:
                if name in self._timers:
                    timer = self._timers[name]
                    timer.set_elapsed(timer.elapsed(reset=True) - peeked[name])
        return table[:, 1 + len(agreed):], others

    def _peek(self, name: str) -> float:
        """The seconds of a timer this rank did not ask for (0 where it has none), not reset."""
        timer = self._timers.get(name)
        return timer.elapsed(reset=False) if timer is not None else 0.0

    def _negotiate(self, names: list) -> None:
        rows: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(rows, list(names), group=self._group)
        self._agreed = list(dict.fromkeys(name for row in rows for name in row))


def _world(group: Any) -> tuple[int, int]:
    """The size of ``group`` (None: the world) and this rank's global rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank()
    return 1, 0


def _ranks(group: Any) -> tuple[list[int], int]:
    """The global ranks of ``group`` (None: the world) in its order, and this rank's global rank."""
    world, me = _world(group)
    return (list(range(world)) if group is None or world == 1 else dist.get_process_group_ranks(group)), me


def _all_gather_rows(row: torch.Tensor, world: int, group: Any = None) -> torch.Tensor:
    device = collective_device(group)
    row = row.to(device)
    out = torch.empty(world * row.numel(), dtype=row.dtype, device=device)
    gather_single()(out, row, group=group)
    return out.view(world, row.numel()).cpu()
