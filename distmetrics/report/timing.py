"""The timers and stragglers section.

Under ``timing_log_option: all`` every rank's timer values are in the file
(``timers/<name>/rank<r>``): a ranks x steps heatmap per timer, the spread over ranks and the
slowest rank at every log step. Under ``max``/``minmax`` only the extremes are: the min..max band
and the straggler's rank. The straggler scores (``stragglers/score_min``, per timer, and the last
``stragglers`` record) follow.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Optional

import numpy as np

from .figures import Figures, escape, fmt, job_number, panel_figure, plot_series, segments
from .heatmap import heatmap

__all__ = ["timer_section"]

MAX_OTHER_PER_RANK = 12
_TIMER_SUFFIX = re.compile(r"/(min|mean|max|min_rank|max_rank)$")


def timer_section(figs: Figures) -> str:
    """Timers (per rank or min/max), straggler scores, and every other per-rank metric."""
    data = figs.data
    out, minmax_panels = [], []
    for name in _timer_names(figs):
        key = f"timers/{name}"
        grid = data.grids.get(("rank", key))
        if grid is not None:  # a job under timing_log_option all
            out.append(_per_rank_timer(figs, key, grid))
        if data.scalars.has(key):  # a job under max or minmax (one file may hold both)
            minmax_panels += _minmax_timer(figs, name)
    if minmax_panels:
        out.insert(0, panel_figure(figs, minmax_panels, "timers (min/max over ranks)"))
    out.append(_straggler_scores(figs))
    others = [g for (kind, name), g in data.grids.items() if kind == "rank" and not name.startswith("timers/")]
    if len(others) > MAX_OTHER_PER_RANK:
        out.append(f"<p class=note>{len(others)} other per-rank metrics; the first {MAX_OTHER_PER_RANK} are "
                   "drawn.</p>")
    for grid in others[:MAX_OTHER_PER_RANK]:  # other per-rank ('all') metrics
        out.append(f"<h3>{escape(grid.name)} (per rank)</h3>")
        out.append(heatmap(figs, grid, f"{grid.name}: ranks x steps (merged ranks show their max)",
                           *_rank_rows(grid), "max", log=False, cmap="magma",
                           colour_label=grid.name.rsplit("/", 1)[-1], row_name="rank"))
    body = "".join(out)
    return _timer_table(figs) + body if body else ""


def _rank_rows(grid) -> tuple[list, Optional[np.ndarray]]:
    """A per-rank heatmap's row labels and the rows drawn: the ranks that hold a value (a Monitor on
    ranks 2 and 3 draws no empty rows for ranks 0 and 1), all where every rank does."""
    held = grid.held_rows()
    return [f"rank {r}" for r in range(grid.rows)], (None if held.size == grid.rows else held)


def _timer_names(figs: Figures) -> list[str]:
    data = figs.data
    names = [n[len("timers/"):] for n in data.scalars.names if n.startswith("timers/") and not _TIMER_SUFFIX.search(n)]
    names += [g.name[len("timers/"):] for (kind, _), g in data.grids.items()
              if kind == "rank" and g.name.startswith("timers/")]
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (n != "step", names.index(n)))


def _per_rank_timer(figs: Figures, key: str, grid) -> str:
    parts = [f"<h3>{escape(key)} (per rank)</h3>",
             heatmap(figs, grid, f"{key}: ranks x steps (ms; merged ranks show their max)",
                     *_rank_rows(grid), "max", log=False, cmap="magma",
                     colour_label="ms", row_name="rank")]
    spread = grid.spread_arrays()
    if spread:
        def draw_spread(ax) -> None:
            fill_by_job(ax, spread["step"], spread["job"], spread["min"], spread["max"])
            plot_series(ax, spread["step"], spread["job"], spread["median"], "median over ranks", color="C0")
            plot_series(ax, spread["step"], spread["job"], spread["max"], "max (the slowest rank)", color="C3", lw=0.8)

        def draw_slowest(ax) -> None:
            ok = (spread["slowest"] >= 0) & not_replaced(spread["step"], spread["job"], figs.data.jobs)
            ax.scatter(spread["step"][ok], spread["slowest"][ok], s=4, color="C3")
            ax.yaxis.get_major_locator().set_params(integer=True)
        parts.append(panel_figure(figs, [(f"{key} over ranks", "ms", draw_spread),
                                         (f"{key}: the slowest rank at each log step", "rank", draw_slowest)],
                                  f"{key} spread"))
    return "".join(parts)


def not_replaced(steps: np.ndarray, jobs: np.ndarray, meta: list) -> np.ndarray:
    """The records no later job replaced: a job resumed at step s (``meta``: the jobs as read, with
    ``resumed_at``) replaces the earlier jobs' steps from s on, whatever it logs itself (one slowest rank
    per log step, as the heatmaps hold only the new job's values there)."""
    keep = np.ones(steps.size, dtype=bool)
    for later, job in enumerate(meta):
        if job.get("resumed_at") is not None:
            keep &= ~((jobs < later) & (steps >= job["resumed_at"]))
    return keep


def fill_by_job(ax, steps: np.ndarray, jobs: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """The min..max band, one piece per job's run of records: a job resumed at an earlier step starts
    its own (one band over both went back in steps, a polygon crossing itself)."""
    for i, (a, b) in enumerate(segments(jobs)):
        ax.fill_between(steps[a:b], low[a:b], high[a:b], color="C0", alpha=0.2,
                        label="min..max over ranks" if i == 0 else None)


def _minmax_timer(figs: Figures, name: str) -> list:
    table, key = figs.data.scalars, f"timers/{name}"

    def draw(ax) -> None:
        steps, jobs, slowest = table.series(key)
        if table.has(f"{key}/min"):
            steps_min, jobs_min, fastest = table.series(f"{key}/min")
            if steps_min.size == steps.size:
                fill_by_job(ax, steps, jobs, fastest, slowest)
            plot_series(ax, steps_min, jobs_min, fastest, "min", color="C2", lw=0.8)
        plot_series(ax, steps, jobs, slowest, "max", color="C3", lw=1.0)
        if table.has(f"{key}/mean"):
            plot_series(ax, *table.series(f"{key}/mean"), "mean", color="C0")
    panels = [(f"{key} (ms)", "ms", draw)]
    rank_key = next((k for k in (f"stragglers/{name}/rank", f"{key}/max_rank") if table.has(k)), None)
    ratio_key = next((k for k in (f"stragglers/{name}/max_over_mean", f"stragglers/{name}/max_over_median")
                      if table.has(k)), None)
    if rank_key or ratio_key:
        def draw_straggler(ax) -> None:
            if rank_key:
                steps, jobs, ranks = table.series(rank_key)
                kept = not_replaced(steps, jobs, figs.data.jobs)
                ax.scatter(steps[kept], ranks[kept], s=8, color="C3", label="the slowest rank", zorder=3)
                ax.yaxis.get_major_locator().set_params(integer=True)
            if ratio_key:
                other = ax.twinx() if rank_key else ax
                plot_series(other, *table.series(ratio_key), ratio_key.rsplit("/", 1)[1], color="C0", lw=1.0)
                other.tick_params(labelsize=7)
                other.set_ylabel(ratio_key.rsplit("/", 1)[1], fontsize=8)
        host = figs.data.last_text.get(f"stragglers/{name}/host")
        panels.append((f"{key}: the straggler" + (f" (last: {host})" if host else ""), "rank", draw_straggler))
    return panels


def _straggler_scores(figs: Figures) -> str:
    """``stragglers/score_min`` (and per timer) over steps, its rank, and the last stragglers record."""
    table = figs.data.scalars
    names = ["stragglers/score_min"] + [n for n in table.names if n.startswith("stragglers/")
                                        and n.endswith("/score_min")]
    names = [n for n in dict.fromkeys(names) if table.has(n)]
    if not names and not figs.data.straggler_reports:
        return ""
    threshold = figs.data.straggler_reports[-1][2].get("threshold") if figs.data.straggler_reports else None
    panels = []
    if names:
        def draw_scores(ax) -> None:
            for i, name in enumerate(names[:10]):
                plot_series(ax, *table.series(name), name, color=f"C{i % 10}", lw=1.0)
            if isinstance(threshold, (int, float)):
                ax.axhline(threshold, color="black", ls=":", lw=0.8, label=f"threshold {threshold:g}")
            ax.set_ylim(0, 1.05)
        panels.append(("Straggler score of the slowest rank (1 = as fast as the fastest)", "score", draw_scores))
    if table.has("stragglers/score_min_rank"):
        def draw_rank(ax) -> None:
            steps, _, ranks = table.series("stragglers/score_min_rank")
            ax.scatter(steps, ranks, s=8, color="C3")
            ax.yaxis.get_major_locator().set_params(integer=True)
        panels.append(("The slowest rank (by score)", "rank", draw_rank))
    return "<h3>Straggler scores</h3>" + panel_figure(figs, panels, "straggler scores") + _straggler_record(figs)


def _straggler_record(figs: Figures) -> str:
    if not figs.data.straggler_reports:
        return ""
    step, job, record = figs.data.straggler_reports[-1]
    columns = ("rank", "host", "local_rank", "score", "ms", "power_w", "sm_clock_mhz")
    rows = []
    timers = record.get("timers") if isinstance(record.get("timers"), dict) else {}
    sides = [(side, record.get(side)) for side in ("slowest", "fastest")]
    for side, held in sides + [(f"slowest in {name}", held) for name, held in timers.items()]:
        for row in held if isinstance(held, list) else []:
            if isinstance(row, dict):
                rows.append(f"<tr><td>{escape(side)}</td>" + "".join(f"<td>{escape(fmt(row.get(c)))}</td>"
                                                                     for c in columns) + "</tr>")
    return (f"<p>The last <code>stragglers</code> record (step {step}, job {job_number(job)}; score over the last "
            f"{escape(record.get('window'))} log steps: the fastest rank's median ms per step / the rank's):</p>"
            "<table><tr><th>side</th>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>" + "".join(rows)
            + "</table>")


def _timer_table(figs: Figures) -> str:
    """One row per timer: median and last max, last min, the slowest rank at the last log step."""
    data, table = figs.data, figs.data.scalars
    rows = []
    for name in _timer_names(figs):
        key = f"timers/{name}"
        grid = data.grids.get(("rank", key))
        sources = []  # ((last job, its last step), max values, last min, slowest rank there) per way of logging
        if grid is not None and grid.spread:
            spread = grid.spread_arrays()
            sources.append(((spread["job"][-1], spread["step"][-1]), spread["max"], spread["min"][-1],
                            int(spread["slowest"][-1])))
        if table.has(key):
            steps, jobs, slowest = table.series(key)

            def at_last(name_: str) -> float:  # its value in the record of the last max (same job, same step):
                if not table.has(name_):  # another series may end at another step or job (a restart under
                    return math.nan  # another timing_log_option, or on fewer ranks)
                their_steps, their_jobs, values = table.series(name_)
                held = (their_steps == steps[-1]) & (their_jobs == jobs[-1])
                return float(values[held][-1]) if held.any() else math.nan

            rank_of = next((at_last(k) for k in (f"stragglers/{name}/rank", f"{key}/max_rank") if table.has(k)
                            and math.isfinite(at_last(k))), math.nan)
            sources.append(((jobs[-1], steps[-1]), slowest, at_last(f"{key}/min"),
                            int(rank_of) if math.isfinite(rank_of) else -1))
        if not sources:
            continue
        # jobs of one file logging it both ways: the median over both, the last values the later job's (a
        # resume at an earlier step is later, though the rolled-back job logged higher steps)
        _, latest, last_min, rank = max(sources, key=lambda source: source[0])
        slowest, last_max = np.concatenate([source[1] for source in sources]), latest[-1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            cells = (key, fmt(float(np.nanmedian(slowest))), fmt(float(last_max)),
                     fmt(float(last_min)) if math.isfinite(last_min) else "",  # none (timing_log_option: max)
                     "" if rank < 0 else rank, data.rank_hosts.get(rank, ""))
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    if not rows:
        return ""
    return ("<table><tr><th>timer</th><th>median of max (ms)</th><th>last max</th><th>last min</th>"
            "<th>slowest rank (last)</th><th>host</th></tr>" + "".join(rows) + "</table>")
