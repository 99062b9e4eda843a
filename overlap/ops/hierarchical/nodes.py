"""The nodes of a group that spans them (`Layout`): which ranks share a node, this rank's place ``(node, local)``,
its counterparts on the other nodes; the node's process group and symmetric heap; the store record of a rank that
died in a call (`report_dead`). Every module of the ``hierarchical`` strategy, the agreement across nodes
(`overlap.ops.hierarchical.agreement`) and expert migration read the group's nodes from here.

Topology: the group's nodes ordered by their lowest group rank; the ranks of a node in group rank order;
``(node, local)`` names a rank. Rank ``(n, l)``'s **counterparts** are the ranks ``(n', l)`` of the other nodes
(with nodes of one size; `Layout.counterparts` says what happens otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ... import symm, world


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

    def counterparts(self) -> list[int]:
        """This rank's counterparts (group ranks), the other nodes from the next one on: on node ``n'`` the ranks
        whose local index equals this rank's modulo the smaller of the two nodes' sizes (with nodes of one size,
        the rank of the same local index), so that every rank of a node has a counterpart on every other node."""
        out = []
        for n in self.remote_order():
            m = min(len(self.nodes[n]), self.ranks_per_node)
            out += [r for i, r in enumerate(self.nodes[n]) if i % m == self.local % m]
        return out


def layout_of(info: world.GroupInfo) -> Layout:
    first: dict[str, int] = {}
    for r, name in enumerate(info.nodes):
        first.setdefault(name, r)
    names = tuple(sorted(first, key=first.get))
    nodes = tuple(tuple(r for r in range(info.world_size) if info.nodes[r] == name) for name in names)
    node = names.index(info.nodes[info.rank])
    return Layout(nodes, names, node, nodes[node].index(info.rank))


_NODE_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def node_group(info: world.GroupInfo, lay: Layout, timeout: float) -> dist.ProcessGroup:
    """The process group of this rank's node (global ranks), made once per set of ranks by its members only
    (per default group: a process that re-initializes torch.distributed makes new ones)."""
    key = (id(dist.group.WORLD), tuple(sorted(info.global_ranks[r] for r in lay.nodes[lay.node])))
    pg = _NODE_GROUPS.get(key)
    if pg is None:
        pg = dist.new_group(list(key[1]), timeout=datetime.timedelta(seconds=timeout),
                            use_local_synchronization=True)
        _NODE_GROUPS[key] = pg
    return pg


def node_heap(info: world.GroupInfo, lay: Layout, timeout: float) -> symm.SymmHeap:
    return symm.heap_for(node_group(info, lay, timeout), timeout)


def dead_key(info: world.GroupInfo) -> str:
    """The store key where the group's ranks record a rank that died in a call (`report_dead`)."""
    return "overlap/hierarchical/dead/" + "-".join(map(str, info.global_ranks))


def report_dead(info: world.GroupInfo, dead: int) -> None:
    """Record `dead` in the store, where every rank of the group finds it (`overlap.ops.hierarchical.node_call.guard`).
    The first record stays: a later one may be a survivor whose connection closed as it left the failed call."""
    with contextlib.suppress(Exception):
        c10d._get_default_store().compare_set(dead_key(info), "", f"{dead}:{info.rank}")
