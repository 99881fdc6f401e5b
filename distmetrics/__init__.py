"""distmetrics: correct, cheap training metrics for distributed PyTorch.

Each rank measures; at a log step values are reduced across ranks in at most one collective
per reduce kind; one rank (first or last) writes JSONL, console, TensorBoard, W&B and a
Megatron-style ``progress.txt``.

``import distmetrics as dm`` gives every public name below. The names that need torch
(``dm.Monitor``, ``dm.Sample``, ...) import it when first used, so the ``distmetrics`` command
line, which only reads files, starts without torch.
"""

from __future__ import annotations

import importlib

from .config import ConfigError, MetricsConfig, TensorInspectConfig
from .per_rank import PerRank
from .sinks.jsonl import read_jsonl

__version__ = "0.1.0"

__all__ = ["Monitor", "MetricsConfig", "TensorInspectConfig", "ConfigError", "Sample", "Reducer",
           "Reduced", "PerRank", "Collector", "LogContext", "Alert", "read_jsonl", "tensor_stats", "clip_grad_norm_",
           "HangError", "PeerLostError", "CollectorFailed", "__version__"]

_USES_TORCH = {"Monitor": ".monitor", "Sample": ".reduce", "Reducer": ".reduce", "Reduced": ".reduce",
               "Collector": ".collectors.base", "LogContext": ".collectors.base", "Alert": ".collectors.base",
               "tensor_stats": ".tensor_stats", "inspect": ".inspect",
               "clip_grad_norm_": ".grad_norm", "HangError": ".guard", "PeerLostError": ".peers",
               "CollectorFailed": ".collectors.base"}
"""Public names imported on first use: name → the module that defines it."""


def __getattr__(name: str):
    """Import a torch-using public name on first use (PEP 562)."""
    module_name = _USES_TORCH.get(name)
    if module_name is None:
        raise AttributeError(f"module 'distmetrics' has no attribute {name!r}")
    module = importlib.import_module(module_name, __name__)
    value = module if module_name == "." + name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list:
    """Every public name, imported or not yet."""
    return sorted(set(globals()) | set(__all__))
