"""Primitives shared by the kernels: a bounded acquire-wait, a count-then-release signal, a GEMM tile (plain, fp8 with
its epilogue's scales, or MX with block scales in its K loop), and the two steps every gather kernel takes before its
GEMM (which tile of which rank's block, wait for that rank's buffer).

Flags are int32 words holding a call's epoch; "reached" is a non-negative int32 difference, so
epochs compare correctly modulo 2^32 (as in ``overlap._C``). System scope throughout: the other
side may be another GPU (through a peer mapping) or another process on the host. A call's epoch
reaches the kernels as a device word (``epoch_ptr``, read once per program), never as an int
argument: Triton would compile a new variant where it is 1 or a multiple of 16.
"""

import triton
import triton.language as tl

from .compat import fix_interpreter_index

fix_interpreter_index()  # before any kernel runs: every kernel file imports this module first

#: how often a spinning wait reads the error word (host memory on GPUs), nanoseconds; also its first read
ERR_POLL_NS: tl.constexpr = tl.constexpr(1_000_000)
#: an MX block: the elements along K that share one e8m0 scale (`overlap.ops.fp8.MX_BLOCK`)
MX_K: tl.constexpr = tl.constexpr(32)
#: a scale mode (`A_SCALE`, `B_SCALE` of the GEMM kernels): MX blocks of `MX_K` along K (1: one value, 2: one per row
#: of a or column of b)
MX_SCALES: tl.constexpr = tl.constexpr(3)


@triton.jit
def cta_any(cond):
    """1 in every thread of the CTA when `cond` (an int or bool scalar) is non-zero in any of them, else 0.

    One ``bar.red.or.pred``: a barrier that also reduces, so its result is the same in every warp by
    construction. Every thread must reach it (never call it under a condition that differs between
    threads). GPUs only (inline PTX).
    """
    return tl.inline_asm_elementwise(
        "{ .reg .pred ovl_in, ovl_out; setp.ne.s32 ovl_in, $1, 0; bar.red.or.pred ovl_out, 0, ovl_in; "
        "selp.s32 $0, 1, 0, ovl_out; }",
        "=r,r", [cond.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, src, timeout_ns, INTERPRETED: tl.constexpr):
    """Spin until ``*flag_ptr`` reaches `epoch`; past the deadline record ``src + 1`` in ``*err_ptr``.

    The deadline is per wait; once any wait of the call has given up (``*err_ptr`` set, polled once a
    millisecond after the first), every other wait stops too, so a dead peer costs one timeout (and at most a
    millisecond more), not one per tile and source.

    Every warp of the CTA leaves the loop on the same iteration (GPUs): each iteration holds barriers
    (the flag's one-thread acquire reaches the other threads through shared memory) and the GEMM after
    the wait reuses that shared memory, so a warp that left early or late would overwrite tile data,
    read tile data as the flag, or wait at a barrier for ever. The flag value is that broadcast (the
    same in every thread); the clock and the error word are read by each thread, so whether to stop is
    decided by `cta_any` over the whole CTA.
    """
    # Epochs wrap modulo 2^32, so "reached" is a non-negative int32 difference (as in overlap._C).
    # System scope: the producer may be another GPU (or the host) writing through a peer mapping.
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if INTERPRETED:  # one thread: the host watchdog's abort word bounds the spin (no clock here)
        aborted = tl.load(abort_ptr, volatile=True)
        while ((ready - epoch) < 0) & (aborted == 0):
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            aborted = tl.load(abort_ptr, volatile=True)
    else:
        start = tl.extra.cuda.globaltimer()
        # The error word is host memory on GPUs: read over PCIe, so not in a wait's first millisecond and then at
        # most once a millisecond per thread (a spinning grid reading it every iteration floods the bus).
        next_poll = start + ERR_POLL_NS
        stop = ((ready - epoch) >= 0).to(tl.int32)  # (the broadcast value: the same in every thread)
        while stop == 0:
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            now = tl.extra.cuda.globaltimer()
            poll = now >= next_poll
            failed = tl.load(err_ptr, mask=poll, other=0, volatile=True)
            next_poll = tl.where(poll, now + ERR_POLL_NS, next_poll)
            stop = cta_any(((ready - epoch) >= 0) | ((now - start) >= timeout_ns) | (failed != 0))
    if (ready - epoch) < 0:  # (the broadcast value again: every thread takes the same branch)
        # A plain store: the word is pinned host memory on GPUs, where a system-scope atomic over PCIe is not
        # atomic with respect to the host; any failing source will do (the host names one peer).
        tl.store(err_ptr, src + 1)


@triton.jit
def count_and_release(counter_ptr, target, flag_ptr, epoch):
    """Count this tile in ``*counter_ptr``; the `target`-th tile resets the counter (so the next call
    finds it at zero) and publishes `epoch` in ``*flag_ptr``.

    Every thread's stores are issued before the CTA barrier; the acq_rel count (system scope: the
    stores went to a peer) orders them before the last tile's release of the flag (the usual
    "barrier, then one thread releases" pattern).
    """
    tl.debug_barrier()
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if seen == target - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def matmul_tile(a_ptrs, b_ptrs, row_ok, offs_k, offs_n, N, K, stride_bk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``a @ b`` in fp32: `a_ptrs` at the tile's rows (unit column
    stride, rows past `row_ok` masked), `b_ptrs` at its columns, both at k = 0. The K step of `b_ptrs`
    (``BLOCK_K * stride_bk``) is computed in 64 bits: a row-major weight's passes 2^31 elements with more
    than ``2^31 / BLOCK_K`` columns."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (docs/toolchain.md): compute in fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * tl.cast(stride_bk, tl.int64)  # (tl.cast: the stride may be the constant 1)
    return acc


@triton.jit
def scale_tile(acc, a_scale, A_ROWWISE: tl.constexpr, b_scale_ptr, offs_n, N, B_SCALE: tl.constexpr):
    """An fp8 tile's epilogue: ``acc * a_scale * b_scale`` (`a_scale`: the tile's rows' scales, ``[BLOCK_M]``, where
    ``A_ROWWISE``, else one value; ``B_SCALE`` 1: one value at `b_scale_ptr`, 2: one per column, ``[N]``). MX tiles
    are scaled in their K loop instead (`mx_matmul_tile`)."""
    if A_ROWWISE:
        acc = acc * a_scale[:, None]
    else:
        acc = acc * a_scale
    if B_SCALE == 2:
        acc = acc * tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    else:
        acc = acc * tl.load(b_scale_ptr)
    return acc


@triton.jit
def e8m0_to_float(e):
    """e8m0 scales (uint8 exponent bytes) as float32 ``2^(e - 127)``: the byte is a float32's exponent field. 0 is
    ``2^-127``, a float32 subnormal (mantissa ``0x400000``); 255 is NaN (exponent 255 with that mantissa bit)."""
    e32 = e.to(tl.int32)
    bits = (e32 << 23) | tl.where((e32 == 0) | (e32 == 255), 0x400000, 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mx_matmul_tile(a_rows, a_scale_rows, b_cols, b_scale_cols, stride_bsk, row_ok, col_ok, K, stride_bk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of an MX product in fp32: every 32-wide block of K is an fp8 dot scaled by its
    row's and its column's e8m0 scale of that block (Hopper has no block-scaled MMA: each block's wgmma result is
    scaled and added in fp32, which is also the dequantized product's value up to the accumulation order).

    `a_rows`: ``[BLOCK_M]`` pointers to the tile's rows at k = 0 (e4m3, unit column stride); `a_scale_rows`:
    ``[BLOCK_M]`` uint8 pointers to each row's scale of block 0, the next block's one byte on; `b_cols`:
    ``[BLOCK_N]`` pointers to the columns at k = 0, `stride_bk` between k; `b_scale_cols`: ``[BLOCK_N]`` uint8
    pointers to each column's scale of block 0, `stride_bsk` between blocks. ``K`` is a multiple of 32; ``BLOCK_K``
    (a multiple of 32) is the K step of the loop, each step ``BLOCK_K / 32`` blocks (the last step's blocks past K
    masked). Masked rows and columns load zeros and the scale 1."""
    offs_k = tl.arange(0, MX_K)
    a_ptrs = a_rows[:, None] + offs_k[None, :]
    b_ptrs = b_cols[None, :] + offs_k[:, None].to(tl.int64) * stride_bk
    block_b = MX_K * tl.cast(stride_bk, tl.int64)  # (tl.cast: the stride may be the constant 1)
    last = K // MX_K - 1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        for j in tl.static_range(BLOCK_K // MX_K):
            blk = kk * (BLOCK_K // MX_K) + j
            k_left = K - blk * MX_K  # (<= 0: a block past K, all masked: its dot is zero)
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
            # a block past K reads the last block's scales (in bounds: they multiply its zero dot)
            at = tl.minimum(blk, last).to(tl.int64)
            a_scale = e8m0_to_float(tl.load(a_scale_rows + at, mask=row_ok, other=127))
            b_scale = e8m0_to_float(tl.load(b_scale_cols + at * tl.cast(stride_bsk, tl.int64), mask=col_ok,
                                            other=127))
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
            a_ptrs += MX_K
            b_ptrs += block_b
    return acc


@triton.jit
def rank_major_tile(pid, rank, world_size, M, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(src, tile_m, tile_n)`` of program `pid` in a launch over every rank's ``[M, N]`` block of the output,
    rank-major from this rank's own block (``rank``, ``rank + 1``, ...), ``BLOCK_M x BLOCK_N`` tiles.

    Own block first: its tiles need no peer. Then ``rank + 1`` on: every rank publishes at about the same
    time, and starting at the next rank spreads the readers over the producers. Within a block, groups of
    `GROUP_M` row tiles sweep the columns together, so the tiles of the operand they share stay in L2.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_block = tiles_m * tiles_n
    src = (rank + pid // tiles_per_block) % world_size
    tile = pid % tiles_per_block
    tile_m, tile_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
    return src, tile_m, tile_n


@triton.jit
def grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """``(tile_m, tile_n)`` of output tile number `tile` of a ``tiles_m x tiles_n`` grid, `GROUP_M` row tiles
    sweeping the columns together (so the tiles of the operand they share stay in L2)."""
    group_size = GROUP_M * tiles_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % group_size) % rows_in_group
    tile_n = (tile % group_size) // rows_in_group
    return tile_m, tile_n


@triton.jit
def wait_rank_buffer(ptr_table, flag_table, src, epoch_ptr, abort_ptr, err_ptr, timeout_ns, like_ptr,
                     INTERPRETED: tl.constexpr):
    """Wait (`wait_flag`) until rank `src`'s ready flag (``flag_table[src]``) reaches the call's epoch
    (``*epoch_ptr``), then return rank `src`'s buffer (``ptr_table[src]``) as a pointer to `like_ptr`'s
    element type.

    The acquire in the wait orders the caller's loads from the buffer after the producer's stores. Buffers
    are 16-byte aligned (`overlap.symm` asserts it); saying so lets the compiler use wide, pipelined loads
    for a pointer that comes out of a table.
    """
    epoch = tl.load(epoch_ptr)
    flag_ptr = tl.load(flag_table + src).to(tl.pointer_type(tl.int32))
    wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, src, timeout_ns, INTERPRETED)
    return tl.multiple_of(tl.load(ptr_table + src).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)
