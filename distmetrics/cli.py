"""``distmetrics`` command line: check configs and features files, summarise a run.

    distmetrics check-config configs/metrics.yaml [key=value ...]
    distmetrics check-features configs/tensor_stats_cpu.yaml [--feature-dir DIR ...]
    distmetrics summary runs/demo/metrics.jsonl
    distmetrics report runs/demo [--out report.html]
"""

from __future__ import annotations

import argparse
import math
import sys

from .config import ConfigError, MetricsConfig
from .report import MissingExtra, NotAMetricsFile
from .sinks.jsonl import read_jsonl

__all__ = ["main"]

_SUMMARY_KEYS = ("train/loss", "grad_norm", "train/lr", "train/tokens_per_sec", "train/step_time_ms",
                 "train/mfu_pct", "memory/host_rss_gib", "memory/max_allocated_gib", "power/mean_w")


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 ok, 2 a bad file or argument)."""
    parser = argparse.ArgumentParser(prog="distmetrics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-config", help="validate a metrics config YAML (and overrides)")
    check.add_argument("path")
    check.add_argument("overrides", nargs="*")
    features = sub.add_parser("check-features", help="validate an nvdlfw-inspect features YAML")
    features.add_argument("path")
    features.add_argument("--feature-dir", action="append", default=[], metavar="DIR",
                          help="a feature folder to load as well (runs its code); may register the "
                               "transformer_engine namespace where TransformerEngine is not installed")
    summary = sub.add_parser("summary", help="first/last train record, evals and alerts of a metrics.jsonl")
    summary.add_argument("path")
    add_report(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "check-config":
            cfg = MetricsConfig.from_yaml(args.path, args.overrides)
            print(f"ok: {args.path} (log_interval={cfg.log_interval}, writer_rank={cfg.writer_rank}, "
                  f"output_dir={cfg.output_dir})")
        elif args.command == "check-features":
            spec = check_features(args.path, args.feature_dir)
            print(f"ok: {args.path} ({len(spec)} section(s): {', '.join(spec)})")
        elif args.command == "report":
            print(args.run(args))
        else:
            print(summarise(args.path))
    except (ConfigError, OSError, MissingExtra, NotAMetricsFile) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def add_report(commands) -> None:
    """``report RUN [--out report.html]``."""
    parser = commands.add_parser("report", help="one self-contained HTML page of a run's metrics "
                                                "(needs the report extra: numpy, matplotlib)")
    parser.add_argument("path", metavar="RUN", help="a run directory or its metrics.jsonl")
    parser.add_argument("--out", default=None, help="the HTML file to write (default: report.html beside "
                                                    "the metrics file)")
    parser.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> str:
    """Write the run report (torch is not imported); says which extra to install when
    matplotlib or numpy is missing (:class:`~distmetrics.report.MissingExtra`, exit status 2)."""
    from .report import write_report

    return f"report: {write_report(args.path, args.out)}"


def check_features(path: str, feature_dirs: list) -> dict:
    """Our checks of a features YAML, then nvdlfw-inspect's own (every feature it names must be
    registered by the folders that would be loaded) when nvdlfw-inspect is installed."""
    import importlib.util
    import tempfile

    from .config import TensorInspectConfig
    from .tensor_stats.features import feature_dirs_for, load_features
    from .tensor_stats.lifecycle import reset_nvdlfw, start_nvdlfw

    config = TensorInspectConfig(enabled=True, features=path, feature_dirs=list(feature_dirs) or None,
                                 allow_custom_feature_dirs=True)
    spec = load_features(path, te_available=True if feature_dirs else None)
    dirs = feature_dirs_for(config, spec)
    if importlib.util.find_spec("nvdlfw_inspect") is None:
        return spec
    import nvdlfw_inspect.api as debug_api

    with tempfile.TemporaryDirectory() as log_dir:
        start_nvdlfw(spec, dirs, log_dir, source=path)
        debug_api.end_debug()
        reset_nvdlfw()
    return spec


def summarise(path: str) -> str:
    """A few lines about a metrics.jsonl: runs, first/last train record, last eval, alerts."""
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
