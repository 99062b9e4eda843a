"""Groups that span nodes: the node layout and the plumbing that ``hierarchical`` shares between the TP ops
(`overlap.ops.tp.hierarchical`, `overlap.ops.tp.hierarchical_reduce`) and the MoE ops
(`overlap.ops.moe.hierarchical`, `overlap.ops.moe.migrate`).

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
handshake (`begin_node`, the same signature) and runs on a slot of the node heap. Every slot starts with a
64-byte header (int64: ``dead + 1``, a failed remote rank this rank saw, else 0); the op's areas follow.

Failures. Every wait has the call's deadline. A network wait that fails (the counterpart's process died:
its connection closed) or times out on a rank whose process is gone writes ``dead + 1`` in this rank's
header, raises every flag this rank owns in the call (so its node's peers stop waiting for it and read the
header) and records the dead rank in the process group's store (`report_dead`); an error raised in a
hierarchical call names the dead rank recorded there, whichever rank it reached first (`guard`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

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
    with contextlib.suppress(Exception):
        c10d._get_default_store().set(_store_key(cc), f"{dead}:{cc.rank}")


@contextlib.contextmanager
def guard(cc: CallContext, lay: Layout | None = None):
    """Around a hierarchical call: an `OverlapError` becomes one naming the dead rank a peer recorded."""
    lay = lay if lay is not None else layout_of(cc.info)
    try:
        yield
    except OverlapError as exc:
        try:
            store = c10d._get_default_store()
            text = store.get(_store_key(cc)).decode() if store.check([_store_key(cc)]) else ""
        except Exception:  # noqa: BLE001 - no store: keep the original error
            text = ""
        if not text or f"rank {text.split(':')[0]} on node" in str(exc):
            raise
        dead, seen_by = (int(v) for v in text.split(":"))
        raise OverlapError(_dead_text(cc, lay, dead, f"rank {seen_by} saw it fail") + f" Here: {exc}") from exc


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to 16: every area of a node slot starts 16-byte aligned."""
    return (nbytes + 15) // 16 * 16
