"""hierarchical: the tensor-parallel ops on groups that span nodes, shared memory within a node and
point-to-point between nodes, composed in one call; this module is the all-gather (`HierGather`), which
`all_gather_matmul`, the backward of `matmul_reduce_scatter` and `all_gather_weight_matmul` run;
`overlap.ops.tp.hierarchical_reduce` sums. The node layout, the node heap's handshake and failures:
`overlap.ops.hierarchical.node_call`.

Problem. On a group that spans nodes, ``pipelined`` exchanges every block with every remote rank: in an
all-gather on 2 nodes x 2 ranks each remote block crosses the slow link once per receiving rank (twice).
Here every datum crosses the network once per node: a block goes to one rank of each other node, which
forwards it to its node's other ranks through the node's symmetric heap; partial sums are summed within
the node before they cross.

Slot layout (every rank's slot): the node header (`overlap.ops.hierarchical.node_call.HEADER_BYTES`), then one block
per node.

All-gather (`HierGather`). Rank ``(n, l)`` first posts the network: its rows to each counterpart, each
counterpart's rows into its gathered tensor (network chunks), so they travel during the node's handshake. It then
copies its rows into block ``n`` of its slot and flags them (chunked for the node link); as each network chunk
lands it copies it into block ``n'`` of its slot and flags it, so the node's other ranks pull it (the copy
engine) while the next chunk travels, and the GEMM takes it. Order of the chunks it yields (the same every call, so
the consumer's sums are repeatable): its own rows, the node's own rows, the network arrivals in posting order (each
forwarded as soon as it landed, while the node's rows are still being taken), then the rows other ranks of the
node forwarded.

Not implemented: GPU ranks (CPU ranks only: `fit_plan` raises), nodes of different sizes, ``fused`` within the
node (``symm``'s copies are used).
"""

from __future__ import annotations

import torch

from ... import comm, symm, world
from ..context import CallContext
from ..hierarchical.agreement import InData
from ..hierarchical.node_call import HEADER_BYTES, Poison, begin_node, guard, padded, wait_local
from ..hierarchical.nodes import Layout, layout_of

# ----------------------------------------------------------------------------------------------
# The all-gather: every rank's rows, each remote block over the network once per node
# ----------------------------------------------------------------------------------------------


class HierGather:
    """A hierarchical gather in flight, with `overlap.ops.tp.gather.Gather`'s interface: `chunks` yields
    ``(row_lo, row_hi, rows)`` of the gathered tensor as they arrive, `gathered` is the whole of it,
    `close` ends the call.

    xcall: the group's call (`overlap.ops.hierarchical.agreement.InData`: its counterparts carry the network's
    messages and the agreement across nodes), which `close` finishes where `ends_call`. x2: this rank's rows
    ``[parts[rank], k]``; parts: ``(lo, hi)`` rows of every group rank in the gathered tensor; full: the gathered
    tensor (None: a new one). call: a node call already begun (then `offset` and the flags ``flag_base ... flag_base +
    flag_budget`` are this gather's part of its slot), else the gather begins and ends its own with `need` bytes at
    least. deferred: this rank's rows are not there yet: each range is sent and flagged by `publish` as it is ready
    (chunked for the network within the node too).
    """

    def __init__(self, cc: CallContext, xcall: InData, x2: torch.Tensor, parts: list[tuple[int, int]], *,
                 full: torch.Tensor | None = None, call: symm.Call | None = None, need: int = 0,
                 offset: int = HEADER_BYTES, flag_base: int = 0, flag_budget: int = symm.MAX_FLAGS,
                 deferred: bool = False, ends_call: bool = False):
        self.cc, self.xcall, self.cp, self.x2, self.parts, self.info = cc, xcall, xcall.cp, x2, parts, cc.info
        self.sub, self.deferred, self.ends_call = xcall.cp.sub(), deferred, ends_call
        self.lay = lay = layout_of(cc.info)
        self.rows = max(hi - lo for lo, hi in parts)
        self.block = padded(self.rows * x2.shape[1] * x2.element_size())
        self.offset, self.flag_base = offset, flag_base
        self.stride = flag_budget // lay.num_nodes
        self.own_call = call is None
        self.full = full if full is not None else x2.new_empty((parts[-1][1], x2.shape[1]))
        self.futures: list = []
        self.net: list = []  # (node, chunk, src, (lo, hi), recv), in posting order, until forwarded
        self.landed: list = []  # rows (lo, hi) of the network chunks forwarded, in posting order
        self.sends: list = []
        self.pulls_own: list = []  # (rows lo, hi, future) of the node's own rows
        self.pulls_fwd: list = []  # ... of rows the node's ranks forwarded
        self.finished = False
        self.abort = [False]  # set by close: pulls still queued on the copy engine return without waiting
        self.call = call
        self.poison: Poison | None = None
        try:
            # The network first: its transfers need no slot, so they travel during the node's handshake.
            self._post_network()
            if self.call is None:
                self.call = begin_node(cc, lay, max(need, offset + lay.num_nodes * self.block), steady=True)
            self._post_node()
        except BaseException as exc:
            if self.poison is not None and isinstance(exc, Exception):
                self.poison.error(exc)
            self.close()
            raise

    # ---- layout ----------------------------------------------------------------------------------------
    def bounds(self, node: int, rows: int) -> list[tuple[int, int]]:
        link = "network" if node != self.lay.node or self.deferred else _node_link(self.info)
        return comm.chunk_bounds(rows, min(self.cc.plan.chunks_for(link), self.stride)) if rows else []

    def slot_block(self, peer: int, node: int, rows: int) -> torch.Tensor:
        return self.call.buffer(peer, self.x2.dtype, (rows, self.x2.shape[1]), offset=self.offset + node * self.block)

    def flag(self, node: int, j: int) -> int:
        return self.flag_base + node * self.stride + j

    def rows_of(self, node: int, local: int) -> tuple[int, int]:
        return self.parts[self.lay.rank(node, local)]

    # ---- posting ---------------------------------------------------------------------------------------
    def _post_network(self) -> None:
        """This rank's rows to every counterpart, every counterpart's rows into the gathered tensor, in chunks."""
        cc, lay = self.cc, self.lay
        l0 = lay.local
        lo, hi = self.parts[cc.rank]
        for n in lay.remote_order():
            if not self.deferred:
                self._send(n, 0, hi - lo)
            src = lay.rank(n, l0)
            rlo, rhi = self.rows_of(n, l0)
            for j, (a, b) in enumerate(self.bounds(n, rhi - rlo)):
                self.net.append((n, j, src, (a, b), self.cp.recv(self.full[rlo + a : rlo + b], src, self.sub, j)))

    def _send(self, n: int, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` of x2 (whole network chunks) to the counterpart that `n`'s position names."""
        lay = self.lay
        dst = lay.rank((2 * lay.node - n) % lay.num_nodes, lay.local)  # the node as far behind as `n` is ahead
        own = self.parts[self.cc.rank]
        for j, (a, b) in enumerate(self.bounds(n, own[1] - own[0])):
            if lo <= a and b <= hi:
                self.sends.append((dst, j, self.cp.send(self.x2[a:b], dst, self.sub)))

    def _post_node(self) -> None:
        """This rank's rows into its slot, flagged; the copy engine's pulls of the node's ranks' blocks."""
        cc, lay, call = self.cc, self.lay, self.call
        n0, l0 = lay.node, lay.local
        lo, hi = self.parts[cc.rank]
        own = self.bounds(n0, hi - lo)
        mine = [self.flag(n0, j) for j in range(len(own))]
        for n in lay.remote_order():
            rlo, rhi = self.rows_of(n, l0)
            mine += [self.flag(n, j) for j in range(len(self.bounds(n, rhi - rlo)))]
        self.poison = Poison(cc, lay, call, mine, self.cp)
        if not self.deferred:
            self.publish(0, hi - lo)
        # Pulls by the copy engine: the node's own rows first (flagged already), then what peers forward.
        engine = comm.copy_engine()
        for q in lay.local_order()[:-1]:
            self._pull(engine, q, n0, self.pulls_own)
        for n in lay.remote_order():
            for q in lay.local_order()[:-1]:
                self._pull(engine, q, n, self.pulls_fwd)

    def publish(self, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` of x2 are final (whole chunks): into the gathered tensor and the slot, flagged, and (if
        deferred) sent to the counterparts."""
        n0 = self.lay.node
        own = self.parts[self.cc.rank]
        self.full[own[0] + lo : own[0] + hi].copy_(self.x2[lo:hi])
        self.slot_block(self.call.rank, n0, own[1] - own[0])[lo:hi].copy_(self.x2[lo:hi])
        for j, (a, b) in enumerate(self.bounds(n0, own[1] - own[0])):
            if lo <= a and b <= hi:
                self.call.signal_ready(self.flag(n0, j))
        if self.deferred:
            for n in self.lay.remote_order():
                self._send(n, lo, hi)

    def _pull(self, engine, q: int, node: int, into: list) -> None:
        lo, hi = self.rows_of(node, q)
        src = self.slot_block(q, node, hi - lo)
        for j, (a, b) in enumerate(self.bounds(node, hi - lo)):
            fut = engine.submit(_pull, self.abort, self.cc, self.lay, self.call, q, self.flag(node, j), src[a:b],
                                self.full[lo + a : lo + b], f"{j} of node {self.lay.names[node]}'s rows")
            self.futures.append(fut)
            into.append((lo + a, lo + b, fut))

    # ---- consuming -------------------------------------------------------------------------------------
    def _forward(self, block: bool) -> None:
        """Network chunks in posting order, each flagged for the node (forwarded) as soon as it landed (`block`:
        wait for every one); they are yielded later, in posting order (`landed`), so that the consumer's sums run
        in the same order every call."""
        while self.net:
            n, j, src, (a, b), work = self.net[0]
            if not block and not work.done():
                return
            self.net.pop(0)
            self.poison.wait(work, src, f"{j} of node {self.lay.names[n]}'s rows")
            rlo, rhi = self.rows_of(n, self.lay.local)
            self.slot_block(self.call.rank, n, rhi - rlo)[a:b].copy_(self.full[rlo + a : rlo + b])
            self.call.signal_ready(self.flag(n, j))  # forwarded: the node's ranks pull it now
            self.landed.append((rlo + a, rlo + b))

    def chunks(self):
        with guard(self.cc, self.lay):  # an error names the remote rank a peer saw fail
            try:
                yield from self._chunks()
            except Exception as exc:
                self.poison.error(exc)
                raise

    def _chunks(self):
        lo, hi = self.parts[self.cc.rank]
        yield lo, hi, self.x2
        for lo, hi, fut in self.pulls_own:
            self._forward(block=False)
            comm.result(fut, self.cc.timeout)
            yield lo, hi, self.full[lo:hi]
        self._forward(block=True)
        for lo, hi in self.landed:
            yield lo, hi, self.full[lo:hi]
        for lo, hi, fut in self.pulls_fwd:
            comm.result(fut, self.cc.timeout)
            yield lo, hi, self.full[lo:hi]
        for dst, j, work in self.sends:  # x2 is the caller's: every send is done before the call returns
            self.poison.wait(work, dst, j)
        self.sends = []

    def gathered(self) -> torch.Tensor:
        return self.full

    def close(self) -> None:
        self.abort[0] = True  # (after a normal end every pull has run)
        comm.drain(self.futures)
        if not self.finished:
            self.finished = True
            if self.own_call and self.call is not None:
                self.call.finish()
            if self.ends_call:
                self.xcall.finish()


def _node_link(info: world.GroupInfo) -> str:
    """The link class between ranks of one node (this group's ranks on this rank's node)."""
    return "shm" if info.device.type != "cuda" else "nvlink"


def _pull(abort: list[bool], cc: CallContext, lay: Layout, call: symm.Call, q: int, index: int,
          src: torch.Tensor, dst: torch.Tensor, chunk: str) -> None:
    if abort[0]:
        return
    wait_local(cc, lay, call, q, index, chunk)
    dst.copy_(src)
