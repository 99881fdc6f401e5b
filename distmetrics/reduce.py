"""Packing samples and reducing them across ranks: at most one collective per reduce kind.

A :class:`~distmetrics.samples.Sample` is ``(name, value, reduce)``, or a vector: a 1-D tensor with one name per
element (every module's norm, every layer's statistic), which enters a pack as one slice.
At a log step :meth:`Reducer.reduce` packs

* every ``sum`` and ``mean`` value into one float64 tensor → one ``all_reduce(SUM)``. Each
  name has two lanes: value·weight and weight (1 for a sum, so the second lane counts the
  ranks that sent the name; a name no rank sent this time is absent, never a 0);
* every ``max``, ``min`` and ``minmax`` value into one int64 tensor → one ``all_reduce(MAX)``.
  Each lane holds an order-preserving key of the float32 value in its high 32 bits and the
  rank in its low 32 bits, so the maximum yields the extreme *and* the rank that holds it;
  a minimum is the maximum of ``-v``. NaN wins both, so a NaN on any rank is never hidden;
* every ``all`` value into one ``[world, 2n]`` float64 tensor (values and a presence mask)
  → one ``all_gather_into_tensor``.

Each pack is built where the values live (:mod:`distmetrics.packs`): values on a device as
device tensors (no Python object per element, one copy to the host per pack); values already
on the host (numbers, CPU tensors) as one Python list, which costs less than the tensor
operations' dispatch. A single process (no process group) packs the same way and skips the
collectives.

Ranks may hold different names (pipeline stages own different layers). The packed layout is
the union of names, agreed when some rank's names change and cached. The MAX pack always goes
first and carries control lanes: "my names are not all in the cached layout", a digest of the
layout, and the step (ranks out of step raise instead of mixing steps). When any rank raises
the flag, every rank learns it from the same collective, renegotiates and repeats the MAX pack;
in steady state no extra collective is issued. Negotiation gathers an 8-byte digest and a size
from every rank, then broadcasts each *distinct* name set once from the lowest rank holding
it: its payload grows with the number of distinct sets (pipeline stages × expert ranks), not
with the world size. Absent names are filled with the identity of their reduction, so a
missing metric never hangs nor mixes values. Names the ranks disagree on are left out, a
vector's other elements kept, for as long as the ranks send them (:mod:`distmetrics.refusals`), and
so are names agreed already by a reducer of another kind of record beside this one (a name in train
records on one rank and in eval records on another would make one tag hold both).

This module knows tensors and process groups, not what the metrics mean.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .maxkeys import HOST_DECODE_LANES, decode_max
from .packing import (CONTROL_LANES, PackLayout, collective_device, decode_all, decode_entries, decode_sum, digest,
                      encode_entries, entries_of, gather_single, global_rank, value_device)
from .packs import (all_row_on_host, all_row_tensor, interleave, max_lanes_on_host, max_pack,
                    sum_lanes_on_host, sum_pack_tensor)
from .names import REDUCE_KINDS, NameClash, NameRegistry, check_reduce
from .peers import InCollective
from .per_rank import PerRank, some_ranks
from .refusals import Refusals, refused_beside
from .samples import Reduced, Sample

__all__ = ["Sample", "Reduced", "Reducer", "REDUCE_KINDS", "PerRank", "PackLayout", "check_reduce"]

KEPT_NEGOTIATIONS = 4
"""A name of the agreed layout that no rank sends at a negotiation stays in the layout (absent: its
reduction's identity, never written) through this many negotiations in a row: name sets that take
turns between log steps settle on their union instead of negotiating again at every log step."""


def _writer(name: str) -> str:
    """Who sent a name, for a message: a user's collector, or the Monitor."""
    return f"the {name!r} collector" if name else "the Monitor (monitor.record, monitor.step or its own collectors)"


def _written_clashes(union: dict[str, str], origin: Optional[dict[str, int]] = None) -> dict[str, str]:
    """The names of a union in which one name writes what another writes (``x`` as ``minmax`` on
    one rank writes ``x/max``, which another rank sends as a name of its own; ``x/rank0`` beside an
    ``all`` ``x``), both of each pair, with why: one value would replace the other in the record.
    The rules of :class:`~distmetrics.names.NameRegistry`, which each rank applies to its own names.
    Every rank holds the same union, in the same order, so every rank finds the same names;
    ``origin`` gives the rank that sent each name, for the message."""
    registry = NameRegistry()
    clashes: dict[str, str] = {}
    for name, kind in union.items():
        try:
            sent = f"rank {origin[name]}" if origin and name in origin else "some rank"
            registry.add(name, kind, f"metric {name!r} from {sent}", names_it=True)
        except NameClash as clash:
            for each in (name, clash.other):
                if each is not None:
                    clashes.setdefault(each, str(clash))
    return clashes


class Reducer:
    """Reduces lists of samples across a process group with ≤ 1 collective per kind.

    ``group`` is the process group (default: the world); with no initialised process group
    the reduction is local. ``collectives`` counts the collectives issued and
    ``negotiation_bytes`` the bytes this rank received while agreeing on names (tests and
    benchmarks read both).
    """

    host_packs = True
    """Build a pack as a Python list where every value is on the host (a few list operations cost
    less than the tensor operations' dispatch); False: always as tensors where the values live,
    as a GPU's values are (tests run both)."""

    def __init__(self, group: Optional[Any] = None, device: Optional[torch.device] = None, guard: Any = None,
                 call: str = "reduce", world: Optional[int] = None, records: str = "these records") -> None:
        self.group = group
        self.world = world
        """The number of ranks the reduction is for (the Monitor's), checked at every :meth:`reduce`;
        None: whatever the process group has."""
        self.guard = guard  # a CollectiveGuard: every rank must arrive at this call first
        self.call = call
        self.records = records
        """What its reductions are written as, for messages ("eval records (monitor.log_eval)")."""
        self._beside: list[Reducer] = []  # reducers of other records whose names share tags with these
        self._written: Optional[NameRegistry] = None  # what the names agreed so far write, where some reducer is beside
        self._call_coded: tuple = (None, 0)  # (call, its code)
        self._device = device
        self._layout: Optional[PackLayout] = None
        self._unsent: dict[str, int] = {}  # a name the layout keeps → negotiations in a row it was not sent at
        self._no_all_steps = 0  # log steps in a row at which no rank sent an 'all' value (the layout holds some)
        self._kinds: dict[str, str] = {}
        self.kinds = self._kinds
        """Every name's reduce kind on this rank so far (read only: a collector's samples checked ahead)."""
        self._agreed: dict[str, str] = {}  # every name's kind in any agreed layout: the same on every rank
        self.writers: dict[str, str] = {}
        """The names of the agreed layout that a user's collector sends, and its name (the same on every rank):
        a rank that sends one from another writer negotiates again, and is refused."""
        self.refused: Optional[ValueError] = None
        """Names whose reduce kind differs between ranks (or from an earlier log step), or that would
        write one key, found by the last negotiation: left out of this reduction (the rest of a vector
        is kept), for the caller to raise once the rest is written; set at each reduction they are left
        out of."""
        self._refusals: Optional[Refusals] = None  # the names the last negotiation refused
        self._checked: set = set()  # (names, reduce) of vector samples whose kinds were checked
        self._last_names: Optional[list] = None  # (names or name, reduce) per sample of the last reduction
        self._group_ranks: Optional[tuple] = None  # (size, the group's global ranks where not 0..size-1)
        self.collectives = 0
        self.negotiations = 0
        self.negotiation_bytes = 0

    def shares_tags_with(self, other: "Reducer") -> None:
        """``other`` reduces another kind of record whose names are tags in the same sinks (eval records
        beside train records): a name already agreed in one is refused in the other's negotiations. A
        rank's own check sees its own calls only; the agreed names are the same on every rank, so
        every rank refuses alike, with no collective of its own."""
        for mine, theirs in ((self, other), (other, self)):
            mine._beside.append(theirs)
            if mine._written is None:
                mine._written = NameRegistry()

    @property
    def distributed(self) -> bool:
        """True when there is a process group of more than one rank to reduce over."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def check_world(self, call: str) -> None:
        """Raise, before any collective, where the process group no longer has :attr:`world` ranks:
        destroyed before ``close()`` (reduced alone, one rank's values were written as the job's),
        or made after a 1-rank Monitor (each rank wrote its own values as the job's)."""
        if self.world is None:
            return
        now = dist.get_world_size(self.group) if self.distributed else 1
        if now == self.world:
            return
        if self.world > 1:
            where = "is not initialised now (destroy_process_group() before close()?)" if now == 1 else \
                f"has {now} ranks now"
            raise RuntimeError(f"{call}: this Monitor was made for {self.world} ranks, but torch.distributed {where}: "
                               "one rank's values are not the job's, and nothing is written; close the Monitor on "
                               "every rank before destroying the process group")
        raise RuntimeError(f"{call}: this Monitor was made before init_process_group, for 1 rank, but the process "
                           f"group has {now} ranks now: each rank would write its own values as the job's; make the "
                           "Monitor after init_process_group")

    @property
    def device(self) -> torch.device:
        """Where packs travel: CUDA for NCCL, else CPU."""
        if self._device is None:
            self._device = collective_device(self.group) if self.distributed else torch.device("cpu")
        return self._device

    def reduce(self, samples: Sequence[Sample], tag: int = 0, steps: int = 0) -> Reduced:
        """Reduce this rank's samples with every other rank's; all ranks must call it together.

        ``tag`` (the step number) and ``steps`` (the ``monitor.step`` calls the values cover) must
        be equal on every rank: they travel in the MAX pack's control lanes, and a mismatch (ranks
        out of step, a rank that skipped a step) raises on every rank instead of mixing values of
        different steps.
        """
        samples = self._check(samples)
        self.check_world(self.call)
        distributed = self.distributed
        if distributed and self.guard is not None:
            self.guard.enter(self.call, tag)
        if not distributed:
            given = samples
            if self._refusals is not None:  # as between ranks: a clash that lasts is left out again
                kept, sent = self._refusals.leave_out(samples)
                if sent == self._refusals.sent:
                    samples = kept
                else:  # the names refused changed: the clash may be over
                    self._layout = None
            if self._layout is None or not self._fits(samples):  # settled as given: a clash that lasts stays
                entries = entries_of(given)
                union = {entry[0]: entry[1] for entry in entries}
                writers = {entry[0]: entry[2] for entry in entries if len(entry) > 2}
                samples = self._settle(given, union, {}, dict.fromkeys(union, 0), writers)
            lanes = self._max_pack(samples, tag, stale=False)[CONTROL_LANES:]
            if self._refusals is not None:  # the rest is written, then the caller raises
                self.refused = self._refusals.error()
        else:
            given, moved = samples, False
            if self._layout is None:
                samples = self._negotiate(given, tag)
            elif self._refusals is not None:  # a clash that lasts is left out again, not negotiated again
                samples, sent = self._refusals.leave_out(given)
                moved = sent != self._refusals.sent  # this rank's refused names changed: the clash may be over
            lanes = self._all_reduce_max(samples, tag, steps, moved)
            if lanes is None:  # some rank holds a name the cached layout lacks
                samples = self._negotiate(given, tag)
                lanes = self._all_reduce_max(samples, tag, steps)
                assert lanes is not None
            if self._refusals is not None:  # the same on every rank: the rest is written, then the caller raises
                self.refused = self._refusals.error()
        layout = self._layout
        result = Reduced(kinds=layout.kinds, layout=layout)
        decode_max(layout, lanes, result)
        if layout.n_sum:
            decode_sum(layout, *self._sum_pack(samples, distributed, tag), result)
        if layout.n_all:
            self._gather_all(samples, result, distributed, tag)
            if not result.per_rank:
                self._drop_unsent_all(layout)
            else:
                self._no_all_steps = 0
        return result

    def _drop_unsent_all(self, layout: PackLayout) -> None:
        """No rank sent any ``all`` value at :data:`KEPT_NEGOTIATIONS` log steps in a row: the ``all`` names
        leave the layout, so that the all-gather is not made for nothing at every log step after it (an
        ``all`` metric recorded once). Decided from the gathered rows: the same on every rank. (One absent
        name beside others sent costs no collective: it is left to the negotiations' count.)"""
        self._no_all_steps += 1
        if self._no_all_steps >= KEPT_NEGOTIATIONS:  # a rank that sends one again: negotiated again, as new
            self._layout = PackLayout([entry for entry in layout.entries if entry[0] not in layout.all_index])
            self._unsent = {name: count for name, count in self._unsent.items() if name not in layout.all_index}
            self._no_all_steps = 0

    # --- checks --------------------------------------------------------------------------
    def _check(self, samples: Sequence[Sample]) -> list[Sample]:
        """Refuse the samples before any collective; the reducer remembers kinds only once all pass.
        The same names in the same samples as the last reduction (the usual log step) passed then."""
        names = [(s.names if s.names is not None else s.name, s.reduce) if isinstance(s, Sample) else None
                 for s in samples]
        last = self._last_names
        if last is not None and len(names) == len(last) and all(  # a vector's names: the same tuple
                a is not None and (a[0] is b[0] or type(a[0]) is str and a[0] == b[0]) and a[1] == b[1]
                for a, b in zip(names, last)):
            return list(samples)
        checked = self._check_all(samples)
        self._last_names = names
        return checked

    def _check_all(self, samples: Sequence[Sample]) -> list[Sample]:
        seen: set = set()
        kinds: dict[str, str] = {}  # names seen for the first time (or in a vector not yet checked)
        vectors: list = []
        for s in samples:
            if not isinstance(s, Sample):
                raise TypeError(f"expected Sample, got {type(s).__name__}: {s!r}")
            names = s.names if s.names is not None else (s.name,)
            unchecked = s.names is None or (s.names, s.reduce) not in self._checked
            if unchecked and s.names is not None and len(set(names)) != len(names):
                raise ValueError(f"vector sample {s.name!r} names an element twice")
            if not seen.isdisjoint(names):
                raise ValueError(f"metric(s) {sorted(seen.intersection(names))[:5]} appear twice in one reduction")
            seen.update(names)
            if unchecked:
                for name in names:
                    known = self._kinds.get(name, s.reduce)
                    if known != s.reduce:
                        raise ValueError(f"metric {name!r} was reduced as {known!r} before and now as "
                                         f"{s.reduce!r}; a name keeps one reduce kind for the whole run")
                    kinds[name] = s.reduce
                if s.names is not None:
                    vectors.append((s.names, s.reduce))
        self._kinds.update(kinds)
        self._checked.update(vectors)
        return list(samples)

    def _fits(self, samples: list[Sample]) -> bool:
        """Are all of this rank's names in the cached layout with their kinds and writers?"""
        kinds, writers = self._layout.kinds, self.writers
        for s in samples:
            if s.names is None:
                if kinds.get(s.name) != s.reduce:
                    return False
                name = s.name
            elif self._layout.vector_base(s.names, s.reduce) is None:
                return False
            elif not s.names:
                continue
            else:
                name = s.names[0]  # a vector's elements are one writer's
            if (writers.get(name, "") if writers else "") != s.writer:  # and from the writer agreed
                return False
        return True

    # --- negotiation ---------------------------------------------------------------------
    def _negotiate(self, samples: list[Sample], tag: int) -> list[Sample]:
        """Agree on the union of names: every rank's digest and payload size in one gather,
        then one broadcast per distinct name set, from the lowest rank holding it. A name whose
        kind differs between ranks, or from an earlier log step, and two names that would write one
        key, are left out (every rank sees the same payloads, so every rank leaves them out) and kept
        for later log steps; returns ``samples`` without those names (a vector keeps its other elements)."""
        payload = encode_entries(sorted(entries_of(samples)))
        world = dist.get_world_size(self.group)
        device = self.device
        head = torch.tensor([digest(payload), len(payload)], dtype=torch.int64, device=device)
        table = torch.empty(world * 2, dtype=torch.int64, device=device)
        with InCollective("the negotiation of metric names (an all_gather of their digests)", self.call, tag):
            gather_single()(table, head, group=self.group)
        self.collectives += 1
        self.negotiations += 1
        rows = table.view(world, 2).cpu().tolist()
        self.negotiation_bytes += table.numel() * 8
        me = dist.get_rank(self.group)
        union: dict[str, str] = {}
        refused: dict[str, str] = {}  # name -> why
        origin: dict[str, int] = {}  # name -> the (global) rank that sent it first, for messages
        senders: dict[int, tuple[int, int]] = {}
        writers: dict[str, str] = {}  # name -> the user's collector that sent it first ('' for the Monitor's)
        for r, (name_set, size) in enumerate(rows):
            senders.setdefault(name_set, (r, size))
        for sender, size in sorted(senders.values()):
            if sender == me:
                buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if size else \
                    torch.empty(0, dtype=torch.uint8, device=device)
            else:
                buffer = torch.empty(size, dtype=torch.uint8, device=device)
            if size:
                with InCollective("the negotiation of metric names (one rank's names broadcast)", self.call, tag):
                    dist.broadcast(buffer, src=global_rank(self.group, sender), group=self.group)
                self.collectives += 1
                self.negotiation_bytes += size
            rank = global_rank(self.group, sender)
            for name, kind, *writer in decode_entries(bytes(buffer.cpu().numpy()) if sender != me else payload):
                origin.setdefault(name, rank)
                if union.setdefault(name, kind) != kind and name not in refused:
                    refused[name] = (f"metric {name!r} is reduced as {union[name]!r} on rank {origin[name]} and "
                                     f"{kind!r} on rank {rank}; every rank must use the same reduce kind for a name")
                by = writer[0] if writer else ""
                if writers.setdefault(name, by) != by and name not in refused:
                    refused[name] = (f"metric {name!r} is sent by {_writer(writers[name])} on rank {origin[name]} "
                                     f"and by {_writer(by)} on rank {rank}: a name is one writer's (the two writers' "
                                     "values would be reduced as one metric); give one of them another name")
        return self._settle(samples, union, refused, origin, writers)

    def _settle(self, samples: list[Sample], union: dict[str, str], refused: dict[str, str],
                origin: dict[str, int], writers: dict[str, str]) -> list[Sample]:
        """The layout of the names sent (``union``: the same on every rank), less those refused (``refused``,
        found while the ranks' names were joined, and those refused here), and the refusals; returns
        ``samples`` without the refused names. A single process settles its own names here too: two of them
        that would write one key are refused as between ranks (``y`` as ``minmax`` writes ``y/max``)."""
        for name, kind in union.items():  # a rank's own check sees its own calls only
            if name not in refused and self._agreed.get(name, kind) != kind:
                refused[name] = (f"metric {name!r} was reduced as {self._agreed[name]!r} at an earlier log step "
                                 f"and now as {kind!r} on rank {origin[name]}; a name keeps one reduce kind "
                                 "for the whole run")
        for name in refused:
            del union[name]
            if name not in self._agreed:  # no kind was agreed: this rank's own check forgets the one it sent,
                self._kinds.pop(name, None)  # or a rank that sent another kind once was refused it for good
        if refused and self._checked:
            self._checked = {entry for entry in self._checked if refused.keys().isdisjoint(entry[0])}
        for name, why in refused_beside(union, origin, self.records, [r._written for r in self._beside]).items():
            del union[name]
            refused[name] = why
        clashes = _written_clashes(union, origin)  # left out too, both names of each pair, then raised like the rest
        for name, why in clashes.items():
            del union[name]
            refused[name] = why
        for name, kind in union.items():
            if name not in self._agreed:
                self._agreed[name] = kind
                if self._written is not None and name[:1] != "_":  # internal lanes are never written
                    self._written.note(name, kind, f"metric {name!r} ({kind}) from rank {origin[name]} in "
                                                   f"{self.records}")
        kept = self._kept(union, refused)
        for name in _written_clashes({**union, **kept}) if kept else ():  # with a name sent now: not kept
            kept.pop(name, None)
        self._layout = PackLayout([*union.items(), *kept.items()])
        self.writers = {name: by for name in (*union, *kept)
                        if (by := writers.get(name) if name in union else self.writers.get(name))}
        self._refusals = Refusals(refused) if refused else None
        return samples if self._refusals is None else self._refusals.first(samples)

    def _kept(self, sent: dict[str, str], refused: dict[str, str]) -> dict[str, str]:
        """The names of the cached layout that no rank sent at this negotiation and that stay in the
        next one (see :data:`KEPT_NEGOTIATIONS`), with their kinds; the same on every rank."""
        kept: dict[str, str] = {}
        unsent: dict[str, int] = {}
        for name, kind in self._layout.entries if self._layout is not None else ():
            if name not in sent and name not in refused and self._unsent.get(name, 0) < KEPT_NEGOTIATIONS:
                kept[name] = kind
                unsent[name] = self._unsent.get(name, 0) + 1
        self._unsent = unsent
        return kept

    # --- MAX pack (+ control lanes) -----------------------------------------------------
    def _max_pack(self, samples: list[Sample], tag: int, stale: bool, steps: int = 0) -> Union[torch.Tensor, list[int]]:
        """The MAX pack: a list of keys where every max/min value is a number on the host, else a tensor."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        call = self._call_code()
        lanes = max_lanes_on_host(self._layout, samples, tag, stale, rank, call, steps) if self.host_packs else None
        if lanes is not None:
            return lanes
        device = self.device if self.distributed else value_device(samples)
        return max_pack(self._layout, samples, tag, stale, rank, device, call, steps)

    def _call_code(self) -> int:
        """A 32-bit code of :attr:`call` (kept per name): folded into the MAX pack's digest lanes."""
        if self._call_coded[0] != self.call:
            self._call_coded = (self.call, zlib.crc32(self.call.encode()))
        return self._call_coded[1]

    def _all_reduce_max(self, samples: list[Sample], tag: int, steps: int = 0,
                        stale: bool = False) -> Optional[Union[torch.Tensor, list[int]]]:
        pack = self._max_pack(samples, tag, stale=stale or not self._fits(samples), steps=steps)
        pack = torch.tensor(pack, dtype=torch.int64) if isinstance(pack, list) else pack
        pack = pack.to(self.device)
        with InCollective("the MAX all_reduce (max/min metrics and the ranks' step check)", self.call, tag):
            dist.all_reduce(pack, op=dist.ReduceOp.MAX, group=self.group)
        self.collectives += 1
        pack = pack.cpu()
        lanes = pack.tolist() if self._layout.n_max <= HOST_DECODE_LANES else None  # decoded from this list
        control = lanes[:CONTROL_LANES] if lanes is not None else pack[:CONTROL_LANES].tolist()
        if control[0] != 0:
            return None
        mark = self._layout.mark(self._call_code())
        if control[1] != mark or control[2] != -mark:  # every rank sees the same lanes: every rank raises
            raise RuntimeError(
                f"distmetrics: ranks made different monitor calls at step {tag}: this rank is in {self.call} "
                "(e.g. log_eval on one rank and a log step on another); every rank must make the same monitor "
                "calls with the same step numbers (with hang_timeout_s on, the arrival check names the "
                "other ranks' calls first). Where every rank made the same call, the ranks' metric layouts "
                "differ: a bug, please report it with the metric names in use")
        if control[3] != tag or control[4] != -tag:  # every rank sees it: one more gather names the ranks
            raise RuntimeError(
                f"distmetrics: ranks are out of step: this reduction was called at {self._whose(tag, tag, 'step ')} "
                f"(this rank: step {tag}); every rank must call monitor.step with the same step numbers")
        if control[5] != steps or control[6] != -steps:
            raise RuntimeError(
                f"distmetrics: ranks made different numbers of monitor.step calls before the log step of step "
                f"{tag}: {self._whose(tag, steps)} (this rank: {steps}), so their values cover different "
                "steps; every rank must call monitor.step at every step, with the same step numbers (a step "
                "number skipped on one rank is a call it did not make; skipped=True for a step the optimizer "
                "skipped)")
        return lanes[CONTROL_LANES:] if lanes is not None else pack[CONTROL_LANES:]

    def _whose(self, tag: int, value: int, unit: str = "") -> str:
        """Which ranks hold which value of a control lane (a step, a count of calls), from one gather
        of every rank's value: made only where the MAX pack found ranks differ, on every rank alike."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        with InCollective("the all_gather naming the ranks out of step", self.call, tag):
            dist.all_gather(rows, mine, group=self.group)
        ranks: dict[int, list[int]] = {}
        for rank, held in enumerate(torch.cat(rows).tolist()):  # one copy to the host
            ranks.setdefault(held, []).append(global_rank(self.group, rank))
        parts = [f"{unit}{v} on {some_ranks(r)}" for v, r in sorted(ranks.items())]
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]

    # --- SUM pack ------------------------------------------------------------------------
    def _sum_pack(self, samples: list[Sample], distributed: bool,
                  tag: int) -> tuple[Sequence[float], Sequence[float]]:
        """The SUM pack reduced: (value·weight, weight) of every name, in the layout's order."""
        lanes = sum_lanes_on_host(self._layout, samples) if self.host_packs else None
        if lanes is not None and not distributed:
            return lanes
        if lanes is not None:
            pack = torch.tensor(interleave(*lanes), dtype=torch.float64).to(self.device)
        else:
            pack = sum_pack_tensor(self._layout, samples, self.device if distributed else value_device(samples))
        if distributed:
            pack = pack.to(self.device)
            with InCollective("the SUM all_reduce (sum and mean metrics)", self.call, tag):
                dist.all_reduce(pack, op=dist.ReduceOp.SUM, group=self.group)
            self.collectives += 1
        totals = pack.cpu().tolist()
        return totals[0::2], totals[1::2]

    def _rank_ids(self, world: int) -> Optional[list]:
        """The global rank of each of the group's ranks, or None where they are 0, 1, ... (the
        world); read once (a call per rank: a loop of thousands at every log step)."""
        if self._group_ranks is None or self._group_ranks[0] != world:
            ranks = [global_rank(self.group, r) for r in range(world)]
            self._group_ranks = (world, None if ranks == list(range(world)) else ranks)
        return self._group_ranks[1]

    # --- ALL pack ------------------------------------------------------------------------
    def _gather_all(self, samples: list[Sample], result: Reduced, distributed: bool, tag: int) -> None:
        layout = self._layout
        n = layout.n_all
        row = all_row_on_host(layout, samples) if self.host_packs else None
        if row is not None:
            rows, packed = [row], torch.tensor(row, dtype=torch.float64) if distributed else None
        else:
            packed = all_row_tensor(layout, samples, self.device if distributed else value_device(samples))
            rows = None if distributed else packed.view(1, 2 * n).cpu().tolist()  # else: the gathered rows
        # in the group's order, each value's global rank kept where they differ (a group other than the world)
        kept = [dist.get_rank()] if dist.is_available() and dist.is_initialized() and dist.get_rank() else None
        if distributed:
            world = dist.get_world_size(self.group)
            out = torch.empty(world * 2 * n, dtype=torch.float64, device=self.device)
            with InCollective("the all_gather of every rank's values (metrics reduced as 'all')", self.call, tag):
                gather_single()(out, packed.to(self.device), group=self.group)
            self.collectives += 1
            rows = out.view(world, 2 * n).cpu().tolist()
            kept = self._rank_ids(world)
        for name, values in decode_all(layout, rows).items():
            result.per_rank[name] = PerRank(values, kept)
