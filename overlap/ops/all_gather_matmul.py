"""all_gather_matmul: ``all_gather(a, dim=0) @ b``, with the gather hidden behind the GEMM.

Problem. In a column-parallel layer with sequence parallelism every rank holds ``a_MK`` (its
slice of the sequence) and a column shard ``b_KN`` of the weight; the layer needs
``[a_0; a_1; ...; a_{W-1}] @ b``. Gathering first and multiplying after leaves the GEMM idle
during the gather. Each rank's block of output rows only needs that rank's chunk, so the GEMM
can start on the local chunk at once and take every peer's chunk as it arrives.

Strategies (same results; `reference` is the oracle):

* ``reference``: ``all_gather_into_tensor``, then one GEMM.
* ``pipelined``: a pairwise exchange (step i: receive from ``rank+i``, send to ``rank-i``), each
  step split into ``num_chunks[link]`` pieces, all posted at once; the local GEMM runs while they
  fly, then each piece's GEMM as soon as it is received. Any backend, any topology.
* ``symm``: every rank copies its shard into its slot of the symmetric heap and flags it; a copy
  engine (a side stream on GPUs, a worker thread on CPU ranks) pulls peers' chunks into a local
  buffer, and the GEMM of each chunk waits only for that chunk. Ranks of one node.
* ``fused``: one Triton kernel (`overlap.kernels.ag_matmul`); each tile waits on the flag of the
  rank chunk it reads and loads it straight from that rank's buffer. Ranks of one node; on CPU
  ranks it runs interpreted (correct, slow: for tests at small sizes).

Autograd (Megatron's convention): ``grad_a = reduce_scatter(grad_out @ b.T)`` (sum),
``grad_b = all_gather(a).T @ grad_out`` for this rank's own shard ``b``. Like Megatron's sequence
parallelism, only the local shard is saved and it is gathered again in backward. ``reference``
does exactly that with plain collectives (the gather in flight during the input-gradient GEMM, the
reduce-scatter during the weight-gradient GEMM). The other strategies overlap both: the gather of
``a`` is posted first (`overlap.ops._gather`; ``fused`` gathers as ``symm`` does), the input
gradient is computed by `matmul_reduce_scatter` with the forward's plan (its own transfers hidden
behind its GEMMs) while the gather flies, then the weight gradient is one GEMM over the gathered
rows (so it rounds exactly like the unfused one).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` may alias each other and any other tensor (they are only read); the output is
a new tensor. A rank's shard is copied into the heap, so ``a`` may be modified once the call returns.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from ..errors import OverlapTimeout
from ..plan import Plan
from . import _common as C
from . import _gather

OP = "all_gather_matmul"


def all_gather_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """``all_gather(a, dim=0) @ b`` over `group`, overlapping the gather with the GEMM.

    Args:
        a: ``[m, ..., k]``, this rank's slice of dim 0 (the sequence of Megatron's ``[s, b, h]``).
        b: ``[k, n]``, any strides (a weight ``w[n, k]`` is passed as ``w.t()``).
        group: process group (default: the world); every rank of it must make the same call.
        strategy: ``"auto"`` (default), ``"reference"``, ``"pipelined"``, ``"symm"`` or ``"fused"``.
        plan: an `overlap.Plan` (overrides `strategy`'s defaults, e.g. chunk counts).
        timeout: seconds any wait on a peer may take (default ``OVERLAP_TIMEOUT_S``, 300).

    Returns:
        ``[world_size * m, ..., n]``: rank r's rows at ``r*m ... (r+1)*m - 1``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, plan), on this rank before
            any data moves; peers already in the call raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    a, b, pg, info, chosen, timeout, sig = C.prepare(OP, a, b, group, strategy, plan, timeout)
    with C.record(OP), torch.autocast(info.device.type, enabled=False):
        return _AllGatherMatmul.apply(a, b, pg, info, chosen, timeout, sig)


def heap_bytes(chosen: Plan, a2: torch.Tensor) -> int:
    """Bytes of one heap slot a call needs (0: the strategy uses no symmetric memory)."""
    return a2.numel() * a2.element_size() if chosen.strategy in ("symm", "fused") else 0


def run(a2: torch.Tensor, b: torch.Tensor | None, pg, info, chosen: Plan, timeout: float, sig: str, op: str = OP,
        keep_gathered: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One call on every rank: the handshake, then the strategy.

    Returns ``(out [W*m, n], gathered [W*m, k])``: ``out`` is None when `b` is None (the call only
    gathers), ``gathered`` (the whole gathered `a2`) is None unless `keep_gathered`: the weight
    gradient of `matmul_reduce_scatter` takes it from the gather its input gradient needs.
    """
    call = C.begin_call(op, pg, info, sig, heap_bytes(chosen, a2), timeout)
    try:
        return STRATEGIES[chosen.strategy](call, a2, b, pg, info, chosen, timeout, op, keep_gathered)
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, pg, info, chosen: Plan, timeout: float, sig: str):
        # The handshake comes first (in `run`): nothing that can fail locally runs before the data.
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        out2, _ = run(a2, b, pg, info, chosen, timeout, sig)
        ctx.save_for_backward(a, b)
        ctx.pg, ctx.info, ctx.timeout, ctx.chosen = pg, info, timeout, chosen
        return out2.view(info.world_size * a.shape[0], *a.shape[1:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.chosen.strategy == "reference":
            grad_a, grad_b = _reference_backward(ctx, a, b, grad_out, need_a, need_b)
        else:
            grad_a, grad_b = _overlapped_backward(ctx, a, b, grad_out, need_a, need_b)
        return grad_a, grad_b, None, None, None, None, None


def _reference_backward(ctx, a, b, grad_out, need_a, need_b):
    """Megatron's sequence-parallel backward with plain collectives (the baseline)."""
    pg, info, timeout = ctx.pg, ctx.info, ctx.timeout
    k, n = b.shape
    op = f"{OP}.backward"
    sig = f"{op}(a={C.describe(a)}, b={tuple(b.shape)}, grads={int(need_a)}{int(need_b)}, reference)"
    call = C.begin_call(op, pg, info, sig, 0, timeout)
    g2 = grad_out.reshape(-1, n)
    a2 = a.reshape(-1, k).contiguous()
    grad_a = grad_b = None
    with C.record(op):
        try:
            if need_b:
                full = a2.new_empty((info.world_size * a2.shape[0], k))
                work = C.all_gather_async(full, a2, pg)
            if need_a:
                partial = torch.mm(g2, b.t())
                grad_a2 = a2.new_empty(a2.shape)
                rs = C.reduce_scatter_async(grad_a2, partial, pg)
            if need_b:
                C.wait_work(work, op, info.rank, "any", "all_gather of a", timeout, info)
                grad_b = torch.mm(full.t(), g2)
            if need_a:
                C.wait_work(rs, op, info.rank, "any", "reduce_scatter of grad_a", timeout, info)
                grad_a = grad_a2.view(a.shape)
        finally:
            call.finish()
    return grad_a, grad_b


def _overlapped_backward(ctx, a, b, grad_out, need_a, need_b):
    """The gather of ``a`` in flight while `matmul_reduce_scatter` computes grad_a; then grad_b by chunks."""
    from . import matmul_reduce_scatter as mrs

    pg, info, timeout, chosen = ctx.pg, ctx.info, ctx.timeout, ctx.chosen
    k, n = b.shape
    op = f"{OP}.backward"
    g2 = grad_out.reshape(-1, n).contiguous()
    a2 = a.reshape(-1, k).contiguous()
    kind = "symm" if chosen.strategy == "fused" else chosen.strategy
    grad_a = grad_b = None
    gather = None
    with C.record(op):
        try:
            if need_b:
                sig = f"{op}.gather(a={C.describe(a)}, plan={chosen.describe()})"
                # The heap cannot grow while this gather is in flight: size it for grad_a's call too.
                need = _gather.heap_bytes(kind, a2)
                if need_a:
                    need = max(need, mrs.heap_bytes(chosen, g2, k, info.world_size))
                call = C.begin_call(op, pg, info, sig, need, timeout)
                gather = _gather.start(kind, call, a2, pg, info, chosen, timeout, op)
            if need_a:
                sig = f"{op}.grad_a(g={C.describe(g2)}, b={(n, k)}, plan={chosen.describe()})"
                grad_a = mrs.run(g2, b.t(), pg, info, chosen, timeout, sig, op).view(a.shape)
            if need_b:
                for _ in gather.chunks():  # arrived during grad_a's GEMMs, most of it
                    pass
                # One GEMM over every row: it rounds exactly as the unfused weight gradient does.
                grad_b = torch.mm(gather.gathered().t(), g2)
        finally:
            if gather is not None:
                gather.close()
    return grad_a, grad_b


# ----------------------------------------------------------------------------------------------
# Forward strategies: (a2 [m, k] contiguous, b [k, n]) -> out [W*m, n]
# ----------------------------------------------------------------------------------------------


def _gathered(call, a2, b, pg, info, chosen, timeout, op, keep_gathered):
    """reference, pipelined, symm: the GEMM of each gathered chunk as soon as it is there."""
    g = _gather.start(chosen.strategy, call, a2, pg, info, chosen, timeout, op)
    try:
        out = a2.new_empty((info.world_size * a2.shape[0], b.shape[1])) if b is not None else None
        for lo, hi, rows in g.chunks():
            if out is not None:
                torch.mm(rows, b, out=out[lo:hi])
        return out, (g.gathered() if keep_gathered else None)
    finally:
        g.close()


def _fused(call, a2, b, pg, info, chosen, timeout, op, keep_gathered):
    if b is None:  # gather only (a weight gradient's gather): the kernel has no GEMM to run
        return _gathered(call, a2, None, pg, info, dataclasses.replace(chosen, strategy="symm"), timeout, op,
                         keep_gathered)
    kernel = C.kernels().all_gather_matmul_kernel
    interpreted = C.interpreted()
    W, r, (m, k), n = info.world_size, info.rank, a2.shape, b.shape[1]
    heap = call.heap
    call.wait_slot_free()
    call.buffer(r, a2.dtype, (m, k)).copy_(a2)
    call.signal_ready()
    out = a2.new_empty((W * m, n))
    # GPU: the kernel's error word is pinned host memory, checked by the next call without a
    # sync. CPU (interpreted): checked right after the kernel.
    err = heap.kernel_err() if a2.is_cuda else torch.zeros(1, dtype=torch.int32)
    abort = torch.zeros(1, dtype=torch.int32) if interpreted else err  # read only when interpreted
    bm, bn, bk = C.fused_tiles(chosen.block_m, chosen.block_n, chosen.block_k, interpreted, a2.dtype)
    grid = (W * C.cdiv(m, bm) * C.cdiv(n, bn),)
    guard = C.Watchdog(abort, timeout) if interpreted else contextlib.nullcontext()
    with guard:
        kernel[grid](
            out, b,
            heap.ptr_table(call.slot), heap.flag_table(call.slot, 0),
            call.word, r, W, abort, err, int(timeout * 1e9),
            m, n, k,
            k,
            b.stride(0), b.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
            UPCAST=interpreted and a2.dtype == torch.bfloat16, INTERPRETED=interpreted,
        )
    bad = 0 if a2.is_cuda else int(err.item())
    if bad:
        raise OverlapTimeout(op, r, bad - 1, f"rank chunk {bad - 1}", timeout, "fused kernel tile wait")
    gathered = None
    if keep_gathered:
        # Every peer's shard stays in its buffer until this rank finishes the call (on GPUs in
        # stream order: the kernel has waited for every flag), so the gathered rows are copied out.
        gathered = torch.cat([call.buffer(p, a2.dtype, (m, k)) for p in range(W)])
    return out, gathered


STRATEGIES = {"reference": _gathered, "pipelined": _gathered, "symm": _gathered, "fused": _fused}
