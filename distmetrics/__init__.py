"""distmetrics: correct, cheap training metrics for distributed PyTorch.

Each rank measures; at a log step values are reduced across ranks in at most one collective
per reduce kind; one rank (first or last) writes JSONL, console, TensorBoard, W&B and a
Megatron-style ``progress.txt``.
"""

import sys as _sys

from . import tensor_stats
from .collectors.base import Alert, Collector, LogContext
from .config import ConfigError, MetricsConfig, TensorInspectConfig
from .grad_norm import clip_grad_norm_
from .guard import HangError
from .monitor import Monitor
from .reduce import PerRank, Reduced, Reducer, Sample
from .sinks.jsonl import read_jsonl

# The earlier name of the tensor statistics module: ``dm.inspect.initialize(config)`` keeps working.
inspect = tensor_stats
_sys.modules[__name__ + ".inspect"] = tensor_stats

__version__ = "0.1.0"

__all__ = ["Monitor", "MetricsConfig", "TensorInspectConfig", "ConfigError", "Sample", "Reducer",
           "Reduced", "PerRank", "Collector", "LogContext", "Alert", "read_jsonl", "tensor_stats", "clip_grad_norm_",
           "HangError", "__version__"]
