"""Who runs the job: every rank's host, local rank and GPU (gathered once at start), the checks
that must pass on every rank before training starts, and the ``run`` record that opens each job
in ``metrics.jsonl``.

Start-up problems are raised on every rank together: the writer's check of ``output_dir`` (can
it create the folder and its files; is another Monitor — in this process or another job —
writing there) and a config one rank cannot take ride the start-up gather, so no rank waits at a
later collective for a rank that gave up."""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .config import MetricsConfig
from .guard import CollectiveGuard
from .output_claim import OutputClaim
from .parallel import Layout, RankInfo, detect_layout, local_rank_from_env
from .peers import InCollective
from .per_rank import some_ranks
from .redaction import redact_argv
from .runlog import METRICS_FILE, last_logged_step
from .sinks import SinkSet, open_sinks, sink_name
from .validation import ConfigError

__all__ = ["coerced_config", "start_up", "said_on_every_rank", "left_at_start", "gather_rank_info", "run_record",
           "open_writer_sinks", "first_step", "resumed_at", "OutputClaim"]

logger = logging.getLogger("distmetrics")


LAUNCHER_WORLD_SIZES = ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
"""Where launchers put the number of processes started together: torchrun (refused: one job),
srun (a job step's tasks; not SLURM_NTASKS, which a batch script running one process has too),
Open MPI, MPICH (a warning: they also start sweeps of separate jobs)."""


def coerced_config(given: Any, device_mesh: Any = None, group: Any = None) -> MetricsConfig:
    """``MetricsConfig.coerce(given)`` for ``Monitor(given, device_mesh=..., group=...)``. A config this
    rank cannot take (``log_interval=0``, a field set after construction) is said on every rank of the
    Monitor's group by the start-up gather, as :func:`start_up` says a missing features file, rather
    than the other ranks waiting there ``hang_timeout_s`` for a rank that never comes. Every rank
    raises the ConfigError, naming the rank; this one's message is its own, after that prefix. A
    ``group`` or ``device_mesh`` that cannot be read is raised on this rank alone: which ranks to tell
    is then unknown (the world may hold other jobs, which never come)."""
    try:
        return _anchored(MetricsConfig.coerce(given))
    except ConfigError as err:
        error = err
    layout = detect_layout(device_mesh, group)
    guard = CollectiveGuard(_hang_timeout_given(given), group)  # made as Monitor() makes one, in the same order
    if layout.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        raise error  # nobody else to tell
    try:
        start_up(None, layout, guard, False, str(error), config_problem=True,
                 derived=dict.fromkeys(SHARED_KEYS, NOT_READ))  # raises: this rank has a problem
    except ValueError:
        raise  # every rank's report, this rank's error in it
    except Exception as failure:  # noqa: BLE001 - the gather failed (the others never came): this rank's own error
        raise error from failure
    raise error


def _anchored(config: MetricsConfig) -> MetricsConfig:
    """The Monitor's copy with its folders made absolute where given relative, from the working directory at
    ``Monitor()``: a loop that changes directory later (a Hydra-style run folder) had its ``close()`` unlink
    another job's lock there, and a reopened file or progress.txt would be another folder's."""
    keys = ("output_dir", "tensorboard_dir", "wandb_save_dir")
    try:
        moved = {key: os.path.abspath(getattr(config, key)) for key in keys
                 if getattr(config, key) and not os.path.isabs(getattr(config, key))}
    except OSError:  # the working directory is gone (removed under this rank): kept as given, where a rank that
        return config  # writes nothing there never looks, and the writer's sinks say what they cannot open
    return config.replace(**moved) if moved else config


def _hang_timeout_given(given: Any) -> float:
    """The ``hang_timeout_s`` of a config that could not be taken, where that key alone is accepted,
    else the default: the start-up check waits as the other ranks' does (with 0 its call is another)."""
    value = given.get("hang_timeout_s") if isinstance(given, dict) else getattr(given, "hang_timeout_s", None)
    try:
        return MetricsConfig.from_dict({} if value is None else {"hang_timeout_s": value}).hang_timeout_s
    except ConfigError:
        return MetricsConfig().hang_timeout_s


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
    hosts = gather_rank_info(layout, guard, problem or claimed, settings, config_problem and problem is not None,
                             claim_problem=problem is None and claimed is not None)
    differing = _differing_settings(hosts)
    # where writer_rank differs, each rank that took itself for the writer claimed output_dir, and all but
    # one were refused: that refusal is the difference's, said alone
    said = _by_problem((h.rank, h.problem) for h in hosts
                       if h.problem and not (h.claim_problem and "writer_rank" in differing))
    problems = said + list(differing.values())
    if problems:
        if claim is not None:
            claim.release()
        message = "distmetrics cannot start: " + "; ".join(problems)
        if said and all(h.config_problem for h in hosts if h.problem) and len(problems) == len(said):
            raise ConfigError(message)  # the same on every rank: a config error, as a job of one rank raises it
        raise ValueError(message)
    return hosts, claim


def left_at_start(how: str, hang_timeout_s: float) -> None:
    """Mark this rank left at the first guarded call of the next Monitor made on the world (as every
    rank makes its guards alike, it is the one the others' ``Monitor()`` waits at): a rank that raises
    before its Monitor (``tensor_stats.initialize``'s check) is named there at once, with ``how``,
    rather than waited for. Nothing without a process group, alone, or with the check off."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        CollectiveGuard(hang_timeout_s).leave(how)


def said_on_every_rank(error: Optional[ConfigError], layout: Layout, hang_timeout_s: float, call: str) -> None:
    """Raise on every rank of ``layout`` the config error any of them found (``error``: this rank's, or
    None), after one guarded gather of them (``call`` names it to the arrival check), as :func:`start_up`
    says a problem: a check that failed on one rank alone (``tensor_stats.initialize``'s features file)
    left the others going on into a collective that rank never reached. A rank that makes another
    guarded call there instead (``Monitor()``) is named at once, one that makes none after
    ``hang_timeout_s``. Without a process group, or alone, this rank's error as it is."""
    if layout.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    guard = CollectiveGuard(hang_timeout_s, layout.group)  # made on every rank alike: later guards keep one numbering
    rows: list[Any] = [None] * layout.world_size
    try:
        guard.enter(call)
        with InCollective("the gather of every rank's start-up problems", call):
            dist.all_gather_object(rows, (layout.rank, None if error is None else str(error)), group=layout.group)
    except Exception as failure:  # noqa: BLE001 - the others never came (or went): this rank's own error, if any
        if error is not None:
            raise error from failure
        raise
    said = _by_problem((rank, problem) for rank, problem in rows if problem is not None)
    if said:
        raise ConfigError("distmetrics cannot start: " + "; ".join(said))


def _by_problem(problems: Iterable[tuple[int, str]]) -> list[str]:
    """Each distinct problem once, with the ranks that have it (``ranks 0, 2: <problem>``), in the
    order first seen: how a start-up check says what ranks found."""
    ranks: dict[str, list[int]] = {}
    for rank, problem in problems:
        ranks.setdefault(problem, []).append(rank)
    return [f"{some_ranks(held)}: {problem}" for problem, held in ranks.items()]


SHARED_KEYS = ("log_interval", "loss_average", "writer_rank", "pipeline_style", "timing_log_level", "timing_log_option",
               "barrier_with_L1_time", "log_grad_norm", "log_grad_norm_per_module",
               "module_norm_depth", "log_params_norm", "log_update_norm", "log_throughput", "log_memory",
               "log_energy", "log_gpu_telemetry", "straggler_window", "straggler_report_every", "total_steps",
               "tensor_inspect.enabled", "tensor_inspect.features", "tensor_inspect.init_training_step",
               "flops_per_token", "peak_tflops", "sol_step_time_ms", "spike_factor")
"""Config keys whose value decides which collectives a rank joins, what its pieces count for, which
rank writes or what the job's derived numbers are: a rank given another value than the others would
hang, count wrong, write nothing or return another dict, so ``Monitor()`` refuses a difference on
every rank (``timing_log_level`` and ``barrier_with_L1_time``: a timer started with ``barrier=True``
waits at a barrier only where its level is enabled; ``tensor_inspect.features``: the features'
content, as a digest, given to :func:`start_up` as derived; ``tensor_inspect.init_training_step``:
which steps the statistics' collective runs at; ``flops_per_token``, ``peak_tflops`` and
``sol_step_time_ms``: each rank computes TFLOP/s, MFU and SOL from its own config after the reduction,
so what it computes them from is compared, given as derived by
:func:`~distmetrics.collectors.throughput.shared_throughput`: the FLOPs per token however given, the
peak however found; the job's numbers are the whole model's, so a pipeline stage's own parameter count
is not one of them; ``spike_factor``: each rank finds a loss spike in the reduced loss by its own, and
``health/loss_spike`` is in the dict ``monitor.step`` returns). The sinks' keys matter on the writer only."""

NOT_READ = "<not read on this rank: its problem is said>"
"""A derived shared value a rank could not read; not compared (its problem is raised)."""


def _setting(config: Any, key: str) -> Any:
    """The value of shared ``key`` as compared (a float key holds a float: ``3`` from a YAML file and
    ``3.0`` from an override are one ``spike_factor``, :func:`~distmetrics.validation.floats_of_ints`)."""
    *sections, name = key.split(".")
    for part in sections:
        config = getattr(config, part)
    return getattr(config, name)


def _differing_settings(hosts: list[RankInfo]) -> dict[str, str]:
    """One problem per shared key whose value differs between ranks, naming the values and a few
    ranks holding each, by key."""
    problems = {}
    for i, key in enumerate(SHARED_KEYS):
        ranks_by_value: dict = {}
        for h in hosts:
            if len(h.settings) == len(SHARED_KEYS) and h.settings[i] != NOT_READ:
                ranks_by_value.setdefault(repr(h.settings[i]), []).append(h.rank)
        if len(ranks_by_value) > 1:
            held = "; ".join(f"{value} on {some_ranks(ranks)}" for value, ranks in ranks_by_value.items())
            problems[key] = f"config key {key} differs between ranks ({held}); every rank must be given the same value"
    return problems


def gather_rank_info(layout: Layout, guard: Any = None, problem: Optional[str] = None,
                     settings: tuple = (), config_problem: bool = False,
                     claim_problem: bool = False) -> list[RankInfo]:
    """Every rank's host, local rank, GPU, start-up problem and shared config values, in one
    ``all_gather_object`` over the Monitor's ranks (its group's: another job sharing the world
    neither waits for this one nor is compared with it), in their group's order."""
    gpu = None
    if torch.cuda.is_available():
        from .collectors.nvml import gpu_model_info

        gpu = gpu_model_info(layout.rank)
    mine = RankInfo(layout.rank, socket.gethostname(), local_rank_from_env(), os.getpid(), gpu, problem, settings,
                    config_problem, claim_problem)
    if layout.world_size == 1 or not dist.is_initialized():
        mine.local_rank = layout.local_rank if mine.local_rank is None else mine.local_rank
        return [mine]
    if guard is not None:
        guard.enter("Monitor()")
    rows: list[Any] = [None] * layout.world_size
    with InCollective("the start-up gather of every rank's host, settings and problems", "Monitor()"):
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
        "end_record": True,  # the job ends with an end record unless killed: readers of older files expect none
        "python_version": platform.python_version(),
        "argv": redact_argv(sys.argv),
        "config": config.to_dict(redact=True),
    }


def open_writer_sinks(config: Any, layout: Layout, hosts: list[RankInfo], writer_rank: int, extra: tuple,
                      claim: Optional[OutputClaim] = None, modules: Sequence[str] = (),
                      timer_order: Callable[[], Sequence[str]] = tuple) -> SinkSet:
    """The writer rank's sinks, opened with the job's ``run`` record (and ``gpu_model`` on GPUs);
    they remember the last step an earlier job logged in ``output_dir`` (from its metrics.jsonl),
    and closing them releases the claim on ``output_dir``. ``timer_order``: see :func:`open_sinks`."""
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
    sinks = open_sinks(config, layout.world_size, extra, claim.reclaim if claim is not None else None, timer_order)
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
    # the drop on disk before the job's first step returns (once per resumed job): a job killed before the writer
    # thread wrote it kept the earlier job's steps on TensorBoard while its train record, in metrics.jsonl, said
    # the drop was made; waited for a second at most (a slow sink ahead of it: said)
    if "tensorboard" in names and not sinks.flush(timeout=1.0):
        logger.warning("distmetrics: the writer thread has not written TensorBoard's drop of the earlier job's steps "
                       "from step %d within a second (a sink is slow): it is written in order, but a job killed "
                       "before then leaves TensorBoard showing both jobs' values at those steps", first)
    sinks.log({"message": message, "last_logged_step": last, "from_step": first,
               "tensorboard_dropped": "tensorboard" in names}, first, "resume")
