"""The page: a summary of the run, its jobs, then every section, written as one HTML file with
its images embedded, its style inline, no script and no reference to anything outside it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Union

import numpy as np

from ..runlog import end_note
from ..sinks import DASHBOARD_KINDS
from .alerts import alert_section, events_of
from .figures import EVENT_COLOURS, HEALTHY_BANDS, Figures, escape, fmt, job_number
from .read import RunData
from .sections import (hardware_section, loss_section, norm_section, other_section, tensor_section,
                       throughput_section)
from .timing import timer_section

__all__ = ["render_report"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1240px;padding:12px 20px;
color:#222;background:#fff}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:3px;margin-top:28px}
h3{font-size:15px;margin:16px 0 4px}
figure{margin:8px 0}img{max-width:100%;height:auto;display:block}
figcaption{font-size:12px;color:#555}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.note{font-size:12px;color:#666}.ev{font-weight:600}
nav a{margin-right:12px;font-size:13px}.sum td:first-child{color:#555}
"""


def render_report(data: RunData, out: Union[str, os.PathLike]) -> str:
    """Draw the report of ``data`` into one self-contained HTML file at ``out``; returns its path.
    The file is written next to its final name and moved there, so a reader never sees half a page."""
    t0 = time.perf_counter()
    figs = Figures(data)
    events = events_of(data)
    for kind in dict.fromkeys(list(EVENT_COLOURS) + [e["type"] for e in events]):
        figs.events[kind] = np.asarray(sorted({e["step"] for e in events if e["type"] == kind}), dtype=np.float64)
    sections = (("loss", "Loss and learning rate", loss_section),
                ("norms", "Gradients, updates and parameters", norm_section),
                ("timers", "Timers and stragglers", timer_section),
                ("throughput", "Throughput, MFU, SOL, ETA", throughput_section),
                ("hardware", "Memory, power, energy", hardware_section),
                ("alerts", "Alerts and health", lambda f: alert_section(f, events)),
                ("tensors", "Tensor statistics", tensor_section),
                ("other", "Other metrics", other_section))
    body, links = [], []
    from matplotlib import rc_context

    for anchor, title, section in sections:
        with rc_context({"text.parse_math": False}):  # a metric named "u/$x$" is text, not mathtext to parse
            content = section(figs)
        if content:
            links.append(f'<a href="#{anchor}">{escape(title)}</a>')
            body.append(f'<section id="{anchor}"><h2>{escape(title)}</h2>{content}</section>')
    drawn_s = time.perf_counter() - t0
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>distmetrics report: {escape(data.path.parent.name or data.path.name)}</title>"
            f"<style>{_CSS}</style></head><body><h1>distmetrics report</h1>"
            + _summary(data, figs, drawn_s) + f"<nav>{' '.join(links)}</nav>" + _legend()
            + "<h2>Jobs</h2>" + _jobs_table(data) + "".join(body) + "</body></html>")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:  # a path that is not UTF-8 (bytes the file system allows) shows "?" for those bytes
        partial.write_bytes(page.encode("utf-8", "replace"))
        os.replace(partial, path)
    except BaseException as err:
        partial.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a full disk's write names no file: the report's
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    return str(path)


def _summary(data: RunData, figs: Figures, drawn_s: float) -> str:
    ranks = max([g.held_rows().size for (kind, _), g in data.grids.items() if kind == "rank"] + [0])
    sizes = list(dict.fromkeys(str(j["world_size"]) for j in data.jobs if j.get("world_size")))  # a list's too
    world = ", ".join(map(str, sizes)) + (" (the jobs ran on different world sizes)" if len(sizes) > 1 else "")
    others = "".join(f", {n} {kind} record(s)" for kind, n in data.kinds.items() if kind not in DASHBOARD_KINDS)
    rows = (("file", f"{data.path} ({data.path.stat().st_size / 2**20:.1f} MiB, {data.lines} lines, "
                     f"{data.bad_lines} unreadable)"),
            ("records", f"{data.records} metric records (train, eval, tensor_stats){others}, {len(data.jobs)} job(s), "
                        f"{len(data.alerts)} alert record(s)"),
            ("steps", f"{data.step_min} .. {data.step_max}"),
            ("world size", f"{world or '-'}" + (f" ({ranks} ranks with per-rank values)" if ranks else "")),
            *([("modules", f"{len(data.modules)}" + (" (in model order)" if data.model_order else ""))]
              if data.modules else []),
            ("GPUs", ", ".join(f"{n} x {k}" for k, n in data.gpu_models.items()) or "-"),
            ("made in", f"read {data.read_s:.2f} s, drawn {drawn_s:.2f} s, {figs.images} images"))
    return "<table class=sum>" + "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in rows) \
        + "</table>"


def _legend() -> str:
    marks = " ".join(f'<span class=ev style="color:{c}">| {escape(k)}</span>' for k, c in EVENT_COLOURS.items())
    bands = "".join(f"<tr><td>{escape(k)}</td><td>{lo:g}</td><td>{hi:g}</td><td>{escape(why)}</td></tr>"
                    for k, (lo, hi, why) in HEALTHY_BANDS.items())
    return (f"<p class=note>Marks on every step plot: <b>- - -</b> a restart (new job) {marks}; a red x at the "
            "top: a non-finite value. Healthy bands (green):</p>"
            f"<table><tr><th>metric</th><th>low</th><th>high</th><th>why</th></tr>{bands}</table>")


def _jobs_table(data: RunData) -> str:
    """A row per job; its first and last step are those of its train records, as `distmetrics summary` gives them
    (a resume, evaluation or tensor_stats record may come first)."""
    rows = []
    for job in data.jobs:
        note = ""
        if job.get("resumed_at_or_before_last"):
            note = f"resumed at step {job['resumed_at']} <= last logged {job['previous_last_step']}"
        elif job["index"] > 0:
            note = "restart"
        cells = (job_number(job["index"]), job["time"], job["first_train_step"], job["last_train_step"], job["records"],
                 job["world_size"], job["hosts"], job["job_id"], job["layout"], job["torch"], job["distmetrics"],
                 end_note(job.get("end"), last=job is data.jobs[-1], expected=job.get("end_record", False)), note)
        rows.append("<tr>" + "".join(f"<td>{escape(fmt(v))}</td>" for v in cells) + "</tr>")
    return ("<table><tr><th>job</th><th>started</th><th>first step</th><th>last step</th><th>records</th>"
            "<th>world size</th><th>hosts</th><th>job id</th><th>layout</th><th>torch</th><th>distmetrics</th>"
            "<th>end</th><th>note</th></tr>" + "".join(rows) + "</table>")
