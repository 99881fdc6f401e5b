"""distmetrics: correct, cheap training metrics for distributed PyTorch.

Each rank measures; at a log step values are reduced across ranks in at most one collective
per reduce kind; one rank (first or last) writes JSONL, console, TensorBoard, W&B and a
Megatron-style ``progress.txt``.
"""

from . import inspect
from .config import ConfigError, MetricsConfig, TensorInspectConfig
from .monitor import Monitor
from .reduce import PerRank, Reduced, Reducer, Sample
from .sinks.jsonl import read_jsonl

__version__ = "0.1.0"

__all__ = ["Monitor", "MetricsConfig", "TensorInspectConfig", "ConfigError", "Sample", "Reducer",
           "Reduced", "PerRank", "read_jsonl", "__version__"]
