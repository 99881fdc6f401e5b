"""Every rank's value of an ``all`` metric. A plain list type of its own, without torch, so that
the sinks and the command line that read records need not import torch."""

from __future__ import annotations

__all__ = ["PerRank", "some_ranks"]


class PerRank(list):
    """Every rank's value of an ``all`` metric, in the order of the Monitor's ranks (its process
    group's: by rank in the world's); ``None`` where a rank had none. ``ranks``: the global rank
    of each place, where they are not 0, 1, 2, ... (a Monitor on a group other than the world)."""

    def __init__(self, values=(), ranks=None) -> None:
        super().__init__(values)
        self.ranks = None if ranks is None else tuple(ranks)

    def rank_ids(self):
        """The global rank of each value (what ``<name>/rank<r>`` names in metrics.jsonl)."""
        return range(len(self)) if self.ranks is None else self.ranks

    def present(self) -> list[float]:
        """The values of the ranks that sent one."""
        return [v for v in self if v is not None]


def some_ranks(ranks: list[int], shown: int = 4) -> str:
    """``rank 3``, ``ranks 0, 1, 2, 4 and 1020 more``: ranks named in a message."""
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:shown]))}{more}"
