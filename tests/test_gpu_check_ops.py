"""Tests of the GPU check's ops section (bench/gpu_check_ops.py, checks i) without a GPU.

Its CPU smoke (``bench/gpu_check.py --cpu-smoke --only i.ops``) runs every op of the op table x {symm, fused} x
{fwd, fwd+bwd} through the public API on two CPU rank processes and on one; a rank whose op is wrong fails the
float64 oracle and one whose op is not deterministic fails the repeat; the merge of the ranks' reports and the
fallback to one rank where two cannot set up. Every run is a subprocess with a timeout: no test hangs.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from overlap.plans import OPS

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))  # the GPU check's modules import one another by name

import gpu_check_ops  # noqa: E402
from gpu_check_common import Report  # noqa: E402


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _expected_cases() -> list[str]:
    """Case names without their dims: every op of the table and its plan variants x symm/fused x fwd/fwd+bwd."""
    return [f"{name}[{v}]" if v else name for name, spec in OPS.items() for v in ("", *spec.variants)]


@pytest.mark.exact
@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks over /dev/shm")
def test_cpu_smoke_runs_every_op_on_two_ranks_and_on_one(tmp_path):
    path = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-smoke", "--no-install", "--only",
                           "ops", "--json", str(path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    results = json.loads(path.read_text())["results"]
    status = {r["name"]: r["status"] for r in results}
    ops = _expected_cases()
    assert {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce[one_shot]", "all_gather_weight_matmul",
            "moe"} <= set(ops)
    for label in ("i.ops W=2", "i.ops W=1"):
        assert status.pop(f"{label} setup") == "PASS", out[-3000:]
        for op in ops:
            for strategy in ("symm", "fused"):
                for mode in ("fwd", "fwd+bwd"):
                    found = [n for n in status if n.startswith(f"{label} {op} {strategy} {mode} ")]
                    assert len(found) == 1 and status.pop(found[0]) == "PASS", (label, op, strategy, mode, out[-3000:])
    assert not status, status  # nothing else: no FAIL, no SKIP, no exit line
    cases = [r for r in results if " m=" in r["name"]]
    assert all("repeat bitwise" in r["value"] and "from float64" in r["value"] for r in cases), cases


_WRONG_OPS = """
import sys
sys.path.insert(0, {bench!r})
import torch
import overlap.ops.tp.all_gather_matmul as agm
import overlap.ops.tp.matmul_reduce_scatter as mrs

real_rs, real_ag = mrs.matmul_reduce_scatter, agm.all_gather_matmul
calls = []

def off_by_a_little(*args, **kwargs):  # off the oracle by far more than rounding, still finite
    out = real_rs(*args, **kwargs)
    return out + 1e-3 * out.detach().abs().max()

def one_ulp_apart(*args, **kwargs):  # right within rounding, but not the same twice
    out = real_ag(*args, **kwargs)
    calls.append(1)
    if len(calls) % 2 == 0:
        first = out.detach().view(-1)[0]
        bump = torch.zeros_like(out)
        bump.view(-1)[0] = torch.nextafter(first, torch.tensor(float("inf"))) - first
        out = out + bump
    return out

mrs.matmul_reduce_scatter, agm.all_gather_matmul = off_by_a_little, one_ulp_apart
import gpu_check_ops_rank
gpu_check_ops_rank.main(sys.argv[1:])
"""


@pytest.mark.exact
@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks over /dev/shm")
def test_a_wrong_op_fails_the_oracle_and_an_unrepeatable_one_the_repeat(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(_WRONG_OPS.format(bench=str(BENCH)))
    args = ["--rank", "0", "--world-size", "1", "--init-file", str(tmp_path / "store"), "--device", "cpu",
            "--seed", "7", "--timeout", "30", "--out", str(tmp_path)]
    env = {**_env(), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(driver), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = gpu_check_ops.read_records(tmp_path / "rank0.jsonl")
    assert [r["status"] for r in records if r["kind"] == "setup"] == ["PASS"], records
    cases = {r["name"]: r for r in records if r["kind"] == "case"}
    assert len(cases) == 4 * len(_expected_cases()), sorted(cases)
    for name, r in cases.items():
        if name.startswith("matmul_reduce_scatter "):
            assert r["status"] == "FAIL" and "out off the float64 oracle" in r["value"], r
        elif name.startswith("all_gather_matmul "):
            assert r["status"] == "FAIL" and "out differs between two identical calls" in r["value"], r
            assert "off the float64 oracle" not in r["value"], r  # one ulp is within the rounding bound
        else:
            assert r["status"] == "PASS", r


# ----------------------------------------------------------------------------------------------
# The parent's side: merging the ranks' reports, the fallback to one rank
# ----------------------------------------------------------------------------------------------


def _report() -> Report:
    return Report(argparse.Namespace(started_at=time.time(), time_limit=420.0, only=""))


def _case(name: str, status: str = "PASS", value: str = "max 1e-7 from float64, repeat bitwise",
          error: bool = False) -> dict:
    return {"kind": "case", "name": name, "status": status, "value": value, "max_err": 1e-7, "seconds": 0.1,
            **({"error": True} if error else {})}


def _setup(status: str = "PASS") -> dict:
    return {"kind": "setup", "status": status, "value": "2 rank(s) on cpu" if status == "PASS" else "OSError: no"}


def test_merge_needs_every_rank_and_says_which_failed():
    names = {"kind": "cases", "names": ["a", "b", "c", "d"]}
    rep = _report()  # rank 0 raised in b (its run ended there); rank 1 then failed c by its deadline
    ranks = [[names, _setup(), _case("a"), _case("b", "FAIL", "OverlapTimeout: peer 1", error=True)],
             [names, _setup(), _case("a"), _case("b"), _case("c", "FAIL", "OverlapTimeout: peer 0", error=True)]]
    assert gpu_check_ops.merge(rep, "x", ranks, [1, 1], 3.0) is None
    got = {r.name: (r.status, r.value) for r in rep.results}
    assert got["x setup"][0] == "PASS" and got["x a"][0] == "PASS"
    assert got["x b"] == ("FAIL", "rank 0: OverlapTimeout: peer 1")
    assert got["x c"] == ("FAIL", "rank 1: OverlapTimeout: peer 0 (rank 0 stopped at b)")
    assert got["x d"] == ("SKIP", "not run: rank 0 stopped at b")
    assert "x exit" not in got  # the failure is already there

    rep = _report()  # every case passed, but a rank was killed at the deadline: the run still fails
    ranks = [[names, _setup(), *map(_case, "abcd")], [names, _setup(), *map(_case, "abcd")]]
    gpu_check_ops.merge(rep, "x", ranks, [0, None], 3.0)
    assert [r.status for r in rep.results] == ["PASS"] * 5 + ["FAIL"]
    assert "rank 1: killed" in rep.results[-1].value

    rep = _report()  # wrong numbers on one rank do not end its run: later cases are judged on their own
    ranks = [[names, _setup(), *map(_case, "abcd")],
             [names, _setup(), _case("a", "FAIL", "out off the float64 oracle"), _case("b"), _case("c"), _case("d")]]
    gpu_check_ops.merge(rep, "x", ranks, [0, 0], 3.0)
    assert [(r.status, r.value) for r in rep.results[1:3]] == [
        ("FAIL", "rank 1: out off the float64 oracle"), ("PASS", rep.results[2].value)]
    assert [r.status for r in rep.results] == ["PASS", "FAIL", "PASS", "PASS", "PASS"]


def test_a_case_that_raises_costs_that_case_only(monkeypatch):
    """The ranks' run ends at a case that raised; fresh ranks go on from the next case, and the merged results
    judge every case."""
    names = {"kind": "cases", "names": ["a", "b", "c", "d"]}
    rounds = [  # first run: rank 0 raised in b, rank 1 was stuck in c when the run was stopped; then c and d
        ([[names, _setup(), _case("a"), _case("b", "FAIL", "RuntimeError: CUDA error", error=True)],
          [names, _setup(), _case("a"), _case("b")]], [1, None]),
        ([[names, _setup(), _case("c"), _case("d")], [names, _setup(), _case("c"), _case("d")]], [0, 0]),
    ]
    starts = []

    def fake_spawn(world_size, device, seed, timeout, budget, tmp, first=0):
        starts.append(first)
        records, codes = rounds[len(starts) - 1]
        for q, rs in enumerate(records):
            (Path(tmp) / f"rank{q}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
        return codes, 1.0

    monkeypatch.setattr(gpu_check_ops, "spawn", fake_spawn)
    rep = _report()
    assert gpu_check_ops.run_world(rep, 2, torch.device("cpu"), 7, "x") is None
    assert starts == [0, 2]
    got = {r.name: (r.status, r.value) for r in rep.results}
    assert got.pop("x b") == ("FAIL", "rank 0: RuntimeError: CUDA error")
    assert {name: status for name, (status, _) in got.items()} == {
        "x setup": "PASS", "x a": "PASS", "x c": "PASS", "x d": "PASS"}, got


@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks over /dev/shm")
def test_a_rank_starts_at_the_case_it_is_given(tmp_path):
    last = len(_expected_cases()) * 4 - 1
    args = ["--rank", "0", "--world-size", "1", "--init-file", str(tmp_path / "store"), "--device", "cpu",
            "--seed", "7", "--timeout", "30", "--out", str(tmp_path), "--first", str(last)]
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check_ops_rank.py"), *args], cwd=ROOT,
                          env={**_env(), "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = gpu_check_ops.read_records(tmp_path / "rank0.jsonl")
    names = next(r["names"] for r in records if r["kind"] == "cases")
    assert [r["name"] for r in records if r["kind"] == "case"] == [names[last]], records


def test_merge_reports_a_failed_setup_and_returns_why():
    rep = _report()
    why = gpu_check_ops.merge(rep, "x", [[_setup()], [_setup("FAIL")], []], [0, 3, None], 1.0)
    assert why and "rank 1: OSError: no" in why and "rank 2: no set-up reported (killed" in why
    assert [(r.name, r.status) for r in rep.results] == [("x setup", "FAIL")]


@pytest.mark.parametrize("kind, two_fails, expected", [
    ("cuda", False, [(2, "i.ops W=2")]),
    ("cuda", True, [(2, "i.ops W=2"), (1, "i.ops W=1 fallback")]),
    ("cpu", False, [(2, "i.ops W=2"), (1, "i.ops W=1")]),
])
def test_one_rank_runs_as_the_fallback_on_a_gpu_and_always_on_the_cpu(monkeypatch, kind, two_fails, expected):
    runs = []

    def fake_run_world(rep, world_size, device, seed, label, budget_s=None):
        runs.append((world_size, label))
        return "set-up failed" if world_size == 2 and two_fails else None

    monkeypatch.setattr(gpu_check_ops, "run_world", fake_run_world)
    gpu_check_ops.run_ops(_report(), torch.device(kind))
    assert runs == expected
