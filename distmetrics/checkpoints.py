"""Saved checkpoints: Megatron's "Saved checkpoint" arithmetic (job and cumulative TFLOP/s/GPU,
floating-point operations, tokens), cumulative across restarts with the same world size by
reading ``progress.txt`` back, as Megatron does."""

from __future__ import annotations

import datetime as _dt
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .peers import InCollective
from .runlog import last_record
from .sinks.jsonl import METRICS_FILE
from .sinks.progress import Saved, checkpoint_message, no_progress, read_progress

__all__ = ["CheckpointLog", "checkpoint_record", "checkpoint_number_problem"]

logger = logging.getLogger("distmetrics")


class CheckpointLog:
    """What a job knows about its checkpoints: where the streak of runs started (read from
    ``progress.txt`` on the writer rank, before this job's "Starting job" line) and when this
    job started."""

    def __init__(self, config: Any, world_size: int, is_writer: bool) -> None:
        self.world_size = world_size
        self.job_start = time.time()
        path = Path(config.output_dir) / "progress.txt"
        self._metrics_file = Path(config.output_dir) / METRICS_FILE if config.json_log and is_writer else None
        self._progress = config.log_progress  # else metrics.jsonl alone tells of earlier checkpoints
        # earlier jobs' files (looked at before this job's sinks open: its own run record is not one)
        earlier = [self._metrics_file] + ([path] if self._progress and is_writer else [])
        self._earlier = any(file is not None and _size(file) > 0 for file in earlier)
        self.resumed = {} if not is_writer else read_progress(path, world_size) if self._progress else no_progress()
        self._short = ""  # why this job's checkpoints count short, said at its first (start_at)
        self._said_unknown = False  # a checkpoint of a job that counted no token was said
        self._said_number = False  # a checkpoint numbered neither the last step nor the next was said

    def start_at(self, step: int, loaded: bool = False) -> None:
        """Where this job's checkpoints count on from (:meth:`_resumed_from`; ``loaded``: the job saved
        checkpoint ``step`` before its first step, the one it loaded, whatever the numbering); a job that loaded a
        checkpoint older than its streak's start (a start from scratch, a rollback past the streak's
        first job) starts a streak of its own, as a job of another world size does: the streak's
        FLOPs counted from its start would leave this job's out, and its cumulative throughput was
        negative. A later job reads that streak back from this job's first save (:func:`read_progress`)."""
        self._resumed_from(step, loaded)
        start, origin = self.resumed.get("start_flops"), self.resumed.get("last_flops", 0.0)
        if start is not None and origin < start:
            self.resumed["start_time"] = self.resumed["start_flops"] = None

    def _resumed_from(self, step: int, loaded: bool = False) -> None:
        """This job's first step is ``step`` (its first ``monitor.step``, the step after an
        evaluation or a checkpoint saved first): it resumed from the checkpoint saved just before
        it, numbered ``step - 1`` where steps count from 1 (Megatron's and torchtitan's numbering)
        or ``step`` where a loop counts from 0 and saves at ``step + 1``: the latest line of the
        highest iteration up to ``step``. A line at ``step`` itself is of either numbering; its
        record's ``after_step`` tells which (:meth:`_saved_after`): saved after step ``step`` (the
        first numbering, checkpoints at consecutive steps, and a rollback past them), it comes after
        this job's start, which counts on from the line before. After a rollback (a restart from
        an older checkpoint than the last one saved) that is not the last "Saved checkpoint" line:
        the job's FLOPs and tokens count on from that checkpoint's, as Megatron's count on from the
        checkpoint they load, not from the last line's. ``loaded``: it resumed from the checkpoint at ``step``
        (its first step is the next)."""
        saved = self.resumed.get("saved") or []
        base = _latest_up_to(saved, step)
        record = self._record_up_to(step, base)
        started, looked = f"started at step {step}", step
        if loaded:  # its first step's number is step + 1, or step in a loop counting from 0: the checkpoint's is known
            started = f"saved checkpoint {step}, the one it loaded, before its first step"
            step += 1
        elif self._saved_after(step, base, record):
            base = _latest_up_to(saved, step - 1)
            record = self._record_up_to(step - 1, base)
        known = max((c.iteration for c in (base, record) if c is not None), default=None)
        if known is not None and known < step - 1:  # under either numbering a checkpoint lies between
            files = " and ".join(name for name, on in (("progress.txt", self._progress),
                                                       ("metrics.jsonl", self._metrics_file is not None)) if on)
            self._short = (f"{files} have no checkpoint after iteration {known}, and this job {started}: "
                           f"its checkpoints' FLOPs and tokens count on from iteration {known}'s and leave out the "
                           "steps after it (a checkpoint between was saved without monitor.checkpoint_saved, or its "
                           "line and record were lost, e.g. to a full disk)")
        if known is None and step > 1 and (self._progress or self._metrics_file is not None):  # a resume
            where = " or ".join(name for name, on in (
                ("progress.txt", self._progress),
                (f"the last {_NO_LINE_WITHIN >> 20} MiB of metrics.jsonl", self._metrics_file is not None)) if on)
            # no earlier job's files at all: the earlier run's are elsewhere (another output_dir), or lost
            fresh = "" if self._earlier else (", in an output_dir holding no earlier job's files: an earlier run's "
                                              "files elsewhere are not read")
            self._short = (f"no checkpoint up to iteration {looked} was found in {where} (this job {started}, a "
                           f"resume{fresh}): its checkpoints' FLOPs and tokens count from this job on")
        later = record is not None and base is not None and record.iteration == base.iteration and \
            not _rounds_alike(record, base) and _has_record_of(self._metrics_file, base)
        if record is not None and (base is None or record.iteration > base.iteration or later):
            # its progress.txt line was lost (a full disk between the two writes, say), or there is no progress.txt;
            # later: the line there is of an earlier save of that iteration (a rollback's), whose record comes
            # before this one in metrics.jsonl
            if self._progress:
                logger.warning("distmetrics: progress.txt has no \"Saved checkpoint\" line for iteration %d, the "
                               "checkpoint this job resumes from%s (%s has its record: the line was lost, e.g. to a "
                               "full disk); FLOPs and tokens count on from that record.", record.iteration,
                               " (its line is an earlier job's save of that iteration)" if later else "",
                               self._metrics_file)
            self.resumed["last_tokens"], self.resumed["last_flops"] = record.tokens, record.flops
            if self.resumed.get("streak_unsaved"):  # the streak's jobs saved nothing: it starts from this one
                self.resumed["start_flops"] = record.flops
            return
        if not saved:
            return
        if base is not saved[-1]:  # a rollback: not the last line's numbers
            self.resumed["last_flops"], self.resumed["last_tokens"] = (base.flops, base.tokens) if base else (0.0, 0.0)
            if self.resumed.get("streak_unsaved"):  # the streak's jobs saved nothing yet: it starts from here too
                self.resumed["start_flops"] = self.resumed["last_flops"]
        if base is not None and self._metrics_file is not None:  # the text's rounded numbers made exact
            if record is None or record.iteration != base.iteration:  # a later job wrote an older one's since
                record = _saved_record(self._metrics_file, lambda iteration: iteration == base.iteration)
            _exact_numbers(self.resumed, record)

    def saved(self, step: int, job_tokens: Any, flops_per_token: Optional[float], group: Any,
              device: torch.device, is_writer: bool, after_step: Optional[int] = None,
              least: Any = None) -> Optional[dict]:
        """Sum this job's tokens over ranks (one all-reduce; every rank calls this) and, on the
        writer, return the ``progress`` record of a checkpoint saved at ``step``. ``job_tokens``
        None: this rank's steps counted none; where no rank's did (no ``tokens=``, or given only where
        they do not count), the job's tokens and FLOPs are not known (nan), not 0. ``after_step``: the
        last ``monitor.step`` before the save (None before the job's first), kept in the record so a
        restart tells which step the checkpoint holds whatever its number (:meth:`_saved_after`).
        ``least``: the least count a tensor gave as tokens on this rank since the last log step (whose
        check has not seen it; None: none), a negative one refused like a bad sum."""
        value = job_tokens.detach().cpu() if isinstance(job_tokens, torch.Tensor) else job_tokens
        low = least.detach().cpu() if isinstance(least, torch.Tensor) else least
        tokens = torch.tensor([0.0 if value is None else float(value), 0.0 if value is None else 1.0,
                               1.0 if low is not None and low < 0 else 0.0],
                              dtype=torch.float64)  # the sum, how many ranks counted any, and gave a negative one
        if self.world_size > 1 and dist.is_initialized():
            tokens = tokens.to(device)
            with InCollective("the SUM all_reduce of the job's tokens", "monitor.checkpoint_saved", step):
                dist.all_reduce(tokens, group=group)
        total, counting, negative = tokens.cpu().tolist()
        if not counting:
            total = math.nan
        elif not (total >= 0 and math.isfinite(total)) or negative:  # the same on every rank: every rank raises
            why = f"since the last log step held a negative count on {negative:g} rank(s), which the others outweigh" \
                if total >= 0 and math.isfinite(total) else "held NaN, inf or a negative count on some rank"
            raise ValueError(f"monitor.checkpoint_saved({step}): this job's tokens summed over ranks are {total!r}: a "
                             f"tensor given as monitor.step(tokens=...) {why}; accepted values are finite numbers "
                             ">= 0. No progress line was written (a restart would count on from it)")
        if not is_writer:
            return None
        if self._short:  # said at the first checkpoint: a job that saves none counts nothing
            logger.warning("distmetrics: %s.", self._short)
            self._short = ""
        if not counting and not self._said_unknown:
            self._said_unknown = True
            logger.warning("distmetrics: monitor.checkpoint_saved(%d): no rank counted tokens in this job's steps "
                           "(no monitor.step(tokens=...), or tokens given only on ranks that do not count them): its "
                           "tokens and FLOPs are not known, nan in progress.txt, and so are the cumulative ones of "
                           "every later checkpoint that counts on from them. Said once", step)
        record = checkpoint_record(step, self.resumed, self.job_start, total, flops_per_token, self.world_size)
        if after_step is not None:
            record["after_step"] = after_step
        if counting and not record.get("checkpoint/tokens", math.nan) >= 0 and not self._said_unknown:
            self._said_unknown = True
            logger.warning("distmetrics: monitor.checkpoint_saved(%d): this job counts on from a checkpoint whose "
                           "tokens were not known (an earlier job counted none): the cumulative tokens and FLOPs are "
                           "nan in progress.txt from here on, this job's own throughput is known. Said once", step)
        return record

    def say_number(self, step: int, last: Optional[int], stride: Optional[int], says: bool) -> None:
        """Say once (where ``says``) a checkpoint numbered neither the last step nor the next
        (:func:`checkpoint_number_problem`); it is written all the same."""
        problem = checkpoint_number_problem(step, last, stride)
        if problem and says and not self._said_number:
            self._said_number = True
            logger.warning("distmetrics: %s. Said once", problem)

    def _saved_after(self, step: int, base: Optional[Saved], record: Optional[Saved]) -> bool:
        """Whether the checkpoint numbered ``step`` was saved after step ``step`` (its latest record's
        ``after_step``), so a job whose first step is ``step`` resumed from an earlier one: a loop
        counting from 1 that saved at consecutive steps, rolled back past them. A loop counting from 0
        saves after step ``step - 1`` as checkpoint ``step``: the one a job starting at ``step`` loaded.
        Without the record or its field (progress.txt alone, an older record, a save before any
        step) the checkpoint at ``step`` is taken, as the number alone suggests."""
        if record is not None and record.iteration == step:
            at = record
        elif base is not None and base.iteration == step and self._metrics_file is not None:
            at = _saved_record(self._metrics_file, lambda iteration: iteration == step)
        else:
            return False
        return at is not None and at.after_step == step  # later: a save reported late, of what it was numbered

    def _record_up_to(self, step: int, base: Optional[Saved]) -> Optional[Saved]:
        """metrics.jsonl's latest checkpoint record of an iteration up to ``step`` (None without the
        file or progress.txt). With a line in progress.txt (``base``) it is that line's or a later
        one's, near the end; with none, the record of a lost only line is near the end too (the disk
        filled shortly before this restart): a job that saved no checkpoint does not read all of a
        long metrics.jsonl."""
        if self._metrics_file is None:
            return None
        return _saved_record(self._metrics_file, lambda iteration: iteration <= step,
                             within=None if base is not None else _NO_LINE_WITHIN)


def checkpoint_number_problem(step: int, last: Optional[int], stride: Optional[int]) -> Optional[str]:
    """What is wrong with a checkpoint numbered ``step`` after the last ``monitor.step`` (``last``), or
    None: a checkpoint is numbered by the last step (Megatron's and torchtitan's iteration) or the next
    (the steps done, in a loop counting from 0; ``last + stride`` where steps go up by ``stride``, None
    while it is not known: any later number). Its record holds the tokens and FLOPs of the steps so far,
    and a restart from it counts on from them, so another number (an older one: an asynchronous save
    reported when it ends; a checkpoint numbered in iterations beside steps numbered in samples) gives
    a restart the wrong count. Said, not raised: the checkpoint is on disk already, and a long job is
    not stopped over its label. Before any step (a resumed job saving the checkpoint it loaded) any
    number is taken."""
    if last is None or step in (last, last + 1) or (step > last if stride is None else step == last + stride):
        return None
    return (f"monitor.checkpoint_saved({step}) came after monitor.step({last}): its progress.txt line and "
            f"record hold the tokens and FLOPs of the steps up to step {last}, and a restart from checkpoint "
            f"{step} counts on from them. Number a checkpoint by the last step or the next (the steps done), "
            "in the numbering monitor.step is given, and report an asynchronous save when it starts")


def _latest_up_to(saved: list, step: int) -> Optional[Saved]:
    """The latest of the progress.txt ``saved`` lines of the highest iteration up to ``step``, or None."""
    base = None
    for line in saved:
        if line.iteration <= step and (base is None or line.iteration >= base.iteration):
            base = line
    return base


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


_NO_LINE_WITHIN = 64 << 20
"""Bytes at the end of metrics.jsonl searched for a checkpoint record when progress.txt has no line."""


def _saved_record(path: Path, accept: Callable[[int], bool],
                  within: Optional[int] = None) -> Optional[Saved]:
    """The numbers of the last ``progress`` record of metrics.jsonl whose iteration
    ``accept`` takes (FLOPs nan where the record has none: not known), or None (``within``: see
    :func:`last_record`)."""
    record = last_record(path, lambda r: _as_saved(r) is not None and accept(r["step"]),
                         starts=b'{"kind":"progress"', within=within)
    return None if record is None else _as_saved(record)


def _has_record_of(path: Optional[Path], line: Saved) -> bool:
    """Whether metrics.jsonl holds a ``progress`` record of the save a progress.txt ``line`` tells of (its
    iteration, numbers that round to its text)."""
    return path is not None and last_record(path, lambda r: (saved := _as_saved(r)) is not None and
                                            saved.iteration == line.iteration and _rounds_alike(saved, line),
                                            starts=b'{"kind":"progress"') is not None


def _as_saved(record: dict) -> Optional[Saved]:
    """A ``progress`` record of a checkpoint's numbers as :class:`Saved` (FLOPs, and tokens in a
    "Saved checkpoint" record, nan where it has none: not known), or None for any other record."""
    if record.get("kind") != "progress" or not isinstance(record.get("step"), int):
        return None
    saved = str(record.get("message", "")).startswith("Saved checkpoint")
    tokens = record.get("checkpoint/tokens", math.nan if saved else None)
    flops = record.get("checkpoint/floating_point_operations", math.nan)
    if not isinstance(tokens, (int, float)) or not isinstance(flops, (int, float)):
        return None
    after = record.get("after_step")
    return Saved(record["step"], float(tokens), float(flops), after if type(after) is int else None)


def _rounds_alike(exact: Saved, line: Saved) -> bool:
    """Whether a checkpoint's exact numbers are the ones a progress.txt ``line`` shows (tokens to 0.01
    billion, FLOPs to three digits)."""
    return f"{exact.tokens / 10**9:.2f}" == f"{line.tokens / 10**9:.2f}" and f"{exact.flops:.2e}" == f"{line.flops:.2e}"


def _exact_numbers(resumed: dict, record: Optional[Saved]) -> None:
    """progress.txt holds a checkpoint's tokens to 0.01 billion and its FLOPs to three digits;
    the same numbers are in metrics.jsonl's last ``progress`` record of that iteration exactly
    (``record``, from :func:`_saved_record`). Take them from there when they round to the text
    (the two files tell of the same checkpoint)."""
    if record is None:
        return
    tokens, flops = record.tokens, record.flops
    if not _rounds_alike(record, Saved(record.iteration, resumed["last_tokens"], resumed["last_flops"])):
        return
    if resumed.get("start_flops") == resumed["last_flops"]:  # the streak began after that checkpoint
        resumed["start_flops"] = flops
    resumed["last_tokens"], resumed["last_flops"] = tokens, flops


def checkpoint_record(step: int, resumed: dict, job_start: float, job_tokens: float,
                      flops_per_token: Optional[float], world_size: int) -> dict:
    """The "Saved checkpoint" message and its numbers, as Megatron computes them.

    Job throughput counts this job's FLOPs over its own time; cumulative throughput counts the
    FLOPs since the first run of the current same-world-size streak (``resumed``, read back
    from progress.txt) over the time since that run started. Without ``flops_per_token`` (no
    model description) the FLOPs are not known: ``nan`` in the text (Megatron's readers parse
    it), left out of the record, never 0; likewise the tokens and FLOPs of a job that counted no
    tokens (``job_tokens`` nan), and what counts on from an earlier job's ``nan``.
    """
    start_flops = resumed.get("last_flops", 0.0)
    job_flops = job_tokens * flops_per_token if flops_per_token is not None else math.nan
    flops = start_flops + job_flops
    job_tflops = job_flops / max(time.time() - job_start, 1e-9) / 1e12 / world_size
    first_start, first_flops = resumed.get("start_time"), resumed.get("start_flops")
    if first_start is None:
        # Megatron reads it from this job's "Starting job" line, to the second, as a later job reads it here
        first_start, first_flops = _dt.datetime.fromtimestamp(job_start).replace(microsecond=0), start_flops
    elapsed = max((_dt.datetime.now() - first_start).total_seconds(), 1e-9)
    cumulative_tflops = (flops - first_flops) / elapsed / 1e12 / world_size
    tokens = resumed.get("last_tokens", 0.0) + job_tokens
    numbers = {"checkpoint/job_tflops_per_gpu": job_tflops, "checkpoint/cumulative_tflops_per_gpu": cumulative_tflops,
               "checkpoint/floating_point_operations": flops, "checkpoint/tokens": tokens}
    return {"message": checkpoint_message(step, job_tflops, cumulative_tflops, flops, tokens),
            **{name: value for name, value in numbers.items() if not math.isnan(value)}}
