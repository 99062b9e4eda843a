"""One transfer towards the experts: each (token, expert) pair's row to its expert's rank, each block multiplied
by its expert's weight on arrival where a weight is given. `overlap.moe.dispatch`'s forward and
`overlap.moe.combine`'s backward run it (`run`).

Strategies (same rows, same order; `reference` is the oracle):

* ``reference``: counts exchanged with ``all_to_all_single``, rows with another, then one GEMM per
  local expert over all of its rows.
* ``pipelined``: counts first, then every peer's rows posted at once as point-to-point pieces
  (``num_chunks[link]`` per peer, pairwise shift: send to ``r+i``, receive from ``r-i``); the GEMM of
  block ``(s, e)`` runs as soon as the pieces holding it are in, this rank's own rows first. Any backend.
* ``symm``: every sender writes its counts and then its rows straight into the receiver's symmetric
  buffer (region of the sender), flagging the counts and each (expert group) block; the receiver
  multiplies each block once its flag is set. On CPU ranks a copy-engine thread writes while the
  GEMMs run; on GPUs one CUDA kernel writes every destination's rows and releases each block's flag
  (`overlap.ops.moe.cuda`). Ranks of one node.
* ``fused`` (grouped-matmul form only): rows written as in ``symm``; one Triton grouped GEMM
  (`overlap.kernels.dispatch_grouped_matmul`) whose tiles wait on the flag of the (source, expert group)
  block they read.
* ``hierarchical``: groups spanning nodes (`overlap.ops.moe.hierarchical`): a token's row once to each node
  that holds one of its experts, fanned out there through the node's heap (on one node the plan is ``symm``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ... import comm
from ...errors import OverlapTimeout
from ...kernels import slots
from ...stages import stage, timed
from .. import fused
from ..context import CallContext
from . import bound as moe_bound
from . import cuda as moe_cuda
from . import entry, grouped, layout
from . import fp8 as moe_fp8
from . import hierarchical as moe_hierarchical

# ----------------------------------------------------------------------------------------------
# One transfer towards the experts (dispatch forward; combine backward)
# ----------------------------------------------------------------------------------------------


def run(h: layout.MoELayout, rows: torch.Tensor, row_of_send: torch.Tensor, w: torch.Tensor | None, cc: CallContext,
        counts: bool = False, keep_rows: bool = False, between: Callable[[], None] | None = None,
        fp8: moe_fp8.RowFormat | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send ``rows[row_of_send[i]]`` (send position ``i``) to its expert's rank; one call on every rank.

    `counts`: this call also exchanges the counts (a dispatch), filling ``h.recv_counts``. With `w`
    (``[L, H, N]``, any strides) every block is multiplied by its expert's weight on arrival.
    `between` runs while the transfers are in flight (after this rank's sends are issued). With `fp8`, `rows` are
    packed fp8 tokens of that format (`overlap.ops.moe.fp8`) and `w` is quantized to match, after any migration
    fetched its copies; ``out`` then has `w`'s dtype. `cc` is the
    context of this call: its op, signature and plan (a combine's backward runs with the combine's plan,
    not the dispatch's).

    Returns ``(recv, out)``: ``recv`` ``[R, H]`` in expert order (None when `w` is given and not
    `keep_rows`), ``out`` ``[R, N]`` (None without `w`).
    """
    kind = cc.plan.strategy
    call = moe_bound.begin(cc, h, kind, rows.shape[1] * rows.element_size())  # (with a bound: the steady state)
    try:
        if w is not None and w.shape[0] < h.num_local_experts:  # the forward's w1 [L]: fetch the copies, agreed
            w = h.migration.fetch(w, "w1", cc)
        if w is not None and fp8 is not None:
            w = moe_fp8.Fp8Experts.quantize(w, fp8)
        keep = w is None or keep_rows
        recv, out = STRATEGIES[kind](cc, call, h, rows, row_of_send, w, counts, between, keep)
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls
    return (recv if keep else None), out


def _reference(cc: CallContext, call, h, rows, row_of_send, w, counts, between, keep=True):
    if counts:
        entry.exchange_counts(h, cc)
    with stage("send"):
        send = rows.index_select(0, row_of_send)
        landed = rows.new_empty((h.num_recv, rows.shape[1]))
        work = dist.all_to_all_single(landed, send, h.recv_splits, h.send_splits, group=cc.pg, async_op=True)
    cc.wait(work, "any", "all_to_all")
    with stage("receive"):
        recv = landed.index_select(0, h.staging_of_expert_row)
    out = grouped.grouped_mm(recv, w, h) if w is not None else None
    if between is not None:
        between()
    return recv, out


def _pipelined(cc: CallContext, call, h, rows, row_of_send, w, counts, between, keep=True):
    if counts:
        entry.exchange_counts(h, cc)
    info, W, r, L = h.info, h.info.world_size, h.info.rank, h.num_local_experts
    landed = rows.new_empty((h.num_recv, rows.shape[1]))

    def to_dest(d: int) -> torch.Tensor:
        lo = h.send_offsets[d]
        with stage("send"):
            return rows.index_select(0, row_of_send[lo : lo + h.send_splits[d]])

    def from_source(s: int) -> torch.Tensor:
        return landed[h.stage_offsets[s] : h.stage_offsets[s] + h.recv_splits[s]]

    # Post every peer's pieces at once (pairwise shift), then copy our own rows.
    pending: dict[int, list] = {s: [] for s in range(W)}
    sent = []
    for i in range(1, W):
        d, s = (r + i) % W, (r - i) % W
        buf = to_dest(d)
        sent.append(buf)  # kept alive until its sends complete
        for j, got, works in comm.exchange_chunked(buf, d, from_source(s), s, cc.plan.chunks_for, info, cc.pg, cc.op):
            pending[s].append((got, j, works))
    mine = to_dest(r)
    with stage("send"):
        from_source(r).copy_(mine)
    out = rows.new_empty((h.num_recv, w.shape[2]), dtype=grouped.out_dtype(w, rows.dtype)) if w is not None else None
    # Multiply block (s, e) once the pieces holding it are in: our own rows first, then in step order.
    for i in range(W):
        s = (r - i) % W
        queue = pending[s]
        for e in range(L):
            c = h.recv_counts[s][e]
            if not c:
                continue
            lo = h.within_source(s, e)
            while queue and queue[0][0] is not None and queue[0][0][0] < lo + c:
                _got, j, works = queue.pop(0)
                for work, peer in works:
                    cc.wait(work, peer, j)
            if out is not None:
                at = h.expert_offsets[e][s]
                grouped.expert_mm(from_source(s)[lo : lo + c], w, e, out[at : at + c])
    if between is not None:
        between()
    for queue in pending.values():
        for _got, j, works in queue:
            for work, peer in works:
                cc.wait(work, peer, j)
    del sent
    with stage("receive"):
        return landed.index_select(0, h.staging_of_expert_row), out


def _symm(cc: CallContext, call, h, rows, row_of_send, w, counts, between, keep=True):
    with _produced(call, h, rows, row_of_send, counts):
        if counts:
            _read_counts(call, h)
        recv, out = _consume(call, h, rows.dtype, rows.shape[1], w, keep)
        if between is not None:
            between()
    return recv, out


def _fused(cc: CallContext, call, h, rows, row_of_send, w, counts, between, keep=True):
    with _produced(call, h, rows, row_of_send, counts):
        if counts:
            _read_counts(call, h)
        if isinstance(w, moe_fp8.Fp8Experts) and not w.fused:  # (block128: symm's host loop)
            recv, out = _consume(call, h, rows.dtype, rows.shape[1], w, keep)
        else:
            recv, out = _consume_fused(cc, call, h, rows.dtype, rows.shape[1], w, keep)
        if between is not None:
            between()
    return recv, out


# ---- symm / fused: producer side ----------------------------------------------------------------


@contextlib.contextmanager
def _produced(call, h: layout.MoELayout, rows, row_of_send, counts: bool):
    """Write this rank's counts (a dispatch) and rows into every destination's region of this rank,
    flagging each; the body runs meanwhile (CPU ranks: the rows are written by the copy engine)."""
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    call.wait_slot_free()
    if counts:
        mine = torch.tensor(h.send_counts, dtype=torch.int32, device=rows.device)
        for i in range(W):
            d = (r + i) % W
            call.buffer(d, torch.int32, (W, L))[r].copy_(mine[d])
            call.signal_ready(d * F)

    def write(d: int) -> None:
        with stage("send"):
            region = layout.region(call, h, d, r, rows.dtype, rows.shape[1])
            base = h.send_offsets[d]
            for g in range(G):
                experts = slots.group_experts(g, L, G)
                lo, hi = h.within_dest(d, experts.start), h.within_dest(d, experts.stop)
                if hi > lo:
                    torch.index_select(rows, 0, row_of_send[base + lo : base + hi], out=region[lo:hi])
                    call.signal_ready(d * F + 1 + g)

    def write_peers() -> None:
        with torch.no_grad():  # (grad mode is per thread; the rows may require grad)
            for i in range(1, W):  # from rank + 1, so the destinations are not all written by everyone at once
                write((r + i) % W)

    if rows.is_cuda and moe_cuda.dispatch_rows(call, h, rows, row_of_send):
        yield  # one kernel wrote every destination's rows and released their flags (not yet run on a GPU)
        return
    with torch.no_grad():
        write(r)  # our own rows first (we multiply them first), on this thread: a failure raises here
    peer_bytes = (sum(h.send_splits) - h.send_splits[r]) * rows.shape[1] * rows.element_size()
    if rows.is_cuda or comm.pulls_inline(peer_bytes):
        # GPUs: stream-ordered on the current stream (not yet run on a GPU). CPU ranks: a few rows are written
        # on this thread, where waking the copy engine would cost more than the copy.
        write_peers()
        yield
        return
    future = comm.copy_engine().submit(write_peers)
    try:
        yield
        comm.result(future, h.timeout)
    finally:
        comm.drain([future])


def _read_counts(call, h: layout.MoELayout) -> None:
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    F = slots.flags_per_peer(W)
    for s in range(W):
        call.wait_ready(s, r * F, chunk="counts")
    h.recv_counts = call.buffer(r, torch.int32, (W, L)).tolist()
    if h.info.device.type == "cuda":
        # (a synchronisation: a wait the host watchdog released has reported first, so the counts are not used)
        call.heap.check_async_errors(call.op, call.timeout)


# ---- symm: consumer side (host loop) -------------------------------------------------------------


def _consume(call, h: layout.MoELayout, dtype, cols: int, w, keep: bool = True):
    """``(recv, out)``: each block once its flag is set, copied out of the region into ``recv`` (expert order)
    where `keep` (else ``recv`` is None and the GEMM reads the block where it landed), multiplied into ``out``."""
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    device = h.info.device
    recv = torch.empty((h.num_recv, cols), dtype=dtype, device=device) if keep or w is None else None
    out = (torch.empty((h.num_recv, w.shape[2]), dtype=grouped.out_dtype(w, dtype), device=device)
           if w is not None else None)
    for i in range(W):  # our own rows first, then in the order the senders write us
        s = (r - i) % W
        region = layout.region(call, h, r, s, dtype, cols)
        for g in range(G):
            experts = slots.group_experts(g, L, G)
            if not sum(h.recv_counts[s][e] for e in experts):
                continue
            call.wait_ready(s, r * F + 1 + g, chunk=f"experts {experts.start}-{experts.stop - 1}")
            for e in experts:
                c = h.recv_counts[s][e]
                if not c:
                    continue
                lo, at = h.within_source(s, e), h.expert_offsets[e][s]
                block = region[lo : lo + c]
                if recv is not None:
                    with stage("receive"):
                        block = recv[at : at + c].copy_(block)
                if out is not None:
                    grouped.expert_mm(block, w, e, out[at : at + c])
    return recv, out


# ---- fused: consumer side (Triton grouped GEMM waiting per block) -------------------------------


def _consume_fused(cc: CallContext, call, h: layout.MoELayout, dtype, cols: int, w, keep: bool = True):
    chosen, timeout = cc.plan, cc.timeout
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    device = h.info.device
    recv = torch.empty((h.num_recv, cols), dtype=dtype, device=device)
    out = torch.empty((h.num_recv, w.shape[2]), dtype=grouped.out_dtype(w, dtype), device=device)
    scaled = isinstance(w, moe_fp8.Fp8Experts)  # packed fp8 rows: the kernel's fp8 form, the rows copied after it
    bm, bn, bk = fused.fused_tiles(chosen.block_m, chosen.block_n, chosen.block_k, fused.interpreted(),
                                   w.w8.dtype if scaled else dtype)
    kernel = fused.kernels().dispatch_grouped_matmul
    table = kernel.dispatch_tile_table(h.recv_counts, r, bm, device)
    if not table.shape[0]:
        return recv, out
    heap = call.heap
    stride = slots.region_stride(call.need, W, L)
    src_table = heap.tables.region_table(call.slot, r, stride, W, slots.header_bytes(W, L))
    err = heap.kernel_err() if out.is_cuda else torch.zeros(1, dtype=torch.int32)
    fp8 = {} if not scaled else {"w_scale": w.scale, "scale_offset": w.fmt.packed.scale_offset,
                                 "row_bytes": w.fmt.cols}
    kernel.launch_grouped_matmul_wait(src_table, heap.tables.flag_table(call.slot, 0), table,
                                      w.w8 if scaled else w, out, None if scaled else recv,
                                      epoch=call.epoch_word(), err=err, timeout_ns=int(timeout * 1e9),
                                      block=(bm, bn, bk), **fp8)
    bad = 0 if out.is_cuda else int(err.item())
    if bad:
        raise OverlapTimeout(cc.op, r, bad - 1, "an expert block", timeout, "fused grouped GEMM wait")
    if scaled and keep:  # every block has landed (the kernel waited for each): the packed rows, scales included
        _copy_rows(call, h, recv, dtype, cols)
    return recv, out


@timed("receive")
def _copy_rows(call, h: layout.MoELayout, recv: torch.Tensor, dtype, cols: int) -> None:
    """`recv` (expert order) from every source's region of this rank's buffer, after the blocks have landed."""
    for s in range(h.info.world_size):
        region = layout.region(call, h, h.info.rank, s, dtype, cols)
        for e in range(h.num_local_experts):
            c = h.recv_counts[s][e]
            if c:
                lo, at = h.within_source(s, e), h.expert_offsets[e][s]
                recv[at : at + c].copy_(region[lo : lo + c])


def _hierarchical(cc: CallContext, call, h, rows, row_of_send, w, counts, between, keep=True):
    """Across nodes (`overlap.ops.moe.hierarchical`): a token crosses the network once per node. Rows keyed by
    pair (the combine's backward) have nothing to share within a node: they go as ``pipelined`` sends them."""
    if row_of_send is not h.token_of:
        return _pipelined(cc, call, h, rows, row_of_send, w, counts, between)
    return moe_hierarchical.to_experts(cc, h, rows, row_of_send, w, between)  # (the routes fill the counts)


STRATEGIES = {"reference": _reference, "pipelined": _pipelined, "symm": _symm, "fused": _fused,
              "hierarchical": _hierarchical}
