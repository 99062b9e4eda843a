"""Where the fused kernels find their data in a symmetric-heap slot: region sizes and strides, header bytes, flag
indices. Plain integers in, plain integers out, no Triton: the non-fused ``symm`` paths lay out their slots the
same way (the same bytes, so a fused and a non-fused rank agree on them), and the GPU check builds its slots
from these too, never from the ops' internals. Each kernel's tile table is beside its launcher.

**Tensor-parallel scatter** (`matmul_reduce_scatter`, two-shot and one-shot `matmul_all_reduce`): a slot holds
one ``[m, n]`` region per source, each `region_bytes` long.

**MoE** (`dispatch_grouped_matmul`, `grouped_matmul_combine`; ``W`` ranks, ``L`` local experts): a header of
``W x L`` int32 counts (`header_bytes`), then ``W`` regions of `region_stride` bytes, region ``s`` holding what
source ``s`` sends (or gets back). Producer ``s``'s flags in a peer's pad: ``d * F`` "counts for ``d`` written",
``d * F + 1 + g`` "rows of expert group ``g`` for ``d`` written", ``F`` = `flags_per_peer`; experts are bucketed
into ``G`` = `expert_groups` contiguous groups (one flag per expert where ``L < F``).
"""

from __future__ import annotations

import torch

from .. import symm

ALIGN = 16  # bytes: every region starts 16-byte aligned (the kernels' vector loads)


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def region_bytes(m: int, n: int, dtype: torch.dtype) -> int:
    """Bytes of one ``[m, n]`` region of a slot, padded so every region starts 16-byte aligned."""
    return aligned(m * n * torch.empty((), dtype=dtype).element_size())


def flags_per_peer(world_size: int) -> int:
    return symm.MAX_FLAGS // world_size


def expert_groups(num_local_experts: int, world_size: int) -> int:
    """How many flags (expert groups) a producer has per peer."""
    return max(1, min(num_local_experts, flags_per_peer(world_size) - 1))


def group_of(e: int, num_local_experts: int, num_groups: int) -> int:
    return e * num_groups // num_local_experts


def group_experts(g: int, num_local_experts: int, num_groups: int) -> range:
    """The local experts of expert group `g` (the inverse of `group_of`)."""
    return range(-(-g * num_local_experts // num_groups), -(-(g + 1) * num_local_experts // num_groups))


def header_bytes(world_size: int, num_local_experts: int) -> int:
    """The MoE slot's header: ``W x L`` int32 counts."""
    return aligned(world_size * num_local_experts * 4)


def moe_slot_bytes(rows: int, row_bytes: int, world_size: int, num_local_experts: int) -> int:
    """A MoE slot for at most `rows` rows of `row_bytes` from each source: the header and ``W`` regions."""
    return header_bytes(world_size, num_local_experts) + world_size * aligned(max(rows, 1) * row_bytes)


def region_stride(slot_bytes: int, world_size: int, num_local_experts: int) -> int:
    """Bytes between the regions of a MoE slot of `slot_bytes` (the largest need of any rank, the same on every
    rank)."""
    return (slot_bytes - header_bytes(world_size, num_local_experts)) // world_size // ALIGN * ALIGN


def source_offsets(recv_counts: list[list[int]]) -> list[list[int]]:
    """``[s][e]``: first row of local expert ``e``'s rows in source ``s``'s region (its send order: by expert)."""
    out = []
    for row in recv_counts:
        at, starts = 0, []
        for c in row:
            starts.append(at)
            at += c
        out.append(starts)
    return out


def expert_offsets(recv_counts: list[list[int]]) -> list[list[int]]:
    """``[e][s]``: first row of block ``(e, s)`` in expert order (by local expert, then source)."""
    offsets, at = [], 0
    for e in range(len(recv_counts[0]) if recv_counts else 0):
        row = []
        for counts in recv_counts:
            row.append(at)
            at += counts[e]
        offsets.append(row)
    return offsets
