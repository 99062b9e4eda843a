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

fp8 operands (e4m3, the partials float32): rowwise or tensorwise scales multiply the tile in its epilogue; MX block
scales (``[M, K/32]`` and ``[K/32, N]`` e8m0) multiply each 32-wide block's dot in the K loop
(`overlap.kernels.flags.mx_matmul_tile`).

One-shot all-reduce uses the same kernels with ``D = 1`` (every rank keeps its whole partial in its
own buffer) and a reduction over every rank's buffer.

Their host launchers (`launch_matmul_scatter`, `launch_reduce_chunks`, and `chunk_count`, the number of
chunks both agree on) follow the kernels; `overlap.matmul_reduce_scatter`'s and `overlap.matmul_all_reduce`'s
``fused`` strategies and the GPU tests (``tests/gpu``) call them.
"""

import torch
import triton
import triton.language as tl

from . import host
from .flags import MX_K, MX_SCALES, count_and_release, grouped_tile, matmul_tile, mx_matmul_tile, scale_tile, wait_flag


# Not specialized on: values that differ between ranks or calls, and counts that only mask rows or index flags
# (the sizes and strides that set the GEMM's vector loads stay specialized).
@triton.jit(do_not_specialize=["FLAG_STRIDE", "epoch_ptr", "rank", "M", "MB", "NUM_DEST", "NCH", "ROWS"])
def matmul_scatter_kernel(
    # the local operands: a [M, K] row-major (contiguous rows), b [K, N] any strides; fp8: their scales (A_SCALE,
    # B_SCALE: 0 none, 1 one float32, 2 one per row of a / column of b, 3 MX blocks: e8m0 bytes, a's [M, K/32]
    # contiguous, b's [K/32, N] with strides stride_bsk, stride_bsn), the partials float32
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr,
    # where block d goes (int64 addresses, one per destination), chunk counters, every rank's flag
    # base (int64; this rank's is used), flags per destination block in the flag area
    dst_table, counters_ptr, flag_table, FLAG_STRIDE,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, rank,
    # sizes: M rows in all, MB rows per block, NUM_DEST blocks, NCH chunks per block; the blocks interleave in
    # runs of ROWS rows (MB: one run each; less: a scatter dim past the first, `overlap.ops.tp.rows.Rows`)
    M, N, K, MB, NUM_DEST, NCH, ROWS,
    # strides
    stride_am,
    stride_bk, stride_bn,
    stride_bsk, stride_bsn,
    stride_dm,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, A_SCALE: tl.constexpr, B_SCALE: tl.constexpr,
):
    # ---- which tile: block-major, destinations from rank + 1 ---------------------------------
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(MB, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_block = tiles_m * tiles_n
    step = pid // tiles_per_block
    d = (rank + 1 + step) % NUM_DEST
    tile = pid % tiles_per_block
    tile_m, tile_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
    rows_d = tl.minimum(tl.maximum(M - d * MB, 0), MB)  # rows of block d (the last may be short)

    # ---- GEMM tile --------------------------------------------------------------------------
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < rows_d
    run = offs_m.to(tl.int64) // ROWS  # 64-bit: D*MB*K can pass 2^31 elements
    a_rows = (run * NUM_DEST + d) * ROWS + offs_m % ROWS
    if A_SCALE == MX_SCALES:  # MX: every 32-wide block of K scaled in the loop
        # 64-bit: a column of a weight of 2^31 elements or more (column-major, w.t(): n * stride_bn) passes 2^31
        acc = mx_matmul_tile(a_ptr + a_rows * stride_am, a_scale_ptr + a_rows * (K // MX_K),
                             b_ptr + offs_n.to(tl.int64) * stride_bn, b_scale_ptr + offs_n.to(tl.int64) * stride_bsn,
                             stride_bsk, row_ok, offs_n < N, K, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        # 64-bit: a column of a weight of 2^31 elements or more (column-major, w.t(): n * stride_bn) passes 2^31
        b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
        acc = matmul_tile(a_ptrs, b_ptrs, row_ok, offs_k, offs_n, N, K, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    # ---- store into the owner's buffer (fp8: scaled, float32) ---------------------------------
    mask = row_ok[:, None] & (offs_n[None, :] < N)
    if A_SCALE:
        if A_SCALE != MX_SCALES:  # (MX: scaled block by block in the K loop)
            if A_SCALE == 2:
                a_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
            else:
                a_scale = tl.load(a_scale_ptr)
            acc = scale_tile(acc, a_scale, A_SCALE == 2, b_scale_ptr, offs_n, N, B_SCALE)
        dst = tl.multiple_of(tl.load(dst_table + d).to(tl.pointer_type(tl.float32)), 16)
        out_ptrs = dst + offs_m[:, None].to(tl.int64) * stride_dm + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=mask)
    else:
        dst = tl.multiple_of(tl.load(dst_table + d).to(tl.pointer_type(a_ptr.dtype.element_ty)), 16)
        out_ptrs = dst + offs_m[:, None].to(tl.int64) * stride_dm + offs_n[None, :]
        tl.store(out_ptrs, acc.to(a_ptr.dtype.element_ty), mask=mask)

    # ---- count the tile; the chunk's last tile publishes the flag ----------------------------
    chunk = tile_m * NCH // tiles_m
    target = (tl.cdiv((chunk + 1) * tiles_m, NCH) - tl.cdiv(chunk * tiles_m, NCH)) * tiles_n
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    epoch = tl.load(epoch_ptr)
    count_and_release(counters_ptr + d * NCH + chunk, target, own_flags + d * FLAG_STRIDE + chunk, epoch)


@triton.jit(do_not_specialize=["epoch_ptr", "abort_ptr", "err_ptr", "timeout_ns", "M", "MB", "NUM_SRC", "NCH"])
def reduce_chunks_kernel(
    # output [M, N] (this rank's block), sources: int64 tables of partial addresses and flag addresses
    out_ptr, src_table, flag_table,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, abort_ptr, err_ptr, timeout_ns: tl.int64,
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
    epoch = tl.load(epoch_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, NUM_SRC):
        flag_ptr = tl.load(flag_table + s).to(tl.pointer_type(tl.int32)) + chunk
        wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, s, timeout_ns, INTERPRETED)
        src = tl.multiple_of(tl.load(src_table + s).to(tl.pointer_type(out_ptr.dtype.element_ty)), 16)
        x = tl.load(src + offs, mask=mask, other=0.0)
        acc += x.to(tl.float32)

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------

GROUP_M = 8  # row tiles that sweep the columns together (L2 reuse of B)


def chunk_count(requested: int, max_chunks: int, block_rows: int, block_m: int) -> int:
    """``NCH``, the chunks of one block both kernels use: `requested` (a plan's count), at most `max_chunks`
    (the flags a destination has) and the block's row tiles, at least 1."""
    return max(1, min(requested, max_chunks, host.cdiv(block_rows, block_m)))


def matmul_scatter_grid(num_dest: int, block_rows: int, n: int, block_m: int, block_n: int) -> int:
    """Programs of one `launch_matmul_scatter`: every block's ``[block_rows, n]`` in tiles."""
    return num_dest * host.cdiv(block_rows, block_m) * host.cdiv(n, block_n)


def reduce_chunks_grid(block_rows: int, n: int, block_m: int, block_n: int) -> int:
    """Programs of one `launch_reduce_chunks`: one block's ``[block_rows, n]`` in tiles."""
    return host.cdiv(block_rows, block_m) * host.cdiv(n, block_n)


def launch_matmul_scatter(a: torch.Tensor, b: torch.Tensor, dst_table: torch.Tensor, counters: torch.Tensor,
                          flag_table: torch.Tensor, *, block_rows: int, num_chunks: int, flag_stride: int,
                          epoch: torch.Tensor, rank: int, block: tuple[int, int, int],
                          rows_per_outer: int | None = None, a_scale: torch.Tensor | None = None,
                          b_scale: torch.Tensor | None = None) -> None:
    """The producer on the current stream: ``a @ b`` cut into ``D`` blocks of `block_rows` rows, block ``d``
    stored at ``dst_table[d]`` and released per chunk in this rank's flags ``d * flag_stride + chunk``.

    Args:
        a: ``[M, K]`` with unit column stride (``M <= D * block_rows``; the last blocks may be short or empty).
        b: ``[K, N]``, any strides, `a`'s dtype.
        dst_table: int64 ``[D]``: where block ``d`` goes (a 16-byte aligned ``[block_rows, N]`` row-major region).
        counters: int32, at least ``D * num_chunks`` words, zero; the kernel leaves them at zero.
        flag_table: int64 ``[W]``: every rank's flag base (this rank's is written).
        block_rows, num_chunks: ``MB`` and ``NCH`` (`chunk_count`); flag_stride: flags per destination
            (at least `num_chunks` where ``D > 1``).
        epoch: int32 word on `a`'s device holding the value the flags get (`overlap.kernels.epoch_word`).
        rank: this rank (destinations are visited from ``rank + 1``).
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``; `launch_reduce_chunks` must use the same ``BLOCK_M``.
        rows_per_outer: the blocks interleave in `a` in runs of this many rows (``a``'s row ``(o * D + d) * R + f``
            is row ``o * R + f`` of block ``d``); default `block_rows` (block ``d`` is rows ``d * block_rows ...``).
        a_scale, b_scale: fp8 `a` and `b` (e4m3): their float32 scales (``a_scale`` one element or ``[M, 1]``,
            ``b_scale`` one element or ``[1, N]``), scaled in the epilogue; or MX block scales on both
            (``torch.float8_e8m0fnu``: ``a_scale`` ``[M, K / 32]`` contiguous, ``b_scale`` ``[K / 32, N]`` any
            strides; ``K`` a multiple of 32, ``BLOCK_K`` of 32), every 32-wide block of K scaled in the K loop. The
            blocks are then float32 partials.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, rows past the blocks, flags of two destinations
            that overlap, a rank outside `flag_table`, a tile size that is not a power of two >= 16.
    """
    kernel = "launch_matmul_scatter"
    host.check_matrix(kernel, "a", a, unit_cols=True, fp8=True)
    host.check_matrix(kernel, "b", b, a.dtype, fp8=True)
    a_mode = b_mode = 0
    if a_scale is not None or b_scale is not None or a.dtype in host.FP8_DTYPES:
        a_mode, b_mode = host.check_a_scale(kernel, a, a_scale), host.check_b_scale(kernel, b, b_scale)
        if (a_mode == host.MX_SCALES) != (b_mode == host.MX_SCALES):
            host.fail(kernel, f"MX block scales on both operands or on neither, got a_scale {a_scale.dtype} and "
                              f"b_scale {b_scale.dtype}")
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k or b.device != a.device:
        host.fail(kernel, f"b must be [{k}, N] on {a.device}, got {list(b.shape)} on {b.device}")
    num_dest = host.table_size(dst_table)
    host.check_table(kernel, "dst_table", dst_table, num_dest, a.device)
    world_size = host.table_size(flag_table)
    host.check_table(kernel, "flag_table", flag_table, world_size, a.device)
    host.check_range(kernel, "rank", rank, 0, world_size)
    host.check_epoch(kernel, epoch, a.device)
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    if a_mode == host.MX_SCALES:
        host.check_mx_tile(kernel, bk)
    host.check_range(kernel, "block_rows", block_rows, 0, 1 << 31)
    if num_dest < 1 or m > num_dest * block_rows:
        host.fail(kernel, f"a's {m} rows do not fit {num_dest} blocks of {block_rows} rows")
    host.check_range(kernel, "num_chunks", num_chunks, 1, max(1, host.cdiv(block_rows, bm)) + 1)
    run = block_rows if rows_per_outer is None else rows_per_outer
    host.check_range(kernel, "rows_per_outer", run, 1, block_rows + 1)
    if block_rows % run or (run != block_rows and m != num_dest * block_rows):
        host.fail(kernel, f"rows_per_outer {run} must divide block_rows {block_rows}, with every block whole")
    if num_dest > 1 and (not isinstance(flag_stride, int) or flag_stride < num_chunks):
        host.fail(kernel, f"flag_stride {flag_stride!r} < num_chunks {num_chunks}: destinations' flags would overlap")
    if counters.dtype != torch.int32 or counters.numel() < num_dest * num_chunks or counters.device != a.device:
        host.fail(kernel, f"counters must be int32 of at least {num_dest * num_chunks} words on {a.device}, got "
                          f"{counters.dtype} [{counters.numel()}] on {counters.device}")
    matmul_scatter_kernel[(matmul_scatter_grid(num_dest, block_rows, n, bm, bn),)](
        a, b, host.scale_arg(a_scale, a_mode, a), host.scale_arg(b_scale, b_mode, b),
        dst_table, counters, flag_table, flag_stride,
        epoch, rank,
        m, n, k, block_rows, num_dest, num_chunks, run,
        a.stride(0),
        b.stride(0), b.stride(1),
        *host.scale_strides(b_scale, b_mode),
        n,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
        UPCAST=host.interpreted() and a.dtype == torch.bfloat16, A_SCALE=a_mode, B_SCALE=b_mode,
    )


def launch_reduce_chunks(out: torch.Tensor, src_table: torch.Tensor, flag_table: torch.Tensor, *, block_rows: int,
                         num_chunks: int, epoch: torch.Tensor, err: torch.Tensor, timeout_ns: int,
                         block: tuple[int, int],
                         abort: torch.Tensor | None = None, watchdog: bool = True) -> None:
    """The consumer on the current stream: ``out = sum_s src_s`` in source order, each chunk once every
    source's flag of it has reached `epoch`.

    Args:
        out: ``[M, N]`` (``M <= block_rows``: the valid rows of this rank's block).
        src_table: int64 ``[S]``: source ``s``'s ``[block_rows, N]`` row-major partial (16-byte aligned).
        flag_table: int64 ``[S]``: source ``s``'s flag of chunk 0 of this block (chunk ``c`` is the next ``c``-th word).
        block_rows, num_chunks: ``MB`` and ``NCH``, as the producers used them.
        epoch: int32 word on `out`'s device holding the value the flags must reach (`overlap.kernels.epoch_word`).
        err: int32 word (GPU: pinned host memory) where a wait that gives up records ``s + 1``; the caller reads it.
        timeout_ns: how long one wait may spin.
        block: ``(BLOCK_M, BLOCK_N)``; ``BLOCK_M`` the producers' (it sets the chunk of a row tile).
        abort, watchdog: as for `overlap.kernels.all_gather_matmul.launch_all_gather_matmul`.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, a tile size that is not a power of two >= 16.
    """
    kernel = "launch_reduce_chunks"
    host.check_matrix(kernel, "out", out)
    num_sources = host.table_size(src_table)
    host.check_table(kernel, "src_table", src_table, num_sources, out.device)
    host.check_table(kernel, "flag_table", flag_table, num_sources, out.device)
    host.check_word(kernel, "err", err)
    host.check_epoch(kernel, epoch, out.device)
    bm, bn = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn)
    rows, n = out.shape
    host.check_range(kernel, "block_rows", block_rows, rows, 1 << 31)
    host.check_range(kernel, "num_chunks", num_chunks, 1, max(1, host.cdiv(block_rows, bm)) + 1)
    interpreted = host.interpreted()
    abort = host.abort_word(kernel, abort, err, interpreted)
    with host.bounded(abort, timeout_ns, watchdog, interpreted):
        reduce_chunks_kernel[(reduce_chunks_grid(block_rows, n, bm, bn),)](
            out, src_table, flag_table,
            epoch, abort, err, timeout_ns,
            rows, n, block_rows, num_sources, num_chunks,
            n,
            out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, INTERPRETED=interpreted,
        )
