"""hierarchical for the MoE ops: on a group that spans nodes a token crosses the network once per destination
node and is fanned out there through the node's symmetric heap; on the way back the rows of one token are
summed within the node before they cross.

The topology, the node group and its heap, the counterparts, the slot header and the failure rules are
those of `overlap.ops.hierarchical.node_call` (read its docstring first). Legend and row orders:
`overlap.ops.moe.layout`. ``N`` nodes of ``Q`` ranks each; rank ``(n, l)``; its counterpart on node ``m`` is ``(m, l)``.

Routes (`Routes`, the same on every rank). The first transfer across nodes of a layout (the dispatch's, or the
combine's where the dispatch ran another plan) sends every rank's ``send_counts`` (``W x L``) and, per node, how
many distinct tokens its rows for that node have to every rank (one ``all_to_all``: one network step, where an
``all_gather`` ring takes ``W - 1``); the layout keeps them (`routes`), so the combine and both backwards, which
move the same rows, exchange nothing before their data. Every rank then knows every transfer's size, and a
dispatch fills ``recv_counts`` from it. The **key** of a send position is the row it sends: its token. A
source's **node list** for node ``m`` is its send positions for the ranks of ``m``, rank by rank in node order
(each rank's in send order); ``idx`` maps each of them to its key's position among the distinct keys (sorted).

Dispatch direction (`to_experts`: the dispatch). Source ``s = (n, l)`` sends to its
counterpart ``(m, l)`` the distinct rows of its node list for ``m`` (a token with several experts on node
``m`` once) and ``idx`` as int32 (omitted where every key is distinct: the rows then travel in list order),
in ``Plan.chunks_for("network")`` pieces straight into area ``n`` of the counterpart's slot, which flags the
area once they landed (its own node's area: at once). Every rank of node ``m`` then reads, for every source,
its part of the list from the area of the counterpart that received it (``rows[idx[part]]``, the source's
send order) and multiplies each (source, expert) block: its own node's sources first, while the network
transfers travel, then each other node's once its area is in. Bitwise ``reference``'s rows.

Combine direction (`to_sources`: the summing combine; the dispatch's backward). The **aggregator** of source
``(n, l)`` on node ``m`` is ``(m, l)``. Every rank writes its results for each source (the source's send
order, times ``w[e]``) into its own region of the source's aggregator's slot and flags it; the aggregator
joins the ``Q`` regions into the node list's rows. Node by node, the other nodes first: a node's rows cross
while the next node's results are computed. Always with weights (`combine` where ``topk_weights`` needs no
gradient; the dispatch's backward, weights 1): rows kept one per pair (for ``topk_weights``' gradient) have
nothing to sum within a node and go flat, as ``pipelined`` sends them (`overlap.ops.moe.to_sources`), as do the
rows of the combine's backward (one per pair, `overlap.ops.moe.to_experts`). The source first sends ``idx`` and
its weights for the node list (fp32, fp64 for fp64), and the aggregator sums the weighted rows of each token in
list order (fp32) and sends one row per token in the op's dtype; the source sums the node sums in node order. The
order of every sum is fixed: the same inputs and plan give bitwise the same result (within the MoE tolerances
of ``reference``, which sums ``k`` in order).

Slot (node heap): the header, then to experts ``N`` areas (rows of the largest distinct-key count, then
``idx``); to sources ``N x Q`` regions (rows of the largest part a rank sends to one rank), region
``(n, q)`` written by local rank ``q`` for the source ``(n, this local index)``. Flags: to experts, flag
``n`` = area ``n`` landed; to sources, flag ``n * Q + l`` of writer ``q`` = its rows for source ``(n, l)``
are in ``(its node, l)``'s slot. Not implemented: GPU ranks, nodes of different sizes (`fit_plan`),
the fused grouped GEMM across nodes (the blocks are multiplied on the host loop, as ``symm``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ... import comm
from ..context import CallContext
from ..hierarchical import node_call as hier
from ..hierarchical.nodes import Layout, layout_of
from . import grouped, layout
from .fp8 import Fp8Experts


def _pad(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


@dataclasses.dataclass
class Routes:
    """What every rank knows after the layout's exchange. ``counts[s][d][e]``: rows source ``s`` sends to
    rank ``d``'s expert ``e``; ``keys[s][m]``: distinct keys of source ``s``'s node list for node ``m``."""

    lay: Layout
    counts: list[list[list[int]]]
    keys: list[list[int]]

    def split(self, s: int, d: int) -> int:
        return sum(self.counts[s][d])

    def pairs(self, s: int, m: int) -> int:
        return sum(self.split(s, d) for d in self.lay.nodes[m])

    def offset(self, s: int, d: int) -> int:
        """First position of rank ``d``'s rows in source ``s``'s node list for ``d``'s node."""
        nodes = self.lay.nodes
        ranks = next(r for r in nodes if d in r)
        return sum(self.split(s, q) for q in ranks[: ranks.index(d)])

    def node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.lay.nodes) if rank in ranks)

    def distinct(self, s: int, m: int) -> bool:
        """Every key of the list is distinct: the rows travel in list order, without ``idx``."""
        return self.keys[s][m] == self.pairs(s, m)


def node_lists(h: layout.MoELayout, lay: Layout, key_of_send: torch.Tensor):
    """Per node ``m``: ``(positions, keys, idx)`` of this rank's node list (send positions, the distinct keys
    sorted, the position of each entry's key among them)."""
    out = []
    for ranks in lay.nodes:
        parts = [torch.arange(h.send_offsets[d], h.send_offsets[d] + h.send_splits[d]) for d in ranks]
        pos = torch.cat(parts).to(key_of_send.device)
        keys, idx = torch.unique(key_of_send.index_select(0, pos), sorted=True, return_inverse=True)
        out.append((pos, keys, idx.to(torch.int32)))
    return out


def routes(cc: CallContext, h: layout.MoELayout, lay: Layout):
    """``(Routes, lists)`` of the layout (lists: this rank's `node_lists` by token). The first call on a layout
    exchanges them (`exchange_routes`) and fills ``h.recv_counts`` where they are still unknown (a dispatch); every
    later one reads them from the layout. Every rank makes the same calls on its layout (the plans agree), so
    every rank exchanges in the same call."""
    got = h.across.get("routes")
    if got is None:
        lists = node_lists(h, lay, h.token_of)
        got = h.across["routes"] = (exchange_routes(cc, h, lay, lists), lists)
    return got


def exchange_routes(cc: CallContext, h: layout.MoELayout, lay: Layout, lists) -> Routes:
    """Every rank's counts and distinct-key counts to every rank, in one ``all_to_all`` (bounded wait)."""
    W, L = cc.world_size, h.num_local_experts
    mine = torch.tensor([c for row in h.send_counts for c in row] + [len(k) for _, k, _ in lists], dtype=torch.int64)
    table = torch.empty(W * mine.numel(), dtype=torch.int64)
    cc.wait(dist.all_to_all_single(table, mine.repeat(W), group=cc.pg, async_op=True), "any", "counts")
    rows = table.view(W, -1).tolist()
    counts = [[row[d * L : (d + 1) * L] for d in range(W)] for row in rows]
    if not h.recv_counts:
        h.recv_counts = [counts[s][cc.rank] for s in range(W)]
    return Routes(lay, counts, [row[W * L :] for row in rows])


def _sends(cc: CallContext, tensor: torch.Tensor, peer: int, link: str, works: list) -> None:
    """`tensor` to `peer` in ``chunks_for(link)`` pieces; ``(peer, piece, work, tensor)`` appended to `works`
    (the tensor kept alive until the call waited for its sends)."""
    for j, (a, b) in enumerate(comm.chunk_bounds(tensor.shape[0], cc.plan.chunks_for(link)) if len(tensor) else []):
        works.append((peer, j, hier.isend(cc, tensor[a:b], peer), tensor))


def _recvs(cc: CallContext, tensor: torch.Tensor, peer: int, link: str, works: list) -> None:
    for j, (a, b) in enumerate(comm.chunk_bounds(tensor.shape[0], cc.plan.chunks_for(link)) if len(tensor) else []):
        works.append((peer, j, hier.irecv(cc, tensor[a:b], peer)))


# ----------------------------------------------------------------------------------------------
# Towards the experts (dispatch; the combine's backward)
# ----------------------------------------------------------------------------------------------


def to_experts(cc: CallContext, h: layout.MoELayout, rows: torch.Tensor, row_of_send: torch.Tensor,
               w: torch.Tensor | None, between):
    """`overlap.ops.moe.dispatch.run`'s transfer across nodes: ``(recv, out)`` as there; `row_of_send` is
    ``h.token_of``."""
    lay = layout_of(cc.info)
    with hier.guard(cc, lay):
        rt, lists = routes(cc, h, lay)
        W, N, r, n0 = cc.world_size, lay.num_nodes, cc.rank, lay.node
        cols, dtype = rows.shape[1], rows.dtype
        row_bytes = cols * rows.element_size()
        max_keys = max(max(k) for k in rt.keys)
        max_pairs = max(rt.pairs(s, m) for s in range(W) for m in range(N))
        rows_bytes = _pad(max(max_keys, 1) * row_bytes)
        area = rows_bytes + _pad(max(max_pairs, 1) * 4)
        call = hier.begin_node(cc, lay, hier.HEADER_BYTES + N * area)
        sends: list = []
        try:
            def area_of(owner: int, m: int, s: int):
                at = hier.HEADER_BYTES + m * area
                keys = call.buffer(owner, dtype, (rt.keys[s][n0], cols), offset=at)
                idx = call.buffer(owner, torch.int32, (rt.pairs(s, n0),), offset=at + rows_bytes)
                return keys, idx

            def payload(m: int):
                pos, keys, idx = lists[m]
                if rt.distinct(r, m):
                    return rows.index_select(0, row_of_send.index_select(0, pos)), None
                return rows.index_select(0, keys), idx

            # The network first: this rank's distinct rows (and idx) to each counterpart, theirs into our areas.
            recvs: list = []
            poison = hier.Poison(cc, lay, call, lay.remote_order())  # the areas our node's ranks wait for
            for m in lay.remote_order():
                peer = lay.rank(m, lay.local)
                data, idx = payload(m)
                if idx is not None:
                    _sends(cc, idx, peer, "network", sends)
                _sends(cc, data, peer, "network", sends)
                got_rows, got_idx = area_of(call.rank, m, peer)
                if not rt.distinct(peer, n0):
                    _recvs(cc, got_idx, peer, "network", recvs)
                _recvs(cc, got_rows, peer, "network", recvs)
            with torch.no_grad():
                data, idx = payload(n0)
                own_rows, own_idx = area_of(call.rank, n0, r)
                own_rows.copy_(data)
                if idx is not None:
                    own_idx.copy_(idx)
            call.signal_ready(n0)
            recv = torch.empty((h.num_recv, cols), dtype=dtype, device=h.info.device)
            out = (torch.empty((h.num_recv, w.shape[2]), dtype=grouped.out_dtype(w, dtype), device=h.info.device)
                   if w is not None else None)
            # Our node's sources first (their GEMMs run while the network transfers travel), then each other
            # node's once its area landed: flagged then, so the node's ranks read it too.
            _take_blocks(cc, h, lay, rt, call, area_of, n0, recv, out, w)
            for m in lay.remote_order():
                peer = lay.rank(m, lay.local)
                for p, j, work in [x for x in recvs if x[0] == peer]:
                    poison.wait(work, p, f"{j} of node {lay.names[m]}'s rows")
                call.signal_ready(m)
                _take_blocks(cc, h, lay, rt, call, area_of, m, recv, out, w)
            if between is not None:
                between()
            for p, j, work, _kept in sends:  # the sent tensors are ours, but the peer must have them before we return
                poison.wait(work, p, j)
            return recv, out
        finally:
            call.finish()


def _take_blocks(cc, h, lay: Layout, rt: Routes, call, area_of, m: int, recv, out, w) -> None:
    """The rows for this rank of every source on node `m`, from area `m` of the node rank that received them
    (our own rows first), into `recv` by expert; each block times its expert's weight into `out`."""
    r, L = cc.rank, h.num_local_experts
    ranks = lay.nodes[m]
    start = ranks.index(r) if r in ranks else 0
    for i in range(len(ranks)):
        s = ranks[(start + i) % len(ranks)]
        c = h.recv_splits[s]
        if not c:
            continue
        owner = ranks.index(s)  # area m of the node rank with the source's local index
        if owner != call.rank:
            hier.wait_local(cc, lay, call, owner, m, f"node {lay.names[m]}'s rows")
        keys, idx = area_of(owner, m, s)
        at = rt.offset(s, r)
        if rt.distinct(s, lay.node):
            staged = keys[at : at + c]
        else:
            staged = keys.index_select(0, idx[at : at + c].to(torch.int64))
        for e in range(L):
            n = h.recv_counts[s][e]
            if n:
                lo, dst = h.within_source(s, e), h.expert_offsets[e][s]
                recv[dst : dst + n].copy_(staged[lo : lo + n])
                if out is not None:
                    grouped.expert_mm(recv[dst : dst + n], w, e, out[dst : dst + n])
    return recv, out


# ----------------------------------------------------------------------------------------------
# Back to the sources (combine; the dispatch's backward)
# ----------------------------------------------------------------------------------------------


def to_sources(cc: CallContext, h: layout.MoELayout, y: torch.Tensor, w: torch.Tensor | Fp8Experts | None,
               between, weights: torch.Tensor) -> torch.Tensor:
    """`overlap.ops.moe.combine.run`'s transfer across nodes with `weights` (``[T, K]``): the weighted sum
    ``[T, N]`` (each node's rows of a token summed there)."""
    lay = layout_of(cc.info)
    with hier.guard(cc, lay):
        rt, lists = routes(cc, h, lay)
        W, N, Q, r, n0, l0 = cc.world_size, lay.num_nodes, lay.ranks_per_node, cc.rank, lay.node, lay.local
        cols = y.shape[1] if w is None else w.shape[2]
        dtype = grouped.out_dtype(w, y.dtype)  # (packed fp8 rows: the weights')
        acc = torch.float64 if torch.float64 in (dtype, weights.dtype) else torch.float32
        biggest = max(rt.split(s, d) for s in range(W) for d in range(W))
        region = _pad(max(biggest, 1) * cols * dtype.itemsize)
        call = hier.begin_node(cc, lay, hier.HEADER_BYTES + N * Q * region)
        sends: list = []
        from_peer: dict[int, list] = {}  # pieces posted from each counterpart: its weights and idx, then our rows
        try:
            def region_of(owner: int, m: int, q: int, rows: int):
                return call.buffer(owner, dtype, (rows, cols), offset=hier.HEADER_BYTES + (m * Q + q) * region)

            # (a network wait that fails raises every flag of ours: our node's ranks then read why in our header)
            poison = hier.Poison(cc, lay, call, list(range(N * Q)))
            flat_w = weights.reshape(-1).to(acc)
            got_weights = {}
            for m in lay.remote_order():  # our weights and idx to the aggregator of our rows; its to us
                peer = lay.rank(m, l0)
                works = from_peer[peer] = []
                pos, _keys, idx = lists[m]
                _sends(cc, idx, peer, "network", sends)
                _sends(cc, flat_w.index_select(0, h.order.index_select(0, pos)), peer, "network", sends)
                got = (torch.empty(rt.pairs(peer, n0), dtype=torch.int32), torch.empty(rt.pairs(peer, n0), dtype=acc))
                _recvs(cc, got[0], peer, "network", works)
                _recvs(cc, got[1], peer, "network", works)
                got_weights[peer] = (got, len(works))
            # What our aggregators send us, posted before we compute.
            results = {}
            for m in lay.remote_order():
                peer = lay.rank(m, l0)
                results[m] = torch.empty((rt.keys[r][m], cols), dtype=dtype)
                _recvs(cc, results[m], peer, "network", from_peer[peer])
            # Node by node (the other nodes first, ours last; the same order on every rank of a node): our results
            # for each of the node's sources into its aggregator's slot, then, as aggregator, its node sums to
            # our counterpart there, which travel while the next node's results are computed.
            own = None
            for m in [*lay.remote_order(), n0]:
                with torch.no_grad():
                    for ls, src in enumerate(lay.nodes[m]):
                        grouped.rows_for(h, y, w, src, region_of(ls, m, l0, h.recv_splits[src]))
                        call.signal_ready(m * Q + ls)
                s = lay.rank(m, l0)
                parts = []
                for q, d in enumerate(lay.nodes[n0]):
                    if q != l0:
                        hier.wait_local(cc, lay, call, q, m * Q + l0, f"rows for rank {s}")
                    parts.append(region_of(call.rank, m, q, rt.split(s, d)))
                joined = torch.cat(parts)
                if m == n0:
                    pos, _keys, idx = lists[m]
                    wts = flat_w.index_select(0, h.order.index_select(0, pos))
                else:
                    (idx, wts), upto = got_weights[s]
                    _wait_from(poison, from_peer, s, lay.names[m], upto)
                summed = torch.zeros((rt.keys[s][n0], cols), dtype=acc)
                summed.index_add_(0, idx.to(torch.int64), joined.to(acc) * wts.unsqueeze(-1))
                if m == n0:
                    own = summed
                else:
                    _sends(cc, summed.to(dtype), s, "network", sends)
            if between is not None:
                between()
            for m in lay.remote_order():
                _wait_from(poison, from_peer, lay.rank(m, l0), lay.names[m])
            for p, j, work, _kept in sends:
                poison.wait(work, p, j)
            return _assemble(h, lay, lists, own, results, acc, dtype)
        finally:
            call.finish()


def _wait_from(poison, from_peer: dict, peer: int, name: str, upto: int | None = None) -> None:
    """Wait for the pieces posted from `peer` not waited yet (the first `upto` of them), in posting order."""
    works = from_peer[peer]
    n = len(works) if upto is None else upto
    done = sum(1 for x in works if x is None)
    for i in range(done, n):
        p, j, work = works[i]
        works[i] = None
        poison.wait(work, p, f"{j} of node {name}'s rows")


def _assemble(h, lay, lists, own, results, acc, dtype):
    """The sum of the node sums in node order ``[T, cols]``."""
    total = torch.zeros((h.num_tokens, own.shape[1]), dtype=acc)
    for m in range(lay.num_nodes):
        got = own if m == lay.node else results[m]
        keys = lists[m][1]
        if len(keys):
            total.index_add_(0, keys, got.to(acc))
    return total.to(dtype)
