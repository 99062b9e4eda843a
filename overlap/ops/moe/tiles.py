"""Tile tables of the fused grouped GEMMs (`overlap.kernels.dispatch_grouped_matmul`,
`overlap.kernels.grouped_matmul_combine`): which tiles a kernel runs, over the MoE slot layout of
`overlap.ops.moe.layout` (regions per source, flags per expert group)."""

from __future__ import annotations

import torch

from .layout import MoELayout, expert_groups, flags_per_peer, group_of


def dispatch_tile_table(h: MoELayout, rank: int, block_m: int, device: torch.device) -> torch.Tensor:
    """The tiles of rank `rank`'s dispatch-direction kernel
    (`overlap.kernels.dispatch_grouped_matmul.launch_grouped_matmul_wait`).

    One entry per `block_m` rows of each (source, local expert) block, sources from this rank down (``r``,
    ``r - 1``, ...: our own rows first, then in the order the senders write us): ``(source, expert, first row
    in the source's region, first row in the output (expert order), rows, flag index)``, the flag being
    ``r * F + 1 + group of the expert`` in the source's pad. Needs ``h.recv_counts``.

    Returns:
        int32 ``[tiles, 6]`` on `device` (``[0, 6]`` where this rank receives no rows).
    """
    W, L = len(h.recv_counts), h.num_local_experts
    F, G = flags_per_peer(W), expert_groups(L, W)
    tiles = []
    for i in range(W):
        s = (rank - i) % W
        for e in range(L):
            c = h.recv_counts[s][e]
            lo, at = h.within_source(s, e), h.expert_offsets[e][s]
            for t in range(0, c, block_m):
                tiles.append((s, e, lo + t, at + t, min(block_m, c - t), rank * F + 1 + group_of(e, L, G)))
    return torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 6)


def combine_tile_table(h: MoELayout, rank: int, block_m: int, tiles_n: int, device: torch.device) -> torch.Tensor:
    """The tiles of rank `rank`'s combine-direction kernel
    (`overlap.kernels.grouped_matmul_combine.launch_grouped_matmul_scatter`).

    One entry per `block_m` rows of each (source, local expert) block, sources from ``r + 1`` (peers first,
    our own rows last): ``(source, expert, first row of y (expert order), first row in the source's region
    (its send order), rows, flag index, tiles of the flag)``: the flag is ``s * F + 1 + group of the expert``
    in this rank's pad, and its tiles are its entries times `tiles_n` (the column tiles); the last one releases it.

    Returns:
        int32 ``[tiles, 7]`` on `device` (``[0, 7]`` where this rank holds no rows).
    """
    W, L = len(h.recv_counts), h.num_local_experts
    F, G = flags_per_peer(W), expert_groups(L, W)
    tiles, per_flag = [], {}
    for i in range(1, W + 1):
        s = (rank + i) % W
        for e in range(L):
            c = h.recv_counts[s][e]
            lo, at = h.within_source(s, e), h.expert_offsets[e][s]
            flag = s * F + 1 + group_of(e, L, G)
            for t in range(0, c, block_m):
                tiles.append([s, e, at + t, lo + t, min(block_m, c - t), flag, 0])
                per_flag[flag] = per_flag.get(flag, 0) + tiles_n
    for tile in tiles:
        tile[6] = per_flag[tile[5]]
    return torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 7)
