"""Fused all-to-all + GEMM (`all_to_all_matmul`, DeepSpeed-Ulysses sequence parallelism): the receiver multiplies
each source's block as its chunks arrive, every source into one fp32 accumulator, in rank order.

Shapes (legend): ``W`` ranks, ``m`` rows (this rank's part of the sequence), ``C`` columns of every source's block
(its heads), ``n`` output columns. Every rank's slot holds ``W`` regions of ``[m, C]`` row-major
(`overlap.kernels.slots.region_bytes` each, 16-byte aligned), region ``s`` what source ``s`` sent this rank; the
senders write them with plain copies and release their flags from the host (no kernel). Source ``s``'s ready flag
``rank * F + chunk`` (``F`` = `overlap.kernels.slots.flags_per_peer`) says "rows of chunk ``chunk`` of my block for
``rank`` are in ``rank``'s region ``s``"; chunk ``c`` covers the row tiles ``t`` (of ``BLOCK_M`` rows, ``tiles_m =
cdiv(max(m, 1), BLOCK_M)``) with ``t * NCH // tiles_m == c`` (`overlap.kernels.slots.sp_chunk_rows`: the rows a
sender copies before it releases a chunk).

`all_to_all_matmul_kernel`. An output tile ``[BLOCK_M, BLOCK_N]`` of ``out [m, n] = sum_s region_s @ b[s*C:(s+1)*C]``
(``b [W*C, n]``) loops over the sources ``s = 0 .. W-1`` in rank order (fixed: the same inputs give bitwise the same
output whatever the order of arrival); for each it waits until ``flag_table[s] + chunk`` (source ``s``'s flag of the
tile's chunk) reaches the call's epoch, then accumulates ``region_s[rows, :C] @ b[s*C:(s+1)*C, cols]`` into the one
fp32 accumulator (a K loop over ``C``), and stores the tile in `out`'s dtype. Waits are bounded as in
`overlap.kernels.flags.wait_flag`: a wait that gives up records ``s + 1`` in the error word (the tile goes on and its
output is not to be used: the host raises).

No fp8 (the sequence-parallel family has none). The host launcher `launch_all_to_all_matmul` (and the chunk count,
`overlap.kernels.matmul_reduce_scatter.chunk_count` with the ``m`` rows as the block) follows the kernel;
`overlap.all_to_all_matmul`'s ``fused`` strategy calls it.
"""

import torch
import triton
import triton.language as tl

from . import host
from .flags import grouped_tile, wait_flag
from .matmul_reduce_scatter import chunk_count

__all__ = ["all_to_all_matmul_grid", "all_to_all_matmul_kernel", "chunk_count", "launch_all_to_all_matmul"]


# Not specialized on: values that differ between ranks or calls, and counts that only mask rows or index flags (C, N
# and the strides set the GEMM's vector loads: they stay specialized).
@triton.jit(do_not_specialize=["epoch_ptr", "abort_ptr", "err_ptr", "timeout_ns", "M", "NUM_SRC", "NCH"])
def all_to_all_matmul_kernel(
    # output [M, N] and the weight b [NUM_SRC * C, N] (any strides)
    out_ptr, b_ptr,
    # sources: int64 tables of region addresses (row-major [M, C]) and of their flags of chunk 0
    src_table, flag_table,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, abort_ptr, err_ptr, timeout_ns: tl.int64,
    # sizes: M rows, N columns, C columns of a source's block (the K of its GEMM), NUM_SRC sources, NCH chunks
    M, N, C, NUM_SRC, NCH,
    # strides
    stride_bk, stride_bn,
    stride_om, stride_on,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # ---- which tile, which chunk of the sources' rows ------------------------------------------
    tiles_m = tl.cdiv(tl.maximum(M, 1), BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = grouped_tile(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    chunk = tile_m * NCH // tiles_m
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    # 64-bit: M*C, W*C*N and a column of a weight of 2^31 elements or more (column-major, w.t(): n * stride_bn) pass
    # 2^31 elements
    region_rows = offs_m[:, None].to(tl.int64) * C + offs_k[None, :]
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    b_step = BLOCK_K * tl.cast(stride_bk, tl.int64)  # (tl.cast: the stride may be the constant 1)

    # ---- every source in rank order (fixed: bitwise reproducible), one fp32 accumulator --------
    epoch = tl.load(epoch_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, NUM_SRC):
        flag_ptr = tl.load(flag_table + s).to(tl.pointer_type(tl.int32)) + chunk
        wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, s, timeout_ns, INTERPRETED)
        region = tl.multiple_of(tl.load(src_table + s).to(tl.pointer_type(b_ptr.dtype.element_ty)), 16)
        a_ptrs = region + region_rows
        b_ptrs = b_cols + (s * C + offs_k[:, None]).to(tl.int64) * stride_bk  # (s * C < W * C: b's rows)
        for kk in range(0, tl.cdiv(C, BLOCK_K)):
            k_left = C - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong (docs/toolchain.md): compute in fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += b_step

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------

GROUP_M = 8  # row tiles that sweep the columns together (L2 reuse of b)


def all_to_all_matmul_grid(rows: int, n: int, block_m: int, block_n: int) -> int:
    """Programs of one launch: the ``[rows, n]`` output in tiles (one row tile where ``rows == 0``)."""
    return host.cdiv(max(rows, 1), block_m) * host.cdiv(n, block_n)


def launch_all_to_all_matmul(out: torch.Tensor, src_table: torch.Tensor, flag_table: torch.Tensor, b: torch.Tensor,
                             *, num_chunks: int, epoch: torch.Tensor, err: torch.Tensor, timeout_ns: int,
                             block: tuple[int, int, int], abort: torch.Tensor | None = None,
                             watchdog: bool = True) -> None:
    """The consumer GEMM on the current stream: ``out = sum_s region_s @ b[s*C:(s+1)*C]`` over the sources in rank
    order, one fp32 accumulator, each tile's source block once that source's flag of its chunk has reached `epoch`.

    Args:
        out: ``[m, n]``, any strides, `b`'s dtype (``m`` may be 0: nothing is written).
        src_table: int64 ``[W]``: region ``s`` of this rank's slot (source ``s``'s ``[m, C]`` row-major block in
            `b`'s dtype, 16-byte aligned).
        flag_table: int64 ``[W]``: source ``s``'s flag of chunk 0 for this rank (its flag ``rank * F``; chunk ``c``
            is the ``c``-th word after it).
        b: ``[W * C, n]``, any strides, float32, bfloat16 or float16; rows ``s*C ... (s+1)*C`` multiply source ``s``.
        num_chunks: ``NCH`` (`chunk_count` with ``m`` rows), as the senders released them.
        epoch: int32 word on `out`'s device holding the value the flags must reach (`overlap.kernels.epoch_word`).
        err: int32 word (GPU: pinned host memory) where a wait that gives up records ``s + 1``; the caller reads it.
        timeout_ns: how long one wait may spin.
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``; ``BLOCK_M`` sets the chunk of a row tile (the senders' chunks:
            `overlap.kernels.slots.sp_chunk_rows`).
        abort, watchdog: as for `overlap.kernels.all_gather_matmul.launch_all_gather_matmul`.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, rows of `b` that do not split into ``W`` blocks, a tile
            size that is not a power of two >= 16.
    """
    kernel = "launch_all_to_all_matmul"
    host.check_matrix(kernel, "b", b)
    host.check_matrix(kernel, "out", out, b.dtype)
    rows_b, n = b.shape
    m = out.shape[0]
    if out.shape[1] != n or out.device != b.device:
        host.fail(kernel, f"out must be [m, {n}] on {b.device}, got {list(out.shape)} on {out.device}")
    world_size = host.table_size(src_table)
    host.check_table(kernel, "src_table", src_table, world_size, b.device)
    host.check_table(kernel, "flag_table", flag_table, world_size, b.device)
    if world_size < 1 or rows_b < world_size or rows_b % world_size:
        host.fail(kernel, f"b's {rows_b} rows do not split into {world_size} blocks of C >= 1 rows")
    c = rows_b // world_size
    host.check_word(kernel, "err", err)
    host.check_epoch(kernel, epoch, b.device)
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    host.check_range(kernel, "m", m, 0, 1 << 31)
    host.check_range(kernel, "num_chunks", num_chunks, 1, host.cdiv(max(m, 1), bm) + 1)
    if n == 0:
        return
    interpreted = host.interpreted()
    abort = host.abort_word(kernel, abort, err, interpreted)
    with host.bounded(abort, timeout_ns, watchdog, interpreted):
        all_to_all_matmul_kernel[(all_to_all_matmul_grid(m, n, bm, bn),)](
            out, b,
            src_table, flag_table,
            epoch, abort, err, timeout_ns,
            m, n, c, world_size, num_chunks,
            b.stride(0), b.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
            UPCAST=interpreted and b.dtype == torch.bfloat16, INTERPRETED=interpreted,
        )
