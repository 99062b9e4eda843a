"""Fused all-gather + GEMM: every tile waits only for the rank chunk it reads.

Shapes (legend): ``M`` rows of one rank's shard, ``W`` ranks, ``K`` inner dim, ``N`` columns.
Each rank's shard ``a_MK`` lives in that rank's symmetric buffer; ``ptr_table[r]`` is the address
of rank r's shard in this process, ``flag_table[r]`` the address of rank r's ready flag. The
output ``out_[W*M]N`` holds rank r's rows at ``r*M ... (r+1)*M``.

Program ids are laid out chunk-major starting from this rank's own chunk, then ``rank + 1``,
``rank + 2``, ...: the first tiles need no peer at all, and peers are visited in the order
their data is most likely to have arrived (everyone publishes at about the same time, and
starting at ``rank + 1`` spreads the readers over the producers).

Waiting: a tile acquires the producer's flag (``flag >= epoch``) before it loads the chunk, so
its loads see the producer's data (release/acquire pairing with the producer's flag store).
The spin is bounded: on GPUs by ``%globaltimer`` against ``timeout_ns``, when interpreted by an
abort word that a host watchdog sets at the deadline. A tile that gives up records ``src + 1``
in ``err_ptr`` (atomic max) and the host raises `OverlapTimeout` naming that peer.

fp8 (e4m3 shards packed with their scales, `overlap.ops.tp.operands.Packed`): rowwise or tensorwise scales multiply
the tile in its epilogue; MX block scales (one e8m0 byte per 32 elements of a row, after the row's bytes) multiply
each 32-wide block's dot in the K loop (`overlap.kernels.flags.mx_matmul_tile`).

`launch_all_gather_matmul` (after the kernel) is its host launcher, called by
`overlap.all_gather_matmul`'s ``fused`` strategy and by the GPU tests (``tests/gpu``).
"""

import torch
import triton
import triton.language as tl

from . import host
from .flags import MX_SCALES, matmul_tile, mx_matmul_tile, rank_major_tile, scale_tile, wait_rank_buffer


# Not specialized on: values that differ between ranks or calls (one compiled variant serves them all) and M
# (rows: it only masks and offsets rows). The sizes and strides that set the GEMM's vector loads stay specialized.
@triton.jit(do_not_specialize=["epoch_ptr", "rank", "world_size", "abort_ptr", "err_ptr", "timeout_ns", "M", "ROWS"])
def all_gather_matmul_kernel(
    # output and the local weight shard (fp8: its scales, one, one per column, or MX: [K/32, N] e8m0 bytes)
    out_ptr, b_ptr, b_scale_ptr,
    # symmetric memory: per-rank shard addresses and ready-flag addresses (int64 tables)
    ptr_table, flag_table,
    # protocol (the call's epoch is an int32 word on the device: `overlap.kernels.flags`)
    epoch_ptr, rank, world_size, abort_ptr, err_ptr, timeout_ns: tl.int64,
    # sizes: M rows per rank, N, K; a rank's rows land in runs of ROWS (M: one run; less: a gather dim past the
    # first, `overlap.ops.tp.rows.Rows`)
    M, N, K, ROWS,
    # strides (the shards are row-major [M, K] in their buffers; fp8: rows of bytes, each row's scales from byte
    # SCALE_OFF of the row: one float32, or MX its K/32 e8m0 bytes, `overlap.ops.tp.operands.Packed`); MX: the
    # weight's block scales' strides
    stride_am, SCALE_OFF,
    stride_bk, stride_bn,
    stride_bsk, stride_bsn,
    stride_om, stride_on,
    # meta (B_SCALE: 0 plain, 1 one scale of b, 2 one per column, 3 MX blocks: `overlap.kernels.flags.MX_SCALES`)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED: tl.constexpr, B_SCALE: tl.constexpr,
):
    # ---- which tile: chunk-major, own chunk first --------------------------------------------
    src, tile_m, tile_n = rank_major_tile(tl.program_id(0), rank, world_size, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # ---- wait for the chunk this tile reads, then load A straight from the producer's buffer ---
    a_ptr = wait_rank_buffer(ptr_table, flag_table, src, epoch_ptr, abort_ptr, err_ptr, timeout_ns, b_ptr,
                             INTERPRETED)

    # ---- GEMM tile ------------------------------------------------------------------------------
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # 64-bit offsets: W*M*N and M*K can pass 2^31 elements at long sequences, and so can a column of a weight of
    # 2^31 elements or more (column-major, w.t(): n * stride_bn).
    a_rows = a_ptr + offs_m.to(tl.int64) * stride_am
    if B_SCALE == MX_SCALES:  # MX: every 32-wide block of K scaled in the loop, a row's scales from its packed row
        a_scale_rows = (a_rows + SCALE_OFF).to(tl.pointer_type(tl.uint8))
        b_cols = b_ptr + offs_n.to(tl.int64) * stride_bn
        b_scale_cols = b_scale_ptr + offs_n.to(tl.int64) * stride_bsn
        acc = mx_matmul_tile(a_rows, a_scale_rows, b_cols, b_scale_cols, stride_bsk, offs_m < M, offs_n < N, K,
                             stride_bk, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_rows[:, None] + offs_k[None, :]
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
        acc = matmul_tile(a_ptrs, b_ptrs, offs_m < M, offs_k, offs_n, N, K, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K,
                          UPCAST)
        if B_SCALE:  # fp8: each row's scale from its packed row, the weight's from b_scale_ptr, in the epilogue
            a_scale = tl.load((a_rows + SCALE_OFF).to(tl.pointer_type(tl.float32)), mask=offs_m < M, other=0.0)
            acc = scale_tile(acc, a_scale, True, b_scale_ptr, offs_n, N, B_SCALE)

    # ---- store into this source rank's rows of the output ------------------------------------
    run = offs_m.to(tl.int64) // ROWS
    rows = (run * world_size + src) * ROWS + offs_m % ROWS
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------

GROUP_M = 8  # row tiles that sweep the columns together (L2 reuse of B)


def all_gather_matmul_grid(world_size: int, rows: int, n: int, block_m: int, block_n: int) -> int:
    """Programs of one launch: every rank chunk's ``[rows, n]`` output in ``block_m x block_n`` tiles."""
    return world_size * host.cdiv(rows, block_m) * host.cdiv(n, block_n)


def launch_all_gather_matmul(b: torch.Tensor, ptr_table: torch.Tensor, flag_table: torch.Tensor, *, rows: int,
                             epoch: torch.Tensor, rank: int, err: torch.Tensor, timeout_ns: int,
                             block: tuple[int, int, int], out: torch.Tensor | None = None,
                             abort: torch.Tensor | None = None, watchdog: bool = True,
                             num_warps: int | None = None, num_stages: int | None = None,
                             rows_per_outer: int | None = None, b_scale: torch.Tensor | None = None,
                             out_dtype: torch.dtype | None = None, scale_offset: int = 0,
                             row_bytes: int | None = None) -> torch.Tensor:
    """``out = cat(shard_0, ..., shard_{W-1}) @ b`` on the current stream, each tile once its shard is flagged.

    Args:
        b: ``[K, N]`` this rank's weight, any strides; its dtype is the shards' and the output's (fp8: see
            `b_scale`).
        ptr_table: int64 ``[W]``, on `b`'s device: the address of rank r's shard, row-major ``[rows, K]``,
            16-byte aligned (a symmetric buffer); fp8: ``[rows, row_bytes]`` bytes, each row's scales from byte
            `scale_offset`: one float32, or with MX scales its ``K / 32`` e8m0 bytes
            (`overlap.ops.tp.operands.Packed`; `row_bytes` default ``scale_offset`` plus those bytes).
        flag_table: int64 ``[W]``: the address of rank r's int32 ready flag; a tile waits until it reaches `epoch`.
        rows: ``M``, rows of every rank's shard.
        epoch: int32 word on `b`'s device holding this call's epoch (`overlap.kernels.epoch_word`; the ops pass
            their heap slot's word). A word, not an int: Triton would compile again for epochs 1 and 16.
        rank: this rank (whose own chunk is multiplied first).
        err: int32 word (GPU: pinned host memory) where a wait that gives up records ``src + 1``; the caller
            reads it (never this launcher: that would synchronize).
        timeout_ns: how long one wait may spin.
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``.
        out: ``[W * rows, N]`` to write (default: a new tensor).
        abort: the interpreter's abort word (default: a new one when interpreted).
        watchdog: when interpreted, set `abort` after `timeout_ns` (False: the caller bounds the launch).
        num_warps, num_stages: Triton launch options on GPUs (default: Triton's).
        rows_per_outer: ``R``, a divisor of `rows`: rank r's rows land in runs of ``R``, its row ``o*R + f`` at
            ``(o*W + r)*R + f`` (a gather dim past the first); default `rows` (one run).
        b_scale: fp8 `b` (e4m3): its float32 scale, one element or ``[1, N]`` (the tile is multiplied in fp8 and
            scaled in its epilogue), or MX block scales ``[K / 32, N]`` (``torch.float8_e8m0fnu``, any strides; ``K``
            a multiple of 32 and ``BLOCK_K`` of 32: every 32-wide block of K scaled in the K loop by its row's and
            column's scales). out_dtype: the output's dtype then (default bfloat16). scale_offset: as above.

    Returns:
        `out`: rank r's rows at ``r*rows ... (r+1)*rows - 1`` (or in runs of `rows_per_outer`).

    Raises:
        ValueError: arguments of the wrong shape, dtype or device, a rank outside the tables, a tile size
            that is not a power of two >= 16.
    """
    kernel = "launch_all_gather_matmul"
    host.check_matrix(kernel, "b", b, fp8=True)
    world_size = host.table_size(ptr_table)
    host.check_table(kernel, "ptr_table", ptr_table, world_size, b.device)
    host.check_table(kernel, "flag_table", flag_table, world_size, b.device)
    host.check_range(kernel, "rank", rank, 0, world_size)
    host.check_range(kernel, "rows", rows, 0, 1 << 31)
    run = rows if rows_per_outer is None else rows_per_outer
    if rows and (not isinstance(run, int) or run < 1 or rows % run):
        host.fail(kernel, f"rows_per_outer must be a positive divisor of rows={rows}, got {run!r}")
    host.check_word(kernel, "err", err)
    host.check_epoch(kernel, epoch, b.device)
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    k, n = b.shape
    b_mode = 0
    if b_scale is not None or b.dtype in host.FP8_DTYPES:
        b_mode = host.check_b_scale(kernel, b, b_scale)
        row_bytes = host.check_packed_rows(kernel, k, b_mode == host.MX_SCALES, bk, scale_offset, row_bytes)
    out_dtype = (out_dtype or torch.bfloat16) if b_mode else b.dtype
    if out is None:
        out = b.new_empty((world_size * rows, n), dtype=out_dtype)
    elif tuple(out.shape) != (world_size * rows, n) or out.dtype != out_dtype or out.device != b.device:
        host.fail(kernel, f"out must be {out_dtype} [{world_size * rows}, {n}] on {b.device}, got {out.dtype} "
                          f"{list(out.shape)} on {out.device}")
    interpreted = host.interpreted()
    abort = host.abort_word(kernel, abort, err, interpreted)
    with host.bounded(abort, timeout_ns, watchdog, interpreted):
        all_gather_matmul_kernel[(all_gather_matmul_grid(world_size, rows, n, bm, bn),)](
            out, b, host.scale_arg(b_scale, b_mode, b),
            ptr_table, flag_table,
            epoch, rank, world_size, abort, err, timeout_ns,
            rows, n, k, max(run, 1),
            row_bytes if b_mode else k, scale_offset,
            b.stride(0), b.stride(1),
            *host.scale_strides(b_scale, b_mode),
            out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
            UPCAST=interpreted and b.dtype == torch.bfloat16, INTERPRETED=interpreted, B_SCALE=b_mode,
            **host.meta_options(num_warps, num_stages, interpreted),
        )
    return out
