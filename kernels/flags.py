"""Primitives shared by the kernels: a bounded acquire-wait, a count-then-release signal, a GEMM tile.

Flags are int32 words holding a call's epoch; "reached" is a non-negative int32 difference, so
epochs compare correctly modulo 2^32 (as in ``overlap._C``). System scope throughout: the other
side may be another GPU (through a peer mapping) or another process on the host.
"""

import triton
import triton.language as tl


@triton.jit
def wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, src, timeout_ns, INTERPRETED: tl.constexpr):
    """Spin until ``*flag_ptr`` reaches `epoch`; past the deadline record ``src + 1`` in ``*err_ptr``.

    The deadline is per wait; once any wait of the call has given up (``*err_ptr`` set, polled after
    the first millisecond), every other wait stops too, so a dead peer costs one timeout, not one per
    tile and source.
    """
    # Epochs wrap modulo 2^32, so "reached" is a non-negative int32 difference (as in overlap._C).
    # System scope: the producer may be another GPU (or the host) writing through a peer mapping.
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if INTERPRETED:
        aborted = tl.load(abort_ptr, volatile=True)
        while ((ready - epoch) < 0) & (aborted == 0):
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            aborted = tl.load(abort_ptr, volatile=True)
    else:
        start = tl.extra.cuda.globaltimer()
        now = start
        failed = ready * 0
        while ((ready - epoch) < 0) & (now - start < timeout_ns) & (failed == 0):
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            now = tl.extra.cuda.globaltimer()
            if now - start > 1_000_000:
                failed = tl.load(err_ptr, volatile=True)
    if (ready - epoch) < 0:
        # The host reads this word (pinned memory on GPUs): system scope.
        tl.atomic_max(err_ptr, src + 1, scope="sys")


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
    stride, rows past `row_ok` masked), `b_ptrs` at its columns, both at k = 0."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (docs/design.md): compute in fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc
