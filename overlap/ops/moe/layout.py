"""What the MoE ops share: routing, the layout handle, input checks, plans, signatures and the heap's slots (their
byte layout and flag indices are `overlap.kernels.slots`', which the fused kernels read; the kernels' tile tables
are beside their launchers).

Legend: ``W`` ranks of the expert-parallel group, ``E`` experts (global ids), ``L = E / W`` local experts
(rank ``r`` holds ``r*L ... (r+1)*L - 1``), ``T`` tokens of this rank, ``K`` experts per token, ``P = T*K``
(token, expert) pairs, pair ``p = t*K + k``. A pair's row travels to the rank of its expert and back.

Three row orders (every strategy uses the same ones, so they agree row for row):

* **send order** (at the source): pairs sorted by global expert, stably (so by destination rank,
  then local expert, then token): ``handle.order[i]`` is the pair at send position ``i``; rank ``d``'s
  rows are the contiguous run ``send_offsets[d] ... + send_splits[d]``.
* **staging order** (at the destination, as transfers arrive): by source rank, then local expert, then
  token: source ``s``'s rows in the order ``s`` sent them.
* **expert order** (the layout of ``x_recv`` and of the grouped GEMMs' rows): by local expert, then
  source rank, then token. ``expert_offsets[e][s]`` is the first row of block ``(e, s)``.

Symmetric-heap layout of one slot (``symm``, ``fused``): a header of ``W x L`` int32 counts (row ``s``
written by source ``s``: how many rows it sends to each of this rank's experts), then ``W`` regions of
``region_stride`` bytes; region ``s`` of rank ``d``'s buffer holds what ``s`` sends to ``d`` (dispatch
direction: in ``s``'s send order; combine direction: ``d``'s results for ``s``'s rows, also in ``s``'s send
order). Regions are sized for the worst case of the call (``T * min(K, L)`` rows of the largest ``T`` of
any rank, or more where one token names one expert twice), agreed through the handshake, so varying
routings do not grow the heap. Flags of producer ``s``: ``d * F`` "counts for ``d`` written",
``d * F + 1 + g`` "rows of expert group ``g`` for ``d`` written", ``F = MAX_FLAGS // W``; experts are
bucketed into ``G = min(L, F - 1)`` contiguous groups (one flag per expert where ``L < F``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist

from ... import world
from ...errors import OverlapMismatchError
from ...kernels import slots
from ...plans import Plan, Problem
from ...plans.auto import as_plan, fit_plan, plan_source, resolve_auto
from ..context import FLOAT_DTYPES, CallContext, describe
from ..fused import check_fused_available


@dataclasses.dataclass(eq=False)
class MoELayout:
    """The layout of one dispatch, needed by the matching combine and by both backwards.

    Attributes (host values unless noted):
        num_experts, num_local_experts, top_k, num_tokens: ``E``, ``L``, ``K``, ``T`` of this rank.
        send_counts: ``[W][L]``: rows this rank sends to rank ``d``'s local expert ``e``.
        recv_counts: ``[W][L]``: rows rank ``s`` sends to this rank's local expert ``e``.
        tokens_per_expert: ``[L]``: rows of each local expert in ``x_recv`` (all sources).
        expert_offsets: ``[L][W]``: first row of block ``(e, s)`` in ``x_recv``.
        order: int64 tensor ``[P]`` (on the tokens' device): the pair at each send position.
        max_tokens_per_rank: the dispatch's bound ``B`` (`overlap.ops.moe.bound`), None for exact counts.
        migration: the plan's `overlap.ops.moe.migration.Migration` (``E``, ``L`` above are then the hosted ones).
        across: what the layout's first transfer across nodes learned of every rank's routes
            (`overlap.ops.moe.hierarchical.routes`), kept for its other transfers.
        routed: a dispatch whose counts travel by `exchange_counts`: this rank's pairs per global expert, then
            its smallest and largest expert id (an int64 tensor ``[E + 2]`` on the tokens' device, `route_stats`),
            read to the host with the received counts (one read per dispatch), which fill ``send_counts``;
            None once read, or where `route` read them.
        context: the dispatch's `overlap.ops.context.CallContext` (group, group facts, plan, deadline);
            the matching combine and the backward passes run in contexts derived from it.
        group, info, plan, timeout: the context's.
    """

    context: CallContext
    num_experts: int
    num_local_experts: int
    top_k: int
    num_tokens: int
    send_counts: list[list[int]]
    order: torch.Tensor
    recv_counts: list[list[int]] = dataclasses.field(default_factory=list)
    max_tokens_per_rank: int | None = None
    migration: Any = None
    across: dict = dataclasses.field(default_factory=dict)
    routed: torch.Tensor | None = None

    @property
    def group(self) -> Any:
        return self.context.pg

    @property
    def info(self) -> world.GroupInfo:
        return self.context.info

    @property
    def plan(self) -> Plan:
        return self.context.plan

    @property
    def timeout(self) -> float:
        return self.context.timeout

    # -- derived layout (host) ----------------------------------------------------------------
    @functools.cached_property
    def send_splits(self) -> list[int]:
        return [sum(row) for row in self.send_counts]

    @functools.cached_property
    def send_offsets(self) -> list[int]:
        return prefix_sums(self.send_splits)

    @functools.cached_property
    def recv_splits(self) -> list[int]:
        return [sum(row) for row in self.recv_counts]

    @functools.cached_property
    def stage_offsets(self) -> list[int]:
        """First row of source ``s``'s rows in staging order."""
        return prefix_sums(self.recv_splits)

    @functools.cached_property
    def tokens_per_expert(self) -> list[int]:
        return [sum(self.recv_counts[s][e] for s in range(len(self.recv_counts)))
                for e in range(self.num_local_experts)]

    @functools.cached_property
    def expert_offsets(self) -> list[list[int]]:
        return slots.expert_offsets(self.recv_counts)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    def within_source(self, s: int, e: int) -> int:
        """First row of block ``(s, e)`` among the rows source ``s`` sends to this rank."""
        return sum(self.recv_counts[s][:e])

    def within_dest(self, d: int, e: int) -> int:
        """First row of block ``(d, e)`` among the rows this rank sends to ``d``."""
        return sum(self.send_counts[d][:e])

    # -- derived layout (device tensors, built once) ---------------------------------------------
    @functools.cached_property
    def token_of(self) -> torch.Tensor:
        """Token of the pair at each send position (``order // K``)."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")

    @functools.cached_property
    def inv_order(self) -> torch.Tensor:
        """Send position of each pair (the permutation back)."""
        inv = torch.empty_like(self.order)
        inv[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return inv

    @functools.cached_property
    def staging_of_expert_row(self) -> torch.Tensor:
        """Staging row of each expert-order row: ``x_recv = staging[staging_of_expert_row]``."""
        # Block (e, s) in expert order starts at staging row stage_offsets[s] + within_source(s, e): each row is
        # its block's start plus its place in the block (a fixed number of ops, whatever the number of experts).
        blocks = [(s, e) for e in range(self.num_local_experts) for s in range(len(self.recv_counts))]
        sizes = [self.recv_counts[s][e] for s, e in blocks]
        starts = [self.stage_offsets[s] + self.within_source(s, e) - at
                  for (s, e), at in zip(blocks, prefix_sums(sizes), strict=True)]
        idx = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64),
                                      output_size=self.num_recv) + torch.arange(self.num_recv)
        return idx.to(self.order.device)

    @functools.cached_property
    def expert_of_staging_row(self) -> torch.Tensor:
        """Expert-order row of each staging row (the inverse permutation)."""
        inv = torch.empty_like(self.staging_of_expert_row)
        inv[self.staging_of_expert_row] = torch.arange(inv.numel(), device=inv.device)
        return inv


def prefix_sums(values: list[int]) -> list[int]:
    out, at = [], 0
    for v in values:
        out.append(at)
        at += v
    return out


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


def route_stats(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` left on the device: the send order, and this rank's pairs per global expert followed by its
    smallest and largest expert id (int64 ``[E + 2]``; ids out of range are counted at the nearest end, the two
    ids tell). No host transfer."""
    flat = topk_idx.reshape(-1).to(torch.int64)
    if flat.numel() == 0:
        return flat, flat.new_zeros(num_experts + 2)  # (ids 0 to 0: in range)
    stats = torch.cat([torch.bincount(flat.clamp(0, num_experts - 1), minlength=num_experts),
                       flat.min().view(1), flat.max().view(1)])
    return torch.argsort(flat, stable=True), stats


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


def moe_problem(tokens: int, hidden: int, ffn: int, num_experts: int, top_k: int, dtype: torch.dtype,
                backward: bool) -> Problem | None:
    """The `overlap.plans.Problem` of a grouped-GEMM MoE call (plan files are keyed by it); `backward`:
    whether the call's backward will run."""
    try:
        return Problem("moe", max(tokens, 1), hidden, ffn, str(dtype).removeprefix("torch."), backward,
                                num_experts, top_k)
    except ValueError:  # a call the model does not describe: no plan file entry can match it
        return None


def heap_need(strategy: str, num_tokens: int, top_k: int, num_local_experts: int, send_splits: list[int],
              row_bytes: int, world_size: int) -> int:
    """Slot bytes this rank needs: the header and ``W`` regions, each for the worst case of this rank
    as a source (``T * min(K, L)`` rows, or the rows actually sent where a token repeats an expert)."""
    if strategy not in ("symm", "fused"):
        return 0
    rows = max([num_tokens * min(top_k, num_local_experts), *send_splits])
    return slots.moe_slot_bytes(rows, row_bytes, world_size, num_local_experts)


def region(call, h: MoELayout, owner: int, source: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Region `source` of `owner`'s buffer in this call's slot, as ``[capacity, cols]`` rows."""
    W, L = h.info.world_size, h.num_local_experts
    stride = slots.region_stride(call.need, W, L)
    row_bytes = cols * torch.empty((), dtype=dtype).element_size()
    return call.buffer(owner, dtype, (stride // row_bytes, cols), offset=slots.header_bytes(W, L) + source * stride)


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


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs: a fixed number of torch ops per call, whatever the number of experts
# ----------------------------------------------------------------------------------------------

#: The dtypes `torch._grouped_mm` takes on CPU ranks. GPU ranks keep one GEMM per block for now (their grouped
#: GEMMs are the fused Triton kernels; `torch._grouped_mm` on CUDA has not run on a GPU here).
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_ok(*tensors: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: CPU, one dtype it has, 16-byte aligned data and
    strides (one of the last two dims contiguous)."""
    t0 = tensors[0]
    if t0.device.type != "cpu" or t0.dtype not in _GROUPED_DTYPES or not hasattr(torch, "_grouped_mm"):
        return False
    size = t0.element_size()
    for t in tensors:
        if t.dtype != t0.dtype or t.data_ptr() % 16 or 1 not in t.stride()[-2:]:
            return False
        if any(s != 1 and s * size % 16 for s in t.stride()):
            return False
    return True


def _ends(counts: list[int]) -> torch.Tensor:
    """The int32 end offsets of consecutive blocks of `counts` rows (`torch._grouped_mm`'s ``offs``)."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)


def _grouped(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """`torch._grouped_mm` of `a` and `b` in consecutive blocks of `counts`, or None where it does not take them
    (the caller then runs a GEMM per block)."""
    if not sum(counts) or not _grouped_ok(a, b):
        return None
    try:
        return torch._grouped_mm(a, b, offs=_ends(counts))
    except RuntimeError:  # (an operand this torch refuses after all)
        return None


def block_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x``'s rows as consecutive blocks of ``counts[i]`` rows, block ``i`` times ``w[i]`` (``len(counts) ==
    w.shape[0]``; a block may be empty): ``[sum(counts), N]``. One grouped GEMM where `torch._grouped_mm` takes
    the operands (the same products as one GEMM per block), else one GEMM per block."""
    n = sum(counts)
    x = x[:n]
    out = _grouped(x, w, counts)
    if out is not None:
        return out
    out = x.new_empty((n, w.shape[2]))
    at = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(x[at : at + c], w[e], out=out[at : at + c])
        at += c
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, handle: MoELayout) -> torch.Tensor:
    """``out_e = x_e @ w[e]`` for the expert-order blocks of ``x``."""
    return block_mm(x, w, handle.tokens_per_expert)


def rows_for(h: MoELayout, y: torch.Tensor, w: torch.Tensor | None, s: int, into: torch.Tensor) -> None:
    """`into` = the rows of source `s` (in `s`'s send order), each block times its expert's weight (a GEMM per
    block, straight into `into`: on CPU ranks cheaper than a grouped GEMM's separate output and its copy)."""
    for e in range(h.num_local_experts):
        c = h.recv_counts[s][e]
        if not c:
            continue
        lo, at = h.within_source(s, e), h.expert_offsets[e][s]
        if w is not None:
            torch.mm(y[at : at + c], w[e], out=into[lo : lo + c])
        else:
            into[lo : lo + c].copy_(y[at : at + c])


def grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, handle: MoELayout, like: torch.Tensor) -> torch.Tensor:
    """``grad_w[e] = x_e.T @ grad_e`` over every row of local expert ``e`` (zeros for an expert with none)."""
    counts = handle.tokens_per_expert
    n = sum(counts)
    grad_w = _grouped(x[:n].t(), grad[:n], counts) if like.dtype == x.dtype else None
    if grad_w is not None:
        return grad_w
    grad_w = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    at = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(x[at : at + c].t(), grad[at : at + c], out=grad_w[e])
        at += c
    return grad_w


def weighted_sum(back: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * back[t*K + k]`` in fp32 (fp64 for fp64; k in order), cast to `out_dtype`.
    Autograd-able: it gives ``topk_weights`` the dot products and the rows ``w``-weighted gradients."""
    T, K = topk_weights.shape
    acc_dtype = torch.float64 if torch.float64 in (back.dtype, topk_weights.dtype) else torch.float32
    rows, wts = back.view(T, K, back.shape[-1]), topk_weights.to(acc_dtype)
    acc = rows[:, 0].to(acc_dtype) * wts[:, :1]
    for k in range(1, K):  # (one row of each token at a time: no [T, K, N] temporary)
        acc.addcmul_(rows[:, k].to(acc_dtype), wts[:, k : k + 1])
    return acc.to(out_dtype)
