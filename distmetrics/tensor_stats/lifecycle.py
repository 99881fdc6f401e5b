"""nvdlfw-inspect's life in this process: one running inspector at a time, started from a clean
slate, ended with ``end_debug()`` and its registries and log handlers cleared.

nvdlfw-inspect keeps its state in module and class attributes, so there is one state here too:
the inspector that is running, which our feature reports to (:func:`accumulate`), which
:func:`current` returns and which the Monitor attaches to.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

from ..config import ConfigError, MetricsConfig, TensorInspectConfig
from ..output_claim import unmakeable
from ..packing import digest
from ..runinfo import NOT_READ, left_at_start, said_on_every_rank
from .features import check_inspect_config, require_nvdlfw

__all__ = ["initialize", "current", "shutdown", "start_for_monitor", "collectors_for", "build_model", "start_nvdlfw", "reset_nvdlfw",
           "accumulate", "check_log_dir"]


class _State:
    inspector: Any = None
    """The running :class:`~distmetrics.tensor_stats.inspector.TensorInspector`, or None."""


_STATE = _State()


def current():
    """The running inspector (started by :func:`initialize` or a Monitor and not yet closed), or None."""
    return _STATE.inspector


def accumulate(layer: str, tensor_name: str, tensor: Any, stats: list) -> None:
    """Called by our nvdlfw-inspect feature: merge a tensor's statistics into the running
    inspector's partials for this step."""
    if _STATE.inspector is not None:
        _STATE.inspector.add(layer, tensor_name, tensor, stats)


def initialize(config: Union[MetricsConfig, TensorInspectConfig], model: Any = None, layout: Any = None,
               output_dir: Optional[str] = None):
    """Check the features file and start nvdlfw-inspect; call it on every rank. With ``model``, the
    layers are named and hooked at once, which costs one small all-reduce (see ``attach``). Call it
    before building TransformerEngine layers: TE decides at construction whether a layer is
    inspected. A running inspector is closed first.

    With torch.distributed initialised, what one rank finds wrong (a features file it cannot read,
    a log folder it cannot make) is not left to that rank alone, where the others went on into the
    Monitor's first collective and waited there: given ``model`` (whose hooking is a collective over
    ``layout``'s group, the world by default, already), it is raised on every rank of that group
    after one gather, bounded by ``hang_timeout_s`` (the config's, or its default); without, the rank
    raises it and marks itself left at the arrival check of the next ``Monitor()`` of the world, so
    the others raise there at once, naming it and the error (no collective here: ranks of jobs that
    share a world through ``Monitor(group=...)`` need not all call it)."""
    from ..parallel import detect_layout

    layout = layout or detect_layout()
    hang_timeout_s = config.hang_timeout_s if isinstance(config, MetricsConfig) else MetricsConfig().hang_timeout_s
    checked, error = None, None
    try:
        checked = _checked(config, output_dir)
    except ConfigError as err:
        error = err
    if model is not None:
        said_on_every_rank(error, layout, hang_timeout_s, "tensor_stats.initialize")
    elif error is not None:
        left_at_start(f"raised {type(error).__name__} in tensor_stats.initialize: {error}", hang_timeout_s)
        raise error
    return _start(config, model, layout, output_dir, checked)


def _checked(config: Union[MetricsConfig, TensorInspectConfig], output_dir: Optional[str]) -> tuple:
    """What :func:`initialize` checks before nvdlfw-inspect starts: the features mapping, the feature
    folders and nvdlfw-inspect's log folder (a ConfigError where something is wrong)."""
    inspect, output_dir = _parts(config, output_dir)
    if not inspect.enabled:
        raise ConfigError("tensor_inspect.enabled is false: nothing to initialise")
    spec, dirs = check_inspect_config(inspect)
    require_nvdlfw()
    return spec, dirs, _checked_log_dir(inspect, output_dir)


def _parts(config: Union[MetricsConfig, TensorInspectConfig], output_dir: Optional[str]) -> tuple:
    """The ``tensor_inspect`` section and the output folder nvdlfw-inspect's log folder defaults under."""
    if isinstance(config, MetricsConfig):
        return config.tensor_inspect, output_dir or config.output_dir
    return config, output_dir


def _start(config: Union[MetricsConfig, TensorInspectConfig], model: Any, layout: Any, output_dir: Optional[str],
           checked: Optional[tuple] = None):
    """Start nvdlfw-inspect and its inspector on this rank (``checked``: what :func:`_checked` gave, or
    checked here: the Monitor's ranks were told by its start-up gather already)."""
    from ..parallel import detect_layout
    from .inspector import ForwardingLogger, TensorInspector

    spec, dirs, log_dir = checked or _checked(config, output_dir)
    inspect = _parts(config, output_dir)[0]
    if _STATE.inspector is not None:
        shutdown(_STATE.inspector)
    inspector = TensorInspector(spec, inspect.init_training_step)
    inspector.on_close = lambda: _release(inspector)
    os.makedirs(log_dir, exist_ok=True)
    start_nvdlfw(spec, dirs, log_dir, ForwardingLogger(inspector), inspect.init_training_step)
    _STATE.inspector = inspector
    try:
        inspector.set_layout(layout or detect_layout())
        if model is not None:
            inspector.attach(model)
    except Exception:
        shutdown(inspector)  # end_debug and handlers: the next initialize starts clean
        raise
    return inspector


def check_inspection(config: MetricsConfig, world_size: int) -> tuple[Optional[str], Optional[str]]:
    """What is wrong with ``tensor_inspect`` on this rank (a features file it cannot read, bad
    YAML), checked before the Monitor's first collective so that every rank raises it (a rank
    raising alone left the others waiting in the next collective): the message, or None. In a
    job of one rank the ConfigError itself is raised. Second, a digest of the features this rank
    runs, which the start-up gather compares: ranks given different files (statistics listed in
    another order, another layer, another ``freq``) merged each statistic over the ranks that
    asked for it alike, and wrote one group's value over another's."""
    if not config.tensor_inspect.enabled:
        return None, None
    if current() is not None:  # started early: checked then
        return None, _digest(current().spec)
    try:
        spec, _ = check_inspect_config(config.tensor_inspect)
        require_nvdlfw()
        check_log_dir(config)
    except Exception as err:  # noqa: BLE001 - any error on one rank is every rank's, before the first collective
        if world_size == 1:
            raise
        return str(err) if isinstance(err, ConfigError) else f"tensor_inspect: {type(err).__name__}: {err}", NOT_READ
    return None, _digest(spec)


def check_log_dir(config: MetricsConfig) -> None:
    """nvdlfw-inspect's log folder, checked before it is made (nothing is left here): every rank
    writes its own, and one that could not be made failed on that rank alone, after the start-up
    check, while the others waited in the statistics' first collective. ``check-config`` runs it too."""
    _checked_log_dir(config.tensor_inspect, config.output_dir)


def _checked_log_dir(config: TensorInspectConfig, output_dir: Optional[str]) -> str:
    """nvdlfw-inspect's log folder (``log_dir``, or ``tensor_inspect`` under the output folder, the
    working directory where there is none), once it is known that it can be made."""
    key, log_dir = ("tensor_inspect.log_dir", config.log_dir) if config.log_dir \
        else ("output_dir", str(Path(output_dir or ".") / "tensor_inspect"))
    problem = unmakeable(Path(log_dir))
    if problem:
        raise ConfigError(f"{key}: nvdlfw-inspect's log folder {log_dir!r} cannot be made on this rank (with tensor "
                          f"statistics on, every rank writes one): {problem}")
    return log_dir


def _digest(spec: dict) -> str:
    """A short digest of a features mapping, the same for the same content however written."""
    return f"content {digest(repr(_canonical(spec)).encode('utf-8')):014x}"


def _canonical(value: Any) -> Any:
    """Mappings as sorted (key, value) pairs, whatever the keys' types (YAML's ``1:`` beside text:
    sorting them as they are raised TypeError, on this rank alone where the files differ)."""
    if isinstance(value, dict):
        return sorted(((repr(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def collectors_for(config: MetricsConfig, model: Any, layout: Any) -> list:
    """The Monitor's tensor statistics collector (the running inspector, attached to ``model``),
    or none when ``tensor_inspect.enabled`` is false."""
    return [start_for_monitor(config, model, layout)] if config.tensor_inspect.enabled else []


def planned_for(config: MetricsConfig) -> list:
    """The class of what :func:`collectors_for` makes (its ``name``, ``after`` and ``writes``), made
    or not, for the Monitor's check of its collectors' names before any collective."""
    from .inspector import TensorInspector

    return [TensorInspector] if config.tensor_inspect.enabled else []


def start_for_monitor(config: MetricsConfig, model: Any, layout: Any):
    """The Monitor's entry: attach to an inspector the user started early, or start one."""
    inspector = current()
    if inspector is None:
        inspector = _start(config, model, layout, None)  # checked on every rank by the Monitor's start-up
        inspector.claimed = True
        return inspector
    if inspector.claimed:
        raise ConfigError("tensor_inspect.enabled: another Monitor in this process runs tensor inspection already "
                          "(nvdlfw-inspect keeps one state per process, so a second one would share its schedule and "
                          "get nothing); close that Monitor first")
    inspector.claimed = True
    try:
        inspector.set_layout(layout)
        if model is not None:
            inspector.attach(model)
    except Exception:
        shutdown(inspector)
        raise
    return inspector


def build_model(config: MetricsConfig, layout: Any, factory: Any, optimizer: Any) -> tuple:
    """``Monitor(model=factory)``: start tensor inspection (if enabled and not running), then
    build the model with ``factory`` (which may return a ``(model, optimizer)`` pair); a failed
    build leaves nothing running."""
    import torch

    if isinstance(factory, (list, tuple)) and len(factory) == 1 and isinstance(factory[0], torch.nn.Module):
        raise TypeError(
            f"Monitor(model=...): a {type(factory).__name__} of one module (Megatron's get_model() returns the model "
            "in a list, one chunk without a virtual pipeline) is not taken: give the module, model[0]")
    if isinstance(factory, (list, tuple)) and factory and all(isinstance(m, torch.nn.Module) for m in factory):
        raise TypeError(
            f"Monitor(model=...): a {type(factory).__name__} of {len(factory)} modules (Megatron's model chunks, the "
            "virtual pipeline's stages) is not taken: one module per rank. torch.nn.ModuleList(chunks) gives exact "
            "totals, with module names that start with the chunk's index ('0.decoder.layers.0', '1.decoder...')")
    if not callable(factory):
        raise TypeError(f"model must be a torch.nn.Module or a callable that builds one, got {type(factory).__name__}")
    started = None
    if config.tensor_inspect.enabled and current() is None:
        started = _start(config, None, layout, None)  # checked on every rank by check_inspection
    try:
        built = factory()
        if isinstance(built, tuple) and len(built) == 2:
            built, optimizer = built
        if not isinstance(built, torch.nn.Module):
            raise TypeError(f"the model factory returned {type(built).__name__}; accepted: a torch.nn.Module "
                            "or a (module, optimizer) pair")
    except BaseException:
        if started is not None:
            shutdown(started)
        raise
    return built, optimizer


def shutdown(inspector: Any) -> None:
    """Remove the inspector's hooks; if it is the running one, ``end_debug()`` and clean up so
    the next :func:`initialize` starts fresh."""
    inspector.remove_hooks()
    _release(inspector)


def _release(inspector: Any) -> None:
    if _STATE.inspector is inspector:
        _STATE.inspector = None
        reset_nvdlfw()


def start_nvdlfw(spec: dict, feature_dirs: list, log_dir: str, statistics_logger: Any = None,
                 init_training_step: int = 0, source: str = "tensor_inspect.features") -> None:
    """``debug_api.initialize`` from a clean slate; its rejection of the features (an
    assertion, or ``SystemExit`` from a feature folder that fails to load) becomes a
    ``ConfigError`` naming ``source`` and the folders, with nothing left running."""
    import nvdlfw_inspect.api as debug_api

    reset_nvdlfw()
    try:
        debug_api.initialize(config_file=spec, feature_dirs=feature_dirs, statistics_logger=statistics_logger,
                             log_dir=log_dir, init_training_step=init_training_step)
    except (SystemExit, AssertionError, ValueError, TypeError) as err:
        reset_nvdlfw()
        raise ConfigError(f"{source}: nvdlfw-inspect rejected the features ({err}); feature folders searched: "
                          f"{feature_dirs}") from None


def reset_nvdlfw() -> None:
    """End nvdlfw-inspect if it runs and clear its registries and its file log handlers."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.config_manager import ConfigManager
    from nvdlfw_inspect.logging import MetricLogger
    from nvdlfw_inspect.registry import Registry

    if debug_api.DEBUG_MANAGER is not None:
        debug_api.end_debug()
    ConfigManager.reset()
    Registry.reset()
    MetricLogger.enabled_loggers.clear()
    for name in ("nvdlfw_inspect", "Default Statistics"):  # its file loggers add a handler per start
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            log.removeHandler(handler)
            handler.close()
