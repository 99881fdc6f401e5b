"""TensorBoard sink through ``torch.utils.tensorboard.SummaryWriter``. Tags equal JSONL keys;
an ``all`` metric becomes ``<name>/max``, ``/min``, ``/mean`` and one histogram, so 4,096 ranks
do not become 4,096 tags."""

from __future__ import annotations

from . import ScalarView

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Scalars and per-rank histograms of train, eval and tensor_stats records."""

    name = "tensorboard"
    fix = 'pip install "torch-distmetrics[tensorboard]" (or tensorboard), or set tensorboard: false'

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def purge_from(self, step: int) -> None:
        """Drop the folder's events at steps >= ``step`` (an earlier job's, when a job resumes
        from an earlier checkpoint): a new event file whose first event is TensorBoard's purge."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step)

    def log_view(self, view: ScalarView, step: int) -> None:
        """Write one record's scalars and histograms."""
        for name, value in view.scalars.items():
            self.writer.add_scalar(name, value, step)
        if view.histograms:
            import numpy as np

            for name, values in view.histograms.items():
                self.writer.add_histogram(name, np.asarray(values, dtype=np.float64), step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
