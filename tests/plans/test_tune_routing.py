"""`overlap tune` for a given MoE routing (``--routing``, `overlap.tune.search.tune`'s `routing`): the shares are
parsed and checked before any rank starts, decide the model's expert-migration candidates, and draw the measured
calls' tokens (each token's ``K`` experts in proportion to its node's shares). Counts and choices, no timings."""

from __future__ import annotations

import json

import pytest
import torch

from overlap.cli.tune import TuneConfig, parse_routing, problems_of
from overlap.plans import Problem, Topology, expected_loads, rank_candidates
from overlap.workloads import moe as moe_workload
from overlap.workloads.data import SeededDraw


def test_routing_is_shares_or_a_json_file(tmp_path):
    assert parse_routing("6,1,1,1") == (6.0, 1.0, 1.0, 1.0)
    path = tmp_path / "loads.json"
    path.write_text(json.dumps([[3, 1], [1, 3], [0, 2], [2, 0]]))
    assert parse_routing(f"@{path}") == ((3.0, 1.0), (1.0, 3.0), (0.0, 2.0), (2.0, 0.0))
    path.write_text(json.dumps({"e0": 1}))
    for bad in ("1,a", "1,-2", f"@{path}", "@/nonexistent.json", ""):
        with pytest.raises(ValueError, match="--routing"):
            parse_routing(bad)
    path.write_text(json.dumps([1, [1, 2]]))
    with pytest.raises(ValueError, match="one per expert"):
        parse_routing(f"@{path}")


def test_routing_must_fit_the_moe_problems():
    config = TuneConfig(["moe:16x8x8:4:2"], None, "out.json", routing="1,1,1,1")
    assert [p.experts for p in problems_of(config, 2)] == [4]
    for routing, message in (("1,1,1", "gives 3 experts' shares"), ("1,1", "gives 2")):
        with pytest.raises(ValueError, match=message):
            problems_of(TuneConfig(["moe:16x8x8:4:2"], None, "out.json", routing=routing), 2)
    with pytest.raises(ValueError, match="MoE problems' routing"):
        problems_of(TuneConfig(["all_gather_matmul:8x8x8"], None, "out.json", routing="1,1"), 2)


def test_the_measured_tokens_follow_the_shares():
    p = Problem("moe", 256, 16, 16, experts=8, top_k=2)
    shares = [12, 1, 1, 1, 12, 1, 1, 0]
    inputs = moe_workload.inputs(p, 2, SeededDraw(3, 0, "cpu", torch.float32), shares=shares)
    idx = inputs.routing
    assert idx.shape == (256, 2) and bool((idx[:, 0] != idx[:, 1]).all())  # K distinct experts per token
    counts = torch.bincount(idx.reshape(-1), minlength=8)
    assert counts[7] == 0  # a share of 0: never drawn
    assert min(counts[0], counts[4]) > max(counts[1:4].max(), counts[5:7].max()) * 3  # the hot experts
    again = moe_workload.inputs(p, 2, SeededDraw(3, 0, "cpu", torch.float32), shares=shares)
    assert torch.equal(again.routing, idx)  # seeded: every candidate of a problem gets the same tokens
    with pytest.raises(ValueError, match="at least top_k=2"):
        moe_workload.inputs(p, 2, SeededDraw(3, 0, "cpu", torch.float32), shares=[1, 0, 0, 0, 0, 0, 0, 0])


def test_the_routing_decides_the_migration_candidates():
    from overlap.plans import GemmFit, LinkFit, Profile

    topology = Topology("cpu", 4, 2, 2, (("shm", 1), ("network", 2)))
    p = Problem("moe", 2048, 512, 1024, experts=8, top_k=2)
    slow = Profile({"shm": {"p2p": LinkFit(1e-4, 0.3e9), "copy": LinkFit(2e-5, 3e9)},
                    "network": {"p2p": LinkFit(1e-4, 0.1e9 / 8)}}, {"float32": GemmFit(7e10, 2e-5)},
                   gemm_slowdown=1.3, comm_slowdown=1.3, per_chunk_s=3e-5)
    hot = (0.3, 0.05, 0.05, 0.05, 0.3, 0.05, 0.15, 0.05)
    skewed = {plan.migrate for plan, _ in rank_candidates(p, topology, slow, expected_loads(p, topology, hot))}
    balanced = {plan.migrate for plan, _ in rank_candidates(p, topology, slow)}
    assert skewed - {()} and skewed != balanced  # the hot experts' pairs: candidates balanced routing has not


def tune_task(rank, world_size, routing):
    from overlap.tune import search

    problem = Problem("moe", 32, 16, 16, experts=4, top_k=2, backward=True)
    _pf, outcomes = search.tune([problem], routing=routing, repeats=1, warmup=0, measure=1, timeout=60)
    (o,) = outcomes
    return [(t.plan.describe(), t.error) for t in o.trials], o.chosen.plan.describe()


def test_tune_with_a_routing_measures_every_family_right(pools):
    results = pools(2).run(tune_task, (3.0, 1.0, 0.0, 2.0), timeout=300)
    assert results[0] == results[1], "ranks ended on different plans"
    trials, _chosen = results[0]
    assert all(not error for _, error in trials), trials  # every candidate agrees with reference on these tokens
    strategies = {plan.split("(")[0].split("[")[0] for plan, _ in trials}
    assert {"reference", "pipelined", "symm"} <= strategies, trials
