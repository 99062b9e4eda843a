#!/usr/bin/env python3
"""The GPU check of overlap: one run on a GPU machine that proves the GPU paths and times them (docs/gpu-check.md).

Usage::

    python3 -m tests.gpu.check                       # a GPU machine: preflight, install, tests/gpu, timings
    python3 -m tests.gpu.check -k "all_gather or moe" # only the tests pytest's -k selects (then the timings)
    python3 -m tests.gpu.check --cpu --no-install    # the same on the CPU (interpreted kernels, no timings)

from the repository's root (``tests`` is a package there).

In order, within ``--time-limit`` (default 540 s, counted from the start, the install included):

1. **preflight** (`tests.gpu.preflight`), every run: ``nvidia-smi``'s facts and compute mode, ``nvcc`` and
   ``CUDACXX``, the build's toolchain (pybind11, CMake, ninja, setuptools, a C++ compiler, Python's headers), a
   writable install target; where an install is needed, what would make it fail
   ends the run here (exit 2);
2. **install** (where ``overlap._C`` does not import, or ``--install``): ``pip install --no-build-isolation
   --no-deps -e .``, building ``_C`` with ``MAX_JOBS`` = the machine's cores, then this command runs again
   (``python -m tests.gpu.check``); then ``_C`` must have its CUDA half where a GPU is present (one clear FAIL,
   exit 2, also with ``--no-install``);
3. **the warm stage** (`tests.gpu.warm`, unless ``--no-warm``): every Triton kernel variant the tests and the timings
   launch, found on the CPU and compiled into Triton's cache by one process per core (for this GPU; with ``--cpu``
   ahead of time for sm_90), at most ``WARM_MAX_S`` or a fifth of what is left; recorded as ``"warm"`` (the
   variants, the architecture, the seconds);
4. **the tests**: ``pytest tests/gpu`` (less tests/gpu/cpu, the CPU tests of this check) in the modules' order of
   `tests.gpu.plan` (the kernel tests first, the ops on one device last), under ``CUDA_DEVICE_MAX_CONNECTIONS=32``
   (on a GPU also ``CUDA_MODULE_LOADING=EAGER`` and ``TORCH_SYMMMEM=CUDA``; the ``cpu_only`` tests deselected) with
   pytest-xdist's one worker (a sticky CUDA fault ends that worker; a fresh one runs the tests after it) and
   pytest-timeout's per-test limit, each module within its budget (`plan.split`: what the last record says each
   module needs, the ops module at least 90 s; a module's first test always runs, its later ones skip once its slot
   has ended), then the tests marked ``one_queue`` again under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (a line of its own
   in the split);
5. **the timings** (`tests.gpu.timings`, GPU only): the rest.

The install, each pass of the tests and the timings run in processes of their own, each killed at its share of the
time (and a stuck test ends its xdist worker at pytest-timeout's limit), so the run always ends by itself within
its limit, and always leaves a record in ``--out`` (default ``gpu_check_out/``, under ``$OUT`` where set):
``gpu_check.json`` (the stages, their figures and the summary, rewritten after each), ``gpu_tests.json`` and
``gpu_tests_one_queue.json`` (every test's outcome, written as it goes), ``gpu_warm.json``, ``junit*.xml``,
``gpu_timings.json`` and
``gpu_check.log`` (everything printed). The output ends with a summary: each failed test (its node id reruns it
with pytest), the skips by reason, the timings' headline figures and a count line. Exit status: 0 everything ran
and passed, 1 a test or timing failed, 2 the preflight, the install or the command line failed, 3 something did not
run (the time limit).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.gpu import plan

T0 = time.time()  # --time-limit counts from here (kept across the re-exec after the install)
ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "gpu"
MODULE = "tests.gpu.check"  # this command: ``python3 -m tests.gpu.check`` from the repository root
INSTALL_RESERVE_S = 30.0  # what the install leaves of --time-limit at least
MARGIN_S = 8.0  # what the run keeps at its end: writing the record and the summary
PER_TEST_S = 240.0  # pytest-timeout's limit per test at most (the ops' one run of the rank processes is the longest)
MIN_PER_TEST_S = 60.0  # ... and at least
WORKER_RESTARTS = 8  # pytest-xdist's --max-worker-restart: sticky faults the run survives
PASSES = (("gpu_tests", "32", None), ("gpu_tests_one_queue", "1", "one_queue"))  # record, queues, marker
ONE_QUEUE_PASS = "one_queue pass"  # the second pass's line in the budget (after the modules of `plan.MODULE_ORDER`)
PASS_STARTUP_S = 10.0  # what a pass of pytest takes before its first test (the interpreter, torch, xdist's worker)
WARM_MAX_S = 90.0  # the warm stage's time at most ...
WARM_SHARE = 0.2  # ... and at most this share of what is left when it starts
EXIT_OK, EXIT_FAILED, EXIT_SETUP, EXIT_INCOMPLETE = 0, 1, 2, 3


def default_out() -> str:
    return os.path.join(os.environ["OUT"], "gpu_check_out") if os.environ.get("OUT") else "gpu_check_out"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu.check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", action="store_true", help="(re)install overlap first, even if overlap._C imports")
    p.add_argument("--no-install", action="store_true", help="never install, even if overlap._C does not import")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU: the tests under the Triton interpreter at tiny sizes, no timings")
    p.add_argument("--out", default=default_out(), help="where the records and the log go (default gpu_check_out/, "
                                                        "under $OUT where set)")
    p.add_argument("--time-limit", type=float, default=540.0,
                   help="seconds from the start, the install included; the run ends by itself within it (default "
                        "540)")
    p.add_argument("-k", dest="keyword", default=None, metavar="EXPR", help="only the tests pytest's -k EXPR selects")
    p.add_argument("--no-timings", action="store_true", help="run the tests only")
    p.add_argument("--no-warm", action="store_true",
                   help="no warm stage: the tests compile their kernels as they launch them")
    p.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)  # kept across the re-exec
    return p.parse_args(argv)


# ==============================================================================================
# The log and the record
# ==============================================================================================


class Run:
    """The run's clock, its log (stdout and ``gpu_check.log``) and its record (``gpu_check.json``)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = args.started_at or T0
        self.deadline = self.started + args.time_limit
        args.out = str(Path(args.out).resolve())  # the children run from the checkout's root
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        fresh = args.started_at is None
        self.log_file = open(self.out / "gpu_check.log", "w" if fresh else "a", encoding="utf-8")  # noqa: SIM115
        record = self.out / "gpu_check.json"
        self.doc: dict[str, Any] = {} if fresh or not record.exists() else json.loads(record.read_text())
        self.doc.setdefault("started", self.started)
        self.doc.update(time_limit=args.time_limit, mode="cpu" if args.cpu else "gpu")
        self.doc.setdefault("stages", {})
        self.doc["order"] = [m for m in plan.MODULE_ORDER if (TESTS / m).is_file()]  # the test pass's modules

    def log(self, msg: str) -> None:
        line = f"[gpu_check {time.time() - self.started:6.1f}s] {msg}"
        self.write(line + "\n")

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.log_file.write(text)
        self.log_file.flush()

    def stage(self, name: str, **facts: Any) -> None:
        """Record what stage `name` found, and save the record."""
        self.doc["stages"].setdefault(name, {}).update(facts)
        self.save()

    def save(self) -> None:
        path = self.out / "gpu_check.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, path)

    def left(self) -> float:
        """Seconds left before the run must end (its margin kept)."""
        return self.deadline - MARGIN_S - time.time()

    def run_teed(self, cmd: list[str], env: dict[str, str], until: float) -> int | None:
        """Run `cmd` in a session of its own, its output copied line by line to ours and to the log; kill its whole
        process group at wall time `until`. Returns its exit status (negative: a signal), None if killed."""
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace", bufsize=1)

        def copy() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.write(line)

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            code: int | None = proc.wait(timeout=max(0.0, until - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            code = None
        copier.join(timeout=5.0)
        return code


# ==============================================================================================
# Preflight and install
# ==============================================================================================


def project_problem() -> str | None:
    """None if overlap._C imports and suits this machine, else what is wrong."""
    import torch

    try:
        from overlap import signals  # overlap._C's exports: raises ImportError where it is not built
    except Exception as exc:  # noqa: BLE001 - whatever keeps overlap from importing is this one problem
        return f"overlap._C does not import ({type(exc).__name__}: {exc})"
    if torch.cuda.is_available() and not signals.has_cuda:
        return "overlap._C was built without its CUDA half, on a machine with a GPU"
    return None


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def install_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The install's environment: ``MAX_JOBS`` = this machine's cores unless the caller set it, and what the
    preflight found the build needs (``CUDACXX`` where CMake would not find nvcc)."""
    env = {**os.environ, **(extra or {})}
    env.setdefault("MAX_JOBS", str(machine_cores()))
    return env


def install_deadline(started: float, time_limit: float) -> float:
    """Wall time by which the install must be done: the run's deadline less INSTALL_RESERVE_S."""
    return started + time_limit - min(INSTALL_RESERVE_S, 0.25 * time_limit)


def install(run: Run) -> str | None:
    """The preflight (its facts logged and recorded), then, where it is needed, the install of overlap (editable,
    building _C here) and this command again (no return); else None. Returns what went wrong where the preflight
    or the install failed."""
    from tests.gpu.preflight import preflight

    args = run.args
    import torch

    if "preflight" not in run.doc["stages"]:  # (not again after the install)
        checked = preflight(dict(os.environ), gpu=not args.cpu and torch.cuda.is_available(), root=ROOT)
        for fact in checked.facts:
            run.log(f"preflight: {fact}")
        run.stage("preflight", facts=checked.facts, problems=checked.problems, env=checked.env,
                  toolchain=checked.toolchain)
    why = None if args.no_install else "--install given" if args.install else project_problem()
    if why is None:
        return None
    checked_problems = run.doc["stages"]["preflight"]["problems"]
    if checked_problems:
        return "the install cannot work here: " + "; ".join(checked_problems)
    until = install_deadline(run.started, args.time_limit)
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", str(ROOT)]
    env = install_env(run.doc["stages"]["preflight"]["env"])
    run.log(f"installing overlap ({why}), MAX_JOBS={env['MAX_JOBS']}, at most {until - time.time():.0f} s: "
            f"{' '.join(cmd)}")
    (ROOT / "build").mkdir(exist_ok=True)
    began = time.time()
    with open(ROOT / "build" / ".gpu_check_install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs on one checkout build one at a time
        code = run.run_teed(cmd, env, until)
    run.stage("install", exit=code, seconds=round(time.time() - began, 1))
    if code != 0:
        return ("the install ran out of time" if code is None else f"the install failed (exit {code})") + \
            "; rerun with --no-install to check what is there"
    argv = [a for a in sys.argv[1:] if a != "--install"] + ["--no-install", "--started-at", repr(run.started)]
    run.log_file.close()
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", MODULE, *argv])
    return None  # not reached


# ==============================================================================================
# The tests and the timings
# ==============================================================================================


def plugins() -> dict[str, bool]:
    """Which of the plugins the run counts on this machine has."""
    return {name: importlib.util.find_spec(module) is not None
            for name, module in (("pytest-xdist", "xdist"), ("pytest-timeout", "pytest_timeout"))}


def pytest_command(args: argparse.Namespace, record: str, marker: str | None, per_test_s: float) -> list[str]:
    """``pytest tests/gpu`` (not tests/gpu/cpu: the CPU tests of this check) with the plugins this machine has: one
    xdist worker (restarted after a sticky fault) and pytest-timeout's limit per test, the junit record beside the
    JSON one."""
    cmd = [sys.executable, "-m", "pytest", str(TESTS), "--ignore", str(TESTS / "cpu"), "-p", "no:cacheprovider",
           "-o", "addopts=", "-rfEs", "--strict-markers", "--junitxml", str(Path(args.out) / f"junit_{record}.xml")]
    have = plugins()
    if have["pytest-xdist"]:
        cmd += ["-n", "1", "--max-worker-restart", str(WORKER_RESTARTS)]
    if have["pytest-timeout"]:
        cmd += ["--timeout", str(int(per_test_s)), "--timeout-method", "thread"]  # a stuck C call ends its worker
    if marker:
        cmd += ["-m", marker]
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd


def run_warm(run: Run) -> None:
    """The warm stage (`tests.gpu.warm`) in a process of its own, one compiling process per core, for at most
    `WARM_MAX_S` or `WARM_SHARE` of what is left; its record goes into ``"warm"`` (``stages.warm`` says how it
    ended). A stage cut short or failing costs only time: a test compiles what it launches either way."""
    path = Path(run.args.out) / "gpu_warm.json"
    path.unlink(missing_ok=True)
    until = time.time() + max(0.0, min(WARM_MAX_S, WARM_SHARE * run.left()))
    cmd = [sys.executable, "-m", "tests.gpu.warm", "--out", str(path), "--until", repr(until),
           "--jobs", str(machine_cores())]
    run.log(f"warm stage, at most {until - time.time():.0f} s: {' '.join(cmd[2:])}")
    began = time.time()
    # the tests' environment (what Triton keys its cache on is the same), compiled rather than interpreted
    code = run.run_teed(cmd, {**os.environ, **test_env(run.args.cpu), "TRITON_INTERPRET": "0"}, until + 5.0)
    doc = json.loads(path.read_text()) if path.exists() else {"variants": [], "complete": False}
    run.doc["warm"] = doc
    run.stage("warm", exit=code, seconds=round(time.time() - began, 1), complete=doc.get("complete", False),
              compiled=doc.get("compiled", 0), variants=len(doc["variants"]))


def budget(run: Run, timings: bool) -> plan.Split:
    """The split of what is left between the modules of the test pass (in `plan.MODULE_ORDER`), the one-queue pass
    on a GPU, and the timings (`plan.split`), from the seconds each took in the records of this --out's last run
    (where there are some); recorded in ``stages.budget``."""
    out = Path(run.args.out)
    known = plan.read_estimates(out / "gpu_tests.json")
    firsts = plan.read_estimates(out / "gpu_tests.json", first=True)
    order = list(run.doc["order"])
    if not run.args.cpu:
        order.append(ONE_QUEUE_PASS)
        one_queue = sum(plan.read_estimates(out / "gpu_tests_one_queue.json").values())
        if one_queue:
            known[ONE_QUEUE_PASS] = one_queue
    passes = 1 if run.args.cpu else len(PASSES)
    got = plan.split(run.left() - passes * PASS_STARTUP_S, order, known, timings=timings, firsts=firsts)
    run.stage("budget", time_left=round(run.left(), 1), source=got.source, tests_s=round(got.tests_s, 1),
              timings_s=round(got.timings_s, 1), modules={m: round(s, 1) for m, s in got.modules.items()},
              needs={m: round(s, 1) for m, s in got.needs.items()})
    return got


def run_tests(run: Run, split: plan.Split) -> None:
    """The passes of `PASSES` (on the CPU only the first), within the budget of `split`: the first pass has the
    modules' budgets (each module's slot ends where `plan.module_ends` says: its later tests skip after that),
    the one-queue pass its own line and what the first left. What each found goes into the record
    (``stages.tests``)."""
    passes = PASSES if not run.args.cpu else PASSES[:1]
    missing = [name for name, there in plugins().items() if not there]
    if missing:
        run.log(f"WARNING: {', '.join(missing)} missing here: without pytest-xdist a sticky CUDA fault skips every "
                "later test; without pytest-timeout a stuck test takes the rest of its pass")
    run.stage("setup", missing_plugins=missing)
    modules = {m: s for m, s in split.modules.items() if m != ONE_QUEUE_PASS}
    began = time.time()
    for i, (record, queues, marker) in enumerate(passes):
        first = i == 0
        ends = plan.module_ends(time.time() + PASS_STARTUP_S, modules)
        end = max(ends.values(), default=time.time()) if first else began + len(passes) * PASS_STARTUP_S + \
            split.tests_s
        path = Path(run.args.out) / f"{record}.json"
        path.unlink(missing_ok=True)
        env = {**os.environ, **test_env(run.args.cpu), "CUDA_DEVICE_MAX_CONNECTIONS": queues,
               "OVERLAP_GPU_RECORD": str(path), "OVERLAP_GPU_TESTS_UNTIL": repr(end)}
        if first:  # the modules' slots count from the pass's first test (the conftest writes its time there)
            anchor = Path(run.args.out) / f"{record}.anchor"
            anchor.unlink(missing_ok=True)
            env["OVERLAP_GPU_MODULE_BUDGETS"] = json.dumps(modules)
            env["OVERLAP_GPU_MODULE_ANCHOR"] = str(anchor)
        # a stuck test ends its worker (xdist starts another) well before the pass's end: the rest still run
        per_test = min(PER_TEST_S, max(MIN_PER_TEST_S, 0.6 * (end - time.time())))
        cmd = pytest_command(run.args, record, marker, per_test)
        run.log(f"tests under CUDA_DEVICE_MAX_CONNECTIONS={queues}, at most {end - time.time():.0f} s: "
                f"{' '.join(cmd[2:])}")
        code = run.run_teed(cmd, env, end)
        run.stage("tests", **{record: summarize_tests(path, code, run.doc["order"] if first else None)})


def test_env(cpu: bool) -> dict[str, str]:
    """What the test processes' environment sets besides the run's: on the CPU no GPU (``CUDA_VISIBLE_DEVICES=``,
    the CPU mode even on a GPU machine); on a GPU CUDA's eager module loading (a kernel's first launch then never
    waits for the device to drain inside a gated window) and torch's symmetric memory backend named (``CUDA``, not
    whatever torch would pick), each unless the caller set it."""
    if cpu:
        return {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    env = {"PYTHONUNBUFFERED": "1"}
    for name, value in TEST_ENV_GPU.items():
        env[name] = os.environ.get(name, value)
    return env


TEST_ENV_GPU = {"CUDA_MODULE_LOADING": "EAGER", "TORCH_SYMMMEM": "CUDA"}


def summarize_tests(path: Path, code: int | None, order: list[str] | None = None) -> dict[str, Any]:
    """Counts, failures and skips of one pass of pytest, from its JSON record (`code`: pytest's exit status, None
    where the pass was killed at its time); with the modules' `order`, each module's counts and verdict
    (`module_verdicts`)."""
    doc = json.loads(path.read_text()) if path.exists() else {"tests": [], "running": None}
    outcome: dict[str, str] = {}
    failures, skips = [], {}
    for t in doc["tests"]:
        if t["outcome"] == "failed":
            outcome[t["test"]] = "failed"
            failures.append({"test": t["test"], "phase": t["phase"], "message": (t["message"] or "")[-600:]})
        elif t["outcome"] == "skipped":
            outcome.setdefault(t["test"], "skipped")
            reason = (t["message"] or "").split("Skipped: ")[-1][:200]
            skips[reason] = skips.get(reason, 0) + 1
        elif t["phase"] == "call":
            outcome.setdefault(t["test"], "passed")
    counts = {k: sum(1 for v in outcome.values() if v == k) for k in ("passed", "failed", "skipped")}
    running = (doc.get("running") or {}).get("test", "(no test started)")
    killed = None if code is not None else running
    if code is not None and not doc.get("finished", False):  # pytest ended by itself before its end (a crash)
        failures.append({"test": running, "phase": "?", "message": f"pytest ended early (exit status {code}) "
                                                                   "during this test; the log has its last output"})
        counts["failed"] += 1
    facts = {"exit": code, "counts": counts, "failures": failures, "skips": skips, "killed_during": killed,
             "complete": code is not None and doc.get("finished", False),
             "figures": {t["test"]: t["properties"] for t in doc["tests"] if t.get("properties")}}
    if order is not None:
        facts["modules"] = module_verdicts(outcome, order, killed)
    return facts


def module_verdicts(outcome: dict[str, str], order: list[str], killed: str | None) -> dict[str, dict[str, Any]]:
    """Per module of `order`: its tests' counts and its verdict: ``failed`` (a test failed), ``passed`` (one passed,
    none failed), ``skipped`` (every test that reported skipped, e.g. needs a GPU, or its budget), ``killed`` (the
    pass ended during its first test), or None (no test of it reported)."""
    got: dict[str, dict[str, Any]] = {m: {"passed": 0, "failed": 0, "skipped": 0} for m in order}
    for test, result in outcome.items():
        got.setdefault(plan.module_of(test), {"passed": 0, "failed": 0, "skipped": 0})[result] += 1
    for module, c in got.items():
        c["verdict"] = ("failed" if c["failed"] else "passed" if c["passed"] else "skipped" if c["skipped"] else
                        "killed" if killed and plan.module_of(killed) == module else None)
    return got


def run_timings(run: Run) -> None:
    """The timings (`tests.gpu.timings`) until the run's end, their record into ``stages.timings``."""
    path = Path(run.args.out) / "gpu_timings.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tests.gpu.timings", "--out", str(path),
           "--until", repr(run.deadline - MARGIN_S - 2.0)]
    run.log(f"timings, at most {run.left():.0f} s")
    code = run.run_teed(cmd, {**os.environ, **test_env(False), "CUDA_DEVICE_MAX_CONNECTIONS": "32"},
                        run.deadline - MARGIN_S)
    doc = json.loads(path.read_text()) if path.exists() else {"results": [], "complete": False}
    run.stage("timings", exit=code, complete=code == 0 and doc.get("complete", False), results=doc["results"])


# ==============================================================================================
# The summary and main
# ==============================================================================================


def summary(doc: dict[str, Any]) -> tuple[str, int]:
    """The closing lines of the output and the run's exit status."""
    lines, failed, complete = [], False, True
    warm = doc.get("warm")
    if warm is not None:
        lines.append(f"warm: {warm.get('compiled', 0)} of {len(warm['variants'])} kernel variants compiled for "
                     f"{warm.get('arch', '?')} in {warm.get('seconds', '?')} s"
                     + ("" if warm["complete"] else " (cut short: the tests compile the rest)"))
        lines += [f"  {v['status']}: {v['kernel'] or v['used_by'][0]} {v['key']}" for v in warm["variants"]
                  if v["status"].startswith("failed")]
    for record, facts in doc["stages"].get("tests", {}).items():
        c = facts["counts"]
        lines.append(f"{record}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
                     + (f"; killed at its time during {facts['killed_during']}" if facts["killed_during"] else ""))
        for f in facts["failures"]:
            message = f["message"].strip().splitlines()[-1] if f["message"].strip() else ""
            lines.append(f"  FAILED {f['test']} ({f['phase']}): {message[:200]}")
        for reason, n in sorted(facts["skips"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n} skipped: {reason}")
        if facts["exit"] not in (None, 0, 1, 5):  # 5: nothing selected; 2-4: interrupted, internal or usage error
            lines.append(f"  pytest exited with status {facts['exit']} (see the log)")
        failed |= c["failed"] > 0 or facts["exit"] not in (None, 0, 1, 5)
        complete &= facts["complete"]
    timings = doc["stages"].get("timings")
    if timings is not None:
        for r in timings["results"]:
            if r.get("headline") or r["status"] == "FAIL":
                lines.append(f"  {r['status']} {r['name']}: {r['value']}")
        if timings["exit"] not in (None, 0):
            lines.append(f"  the timings exited with status {timings['exit']} (see the log)")
        failed |= any(r["status"] == "FAIL" for r in timings["results"]) or timings["exit"] not in (None, 0)
        complete &= timings["complete"]
    code = EXIT_FAILED if failed else EXIT_OK if complete else EXIT_INCOMPLETE
    lines.append(f"gpu_check: {'FAILED' if failed else 'passed' if complete else 'INCOMPLETE'} in "
                 f"{time.time() - doc['started']:.0f} s (records in this run's --out)")
    return "\n".join(lines), code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    try:
        return check(run)
    except Exception as exc:  # a bug of the driver itself, or a machine it did not foresee: said, recorded
        import traceback

        run.write(traceback.format_exc())
        run.stage("setup", problem=f"the driver failed: {type(exc).__name__}: {exc}")
        return EXIT_SETUP
    finally:
        run.log_file.close()


def run_facts(cpu: bool) -> dict[str, Any]:
    """What the record says of how the tests run: the environment `test_env` sets, and what is deselected."""
    return {"test_env": test_env(cpu),
            "deselected": None if cpu else "the tests marked cpu_only (they exist for the CPU mode: interpreted "
                                           "subprocesses), by tests/gpu/conftest.py where a GPU is present"}


def check(run: Run) -> int:
    """The stages of the module docstring, in order; returns the exit status."""
    args = run.args
    if args.started_at is None:
        run.log(f"--time-limit {args.time_limit:.0f} s, --out {args.out}")
    problem = install(run)  # may run this script again
    if problem is None and not args.cpu:
        problem = project_problem()  # after the install too: a GPU with a _C that lacks CUDA is one clear FAIL
    if problem is None and not args.cpu:
        import torch

        if not torch.cuda.is_available():
            problem = "no CUDA device here (--cpu runs the tests on the CPU)"
    if problem is not None:
        run.log(problem)
        run.stage("setup", problem=problem)
        return EXIT_SETUP
    run.stage("setup", problem=None, **run_facts(args.cpu))
    if not args.no_warm:
        run_warm(run)
    timings = not args.cpu and not args.no_timings
    run_tests(run, budget(run, timings))
    if not args.cpu and not args.no_timings and run.left() > 20.0:
        run_timings(run)
    elif not args.cpu and not args.no_timings:
        run.stage("timings", exit=None, complete=False, results=[])
    text, code = summary(run.doc)
    run.doc.update(exit_status=code, summary=text)
    run.save()
    run.write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
