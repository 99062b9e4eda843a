"""The cost model's pipelines of the ``hierarchical`` strategy (`overlap.ops.tp.hierarchical_gather`) on groups that
span nodes: each datum over the network once per node, the node's ranks served by copies through its heap.

Each function takes the cost model's `overlap.plans.costmodel.Schedule` (``x``: its plan, profile, message and
GEMM costs, ``nodes``, ``local_ranks``, ``local_link``) and adds one pipeline to its schedule, as the model's
own ``ag_mm``, ``mm_rs``, ``mm_ar`` and ``gather_again`` do for the other strategies. Transfers within a node
cost the ``copy`` fit of the node's link, between nodes the ``p2p`` fit of ``network``; the transfers of one
rank share one resource (its network receives and its node copies are not modelled as running at once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .optable import moe_row_bytes

if TYPE_CHECKING:  # (the cost model imports this module)
    from .costmodel import Schedule
    from .optable import Problem


def _chunks(x: Schedule, link: str, rows: int) -> int:
    return max(1, min(x.plan.chunks_for(link), rows))


def ag_mm(x: Schedule, m: int, k: int, n: int) -> None:
    """``all_gather(a) @ b``: our block's GEMM; the node's blocks (copies); one block from each other node
    (network, chunked for it); the blocks the node's ranks received and forward (copies of network chunks)."""
    N, L, loc = x.nodes, x.local_ranks, x.local_link
    block = m * k * x.size
    c_loc, c_net = _chunks(x, loc, m), _chunks(x, "network", m)
    stages = [(1, 0.0, x.mm(m, k, n))]
    if L > 1:
        stages.append(((L - 1) * c_loc, x.msgs(loc, block / c_loc), x.mm(m / c_loc, k, n)))
    stages.append(((N - 1) * c_net, x.msgs("network", block / c_net), x.mm(m / c_net, k, n)))
    if L > 1:
        stages.append(((L - 1) * (N - 1) * c_net, x.msgs(loc, block / c_net), x.mm(m / c_net, k, n)))
    x.consume(stages)


def gather_again(x: Schedule, m: int, k: int) -> float:
    """A backward's re-gather of ``[m, k]`` per rank, posted first: link time (network, then node copies)."""
    N, L, loc = x.nodes, x.local_ranks, x.local_link
    block = m * k * x.size
    c_loc, c_net = _chunks(x, loc, m), _chunks(x, "network", m)
    return (N - 1) * x.msgs("network", block, c_net) + (L - 1) * (x.msgs(loc, block, c_loc)
                                                                 + (N - 1) * x.msgs(loc, block, c_net))


def mm_rs(x: Schedule, m: int, k: int, n: int, lead: float = 0.0, riding: float = 0.0) -> None:
    """``reduce_scatter(a @ b)``: per chunk of each other node's rows, the GEMMs of the node's ``L`` destinations,
    then the partials into their node owners (copies) and each owner's node sum over the network; our node's
    rows last (copies only). `lead`: link work posted first (the backward's re-gather); `riding`: link work that
    shares the network stages (an all-reduce's gather of the parts already summed), spread over them."""
    N, L, loc = x.nodes, x.local_ranks, x.local_link
    part = m * n * x.part_size
    c_loc, c_net = _chunks(x, loc, m), _chunks(x, "network", m)
    stages = [(1, 0.0, lead)] if lead else []
    stages.append(((N - 1) * c_net, x.mm(L * m / c_net, k, n),
                   x.msgs("network", part / c_net) + (L - 1) * x.msgs(loc, part / c_net)
                   + riding / ((N - 1) * c_net)))
    stages.append((c_loc, x.mm(L * m / c_loc, k, n), (L - 1) * x.msgs(loc, part / c_loc)))
    x.produce([*stages, (1, 0.0, 0.0)])


def mm_ar(x: Schedule, m: int, k: int, n: int) -> None:
    """``all_reduce(a @ b)`` over ``W*m`` rows: the reduce-scatter above on parts of ``m`` rows, each network
    chunk of this rank's reduced part gathered as soon as it is summed (`overlap.ops.tp.hierarchical_reduce`):
    the gather's chunks ride the reduce-scatter's network stages, and only the last one is exposed."""
    N, L, loc = x.nodes, x.local_ranks, x.local_link
    part = m * n * x.part_size
    c_net = _chunks(x, "network", m)
    chunk = (N - 1) * x.msgs("network", part / c_net) + (L - 1) * N * x.msgs(loc, part / c_net)
    mm_rs(x, m, k, n, riding=(c_net - 1) * chunk)
    x.serial(chunk)


def moe(x: Schedule, p: Problem) -> None:
    """The MoE layer across nodes (`overlap.ops.moe.hierarchical`), uniform routing of ``K`` distinct experts:
    once per layer the routes (every rank's counts to every rank); per transfer by token (the dispatch, the
    dispatch's backward, and the combine where ``topk_weights`` needs no gradient: node sums) to each other node
    the token rows that have an expert there (one row per token and node) with their int32 indices, then the
    node's copies (each rank's rows from the node's ranks that received them); those transfers and their GEMMs
    add up (serial: an upper bound, the dispatch multiplies its node's blocks while the network transfers
    travel). With a backward the combine keeps its rows (one per pair, for ``topk_weights``' gradient): it and
    its backward move as ``pipelined`` moves them. Expert migration scales the network's bytes (``x.tokens``:
    the share of token rows still dispatched). Rows of `optable.moe_row_bytes`: an fp8 dispatch moves packed fp8
    rows and multiplies them at the fp8 rate, the rest of the layer runs in the leaves' dtype."""
    W, N, L, loc = x.W, x.nodes, x.local_ranks, x.local_link
    E, K, T = p.experts, p.top_k, p.m
    per_node = E // N
    miss = 1.0  # the chance that none of a token's K distinct experts is on a given node
    for i in range(min(K, E)):
        miss *= max(0.0, (E - per_node - i) / (E - i))
    rows_node = T * (1.0 - miss)  # distinct tokens to one node
    pairs_node = T * K / N
    dispatched, returned = moe_row_bytes(p)

    def transfer(row_bytes: float) -> float:
        net = (N - 1) * x.msgs("network", x.tokens("network", rows_node * row_bytes + pairs_node * 4),
                               _chunks(x, "network", max(1, int(rows_node))))
        return net + ((W - 1) * x.msgs(loc, T * K / W * row_bytes) if L > 1 else 0.0)

    first = x.moe_every(p)
    x.in_leaves()
    every = x.moe_every(p)
    x.serial(x.each_peer(8 * (E + N)))  # the routes: every rank's counts (W x L) and distinct tokens per node
    if not p.backward:
        return x.serial(transfer(dispatched) + transfer(returned), first + every)
    x.serial(transfer(dispatched), first)  # the dispatch
    x.moe_combine(p, returned)  # rows kept per pair, flat; then its backward (a dispatch, flat) and w2's weight
    x.moe_dispatch(p, returned)  # gradient
    x.serial(transfer(returned), 3 * every)  # the dispatch's backward (node sums): its GEMMs and w1's weight gradient
