"""Heatmaps: rows (modules in model order, ranks, layers) x step bins, one image each.

At most ``MAX_ROWS`` rows are drawn: beyond that neighbouring rows merge — norms by
root-sum-square (the merged modules' norm: per-module norms are subtree norms, so a module whose
ancestor is in the same row adds nothing, its norm being inside the ancestor's), ratios by their
mean, ranks by their max (a slow rank stays visible) — and the caption says how many rows each
drawn row holds. Grey is "no value" (:meth:`StepGrid.image`: steps lost in a ``gap`` record, a
stretch with no record); a magenta cross marks a bin holding a non-finite value. Restarts and
``gap`` records are marked as on every step plot. A colour scale may be logarithmic, and a
healthy band is marked on the colour bar.
"""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from .figures import DPI, EVENT_COLOURS, HEALTHY_BANDS, Figures, _thin
from .store import StepGrid

__all__ = ["heatmap", "MAX_ROWS"]

MAX_ROWS = 500
MAX_CROSSES = 3000
_MERGED = {"rss": "root-sum-square", "max": "max", "mean": "mean"}


def heatmap(figs: Figures, grid: StepGrid, title: str, labels: list, order: Optional[np.ndarray], how: str,
            log: bool, cmap: str, colour_label: str, row_name: str, band: Optional[str] = None) -> str:
    """One heatmap image of ``grid`` (rows in ``order`` when given; ``how`` merges rows beyond
    ``MAX_ROWS``: ``rss``, ``max`` or ``mean``); empty when the grid holds nothing."""
    image = grid.image(figs.data.lost)
    if image is None:
        return ""
    values, nonfinite, x0, x1 = image
    values, nonfinite, labels = _ordered(values, nonfinite, list(labels), order, row_name)
    values, nonfinite, labels, merged = _merge_rows(values, nonfinite, labels, how, row_name)
    rows_by_steps, flags = values.T, nonfinite.T
    try:  # a range near float64's largest (1e308 beside -1e308) fails in matplotlib before the PNG: a note
        fig, ax, bar_axes = _layout(figs, labels)
        norm = _colour_norm(figs, rows_by_steps, log)
        data = np.ma.masked_invalid(rows_by_steps)
        if log:
            data = np.ma.masked_where(~(rows_by_steps > 0), data)
        colours = figs.colormaps[cmap].with_extremes(bad="#d9d9d9")
        drawn = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=colours, norm=norm,
                          extent=(x0, x1, rows_by_steps.shape[0] - 0.5, -0.5))
        if flags.any():
            _cross_nonfinite(ax, flags, x0, x1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(*figs.xlim)
        _mark_steps(ax, [step for step, _ in figs.restarts], "black", figs.xlim)
        lost = sorted({step for first, last in figs.data.lost for step in (first, last)})
        _mark_steps(ax, lost, EVENT_COLOURS["gap"], figs.xlim)
        _colour_bar(fig, drawn, bar_axes, norm, log, colour_label, band)
    except (ValueError, OverflowError) as err:
        return figs.not_drawn(title, err)
    merges = f"; every row merges {merged} neighbouring {row_name}s ({_MERGED[how]}" if merged > 1 else ""
    if merges:
        merges += ", a module inside another of its row counted once)" if how == "rss" and row_name == "module" else ")"
    caption = (f"{rows_by_steps.shape[0]} rows x {rows_by_steps.shape[1]} columns (each {grid.width} step(s) "
               "wide: the mean of its log steps' values)" + merges
               + "; grey: no value (no record there, or lost: a gap record); magenta x: a non-finite value in the bin"
               + ("; dashed lines: restarts" if figs.restarts else "")
               + ("; olive lines: the first and last steps of records lost (gap records)" if figs.data.lost else ""))
    return figs.png(fig, title, caption)


def _mark_steps(ax, steps: list, colour: str, xlim: tuple) -> None:
    """Dashed lines across the heatmap at ``steps`` (thinned to distinct pixels), on a white line so
    they show on any colour."""
    if steps:
        x = _thin(np.asarray(steps, dtype=np.float64), xlim)
        transform = ax.get_xaxis_transform()
        ax.vlines(x, 0, 1, transform=transform, colors="white", linestyles="--", lw=1.4, zorder=5)
        ax.vlines(x, 0, 1, transform=transform, colors=colour, linestyles=(0, (3, 3)), lw=0.8, zorder=6)


def _ordered(values: np.ndarray, nonfinite: np.ndarray, labels: list, order: Optional[np.ndarray], row_name: str):
    """Rows in ``order``; rows a family never logged (shorter grid) are padded with no value."""
    if order is not None and values.shape[1] < order.size:
        pad = order.size - values.shape[1]
        values = np.concatenate([values, np.full((values.shape[0], pad), np.nan)], axis=1)
        nonfinite = np.concatenate([nonfinite, np.zeros((nonfinite.shape[0], pad), dtype=bool)], axis=1)
    if order is not None and (order.size == values.shape[1] or row_name == "rank"):  # ranks: those holding a value
        values, nonfinite, labels = values[:, order], nonfinite[:, order], [labels[i] for i in order]
    labels = labels + [f"{row_name} {i}" for i in range(len(labels), values.shape[1])]
    return values, nonfinite, labels


def _merge_rows(values: np.ndarray, nonfinite: np.ndarray, labels: list, how: str, row_name: str):
    """At most ``MAX_ROWS`` rows: ``k`` neighbours merged into one; returns (values, flags, labels, k)."""
    n = values.shape[1]
    k = -(-n // MAX_ROWS)
    if k <= 1:
        return values, nonfinite, labels, 1
    pad = (-n) % k
    if pad:
        values = np.concatenate([values, np.full((values.shape[0], pad), np.nan)], axis=1)
        nonfinite = np.concatenate([nonfinite, np.zeros((nonfinite.shape[0], pad), dtype=bool)], axis=1)
    if how == "rss" and row_name == "module":
        values = _inside_an_ancestor(values, labels, k)
    groups = values.reshape(values.shape[0], -1, k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups stay NaN
        if how == "rss":
            merged = np.sqrt(np.nansum(groups * groups, axis=2))
            merged[np.isnan(groups).all(axis=2)] = np.nan
        elif how == "max":
            merged = np.nanmax(groups, axis=2)
        else:
            merged = np.nanmean(groups, axis=2)
    flags = nonfinite.reshape(nonfinite.shape[0], -1, k).any(axis=2)
    if row_name == "rank":  # labels "rank <r>": only the ranks holding a value may be drawn (a group's job)
        names = [_ranks_of(labels[i: i + k]) for i in range(0, n, k)]
    else:
        names = [f"{labels[i]} (+{min(k, n - i) - 1})" for i in range(0, n, k)]
    return merged, flags, names, k


def _ranks_of(labels: list) -> str:
    """``ranks 4-7``, or ``ranks 0-6 (4 of them)`` where the ranks between hold no value."""
    first, last = labels[0][len("rank "):], labels[-1][len("rank "):]
    gaps = first.isdigit() and last.isdigit() and int(last) - int(first) + 1 != len(labels)
    return f"ranks {first}-{last}" + (f" ({len(labels)} of them)" if gaps else "")


def _inside_an_ancestor(values: np.ndarray, labels: list, k: int) -> np.ndarray:
    """``values`` with no value where a module's ancestor in its row of ``k`` (``layers`` for
    ``layers.0``) has one: its parameters are counted in the ancestor's norm already."""
    kept = values.copy()
    for start in range(0, len(labels), k):
        row = {name: start + i for i, name in enumerate(labels[start: start + k])}
        for name, column in row.items():
            parts = name.split(".")
            ancestors = [row[a] for a in (".".join(parts[:d]) for d in range(1, len(parts))) if a in row]
            if ancestors:
                kept[np.isfinite(values[:, ancestors]).any(axis=1), column] = np.nan
    return kept


def _layout(figs: Figures, labels: list):
    """(figure, heatmap axes, colour-bar axes) sized to the rows; every row labelled up to 60."""
    nrows = len(labels)
    if nrows <= 60:
        fig = figs.figure(12, max(2.2, 0.95 + 0.12 * nrows))
        font, ticks = 7, np.arange(nrows)
    else:
        fig = figs.figure(12, min(max(2.4, nrows / DPI + 1.5), 7.0))
        font = 6
        fits = max(4, int((fig.get_figheight() - 0.85) * 72 / (font + 4)))
        ticks = np.arange(0, nrows, -(-nrows // fits))
    tick_labels = [labels[i] for i in ticks]
    left = min(4.0, 0.35 + font / 72 * 0.62 * max(len(t) for t in tick_labels))
    width, height = fig.get_size_inches()
    ax = fig.add_axes((left / width, 0.5 / height, 1 - (left + 1.25) / width, 1 - 0.85 / height))
    bar_axes = fig.add_axes((1 - 1.1 / width, 0.5 / height, 0.14 / width, 1 - 0.85 / height))
    ax.set_yticks(ticks, tick_labels, fontsize=font)
    return fig, ax, bar_axes


def _colour_norm(figs: Figures, values: np.ndarray, log: bool):
    """Colour limits from the 0.5th..99.9th percentiles (a few extreme bins do not wash it out)."""
    finite = values[np.isfinite(values)]
    if log:
        finite = finite[finite > 0]
    if not finite.size:
        return figs.colors.LogNorm(1e-3, 1) if log else figs.colors.Normalize(0, 1)
    lo, hi = np.percentile(finite, [0.5, 99.9]) if finite.size > 100 else (finite.min(), finite.max())
    if not hi > lo:
        lo, hi = (lo / 2, hi * 2) if log else (lo - 0.5, hi + 0.5)
    return figs.colors.LogNorm(lo, hi) if log else figs.colors.Normalize(lo, hi)


def _cross_nonfinite(ax, flags: np.ndarray, x0: float, x1: float) -> None:
    """Magenta crosses on bins holding a non-finite value, visible even when a bin is one pixel."""
    rows, columns = np.nonzero(flags)
    per_cross = max(1, flags.shape[1] // 300)
    keep = np.unique(rows * (flags.shape[1] + 1) + columns // per_cross, return_index=True)[1][:MAX_CROSSES]
    x = x0 + (columns[keep] + 0.5) * (x1 - x0) / flags.shape[1]
    ax.scatter(x, rows[keep], s=22, marker="x", color="#ff00ff", linewidths=1.6, zorder=7)


def _colour_bar(fig, drawn, bar_axes, norm, log: bool, label: str, band: Optional[str]) -> None:
    bar = fig.colorbar(drawn, cax=bar_axes, extend="both")
    if log:  # a few labelled ticks, never a crowd of minor labels
        ticks = np.geomspace(norm.vmin, norm.vmax, 5)
        bar.set_ticks(ticks, labels=[f"{t:.2g}" for t in ticks])
        bar.ax.minorticks_off()
    if band in HEALTHY_BANDS:
        lo, hi, _ = HEALTHY_BANDS[band]
        bottom, top = max(lo, norm.vmin), min(hi, norm.vmax)
        if top > bottom:
            bar.ax.axhspan(bottom, top, xmin=0, xmax=1, facecolor="none", edgecolor="#2ca02c", lw=2.0, hatch="//")
        label += f"\n(green: healthy {lo:g}..{hi:g})"
    bar.set_label(label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
