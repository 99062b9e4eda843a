"""Tier 1, the plans layer: the cost model (`overlap.plans.predict` and friends), plan files
(`overlap.plans.planfile`), `Plan` and `auto`'s rules (`overlap.plans.auto`).

Single process, no ranks. Properties are drawn by hypothesis with a bounded, derandomized example count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import overlap
from overlap import envs, plans, world
from overlap.plans import (
    CHUNK_CHOICES,
    GemmFit,
    LinkFit,
    Plan,
    Problem,
    Profile,
    Topology,
    auto,
    candidates,
    default_profile,
    predict,
    rank_candidates,
    topology_of,
)
from overlap.plans.costmodel import pipeline_makespan
from overlap.plans.planfile import PLAN_FILE_VERSION, Entry, PlanFile, load_cached
from overlap.world import LINK_CLASSES

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TOPOLOGIES = [
    Topology("cpu", 1, 1, 1, ()),
    Topology("cpu", 2, 1, 2, (("shm", 1),)),
    Topology("cpu", 3, 1, 3, (("shm", 2),)),
    Topology("cpu", 2, 2, 1, (("network", 1),)),
    Topology("cpu", 4, 2, 2, (("shm", 1), ("network", 2))),
    Topology("cuda", 8, 1, 8, (("nvlink", 7),)),
    Topology("cuda", 4, 1, 4, (("nvlink", 1), ("pcie", 2))),
    Topology("cuda", 16, 2, 8, (("nvlink", 7), ("network", 8))),
    Topology("cuda", 12, 3, 4, (("nvlink", 1), ("pcie", 2), ("network", 8))),
]
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul", "moe")


def rel_le(a: float, b: float) -> bool:
    return a <= b * (1 + 1e-9) + 1e-15


# ---- strategies ----------------------------------------------------------------------------------


@st.composite
def profiles(draw, ideal: bool = False) -> Profile:
    """Any machine; `ideal`: no latency, no per-call or per-chunk cost, no interference, copy == p2p."""
    seconds = st.floats(0, 1e-3)
    rate = st.floats(1e7, 1e12)
    links = {}
    for c in LINK_CLASSES:
        p2p = LinkFit(0.0 if ideal else draw(seconds), draw(rate))
        links[c] = {"p2p": p2p, "copy": p2p if ideal else LinkFit(draw(seconds), draw(rate))}
    gemm = {d: GemmFit(draw(st.floats(1e9, 1e15)), 0.0 if ideal else draw(st.floats(0, 1e-4)))
            for d in ("float32", "bfloat16", "float16")}
    slowdown = st.just(1.0) if ideal else st.floats(1.0, 2.0)
    return Profile(links, gemm, gemm_slowdown=draw(slowdown), comm_slowdown=draw(slowdown),
                   per_chunk_s=0.0 if ideal else draw(st.floats(0, 1e-4)), device="test")


@st.composite
def problems(draw, topology: Topology, min_dim: int = 1) -> Problem:
    op = draw(st.sampled_from(OPS))
    dims = [draw(st.integers(min_dim, 4096)) for _ in range(3)]
    moe = {}
    if op == "moe":
        experts = topology.world_size * draw(st.integers(1, 8))
        moe = {"experts": experts, "top_k": draw(st.integers(1, min(experts, 8)))}
    return Problem(op, *dims, dtype=draw(st.sampled_from(("float32", "bfloat16", "float16"))),
                   backward=draw(st.booleans()), **moe)


@st.composite
def cases(draw, ideal: bool = False, min_dim: int = 1):
    """(problem, plan, topology, profile): any plan `candidates` offers, plus symm on GPUs' PCIe islands."""
    topology = draw(st.sampled_from(TOPOLOGIES))
    problem = draw(problems(topology, min_dim))
    plan = draw(st.sampled_from(candidates(problem, topology)))
    return problem, plan, topology, draw(profiles(ideal))


def scaled_link(profile: Profile, link: str, bandwidth: float = 1.0, latency: float = 1.0) -> Profile:
    fits = {t: LinkFit(f.latency_s * latency, f.bandwidth_Bps * bandwidth) for t, f in profile.links[link].items()}
    return dataclasses.replace(profile, links={**profile.links, link: fits})


# ---- properties ----------------------------------------------------------------------------------


@PROPERTY
@given(cases(), st.sampled_from(LINK_CLASSES), st.floats(1.0, 100.0))
def test_more_bandwidth_never_slower_more_latency_never_faster(case, link, factor):
    problem, plan, topology, profile = case
    base = predict(problem, plan, topology, profile).total_s
    faster = predict(problem, plan, topology, scaled_link(profile, link, bandwidth=factor)).total_s
    slower = predict(problem, plan, topology, scaled_link(profile, link, latency=factor)).total_s
    chunky = predict(problem, plan, topology, dataclasses.replace(profile, per_chunk_s=profile.per_chunk_s * factor))
    assert rel_le(faster, base), (problem, plan.describe(), topology.signature, link, faster, base)
    assert rel_le(base, slower), (problem, plan.describe(), topology.signature, link, slower, base)
    assert rel_le(base, chunky.total_s), (problem, plan.describe(), topology.signature, chunky.total_s, base)


@PROPERTY
@given(cases(min_dim=8), st.sampled_from(("m", "k", "n")), st.floats(1.0, 10.0))
def test_bigger_or_slower_gemms_take_longer(case, dim, factor):
    problem, plan, topology, profile = case
    base = predict(problem, plan, topology, profile)
    bigger = dataclasses.replace(problem, **{dim: 2 * getattr(problem, dim)})
    grown = predict(bigger, plan, topology, profile)
    assert rel_le(base.total_s, grown.total_s) and rel_le(base.compute_s, grown.compute_s), \
        (problem, dim, plan.describe(), topology.signature, base, grown)
    slow = {d: GemmFit(f.peak_flops / factor, f.overhead_s * factor) for d, f in profile.gemm.items()}
    slowed = predict(problem, plan, topology, dataclasses.replace(profile, gemm=slow))
    assert rel_le(base.total_s, slowed.total_s), (problem, plan.describe(), base, slowed)


@PROPERTY
@given(cases())
def test_prediction_bounds(case):
    """reference = comm + compute; an overlapped plan lies between max(comm, compute) and their sum (times
    the worse interference factor)."""
    problem, plan, topology, profile = case
    p = predict(problem, plan, topology, profile)
    what = (problem, plan.describe(), topology.signature, p)
    assert math.isfinite(p.total_s) and p.comm_s >= 0 and p.compute_s > 0, what
    if plan.strategy == "reference":
        assert p.total_s == pytest.approx(p.comm_s + p.compute_s, rel=1e-12), what
        return
    assert rel_le(max(p.comm_s, p.compute_s), p.total_s), what
    worst = max(profile.gemm_slowdown, profile.comm_slowdown)
    assert rel_le(p.total_s, worst * (p.comm_s + p.compute_s)), what
    plain = dataclasses.replace(profile, gemm_slowdown=1.0, comm_slowdown=1.0)
    q = predict(problem, plan, topology, plain)
    assert rel_le(q.total_s, q.comm_s + q.compute_s), (what, q)
    assert rel_le(q.total_s, p.total_s), (what, q)  # interference never helps


@PROPERTY
@given(cases(ideal=True))
def test_overlap_never_slower_than_reference_on_an_ideal_machine(case):
    """With no latency, per-call or per-chunk cost and no interference, hiding transfers only helps (the
    one-shot all-reduce moves more bytes than a ring, so it is left out)."""
    problem, plan, topology, profile = case
    if plan.one_shot:
        return
    ref = predict(problem, Plan("reference"), topology, profile)
    p = predict(problem, plan, topology, profile)
    assert rel_le(p.total_s, ref.total_s), (problem, plan.describe(), topology.signature, p, ref)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=6),
       st.floats(1.0, 3.0), st.floats(1.0, 3.0))
def test_makespan_closed_form_matches_every_path(stages, fa, fb):
    """The grouped closed form equals the maximum over every single stage's path, and without interference
    the two-resource flow shop simulated stage by stage."""
    items = [(a, b) for c, a, b in stages for _ in range(c)]
    if not items:
        assert pipeline_makespan(stages, fa, fb) == 0.0
        return
    total_a, total_b = sum(a for a, _ in items), sum(b for _, b in items)
    paths = []
    for i in range(len(items)):
        a_le, b_lt = sum(a for a, _ in items[: i + 1]), sum(b for _, b in items[:i])
        b_ge, a_gt = total_b - b_lt, total_a - a_le
        paths.append(a_le + (fa - 1) * min(a_le, b_lt) + b_ge + (fb - 1) * min(b_ge, a_gt))
    assert pipeline_makespan(stages, fa, fb) == pytest.approx(max(paths), rel=1e-9, abs=1e-12)
    end_a = end_b = 0.0
    for a, b in items:
        end_a += a
        end_b = max(end_a, end_b) + b
    assert pipeline_makespan(stages, 1.0, 1.0) == pytest.approx(end_b, rel=1e-9, abs=1e-12)


# ---- chunking ------------------------------------------------------------------------------------

TWO_NODES = Topology("cpu", 2, 2, 1, (("network", 1),))
AG = Problem("all_gather_matmul", 1024, 1024, 1024)  # 21 ms per block GEMM at 100 GFLOP/s, 4 MiB per transfer


def network_profile(latency: float, bandwidth: float, per_chunk: float = 0.0, slowdown: float = 1.0) -> Profile:
    return Profile({"network": {"p2p": LinkFit(latency, bandwidth)}}, {"float32": GemmFit(1e11, 0.0)},
                   gemm_slowdown=slowdown, comm_slowdown=slowdown, per_chunk_s=per_chunk)


def best_network_chunks(problem: Problem, profile: Profile) -> int:
    plan = next(p for p, _ in rank_candidates(problem, TWO_NODES, profile) if p.strategy != "reference")
    return plan.chunks_for("network")


def total(plan: Plan, profile: Profile, problem: Problem = AG) -> float:
    return predict(problem, plan, TWO_NODES, profile).total_s


def test_chunking_helps_when_transfer_and_gemm_are_comparable_and_latency_small():
    profile = network_profile(1e-6, 1e8)  # 42 ms transfer against 2 x 21 ms of GEMMs
    one, four = (total(Plan("pipelined", {"network": c}), profile) for c in (1, 4))
    assert four < 0.8 * one, (one, four)
    assert total(Plan("pipelined", {"network": 4}), profile) < total(Plan("reference"), profile)


def test_chunking_hurts_when_per_chunk_overhead_dominates():
    for profile in (network_profile(1e-6, 1e8, per_chunk=20e-3), network_profile(30e-3, 1e8)):
        one, eight = (total(Plan("pipelined", {"network": c}), profile) for c in (1, 8))
        assert eight > one, (profile, one, eight)


@pytest.mark.parametrize("slowdown", [1.0, 1.3])
def test_chosen_chunking_follows_the_link_rate(slowdown):
    """Higher latency: fewer chunks; less bandwidth (from GEMM-bound to transfer-bound): more chunks."""
    by_latency = [best_network_chunks(AG, network_profile(lat, 1e8, slowdown=slowdown))
                  for lat in (1e-6, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2)]
    assert by_latency == sorted(by_latency, reverse=True) and by_latency[0] > by_latency[-1], by_latency
    by_bandwidth = [best_network_chunks(AG, network_profile(1e-6, bw, slowdown=slowdown))
                    for bw in (1e11, 1e9, 2e8, 1e8, 1e7)]
    assert by_bandwidth == sorted(by_bandwidth) and by_bandwidth[0] < by_bandwidth[-1], by_bandwidth
    moe = Problem("moe", 1024, 512, 1024, experts=8, top_k=2)
    fast, slow = (best_network_chunks(moe, network_profile(lat, 1e8, slowdown=slowdown)) for lat in (1e-6, 1e-2))
    assert fast > slow, (fast, slow)


def test_one_shot_all_reduce_wins_for_small_outputs_two_shot_for_large():
    topology, profile = Topology("cuda", 8, 1, 8, (("nvlink", 7),)), default_profile("cuda")
    small = rank_candidates(Problem("matmul_all_reduce", 2, 4096, 512, "bfloat16"), topology, profile)[0][0]
    large = rank_candidates(Problem("matmul_all_reduce", 4096, 4096, 8192, "bfloat16"), topology, profile)[0][0]
    assert small.one_shot and not large.one_shot, (small, large)


# ---- candidates ----------------------------------------------------------------------------------


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: t.signature)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backward", [False, True])
def test_candidates_are_runnable_and_few(topology, op, backward):
    moe = {"experts": 4 * topology.world_size, "top_k": 2} if op == "moe" else {}
    problem = Problem(op, 256, 512, 1024, backward=backward, **moe)
    plans = candidates(problem, topology)
    strategies = {p.strategy for p in plans}
    assert Plan("reference") in plans and len(plans) == len(set(plans)) and len(plans) < 60, plans
    if topology.world_size == 1:
        assert plans == [Plan("reference")]
        return
    if topology.num_nodes > 1:  # hierarchical: CPU ranks, as many on every node, two at least; the TP ops with it
        hier = topology.device == "cpu" and len(set(topology.ranks_per_node)) == 1 and topology.ranks_per_node[0] > 1 \
            and "hierarchical" in overlap.plans.OPS[op].strategies
        assert strategies == {"reference", "pipelined"} | ({"hierarchical"} if hier else set()), strategies
    else:
        assert strategies == ({"reference", "pipelined", "symm"} | ({"fused"} if topology.device == "cuda" else set()))
    assert {p.one_shot for p in plans if p.strategy != "reference"} == ({False, True} if op == "matmul_all_reduce"
                                                                        else {False})
    present = {c for c, _ in topology.links}
    for p in plans:
        assert {c for c, _ in p.num_chunks} <= present and all(n in CHUNK_CHOICES for _, n in p.num_chunks), p
    assert len(candidates(problem, topology, "cpu")) <= len(plans)
    assert not any(p.strategy == "fused" for p in candidates(problem, topology, "cpu"))
    ranked = rank_candidates(problem, topology, default_profile(topology.device))
    assert [p for p, _ in ranked] == sorted(plans, key=lambda p: (predict(problem, p, topology, default_profile(
        topology.device)).total_s, p.describe()))
    assert all(math.isfinite(x.total_s) for _, x in ranked)


def test_cannot_run_predicts_inf_and_bad_input_raises():
    cpu, two_nodes = TOPOLOGIES[1], TOPOLOGIES[7]
    problem = Problem("all_gather_matmul", 64, 64, 64)
    assert predict(problem, Plan("fused"), cpu, default_profile("cpu")).total_s == math.inf
    assert predict(problem, Plan("symm"), two_nodes, default_profile("cuda")).total_s == math.inf
    with pytest.raises(ValueError, match="one_shot"):
        predict(problem, Plan("symm", one_shot=True), cpu, default_profile("cpu"))
    with pytest.raises(ValueError, match="link class 'nvlink'"):
        predict(problem, Plan("pipelined"), TOPOLOGIES[5], default_profile("cpu"))
    with pytest.raises(ValueError, match="divide"):
        predict(Problem("moe", 8, 8, 8, experts=3, top_k=1), Plan("pipelined"), cpu, default_profile("cpu"))
    with pytest.raises(ValueError, match="device"):
        default_profile("tpu")


def test_default_profiles_are_plausible():
    cpu, gpu = default_profile("cpu"), default_profile("cuda:3")
    assert gpu.links["nvlink"]["copy"].bandwidth_Bps == pytest.approx(350e9, rel=0.2)
    assert 600e12 <= gpu.gemm["bfloat16"].peak_flops <= 800e12  # (the h100-sxm preset's)
    assert gpu.gemm["float8_e4m3fn"].peak_flops > gpu.gemm["bfloat16"].peak_flops > gpu.gemm["float32"].peak_flops
    assert 25e9 <= gpu.links["network"]["p2p"].bandwidth_Bps <= 50e9
    assert cpu.links["shm"]["copy"].bandwidth_Bps > cpu.links["shm"]["p2p"].bandwidth_Bps
    assert Profile.from_json(json.loads(json.dumps(gpu.to_json()))) == gpu


# ---- topology and problem ------------------------------------------------------------------------


def group(nodes, rank=0, device="cpu", peer_access=None):
    n = len(nodes)
    return world.GroupInfo(rank=rank, world_size=n, global_ranks=tuple(range(n)), nodes=tuple(nodes),
                           pids=tuple(range(n)), backend="gloo", device=torch.device(device),
                           peer_access=tuple(peer_access or [False] * n))


def test_topology_of_groups():
    nodes = ("a", "a", "b", "b")
    tops = {topology_of(group(nodes, r)) for r in range(4)}
    assert len(tops) == 1  # the same on every rank
    (t,) = tops
    assert t.signature == "cpu:nodes=2:ranks=4:links=network*2,shm*1"
    assert t.links == (("shm", 1), ("network", 2)) and t.slowest_link == "network" and t.ranks_per_node == (2, 2)
    gpu = topology_of(group(("x",) * 3, 0, "cuda", [True, True, False]))
    assert gpu.links == (("nvlink", 1), ("pcie", 1)) and gpu.slowest_link == "pcie"
    assert topology_of(group(("x",), 0)).signature == "cpu:nodes=1:ranks=1:links="
    uneven = topology_of(group(("a", "a", "a", "b"), 3))
    assert uneven.signature == "cpu:nodes=2:ranks=4:per_node=3,1:links=network*3"
    with pytest.raises(ValueError, match="add up"):
        Topology("cpu", 4, 1, 4, (("shm", 2),))
    with pytest.raises(ValueError, match="link"):
        Topology("cpu", 2, 1, 2, (("infiniband", 1),))


def test_problem_key_and_checks():
    assert Problem("matmul_all_reduce", 64, 1024, 512, "bfloat16").key == "matmul_all_reduce:64x1024x512:bfloat16:fwd"
    assert Problem("moe", 512, 128, 448, backward=True, experts=8, top_k=2).key == \
        "moe:512x128x448:float32:fwd+bwd:experts=8:top_k=2"
    for bad in (dict(op="gemm"), dict(m=0), dict(dtype="int8"), dict(experts=4), dict(backward=1)):
        with pytest.raises(ValueError):
            Problem(**{"op": "all_gather_matmul", "m": 1, "k": 1, "n": 1, **bad})
    with pytest.raises(ValueError):
        Problem("moe", 1, 1, 1, experts=2, top_k=3)


# ---- plan files ----------------------------------------------------------------------------------

TOPO = TOPOLOGIES[4]
P1 = Problem("all_gather_matmul", 256, 512, 1024, "bfloat16", backward=True)
P2 = Problem("moe", 512, 128, 448, experts=8, top_k=2)


def sample_file() -> PlanFile:
    f = PlanFile.new(TOPO, TOPO.world_size, default_profile("cpu"))
    f.add(Entry(P1, Plan("pipelined", {"network": 4, "shm": 1}), 0.003, 0.004, 0.0029))
    f.add(Entry(P2, Plan("pipelined", {"network": 2}), measured_s=0.005, reference_s=0.004))
    f.add(Entry(Problem("matmul_all_reduce", 8, 64, 64), Plan("pipelined", one_shot=True, block_m=64)))
    return f


def test_plan_file_round_trip_and_lookup(tmp_path):
    f = sample_file()
    path = tmp_path / "sub" / "plans.json"
    f.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["plans.json"]  # no temporary file left behind
    g = PlanFile.load(path)
    assert g == f and g.version == PLAN_FILE_VERSION and g.path == str(path)
    assert json.loads(path.read_text())["entries"][P1.key]["plan"]["num_chunks"] == {"network": 4, "shm": 1}
    g.check_topology(TOPO)
    assert g.lookup(P1) == Plan("pipelined", {"network": 4, "shm": 1})
    assert g.lookup(P2) == Plan("reference")  # measured slower than reference
    assert g.lookup(dataclasses.replace(P1, backward=False)) is None


def test_plan_file_version_and_topology_mismatch(tmp_path):
    path = tmp_path / "plans.json"
    data = sample_file().to_json()
    data["version"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"has version 7; this overlap reads version 1: re-run overlap tune"):
        PlanFile.load(path)
    other = TOPOLOGIES[3]
    with pytest.raises(ValueError) as exc:
        sample_file().check_topology(other)
    assert TOPO.signature in str(exc.value) and other.signature in str(exc.value) and "re-tune" in str(exc.value)


@pytest.mark.parametrize("damage", ["truncated", "not json", "list", "no entries", "bad plan", "bad problem",
                                    "entry without plan", "bad seconds", "bad profile", "missing file"])
def test_plan_file_damage_raises_value_error(tmp_path, damage):
    path = tmp_path / "plans.json"
    sample_file().save(path)
    text = path.read_text()
    data = json.loads(text)
    entry = data["entries"][P1.key]
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_bytes(b"\xff\xfe garbage")
    elif damage == "list":
        path.write_text("[1, 2]")
    else:
        if damage == "no entries":
            del data["entries"]
        elif damage == "bad plan":
            entry["plan"]["strategy"] = "magic"
        elif damage == "bad problem":
            entry["problem"]["m"] = -1
        elif damage == "entry without plan":
            del entry["plan"]
        elif damage == "bad seconds":
            entry["measured_s"] = "fast"
        elif damage == "bad profile":
            data["profile"] = {"version": 1, "links": 3}
        if damage == "missing file":
            path = tmp_path / "nowhere.json"
        else:
            path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="plan file"):
        PlanFile.load(path)


def test_load_cached_rereads_a_rewritten_file(tmp_path):
    path = tmp_path / "plans.json"
    f = sample_file()
    f.save(path)
    first = load_cached(path)
    assert load_cached(str(path)) is first
    f.add(Entry(Problem("matmul_reduce_scatter", 8, 8, 8), Plan("symm")))
    f.save(path)
    st_ = os.stat(path)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # a new mtime even on coarse clocks
    second = load_cached(path)
    assert second is not first and len(second.entries) == len(first.entries) + 1


def test_plan_path_env(monkeypatch):
    monkeypatch.delenv("OVERLAP_PLAN", raising=False)
    assert envs.plan_path() is None
    monkeypatch.setenv("OVERLAP_PLAN", "~/plans.json")
    assert envs.plan_path() == os.path.expanduser("~/plans.json")
    assert "OVERLAP_PLAN" in envs.VARIABLES


# ---- Plan and auto -------------------------------------------------------------------------------


def test_plan_validates_and_describes():
    p = overlap.Plan("symm", num_chunks={"shm": 3, "network": 2})
    assert p.chunks_for("shm") == 3 and p.chunks_for("nvlink") == plans.DEFAULT_CHUNKS["nvlink"]
    assert p.describe() == "symm[network=2,shm=3]"
    assert hash(p) == hash(overlap.Plan("symm", num_chunks={"network": 2, "shm": 3}))
    with pytest.raises(ValueError, match="strategy"):
        overlap.Plan("magic")
    with pytest.raises(ValueError, match="link class"):
        overlap.Plan("symm", num_chunks={"infiniband": 2})
    with pytest.raises(ValueError, match=">= 1"):
        overlap.Plan("pipelined", num_chunks={"shm": 0})
    with pytest.raises(ValueError, match="power of two"):
        overlap.Plan("fused", block_m=48)


def test_as_plan_rules():
    assert auto.as_plan("auto", None) is None
    assert auto.as_plan("symm", None) == overlap.Plan("symm")
    assert auto.as_plan("auto", {"strategy": "fused", "block_m": 32}).block_m == 32
    with pytest.raises(ValueError, match="contradicts"):
        auto.as_plan("symm", overlap.Plan("pipelined"))
    with pytest.raises(TypeError):
        auto.as_plan("auto", 3)


def test_auto_heuristic_is_documented_and_never_fused_on_cpu(monkeypatch):
    sig = "a=(8, 16):float32, b=(16, 4)"
    assert auto.resolve_auto("op", sig, group(["a"]), 8, "float32").strategy == "reference"
    assert auto.resolve_auto("op", sig, group(["a", "a"]), 4096, "bfloat16").strategy == "symm"
    assert auto.resolve_auto("op", sig, group(["a", "b"]), 8, "float32").strategy == "pipelined"
    gpu = group(["a", "a"], device="cuda", peer_access=[True, True])
    monkeypatch.setattr(auto, "gpu_symmetric_memory", lambda: True)
    assert auto.resolve_auto("op", sig, gpu, 4096, "bfloat16").strategy == "fused"
    assert auto.resolve_auto("op", sig, gpu, 64, "bfloat16").strategy == "symm"
    monkeypatch.setattr(auto, "gpu_symmetric_memory", lambda: False)
    with pytest.warns(UserWarning, match="falls back to 'pipelined'"):
        assert auto.resolve_auto("op", sig + "x", gpu, 4096, "bfloat16").strategy == "pipelined"
    with pytest.raises(ValueError, match="spans nodes"):
        auto.fit_plan("op", overlap.Plan("fused"), group(["a", "b"]))



# ---- the fixed cost of a call (Profile.call_s) -------------------------------------------------


def _protocol_costly(device: str, name: str = "") -> Profile:
    """The default profile of `device` whose overlapped plans cost 1 ms per call, the plain collectives nothing."""
    return dataclasses.replace(default_profile(device), call_s={"reference": 0.0, "pipelined": 1e-3, "symm": 1e-3,
                                                                "fused": 1e-3, "hierarchical": 1e-3})


@pytest.mark.parametrize("op,calls", [("all_gather_matmul", (1, 2)), ("matmul_reduce_scatter", (1, 1)),
                                      ("matmul_all_reduce", (1, 0)), ("all_gather_weight_matmul", (1, 2))])
def test_a_call_is_charged_its_strategy_fixed_cost_per_call(op, calls):
    """`predict` adds `Profile.call_s[strategy]` once per call of the forward and of the backward (`OpSpec.calls`)."""
    topology = TOPOLOGIES[5]
    free = dataclasses.replace(default_profile("cuda"), call_s={})
    costly = dataclasses.replace(free, call_s={"symm": 7e-5, "reference": 3e-5})
    for backward in (False, True):
        p = Problem(op, 64, 1024, 512, "bfloat16", backward)
        n = calls[0] + (calls[1] if backward else 0)
        for strategy, each in (("symm", 7e-5), ("reference", 3e-5), ("pipelined", 0.0)):
            extra = predict(p, Plan(strategy), topology, costly).total_s - predict(p, Plan(strategy), topology,
                                                                                   free).total_s
            assert extra == pytest.approx(n * each, rel=1e-9, abs=1e-15), (op, backward, strategy)
            assert plans.costmodel.call_cost(p, strategy, costly) == pytest.approx(n * each)


@pytest.mark.parametrize("topology", [TOPOLOGIES[1], TOPOLOGIES[5]], ids=["cpu", "cuda"])
def test_per_call_costs_make_the_plain_plan_win_small_calls_only(topology):
    """From a given profile where an overlapped call costs 1 ms more than a plain one: the plain collectives rank
    first for a decode-sized call, an overlapped plan for a call whose overlap saves more than that."""
    profile = _protocol_costly(topology.device)
    dtype = "bfloat16" if topology.device == "cuda" else "float32"
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        small = Problem(op, 2, 256, 256, dtype)
        assert rank_candidates(small, topology, profile)[0][0] == Plan("reference"), op
        big = Problem(op, 1 << 16, 4096, 4096, dtype)
        assert rank_candidates(big, topology, profile)[0][0].strategy != "reference", op


def test_auto_takes_the_plain_plan_where_the_profile_says_the_protocol_costs_more(monkeypatch):
    """`auto` on one node without a plan file: the heuristic's plan, but ``reference`` where the cost model with the
    device's default profile predicts the plain collectives faster (here a given profile stands in for it)."""
    monkeypatch.delenv("OVERLAP_PLAN", raising=False)
    info = world.GroupInfo(0, 2, (0, 1), ("n",) * 2, (1, 2), "gloo", torch.device("cpu"), (False,) * 2)

    def choice(m: int, op: str = "all_gather_matmul") -> Plan:
        problem = Problem(op, m, 256, 256, "float32")
        return auto.resolve_auto(op, f"sig {op} {m}", info, m, "float32", out_bytes=m * 256 * 4, problem=problem)

    monkeypatch.setattr(auto, "default_profile", _protocol_costly)
    auto._plain_is_cheaper.cache_clear()
    try:
        assert choice(2) == Plan("reference") and choice(2, "matmul_all_reduce") == Plan("reference")
        assert choice(1 << 16).strategy == "symm"  # the overlap saves more than the protocol costs
        monkeypatch.setattr(auto, "default_profile", lambda device, name="": dataclasses.replace(
            default_profile(device), call_s={}))  # no per-call costs: the heuristic's plan everywhere
        auto._plain_is_cheaper.cache_clear()
        assert choice(2).strategy == "symm" and choice(2, "matmul_all_reduce") == Plan("symm", one_shot=True)
    finally:
        auto._plain_is_cheaper.cache_clear()
    # the real default CPU profile (measured per-call costs: gloo's collectives cost more than shared-memory flags)
    assert choice(2).strategy == "symm" and choice(8, "matmul_reduce_scatter").strategy == "symm"
