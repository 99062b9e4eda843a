"""The machinery of the ops-on-one-device tests (tests/gpu/test_ops_on_one_device.py, tests/gpu/ops_rank.py), on
the CPU: a rank whose op is wrong fails the float64 oracle and one whose op is not deterministic fails the repeat;
a rank starts at the case it is given; the merge of the ranks' reports needs every rank and says which failed; a
case that raises costs that case only; and one rank runs as the fallback on a GPU, always on the CPU. Every rank
run is a subprocess with a timeout: no test hangs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import ops_rank
from tests.gpu import test_ops_on_one_device as ops

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    return {**env, "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "1"}


def _rank_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--rank", "0", "--world-size", "1", "--init-file", str(tmp_path / "store"), "--device", "cpu",
            "--seed", "7", "--timeout", "30", "--out", str(tmp_path), *extra]


# ----------------------------------------------------------------------------------------------
# The rank's side
# ----------------------------------------------------------------------------------------------


def test_the_cases_are_every_op_and_variant_by_strategy_and_mode():
    from overlap.plans import OPS

    names = [c.name for c in ops_rank.cases(False)]
    ops_and_variants = [f"{n}.{v}" if v else n for n, spec in OPS.items() for v in ("", *spec.variants)]
    strategies = {name: [s for s in ("symm", "fused") if s in spec.strategies] for name, spec in OPS.items()}
    fp8 = [f"{n}.{v}.{r}" if v else f"{n}.{r}" for r in ("fp8", "mxfp8") for n, spec in OPS.items() if spec.fp8
           for v in ("", *spec.variants)]
    assert {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce.one_shot", "all_gather_weight_matmul",
            "moe"} <= set(ops_and_variants)
    assert fp8 == [f"{op}.{r}" for r in ("fp8", "mxfp8") for op in (
        "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_reduce.one_shot",
        "all_gather_weight_matmul", "moe")]
    assert names == [f"{op}-{s}-{mode}" for op in ops_and_variants + fp8 for s in strategies[op.split(".")[0]]
                     for mode in ("fwd", "fwd+bwd")]
    assert [c.name for c in ops_rank.cases(True)] == names  # the sizes differ, the names do not


# The workloads' calls made wrong through the workload table the rank reads (no op internals touched).
_WRONG_OPS = """
import dataclasses
import sys

import torch

import overlap.workloads as wl

calls = []
rs, ag = wl.WORKLOADS["matmul_reduce_scatter"], wl.WORKLOADS["all_gather_matmul"]


def off_by_a_little(*args, **kwargs):  # off the oracle by far more than rounding, still finite
    out = rs.call(*args, **kwargs)
    return out + 1e-3 * out.detach().abs().max()


def one_ulp_apart(*args, **kwargs):  # right within rounding, but not the same twice
    out = ag.call(*args, **kwargs)
    calls.append(1)
    if len(calls) % 2 == 0:
        first = out.detach().view(-1)[0]
        bump = torch.zeros_like(out)
        bump.view(-1)[0] = torch.nextafter(first, torch.tensor(float("inf"))) - first
        out = out + bump
    return out


wl.WORKLOADS["matmul_reduce_scatter"] = dataclasses.replace(rs, call=off_by_a_little)
wl.WORKLOADS["all_gather_matmul"] = dataclasses.replace(ag, call=one_ulp_apart)
from tests.gpu import ops_rank

ops_rank.main(sys.argv[1:])
"""


@pytest.mark.exact
@pytest.mark.cpu_only
@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks over /dev/shm")
def test_a_wrong_op_fails_the_oracle_and_an_unrepeatable_one_the_repeat(tmp_path):
    names = [c.name for c in ops_rank.cases(False)]
    stop = 9  # every case of all_gather_matmul and matmul_reduce_scatter (the table's first two ops), one more
    assert names[8].startswith("matmul_all_reduce-"), names
    proc = subprocess.run([sys.executable, "-c", _WRONG_OPS, *_rank_args(tmp_path, "--stop", str(stop))], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = ops.read_records(tmp_path / "rank0.jsonl")
    assert [r["status"] for r in records if r["kind"] == "setup"] == ["PASS"], records
    cases = {r["name"]: r for r in records if r["kind"] == "case"}
    assert list(cases) == names[:stop], sorted(cases)
    for name, r in cases.items():
        if name.startswith("matmul_reduce_scatter-"):
            assert r["status"] == "FAIL" and "out off the float64 oracle" in r["value"], r
        elif name.startswith("all_gather_matmul-"):
            assert r["status"] == "FAIL" and "out differs between two identical calls" in r["value"], r
            assert "off the float64 oracle" not in r["value"], r  # one ulp is within the rounding bound
        else:
            assert r["status"] == "PASS" and "repeat bitwise" in r["value"], r


@pytest.mark.cpu_only
@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks over /dev/shm")
def test_a_rank_starts_at_the_case_it_is_given(tmp_path):
    last = len(ops_rank.cases(False)) - 1
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.ops_rank", *_rank_args(tmp_path, "--first", str(last))],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = ops.read_records(tmp_path / "rank0.jsonl")
    names = next(r["names"] for r in records if r["kind"] == "cases")
    assert [r["name"] for r in records if r["kind"] == "case"] == [names[last]], records


# ----------------------------------------------------------------------------------------------
# The parent's side: merging the ranks' reports, restarts, the fallback to one rank
# ----------------------------------------------------------------------------------------------


def _case(name: str, status: str = "PASS", value: str = "max 1e-7 from float64, repeat bitwise",
          error: bool = False) -> dict:
    return {"kind": "case", "name": name, "status": status, "value": value, "max_err": 1e-7, "seconds": 0.1,
            **({"error": True} if error else {})}


def _setup(status: str = "PASS") -> dict:
    return {"kind": "setup", "status": status, "value": "2 rank(s) on cpu" if status == "PASS" else "OSError: no"}


NAMES = {"kind": "cases", "names": ["a", "b", "c", "d"]}


def _statuses(world: ops.World) -> dict[str, str]:
    return {name: world.case(name).status for name in world.names}


def test_merge_needs_every_rank_and_says_which_failed():
    # rank 0 raised in b (its run ended there); rank 1 then failed c by its deadline
    ranks = [[NAMES, _setup(), _case("a"), _case("b", "FAIL", "OverlapTimeout: peer 1", error=True)],
             [NAMES, _setup(), _case("a"), _case("b"), _case("c", "FAIL", "OverlapTimeout: peer 0", error=True)]]
    world = ops.merge(ranks, [1, 1], 3.0)
    assert world.setup.status == "PASS" and world.case("a").status == "PASS"
    assert (world.case("b").status, world.case("b").message) == ("FAIL", "rank 0: OverlapTimeout: peer 1")
    assert (world.case("c").status, world.case("c").message) == (
        "FAIL", "rank 1: OverlapTimeout: peer 0 (rank 0 stopped at b)")
    assert (world.case("d").status, world.case("d").message) == ("SKIP", "not run: rank 0 stopped at b")
    assert world.exit.status == "SKIP"  # the failure is already reported by its case

    # every case passed, but a rank was killed at the deadline: the run still fails
    ranks = [[NAMES, _setup(), *map(_case, "abcd")], [NAMES, _setup(), *map(_case, "abcd")]]
    world = ops.merge(ranks, [0, None], 3.0, ["", "waiting for peer 0\n"])
    assert set(_statuses(world).values()) == {"PASS"} and world.exit.status == "FAIL"
    assert "rank 1 (killed" in world.exit.message and "waiting for peer 0" in world.exit.message

    # wrong numbers on one rank do not end its run: later cases are judged on their own
    ranks = [[NAMES, _setup(), *map(_case, "abcd")],
             [NAMES, _setup(), _case("a", "FAIL", "out off the float64 oracle"), _case("b"), _case("c"), _case("d")]]
    world = ops.merge(ranks, [0, 0], 3.0)
    assert (world.case("a").status, world.case("a").message) == ("FAIL", "rank 1: out off the float64 oracle")
    assert _statuses(world) == {"a": "FAIL", "b": "PASS", "c": "PASS", "d": "PASS"}
    assert world.exit.status == "PASS"
    assert world.case("e").status == "FAIL"  # a case the ranks did not list


def test_a_rank_that_left_no_result_is_quoted_and_a_trace_follows_its_message():
    ranks = [[NAMES, _setup(), _case("a"), {**_case("b", "FAIL", "RuntimeError: boom", error=True),
                                            "trace": "Traceback: in run_case"}],
             [NAMES, _setup(), _case("a")]]
    world = ops.merge(ranks, [1, None], 3.0, ["", "stuck in a wait\n"])
    assert world.case("b").message == "rank 0: RuntimeError: boom\nTraceback: in run_case"
    assert world.case("c").status == "SKIP"
    ranks = [[NAMES, _setup(), _case("a"), _case("b")], [NAMES, _setup(), _case("a")]]
    world = ops.merge(ranks, [0, None], 3.0, ["", "stuck in a wait\n"])
    assert world.case("b").message.startswith("rank 1: no result (killed") and "stuck in a wait" in \
        world.case("b").message


def test_a_case_that_raises_costs_that_case_only(monkeypatch):
    """The ranks' run ends at a case that raised; fresh ranks go on from the next case, and the merged results
    judge every case."""
    rounds = [  # first run: rank 0 raised in b, rank 1 was stuck in c when the run was stopped; then c and d
        ([[NAMES, _setup(), _case("a"), _case("b", "FAIL", "RuntimeError: CUDA error", error=True)],
          [NAMES, _setup(), _case("a"), _case("b")]], [1, None]),
        ([[NAMES, _setup(), _case("c"), _case("d")], [NAMES, _setup(), _case("c"), _case("d")]], [0, 0]),
    ]
    starts = []

    def fake_spawn(world_size, device, seed, timeout, budget, tmp, first=0):
        starts.append(first)
        records, codes = rounds[len(starts) - 1]
        for q, rs in enumerate(records):
            (Path(tmp) / f"rank{q}.jsonl").write_text("".join(ops.json.dumps(r) + "\n" for r in rs))
        return codes, 1.0

    monkeypatch.setattr(ops, "spawn", fake_spawn)
    world = ops.run_world(2, torch.device("cpu"), 7, 120.0)
    assert starts == [0, 2]
    assert (world.case("b").status, world.case("b").message) == ("FAIL", "rank 0: RuntimeError: CUDA error")
    assert world.setup.status == "PASS"
    assert _statuses(world) == {"a": "PASS", "b": "FAIL", "c": "PASS", "d": "PASS"}


def test_merge_reports_a_failed_setup():
    world = ops.merge([[_setup()], [_setup("FAIL")], []], [0, 3, None], 1.0)
    assert world.setup.status == "FAIL"
    assert "rank 1: OSError: no" in world.setup.message
    assert "rank 2: no set-up reported (killed" in world.setup.message
    assert world.case("a").status == "SKIP" and "set-up failed" in world.case("a").message
    assert world.exit.status == "SKIP"


@pytest.mark.parametrize("kind, mode, two_fails, two_selected, expected", [
    ("cuda", None, False, True, [2]),
    ("cuda", None, True, True, [2, 1]),
    ("cuda", None, False, False, [1]),  # only the fallback selected: it runs, alone
    ("cuda", "compute mode Exclusive_Process", False, True, [1]),
    ("cpu", None, False, True, [2, 1]),
], ids=["gpu", "gpu-two-fail", "gpu-only-fallback-selected", "gpu-exclusive", "cpu"])
def test_one_rank_runs_as_the_fallback_on_a_gpu_and_always_on_the_cpu(monkeypatch, kind, mode, two_fails,
                                                                      two_selected, expected):
    runs = []

    def fake_run_world(world_size, device, seed, budget_s):
        runs.append(world_size)
        if world_size == 2 and two_fails:
            return ops.World(ops.Outcome("FAIL", "rank 1: set-up failed"))
        return ops.World(ops.Outcome("PASS", f"{world_size} rank(s)"))

    monkeypatch.setattr(ops, "run_world", fake_run_world)
    monkeypatch.setattr(ops, "gpu_facts", lambda: [{"name": "H", "driver": "1", "compute_mode": "x"}])
    monkeypatch.setattr(ops, "compute_mode_problem", lambda gpus: mode)
    worlds = ops.Worlds(torch.device(kind), 7, 120.0, two_selected=two_selected)
    got = {w: worlds.world(w) for w in (ops.WORLD_SIZES if two_selected else (1,))}
    assert runs == expected
    for w, world in got.items():
        assert (world.skipped is None) == (w in expected), (w, world)
    if mode is not None:
        assert mode in got[2].skipped
