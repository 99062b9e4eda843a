"""Fused GEMM + all-to-all (`matmul_all_to_all`, DeepSpeed-Ulysses sequence parallelism): tiles store each
destination's columns of the product straight into its slot and signal per chunk; a second kernel on the receiver
copies the blocks out as their chunks arrive.

Shapes (legend): ``W`` ranks, ``m`` rows on this rank (its part of the sequence), ``K`` inner dim, ``C`` columns per
destination (its heads). The local product ``a_mK @ b_K[W*C]`` is cut into ``W`` column blocks, block ``d`` (columns
``d*C ... (d+1)*C``) belonging to rank ``d``. Every rank's slot holds ``W`` regions of ``[m, C]`` row-major
(`overlap.kernels.slots.region_bytes` each, 16-byte aligned), region ``s`` what source ``s`` sent. ``NCH`` chunks per
block, each a run of whole row tiles: row tile ``t`` (of ``BLOCK_M`` rows, ``tiles_m = cdiv(max(m, 1), BLOCK_M)``) is
in chunk ``t * NCH // tiles_m``. Both kernels use the same ``BLOCK_M``, so a copied tile lies in exactly one chunk.

`matmul_all_to_all_kernel` (the producer). Program ids are destination-major, visiting destinations from
``rank + 1`` (the peers' blocks first, this rank's own last, spreading the writers over the receivers, as
`overlap.kernels.matmul_reduce_scatter`'s scatter). A tile computes ``a[rows] @ b[:, d*C + cols]`` in fp32, stores it
in `a`'s dtype at ``dst_table[d] + row * C + col`` (this rank's region in ``d``'s slot), then counts itself in
``counters[d * NCH + chunk]``; the tile that completes a chunk publishes ``epoch`` in this rank's ready flag
``flag_table[rank][d * FLAG_STRIDE + chunk]`` (`overlap.kernels.flags.count_and_release`: CTA barrier, acq_rel count
at system scope, the last tile resets the counter and release-stores the flag). With ``m == 0`` one row tile of
masked rows still runs per destination, so every flag is published.

`gather_blocks_kernel` (the consumer). ``out [W, m, C]``: tile ``(s, rows, cols)`` waits until source ``s``'s flag of
its chunk (``flag_table[s] + chunk``: source ``s``'s flags for this rank start at its flag ``rank * F``) reaches the
call's epoch, then copies the tile from ``src_table[s]`` (region ``s`` of this rank's slot). Waits are bounded as in
`overlap.kernels.flags.wait_flag`: a wait that gives up records ``s + 1`` in the error word.

No fp8 (the sequence-parallel family has none). Their host launchers (`launch_matmul_all_to_all`,
`launch_gather_blocks`; the chunk count is `overlap.kernels.matmul_reduce_scatter.chunk_count`'s, with the ``m`` rows
as the block) follow the kernels; `overlap.matmul_all_to_all`'s ``fused`` strategy calls them.
"""

import torch
import triton
import triton.language as tl

from . import host
from .flags import count_and_release, grouped_tile, matmul_tile, wait_flag
from .matmul_reduce_scatter import chunk_count

__all__ = ["chunk_count", "gather_blocks_grid", "gather_blocks_kernel", "launch_gather_blocks",
           "launch_matmul_all_to_all", "matmul_all_to_all_grid", "matmul_all_to_all_kernel"]


# Not specialized on: values that differ between ranks or calls, and counts that only mask rows or index flags (C, K
# and the strides set the GEMM's vector loads and the stores' widths: they stay specialized).
@triton.jit(do_not_specialize=["FLAG_STRIDE", "epoch_ptr", "rank", "M", "NUM_DEST", "NCH"])
def matmul_all_to_all_kernel(
    # the local operands: a [M, K] row-major (contiguous rows), b [K, NUM_DEST * C] any strides
    a_ptr, b_ptr,
    # where block d goes (int64 addresses, one per destination), chunk counters, every rank's flag base (int64;
    # this rank's is used), flags per destination in the flag area
    dst_table, counters_ptr, flag_table, FLAG_STRIDE,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, rank,
    # sizes: M rows, C columns per destination, K, NUM_DEST destinations, NCH chunks per destination
    M, C, K, NUM_DEST, NCH,
    # strides (the regions are row-major [M, C]: row stride C)
    stride_am,
    stride_bk, stride_bn,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # ---- which tile: destination-major, destinations from rank + 1 ----------------------------
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(tl.maximum(M, 1), BLOCK_M)  # (m == 0: one tile of masked rows, so the flags are published)
    tiles_n = tl.cdiv(C, BLOCK_N)
    tiles_per_block = tiles_m * tiles_n
    step = pid // tiles_per_block
    d = (rank + 1 + step) % NUM_DEST
    tile_m, tile_n = grouped_tile(pid % tiles_per_block, tiles_m, tiles_n, GROUP_M)

    # ---- GEMM tile: a's rows times block d's columns of b ---------------------------------------
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    # 64-bit: M*K, M*C and a column of a weight of 2^31 elements or more (column-major, w.t(): n * stride_bn) pass
    # 2^31 elements
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    cols = (d * C + offs_n).to(tl.int64)  # block d's columns of b (d * C < W * C: b's columns)
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn
    acc = matmul_tile(a_ptrs, b_ptrs, row_ok, offs_k, offs_n, C, K, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    # ---- store into this rank's region of d's slot ------------------------------------------
    dst = tl.multiple_of(tl.load(dst_table + d).to(tl.pointer_type(a_ptr.dtype.element_ty)), 16)
    out_ptrs = dst + offs_m[:, None].to(tl.int64) * C + offs_n[None, :]
    tl.store(out_ptrs, acc.to(a_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < C))

    # ---- count the tile; the chunk's last tile publishes the flag ----------------------------
    chunk = tile_m * NCH // tiles_m
    target = (tl.cdiv((chunk + 1) * tiles_m, NCH) - tl.cdiv(chunk * tiles_m, NCH)) * tiles_n
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    epoch = tl.load(epoch_ptr)
    count_and_release(counters_ptr + d * NCH + chunk, target, own_flags + d * FLAG_STRIDE + chunk, epoch)


# Not specialized on: values that differ between ranks or calls, and the rows (they only mask). C and the output's
# strides (``m * C`` between sources: a multiple of 16 wherever C is) stay specialized: they set the copy's widths.
@triton.jit(do_not_specialize=["epoch_ptr", "abort_ptr", "err_ptr", "timeout_ns", "M", "NUM_SRC", "NCH"])
def gather_blocks_kernel(
    # output [NUM_SRC, M, C] (unit column stride), sources: int64 tables of region addresses and flag addresses
    out_ptr, src_table, flag_table,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, abort_ptr, err_ptr, timeout_ns: tl.int64,
    # sizes: M rows, C columns, NUM_SRC sources, NCH chunks
    M, C, NUM_SRC, NCH,
    # the output's strides between sources and between rows (the regions are row-major [M, C])
    stride_os, stride_om,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(tl.maximum(M, 1), BLOCK_M)
    tiles_n = tl.cdiv(C, BLOCK_N)
    tiles_per_src = tiles_m * tiles_n
    s = pid // tiles_per_src
    tile = pid % tiles_per_src
    tile_m = tile // tiles_n
    tile_n = tile % tiles_n
    chunk = tile_m * NCH // tiles_m
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < C)

    # ---- wait for source s's chunk, then copy the tile out of its region ----------------------
    epoch = tl.load(epoch_ptr)
    flag_ptr = tl.load(flag_table + s).to(tl.pointer_type(tl.int32)) + chunk
    wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, s, timeout_ns, INTERPRETED)
    src = tl.multiple_of(tl.load(src_table + s).to(tl.pointer_type(out_ptr.dtype.element_ty)), 16)
    x = tl.load(src + offs_m[:, None].to(tl.int64) * C + offs_n[None, :], mask=mask)
    out_ptrs = (out_ptr + s.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om
                + offs_n[None, :])
    tl.store(out_ptrs, x, mask=mask)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------

GROUP_M = 8  # row tiles that sweep the columns together (L2 reuse of b's block)


def matmul_all_to_all_grid(world_size: int, rows: int, cols: int, block_m: int, block_n: int) -> int:
    """Programs of one `launch_matmul_all_to_all`: every destination's ``[rows, cols]`` block in tiles (one row tile
    where ``rows == 0``, so the flags are published)."""
    return world_size * host.cdiv(max(rows, 1), block_m) * host.cdiv(cols, block_n)


def gather_blocks_grid(world_size: int, rows: int, cols: int, block_m: int, block_n: int) -> int:
    """Programs of one `launch_gather_blocks`: every source's ``[rows, cols]`` region in tiles."""
    return world_size * host.cdiv(max(rows, 1), block_m) * host.cdiv(cols, block_n)


def launch_matmul_all_to_all(a: torch.Tensor, b: torch.Tensor, dst_table: torch.Tensor, counters: torch.Tensor,
                             flag_table: torch.Tensor, *, num_chunks: int, flag_stride: int, epoch: torch.Tensor,
                             rank: int, block: tuple[int, int, int]) -> None:
    """The producer on the current stream: ``a @ b`` cut into ``W`` column blocks of ``C = b.shape[1] / W``, block
    ``d`` stored at ``dst_table[d]`` and released per chunk in this rank's flags ``d * flag_stride + chunk``.

    Args:
        a: ``[m, K]`` this rank's rows, unit column stride (``m`` may be 0: every flag is still published).
        b: ``[K, W * C]``, any strides, `a`'s dtype (float32, bfloat16 or float16); column block ``d`` is
            destination ``d``'s.
        dst_table: int64 ``[W]``: where block ``d`` goes (this rank's 16-byte aligned ``[m, C]`` row-major region in
            ``d``'s slot).
        counters: int32, at least ``W * num_chunks`` words, zero; the kernel leaves them at zero.
        flag_table: int64 ``[W]``: every rank's flag base (this rank's is written).
        num_chunks: ``NCH`` (`chunk_count` with ``m`` rows); flag_stride: flags per destination (at least
            `num_chunks` where ``W > 1``; the slots' `overlap.kernels.slots.flags_per_peer`).
        epoch: int32 word on `a`'s device holding the value the flags get (`overlap.kernels.epoch_word`).
        rank: this rank (destinations are visited from ``rank + 1``).
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``; `launch_gather_blocks` must use the same ``BLOCK_M``.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, columns that do not split into ``W`` blocks, flags of
            two destinations that overlap, a rank outside the tables, a tile size that is not a power of two >= 16.
    """
    kernel = "launch_matmul_all_to_all"
    host.check_matrix(kernel, "a", a, unit_cols=True)
    host.check_matrix(kernel, "b", b, a.dtype)
    (m, k), cols = a.shape, b.shape[1]
    if b.shape[0] != k or b.device != a.device:
        host.fail(kernel, f"b must be [{k}, W*C] on {a.device}, got {list(b.shape)} on {b.device}")
    world_size = host.table_size(dst_table)
    host.check_table(kernel, "dst_table", dst_table, world_size, a.device)
    host.check_table(kernel, "flag_table", flag_table, world_size, a.device)
    if world_size < 1 or cols < world_size or cols % world_size:
        host.fail(kernel, f"b's {cols} columns do not split into {world_size} blocks of C >= 1 columns")
    c = cols // world_size
    host.check_range(kernel, "rank", rank, 0, world_size)
    host.check_epoch(kernel, epoch, a.device)
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    host.check_range(kernel, "m", m, 0, 1 << 31)
    host.check_range(kernel, "num_chunks", num_chunks, 1, host.cdiv(max(m, 1), bm) + 1)
    if world_size > 1 and (not isinstance(flag_stride, int) or isinstance(flag_stride, bool)
                           or flag_stride < num_chunks):
        host.fail(kernel, f"flag_stride {flag_stride!r} < num_chunks {num_chunks}: destinations' flags would overlap")
    if counters.dtype != torch.int32 or counters.numel() < world_size * num_chunks or counters.device != a.device:
        host.fail(kernel, f"counters must be int32 of at least {world_size * num_chunks} words on {a.device}, got "
                          f"{counters.dtype} [{counters.numel()}] on {counters.device}")
    matmul_all_to_all_kernel[(matmul_all_to_all_grid(world_size, m, c, bm, bn),)](
        a, b,
        dst_table, counters, flag_table, flag_stride if world_size > 1 else num_chunks,
        epoch, rank,
        m, c, k, world_size, num_chunks,
        a.stride(0),
        b.stride(0), b.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
        UPCAST=host.interpreted() and a.dtype == torch.bfloat16,
    )


def launch_gather_blocks(out: torch.Tensor, src_table: torch.Tensor, flag_table: torch.Tensor, *, num_chunks: int,
                         epoch: torch.Tensor, err: torch.Tensor, timeout_ns: int, block: tuple[int, int],
                         abort: torch.Tensor | None = None, watchdog: bool = True) -> None:
    """The consumer on the current stream: ``out[s] = region_s`` for every source ``s``, each tile once source
    ``s``'s flag of its chunk has reached `epoch`.

    Args:
        out: ``[W, m, C]`` with unit column stride (`a`'s dtype on the producers).
        src_table: int64 ``[W]``: region ``s`` of this rank's slot (source ``s``'s ``[m, C]`` row-major block,
            16-byte aligned).
        flag_table: int64 ``[W]``: source ``s``'s flag of chunk 0 for this rank (its flag ``rank * F``; chunk ``c``
            is the ``c``-th word after it).
        num_chunks: ``NCH``, as the producers used it.
        epoch: int32 word on `out`'s device holding the value the flags must reach (`overlap.kernels.epoch_word`).
        err: int32 word (GPU: pinned host memory) where a wait that gives up records ``s + 1``; the caller reads it.
        timeout_ns: how long one wait may spin.
        block: ``(BLOCK_M, BLOCK_N)``; ``BLOCK_M`` the producers' (it sets the chunk of a row tile).
        abort, watchdog: as for `overlap.kernels.all_gather_matmul.launch_all_gather_matmul`.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, a tile size that is not a power of two >= 16.
    """
    kernel = "launch_gather_blocks"
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.dtype not in host.DTYPES:
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        host.fail(kernel, f"out must be a [W, m, C] tensor of {host.DTYPES}, got {got}")
    world_size, m, c = out.shape
    if c > 1 and out.stride(2) != 1:
        host.fail(kernel, f"out must have unit column stride, got strides {out.stride()}")
    host.check_table(kernel, "src_table", src_table, world_size, out.device)
    host.check_table(kernel, "flag_table", flag_table, world_size, out.device)
    if world_size < 1 or c < 1:
        host.fail(kernel, f"out must have at least one source and one column, got {list(out.shape)}")
    host.check_word(kernel, "err", err)
    host.check_epoch(kernel, epoch, out.device)
    bm, bn = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn)
    host.check_range(kernel, "m", m, 0, 1 << 31)
    host.check_range(kernel, "num_chunks", num_chunks, 1, host.cdiv(max(m, 1), bm) + 1)
    interpreted = host.interpreted()
    abort = host.abort_word(kernel, abort, err, interpreted)
    with host.bounded(abort, timeout_ns, watchdog, interpreted):
        gather_blocks_kernel[(gather_blocks_grid(world_size, m, c, bm, bn),)](
            out, src_table, flag_table,
            epoch, abort, err, timeout_ns,
            m, c, world_size, num_chunks,
            out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, INTERPRETED=interpreted,
        )
