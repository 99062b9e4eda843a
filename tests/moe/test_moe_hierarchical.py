"""The MoE ops with ``hierarchical`` on groups that span nodes, emulated on one machine as in
tests/ops/test_hierarchical.py: each rank's node is its ``OVERLAP_NODE_ID`` (set before the group's first call),
2 nodes x 2 ranks, 2 x 1 and 3 x 1 on the pooled CPU ranks, loopback between them.

Every MoE op x ``hierarchical`` against the float64 dense oracle (`tests.support.moe_oracle.check_moe`: forward and
backward, uneven token counts, empty experts, top-k > 1 with several of a token's experts on one node, a token
naming one expert K times) and against ``reference`` on the same inputs, with the combine's node sums (routing
weights without a gradient) and without them; repeated calls bitwise equal; the payload bytes each call posts
to other nodes (`overlap.comm.network_bytes_sent`) asserted exactly against what the algorithm moves; on one
node it is ``symm``, bitwise; a rank killed on the other node is named by every survivor. No timings.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.support import nodes
from tests.support.gemms import gemm_calls
from tests.support.harness import RankError, run_isolated
from tests.support.moe_oracle import Case, check_moe, make_inputs
from tests.support.nodes import assert_dead_named

# (tokens per rank, cycled), hidden, ffn, experts per rank, top_k, routing
_SPECS = [
    ((5, 3, 0, 7), 16, 12, 2, 2, "random"),
    ((6, 2, 9), 12, 8, 4, 4, "skewed"),  # several of a token's experts on one node
    ((3, 5), 8, 16, 2, 2, "one"),  # a token names one expert twice
    ((4, 3), 8, 8, 4, 2, "empty"),  # experts with no rows
]


def cases_for(world_size: int) -> list[Case]:
    return [Case(t, h, f, e * world_size, k, routing) for t, h, f, e, k, routing in _SPECS]


def spanning_group(rank: int, ranks_per_node: int):
    return nodes.spanning_group(rank, ranks_per_node, "mnode")


def layer(strategy: str, group, x, idx, wt, w1, w2, g, E: int, weight_grad: bool = True):
    """The grouped form forward and backward: ``(h, y, grad x, grad w1, grad w2, grad topk_weights)``."""
    import overlap

    x, w1, w2 = (t.clone().requires_grad_(True) for t in (x, w1, w2))
    wt = wt.clone().requires_grad_(weight_grad)
    h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, group=group, strategy=strategy)
    y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h), w2, wt, handle, strategy=strategy)
    y.backward(g)
    return h.detach(), y.detach(), x.grad, w1.grad, w2.grad, wt.grad


def against_reference(rank: int, world_size: int, ranks_per_node: int, seed: int) -> list[str]:
    group = spanning_group(rank, ranks_per_node)
    try:
        import overlap

        done = check_moe(rank, world_size, "hierarchical", torch.float32, seed, cases_for(world_size), group=group)
        for i, case in enumerate(cases_for(world_size)):
            xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed + 100 + i, world_size, torch.float32)
            L = case.experts // world_size
            mine = (xs[rank], idxs[rank], weights[rank], w1[rank * L : (rank + 1) * L],
                    w2[rank * L : (rank + 1) * L], grads[rank], case.experts)
            for weight_grad in (True, False):  # False: the combine sums a token's rows within each node
                ctx = f"rank {rank}/{world_size} ({ranks_per_node} per node) {case} weight_grad={weight_grad}"
                ref = layer("reference", group, *mine, weight_grad=weight_grad)
                got = layer("hierarchical", group, *mine, weight_grad=weight_grad)
                again = layer("hierarchical", group, *mine, weight_grad=weight_grad)
                for name, a, b, c in zip(("h", "y", "grad x", "grad w1", "grad w2", "grad topk_weights"),
                                         got, ref, again, strict=True):
                    if b is None:
                        assert a is None and c is None, f"{ctx}: {name}"
                        continue
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5,
                                               msg=lambda m, where=ctx, n=name: f"{where}: {n}: {m}")
                    assert torch.equal(a, c), f"{ctx}: {name} not bitwise repeatable"
            done.append(f"reference {case}")
        overlap.release(group)
        return done
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (2, 1), (3, 1)])
def test_every_op_against_oracle_and_reference(pools, seed, world_size, ranks_per_node):
    done = pools(world_size).run(against_reference, ranks_per_node, seed, timeout=240)
    assert all(len(d) == 3 * len(_SPECS) for d in done), done


def bf16_and_bounded(rank: int, world_size: int, ranks_per_node: int, seed: int) -> list[str]:
    """bf16 against the oracle at its tolerances; with ``max_tokens_per_rank`` (padding rows zero, no gradient)
    and 3 network chunks."""
    group = spanning_group(rank, ranks_per_node)
    try:
        import overlap

        cases = cases_for(world_size)[:2]
        done = check_moe(rank, world_size, "hierarchical", torch.bfloat16, seed, cases, group=group)
        three = overlap.Plan("hierarchical", num_chunks={"network": 3})  # transfers in 3 pieces (default 2)
        done += check_moe(rank, world_size, three, torch.float32, seed + 10, cases, slack=2, group=group)
        overlap.release(group)
        return done
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_bf16_and_bounded(pools, seed):
    done = pools(4).run(bf16_and_bounded, 2, seed, timeout=240)
    assert all(len(d) == 8 for d in done), done


# ----------------------------------------------------------------------------------------------
# Exact bytes over the network
# ----------------------------------------------------------------------------------------------


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def to_node(idx: torch.Tensor, node: int, experts_per_node: int) -> tuple[int, int]:
    """``(distinct tokens, pairs)`` of one rank's routing with an expert on `node`."""
    on = (idx // experts_per_node) == node
    return int(on.any(1).sum()), int(on.sum())


def network_bytes(rank: int, world_size: int, ranks_per_node: int, seed: int):
    import overlap
    from overlap import comm

    group = spanning_group(rank, ranks_per_node)
    try:
        # 3 of a token's 4 experts on one node for every token (on another node for token 0, so every rank saves
        # bytes whatever the seed): the case where a token crossing once saves bytes
        E, K, H, T = 4 * world_size, 4, 8, 6 + rank
        N, Q = world_size // ranks_per_node, ranks_per_node
        per_node = E // N
        gen = torch.Generator().manual_seed(seed)
        idxs = []
        for r in range(world_size):
            t = T - rank + r
            first = torch.randint(0, E, (t, 1), generator=gen)
            first[0, 0] = ((node_of(r, Q) + 1) % N) * per_node  # token 0: 3 experts on another node, on every rank
            near = (first // per_node) * per_node + (first + torch.arange(1, 3)) % per_node
            idxs.append(torch.cat([first, near, torch.randint(0, E, (t, 1), generator=gen)], 1))
        x = torch.randn(T, H, generator=gen)
        wt = torch.rand(T, K, generator=gen)
        me, item = node_of(rank, Q), 4
        counterparts = [m * Q + rank % Q for m in range(N) if m != me]
        want_dispatch = want_combine_rows = want_combine_sums = want_pipelined = 0
        for c in counterparts:
            tokens, pairs = to_node(idxs[rank], node_of(c, Q), per_node)
            idx_bytes = 4 * pairs if tokens != pairs else 0
            want_dispatch += tokens * H * item + idx_bytes
            # combine: our idx and fp32 weights to the aggregator there; as aggregator, the counterpart's node
            # sums for our node (one per distinct token)
            c_tokens, _ = to_node(idxs[c], me, per_node)
            want_combine_sums += 8 * pairs + c_tokens * H * item
        L = E // world_size
        for d in range(world_size):
            if node_of(d, Q) != me:
                want_pipelined += int(((idxs[rank] // L) == d).sum()) * H * item
                # rows kept for the weights' gradient (one per pair) go flat: each remote source's rows back to it
                want_combine_rows += int(((idxs[d] // L) == rank).sum()) * H * item
        sent = {}
        with torch.no_grad():
            for strategy in ("hierarchical", "pipelined"):
                before = comm.network_bytes_sent()
                y, handle = overlap.moe.dispatch(x, idxs[rank], E, group=group, strategy=strategy)
                sent[strategy] = comm.network_bytes_sent() - before
            before = comm.network_bytes_sent()
            overlap.moe.combine(y, wt, handle, strategy="hierarchical")
            sent["sums"] = comm.network_bytes_sent() - before
        before = comm.network_bytes_sent()
        overlap.moe.combine(y, wt.clone().requires_grad_(True), handle, strategy="hierarchical")
        sent["rows"] = comm.network_bytes_sent() - before
        want = {"hierarchical": want_dispatch, "pipelined": want_pipelined, "sums": want_combine_sums,
                "rows": want_combine_rows}
        assert sent == want, f"rank {rank}: network bytes {sent} != {want}"
        overlap.release(group)
        return sent
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (2, 1)])
def test_network_bytes_are_exact(pools, seed, world_size, ranks_per_node):
    results = pools(world_size).run(network_bytes, ranks_per_node, seed)
    print(*results, sep="\n")
    assert all(r["hierarchical"] < r["pipelined"] for r in results), results


# ----------------------------------------------------------------------------------------------
# The routes cross once per layer
# ----------------------------------------------------------------------------------------------


def collectives_during(fn) -> list[str]:
    """Names of the torch.distributed collectives (counts and routes exchanges) called while `fn` runs."""
    import torch.distributed as dist

    names = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast")
    saved = {n: getattr(dist, n) for n in names}
    called = []

    def counting(name):
        def call(*args, **kwargs):
            called.append(name)
            return saved[name](*args, **kwargs)
        return call

    try:
        for n in names:
            setattr(dist, n, counting(n))
        fn()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return called


def routes_once(rank: int, world_size: int, seed: int) -> list[str]:
    """A hierarchical layer's forward and backward exchange the routes once (the dispatch's forward); with a
    pipelined dispatch the hierarchical combine summing within the nodes exchanges them. Results equal
    `reference`'s on the same inputs."""
    group = spanning_group(rank, 2)
    try:
        import overlap

        case = cases_for(world_size)[1]
        xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed, world_size, torch.float32)
        L = case.experts // world_size
        mine = (xs[rank], idxs[rank], weights[rank], w1[rank * L : (rank + 1) * L], w2[rank * L : (rank + 1) * L],
                grads[rank], case.experts)
        # (pipelined: its counts, then ours; weight_grad False: the combine sums within nodes, else its rows go flat)
        for dispatch_plan, weight_grad, exchanges in (("hierarchical", True, 1), ("hierarchical", False, 1),
                                                      ("pipelined", False, 2)):
            ref = layer("reference", group, *mine, weight_grad=weight_grad)
            x, idx, wt, a, b, g, E = mine
            x, a, b = (t.clone().requires_grad_(True) for t in (x, a, b))
            wt = wt.clone().requires_grad_(weight_grad)
            out: dict = {}

            def step(x=x, a=a, b=b, wt=wt, idx=idx, g=g, E=E, plan=dispatch_plan, out=out):
                h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, a, E, group=group, strategy=plan)
                y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h), b, wt, handle,
                                                       strategy="hierarchical")
                y.backward(g)
                out["got"] = (h.detach(), y.detach(), x.grad, a.grad, b.grad, wt.grad)

            called = collectives_during(step)
            assert len(called) == exchanges, f"rank {rank}: dispatch {dispatch_plan}: collectives {called}"
            for name, got, want in zip(("h", "y", "grad x", "grad w1", "grad w2", "grad topk_weights"),
                                       out["got"], ref, strict=True):
                if want is None:
                    assert got is None, f"rank {rank}: {dispatch_plan}: {name}"
                    continue
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, n=name, p=dispatch_plan: f"rank {rank}: {p}: {n}: {m}")
        overlap.release(group)
        return called
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_the_routes_cross_once_per_layer(pools, seed):
    pools(4).run(routes_once, seed, timeout=120)


# ----------------------------------------------------------------------------------------------
# One node: symm; a rank killed on the other node: named
# ----------------------------------------------------------------------------------------------


def one_node(rank: int, world_size: int, seed: int) -> None:
    case = cases_for(world_size)[0]
    xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed, world_size, torch.float32)
    L = case.experts // world_size
    mine = (xs[rank], idxs[rank], weights[rank], w1[rank * L : (rank + 1) * L], w2[rank * L : (rank + 1) * L],
            grads[rank], case.experts)
    outs = {}
    calls = {s: gemm_calls(lambda s=s: outs.__setitem__(s, layer(s, None, *mine))) for s in ("symm", "hierarchical")}
    assert calls["hierarchical"] == calls["symm"], f"rank {rank}: hierarchical runs other GEMMs than symm on one node"
    for a, b in zip(outs["hierarchical"], outs["symm"], strict=True):
        assert torch.equal(a, b), f"rank {rank}: hierarchical != symm on one node"


@pytest.mark.exact
def test_one_node_is_symm(pools, seed):
    pools(2).run(one_node, seed)


def killed_remote(rank: int, world_size: int, victim: int, op: str):
    """`victim` (on the second node) dies inside a dispatch or a combine, after the routes' exchange, before it
    sends anything."""
    import signal

    import overlap
    from overlap.ops.hierarchical import node_call
    from tests.support.tp_oracle import expect_error

    group = spanning_group(rank, 2)
    try:
        x, idx = torch.randn(5, 8), torch.randint(0, 8, (5, 2))
        rows, handle = overlap.moe.dispatch(x, idx, 8, group=group, strategy="hierarchical")  # healthy first
        if rank == victim:

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            node_call.begin_node = node_call.isend = die
        start = time.monotonic()
        if op == "dispatch":
            kind, msg, *_ = expect_error(overlap.moe.dispatch, x, idx, 8, group=group, strategy="hierarchical",
                                         timeout=3.0)
        else:
            kind, msg, *_ = expect_error(overlap.moe.combine, rows, torch.rand(5, 2), handle,
                                         strategy="hierarchical", timeout=3.0)
        return kind, msg, time.monotonic() - start
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_killed_rank_on_the_other_node_is_named(op):
    victim = 3
    with pytest.raises(RankError) as failed:
        run_isolated(4, killed_remote, victim, op, timeout=90.0)
    assert_dead_named(failed.value, victim, deadline=3.0)


# ----------------------------------------------------------------------------------------------
# auto and the cost model (single process)
# ----------------------------------------------------------------------------------------------


def info_of(nodes, rank: int = 0):
    from overlap import world

    n = len(nodes)
    return world.GroupInfo(rank=rank, world_size=n, global_ranks=tuple(range(n)), nodes=tuple(nodes),
                           pids=tuple(range(n)), backend="gloo", device=torch.device("cpu"),
                           peer_access=(False,) * n)


def test_auto_keeps_pipelined_and_the_model_counts_hierarchical_only_across_nodes():
    import math

    from overlap.plans import Plan, Problem, candidates, default_profile, predict, topology_of
    from overlap.plans.auto import resolve_auto

    problem = Problem("moe", 64, 32, 48, "float32", True, 8, 2)
    across, one = info_of(("a", "a", "b", "b")), info_of(("a",) * 4)
    assert resolve_auto("moe", "moe sig", across, None, "float32", problem=problem) == Plan("pipelined")
    assert resolve_auto("moe", "moe sig", one, None, "float32", problem=problem).strategy == "symm"
    hier = [p for p in candidates(problem, topology_of(across)) if p.strategy == "hierarchical"]
    assert hier and all(dict(p.num_chunks).keys() == {"network"} for p in hier), hier
    assert all(math.isfinite(predict(problem, p, topology_of(across), default_profile("cpu")).total_s) for p in hier)
    assert not any(p.strategy == "hierarchical" for p in candidates(problem, topology_of(one)))
    # on one node it runs symm: the same prediction
    profile = default_profile("cpu")
    assert predict(problem, Plan("hierarchical"), topology_of(one), profile) == predict(
        problem, Plan("symm"), topology_of(one), profile)


def test_the_model_prices_rows_kept_per_pair_as_pipelined_moves_them():
    """With a backward the combine keeps one row per pair (for ``topk_weights``' gradient) and runs it and its
    backward flat: the hierarchical layer's forward+backward moves its forward's bytes plus what `pipelined`'s
    forward moves (up to the counts), where the node-summed transfers alone would move less."""
    from overlap.plans import Plan, Problem, Profile, predict, topology_of

    fit = {"latency_s": 0.0, "bandwidth_Bps": 1e7}
    profile = Profile.from_json({
        "version": 1, "device": "cpu", "machine": "test",
        "links": {"network": {"p2p": fit}, "shm": {"p2p": {"latency_s": 0.0, "bandwidth_Bps": 1e15}}},
        "gemm": {"float32": {"peak_flops": 1e18, "overhead_s": 0.0}},
        "gemm_slowdown": 1.0, "comm_slowdown": 1.0, "per_chunk_s": 0.0, "call_s": {}})
    topo = topology_of(info_of(("a", "a", "b", "b")))
    fwd, both = (Problem("moe", 256, 256, 256, "float32", b, 8, 2) for b in (False, True))
    hier = Plan("hierarchical")
    flat = predict(fwd, Plan("pipelined"), topo, profile).comm_s
    added = predict(both, hier, topo, profile).comm_s - predict(fwd, hier, topo, profile).comm_s
    counts = 2 * 4 * 2 / 1e7  # pipelined's counts to its two peers on the other node
    assert abs(added - (flat - counts)) < 1e-9, (added, flat)
    assert predict(fwd, hier, topo, profile).comm_s < flat  # a token's row crosses once per node
