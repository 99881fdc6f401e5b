"""``distmetrics`` command line: check configs and features files, summarise a run.

    distmetrics check-config configs/metrics.yaml [key=value ...]
    distmetrics check-features configs/tensor_stats_cpu.yaml [--feature-dir DIR ...]
    distmetrics summary runs/demo                     # a run folder, a folder of them, or a metrics.jsonl
    distmetrics report runs/demo [--out report.html]  # one self-contained HTML page per run

Exit status 0 when all is well, 2 for a bad file or argument (the message names it), 1 where
some of a folder's runs could not be read and the others were summarised or reported. Commands
that read files do not import torch; checking a features file does (nvdlfw-inspect needs it).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Optional

from .config import ConfigError, MetricsConfig, TensorInspectConfig
from .output_claim import file_notes, output_dir_problem
from .overrides import source_of
from .report import MissingExtra
from .runlog import TRAINING_KINDS, Records, end_note, metrics_files, split_jobs
from .sinks import DASHBOARD_KINDS
from .sinks.appendfile import describe_os_error
from .sinks.jsonl import NONFINITE

__all__ = ["main", "check_features", "summarise"]

_SUMMARY_KEYS = ("train/loss", "grad_norm", "train/lr", "train/tokens_per_sec", "train/step_time_ms",
                 "train/mfu_pct", "memory/host_rss_gib", "memory/max_allocated_gib", "power/mean_w")


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 ok, 2 a bad file or argument, 1 some runs not read)."""
    parser = argparse.ArgumentParser(prog="distmetrics", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    # A command is one add_<command>(commands) that registers its arguments and its run function.
    for add in (add_check_config, add_check_features, add_summary, add_report):
        add(commands)
    args = parser.parse_args(argv)
    status = 0
    try:
        text = args.run(args)
    except SomeRunsFailed as partly:
        text, status = partly.text, 1
    except (ValueError, OSError, MissingExtra) as err:  # ConfigError, NotAMetricsFile are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        _print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # a reader that stopped reading (| head): the command did its work
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor fail flushing at exit
    except OSError as err:  # a full disk under `> file`: said, not a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: the output could not be written to stdout: {describe_os_error(err)}", file=sys.stderr)
        return 2
    return status


class SomeRunsFailed(Exception):
    """Some runs of a folder could not be read (each said on stderr), the others were done: ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def _each_run(paths: list, do, joiner: str) -> str:
    """``do(path)`` for each metrics file, joined. A run that cannot be read (an empty file, one that
    is not a metrics.jsonl, no permission) is said on stderr and the others are done all the same:
    :class:`SomeRunsFailed` where some failed, ``ValueError`` where all did (status 2); a single run's
    error is raised as it is."""
    if len(paths) == 1:
        return do(paths[0])
    done, failed = [], 0
    for path in paths:
        try:
            done.append(do(path))
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            failed += 1
        except Exception as err:  # noqa: BLE001 - a bug met in one run's records: said with its traceback, and
            # the other runs done (it silenced every run of the folder)
            logging.getLogger("distmetrics").exception("error: %s could not be read (%s: %s), a bug: please report "
                                                       "it with the file", path, type(err).__name__, err)
            failed += 1
    if not done:
        raise ValueError(f"none of the {len(paths)} runs could be read (each said above)")
    if failed:
        print(f"error: {failed} of the {len(paths)} runs could not be read (each said above)",
              file=sys.stderr)
        raise SomeRunsFailed(joiner.join(done))
    return joiner.join(done)


def _print(text: str) -> None:
    """``text`` on stdout; where stdout cannot encode some of it (a folder name that is not
    UTF-8, read as surrogates, on a strict UTF-8 stream) those characters as escapes."""
    try:
        print(text)
    except UnicodeEncodeError:
        encoding = sys.stdout.encoding or "utf-8"
        print(text.encode(encoding, "backslashreplace").decode(encoding))


# --- check-config ------------------------------------------------------------------------

def add_check_config(commands) -> None:
    """``check-config PATH [key=value ...]``."""
    parser = commands.add_parser("check-config", help="validate a metrics config YAML (and overrides) with every "
                                                      "check the Monitor makes before it starts")
    parser.add_argument("path")
    parser.add_argument("overrides", nargs="*", default=[])  # a default: not listed as required
    parser.set_defaults(run=run_check_config)


def run_check_config(args: argparse.Namespace) -> str:
    """The config's own checks, then what the Monitor checks before it starts: with tensor
    inspection on, the custom feature folders, the features file, nvdlfw-inspect's own check and
    its log folder; then whether the writer can make and write ``output_dir``. The folders are
    checked on this machine, and nothing is made or left in them (a check is not a start)."""
    config = MetricsConfig.from_yaml(args.path, args.overrides)
    try:
        return _checked_beyond_the_file(args, config)
    except (ValueError, OSError) as err:  # what the values lead to: said with the override or the file that set
        if str(args.path) in str(err):  # them, as the config's own checks say them
            raise
        raise ConfigError(source_of(str(err), args.overrides, Path(args.path))) from err


def _checked_beyond_the_file(args: argparse.Namespace, config: MetricsConfig) -> str:
    inspection = note = ""
    log_dir = config.tensor_inspect.log_dir or str(Path(config.output_dir) / "tensor_inspect")
    elsewhere = {key: top for key, folder in (("output_dir", config.output_dir), ("tensor_inspect.log_dir", log_dir))
                 if (top := _not_on_this_machine(folder))}
    if config.tensor_inspect.enabled:
        from .tensor_stats.lifecycle import check_log_dir

        spec = _check_inspection(config.tensor_inspect, "tensor_inspect.features")
        if "tensor_inspect.log_dir" not in elsewhere:
            check_log_dir(config)
        inspection, note = f", tensor_inspect: {len(spec)} section(s)", _unchecked_by_nvdlfw()
    problem = None if "output_dir" in elsewhere else output_dir_problem(config)
    if problem:
        raise ConfigError(problem)
    if "output_dir" not in elsewhere:
        note += "".join(f"\nnote: {line}" for line in file_notes(config, Path(config.output_dir)))
    for key, top in elsewhere.items():
        if key == "output_dir" or config.tensor_inspect.enabled:
            note += f"\nnote: {key} is not checked: {top} does not exist on this machine (the job's, where it runs)"
    return (f"ok: {args.path} (log_interval={config.log_interval}, writer_rank={config.writer_rank}, "
            f"output_dir={config.output_dir}{inspection}){note}")


def _not_on_this_machine(folder: str) -> str:
    """The top folder of an absolute ``folder`` where it does not exist here (``/lustre`` of
    ``/lustre/proj/run`` checked on a laptop or a CI runner): a file system of the machines the job
    runs on, whose folders this machine cannot check. '' where it exists, or ``folder`` is relative."""
    path = Path(folder)
    if not path.is_absolute() or len(path.parts) < 2:
        return ""
    top = Path(path.anchor, path.parts[1])
    return "" if os.path.lexists(top) else str(top)


# --- check-features ----------------------------------------------------------------------

def add_check_features(commands) -> None:
    """``check-features PATH [--feature-dir DIR ...]``."""
    parser = commands.add_parser("check-features", help="validate an nvdlfw-inspect features YAML")
    parser.add_argument("path")
    parser.add_argument("--feature-dir", action="append", default=[], metavar="DIR",
                        help="a feature folder to load as well (runs its code); may register the "
                             "transformer_engine namespace where TransformerEngine is not installed")
    parser.set_defaults(run=run_check_features)


def run_check_features(args: argparse.Namespace) -> str:
    """Check a features file (see :func:`check_features`)."""
    spec = check_features(args.path, args.feature_dir)
    names = ", ".join(map(str, spec))  # a section YAML names by a number (`1:`) has an int key
    return f"ok: {args.path} ({len(spec)} section(s): {names}){_unchecked_by_nvdlfw()}"


def _unchecked_by_nvdlfw() -> str:
    """What an "ok" did not cover where nvdlfw-inspect is missing ("" where it ran)."""
    from .tensor_stats.features import NVDLFW_INSTALL, nvdlfw_installed

    if nvdlfw_installed():
        return ""
    return ("; our checks only: nvdlfw-inspect is not installed, so its own check (every feature registered "
            f"by a folder that would load) did not run: {NVDLFW_INSTALL}")


# --- report ------------------------------------------------------------------------------

def add_report(commands) -> None:
    """``report RUN [--out report.html]``."""
    parser = commands.add_parser("report", help="one self-contained HTML page of a run's metrics "
                                                "(needs the report extra: numpy, matplotlib)")
    parser.add_argument("path", metavar="RUN", help="a run folder, a folder of run folders (one report per "
                                                     "run), or a metrics.jsonl")
    parser.add_argument("--out", default=None, help="the HTML file to write, for one run (default: report.html "
                                                    "beside each metrics file)")
    parser.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> str:
    """Write the report of each run the path names (:func:`~distmetrics.runlog.metrics_files`, as
    ``summary`` reads them; torch is not imported); says which extra to install when matplotlib
    or numpy is missing (:class:`~distmetrics.report.MissingExtra`, exit status 2)."""
    from .report import NOT_A_PAGE, may_overwrite, require_plotting, write_report

    require_plotting()  # the same for every run: said once
    if args.out is not None and os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a folder: give the HTML file to write "
                         f"(--out {os.path.join(args.out, 'report.html')!r}, say)")
    if args.out is not None and not may_overwrite(args.out):
        raise ValueError(f"--out {args.out!r} {NOT_A_PAGE}")
    paths = metrics_files(args.path)
    if args.out is not None and len(paths) > 1:
        raise ValueError(f"--out names one file but {args.path!r} holds {len(paths)} runs: give one run folder "
                         "with --out, or leave --out out for one report beside each run's metrics.jsonl")
    return _each_run(paths, lambda path: f"report: {_report(write_report, path, args.out)}", "\n")


def _report(write_report, path, out) -> str:
    """One run's report. Data the report cannot hold in memory (a file that claims a rank grid of
    a billion ranks) is a message naming the file, exit status 2, not a traceback."""
    try:
        return write_report(path, out)
    except MemoryError as err:
        raise ValueError(f"the report of {str(path)!r} cannot be drawn: {err or 'out of memory'}") from None


def check_features(path: str, feature_dirs: list) -> dict:
    """Our checks of a features YAML, then nvdlfw-inspect's own (every feature it names must be
    registered by the folders that would be loaded) when nvdlfw-inspect is installed."""
    config = TensorInspectConfig(enabled=True, features=path, feature_dirs=list(feature_dirs) or None,
                                 allow_custom_feature_dirs=True)
    return _check_inspection(config, path, "--feature-dir")


def _check_inspection(config: TensorInspectConfig, source: str,
                      dirs_option: str = "tensor_inspect.feature_dirs") -> dict:
    import tempfile

    from .tensor_stats.features import check_inspect_config, nvdlfw_installed, require_nvdlfw

    spec, dirs = check_inspect_config(config, dirs_option)
    if not nvdlfw_installed():
        return spec  # the "ok" line says what did not run
    if dirs_option == "--feature-dir":  # installed but not importable: said as an error, not a traceback
        require_nvdlfw("checking the features file runs nvdlfw-inspect's own check", "uninstall it (our checks only)")
    else:
        require_nvdlfw()
    from .tensor_stats.lifecycle import reset_nvdlfw, start_nvdlfw

    with tempfile.TemporaryDirectory() as log_dir:
        start_nvdlfw(spec, dirs, log_dir, source=source)
        reset_nvdlfw()  # ends it too
    return spec


# --- summary -----------------------------------------------------------------------------

def add_summary(commands) -> None:
    """``summary PATH``."""
    parser = commands.add_parser("summary", help="per job: first/last train record, evals, alerts and lost records of a run")
    parser.add_argument("path", help="a run folder, a folder of run folders, or a metrics.jsonl")
    parser.set_defaults(run=run_summary)


def run_summary(args: argparse.Namespace) -> str:
    """:func:`summarise` each metrics.jsonl the path names."""
    return _each_run(metrics_files(args.path), summarise, "\n\n")


def summarise(path) -> str:
    """A few lines per job of a metrics.jsonl: its ranks and versions, first/last train record,
    last eval, alerts, records that could not be written (``gap``), and whether it resumed at or
    before a step an earlier job logged. The file is read a line at a time and each job keeps only
    what it shows (:class:`_JobSummary`): memory does not grow with the number of records."""
    records = Records(path)
    jobs = split_jobs(records, _JobSummary)
    unreadable = records.unreadable
    skipped = f", {unreadable} unreadable line(s) skipped (a crash cuts the line being written)" if unreadable else ""
    lines = [f"{path}: {len(jobs)} job(s){skipped}"]
    trained = logged = None  # (number, job): the latest job before that trained; that logged anything
    for number, job in enumerate(jobs, start=1):
        lines += _job_lines(number, job, trained or logged, jobs[number] if number < len(jobs) else None)
        if job.trained:
            trained = (number, job)
        elif job.last_logged is not None:
            logged = (number, job)
    return "\n".join(lines)


_RUN_KEYS = ("time", "world_size", "hosts", "layout", "torch_version", "end_record")
"""The fields of a job's ``run`` record that its summary reads."""


class _JobSummary:
    """What ``summary`` shows of one job, taken from its records as they are read: the shown fields
    of its ``run`` record and of its first and last train record, its last eval, its train, eval
    and alert counts, a line per alert, resume and gap record, and the highest step it logged for
    the dashboards (the job after it says when it logs that step again)."""

    def __init__(self, run):
        self.started = run is not None
        """False for records that precede every run record."""
        self.run = {k: run[k] for k in _RUN_KEYS if k in run} if run is not None else {}
        self.train = self.evals = 0
        self.first = self.last = self.last_eval = None
        self.last_logged = None
        """The highest step of the job's train, eval and tensor_stats records."""
        self.trained = False
        """Whether it wrote a train or tensor_stats record (a job that only evaluated dropped nothing from
        the dashboards: a job after it is compared with the one before, as the Monitor compares it)."""
        self.resumes, self.alerts = [], []
        self.gaps: list[list] = []
        """Per gap record: its line, whether a record was written after it, and its step."""
        self.end: Optional[dict] = None
        """The job's last ``end`` record: how its Monitor ended (a killed job writes none)."""

    def add(self, record: dict) -> None:
        """Take one more of the job's records, in file order."""
        kind, step = record.get("kind"), record["step"]
        if self.gaps and kind not in ("gap", "end"):  # a record written after the last gap: its records resumed
            self.gaps[-1][1] = True
        if kind in DASHBOARD_KINDS:
            self.last_logged = step if self.last_logged is None else max(self.last_logged, step)
            self.trained = self.trained or kind in TRAINING_KINDS
        if kind == "train":
            self.train += 1
            self.last = {k: record[k] for k in ("step", *_SUMMARY_KEYS) if k in record}
            if self.first is None:
                self.first = self.last
        elif kind == "eval":
            self.evals += 1
            self.last_eval = (step, record.get("eval/loss"))
        elif kind == "alert":
            self.alerts.append(f"  alert step {step}: {record.get('message')}")
        elif kind == "resume":
            dropped = ("; TensorBoard dropped the earlier events from there on" if record.get("tensorboard_dropped")
                       else "")
            self.resumes.append(f"  resumed at step {record.get('from_step', step)} (step "
                                f"{record.get('last_logged_step')} was logged before{dropped})")
        elif kind == "end":
            self.end = record
        elif kind == "gap":
            # written with the record after it, or at the job's end (the sink's close) with none after it
            self.gaps.append([f"  lost {record.get('lost_records')} record(s), steps {record.get('first_step')}-"
                              f"{record.get('last_step')}: {record.get('error')}", False, step])


def _job_lines(number: int, job: _JobSummary, previous: Optional[tuple], next_job) -> list[str]:
    """``previous``: (number, job) of the latest job before that trained (else that logged anything)."""
    run = job.run
    head = f"job {number}: " + (f"started {run.get('time')}, world size {run.get('world_size')}, hosts "
                                f"{_hosts(run.get('hosts', []))}, layout {run.get('layout')}, torch "
                                f"{run.get('torch_version')}" if job.started else "records before any run record")
    lines = [head, f"  {job.train} train, {job.evals} eval, {len(job.alerts)} alert record(s)"]
    earlier = previous[1].last_logged if previous is not None else None
    lines += job.resumes
    # an evaluation of the restored checkpoint before the first train record is no resume
    first = job.first["step"] if job.first is not None else None
    if earlier is not None and first is not None and not job.resumes and first <= earlier:
        lines.append(f"  logs step {first} again: job {previous[0]} logged up to step {earlier}")
    for label, record in (("first", job.first), ("last", job.last)):
        if record is not None:
            fields = [f"{k.split('/')[-1]}={_fmt(record[k])}" for k in _SUMMARY_KEYS if k in record]
            lines.append(f"  {label} step {record['step']}: " + " ".join(fields))
    if job.last_eval is not None:
        lines.append(f"  last eval step {job.last_eval[0]}: loss={_fmt(job.last_eval[1])}")
    lines += job.alerts
    lines += [f"{text} (written again from step {step})" if resumed else f"{text} (marked at the end of the job: no "
              "record written after it)" for text, resumed, step in job.gaps]
    if job.started or job.end is not None:  # records before any run record (its line lost): its end record told
        lines.append("  " + end_note(job.end, last=next_job is None, expected=job.run.get("end_record", False)))
    return lines


def _hosts(hosts) -> str:
    """A run record's hosts as the summary shows them: a list joined (a hand-made record's odd one as it is)."""
    return ", ".join(map(str, hosts)) if isinstance(hosts, list) else str(hosts)


def _fmt(value) -> str:
    value = NONFINITE.get(value, value) if isinstance(value, str) else value  # the file's "NaN" is a float
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
