"""What ``monitor.step`` and ``monitor.record`` are given: loss, tokens, learning rate, extra
scalars, a user's own values; and the interval's wall-time clock.

Between log steps values are only added into device tensors (:class:`IntervalStats`). Internal
lanes travel with them: the interval's wall time (``max`` across ranks: the job goes at its
slowest rank's pace; see :data:`LOG_SPAN_NS` for where it starts), its tokens (``sum``, counted once
per data-parallel replica) and the tokens of the step that started the clock;
:meth:`StepValues.to_context` moves them into :class:`LogContext` after the reduction.

The clock starts at the first ``monitor.step``, not when the Monitor is built: building it (and
W&B's start-up, the first step's compilation) is no step's time. The first interval therefore
measures one step fewer than it holds, and its throughput counts the tokens of those steps.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Union

import torch

from ..interval import IntervalClock, IntervalStats, as_number, kept, now
from ..names import (NameRegistry, check_count, check_spellings, check_step, check_user_value, local_value,
                     unfit_counts)
from ..parallel import counts_batch_tokens
from ..reduce import check_reduce
from .base import Alert, LogContext, Sample
from .loss_checks import LearningRates, MixedWeights, StageLoss, loss_weight, loss_weights
from .weightless import WeightlessMeans

__all__ = ["StepValues", "INTERVAL_NS", "LOG_SPAN_NS", "TOKENS", "UNTIMED_TOKENS", "LOSS_TOKENS"]

INTERVAL_NS = "_train/interval_ns"
"""Internal lane: the interval's wall time in ns on this rank, less :data:`LOG_SPAN_NS` (max across ranks, as the
int itself: a float32 max's 7 digits made 1234.567891 ms steps 1234.56787109375, and the throughput with it)."""
LOG_SPAN_NS = "_train/log_span_ns"
"""Internal lane: this rank's time from the taking of the last log step's samples to the end of its reduction
(min across ranks). Each rank's clock starts the next interval as it takes its samples, before the reduction,
where a rank that arrived first waits for the last: that wait, counted in its next interval, made the max of
the ranks' intervals exceed the job's wall time (a slow first step on one rank read as ten slow steps in the
next record). Less that span, the ranks' intervals all start at the reduction's end, which they leave
together; the least span is the last rank's, which did not wait: the log step's own time, added back. So
the interval is the wall time from the last rank's arrival at one log step to its arrival at the next, as
Megatron's ``interval-time`` runs from one barrier to the next, the log step included."""
TOKENS = "_train/tokens"
"""Internal lane: the interval's tokens (sum over the ranks that count them)."""
UNTIMED_TOKENS = "_train/untimed_tokens"
"""Internal lane: the tokens of the step that started the clock (sum), not in the timed span."""
LOSS_TOKENS = "_train/loss_tokens"
"""Internal lane: the ``loss_tokens`` that weighed the interval's counted losses (sum over ranks), made only
where some rank gives ``loss_tokens``: a tensor is not read at the call, so a bad one shows in this sum."""
LEAST = "_train/least/"
"""Internal lanes: ``LEAST + "tokens"`` and ``LEAST + "loss_tokens"``, the least count a tensor gave on this rank
in the interval (min, with the rank holding it), made only where tensors are given: a negative count that the
others outweigh does not show in the sum."""
TOKENLESS_STEPS = "_train/tokenless_steps"
"""Internal lane: the interval's timed steps at which this rank, which counts tokens, was given ``tokens=None``
(max, with the rank holding it; made only where there are some): their tokens are not known, and a throughput
that counts them as none reads too low."""
UNCOUNTED_TOKENS = "_train/uncounted_tokens"
"""Internal lane: 1 where this rank was given ``tokens`` in the interval but does not count them (a pipeline
rank without the last stage, a tensor- or context-parallel rank other than 0; max), made only there: tokens
given there alone, with none where they count, would leave the throughput out unsaid."""
LOSS_WEIGHTS = "_train/loss_weights"
"""Internal lane: what this rank weighted its losses by in the interval (minmax): 1 tokens, 2
steps (``tokens=None``), 3 both; a mean of losses weighted by either on different ranks (or
steps) is neither."""
LEARNING_RATES = "_train/lr"
"""Internal lanes: each rank's learning rate (minmax, float32), and their mean (``<lane>/mean``), with two
ranks or more: ``train/lr`` is the writer rank's, so ranks that differ, or a writer rank that gives none
(then ``train/lr`` is the mean), are said."""
STEP_LOSS = "_train/loss/step"
"""Internal lanes: ``STEP_LOSS + str(i)``, the loss of the interval's ``i``-th ``monitor.step`` (from 0) weighed as
``train/loss`` is, across ranks (a mean), made only where ``loss_average`` is ``steps`` or ``last``: one vector
sample of as many elements as the interval's steps, so the names stay those of the last interval of as many
steps. A step without a loss on this rank weighs 0 in it; one whose losses weighed 0 on every rank (or where
none was given) has no reduced value: it is no step of the average."""
BAD_WEIGHT = "_record/bad_weight/"
"""Internal lanes: ``BAD_WEIGHT + name``, 1 where a tensor given as a ``monitor.record`` mean's weight held
NaN, inf or a negative value on this rank in the interval (max, with the lowest rank holding it)."""
Number = Union[int, float, torch.Tensor]
logger = logging.getLogger("distmetrics")


class StepValues:
    """``train/loss`` (token-weighted), ``train/lr`` (the writer rank's last value), extra scalars,
    recorded values, the interval's tokens and wall time. ``writer`` is the global rank that writes
    the records."""

    name = "train"
    after = ()
    writes = ("train/loss", "train/lr")

    def __init__(self, layout: Any, writer: int, loss_average: str = "tokens") -> None:
        self.stats = IntervalStats(by_step=True)  # a value recorded after the last step: taken back at close()
        self.names = NameRegistry()  # the Monitor adds what its other collectors write
        self.names.reserve(["train/loss"], "monitor.step(loss=...)")
        self.names.reserve(["train/lr"], "monitor.step(lr=...)")
        self.counts_tokens = counts_batch_tokens(layout)
        self.stage_loss = StageLoss(layout, "monitor.step")
        self.job_tokens: Number = 0.0  # this rank's share of the tokens since the job started
        self.counted_tokens = False  # whether this rank counted tokens in the job (tokens=0 too): else not known
        self._job_tokens_logged: Number = 0.0  # ... up to the last log step whose tokens were good
        self.refused: Optional[ValueError] = None  # tokens found bad at a log step, raised after its record
        self.timed_steps = 0  # the last interval's steps that the clock measured
        self.clock = IntervalClock()  # restarted by start(), at the first monitor.step
        self._log_span_ns = 0  # the last log step's LOG_SPAN_NS on this rank, in ns (0: none since the clock started)
        self._says_pause = layout.says_once  # a pause a log step ended, then resumed: said once, by the first rank
        # the log step (since the last monitor.step) that ended a pause, when, and how long after it a resume()
        # says that the pause was meant to last (half a step of the interval: a resume() at once ends nothing)
        self._ended_pause: Optional[tuple[int, int, int]] = None
        self._paused_steps = 0  # monitor.step calls in the pause open now: a second says resume() was forgotten
        self._says_unresumed = layout.says_once
        self._starting = False
        self._timed = 0
        self._tokenless = 0  # the interval's timed steps given tokens=None on this rank, which counts tokens
        # this rank was given tokens at some step: where it is given none, they lack (a rank never given any,
        # a stage before the last under a layout the Monitor does not know, sends no tokenless lane)
        self._gives_tokens = False
        self._untimed_tokens: Number = 0.0
        self._loss_weights = 0  # 1 | 2 (loss_checks.loss_weights): what this interval's losses were weighted by
        self.mixed = MixedWeights(LOSS_WEIGHTS, "train/loss", layout.says_once)
        """What train/loss was weighted by (``.by``: in the last record)."""
        # train/lr weighs 1 on the writer rank and 0 elsewhere: the SUM pack adds only zeros to it, so
        # it is written exactly as given (a mean of 0.1 over 3 ranks is 0.30000000000000004 / 3)
        self._lr_weight = 1.0 if layout.rank == writer else 0.0
        self.learning_rates = LearningRates(LEARNING_RATES, writer, layout.says_once) \
            if layout.world_size > 1 else None
        self._lr: Optional[Number] = None  # the interval's last lr, for the LEARNING_RATES lane
        self._lr_nan: Any = False  # a NaN lr at some step of the interval (a tensor's: on its device, unread)
        self._uncounted = False  # tokens given in the interval on this rank, which does not count them
        self._says_uncounted = layout.says_once
        self.weightless = WeightlessMeans()  # monitor.record means left out for a total weight of 0: said
        self.loss_average = loss_average  # "tokens": train/loss is the interval's SUM lanes as they are
        self._step_losses: list[tuple[int, Number, Number]] = []  # (step index, loss, weight) of the interval
        self._step_names: dict[int, tuple[str, ...]] = {}  # the STEP_LOSS names of an interval of n steps
        self._step_lanes: tuple[str, ...] = ()  # the STEP_LOSS names of the last log step's interval
        self.pooled_loss: Optional[float] = None  # the last record's train/loss as loss_average "tokens" makes it

    def check_step(self, step: Any, last: Optional[int], loss: Any, tokens: Any, lr: Any, skipped: Any,
                   scalars: dict[str, Any], loss_tokens: Any = None) -> None:
        """Refuse a step's arguments before anything is recorded (a refused call changes nothing);
        ``last`` is the last step recorded (None: none yet)."""
        check_step(step, "monitor.step", last)
        counts = (("tokens", tokens), ("loss_tokens", loss_tokens))
        for what, value in (("loss", loss), *counts, ("lr", lr), *scalars.items()):
            if value is not None:
                check_user_value(value, "monitor.step(%s=...)", what)
        for what, value in counts:
            if value is not None:
                check_count(value, "monitor.step(%s=...)", what)
        if not isinstance(skipped, bool):
            raise TypeError(f"monitor.step(skipped={skipped!r}): accepted values are True and False")
        check_spellings(scalars, "train", "monitor.step")
        for name in scalars:
            self.names.claim(name if "/" in name else f"train/{name}", "mean", f"monitor.step({name}=...)")

    @property
    def unchecked_least_tokens(self) -> Optional[Number]:
        """The least count a tensor gave as ``tokens`` on this rank since the last log step (None: none),
        which that step's check across ranks has not seen yet."""
        return self.stats.least(LEAST + "tokens")

    def start(self) -> None:
        """Start the clock (the Monitor calls this at the first ``monitor.step``)."""
        self.clock.restart()
        self._log_span_ns = 0
        self._starting = True

    def record_step(self, loss: Optional[Number], tokens: Optional[Number], lr: Optional[Number],
                    scalars: dict[str, Number], loss_tokens: Optional[Number] = None, index: int = 0) -> None:
        """One optimizer step's values (checked by :meth:`check_step` first): ``loss`` weighted by
        :func:`loss_weight`, ``tokens`` counted for the throughput; ``index``: the step's place in its interval
        (from 0, as the log step's ``ctx.steps`` counts them)."""
        self._ended_pause = None  # a resume() from here on ends a pause of its own, or none
        if self.clock.paused:
            self._paused_steps += 1
            if self._paused_steps == 2 and self._says_unresumed:  # one may end inside a pause (an evaluation before it)
                self._says_unresumed = False
                logger.warning(
                    "distmetrics: monitor.step() came twice in one pause (monitor.pause() without monitor.resume()): "
                    "the training between was not counted (step time, tokens/s, MFU, ETA, timers/step) until the "
                    "log step, which ends the pause. Call monitor.resume() after the evaluation or save. Said once.")
        if isinstance(tokens, torch.Tensor):  # float64 once: each lane below takes the tensor as it is
            tokens = as_number(tokens)
        if isinstance(loss_tokens, torch.Tensor):
            loss_tokens = as_number(loss_tokens)
        self._gives_tokens = self._gives_tokens or tokens is not None
        if self._starting:  # the step whose call started the clock: its own time was not measured
            self._starting = False
            if tokens is not None and self.counts_tokens:
                self._untimed_tokens = kept(tokens)
        else:
            self._timed += 1
            if tokens is None and self.counts_tokens:
                self._tokenless += 1
        if loss is not None and not self.stage_loss.drops(loss):
            weight = loss_weight(tokens, loss_tokens)
            weighs = 1.0 if weight is None else weight
            self.stats.record("train/loss", loss, "mean", weight=weighs)
            if self.loss_average != "tokens":  # this step's own loss across ranks, in a lane of its own
                self._step_losses.append((index, kept(loss), kept(weighs)))
            self._loss_weights |= loss_weights(weight)
            if loss_tokens is not None:
                self.stats.record(LOSS_TOKENS, loss_tokens, "sum")
                if isinstance(loss_tokens, torch.Tensor):  # not read here (a device sync): checked at the log
                    self.stats.record(LEAST + "loss_tokens", loss_tokens, "min")  # step, in the MAX pack
        if tokens is not None and self.counts_tokens:
            self.stats.record(TOKENS, tokens, "sum")
            if isinstance(tokens, torch.Tensor):
                self.stats.record(LEAST + "tokens", tokens, "min")
            self.job_tokens = self.job_tokens + as_number(tokens)
            self.counted_tokens = True
        elif tokens is not None:
            self._uncounted = True
        if lr is not None:
            self.stats.record("train/lr", lr, "mean", weight=self._lr_weight, last=True)
            # its lane is made at the log step: a step between them pays one assignment (a tensor: its float64
            # conversion or copy, so a scheduler's tensor changed in place after the call is read as it was)
            self._lr = kept(lr) if isinstance(lr, torch.Tensor) else lr
            if self.learning_rates is not None:  # a NaN at a step between log steps is said too
                if isinstance(lr, torch.Tensor):
                    self._lr_nan = self._lr_nan | torch.isnan(lr)  # on its device, unread
                elif lr != lr:
                    self._lr_nan = True
        for name, value in scalars.items():
            if value is not None:  # like loss=None: this rank has no value this step
                self.stats.record(name if "/" in name else f"train/{name}", value, "mean")
        self.stats.end_step()  # what was recorded up to here is this step's

    def record(self, name: str, value: Number, reduce: str = "mean", weight: Optional[Number] = None) -> None:
        """A user's own value for this interval (see ``Monitor.record``). The name is claimed last:
        a call refused for its value or weight claims nothing, so a retry may use another kind."""
        check_reduce(name if isinstance(name, str) else repr(name), reduce)
        if weight is not None and reduce != "mean":  # it was dropped without a word: the user meant something by it
            raise ValueError(f"monitor.record({name!r}, reduce={reduce!r}, weight=...): only reduce='mean' takes a "
                             f"weight (a weighted mean); reduce={reduce!r} has none to weigh. Pass no weight, or "
                             "reduce='mean'")
        weight = 1.0 if weight is None else weight
        check_user_value(value, "monitor.record(%r)", name)
        check_user_value(weight, "monitor.record(%r, weight=...)", name)
        value, weight = local_value(value), local_value(weight)
        check_count(weight, "monitor.record(%r, weight=...)", name)
        self.names.claim(name, reduce, "monitor.record")
        self.stats.record(name, value, reduce, weight=weight)
        if reduce == "mean":
            self.weightless.means.add(name)  # left out where its weights sum to 0: said at the log step
        if reduce == "mean" and isinstance(weight, torch.Tensor):  # not read here (a device sync): flagged on
            # its device, the flag kept in a MAX lane (1 where NaN, inf or < 0), checked at the log step
            flag = unfit_counts(weight)
            self.stats.record(BAD_WEIGHT + name, flag.to(torch.float64), "max")

    def pause(self) -> None:
        """Stop the interval clock (evaluation, checkpointing)."""
        if not self.clock.paused:
            self._paused_steps = 0
        self.clock.pause()

    def resume(self) -> None:
        """Start the interval clock again after :meth:`pause`. Where a log step ended the pause since the
        last ``monitor.step`` (a pause ends at a log step) and this comes later than half a step after it,
        the pause was opened before that step's ``monitor.step`` and meant to last to here: what came
        between (an evaluation after the step) was counted as step time, said once."""
        if self._ended_pause is not None and not self.clock.paused and self._says_pause \
                and now() - self._ended_pause[1] > self._ended_pause[2]:  # not at once: time between was counted
            self._says_pause = False
            logger.warning(
                "distmetrics: monitor.resume() after the log step of step %d ended no pause: that log step ended the "
                "pause opened before its monitor.step(), so the time since (an evaluation or a save after "
                "monitor.step) was counted as step time (step time, tokens/s, MFU, ETA, timers/step). Call "
                "monitor.pause() after monitor.step(). Said once.", self._ended_pause[0])
        self._ended_pause = None
        self.clock.resume()

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The interval's values and its wall time; the clock starts the next interval."""
        ended_pause = self.clock.paused and ctx.ended_at is None
        counted_ns = self.clock.take_ns(until=ctx.ended_at)  # close(): up to the last monitor.step
        # a resume() later than half a step (at least 1 ms) after this log step, before the next monitor.step
        self._ended_pause = (ctx.step, self.clock.started, max(1_000_000, counted_ns // max(2 * self._timed, 1))) \
            if ended_pause else None
        span_ns, self._log_span_ns = min(self._log_span_ns, counted_ns), 0
        self.timed_steps, self._timed = self._timed, 0
        untimed, self._untimed_tokens = self._untimed_tokens, 0.0
        weights, self._loss_weights = self._loss_weights, 0
        lr, self._lr = self._lr, None
        nan, self._lr_nan = self._lr_nan, False
        tokenless, self._tokenless = self._tokenless, 0
        held, self._step_losses = self._step_losses, []
        lanes = [Sample(INTERVAL_NS, int(counted_ns - span_ns), "imax"), Sample(LOG_SPAN_NS, int(span_ns), "imin"),
                 Sample(UNTIMED_TOKENS, untimed, "sum")]
        if tokenless and self._gives_tokens:
            lanes.append(Sample(TOKENLESS_STEPS, float(tokenless), "max"))
        if weights:
            lanes.append(Sample(LOSS_WEIGHTS, weights, "minmax"))
        if self._uncounted:
            self._uncounted = False
            lanes.append(Sample(UNCOUNTED_TOKENS, 1.0, "max"))
        if lr is not None and self.learning_rates is not None:
            lr = as_number(lr)
            # every rank's lr (float32, to say ranks that differ), and their mean (float64: train/lr where the
            # writer rank gives none, as a loop passing lr beside the loss on the last pipeline stage does)
            lanes += [Sample(LEARNING_RATES, _nan_where(nan, lr), "minmax"),
                      Sample(f"{LEARNING_RATES}/mean", lr, "mean")]
        if self.loss_average != "tokens":  # the names every rank reads, whether it holds a loss or not
            self._step_lanes = self._step_names.get(ctx.steps) or self._step_names.setdefault(
                ctx.steps, tuple(f"{STEP_LOSS}{i}" for i in range(ctx.steps)))
            if held:
                lanes.append(self._step_loss_sample(held))
        self.weightless.sent = self.stats.take_samples()
        return self.weightless.sent + lanes

    def _step_loss_sample(self, held: list) -> Sample:
        """The interval's :data:`STEP_LOSS` lanes as one vector, one element per step, from its ``held``
        (index, loss, weight), a step without a loss weighing 0: built once per log step (no tensor
        operation at a step but a tensor's copy)."""
        names = self._step_lanes
        values, weights = [0.0] * len(names), [0.0] * len(names)
        for index, loss, weight in held:
            values[index], weights[index] = loss, weight
        device = next((v.device for v in values + weights if isinstance(v, torch.Tensor) and not v.is_cpu), None)
        return Sample(STEP_LOSS, _vector(values, device), "mean", weight=_vector(weights, device), names=names)

    def to_context(self, metrics: dict[str, Any], ctx: LogContext) -> None:
        """Move the internal lanes out of the reduced metrics into ``ctx`` (wall time, tokens,
        the steps the clock measured and their tokens)."""
        self.mixed.check_weightless(metrics, ctx.step)  # before a refusal below takes train/loss out
        over = now()  # the reduction is over (see LOG_SPAN_NS)
        self._log_span_ns = over - self.clock.started
        if self._ended_pause is not None:  # a resume() is timed from here: the log step's own time is none of it
            self._ended_pause = (self._ended_pause[0], over, self._ended_pause[2])
        interval_ns, ctx.tokens = metrics.pop(INTERVAL_NS, None), metrics.pop(TOKENS, None)
        span = metrics.pop(LOG_SPAN_NS, None)
        if interval_ns is not None:
            ctx.interval_s = (interval_ns + (span or 0)) / 1e9
        bad = _bad_count(metrics, "tokens", ctx.tokens, ctx.step)
        if bad:  # a tensor count is not read at the call (a device sync): a bad one shows here
            self.refused = ValueError(
                f"monitor.step(tokens=...): {bad}; accepted values are finite numbers >= 0. This record was "
                "written without train/loss (weighted by them) and the throughput; the job's token count "
                "(checkpoints, progress.txt) leaves this interval's tokens out")
            ctx.tokens = None
            metrics.pop("train/loss", None)
            self.job_tokens = self._job_tokens_logged  # every rank: each sees the same sum
        elif ctx.tokens is not None:
            self._job_tokens_logged = self.job_tokens
        self._check_loss_tokens(metrics, ctx.step)
        self.weightless.say(metrics, ctx, refused=self._check_weights(metrics, ctx))
        self._check_uncounted(metrics.pop(UNCOUNTED_TOKENS, None), ctx)
        untimed = metrics.pop(UNTIMED_TOKENS, None) or 0.0
        ctx.timed_steps = self.timed_steps  # equal on every rank: all call monitor.step alike
        ctx.timed_tokens = None if ctx.tokens is None else ctx.tokens - untimed
        tokenless, tokenless_rank = metrics.pop(TOKENLESS_STEPS, None), metrics.pop(TOKENLESS_STEPS + "/max_rank", None)
        if tokenless and ctx.tokens is not None:  # none given anywhere: no throughput, as without tokens
            ctx.tokenless_steps, ctx.tokenless_rank = int(tokenless), int(tokenless_rank)
        self.mixed.check(metrics, ctx.step)
        if self.learning_rates is not None:
            self.learning_rates.check(metrics, ctx.step)
        self._average_steps(metrics)

    def _average_steps(self, metrics: dict[str, Any]) -> None:
        """``train/loss`` from the interval's :data:`STEP_LOSS` lanes (taken out of ``metrics`` whatever the
        setting): the plain mean of its steps' losses (``steps``) or the last one's (``last``), where the
        interval's ``train/loss`` is written at all (a refusal or a mix of weights above leaves it out). The
        token-weighted one is kept as :attr:`pooled_loss` (``eval/gap`` weighs the intervals' by their tokens)."""
        self.pooled_loss = metrics.get("train/loss")
        if self.loss_average == "tokens":
            return
        losses = [metrics.pop(name) for name in self._step_lanes if name in metrics]  # in step order
        if "train/loss" in metrics and losses:
            metrics["train/loss"] = losses[-1] if self.loss_average == "last" else _mean(losses)

    def _check_uncounted(self, uncounted: Optional[float], ctx: LogContext) -> None:
        """Say once where tokens were given in the interval only on ranks that do not count them: the
        record has no throughput, MFU or consumed tokens, and the checkpoints' lines count none of them
        (nan where the job counted none at all)."""
        if not uncounted or ctx.tokens is not None or not self._says_uncounted:
            return
        self._says_uncounted = False
        logger.warning("distmetrics: step %d: monitor.step(tokens=...) was given only on ranks that do not count "
                       "tokens: they count once per data-parallel replica, on the rank of the last pipeline stage "
                       "(pipeline_style decides which) at tensor- and context-parallel rank 0, which were given "
                       "none. Pass the tokens there too (every rank may pass the same number): until then the "
                       "records have no throughput, MFU or consumed tokens, and checkpoints count no tokens (their "
                       "tokens and FLOPs are not known, nan, where no rank counted any in the job). Said once",
                       ctx.step)

    def _check_loss_tokens(self, metrics: dict[str, Any], step: int) -> None:
        """``loss_tokens`` given as tensors, checked in their sum over ranks as ``tokens`` are: NaN, inf
        or a negative sum leaves ``train/loss`` (weighted by them) out of the record, then raises."""
        total = metrics.pop(LOSS_TOKENS, None)
        bad = _bad_count(metrics, "loss_tokens", total, step)
        if not bad:
            return
        metrics.pop("train/loss", None)
        if self.refused is None:  # bad tokens too: that error is raised, and train/loss is left out for both
            self.refused = ValueError(
                f"monitor.step(loss_tokens=...): {bad}; accepted values are finite numbers >= 0. This record was "
                "written without train/loss (weighted by them)")

    def _check_weights(self, metrics: dict[str, Any], ctx: LogContext) -> list[str]:
        """``monitor.record`` weights given as tensors, checked in their :data:`BAD_WEIGHT` lanes: a bad one
        on any rank leaves its metric (a mean weighted by it: outside its values' range, or NaN) out of the
        record, then raises on every rank (said where an error is raised already). Returns those names."""
        bad, names, step = [], [], ctx.step
        for lane in ctx.keys_under(metrics, (BAD_WEIGHT,)):  # found once per set of names, not a pass a log step
            if lane.endswith("/max_rank") or lane not in metrics:
                continue
            flag, rank = metrics.pop(lane), metrics.pop(lane + "/max_rank", None)
            if flag:
                names.append(lane[len(BAD_WEIGHT):])
                metrics.pop(names[-1], None)
                bad.append(f"{names[-1]!r}" + ("" if rank is None else f" on rank {int(rank)}"))
        if not bad:
            return names
        error = ValueError(
            f"monitor.record(name, weight=...): a tensor given as a weight in the steps up to step {step} held NaN, "
            f"inf or a negative value: {', '.join(bad)} (the lowest rank where so); accepted values are finite "
            f"numbers >= 0. This record was written without {', '.join(names)} (means weighted by them)")
        if self.refused is None:
            self.refused = error
        else:
            logger.warning("distmetrics: step %d: %s", step, error)
        return names

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Nothing to derive (the Monitor moves the internal lanes into the context)."""
        return []

    def close(self) -> None:
        """Nothing to release."""


def _bad_count(metrics: dict[str, Any], what: str, total: Optional[float], step: int) -> Optional[str]:
    """What was wrong with the counts given as ``what`` (tensors, not read at the call) in the steps up to
    ``step``, None where nothing: their sum over ranks and steps (``total``) is NaN, inf or negative, or
    the least a tensor gave on some rank (its :data:`LEAST` lane, taken out of ``metrics``) is negative."""
    low, rank = metrics.pop(LEAST + what, None), metrics.pop(f"{LEAST}{what}/min_rank", None)
    where = "" if rank is None else f" on rank {int(rank)}"  # NaN wins: its lowest rank; else the least count's
    if total is not None and not (total >= 0 and math.isfinite(total)):
        if low is not None and math.isnan(low):
            held = [f"NaN{where}"]
        else:  # an inf and a negative count may both be there: each is said
            held = ["inf on some rank"] if total == math.inf or math.isnan(total) else []  # nan: inf - inf
            if low is not None and low < 0:
                held.append(f"a negative count{where}, {low!r}")
            held = held or ["a negative count on some rank"]  # one too small for the least count's float32 lane
        return (f"the {what} of the steps up to step {step}, summed over ranks, are {total!r}: a tensor given as "
                f"{what} held {' and '.join(held)}")
    if low is not None and low < 0:
        return (f"a tensor given as {what}{where} in the steps up to step {step} held a negative count, {low!r}, "
                f"which the other counts outweigh in their sum over ranks and steps ({total!r})")
    return None


def _nan_where(nan: Any, lr: Any) -> Any:
    """The learning rate lane's value: NaN where a NaN ``lr`` came at any step of the interval (``nan``,
    a bool or, where a tensor was given, a device tensor), else the last ``lr``."""
    if isinstance(nan, torch.Tensor):
        last = torch.as_tensor(lr, dtype=torch.float64, device=nan.device)
        return torch.where(nan, torch.full_like(last, math.nan), last)
    return math.nan if nan else lr


def _mean(values: list[float]) -> float:
    """The plain mean of ``values``: each divided first, so finite ones whose sum would pass float64's
    largest (1e308 twice) give their mean, not an overflow; with NaN or inf, as a sum gives it."""
    n = len(values)
    if all(map(math.isfinite, values)):
        return math.fsum(value / n for value in values)
    return sum(values) / n  # fsum refuses inf - inf


def _vector(values: list[Number], device: Optional[torch.device]) -> Any:
    """Numbers and 0-d tensors as one float64 vector: on the host for ``device`` None (numbers and host
    tensors only), else on ``device``, where the numbers and host tensors go in one copy and the device
    tensors are stacked with them (no read of a device tensor)."""
    if device is None:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    on_device = [isinstance(v, torch.Tensor) and not v.is_cpu for v in values]
    numbers = [float(v) for v, there in zip(values, on_device) if not there]
    moved = iter(torch.tensor(numbers, dtype=torch.float64).to(device).unbind() if numbers else ())
    return torch.stack([v.to(device, torch.float64).reshape(()) if there else next(moved)
                        for v, there in zip(values, on_device)])
