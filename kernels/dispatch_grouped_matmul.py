"""The fused grouped GEMM of `overlap.moe.dispatch_grouped_matmul` (the dispatch direction): tiles that wait for
the expert block they read.

Shapes (legend): ``L`` local experts; ``w_LKN`` the stacked expert weights (any strides, so ``w1`` and
the transposed views of the backward pass alike); rows are ``K`` wide, results ``N`` wide. Work is
described by a host-built tile table (one entry per ``BLOCK_M`` rows of one (source rank, expert)
block); program ``pid`` takes entry ``pid // tiles_n`` and column tile ``pid % tiles_n``. Building the
table on the host (counts are host values) keeps the kernels free of searches over ragged offsets.

`grouped_matmul_wait_kernel`. Entry ``(s, e, src_row, out_row, rows, flag)``: the rows arrived from source ``s``
into region ``src_table[s]`` of this rank's buffer. The tile waits (bounded, `overlap.kernels.flags.wait_flag`)
until ``s`` has released flag ``flag`` of its own pad (``flag_table[s]``), then multiplies by ``w[e]`` into
``out``. The column-0 tile also copies the rows it read into ``rows_ptr`` (the layer input the weight gradient
needs), so they are read once.

fp8 (the MoE dispatch's fp8 tokens, `overlap.ops.moe.fp8`): the rows are packed e4m3 tokens with their scales
(`overlap.ops.fp8_rows.Packed`, ``row_bytes`` a row, the scales from byte ``scale_offset``) and ``w`` is e4m3 with
its scales per expert: rowwise (a float32 per row and per column, in the tile's epilogue, `scale_tile`) or MX (e8m0
per 32 of K on both, in the K loop, `mx_matmul_tile`). The rows are not copied then (the caller copies the packed
rows, scales included, once the kernel is done).

Its host launcher (`launch_grouped_matmul_wait`) and the tile table it takes (`dispatch_tile_table`, over the
MoE slot layout of `overlap.kernels.slots`) follow the kernel; the MoE ops' ``fused`` strategy (and
`overlap.moe.combine`'s backward) and the GPU check call them.
"""

import torch
import triton
import triton.language as tl

from . import host, slots
from .flags import MX_SCALES, mx_matmul_tile, scale_tile, wait_flag


# Not specialized on: values that differ between ranks or calls (the sizes and strides that set the GEMM's
# vector loads stay specialized).
@triton.jit(do_not_specialize=["epoch_ptr", "abort_ptr", "err_ptr", "timeout_ns"])
def grouped_matmul_wait_kernel(
    # where the rows are (int64 address of each source's region in this rank's buffer), and every
    # rank's flag base (int64); the tile table (int32 [tiles, 6])
    src_table, flag_table, tile_table,
    # expert weights w [L, K, N] (fp8: their scales [L, 1, N] float32 or [L, K/32, N] e8m0 bytes); the output
    # [R, N]; the copy of the rows read [R, K]
    w_ptr, w_scale_ptr, out_ptr, rows_ptr,
    # protocol (the call's epoch is an int32 word on the device)
    epoch_ptr, abort_ptr, err_ptr, timeout_ns: tl.int64,
    # sizes (ROW_BYTES: a packed fp8 row's bytes, its scales from byte SCALE_OFF; K otherwise)
    N, K, ROW_BYTES, SCALE_OFF,
    # strides
    stride_we, stride_wk, stride_wn,
    stride_se, stride_sk, stride_sn,
    stride_om, stride_rm,
    # meta (B_SCALE: 0 plain, 2 rowwise fp8, 3 MX: `overlap.kernels.flags.MX_SCALES`)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
    UPCAST: tl.constexpr, B_SCALE: tl.constexpr,
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
    epoch = tl.load(epoch_ptr)
    wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, s, timeout_ns, INTERPRETED)

    # ---- GEMM tile, keeping a copy of the rows (plain rows) -----------------------------------
    src = tl.multiple_of(tl.load(src_table + s).to(tl.pointer_type(w_ptr.dtype.element_ty)), 16)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < rows
    a_rows = src + (src_row + offs_m).to(tl.int64) * ROW_BYTES
    w_e = w_ptr + e.to(tl.int64) * stride_we
    if B_SCALE == MX_SCALES:  # every 32 of K scaled in the loop by the row's and the column's e8m0 byte
        a_scale_rows = (a_rows + SCALE_OFF).to(tl.pointer_type(tl.uint8))
        b_cols = w_e + offs_n.to(tl.int64) * stride_wn
        b_scale_cols = w_scale_ptr + e.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
        acc = mx_matmul_tile(a_rows, a_scale_rows, b_cols, b_scale_cols, stride_sk, row_ok, offs_n < N, K,
                             stride_wk, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        a_ptrs = a_rows[:, None] + offs_k[None, :]
        r_ptrs = rows_ptr + (out_row + offs_m)[:, None].to(tl.int64) * stride_rm + offs_k[None, :]
        # 64-bit: a column of an expert's weight of 2^31 elements or more (column-major: n * stride_wn) passes 2^31
        b_ptrs = w_e + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kk * BLOCK_K
            a_mask = row_ok[:, None] & (offs_k[None, :] < k_left)
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            if B_SCALE == 0 and tile_n == 0:
                tl.store(r_ptrs, a, mask=a_mask)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            if UPCAST:  # the interpreter's bf16 dot is wrong (docs/toolchain.md): compute in fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * tl.cast(stride_wk, tl.int64)  # (tl.cast: the stride may be the constant 1)
        if B_SCALE:  # rowwise fp8: the row's float32 scale from its packed row, the column's of w[e]
            a_scale = tl.load((a_rows + SCALE_OFF).to(tl.pointer_type(tl.float32)), mask=row_ok,
                              other=0.0)
            acc = scale_tile(acc, a_scale, True, w_scale_ptr + e.to(tl.int64) * stride_se, offs_n, N, 2)

    out_ptrs = out_ptr + (out_row + offs_m)[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Host launcher
# ----------------------------------------------------------------------------------------------


def launch_grouped_matmul_wait(src_table: torch.Tensor, flag_table: torch.Tensor, tile_table: torch.Tensor,
                               w: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None, *, epoch: torch.Tensor,
                               err: torch.Tensor, timeout_ns: int, block: tuple[int, int, int],
                               abort: torch.Tensor | None = None, watchdog: bool = True,
                               num_warps: int | None = None, num_stages: int | None = None,
                               w_scale: torch.Tensor | None = None, scale_offset: int = 0,
                               row_bytes: int | None = None) -> None:
    """The dispatch direction on the current stream: for every tile table entry ``(s, e, src_row, out_row,
    rows, flag)``, wait until source ``s``'s flag ``flag`` reaches `epoch`, then ``out[out_row:] =
    region_s[src_row:] @ w[e]`` and copy the rows read into ``rows[out_row:]``. No launch for an empty table.

    Args:
        src_table: int64 ``[W]``: source ``s``'s region of this rank's buffer (rows ``K`` wide, row-major,
            16-byte aligned).
        flag_table: int64 ``[W]``: every rank's flag base.
        tile_table: int32 ``[tiles, 6]`` on the kernel's device, built for ``BLOCK_M`` (at most that many rows
            an entry; `overlap.ops.moe.tiles.dispatch_tile_table`).
        w: ``[L, K, N]`` expert weights, any strides. out: ``[R, N]``; rows: ``[R, K]``; both with unit
            column stride, `w`'s dtype.
        epoch, err, timeout_ns, abort, watchdog, num_warps, num_stages: as for
            `overlap.kernels.all_gather_matmul.launch_all_gather_matmul`.
        block: ``(BLOCK_M, BLOCK_N, BLOCK_K)``.
        w_scale: fp8 (`w` e4m3): its scales, float32 ``[L, 1, N]`` (rowwise) or e8m0 ``[L, K/32, N]`` (MX; any
            strides); the regions then hold packed rows of `row_bytes` bytes, each row's scales (a float32, or its
            ``K / 32`` e8m0 bytes) from byte `scale_offset` (`overlap.ops.fp8_rows.Packed`); `rows` is None (not
            copied) and `out` float32, bfloat16 or float16.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, a tile size that is not a power of two >= 16.
    """
    kernel = "launch_grouped_matmul_wait"
    host.check_matrix(kernel, "out", out, unit_cols=True)
    num_rows, n = out.shape
    b_mode = 0
    if w_scale is None:
        host.check_matrix(kernel, "rows", rows, out.dtype, unit_cols=True)
        k = rows.shape[1]
        if rows.shape[0] != num_rows or rows.device != out.device:
            host.fail(kernel, f"rows must be [{num_rows}, K] on {out.device}, got {list(rows.shape)} on {rows.device}")
        host.check_expert_weights(kernel, w, k, out)
        row_bytes = k
    else:
        if rows is not None:
            host.fail(kernel, "with w_scale the rows are not copied: pass rows=None")
        k = w.shape[1] if isinstance(w, torch.Tensor) and w.dim() == 3 else -1
        host.check_expert_weights(kernel, w, k, w)
        b_mode = host.check_expert_scales(kernel, w, w_scale)
        row_bytes = host.check_packed_rows(kernel, k, b_mode == host.MX_SCALES, block[2], scale_offset, row_bytes)
    if w.shape[2] != n:
        host.fail(kernel, f"w's {w.shape[2]} columns differ from out's {n}")
    host.address_tables(kernel, out.device, src_table=src_table, flag_table=flag_table)
    host.check_table(kernel, "tile_table", tile_table, None, out.device, torch.int32, 6)
    host.check_word(kernel, "err", err)
    host.check_epoch(kernel, epoch, out.device)
    bm, bn, bk = block
    host.check_tile(kernel, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    if not tile_table.shape[0]:
        return
    interpreted = host.interpreted()
    abort = host.abort_word(kernel, abort, err, interpreted)
    with host.bounded(abort, timeout_ns, watchdog, interpreted):
        scale = host.scale_arg(w_scale, b_mode, w)
        grouped_matmul_wait_kernel[(host.grouped_matmul_grid(tile_table.shape[0], n, bn),)](
            src_table, flag_table, tile_table,
            w, scale, out, out if rows is None else rows,
            epoch, abort, err, timeout_ns,
            n, k, row_bytes, scale_offset,
            w.stride(0), w.stride(1), w.stride(2),
            *(scale.stride() if b_mode else (0, 0, 0)),
            out.stride(0), out.stride(0) if rows is None else rows.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=interpreted,
            UPCAST=interpreted and out.dtype == torch.bfloat16, B_SCALE=b_mode,
            **host.meta_options(num_warps, num_stages, interpreted),
        )


def dispatch_tile_table(recv_counts: list[list[int]], rank: int, block_m: int, device: torch.device) -> torch.Tensor:
    """The tiles of rank `rank`'s dispatch-direction kernel, from its ``recv_counts[s][e]`` (rows source ``s``
    sends to local expert ``e``; `overlap.kernels.slots` has the slot layout).

    One entry per `block_m` rows of each (source, local expert) block, sources from this rank down (``r``,
    ``r - 1``, ...: our own rows first, then in the order the senders write us): ``(source, expert, first row
    in the source's region, first row in the output (expert order), rows, flag index)``, the flag being
    ``r * F + 1 + group of the expert`` in the source's pad.

    Returns:
        int32 ``[tiles, 6]`` on `device` (``[0, 6]`` where this rank receives no rows).
    """
    W, L = len(recv_counts), len(recv_counts[0]) if recv_counts else 0
    F, G = slots.flags_per_peer(W), slots.expert_groups(max(L, 1), W)
    within, offsets = slots.source_offsets(recv_counts), slots.expert_offsets(recv_counts)
    tiles = []
    for i in range(W):
        s = (rank - i) % W
        for e in range(L):
            c = recv_counts[s][e]
            lo, at = within[s][e], offsets[e][s]
            for t in range(0, c, block_m):
                tiles.append((s, e, lo + t, at + t, min(block_m, c - t), rank * F + 1 + slots.group_of(e, L, G)))
    return torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 6)
