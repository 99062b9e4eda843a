"""Fused MoE kernels: grouped GEMMs whose tiles wait for the expert block they read, or store their
results into the rank that owns the rows and signal.

Shapes (legend): ``L`` local experts; ``w_LKN`` the stacked expert weights (any strides, so ``w1`` and
the transposed views of the backward pass alike); rows are ``K`` wide, results ``N`` wide. Work is
described by a host-built tile table (one entry per ``BLOCK_M`` rows of one (source rank, expert)
block); program ``pid`` takes entry ``pid // tiles_n`` and column tile ``pid % tiles_n``. Building the
table on the host (counts are host values) keeps the kernels free of searches over ragged offsets.

`grouped_matmul_wait_kernel` (dispatch direction). Entry ``(s, e, src_row, out_row, rows, flag)``:
the rows arrived from source ``s`` into region ``src_table[s]`` of this rank's buffer. The tile waits
(bounded, `overlap.kernels.flags.wait_flag`) until ``s`` has released flag ``flag`` of its own pad
(``flag_table[s]``), then multiplies by ``w[e]`` into ``out``. The column-0 tile also copies the rows
it read into ``rows_ptr`` (the layer input the weight gradient needs), so they are read once.

`grouped_matmul_scatter_kernel` (combine direction). Entry ``(s, e, y_row, dst_row, rows, flag,
target)``: the tile multiplies rows of ``y`` by ``w[e]`` and stores the result into this rank's region
of rank ``s``'s buffer (``dst_table[s]``), then counts itself in ``counters[flag]``; the ``target``-th
tile of a flag publishes ``epoch`` in this rank's flag ``flag`` (CTA barrier, acq_rel count at system
scope, release store: the same pattern as `overlap.kernels.mm_rs`) and resets the counter.
"""

import triton
import triton.language as tl

from .flags import count_and_release, matmul_tile, wait_flag


@triton.jit
def grouped_matmul_wait_kernel(
    # where the rows are (int64 address of each source's region in this rank's buffer), and every
    # rank's flag base (int64); the tile table (int32 [tiles, 6])
    src_table, flag_table, tile_table,
    # expert weights w [L, K, N]; the output [R, N]; the copy of the rows read [R, K]
    w_ptr, out_ptr, rows_ptr,
    # protocol
    epoch, abort_ptr, err_ptr, timeout_ns,
    # sizes
    N, K,
    # strides
    stride_we, stride_wk, stride_wn,
    stride_om, stride_rm,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # ---- which tile --------------------------------------------------------------------------
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    entry = tile_table + (pid // tiles_n) * 6
    tile_n = pid % tiles_n
    s = tl.load(entry)
    e = tl.load(entry + 1)
    src_row = tl.load(entry + 2)
    out_row = tl.load(entry + 3)
    rows = tl.load(entry + 4)
    flag = tl.load(entry + 5)

    # ---- wait for the block's flag (acquire: the rows are visible after it) -------------------
    flag_ptr = tl.load(flag_table + s).to(tl.pointer_type(tl.int32)) + flag
    wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, s, timeout_ns, INTERPRETED)

    # ---- GEMM tile, keeping a copy of the rows ------------------------------------------------
    src = tl.multiple_of(tl.load(src_table + s).to(tl.pointer_type(out_ptr.dtype.element_ty)), 16)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < rows
    a_ptrs = src + (src_row + offs_m)[:, None].to(tl.int64) * K + offs_k[None, :]
    r_ptrs = rows_ptr + (out_row + offs_m)[:, None].to(tl.int64) * stride_rm + offs_k[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        a_mask = row_ok[:, None] & (offs_k[None, :] < k_left)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if tile_n == 0:
            tl.store(r_ptrs, a, mask=a_mask)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (docs/design.md): compute in fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk

    out_ptrs = out_ptr + (out_row + offs_m)[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def grouped_matmul_scatter_kernel(
    # rows y [R, K] (row stride stride_ym), expert weights w [L, K, N], the tile table (int32 [tiles, 7])
    y_ptr, w_ptr, tile_table,
    # where source s's results go (int64 address of this rank's region in s's buffer), the flag
    # counters, every rank's flag base (int64; this rank's is used)
    dst_table, counters_ptr, flag_table,
    # protocol
    epoch, rank,
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
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = matmul_tile(a_ptrs, b_ptrs, row_ok, offs_k, offs_n, N, K, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    # ---- store into the source rank's buffer ---------------------------------------------------
    dst = tl.multiple_of(tl.load(dst_table + s).to(tl.pointer_type(y_ptr.dtype.element_ty)), 16)
    out_ptrs = dst + (dst_row + offs_m)[:, None].to(tl.int64) * stride_dm + offs_n[None, :]
    tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))

    # ---- count the tile; the flag's last tile publishes it ---------------------------------------
    own_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    count_and_release(counters_ptr + flag, target, own_flags + flag, epoch)
