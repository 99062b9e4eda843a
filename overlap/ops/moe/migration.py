"""Expert migration (``Plan.migrate``): over a slow link, an expert's weights travel to the tokens' node
instead of the tokens to the expert (the HybridEP idea).

Which experts. ``Plan.migrate`` lists pairs ``(expert e, node m)`` (nodes of the group ordered by their
lowest rank, as in `overlap.ops.hierarchical.node_call`). It is fixed per layer in the plan, not decided per call from
the routing, and is part of the call signature (`Plan.describe`), so every rank agrees on it. The ops it
applies to are the grouped-matmul forms (`dispatch_grouped_matmul`, `grouped_matmul_combine`, and
`overlap.nn.ExpertParallelMLP` through them), on groups that span nodes; plain `dispatch`/`combine` raise
ValueError on a migration plan (there the caller computes the experts and has no copy of them).

How (`Migration`). The pairs of node ``m`` make its **copies** ``C_m`` (sorted expert ids). Every rank then
hosts ``L' = L + max_m |C_m|`` experts: its own ``L``, then copies of ``C_m`` for its node ``m``, then empty
slots up to ``L'`` (zero weights; no row is routed there). A token's pair with expert ``e`` is routed to

* the hosted slot of ``e`` on its own rank where ``e`` is in ``C_m`` (it does not leave the rank), else
* the owner's slot, as without migration;

so the dispatch and the combine run unchanged over the hosted experts (``E' = W * L'`` ids) with whatever
token strategy the plan names (``reference``, ``pipelined``, ``hierarchical``) for the rest. ``h`` and the
handle's layout (``tokens_per_expert``, ``expert_offsets``, ...) are therefore over the ``L'`` hosted
experts: ``handle.migration.hosted_experts()`` names them (global ids; -1 for an empty slot).

The weights' way (`Migration.fetch`): the owner ``o = (n, l)`` of ``e`` sends ``w[e]`` once over the network
to the **receiver** of ``e`` on node ``m``, its rank of local index ``l mod |m|``, which sends it on to the
node's other ranks (within the node). `dispatch_grouped_matmul` fetches ``w1``'s copies,
`grouped_matmul_combine` ``w2``'s, each inside its transfer's call, after the handshake (ranks that disagree
raise `OverlapMismatchError` before any weight moves) and before the rows move. The copies stay with the
layout until the backward (they are inputs of its GEMMs).

The gradients' way back (`Migration.give_back`): each rank of node ``m`` computes its part of the copy's
weight gradient over its own rows; the node's ranks send it to the receiver, which sums them in the node's
rank order (fp32 for 16-bit weights, rounded once) and sends one gradient over the network to the owner,
which adds the nodes' gradients to its own in node order (fp32 for 16-bit, rounded once). Every sum has a
fixed order: the same inputs and plan give bitwise the same gradients.

Not implemented: ``max_tokens_per_rank`` with migration (ValueError), single-node groups (nothing to
migrate: ValueError), the weights' transfer overlapped with the token transfer (it runs first, whole).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ... import comm, world
from ...errors import OverlapError, OverlapTimeout
from ...plans import Plan
from ..context import CallContext
from ..hierarchical import node_call as hier
from ..hierarchical.nodes import Layout, layout_of, report_dead
from . import entry

#: what the grouped-matmul ops call the weights they fetch
WEIGHT_NAMES = ("w1", "w2")


@dataclasses.dataclass(eq=False)
class Migration:
    """The hosted experts of one dispatch (see the module docstring).

    pairs: the plan's ``(expert, node)`` pairs; lay: the group's nodes; num_experts, own: ``E``, ``L``;
    copies: ``C_m`` per node; fetched: the copies this rank fetched, by weight name (``"w1"``: ``[|C_m|, H,
    F]``), kept for the backward.
    """

    pairs: tuple[tuple[int, int], ...]
    lay: Layout
    num_experts: int
    own: int
    copies: tuple[tuple[int, ...], ...]
    fetched: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def hosted(self) -> int:
        """``L'``: experts every rank hosts (its own, its node's copies, empty slots)."""
        return self.own + max(len(c) for c in self.copies)

    @property
    def mine(self) -> tuple[int, ...]:
        """``C_m`` of this rank's node."""
        return self.copies[self.lay.node]

    def hosted_experts(self) -> list[int]:
        """Global ids of this rank's hosted slots, in order (-1: an empty slot)."""
        rank = self.lay.rank(self.lay.node, self.lay.local)
        first = rank * self.own
        return list(range(first, first + self.own)) + list(self.mine) + [-1] * (self.hosted - self.own - len(self.mine))

    def owner(self, e: int) -> int:
        return e // self.own

    def receiver(self, e: int, m: int) -> int:
        """The rank of node `m` that receives expert `e`'s weights over the network (and sums its gradients)."""
        ranks = self.lay.nodes[m]
        owner_local = self.lay.nodes[self._node_of(self.owner(e))].index(self.owner(e))
        return ranks[owner_local % len(ranks)]

    def _node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.lay.nodes) if rank in ranks)

    # -- routing ------------------------------------------------------------------------------------

    def remap(self, op: str, topk_idx: torch.Tensor) -> torch.Tensor:
        """`topk_idx` (global ids ``< E``) as hosted ids ``< W * L'``: a copy's pairs to this rank's slot of it.
        ValueError for an id out of range (one device-to-host read of the ids' range)."""
        E, L, Lh = self.num_experts, self.own, self.hosted
        if topk_idx.numel():
            bad = entry.bad_ids(E, *torch.stack([topk_idx.min(), topk_idx.max()]).tolist())
            if bad:
                raise ValueError(f"overlap.moe.{op}: {bad}")
        ids = torch.arange(E, dtype=torch.int64)
        table = ids // L * Lh + ids % L
        rank = self.lay.rank(self.lay.node, self.lay.local)
        for j, e in enumerate(self.mine):
            table[e] = rank * Lh + L + j
        return table.to(topk_idx.device)[topk_idx.to(torch.int64)]

    # -- weights out, gradients back ----------------------------------------------------------------

    def extend(self, w: torch.Tensor, name: str) -> torch.Tensor:
        """``[L', a, b]``: this rank's experts `w` ``[L, a, b]``, the fetched copies, zero slots."""
        copies = self.fetched[name]
        pad = self.hosted - self.own - copies.shape[0]
        parts = [w, copies] + ([w.new_zeros((pad,) + tuple(w.shape[1:]))] if pad else [])
        return torch.cat(parts)

    def fetch(self, w: torch.Tensor, name: str, cc: CallContext) -> torch.Tensor:
        """Fetch this node's copies of `w` (``[L, a, b]``, this rank's experts) and return `extend`\\ ed `w`.
        Every rank, inside the transfer's call after its handshake (which agreed on the plan): bounded waits."""
        out = w.new_empty((len(self.mine),) + tuple(w.shape[1:]))
        sub = cc.derive(op=f"{cc.op}.migrate_{name}")
        me = cc.rank
        sends, recvs = [], []
        for m, experts in enumerate(self.copies):  # the network: owner -> receiver
            for j, e in enumerate(experts):
                o, c = self.owner(e), self.receiver(e, m)
                if me == o:
                    sends.append((w[e % self.own].contiguous(), c))
                if me == c:
                    recvs.append((out[j], o))
        _exchange(sub, sends, recvs, "weights")
        sends, recvs = [], []
        for j, e in enumerate(self.mine):  # within the node: receiver -> the node's other ranks
            c = self.receiver(e, self.lay.node)
            if me == c:
                sends += [(out[j], r) for r in self.lay.nodes[self.lay.node] if r != c]
            else:
                recvs.append((out[j], c))
        _exchange(sub, sends, recvs, "weights in the node")
        self.fetched[name] = out
        return self.extend(w, name)

    def give_back(self, grad_hosted: torch.Tensor, name: str, cc: CallContext) -> torch.Tensor:
        """This rank's experts' weight gradient ``[L, a, b]`` from its hosted one ``[L', a, b]``: the copies'
        parts summed in each node, then on their owners (fixed orders). Every rank, after the backward's
        transfer (whose handshake agreed on the plan and on which gradients are wanted): bounded waits."""
        me, node, shape = cc.rank, self.lay.node, tuple(grad_hosted.shape[1:])
        acc = torch.float64 if grad_hosted.dtype == torch.float64 else torch.float32
        ranks = self.lay.nodes[node]
        sub = cc.derive(op=f"{cc.op}.migrate_{name}")
        parts = {}  # (j, rank) -> that rank's part of copy j, on the copy's receiver
        sends, recvs = [], []
        for j, e in enumerate(self.mine):  # within the node: every rank's part to the receiver
            c = self.receiver(e, node)
            mine = grad_hosted[self.own + j].contiguous()
            if me != c:
                sends.append((mine, c))
                continue
            for r in ranks:
                parts[j, r] = mine if r == me else grad_hosted.new_empty(shape)
                if r != me:
                    recvs.append((parts[j, r], r))
        _exchange(sub, sends, recvs, "weight gradients in the node")
        sends, recvs, from_nodes = [], [], {}
        for m, experts in enumerate(self.copies):  # the network: receiver's node sum -> owner
            for j, e in enumerate(experts):
                o, c = self.owner(e), self.receiver(e, m)
                if me == c:
                    total = parts[j, ranks[0]].to(acc)
                    for r in ranks[1:]:  # the node's rank order
                        total = total + parts[j, r].to(acc)
                    sends.append((total.to(grad_hosted.dtype), o))
                if me == o:
                    from_nodes[e, m] = grad_hosted.new_empty(shape)
                    recvs.append((from_nodes[e, m], c))
        _exchange(sub, sends, recvs, "weight gradients")
        grad = grad_hosted[: self.own].clone()
        for e in sorted({e for e, _ in from_nodes}):
            summed = grad[e % self.own].to(acc)
            for m in sorted(m for f, m in from_nodes if f == e):  # node order
                summed = summed + from_nodes[e, m].to(acc)
            grad[e % self.own] = summed.to(grad.dtype)
        return grad


def _exchange(cc: CallContext, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              what: str) -> None:
    """Post every send and receive at once (in list order: between two ranks both ends list their messages
    in the same order), then wait for each within the call's deadline, naming its peer."""
    info, ops, peers = cc.info, [], []
    for t, src in recvs:
        ops.append(dist.P2POp(dist.irecv, t, info.global_ranks[src], cc.pg))
        peers.append(src)
    for t, dst in sends:
        comm.count_sent(info, dst, t.numel() * t.element_size())
        ops.append(dist.P2POp(dist.isend, t, info.global_ranks[dst], cc.pg))
        peers.append(dst)
    if not ops:
        return
    with hier.guard(cc):  # an error names the dead rank a peer recorded
        works = dist.batch_isend_irecv(ops)
        for work, peer in zip(works, peers, strict=True):
            try:
                cc.wait(work, peer, what)
            except OverlapError as exc:
                if not isinstance(exc, OverlapTimeout) or info.gone(peer):  # its connection closed: it died
                    report_dead(cc.info, peer)
                raise


def prepare(op: str, chosen: Plan, info: world.GroupInfo, num_experts: int, bound: int | None) -> Migration | None:
    """The call's `Migration` (None where the plan migrates nothing). The plan's pairs were checked with the
    plan (`overlap.plans.auto.fit_plan`: the grouped-matmul ops only, a group spanning nodes, experts
    and nodes in range, never the expert's own node); ValueError here for a bound, before any data moves."""
    if not chosen.migrate:
        return None
    if bound is not None:
        raise ValueError(f"overlap.moe.{op}: plan.migrate with max_tokens_per_rank is not implemented in this "
                         "version; drop one of them")
    lay = layout_of(info)
    copies: list[list[int]] = [[] for _ in lay.nodes]
    for e, m in chosen.migrate:
        copies[m].append(e)
    return Migration(chosen.migrate, lay, num_experts, num_experts // info.world_size,
                     tuple(tuple(sorted(c)) for c in copies))


def check_follows(op: str, chosen: Plan, migration: Migration | None, grouped: bool) -> None:
    """A combine follows its dispatch's migration: ValueError for a plain combine of a migrating dispatch or
    a plan that migrates other pairs than the dispatch did."""
    if migration is None:
        if chosen.migrate:
            raise ValueError(f"overlap.moe.{op}: plan.migrate {chosen.migrate} but the handle's dispatch migrated "
                             "nothing: pass the dispatch's plan")
        return
    if not grouped:
        raise ValueError(f"overlap.moe.{op}: the handle's dispatch migrated experts (plan.migrate "
                         f"{migration.pairs}); only grouped_matmul_combine holds their copies")
    if chosen.migrate and chosen.migrate != migration.pairs:
        raise ValueError(f"overlap.moe.{op}: plan.migrate {chosen.migrate} differs from the dispatch's "
                         f"{migration.pairs}: pass the dispatch's plan")
