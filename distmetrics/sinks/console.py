"""Console sink: one plain-text line per log step through Python ``logging`` on the writer rank.

::

    :: step 100/8000 [ 1.2%] \\ loss 2.3456 | norm 0.1234 | lr 3.00e-04 | 125.3k tok/s | 156 ms | mfu 41.2 | eta 02h15m
    >> eval step 500 | loss 2.1234 | gap +0.0123 | ppl 8.36

``\\``, ``/`` or ``=``: the loss fell, rose or stayed since the last log step (blank on the
first); ``!`` before the norm: a gradient spike (``health/grad_spike``). Fields that were not
measured are left out. Under
``timing_log_option`` minmax/all a Megatron-style block follows::

    (min, max) time across ranks (ms):
        forward-backward ...............................: (10.12, 30.54)
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Optional

from ..megatron_text import time_block
from ..per_rank import PerRank
from . import failure_cause

__all__ = ["ConsoleSink", "format_train_line", "format_eval_line", "format_timer_block"]

LOGGER_NAME = "distmetrics.console"
_SHARED: dict = {}  # the stdout handler a sink added, and how many open sinks print through it


class ConsoleSink:
    """One line per train and eval record, a timer block, alerts as warnings."""

    name = "console"
    fix = "check the logging configuration"

    def __init__(self, verbosity: int = 0, total_steps: Optional[int] = None) -> None:
        self.verbosity = verbosity
        self.total_steps = total_steps
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

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        """Print a train or eval line (and the timer block), or an alert."""
        if kind == "train" and self.verbosity >= 0:
            loss = metrics.get("train/loss")
            self.logger.info(format_train_line(metrics, step, self.total_steps, self._last_loss,
                                               telemetry=self.verbosity >= 1))
            if isinstance(loss, float) and math.isfinite(loss):
                self._last_loss = loss
            block = format_timer_block(metrics)
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


class _Stdout(logging.StreamHandler):
    """The handler the sink adds where logging is not configured. A write that fails (stdout a
    closed pipe, ``| head``; a full disk: an OSError) is kept in ``failed`` for the sink to raise
    once the record has been through every handler, so the sink is turned off with one warning
    naming the cause; ``logging``'s own handling printed a traceback per line and went on. Other
    errors (a line the stream's encoding cannot write) are logging's, as are the failures of
    handlers configured elsewhere."""

    failed: Optional[Exception] = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]  # called inside emit's except block
        if isinstance(error, OSError) or (isinstance(error, ValueError) and "closed file" in str(error)):
            self.failed = error  # the stream cannot be written (a closed sys.stdout raises the ValueError)
        else:
            super().handleError(record)


def format_train_line(m: dict[str, Any], step: int, total_steps: Optional[int] = None,
                      last_loss: Optional[float] = None, telemetry: bool = False) -> str:
    """The one-line summary of a train record."""
    head = f":: step {step}"
    if total_steps:
        head += f"/{total_steps} [{100.0 * step / total_steps:4.1f}%]"
    loss = m.get("train/loss")
    trend = " "
    if isinstance(loss, float) and last_loss is not None and math.isfinite(loss):
        trend = "\\" if loss < last_loss else ("/" if loss > last_loss else "=")
    fields = []
    if loss is not None:
        fields.append(f"loss {_num(loss, '.4f')}")
    if "grad_norm" in m:
        spike = "!" if m.get("health/grad_spike") else ""
        fields.append(f"norm {spike}{_num(m['grad_norm'], '.4f')}")
    if "train/lr" in m:
        fields.append(f"lr {_num(m['train/lr'], '.2e')}")
    if "train/tokens_per_sec" in m:
        fields.append(f"{_si(m['train/tokens_per_sec'])} tok/s")
    if "train/step_time_ms" in m:
        fields.append(_ms(m['train/step_time_ms']))
    if "train/mfu_pct" in m:
        fields.append(f"mfu {m['train/mfu_pct']:.1f}")
    if "moe/aux_loss" in m:
        fields.append(f"aux {_num(m['moe/aux_loss'], '.4f')}")
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
        fields.append(f"loss {_num(m['eval/loss'], '.4f')}")
    if "eval/gap" in m:
        fields.append(f"gap {m['eval/gap']:+.4f}")
    if "eval/ppl" in m:
        fields.append(f"ppl {_num(m['eval/ppl'], '.2f')}")
    if "eval/tokens_per_sec" in m:
        fields.append(f"{_si(m['eval/tokens_per_sec'])} tok/s")
    if "eval/time_ms" in m:
        fields.append(_ms(m['eval/time_ms']))
    return " | ".join(fields)


def format_timer_block(m: dict[str, Any]) -> str:
    """Megatron's ``(min, max) time across ranks (ms):`` block, from ``timers/<name>[/min]``, or
    under ``timing_log_option: max`` (no minimum) its ``max time across ranks (ms):`` block."""
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


def _si(v: float) -> str:
    """One decimal and a unit; a value that rounds up to the next unit takes it (999,960: 1.0M)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale * 0.99995 and (unit == "G" or abs(v) < scale * 999.95):
            return f"{v / scale:.1f}{unit}"
    return f"{v:.1f}"


def _ms(v: float) -> str:
    """Milliseconds to the millisecond; below 10, with the digits that say something (0.42 ms)."""
    return f"{v:.0f} ms" if abs(v) >= 9.5 or not math.isfinite(v) else f"{v:.2g} ms"
