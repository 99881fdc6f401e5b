"""Which collector writes which names: the ``writes`` of the collector contract, enforced.

A collector declares the names it writes in ``writes`` (a name ending in ``/`` stands for every
name under it). Two collectors whose declarations overlap would put two values under one key:
both handed over as samples, every log step refused them both ("appear twice in one reduction")
and no record was written; a sample under a name another collector writes in ``finalize`` was
overwritten there, leaving its own ``/max_rank`` behind. So:

* :func:`check_writes`: ``Monitor()`` refuses overlapping declarations before any collective
  (said on every rank by the start-up gather), naming both collectors and the names. Two collectors
  may share names only where one names the other in ``after``: it runs after the other and writes
  around what that one wrote in ``finalize`` (the timers write ``train/step_time_ms`` only where
  throughput wrote none, and ``stragglers/<timer>/rank`` beside the stragglers collector's scores).
* :class:`ForeignNames`: a user's collector sends the names it declares, or names no other writer
  declares (another collector, ``monitor.step``, ``monitor.record``, ``log_eval``); a sample under
  another's name (or one whose reduce kind writes one: ``x/max_rank``) is left out of the record and
  raised once it is written, on every rank. Looked up only when the collector's names change.
"""

from __future__ import annotations

import numbers
from operator import attrgetter
from typing import Any, Iterable, Optional, Sequence

import torch

from ..names import RECORD_KEYS, REDUCE_KINDS, NameRegistry, collector_label, name_problem, written_names
from ..reduce import Sample

__all__ = ["check_writes", "check_declared", "check_after", "ForeignNames"]


def check_declared(collector: Any) -> tuple:
    """A user's collector's ``writes`` (none: ``()``); raises ``TypeError`` for anything but a list,
    tuple or set of metric names (``writes = ("data/")`` is the string ``"data/"``: five one-letter names)."""
    writes = getattr(collector, "writes", ())
    if isinstance(writes, (list, tuple, set, frozenset)) and all(isinstance(w, str) and w.strip("/") for w in writes):
        return tuple(sorted(writes)) if isinstance(writes, (set, frozenset)) else tuple(writes)
    raise TypeError(f"Monitor(collectors=...): the {collector.name!r} collector's writes={writes!r:.80} is not a "
                    "tuple of metric names (a name ending in '/' stands for every name under it), e.g. ('data/',)")


def check_after(collector: Any) -> None:
    """A user's collector's ``after``: a list, tuple or set of collector names; raises ``TypeError`` for
    anything else (``after = ("norms")`` is the string ``"norms"``: five one-letter names, none found)."""
    after = getattr(collector, "after", ())
    if isinstance(after, (list, tuple, set, frozenset)) and all(isinstance(a, str) and a for a in after):
        return
    raise TypeError(f"Monitor(collectors=...): the {collector.name!r} collector's after={after!r:.80} is not a "
                    "tuple of collector names, e.g. ('norms',)")


def check_writes(collectors: Sequence[Any], others: Iterable[tuple[str, Sequence[str]]] = ()) -> None:
    """Raise ``ValueError`` where two writers' ``writes`` overlap (one name, a name under the other's
    prefix, or one prefix inside the other) and neither collector names the other in ``after``.
    ``collectors``: collectors or their classes (``name``, ``after``, ``writes`` are read);
    ``others``: ``(who, writes)`` of the Monitor's own writers (``log_eval``'s names), shared with none."""
    # the Monitor's own writers first, then the collectors (the built-in ones before the user's): a clash is
    # said of the later writer, the one to give other names ("give monitor.log_eval names of its own" was no help)
    writers = [(who, None, (), tuple(writes)) for who, writes in others]
    writers += [(collector_label(c.name), c.name, tuple(getattr(c, "after", ())), tuple(getattr(c, "writes", ())))
                for c in collectors]
    held: dict[str, list[int]] = {}  # a declared name or prefix → the writers declaring it
    for index, (who, name, after, writes) in enumerate(writers):
        for mine in writes:
            for theirs in _overlapping(mine, held):
                for other in held[theirs]:
                    other_who, other_name, other_after, _ = writers[other]
                    if other == index or name is not None and (name in other_after or other_name in after):
                        continue
                    said = f"writes {mine!r}, which {other_who} writes too" if mine == theirs else \
                        f"writes {mine!r} and {other_who} writes {theirs!r}"
                    own = f" (e.g. under '{name}/')" if name is not None and not f"{name}/".startswith(theirs) else ""
                    raise ValueError(f"{who} {said} (a name ending in '/' stands for every name under it): one key "
                                     "would hold the values of both, one replacing the other or every log step "
                                     f"refusing both; give {who} names of its own{own}. A collector that only "
                                     "derives values from another's in finalize may share its names by naming it "
                                     "in its after")
        for mine in writes:
            held.setdefault(mine, []).append(index)


def _overlapping(mine: str, held: dict[str, list[int]]) -> list[str]:
    """The declarations in ``held`` that overlap ``mine``: the same, a prefix it is under, or (``mine``
    being a prefix) a name or prefix under it."""
    return [theirs for theirs in held if theirs == mine or (theirs.endswith("/") and mine.startswith(theirs))
            or (mine.endswith("/") and theirs.startswith(mine))]


_KEYS = attrgetter("names", "name", "reduce")


def _unfit(key: Any, metrics: dict[str, Any]) -> str:
    """Why no sink can store ``metrics[key]`` under ``key`` ('' where one can); a value of one element in
    a tensor or numpy array is made the 0-d value the sinks write as a number."""
    if not isinstance(key, str):
        return f"a {type(key).__name__}, not a str"
    why, value = name_problem(key), metrics[key]
    array = type(value).__name__ == "ndarray" and type(value).__module__ == "numpy"  # numpy is not imported
    if not why and (array or isinstance(value, torch.Tensor)):
        if (value.size if array else value.numel()) == 1:
            value = metrics[key] = value.reshape(())
        if value.ndim != 0 or (value.dtype.kind == "c" if array else value.is_complex()):
            why = f"a {type(value).__name__} of shape {tuple(value.shape)} and {value.dtype}, not a number"
    elif not why and isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        why = f"{value!r}, a complex number"
    return why


def _put_back(metrics: dict[str, Any], before: dict[str, Any], key: Any) -> None:
    """``key`` in ``metrics`` as it was ``before`` a finalize (removed where it was not there)."""
    if key in before:
        metrics[key] = before[key]
    else:
        del metrics[key]


class ForeignNames:
    """Keeps the user's ``collectors`` to the names they may send (see the module docstring),
    against ``registry``, the Monitor's record of who writes what. The names of a collector's samples
    (one tuple, built in C) are compared with those found clean at the last log step, while nothing
    has joined the registry: the names themselves are looked up only when one of the two changed."""

    def __init__(self, registry: NameRegistry, collectors: Iterable[Any], reducer: Any = None) -> None:
        self._registry = registry
        self._reducer = reducer  # its writers: who sent each name the ranks agreed on (a name's first sender)
        self._clean: dict[str, Optional[tuple]] = {c.name: None for c in collectors}  # (registry size, names)
        self.checked: dict[str, tuple] = {}
        """Per collector, its samples' (names, reduce kinds) and names last found well (collectors.base._checked)."""
        self.said: set = set()
        """What was said once about the user's collectors (log_step._own_kinds)."""

    def refused(self, collector: Any, samples: Sequence[Any]) -> dict[int, str]:
        """The samples of ``collector`` that another writer's names hold, by index, each with what it is."""
        if collector.name not in self._clean:
            return {}
        try:
            names = (self._registry.size, tuple(map(_KEYS, samples)))
        except AttributeError:  # not a Sample: the reducer refuses it, naming it
            return {}
        if names == self._clean[collector.name]:
            return {}
        own = collector_label(collector.name)
        first = getattr(self._reducer, "writers", None) or {}
        refused = {index: f"{own} handed over {said}" for index, said in
                   ((index, self._foreign(sample, own, collector.name, first)) for index, sample in enumerate(samples))
                   if said}
        if not refused:
            self._clean[collector.name] = names
        return refused

    def users(self, collector: Any) -> bool:
        """Whether ``collector`` is one of the user's (the Monitor's own are not kept to these rules)."""
        return collector.name in self._clean

    def before_finalize(self, collector: Any, metrics: dict[str, Any]) -> Optional[dict[str, Any]]:
        """A copy of ``metrics`` before the ``finalize`` of a user's ``collector`` (None for the Monitor's
        own collectors, which are not checked): :meth:`after_finalize` compares with it."""
        return dict(metrics) if self.users(collector) else None

    def after_finalize(self, collector: Any, before: dict[str, Any], metrics: dict[str, Any],
                       senders: Optional[dict[str, str]] = None,
                       kinds: Optional[dict[str, str]] = None) -> tuple[list[str], list[str]]:
        """What a user's ``collector``'s ``finalize`` set, replaced or removed in ``metrics`` that it may not,
        each put back as it was (removed where it is new), in one pass over the record: (what no sink can
        store, what another writer writes).

        No sink can store a name :func:`~distmetrics.names.name_problem` refuses, or no str, nor a tensor or
        numpy array of other than one element (one of one is made 0-d: its number) or a complex value
        (written as the text ``"tensor([4.5, 1.])"``, ``"1j"``). Another writer writes: a declared writer's
        name (the registry's; not one ``collector`` names in its ``after``), a record's own keys (``kind``,
        ``step``, ``time``: set, they replaced the record's in metrics.jsonl), and a value another collector
        handed over under a name no one declares (``senders``: the reducer's name → the user's collector
        that sent it, whose reduce ``kinds`` give the names it writes). Internal ``_`` lanes are neither's:
        a collector that reads another's lanes takes them out of the record."""
        own = collector_label(collector.name)
        allowed = {collector_label(name) for name in getattr(collector, "after", ())}
        missing = object()
        changed = [key for key, value in metrics.items() if before.get(key, missing) is not value]
        changed += [key for key in before if key not in metrics]  # in the record's order: said alike each time
        unfit, elsewhere, sent_by = [], [], None
        for key in changed:
            if isinstance(key, str) and key[:1] == "_":
                continue
            why = _unfit(key, metrics) if key in metrics and key not in RECORD_KEYS else ""
            if why:
                _put_back(metrics, before, key)
                unfit.append(f"{key!r}: {why}")
                continue
            who = self._registry.writer_of(key)
            if who is None and key in RECORD_KEYS:
                who = "the record itself (its own keys are 'kind', 'step' and 'time')"
            elif who is None and key in before and senders:  # handed over by another collector
                if sent_by is None:
                    sent_by = {written: by for name, by in senders.items() if by
                               for written in written_names(name, (kinds or {}).get(name, "mean"))}
                by = sent_by.get(key)
                who = None if by is None else collector_label(by)
            if who is None or who == own or who in allowed:
                continue
            _put_back(metrics, before, key)
            elsewhere.append(f"{key!r}, which {who} writes")
        return unfit, elsewhere

    def _foreign(self, sample: Any, own: str, name: str = "", first: Optional[dict] = None) -> Optional[str]:
        """What ``sample`` is, where it writes a name another writer declares, else None. A name of
        ``log_eval``'s that this collector (``name``) sent into train records first (``first``: the
        reducer's writers) stays its own: the kind of record agreed first keeps a name (a log_eval that
        clashed kept its claim, and the name went into neither kind of record from then on)."""
        if not isinstance(sample, Sample) or sample.reduce not in REDUCE_KINDS:
            return None  # the reducer refuses it, naming it
        for element in sample.names if sample.names is not None else (sample.name,):
            if type(element) is not str or element[:1] == "_":  # internal lanes; a bad name: the reducer says it
                continue
            for written in written_names(element, sample.reduce):
                who = self._registry.writer_of(written)
                if who is None or who == own or (first and first.get(element) == name
                                                 and self._registry.record_of(element) == "eval"):
                    continue
                what = f"a vector sample {sample.name!r} with an element {element!r}" if sample.names is not None \
                    else f"a sample {element!r}"
                if written != element:
                    what += f" ({sample.reduce}, which writes {written!r})"
                return f"{what}, which {who} writes"
        return None
