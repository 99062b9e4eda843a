"""overlap.tune.probing: the fits on synthetic data, the table, the cache files, and the probe itself on
2 CPU ranks (the same Profile on both, sane values, a round trip through the cache, a dead peer raises
within the deadline instead of hanging)."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time

import pytest
import torch

from overlap.plans import GemmFit, LinkFit, Profile
from overlap.tune import (
    cache_path,
    fit_gemm,
    fit_line,
    fit_link,
    format_profile,
    load_cached,
    save_cached,
)
from overlap.world import GroupInfo
from tests.support.harness import LATE_S, RankError, run_isolated

SIZES = [4096 * 4**i for i in range(7)]  # 4 KiB ... 16 MiB


def _noisy(rng: random.Random, t: float, noise: float) -> float:
    return t * (1.0 + rng.uniform(-noise, noise))


# ----------------------------------------------------------------------------------------------
# Fits (single process)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("latency, bandwidth", [(7e-6, 3.2e9), (450e-6, 1.1e9), (2e-6, 150e9)])
def test_fit_link_recovers_latency_and_bandwidth(seed, latency, bandwidth):
    rng = random.Random(seed)
    times = [_noisy(rng, latency + n / bandwidth, 0.03) for n in SIZES]
    fit = fit_link(SIZES, times)
    assert abs(fit.latency_s / latency - 1) < 0.1, (fit, latency, times)
    assert abs(fit.bandwidth_Bps / bandwidth - 1) < 0.06, (fit, bandwidth, times)
    exact = fit_link(SIZES, [latency + n / bandwidth for n in SIZES])
    assert math.isclose(exact.latency_s, latency, rel_tol=1e-9) and math.isclose(exact.bandwidth_Bps, bandwidth,
                                                                                    rel_tol=1e-9), exact


def test_fit_gemm_recovers_peak_and_overhead(seed):
    rng = random.Random(seed)
    peak, overhead = 1.5e11, 2e-5
    flops = [2.0 * n**3 for n in (128, 256, 384, 512, 768, 1024)]
    fit = fit_gemm(flops, [_noisy(rng, overhead + f / peak, 0.02) for f in flops])
    assert abs(fit.peak_flops / peak - 1) < 0.05, fit
    assert abs(fit.overhead_s / overhead - 1) < 0.25, fit


def test_fits_stay_positive_and_finite_on_bad_data():
    # Times that fall with size (noise): no negative bandwidth, latency or peak comes out.
    link = fit_link(SIZES[:3], [3e-4, 2e-4, 1e-4])
    assert 0 < link.latency_s < math.inf and 0 < link.bandwidth_Bps < math.inf, link
    # A steep line through zero: the fitted intercept is negative; the latency is floored.
    link = fit_link([1000, 2000, 4000], [0.9e-6, 2e-6, 4.1e-6])
    assert link.latency_s > 0 and link.bandwidth_Bps > 0, link
    gemm = fit_gemm([1e6, 1e7, 1e8], [1e-3, 9e-4, 8e-4])
    assert 0 < gemm.peak_flops < math.inf and gemm.overhead_s >= 0, gemm


def test_fit_line_rejects_unusable_points():
    assert fit_line([1, 2], [3.0, 5.0]) == pytest.approx((1.0, 2.0))
    for xs, ts in (([1, 1], [1.0, 2.0]), ([1, 2], [1.0, 0.0]), ([1, 2], [1.0, math.nan]), ([1, 2, 3], [1.0, 2.0])):
        with pytest.raises(ValueError):
            fit_line(xs, ts)


# ----------------------------------------------------------------------------------------------
# Table and cache files (single process)
# ----------------------------------------------------------------------------------------------


def _profile() -> Profile:
    return Profile(
        links={"shm": {"copy": LinkFit(2.5e-6, 8e9), "p2p": LinkFit(40e-6, 2e9)},
               "network": {"p2p": LinkFit(1e-3, 1.25e8)}},
        gemm={"float32": GemmFit(1.1e11, 1e-5), "bfloat16": GemmFit(4e11, 3e-5)},
        gemm_slowdown=1.25, comm_slowdown=1.5, per_chunk_s=3e-5, device="cpu", machine="host: 2 rank(s)",
        call_s={"reference": 4e-4, "symm": 1.5e-4},
    )


def test_format_profile_lists_everything():
    text = format_profile(_profile())
    lines = text.splitlines()
    row = {tuple(line.split()[:2]): line.split()[2:] for line in lines if line.split()[:1] in (["shm"], ["network"])}
    assert row[("shm", "p2p")] == ["40.00", "2.000"], text
    assert row[("shm", "copy")] == ["2.50", "8.000"], text
    assert row[("network", "p2p")] == ["1000.00", "0.125"], text
    # p2p before copy, and shm before network (world.LINK_CLASSES order)
    assert text.index("shm      p2p") < text.index("shm      copy") < text.index("network"), text
    assert any(line.split() == ["float32", "0.110", "10.00"] for line in lines), text
    assert any(line.split() == ["bfloat16", "0.400", "30.00"] for line in lines), text
    assert "x1.25" in text and "x1.50" in text and "30.00 us" in text and "host: 2 rank(s)" in text, text
    assert "fixed cost of a call (us): reference 400, symm 150" in text, text
    one_rank = format_profile(Profile(links={}, gemm={"float32": GemmFit(1e11, 0.0)}))
    assert "none measured" in one_rank, one_rank


def _info(rank: int = 0, world_size: int = 2) -> GroupInfo:
    return GroupInfo(rank=rank, world_size=world_size, global_ranks=tuple(range(world_size)),
                     nodes=("n0",) * world_size, pids=tuple(range(world_size)), backend="gloo",
                     device=torch.device("cpu"), peer_access=(False,) * world_size)


def test_cache_path_names_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path / "cache"))
    path = cache_path(_info())
    assert path.parent == tmp_path / "cache", path
    name = path.name
    host = socket.gethostname()
    assert name.endswith(".json") and f"cpu-t{torch.get_num_threads()}" in name and "-w2-shm" in name, name
    if host.replace("_", "").isalnum():
        assert host in name, (host, name)
    assert cache_path(_info(), quick=True).name == name.replace(".json", "-quick.json")
    assert cache_path(_info(0, 1)).name.endswith("-w1-none.json")
    monkeypatch.delenv("OVERLAP_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path(_info()).parent == tmp_path / "home" / ".cache" / "overlap"


def test_cache_round_trip_and_bad_files(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    profile = _profile()
    assert load_cached(_info()) is None  # nothing yet
    assert save_cached(profile, _info(rank=1)) == cache_path(_info())  # rank 1 writes nothing
    assert not cache_path(_info()).exists()
    path = save_cached(profile, _info())
    assert load_cached(_info()) == profile
    assert load_cached(_info(rank=1)) == profile  # the same file from every rank of this machine
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "a temporary file was left behind"
    data = json.loads(path.read_text())
    data["version"] = 999
    path.write_text(json.dumps(data))
    assert load_cached(_info()) is None
    path.write_text("{not json")
    assert load_cached(_info()) is None
    assert "ignoring the machine profile" in caplog.text


# ----------------------------------------------------------------------------------------------
# The probe on 2 CPU ranks
# ----------------------------------------------------------------------------------------------


def quick_probe(rank, world_size, cache):
    import torch.distributed as dist

    from overlap import rendezvous
    from overlap.tune import load_cached, probe, probe_cached, save_cached

    os.environ["OVERLAP_CACHE_DIR"] = cache
    try:
        said, said_cached = [], []
        start = time.perf_counter()
        profile = probe(quick=True, timeout=20, progress=said.append)
        elapsed = time.perf_counter() - start
        path = save_cached(profile, quick=True)
        rendezvous.exchange(dist.group.WORLD, "test-probe-saved", None, 20)  # rank 0 has written it
        loaded = load_cached(quick=True)
        cached = probe_cached(quick=True, timeout=20, progress=said_cached.append)  # from the file: no probe
        return (profile.to_json(), loaded.to_json() if loaded else None, cached.to_json(), elapsed, said_cached,
                said, str(path))
    finally:
        del os.environ["OVERLAP_CACHE_DIR"]


def test_quick_probe_on_two_ranks(pools, tmp_path):
    results = pools(2).run(quick_probe, str(tmp_path), timeout=90)
    (first, _, _, elapsed, _, said, path), second = results[0], results[1]
    assert first == second[0], f"the ranks' profiles differ:\n{first}\n{second[0]}"
    profile = Profile.from_json(first)
    print(format_profile(profile), f"\nquick probe: {elapsed:.2f} s")
    # What was measured depends on the machine's load; asserted is only what the fits guarantee whatever
    # the timings: every figure present, positive (or zero where allowed) and finite.
    for transport in ("p2p", "copy"):
        fit = profile.links["shm"][transport]
        assert 0 < fit.latency_s < math.inf and 0 < fit.bandwidth_Bps < math.inf, (transport, fit)
    assert set(profile.links) == {"shm"}, profile.links
    assert set(profile.gemm) == {"float32", "bfloat16"}, profile.gemm
    for name, fit in profile.gemm.items():
        assert 0 < fit.peak_flops < math.inf and 0 <= fit.overhead_s < math.inf, (name, fit)
    assert 1.0 <= profile.gemm_slowdown < math.inf and 1.0 <= profile.comm_slowdown < math.inf, profile
    assert 0.0 <= profile.per_chunk_s < math.inf, profile
    # the fixed cost of a call of every strategy that runs on one node of CPU ranks
    assert set(profile.call_s) == {"reference", "pipelined", "symm"}, profile.call_s
    assert all(0.0 <= t < math.inf for t in profile.call_s.values()), profile.call_s
    assert profile.device == "cpu" and "2 rank(s)" in profile.machine, profile
    for step in ("links: p2p over shm", "links: copy over shm", "GEMM float32", "GEMM bfloat16", "interference",
                 "chunking", "calls: 16x64x64 all_gather_matmul, reference, pipelined, symm"):
        assert any(s.startswith(step) for s in said), (step, said)
    # The cache: rank 0 wrote the file; every rank read it back and probe_cached took it from there.
    assert os.path.dirname(path) == str(tmp_path) and Profile.from_json(json.loads(open(path).read())) == profile
    for rank, (_, loaded, cached, _, said_cached, _, _) in enumerate(results):
        assert loaded == first and cached == first, rank
        assert said_cached == ["machine profile from the cache"], f"rank {rank} probed again: {said_cached}"


def dying_probe(rank, world_size):
    import signal

    from overlap.tune import probe

    def progress(text):
        if rank == 1 and text.startswith("links: copy"):
            os.kill(os.getpid(), signal.SIGKILL)

    start = time.perf_counter()
    try:
        probe(quick=True, timeout=3.0, progress=progress)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return None, "", time.perf_counter() - start


def test_dead_peer_raises_within_the_deadline():
    with pytest.raises(RankError) as failed:
        run_isolated(2, dying_probe, timeout=60)
    assert "rank 1 died" in str(failed.value), failed.value
    kind, msg, secs = failed.value.results[0]
    assert kind in ("OverlapTimeout", "OverlapError") and "overlap.probe" in msg and "peer 1" in msg, (kind, msg)
    assert secs <= 3.0 + LATE_S, secs
