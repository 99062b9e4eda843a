"""Tier 1: GPU machines by name (`overlap.plans.presets`), the cost model's view of a described cluster
(`overlap.plans.forecast`) and ``auto``'s choice there (`overlap.plans.auto.described_plan`).

Single process, no ranks, no GPU: every preset, every op family, forward and backward, bf16 and fp8."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap.plans import GemmFit, LinkFit, Plan, Problem, Profile, default_profile, predict, presets
from overlap.plans.auto import described_plan
from overlap.plans.costmodel import call_cost
from overlap.plans.forecast import forecast
from overlap.plans.optable import OPS, TRAINING_DTYPES

PROPERTY = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = tuple(presets.PRESETS)
REQUIRED = ("h100-sxm", "h800", "h200", "a100-sxm", "h20", "b200", "mi300x")


def rel_le(a: float, b: float) -> bool:
    return a <= b * (1 + 1e-9) + 1e-15


def problems_for(op: str, dtype: str, backward: bool, W: int) -> list[Problem]:
    """A decode-sized, a middle and a large problem of `op` for W ranks."""
    if OPS[op].family == "moe":
        return [Problem(op, m, 4096, 1536, dtype, backward, 8 * W, 8) for m in (16, 1024, 8192)]
    return [Problem(op, m, 8192, 3584, dtype, backward) for m in (2, 256, 2048)]


def test_every_required_machine_has_a_complete_preset():
    assert set(REQUIRED) <= set(NAMES)
    for name, m in presets.PRESETS.items():
        assert m.name == name and m.about and m.sources and m.device_names, m
        for field in ("bf16_flops", "fp32_flops", "hbm_Bps", "link_Bps", "pcie_Bps", "nic_Bps"):
            assert getattr(m, field) > 0, (name, field)
        assert m.sms > 0 and m.gpus_per_node >= 2 and m.fp8_flops >= 0, m
        assert m.fp8_flops == 0 or m.fp8_flops > m.bf16_flops > m.fp32_flops, m  # FP8 doubles BF16's peak
        e = m.efficiency
        for field in ("gemm", "gemm_fp8", "gemm_fp32", "memory", "link_p2p", "link_copy", "pcie", "network"):
            assert 0 < getattr(e, field) <= 1, (name, field)  # a share of a peak
        assert e.sm_gemm_slowdown >= e.copy_gemm_slowdown >= 1.0 and e.comm_slowdown >= 1.0, (name, e)
        assert set(e.call_s) >= {"reference", "pipelined", "symm", "fused"}, e


@pytest.mark.parametrize("name", NAMES)
def test_profile_of_a_preset_covers_every_link_and_dtype_and_round_trips(name):
    m = presets.machine(name.upper().replace("-", "_"))  # case and separator do not matter
    profile = presets.profile_of(m)
    assert set(profile.links) == {"nvlink", "pcie", "network"} and set(profile.links["nvlink"]) == {"p2p", "copy"}
    assert set(TRAINING_DTYPES) <= set(profile.gemm), profile.gemm
    assert profile.links["nvlink"]["p2p"].bandwidth_Bps == pytest.approx(m.efficiency.link_p2p * m.link_Bps)
    assert profile.gemm["bfloat16"].peak_flops == pytest.approx(m.efficiency.gemm * m.bf16_flops)
    assert profile.gemm["bfloat16"].memory_Bps == pytest.approx(m.efficiency.memory * m.hbm_Bps)
    assert profile.gemm_slowdown_for("p2p") == m.efficiency.sm_gemm_slowdown
    assert profile.gemm_slowdown_for("copy") == m.efficiency.copy_gemm_slowdown
    assert Profile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert profile.device == m.device_names[0] and "not measured" in profile.machine


def test_unknown_machine_names_the_presets():
    with pytest.raises(ValueError, match="h100-sxm.*mi300x"):
        presets.machine("h900")


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (8, 1), (4, 1), (8, 2), (2, 4)])
def test_cluster_topology(gpus, nodes):
    t = presets.topology_of_cluster(gpus, nodes)
    assert t.world_size == gpus * nodes and t.num_nodes == nodes and t.ranks_per_node == (gpus,) * nodes
    assert dict(t.links) == {k: v for k, v in (("nvlink", gpus - 1), ("network", gpus * (nodes - 1))) if v}
    assert t.device == "cuda"
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError):
            presets.topology_of_cluster(bad, nodes)


def test_default_gpu_profile_is_the_preset_of_the_gpu():
    def plain(profile):
        return dataclasses.replace(profile, machine="")

    h100, h800 = presets.profile_of(presets.machine("h100-sxm")), presets.profile_of(presets.machine("h800"))
    assert plain(default_profile("cuda")) == plain(h100)  # no name, or a GPU without a preset: the H100's
    assert plain(default_profile("cuda:1", "NVIDIA L4")) == plain(h100)
    assert plain(default_profile("cuda", "NVIDIA H800")) == plain(h800)
    assert presets.for_device("AMD Instinct MI300X") is presets.PRESETS["mi300x"] and presets.for_device("x") is None


# ---- a measured profile replaces the preset's numbers ----------------------------------------------------------


def measured(device: str) -> Profile:
    return Profile({"nvlink": {"p2p": LinkFit(7e-6, 1.23e11), "copy": LinkFit(3e-6, 2e11)}},
                   {"bfloat16": GemmFit(5e14, 9e-6)}, device=device, machine="probed")


def test_a_measured_profile_of_the_same_gpu_replaces_the_preset(tmp_path):
    h100 = presets.machine("h100-sxm")
    (tmp_path / "profile-host-NVIDIA_H100-w8-nvlink.json").write_text(json.dumps(measured(h100.device_names[0])
                                                                                 .to_json()))
    (tmp_path / "profile-host-NVIDIA_H100-w8-nvlink-quick.json").write_text(json.dumps(measured(
        h100.device_names[0]).to_json()))  # a quick probe: never the replacement
    (tmp_path / "profile-host-other-w8-nvlink.json").write_text(json.dumps(measured("NVIDIA A100-SXM4-80GB")
                                                                           .to_json()))
    (tmp_path / "profile-host-broken-w8-nvlink.json").write_text("{not json")
    c = presets.cluster("h100-sxm", cache=tmp_path)
    probed, preset = measured(h100.device_names[0]), presets.profile_of(h100)
    assert c.measured.endswith("profile-host-NVIDIA_H100-w8-nvlink.json"), c
    fit = c.profile.gemm["bfloat16"]
    assert c.profile.links["nvlink"] == probed.links["nvlink"] and (fit.peak_flops, fit.overhead_s) == (
        probed.gemm["bfloat16"].peak_flops, probed.gemm["bfloat16"].overhead_s), c.profile  # the measured win ...
    assert c.profile.links["network"] == preset.links["network"] and c.profile.gemm["float32"] == preset.gemm[
        "float32"] and c.profile.call_s == preset.call_s  # ... the preset fills what the probe did not measure
    assert c.profile.gemm_slowdown == probed.gemm_slowdown  # measured beside a transfer
    assert "measured profile" in c.about
    assert presets.cluster("h100-sxm").measured == ""  # no cache given: the preset
    assert presets.cluster("h200", cache=tmp_path).measured == ""  # no H200 profile there
    a100 = presets.cluster("a100-sxm", cache=tmp_path)
    assert a100.profile.machine == "probed" and os.path.basename(a100.measured) == "profile-host-other-w8-nvlink.json"
    one_gpu = Profile({}, {"bfloat16": GemmFit(6e14, 7e-6)}, device=h100.device_names[0])  # a probe on one GPU
    done = presets.completed(one_gpu, preset)
    # the probe's GEMM rate and launch, the preset's HBM rate (the probe fits square GEMMs: no memory roofline)
    assert done.links == preset.links and done.gemm["bfloat16"] == GemmFit(6e14, 7e-6, preset.gemm["bfloat16"]
                                                                             .memory_Bps)
    decode = Problem("all_gather_matmul", 2, 8192, 3584, "bfloat16")
    topology = presets.topology_of_cluster(8)
    roofline = predict(decode, Plan("reference"), topology, done).compute_s
    flops_only = predict(decode, Plan("reference"), topology, dataclasses.replace(
        done, gemm={"bfloat16": GemmFit(6e14, 7e-6)})).compute_s
    assert roofline > 2 * flops_only, (roofline, flops_only)  # a decode GEMM reads its weight: memory-bound
    assert (done.gemm_slowdown, done.copy_gemm_slowdown, done.per_chunk_s) == (
        preset.gemm_slowdown, preset.copy_gemm_slowdown, preset.per_chunk_s)
    assert presets.cluster("b200", cache=tmp_path / "missing").measured == ""


# ---- the roofline and the interference by transport ---------------------------------------------------------


def test_gemm_fit_memory_roofline_and_old_profiles_load():
    fit = GemmFit(1e15, 5e-6, memory_Bps=2e12)
    assert fit.time(2e12) == pytest.approx(5e-6 + 2e-3)  # compute-bound
    assert fit.time(2e9, nbytes=1e9) == pytest.approx(5e-6 + 5e-4)  # memory-bound: 1 GB at 2 TB/s
    assert GemmFit(1e15, 0.0).time(2e9, nbytes=1e12) == pytest.approx(2e-6)  # no memory rate: flops alone
    data = presets.profile_of(presets.machine("h100-sxm")).to_json()
    for fit_json in data["gemm"].values():
        fit_json.pop("memory_Bps")
    data.pop("copy_gemm_slowdown")
    old = Profile.from_json(data)  # a profile saved before these fields existed
    assert old.gemm["bfloat16"].memory_Bps == 0 and old.gemm_slowdown_for("copy") == old.gemm_slowdown
    for field, value in (("copy_gemm_slowdown", -1.0), ("copy_gemm_slowdown", "1.1"), ("copy_gemm_slowdown", 1e9)):
        bad = dict(data, **{field: value})
        with pytest.raises(ValueError, match=field):
            Profile.from_json(bad)
    bad = json.loads(json.dumps(data))
    bad["gemm"]["bfloat16"]["memory_Bps"] = float("nan")
    with pytest.raises(ValueError, match="gemm.bfloat16.memory_Bps"):
        Profile.from_json(bad)


def test_decode_sized_chunks_are_memory_bound():
    """A chunked GEMM of a few rows reads its weight again per chunk: with the roofline, more chunks cost more
    even on an ideal link (a fused kernel, one GEMM, reads it once)."""
    c = presets.cluster("h100-sxm")
    p = Problem("all_gather_matmul", 4, 8192, 3584, "bfloat16")
    times = [predict(p, Plan("symm", (("nvlink", ch),)), c.topology, c.profile).compute_s for ch in (1, 2, 4)]
    assert times[0] < times[1] < times[2], times
    flops_only = dataclasses.replace(c.profile, gemm={d: dataclasses.replace(f, memory_Bps=0.0)
                                                      for d, f in c.profile.gemm.items()})
    assert predict(p, Plan("symm"), c.topology, flops_only).compute_s < times[0]


# ---- predict and auto on every preset and op family -------------------------------------------------------------


CASES = [(name, op, dtype, backward, nodes) for name in NAMES for op in OPS
         for dtype in ("bfloat16", "float8_e4m3fn", "mxfp8") if dtype == "bfloat16" or OPS[op].fp8
         for backward in (False, True) for nodes in (1, 2)]


@pytest.mark.parametrize("name, op, dtype, backward, nodes", CASES)
def test_forecast_runs_and_auto_is_never_slower_than_unfused(name, op, dtype, backward, nodes):
    c = presets.cluster(name, nodes=nodes)
    for p in problems_for(op, dtype, backward, c.topology.world_size):
        f = forecast(p, c.topology, c.profile)
        ref = f.reference
        what = (name, nodes, p.key)
        calls = call_cost(p, "reference", c.profile)
        assert math.isfinite(ref.total_s) and ref.total_s == pytest.approx(ref.comm_s + ref.compute_s + calls), what
        assert ref.comm_s > 0 and ref.compute_s > 0, what
        assert rel_le(f.auto.seconds, ref.total_s), (what, f.auto, ref)  # never slower than unfused
        labels = [r.label for r in f.rows]
        assert labels[0] == "reference" and len(labels) == len(set(labels)), labels
        runnable = {r.label for r in f.rows if math.isfinite(r.seconds)}
        if nodes > 1:
            assert not runnable & {"symm", "fused"}, (what, runnable)  # one node only
        else:
            assert {"pipelined", "symm"} & set(OPS[op].strategies) <= runnable, (what, runnable)
        best = f.best
        assert best is not None and 0 <= f.hidden(best) <= 1, what
        assert f.verdict.startswith(("overlap pays", "marginal", "overlap does not pay")), f.verdict
        assert (best.seconds >= ref.total_s) == f.verdict.startswith("overlap does not pay"), (what, f.verdict)
        payload = json.loads(json.dumps(f.to_json()))
        assert payload["unfused_s"] == ref.total_s and payload["auto"]["how"] == f.auto_how, payload


def test_overlap_does_not_pay_for_decode_and_pays_for_training_shapes():
    c = presets.cluster("h100-sxm")
    decode = forecast(Problem("all_gather_matmul", 2, 8192, 3584, "bfloat16"), c.topology, c.profile)
    assert decode.verdict.startswith("overlap does not pay") and "decode" in decode.verdict, decode.verdict
    assert decode.auto.plan == Plan("reference") and "cost model" in decode.auto_how
    train = forecast(Problem("all_gather_matmul", 1024, 8192, 3584, "bfloat16", True), c.topology, c.profile)
    assert train.verdict.startswith("overlap pays") and train.auto.plan.strategy == "fused", train.verdict
    assert train.speedup(train.auto) > 1.1


@st.composite
def described(draw):
    name = draw(st.sampled_from(NAMES))
    op = draw(st.sampled_from(tuple(OPS)))
    nodes = draw(st.sampled_from((1, 1, 2)))
    gpus = draw(st.sampled_from((2, 4, 8)))
    W = gpus * nodes
    dims = [draw(st.integers(1, 16384)) for _ in range(3)]
    moe = {"experts": W * draw(st.integers(1, 8)), "top_k": 0} if OPS[op].family == "moe" else {}
    if moe:
        moe["top_k"] = draw(st.integers(1, min(8, moe["experts"])))
    dtype = draw(st.sampled_from(("bfloat16", "float16", "float32")
                                 + (("float8_e4m3fn", "mxfp8") if OPS[op].fp8 else ())))
    if dtype == "mxfp8":  # (MX blocks of 32 along k)
        dims[1] = 32 * -(-dims[1] // 32)
    return presets.cluster(name, gpus, nodes), Problem(op, *dims, dtype=dtype, backward=draw(st.booleans()), **moe)


@PROPERTY
@given(described())
def test_auto_on_a_described_cluster_is_never_predicted_slower_than_unfused(case):
    c, p = case
    plan, how = described_plan(p, c.topology, c.profile)
    chosen = predict(p, plan, c.topology, c.profile).total_s
    plain = predict(p, Plan("reference"), c.topology, c.profile).total_s
    assert rel_le(chosen, plain), (c.about, p.key, plan.describe(), how, chosen, plain)


@PROPERTY
@given(described(), st.sampled_from(("nvlink", "network")), st.floats(1.0, 20.0))
def test_presets_more_bandwidth_never_slower(case, link, factor):
    c, p = case
    if link not in dict(c.topology.links):
        return
    faster = dict(c.profile.links)
    faster[link] = {t: dataclasses.replace(f, bandwidth_Bps=f.bandwidth_Bps * factor) for t, f in faster[link].items()}
    quick = dataclasses.replace(c.profile, links=faster)
    base, fast = forecast(p, c.topology, c.profile), forecast(p, c.topology, quick)
    assert rel_le(fast.reference.total_s, base.reference.total_s), (p.key, link)
    for slow_row, fast_row in zip(base.rows, fast.rows):
        assert rel_le(fast_row.seconds, slow_row.seconds), (p.key, link, slow_row.label, fast_row, slow_row)


@PROPERTY
@given(described(), st.sampled_from(("m", "k", "n")))
def test_presets_bigger_gemm_never_faster(case, dim):
    c, p = case
    bigger = dataclasses.replace(p, **{dim: 2 * getattr(p, dim)})
    base, grown = forecast(p, c.topology, c.profile), forecast(bigger, c.topology, c.profile)
    assert rel_le(base.reference.compute_s, grown.reference.compute_s), (p.key, dim)
    assert rel_le(base.reference.total_s, grown.reference.total_s), (p.key, dim)
    for small, big in zip(base.rows, grown.rows):
        assert rel_le(small.seconds, big.seconds), (c.about, p.key, dim, small, big)
