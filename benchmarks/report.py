"""The run report at scale: synthetic ``metrics.jsonl`` files of a 4,096-rank job with 2,000
modules (tests/synthetic_run.py), rendered by ``distmetrics report``, each in a fresh process.

    python -m benchmarks.report                              # 100, 200, 400 log steps (~1 minute)
    python -m benchmarks.report --sizes 10000 --dir DIR      # the full size: ~12 GB of disk in DIR
    python -m benchmarks.report --ranks 64 --modules 100 --sizes 100,200

For every size: the file's size, the time to read it and to draw the page, the peak memory of the
process, and the baseline measured on the same file in the same run: ``json.loads`` of every
line and nothing else (the floor for any reader of the file in Python). Then the growth: time
ratio over size ratio between the largest and the smallest file (1.0 = linear in the file's
size; below 1, drawing's fixed cost is spread). Generated files are deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render_one(source: str, out: str) -> dict:
    """Read and draw one file in this process: seconds, peak memory, page size, and the baseline."""
    import resource

    from distmetrics.report import load_metrics, require_plotting
    from distmetrics.report.html import render_report

    require_plotting()
    import matplotlib.figure  # noqa: F401 - importing matplotlib is not part of the timing

    t0 = time.perf_counter()
    data = load_metrics(source)
    t1 = time.perf_counter()
    render_report(data, out)
    t2 = time.perf_counter()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(source, "rb") as f:  # the baseline: parse every line, keep nothing
        for line in f:
            json.loads(line)
    t3 = time.perf_counter()
    return {"read_s": t1 - t0, "draw_s": t2 - t1, "total_s": t2 - t0, "json_loads_s": t3 - t2,
            "peak_rss_mib": peak_mib, "html_mib": os.path.getsize(out) / 2**20}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--modules", type=int, default=2000)
    parser.add_argument("--sizes", default="100,200,400", help="log steps per file, comma-separated")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--out", default="runs/report_benchmark.json")
    parser.add_argument("--render-one", nargs=2, metavar=("SOURCE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render_one:
        print(json.dumps(render_one(*args.render_one)))
        return []
    from tests.synthetic_run import generate

    folder = Path(args.dir or tempfile.mkdtemp(prefix="distmetrics_report_bench_"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{args.ranks} ranks x {args.modules} modules, timers of every rank; log steps: {args.sizes}", flush=True)
    print(f"{'log steps':>9} {'lines':>6} {'file GiB':>8} {'read s':>7} {'draw s':>7} {'total s':>8} "
          f"{'json.loads s':>12} {'total/json':>10} {'s/GiB':>6} {'peak MiB':>8} {'html MiB':>8}", flush=True)
    rows, started = [], time.perf_counter()
    for steps in [int(s) for s in args.sizes.split(",")]:
        source = folder / f"metrics_{args.ranks}r_{args.modules}m_{steps}s.jsonl"
        made = generate(source, steps, args.ranks, args.modules)
        run = subprocess.run([sys.executable, "-m", "benchmarks.report", "--render-one", str(source),
                              str(folder / f"report_{steps}.html")], capture_output=True, text=True, cwd=ROOT)
        if run.returncode != 0:
            raise SystemExit(run.stderr[-3000:])
        row = dict(steps=steps, **made, **json.loads(run.stdout.strip().splitlines()[-1]))
        rows.append(row)
        gib = row["bytes"] / 2**30
        print(f"{steps:>9} {row['lines']:>6} {gib:>8.2f} {row['read_s']:>7.1f} {row['draw_s']:>7.1f} "
              f"{row['total_s']:>8.1f} {row['json_loads_s']:>12.1f} {row['total_s'] / row['json_loads_s']:>10.2f} "
              f"{row['total_s'] / gib:>6.1f} {row['peak_rss_mib']:>8.0f} {row['html_mib']:>8.1f}", flush=True)
        if not args.keep:
            source.unlink()
    if len(rows) > 1:
        small, large = rows[0], rows[-1]
        size = large["bytes"] / small["bytes"]
        print(f"growth, largest vs smallest file ({size:.1f}x the bytes): total time "
              f"{large['total_s'] / small['total_s'] / size:.2f}x linear, reading "
              f"{large['read_s'] / small['read_s'] / size:.2f}x linear (1.00 = linear in the file's size)")
    print(f"benchmark wall time (writing the files included): {time.perf_counter() - started:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
