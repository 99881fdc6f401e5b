"""A run report: one self-contained HTML page of a run's ``metrics.jsonl``, to look at.

    distmetrics report runs/demo/<time>               # writes runs/demo/<time>/report.html
    distmetrics report runs/demo                      # one report beside each run's metrics.jsonl
    distmetrics report runs/demo/<time>/metrics.jsonl --out /tmp/demo.html

    from distmetrics.report import write_report
    write_report("runs/demo", "runs/demo/report.html")

Loss (train, eval, by category), learning rate and eval gap; total grad norm, clip ratio and
per-module heatmaps (modules in model order x log steps, log colour scale) of grad, update and
parameter norms and the relative update norm, with the healthy bands marked; timers as a ranks x
steps heatmap (``timing_log_option: all``) or the min/max band with the straggler's rank;
straggler scores; throughput, MFU, SOL and ETA; memory, power and energy; alerts marked on every
curve; tensor statistics per layer. Several jobs in one file are one timeline, restarts marked.
The page holds its images as PNG data URIs and its style inline: no script, no network.

It reads the file line by line into bounded arrays (:mod:`.read`, :mod:`.store`): 4,096 ranks x
2,000 modules x 10,000 log steps (a 12 GB file) render in 141 s on 2 CPU cores, 1.5x the time
``json.loads`` alone takes on that file, growing linearly with its size (``python -m
benchmarks.report``). It needs numpy and matplotlib, the ``report`` extra;
it never imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..runlog import EmptyMetricsFile, NotAMetricsFile

__all__ = ["write_report", "load_metrics", "require_plotting", "MissingExtra", "NotAMetricsFile", "EmptyMetricsFile",
           "INSTALL_HINT"]

INSTALL_HINT = 'pip install numpy matplotlib (the "report" extra)'
"""How to get what the report needs."""


class MissingExtra(ImportError):
    """The report's plotting packages are not installed (the message says how to install them)."""


def require_plotting() -> None:
    """Raise :class:`MissingExtra`, naming the extra to install, unless numpy and matplotlib import."""
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as err:
        raise MissingExtra(f"the run report needs numpy and matplotlib ({err.name or err} is not installed): "
                           f"{INSTALL_HINT}") from err


NOT_A_PAGE = ("is a file that is not an HTML page (a run's metrics.jsonl, say), which the report would replace; "
              "give the HTML file to write (report.html, say)")


def may_overwrite(out: Union[str, os.PathLike]) -> bool:
    """Whether ``out`` may be written: no file there, an empty one, or an HTML page (a report before)."""
    try:
        with open(out, "rb") as f:
            head = f.read(64).lstrip().lower()
    except OSError:
        return True  # none there (a folder is said apart), or unreadable: the write says why
    return not head or head.startswith((b"<!doctype html", b"<html"))


def write_report(run: Union[str, os.PathLike], out: Optional[Union[str, os.PathLike]] = None) -> str:
    """Read a run's ``metrics.jsonl`` (the file, the run directory holding it, or a folder holding
    one such run directory) and write the report to ``out`` (default: ``report.html`` beside the
    file); returns the path written. Raises :class:`MissingExtra` before reading anything when
    matplotlib or numpy is missing, ``FileNotFoundError`` when the path does not exist,
    ``ValueError`` when it names no metrics file or several runs or ``out`` is a folder or a file
    other than an HTML page,
    :class:`EmptyMetricsFile` when the file holds nothing but blank lines (a run that wrote nothing), and
    :class:`NotAMetricsFile` when not one of its lines is a record, as ``summary`` reads them."""
    require_plotting()
    from .html import render_report
    from .read import load_metrics as load, metrics_path

    if out is not None and os.path.isdir(out):  # refused before a long read, not at the rename after it
        raise ValueError(f"{str(out)!r} is a folder: give the HTML file to write "
                         f"({str(Path(out) / 'report.html')!r}, say)")
    if out is not None and not may_overwrite(out):
        raise ValueError(f"{str(out)!r} {NOT_A_PAGE}")
    path = metrics_path(run)
    data = load(path)
    return render_report(data, Path(out) if out is not None else path.parent / "report.html")


def load_metrics(run: Union[str, os.PathLike]):
    """What the report draws (a :class:`~distmetrics.report.read.RunData`), read from a run."""
    require_plotting()
    from .read import load_metrics as load

    return load(run)
