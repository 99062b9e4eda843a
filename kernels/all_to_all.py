"""The launch data of ``overlap._C``'s MoE all-to-all kernels (``csrc/cuda/moe_a2a.cu``: ``moe_dispatch_rows``,
``moe_combine_rows``): the row dtypes' codes, the copy granularity, and the tables the dispatch kernel takes.

``h`` is a routing on this rank (the ops' `overlap.ops.moe.layout.MoELayout`, or the GPU tests' own): ``W``
destinations, ``send_counts[d][e]``, ``send_splits[d]``, ``send_offsets[d]`` (its first send position),
``within_dest(d, e)`` (expert ``e``'s first row among destination ``d``'s), ``num_local_experts`` ``L``. This rank's
send positions split into ``W*G`` contiguous **blocks**, block ``i = d*G + g`` holding the rows for destination
``d`` and its expert group ``g`` (`slots.expert_groups`), flagged with ready flag ``d*F + 1 + g``
(`slots.flags_per_peer`). Imports no Triton.
"""

from __future__ import annotations

import torch

from . import slots

#: Row dtypes of the combine kernel and their codes in ``csrc/include/overlap/moe_a2a.cuh``.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ROW_ALIGN = 16  # bytes of one vectorized copy: row sizes and addresses must be multiples of it
CHUNK_BYTES = 1 << 16  # bytes one CTA of the dispatch kernel copies, at most (at least one row)
MAX_TOP_K = 1024  # the combine kernel keeps K addresses and weights in shared memory


def dispatch_blocks(h) -> list[int]:
    """``[W*G + 1]`` first send position of each block, then ``P``. Block ``d*G + g`` holds the rows the
    CPU path writes with ``index_select`` for destination ``d`` and expert group ``g``; ``[d*G]`` is
    ``send_offsets[d]``."""
    W, L = len(h.send_counts), h.num_local_experts
    G = slots.expert_groups(L, W)
    offsets = [h.send_offsets[d] + h.within_dest(d, slots.group_experts(g, L, G).start)
               for d in range(W) for g in range(G)]
    return [*offsets, sum(h.send_splits)]


def rows_per_chunk(row_bytes: int) -> int:
    """Rows one CTA of the dispatch kernel copies: about `CHUNK_BYTES`, at least one row."""
    return max(1, CHUNK_BYTES // row_bytes)


def chunk_offsets(blocks: list[int], rows_per_chunk: int) -> list[int]:
    """``[W*G + 1]`` first chunk (CTA) of each block, then the number of chunks; empty blocks have none."""
    out, at = [], 0
    for lo, hi in zip(blocks[:-1], blocks[1:]):
        out.append(at)
        at += -(-(hi - lo) // rows_per_chunk)
    return [*out, at]


def block_flags(h) -> list[int]:
    """``[W*G]`` ready-flag index of each block: ``d*F + 1 + g`` (the slots' flag layout)."""
    W, L = len(h.send_counts), h.num_local_experts
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    return [d * F + 1 + g for d in range(W) for g in range(G)]
