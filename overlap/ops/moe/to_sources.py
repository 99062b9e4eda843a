"""One transfer back to the sources: every expert's rows to the rank and token they came from, each block
multiplied by its expert's weight before it leaves where a weight is given. `overlap.moe.combine`'s forward
and `overlap.moe.dispatch`'s backward run it (`run`).

Strategies (same rows, same order; `reference` is the oracle). The weighted sum is the same code in
all of them (fp32, ``k`` in order), so the strategies differ only by the GEMMs' own rounding:

* ``reference``: one GEMM per local expert, then ``all_to_all_single`` back, then the weighted sum.
* ``pipelined``: pairwise shift (send to ``r+i``, receive from ``r-i``); the rows for rank ``r+i`` are
  multiplied and posted (``num_chunks[link]`` pieces) while the rows for ``r+i+1`` are multiplied; this
  rank's own rows last. Any backend.
* ``symm``: the results for source ``s`` are written (GEMM output stored) straight into this rank's
  region of ``s``'s symmetric buffer, flagged per expert group, peers first from ``r+1``; each rank then
  waits for the flags of its own rows and sums (on GPUs, where no gradient is needed, one CUDA kernel
  gathers and sums straight from the regions: `overlap.ops.moe.cuda`). Ranks of one node.
* ``fused`` (grouped-matmul form only): one Triton grouped GEMM (`overlap.kernels.grouped_matmul_combine`) whose tiles
  store into the source's buffer and count per (source, expert group); the group's last tile releases
  its flag.
* ``hierarchical``: groups spanning nodes (`overlap.ops.moe.hierarchical`): a token's rows summed within
  each node before they cross, where the rows are not kept for ``topk_weights``' gradient (on one node the
  plan is ``symm``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ... import comm
from ...kernels import slots
from ...stages import stage
from .. import fused
from ..context import CallContext
from . import bound as moe_bound
from . import cuda as moe_cuda
from . import grouped, layout
from . import hierarchical as moe_hierarchical
from .fp8 import Fp8Experts

# ----------------------------------------------------------------------------------------------
# One transfer back to the sources (combine forward; dispatch backward)
# ----------------------------------------------------------------------------------------------


def run(h: layout.MoELayout, y: torch.Tensor, w: torch.Tensor | Fp8Experts | None, cc: CallContext,
        between: Callable[[], None] | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Return each expert-order row of `y` (times its expert's ``w[e]`` where `w` is given, ``[L, H, N]``
    any strides; packed fp8 rows where `w` is `Fp8Experts`: the dispatch's backward with fp8 gradients) to the
    rank of its token; one call on every rank (`cc`: its op, plan, signature). `between` runs while the rows
    travel.

    Returns ``[P, N]`` in pair order (pair ``t*K + k``), on the rank of the tokens. With `weights`
    (``[T, K]``; ``symm``/``fused`` on GPUs, see `moe_cuda.sums_on_device`) returns the weighted sum
    ``[T, N]`` instead, summed by the combine kernel straight from the regions (no autograd).
    """
    cols = y.shape[1] if w is None else w.shape[2]
    kind = cc.plan.strategy
    row_bytes = cols * grouped.out_dtype(w, y.dtype).itemsize
    call = moe_bound.begin(cc, h, kind, row_bytes)  # (with a bound: the steady state)
    extra = {} if weights is None else {"weights": weights}  # (symm and fused on GPUs; hierarchical across nodes)
    try:
        if w is not None and w.shape[0] < h.num_local_experts:  # the forward's w2 [L]: fetch the copies, agreed
            w = h.migration.fetch(w, "w2", cc)
        back = STRATEGIES[kind](cc, call, h, y, w, between, **extra)
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls
    if weights is not None or kind in _IN_PAIR_ORDER:
        return back
    with stage("receive"):
        return back.index_select(0, h.inv_order)


def _reference(cc: CallContext, call, h, y, w, between):
    z = grouped.grouped_mm(y, w, h) if w is not None else y
    with stage("send"):
        staged = z.index_select(0, h.expert_of_staging_row)
        back = z.new_empty((h.num_tokens * h.top_k, z.shape[1]))
        work = dist.all_to_all_single(back, staged, h.send_splits, h.recv_splits, group=cc.pg, async_op=True)
    cc.wait(work, "any", "all_to_all")
    if between is not None:
        between()
    return back


def _pipelined(cc: CallContext, call, h, y, w, between):
    info, W, r = h.info, h.info.world_size, h.info.rank
    cols, dtype = y.shape[1] if w is None else w.shape[2], grouped.out_dtype(w, y.dtype)
    back = y.new_empty((h.num_tokens * h.top_k, cols), dtype=dtype)

    def ours_from(d: int) -> torch.Tensor:  # where rank d's results for our rows land
        return back[h.send_offsets[d] : h.send_offsets[d] + h.send_splits[d]]

    posted, sent = [], []
    for i in range(1, W):
        s, src = (r + i) % W, (r - i) % W
        buf = y.new_empty((h.recv_splits[s], cols), dtype=dtype)
        grouped.rows_for(h, y, w, s, buf)  # the next source's GEMMs run while this one's rows travel
        sent.append(buf)
        posted.extend(comm.exchange_chunked(buf, s, ours_from(src), src, cc.plan.chunks_for, info, cc.pg, cc.op))
    grouped.rows_for(h, y, w, r, ours_from(r))
    if between is not None:
        between()
    for _j, _got, works in posted:
        for work, peer in works:
            cc.wait(work, peer, _j)
    del sent
    return back


def _symm(cc: CallContext, call, h, y, w, between, weights=None):
    cols, dtype = y.shape[1] if w is None else w.shape[2], grouped.out_dtype(w, y.dtype)
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    call.wait_slot_free()
    for i in range(1, W + 1):  # peers from rank + 1, our own rows last
        s = (r + i) % W
        region = layout.region(call, h, s, r, dtype, cols)
        for g in range(G):
            experts = slots.group_experts(g, L, G)
            if not sum(h.recv_counts[s][e] for e in experts):
                continue
            for e in experts:
                c = h.recv_counts[s][e]
                if c:
                    lo, at = h.within_source(s, e), h.expert_offsets[e][s]
                    if w is not None:
                        with stage("gemm"):
                            grouped.mm_into(y[at : at + c], w, e, region[lo : lo + c])
                    else:
                        with stage("send"):
                            region[lo : lo + c].copy_(y[at : at + c])
            call.signal_ready(s * F + 1 + g)
    if between is not None:
        between()
    return _collect(call, h, dtype, cols, weights)


def _fused(cc: CallContext, call, h, y, w, between, weights=None):
    if isinstance(w, Fp8Experts):  # (fp8 gradients: the combine kernel has no fp8 form; symm's host loop)
        return _symm(cc, call, h, y, w, between, weights)
    chosen = cc.plan
    y = y.contiguous()  # the kernel reads rows with unit column stride
    cols = w.shape[2]
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    bm, bn, bk = fused.fused_tiles(chosen.block_m, chosen.block_n, chosen.block_k, fused.interpreted(), y.dtype)
    call.wait_slot_free()
    kernel = fused.kernels().grouped_matmul_combine
    table = kernel.combine_tile_table(h.recv_counts, r, bm, fused.cdiv(cols, bn), y.device)
    if table.shape[0]:
        heap = call.heap
        stride = slots.region_stride(call.need, W, L)
        counters = heap.tables.counters(call.slot)  # indices < W * F <= MAX_FLAGS; the kernel leaves them at zero
        if not y.is_cuda:
            counters.zero_()  # (an interpreted kernel can stop half-way on an exception; a memset is free here)
        kernel.launch_grouped_matmul_scatter(
            y, w, table, heap.tables.ptr_table(call.slot, slots.header_bytes(W, L) + r * stride), counters,
            heap.tables.flag_table(call.slot, 0), epoch=call.epoch_word(), rank=r, block=(bm, bn, bk))
        if y.is_cuda:  # the kernel released device flag words; `_collect`'s stream-ordered waits read the pads
            _mirror_flags(call, h)
    if between is not None:
        between()
    return _collect(call, h, y.dtype, cols, weights)


def _mirror_flags(call, h: layout.MoELayout) -> None:
    """GPU: publish, after the kernel in stream order, every flag the combine kernel released (those of the
    (source, expert group) blocks with rows), for the peers' stream-ordered waits on the control pads."""
    W, L = h.info.world_size, h.num_local_experts
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    for s in range(W):
        for g in range(G):
            if sum(h.recv_counts[s][e] for e in slots.group_experts(g, L, G)):
                call.signal_ready(s * F + 1 + g)


def _collect(call, h: layout.MoELayout, dtype: torch.dtype, cols: int,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """Wait for every rank's results for our rows (flag by flag) and copy each rank's out as it is flagged (send
    order), then gather them into pair order (a gather: several times faster than scattering each row to its pair
    on CPUs). With `weights` (GPUs): after the same waits, the combine kernel sums them into ``[T, cols]``."""
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    staged = None if weights is not None else torch.empty((h.num_tokens * h.top_k, cols), dtype=dtype,
                                                           device=h.info.device)
    for i in range(W):
        d = (r - i) % W  # in the order the ranks write us (rank r - 1 first)
        for g in range(G):
            experts = slots.group_experts(g, L, G)
            if sum(h.send_counts[d][e] for e in experts):
                call.wait_ready(d, r * F + 1 + g, chunk=f"experts {experts.start}-{experts.stop - 1} of rank {d}")
        n = h.send_splits[d]
        if n and staged is not None:
            with stage("receive"):
                lo = h.send_offsets[d]
                staged[lo : lo + n].copy_(layout.region(call, h, r, d, dtype, cols)[:n])
    if weights is not None:  # the waits above are stream-ordered: the kernel reads after every flag
        return moe_cuda.combine_rows(call, h, dtype, cols, weights)
    with stage("receive"):
        return staged.index_select(0, h.inv_order)


def _hierarchical(cc: CallContext, call, h, y, w, between, weights=None):
    """Across nodes (`overlap.ops.moe.hierarchical`): a token's rows summed within each node before they
    cross, where `weights` are given; else each row crosses once, as ``pipelined`` sends it (the node has
    nothing to sum or share)."""
    if weights is None:
        return _pipelined(cc, call, h, y, w, between)
    return moe_hierarchical.to_sources(cc, h, y, w, between, weights)


#: the strategies whose rows come back in pair order already (`_collect`)
_IN_PAIR_ORDER = ("symm", "fused")

STRATEGIES = {"reference": _reference, "pipelined": _pipelined, "symm": _symm, "fused": _fused,
              "hierarchical": _hierarchical}
