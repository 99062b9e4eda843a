"""matmul_all_to_all: the QKV projections of sequence-parallel (Ulysses) attention with the all-to-all that follows
them hidden behind their GEMMs.

Problem. Each rank holds a shard of the sequence, ``x`` ``[s/W, b, h_in]``, and the whole projection weights; for
attention it needs its ``heads/W`` heads over the whole sequence, ``[s, b, heads/W * d]``. Projecting first and
exchanging after leaves the links idle during the GEMM and the GEMM idle during the exchange. Each destination's
heads are their own columns of the weight, so the columns for one destination can travel while the next
destination's are computed (`overlap.ops.sp.heads.scatter_heads`). Several weights (q, k, v, each with its own head
count: grouped-query attention's fewer key/value heads) share one transfer per destination: their columns for that
destination are packed side by side.

Autograd. The all-to-all's backward is the reverse all-to-all: ``grad_x`` is `overlap.all_to_all_matmul`'s product
of the output gradients with the weights transposed (`overlap.ops.sp.heads.gather_heads`: each source's block
multiplied as it lands), in the forward's plan. The weights' gradients are one GEMM over the gathered gradient
rows, ``x.T @ g``: as the unfused layer's, this rank's sequence shard's share (a sequence-parallel group sums them
with the data-parallel gradient reduction, as DeepSpeed-Ulysses does).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every rank; the
operands are only read; the outputs are new tensors.
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

OP = "matmul_all_to_all"


def matmul_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor | list[torch.Tensor],
    *,
    heads: int | list[int],
    seq_dim: int = 0,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """``all_to_all(x @ w)`` over `group`: this rank's heads of the projection for the whole sequence, the exchange
    overlapped with the GEMMs.

    Args:
        x: ``[..., s/W, ..., h_in]``: this rank's shard of the sequence (at `seq_dim`), every feature.
        w: ``[h_in, heads * head_dim]`` (pass a ``Linear``'s ``w[out, in]`` as ``w.t()``), or a list of them (q, k,
            v) with one transfer for all.
        heads: the head count of `w`, or one per weight of the list; each must divide by the world size (every rank
            gets whole heads: GQA's key/value heads included).
        seq_dim: the sequence's dim of `x` (0 for ``[s, b, h]``, 1 for batch-first ``[b, s, h]``), any but the last.
        group, strategy, plan, timeout: as for `overlap.all_gather_matmul` (this family's strategies: ``reference``,
            ``pipelined``, ``auto``).

    Returns:
        ``[..., s, ..., heads/W * head_dim]`` (`x`'s shape with the whole sequence at `seq_dim`): the heads
        ``r*heads/W ... (r+1)*heads/W - 1`` of rank ``r``, positions of rank ``q``'s shard at
        ``q*s/W ... (q+1)*s/W - 1``; a list of them where `w` is a list.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, head counts that do not divide by the world
            size or do not divide a weight's columns, a head count per weight missing, plan), on this rank before any
            data moves; peers already in the call raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, heads, seq_dim, plan), on every rank.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    many = isinstance(w, (list, tuple))
    ws = list(w) if many else [w]
    counts = list(heads) if isinstance(heads, (list, tuple)) else [heads]
    call = SpCall(OP, group, strategy, plan, timeout, seq_dim, counts if many or isinstance(heads, (list, tuple))
                  else heads)
    args = library.call_args(group, strategy, plan, timeout)
    ints = all(isinstance(h, int) and not isinstance(h, bool) for h in counts) and isinstance(seq_dim, int)
    if args is None or not ws or not library.tensors(x, *ws) or not ints or len(counts) != len(ws):
        entry.prepare(call, x, ws)  # raises on this rank, peers told
        raise TypeError(f"overlap.{OP}: unsupported arguments")  # pragma: no cover - prepare raised
    x, *ws = autocast_inputs(x, *ws)
    ys, _ = _op(x, ws, counts, seq_dim, *args, library.needs_grad(x, *ws))
    return list(ys) if many else ys[0]


def packed(ws: list[torch.Tensor], W: int) -> torch.Tensor:
    """The weights as one ``[h_in, W*C]``: column block ``d`` holds destination ``d``'s columns of each weight in
    turn (``C``: every weight's columns per rank). One weight is its own packing (no copy)."""
    if len(ws) == 1:
        return ws[0]
    k = ws[0].shape[0]
    return torch.cat([w.reshape(k, W, w.shape[1] // W) for w in ws], dim=2).reshape(k, -1)


def _columns(ws: list[torch.Tensor], W: int) -> list[tuple[int, int]]:
    """``(offset, columns)`` of each weight's block inside one destination's ``C`` columns."""
    spans, offset = [], 0
    for w in ws:
        spans.append((offset, w.shape[1] // W))
        offset += w.shape[1] // W
    return spans


def _forward(x, ws, counts, dim, group, strategy, plan, timeout, needs_grad):
    """``overlap::matmul_all_to_all``: the whole call (checks, plan, handshake, strategy) on this rank."""
    ws, d, cc = entry.context(SpCall(OP, group, strategy, plan, timeout, dim, list(counts)), x, ws, needs_grad)
    W = cc.world_size
    with record(OP), no_autocast(cc.info.device.type):
        xs = seq_first(x, d)
        recv = heads.scatter_heads(cc, xs.reshape(-1, x.shape[-1]), packed(ws, W))
        shape = [W * xs.shape[0], *xs.shape[1:-1]]
        if len(ws) == 1:
            ys = [from_seq_first(recv, [*shape, recv.shape[-1]], d)]
        else:  # (each weight's columns copied out: outputs of a custom op never alias each other)
            ys = [from_seq_first(recv[..., lo : lo + c].contiguous(), [*shape, c], d) for lo, c in _columns(ws, W)]
    return ys, library.context_out(cc, needs_grad)


def _fake(x, ws, counts, dim, group, strategy, plan, timeout, needs_grad):
    W = library.world_size(group)
    d = entry.fake_seq_dim(OP, dim, x.shape)
    shape = list(x.shape)
    shape[d] *= W
    ys = [x.new_empty((*shape[:-1], w.shape[1] // W)) for w in ws]
    return ys, library.context_fake(needs_grad)


def _save(ctx: Any, inputs: tuple, output: Any) -> None:
    x, ws, _counts, dim, *_ = inputs
    ctx.save_for_backward(x, *ws, output[1])
    ctx.dim, ctx.need_w = entry.seq_dim_of(OP, dim, x.shape), [w.requires_grad for w in ws]
    ctx.shapes = [y.shape for y in output[0]]
    ctx.rest = len(inputs) - 2
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx: Any, grads: list, _grad_context: Any):
    x, *ws, context = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    grads = [g if g is not None else x.new_zeros(shape) for g, shape in zip(grads, ctx.shapes, strict=True)]
    grad_x, grad_ws = _backward_op(grads, x, ws, context, ctx.dim, need_x, ctx.need_w)
    return (grad_x if need_x else None, [g if need else None for g, need in zip(grad_ws, ctx.need_w, strict=True)],
            *(None,) * ctx.rest)


def _backward(grads, x, ws, context, dim, need_x, need_w):
    """``overlap::matmul_all_to_all_backward``: ``(grad_x, grad_ws)`` in the forward's call context."""
    cc = library.kept(context, f"{OP}.backward")
    op = f"{OP}.backward"
    W, k = cc.world_size, x.shape[-1]
    cc = cc.derive(op=op, signature=f"{op}(gs={[describe(g) for g in grads]}, x={describe(x)}, seq_dim={dim}, "
                                    f"plan={cc.plan.describe()})")
    with record(op), no_autocast(cc.info.device.type):
        xs = seq_first(x, dim)
        a = xs.reshape(-1, k)
        m = a.shape[0]
        gs = [seq_first(g, dim).view(W, m, g.shape[-1]) for g in grads]
        sends = gs[0] if len(gs) == 1 else torch.cat(gs, dim=2)
        b = packed(ws, W)
        out, gathered = heads.gather_heads(cc, sends, b.t())
        # One GEMM over every gathered row: it rounds as the unfused weight gradient does.
        grad_b = torch.mm(a.t(), gathered.transpose(0, 1).reshape(m, -1)) if any(need_w) else None
    grad_ws = []
    for w, (lo, c), need in zip(ws, _columns(ws, W), need_w, strict=True):
        if not need:
            grad_ws.append(w.new_empty(0))
        elif len(ws) == 1:
            grad_ws.append(grad_b)
        else:
            grad_ws.append(grad_b.view(k, W, -1)[:, :, lo : lo + c].contiguous().view(w.shape))
    grad_x = from_seq_first(out, list(xs.shape), dim) if need_x else x.new_empty(0)
    return grad_x, grad_ws


def _backward_fake(grads, x, ws, context, dim, need_x, need_w):
    return (x.new_empty(x.shape if need_x else (0,)),
            [w.new_empty(w.shape if need else (0,)) for w, need in zip(ws, need_w, strict=True)])


BACKWARD_SCHEMA = ("(Tensor[] grads, Tensor x, Tensor[] ws, Tensor context, int dim, bool need_x, bool[] need_w) "
                   "-> (Tensor, Tensor[])")
SCHEMA = ("(Tensor x, Tensor[] ws, int[] heads, int dim, str group, str strategy, str plan, float? timeout, "
          "bool needs_grad) -> (Tensor[], Tensor)")
_backward_op = library.define(f"{OP}_backward", BACKWARD_SCHEMA, _backward, _backward_fake)
_op = library.define(OP, SCHEMA, _forward, _fake, _autograd_backward, _save)
