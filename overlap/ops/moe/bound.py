"""MoE with a fixed bound: ``max_tokens_per_rank=B`` gives the dispatch's output a static shape.

Without a bound a dispatch returns exactly the rows this rank's experts receive, a count that depends on
every rank's routing (a data-dependent size: torch.compile needs an unbacked symbol for it). With
``max_tokens_per_rank=B`` on every rank of the call:

* ``x_recv`` / ``h`` are ``[capacity, cols]`` with ``capacity = W * B * min(K, L)``: the received rows
  in today's expert order (local expert, then source rank, then token order), packed at the front; the
  rows after them (padding) are zero.
* The handle carries the layout as tensors on the tokens' device (pytree children, so a compiled graph
  can read them): ``tokens_per_expert`` ``[L]``, ``expert_offsets`` ``[L, W]``, ``num_recv`` ``[]`` (all
  int64). In eager code the host lists stay at ``handle.layout``.
* Padding rows are never read: the combine reads the first ``num_recv`` rows only, the backward of the
  dispatch takes the first ``num_recv`` rows of the gradient, and the rows' gradient that a combine
  returns is zero on the padding. An expert function that maps a zero row to a nonzero one (a bias)
  therefore changes no result and no gradient.
* A rank with more than ``B`` tokens (or one that would send more than ``B * min(K, L)`` rows to one rank:
  a token naming one expert twice) raises ValueError before any data moves; its peers raise
  `overlap.OverlapMismatchError` (a ValueError) at once. ``B`` is part of the call signature.

Today the bounded ops run the exact-count transfer of every strategy (the counts still travel to the
host inside the op) and then place the rows into the bounded output; what the bound gives is static
shapes, so the custom op's fake returns a fixed row count and the bounded dispatch is an ordered effect
like every other op (`overlap.ops.library`). The custom op, ``overlap::moe_dispatch_bounded`` (`define`,
called by `overlap.ops.moe.dispatch`), shares the unbounded dispatch's implementation and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import library
from . import fp8 as moe_fp8
from . import handle as moe_handle
from . import layout


def capacity(world_size: int, bound: int, top_k: int, num_local_experts: int) -> int:
    """Rows of a bounded dispatch's output: ``W * B * min(K, L)``."""
    return world_size * bound * min(top_k, num_local_experts)


def check_bound(op: str, bound: Any, num_tokens: int) -> None:
    """`bound` is None or a positive int of at least this rank's token count (ValueError otherwise)."""
    if bound is None:
        return
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        raise ValueError(f"overlap.moe.{op}: max_tokens_per_rank must be None or a positive int, got {bound!r}")
    if num_tokens > bound:
        raise ValueError(f"overlap.moe.{op}: this rank has {num_tokens} tokens, more than "
                         f"max_tokens_per_rank={bound}")


def check_rows(op: str, bound: int | None, send_counts: list[list[int]], top_k: int, num_local_experts: int) -> None:
    """Every destination gets at most ``B * min(K, L)`` rows from this rank (only a token that names one
    expert more than once can send more)."""
    if bound is None:
        return
    limit = bound * min(top_k, num_local_experts)
    for d, row in enumerate(send_counts):
        if sum(row) > limit:
            raise ValueError(f"overlap.moe.{op}: this rank sends {sum(row)} rows to rank {d}, more than "
                             f"max_tokens_per_rank * min(top_k, local experts) = {limit} (a token names one "
                             "expert more than once)")


def begin(cc: Any, h: layout.MoELayout, kind: str, row_bytes: int) -> Any:
    """The handshake of one transfer of `h`'s call (`CallContext.begin`). Exact counts: the slot sized for
    this rank's rows, agreed in a full handshake. With a bound: sized for ``B * min(K, L)`` rows from every
    source, a size the signature fixes, so a warmed ``symm`` transfer takes the steady state (no host
    rendezvous: `overlap.symm.handshake`; its waits on the counts' flags of every source check the peers'
    signatures in the data)."""
    B = h.max_tokens_per_rank
    if B is None:
        splits = [] if h.routed is not None else h.send_splits  # (a route still on the device: no heap slot)
        return cc.begin(layout.heap_need(kind, h.num_tokens, h.top_k, h.num_local_experts, splits,
                                         row_bytes, cc.world_size))
    rows = B * min(h.top_k, h.num_local_experts)
    need = layout.heap_need(kind, B, h.top_k, h.num_local_experts, [rows], row_bytes, cc.world_size)
    return cc.begin(need, steady=kind == "symm")


def signature_part(bound: int | None) -> str:
    return "" if bound is None else f", max_tokens_per_rank={bound}"


def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` (``[n, cols]``, ``n <= rows``) followed by zero rows up to `rows`."""
    out = t.new_zeros((rows, t.shape[1]))
    out[: t.shape[0]].copy_(t)
    return out


def grad_padded(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A gradient of the first rows of `like` as a gradient of all of `like` (zero on the padding)."""
    return grad if grad.shape[0] == like.shape[0] else padded(grad, like.shape[0])


def device_layout(h: layout.MoELayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens_per_expert [L], expert_offsets [L, W], num_recv [])``, int64 on `device`."""
    L, W = h.num_local_experts, len(h.recv_counts)
    flat = [*h.tokens_per_expert, *(o for row in h.expert_offsets for o in row), h.num_recv]
    t = torch.tensor(flat, dtype=torch.int64).to(device)
    return t[:L].clone(), t[L : L + L * W].view(L, W).clone(), t[-1].clone()


def exact(rows: torch.Tensor, h: layout.MoELayout) -> torch.Tensor:
    """The rows a bounded call's `rows` hold before their padding (all of them without a bound)."""
    return rows if h.max_tokens_per_rank is None or rows.dim() != 2 else rows[: h.num_recv]


# ----------------------------------------------------------------------------------------------
# The custom op: ``overlap::moe_dispatch_bounded`` (both dispatches with a bound)
# ----------------------------------------------------------------------------------------------


def define(forward: Callable, backward_op: Any) -> Any:
    """Define ``overlap::moe_dispatch_bounded`` around the unbounded dispatch's `forward` (exact rows, given
    the bound for its checks and signature) and its backward op `backward_op` (which reads only the first
    ``num_recv`` rows of a bounded gradient). Returns the op's overload packet."""

    def bounded(x, topk_idx, w, num_experts, bound, group, strategy, plan, timeout, grads, fp8):
        out, rows, key = forward(x, topk_idx, w, num_experts, group, strategy, plan, timeout, grads, fp8, bound)
        h = moe_handle.layout_of(key, "dispatch")
        cap = capacity(h.info.world_size, bound, h.top_k, h.num_local_experts)
        rows = padded(rows, cap) if rows.dim() == 2 else rows
        return (padded(out, cap), rows, key, *device_layout(h, x.device))

    def save(ctx, inputs, output) -> None:
        x, topk_idx, w, *_ = inputs
        ctx.save_for_backward(topk_idx, output[1], w, output[2])

    def autograd_backward(ctx, grad_out, *_grads):
        topk_idx, rows, w, key = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_x, grad_w = backward_op(grad_out, topk_idx, rows, w, key, need_x, need_w)
        return (grad_x if need_x else None, None, grad_w if need_w else None) + (None,) * 8

    return library.define(
        "moe_dispatch_bounded",
        "(Tensor x, Tensor topk_idx, Tensor? w, int num_experts, int bound, str group, str strategy, str plan, "
        "float? timeout, str grads, str fp8) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        bounded, _fake, autograd_backward, save)  # static shapes: an ordered effect like every other op


def _fake(x, topk_idx, w, num_experts, bound, group, strategy, plan, timeout, grads, fp8):
    W = library.world_size(group)
    L = num_experts // W
    cap = capacity(W, bound, topk_idx.shape[1], L)
    cols = x.shape[1] if w is None else w.shape[2]
    counts = torch.empty(L, dtype=torch.int64, device=x.device)
    return (x.new_empty((cap, cols)), moe_fp8.kept_rows(x, w, grads, fp8, cap),
            torch.empty(1, dtype=torch.int64), counts, counts.new_empty((L, W)), counts.new_empty(()))
