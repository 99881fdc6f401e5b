"""Console sink: one plain-text line per log step through Python ``logging`` on the writer rank.

::

    :: step 100/8000 [ 1.2%] \\ loss 2.3456 | norm 0.1234 | lr 3.00e-04 | 125.3k tok/s | 156 ms | mfu 41.2 | eta 02h15m
    >> eval step 500 | loss 2.1234 | gap +0.0123 | ppl 8.36

``\\``, ``/`` or ``=``: the loss fell, rose or stayed since the last log step (blank on the
first); past ``total_steps`` the line gives the step alone (``:: step 8001``; said once, with no
ETA from there: the end is not known); ``!`` before the norm: a gradient spike
(``health/grad_spike``). Fields that were not measured are left out. Under ``timing_log_option``
minmax/all a Megatron-style block follows::

    (min, max) time across ranks (ms):
        forward-backward ...............................: (10.12, 30.54)

(under ``all`` too: the fastest and slowest of every rank's values, not Megatron's line per rank,
which ``monitor.timers.log`` prints; under ``max`` Megatron's ``max time across ranks (ms):``).
"""

from __future__ import annotations

import codecs
import errno
import io
import logging
import math
import os
import stat
import sys
from typing import Any, Callable, Optional, Sequence

from ..megatron_text import time_block
from ..per_rank import PerRank
from . import failure_cause
from .appendfile import Lost, describe_os_error

__all__ = ["ConsoleSink", "format_train_line", "format_eval_line", "format_timer_block"]

LOGGER_NAME = "distmetrics.console"
_SHARED: dict = {}  # the stdout handler a sink added, and how many open sinks print through it
_MARKED = frozenset({"utf-8-sig", "utf-16", "utf-32"})  # codecs that write a byte-order mark first
_GONE = (errno.EPIPE, errno.EBADF)  # stdout's reader went (``| head``) or it was closed: no later line can go
logger = logging.getLogger("distmetrics")


class ConsoleSink:
    """One line per train and eval record, a timer block, alerts as warnings."""

    name = "console"
    fix = "check the logging configuration"

    def __init__(self, verbosity: int = 0, total_steps: Optional[int] = None,
                 timer_order: Callable[[], Sequence[str]] = tuple) -> None:
        self.verbosity = verbosity
        self.total_steps = total_steps
        self.timer_order = timer_order
        """The writer's timer names in the order they were made: the timer block's order."""
        self.logger = logging.getLogger(LOGGER_NAME)
        if self.logger.level == logging.NOTSET:
            self.logger.setLevel(logging.INFO)
        self._stdout: Optional[_Stdout] = None
        shared = _SHARED.get("handler")
        if shared is not None and shared in self.logger.handlers:  # another open Monitor's: shared until both close
            self._stdout = shared
            _SHARED["users"] += 1
        elif not self.logger.handlers and not logging.getLogger().handlers:
            self._stdout = _Stdout(sys.stdout)
            self._stdout.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(self._stdout)
            _SHARED.update(handler=self._stdout, users=1)
        self._last_loss: Optional[float] = None
        self._past_said = False  # a step past total_steps was said

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Print a train or eval line (and the timer block), or an alert."""
        if self._stdout is not None:
            self._stdout.step = step  # what its warnings of lines not written name
        if kind == "train" and self.verbosity >= 0:
            loss = metrics.get("train/loss")
            if self.total_steps and step > self.total_steps and not self._past_said:
                self._past_said = True
                self.logger.warning("distmetrics: step %d is past total_steps=%d: from here on the console shows the "
                                    "step without progress or ETA. Said once", step, self.total_steps)
            self.logger.info(format_train_line(metrics, step, self.total_steps, self._last_loss,
                                               telemetry=self.verbosity >= 1))
            if isinstance(loss, float) and math.isfinite(loss):
                self._last_loss = loss
            block = format_timer_block(metrics, self.timer_order())
            if block:
                self.logger.info(block)
        elif kind == "eval":
            self.logger.info(format_eval_line(metrics, step))
        elif kind == "alert":
            self.logger.warning("!! step %d: %s", step, metrics.get("message", metrics))
        if self._stdout is not None and self._stdout.failed is not None:
            self._stdout_failed()

    def _stdout_failed(self) -> None:
        """The stdout handler could not write: it goes; with no other handler the sink is turned
        off (raising the cause), else the lines go on to the handlers added since, with a warning."""
        error, handler, self._stdout = self._stdout.failed, self._stdout, None
        self.logger.removeHandler(handler)
        if _SHARED.get("handler") is handler:  # gone for every sink that shared it
            _SHARED.clear()
        if not self.logger.hasHandlers():
            raise error
        logging.getLogger("distmetrics").warning(
            "distmetrics: the console sink's stdout handler cannot write (%s) and is removed; its lines go on to "
            "the other logging handlers.", failure_cause(error))

    def close(self) -> None:
        """Remove the stdout handler the sinks open together added, with the last of them to close:
        it writes to the ``sys.stdout`` of its time (a capture, a notebook cell's), and the next
        Monitor's sink adds its own, to the stdout of then."""
        if self._stdout is not None:
            self._release(self._stdout)
            self._stdout = None

    def _release(self, handler: "_Stdout") -> None:
        if _SHARED.get("handler") is handler:
            _SHARED["users"] -= 1
            if _SHARED["users"] > 0:
                return
            _SHARED.clear()
        self.logger.removeHandler(handler)
        handler.say_lost()


class _Stdout(logging.StreamHandler):
    """The handler the sink adds where logging is not configured. A failure that no later line
    can get past (stdout a closed pipe, ``| head``: EPIPE; a closed ``sys.stdout``) is kept in
    ``failed`` for the sink to raise once the record has been through every handler, so the sink
    is turned off with one warning naming the cause; ``logging``'s own handling printed a
    traceback per line and went on. Other errors (a line the stream's encoding cannot write) are
    logging's, as are the failures of handlers configured elsewhere.

    Where the stream is a file object over a descriptor (``sys.stdout`` as Python opens it: a
    terminal, a pipe, the file stdout is redirected to) each line is written in one ``write`` of
    its own on the descriptor, after what ``print`` left in the stream's buffer, so that a full
    disk cannot leave half a line behind: through the buffer, the first part of a line landed in
    the file and the rest waited in the buffer to be glued to whatever came next. A write that
    fails partway (a full disk, a quota, a file-size limit) is cut back off the file (a pipe or a
    terminal cannot be cut: the next line then starts on a line of its own), the line is counted
    as lost and every later line is tried again, so printing resumes by itself when there is room:
    one warning when it starts to fail (the errno), one when it works again (how many records,
    which steps), one at close if it never did. A stream without a descriptor (a capture, a
    notebook cell's) is written as logging writes it."""

    failed: Optional[Exception] = None
    step = 0
    """The step of the record being printed (the sink sets it): what the warnings of lost lines name."""
    lost: Optional[Lost] = None
    """The records not written since writing last worked."""
    _torn = False  # a line cut short could not be cut off: the next one starts with a newline

    def emit(self, record: logging.LogRecord) -> None:
        fd = _descriptor(self.stream)
        if fd is None:
            super().emit(record)
            return
        try:
            line = self.format(record) + self.terminator
            data = line.encode(self.stream.encoding or "utf-8", self.stream.errors or "strict")
            self.stream.flush()  # print()'s text first; where it cannot go, this line waits behind it and is lost
            self._write(fd, data)
        except OSError as err:
            if err.errno in _GONE:
                self.failed = err
            else:
                self._lose(err, fd)
        except Exception:  # noqa: BLE001 - logging's handling, as for any handler
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]  # called inside emit's except block
        if isinstance(error, OSError) or (isinstance(error, ValueError) and "closed file" in str(error)):
            self.failed = error  # the stream cannot be written (a closed sys.stdout raises the ValueError)
        else:
            super().handleError(record)

    def say_lost(self) -> None:
        """At close: say what was not written, where writing never worked again."""
        lost, self.lost = self.lost, None
        if lost is not None:
            logger.warning("distmetrics: the console sink closed %s with %d record%s (steps %d-%d) not written: %s.",
                           self._where(), lost.records, "" if lost.records == 1 else "s", lost.first_step,
                           lost.last_step, lost.error)

    def _write(self, fd: int, data: bytes) -> None:
        """``data`` whole at the descriptor's offset, or cut back off (:meth:`_cut`) and the error raised."""
        view = memoryview(b"\n" + data if self._torn else data)
        done = 0
        try:
            while done < len(view):  # a short write (the disk filling up, a signal): the rest, until it raises
                done += os.write(fd, view[done:])
        except OSError:
            self._cut(fd, done)
            raise
        self._torn = False
        if self.lost is not None:
            lost, self.lost = self.lost, None
            logger.warning("distmetrics: the console sink writes %s again from step %d; %d record%s (steps %d-%d) "
                           "could not be written.", self._where(fd), self.step, lost.records,
                           "" if lost.records == 1 else "s", lost.first_step, lost.last_step)

    def _cut(self, fd: int, written: int) -> None:
        """Cut the ``written`` bytes of a line that could not be written whole off a file (the
        offset after a write is its end, also where stdout was opened for appending, ``>>``), only
        while they are the file's last bytes: stdout's file is often shared (other ranks, stderr
        sent to it), and what another process wrote after them is not this sink's to cut."""
        if not written:
            return
        try:
            end, info = os.lseek(fd, 0, os.SEEK_CUR), os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_size == end:
                os.ftruncate(fd, end - written)
                os.lseek(fd, end - written, os.SEEK_SET)
                return
        except OSError:
            pass
        self._torn = True

    def _lose(self, err: OSError, fd: int) -> None:
        """Count the record as lost; warn at the first since writing last worked."""
        if self.lost is None:
            self.lost = Lost(self.step, self.step, 0, describe_os_error(err))
            logger.warning("distmetrics: the console sink cannot write %s at step %d: %s. Lines that cannot be "
                           "written are left out and counted; every later line is tried again.", self._where(fd),
                           self.step, self.lost.error)
        lost = self.lost
        lost.first_step, lost.last_step = min(lost.first_step, self.step), max(lost.last_step, self.step)
        lost.records += 1

    def _where(self, fd: Optional[int] = None) -> str:
        """``stdout``, with the file it goes to where the system says (``stdout (/runs/x/log.txt)``)."""
        fd = _descriptor(self.stream) if fd is None else fd
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except (OSError, TypeError):
            return "stdout"
        return f"stdout ({target})" if target.startswith("/") else "stdout"


def _descriptor(stream: Any) -> Optional[int]:
    """The descriptor under a text file object (``sys.stdout``), or None where its own ``write`` must
    see each line: a capture, a notebook's stream, a ``write`` replaced on the stream (W&B's console
    capture wraps ``sys.stdout.write`` to copy the run's output), or an encoding that begins a stream
    with a byte-order mark (``utf-8-sig``, ``utf-16``: one at each line's own encoding)."""
    if not isinstance(stream, io.TextIOWrapper) or "write" in getattr(stream, "__dict__", ()):
        return None
    if codecs.lookup(stream.encoding or "utf-8").name in _MARKED:
        return None
    try:
        return stream.fileno()
    except (OSError, ValueError):  # an in-memory buffer under it; closed
        return None


def format_train_line(m: dict[str, Any], step: int, total_steps: Optional[int] = None,
                      last_loss: Optional[float] = None, telemetry: bool = False) -> str:
    """The one-line summary of a train record; past ``total_steps``, the step alone (no fraction above 100%)."""
    head = f":: step {step}"
    if total_steps and step <= total_steps:
        # 100.0% is the last step's alone (7,999 of 8,000 is 99.9%)
        share = min(100.0 * step / total_steps, 99.9) if step < total_steps else 100.0
        head += f"/{total_steps} [{share:4.1f}%]"
    loss = m.get("train/loss")
    trend = " "
    if isinstance(loss, float) and last_loss is not None and math.isfinite(loss):
        trend = "\\" if loss < last_loss else ("/" if loss > last_loss else "=")
    fields = []
    if loss is not None:
        fields.append(f"loss {_small(loss)}")
    if "grad_norm" in m:
        spike = "!" if m.get("health/grad_spike") else ""
        fields.append(f"norm {spike}{_small(m['grad_norm'])}")
    if "train/lr" in m:
        fields.append(f"lr {_num(m['train/lr'], '.2e')}")
    if "train/tokens_per_sec" in m:
        fields.append(f"{_si(m['train/tokens_per_sec'])} tok/s")
    if "train/step_time_ms" in m:
        fields.append(_ms(m['train/step_time_ms']))
    if "train/mfu_pct" in m:
        fields.append(f"mfu {m['train/mfu_pct']:.1f}")
    if "moe/aux_loss" in m:
        fields.append(f"aux {_small(m['moe/aux_loss'])}")
    if "moe/load_imbalance" in m:
        fields.append(f"imbal {_num(m['moe/load_imbalance'], '.2f')}")
    if "train/eta_s" in m:
        fields.append(f"eta {format_duration(m['train/eta_s'])}")
    if telemetry:
        for key, label in (("memory/max_allocated_gib", "max_allocated_gib"), ("memory/host_rss_gib", "host_rss_gib"),
                           ("power/mean_w", "mean_w"), ("gpu/temperature_c/max", "temperature_c")):
            if key in m:  # the temperature is the hottest GPU's (a minmax reduction)
                fields.append(f"{label} {_num(m[key], '.1f')}")
    return f"{head} {trend} " + " | ".join(fields)


def format_eval_line(m: dict[str, Any], step: int) -> str:
    """The one-line summary of an eval record."""
    fields = [f">> eval step {step}"]
    if "eval/loss" in m:
        fields.append(f"loss {_small(m['eval/loss'])}")
    if "eval/gap" in m:
        gap = m["eval/gap"]
        finite = isinstance(gap, (int, float)) and math.isfinite(gap)
        fields.append(f"gap {_small(gap, '+.4f')}" if finite else f"gap {gap}")
    if "eval/ppl" in m:
        fields.append(f"ppl {_num(m['eval/ppl'], '.2f')}")
    if "eval/tokens_per_sec" in m:
        fields.append(f"{_si(m['eval/tokens_per_sec'])} tok/s")
    if "eval/time_ms" in m:
        fields.append(_ms(m['eval/time_ms']))
    return " | ".join(fields)


def format_timer_block(m: dict[str, Any], order: Sequence[str] = ()) -> str:
    """Megatron's ``(min, max) time across ranks (ms):`` block, from ``timers/<name>[/min]``, or
    under ``timing_log_option: max`` (no minimum) its ``max time across ranks (ms):`` block. The
    timers named in ``order`` come first, in that order; the others (made on other ranks only) after
    them, in the record's order."""
    times, slowest = {}, {}
    for key, value in m.items():
        low = high = None
        if key.startswith("timers/") and key.endswith("/min"):
            name = key[len("timers/"):-len("/min")]
            high = m.get(f"timers/{name}")
            low, high = value, (m.get(f"timers/{name}/max") if isinstance(high, PerRank) else high)
        elif key.startswith("timers/") and key.endswith("/max_rank"):  # under max: timers/<name> is the slowest
            name = key[len("timers/"):-len("/max_rank")]
            if f"timers/{name}/min" not in m and isinstance(m.get(f"timers/{name}"), (int, float)):
                slowest[name] = (m[f"timers/{name}"], m[f"timers/{name}"])
        if isinstance(low, (int, float)) and isinstance(high, (int, float)):
            times[name] = (low, high)
    place = {name: at for at, name in enumerate(order)}
    times, slowest = ({n: d[n] for n in sorted(d, key=lambda n: place.get(n, len(place)))} for d in (times, slowest))
    return time_block(times) if times or not slowest else time_block(slowest, max_only=True)


def format_duration(seconds: float) -> str:
    """``02h15m`` / ``3d04h`` / ``45s``."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours:02d}h{minutes:02d}m"
    if minutes:
        return f"{minutes:02d}m{s:02d}s"
    return f"{s}s"


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else str(v)


def _small(v: Any, fmt: str = ".4f") -> str:
    """``fmt`` (4 decimals), or 4 significant digits in exponent form where those decimals would show a
    non-zero value as 0 (a loss of 1e-8 read "loss 0.0000"; Megatron prints its loss as ``.6E``)."""
    if isinstance(v, (int, float)) and v != 0 and abs(v) < 1e-3:
        return format(v, fmt[:fmt.index(".")] + ".3e")
    return _num(v, fmt)


def _si(v: float) -> str:
    """One decimal and a unit; a value that rounds up to the next unit takes it (999,960: 1.0M); NaN and
    inf as they are."""
    if not math.isfinite(v):
        return f"{v}"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale * 0.99995 and (unit == "G" or abs(v) < scale * 999.95):
            return f"{v / scale:.1f}{unit}"
    return f"{v:.1f}"


def _ms(v: float) -> str:
    """Milliseconds to the millisecond; below 10, with the digits that say something (0.42 ms)."""
    if abs(v) >= 9.5 or not math.isfinite(v):
        return f"{v:.0f} ms"
    return f"{v:.2g} ms" if abs(v) >= 0.0095 else f"{v:.2f} ms"  # not 4.2e-05 ms
