"""Megatron-Core's timer text block, written once for the Megatron timer reports
(:mod:`distmetrics.collectors.timer_reports`) and the console sink::

    (min, max) time across ranks (ms):
        forward-backward ...............................: (10.12, 30.54)

(``max time across ranks (ms):`` and one number per line under ``timing_log_option: max``).
Byte for byte Megatron's (``megatron/core/timers.py``); no torch, so the sinks can use it.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["time_block"]


def time_block(times: Mapping[str, tuple[float, float]], max_only: bool = False) -> str:
    """The block for ``name → (fastest, slowest)`` in milliseconds; ``""`` when there are none."""
    if not times:
        return ""
    lines = ["max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"]
    for name, (low, high) in times.items():
        label = (name + " ").ljust(48, ".")
        lines.append(f"    {label}: {high:.2f}" if max_only else f"    {label}: ({low:.2f}, {high:.2f})")
    return "\n".join(lines)
