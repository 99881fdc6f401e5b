"""Every rank's value of an ``all`` metric. A plain list type of its own, without torch, so that
the sinks and the command line that read records need not import torch."""

from __future__ import annotations

__all__ = ["PerRank", "some_ranks"]


class PerRank(list):
    """Every rank's value of an ``all`` metric, indexed by rank; ``None`` where a rank had none."""

    def present(self) -> list[float]:
        """The values of the ranks that sent one."""
        return [v for v in self if v is not None]


def some_ranks(ranks: list[int], shown: int = 4) -> str:
    """``rank 3``, ``ranks 0, 1, 2, 4 and 1020 more``: ranks named in a message."""
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:shown]))}{more}"
