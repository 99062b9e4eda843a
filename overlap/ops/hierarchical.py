"""hierarchical: the tensor-parallel ops on groups that span nodes, shared memory within a node and
point-to-point between nodes, composed in one call.

Problem. On a group that spans nodes, ``pipelined`` exchanges every block with every remote rank: in an
all-gather on 2 nodes x 2 ranks each remote block crosses the slow link once per receiving rank (twice).
Here every datum crosses the network once per node: a block goes to one rank of each other node, which
forwards it to its node's other ranks through the node's symmetric heap; partial sums are summed within
the node before they cross.

Topology (`Layout`). The group's nodes, ordered by their lowest group rank; the ranks of a node in group
rank order; ``(node, local)`` names a rank. Every node must hold the same number of ranks ``L`` (ValueError
otherwise, from `overlap.plans.auto.fit_plan`, in the preamble). Rank ``(n, l)``'s **counterparts**
are the ranks ``(n', l)`` of the other nodes: all network traffic is between counterparts, chunked for the
``network`` link (`Plan.chunks_for("network")`); traffic within a node goes through the node's heap, chunked
for the node's link (``shm`` on CPU ranks).

The node's heap belongs to a **node group**: a process group of the node's ranks, made once per set of
ranks (``dist.new_group(..., use_local_synchronization=True)``: only its members take part, so nothing is
collective over the world) and shared by every group whose node holds those ranks. A call makes the group's
handshake (`CallContext.begin`: across nodes a collective of the call signatures), then the node's
handshake (`begin_node`, the same signature) and runs on a slot of the node heap.

Slot layout (every rank's slot): a 64-byte header (int64: ``dead + 1``, a failed remote rank this rank
saw, else 0), then the op's areas (`HierGather`: one block per node; `overlap.ops.hierarchical_reduce`:
one region per (source, destination node)).

All-gather (`HierGather`). Rank ``(n, l)`` first posts the network: its rows to each counterpart, each
counterpart's rows into its gathered tensor (network chunks), so they travel during the node's handshake. It then
copies its rows into block ``n`` of its slot and flags them (chunked for the node link); as each network chunk
lands it copies it into block ``n'`` of its slot and flags it, so the node's other ranks pull it (the copy
engine) while the next chunk travels, and the GEMM takes it. Order of the chunks it yields: its own rows, the
node's own rows (interleaved with network arrivals as they complete), the rest of the network arrivals, then
the rows other ranks of the node forwarded.

Failures. Every wait has the call's deadline. A network wait that fails (the counterpart's process died:
its connection closed) or times out on a rank whose process is gone writes ``dead + 1`` in this rank's
header, raises every flag this rank owns in the call (so its node's peers stop waiting for it and read the
header) and records the dead rank in the process group's store (`report_dead`); an error raised in a
hierarchical call names the dead rank recorded there, whichever rank it reached first (`guard`).

Not implemented: GPU ranks (CPU ranks only: `fit_plan` raises), nodes of different sizes, ``fused`` within the
node (``symm``'s copies are used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch
import torch.distributed as dist

from .. import comm, symm, world
from ..errors import OverlapError, OverlapTimeout
from .context import CallContext

#: bytes of a slot's header (the failed remote rank, then padding)
HEADER_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """The group's nodes: ``nodes[n]`` is the group ranks of node ``n`` (nodes by lowest rank, ranks in
    order); this rank is ``(node, local)``."""

    nodes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    node: int
    local: int

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        return len(self.nodes[self.node])

    def rank(self, node: int, local: int) -> int:
        return self.nodes[node][local]

    def remote_order(self) -> list[int]:
        """The other nodes, from the next one on (so the counterparts do not all send to one node at once)."""
        N = self.num_nodes
        return [(self.node + i) % N for i in range(1, N)]

    def local_order(self) -> list[int]:
        """Local indices from this rank's next one on, this rank's own last."""
        L = self.ranks_per_node
        return [(self.local + i) % L for i in range(1, L + 1)]


def layout_of(info: world.GroupInfo) -> Layout:
    first: dict[str, int] = {}
    for r, name in enumerate(info.nodes):
        first.setdefault(name, r)
    names = tuple(sorted(first, key=first.get))
    nodes = tuple(tuple(r for r in range(info.world_size) if info.nodes[r] == name) for name in names)
    node = names.index(info.nodes[info.rank])
    return Layout(nodes, names, node, nodes[node].index(info.rank))


# ----------------------------------------------------------------------------------------------
# The node group, its heap and the call's node handshake
# ----------------------------------------------------------------------------------------------

_NODE_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def node_group(cc: CallContext, lay: Layout) -> dist.ProcessGroup:
    """The process group of this rank's node (global ranks), made once per set of ranks by its members only
    (per default group: a process that re-initializes torch.distributed makes new ones)."""
    key = (id(dist.group.WORLD), tuple(sorted(cc.info.global_ranks[r] for r in lay.nodes[lay.node])))
    pg = _NODE_GROUPS.get(key)
    if pg is None:
        pg = dist.new_group(list(key[1]), timeout=datetime.timedelta(seconds=cc.timeout),
                            use_local_synchronization=True)
        _NODE_GROUPS[key] = pg
    return pg


def begin_node(cc: CallContext, lay: Layout, need: int) -> symm.Call:
    """The node's handshake for this call (after the group's): a slot of at least `need` bytes (the header
    included); its header cleared once the slot is free."""
    heap = symm.heap_for(node_group(cc, lay), cc.timeout)
    call = heap.begin(cc.op, cc.signature, max(need, HEADER_BYTES), cc.timeout)
    try:
        call.wait_slot_free()
        header(call, call.rank).zero_()
    except BaseException:
        call.finish()
        raise
    return call


def header(call: symm.Call, peer: int) -> torch.Tensor:
    return call.buffer(peer, torch.int64, (1,))


def wait_local(cc: CallContext, lay: Layout, call: symm.Call, peer: int, index: int, chunk) -> None:
    """Wait for local rank `peer`'s flag `index`, then check its header; errors name group ranks (the node
    heap's own are node-local)."""
    try:
        call.wait_ready(peer, index, chunk=chunk)
    except OverlapTimeout as exc:
        raise OverlapTimeout(cc.op, cc.rank, lay.rank(lay.node, peer), chunk, cc.timeout,
                             "data never signalled ready by this node's rank") from exc
    check_header(cc, lay, call, peer)


def check_header(cc: CallContext, lay: Layout, call: symm.Call, peer: int) -> None:
    """After a flag of local rank `peer`: raise if it flagged because a remote rank failed."""
    dead = int(header(call, peer)[0])
    if dead:
        raise OverlapError(_dead_text(cc, lay, dead - 1, f"local rank {lay.rank(lay.node, peer)} saw it fail"))


def _dead_text(cc: CallContext, lay: Layout, dead: int, how: str) -> str:
    node = next(n for n, ranks in enumerate(lay.nodes) if dead in ranks)
    return (f"overlap.{cc.op}: rank {cc.rank}: rank {dead} on node {lay.names[node]!r} failed during the call "
            f"({how}). The peer probably died; destroy and re-create the group.")


# ----------------------------------------------------------------------------------------------
# Point-to-point between counterparts (bytes to other nodes counted by `overlap.comm`)
# ----------------------------------------------------------------------------------------------


def isend(cc: CallContext, tensor: torch.Tensor, peer: int):
    comm.count_sent(cc.info, peer, tensor.numel() * tensor.element_size())
    return _post(cc, dist.isend, tensor, peer)


def irecv(cc: CallContext, tensor: torch.Tensor, peer: int):
    return _post(cc, dist.irecv, tensor, peer)


def _post(cc: CallContext, fn, tensor: torch.Tensor, peer: int):
    try:
        return fn(tensor, cc.info.global_ranks[peer], group=cc.pg)
    except RuntimeError as exc:
        raise OverlapError(f"overlap.{cc.op}: rank {cc.rank}: posting a transfer with rank {peer} failed: {exc}. "
                           "The peer probably died; destroy and re-create the group.") from exc


class Poison:
    """What a rank does when a network wait fails: mark its header, raise every flag it owns in the call
    (`flags`: the indices), record the dead rank in the store; then the error is raised."""

    def __init__(self, cc: CallContext, lay: Layout, call: symm.Call, flags: list[int]):
        self.cc, self.lay, self.call, self.flags = cc, lay, call, flags

    def wait(self, work, peer: int, chunk) -> None:
        try:
            self.cc.wait(work, peer, chunk)
        except OverlapError as exc:
            if not isinstance(exc, OverlapTimeout) or self.cc.info.gone(peer):
                self.fire(peer)
            raise

    def fire(self, dead: int) -> None:
        with contextlib.suppress(Exception):  # best effort on an error path
            header(self.call, self.call.rank)[0] = dead + 1
            for index in self.flags:
                self.call.signal_ready(index)
        report_dead(self.cc, dead)


def _store_key(cc: CallContext) -> str:
    return "overlap/hierarchical/dead/" + "-".join(map(str, cc.info.global_ranks))


def report_dead(cc: CallContext, dead: int) -> None:
    """Record `dead` in the store, where `guard` finds it on every rank of the group."""
    from torch.distributed import distributed_c10d as c10d

    with contextlib.suppress(Exception):
        c10d._get_default_store().set(_store_key(cc), f"{dead}:{cc.rank}")


@contextlib.contextmanager
def guard(cc: CallContext, lay: Layout | None = None):
    """Around a hierarchical call: an `OverlapError` becomes one naming the dead rank a peer recorded."""
    lay = lay if lay is not None else layout_of(cc.info)
    try:
        yield
    except OverlapError as exc:
        from torch.distributed import distributed_c10d as c10d

        try:
            store = c10d._get_default_store()
            text = store.get(_store_key(cc)).decode() if store.check([_store_key(cc)]) else ""
        except Exception:  # noqa: BLE001 - no store: keep the original error
            text = ""
        if not text or f"rank {text.split(':')[0]} on node" in str(exc):
            raise
        dead, seen_by = (int(v) for v in text.split(":"))
        raise OverlapError(_dead_text(cc, lay, dead, f"rank {seen_by} saw it fail") + f" Here: {exc}") from exc


# ----------------------------------------------------------------------------------------------
# The all-gather: every rank's rows, each remote block over the network once per node
# ----------------------------------------------------------------------------------------------


def gather_bytes(x2: torch.Tensor, world_size: int) -> int:
    """Slot bytes of a gather of `x2` (also enough for ``symm``'s, which the one-node case runs)."""
    return HEADER_BYTES + world_size * _padded(x2.numel() * x2.element_size())


def _padded(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


class HierGather:
    """A hierarchical gather in flight, with `overlap.ops._gather.Gather`'s interface: `chunks` yields
    ``(row_lo, row_hi, rows)`` of the gathered tensor as they arrive, `gathered` is the whole of it,
    `close` ends the call.

    x2: this rank's rows ``[parts[rank], k]``; parts: ``(lo, hi)`` rows of every group rank in the gathered
    tensor; full: the gathered tensor (None: a new one). call: a node call already begun (then `offset`
    and the flags ``flag_base ... flag_base + flag_budget`` are this gather's part of its slot), else the
    gather begins and ends its own with `need` bytes at least.
    """

    def __init__(self, cc: CallContext, x2: torch.Tensor, parts: list[tuple[int, int]], *,
                 full: torch.Tensor | None = None, call: symm.Call | None = None, need: int = 0,
                 offset: int = HEADER_BYTES, flag_base: int = 0, flag_budget: int = symm.MAX_FLAGS):
        self.cc, self.x2, self.parts, self.info = cc, x2, parts, cc.info
        self.lay = lay = layout_of(cc.info)
        self.rows = max(hi - lo for lo, hi in parts)
        self.block = _padded(self.rows * x2.shape[1] * x2.element_size())
        self.offset, self.flag_base = offset, flag_base
        self.stride = flag_budget // lay.num_nodes
        self.own_call = call is None
        self.full = full if full is not None else x2.new_empty((parts[-1][1], x2.shape[1]))
        self.futures: list = []
        self.net: list = []  # (node, chunk, (lo, hi), recv work), in arrival order
        self.sends: list = []
        self.pulls_own: list = []  # (rows lo, hi, future) of the node's own rows
        self.pulls_fwd: list = []  # ... of rows the node's ranks forwarded
        self.finished = False
        self.abort = [False]  # set by close: pulls still queued on the copy engine return without waiting
        self.call = call
        try:
            # The network first: its transfers need no slot, so they travel during the node's handshake.
            self._post_network()
            if self.call is None:
                self.call = begin_node(cc, lay, max(need, offset + lay.num_nodes * self.block))
            self._post_node()
        except BaseException:
            self.close()
            raise

    # ---- layout ----------------------------------------------------------------------------------------
    def bounds(self, node: int, rows: int) -> list[tuple[int, int]]:
        link = "network" if node != self.lay.node else _node_link(self.info)
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
        cc, lay, x2 = self.cc, self.lay, self.x2
        n0, l0 = lay.node, lay.local
        lo, hi = self.parts[cc.rank]
        for n in lay.remote_order():
            dst = lay.rank((2 * n0 - n) % lay.num_nodes, l0)  # the node as far behind as `n` is ahead
            for j, (a, b) in enumerate(self.bounds(n, hi - lo)):
                self.sends.append((dst, j, isend(cc, x2[a:b], dst)))
            src = lay.rank(n, l0)
            rlo, rhi = self.rows_of(n, l0)
            for j, (a, b) in enumerate(self.bounds(n, rhi - rlo)):
                self.net.append((n, j, src, (a, b), irecv(cc, self.full[rlo + a : rlo + b], src)))

    def _post_node(self) -> None:
        """This rank's rows into its slot, flagged; the copy engine's pulls of the node's ranks' blocks."""
        cc, lay, call, x2 = self.cc, self.lay, self.call, self.x2
        n0, l0 = lay.node, lay.local
        lo, hi = self.parts[cc.rank]
        self.full[lo:hi].copy_(x2)
        own = self.bounds(n0, hi - lo)
        self.slot_block(call.rank, n0, hi - lo).copy_(x2)
        for j in range(len(own)):
            call.signal_ready(self.flag(n0, j))
        mine = [self.flag(n0, j) for j in range(len(own))]
        for n in lay.remote_order():
            rlo, rhi = self.rows_of(n, l0)
            mine += [self.flag(n, j) for j in range(len(self.bounds(n, rhi - rlo)))]
        self.poison = Poison(cc, lay, call, mine)
        # Pulls by the copy engine: the node's own rows first (flagged already), then what peers forward.
        engine = comm.copy_engine()
        for q in lay.local_order()[:-1]:
            self._pull(engine, q, n0, self.pulls_own)
        for n in lay.remote_order():
            for q in lay.local_order()[:-1]:
                self._pull(engine, q, n, self.pulls_fwd)

    def _pull(self, engine, q: int, node: int, into: list) -> None:
        lo, hi = self.rows_of(node, q)
        src = self.slot_block(q, node, hi - lo)
        for j, (a, b) in enumerate(self.bounds(node, hi - lo)):
            fut = engine.submit(_pull, self.abort, self.cc, self.lay, self.call, q, self.flag(node, j), src[a:b],
                                self.full[lo + a : lo + b], f"{j} of node {self.lay.names[node]}'s rows")
            self.futures.append(fut)
            into.append((lo + a, lo + b, fut))

    # ---- consuming -------------------------------------------------------------------------------------
    def _arrivals(self, block: bool):
        """Network chunks in posting order, each flagged for the node (forwarded) as soon as it landed."""
        while self.net:
            n, j, src, (a, b), work = self.net[0]
            if not block and not work.is_completed():
                return
            self.net.pop(0)
            self.poison.wait(work, src, f"{j} of node {self.lay.names[n]}'s rows")
            rlo, rhi = self.rows_of(n, self.lay.local)
            self.slot_block(self.call.rank, n, rhi - rlo)[a:b].copy_(self.full[rlo + a : rlo + b])
            self.call.signal_ready(self.flag(n, j))  # forwarded: the node's ranks pull it now
            yield rlo + a, rlo + b, self.full[rlo + a : rlo + b]

    def chunks(self):
        with guard(self.cc, self.lay):  # an error names the remote rank a peer saw fail
            yield from self._chunks()

    def _chunks(self):
        lo, hi = self.parts[self.cc.rank]
        yield lo, hi, self.x2
        for lo, hi, fut in self.pulls_own:
            yield from self._arrivals(block=False)
            comm.result(fut, self.cc.timeout)
            yield lo, hi, self.full[lo:hi]
        yield from self._arrivals(block=True)
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


def _node_link(info: world.GroupInfo) -> str:
    """The link class between ranks of one node (this group's ranks on this rank's node)."""
    return "shm" if info.device.type != "cuda" else "nvlink"


def _pull(abort: list[bool], cc: CallContext, lay: Layout, call: symm.Call, q: int, index: int,
          src: torch.Tensor, dst: torch.Tensor, chunk: str) -> None:
    if abort[0]:
        return
    wait_local(cc, lay, call, q, index, chunk)
    dst.copy_(src)
