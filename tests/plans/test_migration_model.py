"""The expert-migration model (`overlap.plans.migration`): which (expert, node) pairs move their weights instead of
their tokens, as the link rate and the routing skew change, from given profiles; its place in `predict`,
`candidates` and the tuner's list; the checks of a plan that migrates (`fit_plan`). No timings."""

from __future__ import annotations

import math

import pytest
import torch

from overlap import world
from overlap.plans import (
    GemmFit,
    LinkFit,
    Plan,
    Problem,
    Profile,
    Topology,
    candidates,
    choose_migration,
    expected_loads,
    measured_loads,
    predict,
    rank_candidates,
)
from overlap.plans.auto import fit_plan
from overlap.plans.migration import MIN_GAIN, check_migrate, network_effect, nodes_of, owner_node, pair_bytes
from overlap.tune.search import family, to_measure

TWO_BY_TWO = ((0, 1), (2, 3))
TOPOLOGY = Topology("cpu", 4, 2, 2, (("shm", 1), ("network", 2)))
#: 8 experts (2 per rank): two hot ones, one on each node (0 on rank 0, 4 on rank 2), a warm one (6)
HOT = (0.3, 0.05, 0.05, 0.05, 0.3, 0.05, 0.15, 0.05)


def gbit(rate: float) -> float:
    """Bytes per second of a link of `rate` Gbit/s."""
    return rate * 1e9 / 8


def profile(bandwidth_Bps: float, latency_s: float = 1e-4, fp32_flops: float = 7e10,
            bf16_flops: float = 7e10) -> Profile:
    """A CPU profile with the given network rate (shared memory as the default profile's)."""
    return Profile({"shm": {"p2p": LinkFit(1e-4, 0.3e9), "copy": LinkFit(2e-5, 3e9)},
                    "network": {"p2p": LinkFit(latency_s, bandwidth_Bps)}},
                   {"float32": GemmFit(fp32_flops, 2e-5), "bfloat16": GemmFit(bf16_flops, 2e-5)},
                   gemm_slowdown=1.3, comm_slowdown=1.3, per_chunk_s=3e-5)


def moe(tokens: int = 2048, hidden: int = 512, ffn: int = 1024, *, dtype: str = "float32", backward: bool = False,
        experts: int = 8, top_k: int = 2) -> Problem:
    return Problem("moe", tokens, hidden, ffn, dtype, backward, experts, top_k)


def mixed(skew: float) -> list[float]:
    """Shares between balanced (0) and `HOT` (1)."""
    return [(1 - skew) / len(HOT) + skew * h for h in HOT]


def remote(pairs, problem: Problem, nodes=TWO_BY_TWO) -> bool:
    return all(owner_node(e, problem.experts, nodes) != m for e, m in pairs)


# ---- loads ------------------------------------------------------------------------------------------------------


def test_expected_loads_balanced_skewed_and_per_node():
    p = moe()
    balanced = expected_loads(p, TWO_BY_TWO)
    assert len(balanced) == 8 and all(row == pytest.approx((1024.0, 1024.0)) for row in balanced)
    assert sum(map(sum, balanced)) == pytest.approx(4 * 2048 * 2)  # every pair of every rank
    skewed = expected_loads(p, TWO_BY_TWO, HOT)
    assert skewed[0] == pytest.approx((0.3 * 2 * 2048 * 2,) * 2) and skewed[1][0] == pytest.approx(409.6)
    assert expected_loads(p, TWO_BY_TWO, [2 * h for h in HOT]) == skewed  # shares are normalized
    per_node = expected_loads(p, TWO_BY_TWO, [(h, 1 / 8) for h in HOT])
    assert [row[0] for row in per_node] == pytest.approx([row[0] for row in skewed])
    assert [row[1] for row in per_node] == pytest.approx([1024.0] * 8)
    assert expected_loads(p, TOPOLOGY) == balanced
    with pytest.raises(ValueError, match="1/top_k"):  # a token names an expert once: at most half the pairs
        expected_loads(p, TWO_BY_TWO, [0.6] + [0.4 / 7] * 7)
    with pytest.raises(ValueError, match="8 shares"):
        expected_loads(p, TWO_BY_TWO, HOT[:4])
    with pytest.raises(ValueError, match=">= 0"):
        expected_loads(p, TWO_BY_TWO, [-0.1] + [1.1 / 7] * 7)


def test_measured_loads_count_each_nodes_pairs():
    idx = [torch.tensor([[0, 1], [0, 4]]), torch.tensor([[0, 2]]), [[4, 5]], torch.tensor([[4, 0], [7, 6]])]
    loads = measured_loads(idx, TWO_BY_TWO, 8)
    assert loads[0] == (3.0, 1.0) and loads[4] == (1.0, 2.0) and loads[3] == (0.0, 0.0)
    assert sum(map(sum, loads)) == 12


def test_nodes_of_topology_group_and_lists():
    assert nodes_of(TOPOLOGY) == TWO_BY_TWO
    info = world.GroupInfo(0, 4, (0, 1, 2, 3), ("b", "a", "b", "a"), (1, 2, 3, 4), "gloo", torch.device("cpu"),
                           (False,) * 4)
    assert nodes_of(info) == ((0, 2), (1, 3))  # nodes in the order of their lowest rank, whatever their names
    assert nodes_of([[1, 0], [2, 3]]) == TWO_BY_TWO
    for bad in ([[0, 1], [1, 2]], [[2, 3], [0, 1]], [[0], []], [[0, 2]]):
        with pytest.raises(ValueError, match="nodes"):
            nodes_of(bad)


def test_pair_bytes_sizes_dtype_and_backward():
    tokens, weights = pair_bytes(moe(), 3000)
    assert (tokens, weights) == (2 * 3000 * 512 * 4, 2 * 512 * 1024 * 4)
    assert pair_bytes(moe(dtype="bfloat16"), 3000) == (tokens / 2, weights / 2)
    assert pair_bytes(moe(backward=True), 3000) == (2 * tokens, 2 * weights)
    at_f = pair_bytes(moe(), 1024)
    assert at_f[0] == at_f[1]  # the bytes favour migration exactly above F rows


# ---- the choice -------------------------------------------------------------------------------------------------


def test_choice_flips_to_migration_as_the_link_slows():
    p = moe()
    loads = expected_loads(p, TWO_BY_TWO, HOT)
    chosen = {rate: choose_migration(p, profile(gbit(rate)), TWO_BY_TWO, loads) for rate in (100, 10, 1, 0.1, 0.01)}
    assert chosen[100] == chosen[10] == chosen[1] == ()  # the transfers hide behind the GEMMs
    assert chosen[0.1] == chosen[0.01] == ((0, 1), (4, 0))  # the two hot experts, each to the other node
    sizes = [len(chosen[r]) for r in (100, 10, 1, 0.1, 0.01)]
    assert sizes == sorted(sizes)


def test_choice_flips_to_migration_as_the_skew_grows():
    p, slow = moe(), profile(gbit(0.1))
    chosen = [choose_migration(p, slow, TWO_BY_TWO, expected_loads(p, TWO_BY_TWO, mixed(s))) for s in
              (0, 0.05, 0.1, 0.25, 0.5, 1)]
    # the hot experts' rows per node: F (bytes even), 1.07 F, 1.14 F (a saving under MIN_GAIN), then 1.35 F and
    # more: the two, each node's hot expert to the other node, relieve both directions of the link together
    assert chosen[0] == chosen[1] == chosen[2] == ()
    assert chosen[3] == chosen[4] == chosen[5] == ((0, 1), (4, 0))
    assert [len(c) for c in chosen] == sorted(len(c) for c in chosen)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("rate", [100, 1, 0.01, 0.0001])
def test_balanced_routing_below_weight_bytes_never_migrates(dtype, backward, rate):
    p = moe(dtype=dtype, backward=backward)  # 1024 rows per (expert, node) = F: tokens never outweigh weights
    loads = expected_loads(p, TWO_BY_TWO)
    assert all(pair_bytes(p, x)[0] <= pair_bytes(p, x)[1] for row in loads for x in row)
    assert choose_migration(p, profile(gbit(rate)), TWO_BY_TWO) == ()
    assert choose_migration(p, profile(gbit(rate)), TOPOLOGY, loads) == ()


def test_balanced_routing_above_weight_bytes_migrates_on_a_slow_link():
    p = moe(tokens=8192, ffn=512, backward=True)  # 8192 rows per (expert, node), F = 512
    assert choose_migration(p, profile(gbit(100)), TWO_BY_TWO) == ()
    every_remote = tuple(sorted((e, 1 - e // 4) for e in range(8)))
    assert choose_migration(p, profile(gbit(0.01)), TWO_BY_TWO) == every_remote


@pytest.mark.parametrize("nodes", [TWO_BY_TWO, ((0, 1, 2), (3, 4, 5)), ((0, 1), (2, 3), (4, 5)), ((0,), (1,))])
@pytest.mark.parametrize("skew", [0.5, 1.0])
@pytest.mark.parametrize("rate", [1, 0.1, 0.01])
def test_never_a_pair_on_the_experts_own_node(nodes, skew, rate):
    W = sum(map(len, nodes))
    p = moe(experts=2 * W, ffn=256)
    hot = [0.3 if e % 3 == 0 else 0.05 for e in range(2 * W)]  # hot experts on every node
    shares = [(1 - skew) / (2 * W) + skew * h / sum(hot) for h in hot]
    pairs = choose_migration(p, profile(gbit(rate)), nodes, expected_loads(p, nodes, shares))
    assert remote(pairs, p, nodes) and list(pairs) == sorted(set(pairs))
    if pairs:
        Plan("pipelined", migrate=pairs)  # a valid plan field
        check_migrate("moe", pairs, nodes, p.experts)
    assert choose_migration(p, profile(gbit(rate)), ((tuple(range(W))),)) == ()  # one node: nothing to save


def test_bf16_halves_the_bytes_so_it_chooses_as_fp32_on_a_link_twice_as_fast():
    """With equal GEMM rates and no per-message cost, half the bytes on a link of half the rate is the same
    problem; with bf16's faster GEMMs the transfers weigh more, so bf16 migrates where fp32 does not."""
    fp32, bf16 = moe(), moe(dtype="bfloat16")
    for rate in (10, 1, 0.5, 0.2, 0.1, 0.01):
        loads = expected_loads(fp32, TWO_BY_TWO, HOT)
        assert choose_migration(bf16, profile(gbit(rate) / 2, latency_s=0.0), TWO_BY_TWO, loads) == \
            choose_migration(fp32, profile(gbit(rate), latency_s=0.0), TWO_BY_TWO, loads)
    loads, fast_bf16 = expected_loads(fp32, TWO_BY_TWO, HOT), profile(gbit(0.5), bf16_flops=3e11)
    assert choose_migration(fp32, fast_bf16, TWO_BY_TWO, loads) == ()
    assert choose_migration(bf16, fast_bf16, TWO_BY_TWO, loads) == ((0, 1), (4, 0))


def test_backward_doubles_the_saving_of_a_pair_between_f_and_2f_rows():
    """A forward pair saves ``x H s`` each way and sends ``2 H F s`` one way: with ``F < x < 2F`` the owner node's
    sends grow, so only a backward (the gradients back: both ways) migrates it."""
    shares = [0.375] + [0.625 / 7] * 7  # expert 0: 3072 rows from node 1, F = 2048
    fwd, bwd = moe(ffn=2048), moe(ffn=2048, backward=True)
    loads = expected_loads(fwd, TWO_BY_TWO, shares)
    assert 2048 < loads[0][1] < 4096
    slow = profile(gbit(0.01))
    assert choose_migration(fwd, slow, TWO_BY_TWO, loads) == ()
    assert choose_migration(bwd, slow, TWO_BY_TWO, loads) == ((0, 1),)


def test_the_choice_is_worth_min_gain_and_bad_inputs_raise():
    p = moe()
    loads = expected_loads(p, TWO_BY_TWO, HOT)
    slow = profile(gbit(0.1))
    pairs = choose_migration(p, slow, TWO_BY_TWO, loads)
    share, weights_s = network_effect(p, slow, TWO_BY_TWO, pairs, loads)
    assert 0 < share < 1 and weights_s > 0 and MIN_GAIN > 0
    with pytest.raises(ValueError, match="divide"):
        choose_migration(moe(experts=6), slow, TWO_BY_TWO)
    with pytest.raises(ValueError, match="loads"):
        choose_migration(p, slow, TWO_BY_TWO, loads[:7])
    with pytest.raises(ValueError, match="loads"):
        network_effect(p, slow, TWO_BY_TWO, pairs, [row[:1] for row in loads])
    with pytest.raises(ValueError, match="network"):
        choose_migration(p, Profile({"shm": {"p2p": LinkFit(1e-4, 1e9)}}, {"float32": GemmFit(1e10, 0)}), TWO_BY_TWO,
                         loads)


# ---- the cost model and the tuner ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pipelined", "hierarchical", "reference"])
def test_predict_with_migrate_fewer_token_bytes_plus_weights(strategy):
    p = moe()
    loads = expected_loads(p, TWO_BY_TWO, HOT)
    pairs = ((0, 1), (4, 0))
    slow, fast = profile(gbit(0.1)), profile(gbit(100))
    plain, migrating = Plan(strategy), Plan(strategy, migrate=pairs)
    assert predict(p, migrating, TOPOLOGY, slow, loads).comm_s < predict(p, plain, TOPOLOGY, slow, loads).comm_s
    assert predict(p, migrating, TOPOLOGY, slow, loads).total_s < predict(p, plain, TOPOLOGY, slow, loads).total_s
    assert predict(p, migrating, TOPOLOGY, fast, loads).total_s > predict(p, plain, TOPOLOGY, fast, loads).total_s
    balanced = predict(p, migrating, TOPOLOGY, slow)  # cold under balanced routing: the weights for little
    assert balanced.total_s > predict(p, migrating, TOPOLOGY, slow, loads).total_s
    assert predict(p, migrating, TOPOLOGY, slow, loads).compute_s == pytest.approx(
        predict(p, plain, TOPOLOGY, slow, loads).compute_s)


def test_predict_rejects_migrate_where_it_does_not_apply():
    slow = profile(gbit(0.1))
    with pytest.raises(ValueError, match="applies only"):
        predict(Problem("all_gather_matmul", 64, 64, 64), Plan("pipelined", migrate=((0, 1),)), TOPOLOGY, slow)
    with pytest.raises(ValueError, match="holds expert"):
        predict(moe(), Plan("pipelined", migrate=((0, 0),)), TOPOLOGY, slow)
    with pytest.raises(ValueError, match="one node"):
        predict(moe(), Plan("pipelined", migrate=((0, 1),)), Topology("cpu", 2, 1, 2, (("shm", 1),)), slow)


def test_candidates_and_ranking_add_the_models_migrate_set():
    p = moe()
    loads = expected_loads(p, TWO_BY_TWO, HOT)
    slow, fast = profile(gbit(0.1)), profile(gbit(100))
    plain = candidates(p, TOPOLOGY)
    assert not any(c.migrate for c in plain)
    assert candidates(p, TOPOLOGY, profile=fast, loads=loads) == plain  # nothing worth it on a fast link
    assert candidates(p, TOPOLOGY, profile=slow) == plain  # balanced: nothing worth it
    with_migration = candidates(p, TOPOLOGY, profile=slow, loads=loads)
    extra = [c for c in with_migration if c.migrate]
    assert with_migration[: len(plain)] == plain and len(with_migration) < 60
    assert {c.migrate for c in extra} == {((0, 1), (4, 0))}
    assert {c.strategy for c in extra} == {"pipelined", "hierarchical"}
    assert len(extra) == sum(c.strategy in ("pipelined", "hierarchical") for c in plain)
    ranked = rank_candidates(p, TOPOLOGY, slow, loads)
    assert ranked[0][0].migrate == ((0, 1), (4, 0))  # on the slow link the model ranks migration first
    assert all(math.isfinite(pred.total_s) for _, pred in ranked)
    assert not any(plan.migrate for plan, _ in rank_candidates(p, TOPOLOGY, fast, loads))
    tp = Problem("all_gather_matmul", 256, 512, 512)  # no migration for the TP ops
    assert candidates(tp, TOPOLOGY, profile=slow) == candidates(tp, TOPOLOGY)


@pytest.mark.parametrize("rate, loads", [(0.1, HOT), (0.1, None), (1.0, None), (10.0, HOT)])
def test_the_tuner_measures_the_best_plan_of_every_family(rate, loads):
    p = moe()
    ranked = rank_candidates(p, TOPOLOGY, profile(gbit(rate)), expected_loads(p, TWO_BY_TWO, loads))
    families = {family(plan) for plan, _ in ranked}
    assert {("pipelined", False), ("hierarchical", False), ("reference", False)} <= families
    for measure in (1, 2, 3):
        trials = to_measure(ranked, measure)
        others = [plan for plan, _ in ranked if plan.strategy != "reference"]
        assert trials[0].plan == Plan("reference") and [t.plan for t in trials[1 : measure + 1]] == others[:measure]
        assert {family(t.plan) for t in trials} == families, (rate, loads, measure)  # flat beside hierarchical
        for t in trials[measure + 1 :]:  # a family's plan beyond the best few: its best-predicted one
            assert t.plan == next(plan for plan, _ in ranked if family(plan) == family(t.plan))
        assert len({t.plan for t in trials}) == len(trials)
    if rate < 1.0 and loads is not None:
        assert any(plan.migrate for plan, _ in ranked)  # (a hot routing on a slow link: the model migrates)
        behind = [(plan, pred) for plan, pred in ranked if not plan.migrate] + [pp for pp in ranked if pp[0].migrate]
        trials = to_measure(behind, 2)  # migration ranked last: measured all the same
        assert trials[-1].plan.migrate and not trials[1].plan.migrate


# ---- forced plans -------------------------------------------------------------------------------------------------


def info_of(nodes: list[str], rank: int = 0) -> world.GroupInfo:
    n = len(nodes)
    return world.GroupInfo(rank, n, tuple(range(n)), tuple(nodes), tuple(range(1, n + 1)), "gloo",
                           torch.device("cpu"), (False,) * n)


def test_fit_plan_rejects_migrate_where_it_cannot_run():
    two_nodes = info_of(["a", "a", "b", "b"])
    good = Plan("hierarchical", migrate=((0, 1), (4, 0)))
    for op in ("dispatch_grouped_matmul", "grouped_matmul_combine"):
        fit_plan(op, good, two_nodes, num_experts=8)
        fit_plan(op, good, two_nodes)  # without the expert count: what can be checked
        fit_plan(op, Plan("pipelined"), info_of(["a"] * 4), num_experts=8)
    cases = [
        ("all_gather_matmul", Plan("pipelined", migrate=((0, 1),)), two_nodes, None, "applies only"),
        ("matmul_reduce_scatter", Plan("pipelined", migrate=((0, 1),)), two_nodes, None, "applies only"),
        ("dispatch", Plan("pipelined", migrate=((0, 1),)), two_nodes, 8, "applies only"),  # no weights to move
        ("combine", Plan("pipelined", migrate=((0, 1),)), two_nodes, 8, "applies only"),
        ("dispatch_grouped_matmul", Plan("reference", migrate=((0, 1),)), info_of(["a"] * 4), 8, "one node"),
        ("dispatch_grouped_matmul", Plan("pipelined", migrate=((8, 1),)), two_nodes, 8, "expert 8"),
        ("grouped_matmul_combine", Plan("pipelined", migrate=((0, 2),)), two_nodes, 8, "node 2"),
        ("grouped_matmul_combine", Plan("pipelined", migrate=((0, 2),)), two_nodes, None, "node 2"),
        ("dispatch_grouped_matmul", Plan("pipelined", migrate=((3, 0),)), two_nodes, 8, "holds expert 3"),
        ("grouped_matmul_combine", Plan("pipelined", migrate=((5, 1),)), two_nodes, 8, "holds expert 5"),
        ("dispatch_grouped_matmul", Plan("pipelined", migrate=((0, 1),)), two_nodes, 6, "divide"),
    ]
    for op, plan, info, experts, match in cases:
        with pytest.raises(ValueError, match=match):
            fit_plan(op, plan, info, num_experts=experts)
    # nodes ordered by their lowest rank: ranks 0 and 2 form node 0 here, so expert 2 (rank 1) lives on node 1
    interleaved = info_of(["a", "b", "a", "b"])
    fit_plan("dispatch_grouped_matmul", Plan("pipelined", migrate=((2, 0),)), interleaved, num_experts=8)
    with pytest.raises(ValueError, match="holds expert 2"):
        fit_plan("dispatch_grouped_matmul", Plan("pipelined", migrate=((2, 1),)), interleaved, num_experts=8)


def test_a_plan_file_entry_with_migrate_round_trips_and_auto_takes_it(tmp_path, monkeypatch):
    from overlap.plans import Entry, PlanFile
    from overlap.plans.auto import resolve_auto

    p = moe(backward=True)
    plan = Plan("hierarchical", (("network", 2), ("shm", 1)), migrate=((0, 1), (4, 0)))
    pf = PlanFile.new(TOPOLOGY, 4, profile(gbit(0.1)))
    pf.add(Entry(p, plan, 0.5, 0.7, 0.4))
    path = tmp_path / "plans.json"
    pf.save(path)
    assert PlanFile.load(path).lookup(p) == plan
    two_nodes = info_of(["a", "a", "b", "b"])
    got = resolve_auto("dispatch_grouped_matmul", "moe dispatch_grouped_matmul", two_nodes, None, "float32",
                       problem=moe(tokens=1000, backward=True), plan_file=str(path))
    assert got == plan  # the layer's entry, whatever this rank's token count
    monkeypatch.delenv("OVERLAP_PLAN", raising=False)
    fit_plan("dispatch_grouped_matmul", got, two_nodes, num_experts=8)
    no_file = resolve_auto("dispatch_grouped_matmul", "moe dispatch_grouped_matmul", two_nodes, None, "float32",
                           problem=p)
    assert not no_file.migrate  # auto's default never migrates
