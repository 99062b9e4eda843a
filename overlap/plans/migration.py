"""Expert migration (HybridEP, ``Plan.migrate``): which ``(expert, node)`` pairs move the expert's weights to
the tokens' node instead of the tokens to the expert, and the checks of a plan that migrates.

Layout as the runtime's (`overlap.ops.moe.migration`; nodes as `overlap.ops.hierarchical.nodes.layout_of` orders them):
``W`` ranks, ``E`` experts, ``L = E / W`` per rank, expert ``e`` on rank ``e // L``; `Nodes` lists the group
ranks of each node, nodes in the order of their lowest rank, so node ``m`` of a pair is an index into it.

For a migrated pair ``(e, m)`` the tokens of node ``m``'s ranks routed to ``e`` stay on their ranks, which
multiply them with a copy of ``w1[e]`` and ``w2[e]``; per call ``w1[e]`` and ``w2[e]`` cross the network once
(owner -> one rank of node ``m``, fanned out within the node) and, in a backward, their gradients once back
(summed within node ``m`` first). A token-dispatched pair moves its rows: ``x`` to the expert and ``y`` back, in
a backward ``grad_y`` to the expert and ``grad_x`` back. `pair_bytes` counts both.

Loads (`expected_loads`, `measured_loads`): ``loads[e][m]``, the rows per call (floats, expected values) that
node ``m``'s ranks route to expert ``e``. `choose_migration` is the model; its docstring gives the formula.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..world import GroupInfo
from .machine import Profile, Topology
from .optable import FP8_DTYPES, FP8_LEAVES, ITEMSIZE, Problem, moe_row_bytes

#: the group ranks of each node, nodes in the order of their lowest rank
Nodes = tuple[tuple[int, ...], ...]
#: ``loads[e][m]``: expected rows per call from node ``m``'s ranks to expert ``e``
Loads = tuple[tuple[float, ...], ...]

#: a group as `nodes_of` reads it
Where = Topology | GroupInfo | Sequence[Sequence[int]]

#: the ops that take ``Plan.migrate`` (the grouped-matmul forms: the weights must be the op's)
MIGRATE_OPS = ("moe", "dispatch_grouped_matmul", "grouped_matmul_combine")
#: `choose_migration` migrates nothing unless the layer's modelled time drops by at least this share
MIN_GAIN = 0.05


def nodes_of(where: Where) -> Nodes:
    """The `Nodes` of a group: from its `GroupInfo` (as the runtime orders them), a `Topology` (its ranks taken
    as consecutive blocks of ``ranks_per_node``, in that order), or given (each node's ranks; every rank once,
    nodes in the order of their lowest rank). Raises ValueError on ranks missing, repeated or out of order."""
    if isinstance(where, GroupInfo):
        first: dict[str, int] = {}
        for r, name in enumerate(where.nodes):
            first.setdefault(name, r)
        return tuple(tuple(r for r in range(where.world_size) if where.nodes[r] == name)
                     for name in sorted(first, key=first.get))
    if isinstance(where, Topology):
        starts = [sum(where.ranks_per_node[:i]) for i in range(where.num_nodes)]
        return tuple(tuple(range(s, s + n)) for s, n in zip(starts, where.ranks_per_node, strict=True))
    nodes = tuple(tuple(sorted(int(r) for r in node)) for node in where)
    ranks = sorted(r for node in nodes for r in node)
    if not nodes or any(not node for node in nodes) or ranks != list(range(len(ranks))) \
            or [node[0] for node in nodes] != sorted(node[0] for node in nodes):
        raise ValueError(f"nodes: the ranks 0..W-1 of each node, every rank once, nodes in the order of their "
                         f"lowest rank; got {where!r}")
    return nodes


def _node_index(nodes: Nodes) -> dict[int, int]:
    return {r: n for n, node in enumerate(nodes) for r in node}


def owner_node(expert: int, num_experts: int, nodes: Nodes) -> int:
    """The node of the rank that holds `expert` (rank ``expert // (E / W)``)."""
    world = sum(len(node) for node in nodes)
    return _node_index(nodes)[expert // (num_experts // world)]


def check_migrate(op: str, pairs: Sequence[tuple[int, int]], nodes: Nodes, num_experts: int | None = None) -> None:
    """Raise ValueError where `pairs` (``Plan.migrate``) cannot apply to `op` on a group of `nodes`: an op without
    weights to move (`MIGRATE_OPS`), a group of one node, a node index out of range; with `num_experts`, an expert
    out of range or a pair whose node holds the expert (its tokens do not cross the network)."""
    if not pairs:
        return
    text = "+".join(f"{e}@{m}" for e, m in pairs)
    if op not in MIGRATE_OPS:
        raise ValueError(f"overlap.{op}: plan.migrate ({text}) applies only to the MoE grouped-matmul ops "
                         f"{MIGRATE_OPS}, whose expert weights can move")
    if len(nodes) < 2:
        raise ValueError(f"overlap.{op}: plan.migrate ({text}) needs a group spanning nodes; this group is one node")
    world = sum(len(node) for node in nodes)
    if num_experts is not None and (num_experts < 1 or num_experts % world):
        raise ValueError(f"overlap.{op}: {num_experts} experts do not divide over {world} ranks")
    for e, m in pairs:
        if m >= len(nodes):
            raise ValueError(f"overlap.{op}: plan.migrate pair {e}@{m}: node {m} >= the group's {len(nodes)} nodes")
        if num_experts is None:
            continue
        if e >= num_experts:
            raise ValueError(f"overlap.{op}: plan.migrate pair {e}@{m}: expert {e} >= the {num_experts} experts")
        if owner_node(e, num_experts, nodes) == m:
            raise ValueError(f"overlap.{op}: plan.migrate pair {e}@{m}: node {m} holds expert {e} (rank "
                             f"{e // (num_experts // world)}); migrate only to other nodes")


def expected_loads(problem: Problem, nodes: Where,
                   routing: Sequence[float] | Sequence[Sequence[float]] | None = None) -> Loads:
    """Expected rows per call per (expert, node), ``loads[e][m] = R_m * T * K * share[e][m]`` (``R_m`` ranks on
    node ``m``, ``T = problem.m`` tokens per rank, ``K = problem.top_k``).

    routing: None, balanced (``share = 1 / E``); or ``E`` per-expert shares of the routed pairs, the same on
    every node (a skewed router: a few hot experts with large shares); or ``E`` rows of per-node shares
    (``routing[e][m]``). Shares are normalized per node (they need not add up to 1). Raises ValueError on a
    negative share, a node with none, a length that does not match, or a share above ``1 / K`` (a token names
    an expert at most once, so an expert gets at most ``T`` of a rank's ``T * K`` pairs).
    """
    nodes = nodes_of(nodes)
    E, K, N = problem.experts, problem.top_k, len(nodes)
    if routing is None:
        shares = [[1.0 / E] * N for _ in range(E)]
    else:
        rows = [list(r) if isinstance(r, Sequence) else [r] * N for r in routing]
        if len(rows) != E or any(len(r) != N for r in rows):
            raise ValueError(f"expected_loads: routing must give {E} shares (or {E} rows of {N}), got {routing!r}")
        total = [sum(float(r[m]) for r in rows) for m in range(N)]
        if any(float(v) < 0 for r in rows for v in r) or min(total) <= 0:
            raise ValueError(f"expected_loads: shares must be >= 0 and some > 0 on every node, got {routing!r}")
        shares = [[float(r[m]) / total[m] for m in range(N)] for r in rows]
    if max(max(s) for s in shares) > 1.0 / K + 1e-9:
        raise ValueError(f"expected_loads: a share above 1/top_k = {1 / K:.4g} (an expert gets at most one of a "
                         "token's pairs)")
    return tuple(tuple(len(nodes[m]) * problem.m * K * shares[e][m] for m in range(N)) for e in range(E))


def measured_loads(topk_idx_per_rank: Sequence, nodes: Where, num_experts: int) -> Loads:
    """The exact loads of one routing: ``topk_idx_per_rank[r]`` holds rank ``r``'s ``[T_r, K]`` expert ids (a
    tensor or nested lists); ``loads[e][m]`` counts node ``m``'s pairs naming ``e``."""
    nodes = nodes_of(nodes)
    node = _node_index(nodes)
    loads = [[0.0] * len(nodes) for _ in range(num_experts)]
    for r, idx in enumerate(topk_idx_per_rank):
        flat = idx.reshape(-1).tolist() if hasattr(idx, "reshape") else [e for row in idx for e in row]
        for e in flat:
            loads[int(e)][node[r]] += 1.0
    return tuple(map(tuple, loads))


def _row_bytes(problem: Problem) -> tuple[float, float]:
    """``(to the expert, back)``: one routed row's bytes per call each way (`optable.moe_row_bytes`: ``x`` and in a
    backward ``grad_y`` to the expert, ``y`` and ``grad_x`` back)."""
    dispatched, returned = moe_row_bytes(problem)
    return dispatched + (returned if problem.backward else 0), returned * (2 if problem.backward else 1)


def _weight_size(problem: Problem) -> int:
    """Bytes per element of a migrated weight: the dtype's, an fp8 call's leaves' (its weights travel unquantized)."""
    return ITEMSIZE[FP8_LEAVES if problem.dtype in FP8_DTYPES else problem.dtype]


def pair_bytes(problem: Problem, rows: float) -> tuple[float, float]:
    """``(token bytes, weight bytes)`` that cross the network per call for one remote pair with `rows` rows:
    tokens ``2 * P * rows * H * s`` (rows to the expert and back, ``P = 2`` passes with a backward: ``grad_y`` to
    the expert and ``grad_x`` back), weights ``2 * P * H * F * s`` (``w1`` and ``w2``, their gradients back), ``s``
    the dtype's size. Per direction the same, so the bytes favour migration exactly when ``rows > F``. An fp8 call
    (`optable.moe_row_bytes`): its dispatched rows are packed fp8, all else (weights included) its leaves' bf16."""
    to_expert, back = _row_bytes(problem)
    return rows * (to_expert + back), 2 * (2 if problem.backward else 1) * problem.k * problem.n * _weight_size(problem)


@dataclasses.dataclass
class _Account:
    """One call: per node the network bytes out and in and the weight messages sent; per rank the expert rows
    it multiplies."""

    out: list[float]
    into: list[float]
    msgs: list[float]
    rows: list[float]


class _Balance:
    """The account of one call with a migrate set, updated pair by pair (`move`)."""

    def __init__(self, problem: Problem, profile: Profile, nodes: Nodes, loads: Loads):
        self.p, self.nodes, self.loads = problem, nodes, loads
        self.W, self.N = sum(len(node) for node in nodes), len(nodes)
        self.L = problem.experts // self.W
        self.node = _node_index(nodes)
        fit = profile.links.get("network", {}).get("p2p")
        gfit = profile.gemm.get(problem.dtype) or profile.gemm.get("float32")
        leaves = profile.gemm.get(FP8_LEAVES) if problem.dtype in FP8_DTYPES else None
        if fit is None or gfit is None:
            raise ValueError("choose_migration: the machine profile needs a network p2p fit and a GEMM fit for "
                             f"{problem.dtype} (or float32): probe on this topology")
        self.bw, self.msg_s = fit.bandwidth_Bps, fit.latency_s + profile.per_chunk_s
        self.passes = 2 if problem.backward else 1
        # a row's GEMMs: the first at the dtype's rate, the rest at the leaves' (an fp8 call's backward and w2)
        rest = (5 if problem.backward else 1) / (leaves or gfit).peak_flops
        self.row_s = 2 * problem.k * problem.n * (1 / gfit.peak_flops + rest)
        self.to_expert, self.back = _row_bytes(problem)  # per row, each way
        self.weight_bytes = 2 * problem.k * problem.n * _weight_size(problem)  # w1 and w2 (or their gradients)
        self.acct = _Account([0.0] * self.N, [0.0] * self.N, [0.0] * self.N, [0.0] * self.W)
        for e in range(problem.experts):
            for m in range(self.N):
                self._tokens(e, m, 1.0)
        self.gemm_floor = max(r * self.row_s for r in self.acct.rows)  # the busiest rank's GEMMs, all dispatched

    def _tokens(self, e: int, m: int, sign: float) -> None:
        """Pair ``(e, m)`` dispatched: node ``m`` sends its rows to the owner's node and receives them back; the
        owner multiplies them."""
        o, x, a = e // self.L, self.loads[e][m], self.acct
        a.rows[o] += sign * x
        n = self.node[o]
        if n != m:
            for (src, dst), nbytes in (((m, n), self.to_expert), ((n, m), self.back)):
                a.out[src] += sign * x * nbytes
                a.into[dst] += sign * x * nbytes

    def move(self, e: int, m: int, sign: float) -> None:
        """Migrate pair ``(e, m)`` (`sign` 1) or undo it (-1): its tokens stay, the weights travel to node ``m``
        (2 messages), their gradients back in a backward; node ``m``'s ranks multiply the rows, each its own."""
        o, x, a = e // self.L, self.loads[e][m], self.acct
        n = self.node[o]
        self._tokens(e, m, -sign)  # the owner neither receives nor multiplies them
        for q in self.nodes[m]:
            a.rows[q] += sign * x / len(self.nodes[m])
        for src, dst in ((n, m), (m, n))[: self.passes]:
            a.out[src] += sign * self.weight_bytes
            a.into[dst] += sign * self.weight_bytes
            a.msgs[src] += sign * 2

    def network_seconds(self, n: int) -> float:
        """Node `n`'s transfers over its ranks' links (full duplex: the busier direction) and its weight messages."""
        a = self.acct
        return max(a.out[n], a.into[n]) / (len(self.nodes[n]) * self.bw) + a.msgs[n] * self.msg_s

    def score(self) -> tuple[float, float]:
        """``(C, sum over nodes of max(network, its busiest rank's GEMMs))``: the layer's time, then a tie-break.
        ``C`` is the busiest node's network or rank's GEMM time, never below the busiest GEMMs of token dispatch
        (`gemm_floor`)."""
        net = [self.network_seconds(n) for n in range(self.N)]
        gemm = [max(self.acct.rows[r] for r in node) * self.row_s for node in self.nodes]
        return max(*net, *gemm, self.gemm_floor), sum(max(t, g) for t, g in zip(net, gemm, strict=True))


def _checked_loads(problem: Problem, nodes: Nodes, loads: Loads | None) -> Loads:
    """`loads`, or the balanced ones where None; ValueError unless ``E`` rows of one value >= 0 per node."""
    if loads is None:
        return expected_loads(problem, nodes)
    loads = tuple(tuple(float(x) for x in row) for row in loads)
    if len(loads) != problem.experts or any(len(row) != len(nodes) or min(row) < 0 for row in loads):
        raise ValueError(f"loads: {problem.experts} rows (experts) of {len(nodes)} values >= 0 (nodes), got "
                         f"{len(loads)} rows")
    return loads


def _pairs_worth_bytes(problem: Problem, nodes: Nodes, loads: Loads) -> list[tuple[int, int]]:
    """The remote pairs whose token bytes exceed their weight bytes (`pair_bytes`), most rows first."""
    pairs = []
    for e in range(problem.experts):
        home = owner_node(e, problem.experts, nodes)
        for m in range(len(nodes)):
            tokens, weights = pair_bytes(problem, loads[e][m])
            if m != home and tokens > weights:
                pairs.append((e, m))
    return sorted(pairs, key=lambda em: (-loads[em[0]][em[1]], em))


def choose_migration(problem: Problem, profile: Profile, topology_or_nodes: Where,
                     loads: Loads | None = None) -> tuple[tuple[int, int], ...]:
    """The ``(expert, node)`` pairs worth migrating for `problem` (op ``moe``) on a group of `topology_or_nodes`
    (`nodes_of`) with the network of `profile` (its ``network`` ``p2p`` fit: latency ``a``, bandwidth ``B``) and
    its GEMM rate (``peak`` of the dtype's fit), for `loads` (`expected_loads`; None: balanced). Sorted, as
    ``Plan.migrate`` keeps them; empty where nothing is worth it (always on one node).

    The model, per call (``P = 2`` passes with a backward, else 1; ``s`` the dtype's size; ``R_n`` ranks on node
    ``n``):

    * a dispatched remote pair ``(e, m)`` with ``x = loads[e][m]`` rows: node ``m`` sends ``P * x * H * s`` bytes
      to the owner's node ``n`` and receives as many back; the owner ``o = e // L`` multiplies the ``x`` rows.
    * a migrated pair: node ``n`` sends ``2 * H * F * s`` (``w1[e]``, ``w2[e]``: 2 messages) to node ``m``; with
      a backward node ``m`` sends as many back (its summed weight gradients); each of node ``m``'s ranks
      multiplies its own rows (``x / R_m``). Copies within a node are not network time.
    * per node ``net_n = max(out_n, in_n) / (R_n * B) + msgs_n * (a + per_chunk_s)``: full duplex, a node's
      transfers spread over its ranks' links (as ``hierarchical``'s counterparts do); per rank
      ``gemm_r = rows_r * (1 or 3) * 4 * H * F / peak``. Transfers overlap the GEMMs, so the layer takes
      ``C = max(max_n net_n, max_r gemm_r, G0)``, ``G0`` the busiest rank's GEMMs under token dispatch:
      the model credits migration only with network time. GEMMs moved to node ``m`` may lengthen the layer
      (an overloaded node), never shorten it below ``G0`` (a hot expert's copies do spread its GEMMs, but
      relieving compute is not what the plan field is chosen for: on a compute-bound layer nothing migrates).

    Candidates are the remote pairs whose bytes favour migration (`pair_bytes`: token bytes ``2 P x H s`` above
    weight bytes ``2 P H F s``, i.e. ``x > F``), hot pairs first. A greedy pass adds each candidate that lowers
    ``(C, sum_n max(net_n, max_{r on n} gemm_r))`` (the sum breaks ties where another node is the bottleneck),
    repeated until none is added; then a pair whose removal leaves ``C`` as it is goes. The same pruning also
    starts from every candidate at once (pairs can pay only together: each node's hot expert migrating to the
    other relieves both directions of the link, which no single move shows), and the better set is kept
    (fewer pairs on a tie). Unless ``C`` drops by
    `MIN_GAIN` of the token-dispatch ``C``, nothing migrates. So on a fast link, where the transfers hide behind the
    GEMMs, migration saves nothing and is not chosen (it would cost memory and a weight transfer); on a slow link
    the hot pairs migrate, cold ones (``x <= F``) never. Per direction a forward pair saves ``x H s`` of the
    owner node's sends and costs it ``2 H F s``, so without a backward one pair alone wants ``x > 2F``; two that
    mirror each other (each node's hot expert to the other node) save ``2 x H s`` of each node's sends: ``x > F``.

    Assumptions: the loads are expected values (routing fixed per layer, not per call); a node's rows spread
    evenly over its ranks; with ``hierarchical`` a token crosses once per destination node (its bytes are
    shared by its experts there), so a migrated pair saves at most its rows' bytes (an upper bound); interference,
    the fill and drain of the pipelines, the counts and indices, and the memory of the weight copies are not
    modelled. Raises ValueError where the profile lacks the network or GEMM fit or the experts do not divide.

    An fp8 problem (``fp8=`` of the dispatch): the rows to the expert are packed fp8 rows
    (`optable.moe_row_bytes`) instead of ``H * s`` forward, everything else moves in the leaves' bf16 (``s = 2``,
    the weights included); a row's first GEMM runs at the dtype's rate, its others at bf16's.
    """
    nodes = nodes_of(topology_or_nodes)
    W = sum(len(node) for node in nodes)
    if problem.experts % W:
        raise ValueError(f"choose_migration: {problem.experts} experts do not divide over {W} ranks")
    if len(nodes) < 2:
        return ()
    loads = _checked_loads(problem, nodes, loads)
    pairs = _pairs_worth_bytes(problem, nodes, loads)
    if not pairs:
        return ()
    bal = _Balance(problem, profile, nodes, loads)
    start = bal.score()
    picks = [_greedy(bal, pairs, start)]
    joint = _Balance(problem, profile, nodes, loads)  # every candidate at once (pairs that pay only together:
    for e, m in pairs:  # each node's hot expert migrating to the other relieves both directions), then pruned
        joint.move(e, m, 1.0)
    picks.append(_pruned(joint, dict.fromkeys(pairs), joint.score(), loads))
    chosen, best = min(picks, key=lambda pick: (pick[1], len(pick[0])))
    if start[0] - best[0] < MIN_GAIN * start[0]:
        return ()
    return tuple(sorted(chosen))


def _greedy(bal: _Balance, pairs: list[tuple[int, int]], start: tuple[float, float]):
    """Add each pair that lowers the score, until none does; then `_pruned`. Returns ``(pairs, score)``."""
    best, tol = start, 1e-12 * max(start[0], 1e-30)
    chosen: dict[tuple[int, int], None] = {}  # in the order added
    added = True
    while added:
        added = False
        for e, m in pairs:
            if (e, m) in chosen:
                continue
            bal.move(e, m, 1.0)
            now = bal.score()
            if now[0] < best[0] - tol or (now[0] <= best[0] + tol and now[1] < best[1] - tol):
                chosen[(e, m)] = None
                best, added = now, True
            else:
                bal.move(e, m, -1.0)
    return _pruned(bal, chosen, best, bal.loads)


def _pruned(bal: _Balance, chosen: dict, best: tuple[float, float], loads: Loads):
    """Drop each chosen pair (coldest first) whose removal does not lengthen the layer. ``(pairs, score)``."""
    tol = 1e-12 * max(best[0], 1e-30)
    for e, m in sorted(chosen, key=lambda em: (loads[em[0]][em[1]], em)):
        bal.move(e, m, -1.0)
        now = bal.score()
        if now[0] <= best[0] + tol:
            del chosen[(e, m)]
            best = now
        else:
            bal.move(e, m, 1.0)
    return tuple(chosen), best


def network_effect(problem: Problem, profile: Profile, nodes: Nodes, migrate: Sequence[tuple[int, int]],
                   loads: Loads | None = None) -> tuple[float, float]:
    """What `migrate` changes in a call's network transfers, for the cost model (`costmodel.predict`):
    ``(share, weights_s)``: the share of the remote token rows (under `loads`, default balanced) that still
    cross the network, and the busiest node's time on the network for the weights (and their gradients)."""
    loads = _checked_loads(problem, nodes, loads)
    remote = kept = 0.0
    moved = set(migrate)
    for e in range(problem.experts):
        home = owner_node(e, problem.experts, nodes)
        for m in range(len(nodes)):
            if m != home:
                remote += loads[e][m]
                kept += 0.0 if (e, m) in moved else loads[e][m]
    bal = _Balance(problem, profile, nodes, tuple(tuple(0.0 for _ in row) for row in loads))
    for e, m in migrate:
        bal.move(e, m, 1.0)
    weights_s = max(bal.network_seconds(n) for n in range(bal.N))
    return (kept / remote if remote else 1.0), weights_s
