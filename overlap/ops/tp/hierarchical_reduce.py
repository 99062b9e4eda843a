"""The reductions of the ``hierarchical`` strategy: reduce-scatter and all-reduce of a GEMM's partials on a
group that spans nodes, each partial summed within its node before it crosses the network once.

The topology, the node heap, the slot header, the counterparts and the failure rules are those of
`overlap.ops.hierarchical.node_call` (read its docstring first).

Reduce-scatter (`reduce_scatter_parts`). Destination ``d = (n', l')`` gets rows ``parts[d]`` of
``sum_r a_r @ b_r``. Rank ``(n, l)`` computes the partial of every destination chunk by chunk and writes it
into its own region of the slot of rank ``(n, l')`` of its node (the **node owner** of every destination
with local index ``l'``), flagging each chunk; the destinations on other nodes first, node by node, so their
sums travel while the rest is computed. The node owner sums the ``L`` regions of a chunk in local order
once flagged and, for a destination on another node, sends the node's sum to it (its counterpart there) in
network chunks; for its own rows it keeps the node's sum. Each rank then sums the node sums in node order:
the result's order of summation is fixed (node, then local rank), so the same inputs and plan give bitwise
the same result. 16-bit: partials are summed in fp32; a node's sum crosses the network in the op's dtype
(one rounding per node, half the bytes of fp32) and the final sum is in fp32, rounded once.

Slot: the header, then for each source ``l`` and destination node ``n'`` a region ``[rows, n]`` (``rows``
the largest part), at ``(l * N + n') * region`` bytes; ready flag ``flag_base + n' * F + j`` of the
producer says "chunk ``j`` of my partial for your destination on node ``n'`` is in your buffer".

All-reduce (`all_reduce`): the rows cut into ``W`` parts of ``ceil(M / W)`` rows (as ``symm``'s two-shot),
the reduce-scatter above into the first half of the flags, then the reduced parts gathered by
`overlap.ops.tp.hierarchical_gather.HierGather` in the same slot (second half of the flags): every rank ends with
bitwise the same output. ``Plan.one_shot`` is ignored across nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import comm, symm
from ..context import CallContext
from ..hierarchical.agreement import InData
from ..hierarchical.node_call import HEADER_BYTES, Poison, begin_node, guard, padded, wait_local
from ..hierarchical.nodes import Layout, layout_of
from ..sums import LOW, sum_in_order
from .hierarchical_gather import HierGather
from .operands import Gemm
from .rows import Product, Rows


def reduce_bytes(rows: int, n: int, dtype: torch.dtype, world_size: int) -> int:
    """Slot bytes of a reduce-scatter whose largest part has `rows` rows (the header included)."""
    return HEADER_BYTES + world_size * padded(rows * n * torch.empty((), dtype=dtype).element_size())


def reduce_scatter(cc: CallContext, xcall: InData, prod: Product, out: torch.Tensor | None = None) -> torch.Tensor:
    """``matmul_reduce_scatter`` across nodes: `prod` (``[W*m, k] @ [k, n]``, rank-major: one outer block), this
    rank's ``[m, n]`` of the sum (into `out` if given). `xcall`: the group's call
    (`overlap.ops.hierarchical.agreement.InData`)."""
    lay = layout_of(cc.info)
    W, n, m = cc.world_size, prod.n, prod.m
    with guard(cc, lay):
        call = begin_node(cc, lay, reduce_bytes(m, n, prod.dtype, W), steady=True)
        try:
            return reduce_scatter_parts(cc, xcall, lay, call, prod, [(d * m, (d + 1) * m) for d in range(W)],
                                        out=out)
        finally:
            call.finish()


def all_reduce(cc: CallContext, xcall: InData, g: Gemm) -> torch.Tensor:
    """``matmul_all_reduce`` across nodes: ``[M, k] @ [k, n]`` (`g`) summed over ranks, ``[M, n]`` on every rank:
    the reduce-scatter of `reduce_scatter_parts`, each network chunk of this rank's reduced part gathered
    (`HierGather`, deferred) as soon as it is summed, while the next chunks are still being reduced."""
    lay = layout_of(cc.info)
    W, n, M = cc.world_size, g.n, g.a.shape[0]
    size = -(-M // W)
    parts = [(min(d * size, M), min((d + 1) * size, M)) for d in range(W)]
    rs = reduce_bytes(size, n, g.dtype, W)
    ag = padded(size * n * g.dtype.itemsize)
    half = symm.MAX_FLAGS // 2
    out = g.a.new_empty((M, n), dtype=g.dtype)
    lo, hi = parts[cc.rank]
    mine = g.a.new_empty((hi - lo, n), dtype=g.dtype)
    with guard(cc, lay):
        call = begin_node(cc, lay, rs + lay.num_nodes * ag, steady=True)
        try:
            gather = HierGather(cc, xcall, mine, parts, full=out, call=call, offset=rs, flag_base=half,
                                flag_budget=half, deferred=True)
            try:
                reduce_scatter_parts(cc, xcall, lay, call, Product([g], Rows.flat(W, size)), parts,
                                     flag_budget=half, out=mine, on_rows=gather.publish)
                for _ in gather.chunks():
                    pass
            except Exception as exc:
                gather.poison.error(exc)
                raise
            finally:
                gather.close()
        finally:
            call.finish()
    return out


def reduce_scatter_parts(cc: CallContext, xcall: InData, lay: Layout, call: symm.Call, prod: Product,
                         parts: list[tuple[int, int]], flag_budget: int = symm.MAX_FLAGS,
                         out: torch.Tensor | None = None,
                         on_rows: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """This rank's part of ``reduce_scatter(prod)`` (`prod`: rank-major, parts ``d * prod.m``): rows
    ``parts[rank]`` of the sum over ranks, ``[rows, n]`` in its dtype (into `out` if given). `call` is the node's
    call (begun, slot free); the regions start after the header. `on_rows(lo, hi)`: told of each network chunk of
    the result as soon as it is summed."""
    n0, l0, N = lay.node, lay.local, lay.num_nodes
    n, dtype = prod.n, prod.dtype
    cp, sub = xcall.cp, xcall.cp.sub()
    a2 = torch.empty((), dtype=dtype, device=prod.device)  # (new tensors' dtype and device)
    rows = max(hi - lo for lo, hi in parts)
    region = padded(rows * n * a2.element_size())
    F = flag_budget // N
    node_link = "shm" if a2.device.type == "cpu" else "nvlink"

    def bounds(node: int, count: int) -> list[tuple[int, int]]:
        link = "network" if node != n0 else node_link
        return comm.chunk_bounds(count, min(cc.plan.chunks_for(link), F))

    def area(owner: int, source: int, node: int, count: int) -> torch.Tensor:
        return call.buffer(owner, dtype, (count, n), offset=HEADER_BYTES + (source * N + node) * region)

    def size(node: int, local: int) -> int:
        lo, hi = parts[lay.rank(node, local)]
        return hi - lo

    my_lo, my_hi = parts[cc.rank]
    mine_rows = my_hi - my_lo
    # Every flag this rank may raise (so that on a failure its node's peers stop waiting for it).
    flags = [node * F + j for node in range(N) for j in range(max(len(bounds(node, size(node, q)))
                                                                   for q in range(lay.ranks_per_node)))]
    poison = Poison(cc, lay, call, flags, cp)
    try:
        # The node sums of our rows from every other node, in network chunks, posted first.
        received, recvs = {}, []
        for node in lay.remote_order():
            received[node] = buf = a2.new_empty((mine_rows, n))
            src = lay.rank(node, l0)
            recvs.append({j: (src, cp.recv(buf[lo:hi], src, sub, j))
                          for j, (lo, hi) in enumerate(bounds(node, mine_rows)) if hi > lo})
        sends, node_sums = [], {}
        for node in [*lay.remote_order(), n0]:
            dest = lay.rank(node, l0)  # the destination this rank owns on `node`
            dest_rows = size(node, l0)
            node_sums[node] = total = a2.new_empty((dest_rows, n), dtype=torch.float32 if dtype in LOW and
                                                   node == n0 else dtype)
            chunks = max(len(bounds(node, size(node, q))) for q in range(lay.ranks_per_node))
            for j in range(chunks):
                # Produce chunk j of every destination of `node` into its node owner's buffer, owners from ours on.
                for q in lay.local_order():
                    d = lay.rank(node, q)
                    got = bounds(node, size(node, q))
                    if j >= len(got):
                        continue
                    lo, hi = got[j]
                    prod.into(d, lo, hi, area(q, l0, node, size(node, q))[lo:hi])
                    if q != l0:
                        call.signal_ready(node * F + j)
                # Own: sum chunk j of our destination on `node` over the node's ranks, local order.
                got = bounds(node, dest_rows)
                if j >= len(got):
                    continue
                lo, hi = got[j]
                for q in range(lay.ranks_per_node):
                    if q != l0:
                        wait_local(cc, lay, call, q, node * F + j, f"{j} of the partials for node {lay.names[node]}")
                sum_in_order([area(l0, q, node, dest_rows) for q in range(lay.ranks_per_node)], total, lo, hi)
                if node != n0 and hi > lo:
                    sends.append((dest, j, cp.send(total[lo:hi], dest, sub)))
        # Our rows: the node sums in node order (ours kept in fp32 for 16-bit dtypes), rounded once; chunk by
        # network chunk, each told to `on_rows` as it is summed (an all-reduce sends it on at once).
        out = a2.new_empty((mine_rows, n)) if out is None else out
        for j, (lo, hi) in enumerate(comm.chunk_bounds(mine_rows, min(cc.plan.chunks_for("network"), F))):
            for per_node in recvs:
                if j in per_node:
                    src, work = per_node[j]
                    poison.wait(work, src, f"{j} of the node sum")
            terms = [node_sums[n0][lo:hi] if node == n0 else received[node][lo:hi] for node in range(N)]
            if dtype in LOW:
                acc = terms[0].float()
                for t in terms[1:]:
                    acc += t
                out[lo:hi].copy_(acc)
            else:
                out[lo:hi].copy_(terms[0])
                for t in terms[1:]:
                    out[lo:hi] += t
            if on_rows is not None:
                on_rows(lo, hi)
        for dst, j, work in sends:
            poison.wait(work, dst, j)
    except Exception as exc:
        poison.error(exc)
        raise
    return out
