"""The entry of an MoE call, before any row moves: input checks and routing (local, before any communication), the
plan, the call's `overlap.plans.Problem` and signature, the context of a call that follows a dispatch, and the counts'
exchange (the dispatch's one device-to-host read). Legend and row orders: `overlap.ops.moe.layout`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist

from ... import world
from ...errors import OverlapMismatchError
from ...plans import Plan, Problem
from ...plans.auto import as_plan, fit_plan, plan_source, resolve_auto
from ...stages import timed
from ..context import FLOAT_DTYPES, CallContext, describe
from ..fused import check_fused_available
from .layout import MoELayout

# ----------------------------------------------------------------------------------------------
# Input checks and routing (local, before any communication)
# ----------------------------------------------------------------------------------------------


def check_experts(op: str, num_experts: Any, world_size: int) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        got = (f"a tensor of shape {tuple(num_experts.shape)} (arguments in the wrong order?)"
               if isinstance(num_experts, torch.Tensor) else repr(num_experts))
        raise ValueError(f"overlap.moe.{op}: num_experts must be a positive int, got {got}")
    if num_experts % world_size:
        raise ValueError(f"overlap.moe.{op}: num_experts ({num_experts}) must divide by the expert-parallel "
                         f"world size ({world_size}): experts are split evenly and contiguously over ranks")
    return num_experts // world_size


def check_tokens(op: str, x: Any, device: torch.device, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"overlap.moe.{op}: {name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"overlap.moe.{op}: {name} must be [tokens, hidden], got {describe(x)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"overlap.moe.{op}: {name} must have a dtype in {FLOAT_DTYPES}, got {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError(f"overlap.moe.{op}: {name} has no columns: {describe(x)}")
    if x.device.type != device.type or (device.type == "cuda" and x.device.index != device.index):
        raise ValueError(f"overlap.moe.{op}: this rank's group computes on {device} but {name} is on {x.device}")


def check_topk_idx(op: str, topk_idx: Any, num_tokens: int, device: torch.device) -> None:
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"overlap.moe.{op}: topk_idx must be a tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"overlap.moe.{op}: topk_idx must be int64 or int32, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens or topk_idx.shape[1] < 1:
        raise ValueError(f"overlap.moe.{op}: topk_idx must be [tokens, top_k] with tokens={num_tokens} and "
                         f"top_k >= 1, got {describe(topk_idx)}")
    if topk_idx.device != device:
        raise ValueError(f"overlap.moe.{op}: topk_idx is on {topk_idx.device}, the tokens on {device}")


def check_weights(op: str, w: Any, num_local_experts: int, rows: int, dtype: torch.dtype, device: torch.device,
                  name: str) -> torch.Tensor:
    """Stacked ``[L, in, out]`` expert weights (a list of ``[in, out]`` tensors is stacked)."""
    if isinstance(w, (list, tuple)):
        if len(w) != num_local_experts or not all(isinstance(t, torch.Tensor) for t in w):
            raise ValueError(f"overlap.moe.{op}: {name} as a list needs {num_local_experts} tensors (one per local "
                             f"expert), got {len(w)} items")
        if len({tuple(t.shape) for t in w}) != 1 or w[0].dim() != 2:
            raise ValueError(f"overlap.moe.{op}: {name}'s tensors must all be [in, out], got "
                             f"{[tuple(t.shape) for t in w]}")
        w = torch.stack(list(w))
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"overlap.moe.{op}: {name} must be a tensor or a list of tensors, got {type(w).__name__}")
    if w.dim() != 3 or w.shape[0] != num_local_experts or w.shape[1] != rows or w.shape[2] == 0:
        raise ValueError(f"overlap.moe.{op}: {name} must be [num_local_experts={num_local_experts}, in={rows}, out], "
                         f"got {describe(w)}")
    if w.dtype != dtype:
        raise TypeError(f"overlap.moe.{op}: {name} ({w.dtype}) and the rows ({dtype}) must have one dtype outside "
                        "autocast")
    if w.device != device:
        raise ValueError(f"overlap.moe.{op}: {name} is on {w.device}, the rows on {device}")
    return w


def stacked(w: Any) -> Any:
    """A list or tuple of equal-shaped ``[in, out]`` tensors stacked into ``[L, in, out]``; anything else as
    it is (`check_weights` says what is wrong with it)."""
    if (isinstance(w, (list, tuple)) and w and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in w)
            and len({(tuple(t.shape), t.dtype, t.device) for t in w}) == 1):
        return torch.stack(list(w))
    return w


def route(op: str, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Send order and per-(rank, local expert) counts of this rank's pairs; raises on bad expert ids.

    One device-to-host transfer (the counts, with the ids' range)."""
    order, stats = route_stats(topk_idx, num_experts)
    return order, routed_counts(op, stats.tolist(), num_experts, world_size)


@timed("route")
def route_stats(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` left on the device: the send order, and this rank's pairs per global expert followed by its
    smallest and largest expert id (int64 ``[E + 2]``; ids out of range are counted at the nearest end, the two
    ids tell). No host transfer."""
    flat = topk_idx.reshape(-1).to(torch.int64)
    if flat.numel() == 0:
        return flat, flat.new_zeros(num_experts + 2)  # (ids 0 to 0: in range)
    lo, hi = torch.aminmax(flat)
    stats = torch.cat([torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts), lo.view(1), hi.view(1)])
    return torch.argsort(flat, stable=True), stats


@timed("route")
def routed_counts(op: str, stats: list[int], num_experts: int, world_size: int) -> list[list[int]]:
    """``send_counts`` (``[W][L]``) from `route_stats`' values read to the host; raises on bad expert ids."""
    bad = bad_ids(num_experts, stats[num_experts], stats[num_experts + 1])
    if bad:
        raise ValueError(f"overlap.moe.{op}: {bad}")
    L = num_experts // world_size
    return [stats[d * L : (d + 1) * L] for d in range(world_size)]


def bad_ids(num_experts: int, lo: int, hi: int) -> str | None:
    """What is wrong with expert ids from `lo` to `hi`, or None where they are all in range."""
    if lo < 0 or hi >= num_experts:
        return f"expert ids must be in [0, {num_experts}), got values from {lo} to {hi}"
    return None


def reads_route_with_counts(chosen: Plan, bound: int | None, migration: Any) -> bool:
    """Whether a dispatch reads its route to the host with the received counts (`exchange_counts`) instead of
    before its handshake: plans whose counts travel by a collective (``reference``, ``pipelined``) with exact
    counts and no migration. The others size their heap slot or check their bound from this rank's counts
    before the handshake."""
    return chosen.strategy in ("reference", "pipelined") and bound is None and migration is None


# ----------------------------------------------------------------------------------------------
# The call's preamble and handshake
# ----------------------------------------------------------------------------------------------


def resolve_plan(op: str, strategy: str, plan, info: world.GroupInfo, dtype: torch.dtype, allow_fused: bool,
                 problem: Problem | None = None, num_experts: int | None = None) -> Plan:
    """The call's plan: forced, else ``auto`` (a plan file's entry for `problem`'s layer, the heuristic), the
    same on every rank: nothing of it depends on this rank's token count (token counts differ between ranks).
    `num_experts` (``E``) for the checks of ``plan.migrate``."""
    chosen = as_plan(strategy, plan)
    if chosen is None:
        chosen = resolve_auto(op, f"moe {op}", info, None, str(dtype).removeprefix("torch."),
                              problem=problem, plan_file=plan_source(plan))
        if chosen.strategy == "fused" and not allow_fused:
            chosen = dataclasses.replace(chosen, strategy="symm")
    if chosen.strategy == "fused" and not allow_fused:
        raise ValueError(f"overlap.moe.{op}: strategy 'fused' fuses a grouped GEMM; plain {op} has 'reference', "
                         "'pipelined' and 'symm' (use the grouped-matmul form)")
    chosen = fit_plan(op, chosen, info, num_experts)
    if chosen.strategy == "fused":
        check_fused_available(op, dtype)
    return chosen


def sums_in_node(cc: CallContext) -> bool:
    """Whether a transfer back to the sources can sum a token's rows within each node before they cross
    (``hierarchical`` across nodes, `overlap.ops.moe.hierarchical`)."""
    return cc.plan.strategy == "hierarchical"


@functools.lru_cache(maxsize=256)
def moe_problem(tokens: int, hidden: int, ffn: int, num_experts: int, top_k: int, dtype: torch.dtype | str,
                backward: bool) -> Problem | None:
    """The `overlap.plans.Problem` of a grouped-GEMM MoE call (plan files are keyed by it); `dtype`: the tokens',
    or an fp8 dispatch's `overlap.plans.fp8_dtype`; `backward`: whether the call's backward will run. Once per
    shape (a `Problem` is immutable; every dispatch and combine asks for it)."""
    try:
        return Problem("moe", max(tokens, 1), hidden, ffn, str(dtype).removeprefix("torch."), backward,
                                num_experts, top_k)
    except ValueError:  # a call the model does not describe: no plan file entry can match it
        return None


def signature(op: str, hidden: int, out: int | None, num_experts: int, top_k: int, dtype: torch.dtype,
              chosen: Plan, info: world.GroupInfo, grads: str = "") -> str:
    """The call signature: everything ranks must agree on (token counts may differ, so they are not in it).

    `grads`: one ``0``/``1`` per tensor whose gradient the backward computes (`grad_flags`); part of the
    signature, since the backward communicates only where autograd calls it (ranks that disagree would
    leave each other waiting in the backward: they raise in the forward instead)."""
    cols = f"h={hidden}" + (f"->{out}" if out is not None else "")
    return (f"{op}({cols}, experts={num_experts}, top_k={top_k}, {str(dtype).removeprefix('torch.')}, "
            f"plan={chosen.describe()}, ring={info.slowest_link}{', grads=' + grads if grads else ''})")


def grad_flags(*tensors: Any) -> str:
    """``"1"`` per tensor autograd will ask a gradient for, else ``"0"`` (read where the op is called: inside
    a custom op autograd is off)."""
    return "".join(str(int(torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad))
                   for t in tensors)


def call_signature(op: str, h: MoELayout, rows: torch.Tensor, w: torch.Tensor | None, chosen: Plan,
                   grads: str = "") -> str:
    """`signature` of a call that follows a dispatch (a combine, a backward)."""
    return signature(op, rows.shape[1], None if w is None else w.shape[2], h.num_experts, h.top_k, rows.dtype,
                     chosen, h.info, grads)


def follow_up(h: MoELayout, op: str, rows: torch.Tensor, w: torch.Tensor | None, chosen: Plan,
              grads: str = "") -> CallContext:
    """The context of a call that follows the dispatch of `h` (a combine, a backward): its op, plan and
    signature in the dispatch's group and deadline."""
    return h.context.derive(op=op, plan=chosen, signature=call_signature(op, h, rows, w, chosen, grads))


@timed("counts")
def exchange_counts(handle: MoELayout, cc: CallContext) -> None:
    """``recv_counts`` from every rank's ``send_counts`` with one ``all_to_all_single`` (bounded wait).

    Each rank sends every rank its counts for that rank's experts with its own smallest and largest expert id.
    A layout still ``routed`` on the device reads its own route with the received counts, at once: the
    dispatch's one device-to-host transfer. A rank whose ids are out of range raises ValueError, its peers
    OverlapMismatchError, at once and before any row moves (the ranks made the same collectives: the group
    stays usable)."""
    info, W, L, E = handle.info, handle.info.world_size, handle.num_local_experts, handle.num_experts
    stats = handle.routed
    routed = stats is not None
    if not routed:  # (read already, and checked: ids 0 to 0 stand for them)
        stats = torch.tensor([c for row in handle.send_counts for c in row] + [0, 0], dtype=torch.int64,
                             device=info.device)
    send = torch.cat([stats[:E].view(W, L), stats[E:].view(1, 2).expand(W, 2)], dim=1).reshape(-1)
    recv = torch.empty_like(send)
    cc.wait(dist.all_to_all_single(recv, send, group=cc.pg, async_op=True), "any", "counts")
    got = (torch.cat([stats, recv]) if routed else recv).tolist()
    if routed:
        handle.send_counts = routed_counts(cc.op.removeprefix("moe."), got, E, W)  # (raises on this rank's bad ids)
        handle.routed, got = None, got[E + 2 :]
    rows = [got[s * (L + 2) : (s + 1) * (L + 2)] for s in range(W)]
    bad = [(s, text) for s, row in enumerate(rows) if (text := bad_ids(E, row[L], row[L + 1]))]
    if bad:
        raise OverlapMismatchError(f"overlap.{cc.op}: invalid input on rank {bad[0][0]}: {bad[0][1]}")
    handle.recv_counts = [row[:L] for row in rows]
