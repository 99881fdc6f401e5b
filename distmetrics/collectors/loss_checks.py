"""Checks on what a record's loss and learning rate were made of, shared by training
(:mod:`~distmetrics.collectors.steps`) and evaluation (:mod:`distmetrics.evaluation`): losses weighted
by tokens on some ranks or steps and by steps on others, losses over no tokens, a pipeline stage's
placeholder loss, ranks whose learning rates differ or whose writer rank gives none. Each reads
lanes the log step reduces anyway and says what it finds once."""

from __future__ import annotations

import logging
from typing import Any, Optional

__all__ = ["loss_weights", "loss_weight", "MixedWeights", "StageLoss", "LearningRates"]

logger = logging.getLogger("distmetrics")
_BY_TOKENS, _BY_STEPS = 1, 2


def loss_weights(tokens: Any) -> int:
    """What a loss given with ``tokens`` is weighted by (a bit of the steps' ``LOSS_WEIGHTS`` lane)."""
    return _BY_STEPS if tokens is None else _BY_TOKENS


def loss_weight(tokens: Any, loss_tokens: Any) -> Any:
    """The tokens a rank's loss is a mean over: ``loss_tokens`` where given, else ``tokens`` (None: by
    steps). Under context parallelism each rank's loss is a mean over its slice of the sequences, while
    ``tokens`` is the whole sequences' (the throughput's count): slices of unequal valid tokens weighed
    alike would give a mean that is not the batch's."""
    return tokens if loss_tokens is None else loss_tokens


class MixedWeights:
    """A reduced ``minmax`` lane (the OR of :func:`loss_weights` over each rank's losses) taken
    out of a record: where ranks weighted their losses by tokens at some steps and by steps
    (``tokens=None``) at others, the loss (``loss``) is left out of it, with one warning from
    the rank that ``says`` (the first of the Monitor's ranks). Where every loss given weighed 0
    tokens, the reduction already left the loss out (a mean over no tokens): that is said once too.
    ``follows``: the names derived from the loss, said with it."""

    def __init__(self, lane: str, loss: str, says: bool, follows: str = "") -> None:
        self.lane, self.loss, self.says, self.follows = lane, loss, says, follows
        self.by: Optional[int] = None
        """What the last record's loss was weighted by (:func:`loss_weights`), or None (no loss, or mixed)."""
        self._said = False
        self._weightless_said = False

    def check_weightless(self, metrics: dict[str, Any], step: int) -> None:
        """Say once where losses were given but the loss is not in the reduced ``metrics``: its weights
        summed to 0 over every rank (and step), as a rank-step's ``tokens=0`` (``loss_tokens=0``) adds
        nothing, so the reduction has no mean to give. Called before anything else takes the loss out."""
        if self.loss in metrics or f"{self.lane}/max" not in metrics or self._weightless_said or not self.says:
            return
        self._weightless_said = True
        logger.warning("distmetrics: %s%s is left out of the record of step %d, and of every record where this "
                       "recurs: every loss in it was given with 0 tokens (loss_tokens where given) on every rank, "
                       "and a mean weighted by tokens over no tokens is not defined. Said once", self.loss,
                       self.follows, step)

    def check(self, metrics: dict[str, Any], step: int) -> None:
        high, high_rank, low, low_rank = (metrics.pop(f"{self.lane}/{end}", None)
                                          for end in ("max", "max_rank", "min", "min_rank"))
        self.by = high if high is not None and high == low != _BY_TOKENS | _BY_STEPS else None
        if high is None or self.by is not None:
            return
        metrics.pop(self.loss, None)  # the same on every rank: every rank leaves it out
        if self._said or not self.says:
            return
        self._said = True
        how = (f"rank {int(high_rank)} passed losses with tokens=None at some steps and with tokens at others"
               if high == _BY_TOKENS | _BY_STEPS else
               f"rank {int(high_rank)} passed its losses with tokens=None and rank {int(low_rank)} with tokens")
        logger.warning("distmetrics: %s is left out of the record of step %d, and of every record where this "
                       "recurs: %s; a mean weighted by tokens at some and by steps at others is neither. Pass "
                       "tokens with every loss, or with none.", self.loss, step, how)


class StageLoss:
    """Whether this rank's loss counts: under pipeline parallelism the last stage's alone (the model's
    loss is computed there; torchtitan passes a placeholder of -1 on the other stages, which a mean
    took in: 1.34 for 3.68), as tokens are counted there. A loss passed on another pipeline rank is
    left out, said once by the first rank of the first pipeline rank that does not hold the last stage
    (``Layout.is_last_stage``: the last pipeline rank, or the first under ``pipeline_style="v"``)."""

    def __init__(self, layout: Any, call: str) -> None:
        self.counts = layout is None or layout.pp_size <= 1 or layout.is_last_stage
        v = layout is not None and layout.pp_style == "v"
        self._says = layout is not None and layout.pp_rank == int(v) and not (
            layout.dp_rank or layout.tp_rank or layout.cp_rank)
        self._call = call
        self._pp = (0, 1, v) if layout is None else (layout.pp_rank, layout.pp_size, v)

    def drops(self, loss: Any) -> bool:
        """True where ``loss`` (not None) is passed on a stage whose loss does not count."""
        if self.counts or loss is None:
            return False
        if self._says:
            self._says = False
            rank, size, v = self._pp
            where = ("pipeline_style='v' puts on pipeline rank 0 ('loop': on the last)" if v else
                     f"pipeline_style='loop' puts on pipeline rank {size - 1} ('v': on rank 0, as ZBV and "
                     "DualPipeV schedules do)")
            logger.warning("distmetrics: %s(loss=...) on pipeline rank %d of %d is left out: the loss is the last "
                           "stage's, which %s; a placeholder, as torchtitan passes on the other stages, would be "
                           "averaged in: pass loss=None there. Said once", self._call, rank, size, where)
        return True


class LearningRates:
    """The ranks' learning rates, a reduced ``minmax`` lane taken out of a record. ``train/lr`` is
    the writer rank's own value (as Megatron and torchtitan log one rank's), so a job whose ranks
    follow different schedules, or whose writer rank passes no ``lr``, is said once by the rank that
    ``says``. The lane holds float32: learning rates alike to 7 digits look the same there."""

    def __init__(self, lane: str, writer: int, says: bool) -> None:
        self.lane, self.writer, self.says = lane, writer, says
        self._said: set = set()  # "differ", "missing": each said once

    def check(self, metrics: dict[str, Any], step: int) -> None:
        high, high_rank, low, low_rank = (metrics.pop(f"{self.lane}/{end}", None)
                                          for end in ("max", "max_rank", "min", "min_rank"))
        mean = metrics.pop(f"{self.lane}/mean", None)
        if high is None:
            return
        missing = "train/lr" not in metrics
        if missing:  # the writer rank gave none: the mean of the ranks that gave one (float64)
            metrics["train/lr"] = mean
            if self.says and "missing" not in self._said:
                self._said.add("missing")
                logger.warning("distmetrics: train/lr is the writer rank's (rank %d) learning rate, and that rank "
                               "passed no lr to monitor.step in the interval up to step %d while rank %d did: "
                               "train/lr is the mean of "
                               "the ranks that passed one, in every record where this recurs; pass lr on every rank",
                               self.writer, step, int(high_rank))
        if not self.says:
            return
        if high != high and "nan" not in self._said:  # NaN on some rank wins the max lane, with the lowest such rank
            self._said.add("nan")
            whose = "the mean of the ranks that passed one" if missing else \
                f"the writer rank's (rank {self.writer}) at that step"
            logger.warning("distmetrics: rank %d passed a learning rate of NaN in the interval up to step %d (of the "
                           "ranks that did, the lowest); train/lr is %s: %s. Said once", int(high_rank), step, whose,
                           metrics["train/lr"])
        elif high > low and not missing and "differ" not in self._said:
            self._said.add("differ")
            logger.warning("distmetrics: ranks passed different learning rates by step %d (each rank's last in the "
                           "interval): %.7g on rank %d and %.7g on rank %d; train/lr is the writer rank's (rank %d). "
                           "Said once: every rank's "
                           "optimizer is expected to follow one schedule", step, high, int(high_rank), low,
                           int(low_rank), self.writer)
