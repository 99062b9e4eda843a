"""Fused GEMM + reduce-scatter: tiles store their partials in the owning rank's buffer and signal
per chunk; a second kernel sums what arrived, in a fixed order.

Shapes (legend): ``W`` ranks; the local product ``a_[D*MB]K @ b_KN`` is cut into ``D`` destination
blocks of ``MB`` rows (the last ones may be shorter: ``M`` is the true row count); block ``d``
belongs to the rank that owns it. ``NCH`` chunks per block, each a run of whole row tiles:
row tile ``t`` of a block is in chunk ``t * NCH // tiles_m``. Both kernels use the same
``BLOCK_M``, so a reduction tile lies in exactly one chunk.

`matmul_scatter_kernel` (the producer). Program ids are laid out block-major, visiting
destinations from ``rank + 1`` (the peers' blocks first, this rank's own last, spreading the
writers over the owners). A tile stores its partial straight into ``dst_table[d]`` (this rank's
region in the owner's symmetric buffer), then counts itself in ``counters[d * NCH + chunk]``;
the tile that completes a chunk publishes ``epoch`` in this rank's ready flag
``flag_table[rank][d * FLAG_STRIDE + chunk]``. The count is an acq_rel atomic at system scope after a CTA barrier,
so the last tile has observed every other tile's stores before its release store of the flag
(the usual "barrier, then one thread releases" pattern). The last tile also resets the counter,
so a counter tensor can be reused by the next call.

`reduce_chunks_kernel` (the consumer). Each tile of this rank's block waits for the chunk's flag
of every source (``flag_table[s] + chunk``), loads the source's partial from ``src_table[s]``
and adds it in fp32, sources in the fixed order ``0 .. W-1``: the same inputs give bitwise the same
sum whatever the order of arrival. Waits are bounded as in `overlap.kernels.flags.wait_flag`.

One-shot all-reduce uses the same kernels with ``D = 1`` (every rank keeps its whole partial in its
own buffer) and a reduction over every rank's buffer.
"""

import triton
import triton.language as tl

from .flags import count_and_release, matmul_tile, wait_flag


@triton.jit
def matmul_scatter_kernel(
    # the local operands: a [M, K] row-major (contiguous rows), b [K, N] any strides
    a_ptr, b_ptr,
    # where block d goes (int64 addresses, one per destination), chunk counters, every rank's flag
    # base (int64; this rank's is used), flags per destination block in the flag area
    dst_table, counters_ptr, flag_table, FLAG_STRIDE,
    # protocol
    epoch, rank,
    # sizes: M rows in all, MB rows per block, NUM_DEST blocks, NCH chunks per block
    M, N, K, MB, NUM_DEST, NCH,
    # strides
    stride_am,
    stride_bk, stride_bn,
    stride_dm,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # ---- which tile: block-major, destinations from rank + 1 ---------------------------------
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(MB, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_block = tiles_m * tiles_n
    step = pid // tiles_per_block
    d = (rank + 1 + step) % NUM_DEST
    tile = pid % tiles_per_block
    group_size = GROUP_M * tiles_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % group_size) % rows_in_group
    tile_n = (tile % group_size) // rows_in_group
    rows_d = tl.minimum(tl.maximum(M - d * MB, 0), MB)  # rows of block d (the last may be short)

    # ---- GEMM tile --------------------------------------------------------------------------
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < rows_d
    a_rows = d.to(tl.int64) * MB + offs_m  # 64-bit: D*MB*K can pass 2^31 elements
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = matmul_tile(a_ptrs, b_ptrs, row_ok, offs_k, offs_n, N, K, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    # ---- store into the owner's buffer ------------------------------------------------------
    dst = tl.multiple_of(tl.load(dst_table + d).to(tl.pointer_type(a_ptr.dtype.element_ty)), 16)
    out_ptrs = dst + offs_m[:, None].to(tl.int64) * stride_dm + offs_n[None, :]
    tl.store(out_ptrs, acc.to(a_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))

    # ---- count the tile; the chunk's last tile publishes the flag ----------------------------
    chunk = tile_m * NCH // tiles_m
    target = (tl.cdiv((chunk + 1) * tiles_m, NCH) - tl.cdiv(chunk * tiles_m, NCH)) * tiles_n
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    count_and_release(counters_ptr + d * NCH + chunk, target, own_flags + d * FLAG_STRIDE + chunk, epoch)


@triton.jit
def reduce_chunks_kernel(
    # output [M, N] (this rank's block), sources: int64 tables of partial addresses and flag addresses
    out_ptr, src_table, flag_table,
    # protocol
    epoch, abort_ptr, err_ptr, timeout_ns,
    # sizes: M valid rows, MB rows of a block (sets the chunk map), NUM_SRC sources, NCH chunks
    M, N, MB, NUM_SRC, NCH,
    # strides (the partials are row-major with row stride stride_sm)
    stride_sm,
    stride_om, stride_on,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(MB, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m = pid // tiles_n
    tile_n = pid % tiles_n
    chunk = tile_m * NCH // tiles_m
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offs = offs_m[:, None].to(tl.int64) * stride_sm + offs_n[None, :]

    # ---- sum the sources in rank order (fixed: bitwise reproducible) -------------------------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, NUM_SRC):
        flag_ptr = tl.load(flag_table + s).to(tl.pointer_type(tl.int32)) + chunk
        wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, s, timeout_ns, INTERPRETED)
        src = tl.multiple_of(tl.load(src_table + s).to(tl.pointer_type(out_ptr.dtype.element_ty)), 16)
        x = tl.load(src + offs, mask=mask, other=0.0)
        acc += x.to(tl.float32)

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
