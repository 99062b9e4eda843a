"""Bad numbers fail fast, with one error naming the variable or the file and the field: OVERLAP_TIMEOUT_S and
``timeout=`` (finite, at most 7 days), yes/no variables, OVERLAP_LOG (a bad level warns, never breaks the import),
machine profiles (`Profile.from_json`: from a file, the cache or a plan file) and plan files (`PlanFile.load`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest

from overlap import envs, logs
from overlap.plans import Entry, Plan, PlanFile, Problem, Profile, Topology, default_profile
from overlap.plans.planfile import MAX_PLAN_BLOCK, MAX_PLAN_CHUNKS, MAX_PLAN_DIM

# ---- OVERLAP_TIMEOUT_S and timeout= ----------------------------------------------------------------


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "Infinity", "0", "-1", "604801", "1e12"])
def test_timeout_variable_refuses_non_finite_and_unbounded(monkeypatch, raw):
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match=r"^OVERLAP_TIMEOUT_S='.*': not a finite number of seconds > 0 and at most "
                                         r"604800 \(7 days\); set one") as exc:
        envs.timeout_s()
    assert repr(raw) in str(exc.value)
    with pytest.raises(ValueError, match="OVERLAP_TIMEOUT_S"):
        envs.resolve_timeout(None)


@pytest.mark.parametrize("raw, seconds", [("604800", 604800.0), (" 2.5 ", 2.5), ("", 300.0)])
def test_timeout_variable_takes_finite_seconds_up_to_a_week(monkeypatch, raw, seconds):
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", raw)
    assert envs.timeout_s() == seconds


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), -float("inf"), 7 * 86400 + 1, 1e300, 0, -1, True,
                                     "10"])
def test_per_call_timeout_refuses_non_finite_and_unbounded(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0 and at most 604800 "
                                         r"\(7 days\)"):
        envs.resolve_timeout(timeout)


def test_per_call_timeout_up_to_a_week():
    assert envs.resolve_timeout(7 * 86400) == 7 * 86400.0
    assert envs.resolve_timeout(0.5) == 0.5


# ---- yes/no variables ---------------------------------------------------------------------------


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("On", True),
                                        ("0", False), ("false", False), ("False", False), ("no", False),
                                        ("OFF", False), ("", False), ("   ", False)])
def test_check_every_call_parses_booleans_strictly(monkeypatch, raw, value):
    monkeypatch.setenv("OVERLAP_CHECK_EVERY_CALL", raw)
    assert envs.check_every_call() is value


@pytest.mark.parametrize("raw", ["2", "enabled", "y", "nope", "-1", "truee"])
def test_check_every_call_refuses_other_words(monkeypatch, raw):
    monkeypatch.setenv("OVERLAP_CHECK_EVERY_CALL", raw)
    with pytest.raises(ValueError, match=r"^OVERLAP_CHECK_EVERY_CALL='.*': neither on \(1, true, yes, on\) nor off "
                                         r"\(0, false, no, off\), in any case; set one") as exc:
        envs.check_every_call()
    assert repr(raw) in str(exc.value)


# ---- OVERLAP_LOG ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["basic_format", "verbose", "5", "root"])
def test_a_bad_log_level_never_breaks_the_import(raw):
    """``OVERLAP_LOG=basic_format`` made ``import overlap`` raise (logging.BASIC_FORMAT is no level); ``verbose`` was
    ignored without a word. Now: the import works (under ``-W error`` too), the level is warning, one warning names
    the variable."""
    env = dict(os.environ, OVERLAP_LOG=raw)
    code = ("import logging, overlap, overlap.logs as l; l.configure(); "
            "print(logging.getLogger('overlap').level)")
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(logging.WARNING)], proc.stdout
    warned = [ln for ln in proc.stderr.splitlines() if "OVERLAP_LOG must be one of" in ln]
    assert len(warned) == 1, proc.stderr  # once, though configure ran twice
    assert "debug, info, warning, error" in warned[0] and repr(raw) in warned[0], warned


@pytest.mark.parametrize("raw, level", [("debug", logging.DEBUG), (" INFO ", logging.INFO), ("Error", logging.ERROR),
                                        ("", logging.WARNING)])
def test_log_levels_any_case(monkeypatch, raw, level):
    log = logging.getLogger("overlap")
    old = log.level
    monkeypatch.setenv("OVERLAP_LOG", raw)
    try:
        logs.configure()
        assert log.level == level
    finally:
        log.setLevel(old)


def test_log_level_names_the_variable(monkeypatch):
    monkeypatch.setenv("OVERLAP_LOG", "loud")
    with pytest.raises(ValueError, match=r"OVERLAP_LOG must be one of debug, info, warning, error, critical"):
        envs.log_level()


# ---- machine profiles ---------------------------------------------------------------------------

BAD_RATES = [0, -1.0, float("nan"), float("inf"), "abc", "1e9", True, None, 1e30]
BAD_SECONDS = [-1e-6, float("nan"), float("inf"), "abc", False, None, 1e9]


def _profile_json() -> dict:
    return json.loads(json.dumps(default_profile("cuda").to_json()))


def _set(data: dict, field: str, value) -> None:
    *path, last = field.split(".")
    for key in path:
        data = data[key]
    data[last] = value


PROFILE_FIELDS = ([("links.nvlink.p2p.bandwidth_Bps", v) for v in BAD_RATES]
                  + [("links.pcie.copy.latency_s", v) for v in BAD_SECONDS]
                  + [("gemm.bfloat16.peak_flops", v) for v in BAD_RATES]
                  + [("gemm.float32.overhead_s", v) for v in BAD_SECONDS]
                  + [("per_chunk_s", v) for v in BAD_SECONDS]
                  + [("call_s.symm", v) for v in BAD_SECONDS]
                  + [("gemm_slowdown", v) for v in (0, -2.0, float("nan"), float("inf"), "1.1", 1e9)]
                  + [("comm_slowdown", v) for v in (0, float("inf"))])


@pytest.mark.parametrize("field, value", PROFILE_FIELDS, ids=[f"{f}={v!r}" for f, v in PROFILE_FIELDS])
def test_profile_numbers_are_checked_where_they_enter(field, value):
    """A zero, negative, NaN, inf, string or absurd number loaded (bandwidth 0: every prediction then died in
    ZeroDivisionError); now one ValueError naming the file and the field."""
    data = _profile_json()
    _set(data, field, value)
    with pytest.raises(ValueError) as exc:
        Profile.from_json(data, where="profile /some/where.json")
    text = str(exc.value)
    assert text.startswith(f"profile /some/where.json: {field} must be a finite number"), text
    assert f"got {value!r}" in text, text


@pytest.mark.parametrize("damage, says", [
    (lambda d: d["links"].update(nvlnk={}), "links.nvlnk is no link class"),
    (lambda d: d["links"]["nvlink"].update(rdma={"latency_s": 1e-6, "bandwidth_Bps": 1e9}), "links.nvlink.rdma is no"),
    (lambda d: d["links"]["nvlink"]["p2p"].pop("bandwidth_Bps"), "links.nvlink.p2p.bandwidth_Bps is missing"),
    (lambda d: d["links"]["nvlink"]["p2p"].update(speed=1), "links.nvlink.p2p.speed is not a field"),
    (lambda d: d.update(links=[1]), "links must be a JSON object"),
    (lambda d: d["gemm"].update(float32=3), "gemm.float32 must be a JSON object"),
    (lambda d: d.update(call_s="fast"), "call_s must be a JSON object"),
    (lambda d: d.update(device=3), "device must be a string"),
    (lambda d: d.pop("gemm"), "gemm is missing"),
    (lambda d: d.update(version=0), "version 0 is not 1: probe again"),
])
def test_profile_structure_is_checked(damage, says):
    data = _profile_json()
    damage(data)
    with pytest.raises(ValueError, match=r"^profile /p\.json: .*") as exc:
        Profile.from_json(data, where="profile /p.json")
    assert says in str(exc.value), str(exc.value)


def test_valid_profiles_round_trip():
    for device in ("cpu", "cuda"):
        p = default_profile(device)
        assert Profile.from_json(json.loads(json.dumps(p.to_json()))) == p
    data = _profile_json()
    _set(data, "links.nvlink.p2p.latency_s", 0)  # a latency, a cost may be 0; integers are numbers
    _set(data, "per_chunk_s", 0)
    _set(data, "gemm.float32.peak_flops", 10**12)
    assert Profile.from_json(data).links["nvlink"]["p2p"].latency_s == 0.0


def test_fits_never_write_a_rate_the_loader_refuses():
    from overlap.plans.machine import MAX_PROFILE_RATE
    from overlap.tune.fits import fit_gemm, fit_link

    flat = [1e-3, 1e-3 + 1e-18]  # a slope of ~1e-22 s/B: a rate of ~1e21-1e24 uncapped
    assert 0 < fit_link([4096, 8192], flat).bandwidth_Bps <= MAX_PROFILE_RATE
    assert 0 < fit_gemm([1e6, 2e6], flat).peak_flops <= MAX_PROFILE_RATE


def test_a_cached_profile_with_a_bad_number_names_the_file_and_is_probed_again(tmp_path, monkeypatch, caplog):
    import torch

    from overlap.tune.cache import cache_path, load_cached
    from overlap.world import GroupInfo

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    info = GroupInfo(rank=0, world_size=2, global_ranks=(0, 1), nodes=("n0", "n0"), pids=(0, 1), backend="gloo",
                     device=torch.device("cpu"), peer_access=(False, False))
    path = cache_path(info)
    data = json.loads(json.dumps(default_profile("cpu").to_json()))
    data["links"]["shm"]["p2p"]["bandwidth_Bps"] = 0
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="overlap"):
        assert load_cached(info) is None  # (was a profile whose every prediction divided by zero)
    assert f"profile {path}: links.shm.p2p.bandwidth_Bps must be a finite number > 0" in caplog.text, caplog.text


# ---- plan files ----------------------------------------------------------------------------------

TOPO = Topology("cpu", 4, 2, 2, {"shm": 1, "network": 2})
MOE = Problem("moe", 512, 128, 448, experts=8, top_k=2)
TP = Problem("all_gather_matmul", 256, 512, 1024, "bfloat16", backward=True)


def _plan_json(tmp_path) -> tuple[dict, str]:
    f = PlanFile.new(TOPO, TOPO.world_size, default_profile("cpu"))
    f.add(Entry(TP, Plan("fused", {"network": 4, "shm": 1}, block_m=64, block_n=64, block_k=32), 0.003, 0.004,
                0.0029))
    f.add(Entry(MOE, Plan("pipelined", {"network": 2}, migrate=((3, 1),)), 0.004, 0.005))
    path = tmp_path / "plans.json"
    f.save(path)
    return json.loads(path.read_text()), str(path)


PLAN_DAMAGE = {
    "chunks 2^40": (TP, lambda e: e["plan"]["num_chunks"].update(network=2**40), "plan.num_chunks.network must be "
                    f"an int from 1 to {MAX_PLAN_CHUNKS}, got {2**40}"),
    "block_m 2^40": (TP, lambda e: e["plan"].update(block_m=2**40), f"plan.block_m must be 0 (the kernel's default) "
                     f"or a power of two from 16 to {MAX_PLAN_BLOCK}, got {2**40}"),
    "block_k 2048": (TP, lambda e: e["plan"].update(block_k=2048), "plan.block_k must be 0"),
    "m 2^40": (TP, lambda e: e["problem"].update(m=2**40), f"problem.m must be an int from 1 to {MAX_PLAN_DIM}"),
    "experts 2^40": (MOE, lambda e: e["problem"].update(experts=2**40), "problem.experts must be an int from 1"),
    "one_shot 1": (TP, lambda e: e["plan"].update(one_shot=1), "plan.one_shot must be true or false, got 1"),
    "migrate expert": (MOE, lambda e: e["plan"].update(migrate=[[8, 1]]), "pair (8, 1) names no expert"),
    "migrate node": (MOE, lambda e: e["plan"].update(migrate=[[3, 4]]), "pair (3, 4) names no expert"),
    "measured nan": (TP, lambda e: e.update(measured_s=float("nan")), "measured_s must be null or a finite number"),
    "reference inf": (TP, lambda e: e.update(reference_s=float("inf")), "reference_s must be null or a finite"),
    "predicted -1": (TP, lambda e: e.update(predicted_s=-1.0), "predicted_s must be null or a finite number"),
    "chunks float": (TP, lambda e: e["plan"]["num_chunks"].update(shm=2.0), "num_chunks['shm'] must be an int"),
    "entry empty": (TP, lambda e: e.clear(), "missing field"),
}


@pytest.mark.parametrize("damage", list(PLAN_DAMAGE))
def test_plan_file_numbers_are_checked_naming_the_file_and_entry(tmp_path, damage):
    """Chunk counts and tiles of 2^40, NaN seconds, a one_shot of 1 loaded before; now a ValueError naming the
    file, the entry and the field."""
    data, path = _plan_json(tmp_path)
    problem, change, says = PLAN_DAMAGE[damage]
    change(data["entries"][problem.key])
    with open(path, "w") as f:
        json.dump(data, f)  # (json writes NaN and Infinity, and reads them back)
    with pytest.raises(ValueError) as exc:
        PlanFile.load(path)
    text = str(exc.value)
    assert text.startswith(f"plan file {path}: entry {problem.key!r} is malformed ("), text
    assert says in text and text.endswith("re-run overlap tune"), text


@pytest.mark.parametrize("world_size", [0, -2, 2**40, 2.0, "4"])
def test_plan_file_world_size_is_checked(tmp_path, world_size):
    data, path = _plan_json(tmp_path)
    data["world_size"] = world_size
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match=rf"^plan file {path}: topology must be a string, world_size an int from 1"):
        PlanFile.load(path)


@pytest.mark.parametrize("value", [0, float("nan"), "abc"])
def test_plan_file_profile_numbers_name_the_file_and_field(tmp_path, value):
    data, path = _plan_json(tmp_path)
    data["profile"]["links"]["shm"]["p2p"]["bandwidth_Bps"] = value
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError) as exc:
        PlanFile.load(path)
    assert str(exc.value).startswith(f"plan file {path}: profile: links.shm.p2p.bandwidth_Bps must be a finite "
                                     f"number > 0 and at most 1e+21, got {value!r}"), str(exc.value)


def test_plan_files_round_trip_and_write_no_time_they_refuse(tmp_path):
    data, path = _plan_json(tmp_path)
    loaded = PlanFile.load(path)
    assert loaded.entries[TP.key].plan.block_m == 64 and loaded.entries[MOE.key].plan.migrate == ((3, 1),)
    loaded.add(Entry(Problem("matmul_all_reduce", 8, 64, 64), Plan("reference"), 0.001, 0.001, math.inf))
    loaded.add(Entry(Problem("matmul_all_reduce", 16, 64, 64), Plan("reference"), math.nan, None, 1e12))
    loaded.save(path)
    again = PlanFile.load(path)  # (the writer put inf and NaN as Infinity and NaN)
    assert again.entries[Problem("matmul_all_reduce", 8, 64, 64).key].predicted_s is None
    assert again.entries[Problem("matmul_all_reduce", 16, 64, 64).key].measured_s is None
    assert again.entries[Problem("matmul_all_reduce", 16, 64, 64).key].predicted_s is None
    assert "NaN" not in open(path).read() and "Infinity" not in open(path).read()


@pytest.mark.parametrize("text", ["nan,1,1,1", "1,inf,1,1", "@"])
def test_routing_shares_must_be_finite(tmp_path, text):
    from overlap.cli.tune import parse_routing

    if text == "@":
        (tmp_path / "r.json").write_text("[1, NaN, 1, 1]")
        text = f"@{tmp_path / 'r.json'}"
    with pytest.raises(ValueError, match=r"--routing .*shares must be finite numbers >= 0"):
        parse_routing(text)
