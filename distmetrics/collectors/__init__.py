"""Collectors: each measures on its rank and hands the log step samples (see :mod:`.base`).

:func:`build_collectors` makes the built-in ones a config asks for; a user's own are passed as
``Monitor(..., collectors=[...])``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .base import Alert, Collector, LogContext, Record, Sample, finalize_order

__all__ = ["build_collectors", "planned_collectors", "idle_collectors", "Collector", "LogContext", "Alert", "Record",
           "Sample", "finalize_order"]


def build_collectors(config: Any, layout: Any, model: Optional[Any] = None, optimizer: Optional[Any] = None,
                     group: Any = None) -> list:
    """The built-in collectors for a :class:`~distmetrics.MetricsConfig`, in finalize order.

    ``model`` enables norms, ``optimizer`` update norms (the Monitor attaches them). Tensor
    statistics come from :func:`distmetrics.tensor_stats.lifecycle.collectors_for`."""
    return finalize_order([make() for _, make in planned_collectors(config, layout, model, group)])


def planned_collectors(config: Any, layout: Any, model: Optional[Any] = None,
                       group: Any = None) -> list[tuple[type, Callable[[], Any]]]:
    """The built-in collectors :func:`build_collectors` makes, each as its class and how it is made:
    a class holds the collector's ``name``, ``after`` and ``writes``, which ``Monitor()`` checks
    against a user's collectors before any collective (nothing is made, hooked or started here)."""
    from ..parallel import sees_distinct_tokens
    from .health import HealthCollector
    from .losses import LossCollector
    from .memory import MemoryCollector
    from .moe import MoECollector
    from .norms import NormCollector
    from .nvml import EnergyCollector, TelemetryCollector
    from .steps import StepValues
    from .stragglers import StragglerCollector
    from .throughput import ThroughputCollector, resolve_peak_tflops
    from .timer_collector import TimerCollector
    from .timers import Timers

    ranks = layout.world_size  # the reduction's: the Monitor's group's
    # straggler scores compare ranks: with one rank there is nothing to compare, so none are kept.
    # With them on, every rank's timer values also travel (in the one ALL gather).
    scores = config.straggler_window > 0 and ranks > 1

    def timers() -> TimerCollector:
        # barrier=True and the timer reports wait for the Monitor's ranks (its group's), not the world's
        made = Timers(config.timing_log_level, config.timing_log_option,
                      barrier_with_L1_time=config.barrier_with_L1_time, barrier_group=layout.group,
                      off=config.timing_log_level < 0)
        return TimerCollector(made, config.timing_log_option, per_rank=scores, stragglers=ranks > 1)

    out: list = [(StepValues, lambda: StepValues(layout, layout.writer(config.writer_rank), config.loss_average)),
                 (TimerCollector, timers)]
    if config.log_throughput:
        out.append((ThroughputCollector, lambda: ThroughputCollector(
            ranks, config.resolved_flops_per_token, resolve_peak_tflops(config, warns=layout.says_once),
            config.total_steps, config.sol_step_time_ms, warns=layout.says_once)))
    if config.log_memory:
        out.append((MemoryCollector, MemoryCollector))
    if config.log_energy:
        out.append((EnergyCollector, lambda: EnergyCollector(ranks)))  # the GPUs its reduction sums over
    if telemetry_setting(config):
        out.append((TelemetryCollector, TelemetryCollector))
    if model is not None:
        out.append((NormCollector, lambda: NormCollector(
            model, layout, group, depth=config.module_norm_depth, per_module=config.log_grad_norm_per_module,
            log_grad_norm=config.log_grad_norm, log_params_norm=config.log_params_norm,
            log_update_norm=config.log_update_norm, snapshot=config.update_norm_snapshot)))
    out += [(HealthCollector, lambda: HealthCollector(config.spike_factor)), (LossCollector, LossCollector),
            (MoECollector, lambda: MoECollector(sees_distinct_tokens(layout)))]
    if scores:
        out.append((StragglerCollector, lambda: StragglerCollector(
            config.straggler_window, config.straggler_report_every, config.straggler_report_ranks,
            config.straggler_threshold, nvml=config.log_energy or config.log_gpu_telemetry)))
    return out


VERBOSE_TELEMETRY = "on: verbosity 1 on a rank that sees a GPU"
"""How :func:`telemetry_setting` says telemetry that ``verbosity`` turned on (the start-up check names it)."""


def sees_gpu() -> bool:
    """Whether this rank sees a GPU (``torch.cuda.is_available()``)."""
    import torch

    return torch.cuda.is_available()


def telemetry_setting(config: Any) -> Any:
    """Whether this rank runs the telemetry collector, as start-up compares it between ranks: True for
    ``log_gpu_telemetry``, :data:`VERBOSE_TELEMETRY` where ``verbosity`` 1 turned it on (the console's
    memory, power and temperature, on a rank that sees a GPU), else False. ``verbosity`` alone matters on
    the writer only, but a rank without the collector adds nothing to ``gpu/*``: ranks given another
    ``verbosity`` would write the hottest GPU of some ranks as the job's, so the difference is refused."""
    if config.log_gpu_telemetry:
        return True
    return VERBOSE_TELEMETRY if config.verbosity >= 1 and sees_gpu() else False


def idle_collectors(planned: list, given: Any = ()) -> list[type]:
    """The classes of the built-in collectors with names of their own that the config switches off
    (``log_throughput``, ``log_memory``, ``log_energy``, ``log_gpu_telemetry``, ``tensor_inspect.enabled``),
    none of them made. ``Monitor()`` reserves their names all the same, as the timers' and the stragglers'
    are whatever the switches: a name of the user's under ``memory/`` (or ``train/tokens_per_sec``) would
    otherwise be written beside the built-in's names in one run and refused in the run that turns the switch
    on. Not the norms' without a model: a Monitor given none is one over a loop that measures its own
    (DeepSpeed's, Megatron's clip) and records them as ``grad_norm``. ``planned``: the classes the config makes;
    ``given``: the user's collectors, where one made of these classes (an ``EnergyCollector`` for one GPU)
    runs it in the switch's place and writes its names."""
    from ..tensor_stats.inspector import TensorInspector
    from .memory import MemoryCollector
    from .nvml import EnergyCollector, TelemetryCollector
    from .throughput import ThroughputCollector

    given = given if isinstance(given, (list, tuple)) else ()  # anything else: check_collectors names it
    switched = (ThroughputCollector, MemoryCollector, EnergyCollector, TelemetryCollector, TensorInspector)
    return [kind for kind in switched
            if kind not in planned and not any(isinstance(collector, kind) for collector in given)]
