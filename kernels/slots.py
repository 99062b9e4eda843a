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

**Sequence parallel** (`matmul_all_to_all`, `all_to_all_matmul`; ``W`` ranks, ``m`` rows on every rank, ``C`` columns
of a block: the heads one rank sends another): a slot holds ``W`` regions of ``[m, C]`` row-major, each
`region_bytes` long (16-byte aligned; `sp_slot_bytes` in all), region ``s`` holding what source ``s`` sent this rank.
Producer ``s``'s flags in its pad: ``d * F + c`` "rows of chunk ``c`` of my block for ``d`` are in ``d``'s region
``s``" (``F`` = `flags_per_peer`), ``NCH`` chunks (`overlap.kernels.matmul_reduce_scatter.chunk_count` with ``m``
rows as the block), chunk ``c`` the rows `sp_chunk_rows` gives (whole row tiles of ``BLOCK_M``, the fused kernels'
map; a ``symm`` path with no kernel may use any ``BLOCK_M``, the same on every rank).
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


def sp_slot_bytes(m: int, c: int, dtype: torch.dtype, world_size: int) -> int:
    """A sequence-parallel slot: ``W`` regions of ``[m, c]``, each `region_bytes` long."""
    return world_size * region_bytes(m, c, dtype)


def sp_chunk_rows(m: int, block_m: int, num_chunks: int, chunk: int) -> range:
    """The rows of a sequence-parallel block (``m`` rows) that chunk `chunk` of `num_chunks` covers: row tile ``t``
    (of `block_m` rows) is in chunk ``t * num_chunks // tiles_m``, ``tiles_m = cdiv(max(m, 1), block_m)``, so chunk
    ``c`` is the row tiles ``cdiv(c * tiles_m, num_chunks) .. cdiv((c + 1) * tiles_m, num_chunks)`` (clipped to
    ``m``; empty where a chunk has no row)."""
    tiles_m = -(-max(m, 1) // block_m)
    first, last = -(-chunk * tiles_m // num_chunks), -(-(chunk + 1) * tiles_m // num_chunks)
    return range(min(first * block_m, m), min(last * block_m, m))


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
