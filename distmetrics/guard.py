"""A rank that does not arrive is named, within a bound.

Every collective the monitor makes (start-up, log steps, evaluation, checkpoints, close, tensor
statistics steps, Megatron's timer reports) is preceded by an arrival check through the c10d
store the process group was made with — not a collective: each rank adds ``1 + world * h`` to a
counter keyed by the guarded call's sequence number, ``h`` a hash of the call and its step, and
waits for the last one to mark it complete. The total says how many ranks arrived (it is a
multiple of the world size once all have) and the sum of their hashes: the last rank compares
that sum with ``world`` times its own hash, so ranks that made different calls there
(``log_eval`` on one, ``step`` on another, or ``step(3)`` on one and ``step(4)`` on another) are
known as soon as the last of them arrives. It marks the call ``differ`` instead of done, and
every rank raises :class:`HangError` at once naming each rank's call, instead of waiting out
``hang_timeout_s`` or mixing collectives until the process group aborts. (Two different calls
leave a sum other than ``world * h`` unless their hashes are equal; three or more can also match
it. Either happens about once in the number of values a hash takes — 2**32, and 2**62 /
world**2 above 32,768 ranks, so that the total fits an int64 — and those ranks then meet in the
collectives as they would with the check off.) When ranks make the same calls in the same order
that costs a publish and three store round trips per guarded call (add, wait, get; the last rank
to arrive: add, compare_set, and two deletions of the previous call's keys). When some rank
does not arrive within ``hang_timeout_s`` (it stopped calling, hangs elsewhere or
died), every waiting rank raises :class:`HangError` naming the ranks that did not arrive and the
last monitor call and step each of them made (each rank publishes its guarded calls, and its
other monitor calls at most once a second — less often above 1,000 ranks: every ``world_size /
1000`` seconds, so the store takes at most about 1,000 such writes a second from the whole job —
but for a timer's ``barrier=True``, published at once where it is not the call published last, at
most ten times a second: a rank may wait there until the process group's timeout, and publishes
nothing more).
A rank that has left its Monitor (closed it, or left it on an error) will not come: it publishes
how it left and marks the guarded call it is in (arrived, not yet past: a signal handler's close())
or else its next one done with ``left``, and the ranks waiting there raise at once rather than at
``hang_timeout_s`` (the third round trip reads which mark it is). So does a rank that an exception
which is no error (a signal handler's ``SystemExit``, Ctrl-C's ``KeyboardInterrupt``) takes out of
a guarded call. Their message names the ranks whose published state says they left (how, and after
which call) apart from those that had simply not arrived yet, which may be on their way: the mark
says that some rank left, not which, and a slow rank is not one that left.
A rank waits in no store call longer than :data:`WAIT_SLICE_S`: Python runs a signal's handler only
between calls into C++, and a launcher's SIGKILL follows its SIGTERM after about 30 s.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import logging
import math
import random
import time
import zlib
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from .per_rank import some_ranks

__all__ = ["CollectiveGuard", "HangError"]

logger = logging.getLogger("distmetrics")

_MONITORS = itertools.count()  # Monitors are made in the same order on every rank
_PUBLISH_EVERY_S = 1.0
_STORE_PUBLISHES_PER_S = 1000.0  # from all ranks together, between guarded calls
URGENT_SHARE = 10
"""An urgent note (a timer's barrier) waits a tenth of :attr:`CollectiveGuard.publish_every_s` after the
last urgent one: the store takes at most about ten times the other calls' writes."""


class HangError(RuntimeError):
    """Some ranks did not arrive at a collective call within ``hang_timeout_s``."""


class CollectiveGuard:
    """Arrival checks before collectives (see the module docstring); off when ``timeout_s`` is 0
    (but for the first call: :meth:`_enter_off`), with one rank, or without a c10d store."""

    def __init__(self, timeout_s: float, group: Any = None) -> None:
        self.timeout_s = float(timeout_s)
        self.store: Any = None
        self.rank, self.world = 0, 1
        self._hashes = 2 ** 32  # the values a call's hash takes: fewer above 32,768 ranks (set with the world)
        self._seq = 0
        self._previous = ""  # the key of the last guarded call, deleted once every rank is past it
        self._published = 0.0
        self._last = "none since start-up"
        self._last_published = ""  # the call the store holds for this rank (an urgent note compares with it)
        self._urgent_at = 0.0  # when an urgent note (a timer's barrier) was last published
        self._left = ""  # how this rank left its Monitor ("closed its Monitor", ...); "" while it has not
        self._inside = False  # in guarded call self._seq, not yet past it: a rank leaving now marks this one
        self._left_in = 0  # the guarded call this rank left inside (arrived, not past it); 0: left between calls
        self._start_store: Any = None  # with the check off: the store, for the start-up call's check only
        self._label = "hang_timeout_s"  # what the wait's bound is called in a report
        monitor_id = next(_MONITORS)
        if not (dist.is_available() and dist.is_initialized()):
            return
        if self.timeout_s <= 0:  # off; but the first call is still checked, so a rank whose check is on is told at
            # once (it waited hang_timeout_s at start-up for a rank that never came, then named it as not arrived)
            if (group is None or group is dist.group.WORLD) and dist.get_world_size() > 1:
                self.world, self.rank = dist.get_world_size(), dist.get_rank()
                self._hashes = max(1, min(2 ** 32, 2 ** 62 // self.world ** 2))
                self._start_store = dist.PrefixStore(f"distmetrics/guard/{monitor_id}/",
                                                     dist.distributed_c10d._get_default_store())
            return
        if group is not None and group is not dist.group.WORLD:
            # the store's counters need every rank of the world: a sub-group is not guarded (said by its first rank)
            if dist.get_process_group_ranks(group)[0] != dist.get_rank():
                return
            logger.warning("distmetrics: Monitor(group=...) reduces over a process group other than the world, where "
                           "the arrival check (hang_timeout_s=%g) cannot run: a rank that skips or mismatches a "
                           "monitor call is not named, and the collective may hang.", self.timeout_s)
            return
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        # the counter's total, world + world**2 * (hashes below this) at most, stays below 2**63 (int64)
        self._hashes = max(1, min(2 ** 32, 2 ** 62 // self.world ** 2))
        if self.world > 1:
            store = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore(f"distmetrics/guard/{monitor_id}/", store)

    @property
    def inside(self) -> bool:
        """True while this rank is in a guarded call's arrival check (a signal handler's call lands there)."""
        return self._inside

    @property
    def enabled(self) -> bool:
        """True when calls are checked."""
        return self.store is not None

    @property
    def publish_every_s(self) -> float:
        """Seconds between two publishes of a call that is not a collective: 1, or ``world_size /
        1000`` above 1,000 ranks (the one c10d store serves every rank)."""
        return max(_PUBLISH_EVERY_S, self.world / _STORE_PUBLISHES_PER_S)

    def note(self, call: str, step: Optional[int] = None, urgent: bool = False) -> None:
        """Remember this rank's latest monitor call (published at most every :attr:`publish_every_s`).
        ``urgent`` (a timer's barrier, where a rank may block with no later call to publish it): at once
        where it is not the call the store holds, unless another urgent note was published less than
        ``publish_every_s / URGENT_SHARE`` ago. So the same barrier step after step is not written
        again, one barrier a step adds about one write per publish of another call (a log step's, a
        throttled one), and barriers of two timers in turn each step are written at most
        ``URGENT_SHARE`` times as often as other calls."""
        self._last = _describe(call, step)
        now = time.monotonic()
        due = now - self._published > self.publish_every_s
        if urgent and not due:
            due = self._last != self._last_published and now - self._urgent_at > self.publish_every_s / URGENT_SHARE
        if self.store is not None and due:
            if urgent:
                self._urgent_at = now
            try:
                self._publish()
            except Exception as err:  # noqa: BLE001 - the store's host rank has ended: said as a hang is
                failure = err
            else:
                return
            raise HangError(self._report(call, step, failure, 0.0))

    def leave(self, how: str) -> None:
        """This rank is done with the Monitor (``how``: closed, or left after an error): published
        at once, so a rank still waiting names that rather than the last call published; and the
        guarded call it is in (a signal handler's close() landing in its arrival check), or else its
        next one, is marked done with ``left`` unless it is marked already, so the ranks waiting
        there (it will not go on, or come) stop waiting at once."""
        self._left = how.replace("|", "/")  # one field of the published row
        if self._inside and not self._left_in:  # the ranks there name it as one that left, not as arrived
            self._left_in = self._seq
        if self.store is not None:
            try:
                self._publish()
                self.store.compare_set(_done(self._seq if self._inside else self._seq + 1), "", _LEFT_MARK)
            except Exception:  # noqa: BLE001 - the store's host rank has ended: nobody to tell
                pass

    def enter(self, call: str, step: Optional[int] = None) -> None:
        """Wait until every rank arrives at this call (the same call, step and position in the
        sequence of guarded calls); raise :class:`HangError` as soon as the last rank arrives where
        the ranks made different calls, after ``timeout_s`` where some rank does not arrive, or as
        soon as a rank leaves its Monitor before arriving or inside this call, or one that arrived
        gives up waiting. A rank arriving after another gave up raises too (it must not enter the
        collective alone), and so does every rank where the store cannot be reached (its host, rank
        0, has ended)."""
        if self._inside:  # a signal handler's monitor call while this rank waits at another: it cannot go on
            outer = self._last
            self.leave(f"made {_describe(call, step)} while waiting at {outer}")
            raise HangError(f"{_describe(call, step)} was called while this rank waited at the arrival check of "
                            f"{outer} (from a signal handler): that call is marked left, so the other ranks raise "
                            "at once, and no collective follows here")
        self._last = _describe(call, step)
        if self.store is None:
            if self._start_store is not None and self._seq == 0:
                self._enter_off(call, step)
            return
        self._seq += 1
        self._inside = True
        key, done = f"{self._seq}|arrived", _done(self._seq)
        mine = 1 + self.world * (zlib.crc32(f"{call}|{step}".encode()) % self._hashes)
        started = time.monotonic()
        failure: Optional[BaseException] = None
        try:
            self._publish()
            total = self.store.add(key, mine)  # (ranks arrived) + world * (the sum of their hashes)
            last = total % self.world == 0  # every rank adds 1 + a multiple of world: all of them are here
            if last:  # the last to arrive marks the call done (or differ), unless a rank left or gave up before
                mark = self.store.compare_set(done, "", _DONE_MARK if total == self.world * mine else _DIFFER_MARK)
            else:
                mark = self._wait(done)
                if mark is None:  # gave up, unless the last rank marked the call done just now
                    failure = TimeoutError(f"{done} not marked within {self.timeout_s:g} s")
                    mark = self.store.compare_set(done, "", _GAVE_UP_MARK)
            if mark == _DONE_MARK.encode():
                if last and self._previous:  # every rank added itself here, so every rank is past the previous call
                    self.store.delete_key(self._previous)
                    self.store.delete_key(_done(self._seq - 1))
                self._previous = key
                self._inside = False
                return
            if mark == _DIFFER_MARK.encode():
                failure = _Differ()
            elif mark == _LEFT_MARK.encode():
                failure = HangError("a rank has left its Monitor")
            elif failure is None:  # this rank arrived after another had given up: it must not go on alone
                failure = _Late("another rank gave up waiting at this guarded call after hang_timeout_s, "
                                "before every rank arrived")
        except dist.DistError as err:  # any store failure (its host rank has ended) is a hang too
            failure = err
        except BaseException as err:  # a signal handler's SystemExit, Ctrl-C, or its own error raised in the
            self._stopped(err)  # wait: this rank will not go on in this call, and the error is the user's
            raise
        self._inside = False
        # raised here, not in an except clause: the store's error is no news, but an exception the
        # caller is handling (close() in a finally after its own error) stays attached as the context
        raise HangError(self._report(call, step, failure, time.monotonic() - started))

    def _wait(self, done: str) -> Optional[bytes]:
        """The mark some rank set on this call (done, differ, left, gave up), or None after ``timeout_s``.
        First one store wait of at most :data:`WAIT_SLICE_S`, where a healthy call ends (one request, as
        a single wait of ``timeout_s`` made); then a check at growing intervals, up to
        :attr:`publish_every_s` (about 1,000 requests a second from the whole job once they reach it; the
        first, from a quarter of a second, at random points so ranks that waited alike do not check
        together), sleeping between them: a signal's handler runs at once there, and within
        ``WAIT_SLICE_S`` in the first wait. A rank that waited past the first wait goes on up to
        ``publish_every_s`` after the last rank arrives. (Not more store waits: c10d says every wait
        that times out in two warning lines.)"""
        deadline = time.monotonic() + self.timeout_s
        try:
            self.store.wait([done], _dt.timedelta(seconds=min(WAIT_SLICE_S, self.timeout_s)))
            return self.store.get(done)
        except dist.DistError:  # DistStoreError at the slice's end; another store failure the check raises again
            pass
        pause = _FIRST_CHECK_S
        while not self.store.check([done]):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(pause * _JITTER.uniform(0.5, 1.0), remaining))  # ranks that waited alike check apart
            pause = min(2 * pause, self.publish_every_s)
        return self.store.get(done)

    def _stopped(self, err: BaseException) -> None:
        """An exception that is no error (a signal handler's ``SystemExit``, Ctrl-C's
        ``KeyboardInterrupt``) leaves enter(): the call is marked ``left`` (unless it is marked already:
        the last rank's done stays), so the ranks waiting there raise at once, naming this one, rather than
        at ``hang_timeout_s`` (how it left: as a close() in the handler published it, if one did)."""
        if self._inside:
            self.leave(self._left or f"left its Monitor on {type(err).__name__}")
        self._inside = False

    def _enter_off(self, call: str, step: Optional[int]) -> None:
        """The first guarded call with the check off (``hang_timeout_s`` 0): checked as with it on, as
        another call (every rank's check must agree), so ranks whose check is on and off raise at once
        naming which is which; waiting at most :data:`START_WAIT_S` (a rank that does not come: named)."""
        bound = max(START_WAIT_S, _seconds(getattr(self._start_store, "timeout", None)))  # the job's own, if longer
        self.store, self.timeout_s, self._label = self._start_store, bound, "the start-up bound with " \
            "hang_timeout_s 0"
        try:
            self.enter(f"{call}{_OFF}", step)
        finally:
            self.store, self.timeout_s, self._start_store = None, 0.0, None

    def _publish(self) -> None:
        self._published, self._last_published = time.monotonic(), self._last
        # read from both ends (_rows): a timer's name in the call may hold "|"
        self.store.set(f"rank{self.rank}", f"{self._seq}|{self._last}|{time.time():.3f}|{self._left_in}|{self._left}")

    def _rows(self) -> list[_Row]:
        """Every rank's published state (guarded call number, last call, when, how and inside which
        guarded call it left), by rank."""
        keys = [f"rank{r}" for r in range(self.world)]
        # a rank that never made a guarded call has no key: get() would wait for it (30 min), so the keys
        # are checked first: all at once (one request), one by one only if some are missing
        present = keys if self.store.check(keys) else [key for key in keys if self.store.check([key])]
        found = dict(zip(present, self.store.multi_get(present) if present else []))
        rows = []
        for key in keys:
            raw = found.get(key)
            head, stamp, left_in, left = raw.decode().rsplit("|", 3) if raw else (
                "0|nothing published (it has not reached Monitor(), died before, or runs with hang_timeout_s 0)",
                "nan", "0", "")  # no time: nothing was published
            seq, call = head.split("|", 1)
            rows.append(_Row(int(seq), call, left, float(stamp), int(left_in)))
        return rows

    def _arrived(self, row: _Row, call: str, step: Optional[int]) -> bool:
        """Whether a rank's published call is this one (it may have left since: its own HangError)."""
        return row.seq == self._seq and row.call == _describe(call, step)

    def _report(self, call: str, step: Optional[int], err: BaseException, waited: float) -> str:
        waiting = _describe(call, step)
        try:
            rows = self._rows()
        except Exception:  # noqa: BLE001 - the store itself is gone (its host rank died)
            if isinstance(err, _Differ):  # the mark was read: the calls were not (rank 0 raised and ended first)
                return (f"distmetrics: rank {self.rank} is at {waiting}, guarded call #{self._seq}, where the ranks "
                        "made different calls (the last rank to arrive found it); which rank made which call could "
                        "not be read: the c10d store became unreachable, its host rank 0 having ended (on this "
                        "error: its message names them). Every rank must make the same monitor calls (step, "
                        "log_eval, checkpoint_saved, close) with the same step numbers, in the same order.")
            return (f"distmetrics: rank {self.rank} waited at {waiting} and the c10d store became unreachable "
                    f"({type(err).__name__}: {err}); the rank hosting it (rank 0) has ended: it may have died, "
                    "or raised its own HangError first (its message names the ranks that did not arrive)")
        if isinstance(err, _Differ):
            return self._differ_report(waiting, rows)
        now = time.time()
        left, missing = [], []  # a rank that left will not come; one that has not arrived yet may be on its way
        for r, row in enumerate(rows):  # one that arrived and left inside this call (a signal's) will not go on
            if not self._arrived(row, call, step) or row.left_in == self._seq:
                ago = "" if math.isnan(row.stamp) else f" (published {now - row.stamp:.1f} s ago)"
                (left if row.left else missing).append(f"rank {r}: last call {row.last}{ago}")
        if isinstance(err, _Late) and not left and not missing:  # every other rank had come: this one was late
            return (f"distmetrics: rank {self.rank} arrived at {waiting}, guarded call #{self._seq}, "
                    f"{waited:.1f} s after it started the call, but another rank had given up waiting there after "
                    f"hang_timeout_s ({self.timeout_s:g} s): this rank came late (slower than hang_timeout_s allows "
                    "between two monitor calls, or held up outside the Monitor), and the ranks that waited raised "
                    "HangError naming it. Raise hang_timeout_s where a rank may take longer between two monitor calls "
                    "(a slow first step, a long save on one rank: a pause does not stop this check).")
        who = "; ".join(missing) or ("none" if left else
                                     "none of the other ranks published a different call (they may have died)")
        gone = f"ranks that left their Monitor and will not arrive: {'; '.join(left)}; " if left else ""
        wait = (f"{waited:.1f} s (of {self._label} {self.timeout_s:g}: {err})"
                if isinstance(err, HangError) else f"{self.timeout_s:g} s ({self._label})")
        return (f"distmetrics: rank {self.rank} waited {wait} at {waiting}, guarded call #{self._seq}; "
                f"{gone}ranks that did not arrive{' yet' if left else ''}: {who}. Every rank must make the same "
                "monitor calls (step, log_eval, checkpoint_saved, close) with the same step numbers; a rank that "
                "made them and is not here died (a SIGKILL or an out-of-memory kill leaves no word) or hangs "
                "outside the Monitor. (Calls that "
                f"are not collectives are published at most every {self.publish_every_s:g} s, a timer's "
                "barrier=True at once.)")

    def _differ_report(self, waiting: str, rows: list[_Row]) -> str:
        """Every rank arrived at this guarded call number, not all at one call: the calls, and who made each."""
        ranks: dict[str, list[int]] = {}
        for r, row in enumerate(rows):  # a rank may have raised and left since: its call is the one it made
            ranks.setdefault(row.call if row.seq == self._seq else f"{row.call} (guarded call #{row.seq})",
                             []).append(r)
        calls = [f"{last} on {some_ranks(r)}" for last, r in ranks.items()]
        same = " Give every rank the same hang_timeout_s." if any(_OFF in call for call in ranks) else ""
        more = f"; and {len(calls) - _CALLS_SHOWN} more calls" if len(calls) > _CALLS_SHOWN else ""
        return (f"distmetrics: rank {self.rank} is at {waiting}, guarded call #{self._seq}, where the ranks made "
                f"different calls: {'; '.join(calls[:_CALLS_SHOWN])}{more}. Every rank must make the same monitor "
                f"calls (step, log_eval, checkpoint_saved, close) with the same step numbers, in the same order.{same}")


class _Row(NamedTuple):
    """One rank's published state: its guarded call number, its last monitor call, how it left its
    Monitor ("" while it has not), when it published (NaN: nothing), and the guarded call it left inside (0: none)."""

    seq: int
    call: str
    left: str
    stamp: float
    left_in: int

    @property
    def last(self) -> str:
        """The call, or how the rank left after it (``closed its Monitor, after monitor.step(step=2)``)."""
        return f"{self.left}, after {self.call}" if self.left else self.call


class _Differ(Exception):
    """The last rank to arrive found that the ranks made different calls (the ``differ`` mark)."""


class _Late(HangError):
    """This rank arrived after another had given up waiting (the ``gave up`` mark): late itself where every
    other rank had arrived, else behind a rank that has not."""


_OFF = " with hang_timeout_s 0 (the arrival check off)"  # the start-up call's text on a rank with the check off
START_WAIT_S = 600.0
"""With the arrival check off, the least time a rank waits at the start-up check for the others; the
job's process-group timeout where it is longer (the store's, which the collectives share)."""
WAIT_SLICE_S = 5.0
"""The longest one store wait at an arrival check: a signal's handler (Ctrl-C, a SIGTERM made an exit)
runs at its end at the latest, well within the ~30 s a launcher gives between SIGTERM and SIGKILL. Not
shorter: c10d says a wait that times out in two warning lines, and a rank that reaches a log step a
second or two before the slowest (a straggler, a pipeline's last stage) would print them every log
step; past 5 s it is a hang in the making."""
_FIRST_CHECK_S = 0.25  # after the first wait: the first pause between two checks, doubled up to publish_every_s
_JITTER = random.Random()  # its own: the user's seeded global random stays as the user's code draws it
_CALLS_SHOWN = 8  # distinct calls named in the message where the ranks made different ones
_DONE_MARK = "1"  # a guarded call's done key set by the last rank to arrive
_LEFT_MARK = "left"  # ... by a rank that left its Monitor instead of arriving
_GAVE_UP_MARK = "gave up"  # ... by a rank that waited hang_timeout_s (a rank arriving later must not go on)
_DIFFER_MARK = "differ"  # ... by the last rank to arrive, where the ranks' calls or steps differ


def _seconds(timeout: Any) -> float:
    """A store's timeout (``init_process_group(timeout=...)``'s) in seconds; 0 where it has none."""
    try:
        return float(timeout.total_seconds())
    except (AttributeError, TypeError, ValueError):
        return 0.0


def _done(seq: int) -> str:
    """The key that marks guarded call number ``seq`` done (by position: a rank leaving knows its
    next call's number, not the call)."""
    return f"{seq}|done"


def _describe(call: str, step: Optional[int]) -> str:
    if step is not None:
        return f"{call}(step={step})"
    return call if call.endswith(")") else f"{call}()"  # "Monitor()" is named with its parentheses
