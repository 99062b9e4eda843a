"""The GPU check's plan of its test pass (docs/gpu-check.md): the modules of tests/gpu in the order they run, and
the split of the time left between them and the timings.

* **The order** (`MODULE_ORDER`, defined here only): the kernel tests first (all-gather, reduce-scatter, MoE
  dispatch and combine, the MoE all-to-all, stream signals, the ``symm`` pipeline, host waits), then the ops'
  logic, the ops on one device last (the slowest: two processes per case). tests/gpu/conftest.py sorts what pytest
  collected by it, the driver records it (``gpu_check.json``'s ``"order"``), and a run cut off at its limit loses
  the end of this list, never a kernel module.
* **The budget** (`split`, a pure function): the test pass gets what its modules need (each module's seconds in
  the record of the last run where one exists, else `DEFAULT_ESTIMATE_S`; at least `MIN_MODULE_S`, the ops module at
  least its floor of `FLOORS`, and each at least its first test's seconds in that record), with `MARGIN` on top;
  the timings get the rest, at least `TIMINGS_MIN_S` where the time allows. Where the time left is less than the
  modules need, every module still gets its minimum before any gets more, and before the timings get theirs: the
  split alone never leaves a module without a verdict.
* **The schedule in the pass** (`module_ends`, `should_skip`): each module's slot ends at the start of the pass's
  first test plus the budgets of the modules up to it (time a module leaves unused goes to the ones after it). A
  module's first test always runs; a later one skips, saying so, once its module's slot has ended, so the modules
  after it run.
  `simulate` replays a run's per-test seconds through these rules (tests/gpu/cpu/test_gpu_check_plan.py).

Imports nothing of overlap or torch (the driver reads it before the install).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

# The modules of tests/gpu (less tests/gpu/cpu), in the order the GPU check runs them.
MODULE_ORDER = (
    "test_all_gather_kernels.py",
    "test_reduce_scatter_kernels.py",
    "test_moe_dispatch_kernel.py",
    "test_moe_combine_kernel.py",
    "test_moe_all_to_all.py",
    "test_stream_signals.py",
    "test_symm_pipeline.py",
    "test_host_waits.py",
    "test_ops_world.py",
    "test_ops_on_one_device.py",
)
OPS_MODULE = "test_ops_on_one_device.py"
FLOORS = {OPS_MODULE: 90.0}  # seconds a module gets at least (the ops: one run of two rank processes per case)
MIN_MODULE_S = 15.0  # ... and every other module
DEFAULT_ESTIMATE_S = 30.0  # a module's need where no earlier record says (its floor where that is more)
MARGIN = 1.25  # the test pass gets its modules' needs times this, where the time allows
TIMINGS_MIN_S = 90.0  # what the timings keep at least, where the time allows
SKIP_REASON = "the budget of {module} ({seconds:.0f} s) is spent: its later tests skip so the modules after it run"


def module_of(nodeid: str) -> str:
    """``tests/gpu/test_x.py::test_y[a]`` -> ``test_x.py``."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def rank(module: str) -> int:
    """A module's place in `MODULE_ORDER` (an unlisted one runs after every listed one)."""
    return MODULE_ORDER.index(module) if module in MODULE_ORDER else len(MODULE_ORDER)


def estimates(records: Iterable[Mapping], first: bool = False) -> dict[str, float]:
    """Seconds each module took, summed over the tests (every phase) of the test-pass records given (the
    ``gpu_tests.json`` of earlier runs; for a module in several, the last); with `first`, the seconds of each
    module's first test only (the one that always runs, and pays the module's first compiles)."""
    found: dict[str, float] = {}
    for doc in records:
        mine: dict[str, float] = {}
        firsts: dict[str, str] = {}
        for t in doc.get("tests", []):
            module = module_of(t["test"])
            if first and firsts.setdefault(module, t["test"]) != t["test"]:
                continue
            mine[module] = mine.get(module, 0.0) + float(t.get("seconds") or 0.0)
        found.update(mine)
    return found


def read_estimates(path: Path, first: bool = False) -> dict[str, float]:
    """`estimates` of the record at `path`, nothing where there is none or it does not parse."""
    try:
        return estimates([json.loads(path.read_text())], first)
    except (OSError, ValueError, KeyError, TypeError):
        return {}


@dataclasses.dataclass
class Split:
    modules: dict[str, float]  # seconds per module, in run order
    tests_s: float  # their sum: the test pass's budget
    timings_s: float  # the rest of the time left
    needs: dict[str, float]  # what each module was estimated to need
    source: str  # where the needs came from: "last record" or "defaults"


def split(time_left: float, order: Iterable[str], known: Mapping[str, float] | None = None,
          floors: Mapping[str, float] | None = None, timings: bool = True,
          firsts: Mapping[str, float] | None = None) -> Split:
    """The test pass's budget per module and the timings' share of `time_left` seconds (see the module's doc).
    `known`: the seconds each module took in the last record; `firsts`: those of its first test, which always
    runs: a module's minimum covers it, so a slow first test does not eat the slots of the modules after it."""
    order = list(order)
    known = dict(known or {})
    floors = FLOORS if floors is None else floors
    firsts = firsts or {}
    least = {m: max(MIN_MODULE_S, floors.get(m, 0.0), firsts.get(m, 0.0)) for m in order}
    needs = {m: max(least[m], known.get(m, max(DEFAULT_ESTIMATE_S, least[m]))) for m in order}
    want = MARGIN * sum(needs.values())
    floor_sum = sum(least.values())
    room = max(0.0, time_left - (TIMINGS_MIN_S if timings else 0.0))
    tests_s = min(want, max(room, floor_sum)) if timings else max(want, time_left)
    tests_s = min(tests_s, time_left) if time_left > 0 else 0.0
    if tests_s <= floor_sum:  # less than the minimums: every module its share of them
        scale = tests_s / floor_sum if floor_sum else 0.0
        modules = {m: least[m] * scale for m in order}
    else:  # the minimums, then the rest in proportion to what each needs beyond its minimum (or its need)
        extra = {m: (MARGIN * needs[m]) - least[m] for m in order}
        total = sum(extra.values())
        rest = tests_s - floor_sum
        modules = {m: least[m] + (rest * extra[m] / total if total > 0 else rest / len(order)) for m in order}
    tests_s = sum(modules.values())
    return Split(modules, tests_s, max(0.0, time_left - tests_s), needs,
                 "last record" if any(m in known for m in order) else "defaults")


def module_ends(start: float, budgets: Mapping[str, float]) -> dict[str, float]:
    """The wall time each module's slot ends at: `start` plus the budgets of the modules up to it (in order)."""
    ends, at = {}, start
    for module, seconds in budgets.items():
        at += seconds
        ends[module] = at
    return ends


def should_skip(module: str, now: float, ends: Mapping[str, float], first_of_module: bool) -> bool:
    """Whether a test of `module` starting at `now` skips: not its module's first, and past its slot's end."""
    return not first_of_module and module in ends and now > ends[module]


def simulate(budgets: Mapping[str, float], tests: Iterable[tuple[str, float]], until: float) -> dict[str, dict]:
    """Replay `tests` (node id, seconds, in run order) through the schedule from time 0, the pass killed at `until`:
    per module, how many ran, skipped at the budget and never started, and its verdict (``"complete"``,
    ``"partial"``: some skipped at the budget or killed, ``None``: no test of it ran)."""
    ends = module_ends(0.0, budgets)
    out: dict[str, dict] = {m: {"ran": 0, "skipped": 0, "not_started": 0} for m in budgets}
    now, seen = 0.0, set()
    for nodeid, seconds in tests:
        module = module_of(nodeid)
        got = out.setdefault(module, {"ran": 0, "skipped": 0, "not_started": 0})
        if now >= until:
            got["not_started"] += 1
            continue
        if should_skip(module, now, ends, module not in seen):
            got["skipped"] += 1
            continue
        seen.add(module)
        now += seconds
        if now > until:
            got["not_started"] += 1  # killed during it: no verdict of its own
            continue
        got["ran"] += 1
    for got in out.values():
        got["verdict"] = None if got["ran"] == 0 else "complete" if got["skipped"] + got["not_started"] == 0 \
            else "partial"
    return out
