"""What grows with the world size: the bytes a rank receives while the ranks agree on metric
names, the cost of the arrival check in front of every collective monitor call, the time
the writer takes to merge every rank's tensor-statistics partials, and the straggler scores'
work at a log step.

    python -m benchmarks.scale              # all four (8, 9 on 2/4/8 gloo ranks; 10, 11 in one process)
    python -m benchmarks                    # runs these too (sections 8 to 11)

Measured on real gloo ranks; the figures for 1,024–16,384 ranks are the measured per-set payload
put into the formula the reducer follows (a 16-byte digest and size from every rank, then every
distinct name set once), beside what gathering every rank's names would receive.
"""

from __future__ import annotations

import pickle
import statistics
import time
import zlib

from tests.dist_utils import quiet_config, run_ranks

NAMES_PER_SET = 2400  # per-module norms, timers and statistics of one pipeline stage


def _names(stage: int) -> list[str]:
    return [f"grad_norm/decoder.layers.{stage}.module{i:04d}.linear_fc{i % 2 + 1}" for i in range(NAMES_PER_SET)]


def _negotiation_worker(rank: int, world: int, distinct: int) -> dict:
    from distmetrics.reduce import Reducer, Sample

    names = _names(rank % distinct)
    reducer = Reducer()
    reducer.reduce([Sample(n, 1.0, "sum") for n in names])
    listed = pickle.dumps(sorted((n, "sum") for n in names))
    # what all_gather_object of every rank's list moves, and that list compressed as ours is: the
    # second part of the gap is the deduplication of name sets alone
    return {"received": reducer.negotiation_bytes, "per_rank_list_pickled": len(listed),
            "per_rank_list_compressed": len(zlib.compress(listed))}


def bench_negotiation(worlds=(2, 4, 8), distinct: int = 2) -> dict:
    """Bytes one rank receives while agreeing on names: measured, and extrapolated."""
    rows = []
    for world in worlds:
        result = run_ranks(_negotiation_worker, world, min(distinct, world), timeout=600, threads=None)[0]
        rows.append({"world": world, "distinct_sets": min(distinct, world), "received": result["received"],
                     "gather_every_rank": world * result["per_rank_list_pickled"],
                     "gather_every_rank_compressed": world * result["per_rank_list_compressed"]})
    per_set = (rows[-1]["received"] - 16 * rows[-1]["world"]) / rows[-1]["distinct_sets"]
    pickled = rows[-1]["gather_every_rank"] / rows[-1]["world"]
    compressed = rows[-1]["gather_every_rank_compressed"] / rows[-1]["world"]
    formula = [{"world": w, "distinct_sets": s, "received": 16 * w + s * per_set, "gather_every_rank": w * pickled,
                "gather_every_rank_compressed": w * compressed} for w in (1024, 4096, 16384) for s in (2, 8)]
    return {"measured": rows, "formula": formula, "bytes_per_set": per_set, "names_per_set": NAMES_PER_SET}


def _guard_worker(rank: int, world: int, steps: int) -> dict:
    import distmetrics as dm

    # both Monitors open at once, their log steps alternating (off first at odd steps, on first at even
    # ones): baseline and candidate interleaved, as every other section
    monitors = {timeout: dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=timeout,
                                                 output_dir=f"runs/bench_guard_{timeout:g}"))
                for timeout in (0.0, 300.0)}
    times: dict[float, list] = {timeout: [] for timeout in monitors}
    for step in range(1, steps + 1):
        for timeout in sorted(monitors, reverse=step % 2 == 0):
            monitor = monitors[timeout]
            for i in range(20):
                monitor.record(f"m/{i}", float(rank + i), "mean")
            start = time.perf_counter()
            monitor.step(step)
            times[timeout].append(time.perf_counter() - start)
    for monitor in monitors.values():
        monitor.close()
    return {timeout: statistics.median(t[3:]) for timeout, t in times.items()}


def bench_guard(world: int = 4, steps: int = 60) -> dict:
    """A healthy log step with the arrival check (hang_timeout_s=300) against without (0)."""
    result = run_ranks(_guard_worker, world, steps, timeout=600, threads=None)[0]  # as in the README's rows
    return {"world": world, "off_ms": result[0.0] * 1e3, "on_ms": result[300.0] * 1e3,
            "added_ms": (result[300.0] - result[0.0]) * 1e3, "ratio": result[300.0] / result[0.0]}


def bench_tensor_stats_merge(worlds=(256, 1024), keys: int = 50, repeats: int = 3) -> list[dict]:
    """Merging every rank's partials of ``keys`` (layer, tensor) statistics at a statistics step:
    one vectorised pass over the ranks (ours) against a pairwise merge per rank and key."""
    import random

    import torch

    from distmetrics.per_rank import PerRank
    from distmetrics.tensor_stats.rank_merge import combine
    from distmetrics.tensor_stats.statistics import PARTS, merge

    def pairwise(per_rank: dict) -> list[float]:
        out = []
        for key in range(keys):
            parts = {p: per_rank[f"activation|std|{p}|model.l{key}"] for p in PARTS}
            merged = None
            for rank in range(len(parts["n"])):
                one = {p: torch.tensor(parts[p][rank], dtype=torch.float64) for p in PARTS}
                merged = one if merged is None else merge(merged, one)
            out.append(float(merged["m2"]))
        return out

    rows = []
    for world in worlds:
        rng = random.Random(world)
        per_rank = {f"activation|std|{p}|model.l{key}": PerRank(
            [float(rng.randint(1, 4096)) if p == "n" else rng.random() for _ in range(world)])
            for key in range(keys) for p in PARTS}
        times: dict[str, list] = {"pairwise": [], "ours": []}
        for _ in range(repeats):
            start = time.perf_counter()
            pairwise(per_rank)
            times["pairwise"].append(time.perf_counter() - start)
            start = time.perf_counter()
            combine(dict(per_rank))
            times["ours"].append(time.perf_counter() - start)
        base, ours = statistics.median(times["pairwise"]), statistics.median(times["ours"])
        rows.append({"world": world, "keys": keys, "pairwise_s": base, "ours_s": ours, "faster": base / ours})
    return rows


def bench_straggler_windows(cases=((32, 10), (32, 100), (256, 10), (256, 100), (1024, 10), (1024, 100), (4096, 10)),
                            series: int = 20, repeats: int = 5) -> list[dict]:
    """The straggler scores' work at a log step (``StragglerCollector.finalize``: every series' window
    medians, the minima, the alert's streaks) once the window is full, for ``(world, window)`` and the
    step time plus ``series - 1`` timers, every rank's values given as the gather hands them over; with
    the tensor ring's size above 32 ranks (Python lists up to 32)."""
    import random

    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.stragglers import RANK_TIMERS_PREFIX, STEP_MS, StragglerCollector
    from distmetrics.per_rank import PerRank

    rows = []
    for world, window in cases:
        rng = random.Random(world * window)
        collector = StragglerCollector(window=window, report_every=0)
        ctx = LogContext(step=1, steps=1, layout=None)
        names = [STEP_MS] + [f"{RANK_TIMERS_PREFIX}t{i}" for i in range(series - 1)]
        values = [[PerRank([rng.uniform(50, 100) for _ in range(world)]) for _ in names] for _ in range(7)]
        for k in range(window):
            collector.finalize(dict(zip(names, values[k % 7])), ctx)
        times = []
        for k in range(repeats):
            metrics = dict(zip(names, values[k % 7]))  # made before the clock: the gather hands it over
            start = time.perf_counter()
            collector.finalize(metrics, ctx)
            times.append(time.perf_counter() - start)
        ring = getattr(collector._windows, "ring", None)
        rows.append({"world": world, "window": window, "series": series, "ms": statistics.median(times) * 1e3,
                     "ring_mb": ring.numel() * 8 / 1e6 if ring is not None else None})
    return rows


def report_negotiation(n: dict) -> None:
    """Print section 8."""
    print(f"   {n['names_per_set']} names per set, {n['bytes_per_set']:.0f} B each", flush=True)
    for r in n["measured"] + n["formula"]:
        kind = "measured" if r in n["measured"] else "formula "
        print(f"   {kind} {r['world']:6d} ranks, {r['distinct_sets']} distinct sets: {r['received'] / 1e6:9.3f} MB "
              f"received per rank | gathering every rank's names: {r['gather_every_rank'] / 1e6:10.3f} MB, "
              f"compressed {r['gather_every_rank_compressed'] / 1e6:9.3f} MB", flush=True)


def report_guard(g: dict) -> None:
    """Print section 9."""
    print(f"   {g['world']} ranks, log step: check off {g['off_ms']:.2f} ms | on {g['on_ms']:.2f} ms = "
          f"{g['ratio']:.2f}x (+{g['added_ms']:.2f} ms, a publish and three store round trips, four for the last rank; "
          "no collective)",
          flush=True)


def report_tensor_stats_merge(rows: list[dict]) -> None:
    """Print section 10."""
    for r in rows:
        print(f"   {r['world']:5d} ranks x {r['keys']} keys: pairwise per rank and key {r['pairwise_s'] * 1e3:8.1f} ms | "
              f"ours {r['ours_s'] * 1e3:6.1f} ms = {r['faster']:.0f}x faster", flush=True)


def report_straggler_windows(rows: list[dict]) -> None:
    """Print section 11."""
    for r in rows:
        kept = "Python lists" if r["ring_mb"] is None else f"a {r['ring_mb']:.1f} MB tensor ring"
        print(f"   {r['world']:5d} ranks, window {r['window']:3d}, {r['series']} series: {r['ms']:7.2f} ms a log step "
              f"({kept})", flush=True)


def main() -> dict:
    """The four sections, printed."""
    print("8. name negotiation: bytes received per rank", flush=True)
    negotiation = bench_negotiation()
    report_negotiation(negotiation)
    print("9. the arrival check (hang_timeout_s) on a healthy log step", flush=True)
    guard = bench_guard()
    report_guard(guard)
    print("10. tensor statistics: merging every rank's partials at a statistics step (one process)", flush=True)
    merge = bench_tensor_stats_merge()
    report_tensor_stats_merge(merge)
    print("11. straggler scores: a log step's scoring once the window is full (one process)", flush=True)
    windows = bench_straggler_windows()
    report_straggler_windows(windows)
    return {"negotiation": negotiation, "guard": guard, "tensor_stats_merge": merge, "straggler_windows": windows}


if __name__ == "__main__":
    main()
