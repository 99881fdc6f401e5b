"""TensorBoard sink through ``torch.utils.tensorboard.SummaryWriter``. Tags equal JSONL keys;
an ``all`` metric becomes ``<name>/max``, ``/min``, ``/mean`` and one histogram, so 4,096 ranks
do not become 4,096 tags."""

from __future__ import annotations

from typing import Any

from . import numeric_items, per_rank_summary
from ..reduce import PerRank

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    name = "tensorboard"
    fix = "pip install distmetrics[tensorboard] (or set tensorboard: false)"

    def __init__(self, log_dir: str, include_timers: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=log_dir)
        self.include_timers = include_timers

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        if kind not in ("train", "eval", "tensor_stats"):
            return
        for name, value in numeric_items(metrics):
            if not self.include_timers and name.startswith("timers/"):
                continue
            if isinstance(value, PerRank):
                for stat, v in per_rank_summary(value).items():
                    self.writer.add_scalar(f"{name}/{stat}", v, step)
                present = value.present()
                if present:
                    import numpy as np

                    self.writer.add_histogram(name, np.asarray(present, dtype=np.float64), step)
            else:
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
