"""The report's sections that plot metrics over steps: loss, norms, throughput, hardware,
tensor statistics and whatever else the file holds. Each returns HTML ("" when it has nothing)."""

from __future__ import annotations

import re

import numpy as np

from .figures import HEALTHY_BANDS, Figures, panel_figure, plot_series, series_panel
from .heatmap import heatmap
from .read import MODULE_FAMILIES, RunData

__all__ = ["loss_section", "norm_section", "throughput_section", "hardware_section", "tensor_section",
           "other_section", "outside_band", "RANK_VALUED", "SHOWN"]

MAX_CATEGORIES = 12
MAX_TENSOR_FAMILIES = 36
MAX_OTHER_PANELS = 48
RANK_VALUED = re.compile(r"(^|/|_)(min_|max_|local_)?rank$")
"""Names whose values are rank numbers (``…/max_rank``, ``stragglers/…/rank``): not plotted as curves."""
_ROOT_SUM_SQUARE = {"grad_norm", "update_norm", "param_norm"}  # merged module rows: the merged norm
_SHOWN_ELSEWHERE = ("timers/", "stragglers/", "health/", "memory/", "power/", "energy/", "gpu/", "train/loss/",
                    "eval/loss/")
SHOWN = {"train/loss", "eval/loss", "train/lr", "eval/gap", "eval/ppl", "grad_norm", "grad_clip_ratio",
         "update_norm", "param_norm", "relative_update_norm", "effective_lr_ratio", "train/tokens_per_sec",
         "eval/tokens_per_sec", "train/tokens_per_sec_per_gpu", "train/tflops_per_gpu", "train/mfu_pct",
         "train/sol_pct", "train/step_time_ms", "train/consumed_tokens", "train/eta_s", "grad_nonfinite",
         "grad_missing_params"}


def loss_section(figs: Figures) -> str:
    """Train and eval loss, loss by category, learning rate, eval gap and perplexity."""
    table = figs.data.scalars
    categories = list(dict.fromkeys(n.split("/", 2)[2] for n in table.names
                                    if n.startswith(("train/loss/", "eval/loss/"))))
    panels = [series_panel(figs, ["train/loss", "eval/loss"], "Loss", "loss")]
    if categories:
        def draw_categories(ax) -> None:
            for i, category in enumerate(categories[:MAX_CATEGORIES]):
                for split, ls, marker in (("train", "-", None), ("eval", "--", "o")):
                    name = f"{split}/loss/{category}"
                    if table.has(name):
                        steps, jobs, values = table.series(name)
                        plot_series(ax, steps, jobs, values, f"{split} {category}", color=f"C{i % 10}", ls=ls,
                                    marker=marker, lw=1.0)
        panels.append(("Loss by category (train solid, eval dashed)", "loss", draw_categories))
    panels.append(series_panel(figs, ["train/lr"], "Learning rate", "lr", log=False))
    gap = series_panel(figs, ["eval/gap"], "Eval gap (eval loss - train loss since the last eval)", "loss")
    if gap:
        def draw_gap(ax, inner=gap[2]) -> None:
            inner(ax)
            ax.axhline(0, color="black", lw=0.7)
        panels.append((gap[0], gap[1], draw_gap))
    panels.append(series_panel(figs, ["eval/ppl"], "Eval perplexity", "ppl"))
    note = (f"<p class=note>{len(categories)} loss categories; the first {MAX_CATEGORIES} are drawn.</p>"
            if len(categories) > MAX_CATEGORIES else "")
    return panel_figure(figs, panels, "loss") + note


def norm_section(figs: Figures) -> str:
    """Total norms and ratios with their healthy bands, the share of modules outside a band (leaf
    modules: a container is not counted again beside what it holds), and one heatmap per
    per-module family (modules in model order x log steps, log colour scale)."""
    data = figs.data
    panels = []
    for name, title in (("grad_norm", "Gradient norm (pre-clip, total)"), ("grad_clip_ratio", "Clip ratio"),
                        ("update_norm", "Update norm |P_new - P_old|"), ("param_norm", "Parameter norm"),
                        ("relative_update_norm", "Relative update norm |dP| / |P|"),
                        ("effective_lr_ratio", "Effective LR ratio |dP| / |G_clipped|")):
        panels.append(series_panel(figs, [name], title, band=name if name in HEALTHY_BANDS else None))
    panels += [_outside_band_panel(figs, family) for family in MODULE_FAMILIES if family in HEALTHY_BANDS]
    out = [panel_figure(figs, panels, "gradients and updates")]
    for family, cmap in zip(MODULE_FAMILIES, ("viridis", "viridis", "cividis", "plasma", "plasma")):
        grid = data.grids.get(("module", family))
        if grid is not None:
            out.append(heatmap(figs, grid, f"{family}/<module> (log colour scale; rows: modules in model order)",
                               data.modules, data.module_rows, "rss" if family in _ROOT_SUM_SQUARE else "mean",
                               log=True, cmap=cmap, colour_label=family, row_name="module",
                               band=family if family in HEALTHY_BANDS else None))
    return "".join(out)


def _outside_band_panel(figs: Figures, family: str):
    share = outside_band(figs.data, family)
    if share is None:
        return None
    steps, outside, below = share
    lo, hi, _ = HEALTHY_BANDS[family]

    def draw(ax) -> None:
        ax.plot(steps, 100 * outside, lw=1.2, label="outside the band", marker="o" if steps.size < 30 else None, ms=3)
        ax.plot(steps, 100 * below, lw=0.9, ls="--", label="below the band")
        ax.set_ylim(-2, 102)
    return (f"{family}: leaf modules outside [{lo:g}, {hi:g}] (%)", "% of leaf modules", draw)


def outside_band(data: RunData, family: str):
    """(steps, share outside the band, share below it) of the leaf modules with a value of
    ``family`` at each logged bin; None when the file holds no ``family/<module>``."""
    grid = data.grids.get(("module", family))
    logged = grid.logged() if grid is not None else None
    if logged is None:
        return None
    steps, values = logged
    values = values[:, [row for row in _leaf_rows(data.modules) if row < values.shape[1]]]
    lo, hi, _ = HEALTHY_BANDS[family]
    with np.errstate(invalid="ignore"):
        counted = np.maximum(np.isfinite(values).sum(axis=1), 1)
        return steps, ((values < lo) | (values > hi)).sum(axis=1) / counted, (values < lo).sum(axis=1) / counted


def _leaf_rows(modules: list) -> list:
    """The rows of the modules no other logged module lies inside (per-module norms are subtree
    norms: ``layers`` and ``layers.0`` beside ``layers.0.fc1`` would count its parameters thrice)."""
    containers = {".".join(parts[:d]) for parts in (m.split(".") for m in modules) for d in range(1, len(parts))}
    return [row for row, name in enumerate(modules) if name not in containers]


def throughput_section(figs: Figures) -> str:
    """Tokens/s, TFLOP/s per GPU, MFU and SOL, step time, consumed tokens, ETA."""
    panels = [series_panel(figs, names, title, ylabel, log=log) for title, names, ylabel, log in (
        ("Tokens / s", ["train/tokens_per_sec", "eval/tokens_per_sec"], "tokens/s", None),
        ("Tokens / s per GPU", ["train/tokens_per_sec_per_gpu"], "tokens/s", None),
        ("TFLOP/s per GPU", ["train/tflops_per_gpu"], "TFLOP/s", None),
        ("MFU / SOL (%)", ["train/mfu_pct", "train/sol_pct"], "%", False),
        ("Step time (ms)", ["train/step_time_ms"], "ms", None),
        ("Consumed tokens (this job)", ["train/consumed_tokens"], "tokens", False))]
    table = figs.data.scalars
    if table.has("train/eta_s"):
        def draw_eta(ax) -> None:
            steps, jobs, values = table.series("train/eta_s")
            plot_series(ax, steps, jobs, values / 3600.0, "ETA")
        panels.append(("ETA (hours)", "h", draw_eta))
    return panel_figure(figs, panels, "throughput")


def hardware_section(figs: Figures) -> str:
    """Memory, power, energy and GPU telemetry: the extremes over ranks and the rank holding them."""
    names = [n for n in figs.data.scalars.names if not RANK_VALUED.search(n)]
    memory = [n for n in names if n.startswith("memory/")]
    groups = [("Memory (GiB, max over ranks)", [n for n in memory if n.endswith("_gib")], "GiB"),
              ("Allocator retries / OOMs", [n for n in memory if not n.endswith("_gib")], "count"),
              ("Power (W per GPU: mean, and the extremes over ranks)", [n for n in names if n.startswith("power/")],
               "W")]
    groups += [(n, [n], "J") for n in names if n.startswith("energy/")]
    for field in dict.fromkeys(n.rsplit("/", 1)[0] for n in names if n.startswith("gpu/")):
        groups.append((field, [n for n in names if n.rsplit("/", 1)[0] == field], ""))
    panels = [series_panel(figs, members, title, ylabel, log=False) for title, members, ylabel in groups]
    holders = [n for n in figs.data.scalars.names if n.startswith(("memory/", "power/")) and RANK_VALUED.search(n)]
    if holders:
        def draw_ranks(ax) -> None:
            for i, name in enumerate(holders[:10]):
                steps, _, ranks = figs.data.scalars.series(name)
                ax.scatter(steps, ranks, s=8, color=f"C{i % 10}", label=name)
            ax.yaxis.get_major_locator().set_params(integer=True)
        panels.append(("The rank holding each extreme", "rank", draw_ranks))
    return panel_figure(figs, panels, "memory, power, energy")


def tensor_section(figs: Figures) -> str:
    """Tensor statistics per layer: one line per layer for a few layers, else a heatmap."""
    data = figs.data
    grids = [g for (kind, _), g in data.grids.items() if kind == "tensor"]
    if not grids:
        return ""
    out, small = [], []
    if len(grids) > MAX_TENSOR_FAMILIES:
        out.append(f"<p class=note>{len(grids)} tensor/statistic pairs; the first {MAX_TENSOR_FAMILIES} are drawn.</p>")
    for grid in grids[:MAX_TENSOR_FAMILIES]:
        logged = grid.logged()
        if logged is None:
            continue
        steps, values = logged
        finite = values[np.isfinite(values)]
        log = bool(finite.size) and bool((finite > 0).all()) and finite.max() / finite.min() > 30
        if grid.rows <= 8:
            small.append((f"tensor_stats/<layer>/{grid.name}", "", _layer_lines(data, grid, steps, values, log)))
        else:
            out.append(heatmap(figs, grid, f"tensor_stats/<layer>/{grid.name} (layers x steps)", data.layers,
                               data.layer_rows, "mean", log=log, cmap="viridis", colour_label=grid.name,
                               row_name="layer"))
    return panel_figure(figs, small, "tensor statistics") + "".join(out)


def _layer_lines(data, grid, steps, values, log):
    def draw(ax) -> None:
        for row in [r for r in data.layer_rows if r < grid.rows]:
            ax.plot(steps, values[:, row], lw=1.0, label=data.layers[row], marker="o" if steps.size < 30 else None,
                    ms=3)
        if log:
            ax.set_yscale("log")
    return draw


def other_section(figs: Figures) -> str:
    """Every other scalar in the file, one small panel each."""
    rest = [n for n in figs.data.scalars.names if n not in SHOWN and not RANK_VALUED.search(n)
            and not n.startswith(_SHOWN_ELSEWHERE)]
    if not rest:
        return ""
    note = ""
    if len(rest) > MAX_OTHER_PANELS:
        note = f"<p class=note>{len(rest)} metrics; the first {MAX_OTHER_PANELS} are drawn.</p>"
        rest = rest[:MAX_OTHER_PANELS]
    return note + panel_figure(figs, [series_panel(figs, [n], n) for n in rest], "other metrics", ncols=3,
                               height=2.6)

