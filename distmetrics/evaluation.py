"""Evaluation records: the eval loss (token-weighted across ranks), perplexity, the gap to the
training loss since the last evaluation, eval throughput and loss by category.

Eval tokens are counted like training tokens: once per data-parallel replica
(:func:`distmetrics.parallel.counts_batch_tokens`), so tensor-, context- and pipeline-parallel
peers that see the same batch do not multiply ``eval/tokens_per_sec``."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Optional, Union

import torch

from .collectors.losses import CategoryLosses
from .collectors.loss_checks import MixedWeights, StageLoss, loss_weight, loss_weights
from .interval import as_number
from .names import NameRegistry, check_count, check_spellings, check_step, check_user_value, local_value
from .parallel import counts_batch_tokens
from .reduce import Reducer, Sample

__all__ = ["EvalLog"]

Number = Union[int, float, torch.Tensor]
_TOKENS = "_eval/tokens"
_LOSS_WEIGHTS = "_eval/loss_weights"  # minmax: what each rank weighted its loss by (steps.LOSS_WEIGHTS)
_LOSS_TOKENS = "_eval/loss_tokens"  # sum: the loss_tokens that weigh eval/loss (where some rank gives them)
_LEAST = {"tokens": "_eval/least_tokens", "time_ms": "_eval/least_time_ms",  # min: a bad tensor on any rank
          "loss_tokens": "_eval/least_loss_tokens"}
logger = logging.getLogger("distmetrics")


class EvalLog:
    """Reduces evaluation results on demand (its own reducer: eval names never disturb the train
    layout) and remembers the training loss since the last evaluation."""

    writes = ("eval/loss", "eval/ppl", "eval/gap", "eval/tokens_per_sec", "eval/time_ms", "eval/time_ms/max_rank",
              "eval/loss/")
    """The names an eval record holds besides the user's own (``eval/loss/<category>`` under the prefix)."""

    def __init__(self, group: Any, guard: Any = None, layout: Any = None, world: Optional[int] = None,
                 records: Any = None) -> None:
        self.reducer = Reducer(group, guard=guard, call="monitor.log_eval", world=world,
                               records="eval records (monitor.log_eval)")
        self._records = records if records is not None else contextlib.nullcontext()
        """The Monitor's lock of its record calls: held while the eval categories are taken, not
        through the collective (a thread of the user's may wait on a rank that waits on it)."""
        self.counts_tokens = layout is None or counts_batch_tokens(layout)
        self.stage_loss = StageLoss(layout, "monitor.log_eval")
        self.categories = CategoryLosses("eval/loss")
        self.names = NameRegistry()
        self.use_names(self.names)
        self._train_losses = _TrainLosses()  # the train records' losses since the last evaluation
        self._gap_said = False
        self.says = layout is None or layout.says_once  # warnings once per job: the first of its ranks
        self._mixed = MixedWeights(_LOSS_WEIGHTS, "eval/loss", self.says, follows=" (with eval/ppl and eval/gap)")
        self.refused: Optional[ValueError] = None  # tokens or time_ms found bad: raised after the record

    def use_names(self, names: NameRegistry) -> None:
        """Check eval names against ``names`` (the Monitor shares one registry between
        ``monitor.step``, ``monitor.record`` and ``log_eval``: a name is one tag in every sink)."""
        names.reserve(["eval/loss"], "monitor.log_eval(loss=...)")
        # time_ms= is log_eval's own, as loss= is: a monitor.record of its names is refused at the call (claimed
        # by a record first, the next log_eval(time_ms=...) would raise and its record go unwritten)
        names.reserve(["eval/time_ms", "eval/time_ms/max_rank"], "monitor.log_eval(time_ms=...)")
        names.reserve(self.writes, "monitor.log_eval")
        self.names = names

    def _refuse_bad_counts(self, metrics: dict[str, Any], step: int) -> None:
        """Tokens, loss_tokens or time_ms given as tensors are not read at the call (a device sync):
        NaN, inf or a negative count on some rank shows here, in the least any rank gave and in the
        sum or max. What they weigh or divide is left out of the record, which is written, and
        :attr:`refused` is raised after it (on every rank: every rank sees the same values)."""
        bad, unwritten = [], []
        loss = ("eval/loss", "eval/ppl", "eval/gap")
        # what this call writes that a bad count drops: the loss where some rank gave one (weighed by 0 tokens
        # in all, eval/loss is absent already), the time where given, and tokens/s where both came
        given = set(loss) if any(key.startswith(_LOSS_WEIGHTS) for key in metrics) else set()
        if "eval/time_ms" in metrics:
            given |= {"eval/time_ms", "eval/tokens_per_sec"} if _TOKENS in metrics else {"eval/time_ms"}
        for key, total_key, drop, written in (
                ("tokens", _TOKENS, ("eval/loss", _TOKENS), loss + ("eval/tokens_per_sec",)),
                ("loss_tokens", _LOSS_TOKENS, ("eval/loss",), loss),
                ("time_ms", "eval/time_ms", ("eval/time_ms", "eval/time_ms/max_rank"),
                 ("eval/time_ms", "eval/tokens_per_sec"))):
            least, total = metrics.get(_LEAST[key]), metrics.get(total_key)
            if any(v is not None and not (v >= 0 and math.isfinite(v)) for v in (least, total)):
                summed = "the slowest rank's" if key == "time_ms" else "summed over ranks"
                bad.append(f"{key}: {summed} {total!r}, the least a rank gave {least!r}")
                unwritten += [name for name in written if name in given and name not in unwritten]
                for name in drop:
                    metrics.pop(name, None)
        if bad and self.refused is None:
            self.refused = ValueError(
                f"monitor.log_eval(step={step}): {'; '.join(bad)}: a tensor given held NaN, inf or a negative value on "
                "some rank; accepted values are finite numbers >= 0. The eval record was written "
                + (f"without what they weigh or divide ({', '.join(unwritten)})" if unwritten else
                   "whole (they weigh or divide nothing it holds)"))

    def note_train_loss(self, loss: Any, weight: Optional[float], by: Optional[int] = None) -> None:
        """A train record's loss and the weight it is the mean over (Σ tokens, or steps, of the
        rank-steps whose loss counted: a skipped step's did not), for ``eval/gap``; ``by``: which
        of the two (:func:`~distmetrics.collectors.loss_checks.loss_weights`)."""
        if isinstance(loss, float) and weight:
            self._train_losses.add(loss, weight, by)

    def log(self, step: int, loss: Optional[Number], tokens: Optional[Number],
            scalars: dict[str, Number], loss_tokens: Optional[Number] = None) -> dict[str, Any]:
        """Reduce one evaluation (every rank) and return the ``eval`` record's metrics; ``loss`` is
        weighted by :func:`~distmetrics.collectors.loss_checks.loss_weight`. Arguments are checked before
        anything is reduced: a refused call changes nothing."""
        check_step(step, "monitor.log_eval")
        for what, value in (("loss", loss), ("tokens", tokens), ("loss_tokens", loss_tokens), *scalars.items()):
            if value is not None:
                check_user_value(value, "monitor.log_eval(%s=...)", what)
        # time_ms= and its written name alike: one check, as the count it is (eval/tokens_per_sec divides by it)
        time_key = next((key for key in ("time_ms", "eval/time_ms") if scalars.get(key) is not None), None)
        time_ms = None if time_key is None else scalars[time_key]
        counts = (("tokens", tokens), ("loss_tokens", loss_tokens), (time_key, time_ms))
        for what, value in counts:
            if value is not None:
                check_count(value, "monitor.log_eval(%s=...)", what)
        check_spellings(scalars, "eval", "monitor.log_eval")  # before the eval categories are taken below
        loss, tokens, loss_tokens = local_value(loss), local_value(tokens), local_value(loss_tokens)
        scalars = {k: local_value(v) for k, v in scalars.items()}
        time_ms = local_value(time_ms)
        names = {key: key if "/" in key else f"eval/{key}" for key in scalars}
        kinds = {key: "max" if name == "eval/time_ms" else "mean" for key, name in names.items()}  # wall time:
        for key, name in names.items():  # its slowest rank's, as training's step time (others wait for it)
            if name != "eval/time_ms":  # reserved for this call in use_names
                self.names.claim(name, kinds[key], f"monitor.log_eval({key}=...)", record="eval")
        samples = []
        if loss is not None and not self.stage_loss.drops(loss):
            weight = loss_weight(tokens, loss_tokens)
            samples.append(Sample("eval/loss", as_number(loss), "mean",
                                  weight=1.0 if weight is None else as_number(weight)))
            samples.append(Sample(_LOSS_WEIGHTS, loss_weights(weight), "minmax"))
            if loss_tokens is not None:  # checked as tokens are: in their sum and in the least a rank gave
                samples += [Sample(_LOSS_TOKENS, as_number(loss_tokens), "sum"),
                            Sample(_LEAST["loss_tokens"], as_number(loss_tokens), "min")]
        if tokens is not None and self.counts_tokens:
            samples.append(Sample(_TOKENS, as_number(tokens), "sum"))
        samples += [Sample(names[key], as_number(value), kinds[key]) for key, value in scalars.items()
                    if value is not None]
        samples += [Sample(_LEAST[key], as_number(value), "min") for key, value in (("tokens", tokens),
                    ("time_ms", time_ms)) if value is not None]
        with self._records:  # no record_losses(split="eval") lands in them while they are taken
            samples += self.categories.take_samples()
        metrics = self.reducer.reduce(samples, tag=step).to_metrics()
        self.refused, self.reducer.refused = self.reducer.refused, None  # a name whose kind differs between ranks
        self._mixed.check_weightless(metrics, step)  # before a refusal takes eval/loss out
        self._refuse_bad_counts(metrics, step)
        bad_weights = self.categories.refuse_bad_weights(metrics, f"for monitor.log_eval(step={step})")
        self.refused = self.refused or bad_weights
        self._mixed.check(metrics, step)  # eval/ppl and eval/gap go with eval/loss
        if metrics.get(_TOKENS) is not None and metrics.get("eval/time_ms"):  # 0 tokens: 0.0, as in training
            metrics["eval/tokens_per_sec"] = metrics[_TOKENS] / (metrics["eval/time_ms"] / 1000.0)
        metrics = {k: v for k, v in sorted(metrics.items()) if not k.startswith("_")}
        eval_loss = metrics.get("eval/loss")
        if isinstance(eval_loss, float):
            try:  # a NaN loss stays NaN
                metrics["eval/ppl"] = math.exp(eval_loss)
            except OverflowError:  # a loss above about 709.78
                metrics["eval/ppl"] = math.inf
            total_w = self._train_losses.weight
            if len(self._train_losses.by) > 1:  # tokens in some records, steps in others
                if not self._gap_said and self.says:
                    self._gap_said = True
                    logger.warning("distmetrics: eval/gap is left out of the eval record of step %d, and of every "
                                   "one where this recurs: the train records since the last evaluation weighted "
                                   "their losses by tokens in some and by steps (tokens=None) in others, so they "
                                   "have no common mean. Pass tokens with every loss, or with none.", step)
            elif total_w > 0:
                train_mean = self._train_losses.weighted / total_w
                metrics["eval/gap"] = eval_loss - train_mean
        self._train_losses = _TrainLosses()
        return metrics


class _TrainLosses:
    """The train records' losses since the last evaluation as sums, added in record order (the
    mean is the one a list of them gave, to the bit), in constant memory: a job that never
    evaluates kept a tuple per log step."""

    def __init__(self) -> None:
        self.weighted = 0.0
        """Σ loss × weight."""
        self.weight = 0.0
        """Σ weight."""
        self.by: set = set()
        """What the weights count (tokens, steps) in the records."""

    def add(self, loss: float, weight: float, by: Optional[int]) -> None:
        self.weighted += loss * weight
        self.weight += weight
        self.by.add(by)
