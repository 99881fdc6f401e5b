"""W&B sink: one run, created on the writer rank only; ``wandb_mode: offline`` needs no network."""

from __future__ import annotations

from typing import Any, Optional

from . import ScalarView

__all__ = ["WandbSink"]


class WandbSink:
    """One W&B row per train, eval and tensor_stats record; ``all`` metrics as histograms."""

    name = "wandb"
    fix = 'pip install "torch-distmetrics[wandb]" (or wandb), check the network or set wandb_mode: offline'

    def __init__(self, project: str, name: Optional[str], entity: Optional[str], save_dir: str,
                 mode: str, config: dict) -> None:
        import sys

        import wandb  # optional dependency, imported only when W&B is asked for

        from ..redaction import redact_argv

        self._wandb = wandb
        # W&B copies the command line into the run's metadata: let it see the redacted one.
        argv, sys.argv = sys.argv, redact_argv(sys.argv)
        try:
            self.run = wandb.init(project=project, name=name, entity=entity, dir=save_dir, mode=mode,
                                  config=config, reinit="create_new")
        finally:
            sys.argv = argv

    def log_view(self, view: ScalarView, step: int) -> None:
        """Log one record's scalars and histograms as one row at ``step``."""
        row: dict[str, Any] = dict(view.scalars)
        for name, values in view.histograms.items():
            row[name] = self._wandb.Histogram(values)
        self.run.log(row, step=step)

    def close(self) -> None:
        """Finish the run."""
        self.run.finish()
