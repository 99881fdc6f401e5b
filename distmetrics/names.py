"""The names and values a user hands the Monitor, checked at the call — before anything is
recorded, so a refused call changes nothing and a retry works.

A name must be a non-empty string that every sink can store (TensorBoard and W&B need valid
UTF-8: a lone surrogate is refused), not starting with ``_`` (internal lanes) or ``/``. Names also
must not collide: a reduce kind writes more than its name (``x/max`` and ``x/min_rank`` for a
``minmax`` ``x``, ``x/rank<r>`` in JSONL and ``x/mean`` for an ``all`` ``x``), and the Monitor's
collectors write names of their own, each declared in its ``writes`` (``train/loss``, the
throughput names, everything under ``memory/``, ...); a user's value that would write a name
another source writes raises a ``ValueError`` naming both instead of one silently overwriting
the other (or a log step refusing both).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import sys
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["NameRegistry", "NameClash", "REDUCE_KINDS", "EXACT_KINDS", "check_reduce", "check_name", "name_problem",
           "check_value",
           "check_step", "check_spellings", "written_names", "collector_label"]

REDUCE_KINDS = ("sum", "mean", "max", "min", "minmax", "all")
EXACT_KINDS = ("imax", "imin")
"""Internal lanes' (names starting with ``_``) exact integer max and min: the int64 itself in the MAX
pack, no rank beside it (an interval's wall time in ns, past float32's 7 digits)."""

_RANK = re.compile(r"^(.*)/rank\d+$")


def written_names(name: str, kind: str) -> list[str]:
    """Every name a value of this reduce kind writes (JSONL's per-rank names excepted)."""
    return {"sum": [name], "mean": [name], "max": [name, f"{name}/max_rank"], "min": [name, f"{name}/min_rank"],
            "minmax": [f"{name}/max", f"{name}/min", f"{name}/max_rank", f"{name}/min_rank"],
            "all": [name, f"{name}/max", f"{name}/min", f"{name}/mean"], "imax": [name], "imin": [name]}[kind]


def check_reduce(name: str, reduce: str) -> None:
    """Raise a clear error for an unknown reduce kind (before any collective)."""
    if reduce not in REDUCE_KINDS:
        raise ValueError(f"metric {name!r}: reduce={reduce!r} is not one of {', '.join(REDUCE_KINDS)}")


RECORD_KEYS = ("kind", "step", "time")
"""The keys of every metrics.jsonl record besides its metrics (``step`` is W&B's step metric too)."""


def name_problem(name: str) -> str:
    """What makes a name no sink's key, beside the rules of each kind of name ('' where nothing): an
    empty part (``a//b``), blank text, a control character (a newline splits a console line), text
    that is not valid UTF-8 (a lone surrogate: TensorBoard and W&B cannot store it)."""
    if "//" in name:
        return "it has an empty part ('//'); parts are joined by one '/'"
    if name.isspace():
        return "it is blank"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029" for c in name):
        return ("it holds a control character (a newline, a tab, NUL, U+0085, U+2028, ...), which splits or garbles "
                "console lines and lines of metrics.jsonl")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"it is not valid UTF-8 ({err.reason} at position {err.start}), which TensorBoard and W&B cannot "
                "store")
    return ""


def check_name(name: Any, what: str) -> None:
    """Raise a clear error for a name no sink can store or that the Monitor keeps for itself."""
    if not isinstance(name, str):
        raise TypeError(f"{what}: a metric name is a str, got {type(name).__name__} {name!r}")
    if not name or name.startswith(("_", "/")) or name.endswith("/"):
        raise ValueError(f"{what}: metric name {name!r} is refused: names are non-empty, do not start with '_' "
                         "(internal lanes) and do not start or end with '/'")
    odd = name_problem(name)
    if odd:
        raise ValueError(f"{what}: metric name {name!r} is refused: {odd}")
    if name in RECORD_KEYS:
        raise ValueError(f"{what}: metric name {name!r} is refused: every record's own keys are "
                         f"{', '.join(map(repr, RECORD_KEYS))} (a metric of that name replaced them in metrics.jsonl); "
                         f"give it a prefix, e.g. 'train/{name}'")


def check_value(value: Any, what: str, *args: Any) -> None:
    """A number (a Python or numpy number, not a bool) within float64's range, or a 1-element
    tensor (None is checked by the caller). The message names ``what % args`` (formatted only
    for a bad value: this runs for every sample). An int beyond float64 (``10**400``) failed
    inside a pack, after the other ranks had entered the collective."""
    if type(value) is float or type(value) is int and -_FLOAT_MAX <= value <= _FLOAT_MAX:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what % args if args else what}: expected a number or a 1-element tensor, got a "
                             f"tensor of shape {tuple(value.shape)}")
        if value.is_complex():  # its imaginary part was dropped without a word (a loss raised mid-call)
            raise TypeError(f"{what % args if args else what}: expected a real number, got a tensor of "
                            f"{value.dtype} (pass .real, .abs() or the value you mean)")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what % args if args else what}: expected a number or a 1-element tensor, got "
                        f"{type(value).__name__} {value!r:.100}")
    elif not _in_range(value):
        raise ValueError(f"{what % args if args else what}: {_shown(value)} is beyond float64's range (about "
                         "±1.8e308), in which every value is reduced")


def _in_range(value: Any) -> bool:
    """Whether a number converts to a float64 (an int or a Fraction beyond its range does not, nor
    a finite numpy longdouble past it, which float() makes inf)."""
    if isinstance(value, numbers.Rational):
        return -_FLOAT_MAX <= value <= _FLOAT_MAX
    converted = float(value)
    return not math.isinf(converted) or value == converted


_FLOAT_MAX = int(sys.float_info.max)


def _shown(value: Any) -> str:
    """A value as a message shows it: an integer of hundreds of digits by its first ones and its length."""
    text = repr(value)
    if len(text) <= 24:
        return text
    if isinstance(value, int):
        return f"{text[:12]}... ({len(text)} digits)"
    return f"{text[:24]}... ({len(text)} characters)"


def check_user_value(value: Any, what: str, *args: Any) -> None:
    """:func:`check_value` for a value a user hands over (``monitor.step``, ``record``,
    ``log_eval``, ``record_moe``): also no bool tensor (as no Python bool), no quantized tensor, no tensor on the meta
    device (it failed inside the reduction, after the other ranks had entered it) and no DTensor whose
    piece on this rank is not the value (a Replicate DTensor, ``loss_parallel``'s loss, is this rank's
    copy)."""
    check_value(value, what, *args)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:  # as a Python bool is: a mask's or a test's
        # result, counted as 0 or 1 without a word (tokens=mask.any() for mask.sum())
        raise TypeError(f"{what % args if args else what}: expected a number or a 1-element tensor, got a bool "
                        "tensor (convert a flag with .float(), or pass the count you mean)")
    if isinstance(value, torch.Tensor) and (type(value) is not torch.Tensor or value.is_meta
                                            or value.layout is not torch.strided or value.is_quantized):
        user_tensor(value, what % args if args else what)


def outside_inference(method: Callable) -> Callable:
    """``method`` run outside ``torch.inference_mode`` where called inside it (an evaluation's forward
    recording router statistics): accumulators it makes there would be inference tensors, which the
    next call outside it cannot add to in place (torch raises after the add: a sum counted, its weight
    not). Recorded tensors made in inference mode are read as they are."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False):
            return method(*args, **kwargs)
    return call


def user_tensor(value: Any, what: str) -> Any:
    """A tensor a user hands over whole (per-sample losses, counts per expert) as this rank's
    copy: refused on the meta device (no value), sparse, quantized (it raised torch's own error in the
    step, or in a GPU job's packs on that rank alone, after a collective), or as a DTensor whose piece is
    not the whole (Partial, Shard); a Replicate DTensor is this rank's copy."""
    if not isinstance(value, torch.Tensor) or (type(value) is torch.Tensor and not value.is_meta
                                               and value.layout is torch.strided and not value.is_quantized):
        return value
    if value.is_meta:
        raise ValueError(f"{what}: a tensor on the meta device holds no value")
    if value.is_quantized:
        raise TypeError(f"{what}: expected a number or a tensor of numbers, got a quantized tensor ({value.dtype}); "
                        "pass value.dequantize()")
    if value.layout is not torch.strided:
        raise ValueError(f"{what}: expected a dense tensor, got a {value.layout} one; pass value.to_dense()")
    if is_dtensor(value):
        if not all(p.is_replicate() for p in value.placements):
            raise ValueError(f"{what}: a DTensor with placements {tuple(value.placements)}: each rank's piece is not "
                             "the value; pass a Replicate DTensor (loss_parallel's loss) or value.full_tensor()")
        return value.to_local()
    return value


def local_value(value: Any) -> Any:
    """This rank's piece of a DTensor (``to_local()``), else ``value`` (``parallel.local_tensor``).
    Applied where a user's value comes in (a Replicate DTensor, checked by :func:`check_user_value`),
    so no collector sees a DTensor (packed with tensors by ``torch.cat`` on a GPU, it raised)."""
    if type(value) is float or type(value) is int or type(value) is torch.Tensor or value is None:
        return value
    return value.to_local() if is_dtensor(value) else value


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (checked by shape of the API, not by import)."""
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def check_count(value: Any, what: str, *args: Any) -> None:
    """A count or a weight (tokens, a mean's weight, a duration): a Python number must be finite
    and >= 0 (a tensor is not read: that would wait for the device)."""
    number = type(value) is float or type(value) is int or (
        not isinstance(value, (torch.Tensor, bool)) and isinstance(value, numbers.Real))  # numpy's numbers too
    if number and not (value >= 0 and _in_range(value) and math.isfinite(value)):
        raise ValueError(f"{what % args if args else what}: {_shown(value)} is refused: accepted values are finite "
                         "numbers >= 0")


def unfit_counts(value: torch.Tensor) -> torch.Tensor:
    """Where a count or a weight given as a tensor is not a finite number >= 0 (:func:`check_count`'s rule),
    computed on its device: read later, with the log step's values (reading it here would wait for the device)."""
    return ~(torch.isfinite(value) & (value >= 0))


def check_spellings(scalars: dict[str, Any], split: str, call: str) -> None:
    """Refuse keyword values of one call that name one metric (``acc=`` and ``**{"train/acc": ...}``:
    a name without ``/`` is written under ``split/``): their values were merged into one mean."""
    if len(scalars) < 2 or not any("/" in key for key in scalars):
        return
    seen: dict[str, str] = {}
    for key in scalars:
        name = key if "/" in key else f"{split}/{key}"
        if seen.setdefault(name, key) != key:
            raise ValueError(f"{call}({seen[name]}=..., {key}=...): both name the metric {name!r} (a name without "
                             f"'/' is written under '{split}/'); give it once")


def check_step(step: Any, what: str, last: Optional[int] = None) -> None:
    """A step number: an int from 0 to 2**63 - 1 (it travels in an int64 lane), above ``last``."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        raise ValueError(f"{what}: step={step!r}: accepted values are Python ints from 0 to 2**63 - 1 "
                         "(int(step) for a numpy integer or a tensor)")
    if last is not None and step <= last:
        raise ValueError(f"{what}: step={step} does not increase (the last step was {last})")


def collector_label(name: str) -> str:
    """How a collector named ``name`` is said as the writer of its ``writes``: "the 'memory' collector"."""
    return f"the {name!r} collector"


class NameClash(ValueError):
    """A name that would write a key another source writes; ``other`` is the metric name whose value
    writes it (None where a collector or the Monitor writes it), so a negotiation can leave both out."""

    def __init__(self, message: str, other: Optional[str] = None) -> None:
        super().__init__(message)
        self.other = other


class NameRegistry:
    """The names the Monitor's collectors write and the names user values write, so a user's
    name that collides is refused at its first call."""

    def __init__(self) -> None:
        self._writers: dict[str, str] = {}  # a written name → who writes it
        self._rank_shaped: dict[str, list[str]] = {}  # "x" → the written names "x/rank<N>", in the order written
        self._prefixes: dict[str, str] = {}  # "memory/" → who writes every name under it
        self._claimed: dict[str, str] = {}  # user name → reduce kind
        self._records: dict[str, str] = {}  # user name → the record kind it is written in
        self._sources: dict[str, str] = {}  # a written name → the metric name whose value writes it (add)

    def reserve(self, names: Iterable[str], who: str) -> None:
        """Names (or prefixes ending in ``/``: every name under it) that ``who`` writes; a name
        reserved already keeps its first writer (collectors whose ``writes`` overlap are refused
        before, by :func:`~distmetrics.collectors.base.check_writes`, unless one runs after the
        other and writes around it: the timers' ``stragglers/`` beside the stragglers collector's)."""
        for name in names:
            if name.endswith("/"):
                self._prefixes.setdefault(name, who)
            elif name not in self._writers:
                self._write(name, who)

    def record_of(self, name: str) -> Optional[str]:
        """The record kind a user's name is written in (``eval``: a ``log_eval`` name), None where unclaimed."""
        return self._records.get(name)

    def reserve_writers(self, writers: Iterable[Any]) -> "NameRegistry":
        """Reserve what each collector declares in its ``writes`` (a user's collector may
        declare nothing); returns the registry."""
        for writer in writers:
            self.reserve(getattr(writer, "writes", ()), collector_label(writer.name))
        return self

    @property
    def size(self) -> int:
        """How many names and prefixes are reserved or claimed. It only grows, so what was found
        against the registry holds while its size is unchanged."""
        return len(self._writers) + len(self._prefixes)

    def writer_of(self, name: str) -> Optional[str]:
        """Who writes ``name`` already (None: nobody)."""
        if name in self._writers:
            return self._writers[name]
        return next((who for prefix, who in self._prefixes.items() if name.startswith(prefix)), None)

    def claim(self, name: Any, kind: str, what: str, record: str = "train") -> None:
        """Check ``name`` (recorded as ``kind`` by ``what``, into ``record`` records) and remember
        what it writes."""
        if isinstance(name, str) and self._claimed.get(name) == kind and self._records.get(name, record) == record:
            return  # seen before, checked then
        check_name(name, what)
        if name in self._claimed and self._records.get(name, record) != record:
            raise ValueError(f"{what}: metric {name!r} is written in {self._records[name]} records already, and "
                             f"{what} writes {record} records: one tag would hold both (values of one kind of "
                             "record at the steps of the other); give it another name")
        if name in self._claimed:
            raise ValueError(f"{what}: metric {name!r} was recorded as {self._claimed[name]!r} before and now as "
                             f"{kind!r}; a name keeps one reduce kind")
        self.add(name, kind, what)
        self._records[name] = record

    def add(self, name: str, kind: str, what: str, names_it: bool = False) -> None:
        """Remember what ``name`` (reduced as ``kind``, by ``what``) writes; raise where another name
        writes one of those keys (what :meth:`claim` checks after the name itself; internal lanes
        pass here too: the reducer checks the names every rank sent with it). ``names_it``: ``what``
        says the name already (the reducer's "metric 'x' from rank 3")."""
        source = f"{what} ({kind})"
        clash = self.clash(name, kind, source)
        if clash is not None:
            raise clash
        self.note(name, kind, source if names_it else f"{what} ({name!r}, {kind})")

    def clash(self, name: str, kind: str, source: str) -> Optional[NameClash]:
        """The clash ``name``, reduced as ``kind``, would make with what is remembered (a key another
        name writes), said as ``source``'s; None where there is none. Nothing is remembered."""
        written = written_names(name, kind)
        for other in written:
            who = self.writer_of(other)
            if who is not None:
                return NameClash(f"{source} would write {other!r}, which {who} writes already",
                                 self._sources.get(other))
        rank = _RANK.match(name)
        if rank and self._claimed.get(rank.group(1)) == "all":
            return NameClash(f"{source} would write {name!r}, which JSONL uses for a rank of the 'all' metric "
                             f"{rank.group(1)!r}", rank.group(1))
        if kind == "all":
            clash = self._rank_shaped.get(name)
            if clash:
                return NameClash(f"{source}: JSONL would write {name!r}'s ranks as {clash[0]!r}, which "
                                 f"{self._writers[clash[0]]} writes already", self._sources.get(clash[0]))
        return None

    def note(self, name: str, kind: str, who: str) -> None:
        """Remember what ``name``, reduced as ``kind``, writes, and that ``who`` writes it, unchecked
        (:meth:`add` checks first); a key written already keeps its first writer."""
        for other in written_names(name, kind):
            if other not in self._writers:
                self._write(other, who)
                self._sources[other] = name
        self._claimed.setdefault(name, kind)

    def _write(self, name: str, who: str) -> None:
        """Remember that ``who`` writes ``name``, and under its base name where it has the shape of
        an ``all`` metric's rank (``x/rank0``): :meth:`add` looks an ``all`` ``x`` up there rather
        than matching every name written so far (quadratic in a negotiation's names)."""
        if name not in self._writers:
            rank = _RANK.match(name)
            if rank:
                self._rank_shaped.setdefault(rank.group(1), []).append(name)
        self._writers[name] = who
