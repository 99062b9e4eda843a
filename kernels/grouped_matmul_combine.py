"""The fused grouped GEMM of `overlap.moe.grouped_matmul_combine` (the combine direction): tiles that store their
results into the rank that owns the rows and signal.

Shapes (legend): ``L`` local experts; ``w_LKN`` the stacked expert weights (any strides, so ``w1`` and
the transposed views of the backward pass alike); rows are ``K`` wide, results ``N`` wide. Work is
described by a host-built tile table (one entry per ``BLOCK_M`` rows of one (source rank, expert)
block); program ``pid`` takes entry ``pid // tiles_n`` and column tile ``pid % tiles_n``. Building the
table on the host (counts are host values) keeps the kernels free of searches over ragged offsets.

`grouped_matmul_scatter_kernel`. Entry ``(s, e, y_row, dst_row, rows, flag, target)``: the tile multiplies
rows of ``y`` by ``w[e]`` and stores the result into this rank's region of rank ``s``'s buffer
(``dst_table[s]``), then counts itself in ``counters[flag]``; the ``target``-th tile of a flag publishes
``epoch`` in this rank's flag ``flag`` (CTA barrier, acq_rel count at system scope, release store: the same
pattern as `overlap.kernels.matmul_reduce_scatter`) and resets the counter.

Its host launcher (`launch_grouped_matmul_scatter`) and the tile table it takes (`combine_tile_table`, over the
MoE slot layout of `overlap.kernels.slots`) follow the kernel; the MoE ops' ``fused`` strategy (and
`overlap.moe.dispatch`'s backward) and the GPU check call them.
"""

import torch
import triton
import triton.language as tl

from . import host, slots
from .flags import count_and_release, matmul_tile


@triton.jit(do_not_specialize=["epoch_ptr", "rank"])
def grouped_matmul_scatter_kernel(
    # rows y [R, K] (row stride stride_ym), expert weights w [L, K, N], the tile table (int32 [tiles, 7])
    y_ptr, w_ptr, tile_table,
    # where source s's results go (int64 address of this rank's region in s's buffer), the flag
    # counters, every rank's flag base (int64; this rank's is used)
    dst_table, counters_ptr, flag_table,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, rank,
    # sizes
    N, K,
    # strides
    stride_ym,
    stride_we, stride_wk, stride_wn,
    stride_dm,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    # ---- which tile --------------------------------------------------------------------------
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    entry = tile_table + (pid // tiles_n) * 7
    tile_n = pid % tiles_n
    s = tl.load(entry)
    e = tl.load(entry + 1)
    y_row = tl.load(entry + 2)
    dst_row = tl.load(entry + 3)
    rows = tl.load(entry + 4)
    flag = tl.load(entry + 5)
    target = tl.load(entry + 6)

    # ---- GEMM tile -----------------------------------------------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < rows
    a_ptrs = y_ptr + (y_row + offs_m)[:, None].to(tl.int64) * stride_ym + offs_k[None, :]
    # 64-bit: a column of an expert's weight of 2^31 elements or more (column-major: n * stride_wn) passes 2^31
    b_ptrs = (w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None].to(tl.int64) * stride_wk
              + offs_n[None, :].to(tl.int64) * stride_wn)
    acc = matmul_tile(a_ptrs, b_ptrs, row_ok, offs_k, offs_n, N, K, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    # ---- store into the source rank's buffer ---------------------------------------------------
    dst = tl.multiple_of(tl.load(dst_table + s).to(tl.pointer_type(y_ptr.dtype.element_ty)), 16)
    out_ptrs = dst + (dst_row + offs_m)[:, None].to(tl.int64) * stride_dm + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))

    # ---- count the tile; the flag's last tile publishes it ---------------------------------------
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    epoch = tl.load(epoch_ptr)
    count_and_release(counters_ptr + flag, target, own_flags + flag, epoch)


# ----------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------


def launch_grouped_matmul_scatter(y: torch.Tensor, w: torch.Tensor, tile_table: torch.Tensor,
                                  dst_table: torch.Tensor, counters: torch.Tensor, flag_table: torch.Tensor, *,
                                  epoch: torch.Tensor, rank: int, block: tuple[int, int, int]) -> None:
    """The combine direction on the current stream: for every tile table entry ``(s, e, y_row, dst_row, rows,
    flag, target)``, store ``y[y_row:] @ w[e]`` at row ``dst_row`` of ``dst_table[s]`` and count the tile in
    ``counters[flag]``; the ``target``-th tile of a flag releases `epoch` in this rank's flag ``flag``. No
    launch for an empty table.

    Args:
        y: ``[R, K]`` with unit column stride. w: ``[L, K, N]``, any strides, `y`'s dtype.
        tile_table: int32 ``[tiles, 7]`` on `y`'s device (`overlap.ops.moe.layout.combine_tile_table`, built
            for ``BLOCK_M`` and ``N / BLOCK_N`` column tiles).
        dst_table: int64 ``[W]``: this rank's region (``N``-wide rows, 16-byte aligned) in rank ``s``'s buffer.
        counters: int32 flag counters of this rank, zero; the kernel leaves them at zero.
        flag_table: int64 ``[W]``: every rank's flag base (this rank's is written).
        epoch: int32 word on `y`'s device holding the value the flags get (`overlap.kernels.epoch_word`).
        rank: this rank.
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, a rank outside the tables, a tile size that is
            not a power of two >= 16.
    """
    kernel = "launch_grouped_matmul_scatter"
    host.check_matrix(kernel, "y", y, unit_cols=True)
    host.check_expert_weights(kernel, w, y.shape[1], y)
    world_size = host.address_tables(kernel, y.device, dst_table=dst_table, flag_table=flag_table)
    host.check_range(kernel, "rank", rank, 0, world_size)
    host.check_epoch(kernel, epoch, y.device)
    host.check_table(kernel, "tile_table", tile_table, None, y.device, torch.int32, 7)
    if counters.dtype != torch.int32 or counters.dim() != 1 or counters.device != y.device:
        host.fail(kernel, f"counters must be int32 [flags] on {y.device}, got {counters.dtype} "
                          f"{list(counters.shape)} on {counters.device}")
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    if not tile_table.shape[0]:
        return
    n = w.shape[2]
    grouped_matmul_scatter_kernel[(host.grouped_matmul_grid(tile_table.shape[0], n, bn),)](
        y, w, tile_table,
        dst_table, counters, flag_table,
        epoch, rank,
        n, y.shape[1],
        y.stride(0),
        w.stride(0), w.stride(1), w.stride(2),
        n,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=host.interpreted() and y.dtype == torch.bfloat16,
    )


def combine_tile_table(recv_counts: list[list[int]], rank: int, block_m: int, tiles_n: int,
                       device: torch.device) -> torch.Tensor:
    """The tiles of rank `rank`'s combine-direction kernel, from its ``recv_counts[s][e]`` (rows source ``s``
    sent to local expert ``e``; `overlap.kernels.slots` has the slot layout).

    One entry per `block_m` rows of each (source, local expert) block, sources from ``r + 1`` (peers first,
    our own rows last): ``(source, expert, first row of y (expert order), first row in the source's region
    (its send order), rows, flag index, tiles of the flag)``: the flag is ``s * F + 1 + group of the expert``
    in this rank's pad, and its tiles are its entries times `tiles_n` (the column tiles); the last one releases it.

    Returns:
        int32 ``[tiles, 7]`` on `device` (``[0, 7]`` where this rank holds no rows).
    """
    W, L = len(recv_counts), len(recv_counts[0]) if recv_counts else 0
    F, G = slots.flags_per_peer(W), slots.expert_groups(max(L, 1), W)
    within, offsets = slots.source_offsets(recv_counts), slots.expert_offsets(recv_counts)
    tiles, per_flag = [], {}
    for i in range(1, W + 1):
        s = (rank + i) % W
        for e in range(L):
            c = recv_counts[s][e]
            lo, at = within[s][e], offsets[e][s]
            flag = s * F + 1 + slots.group_of(e, L, G)
            for t in range(0, c, block_m):
                tiles.append([s, e, at + t, lo + t, min(block_m, c - t), flag, 0])
                per_flag[flag] = per_flag.get(flag, 0) + tiles_n
    for tile in tiles:
        tile[6] = per_flag[tile[5]]
    return torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 7)
