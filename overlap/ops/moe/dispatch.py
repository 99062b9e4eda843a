"""MoE dispatch: tokens to the ranks of their experts, optionally fused with the experts' first GEMM.

Problem. With expert parallelism every rank routes each of its ``T`` tokens to ``K`` experts spread
over the ``W`` ranks; an all-to-all sends each (token, expert) pair's row to the rank of its expert,
which then runs one GEMM per local expert. Sending everything first leaves the GEMMs idle during the
all-to-all. Each (source rank, expert) block of rows is its own GEMM, so a block can be multiplied as
soon as it has arrived while the others are still in flight. Layouts and the handle: `overlap.ops.moe.layout`.

Strategies: `overlap.ops.moe.to_experts` (``reference``, ``pipelined``, ``symm``, ``fused`` for the
grouped-matmul form, ``hierarchical`` across nodes), which `combine`'s backward runs too.

Autograd (docs/conventions.md): the backward of the transfer sends each row's gradient back to its token and
sums a token's ``K`` copies (in fp32, ``k`` in order); it is the combine direction
(`overlap.ops.moe.combine`), fused there with the input-gradient GEMM ``grad_h_e @ w1[e].T``. The
weight gradient ``x_recv_e.T @ grad_h_e`` is one GEMM per expert, run while those rows travel.

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; inputs are only read; outputs are new tensors (the heap is reused by the next call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...plans import fp8_dtype
from .. import library
from ..context import CallContext, autocast_inputs, no_autocast, preamble, record
from ..fp8_recipe import text_of
from . import bound as moe_bound
from . import entry, grouped, layout, to_experts, to_sources
from . import fp8 as moe_fp8
from . import handle as moe_handle
from . import migration as moe_migration
from .handle import MoEHandle

OP_DISPATCH = "dispatch"
OP_DISPATCH_MM = "dispatch_grouped_matmul"


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None = None,
             strategy: str = "auto", plan=None, timeout: float | None = None,
             max_tokens_per_rank: int | None = None, fp8=None) -> tuple[torch.Tensor, MoEHandle]:
    """Send every (token, expert) pair's row to the rank that holds the expert.

    Args:
        x: ``[T, H]``, this rank's tokens (``T`` may differ between ranks, and may be 0).
        topk_idx: ``[T, K]`` int64/int32 global expert ids; experts ``r*L ... (r+1)*L - 1`` live on rank
            ``r`` (``L = num_experts / W``). Any routing: repeated and unused experts are fine.
        num_experts: ``E``, divisible by the group's size.
        group, strategy, plan, timeout: as for `overlap.all_gather_matmul`; strategies ``reference``,
            ``pipelined``, ``symm``, ``hierarchical`` (``auto`` picks one).
        max_tokens_per_rank: ``B``, None (exact row counts) or a bound on every rank's ``T``, the same on
            every rank: ``x_recv`` is then ``[W * B * min(K, L), H]``, the rows packed at the front and zero
            padding after them, and the handle's ``tokens_per_expert``, ``expert_offsets`` and ``num_recv``
            are int64 tensors on the tokens' device (`overlap.ops.moe.bound`). Static shapes for
            torch.compile; the counts still travel to the host inside the op.
        fp8: None, or ``"rowwise"``, ``"block128"``, ``"mxfp8"`` (or an `overlap.Fp8Recipe` of one): every
            token is quantized to e4m3 once, on this rank, and travels with its scales in its row
            (`overlap.ops.moe.fp8`); ``x_recv`` holds the values the fp8 rows stand for, in ``x``'s dtype (a
            recipe's ``grads`` has no GEMM to act on here: the backward is the straight-through copy).

    Returns:
        ``(x_recv, handle)``: ``x_recv`` ``[R, H]`` holds the rows of this rank's experts grouped by local
        expert, then source rank, then token order (``handle.expert_offsets``, ``handle.tokens_per_expert``);
        ``handle`` is what `combine` and the backward need.

    Raises:
        TypeError / ValueError: bad arguments (shapes, dtypes, expert ids out of range, ``num_experts``
            not divisible by the world size, more than ``max_tokens_per_rank`` tokens), on this rank before
            any data moves; peers raise at once (OverlapMismatchError, a ValueError).
        OverlapMismatchError: ranks made different calls (hidden size, experts, top-k, dtype, plan, bound).
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    return _call(OP_DISPATCH, x, topk_idx, None, num_experts, group, strategy, plan, timeout, max_tokens_per_rank,
                 fp8)


def dispatch_grouped_matmul(x: torch.Tensor, topk_idx: torch.Tensor, w1, num_experts: int,
                            group: dist.ProcessGroup | None = None, strategy: str = "auto", plan=None,
                            timeout: float | None = None, max_tokens_per_rank: int | None = None,
                            fp8=None) -> tuple[torch.Tensor, MoEHandle]:
    """`dispatch`, then ``h_e = x_recv_e @ w1[e]`` for every local expert, each block multiplied on arrival.

    Args:
        x, topk_idx, num_experts, group, strategy, plan, timeout, max_tokens_per_rank: as for `dispatch`;
            ``fused`` is available.
        w1: ``[L, H, F]`` (any strides) or a list of ``L`` tensors ``[H, F]``: this rank's experts, in order.
        fp8: as for `dispatch`; the tokens stay fp8 into the GEMM, ``w1`` is quantized along ``H`` at the same
            granularity and each block is a scaled GEMM (`overlap.ops.moe.fp8`); ``h`` has ``w1``'s dtype. The
            backward's GEMMs run in ``w1``'s dtype, or in fp8 with a recipe of ``grads=True`` (``"rowwise+grads"``,
            ``"block128+grads"``, ``"mxfp8+grads"``; ``mxfp8`` then needs ``F`` a multiple of 32).

    Returns:
        ``(h, handle)``: ``h`` ``[R, F]`` in `dispatch`'s row order (no activation applied; with
        ``max_tokens_per_rank``, ``[W * B * min(K, L), F]`` with zero padding rows).

    Raises: as `dispatch`; also for a `w1` of the wrong shape, dtype or device.
    """
    return _call(OP_DISPATCH_MM, x, topk_idx, w1, num_experts, group, strategy, plan, timeout, max_tokens_per_rank,
                 fp8)


def _call(op, x, topk_idx, w, num_experts, group, strategy, plan, timeout, bound,
          fp8) -> tuple[torch.Tensor, MoEHandle]:
    """Both dispatches' public path: the arguments as the custom op takes them (autocast and a list of
    weights stacked here, where torch.compile traces it), then ``overlap::moe_dispatch`` (with a `bound`,
    ``overlap::moe_dispatch_bounded``). Arguments of the wrong types raise through the op's checks (which
    tell the peers) instead."""
    args = library.call_args(group, strategy, plan, timeout)
    fp8 = text_of(fp8) if fp8 is not None else ""
    if w is not None:
        w = entry.stacked(w)
    if (args is None or not library.tensors(x, topk_idx) or (w is not None and not library.tensors(w))
            or isinstance(num_experts, bool) or not isinstance(num_experts, int)
            or (bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)))
            or not isinstance(fp8, str)):
        _prepare(op, x, topk_idx, num_experts, w, group, strategy, plan, timeout, "", bound, fp8)  # raises, peers told
        raise TypeError(f"overlap.moe.{op}: unsupported arguments")  # pragma: no cover - _prepare raised
    if w is not None:
        x, w = autocast_inputs(x, w)
    grads = entry.grad_flags(x) if w is None else entry.grad_flags(x, w)
    L = num_experts // dist.get_world_size(group)
    if bound is None:
        out, _, key = _op(x, topk_idx, w, num_experts, *args, grads, fp8)
        return out, MoEHandle(key, num_experts, L, topk_idx.shape[1])
    out, _, key, *tensors = _bounded_op(x, topk_idx, w, num_experts, bound, *args, grads, fp8)
    return out, MoEHandle(key, num_experts, L, topk_idx.shape[1], bound, tuple(tensors))


def _prepare(op, x, topk_idx, num_experts, w, group, strategy, plan, timeout, grads: str, bound=None, fp8=""):
    """Local checks, plan, routing and signature (`overlap.ops.context.preamble`: a local mistake raises on
    every rank). `grads`: `entry.grad_flags` of ``x`` (and ``w``), read by the caller. Returns ``(x, w,
    layout)``; the layout holds the dispatch's call context and its fp8 row format."""

    def decide(cc: CallContext):
        nonlocal w
        info = cc.info
        L = entry.check_experts(op, num_experts, info.world_size)
        entry.check_tokens(op, x, info.device)
        recipe = moe_fp8.check(op, fp8, x)
        if w is not None:
            w = entry.check_weights(op, w, L, x.shape[1], x.dtype, x.device, "w1")
            moe_fp8.check_width(f"moe.{op}", recipe, w.shape[2])
        entry.check_topk_idx(op, topk_idx, x.shape[0], x.device)
        moe_bound.check_bound(op, bound, x.shape[0])
        key_dtype = x.dtype if recipe is None else fp8_dtype(recipe.granularity)  # (an fp8 call's bytes differ)
        problem = None if w is None else entry.moe_problem(x.shape[0], x.shape[1], w.shape[2], num_experts,
                                                        topk_idx.shape[1], key_dtype, "1" in grads)
        chosen = entry.resolve_plan(op, strategy, plan, info, x.dtype, w is not None, problem, num_experts)
        mig = moe_migration.prepare(op, chosen, info, num_experts, bound)  # (hosted experts)
        idx, E = (topk_idx, num_experts) if mig is None else (mig.remap(op, topk_idx), mig.hosted * info.world_size)
        if entry.reads_route_with_counts(chosen, bound, mig):  # (read with the received counts)
            (order, routed), send_counts = entry.route_stats(idx, E), []
        else:
            (order, send_counts), routed = entry.route(op, idx, E, info.world_size), None
            moe_bound.check_rows(op, bound, send_counts, topk_idx.shape[1], L)
        sig = entry.signature(f"moe.{op}", x.shape[1], None if w is None else w.shape[2], num_experts,
                               topk_idx.shape[1], x.dtype, chosen, info, grads) + moe_bound.signature_part(bound)
        sig += f", fp8={recipe.text}" if recipe is not None else ""
        return chosen, sig, (E, order, send_counts, routed, mig, moe_fp8.row_format(recipe, x.shape[1], x.device))

    cc, (E, order, send_counts, routed, mig, fmt) = preamble(f"moe.{op}", group, timeout, decide)
    h = layout.MoELayout(cc, E, E // cc.world_size, topk_idx.shape[1], x.shape[0], send_counts, order,
                         max_tokens_per_rank=bound, migration=mig, routed=routed, fp8=fmt)
    return x, w, h


# ----------------------------------------------------------------------------------------------
# The custom ops: ``overlap::moe_dispatch`` (both dispatches) and its backward
# ----------------------------------------------------------------------------------------------


def forward(x, topk_idx, w, num_experts, group, strategy, plan, timeout, grads, fp8="", bound=None):
    """``(out, rows, key)``: out is ``x_recv`` (no `w`) or ``h``; rows is ``x_recv`` where the weight
    gradient will need it (else 0 elements; packed fp8 rows with `fp8`); key names the layout
    (`overlap.ops.moe.handle`). Exact row counts, also with a `bound` (`overlap.ops.moe.bound` pads them)."""
    op = OP_DISPATCH if w is None else OP_DISPATCH_MM
    x, w, h = _prepare(op, x, topk_idx, num_experts, w, library.group_of(group), strategy, library.plan_of(plan),
                       timeout, grads, bound, fp8)
    with record(f"moe.{op}"), no_autocast(h.info.device.type):
        keep = w is not None and grads[1] == "1"
        rows = x if h.fp8 is None else moe_fp8.pack(x, h.fp8)  # (once per token, before routing copies it)
        recv, out = to_experts.run(h, rows, h.token_of, w, h.context, counts=True, keep_rows=keep, fp8=h.fp8)
    if w is None:
        if h.fp8 is not None:
            recv = moe_fp8.dequantize_rows(recv, h.fp8, x.dtype)
        return recv, x.new_empty(0), moe_handle.register(h)
    return out, recv if keep else x.new_empty(0), moe_handle.register(h)


def _fake(x, topk_idx, w, num_experts, group, strategy, plan, timeout, grads, fp8=""):
    rows = torch.library.get_ctx().new_dynamic_size()  # data-dependent: the routing of every rank
    cols = x.shape[1] if w is None else w.shape[2]
    return x.new_empty((rows, cols)), moe_fp8.kept_rows(x, w, grads, fp8, rows), torch.empty(1, dtype=torch.int64)


def _save(ctx, inputs, output) -> None:
    x, topk_idx, w, *_ = inputs
    _, rows, key = output
    ctx.save_for_backward(topk_idx, rows, w, key)


def _autograd_backward(ctx, grad_out, _grad_rows, _grad_key):
    topk_idx, rows, w, key = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_x, grad_w = backward_op(grad_out, topk_idx, rows, w, key, need_x, need_w)
    return (grad_x if need_x else None, None, grad_w if need_w else None) + (None,) * 7


def _backward(grad_out, topk_idx, rows, w, key, need_x, need_w):
    """``overlap::moe_dispatch_backward``: each row's gradient back to its token (the combine direction),
    fused with ``grad_h_e @ w[e].T`` where the dispatch multiplied; the weight gradient meanwhile."""
    op = OP_DISPATCH if w is None else OP_DISPATCH_MM
    h = moe_handle.layout_of(key, f"{op}.backward")
    grad_out, rows = moe_bound.exact(grad_out, h).contiguous(), moe_bound.exact(rows, h)  # (padding: never read)
    fp8_grads = h.fp8 if w is not None and h.fp8 is not None and h.fp8.grads else None  # (`overlap.ops.moe.fp8`)
    grads_in = None if fp8_grads is None else fp8_grads.granularity  # (the weight gradient's GEMMs in fp8)
    if need_w and h.fp8 is not None:  # what the forward multiplied: the values of the fp8 rows
        rows = moe_fp8.dequantize_rows(rows, h.fp8, w.dtype if fp8_grads is None else torch.float32)
    grad_w: list[torch.Tensor] = []
    w = w if h.migration is None else h.migration.extend(w, "w1")  # the hosted experts, as in the forward

    def weight_grad() -> None:  # runs while the input-gradient rows travel
        if need_w:
            grad_w.append(grouped.grouped_weight_grad(rows, grad_out, h, w, grads_in))

    grad_x = None
    with no_autocast(h.info.device.type):
        if need_x:
            w_t = None if w is None else w.transpose(1, 2)
            cc = entry.follow_up(h, f"moe.{op}.backward", grad_out, w_t, h.plan)
            y = grad_out
            if fp8_grads is not None:  # the output gradient's rows quantized once, here; w1 along N to match
                y, w_t = moe_fp8.backward_operands(grad_out, w_t, fp8_grads)
            if entry.sums_in_node(cc):  # a token's copies summed within each node before they cross
                ones = torch.ones((h.num_tokens, h.top_k), dtype=torch.float32, device=grad_out.device)
                grad_x = to_sources.run(h, y, w_t, cc, between=weight_grad, weights=ones)
            else:
                grad_x = _sum_copies(to_sources.run(h, y, w_t, cc, between=weight_grad), h)
        else:
            weight_grad()
        if need_w and h.migration is not None:  # the copies' gradients to their owners
            grad_w[0] = h.migration.give_back(grad_w[0], "w1", h.context.derive(op=f"moe.{op}.backward"))
    return library.grads_out(grad_x, grad_w[0] if need_w else None, grad_out, grad_out)


def _backward_fake(grad_out, topk_idx, rows, w, key, need_x, need_w):
    hidden = grad_out.shape[1] if w is None else w.shape[1]
    return (grad_out.new_empty((topk_idx.shape[0], hidden) if need_x else (0,)),
            grad_out.new_empty(w.shape if need_w and w is not None else (0,)))


backward_op = library.define(
    "moe_dispatch_backward",
    "(Tensor grad, Tensor topk_idx, Tensor rows, Tensor? w, Tensor key, bool need_x, bool need_w) -> (Tensor, Tensor)",
    _backward, _backward_fake)
_op = library.define(
    "moe_dispatch",
    "(Tensor x, Tensor topk_idx, Tensor? w, int num_experts, str group, str strategy, str plan, float? timeout, "
    "str grads, str fp8) -> (Tensor, Tensor, Tensor)",
    # Not an ordered effect: inductor (torch 2.13) cannot schedule an effectful op whose output has a
    # data-dependent size. Never dropped (a side effect); its data orders it before its combine. (With a
    # bound the sizes are static: `overlap.ops.moe.bound`'s op is ordered.)
    forward, _fake, _autograd_backward, _save, ordered=False)
_bounded_op = moe_bound.define(forward, backward_op)  # ``overlap::moe_dispatch_bounded`` (max_tokens_per_rank)


def _sum_copies(back: torch.Tensor, h: layout.MoELayout) -> torch.Tensor:
    """``grad_x[t] = sum_k back[t*K + k]`` (fp32 for 16-bit rows, ``k`` in order)."""
    T, K = h.num_tokens, h.top_k
    acc = torch.float32 if back.dtype in (torch.float16, torch.bfloat16) else back.dtype
    return back.view(T, K, back.shape[-1]).to(acc).sum(dim=1).to(back.dtype)
