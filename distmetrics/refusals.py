"""Names a negotiation refused, left out of the packs for as long as the ranks keep sending them.

A negotiation refuses a name whose reduce kind differs between ranks (or from an earlier log step),
both names of a pair that would write one key, and a name that writes a key another kind of record
holds (:func:`refused_beside`). Such a name may be one element of a vector
sample (one timer among the timers, one module among the per-module norms): only that element is
left out, so the vector's other elements are still reduced and written.

The refusal stays with the layout it was agreed with. At a later log step each rank leaves the same
names out again, and raises the MAX pack's stale flag only where the refused names it sends have
changed (the clash may be over then). A clash that lasts therefore costs no negotiation at each log
step, and every rank still hands its caller the error there, as every rank holds the same refusal.

This module knows samples and names, not process groups: :mod:`distmetrics.reduce` negotiates.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

__all__ = ["Refusals", "refused_beside"]


class Refusals:
    """The names the last negotiation refused, with why (the same on every rank), and which of them
    this rank sent then (:attr:`sent`)."""

    def __init__(self, why: dict[str, str]) -> None:
        self.why = why
        self.message = "; ".join(dict.fromkeys(why.values())) + " (left out of this record)"
        self.sent: frozenset = frozenset()
        """The refused names this rank sent to the negotiation, with their reduce kinds and writers: another
        set at a later log step (a kind or a writer changed back too) raises the stale flag."""
        self._vectors: dict[tuple, tuple] = {}  # (id(names), reduce) → (names, refused among them, kept names, index)

    def error(self) -> ValueError:
        """The error the reducer's caller raises once the record is written (a new one each log step:
        one exception raised again and again would pile up tracebacks)."""
        return ValueError(self.message)

    def first(self, samples: Sequence[Any]) -> list:
        """:meth:`leave_out` at the negotiation itself, where :attr:`sent` is taken."""
        kept, self.sent = self.leave_out(samples)
        return kept

    def leave_out(self, samples: Sequence[Any]) -> tuple[list, frozenset]:
        """``samples`` without the refused names (a vector keeps its other elements, as a vector),
        and the refused names among them, as (name, reduce kind, writer) triples."""
        kept: list = []
        sent: set = set()
        for s in samples:
            if s.names is None:
                if s.name in self.why:
                    sent.add((s.name, s.reduce, s.writer))
                else:
                    kept.append(s)
                continue
            _, refused, names, index = self._vector(s.names, s.reduce)
            if not refused:
                kept.append(s)
                continue
            sent.update((name, s.reduce, s.writer) for name in refused)
            if names:
                kept.append(_part(s, names, index))
        return kept, frozenset(sent)

    def _vector(self, names: tuple, reduce: str) -> tuple:
        """Which of a vector's names are refused, the others and their positions; cached per tuple
        (collectors pass the same one at each log step)."""
        key = (id(names), reduce)
        cached = self._vectors.get(key)
        if cached is None or cached[0] is not names:
            refused = frozenset(name for name in names if name in self.why)
            positions = [i for i, name in enumerate(names) if name not in refused]
            if len(self._vectors) >= 256:  # tuples made anew at each log step: keep a few
                self._vectors.clear()
            cached = self._vectors[key] = (names, refused, tuple(names[i] for i in positions),
                                           {None: torch.tensor(positions, dtype=torch.long)})
        return cached


def _part(s: Any, names: tuple, index: dict) -> Any:
    """A vector sample's elements at ``index`` (positions by device, filled as needed), named ``names``."""
    def pick(values: Optional[Any]) -> Optional[Any]:
        if not isinstance(values, torch.Tensor):
            return values  # a number stands for every element
        at = index.get(values.device)
        if at is None:
            at = index[values.device] = index[None].to(values.device)
        return values.index_select(0, at)

    return dataclasses.replace(s, value=pick(s.value), weight=pick(s.weight), low=pick(s.low), names=names)


def refused_beside(union: dict[str, str], origin: dict[str, int], records: str,
                   beside: Sequence[Any]) -> dict[str, str]:
    """The names of a negotiation's ``union`` (name → reduce kind, ``origin``: a rank that sent each) that
    would write a key which another kind of record holds already, with why: ``beside`` holds, per kind,
    a :class:`~distmetrics.names.NameRegistry` of the names agreed for it (the same on every rank), and
    ``records`` says which records ``union`` is for. ``eval/acc`` in train records from ``monitor.record``
    on one rank and in eval records from ``log_eval(acc=...)`` on another: the records written keep it."""
    refused: dict[str, str] = {}
    for written in beside:
        if not written.size:
            continue
        for name, kind in union.items():
            if name[:1] == "_" or name in refused:  # internal lanes are never written
                continue
            clash = written.clash(name, kind, f"metric {name!r} ({kind}) from rank {origin[name]} in {records}")
            if clash is not None:
                refused[name] = (f"{clash}: one tag would hold both kinds of record (values of one at the steps of "
                                 "the other); give one of them another name")
    return refused
