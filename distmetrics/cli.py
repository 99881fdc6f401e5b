"""``distmetrics`` command line: check configs and features files, summarise a run.

    distmetrics check-config configs/metrics.yaml [key=value ...]
    distmetrics check-features configs/tensor_stats_cpu.yaml
    distmetrics summary runs/demo/metrics.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys

from .config import ConfigError, MetricsConfig
from .sinks.jsonl import read_jsonl

__all__ = ["main"]

_SUMMARY_KEYS = ("train/loss", "grad_norm", "train/lr", "train/tokens_per_sec", "train/step_time_ms",
                 "train/mfu_pct", "memory/host_rss_gib", "memory/max_allocated_gib", "power/mean_w")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="distmetrics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-config", help="validate a metrics config YAML (and overrides)")
    check.add_argument("path")
    check.add_argument("overrides", nargs="*")
    features = sub.add_parser("check-features", help="validate an nvdlfw-inspect features YAML")
    features.add_argument("path")
    summary = sub.add_parser("summary", help="first/last train record, evals and alerts of a metrics.jsonl")
    summary.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "check-config":
            cfg = MetricsConfig.from_yaml(args.path, args.overrides)
            print(f"ok: {args.path} (log_interval={cfg.log_interval}, writer_rank={cfg.writer_rank}, "
                  f"output_dir={cfg.output_dir})")
        elif args.command == "check-features":
            from .collectors.tensor_inspect import load_features

            spec = load_features(args.path)
            print(f"ok: {args.path} ({len(spec)} section(s): {', '.join(spec)})")
        else:
            print(summarise(args.path))
    except (ConfigError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def summarise(path: str) -> str:
    records = list(read_jsonl(path))
    runs = [r for r in records if r.get("kind") == "run"]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    alerts = [r for r in records if r.get("kind") == "alert"]
    lines = [f"{path}: {len(runs)} run(s), {len(train)} train, {len(evals)} eval, {len(alerts)} alert record(s)"]
    if runs:
        last = runs[-1]
        lines.append(f"world size {last.get('world_size')}, hosts {', '.join(last.get('hosts', []))}, "
                     f"layout {last.get('layout')}, torch {last.get('torch_version')}")
    for label, record in (("first", train[0] if train else None), ("last", train[-1] if train else None)):
        if record is not None:
            fields = [f"{k.split('/')[-1]}={_fmt(record[k])}" for k in _SUMMARY_KEYS if k in record]
            lines.append(f"{label} step {record['step']}: " + " ".join(fields))
    if evals:
        lines.append(f"last eval step {evals[-1]['step']}: loss={_fmt(evals[-1].get('eval/loss'))}")
    for alert in alerts:
        lines.append(f"alert step {alert['step']}: {alert.get('message')}")
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
