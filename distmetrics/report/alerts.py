"""Alerts and health: every ``alert`` record, plus what the health metrics flag (spikes, skipped
steps, non-finite values) where no alert record says it, with the first non-finite module, and
the ``gap`` (records that could not be written) and ``resume`` records. The steps of each kind
are marked on every step plot (:meth:`Figures.mark`)."""

from __future__ import annotations

import math

import numpy as np

from .figures import EVENT_COLOURS, Figures, escape, job_number, panel_figure, series_panel
from .read import RunData

__all__ = ["events_of", "alert_section"]

MAX_TABLE_ROWS = 300
_FLAGS = (("health/loss_spike", "loss_spike", "health/loss_spike_factor", "loss spike: {:.3g} x the moving average"),
          ("health/grad_spike", "grad_spike", "health/grad_spike_factor", "grad-norm spike: {:.3g} x the average"),
          ("health/skipped_steps", "skipped_steps", None, "{:g} skipped step(s)"),
          ("health/nonfinite_loss", "nonfinite_loss", None, "non-finite loss in {:g} rank-step(s)"),
          ("grad_nonfinite", "nonfinite_grad", None, "{:g} non-finite gradient tensor(s)"))


def events_of(data: RunData) -> list[dict]:
    """Alert, gap and resume records and the health metrics' flags, in job and step order (one per
    job, step and kind: a restarted job's step is its own, beside the earlier job's)."""
    events = [dict(a, source="alert") for a in data.alerts] + [dict(e, source="record") for e in data.events]
    have = {(e["job"], e["step"], e["type"]) for e in events}
    nonfinite: dict[tuple, list[dict]] = {}  # (job, step) -> its nonfinite_grad events (one pass, not one per find)
    for event in events:
        if event["type"] == "nonfinite_grad":
            nonfinite.setdefault((event["job"], event["step"]), []).append(event)
    for found in data.first_nonfinite:  # the first non-finite module, written beside the metrics
        for event in nonfinite.get((found["job"], found["step"]), ()):
            if not event.get("first_module"):
                event["first_module"] = found["module"]
        if (found["job"], found["step"], "nonfinite_grad") not in have:
            events.append({"step": found["step"], "job": found["job"], "type": "nonfinite_grad", "source": "metric",
                           "message": "non-finite gradient", "first_module": found["module"]})
            have.add((found["job"], found["step"], "nonfinite_grad"))
    table = data.scalars
    for key, kind, factor_key, message in _FLAGS:
        if not table.has(key):
            continue
        steps, jobs, values = table.series(key)
        factors = {}
        if factor_key and table.has(factor_key):
            factor_steps, factor_jobs, factor_values = table.series(factor_key)
            factors = dict(zip(zip(factor_jobs.tolist(), factor_steps.tolist()), factor_values.tolist()))
        for i in np.flatnonzero(np.nan_to_num(values, nan=1.0) > 0):
            step, job = int(steps[i]), int(jobs[i])
            if (job, step, kind) in have:
                continue
            have.add((job, step, kind))
            value = float(factors.get((jobs[i].item(), steps[i].item()), values[i]))
            events.append({"step": step, "job": job, "type": kind, "source": "metric", "first_module": None,
                           "message": message.format(value) if math.isfinite(value) else f"{key} = {value}"})
    events.sort(key=lambda e: (e["job"], e["step"]))
    return events


def alert_section(figs: Figures, events: list[dict]) -> str:
    """Health curves, counts per kind and a table of the events (the first ``MAX_TABLE_ROWS``)."""
    panels = [series_panel(figs, names, title, ylabel, log=log) for title, names, ylabel, log in (
        ("Spike factors (value / moving average)", ["health/loss_spike_factor", "health/grad_spike_factor"], "x", None),
        ("Non-finite loss (rank-steps) / skipped steps", ["health/nonfinite_loss", "health/skipped_steps"], "count",
         False),
        ("Non-finite gradient tensors / parameters without a gradient", ["grad_nonfinite", "grad_missing_params"],
         "count", False))]
    out = [panel_figure(figs, panels, "health")]
    if not events:
        return out[0] + ("<p>No alert record, and no spike, skipped step or non-finite value flagged by the health "
                         "metrics.</p>")
    counts: dict[str, int] = {}
    for event in events:
        counts[event["type"]] = counts.get(event["type"], 0) + 1
    out.append("<p>" + ", ".join(f'<span class=ev style="color:{EVENT_COLOURS.get(k, "#000")}">{escape(k)}</span>: {n}'
                                 for k, n in counts.items()) + "</p>")
    rows = [f'<tr><td>{e["step"]}</td><td>{job_number(e["job"])}</td>'
            f'<td style="color:{EVENT_COLOURS.get(e["type"], "#000")}">{escape(e["type"])}</td>'
            f'<td>{escape(e.get("first_module") or "")}</td><td>{escape(e.get("message", ""))}</td>'
            f'<td>{escape(e["source"])}</td></tr>' for e in events[:MAX_TABLE_ROWS]]
    out.append("<table><tr><th>step</th><th>job</th><th>type</th><th>first module</th><th>message</th><th>from</th>"
               "</tr>" + "".join(rows) + "</table>")
    if len(events) > MAX_TABLE_ROWS:
        out.append(f"<p class=note>{len(events) - MAX_TABLE_ROWS} more not listed.</p>")
    return "".join(out)
