"""all_gather_matmul: ``all_gather(a, dim=0) @ b``, with the gather hidden behind the GEMM.

Problem. In a column-parallel layer with sequence parallelism every rank holds ``a_MK`` (its
slice of the sequence) and a column shard ``b_KN`` of the weight; the layer needs
``[a_0; a_1; ...; a_{W-1}] @ b``. Gathering first and multiplying after leaves the GEMM idle
during the gather. Each rank's block of output rows only needs that rank's chunk, so the GEMM
can start on the local chunk at once and take every peer's chunk as it arrives.

Strategies: `overlap.ops.tp.gather_gemm` (``reference``, ``pipelined``, ``symm``, ``fused``, and
``hierarchical`` across nodes), which the input gradient of `matmul_reduce_scatter` runs too.

Autograd (Megatron's convention): ``grad_a = reduce_scatter(grad_out @ b.T)`` (sum),
``grad_b = all_gather(a).T @ grad_out`` for this rank's own shard ``b``. Like Megatron's sequence
parallelism, only the local shard is saved and it is gathered again in backward. ``reference``
does exactly that with plain collectives (the gather in flight during the input-gradient GEMM, the
reduce-scatter during the weight-gradient GEMM). The other strategies overlap both: the gather of
``a`` is posted first (`overlap.ops.tp.gather`; ``fused`` gathers as ``symm`` does), the input
gradient is computed by `overlap.ops.tp.scatter_gemm` with the forward's plan (its own transfers hidden
behind its GEMMs) while the gather flies, then the weight gradient is one GEMM over the gathered
rows (so it rounds exactly like the unfused one).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` may alias each other and any other tensor (they are only read); the output is
a new tensor. A rank's shard is copied into the heap, so ``a`` may be modified once the call returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm
from ...plans import Plan
from .. import library
from ..context import CallContext, describe, no_autocast, record
from . import entry, gather, gather_gemm, scatter_gemm

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
    return entry.tp_call(_op, OP, a, b, group, strategy, plan, timeout)


def _forward(a, b, group, strategy, plan, timeout, needs_grad):
    """``overlap::all_gather_matmul``: the whole call (checks, plan, handshake, strategy) on this rank."""
    cc = entry.tp_context(OP, a, b, group, strategy, plan, timeout, needs_grad)
    # The handshake comes first (in `run`): nothing that can fail locally runs before the data.
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        out2, _ = gather_gemm.run(a2, b, cc)
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


_backward_op = library.define(f"{OP}_backward", entry.TP_BACKWARD_SCHEMA, _backward, entry.tp_backward_fake)
_op = library.define(OP, entry.TP_SCHEMA, _forward, _fake, entry.tp_backward(_backward_op), entry.tp_save)


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
    chosen = cc.plan
    k, n = b.shape
    g2 = grad_out.reshape(-1, n).contiguous()
    a2 = a.reshape(-1, k).contiguous()
    kind = "symm" if chosen.strategy == "fused" else chosen.strategy
    grad_a = grad_b = None
    gathered = None
    with record(cc.op):
        try:
            if need_b:
                gather_cc = cc.derive(signature=f"{cc.op}.gather(a={describe(a)}, plan={chosen.describe()})")
                # The heap cannot grow while this gather is in flight: size it for grad_a's call too.
                need = gather.heap_bytes(kind, a2)
                if need_a:
                    need = max(need, scatter_gemm.heap_bytes(chosen, g2, k, cc.world_size))
                gather_call = gather_cc.begin(need, steady=kind in ("symm", "pipelined"))
                gathered = gather.start(kind, gather_call, a2, gather_cc, need=need)
            if need_a:
                grad_cc = cc.derive(signature=f"{cc.op}.grad_a(g={describe(g2)}, b={(n, k)}, plan={chosen.describe()})")
                grad_a = scatter_gemm.run(g2, b.t(), grad_cc).view(a.shape)
            if need_b:
                for _ in gathered.chunks():  # arrived during grad_a's GEMMs, most of it
                    pass
                # One GEMM over every row: it rounds exactly as the unfused weight gradient does.
                grad_b = torch.mm(gathered.gathered().t(), g2)
        finally:
            if gathered is not None:
                gathered.close()
    return grad_a, grad_b
