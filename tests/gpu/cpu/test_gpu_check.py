"""Tests of the GPU check's driver (tests/gpu/check.py) and its timings' plan (tests/gpu/timings.py) without a GPU:
the driver runs tests/gpu on the CPU (``--cpu``) and leaves its records; a sticky CUDA fault (a test hook) ends only
its xdist worker, the tests after it run in a fresh one; at its time limit the driver ends the tests and says where
they were; the install's environment and deadline; the summary's verdict and exit status. Every run is a subprocess
with a timeout: no test hangs. (The preflight: tests/gpu/cpu/test_gpu_check_preflight.py; the GPU tests' device
work on a model of the hardware queues: tests/gpu/cpu/test_gpu_check_order.py.)
"""

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu import check as gpu_check
from tests.support.scripts import run_module

ROOT = Path(__file__).resolve().parents[3]
MODULE = "tests.gpu.check"  # ``python3 -m tests.gpu.check``
CPU = ["--cpu", "--no-install"]
# Two quick tests of tests/gpu that run on the CPU, in this order (the all-gather file is collected first).
FIRST = "test_all_gather_kernel_gives_up_on_a_shard_never_flagged_and_names_it"
SECOND = "test_reduction_gives_up_on_a_rank_that_never_scatters_and_names_it"
BOTH = "gives_up_on_a"


def _records(out: Path) -> tuple[dict, dict]:
    return json.loads((out / "gpu_check.json").read_text()), json.loads((out / "gpu_tests.json").read_text())


def _outcomes(tests: dict) -> dict[str, list[tuple[str, str]]]:
    """Test name -> [(phase, outcome)] of every report in the record."""
    got: dict[str, list[tuple[str, str]]] = {}
    for t in tests["tests"]:
        got.setdefault(t["test"].split("::")[-1], []).append((t["phase"], t["outcome"]))
    return got


def test_help_names_every_option():
    proc = run_module(MODULE, ["--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--install", "--no-install", "--cpu", "--out", "--time-limit", "-k", "--no-timings", "--no-warm"):
        assert option in proc.stdout, option
    assert "(default 540)" in proc.stdout


def test_a_cpu_run_records_every_test_as_it_goes_and_ends_with_the_verdict(tmp_path):
    # from another folder, with a relative --out: every record lands there (the tests run from the checkout)
    proc = run_module(MODULE, [*CPU, "--out", "records", "-k", "gives_up_on_a or host_word"], timeout=300, cwd=tmp_path)
    tmp_path = tmp_path / "records"
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("gpu_check: passed in "), out[-2000:]
    doc, tests = _records(tmp_path)
    assert doc["exit_status"] == 0 and doc["stages"]["setup"]["problem"] is None, doc
    facts = doc["stages"]["tests"]["gpu_tests"]
    assert facts["complete"] and facts["counts"] == {"passed": 3, "failed": 0, "skipped": 1}, facts  # 1 needs CUDA
    assert "gpu_tests_one_queue" not in doc["stages"]["tests"] and "timings" not in doc["stages"]  # CPU: one pass
    assert tests["finished"] and tests["running"] is None and tests["cuda_device_max_connections"] == "32", tests
    outcomes = _outcomes(tests)
    assert outcomes[FIRST] == [("call", "passed")] and outcomes[SECOND] == [("call", "passed")], outcomes
    notes = {t["test"].split("::")[-1]: t["properties"] for t in tests["tests"]}
    assert "summary" in notes[FIRST] and notes[FIRST]["waited_s"] > 0, notes  # the test's figures, in the record
    assert (tmp_path / "junit_gpu_tests.xml").exists() and "gives_up_on_a" in (tmp_path / "gpu_check.log").read_text()
    # the plan: the modules in their order, each with its budget; the tests ran in that order; a verdict per module
    assert doc["order"] == list(gpu_check.plan.MODULE_ORDER), doc["order"]
    budget = doc["stages"]["budget"]
    assert list(budget["modules"]) == doc["order"] and all(s > 0 for s in budget["modules"].values()), budget
    assert budget["timings_s"] == 0 and budget["source"] == "defaults", budget  # the CPU: no timings; a fresh --out
    ran = [gpu_check.plan.module_of(t["test"]) for t in tests["tests"]]
    assert ran == sorted(ran, key=gpu_check.plan.rank), ran
    verdicts = {m: v["verdict"] for m, v in facts["modules"].items()}
    assert verdicts["test_all_gather_kernels.py"] == verdicts["test_reduce_scatter_kernels.py"] == "passed", verdicts
    assert doc["stages"]["setup"]["test_env"]["CUDA_VISIBLE_DEVICES"] == "", doc["stages"]["setup"]
    toolchain = doc["stages"]["preflight"]["toolchain"]  # the build's toolchain, a fact each
    assert set(toolchain) == {"pybind11", "setuptools", "cmake", "ninja", "c++", "nvcc", "Python.h"}, toolchain
    # the warm stage ran before the tests, compiling ahead of time for sm_90 (how far it got depends on the load)
    stages = list(doc["stages"])
    assert stages.index("warm") < stages.index("budget") < stages.index("tests"), stages
    warm = doc["warm"]
    assert warm["arch"] == "sm_90" and not warm["native"] and warm["jobs"] >= 1 and warm["failed"] == 0, warm
    assert all(v["status"] in ("compiled", "not reached") for v in warm["variants"]), warm["variants"]
    assert (tmp_path / "gpu_warm.json").exists() and "warm:" in proc.stdout


def test_a_sticky_fault_ends_only_its_worker_and_the_next_test_runs_in_a_fresh_one(tmp_path):
    proc = run_module(MODULE, [*CPU, "--no-warm", "--out", str(tmp_path), "-k", BOTH], timeout=300,
                      OVERLAP_GPU_TEST_HOOK=f"fault:{FIRST}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "replacing crashed worker gw0" in out, out[-4000:]
    doc, tests = _records(tmp_path)
    outcomes = _outcomes(tests)
    assert ("setup", "failed") in outcomes[FIRST], outcomes
    assert outcomes[SECOND] == [("call", "passed")], outcomes  # in the fresh worker
    facts = doc["stages"]["tests"]["gpu_tests"]
    assert facts["counts"]["passed"] == 1 and facts["counts"]["failed"] == 1, facts
    assert any("illegal memory access" in f["message"] for f in facts["failures"]), facts
    tail = proc.stdout.rstrip().splitlines()
    assert tail[-1].startswith("gpu_check: FAILED") and any("FAILED tests/gpu/" in line and FIRST in line
                                                            for line in tail), tail[-10:]


def test_without_xdist_the_tests_after_a_sticky_fault_skip_saying_why(tmp_path):
    record = tmp_path / "record.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    env.update(OVERLAP_GPU_TEST_HOOK=f"fault:{FIRST}", OVERLAP_GPU_RECORD=str(record))
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "--ignore", "tests/gpu/cpu", "-k", BOTH,
                           "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-4000:]
    tests = json.loads(record.read_text())
    second = [t for t in tests["tests"] if t["test"].endswith(SECOND)]
    assert second and second[0]["outcome"] == "skipped" and "unusable since" in second[0]["message"], second


def test_at_its_time_limit_the_run_ends_the_tests_and_says_where_they_were(tmp_path):
    began = time.monotonic()
    proc = run_module(MODULE, [*CPU, "--no-warm", "--out", str(tmp_path), "--time-limit", "60", "-k", BOTH],
                      timeout=150, OVERLAP_GPU_TEST_HOOK=f"sleep=600:{FIRST}")
    took = time.monotonic() - began
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert took < 60 + 10, took  # the limit, and the interpreter's start and exit
    doc, tests = _records(tmp_path)
    facts = doc["stages"]["tests"]["gpu_tests"]
    assert facts["exit"] is None and not facts["complete"] and facts["killed_during"].endswith(FIRST), facts
    assert tests["running"]["test"].endswith(FIRST) and not tests["finished"], tests
    assert proc.stdout.rstrip().splitlines()[-1].startswith("gpu_check: INCOMPLETE"), out[-2000:]


def test_the_summary_says_failed_incomplete_or_passed():

    def doc(tests_complete=True, failed=0, timings=None):
        facts = {"counts": {"passed": 5, "failed": failed, "skipped": 2}, "complete": tests_complete,
                 "exit": (1 if failed else 0) if tests_complete else None,
                 "killed_during": None if tests_complete else "tests/gpu/test_x.py::test_y",
                 "failures": [{"test": "tests/gpu/test_x.py::test_z", "phase": "call", "message": "E  boom"}] * failed,
                 "skips": {"needs a GPU": 2}}
        stages = {"tests": {"gpu_tests": facts}}
        if timings is not None:
            stages["timings"] = timings
        return {"started": time.time(), "stages": stages}

    text, code = gpu_check.summary(doc())
    assert code == 0 and text.splitlines()[-1].startswith("gpu_check: passed") and "2 skipped: needs a GPU" in text
    text, code = gpu_check.summary(doc(failed=1))
    assert code == 1 and "FAILED tests/gpu/test_x.py::test_z (call): E  boom" in text
    text, code = gpu_check.summary(doc(tests_complete=False))
    assert code == 3 and "killed at its time during tests/gpu/test_x.py::test_y" in text
    text, code = gpu_check.summary({**doc(), "stages": {"tests": {"gpu_tests": {
        **doc()["stages"]["tests"]["gpu_tests"], "exit": 4}}}})
    assert code == 1 and "pytest exited with status 4" in text  # a usage error (a bad -k) is no pass
    slow = {"exit": 0, "complete": True,
            "results": [{"name": "fused all-gather GEMM x", "status": "PASS", "value": "1.2x", "headline": True}]}
    text, code = gpu_check.summary(doc(timings=slow))
    assert code == 0 and "PASS fused all-gather GEMM x: 1.2x" in text
    text, code = gpu_check.summary(doc(timings={**slow, "complete": False}))
    assert code == 3
    text, code = gpu_check.summary(doc(timings={**slow, "exit": -11, "complete": False}))
    assert code == 1 and "the timings exited with status -11" in text


def test_a_pytest_that_ends_before_its_end_is_a_failure_named_for_its_test(tmp_path):
    record = tmp_path / "gpu_tests.json"
    record.write_text(json.dumps({"finished": False, "running": {"test": "tests/gpu/test_x.py::test_y"}, "tests": [
        {"test": "tests/gpu/test_x.py::test_w", "phase": "call", "outcome": "passed", "message": None,
         "properties": {}}]}))
    crashed = gpu_check.summarize_tests(record, -11)
    assert crashed["counts"] == {"passed": 1, "failed": 1, "skipped": 0} and not crashed["complete"], crashed
    assert crashed["failures"][0]["test"] == "tests/gpu/test_x.py::test_y" and "exit status -11" in \
        crashed["failures"][0]["message"], crashed
    killed = gpu_check.summarize_tests(record, None)  # killed at its time: incomplete, not failed
    assert killed["counts"]["failed"] == 0 and killed["killed_during"] == "tests/gpu/test_x.py::test_y", killed


def test_the_install_uses_every_core_and_ends_before_the_time_limit():
    code = ("from tests.gpu import check as g; "
            "print(g.install_env()['MAX_JOBS'], g.machine_cores(), g.install_deadline(1000.0, 480.0))")
    env = {k: v for k, v in os.environ.items() if k != "MAX_JOBS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs, cores, until = proc.stdout.split()
    assert jobs == cores and int(cores) == len(os.sched_getaffinity(0))
    assert float(until) == 1000.0 + 480.0 - 30.0  # leaves time to write the record and exit


def test_the_timings_cover_each_kernel_against_what_it_replaces():
    proc = run_module("tests.gpu.timings", ["--list"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = proc.stdout.splitlines()
    for what in ("d2d copy", "stream-ordered signal", "fused all-gather GEMM llama3-70b-tp8 qkv",
                 "fused GEMM + reduce-scatter llama3-70b-tp8 mlp-down",
                 "fused GEMM + one-shot all-reduce llama3-70b-tp8 mlp-down decode",
                 "fused MoE dispatch GEMM mixtral-full", "fused MoE combine GEMM deepseek-v3-full"):
        assert what in names, names


GPU_CHECK_FILES = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests" / "gpu").glob("*.py"))
                   if p.name != "__init__.py"]  # the driver, preflight and timings among them


@pytest.mark.parametrize("path", GPU_CHECK_FILES)
def test_the_gpu_check_imports_no_op_internals(path):
    """The GPU tests, the driver and the timings reach the kernels through the launchers, tile tables and slot
    layouts of `overlap.kernels`, and the ops through their public API: a layout change in `overlap/ops/` cannot
    leave a copy of it here behind."""
    tree = ast.parse((ROOT / path).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in modules if m.startswith("overlap.ops")], modules


def test_on_a_gpu_the_tests_run_twice_the_second_time_under_one_queue(tmp_path, monkeypatch):
    """The passes a GPU run makes (recorded, not run): all of tests/gpu under 32 hardware queues within the modules'
    budgets (each module's slot end passed to the tests), then the ``one_queue`` tests under 1 until the test
    budget's end, each with its record and deadline; eager module loading and the symmetric memory backend set."""
    run = gpu_check.Run(gpu_check.parse_args(["--out", str(tmp_path), "-k", "kernel"]))
    calls = []
    monkeypatch.setattr(run, "run_teed", lambda cmd, env, until: calls.append((cmd, env, until)) or 0)
    began = time.time()
    order = run.doc["order"] + [gpu_check.ONE_QUEUE_PASS]
    split = gpu_check.plan.split(400.0, order, {})
    try:
        gpu_check.run_tests(run, split)
    finally:
        run.log_file.close()
    assert len(calls) == 2, calls
    (first, env1, until1), (second, env2, until2) = calls
    assert env1["CUDA_DEVICE_MAX_CONNECTIONS"] == "32" and env2["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env1["CUDA_MODULE_LOADING"] == "EAGER" and env1["TORCH_SYMMMEM"] == "CUDA" and "CUDA_VISIBLE_DEVICES" \
        not in {k for k, v in env1.items() if v == ""}
    assert "one_queue" not in first and second[second.index("-m", 3) + 1] == "one_queue"  # (after "-m pytest")
    assert first[first.index("-k") + 1] == "kernel" == second[second.index("-k") + 1]
    assert {"-n", "--max-worker-restart", "--timeout"} <= set(first) and str(tmp_path / "gpu_tests.json") == \
        env1["OVERLAP_GPU_RECORD"] and env2["OVERLAP_GPU_RECORD"].endswith("gpu_tests_one_queue.json")
    modules = sum(s for m, s in split.modules.items() if m != gpu_check.ONE_QUEUE_PASS)
    step = gpu_check.PASS_STARTUP_S
    assert began + step + modules <= until1 <= time.time() + step + modules
    assert began + 2 * step + split.tests_s <= until2 <= time.time() + 2 * step + split.tests_s
    assert float(env1["OVERLAP_GPU_TESTS_UNTIL"]) == until1 and float(env2["OVERLAP_GPU_TESTS_UNTIL"]) == until2
    budgets = json.loads(env1["OVERLAP_GPU_MODULE_BUDGETS"])
    assert list(budgets) == run.doc["order"] and "OVERLAP_GPU_MODULE_BUDGETS" not in env2, budgets
    assert env1["OVERLAP_GPU_MODULE_ANCHOR"] == str(tmp_path / "gpu_tests.anchor")
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["tests"]
    assert set(stages) == {"gpu_tests", "gpu_tests_one_queue"}, stages
