"""Tensor inspection set-up: ``distmetrics.inspect.initialize(config)``.

The :class:`~distmetrics.Monitor` does all of this when ``tensor_inspect.enabled`` is true. Call
it yourself only when TransformerEngine layers must see nvdlfw-inspect initialised *before*
they are built (TE decides at construction whether a layer is debuggable)::

    import distmetrics as dm
    config = dm.MetricsConfig.from_yaml("configs/metrics.yaml")
    dm.inspect.initialize(config)          # 1. before the model
    model = build_model_with_te_layers()   # 2. the model
    monitor = dm.Monitor(config, model=model)   # 3. names layers, hooks, step(), end_debug()
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Optional, Union

from .config import ConfigError, MetricsConfig, TensorInspectConfig

__all__ = ["initialize", "current", "feature_dirs_for", "start_for_monitor", "shutdown"]

_CURRENT = None


def current():
    """The inspector initialised by :func:`initialize` and not yet closed, or None."""
    return _CURRENT


def initialize(config: Union[MetricsConfig, TensorInspectConfig], model: Any = None, layout: Any = None,
               output_dir: Optional[str] = None):
    """Check the features file and start nvdlfw-inspect (every rank). With ``model``, the layers
    are named and hooked at once, which costs one small all-reduce (see ``attach``)."""
    global _CURRENT
    from .collectors.tensor_inspect import TensorInspector, load_features
    from .parallel import detect_layout

    if isinstance(config, MetricsConfig):
        output_dir = output_dir or config.output_dir
        config = config.tensor_inspect
    if not config.enabled:
        raise ConfigError("tensor_inspect.enabled is false: nothing to initialise")
    # Feature folders of the user's own may register the transformer_engine namespace (an
    # emulation, a fork); they stand in for TE's, and nvdlfw-inspect checks them at start.
    _check_custom_dirs(config)
    spec = load_features(config.features, te_available=True if config.feature_dirs else None)
    dirs = feature_dirs_for(config, spec)
    log_dir = config.log_dir or str(Path(output_dir or ".") / "tensor_inspect")
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = TensorInspector(spec, model, layout or detect_layout(), log_dir, config.init_training_step, dirs)
    return _CURRENT


def feature_dirs_for(config: TensorInspectConfig, spec: dict) -> list:
    """Our feature namespace, TransformerEngine's when the YAML uses it, and custom folders
    only when ``allow_custom_feature_dirs`` is true (they run code)."""
    from .collectors.tensor_inspect import FEATURES_DIR

    dirs = [FEATURES_DIR]
    te = importlib.util.find_spec("transformer_engine")
    if te is not None and any("transformer_engine" in body for body in spec.values() if isinstance(body, dict)):
        dirs.append(os.path.join(list(te.submodule_search_locations)[0], "debug", "features"))
    if config.feature_dirs:
        _check_custom_dirs(config)
        dirs += list(config.feature_dirs)
    return dirs


def _check_custom_dirs(config: TensorInspectConfig) -> None:
    if not config.feature_dirs:
        return
    if not config.allow_custom_feature_dirs:
        raise ConfigError(f"tensor_inspect.feature_dirs={config.feature_dirs!r}: custom feature folders run "
                          "code; set tensor_inspect.allow_custom_feature_dirs: true to allow them")
    for folder in config.feature_dirs:
        if not os.path.isdir(folder):
            raise ConfigError(f"tensor_inspect.feature_dirs: {folder!r} is not a folder")


def start_for_monitor(config: MetricsConfig, model: Any, layout: Any):
    """The Monitor's entry: attach to an inspector the user started early, or start one."""
    inspector = current()
    if inspector is None:
        return initialize(config, model=model, layout=layout)
    inspector.set_layout(layout)
    if model is not None:
        try:
            inspector.attach(model)
        except Exception:
            shutdown(inspector)
            raise
    return inspector


def shutdown(inspector) -> None:
    """``end_debug()`` and handler clean-up; the next initialize starts fresh."""
    global _CURRENT
    inspector.close()
    if _CURRENT is inspector:
        _CURRENT = None
