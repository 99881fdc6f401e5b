"""Who runs the job: every rank's host, local rank and GPU (gathered once at start), the checks
that must pass on every rank before training starts, and the ``run`` record that opens each job
in ``metrics.jsonl``.

Start-up problems are raised on every rank together: the writer's check of ``output_dir`` (can
it create the folder and its files; is another Monitor — in this process or another job —
writing there) rides the start-up gather, so no rank waits at a later collective for a rank
that gave up."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import platform
import socket
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .parallel import Layout, RankInfo, local_rank_from_env
from .per_rank import some_ranks
from .redaction import redact_argv
from .runlog import METRICS_FILE, last_logged_step
from .sinks import SinkSet, open_sinks, sink_name
from .sinks.appendfile import describe_os_error
from .validation import ConfigError

__all__ = ["start_up", "gather_rank_info", "run_record", "open_writer_sinks", "first_step", "resumed_at",
           "OutputClaim"]

logger = logging.getLogger("distmetrics")
_LOCK_TRIES = 5
_LOCK_NAME = ".distmetrics.lock"


class OutputClaim:
    """The writer's hold on ``output_dir``: an exclusive lock on ``{output_dir}/.distmetrics.lock``
    (released at close or when the process ends), refused while another Monitor holds it. A forked
    child closes its copy of the lock's file descriptor at once (:func:`_let_go_in_child`): a flock
    lasts while any descriptor of it is open, so a child outliving a killed trainer (a DataLoader
    worker, an uploader) would otherwise keep the next job out. A lock file removed with its folder
    while held is taken again before a sink makes its file there again (:meth:`reclaim`)."""

    def __init__(self, config: Any) -> None:
        self.problem: Optional[str] = None
        self._file: Any = None
        self._held: Optional[Path] = None
        self._busy = False  # the last try found another Monitor holding the lock
        self._retake: Optional[Path] = None  # the folder whose removed lock reclaim() could not take again yet
        self._mutex = threading.Lock()  # reclaim() runs on the training thread and the writer thread
        if not (config.json_log or config.log_progress or (config.tensorboard and not config.tensorboard_dir)):
            return  # nothing is written there
        path = Path(config.output_dir)
        for _ in range(_LOCK_TRIES):
            if not self._lock(path) or self._held is not None or self.problem is not None:
                return
        self.release()  # the file was replaced under us every time: another writer keeps starting
        self.problem = f"output_dir={str(path)!r} is in use by other Monitors starting there at the same time"

    def _lock(self, path: Path) -> bool:
        """One try to hold the lock file; False when there is nothing to hold (``problem`` says
        why, or the file system cannot lock), True otherwise; ``_held`` is set once held. A lock
        on a file that a closing Monitor unlinked meanwhile holds nothing: that try ends without it."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / _LOCK_NAME, "a+")
        except OSError as err:
            self.release()
            self.problem = (f"output_dir={str(path)!r} cannot be written on the writer rank "
                            f"({socket.gethostname()}): {describe_os_error(err)}")
            return False
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                # A file system without flock (some NFS or Lustre mounts): the folder is writable,
                # only the guard against a second writer is missing.
                logger.warning("distmetrics: output_dir=%r cannot be locked (%s); a second Monitor writing there "
                               "would not be refused: give each job its own output_dir.", str(path),
                               describe_os_error(err))
                self.release()
                (path / _LOCK_NAME).unlink(missing_ok=True)  # it locks nothing here
                return False
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._busy = True
            self.release()
            self.problem = (f"output_dir={str(path)!r} is in use by another Monitor ({holder}); two writers would "
                            "interleave their records: give each job its own output_dir")
            return True
        try:
            same = os.fstat(self._file.fileno()).st_ino == os.stat(path / _LOCK_NAME).st_ino
        except OSError:
            same = False
        if not same:  # the Monitor that held it closed and unlinked it between our open and lock
            self.release()
            return True
        self._held = path / _LOCK_NAME
        _HELD.add(self)
        try:  # who holds it, for a refused second writer's message; a full disk leaves it out
            os.ftruncate(self._file.fileno(), 0)  # past the text layer: nothing left buffered to fail at close
            os.pwrite(self._file.fileno(), f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError as err:
            logger.warning("distmetrics: output_dir=%r: the lock is held but who holds it could not be written "
                           "(%s); the metric files will say what they can write.", str(path),
                           describe_os_error(err))
        return True

    def reclaim(self) -> None:
        """Take the lock again where its file was removed with ``output_dir`` while held (a sink is
        about to make its removed file there again), so a second Monitor is still refused there.
        Raises OSError: EBUSY where another Monitor took the folder meanwhile (each later call tries
        again), or the folder's own error. Held in place, or moved with its folder: nothing to do."""
        with self._mutex:
            folder = self._held.parent if self._held is not None else self._retake
            if folder is None or (self._held is not None and os.fstat(self._file.fileno()).st_nlink > 0):
                return  # nothing held (no flock on this file system), or held still
            if self._held is not None:
                _HELD.discard(self)
                self._held = None
                self.release()  # the file removed: closed, nothing unlinked
            self._retake, self._busy = folder, False  # until it is held again
            folder.mkdir(parents=True, exist_ok=True)  # its error, not the lock's, where it cannot be made
            for _ in range(_LOCK_TRIES):
                if not self._lock(folder) or self._held is not None or self.problem is not None:
                    break
            problem, self.problem = self.problem, None
            if self._held is None and (self._busy or problem is not None):
                raise OSError(errno.EBUSY if self._busy else errno.EIO, f"{folder} was removed while this run wrote "
                              f"it, and it cannot be taken again: {problem}")
            self._retake = None  # held again (or no flock here: warned)

    def release(self) -> None:
        """Let another Monitor write ``output_dir`` (the lock file goes; a killed process leaves
        a file that no longer locks anything)."""
        if self._held is not None:
            self._held.unlink(missing_ok=True)
            self._held = None
            _HELD.discard(self)
        if self._file is not None:
            self._file.close()
            self._file = None


_HELD: "weakref.WeakSet[OutputClaim]" = weakref.WeakSet()  # the claims this process holds


def _let_go_in_child() -> None:
    """In a forked child: close the inherited descriptors of the parent's locks, and forget them, so
    nothing in the child (no release(), no exit) unlinks the parent's lock file. Closing a copy does
    not unlock: the parent's own descriptor keeps the lock."""
    for claim in list(_HELD):
        claim._held = None
        claim.release()
    _HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)  # once per process: a child inherits the registration


LAUNCHER_WORLD_SIZES = ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
"""Where launchers put the number of processes started together: torchrun (refused: one job),
srun (a job step's tasks; not SLURM_NTASKS, which a batch script running one process has too),
Open MPI, MPICH (a warning: they also start sweeps of separate jobs)."""


def start_up(config: Any, layout: Layout, guard: Any, is_writer: bool, problem: Optional[str] = None,
             config_problem: bool = False,
             derived: Optional[dict] = None) -> tuple[list[RankInfo], Optional[OutputClaim]]:
    """The checks every rank passes before training starts, and every rank's info (one gather):
    raises on every rank when one rank has a problem (``problem``: one found by the caller;
    ``config_problem``: a config error, raised as a ConfigError where every problem is one;
    ``derived``: values of shared keys read from what the config names rather than the config
    itself, e.g. the features file's content; :data:`NOT_READ` where this rank could not)."""
    if not (dist.is_available() and dist.is_initialized()):
        for variable in LAUNCHER_WORLD_SIZES:
            world = os.environ.get(variable, "").strip()
            if not (world.isdigit() and int(world) > 1):
                continue
            said = (f"{variable}={world} in the environment but torch.distributed is not initialised: call "
                    "torch.distributed.init_process_group(...) before Monitor(...), or every rank believes it is "
                    "alone and writes its own files")
            if variable == "WORLD_SIZE":  # torchrun's processes are one job
                raise RuntimeError(said)
            # srun and mpirun also start sweeps of separate 1-process jobs (each its own output_dir)
            logger.warning("distmetrics: %s (where these processes are separate jobs, give each its own "
                           "output_dir and ignore this)", said)
            break
    claim = OutputClaim(config) if is_writer else None
    derived = derived or {}
    settings = tuple(derived[key] if key in derived else _setting(config, key) for key in SHARED_KEYS)
    claimed = claim.problem if claim is not None else None
    hosts = gather_rank_info(layout, guard, problem or claimed, settings, config_problem and problem is not None)
    by_problem: dict[str, list[int]] = {}
    for h in hosts:
        if h.problem:
            by_problem.setdefault(h.problem, []).append(h.rank)
    problems = [f"{some_ranks(ranks)}: {text}" for text, ranks in by_problem.items()] + _differing_settings(hosts)
    if problems:
        if claim is not None:
            claim.release()
        message = "distmetrics cannot start: " + "; ".join(problems)
        if by_problem and all(h.config_problem for h in hosts if h.problem) and len(problems) == len(by_problem):
            raise ConfigError(message)  # the same on every rank: a config error, as a job of one rank raises it
        raise ValueError(message)
    return hosts, claim


SHARED_KEYS = ("log_interval", "writer_rank", "pipeline_style", "timing_log_level", "timing_log_option",
               "barrier_with_L1_time", "log_grad_norm", "log_grad_norm_per_module",
               "module_norm_depth", "log_params_norm", "log_update_norm", "log_throughput", "log_memory",
               "log_energy", "log_gpu_telemetry", "straggler_window", "straggler_report_every", "total_steps",
               "tensor_inspect.enabled", "tensor_inspect.features", "tensor_inspect.init_training_step")
"""Config keys whose value decides which collectives a rank joins, what its pieces count for, or
which rank writes: a rank given another value than the others would hang, count wrong or write
nothing, so ``Monitor()`` refuses a difference on every rank (``timing_log_level`` and
``barrier_with_L1_time``: a timer started with ``barrier=True`` waits at a barrier only where its
level is enabled; ``tensor_inspect.features``: the features' content, as a digest, given to
:func:`start_up` as derived; ``tensor_inspect.init_training_step``: which steps the statistics'
collective runs at). The sinks' keys matter on the writer only."""

NOT_READ = "<not read on this rank: its problem is said>"
"""A derived shared value a rank could not read; not compared (its problem is raised)."""


def _setting(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _differing_settings(hosts: list[RankInfo]) -> list[str]:
    """One problem per shared key whose value differs between ranks, naming the values and a few
    ranks holding each."""
    problems = []
    for i, key in enumerate(SHARED_KEYS):
        ranks_by_value: dict = {}
        for h in hosts:
            if len(h.settings) == len(SHARED_KEYS) and h.settings[i] != NOT_READ:
                ranks_by_value.setdefault(repr(h.settings[i]), []).append(h.rank)
        if len(ranks_by_value) > 1:
            held = "; ".join(f"{value} on {some_ranks(ranks)}" for value, ranks in ranks_by_value.items())
            problems.append(f"config key {key} differs between ranks ({held}); every rank must be given the same "
                            "value")
    return problems


def gather_rank_info(layout: Layout, guard: Any = None, problem: Optional[str] = None,
                     settings: tuple = (), config_problem: bool = False) -> list[RankInfo]:
    """Every rank's host, local rank, GPU, start-up problem and shared config values, in one
    ``all_gather_object`` over the Monitor's ranks (its group's: another job sharing the world
    neither waits for this one nor is compared with it), in their group's order."""
    gpu = None
    if torch.cuda.is_available():
        from .collectors.nvml import gpu_model_info

        gpu = gpu_model_info(layout.rank)
    mine = RankInfo(layout.rank, socket.gethostname(), local_rank_from_env(), os.getpid(), gpu, problem, settings,
                    config_problem)
    if layout.world_size == 1 or not dist.is_initialized():
        mine.local_rank = layout.local_rank if mine.local_rank is None else mine.local_rank
        return [mine]
    if guard is not None:
        guard.enter("Monitor()")
    rows: list[Any] = [None] * layout.world_size
    dist.all_gather_object(rows, mine, group=layout.group)
    by_host: dict[str, list] = {}
    for row in sorted(rows, key=lambda r: r.rank):
        by_host.setdefault(row.hostname, []).append(row)
    for host_rows in by_host.values():
        # no launcher variable, or one every rank of the host inherited alike (SLURM_LOCALID=0 of one
        # task that spawned its ranks): the place on the host. Two torchrun agents on one host name
        # number their ranks 0, 1, 0, 1: those stay.
        given = [row.local_rank for row in host_rows]
        if None in given or (len(given) > 1 and len(set(given)) == 1):
            for place, row in enumerate(host_rows):
                row.local_rank = place
    if layout.says_once:
        _say_shared_gpus(by_host)
    return rows


def _say_shared_gpus(by_host: dict[str, list]) -> None:
    """Warn where ranks of one host use one GPU (no ``torch.cuda.set_device(local_rank)`` before the
    Monitor: every rank on cuda:0): each reads that GPU's energy counter and memory as its own."""
    for host, host_rows in by_host.items():
        users: dict[str, list[int]] = {}
        for row in host_rows:
            if row.gpu and row.gpu.get("uuid"):
                users.setdefault(row.gpu["uuid"], []).append(row.rank)
        for uuid, ranks in users.items():
            if len(ranks) > 1:
                logger.warning("distmetrics: %s on %s all use GPU %s: call torch.cuda.set_device(local_rank) "
                               "before Monitor() and the model. As it is, each of them reads that GPU's energy "
                               "counter and memory as its own: energy totals count that GPU once per rank.",
                               some_ranks(ranks), host, uuid)
                return  # one warning names the first such GPU


def job_module_order(layout: Layout, local: Sequence[str], guard: Any = None, chunked: bool = False) -> list[str]:
    """The job's module names in model order, the same on every rank: with pipeline stages, each
    stage's in stage order, gathered over this rank's pipeline group (the stages' lists: what it
    receives grows with the model, not the world; a rank holds its stage's modules only: the
    writer's alone put the last stage first in the report, and each stage named a different
    module as the first non-finite one); else this rank's (``local``). ``chunked``: the model is a
    ``ModuleList`` of virtual pipeline chunks (names start with the chunk's index) on every rank of the
    group, ordered by the stage each chunk is (:func:`_stage_of`): chunk 0 of every rank, then chunk 1
    of every rank (in reverse rank order under ``pipeline_style="v"``)."""
    group = layout.pp_group
    if layout.pp_size <= 1 or group is None or not (dist.is_available() and dist.is_initialized()):
        return list(local)
    if guard is not None:
        guard.enter("Monitor()")
    stages: list[Any] = [None] * layout.pp_size
    dist.all_gather_object(stages, (layout.pp_rank, tuple(local), chunked), group=group)
    if all(chunks for _, _, chunks in stages):
        keyed = sorted((_stage_of(_chunk_index(name), rank, layout), rank, at, name)
                       for rank, names, _ in stages for at, name in enumerate(names))
        return list(dict.fromkeys(name for *_, name in keyed))
    return list(dict.fromkeys(name for _, names, _ in sorted(stages, key=lambda s: s[0]) for name in names))


def _stage_of(chunk: int, pp_rank: int, layout: Layout) -> int:
    """The pipeline stage that chunk ``chunk`` of pipeline rank ``pp_rank`` is: ``chunk·pp + pp_rank``
    (``loop``); under ``v`` the odd chunks run back down the ranks (rank r holds stages r and
    2·pp − 1 − r). The root's own name (chunk -1) comes first."""
    if chunk < 0:
        return -1
    pp = layout.pp_size
    return chunk * pp + (pp - 1 - pp_rank if layout.pp_style == "v" and chunk % 2 else pp_rank)


def _chunk_index(name: str) -> int:
    """The virtual pipeline chunk a module of a ``ModuleList`` of chunks belongs to (its name's first
    part); -1 for the root's own name, which comes first."""
    first = name.split(".", 1)[0]
    return int(first) if first.isdigit() else -1


def run_record(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int,
               modules: Sequence[str] = ()) -> dict[str, Any]:
    """The fields of the ``run`` record: the Monitor's ranks (its group's: their number as
    ``world_size``, each by its global rank) and hosts, the model's module names in model
    order (nearest the input first; a report draws per-module norms in this order, the metric
    records hold them sorted by name), versions, the command line and the config, with secret
    values hidden (:mod:`distmetrics.redaction`)."""
    from . import __version__

    return {
        "world_size": layout.world_size,
        "writer_rank": writer_rank,
        "hosts": sorted({h.hostname for h in hosts}),
        "ranks": [{"rank": h.rank, "host": h.hostname, "local_rank": h.local_rank} for h in hosts],
        "modules": list(modules),
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "layout": layout.source,
        "torch_version": torch.__version__,
        "distmetrics_version": __version__,
        "python_version": platform.python_version(),
        "argv": redact_argv(sys.argv),
        "config": config.to_dict(redact=True),
    }


def open_writer_sinks(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int, extra: tuple,
                      claim: Optional[OutputClaim] = None, modules: Sequence[str] = ()) -> SinkSet:
    """The writer rank's sinks, opened with the job's ``run`` record (and ``gpu_model`` on GPUs);
    they remember the last step an earlier job logged in ``output_dir`` (from its metrics.jsonl),
    and closing them releases the claim on ``output_dir``."""
    last_logged = last_logged_step(os.path.join(config.output_dir, METRICS_FILE)) if config.json_log else None
    if not config.json_log and config.tensorboard and _has_events(config.resolved_tensorboard_dir):
        logger.warning("distmetrics: %s holds an earlier job's TensorBoard events, and with json_log off a restart "
                       "from an earlier checkpoint is not recognised (the last step logged is read from "
                       "metrics.jsonl): TensorBoard will show both jobs' values at the steps they share. Set "
                       "json_log: true to have it drop the earlier job's.", config.resolved_tensorboard_dir)
    elif config.json_log and config.tensorboard and config.tensorboard_dir and last_logged is None \
            and _has_events(config.resolved_tensorboard_dir):  # (its own folder: a job that logged nothing yet)
        logger.warning("distmetrics: %s holds TensorBoard events, and %s has no step logged to tell a restart from (a "
                       "tensorboard_dir shared with another output_dir?): where they hold steps this job logs too, "
                       "TensorBoard will show both jobs' values at them. Give each output_dir its own "
                       "tensorboard_dir, or restart into the output_dir that wrote them.",
                       config.resolved_tensorboard_dir, os.path.join(config.output_dir, METRICS_FILE))
    sinks = open_sinks(config, layout.world_size, extra, claim.reclaim if claim is not None else None)
    sinks.last_logged_step = last_logged
    if claim is not None:
        sinks.on_close(claim.release)
    sinks.log(run_record(config, layout, hosts, writer_rank, modules), 0, "run")
    gpus = [h.gpu for h in hosts if h.gpu is not None]
    if gpus:
        sinks.log({"ranks": gpus}, 0, "gpu_model")
    return sinks


def _has_events(folder: str) -> bool:
    """Whether ``folder`` holds a TensorBoard event file."""
    try:
        return any(name.startswith("events.out.tfevents.") for name in os.listdir(folder))
    except OSError:
        return False


def first_step(clocks: list) -> None:
    """The job's first ``monitor.step``: the clocks start (building the Monitor is no step's time
    or energy)."""
    for clock in clocks:
        clock.start()


def resumed_at(first: int, sinks: SinkSet) -> None:
    """The job's first ``monitor.step`` is ``first`` (called once). On the writer, a job that
    starts at or before the last step logged in its output_dir (a restart from an earlier
    checkpoint) has TensorBoard drop the earlier job's events from ``first`` on (``purge_step``),
    and says so: a warning and a ``resume`` record. What the job wrote before (an evaluation of
    the checkpoint it restored, at ``first`` where a loop counts from 0) stays. A job that never
    steps (an evaluation-only job) drops nothing."""
    last = sinks.last_logged_step
    if last is None or first > last:
        sinks.purge_from(None)  # nothing to drop: TensorBoard stops keeping what it would write again
        return
    names = {sink_name(sink) for sink in sinks.sinks}  # those still on: a sink that failed does neither
    said = ([f"TensorBoard drops the earlier events from step {first} on"] if "tensorboard" in names else []) + \
        (["metrics.jsonl keeps both jobs' records (each job starts with a run record)"] if "jsonl" in names else [])
    message = (f"this job starts at step {first}, at or before step {last}, the last step an earlier job logged "
               f"here" + (f": {'; '.join(said)}" if said else ""))
    logger.warning("distmetrics: %s", message)
    sinks.purge_from(first)
    sinks.log({"message": message, "last_logged_step": last, "from_step": first,
               "tensorboard_dropped": "tensorboard" in names}, first, "resume")
