"""Fused weight-side all-gather + GEMM: every output-column tile waits only for the shard it reads.

Shapes (legend): ``M`` rows of this rank's input ``a_MK`` (its own data, not gathered), ``W`` ranks, ``K``
inner dim, ``N`` columns of one rank's shard. Rank r's shard of the weight lives in its symmetric buffer as
rows of ``w``, row-major ``[N, K]`` (so ``b_r = shard_r.T``); ``ptr_table[r]`` is its address in this
process, ``flag_table[r]`` the address of rank r's ready flag. The output ``out_M[W*N]`` holds
``a @ b_r`` at columns ``r*N ... (r+1)*N``: the whole weight is never materialized, each tile loads its
``[BLOCK_K, BLOCK_N]`` pieces straight from the owner's buffer.

Program ids are laid out shard-major, starting from this rank's own shard, then ``rank + 1``, ...: the
tiles of one shard run together (each peer's shard is read from that peer about once per call, the row
tiles that share a column tile grouped for L2), the first tiles need no peer, and starting at
``rank + 1`` spreads the readers over the owners.

Waiting, as `overlap.kernels.all_gather_matmul`: a tile acquires the owner's flag (``flag >= epoch``) before it
loads; the spin is bounded by ``%globaltimer`` on GPUs, by an abort word a host watchdog sets when
interpreted; a tile that gives up records ``src + 1`` in ``err_ptr``.

fp8 (the recipe, `overlap.ops.tp.all_gather_weight_matmul`): ``a`` is e4m3 with its scales (one, one per row, or MX
``[M, K/32]`` e8m0) and each shard's rows are rows of bytes (`overlap.ops.tp.operands.Packed`): ``K`` e4m3 bytes, and
from byte ``SCALE_OFF`` of the row its scales, one float32 (a tensorwise shard's one scale on each row) or ``K/32``
e8m0 bytes; ``stride_wn`` is the row's bytes. The tile multiplies in fp8 and applies both scales in its epilogue, or
(MX) each 32-wide block of K's scales in its K loop (`overlap.kernels.flags.mx_matmul_tile`).

`launch_all_gather_weight_matmul` (after the kernel) is its host launcher, called by
`overlap.all_gather_weight_matmul`'s ``fused`` strategy.
"""

import torch
import triton
import triton.language as tl

from . import host
from .flags import MX_SCALES, matmul_tile, mx_matmul_tile, rank_major_tile, wait_rank_buffer


# Not specialized on: values that differ between ranks or calls, and M (rows only mask and offset). The
# sizes and strides that set the GEMM's vector loads (N, K, the row strides) stay specialized.
@triton.jit(do_not_specialize=["epoch_ptr", "rank", "world_size", "abort_ptr", "err_ptr", "timeout_ns", "M"])
def all_gather_weight_matmul_kernel(
    # output, this rank's input and (fp8) its scales: one, one per row, or MX [M, K/32] e8m0 bytes
    out_ptr, a_ptr, a_scale_ptr,
    # symmetric memory: per-rank shard addresses and ready-flag addresses (int64 tables)
    ptr_table, flag_table,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, rank, world_size, abort_ptr, err_ptr, timeout_ns: tl.int64,
    # sizes: M rows of a, N columns per shard, K
    M, N, K,
    # strides: a's rows (unit columns); a shard's rows in its buffer (K; fp8: the packed row's bytes, its scales
    # from byte SCALE_OFF); MX: a's scales' rows; the output's
    stride_am, stride_wn, SCALE_OFF, stride_asm,
    stride_om, stride_on,
    # meta (A_SCALE: 0 plain, 1 one scale of a, 2 one per row, 3 MX blocks: `overlap.kernels.flags.MX_SCALES`)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED: tl.constexpr, A_SCALE: tl.constexpr,
):
    # ---- which tile: shard-major, own shard first ---------------------------------------------
    src, tile_m, tile_n = rank_major_tile(tl.program_id(0), rank, world_size, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # ---- wait for the shard this tile reads, then load it straight from the owner's buffer -----
    w_ptr = wait_rank_buffer(ptr_table, flag_table, src, epoch_ptr, abort_ptr, err_ptr, timeout_ns, a_ptr,
                             INTERPRETED)

    # ---- GEMM tile: b[k, n] = shard[n, k] ---------------------------------------------------------
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + offs_m.to(tl.int64) * stride_am
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # column n of b is row n of the shard
    if A_SCALE == MX_SCALES:  # MX: every 32-wide block of K scaled in the loop, a column's scales in its packed row
        a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
        w_scales = (w_rows + SCALE_OFF).to(tl.pointer_type(tl.uint8))
        acc = mx_matmul_tile(a_rows, a_scale_rows, w_rows, w_scales, 1, offs_m < M, offs_n < N, K, 1,
                             BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_rows[:, None] + offs_k[None, :]
        b_ptrs = w_rows[None, :] + offs_k[:, None]
        acc = matmul_tile(a_ptrs, b_ptrs, offs_m < M, offs_k, offs_n, N, K, 1, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        if A_SCALE:  # fp8: a's scales, and each column's float32 scale from its packed row, in the epilogue
            if A_SCALE == 2:
                a_scale = tl.load(a_scale_ptr + offs_m.to(tl.int64) * stride_asm, mask=offs_m < M, other=0.0)
                acc = acc * a_scale[:, None]
            else:
                acc = acc * tl.load(a_scale_ptr)
            w_scale = tl.load((w_rows + SCALE_OFF).to(tl.pointer_type(tl.float32)), mask=offs_n < N, other=0.0)
            acc = acc * w_scale[None, :]

    # ---- store into the source rank's columns of the output -----------------------------------
    cols = src.to(tl.int64) * N + offs_n
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------

GROUP_M = 8  # row tiles that sweep one shard's columns together (L2 reuse of its tiles)


def all_gather_weight_matmul_grid(world_size: int, rows: int, n: int, block_m: int, block_n: int) -> int:
    """Programs of one launch: every shard's ``[rows, n]`` block of the output in ``block_m x block_n`` tiles."""
    return world_size * host.cdiv(rows, block_m) * host.cdiv(n, block_n)


def launch_all_gather_weight_matmul(a: torch.Tensor, ptr_table: torch.Tensor, flag_table: torch.Tensor, *, n: int,
                                    epoch: torch.Tensor, rank: int, err: torch.Tensor, timeout_ns: int,
                                    block: tuple[int, int, int], out: torch.Tensor | None = None,
                                    abort: torch.Tensor | None = None, watchdog: bool = True,
                                    num_warps: int | None = None, num_stages: int | None = None,
                                    a_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                                    scale_offset: int = 0, row_bytes: int | None = None) -> torch.Tensor:
    """``out = a @ cat(shard_0.T, ..., shard_{W-1}.T)`` on the current stream, each tile once its shard is flagged.

    Args:
        a: ``[M, K]`` this rank's input, unit column stride; its dtype is the shards' and the output's (fp8: see
            `a_scale`).
        ptr_table: int64 ``[W]``, on `a`'s device: the address of rank r's shard, row-major ``[n, K]``
            (rows of the weight), 16-byte aligned (a symmetric buffer); fp8: ``[n, row_bytes]`` bytes, each row's
            scales from byte `scale_offset`: one float32, or with MX scales its ``K / 32`` e8m0 bytes
            (`overlap.ops.tp.operands.Packed`; `row_bytes` default ``scale_offset`` plus those bytes).
        flag_table: int64 ``[W]``: the address of rank r's int32 ready flag; a tile waits until it reaches `epoch`.
        n: ``N``, columns of every rank's shard (rows of its buffer).
        epoch: int32 word on `a`'s device holding this call's epoch (`overlap.kernels.epoch_word`).
        rank: this rank (whose own shard is multiplied first).
        err: int32 word (GPU: pinned host memory) where a wait that gives up records ``src + 1``.
        timeout_ns: how long one wait may spin.
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``.
        out: ``[M, W * n]`` to write (default: a new tensor).
        abort: the interpreter's abort word (default: a new one when interpreted).
        watchdog: when interpreted, set `abort` after `timeout_ns` (False: the caller bounds the launch).
        num_warps, num_stages: Triton launch options on GPUs (default: Triton's).
        a_scale: fp8 `a` (e4m3): its float32 scale, one element or ``[M, 1]`` (the tile multiplied in fp8 and scaled
            in its epilogue by it and by each column's scale from the packed rows), or MX block scales ``[M, K / 32]``
            (``torch.float8_e8m0fnu``, contiguous; ``K`` a multiple of 32 and ``BLOCK_K`` of 32: every 32-wide block
            of K scaled in the K loop). out_dtype: the output's dtype then (default bfloat16). scale_offset,
            row_bytes: as above.

    Returns:
        `out`: rank r's block of columns at ``r*n ... (r+1)*n - 1``.

    Raises:
        ValueError: arguments of the wrong shape, dtype or device, a rank outside the tables, a tile size
            that is not a power of two >= 16.
    """
    kernel = "launch_all_gather_weight_matmul"
    host.check_matrix(kernel, "a", a, unit_cols=True, fp8=True)
    world_size = host.table_size(ptr_table)
    host.check_table(kernel, "ptr_table", ptr_table, world_size, a.device)
    host.check_table(kernel, "flag_table", flag_table, world_size, a.device)
    host.check_range(kernel, "rank", rank, 0, world_size)
    host.check_range(kernel, "n", n, 1, 1 << 31)
    host.check_word(kernel, "err", err)
    host.check_epoch(kernel, epoch, a.device)
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    m, k = a.shape
    a_mode = 0
    if a_scale is not None or a.dtype in host.FP8_DTYPES:
        a_mode = host.check_a_scale(kernel, a, a_scale)
        row_bytes = host.check_packed_rows(kernel, k, a_mode == host.MX_SCALES, bk, scale_offset, row_bytes)
    out_dtype = (out_dtype or torch.bfloat16) if a_mode else a.dtype
    if out is None:
        out = a.new_empty((m, world_size * n), dtype=out_dtype)
    elif tuple(out.shape) != (m, world_size * n) or out.dtype != out_dtype or out.device != a.device:
        host.fail(kernel, f"out must be {out_dtype} [{m}, {world_size * n}] on {a.device}, got {out.dtype} "
                          f"{list(out.shape)} on {out.device}")
    interpreted = host.interpreted()
    abort = host.abort_word(kernel, abort, err, interpreted)
    with host.bounded(abort, timeout_ns, watchdog, interpreted):
        all_gather_weight_matmul_kernel[(all_gather_weight_matmul_grid(world_size, m, n, bm, bn),)](
            out, a, host.scale_arg(a_scale, a_mode, a),
            ptr_table, flag_table,
            epoch, rank, world_size, abort, err, timeout_ns,
            m, n, k,
            a.stride(0), row_bytes if a_mode else k, scale_offset, a_scale.stride(0) if a_mode in (2, 3) else 0,
            out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
            UPCAST=interpreted and a.dtype == torch.bfloat16, INTERPRETED=interpreted, A_SCALE=a_mode,
            **host.meta_options(num_warps, num_stages, interpreted),
        )
    return out
