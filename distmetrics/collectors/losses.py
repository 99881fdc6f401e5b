"""Loss by category: per-sample losses with a category per sample (a data source, a language,
a task), accumulated on device and written as ``<split>/loss/<category>``.

Training samples belong to the step ``monitor.step`` reports next: they wait there and join the
interval at that call, or are dropped with it where the step is skipped, as its loss is left out of
``train/loss``. Evaluation samples join at once (``log_eval`` writes them).

Weights are counts (finite, >= 0): given as host values they are checked at the call; a tensor is not
read there (a device sync), so its bad weights are counted on its device and the count travels in the
log step's (or ``log_eval``'s) reduction, where any on any rank leaves the split's categories out of the
record and raises, as bad ``tokens`` do."""

from __future__ import annotations

import numbers
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from ..names import check_name, outside_inference, user_tensor
from ..packing import weighted
from .base import Alert, LogContext, Sample

__all__ = ["CategoryLosses", "LossCollector"]

_LOOKUPS_KEPT = 4
"""Distinct ``names=`` contents whose lookups a split keeps (the least recently used goes first): each
holds its key, the contents, so a ``names=`` that grows by an id per call (ids named as they are seen)
holds four copies of a million-entry map at most, not sixteen; a few maps used in turn stay made."""


_SLACK = 64
"""Categories with no sample since the last log step kept beside the others (see ``take_samples``)."""


class CategoryLosses:
    """Per-category sums and weights of per-sample losses, on device, for one split."""

    def __init__(self, prefix: str, per_step: bool = False) -> None:
        self.prefix = prefix  # "train/loss" or "eval/loss"
        self.per_step = per_step  # samples wait for the step's end (:meth:`end_step`)
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self._sums: Optional[torch.Tensor] = None  # the interval's Σ loss·w per category
        self._weights: Optional[torch.Tensor] = None  # ... and Σ w
        self._step_sums: Optional[torch.Tensor] = None  # the same since the last end_step (per_step)
        self._step_weights: Optional[torch.Tensor] = None
        self._names_made: tuple = (-1, ())  # (categories named, their record names) at the last log step
        self._bad: Optional[torch.Tensor] = None  # weights given in tensors that are NaN, inf or < 0 (a count)
        self._step_bad: Optional[torch.Tensor] = None  # ... since the last end_step (per_step)
        self.bad_lane = f"_{prefix}/bad_weights"
        """Internal lane: that count, summed over ranks."""
        self._lookups: dict[Any, dict] = {}  # names= contents -> {device: (its ids sorted, their slots)}
        self._touched: set[int] = set()  # the slots the interval's samples went to (on the host: no device read)
        self._step_touched: set[int] = set()  # ... and those of the step under way (per_step)
        self._slot_sets: dict[int, tuple] = {}  # id(a lookup's host slots) -> (them, as a set)

    @outside_inference
    def record(self, losses: torch.Tensor, categories: Union[Sequence, torch.Tensor],
               weights: Optional[torch.Tensor] = None, names: Union[None, Sequence[str], dict] = None) -> None:
        """Add per-sample ``losses`` under their categories (see ``Monitor.record_losses``)."""
        if not isinstance(losses, torch.Tensor):
            raise TypeError(f"record_losses(per_sample_loss=...): expected a tensor of per-sample losses "
                            f"(reduction='none'), got {type(losses).__name__} {losses!r:.80}")
        losses = user_tensor(losses, "record_losses(per_sample_loss)")
        weights = user_tensor(weights, "record_losses(weights=...)")
        categories = user_tensor(categories, "record_losses(categories)")
        losses = losses.detach().reshape(-1).to(torch.float64)
        n = losses.numel()
        w, bad = torch.ones_like(losses), None
        if weights is not None:
            # host values (Python floats, a numpy array) straight to float64: torch.as_tensor made floats float32
            w = (weights if isinstance(weights, torch.Tensor) else torch.as_tensor(weights, dtype=torch.float64))
            w = w.detach().reshape(-1).to(torch.float64)
            if not isinstance(weights, torch.Tensor):  # host values (a list, a numpy array): read now
                _check_weights(w)
            w = w.to(losses.device)
            if isinstance(weights, torch.Tensor):  # not read here: its bad weights are counted on the device
                bad = (~(torch.isfinite(w) & (w >= 0))).sum().to(torch.float64)
        if w.numel() != n:
            raise ValueError(f"record_losses: {n} losses but {w.numel()} weights")
        if isinstance(categories, torch.Tensor):
            if categories.is_floating_point() or categories.is_complex():  # a bool mask is the ids 0 and 1
                raise TypeError(f"record_losses(categories=...): a tensor of categories holds integer ids, got "
                                f"{categories.dtype} (its ids were cut to integers)")
            if categories.numel() != n:
                raise ValueError(f"record_losses: {n} losses but {categories.numel()} categories")
            if names is None:
                raise ValueError("record_losses: integer category tensors need names= (a list or dict id → name), "
                                 "so the monitor knows every category without reading the tensor")
            ids = categories.reshape(-1).to(device=losses.device, dtype=torch.long).contiguous()
            # an id names= does not name (an ignore index such as -1 or -100, padding) counts in no
            # category: its loss and weight are zeroed in slot 0 (no host sync here)
            index, named = _slots_of(ids, *self._lookup(names, losses.device))
            used = self._named_slots(names)
            losses = torch.where(named, losses, 0.0)
            w = torch.where(named, w, 0.0)
            weights = w
        else:
            categories = list(categories)
            if len(categories) != n:
                raise ValueError(f"record_losses: {n} losses but {len(categories)} categories")
            if names is None:  # each distinct category checked, named and given its slot once, not per sample
                slot = {label: self._slot(name) for label, name in _labels(categories).items()}
                slots = [slot[c] for c in categories]
                used = slot.values()
            else:
                used = self._named_slots(names)  # checked, and every category it names known (and kept in the
                # vector), as for a tensor of ids
                labels = [_named(names, c) for c in categories]
                if None in labels:  # an id names= does not name (-100, -1: an ignore index) counts in no category
                    kept = [i for i, label in enumerate(labels) if label is not None]
                    where = _to_device(torch.tensor(kept, dtype=torch.long), losses.device)
                    losses, w, labels = losses[where], w[where], [labels[i] for i in kept]
                    weights = None if weights is None else w
                slots = [self._slot(c) for c in labels]
            index = _to_device(torch.tensor(slots, dtype=torch.long), losses.device)
        (self._step_touched if self.per_step else self._touched).update(used)
        if self.per_step:
            self._step_sums, self._step_weights = sums, totals = _grown(self._step_sums, self._step_weights,
                                                                        len(self.names), losses.device)
            self._step_bad = _plus(self._step_bad, bad)
        else:
            self._sums, self._weights = sums, totals = _grown(self._sums, self._weights, len(self.names),
                                                              losses.device)
            self._bad = _plus(self._bad, bad)
        # a sample of weight 0 counts for nothing, even its NaN (the loss of an all-masked sample)
        sums.index_add_(0, index, losses if weights is None else weighted(losses, w))
        totals.index_add_(0, index, w)

    def pending(self) -> bool:
        """Whether samples wait: for a step's end (``per_step``: :meth:`end_step`), else for the next
        :meth:`take_samples` (``log_eval``'s)."""
        return (self._step_sums if self.per_step else self._sums) is not None

    @outside_inference
    def end_step(self, skipped: bool) -> None:
        """The step the samples since the last call belong to has ended: they join the interval,
        or are dropped where the step was ``skipped`` (on device: no host sync)."""
        sums, weights, self._step_sums, self._step_weights = self._step_sums, self._step_weights, None, None
        bad, self._step_bad = self._step_bad, None
        touched, self._step_touched = self._step_touched, set()
        if sums is None or skipped:
            return
        self._touched |= touched
        self._bad = _plus(self._bad, bad)
        if self._sums is None:
            self._sums, self._weights = sums, weights
            return
        size = len(self.names)  # either may lack the categories named after its last sample
        self._sums, self._weights = _grown(self._sums, self._weights, size, sums.device)
        sums, weights = _grown(sums, weights, size, sums.device)
        self._sums += sums
        self._weights += weights

    def take_samples(self) -> list[Sample]:
        """One vector sample of the categories' (Σ loss·w, Σ w); then start again. Categories no sample
        went to since the last log step are let go once they are more than half of those named (and
        more than ``_SLACK``): a category per data shard or checkpoint made every log step's vector,
        its pack and its host work grow with every category the run ever named."""
        if self._sums is None:
            self._touched = set()
            return []
        # a category named in a skipped step only has no slot yet: it gets one of weight 0
        self._sums, self._weights = _grown(self._sums, self._weights, len(self.names), self._sums.device)
        keep = self._touched | self._step_touched
        if len(self.names) - len(keep) > max(_SLACK, len(self.names) // 2):
            self._keep_only(sorted(keep))
        self._touched = set()
        if self._names_made[0] != len(self.names):  # the same tuple while no category is added: the pack's
            # layout knows a vector by its names' tuple, and a new one each log step rebuilt its positions
            self._names_made = (len(self.names), tuple(f"{self.prefix}/{name}" for name in self.names))
        out = [Sample(self.prefix, self._sums, "mean", weight=self._weights, summed=True, names=self._names_made[1])]
        if self._bad is not None:
            out.append(Sample(self.bad_lane, self._bad, "sum"))
        self._sums = self._weights = self._bad = None
        return out

    def refuse_bad_weights(self, metrics: dict[str, Any], when: str) -> Optional[ValueError]:
        """Take the count of bad weights out of the reduced ``metrics``; where there are any (on any
        rank: the same everywhere), leave the split's categories out of the record and return the error
        to raise once it is written (``when``: the samples' steps or evaluation)."""
        bad = metrics.pop(self.bad_lane, None)
        if not bad:
            return None
        for name in [name for name in metrics if name.startswith(self.prefix + "/")]:
            del metrics[name]
        return ValueError(f"record_losses(weights=...): the weights given as tensors {when} held {bad:.0f} that are "
                          "NaN, inf or negative (summed over ranks); accepted values are finite numbers >= 0. The "
                          f"record was written without {self.prefix}/<category> (weighted by them)")

    def _lookup(self, names: Union[Sequence[str], dict],
                device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids ``names`` names, sorted, and each one's slot, on ``device`` (None: the host). Their
        size is that of ``names``, whatever its ids are: a table indexed by the id itself took
        max(id) + 1 slots (760 MB per call for an id of 1e8, and an id of 1e10 could not be held).
        Made once per contents of ``names`` (checked then) and per device, not per call."""
        try:
            key = _contents(names)
            tables = self._lookups.pop(key, None)
            if tables is not None:
                self._lookups[key] = tables  # the most recently used, last
        except TypeError:  # an unhashable id or name: refused by _table
            key, tables = None, None
        if tables is None:
            tables = {None: self._table(names)}
            if len(self._lookups) >= _LOOKUPS_KEPT:  # the least recently used goes
                del self._lookups[next(iter(self._lookups))]
            self._lookups[key] = tables
        if device not in tables:
            tables[device] = tuple(_to_device(t, device) for t in tables[None])
        return tables[device]

    def _table(self, names: Union[Sequence[str], dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_lookup`'s host tensors: ``names`` checked, and each category it names given a slot."""
        table = dict(enumerate(names)) if not isinstance(names, dict) else \
            {int(k) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k: v for k, v in names.items()}
        for key in table:  # numpy integer ids (a dict made from np.unique) as the ints they are
            if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < 2 ** 63:
                raise ValueError("record_losses: names= maps integer category ids >= 0 (below 2**63: ids travel as "
                                 f"int64) to names; got the id {key!r}")
        labels = _labels(table.values(), "names")  # checked as a list of categories is
        slots = {key: self._slot(labels[name]) for key, name in table.items()}
        ids = sorted(slots)
        return torch.tensor(ids, dtype=torch.long), torch.tensor([slots[i] for i in ids], dtype=torch.long)

    def _named_slots(self, names: Union[Sequence[str], dict]) -> frozenset:
        """The slots of the categories ``names`` names (the host table :meth:`_lookup` made), as a set."""
        slots = self._lookup(names)[1]
        cached = self._slot_sets.get(id(slots))
        if cached is None or cached[0] is not slots:
            cached = self._slot_sets[id(slots)] = (slots, frozenset(slots.tolist()))
            if len(self._slot_sets) > _LOOKUPS_KEPT:
                del self._slot_sets[next(iter(self._slot_sets))]
        return cached[1]

    def _keep_only(self, order: list[int]) -> None:
        """Keep the slots ``order`` lists, in that order (their sums, the step's too); the others'
        categories are named again, as new ones, when a sample goes to them."""
        new = {old: slot for slot, old in enumerate(order)}
        where = _to_device(torch.tensor(order, dtype=torch.long), self._sums.device)
        self._sums, self._weights = self._sums[where], self._weights[where]
        if self._step_sums is not None:
            step_sums, step_weights = _grown(self._step_sums, self._step_weights, len(self.names),
                                             self._step_sums.device)
            where = where.to(step_sums.device)
            self._step_sums, self._step_weights = step_sums[where], step_weights[where]
        self.names = [self.names[i] for i in order]
        self._index = {name: slot for slot, name in enumerate(self.names)}
        self._touched = {new[s] for s in self._touched}
        self._step_touched = {new[s] for s in self._step_touched}
        self._lookups.clear()  # their slot tables name the old slots
        self._slot_sets.clear()
        self._names_made = (-1, ())

    def _slot(self, name: str) -> int:
        if name not in self._index:
            if "/" in name:
                raise ValueError(f"record_losses: category {name!r} may not contain '/'")
            check_name(f"{self.prefix}/{name}", f"record_losses: category {name!r}")  # not empty, UTF-8
            self._index[name] = len(self.names)
            self.names.append(name)
        return self._index[name]


class LossCollector:
    """Training loss by category (``train/loss/<category>``), one vector per log step."""

    name = "losses"
    after = ()
    writes = ("train/loss/",)

    def __init__(self) -> None:
        self.train = CategoryLosses("train/loss", per_step=True)

    def split(self, name: str, eval_losses: CategoryLosses) -> CategoryLosses:
        """The accumulator of a split: ``train`` (written at the log step) or ``eval`` (kept by
        the evaluation log, written by ``log_eval``)."""
        if name not in ("train", "eval"):
            raise ValueError(f"record_losses: split={name!r}; accepted values are 'train', 'eval'")
        return self.train if name == "train" else eval_losses

    def end_step(self, skipped: bool) -> None:
        """``monitor.step`` ended a step: its training samples join the interval unless it was skipped."""
        self.train.end_step(skipped)

    def take_samples(self, ctx: LogContext) -> list[Sample]:
        """The interval's per-category sums."""
        return self.train.take_samples()

    def finalize(self, metrics: dict[str, Any], ctx: LogContext) -> list[Alert]:
        """Nothing to derive (the reduction already gives each category's mean); bad weights given
        in tensors leave the categories out and raise once the record is written."""
        refused = self.train.refuse_bad_weights(metrics, f"in the steps up to step {ctx.step}")
        if refused is not None:
            raise refused
        return []

    def close(self) -> None:
        """Nothing to release."""


def _contents(names: Union[Sequence[str], dict]) -> tuple:
    """``names`` as a key of its lookup: each (id, name) with their types (1 and True are equal keys, and
    True is refused as an id). A TypeError where one is unhashable."""
    pairs = names.items() if isinstance(names, dict) else enumerate(names)
    out = tuple((type(key), key, type(name), name) for key, name in pairs)
    hash(out)
    return out


def _slots_of(ids: torch.Tensor, named_ids: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id's slot (0 where ``named_ids`` lacks it) and whether it has one: a binary search of the
    sorted ``named_ids``, on the ids' device, in memory of the ids' size and the names' (no host sync)."""
    if not named_ids.numel():
        return torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    at = torch.searchsorted(named_ids, ids).clamp_(max=named_ids.numel() - 1)
    named = named_ids[at] == ids
    return torch.where(named, slots[at], 0), named


def _named(names: Union[Sequence[str], dict], category: Any) -> Optional[str]:
    """The name ``names`` (a list, or a dict id → name) gives an integer category id; None for an
    id it does not name (an ignore index such as -100 or -1), which counts in no category."""
    if isinstance(category, bool) or not isinstance(category, numbers.Integral):
        raise TypeError(f"record_losses(categories=...): with names= the categories are integer ids, got "
                        f"{type(category).__name__} {category!r:.40}")
    if isinstance(names, dict):
        return str(names[category]) if category in names else None
    return str(names[category]) if 0 <= category < len(names) else None


def _check_weights(weights: torch.Tensor) -> None:
    """Weights given as host values: finite and >= 0 (a negative one puts a category's mean outside its
    samples' range)."""
    bad = ~(torch.isfinite(weights) & (weights >= 0))
    if bool(bad.any()):
        at = int(bad.nonzero()[0])
        raise ValueError(f"record_losses(weights=...): the weight {float(weights[at])!r} of sample {at} is refused: "
                         "accepted values are finite numbers >= 0")


def _plus(total: Optional[torch.Tensor], more: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if more is None:
        return total
    return more if total is None else total + more.to(total.device)


def _grown(sums: Optional[torch.Tensor], weights: Optional[torch.Tensor], size: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-category sums and weights with ``size`` slots: zeros where None, padded with zeros
    where shorter (categories named since)."""
    if sums is None:
        return (torch.zeros(size, dtype=torch.float64, device=device),
                torch.zeros(size, dtype=torch.float64, device=device))
    if sums.numel() < size:
        pad = torch.zeros(size - sums.numel(), dtype=torch.float64, device=sums.device)
        return torch.cat([sums, pad]), torch.cat([weights, pad])
    return sums, weights


def _labels(categories: Iterable, what: str = "categories") -> dict:
    """Each distinct category label (in the order first given) → its name: a str as it is, an int
    (not a bool) as ``str()`` writes it. Other labels are refused (``str()`` named None "None" and a
    0-d tensor "tensor(0)", and True merged with 1), and so are two labels of one call that give one
    name (1 and "1" merged into one category)."""
    for kind in set(map(type, categories)):  # every label's type, not the distinct labels': True == 1
        if not issubclass(kind, str) and (not issubclass(kind, numbers.Integral) or issubclass(kind, bool)):
            label = next(c for c in categories if type(c) is kind)
            raise TypeError(f"record_losses({what}=...): a category is a str or an int (not a bool), got "
                            f"{kind.__name__} {label!r:.40}")
    named = {label: str(label) if isinstance(label, str) else str(int(label)) for label in dict.fromkeys(categories)}
    if len(set(named.values())) < len(named):
        first: dict = {}
        for label, name in named.items():
            if first.setdefault(name, label) is not label:
                raise ValueError(f"record_losses({what}=...): the categories {first[name]!r} and {label!r} are both "
                                 f"named {name!r}, so their losses would be one category's; give one of them")
    return named


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host index → device without making the host wait for queued device work."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
