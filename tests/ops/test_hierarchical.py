"""The ``hierarchical`` strategy on groups that span nodes, emulated on one machine: each rank's node is
its ``OVERLAP_NODE_ID`` (set in the rank before the group's first call), so 2 nodes x 2 ranks, 2 x 1 and 3 x 1
rank run on the pooled CPU ranks without root; the network between them is loopback. (The emulated
cluster's tests, as root, check the same strategy over a veth pair: tests/emulated/test_emulated_cluster.py.)

Every op x ``hierarchical`` against ``reference`` on the same group and fresh random inputs, forward and
backward, and against the float64 oracle; repeated calls bitwise equal (every rank's all-reduce output too);
the payload bytes each call posts to other nodes, counted by the transfer layer
(`overlap.comm.network_bytes_sent`), asserted exactly against what the algorithm moves (and ``pipelined``'s
beside it); on one node it is ``symm``, bitwise; a rank killed on the other node is named by every
survivor.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.support import nodes
from tests.support.gemms import gemm_calls
from tests.support.harness import RankError, run_isolated
from tests.support.nodes import assert_dead_named
from tests.support.tp_oracle import AGM, MAR, MRS, b_of, compare, forward_backward, oracle

OPS = (AGM, MRS, MAR)
# (rows, middle dims, k, n, b layout): odd sizes, one row, 3-D input, transposed weight views.
CASES = [(5, (), 7, 3, "weight.t()"), (1, (), 16, 9, "contiguous"), (4, (3,), 13, 11, "weight.t()")]


def spanning_group(rank: int, ranks_per_node: int):
    return nodes.spanning_group(rank, ranks_per_node, "hnode")


def expected_bytes(op: str, case, world_size: int, ranks_per_node: int, rank: int, itemsize: int,
                   backward: bool) -> int:
    """Payload bytes one rank posts to other nodes in one ``hierarchical`` call: one copy per other node."""
    rows, mid, k, n, _ = case
    per = rows * (int(torch.tensor(mid).prod().item()) if mid else 1)  # rows of dim 0 times the middle dims
    others = world_size // ranks_per_node - 1
    if op == AGM:  # forward: a's rows; backward: a's rows again, and the node sums of grad_a
        return others * per * k * itemsize * (3 if backward else 1)
    if op == MRS:  # forward: the node sums of the partials; backward: the gather of grad_out
        return others * per * n * itemsize * (2 if backward else 1)
    # all-reduce: M rows in W parts of ceil(M/W); this rank sends the node sum of its counterparts' parts,
    # then its own reduced part, to every other node; its backward communicates nothing
    M = per
    size = -(-M // world_size)
    part = [max(0, min(size, M - d * size)) for d in range(world_size)]
    local = rank % ranks_per_node
    sums = sum(part[node * ranks_per_node + local] for node in range(world_size // ranks_per_node)
               if node != rank // ranks_per_node)
    return (sums + others * part[rank]) * n * itemsize


def ops_against_reference(rank, world_size, ranks_per_node, dtype, seed):
    import overlap
    from overlap import comm

    group = spanning_group(rank, ranks_per_node)
    sent = []
    try:
        for op in OPS:
            for i, case in enumerate(CASES):
                inputs, want = oracle(op, seed + i, world_size, case, dtype)
                a, param, g = inputs[rank]
                ctx = f"{op} rank {rank}/{world_size} ({ranks_per_node} per node) {dtype} case {case} seed {seed + i}"
                ref = forward_backward(op, "reference", a, param, case[4], g, group=group)
                before = comm.network_bytes_sent()
                with torch.no_grad():
                    y = getattr(overlap, op)(a, b_of(param, case[4]), group=group, strategy="hierarchical")
                fwd = comm.network_bytes_sent() - before
                before = comm.network_bytes_sent()
                got = forward_backward(op, "hierarchical", a, param, case[4], g, group=group)
                both = comm.network_bytes_sent() - before
                again = forward_backward(op, "hierarchical", a, param, case[4], g, group=group)
                compare(ctx + " vs reference", got, ref, dtype)
                compare(ctx + " vs float64", got, want[rank], dtype)
                for label, x, z in zip(("out", "grad_a", "grad_b"), got, again):
                    assert torch.equal(x, z), f"{ctx}: {label} differs between two identical calls"
                assert torch.equal(y, got[0]), f"{ctx}: the forward without grad differs"
                item = torch.empty((), dtype=dtype).element_size()
                want_fwd = expected_bytes(op, case, world_size, ranks_per_node, rank, item, backward=False)
                want_both = expected_bytes(op, case, world_size, ranks_per_node, rank, item, backward=True)
                assert (fwd, both) == (want_fwd, want_both), \
                    f"{ctx}: network bytes {(fwd, both)} != {(want_fwd, want_both)}"
                sent.append((op, i, fwd, both, got[0] if op == MAR else None))
        overlap.release(group)
        return sent
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (2, 1), (3, 1)])
def test_every_op_against_reference(pools, seed, world_size, ranks_per_node):
    results = pools(world_size).run(ops_against_reference, ranks_per_node, torch.float32, seed)
    for i in range(len(results[0])):  # the all-reduce's output: bitwise the same on every rank
        outs = [r[i][4] for r in results]
        if outs[0] is not None:
            assert all(torch.equal(outs[0], o) for o in outs[1:]), \
                f"all-reduce outputs differ across ranks: {results[0][i][:2]}"


def bf16_against_reference(rank, world_size, ranks_per_node, seed):
    group = spanning_group(rank, ranks_per_node)
    try:
        for op in OPS:
            case = (6, (), 24, 10, "weight.t()")
            inputs, want = oracle(op, seed, world_size, case, torch.bfloat16)
            a, param, g = inputs[rank]
            ref = forward_backward(op, "reference", a, param, case[4], g, group=group)
            got = forward_backward(op, "hierarchical", a, param, case[4], g, group=group)
            compare(f"{op} bf16 rank {rank} seed {seed}", got, ref, torch.bfloat16)
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def weight_op(rank, world_size, ranks_per_node, seed):
    """all_gather_weight_matmul x hierarchical against reference, forward and backward, and its network bytes."""
    import overlap
    from overlap import comm

    group = spanning_group(rank, ranks_per_node)
    try:
        m, k, n = 5, 12, 3
        gen = torch.Generator().manual_seed(seed * 31 + rank)
        a, w, g = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(m, world_size * n,
                                                                                                   generator=gen)
        out = {}
        for strategy in ("reference", "hierarchical", "hierarchical"):
            a1, w1 = a.clone().requires_grad_(), w.clone().requires_grad_()
            before = comm.network_bytes_sent()
            y = overlap.all_gather_weight_matmul(a1, w1.t(), group=group, strategy=strategy)
            fwd = comm.network_bytes_sent() - before
            y.backward(g)
            got = (y.detach(), a1.grad, w1.grad)
            if strategy in out:
                assert all(torch.equal(x, z) for x, z in zip(got, out[strategy])), f"rank {rank}: not repeatable"
            out[strategy] = got
            if strategy == "hierarchical":
                others = world_size // ranks_per_node - 1
                both = comm.network_bytes_sent() - before
                assert (fwd, both) == (others * n * k * 4, 3 * others * n * k * 4), (rank, fwd, both)
        compare(f"all_gather_weight_matmul rank {rank} seed {seed}", out["hierarchical"], out["reference"],
                torch.float32)
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (2, 1)])
def test_weight_gather_against_reference(pools, seed, world_size, ranks_per_node):
    pools(world_size).run(weight_op, ranks_per_node, seed)


def test_bf16_against_reference(pools, seed):
    pools(4).run(bf16_against_reference, 2, seed)


def pipelined_bytes(rank, world_size, ranks_per_node):
    """``pipelined`` sends each block to every remote rank: twice ``hierarchical``'s at 2 x 2."""
    import overlap
    from overlap import comm

    group = spanning_group(rank, ranks_per_node)
    try:
        a, b = torch.randn(6, 8), torch.randn(8, 5)
        counts = {}
        for strategy in ("pipelined", "hierarchical"):
            before = comm.network_bytes_sent()
            overlap.all_gather_matmul(a, b, group=group, strategy=strategy)
            counts[strategy] = comm.network_bytes_sent() - before
        return counts
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
def test_all_gather_halves_network_bytes(pools):
    for counts in pools(4).run(pipelined_bytes, 2):
        assert counts == {"pipelined": 2 * 6 * 8 * 4, "hierarchical": 6 * 8 * 4}, counts


def one_node(rank, world_size, seed):
    """On a group of one node ``hierarchical`` is ``symm``: the same GEMMs on the same shapes in the same order
    (which fails on any CPU when the paths part), then bitwise the same results; every op, forward and
    backward, two layouts of ``b`` and a 3-D input."""
    import overlap

    def weight_gather(strategy, a, w, g):
        a1, w1 = a.clone().requires_grad_(), w.clone().requires_grad_()
        y = overlap.all_gather_weight_matmul(a1, w1.t(), strategy=strategy)
        y.backward(g)
        return y.detach(), a1.grad, w1.grad

    runs = []
    for i, case in enumerate(CASES):
        for op in OPS:
            inputs, _ = oracle(op, seed + i, world_size, case, torch.float32)
            a, param, g = inputs[rank]
            runs.append((f"{op} case {case}", lambda s, a=a, p=param, g=g, op=op, c=case: forward_backward(
                op, s, a, p, c[4], g)))
    gen = torch.Generator().manual_seed(seed + rank)
    for m, k, n in ((4, 6, 3), (5, 16, 7)):
        a, w, g = (torch.randn(shape, generator=gen) for shape in ((m, k), (n, k), (m, world_size * n)))
        runs.append((f"all_gather_weight_matmul m={m} k={k} n={n}", lambda s, a=a, w=w, g=g: weight_gather(
            s, a, w, g)))
    for what, run in runs:
        ctx = f"{what} rank {rank} seed {seed}"
        outs, calls = {}, {}
        for strategy in ("symm", "hierarchical"):

            def step(s=strategy, run=run, outs=outs):
                outs[s] = run(s)

            calls[strategy] = gemm_calls(step)
        assert calls["hierarchical"] == calls["symm"], \
            f"{ctx}: hierarchical runs other GEMMs than symm on one node:\n{calls['hierarchical']}\n{calls['symm']}"
        for label, x, y in zip(("out", "grad_a", "grad_b"), outs["hierarchical"], outs["symm"]):
            assert torch.equal(x, y), f"{ctx}: {label} of hierarchical != symm on one node"


def test_plan_on_one_node_is_symm():
    """The one place that makes it so: `fit_plan` gives a forced ``hierarchical`` on one node as ``symm`` (every
    other field kept), and leaves it alone on a group that spans nodes."""
    from overlap import Plan, world
    from overlap.plans.auto import fit_plan

    def info(nodes):
        n = len(nodes)
        return world.GroupInfo(0, n, tuple(range(n)), tuple(nodes), tuple(range(1, n + 1)), "gloo",
                               torch.device("cpu"), (False,) * n)

    plan = Plan("hierarchical", num_chunks={"shm": 3, "network": 5})
    for op in (*OPS, "all_gather_weight_matmul", "dispatch", "grouped_matmul_combine"):
        assert fit_plan(op, plan, info(["a", "a"])) == Plan("symm", num_chunks={"shm": 3, "network": 5}), op
        assert fit_plan(op, plan, info(["a", "a", "b", "b"])) == plan, op


@pytest.mark.exact
def test_one_node_is_symm(pools, seed):
    pools(2).run(one_node, seed)


def uneven_nodes(rank, world_size):
    import torch.distributed as dist

    import overlap
    from tests.support.tp_oracle import expect_error

    os.environ["OVERLAP_NODE_ID"] = "u0" if rank < 2 else "u1"
    try:
        group = dist.new_group(list(range(world_size)))
        return expect_error(overlap.all_gather_matmul, torch.randn(2, 4), torch.randn(4, 3), group=group,
                            strategy="hierarchical")
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_uneven_nodes_raise_on_every_rank(pools):
    for kind, msg, *_ in pools(3).run(uneven_nodes):
        assert kind == "ValueError" and "same number of ranks" in msg, (kind, msg)


# ----------------------------------------------------------------------------------------------
# A rank killed on the other node: every survivor raises, naming it
# ----------------------------------------------------------------------------------------------


def killed_remote(rank, world_size, op, victim, late=None):
    """`victim` (on the second node) dies inside a call, after its header, before it sends any data. `late`: a
    rank that starts the call a second late, when the victim's connections may already be closed (its first post
    to the victim fails)."""
    import signal

    import overlap
    from overlap.ops.hierarchical import agreement
    from overlap.ops.tp import hierarchical_gather, hierarchical_reduce
    from tests.support.tp_oracle import expect_error

    group = spanning_group(rank, 2)
    try:
        a = torch.randn(4 * (world_size if op != AGM else 1), 8)
        b = torch.randn(8, 6)
        getattr(overlap, op)(a, b, group=group, strategy="hierarchical")  # healthy: node groups and heaps exist
        if rank == victim:  # dies at its first send or its node's handshake, whichever comes first: nothing sent

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            hierarchical_gather.begin_node = hierarchical_reduce.begin_node = agreement.Counterparts.send = die
        start = time.monotonic()
        if rank == late:
            time.sleep(1.0)
        kind, msg, *_ = expect_error(getattr(overlap, op), a, b, group=group, strategy="hierarchical", timeout=3.0)
        return kind, msg, time.monotonic() - start
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.parametrize("late", [None, 1], ids=["together", "counterpart-late"])
@pytest.mark.parametrize("op", [AGM, MRS])
def test_killed_rank_on_the_other_node_is_named(op, late):
    """Also where the victim's counterpart comes to the call after the victim died: its posts fail at once, and
    its node learns of the death through it, not by waiting out the deadline for its data."""
    victim = 3
    with pytest.raises(RankError) as failed:  # the victim's death fails the task; the survivors' results remain
        run_isolated(4, killed_remote, op, victim, late, timeout=90.0)
    assert_dead_named(failed.value, victim, deadline=3.0)


# ----------------------------------------------------------------------------------------------
# The cost model's choice and auto's, from given profiles (single process, no timing)
# ----------------------------------------------------------------------------------------------

TWO_BY_TWO = "cpu:nodes=2:ranks=4:links=network*2,shm*1"


def profile_at(network_Bps: float, latency_s: float = 50e-6):
    """The default CPU profile (shared memory, GEMMs) with the network at `network_Bps`."""
    import dataclasses

    from overlap.plans import LinkFit, default_profile

    base = default_profile("cpu")
    return dataclasses.replace(base, links={**base.links, "network": {"p2p": LinkFit(latency_s, network_Bps)}})


def info_of(nodes, rank=0, device="cpu"):
    from overlap import world

    n = len(nodes)
    return world.GroupInfo(rank=rank, world_size=n, global_ranks=tuple(range(n)), nodes=tuple(nodes),
                           pids=tuple(range(n)), backend="gloo", device=torch.device(device),
                           peer_access=(False,) * n)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_model_picks_hierarchical_where_the_network_is_the_bottleneck(op, backward):
    """At 100 Mbit/s between 2 nodes x 2 ranks the model ranks ``hierarchical`` first (its network bytes are
    half ``pipelined``'s for the all-gather, the node's sums for the reductions), chunked per link."""
    from overlap.plans import Problem, rank_candidates, topology_of

    topology = topology_of(info_of(("a", "a", "b", "b")))
    assert topology.signature == TWO_BY_TWO
    problem = Problem(op, 128, 256, 512, "float32", backward)
    ranked = rank_candidates(problem, topology, profile_at(12.5e6))
    best = ranked[0][0]
    assert best.strategy == "hierarchical", [(p.describe(), round(x.total_s * 1e3, 2)) for p, x in ranked[:5]]
    assert {c for c, _ in best.num_chunks} == {"shm", "network"}, best
    by = {}
    for plan, pred in ranked:
        by.setdefault(plan.strategy, pred)
    if op == AGM and not backward:  # half the bytes over the bottleneck: the transfers take about half as long
        assert by["hierarchical"].comm_s < 0.6 * by["pipelined"].comm_s, by


def test_model_keeps_pipelined_where_node_copies_cost_more_than_the_network():
    """A profile whose network is faster than its node's copies: forwarding through the node does not pay."""
    import dataclasses

    from overlap.plans import LinkFit, Problem, rank_candidates, topology_of

    slow_node = profile_at(50e9, 1e-6)
    slow_node = dataclasses.replace(slow_node, links={**slow_node.links, "shm": {"p2p": LinkFit(1e-6, 50e9),
                                                                                  "copy": LinkFit(5e-3, 1e8)}})
    topology = topology_of(info_of(("a", "a", "b", "b")))
    for op in OPS:
        best = rank_candidates(Problem(op, 128, 256, 512), topology, slow_node)[0][0]
        assert best.strategy != "hierarchical", (op, best)


def test_no_hierarchical_candidate_where_it_cannot_run_or_adds_nothing():
    from overlap.plans import Plan, Problem, candidates, default_profile, predict, topology_of

    problem = Problem(AGM, 64, 64, 64)
    one_per_node = topology_of(info_of(("a", "b")))
    uneven = topology_of(info_of(("a", "a", "a", "b")))
    gpu = topology_of(info_of(("a", "a", "b", "b"), device="cuda"))
    for topology in (one_per_node, uneven, gpu):
        assert all(p.strategy != "hierarchical" for p in candidates(problem, topology)), topology
    assert predict(problem, Plan("hierarchical"), uneven, default_profile("cpu")).total_s == float("inf")
    assert predict(problem, Plan("hierarchical"), gpu, default_profile("cuda")).total_s == float("inf")
    one_node = topology_of(info_of(("a", "a")))
    assert predict(problem, Plan("hierarchical"), one_node, default_profile("cpu")) \
        == predict(problem, Plan("symm"), one_node, default_profile("cpu"))
    # MoE and the weight-side gather have it too (MoE: tests/moe/test_moe_hierarchical.py)
    two_by_two = topology_of(info_of(("a", "a", "b", "b")))
    moe = Problem("moe", 64, 64, 64, experts=8, top_k=2)
    assert any(p.strategy == "hierarchical" for p in candidates(moe, two_by_two))
    assert any(p.strategy == "hierarchical" for p in candidates(Problem("all_gather_weight_matmul", 64, 64, 64),
                                                                two_by_two))


def test_auto_across_nodes_from_the_model_or_the_plan_file():
    """``auto`` on a TP call across nodes: the model's best under the default profile without a plan file, the
    model's under the file's profile with one (an entry of the file first); never hierarchical where it cannot run."""
    from overlap.plans import Entry, Plan, PlanFile, Problem, auto, topology_of

    def resolve(nodes, plan_file=None, device="cpu", m=128):
        info = info_of(nodes, device=device)
        problem = Problem(AGM, m, 256, 512)
        return auto.resolve_auto(AGM, "sig", info, m, "float32", problem=problem, plan_file=plan_file)

    assert resolve(("a", "a", "b", "b")).strategy == "hierarchical"
    assert resolve(("a", "b")).strategy in ("pipelined", "reference")
    assert resolve(("a", "a", "b", "b"), device="cuda").strategy in ("pipelined", "reference")
    topology = topology_of(info_of(("a", "a", "b", "b")))
    fast_node = PlanFile.new(topology, 4, profile_at(12.5e6))
    assert resolve(("a", "a", "b", "b"), fast_node).strategy == "hierarchical"
    tuned = PlanFile.new(topology, 4, profile_at(12.5e6))
    tuned.add(Entry(Problem(AGM, 128, 256, 512), Plan("pipelined", {"network": 4}), 0.01, 0.02, 0.01))
    assert resolve(("a", "a", "b", "b"), tuned) == Plan("pipelined", {"network": 4})
