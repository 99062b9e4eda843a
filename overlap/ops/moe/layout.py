"""The layout of an MoE call: the handle (`MoELayout`: counts, offsets, the permutation back), the row orders every
strategy shares, and the heap slot's regions (their byte layout and flag indices are `overlap.kernels.slots`', which
the fused kernels read; the kernels' tile tables are beside their launchers). The call's entry (input checks, routing,
plan, signature, the counts' exchange) is `overlap.ops.moe.entry`; the grouped GEMMs `overlap.ops.moe.grouped`.

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
from typing import Any

import torch

from ... import world
from ...kernels import slots
from ...plans import Plan
from ..context import CallContext


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
        fp8: the dispatch's `overlap.ops.moe.fp8.RowFormat` (its tokens travelled as packed fp8 rows), or None.
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
    fp8: Any = None

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
    row_bytes = cols * dtype.itemsize
    return call.buffer(owner, dtype, (stride // row_bytes, cols), offset=slots.header_bytes(W, L) + source * stride)
