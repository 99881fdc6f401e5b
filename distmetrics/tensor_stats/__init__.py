"""Tensor statistics selected by an nvdlfw-inspect features YAML, into every sink.

The :class:`~distmetrics.Monitor` does everything when ``tensor_inspect.enabled`` is true. Call
:func:`initialize` yourself only when TransformerEngine layers must see nvdlfw-inspect
initialised *before* they are built (TE decides at construction whether a layer is
inspected)::

    import distmetrics as dm
    config = dm.MetricsConfig.from_yaml("configs/metrics.yaml")
    dm.tensor_stats.initialize(config)           # 1. before the model
    model = build_model_with_te_layers()         # 2. the model
    monitor = dm.Monitor(config, model=model)    # 3. names layers, hooks, step(), end_debug()

Parts: :mod:`.features` (reading and checking a features file), :mod:`.lifecycle`
(nvdlfw-inspect's start, the running inspector, the reset), :mod:`.inspector` (hooks, per-step
reduction, forwarding), :mod:`.layer_tensors` (what a hooked layer's tensors are),
:mod:`.statistics` (mergeable partials), :mod:`.rank_merge` (every rank's partials merged),
:mod:`.te_names` (TE's names), :mod:`.compiled` (the hooks under ``torch.compile``).
``distmetrics.inspect`` is the same module under its earlier name.
"""

from .features import feature_dirs_for, load_features
from .lifecycle import current, initialize, reset_nvdlfw, shutdown, start_for_monitor

__all__ = ["initialize", "current", "shutdown", "start_for_monitor", "reset_nvdlfw", "load_features",
           "feature_dirs_for"]
