"""``all_gather_weight_matmul``'s ``hierarchical`` strategy: the weight's shards (rows of ``w``, ``[n, k]`` per
rank) gathered across nodes as `overlap.ops.tp.hierarchical_gather.HierGather` gathers rows: each shard over the network
once per node, to the owner's counterparts, forwarded within each node through its symmetric heap. On a group
of one node the plan is the op's ``symm`` (`overlap.plans.auto.fit_plan`).

Across nodes the whole weight is gathered into a local buffer (as ``reference`` and ``pipelined`` do), and the
op's backward re-gathers it the same way while ``grad_b``'s reduce-scatter (`matmul_reduce_scatter`'s
``hierarchical``) runs: the node's slot is sized for both (`start`'s `need`). With the fp8 recipe the forward's rows
are the shard's packed fp8 rows (uint8, `overlap.ops.fp8_rows.Packed`: a row's scales travel with it); the
backward re-gathers the leaves.
"""

from __future__ import annotations

import torch

from ..context import CallContext
from .hierarchical_gather import HierGather


def start(shard_NK: torch.Tensor, cc: CallContext, xcall, need: int = 0):
    """Post the gather of this rank's shard ``[n, k]`` (`xcall`: the group's call, which the gather's close ends);
    chunks arrive as ``(row_lo, row_hi, rows)`` of ``w``."""
    n = shard_NK.shape[0]
    return HierGather(cc, xcall, shard_NK, [(p * n, (p + 1) * n) for p in range(cc.world_size)], need=need,
                      ends_call=True)
