"""W&B sink: one run, created on the writer rank only; ``wandb_mode: offline`` needs no network."""

from __future__ import annotations

from typing import Any, Optional

from . import numeric_items, per_rank_summary
from ..reduce import PerRank

__all__ = ["WandbSink"]


class WandbSink:
    name = "wandb"
    fix = "pip install distmetrics[wandb], check the network or set wandb_mode: offline"

    def __init__(self, project: str, name: Optional[str], entity: Optional[str], save_dir: str,
                 mode: str, config: dict, include_timers: bool = True) -> None:
        import wandb  # optional dependency, imported only when W&B is asked for

        self._wandb = wandb
        self.include_timers = include_timers
        self.run = wandb.init(project=project, name=name, entity=entity, dir=save_dir, mode=mode,
                              config=config, reinit="create_new")

    def log(self, metrics: dict[str, Any], step: int, kind: str) -> None:
        if kind not in ("train", "eval", "tensor_stats"):
            return
        row: dict[str, Any] = {}
        for name, value in numeric_items(metrics):
            if not self.include_timers and name.startswith("timers/"):
                continue
            if isinstance(value, PerRank):
                for stat, v in per_rank_summary(value).items():
                    row[f"{name}/{stat}"] = v
                if value.present():
                    row[name] = self._wandb.Histogram(value.present())
            else:
                row[name] = value
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()
