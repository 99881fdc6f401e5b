"""Drawing: matplotlib figures (the Agg canvas, never pyplot) turned into embedded PNG images.

Every step plot shares the report's step axis, breaks its line at restarts (one segment per
job), marks restarts with a dashed line and alerts with thin coloured lines, draws a
non-finite value as a red cross at the top, and shades a metric's healthy band in green.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any, Callable, Optional

import numpy as np

from .read import RunData

__all__ = ["HEALTHY_BANDS", "EVENT_COLOURS", "Figures", "plot_series", "panel_figure", "series_panel",
           "escape", "fmt", "auto_log", "mark_band", "margins", "segments"]

HEALTHY_BANDS: dict[str, tuple[float, float, str]] = {
    "relative_update_norm": (1e-4, 1e-2, "|dP| / |P| per step: below 1e-4 the weights barely move, "
                                         "above 1e-2 each step rewrites a percent of them (unstable)"),
    "grad_clip_ratio": (0.0, 1.0, "grad_norm / max_norm: above 1 the step was clipped"),
}
"""metric → (low, high, why): shaded green on that metric's plot and marked on its per-module
heatmap's colour bar (the README's table of healthy bands)."""

EVENT_COLOURS = {"nonfinite_grad": "#d62728", "nonfinite_loss": "#8b0000", "loss_spike": "#ff7f0e",
                 "grad_spike": "#9467bd", "skipped_steps": "#7f7f7f", "straggler": "#17becf", "gap": "#bcbd22",
                 "resume": "#2ca02c"}
DPI = 100
MAX_EVENT_LINES = 1500  # vertical event lines per plot (thinned to distinct pixels beyond)

Panel = tuple[str, str, Callable[[Any], None]]  # (title, y label, draw(axes))


class Figures:
    """What every plot shares: matplotlib, the step range, restarts, event steps, the image count."""

    def __init__(self, data: RunData) -> None:
        from matplotlib import colormaps, colors
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._figure, self._canvas = Figure, FigureCanvasAgg
        self.colors, self.colormaps = colors, colormaps
        self.data = data
        lo = data.step_min if data.step_min is not None else 0
        hi = data.step_max if data.step_max is not None else 1
        steps = np.unique(data.scalars.steps)
        interval = float(np.median(np.diff(steps))) if steps.size > 1 else 1.0
        pad = max(0.5 * interval, 0.005 * (hi - lo), 0.5)
        self.xlim = (lo - pad, hi + pad)
        self.restarts = [(j["first_step"], j["index"]) for j in data.jobs[1:] if j["first_step"] is not None]
        self.events: dict[str, np.ndarray] = {}
        self.images = 0

    def figure(self, width: float, height: float):
        """A new figure (inches) on an Agg canvas; fixed margins, as constrained layout is slow."""
        fig = self._figure(figsize=(width, height), dpi=DPI)
        self._canvas(fig)
        return fig

    def png(self, fig, alt: str, caption: str = "") -> str:
        """The figure as an ``<img>`` with a base64 PNG data URI (the page needs no other file)."""
        buffer = io.BytesIO()
        try:
            fig.savefig(buffer, format="png", dpi=DPI)
        except (ValueError, OverflowError) as err:  # matplotlib's ticks over a range near float64's (1e308)
            return self.not_drawn(alt, err)
        self.images += 1
        uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
        text = f"<figcaption>{escape(caption)}</figcaption>" if caption else ""
        return f'<figure><img src="{uri}" alt="{escape(alt)}">{text}</figure>'

    def not_drawn(self, alt: str, err: Exception) -> str:
        """The note in place of a figure matplotlib raised ``err`` drawing (the page goes on)."""
        return (f'<p class="note">{escape(alt)}: not drawn (matplotlib raised {escape(type(err).__name__)}: '
                f'{escape(str(err))}); metrics.jsonl has the values.</p>')

    def mark(self, ax, events: bool = True) -> None:
        """Restarts (dashed, labelled) and events (thin coloured lines) across a step plot."""
        transform = ax.get_xaxis_transform()
        if len(self.restarts) > 20:  # many restarts: one collection, no labels
            ax.vlines([r[0] for r in self.restarts], 0, 1, transform=transform, colors="black",
                      linestyles="--", lw=0.8, alpha=0.6, zorder=5)
        else:
            gap, labelled = 0.04 * (self.xlim[1] - self.xlim[0]), None  # labels closer than this would overlap
            for step, index in self.restarts:
                ax.axvline(step, color="black", ls="--", lw=1.0, alpha=0.8, zorder=5)
                if labelled is None or step - labelled >= gap:
                    labelled = step
                    ax.text(step, 0.99, f" job {job_number(index)}", transform=transform, fontsize=7, va="top",
                            ha="left", zorder=6)
        if events:
            for kind, steps in self.events.items():
                if steps.size:
                    ax.vlines(_thin(steps, self.xlim), 0, 1, transform=transform,
                              colors=EVENT_COLOURS.get(kind, "black"), lw=0.9, alpha=0.55, zorder=4)

    def axis(self, ax, title: str, ylabel: str = "") -> None:
        """Title, label, the shared step range, small ticks, a light grid."""
        ax.set_title(title, fontsize=10)
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlim(*self.xlim)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.25)


def panel_figure(figs: Figures, panels: list, title: str, ncols: int = 2, height: float = 2.9) -> str:
    """Small multiples, one image: ``panels`` = [(title, y label, draw(axes))]; None entries skipped."""
    panels = [p for p in panels if p]
    if not panels:
        return ""
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = figs.figure(12, height * nrows)
    margins(fig, left=0.8, right=0.6, top=0.3, bottom=0.45, hspace=0.75, wspace=1.1, nrows=nrows, ncols=ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (panel_title, ylabel, draw) in zip(axes.ravel(), panels):
        figs.axis(ax, panel_title, ylabel)
        draw(ax)
        figs.mark(ax)
        handles, labels = ax.get_legend_handles_labels()
        if len(handles) > 1 or (handles and labels[0] != panel_title):
            ax.legend(fontsize=7, loc="best")
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    return figs.png(fig, f"{title}: " + "; ".join(p[0] for p in panels))


def series_panel(figs: Figures, names: list, title: str, ylabel: str = "", log: Optional[bool] = None,
                 band: Optional[str] = None) -> Optional[Panel]:
    """A panel of the scalar metrics ``names`` present in the file (None if none is); ``log``
    None: a log scale when the values span more than 30x; ``band``: shade that healthy band."""
    table = figs.data.scalars
    names = [n for n in names if table.has(n)]
    if not names:
        return None

    def draw(ax) -> None:
        arrays = []
        for name in names:
            steps, jobs, values = table.series(name)
            plot_series(ax, steps, jobs, values, name,
                        marker="o" if name.startswith("eval/") or steps.size < 30 else None)
            arrays.append(values)
        limits = HEALTHY_BANDS.get(band) if band else None
        if log or (log is None and limits and limits[0] > 0 and limits[1] / limits[0] >= 100):
            ax.set_yscale("log")
        elif log is None:
            auto_log(ax, *arrays)
        if band:
            mark_band(ax, band)
    return (title, ylabel, draw)


def plot_series(ax, steps, jobs, values, label, color=None, marker=None, ls="-", lw=1.2, alpha=1.0):
    """One series, one line segment per job; non-finite values as red crosses at the top."""
    handle = None
    for a, b in segments(jobs):
        y = values[a:b]
        (line,) = ax.plot(steps[a:b], np.where(np.isfinite(y), y, np.nan), label=label if handle is None else None,
                          color=color if handle is None else handle.get_color(), ls=ls, lw=lw, alpha=alpha,
                          marker=marker, ms=3 if marker else 0)
        handle = handle or line
    bad = ~np.isfinite(values)
    if bad.any():
        ax.plot(steps[bad], np.full(int(bad.sum()), 0.97), "x", color="red", ms=6, mew=1.5,
                transform=ax.get_xaxis_transform(), zorder=7)
    return handle


def auto_log(ax, *arrays) -> None:
    """A log y scale when all values are positive and span more than 30x."""
    values = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays]) if arrays else np.empty(0)
    values = values[np.isfinite(values)]
    if values.size and (values > 0).all() and values.max() / values.min() > 30:
        ax.set_yscale("log")


def mark_band(ax, name: str) -> None:
    """Shade the healthy band of ``name`` (green), with dotted edges."""
    lo, hi, _ = HEALTHY_BANDS[name]
    ax.axhspan(lo, hi, color="#2ca02c", alpha=0.10, zorder=0, label="healthy band")
    for y in (lo, hi):
        if y > 0 or ax.get_yscale() != "log":
            ax.axhline(y, color="#2ca02c", lw=0.8, ls=":", zorder=1)


def margins(fig, left: float, right: float, top: float, bottom: float, hspace: float = 0.0,
            wspace: float = 0.0, nrows: int = 1, ncols: int = 1) -> None:
    """Subplot margins and gaps in inches (matplotlib wants fractions)."""
    w, h = fig.get_size_inches()
    axes_h = max((h - top - bottom - (nrows - 1) * hspace) / nrows, 0.1)
    axes_w = max((w - left - right - (ncols - 1) * wspace) / ncols, 0.1)
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h,
                        hspace=hspace / axes_h, wspace=wspace / axes_w)


def escape(value: Any) -> str:
    """HTML-escaped text."""
    return html.escape(str(value), quote=True)


def job_number(index: int) -> int:
    """A job as the report shows it: numbered from 1 in the file's order, as ``distmetrics summary`` does."""
    return index + 1


def fmt(value: Any) -> str:
    """A table cell: 4 significant digits for floats, empty for None."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def segments(jobs: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges of consecutive records of one job (lines break at restarts)."""
    if jobs.size == 0:
        return []
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(jobs) != 0) + 1, [jobs.size]])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _thin(steps: np.ndarray, xlim: tuple) -> np.ndarray:
    if steps.size <= MAX_EVENT_LINES:
        return steps
    span = max(xlim[1] - xlim[0], 1e-9)
    _, first = np.unique(np.round((steps - xlim[0]) / span * MAX_EVENT_LINES), return_index=True)
    return steps[np.sort(first)]
