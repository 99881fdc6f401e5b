"""Every rank's gathered tensor statistics → the values written: partials merged over the ranks
in one vectorised pass (a tensor- or context-parallel peer's copy of its group's first rank's
tensor left out), values TE and nvdlfw-inspect logged themselves taken from the lowest rank."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..reduce import PerRank
from .statistics import PARTS, merge_ranks, stat_value

__all__ = ["FORWARDED", "PEERS", "REPLICA", "OWED", "combine"]

FORWARDED = "fwd|"  # reducer names of values logged through nvdlfw-inspect's MetricLogger
PEERS = "tp_cp_peers"  # reducer name of the rank's TP x CP group (the same number on its peers)
OWED = "owed|"
"""Opens the reducer name of a layer whose weight shard this rank holds, due at the step, but did not
measure: it did not run the layer (layer drop). The weight's statistics would be the other shards'."""
REPLICA = "="
"""Opens the tensor name of a plain tensor every rank holds a copy of (a DDP model's weight): every
rank that ran the layer in the step sends its copy, and the lowest of them is written, not their
merge (which would count it once per rank). Rank 0 alone sending lost the weight of a layer it
skipped (layer drop, an expert no token reached), and a Monitor on a group without global rank 0 never
wrote one."""


def combine(per_rank: dict[str, PerRank], empty: Optional[set] = None, clashes: Optional[set] = None,
            owed: Optional[dict] = None) -> dict:
    """Every rank's partials → merged statistics (a TP/CP peer's copy of its group's first
    rank's tensor left out); forwarded values → the lowest rank's. ``empty`` gets the
    ``(layer, tensor)`` that ran but held no element on any rank: no statistic is written for them.
    ``clashes`` gets the names both measured by the hooks and forwarded (a user's own
    ``log_tensor_stats`` of a hooked layer's tensor): the hooks' value is written. ``owed`` gets each
    layer a rank owed its weight shard (:data:`OWED`) → those global ranks: its weight is not written."""
    groups: dict[tuple, dict[str, list]] = {}
    replicas: set = set()
    out = {}
    peers = per_rank.pop(PEERS, None)
    missing: dict = {}
    for name, values in per_rank.items():
        if name.startswith(OWED):
            missing[name[len(OWED):]] = [r for r, v in zip(values.rank_ids(), values) if v is not None]
            continue
        if name.startswith(FORWARDED):
            # Reduced by TE over its group already; where ranks still differ (weights, which
            # TE reports per rank; tensor-parallel shards) the lowest rank's value is written.
            out[name[len(FORWARDED):]] = values.present()[0]
            continue
        tensor_name, stats, part, layer = name.split("|", 3)  # the layer (ours already) last, "|" and all
        if tensor_name.startswith(REPLICA):
            tensor_name = tensor_name[len(REPLICA):]
            replicas.add((layer, tensor_name, stats))
        groups.setdefault((layer, tensor_name, stats), {})[part] = values
    for key in replicas:  # the lowest rank that sent the copy: its place in every part (a count is never NaN)
        parts = groups[key]
        first = next(i for i, v in enumerate(parts["n"]) if v is not None)
        for part, values in parts.items():
            parts[part] = [v if i == first else None for i, v in enumerate(values)]
    keys = sorted(groups)
    if not keys:
        return out
    # One table [key, part, rank] (NaN where a rank sent nothing) merged in one pass over the
    # ranks: at thousands of ranks a merge per rank and key would take seconds.
    rows = [[math.nan if v is None else v for v in groups[key][part]] for key in keys for part in PARTS]
    table = torch.tensor(rows, dtype=torch.float64).view(len(keys), len(PARTS), -1)
    merged = merge_ranks(_without_copies(table, peers))
    columns = {part: merged[part].tolist() for part in PARTS}
    for i, (layer, tensor_name, stats) in enumerate(keys):
        if columns["n"][i] == 0:  # the ranks that sent this key measured empty tensors
            if empty is not None:
                empty.add((layer, tensor_name))
            continue
        if tensor_name == "weight" and layer in missing:  # some shard unmeasured: not the whole weight's
            if owed is not None:
                owed[layer] = missing[layer]
            continue
        values = {part: columns[part][i] for part in PARTS}
        prefix = f"tensor_stats/{layer}/{tensor_name}"
        for stat in stats.split(","):
            if clashes is not None and f"{prefix}/{stat}" in out:
                clashes.add(f"{prefix}/{stat}")
            out[f"{prefix}/{stat}"] = stat_value(stat, values)
    return out


def _without_copies(table: torch.Tensor, peers: Optional[PerRank]) -> torch.Tensor:
    """``table[key, part, rank]`` with the ranks that hold a copy of their TP/CP group's first
    rank's tensor marked as sending nothing (NaN): every part equal to that rank's, bit for bit
    (NaN to NaN). A rank whose piece differs (a shard, a sequence chunk) stays."""
    if peers is None or len(set(peers)) == len(peers):
        return table
    first: dict = {}
    leaders = torch.tensor([first.setdefault(group, rank) for rank, group in enumerate(peers)])
    lead = table[:, :, leaders]
    same = ((table == lead) | (torch.isnan(table) & torch.isnan(lead))).all(dim=1)
    copies = same & (leaders != torch.arange(len(peers)))
    return torch.where(copies.unsqueeze(1), math.nan, table)
