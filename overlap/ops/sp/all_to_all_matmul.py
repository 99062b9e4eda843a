"""all_to_all_matmul: the output projection of sequence-parallel (Ulysses) attention with the all-to-all before it
hidden behind its GEMMs.

Problem. After attention each rank holds its ``heads/W`` heads over the whole sequence, ``ctx`` ``[s, b, heads/W *
d]``; the output projection needs every head of its own sequence shard, ``all_to_all(ctx)`` ``[s/W, b, heads * d]``,
times ``w_o`` ``[heads * d, h_out]``. Exchanging first and multiplying after leaves the GEMM idle during the
exchange. Each peer's block is the peer's heads, which meet their own rows of ``w_o``: each block is multiplied as it
lands (`overlap.ops.sp.heads.gather_heads`), the partial products summed in rank order in fp32, so the result does
not depend on the order of arrival.

Autograd. The backward of the all-to-all is the reverse one: ``grad_ctx`` is `overlap.matmul_all_to_all`'s exchange
of ``grad_out @ w_o.T`` (each destination's columns computed and sent while the next destination's are computed:
`overlap.ops.sp.heads.scatter_heads`), in the forward's plan. ``grad_w_o = all_to_all(ctx).T @ grad_out`` is one GEMM
over the gathered rows the forward kept: this rank's sequence shard's share, as in the unfused layer.

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every rank; the
operands are only read; the output is a new tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...plans import Plan
from .. import library
from ..context import autocast_inputs, describe, no_autocast, record
from . import entry, heads
from .entry import SpCall, from_seq_first, seq_first

OP = "all_to_all_matmul"


def all_to_all_matmul(
    ctx: torch.Tensor,
    w_o: torch.Tensor,
    *,
    seq_dim: int = 0,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """``all_to_all(ctx) @ w_o`` over `group`: this rank's sequence shard of the output projection, the exchange
    overlapped with the GEMMs.

    Args:
        ctx: ``[..., s, ..., c]``: this rank's heads (``c = heads/W * head_dim`` columns) for the whole sequence at
            `seq_dim` (``s`` a multiple of the world size: pad the sequence otherwise).
        w_o: ``[W * c, h_out]``, every head's rows in rank order (pass a ``Linear``'s ``w[out, in]`` as ``w.t()``).
        seq_dim: the sequence's dim of `ctx` (0 for ``[s, b, c]``, 1 for batch-first ``[b, s, c]``), any but the last.
        group, strategy, plan, timeout: as for `overlap.matmul_all_to_all`.

    Returns:
        ``[..., s/W, ..., h_out]``: positions ``r*s/W ... (r+1)*s/W - 1`` of the projection on rank ``r``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, a sequence that does not divide by the world
            size, ``w_o`` rows other than ``W * c``, plan), on this rank before any data moves; peers already in the
            call raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, seq_dim, plan), on every rank.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    call = SpCall(OP, group, strategy, plan, timeout, seq_dim)
    args = library.call_args(group, strategy, plan, timeout)
    if args is None or not library.tensors(ctx, w_o) or not isinstance(seq_dim, int):
        entry.prepare(call, ctx, w_o)  # raises on this rank, peers told
        raise TypeError(f"overlap.{OP}: unsupported arguments")  # pragma: no cover - prepare raised
    ctx, w_o = autocast_inputs(ctx, w_o)
    return _op(ctx, w_o, seq_dim, *args, library.needs_grad(ctx, w_o))[0]


def _forward(ctx, w_o, dim, group, strategy, plan, timeout, needs_grad):
    """``overlap::all_to_all_matmul``: the whole call on this rank; returns the output, the gathered rows its
    backward's weight gradient reads (empty without a backward) and the call context's key."""
    _ws, d, cc = entry.context(SpCall(OP, group, strategy, plan, timeout, dim), ctx, w_o, needs_grad)
    W = cc.world_size
    with record(OP), no_autocast(cc.info.device.type):
        cs = seq_first(ctx, d)
        out, gathered = heads.gather_heads(cc, cs.view(W, -1, ctx.shape[-1]), w_o)
        y = from_seq_first(out, [cs.shape[0] // W, *cs.shape[1:-1], w_o.shape[1]], d)
    return y, gathered if needs_grad else ctx.new_empty(0), library.context_out(cc, needs_grad)


def _fake(ctx, w_o, dim, group, strategy, plan, timeout, needs_grad):
    W = library.world_size(group)
    d = entry.fake_seq_dim(OP, dim, ctx.shape)
    shape = list(ctx.shape)
    rows = ctx.numel() // ctx.shape[-1] // W
    shape[d] //= W
    gathered = ctx.new_empty((W, rows, ctx.shape[-1]) if needs_grad else (0,))
    return ctx.new_empty((*shape[:-1], w_o.shape[1])), gathered, library.context_fake(needs_grad)


def _save(ctx: Any, inputs: tuple, output: Any) -> None:
    t, w_o, dim, *_ = inputs
    ctx.save_for_backward(t, w_o, output[1], output[2])
    ctx.dim = entry.seq_dim_of(OP, dim, t.shape)
    ctx.rest = len(inputs) - 2
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx: Any, grad: torch.Tensor, _grad_gathered: Any, _grad_context: Any):
    t, w_o, gathered, context = ctx.saved_tensors
    need_ctx, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad is None:
        return (None, None, *(None,) * ctx.rest)
    grad_ctx, grad_w = _backward_op(grad, t, w_o, gathered, context, ctx.dim, need_ctx, need_w)
    return (grad_ctx if need_ctx else None, grad_w if need_w else None, *(None,) * ctx.rest)


def _backward(grad, t, w_o, gathered, context, dim, need_ctx, need_w):
    """``overlap::all_to_all_matmul_backward``: ``(grad_ctx, grad_w_o)`` in the forward's call context."""
    cc = library.kept(context, f"{OP}.backward")
    op = f"{OP}.backward"
    n = w_o.shape[1]
    cc = cc.derive(op=op, signature=f"{op}(g={describe(grad)}, ctx={describe(t)}, seq_dim={dim}, "
                                    f"plan={cc.plan.describe()})")
    with record(op), no_autocast(cc.info.device.type):
        g = seq_first(grad, dim).reshape(-1, n)
        grad_ctx = t.new_empty(0)
        if need_ctx:
            recv = heads.scatter_heads(cc, g, w_o.t())
            grad_ctx = from_seq_first(recv, [t.shape[dim], *(s for i, s in enumerate(t.shape) if i != dim)], dim)
        # One GEMM over every gathered row: it rounds as the unfused weight gradient does.
        grad_w = torch.mm(gathered.transpose(0, 1).reshape(g.shape[0], -1).t(), g) if need_w else w_o.new_empty(0)
    return grad_ctx, grad_w


def _backward_fake(grad, t, w_o, gathered, context, dim, need_ctx, need_w):
    return t.new_empty(t.shape if need_ctx else (0,)), w_o.new_empty(w_o.shape if need_w else (0,))


BACKWARD_SCHEMA = ("(Tensor grad, Tensor ctx, Tensor w_o, Tensor gathered, Tensor context, int dim, bool need_ctx, "
                   "bool need_w) -> (Tensor, Tensor)")
SCHEMA = ("(Tensor ctx, Tensor w_o, int dim, str group, str strategy, str plan, float? timeout, bool needs_grad) "
          "-> (Tensor, Tensor, Tensor)")
_backward_op = library.define(f"{OP}_backward", BACKWARD_SCHEMA, _backward, _backward_fake)
_op = library.define(OP, SCHEMA, _forward, _fake, _autograd_backward, _save)
