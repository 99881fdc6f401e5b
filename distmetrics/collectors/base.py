"""The one contract every collector implements, and what a log step passes to it.

A collector measures on its rank between log steps (adding into device tensors: no host sync,
no collective) and, at a log step, hands over what it measured::

    class QueueDepth:
        name = "queue"
        after = ()                                   # collectors whose results finalize() reads
        writes = ("data/",)                          # the names it writes ("data/": all under it)

        def take_samples(self, ctx):                 # hands over the interval and resets it
            return [Sample("data/queue_depth", self.depth, "max")]

        def finalize(self, metrics, ctx):            # derived values, alerts (after the reduction)
            return []                                # Alert(...)s, or Record(...)s of a kind of their own

        def close(self):
            pass

The Monitor's log step is a loop: ``take_samples`` from every collector → one reduction (at
most one collective per reduce kind, whatever the number of collectors and names) →
``finalize`` in dependency order (``after``) on the reduced metrics, which are the same on
every rank → write. What several collectors need (the step, the interval's steps, its wall
time and tokens, the layout, the model's module order) comes in :class:`LogContext`, computed
once; a collector never reads another collector's attributes, only the metric names of the
collectors it declares in ``after``. What a collector declares in ``writes`` is its own
(:mod:`.writes`): ``Monitor()`` refuses two collectors whose ``writes`` overlap (unless one runs
after the other, in ``after``), a collector's sample named as another writer's name is left out
and raised, and ``monitor.record`` or a ``monitor.step`` scalar that would write one of those names
is refused at its call, instead of two values of one name failing the log step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from ..guard import HangError
from ..names import EXACT_KINDS, RECORD_KEYS, REDUCE_KINDS, check_name, name_problem, unfit_counts, written_names
from ..reduce import Sample
from ..samples import check_tensors
from .writes import ForeignNames, check_after, check_declared, check_writes

logger = logging.getLogger("distmetrics")

__all__ = ["Collector", "LogContext", "Alert", "Record", "Sample", "finalize_order", "check_collectors", "take_samples",
           "ForeignNames", "CollectorFailed"]

_clean_names: dict[int, tuple] = {}  # id → vector names tuples found to hold no record key (kept alive here)


@dataclass
class LogContext:
    """What a log step knows, passed to every collector."""

    step: int
    """The optimizer step being logged."""
    steps: int
    """Optimizer steps in this interval (``monitor.step`` calls since the last log step)."""
    layout: Any
    """This rank's :class:`~distmetrics.parallel.Layout`."""
    hosts: Sequence[Any] = ()
    """Every rank's :class:`~distmetrics.parallel.RankInfo` (global rank, host, local rank, GPU), in the
    order of the Monitor's ranks (its group's rank order; by rank for the world)."""
    module_order: Sequence[str] = ()
    """The model's module names in model order (the first is nearest the input)."""
    interval_s: Optional[float] = None
    """After the reduction: the slowest rank's wall time of the interval, seconds."""
    tokens: Optional[float] = None
    """After the reduction: the tokens of the interval, counted once per data-parallel replica."""
    timed_steps: Optional[int] = None
    """After the reduction: the steps ``interval_s`` measured. The clock starts at the first
    ``monitor.step``, so the first interval measures one step fewer than it holds (None: all)."""
    timed_tokens: Optional[float] = None
    """After the reduction: the tokens of those steps (None: ``tokens``)."""
    tokenless_steps: int = 0
    """After the reduction: where tokens were given in the interval, the most timed steps at which one rank
    that counts tokens was given ``tokens=None`` (0: none). Those steps' tokens are not known: what divides
    the timed tokens by the time or the energy (tokens/s, TFLOP/s, MFU, energy per token) is left out."""
    tokenless_rank: Optional[int] = None
    """The rank given ``tokens=None`` at that many steps (the lowest of those tied)."""
    stride: int = 1
    """The last step's number less the one before (at least 1): steps numbered 2, 4, 6... leave
    half as many calls as numbers to ``total_steps``."""
    ended_at: Optional[int] = None
    """The record ``close()`` writes: when the last ``monitor.step`` returned (a reading of
    :func:`distmetrics.interval.now`, ns). The interval ends there, not at ``close()``: what came after
    (a final checkpoint save, teardown) is no step's time. None at a log step."""
    reduced: Any = None
    """After the reduction: the :class:`~distmetrics.reduce.Reduced` result (see :meth:`keys_under`)."""
    previous: dict = field(default_factory=dict)
    """The last train record written (empty before the first): "once per event" is decided
    against what was written, so a log step that raised after a collector's ``finalize`` hides
    no event's alert."""

    def keys_under(self, metrics: dict[str, Any], prefixes: tuple) -> tuple:
        """The reduction's metric keys that start with one of ``prefixes``: worked out once per
        set of names where the reduction is known (present this log step or not: read them with
        ``metrics.get``), else found by a pass over ``metrics``."""
        if self.reduced is not None:
            return self.reduced.keys_under(prefixes)
        return tuple(key for key in metrics if key.startswith(prefixes))


@dataclass
class Alert:
    """Something an engineer must see: written as an ``alert`` record and a console warning."""

    alert: str
    """A short machine-readable kind, e.g. ``nonfinite_grad``."""
    message: str
    """One line for people."""
    details: dict = field(default_factory=dict)
    """Extra fields of the record (e.g. ``first_module``)."""
    kind: ClassVar[str] = "alert"
    """The record kind it is written as."""

    def to_record(self) -> dict:
        """The fields of the JSONL ``alert`` record."""
        return {"message": self.message, "alert": self.alert, **self.details}


@dataclass
class Record:
    """A record of a kind of its own that a collector hands the writer at a log step, written
    beside the ``train`` record (e.g. ``{"kind": "stragglers", ...}``); sinks that plot numbers
    leave it out."""

    kind: str
    """The record kind, e.g. ``stragglers``."""
    fields: dict
    """The record's fields (JSON-serialisable: numbers, strings, lists, mappings)."""

    def to_record(self) -> dict:
        """The fields of the JSONL record."""
        return dict(self.fields)


@runtime_checkable
class Collector(Protocol):
    """What every collector implements (see the module docstring)."""

    name: str
    """Unique among a Monitor's collectors; what others name in ``after``."""
    after: tuple
    """Names of the collectors whose results :meth:`finalize` reads (run after them)."""
    writes: tuple
    """The metric names it writes, a name ending in ``/`` standing for every name under it (may be
    empty). They are its own: another collector's that overlap them are refused at ``Monitor()``
    (unless one names the other in ``after``), and so is a user's value under one of them at its
    call; its samples are named by them, or by names no other writer declares."""

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """This interval's samples on this rank; the interval starts again."""
        ...

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Union[Alert, Record]]:
        """Derive values in ``metrics`` (the reduced result, the same on every rank); return alerts
        (and records of other kinds) for the writer."""
        ...

    def close(self) -> None:
        """Release what the collector holds (hooks, handles)."""
        ...


def take_samples(collectors: Sequence[Any], ctx: LogContext, foreign: Optional[ForeignNames] = None,
                 kinds: Optional[dict] = None) -> tuple[list, Optional[Exception]]:
    """Every collector's samples for a log step, and an error to raise once its record is written,
    or None. A collector of the user's whose ``take_samples`` raises (not a HangError: a rank gone) hands
    over nothing: the record is written without it, then its error is raised (:class:`CollectorFailed`, on
    every rank: the others name the rank); the Monitor's own collectors' errors come as they are. A
    sample named as one of a record's own keys (``kind``, ``step``, ``time``; a vector's
    element too) is left out, and the error names its collector: written, it replaced the record's
    own key in metrics.jsonl (``"step": 7.0``), whose readers then skipped the line. So is a sample
    of a user's collector that ``foreign`` finds under another writer's name (:mod:`.writes`). A user's
    collector whose samples the reduction would refuse on this rank alone (no Sample, a name twice, a
    name's reduce kind other than the one ``kinds``, the reducer's, holds), or whose names no sink
    stores or the Monitor keeps for itself (see :func:`~distmetrics.names.check_name`; an internal lane's
    ``_train/tokens`` made every log step raise), fails as one that raised."""
    samples: list = []
    seen: dict[str, str] = {}  # the names handed over so far, and their reduce kinds
    refused: list[tuple[str, str, str]] = []  # (collector, what, key)
    elsewhere: list[str] = []  # what each sample under another writer's name was
    failed: Optional[Exception] = None
    for collector in collectors:
        taken = weights = None
        try:
            got = collector.take_samples(ctx)
            if foreign is not None and foreign.users(collector):
                got = list(got)
                taken = foreign.refused(collector, got)  # under another writer's names: left out, said below
                if taken:
                    got = [sample for index, sample in enumerate(got) if index not in taken]
                # what the reducer would refuse before its collectives, on this rank alone (the others waiting)
                got = _checked(got, seen, kinds or {}, foreign.checked, collector)
                weights = _weights_lane(collector, got)
        except Exception as err:  # noqa: BLE001 - raised once the record is written, without this collector's
            # samples: raised here, it lost the samples the collectors before it had taken (their intervals begun
            # again), and the record with them, counted nowhere
            if foreign is None or not foreign.users(collector) or isinstance(err, HangError):
                raise
            samples.append(Sample(FAILED_BY + collector.name, 1.0, "max"))  # its names go on every rank
            if failed is None:
                failed = CollectorFailed(f"the {getattr(collector, 'name', collector)!r} collector's take_samples "
                                         f"raised {type(err).__name__}: {err}; the record of step {ctx.step} was "
                                         "written without its samples")
                failed.__cause__ = err
            else:
                logger.warning("distmetrics: the %r collector's take_samples also raised at step %d: %s: %s",
                               getattr(collector, "name", collector), ctx.step, type(err).__name__, err)
            continue
        if taken:
            elsewhere += taken.values()
        if weights is not None:
            samples.append(weights)
        writer = collector.name if foreign is not None and foreign.users(collector) else ""
        for sample in got:
            key = _record_key(sample)
            if key is None:
                if writer:  # a user's: ranks that send one name from two writers are refused (the reduction's)
                    sample.writer = writer
                samples.append(sample)
            else:
                what = f"a vector sample {sample.name!r} with an element" if sample.names is not None else "a sample"
                refused.append((collector.name, what, key))
    errors = []
    if refused:
        samples.append(Sample(MISNAMED, 1.0, "max"))  # every rank raises, not only this one (see misnamed_elsewhere)
        said = "; ".join(f"the {who!r} collector handed over {what} named {key!r}" for who, what, key in refused)
        who, _, key = refused[0]
        errors.append(f"{said}: every record's own keys are {', '.join(map(repr, RECORD_KEYS))}, which a metric of "
                      f"that name replaced in metrics.jsonl; give it a prefix (e.g. '{who}/{key}'). The record was "
                      "written without it")
    if elsewhere:
        samples.append(Sample(FOREIGN, 1.0, "max"))
        errors.append(f"{'; '.join(elsewhere)}: a collector sends the names it declares in its writes, or names no "
                      "other writer declares (one key would hold both values: one replaced by the other, or every log "
                      "step refusing both); give it names of its own. The record was written without it")
    if failed is not None:
        samples.append(Sample(FAILED, 1.0, "max"))  # every rank raises, not only this one (see misnamed_elsewhere)
        if errors:  # one error is raised: the other is said
            logger.warning("distmetrics: step %d: %s", ctx.step, "; ".join(errors))
        return samples, failed
    return samples, ValueError("; ".join(errors)) if errors else None


MONITORS_LANES = frozenset(("_train/", "_eval/", "_stragglers/", "_monitor/", "_grad_bad/", "_grad_blown/", "_energy/",
                            "_ranks/", "_norms/", "_moe/", "_record/", "_gpu/", "_tensor_stats/"))
"""The prefixes of the Monitor's internal lanes, which no collector of the user's sends as its own."""


def of_ours(collector: Any) -> bool:
    """Whether a user's collector is (made from) one of the Monitor's own, whose internal lanes start with '_'."""
    return any(c.__module__.startswith("distmetrics.") and c.__module__ != __name__ for c in type(collector).__mro__)


def _checked(got: Any, seen: dict[str, str], kinds: dict[str, str], memo: dict[str, tuple], collector: Any) -> list:
    """A user's collector's samples as a list, their names added to ``seen``; a ``TypeError`` or
    ``ValueError`` for what the reduction would refuse (checked as it does, ahead of it), and for a
    name the rules of ``monitor.record``'s refuse (not where the collector is made from one of the
    Monitor's). Samples of the same names and kinds as at the last log step (``memo``) passed then."""
    got = list(got)
    for sample in got:  # values change at every log step: checked at each
        if isinstance(sample, Sample):
            check_tensors(sample)
    shape = tuple((s.names if s.names is not None else s.name, s.reduce) if isinstance(s, Sample) else None
                  for s in got)
    last = memo.get(collector.name)
    if last is not None and last[0] == shape and seen.keys().isdisjoint(last[1]):
        seen.update(last[1])
        return got
    ours, own = of_ours(collector), f"_{collector.name}/"
    own = None if own in MONITORS_LANES else own  # a collector named as the Monitor's lanes ('ranks') has none
    mine: dict[str, str] = {}
    for sample in got:
        if not isinstance(sample, Sample):
            raise TypeError(f"take_samples returned a {type(sample).__name__} ({sample!r:.80}), not a Sample")
        names = sample.names if sample.names is not None else (sample.name,)
        if sample.names is not None and len(set(names)) != len(names):
            raise ValueError(f"the vector sample {sample.name!r} names an element twice")
        if sample.reduce in EXACT_KINDS and not ours:  # the Monitor's own lanes' kinds
            raise ValueError(f"the sample {sample.name!r}: reduce={sample.reduce!r} is the Monitor's own; accepted: "
                             f"{', '.join(REDUCE_KINDS)}")
        for name in names:
            known = kinds.get(name)
            if ours or known is not None and name[:1] != "_" or name in RECORD_KEYS:  # passed once: passes
                pass
            elif own is not None and name.startswith(own):  # a lane of its own, for its finalize (not written)
                odd = name_problem(name)
                if odd:
                    raise ValueError(f"the sample {name!r} is refused: {odd}")
            else:  # the Monitor's lanes start with '_' ('_train/tokens'), no valid UTF-8, a control character
                check_name(name, "the sample" + (f" (lanes of its own start with {own!r})" if own else ""))
            known = known or sample.reduce
            if name in mine or name in seen:
                raise ValueError(f"the metric {name!r} was handed over twice at one log step"
                                 f"{'' if name in mine else ' (another collector sends it too)'}")
            if known != sample.reduce:
                raise ValueError(f"the metric {name!r} was reduced as {known!r} before and now as "
                                 f"{sample.reduce!r}; a name keeps one reduce kind for the whole run")
            mine[name] = sample.reduce
    seen.update(mine)
    memo[collector.name] = (shape, mine)
    return got


class CollectorFailed(RuntimeError):
    """A collector's ``take_samples`` raised at a log step: the record was written without its samples."""


BAD_WEIGHTS_BY = "_monitor/bad_weights/"
"""Internal lanes: ``BAD_WEIGHTS_BY + name``, 1 where a mean's weight the collector ``name`` gave as a tensor
held NaN, inf or a negative value on a rank (a max: the rank in ``/max_rank``), read on the device."""


def _weights_lane(collector: Any, got: list) -> Optional[Sample]:
    """The :data:`BAD_WEIGHTS_BY` lane of a user's collector whose means carry tensor weights, flagged on their
    device (no sync; a scalar weight is checked when its Sample is made), or None where none does."""
    flags = [unfit_counts(s.weight).any() for s in got if s.reduce == "mean" and isinstance(s.weight, torch.Tensor)]
    if not flags:
        return None
    flag = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).any()
    return Sample(BAD_WEIGHTS_BY + collector.name, flag.to(torch.float64), "max")


def bad_weights(metrics: dict[str, Any], reduced: Any, step: int) -> tuple[tuple, Optional[Exception]]:
    """The user's collectors some rank flagged in a :data:`BAD_WEIGHTS_BY` lane (taken out of ``metrics``),
    to be left out as failed ones are (:func:`left_out_failed`), and the error every rank raises for them."""
    said = []
    for key in reduced.keys_under((BAD_WEIGHTS_BY,)) if reduced is not None else ():
        flag = metrics.pop(key, None)
        if flag and reduced.kinds.get(key) == "max":  # not its /max_rank
            rank = metrics.get(f"{key}/max_rank")
            said.append((key[len(BAD_WEIGHTS_BY):], "some rank" if rank is None else f"rank {int(rank)}"))
        metrics.pop(f"{key}/max_rank", None)
    if not said:
        return (), None
    return tuple(name for name, _ in said), CollectorFailed(
        f"{'; '.join(f'the {name!r} collector on {where}' for name, where in said)} gave a mean's weight as a tensor "
        f"holding NaN, inf or a negative value in the samples of step {step}: accepted weights are finite numbers "
        ">= 0 (a mean weighted by it is NaN or outside its values' range). The record was written without its "
        "samples")


MISNAMED = "_monitor/misnamed"
"""Internal lane: a rank's collector handed over a sample named as a record key (a max: 1 there)."""
FOREIGN = "_monitor/foreign_name"
"""Internal lane: a rank's collector handed over a sample under another writer's name (a max: 1 there)."""
FAILED = "_monitor/take_samples_failed"
"""Internal lane: a rank's collector raised in ``take_samples`` (a max: 1 there)."""
FAILED_BY = "_monitor/failed_collector/"
"""Internal lanes: ``FAILED_BY + name``, the collector ``name`` raised in ``take_samples`` on a rank
(a max: 1 there)."""
_ELSEWHERE = {MISNAMED: f"a sample named as one of a record's own keys ({', '.join(map(repr, RECORD_KEYS))})",
              FOREIGN: "a sample named as a name another writer writes"}


def left_out_failed(metrics: dict[str, Any], reduced: Any, collectors: Sequence[Any], memo: dict[str, tuple],
                    writers: Optional[dict[str, str]] = None, also: tuple = ()) -> tuple:
    """The names of the user's collectors whose ``take_samples`` raised on some rank at this log step
    (the reduced :data:`FAILED_BY` lanes, taken out of ``metrics``), and their values taken out of
    ``metrics`` on every rank: reduced from the ranks where it did not raise, a value was part of
    the metric under its full name (a sum over some ranks). Its values: the names it declares in
    ``writes``, its own lanes ``_<name>/``, the names it handed over on this rank at this log
    step or, where it raised here, at the last one it handed over any (``memo``, of
    :func:`take_samples`'s checks), and the names of the agreed layout that it sent on any rank
    (``writers``, the reducer's: a name only other ranks handed over). ``also``: collectors to leave out as
    failed ones (:func:`bad_weights`)."""
    lanes = reduced.keys_under((FAILED_BY,)) if reduced is not None else ()
    failed = list(also)
    for key in lanes:
        flag = metrics.pop(key, None)
        if flag and reduced.kinds.get(key) == "max":  # not its /max_rank
            failed.append(key[len(FAILED_BY):])
        metrics.pop(f"{key}/max_rank", None)
    for collector in collectors:
        if collector.name not in failed:
            continue
        writes = tuple(getattr(collector, "writes", ()))
        keys = set(reduced.keys_under(tuple(w for w in writes if w.endswith("/")) + (f"_{collector.name}/",)))
        sent = memo.get(collector.name, ((), {}))[1]
        elsewhere = [name for name, by in (writers or {}).items() if by == collector.name]
        for name in (*(w for w in writes if not w.endswith("/")), *sent, *elsewhere):
            kind = reduced.kinds.get(name)
            if kind is not None:
                keys.update(written_names(name, kind))
        # a collector sharing its prefix (one naming it in after) lost its values with it
        others = {written for name, by in (writers or {}).items() if by and by != collector.name
                  for written in written_names(name, reduced.kinds.get(name, "mean"))}
        for key in keys - others:
            metrics.pop(key, None)
    return tuple(dict.fromkeys(failed))


def misnamed_elsewhere(metrics: dict[str, Any], error: Optional[Exception], failed: tuple = ()) -> Optional[Exception]:
    """This rank's error from :func:`take_samples`, or, where another rank's collector handed over a
    sample named as a record key or as another writer's name, or raised (the reduced :data:`MISNAMED`,
    :data:`FOREIGN` and :data:`FAILED` lanes, taken out of ``metrics``), one naming that rank: raised on every rank once
    the record is written, as the ranks must stay in step (a rank that went on alone to its next
    call waited there for the one that raised)."""
    flag, rank = metrics.pop(FAILED, None), metrics.pop(f"{FAILED}/max_rank", None)
    if flag and error is None:
        who = f"collector {failed[0]!r}" if len(failed) == 1 else f"collectors {', '.join(map(repr, failed))}"
        return CollectorFailed(f"{'a rank' if rank is None else f'rank {int(rank)}'}'s {who} raised in "
                               "take_samples, which that rank's error names; the record was written without its "
                               "samples")
    said = []
    for lane, what in _ELSEWHERE.items():
        flag, rank = metrics.pop(lane, None), metrics.pop(f"{lane}/max_rank", None)
        if flag:
            said.append(f"{'a rank' if rank is None else f'rank {int(rank)}'}'s collectors handed over {what}")
    if not said or error is not None:
        return error
    return ValueError(f"{'; '.join(said)}, which that rank's error names. The record was written without it")


def _record_key(sample: Any) -> Optional[str]:
    """The name of ``sample`` (or of an element of a vector) that is a record's own key, or None;
    a vector's names tuple is checked once (collectors pass the same tuple at every log step)."""
    names = getattr(sample, "names", None)
    if names is None:
        name = getattr(sample, "name", None)
        return name if type(name) is str and name in RECORD_KEYS else None
    if names is _clean_names.get(id(names)):
        return None
    key = next((name for name in names if name in RECORD_KEYS), None)
    if key is None and type(names) is tuple:
        if len(_clean_names) >= 256:
            _clean_names.clear()
        _clean_names[id(names)] = names
    return key


def finalize_order(collectors: Sequence[Any]) -> list[Any]:
    """The collectors ordered so that each comes after those it names in ``after``.

    Raises ``ValueError`` for a duplicate name or a cycle; names of collectors that are not
    there (e.g. norms without a model) are ignored."""
    by_name: dict[str, Any] = {}
    for c in collectors:
        if c.name in by_name:
            raise ValueError(f"two collectors are named {c.name!r}; collector names must be unique")
        by_name[c.name] = c
    ordered: list[Any] = []
    state: dict[str, str] = {}

    def visit(c: Any, path: tuple) -> None:
        if state.get(c.name) == "done":
            return
        if state.get(c.name) == "visiting":
            raise ValueError(f"collectors depend on each other in a circle: {' -> '.join(path + (c.name,))}")
        state[c.name] = "visiting"
        for dep in getattr(c, "after", ()):
            if dep in by_name:
                visit(by_name[dep], path + (c.name,))
        state[c.name] = "done"
        ordered.append(c)

    for c in collectors:
        visit(c, ())
    return ordered


def check_collectors(collectors: Any, built_in: Sequence[Any] = (), others: Sequence[tuple] = (),
                     reserved: Sequence[type] = ()) -> tuple:
    """The user's extra collectors as a tuple; raises ``TypeError`` naming one that is not a collector
    (a ``name``, callable ``take_samples``, ``finalize`` and ``close``, and ``writes``, if any, a tuple
    of names), and ``ValueError`` where its name or its ``writes`` are another's (one of the ``built_in``
    collectors or their classes, or another of the user's; ``others``: see :func:`.writes.check_writes`).
    ``reserved``: built-in classes not made (the norms' without a model, the stragglers' on one rank)
    whose names the Monitor looks up all the same: a collector of the user's under one, not of that
    class, was taken for it (every monitor.step raised AttributeError)."""
    if collectors is None:
        collectors = ()
    if isinstance(collectors, (str, bytes)) or not isinstance(collectors, (list, tuple)):
        raise TypeError(f"Monitor(collectors=...): expected a list or tuple of collectors, got "
                        f"{type(collectors).__name__} {collectors!r:.80}")
    for collector in collectors:
        if isinstance(collector, type):  # its methods are there, unbound: every log step failed calling them
            raise TypeError(f"Monitor(collectors=...): {collector.__name__} is a class, not a collector; give an "
                            f"instance of it ({collector.__name__}(...))")
        name = getattr(collector, "name", None)
        missing = [verb for verb in ("take_samples", "finalize", "close")
                   if not callable(getattr(collector, verb, None))]
        if not isinstance(name, str) or not name or missing:
            lacks = ", ".join((["a name (a non-empty str)"] if not isinstance(name, str) or not name else []) +
                              [f"{verb}()" for verb in missing])
            raise TypeError(f"Monitor(collectors=...): {collector!r:.80} is not a collector: it lacks {lacks} "
                            "(see distmetrics.collectors.base.Collector)")
        check_declared(collector)
        check_after(collector)
    for collector in collectors:
        kind = next((kind for kind in reserved if kind.name == collector.name), None)
        if kind is not None and not isinstance(collector, kind):
            raise ValueError(f"a collector of yours is named {collector.name!r}, the name of a built-in collector "
                             f"({kind.__name__}, which the Monitor looks up by that name whether it makes one or "
                             "not); collector names must be unique: give it another")
    names = [c.name for c in built_in] + [c.name for c in collectors]
    twice = next((name for index, name in enumerate(names) if name in names[:index]), None)
    if twice is not None:  # before its writes: they would seem to overlap another's
        if twice in names[:len(built_in)]:  # a built-in's, which holds its name whatever its switch
            raise ValueError(f"a collector of yours is named {twice!r}, the name of a built-in collector (held "
                             "whether its config switch is on or off); collector names must be unique. One made of "
                             "the built-in's own class (an EnergyCollector for one GPU) runs in its place where its "
                             "switch is off")
        raise ValueError(f"two collectors are named {twice!r}; collector names must be unique")
    check_writes(list(built_in) + list(collectors), others)
    finalize_order(list(built_in) + list(collectors))  # a circle of afters: here, before the start-up gather
    return tuple(collectors)
