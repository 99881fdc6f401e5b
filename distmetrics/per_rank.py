"""Every rank's value of an ``all`` metric. A plain list type of its own, without torch, so that
the sinks and the command line that read records need not import torch."""

from __future__ import annotations

__all__ = ["PerRank"]


class PerRank(list):
    """Every rank's value of an ``all`` metric, indexed by rank; ``None`` where a rank had none."""

    def present(self) -> list[float]:
        """The values of the ranks that sent one."""
        return [v for v in self if v is not None]
