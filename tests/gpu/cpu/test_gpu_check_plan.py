"""The GPU check's plan (tests/gpu/plan.py) without a GPU: one order of the modules of tests/gpu, kernels first, the
ops on one device last, covering every module; the budget split between the modules and the timings; and a
recorded slow first run (``slow_h200_cold_run.json``: MADE UP, plausible per-test seconds of a cold H200 run, since
no GPU has run these tests yet) replayed through the split and the in-pass schedule: every module gets a budget and
a verdict. The rehearsal's record shows the same order (tests/gpu/cpu/test_gpu_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import check as gpu_check
from tests.gpu import plan

ROOT = Path(__file__).resolve().parents[3]
SLOW_RUN = Path(__file__).with_name("slow_h200_cold_run.json")
KERNEL_MODULES = ("test_all_gather_kernels.py", "test_reduce_scatter_kernels.py", "test_moe_dispatch_kernel.py",
                  "test_moe_combine_kernel.py", "test_moe_all_to_all.py", "test_stream_signals.py",
                  "test_symm_pipeline.py", "test_host_waits.py")
# what a first GPU run has for its tests and timings: --time-limit, less the preflight, the warm stage and the margin
FIRST_RUN_LEFT_S = 540.0 - 15.0 - 60.0 - gpu_check.MARGIN_S


def test_the_order_is_every_module_of_tests_gpu_kernels_first_ops_last():
    present = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert sorted(plan.MODULE_ORDER) == present  # a new module must take its place in the order
    assert set(plan.MODULE_ORDER[:len(KERNEL_MODULES)]) == set(KERNEL_MODULES)
    assert plan.MODULE_ORDER[-1] == plan.OPS_MODULE == "test_ops_on_one_device.py"
    assert sorted(present) != list(plan.MODULE_ORDER)  # (pytest's alphabetical order would not be it)


def _slow_run() -> dict:
    doc = json.loads(SLOW_RUN.read_text())
    assert "MADE-UP" in doc["made_up"]
    return doc


def _order() -> list[str]:
    return [*plan.MODULE_ORDER, gpu_check.ONE_QUEUE_PASS]


def test_the_recorded_slow_run_is_over_budget_and_covers_every_module():
    doc = _slow_run()
    needs = plan.estimates([doc])
    assert set(needs) == set(plan.MODULE_ORDER), needs
    assert sum(needs.values()) > FIRST_RUN_LEFT_S  # the case the split exists for: not everything fits


def test_a_recorded_slow_run_through_the_split_and_the_schedule_leaves_no_module_without_a_verdict():
    doc = _slow_run()
    known, firsts = plan.estimates([doc]), plan.estimates([doc], first=True)
    got = plan.split(FIRST_RUN_LEFT_S - 2 * gpu_check.PASS_STARTUP_S, _order(), known, firsts=firsts)
    assert got.source == "last record" and list(got.modules) == _order()
    assert all(s > 0 for s in got.modules.values()), got.modules
    assert got.modules[plan.OPS_MODULE] >= plan.FLOORS[plan.OPS_MODULE], got.modules
    # the modules' minimums (their first tests here) come before the timings' minimum: the timings get the rest
    assert 0 < got.timings_s < plan.TIMINGS_MIN_S and got.tests_s + got.timings_s == pytest.approx(
        FIRST_RUN_LEFT_S - 2 * gpu_check.PASS_STARTUP_S)
    modules = {m: s for m, s in got.modules.items() if m != gpu_check.ONE_QUEUE_PASS}
    tests = sorted(((t["test"], t["seconds"]) for t in doc["tests"]), key=lambda t: plan.rank(plan.module_of(t[0])))
    verdicts = plan.simulate(modules, tests, until=sum(modules.values()))
    assert [m for m, v in verdicts.items() if v["verdict"] is None] == [], verdicts
    assert any(v["verdict"] == "partial" for v in verdicts.values()), verdicts  # the budgets did cut
    # without the first tests' seconds the minimums would not cover them: the ops module, last, would get no verdict
    blind = plan.split(FIRST_RUN_LEFT_S - 2 * gpu_check.PASS_STARTUP_S, _order(), known)
    blind_modules = {m: s for m, s in blind.modules.items() if m != gpu_check.ONE_QUEUE_PASS}
    assert plan.simulate(blind_modules, tests, until=sum(blind_modules.values()))[plan.OPS_MODULE]["verdict"] is None


def test_the_ops_module_gets_its_floor_and_time_it_does_not_need_goes_to_the_timings():
    fast = {m: 2.0 for m in plan.MODULE_ORDER}
    got = plan.split(450.0, plan.MODULE_ORDER, fast)
    assert got.modules[plan.OPS_MODULE] >= 90.0 and all(s >= plan.MIN_MODULE_S for s in got.modules.values())
    assert got.tests_s == pytest.approx(plan.MARGIN * sum(got.needs.values())) and got.timings_s > 150.0, got
    none = plan.split(450.0, plan.MODULE_ORDER, {})  # no record: the defaults
    assert none.source == "defaults" and none.needs[plan.OPS_MODULE] >= 90.0
    cpu = plan.split(280.0, plan.MODULE_ORDER, {}, timings=False)  # the rehearsal: no timings, the tests get it all
    assert cpu.timings_s == 0.0 and cpu.tests_s == pytest.approx(280.0)


@pytest.mark.parametrize("left", [0.0, 30.0, 120.0, 250.0])
def test_too_little_time_still_gives_every_module_a_share(left):
    got = plan.split(left, _order(), plan.estimates([_slow_run()]))
    assert got.tests_s <= max(left, 0.0) + 1e-9
    if left > 0:
        assert all(s > 0 for s in got.modules.values()), got.modules


def test_a_modules_first_test_always_runs_and_its_later_ones_skip_past_its_slot():
    ends = plan.module_ends(100.0, {"a.py": 10.0, "b.py": 5.0})
    assert ends == {"a.py": 110.0, "b.py": 115.0}
    assert not plan.should_skip("a.py", 500.0, ends, first_of_module=True)
    assert plan.should_skip("a.py", 110.5, ends, first_of_module=False)
    assert not plan.should_skip("b.py", 112.0, ends, first_of_module=False)  # time a left goes to b


def test_the_gpu_tests_run_in_the_plans_order_and_skip_past_their_modules_slot(tmp_path):
    """pytest of tests/gpu (CPU mode) with every module's slot already ended: the modules run in `MODULE_ORDER`,
    the first test of each runs and the later ones skip, saying why."""
    record, anchor = tmp_path / "record.json", tmp_path / "anchor"
    anchor.write_text("0.0")  # the pass's first test started long ago: every slot has ended
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER",)}
    env.update(OVERLAP_GPU_RECORD=str(record), OVERLAP_GPU_MODULE_ANCHOR=str(anchor),
               OVERLAP_GPU_MODULE_BUDGETS=json.dumps({m: 1.0 for m in plan.MODULE_ORDER}))
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "--ignore", "tests/gpu/cpu", "-p",
                           "no:cacheprovider", "-p", "no:xdist", "-k", "gives_up_on_a or cases_are_every or merge"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    tests = json.loads(record.read_text())["tests"]
    modules = [plan.module_of(t["test"]) for t in tests]
    assert modules == sorted(modules, key=plan.rank) and modules[0] == "test_all_gather_kernels.py", modules
    by_module: dict[str, list[tuple[str, str]]] = {}
    for t in tests:
        by_module.setdefault(plan.module_of(t["test"]), []).append((t["outcome"], t["message"] or ""))
    assert set(by_module) == {"test_all_gather_kernels.py", "test_reduce_scatter_kernels.py", "test_ops_world.py"}
    for module, got in by_module.items():
        assert got[0][0] == "passed", (module, got)
        assert all(outcome == "skipped" and "budget of " + module in why for outcome, why in got[1:]), got
    assert len(by_module["test_ops_world.py"]) >= 3  # (two merge tests and the cases)
