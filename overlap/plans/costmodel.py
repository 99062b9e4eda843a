"""The cost model: what a call costs on a topology, per plan.

`Profile` holds what the model knows of a machine (link fits per link class and transport, GEMM fits
per dtype, interference, per-chunk cost; measured by `overlap.tune.probe`, or `default_profile`), `Topology`
a group (both defined in `overlap.plans.machine`, re-exported here). Expert migration (``Plan.migrate``)
is `overlap.plans.migration`'s model.
`predict` scores one plan of one `Problem` on a `Topology`; `candidates` lists the plans worth trying
and `rank_candidates` sorts them by prediction. `overlap tune` measures the best few and writes plan
files (`overlap.plans.planfile`); `overlap.plans.auto.resolve_auto` uses a plan file's choice, else this
model's with the file's profile, else its default heuristic.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ..symm import MAX_FLAGS
from . import hierarchical_cost, migration, presets
from .machine import PROFILE_VERSION, GemmFit, LinkFit, Profile, Topology, topology_of
from .optable import FP8_DTYPES, FP8_LEAVES, ITEMSIZE, OPS, Problem, moe_row_bytes, op_spec, wire_sizes
from .plan import Plan

# ----------------------------------------------------------------------------------------------
# Cost model: what a call costs on a topology, per plan (`predict`), and the plans worth trying
# ----------------------------------------------------------------------------------------------

#: the ops the cost model knows: every op of the table (`optable.OPS`)
MODEL_OPS = tuple(OPS)
#: chunk counts per link class that `candidates` tries
CHUNK_CHOICES = (1, 2, 4, 8)

__all__ = ["CHUNK_CHOICES", "MODEL_OPS", "PROFILE_VERSION", "GemmFit", "LinkFit", "Prediction", "Profile", "Topology",
           "call_cost", "candidates", "default_profile", "hierarchical_fits", "pipeline_makespan", "predict",
           "rank_candidates", "topology_of"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one call: `total_s`, the transfers alone (`comm_s`), the GEMMs alone (`compute_s`)."""

    total_s: float
    comm_s: float
    compute_s: float
    detail: str = ""


def pipeline_makespan(stages: list[tuple[int, float, float]], fa: float, fb: float) -> float:
    """Two resources in a row: stage i's ``b`` (second resource) starts once its ``a`` and the previous ``b``
    are done. ``stages``: ``(count, a, b)``, count equal stages each.

    Without interference the makespan is the flow shop's ``max_i (sum_{j<=i} a_j + sum_{j>=i} b_j)`` (a
    fill, stages of max(a, b), a drain). Interference: on the path through stage i, the first resource's
    part overlaps at most the second's work queued before it and is slowed by `fa` over that overlap,
    and the reverse for the second's part (`fb`). Within ``count`` equal stages the path is concave in
    the position, so its maximum is at an end or where one of the two ``min`` switches sides.
    """
    total_a = sum(c * a for c, a, _ in stages)
    total_b = sum(c * b for c, _, b in stages)

    def path(a_le: float, b_lt: float) -> float:
        b_ge, a_gt = total_b - b_lt, total_a - a_le
        return a_le + (fa - 1) * min(a_le, b_lt) + b_ge + (fb - 1) * min(b_ge, a_gt)

    best, a0, b0 = 0.0, 0.0, 0.0
    for c, a, b in stages:
        if c < 1:
            continue
        at = {0, c - 1}
        if a != b:
            for x in ((b0 - a0 - a) / (a - b), (total_a - a0 - a - total_b + b0) / (a - b)):
                at.update(min(c - 1, max(0, math.floor(x) + d)) for d in (0, 1) if math.isfinite(x))
        best = max(best, *(path(a0 + (j + 1) * a, b0 + j * b) for j in at))
        a0, b0 = a0 + c * a, b0 + c * b
    return best


class Schedule:
    """Costs of one (problem, plan, topology, profile) and the schedule they add up to: what an op's cost function
    (`OpSpec.cost`, in `tp_ops`, `moe_op`) and the ``hierarchical`` pipelines (`hierarchical_cost`) add their
    stages to, and `predict` reads (``total``, ``comm``, ``compute``)."""

    def __init__(self, problem: Problem, plan: Plan, topo: Topology, profile: Profile,
                 migrated: tuple[float, float] = (1.0, 0.0)):
        self.W, self.peers, self.plan, self.profile = topo.world_size, topo.links, plan, profile
        # bytes per element of the gathered operands, of the reduced partials, of the backward (`wire_sizes`)
        self.slowest = topo.slowest_link
        self.size, self.part_size, self.grad_size = wire_sizes(problem)
        self.fused, self.fp8 = plan.strategy == "fused", problem.dtype in FP8_DTYPES
        self.transport = "p2p" if plan.strategy in ("reference", "pipelined") else "copy"
        # fp8 GEMMs: the profile's fit of the dtype where it has one (a preset's: `presets.profile_of`, MX at the FP8
        # or the FP32 rate); else a GPU's scaled GEMM runs at least at its bf16 rate, a CPU's dequantizes to fp32
        # (`overlap.ops.fp8.scaled_mm`)
        fallback = (FP8_LEAVES if topo.device != "cpu" else "float32") if self.fp8 else "float32"
        self.gfit = profile.gemm.get(problem.dtype) or profile.gemm.get(fallback) or profile.gemm.get("float32")
        if self.gfit is None:
            raise ValueError(f"machine profile has no GEMM fit for {problem.dtype} (nor float32): probe again")
        self.launch = self.gfit.overhead_s if self.fused else 0.0  # a fused kernel's one launch
        # what a GEMM reads and writes per element (its memory roofline): an fp8 GEMM writes its leaves' dtype
        self.itemsize = ITEMSIZE[problem.dtype]
        self.out_itemsize = ITEMSIZE[FP8_LEAVES] if self.fp8 else self.itemsize
        self.cs, self.gs = max(1.0, profile.comm_slowdown), max(1.0, profile.gemm_slowdown_for(self.transport))
        self.total = self.comm = self.compute = 0.0
        # hierarchical (`hierarchical_cost`): nodes, ranks per node, the class of the links within a node
        self.hier = plan.strategy == "hierarchical"
        self.nodes, self.local_ranks = topo.num_nodes, topo.ranks_per_node[0]
        self.local_link = next((c for c, _ in topo.links if c != "network"),
                               "shm" if topo.device == "cpu" else "nvlink")
        # expert migration (`migration.network_effect`): the share of MoE token rows still crossing the network,
        # the weights' time on it
        self.token_share, self.weights_s = migrated

    def backward(self) -> None:
        """What follows is the call's backward: its transfers move `grad_size` bytes per element; an fp8 call's
        backward GEMMs run in its leaves' dtype (`optable.FP8_LEAVES`)."""
        self.size = self.part_size = self.grad_size
        self.in_leaves()

    def in_leaves(self) -> None:
        """The GEMMs that follow run in the leaves' dtype (`optable.FP8_LEAVES`) where the call is fp8: its backward,
        and an MoE layer's after the first grouped GEMM (only the dispatched tokens are fp8)."""
        if self.fp8:
            self.gfit = self.profile.gemm.get(FP8_LEAVES) or self.gfit
            self.itemsize = self.out_itemsize = ITEMSIZE[FP8_LEAVES]

    # ---- costs ---------------------------------------------------------------------------------
    def msgs(self, link: str, nbytes: float, count: float = 1) -> float:
        """`nbytes` in `count` messages (chunks) over `link`: latency and per-chunk cost each."""
        fits = self.profile.links.get(link, {})
        fit = fits.get(self.transport) or fits.get("p2p")
        if fit is None:
            raise ValueError(f"machine profile has no fit for link class {link!r}: probe on this topology")
        return count * (fit.latency_s + self.profile.per_chunk_s) + nbytes / fit.bandwidth_Bps

    def ring(self, steps: int, nbytes: float) -> float:
        """A ring's steps: each crosses the slowest link of the ring (the slowest fit, whatever its class)."""
        return steps * max((self.msgs(link, nbytes) for link, _ in self.peers), default=0.0)

    def each_peer(self, nbytes: float) -> float:
        return sum(count * self.msgs(link, nbytes) for link, count in self.peers)

    def tokens(self, link: str, nbytes: float) -> float:
        """MoE token bytes over `link`: over the network only the share that expert migration leaves."""
        return nbytes * self.token_share if link == "network" else nbytes

    def gemm(self, flops: float, calls: float = 1, nbytes: float = 0.0) -> float:
        """GEMM calls (one launch each) of `flops` reading and writing `nbytes` (the memory roofline, where the
        profile has one: `GemmFit.work`); inside a fused kernel no launch (the kernel adds `launch`)."""
        return (0 if self.fused else calls * self.gfit.overhead_s) + self.gfit.work(flops, nbytes)

    def mm(self, rows: float, k: int, n: int, calls: float = 1, weights: float = 1, of_rows: float = 0) -> float:
        """``[rows, k] @ [k, n]`` in `calls` calls reading `weights` ``[k, n]`` matrices (an MoE block: one per
        expert): every call reads its operands and writes its output once (a chunked GEMM reads its weight again
        per chunk: what makes chunks of a few rows memory-bound). Inside a fused kernel the piece is some tiles of
        one GEMM of `of_rows` rows, which reads its weight once: the piece's share of it."""
        share = rows / of_rows if self.fused and of_rows > rows else 1.0
        nbytes = (rows * k + weights * k * n * share) * self.itemsize + rows * n * self.out_itemsize
        return self.gemm(2 * rows * k * n, calls, nbytes)

    # ---- schedule ------------------------------------------------------------------------------
    def serial(self, comm: float = 0.0, gemm: float = 0.0) -> None:
        self.total, self.comm, self.compute = self.total + comm + gemm, self.comm + comm, self.compute + gemm

    def consume(self, stages: list[tuple[int, float, float]]) -> None:
        """``(count, transfer, gemm)``: each stage's GEMM needs its transfer (a gather, a dispatch)."""
        self.total += pipeline_makespan(stages, self.cs, self.gs)
        self.comm += sum(c * t for c, t, _ in stages)
        self.compute += sum(c * g for c, _, g in stages)

    def produce(self, stages: list[tuple[int, float, float]]) -> None:
        """``(count, gemm, transfer)``: each stage's transfer sends its GEMM's output (a scatter, a combine)."""
        self.total += pipeline_makespan(stages, self.gs, self.cs)
        self.comm += sum(c * t for c, _, t in stages)
        self.compute += sum(c * g for c, g, _ in stages)

    def weight_gradient(self, m: int, k: int, n: int) -> float:
        """A weight gradient: one GEMM over every row (``2*W*m*k*n`` flops)."""
        return self.mm(self.W * m, k, n) + self.launch

    def gather_again(self, m: int, k: int) -> float:
        """A backward's re-gather of ``[m, k]`` per rank, posted first: a ring (reference) or pairwise pulls
        chunked per peer link."""
        nbytes = m * k * self.size
        if self.hier:
            return hierarchical_cost.gather_again(self, m, k)
        if self.plan.strategy == "reference":
            return self.ring(self.W - 1, nbytes)
        return sum(c * self.msgs(link, nbytes, min(self.plan.chunks_for(link), m)) for link, c in self.peers)

    # ---- the pipelines an op's cost (`optable.OpSpec.cost`) is made of -----------------------------
    def ag_mm(self, m: int, k: int, n: int) -> None:
        """``all_gather(a) @ b``: pairwise pulls per peer link, chunked for it; our own block first."""
        if self.hier:
            return hierarchical_cost.ag_mm(self, m, k, n)
        if self.plan.strategy == "reference":
            return self.serial(self.ring(self.W - 1, m * k * self.size), self.mm(self.W * m, k, n))
        stages = [(1, 0.0, self.mm(m, k, n, of_rows=self.W * m) + self.launch)]
        for link, count in self.peers:
            ch = 1 if self.fused else min(self.plan.chunks_for(link), m)  # fused: one flag per rank
            piece = self.mm(m / ch, k, n, of_rows=self.W * m)
            stages.append((count * ch, self.msgs(link, m * k * self.size / ch), piece))
        self.consume(stages)

    def mm_rs(self, m: int, k: int, n: int, lead: float = 0.0, max_chunks: int = 0) -> None:
        """``reduce_scatter(a @ b)``; `lead`: link work posted first (the backward's re-gather)."""
        W, part = self.W, m * n * self.part_size
        if self.hier:
            return hierarchical_cost.mm_rs(self, m, k, n, lead)
        if self.plan.strategy == "reference":
            return self.serial(lead + self.ring(W - 1, part), self.mm(W * m, k, n))
        stages = [(1, 0.0, lead)] if lead else []
        if self.plan.strategy == "pipelined":  # one GEMM per destination, its partial sent in chunks
            stages += [(c, self.mm(m, k, n), self.msgs(link, part, min(self.plan.chunks_for(link), m)))
                       for link, c in self.peers]
            return self.produce([*stages, (1, self.mm(m, k, n), 0.0)])
        ch = min(self.plan.chunks_for(self.slowest), m, max_chunks or MAX_FLAGS // W)  # flagged per chunk
        piece = self.mm(m / ch, k, n, of_rows=W * m)
        stages += [(c * ch, piece, self.msgs(link, part / ch)) for link, c in self.peers]
        self.produce([(1, 2 * self.launch, 0.0), *stages, (ch, piece, 0.0)])  # GEMM + reduction kernels

    def mm_ar(self, m: int, k: int, n: int) -> None:
        """``all_reduce(a @ b)`` over ``M = W*m`` rows: ring (two-shot) or every partial to every rank."""
        W, M, plan, size = self.W, self.W * m, self.plan, self.part_size
        if self.hier:
            return hierarchical_cost.mm_ar(self, m, k, n)
        if plan.strategy == "reference":
            return self.serial(self.ring(2 * (W - 1), m * n * size), self.mm(M, k, n))
        ch = plan.chunks_for(self.slowest)
        if plan.strategy == "pipelined":  # W*ch pieces, each piece's collective behind the next GEMM
            p = min(W * ch, M)
            coll = self.ring(W - 1, M / p * n * size) if plan.one_shot else self.ring(2 * (W - 1), m / p * n * size)
            return self.produce([(p, self.mm(M / p, k, n), coll)])
        if plan.one_shot:
            ch = min(ch, M, MAX_FLAGS)
            return self.produce([(1, 2 * self.launch, 0.0),
                                 (ch, self.mm(M / ch, k, n, of_rows=M), self.each_peer(M / ch * n * size))])
        ch = min(ch, m, MAX_FLAGS // (W + 1))
        self.mm_rs(m, k, n, max_chunks=ch)  # then every rank pulls every reduced part (exposed)
        pulls = 1 if self.fused else ch
        self.serial(sum(c * self.msgs(link, m * n * size, pulls) for link, c in self.peers))

    def mm_a2a(self, m: int, k: int, n: int) -> None:
        """``all_to_all(a @ b)`` by destination (sequence parallelism's QKV side): ``[m, k] @ [k, n/W]`` per
        destination, each ``m x n/W`` block sent, chunked for its link, while the next one is computed."""
        W, block = self.W, m * n / self.W * self.size
        if self.plan.strategy == "reference":
            return self.serial(self.each_peer(block), self.mm(m, k, n))
        piece = self.mm(m, k, n / W)
        self.produce([*((c, piece, self.msgs(link, block, min(self.plan.chunks_for(link), m)))
                        for link, c in self.peers), (1, piece, 0.0)])

    def a2a_mm(self, m: int, k: int, n: int) -> None:
        """``all_to_all(a) @ b`` (the output side): each source's ``m x k/W`` block, chunked for its link, multiplied
        by its rows of ``b`` as it lands; our own block first."""
        W, block = self.W, m * k / self.W * self.size
        if self.plan.strategy == "reference":
            return self.serial(self.each_peer(block), self.mm(m, k, n))
        stages = [(1, 0.0, self.mm(m, k / W, n))]
        for link, c in self.peers:
            ch = min(self.plan.chunks_for(link), m)
            stages.append((c * ch, self.msgs(link, block / ch), self.mm(m / ch, k / W, n)))
        self.consume(stages)

    def moe(self, p: Problem) -> None:
        """Dispatch + grouped GEMM, combine; uniform routing: ``T*K/W`` rows to and from every peer, each of
        `optable.moe_row_bytes` (an fp8 call: the dispatch's rows packed fp8 and its GEMM at the fp8 rate, the rest
        in the leaves' dtype)."""
        if self.hier:
            return hierarchical_cost.moe(self, p)
        L = p.experts // self.W
        dispatched, returned = moe_row_bytes(p)
        self.serial(self.each_peer(4 * L))  # the counts
        if self.plan.strategy == "reference":
            first = self.moe_every(p)
            self.in_leaves()
            rows = p.m * p.top_k / self.W

            def moves(row_bytes: float) -> float:
                return sum(c * self.msgs(link, self.tokens(link, rows * row_bytes)) for link, c in self.peers)

            return self.serial(moves(dispatched) + (1 + 2 * p.backward) * moves(returned),
                               first + (1 + 4 * p.backward) * self.moe_every(p))
        self.moe_dispatch(p, dispatched)
        self.in_leaves()
        every = self.moe_every(p)
        self.moe_combine(p, returned)
        if p.backward:  # combine's backward (a dispatch), w2's weight gradient; then dispatch's backward
            self.moe_dispatch(p, returned)  # (a combine) with w1's weight gradient run while those rows travel
            self.serial(gemm=every)
            self.moe_combine(p, returned, tail=every)

    def moe_every(self, p: Problem) -> float:
        """Every row of this rank's experts through them: ``T*K`` rows (uniform routing), ``L`` GEMM calls."""
        L = p.experts // self.W
        return self.mm(p.m * p.top_k, p.k, p.n, calls=L, weights=L)

    def _moe_flow(self, p: Problem, row_bytes: float):
        """``(L, nbytes, block, groups, chunks)`` of one MoE transfer of rows of `row_bytes` between every two ranks:
        ``pipelined``'s (and ``hierarchical``'s rows kept one per pair), pairwise (`groups` None), or
        ``symm``/``fused``'s, flagged per expert group."""
        W, L, H, plan = self.W, p.experts // self.W, p.k, self.plan
        rows = p.m * p.top_k / W
        block = self.mm(rows, H, p.n, calls=L, weights=L, of_rows=W * rows)  # one source's rows through our L experts
        groups = max(1, min(L, MAX_FLAGS // W - 1))
        pairwise = plan.strategy in ("pipelined", "hierarchical")

        def chunks(link: str) -> int:
            return min(plan.chunks_for(link), max(1, int(rows))) if pairwise else groups

        return L, rows * row_bytes, block, (None if pairwise else groups), chunks

    def moe_dispatch(self, p: Problem, row_bytes: float) -> None:
        """Towards the experts (rows of `row_bytes`): a peer's chunks multiplied as they arrive, no finer than a GEMM
        per expert block."""
        L, nbytes, block, groups, chunks = self._moe_flow(p, row_bytes)
        stages = [(1, 0.0, block + self.launch)]
        for link, c in self.peers:
            ch = chunks(link)
            s = min(ch, L) if groups is None else groups
            stages.append((c * s, self.msgs(link, self.tokens(link, nbytes) / s, ch / s), block / s))
        self.consume(stages)

    def moe_combine(self, p: Problem, row_bytes: float, tail: float = 0.0) -> None:
        """Back to the sources: a source's GEMMs, then its rows of `row_bytes` (pairwise: in chunks; else per expert
        group); `tail`: work after the last rows left (the dispatch's backward's weight gradient)."""
        _L, nbytes, block, groups, chunks = self._moe_flow(p, row_bytes)
        s = 1 if groups is None else groups
        peers = [(c * s, block / s, self.msgs(link, self.tokens(link, nbytes) / s, chunks(link) / s))
                 for link, c in self.peers]
        self.produce([(1, self.launch, 0.0), *peers, (s, block / s, 0.0), (1, tail, 0.0)])


def predict(problem: Problem, plan: Plan, topology: Topology, profile: Profile,
            loads: migration.Loads | None = None) -> Prediction:
    """Predicted seconds of one call of `problem` run with `plan` on `topology`, from `profile`.

    A transfer of ``b`` bytes in ``c`` chunks over a link costs ``c * (latency + per_chunk_s) + b / bandwidth``
    (``p2p`` fits for reference and pipelined, ``copy`` fits for symm and fused, else ``p2p``); a GEMM of
    ``f`` flops in ``c`` calls ``c * overhead + f / peak`` (a fused kernel pays one overhead). Every call adds its
    strategy's fixed per-call cost (`Profile.call_s`, measured by the probe; `call_cost`), serial: on small calls
    it decides between a plain collective (``reference``) and an overlapped plan.

    * ``reference``: the collective, then the GEMMs (or the reverse), in sequence: total = comm + compute.
      Its collectives are rings, ``W - 1`` steps (all-reduce ``2 * (W - 1)``) over the slowest link;
      all-to-all is pairwise.
    * overlapped strategies: a pipeline of stages, each a transfer and the GEMM that consumes (gather,
      dispatch) or produces (scatter, combine) it: fill (the first transfer before its GEMM, unless a
      local GEMM hides it), stages of max(transfer, GEMM) with interference (`pipeline_makespan`: a GEMM beside a
      transfer is ``gemm_slowdown`` x slower, a transfer ``comm_slowdown`` x), drain (the last GEMM's
      transfer). Pairwise transfers are chunked per peer link, rings and flagged reductions for the
      slowest link, as the ops do; backward follows the ops' docstrings (each backward GEMM behind the
      transfers its op overlaps it with). Not modelled: reductions and permutations (memory-bound),
      uneven MoE routing, contention beyond sharing this rank's link time, the little overlap inside
      reference's backward (a plain collective in flight during a GEMM): reference is modelled serial.
    * expert migration (``plan.migrate``, MoE across nodes; `migration.network_effect` under `loads`,
      `migration.expected_loads`, default balanced): the network's token bytes scaled by the share of remote
      rows still dispatched, plus the busiest rank's network time for the migrated weights (and their
      gradients), serial; the GEMMs that move to the tokens' node are not modelled (their total is the same).

    `symm`/`fused` across nodes, `fused` on CPU ranks (interpreted) and a strategy the op does not implement
    (`OpSpec.strategies`) predict ``inf``. Raises ValueError
    where `profile` lacks a link class of `topology` or the dtype's GEMM fit (and float32's), where
    ``one_shot`` is set for an op without that variant (`OpSpec.variants`), the experts do not divide by
    the ranks, or ``migrate`` does not apply (`migration.check_migrate`: a TP op, one node, a bad pair). Each
    op's schedule is its table entry's `OpSpec.cost` (`optable`).
    """
    W, spec = topology.world_size, op_spec(problem.op)
    if plan.one_shot and "one_shot" not in spec.variants:
        takers = [name for name, s in OPS.items() if "one_shot" in s.variants]
        raise ValueError(f"predict: plan.one_shot applies only to {', '.join(takers)}, got {problem.op}")
    if spec.family == "moe" and problem.experts % W:
        raise ValueError(f"predict: {problem.experts} experts do not divide over {W} ranks")
    nodes = migration.nodes_of(topology)
    migration.check_migrate(problem.op, plan.migrate, nodes, problem.experts if spec.family == "moe" else None)
    if plan.strategy not in spec.strategies:
        return Prediction(math.inf, math.inf, math.inf, f"{plan.describe()}: not implemented for {problem.op}")
    if plan.strategy in ("symm", "fused") and topology.num_nodes > 1:
        return Prediction(math.inf, math.inf, math.inf, f"{plan.describe()}: needs the ranks of one node")
    if plan.strategy == "hierarchical" and topology.num_nodes == 1:  # runs symm
        plan = dataclasses.replace(plan, strategy="symm")
    elif plan.strategy == "hierarchical" and not hierarchical_fits(topology):
        return Prediction(math.inf, math.inf, math.inf, f"{plan.describe()}: CPU ranks, as many on every node")
    if plan.strategy == "fused" and topology.device == "cpu":
        return Prediction(math.inf, math.inf, math.inf, f"{plan.describe()}: interpreted on CPU ranks")
    migrated = migration.network_effect(problem, profile, nodes, plan.migrate, loads) if plan.migrate else (1.0, 0.0)
    x = Schedule(problem, plan, topology, profile, migrated)
    spec.cost(x, problem)
    x.serial(x.weights_s)
    calls = call_cost(problem, plan.strategy, profile)
    x.total += calls
    return Prediction(x.total, x.comm, x.compute, f"{plan.describe()}: comm {x.comm * 1e3:.4g} ms, GEMMs "
                      f"{x.compute * 1e3:.4g} ms, calls {calls * 1e3:.4g} ms, total {x.total * 1e3:.4g} ms")


def call_cost(problem: Problem, strategy: str, profile: Profile) -> float:
    """Seconds of the fixed per-call cost of `problem` run by `strategy`: `Profile.call_s` per call, times the calls
    its forward (and backward) make (`OpSpec.calls`)."""
    forward, backward = op_spec(problem.op).calls
    return profile.call_s.get(strategy, 0.0) * (forward + (backward if problem.backward else 0))


def hierarchical_fits(topology: Topology) -> bool:
    """Whether ``hierarchical`` runs across the nodes of `topology`: CPU ranks, the same count on every node."""
    return topology.device == "cpu" and len(set(topology.ranks_per_node)) == 1


def candidates(problem: Problem, topology: Topology, device_type: str | None = None, profile: Profile | None = None,
               loads: migration.Loads | None = None) -> list[Plan]:
    """Every plan worth predicting for `problem` on `topology` (``device_type`` defaults to its device).

    ``reference`` always; ``pipelined``; ``symm`` on one node; ``fused`` on one node of GPUs; ``hierarchical``
    across nodes of CPU ranks with at least two ranks on each (with one it moves what ``pipelined`` moves). Each with
    `CHUNK_CHOICES` per link class it chunks for (beyond two classes: the slowest link's count times
    one count shared by the others, so the list stays under ~60), and for an op with the ``one_shot``
    variant (`OpSpec.variants`) both variants (two-shot, one-shot). One rank: ``reference`` alone. With a
    `profile`, an op that takes ``migrate`` (`migration.MIGRATE_OPS`) across nodes: each ``pipelined`` and
    ``hierarchical`` plan also with the pairs `migration.choose_migration` picks for `loads` (default
    balanced), where it picks any.
    """
    device, spec = (device_type or topology.device).split(":")[0], op_spec(problem.op)
    if topology.world_size == 1:
        return [Plan("reference")]
    strategies = ["pipelined"] + (["symm"] + (["fused"] if device != "cpu" else []) if topology.num_nodes == 1 else [])
    if topology.num_nodes > 1 and hierarchical_fits(topology) and topology.ranks_per_node[0] > 1 and device == "cpu":
        strategies.append("hierarchical")
    plans = [Plan("reference")]
    for strategy in (s for s in strategies if s in spec.strategies):
        links = spec.chunked(strategy, problem.backward, topology)
        if len(links) > 2:
            counts = [(o,) * (len(links) - 1) + (s,) for o in CHUNK_CHOICES for s in CHUNK_CHOICES]
        else:
            counts = list(itertools.product(CHUNK_CHOICES, repeat=len(links)))
        # (hierarchical's all-reduce across nodes is two-shot: one_shot does not apply)
        for one_shot in (False, True) if "one_shot" in spec.variants and strategy != "hierarchical" else (False,):
            plans += [Plan(strategy, tuple(zip(links, c)), one_shot=one_shot) for c in counts]
    if profile is not None and topology.num_nodes > 1 and problem.op in migration.MIGRATE_OPS:
        pairs = migration.choose_migration(problem, profile, topology, loads)
        if pairs:
            plans += [dataclasses.replace(p, migrate=pairs) for p in plans
                      if p.strategy in ("pipelined", "hierarchical")]
    return plans


def rank_candidates(problem: Problem, topology: Topology, profile: Profile,
                    loads: migration.Loads | None = None) -> list[tuple[Plan, Prediction]]:
    """`candidates` (with `profile`'s migration variants for `loads`) with their predictions, fastest first (ties
    by `Plan.describe`, so every rank agrees)."""
    scored = [(plan, predict(problem, plan, topology, profile, loads))
              for plan in candidates(problem, topology, profile=profile, loads=loads)]
    return sorted(scored, key=lambda pp: (pp[1].total_s, pp[0].describe()))


#: the default CPU profile's fixed cost of a call per strategy: the probe's on the 2-core VM, rounded (two runs:
#: reference 898-974 us, pipelined 1105-1440, symm 135-448)
CPU_CALL_S = {"reference": 900e-6, "pipelined": 1200e-6, "symm": 250e-6, "hierarchical": 1200e-6, "fused": 250e-6}
def default_profile(device: str, name: str = "") -> Profile:
    """Rough defaults, not measurements: the model works before any probe (``overlap tune`` measures).

    ``"cpu"``, a 2-core VM with gloo ranks of one torch thread: gloo point-to-point ~100 us + 0.3 GB/s (the
    benchmarks' all-to-alls see ~0.1-0.7 GB/s), shared-memory copies ~20 us + 3 GB/s, a 1 Gb/s network;
    fp32 GEMMs ~70 GFLOP/s (bf16 ~200 with AMX, fp16 ~30), 20 us a call; interference 1.3 both ways (two
    cores shared with gloo's and the copy engine's threads), 30 us a chunk (Python-level messages, flags); the
    fixed cost of a call as the probe measured it there (`CPU_CALL_S`: gloo's collectives cost far more per call
    than shared-memory flags).
    ``"cuda"``: the preset of the GPU `name` (``torch.cuda.get_device_name``: `overlap.plans.presets.for_device`),
    else the ``h100-sxm`` preset (vendor peaks times documented efficiencies, 8 GPUs on NVLink through NVSwitch,
    400 Gb/s per GPU, PCIe 5.0); their fixed per-call costs guessed (no GPU has run the probe here).
    Raises ValueError for another device.
    """
    kind = device.split(":")[0]
    if kind == "cpu":
        return Profile(
            links={"shm": {"p2p": LinkFit(100e-6, 0.3e9), "copy": LinkFit(20e-6, 3e9)},
                   "network": {"p2p": LinkFit(150e-6, 0.125e9)}},
            gemm={"float32": GemmFit(7e10, 20e-6), "bfloat16": GemmFit(2e11, 20e-6), "float16": GemmFit(3e10, 20e-6)},
            gemm_slowdown=1.3, comm_slowdown=1.3, per_chunk_s=30e-6, device="cpu", call_s=dict(CPU_CALL_S),
            machine="default: 2-core VM, gloo (rough constants, not measured here)")
    if kind == "cuda":
        profile = presets.profile_of(presets.for_device(name) or presets.PRESETS["h100-sxm"])
        return dataclasses.replace(profile, machine=f"default: {profile.machine}")
    raise ValueError(f"default_profile: device must be 'cpu' or 'cuda', got {device!r}")
