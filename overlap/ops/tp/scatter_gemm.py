"""Each destination's GEMM, scattered and summed: ``reduce_scatter(a @ b, dim=0)`` with the scatter hidden behind
the GEMMs. The forward of `overlap.matmul_reduce_scatter`, the input gradient of `overlap.all_gather_matmul`,
the weight gradient of `overlap.all_gather_weight_matmul` (``pipelined``) run it; `overlap.matmul_all_reduce`'s
two-shot ``fused`` runs `scatter_and_reduce`; its regions are laid out by `overlap.kernels.slots.region_bytes`.
What is scattered is a `overlap.ops.tp.rows.Product`: one GEMM or the sum of several (the input gradient of a
gather that fed several weights, plus that of its returned gathered input), its rows in the gathered layout
(a scatter dim past the first: each destination's rows are runs, multiplied in place).

Strategies (same results up to rounding; `reference` is the oracle). Every one sums in a fixed
order, so the same inputs and plan give bitwise the same result run after run:

* ``reference``: one GEMM, then ``reduce_scatter_tensor``.
* ``pipelined``: pairwise steps. At step ``i`` rank ``r`` computes its partial for block ``r + i``
  and sends it to that block's owner while receiving rank ``r - i``'s partial for its own block
  (a shift: every send meets its receive at the same step), each transfer cut into
  ``num_chunks[link]`` pieces; the next step's GEMM runs while the partial travels, this rank's own
  block last. The owner then sums the ``W`` partials in rank order. (A ring would add at every hop
  and round a 16-bit sum ``W - 1`` times; here every 16-bit partial is rounded once and summed in
  fp32, as ``symm`` and ``fused`` do.) Any backend.
* ``symm``: each destination's GEMM goes into this rank's region of the destination's symmetric
  buffer (destinations from ``rank + 1``), flagged per chunk; every rank sums its regions in rank
  order, chunk by chunk as the flags arrive. CPU ranks write the GEMM straight into the peer's
  shared memory; GPUs compute into a local buffer and a side stream copies it (copy engine).
* ``fused``: one Triton GEMM (`overlap.kernels.matmul_reduce_scatter`) whose tiles store straight into the
  owner's buffer and signal per chunk, then a reduction kernel that waits per chunk and sums in rank order.
* ``hierarchical``: groups spanning nodes (`overlap.ops.tp.hierarchical_reduce`): the partials summed within
  the node by shared memory, each node's sum sent once to the destination's node, chunk by chunk while the
  next node's GEMMs run; the node sums added in node order. (On one node the plan is ``symm``.)

Buffer layout (symm, fused): a slot holds ``W`` regions of ``[m, n]`` (each padded to 16 bytes),
region ``s`` written by rank ``s``; ready flag ``d * F + j`` in producer ``s``'s pad says "chunk ``j``
of my partial for ``d`` is in ``d``'s buffer", ``F = MAX_FLAGS // W``.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import comm, symm
from ...errors import OverlapTimeout
from ...kernels import slots
from ...plans import Plan
from ...symm import p2p
from .. import fused
from ..context import CallContext
from ..sums import sum_in_order
from . import hierarchical_reduce
from .operands import Gemm, kernel_tile
from .rows import Product


def heap_bytes(chosen: Plan, m: int, n: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one heap slot a call with `m` rows per destination needs (0: no symmetric memory)."""
    if chosen.strategy == "hierarchical":  # (across nodes: the node's slot)
        return hierarchical_reduce.reduce_bytes(m, n, dtype, world_size)
    if chosen.strategy not in ("symm", "fused"):
        return 0
    return world_size * slots.region_bytes(m, n, dtype)


def run(prod: Product, cc: CallContext) -> torch.Tensor:
    """One call on every rank (`cc`: its op, group, plan, deadline, signature): the handshake, then the
    strategy; returns this rank's ``[m, n]`` of the sum over ranks of `prod` (`overlap.ops.tp.rows.Product`:
    its rows in the gathered layout, one or more GEMMs)."""
    if cc.plan.strategy == "fused" and not prod.simple:  # (the kernel multiplies one pair: symm's copies)
        cc = cc.derive(plan=dataclasses.replace(cc.plan, strategy="symm"))
    steady = cc.plan.strategy in ("symm", "pipelined")  # (pipelined: checked in its messages, `overlap.symm.p2p`)
    call = cc.begin(heap_bytes(cc.plan, prod.m, prod.n, prod.dtype, cc.world_size), steady=steady,
                    in_data=cc.plan.strategy == "hierarchical",
                    plain=cc.plan.strategy == "reference")
    try:
        return STRATEGIES[cc.plan.strategy](cc, call, prod)
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls


def _new(prod: Product, rows: int) -> torch.Tensor:
    return torch.empty((rows, prod.n), dtype=prod.dtype, device=prod.device)


# ----------------------------------------------------------------------------------------------
# Forward strategies: prod (rows [outer*W*rows, k] in the gathered layout) -> out [m, n]
# ----------------------------------------------------------------------------------------------


def post_reference(cc: CallContext, prod: Product) -> tuple[torch.Tensor, list, torch.Tensor]:
    """``reference`` up to the wait: every GEMM, then the reduce-scatter posted (one collective per outer block:
    each block is rank-major). Returns ``(out, works, partial)``; `out` is this rank's sum once every work is
    done, and `partial` (what they send) must live until then."""
    partial, ro = prod.whole(), prod.rows
    out = _new(prod, prod.m)
    works = [comm.reduce_scatter_async(out[o * ro.rows : (o + 1) * ro.rows], partial[slice(*ro.block(o))], cc.pg)
             for o in range(ro.outer)]
    return out, works, partial


def _reference(cc: CallContext, call, prod):
    out, works, _partial = post_reference(cc, prod)
    for work in works:
        cc.wait(work, "any", "reduce_scatter")
    return out


def _pipelined(cc: CallContext, call, prod):
    W, r, n = cc.world_size, cc.rank, prod.n
    m = prod.m
    # Pairwise shift: at step i this rank sends its partial for block r+i to rank r+i and receives
    # rank r-i's partial for its own block (every send meets its receive at the same step, also
    # where a backend serializes steps). Each transfer is cut into chunks for its link.
    received = torch.empty((W, m, n), dtype=prod.dtype, device=prod.device)  # [s]: rank s's partial for our block
    if p2p.tagged(call):
        return _pipelined_tagged(cc, call, prod, received)
    posted = []
    for i in range(1, W):
        d, src = (r + i) % W, (r - i) % W
        part = prod.block(d)  # the next GEMM runs while this partial travels
        pairs = comm.exchange_chunked(part, d, received[src], src, cc.plan.chunks_for, cc.info, cc.pg, cc.op)
        posted.extend((src, j, part, works) for j, _, works in pairs)  # part: kept alive until sent
    prod.into(r, 0, m, received[r])
    for _src, j, _part, works in posted:
        for work, peer in works:
            cc.wait(work, peer, j)
    out = _new(prod, m)
    sum_in_order(list(received.unbind(0)), out, 0, m)  # rank order, one rounding
    return out


def _pipelined_tagged(cc: CallContext, call, prod, received):
    """`_pipelined` on CPU ranks of one node: tagged messages with headers (`overlap.symm.p2p`)."""
    W, r, m = cc.world_size, cc.rank, prod.m
    ex = p2p.Exchange(call, cc)
    try:
        for i in range(1, W):
            ex.expect(received[(r - i) % W], (r - i) % W)
        parts = []  # kept alive until sent
        for i in range(1, W):
            d = (r + i) % W
            parts.append(prod.block(d))  # the next GEMM runs while this partial travels
            ex.send(parts[-1], d)
            ex.arm(block=False)
        prod.into(r, 0, m, received[r])
        for i in range(1, W):
            for _ in ex.arrivals((r - i) % W):
                pass
        ex.close()
    except BaseException as exc:
        ex.abandon(exc)
        raise
    out = _new(prod, m)
    sum_in_order(list(received.unbind(0)), out, 0, m)  # rank order, one rounding
    return out


def _flag_chunks(chosen: Plan, info, m: int) -> tuple[list[tuple[int, int]], int]:
    """Chunk bounds of one block (uniform over peers: the slowest link's count) and the flag stride."""
    stride = symm.MAX_FLAGS // info.world_size
    return comm.chunk_bounds(m, min(chosen.chunks_for(info.slowest_link), stride)), stride


def _symm(cc: CallContext, call, prod):
    info = cc.info
    W, r, n, dtype, m = info.world_size, info.rank, prod.n, prod.dtype, prod.m
    rb = slots.region_bytes(m, n, dtype)
    bounds, stride = _flag_chunks(cc.plan, info, m)

    def region(owner: int, writer: int) -> torch.Tensor:
        return call.buffer(owner, dtype, (m, n), offset=writer * rb)

    if prod.device.type == "cuda":
        return _symm_cuda(call, prod, info, region, bounds, stride)
    call.wait_slot_free()
    # Produce: the partial of each destination straight into our region of its buffer, peers first
    # (from rank + 1, so the owners are not all written by everyone at once), our own block last.
    for i in range(1, W + 1):
        d = (r + i) % W
        dst = region(d, r)
        for j, (lo, hi) in enumerate(bounds):
            prod.into(d, lo, hi, dst[lo:hi])
            if d != r:
                call.signal_ready(d * stride + j)
    # Consume: chunk by chunk, once every source has flagged it, sum the regions in rank order.
    mine = [region(r, s) for s in range(W)]
    out = _new(prod, m)
    for j, (lo, hi) in enumerate(bounds):
        for s in range(W):
            if s != r:
                call.wait_ready(s, r * stride + j, chunk=j)
        sum_in_order(mine, out, lo, hi)
    return out


def _symm_cuda(call, prod, info, region, bounds, stride):
    """GPU: GEMMs on the current stream into local buffers, copies to the owners on a side stream.

    Not yet run on a GPU. A wait that passes its deadline is reported by the next call on the group.
    """
    W, r, m = info.world_size, info.rank, prod.m
    main = torch.cuda.current_stream()
    side = comm.side_stream(prod.device)
    call.wait_slot_free(main)
    for i in range(1, W):
        d = (r + i) % W
        part = prod.block(d)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst = region(d, r)
            for j, (lo, hi) in enumerate(bounds):
                dst[lo:hi].copy_(part[lo:hi], non_blocking=True)
                call.signal_ready(d * stride + j, stream=side)
        part.record_stream(side)
    prod.into(r, 0, m, region(r, r))
    mine = [region(r, s) for s in range(W)]
    out = _new(prod, m)
    for j, (lo, hi) in enumerate(bounds):
        for s in range(W):
            if s != r:
                call.wait_ready(s, r * stride + j, stream=main, chunk=j)
        sum_in_order(mine, out, lo, hi)
    main.wait_stream(side)  # our copies into peers' buffers are part of this call too
    call.finish(stream=main)
    return out


def _fused(cc: CallContext, call, prod):
    W, r, n, m = cc.world_size, cc.rank, prod.n, prod.m
    g = prod.only()
    heap = call.heap
    rb = slots.region_bytes(m, n, g.dtype)
    stride = symm.MAX_FLAGS // W
    out = _new(prod, m)
    # Block d goes to our region (r) of d's buffer; we sum the W regions of our own buffer.
    scatter_and_reduce(cc, call, g, out, block_rows=m, rows_per_outer=prod.rows.rows,
                       dst_table=heap.tables.ptr_table(call.slot, r * rb), flag_index=r * stride,
                       src_table=heap.tables.region_table(call.slot, r, rb, W), max_chunks=stride, flag_stride=stride)
    return out


def scatter_and_reduce(cc: CallContext, call, g: Gemm, out, *, block_rows: int, dst_table: torch.Tensor,
                       flag_index: int, src_table: torch.Tensor, max_chunks: int, flag_stride: int = 0,
                       rows_per_outer: int | None = None) -> None:
    """The two fused kernels (`overlap.kernels.matmul_reduce_scatter`, through their launchers).

    Producer: ``g`` (``a2 @ b``, `overlap.ops.tp.operands.Gemm`: fp8 scaled into float32 partials, MX block by
    block in the kernel's K loop) cut into ``len(dst_table)`` blocks of `block_rows` rows, block ``d`` stored at
    ``dst_table[d]`` and flagged per chunk in this rank's ready flags ``d * flag_stride + chunk``; the blocks
    interleave in runs of `rows_per_outer` rows (default `block_rows`: `overlap.ops.tp.rows.Rows`).
    Consumer: ``out = sum_s src_table[s]`` (``out.shape[0]`` rows), rank order, each chunk once every
    rank's flag ``flag_index + chunk`` has this call's epoch. Used by the reduce-scatter (one block
    per rank) and by ``matmul_all_reduce`` (one-shot: one block, summed over every rank's buffer).
    """
    info, chosen = cc.info, cc.plan
    kernels = fused.kernels().matmul_reduce_scatter
    heap = call.heap
    a2, b = g.a, g.b
    bm, bn, bk = kernel_tile(fused.fused_tiles(chosen.block_m, chosen.block_n, chosen.block_k, fused.interpreted(),
                                               a2.dtype), g.mx)
    nch = kernels.chunk_count(chosen.chunks_for(info.slowest_link), max_chunks, block_rows, bm)
    call.wait_slot_free()
    counters = heap.tables.counters(call.slot)  # num_dest * nch <= MAX_FLAGS; the kernel leaves them at zero
    if not a2.is_cuda:
        counters.zero_()  # (an interpreted kernel can stop half-way on an exception; a memset is free here)
    epoch = call.epoch_word()  # (after wait_slot_free: the slot's word)
    kernels.launch_matmul_scatter(a2, b, dst_table, counters, heap.tables.flag_table(call.slot, 0),
                                  block_rows=block_rows, num_chunks=nch, flag_stride=flag_stride, epoch=epoch,
                                  rank=info.rank, block=(bm, bn, bk), rows_per_outer=rows_per_outer, a_scale=g.a_scale,
                                  b_scale=g.b_scale)
    reduce_sources(cc, call, out, src_table, heap.tables.flag_table(call.slot, flag_index), block_rows, nch, bm, bn,
                   epoch)


def reduce_sources(cc: CallContext, call, out, src_table, flag_table, block_rows, nch, bm, bn, epoch) -> None:
    """The reduction kernel: ``out = sum_s src_s`` in rank order, each chunk once its flags are set."""
    info, timeout = cc.info, cc.timeout
    # GPU: the error word is pinned host memory, checked by the next call without a sync. CPU
    # (interpreted): checked right after the kernel.
    err = call.heap.kernel_err() if out.is_cuda else torch.zeros(1, dtype=torch.int32)
    fused.kernels().matmul_reduce_scatter.launch_reduce_chunks(
        out, src_table, flag_table, block_rows=block_rows, num_chunks=nch, epoch=epoch, err=err,
        timeout_ns=int(timeout * 1e9), block=(bm, bn))
    bad = 0 if out.is_cuda else int(err.item())
    if bad:
        raise OverlapTimeout(cc.op, info.rank, bad - 1, "a reduced chunk", timeout, "fused reduction wait")


def _hierarchical(cc: CallContext, call, prod):
    """Across nodes (on one node the plan is ``symm``): `overlap.ops.tp.hierarchical_reduce.reduce_scatter`, one
    call per outer block of a gather dim past the first (each block is rank-major)."""
    ro = prod.rows
    if ro.outer == 1:
        return hierarchical_reduce.reduce_scatter(cc, call, prod)
    out = _new(prod, prod.m)
    for o in range(ro.outer):
        hierarchical_reduce.reduce_scatter(cc, call, prod.outer_block(o), out=out[o * ro.rows : (o + 1) * ro.rows])
    return out


STRATEGIES = {"reference": _reference, "pipelined": _pipelined, "symm": _symm, "fused": _fused,
              "hierarchical": _hierarchical}
