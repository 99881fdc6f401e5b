"""``monitor.record`` means whose weights summed to 0 over every rank and step of an interval: the
reduction leaves a mean over no weight out of the record (it is not defined), and the metric went
missing without a word. Said once per name, from what the log step reads already: the samples this
rank sent and the reduction's weights, on the host (no collective, no sync)."""

from __future__ import annotations

import logging
from typing import Any

from .base import LogContext

__all__ = ["WeightlessMeans", "WeightlessSamples"]

logger = logging.getLogger("distmetrics")


class WeightlessMeans:
    """The names ``monitor.record`` has recorded as means on this rank, the samples of the interval the
    log step took, and the names said. Said by each rank that sent the name: which other ranks did is
    not known without one more collective (the cached layout keeps names no rank sends any more, at
    weight 0 as well)."""

    def __init__(self) -> None:
        self.means: set = set()
        """Every name ``monitor.record`` recorded as a mean on this rank."""
        self.sent: list = []
        """This rank's samples of the interval the last log step took (values of ``monitor.record``,
        ``monitor.step``'s loss and scalars)."""
        self._said: set = set()

    def say(self, metrics: dict[str, Any], ctx: LogContext, refused: list) -> None:
        """Say each mean sent in the interval that the reduction left out for a total weight of 0 (not
        one ``refused`` for its weights); forget the interval's samples."""
        sent, self.sent = self.sent, []
        if not self.means or ctx.reduced is None or 0.0 not in ctx.reduced.sum_weights:
            return
        for sample in sent:
            name = sample.name
            if name in metrics or sample.reduce != "mean" or name not in self.means or name in self._said \
                    or name in refused or ctx.reduced.weight(name) != 0.0:
                continue
            self._said.add(name)
            logger.warning("distmetrics: monitor.record(%r) is left out of the record of step %d, and of every "
                           "record where this recurs: its weights summed to 0 over every rank and step of the "
                           "interval, and a mean over no weight is not defined. Said once", name, ctx.step)


class WeightlessSamples:
    """The same for the user's collectors' ``mean`` samples (a vector's elements too): left out where their
    weights summed to 0 over every rank, said once per name by each rank that sent it, one line per collector
    and log step."""

    def __init__(self) -> None:
        self._said: set = set()

    def say(self, samples: list, metrics: dict[str, Any], reduced: Any, step: int, failed: tuple = ()) -> None:
        """``failed``: collectors whose values are out of this record (bad weights, a take_samples that
        raised): their means are no weightless ones, and a later real one is still said."""
        if reduced is None or 0.0 not in reduced.sum_weights:
            return
        fresh: dict[str, list] = {}
        for sample in samples:
            # the user's collectors' samples carry their writer
            if not sample.writer or sample.reduce != "mean" or sample.writer in failed:
                continue
            for name in sample.names or (sample.name,):
                if name in metrics or name in self._said or reduced.weight(name) != 0.0:
                    continue
                self._said.add(name)
                fresh.setdefault(sample.writer, []).append(name)
        for writer, names in fresh.items():
            shown = ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            logger.warning("distmetrics: the %r collector's mean %s left out of the record of step %d, and of every "
                           "record where this recurs: the weights of each summed to 0 over every rank, and a mean "
                           "over no weight is not defined. Said once per name", writer,
                           f"{shown} is" if len(names) == 1 else f"values {shown} are", step)
