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
* ``hierarchical``: groups spanning nodes (`overlap.ops.hierarchical`): each block sent once to each other
  node (the rank with the same index there), forwarded within the node by shared memory as each network
  chunk lands; every chunk's GEMM as it arrives. ``symm`` on one node.

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

import dataclasses

import torch
import torch.distributed as dist

from .. import comm
from ..errors import OverlapTimeout
from ..plans import Plan
from . import _gather, fused, hierarchical, library
from .context import CallContext, describe, no_autocast, record

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
        strategy: ``"auto"`` (default), ``"reference"``, ``"pipelined"``, ``"symm"``, ``"fused"`` or ``"hierarchical"``.
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
    return library.tp_call(_op, OP, a, b, group, strategy, plan, timeout)


def heap_bytes(chosen: Plan, a2: torch.Tensor) -> int:
    """Bytes of one heap slot a call needs (0: the strategy uses no symmetric memory)."""
    return a2.numel() * a2.element_size() if chosen.strategy in ("symm", "fused", "hierarchical") else 0


def run(a2: torch.Tensor, b: torch.Tensor | None, cc: CallContext,
        keep_gathered: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One call on every rank (`cc`: its op, group, plan, deadline, signature): the handshake, then the strategy.

    Returns ``(out [W*m, n], gathered [W*m, k])``: ``out`` is None when `b` is None (the call only
    gathers), ``gathered`` (the whole gathered `a2`) is None unless `keep_gathered`: the weight
    gradient of `matmul_reduce_scatter` takes it from the gather its input gradient needs.
    """
    call = cc.begin(heap_bytes(cc.plan, a2), steady=cc.plan.strategy in ("symm", "pipelined"))
    try:
        return STRATEGIES[cc.plan.strategy](cc, call, a2, b, keep_gathered)
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls


def _forward(a, b, group, strategy, plan, timeout, needs_grad):
    """``overlap::all_gather_matmul``: the whole call (checks, plan, handshake, strategy) on this rank."""
    cc = library.tp_context(OP, a, b, group, strategy, plan, timeout, needs_grad)
    # The handshake comes first (in `run`): nothing that can fail locally runs before the data.
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        out2, _ = run(a2, b, cc)
        out = out2.view(cc.world_size * a.shape[0], *a.shape[1:-1], b.shape[1])
    return out, library.context_out(cc, needs_grad)


def _fake(a, b, group, strategy, plan, timeout, needs_grad):
    out = a.new_empty((library.world_size(group) * a.shape[0], *a.shape[1:-1], b.shape[-1]))
    return out, library.context_fake(needs_grad)


def _backward(grad_out, a, b, context, need_a, need_b):
    """``overlap::all_gather_matmul_backward``: ``(grad_a, grad_b)`` in the forward's call context."""
    cc = library.kept(context, f"{OP}.backward").derive(op=f"{OP}.backward")
    with no_autocast(cc.info.device.type):
        if cc.plan.strategy == "reference":
            grad_a, grad_b = _reference_backward(cc, a, b, grad_out, need_a, need_b)
        else:
            grad_a, grad_b = _overlapped_backward(cc, a, b, grad_out, need_a, need_b)
    return library.grads_out(grad_a, grad_b, a, b)


_backward_op = library.define(f"{OP}_backward", library.TP_BACKWARD_SCHEMA, _backward, library.tp_backward_fake)
_op = library.define(OP, library.TP_SCHEMA, _forward, _fake, library.tp_backward(_backward_op), library.tp_save)


def _reference_backward(cc: CallContext, a, b, grad_out, need_a, need_b):
    """Megatron's sequence-parallel backward with plain collectives (the baseline)."""
    k, n = b.shape
    cc = cc.derive(signature=f"{cc.op}(a={describe(a)}, b={tuple(b.shape)}, grads={int(need_a)}{int(need_b)}, "
                             "reference)")
    call = cc.begin()
    g2 = grad_out.reshape(-1, n)
    a2 = a.reshape(-1, k).contiguous()
    grad_a = grad_b = None
    with record(cc.op):
        try:
            if need_b:
                full = a2.new_empty((cc.world_size * a2.shape[0], k))
                work = comm.all_gather_async(full, a2, cc.pg)
            if need_a:
                partial = torch.mm(g2, b.t())
                grad_a2 = a2.new_empty(a2.shape)
                rs = comm.reduce_scatter_async(grad_a2, partial, cc.pg)
            if need_b:
                cc.wait(work, "any", "all_gather of a")
                grad_b = torch.mm(full.t(), g2)
            if need_a:
                cc.wait(rs, "any", "reduce_scatter of grad_a")
                grad_a = grad_a2.view(a.shape)
        finally:
            call.finish()
    return grad_a, grad_b


def _overlapped_backward(cc: CallContext, a, b, grad_out, need_a, need_b):
    """The gather of ``a`` in flight while `matmul_reduce_scatter` computes grad_a; then grad_b by chunks."""
    from . import matmul_reduce_scatter

    chosen = cc.plan
    k, n = b.shape
    g2 = grad_out.reshape(-1, n).contiguous()
    a2 = a.reshape(-1, k).contiguous()
    kind = "symm" if chosen.strategy == "fused" else chosen.strategy
    grad_a = grad_b = None
    gather = None
    with record(cc.op):
        try:
            if need_b:
                gather_cc = cc.derive(signature=f"{cc.op}.gather(a={describe(a)}, plan={chosen.describe()})")
                # The heap cannot grow while this gather is in flight: size it for grad_a's call too.
                need = _gather.heap_bytes(kind, a2)
                if need_a:
                    need = max(need, matmul_reduce_scatter.heap_bytes(chosen, g2, k, cc.world_size))
                gather_call = gather_cc.begin(need, steady=kind in ("symm", "pipelined"))
                gather = _gather.start(kind, gather_call, a2, gather_cc, need=need)
            if need_a:
                grad_cc = cc.derive(signature=f"{cc.op}.grad_a(g={describe(g2)}, b={(n, k)}, plan={chosen.describe()})")
                grad_a = matmul_reduce_scatter.run(g2, b.t(), grad_cc).view(a.shape)
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


def _gathered(cc: CallContext, call, a2, b, keep_gathered):
    """reference, pipelined, symm: the GEMM of each gathered chunk as soon as it is there."""
    g = _gather.start(cc.plan.strategy, call, a2, cc)
    try:
        out = a2.new_empty((cc.world_size * a2.shape[0], b.shape[1])) if b is not None else None
        for lo, hi, rows in g.chunks():
            if out is not None:
                torch.mm(rows, b, out=out[lo:hi])
        return out, (g.gathered() if keep_gathered else None)
    finally:
        g.close()


def _fused(cc: CallContext, call, a2, b, keep_gathered):
    chosen, timeout = cc.plan, cc.timeout
    if b is None:  # gather only (a weight gradient's gather): the kernel has no GEMM to run
        return _gathered(cc.derive(plan=dataclasses.replace(chosen, strategy="symm")), call, a2, None, keep_gathered)
    kernels = fused.kernels()
    W, r, (m, k) = cc.world_size, cc.rank, a2.shape
    heap = call.heap
    call.wait_slot_free()
    call.buffer(r, a2.dtype, (m, k)).copy_(a2)
    call.signal_ready()
    # GPU: the kernel's error word is pinned host memory, checked by the next call without a
    # sync. CPU (interpreted): checked right after the kernel.
    err = heap.kernel_err() if a2.is_cuda else torch.zeros(1, dtype=torch.int32)
    tile = fused.fused_tiles(chosen.block_m, chosen.block_n, chosen.block_k, fused.interpreted(), a2.dtype)
    out = kernels.launch_all_gather_matmul(b, heap.ptr_table(call.slot), heap.flag_table(call.slot, 0), rows=m,
                                           epoch=call.epoch_word(), rank=r, err=err, timeout_ns=int(timeout * 1e9),
                                           block=tile)
    bad = 0 if a2.is_cuda else int(err.item())
    if bad:
        raise OverlapTimeout(cc.op, r, bad - 1, f"rank chunk {bad - 1}", timeout, "fused kernel tile wait")
    gathered = None
    if keep_gathered:
        # Every peer's shard stays in its buffer until this rank finishes the call (on GPUs in
        # stream order: the kernel has waited for every flag), so the gathered rows are copied out.
        gathered = torch.cat([call.buffer(p, a2.dtype, (m, k)) for p in range(W)])
    return out, gathered


def _hierarchical(cc: CallContext, call, a2, b, keep_gathered):
    """Across nodes: `overlap.ops.hierarchical.HierGather` under `_gather` (on one node the plan is ``symm``:
    `overlap.plans.auto.fit_plan`)."""
    with hierarchical.guard(cc):
        return _gathered(cc, call, a2, b, keep_gathered)


STRATEGIES = {"reference": _gathered, "pipelined": _gathered, "symm": _gathered, "fused": _fused,
              "hierarchical": _hierarchical}
