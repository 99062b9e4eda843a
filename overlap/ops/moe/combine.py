"""MoE combine: expert results back to their tokens, weighted and summed, optionally fused with the
experts' second GEMM.

Problem. After the experts ran, every row must return to the rank and token it came from, where a
token's ``K`` rows are summed with its routing weights. Computing every expert's output first and then
running the all-to-all leaves the links idle during the GEMMs. The rows for one source rank are a
few (expert, source) blocks, so they can travel while the blocks for the next source are multiplied.
Layouts and the handle: `overlap.ops.moe.layout`.

Strategies: `overlap.ops.moe.to_sources` (``reference``, ``pipelined``, ``symm``, ``fused`` for the
grouped-matmul form, ``hierarchical`` across nodes), which `dispatch`'s backward runs too. The weighted sum is
the same code in all of them (fp32, ``k`` in order), so the strategies differ only by the GEMMs' own rounding.

Autograd (docs/conventions.md): the weighted sum gives ``topk_weights`` the dot products and each row its
``topk_weights``-weighted gradient; those rows travel to the experts again (the dispatch direction,
`overlap.ops.moe.dispatch`), fused there with the input-gradient GEMM ``grad_e @ w2[e].T``; the weight
gradient is ``h_e.T @ grad_e``, one GEMM per expert.

Concurrency and aliasing: as `overlap.ops.moe.dispatch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...plans import Plan, fp8_dtype
from .. import library
from ..context import CallContext, autocast_inputs, describe, no_autocast, preamble, record
from . import bound as moe_bound
from . import cuda as moe_cuda
from . import entry, grouped, layout, to_experts, to_sources
from . import handle as moe_handle
from . import migration as moe_migration
from .handle import MoEHandle

OP_COMBINE = "combine"
OP_MM_COMBINE = "grouped_matmul_combine"


def combine(y_recv: torch.Tensor, topk_weights: torch.Tensor, handle: MoEHandle, strategy: str = "auto",
            plan=None, timeout: float | None = None) -> torch.Tensor:
    """Return every row of `y_recv` to its token and sum a token's rows weighted by `topk_weights`.

    Args:
        y_recv: ``[R, H]`` in the row order of the `dispatch` that made `handle` (``R = handle.num_recv``;
            with the dispatch's ``max_tokens_per_rank``, its bounded row count: only the first
            ``handle.num_recv`` rows are read, the others get a zero gradient).
        topk_weights: ``[T, K]`` floating weights of this rank's tokens (any float dtype; summed in fp32).
        handle: from `dispatch` / `dispatch_grouped_matmul` on the same group.
        strategy, plan, timeout: ``reference``, ``pipelined``, ``symm``, ``hierarchical`` or ``auto``; timeout
            as elsewhere.

    Returns:
        ``[T, H]`` in `y_recv`'s dtype: ``out[t] = sum_k topk_weights[t, k] * row of (t, k)``.

    Raises:
        TypeError / ValueError: shapes that do not match the handle, dtypes, devices, plan; on this rank
            before any data moves, peers raise at once. OverlapMismatchError, OverlapTimeout: as elsewhere.
    """
    return _call(OP_COMBINE, y_recv, None, topk_weights, handle, strategy, plan, timeout)


def grouped_matmul_combine(h: torch.Tensor, w2, topk_weights: torch.Tensor, handle: MoEHandle,
                           strategy: str = "auto", plan=None, timeout: float | None = None) -> torch.Tensor:
    """`combine` of ``h_e @ w2[e]``: each source's rows multiplied, then sent while the next are multiplied.

    Args:
        h: ``[R, F]`` in the handle's row order (e.g. the activation of `dispatch_grouped_matmul`'s output).
        w2: ``[L, F, H]`` (any strides) or a list of ``L`` tensors ``[F, H]``: this rank's experts.
        topk_weights, handle, strategy, plan, timeout: as for `combine`; ``fused`` is available.

    Returns:
        ``[T, H]`` in `h`'s dtype.

    Raises: as `combine`; also for a `w2` of the wrong shape, dtype or device.
    """
    return _call(OP_MM_COMBINE, h, w2, topk_weights, handle, strategy, plan, timeout)


def _call(op, y, w, topk_weights, handle, strategy, plan, timeout) -> torch.Tensor:
    """Both combines' public path: the arguments as the custom op takes them (autocast and a list of
    weights stacked here, where torch.compile traces it), then ``overlap::moe_combine``. Arguments of the
    wrong types raise through the op's checks (which tell the peers) instead."""
    if not isinstance(handle, MoEHandle):
        raise TypeError(f"overlap.moe.{op}: handle must come from overlap.moe.dispatch, got {type(handle).__name__}")
    args = library.call_args(None, strategy, plan, timeout)
    if w is not None:
        w = entry.stacked(w)
    if args is None or not library.tensors(y, topk_weights) or (w is not None and not library.tensors(w)):
        h = moe_handle.layout_of(handle.key, op)
        _prepare(op, y, w, topk_weights, h, strategy, plan, timeout, "")  # raises, peers told
        raise TypeError(f"overlap.moe.{op}: unsupported arguments")  # pragma: no cover - _prepare raised
    if w is not None:
        y, w = autocast_inputs(y, w)
    out, _, _ = _op(y, w, topk_weights, handle.key, *args[1:], entry.grad_flags(y, w, topk_weights))
    return out


def _prepare(op, y, w, topk_weights, h: layout.MoELayout, strategy, plan, timeout, grads: str):
    """Local checks, plan and signature in the dispatch's group (`overlap.ops.context.preamble`: a local
    mistake raises on every rank). `grads`: `entry.grad_flags` of ``(y, w, topk_weights)``. Returns ``(y,
    w, layout with this call's deadline, context of this call)``."""

    def decide(cc: CallContext):
        nonlocal w
        info = cc.info
        entry.check_tokens(op, y, info.device, "the expert rows")
        rows = h.num_recv if h.max_tokens_per_rank is None else moe_bound.capacity(
            info.world_size, h.max_tokens_per_rank, h.top_k, h.num_local_experts)
        if y.shape[0] != rows:
            raise ValueError(f"overlap.moe.{op}: the handle's dispatch gave this rank {rows} rows, "
                             f"got {describe(y)}")
        if w is not None:
            own = h.num_local_experts if h.migration is None else h.migration.own  # (not the hosted copies)
            w = entry.check_weights(op, w, own, y.shape[1], y.dtype, y.device, "w2")
        _check_weights_of_topk(op, topk_weights, h, info.device)
        chosen = _plan(op, h, y, w, strategy, plan, info, "1" in grads[:2])
        moe_migration.check_follows(op, chosen, h.migration, w is not None)
        return chosen, entry.call_signature(f"moe.{op}", h, y, w, chosen, grads=grads[:2]), None

    cc, _ = preamble(f"moe.{op}", h.group, timeout, decide)
    return y, w, _with_deadline(h, cc.timeout), cc


def _plan(op, h: layout.MoELayout, y, w, strategy, plan, info, needs_grad: bool) -> Plan:
    experts = h.num_experts if h.migration is None else h.migration.num_experts  # (the dispatch's own E)
    key_dtype = y.dtype if h.fp8 is None else fp8_dtype(h.fp8.granularity)  # (the dispatch's key: its layer's)
    problem = None if w is None else entry.moe_problem(h.num_tokens, w.shape[2], y.shape[1], experts,
                                                    h.top_k, key_dtype, needs_grad)
    return entry.resolve_plan(op, strategy, plan, info, y.dtype, w is not None, problem, experts)


def _with_deadline(h: layout.MoELayout, timeout: float) -> layout.MoELayout:
    """The layout with a combine's deadline (its backward's too); the dispatch keeps its own."""
    return h if timeout == h.timeout else dataclasses.replace(h, context=h.context.derive(timeout=timeout))


def _check_weights_of_topk(op: str, topk_weights: Any, handle: layout.MoELayout, device: torch.device) -> None:
    if not isinstance(topk_weights, torch.Tensor):
        raise TypeError(f"overlap.moe.{op}: topk_weights must be a tensor, got {type(topk_weights).__name__}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"overlap.moe.{op}: topk_weights must be floating, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (handle.num_tokens, handle.top_k):
        raise ValueError(f"overlap.moe.{op}: topk_weights must be [tokens={handle.num_tokens}, "
                         f"top_k={handle.top_k}] as in the dispatch, got {describe(topk_weights)}")
    if topk_weights.device != device:
        raise ValueError(f"overlap.moe.{op}: topk_weights is on {topk_weights.device}, the group computes on {device}")


# ----------------------------------------------------------------------------------------------
# The custom ops: ``overlap::moe_combine`` (both combines) and its backward
# ----------------------------------------------------------------------------------------------


def _forward(y, w, topk_weights, key, strategy, plan, timeout, grads):
    """``(out, back, context)``: out ``[T, N]`` is the weighted sum; back ``[T*K, N]`` the rows returned to
    their pairs, kept where autograd will need it (the weights' gradient), else 0 elements; context the key of
    this call's plan and layout for the backward (`library.context_out`)."""
    op = OP_COMBINE if w is None else OP_MM_COMBINE
    y, w, h, cc = _prepare(op, y, w, topk_weights, moe_handle.layout_of(key, op), strategy, library.plan_of(plan),
                           timeout, grads)
    y = moe_bound.exact(y, h)  # (a bounded dispatch's padding rows are never read)
    needs_grad = "1" in grads
    context = library.context_out((cc.plan, h), needs_grad)
    with record(cc.op), no_autocast(h.info.device.type):
        if moe_cuda.sums_on_device(y, topk_weights, cc.plan, needs_grad) or (
                entry.sums_in_node(cc) and grads[2] == "0"):  # (the rows are kept only for topk_weights' grad)
            return to_sources.run(h, y, w, cc, weights=topk_weights), y.new_empty(0), context
        back = to_sources.run(h, y, w, cc)
        return grouped.weighted_sum(back, topk_weights, y.dtype), back if needs_grad else y.new_empty(0), context


def _fake(y, w, topk_weights, key, strategy, plan, timeout, grads):
    T, K = topk_weights.shape
    cols = y.shape[1] if w is None else w.shape[2]
    return (y.new_empty((T, cols)), y.new_empty((T * K, cols) if "1" in grads else (0,)),
            library.context_fake("1" in grads))


def _save(ctx, inputs, output) -> None:
    y, w, topk_weights, *_ = inputs
    ctx.save_for_backward(y, w, topk_weights, output[1], output[2])


def _autograd_backward(ctx, grad_out, _grad_back, _grad_context):
    """The weighted sum's gradients here (torch code the compiler traces), the rows' through the backward op."""
    y, w, topk_weights, back, context = ctx.saved_tensors
    need_y, need_w, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    (T, K), N = topk_weights.shape, grad_out.shape[-1]
    acc = torch.float64 if torch.float64 in (back.dtype, topk_weights.dtype) else torch.float32
    g = grad_out.to(acc).unsqueeze(1)  # [T, 1, N]
    grad_t = None
    if need_t:  # (one batched GEMM ``[T, K, N] @ [T, N, 1]``: no ``[T, K, N]`` temporary)
        grad_t = torch.bmm(back.view(T, K, N).to(acc), g.transpose(1, 2)).squeeze(-1).to(topk_weights.dtype)
    grad_y = grad_w = None
    if need_y or need_w:
        grad_back = (g * topk_weights.to(acc).unsqueeze(-1)).reshape(T * K, N).to(back.dtype)
        grad_y, grad_w = _backward_op(grad_back, y, w, context, need_y, need_w)
    return grad_y if need_y else None, grad_w if need_w else None, grad_t, None, None, None, None, None


def _backward(grad_back, y, w, context, need_y, need_w):
    """``overlap::moe_combine_backward``: the rows' gradients to the experts (the dispatch direction), fused
    with ``grad_back @ w[e].T`` where the combine multiplied; the weight gradient from the rows that arrive.
    The forward's plan and layout (with the combine's deadline) come from its context key."""
    op = OP_COMBINE if w is None else OP_MM_COMBINE
    chosen, h = library.kept(context, f"moe.{op}.backward")
    grad_back = grad_back.contiguous()
    padded_y, y = y, moe_bound.exact(y, h)  # a bounded dispatch's padding rows: a zero gradient
    with no_autocast(h.info.device.type):
        if w is None:
            cc = entry.follow_up(h, f"moe.{op}.backward", grad_back, None, chosen)
            grad_y, _ = to_experts.run(h, grad_back, h.order, None, cc)
            return library.grads_out(moe_bound.grad_padded(grad_y, padded_y), None, y, y)
        w = w if h.migration is None else h.migration.extend(w, "w2")  # the hosted experts, as in the forward
        w_t = w.transpose(1, 2) if need_y else None
        if w_t is None and chosen.strategy == "fused":
            chosen = Plan("symm", chosen.num_chunks)  # no GEMM to fuse: the rows alone travel as in symm
        cc = entry.follow_up(h, f"moe.{op}.backward", grad_back, w_t, chosen)
        grad_rows, grad_y = to_experts.run(h, grad_back, h.order, w_t, cc, keep_rows=True)
        grad_w = grouped.grouped_weight_grad(y, grad_rows, h, w) if need_w else None
        if grad_w is not None and h.migration is not None:  # the copies' gradients to their owners
            grad_w = h.migration.give_back(grad_w, "w2", cc)
    return library.grads_out(moe_bound.grad_padded(grad_y, padded_y) if need_y else None, grad_w, y, y)


def _backward_fake(grad_back, y, w, context, need_y, need_w):
    return (y.new_empty(y.shape if need_y else (0,)), y.new_empty(w.shape if need_w and w is not None else (0,)))


_backward_op = library.define(
    "moe_combine_backward",
    "(Tensor grad, Tensor y, Tensor? w, Tensor context, bool need_y, bool need_w) -> (Tensor, Tensor)",
    _backward, _backward_fake)
_op = library.define(
    "moe_combine",
    "(Tensor y, Tensor? w, Tensor topk_weights, Tensor key, str strategy, str plan, float? timeout, str grads) "
    "-> (Tensor, Tensor, Tensor)",
    _forward, _fake, _autograd_backward, _save)
