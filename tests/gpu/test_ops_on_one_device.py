"""The ops' own code on one device, through the public API, in several processes.

The virtual-rank tests launch the kernels on ranks of one process; ``overlap bench`` runs the ops themselves, with a
GPU per rank. These tests run every op of the op table (``overlap.plans.OPS``:
``all_gather_matmul``, ``matmul_reduce_scatter``, ``matmul_all_reduce`` and its ``one_shot`` variant, the
weight-side ``all_gather_weight_matmul``, the MoE layer ``dispatch_grouped_matmul`` + gelu +
``grouped_matmul_combine``) x {``symm``, ``fused``} x {forward under ``no_grad``, forward and backward} on ranks that
are **processes sharing one GPU**, so that everything between an op call and its kernels runs as it does in
training: the symmetric heap in torch's CUDA symmetric memory (``empty``, ``rendezvous``, ``get_buffer`` of a
peer), the flag words and the pinned error words, the stream-ordered waits and writes, the ``symm`` side-stream
pipelines (peer pulls and copies behind waits on another process's flags), the MoE dispatch and combine CUDA
kernels with their tables, and every backward.

Each rank (tests/gpu/ops_rank.py, ``python -m tests.gpu.ops_rank``, one process each) draws every rank's inputs from the
seed (``Workload.inputs``, ``SeededDraw``), computes its own results with the workload's oracle (``Workload.oracle``) on
float64 copies, makes each call twice and requires bitwise the same results (the determinism claim of docs/design.md),
and checks the first against the oracle: TP ops within a rounding bound from the oracle on the inputs' magnitudes, MoE
within docs/design.md's tolerance (c). A case passes if it passes on every rank. One run of the ranks serves every
case's test (`Worlds`: one run per world size, kept for the module).

How ranks share the GPU: the process group is ``cpu:gloo,cuda:nccl`` (overlap reads the group's device from its
backend's name; no NCCL communicator is ever created) and torch's CUDA symmetric-memory backend maps every
process's allocation into every other, on the same device, once ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``
lifts its one-device-per-rank check (no multicast, which overlap does not use). Without MPS the processes'
kernels time-slice the GPU: a kernel spinning on a peer's flag runs until the peer's context gets its slice,
hence small sizes and deadlines of a minute. On a GPU ``W=2`` processes run; where their set-up (process group,
group facts, ``overlap.reserve``) fails, or the GPU's compute mode takes one process at a time, a **one-rank
fallback** runs the same cases. One rank does not short-circuit to ``reference``: its forced ``symm``/``fused``
calls still allocate and rendezvous the heap, write and wait on their own flags and run every kernel, but every
loop over peers is empty, so only ``W=2`` proves the cross-process path. On the CPU the same code runs on gloo
ranks (POSIX shared memory, ``fused`` under the Triton interpreter, tiny sizes), ``W=2`` and ``W=1`` both.

A case whose call raises ends that run of the ranks (the group may be unusable after it): they are stopped and
fresh ones start at the next case, so a failure costs one case. Every run has deadlines (each call's waits, the
set-up, the whole run, the grace its peers get after a rank failed): past one the ranks are killed and the tests
report what they had written. ``OVERLAP_TEST_SEED`` fixes the inputs' seed (else drawn and noted).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.machine import compute_mode_problem, gpu_facts
from tests.gpu.ops_rank import cases
from tests.gpu.tolerance import note

ROOT = Path(__file__).resolve().parents[2]
RANK_MODULE = "tests.gpu.ops_rank"  # run as ``python -m`` from the repository root
#: per-call deadline (every wait on a peer), seconds: time-sliced GPU processes; loaded CI machines
CALL_TIMEOUT_S = {"cuda": 60.0, "cpu": 30.0}
#: the most a run of all ranks may take, seconds
RUN_BUDGET_S = {"cuda": 180.0, "cpu": 120.0}
#: the same under one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, the GPU check's second pass): Triton's
#: on-disk cache holds what the first pass compiled
ONE_QUEUE_BUDGET_S = 120.0
#: the most the ranks may take to start, form the group and create the heap (the set-up smoke), seconds
SETUP_BUDGET_S = {"cuda": 120.0, "cpu": 60.0}
GRACE_S = 15.0  # after a rank failed, how long its peers get to report before the run is stopped
RESTART_LEFT_S = 30.0  # fresh ranks start after a raising case only with this much of the run's budget left
LOG_CHARS = 2000  # how much of a rank's output a report quotes where the rank left no record

CUDA = torch.cuda.is_available()  # decided at collection: the case list's sizes depend on it
CASES = [c.name for c in cases(CUDA)]
WORLD_SIZES = (2, 1)

pytestmark = pytest.mark.one_queue


# ==============================================================================================
# The ranks' merged results
# ==============================================================================================


@dataclasses.dataclass
class Outcome:
    """What one test reports: ``PASS``, ``FAIL`` or ``SKIP``, in words, with figures for the record."""

    status: str
    message: str
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class World:
    """One world size's run of the ranks, merged (`merge`), or why it did not run (`skipped`)."""

    setup: Outcome
    names: list[str] = dataclasses.field(default_factory=list)  # the cases the ranks listed
    cases: dict[str, Outcome] = dataclasses.field(default_factory=dict)
    exit: Outcome = dataclasses.field(default_factory=lambda: Outcome("PASS", "every rank exited with status 0"))
    skipped: str | None = None

    @classmethod
    def not_run(cls, why: str) -> World:
        return cls(Outcome("SKIP", why), skipped=why)

    def case(self, name: str) -> Outcome:
        """The merged outcome of case `name`."""
        if self.setup.status != "PASS":
            return Outcome("SKIP", f"not run: the ranks' set-up failed ({self.setup.message})")
        if name not in self.names:
            return Outcome("FAIL", f"the ranks did not list case {name} (they listed {self.names})")
        return self.cases[name]


def merge(ranks: list[list[dict]], codes: list[int | None], elapsed: float,
          logs: list[str] | None = None) -> World:
    """The set-up smoke's outcome and one per case (PASS only if every rank passed it) from every rank's records
    (`codes`: each one's exit status, None where it was killed at a deadline; `logs`: the end of each one's
    output, quoted where a rank left no record)."""
    W = len(ranks)
    names = next((r["names"] for records in ranks for r in records if r["kind"] == "cases"), [])
    setups = [next((r for r in records if r["kind"] == "setup"), None) for records in ranks]
    fate = [("killed at the run's deadline" if c is None else f"exit status {c}") for c in codes]

    def silent(q: int, what: str) -> str:
        tail = (logs[q] if logs else "").strip()
        return f"{what} ({fate[q]})" + (f"; its output ends:\n{tail}" if tail else "")

    bad_setup = [f"rank {q}: " + (_with_trace(s) if s else silent(q, "no set-up reported"))
                 for q, s in enumerate(setups) if s is None or s["status"] != "PASS"]
    if bad_setup:
        return World(Outcome("FAIL", "; ".join(bad_setup)), names,
                     exit=Outcome("SKIP", "the ranks' set-up failed: its test says why"))
    world = World(Outcome("PASS", setups[0]["value"], {"world_size": W}), names)
    per_rank = [{r["name"]: r for r in records if r["kind"] == "case"} for records in ranks]
    ended = None  # the first case whose error ended a rank's run: later cases may lack that rank's result
    for name in names:
        got = [results.get(name) for results in per_rank]
        if all(g is None for g in got):
            why = ended or f"ranks ended ({', '.join(fate)}) after {elapsed:.0f} s"
            world.cases[name] = Outcome("SKIP", f"not run: {why}")
            continue
        failing = [(q, g) for q, g in enumerate(got) if g is None or g["status"] != "PASS"]
        if failing:
            q, g = min(failing, key=lambda f: f[1] is None)  # a rank's own report before a missing one
            value = f"rank {q}: " + (g["value"] if g else silent(q, "no result"))
            if ended and any(x is None for x in got):  # a rank stopped before it: why its peers failed
                value += f" ({ended})"
            if g and g.get("trace"):
                value += f"\n{g['trace']}"
            ended = ended or next((f"rank {p} stopped at {name}" for p, h in failing if h and h.get("error")), None)
            world.cases[name] = Outcome("FAIL", value, {"ranks_failed": [p for p, _ in failing]})
            continue
        worst = max(float(g["max_err"]) for g in got)
        seconds = max(g.get("seconds", 0.0) for g in got)
        world.cases[name] = Outcome(
            "PASS", f"{got[0]['value']}; max over {W} rank(s) {worst:.1e}, {seconds:.1f} s",
            {"max_err": worst, "seconds": seconds, "world_size": W, "dims": got[0].get("dims", "")})
    if any(c != 0 for c in codes):
        ends = ", ".join(f"rank {q}: {f}" for q, f in enumerate(fate))
        if any(o.status == "FAIL" for o in world.cases.values()):
            world.exit = Outcome("SKIP", f"ranks ended early ({ends}) after a failing case: its test says why")
        elif None in codes and any(o.status == "SKIP" for o in world.cases.values()):
            world.exit = Outcome("SKIP", f"the ranks ran out of the run's time ({ends}): the cases they did not "
                                         "reach skip, saying so")
        else:
            world.exit = Outcome("FAIL", "; ".join(silent(q, f"rank {q}") for q, c in enumerate(codes) if c != 0))
    return world


def _with_trace(record: dict) -> str:
    return record["value"] + (f"\n{record['trace']}" if record.get("trace") else "")


# ==============================================================================================
# Running the ranks
# ==============================================================================================


def run_world(world_size: int, device: torch.device, seed: int, budget_s: float) -> World:
    """Run `world_size` rank processes on `device`, at most `budget_s` seconds in all, and merge their results.

    A case whose call raises ends that run of the ranks (the group may be unusable after it): the ranks are
    stopped and fresh ones start at the next case, so a failure costs one case, not every later one."""
    kind = device.type
    timeout = CALL_TIMEOUT_S[kind]
    end = time.monotonic() + budget_s
    ranks: list[list[dict]] = [[] for _ in range(world_size)]
    first, codes, logs, elapsed = 0, [], [], 0.0
    while True:
        tmp = tempfile.mkdtemp(prefix="overlap-ops-ranks-")
        try:
            codes, took = spawn(world_size, device, seed, timeout, end - time.monotonic(), tmp, first)
            run = [read_records(Path(tmp) / f"rank{r}.jsonl") for r in range(world_size)]
            logs = [_tail(Path(tmp) / f"rank{r}.log") for r in range(world_size)]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        elapsed += took
        for q in range(world_size):
            ranks[q] += run[q] if first == 0 else [r for r in run[q] if r["kind"] == "case"]
        names = next((r["names"] for records in run for r in records if r["kind"] == "cases"), [])
        raised = [names.index(r["name"]) for records in run for r in records if r["kind"] == "case" and r.get("error")]
        set_up = all(any(r["kind"] == "setup" and r["status"] == "PASS" for r in records) for records in run)
        if not raised or not set_up or min(raised) + 1 >= len(names) or end - time.monotonic() < RESTART_LEFT_S:
            break
        first = min(raised) + 1
        print(f"W={world_size}: the ranks stopped at {names[first - 1]}; fresh ranks go on from {names[first]}")
    return merge(ranks, codes, elapsed, logs)


def spawn(world_size: int, device: torch.device, seed: int, timeout: float, budget: float,
          tmp: str, first: int = 0) -> tuple[list[int | None], float]:
    """Start the rank processes at case `first` and wait for them: at most `budget` seconds, `SETUP_BUDGET_S`
    until every rank has reported its set-up, and `GRACE_S` after a rank failed (its peers may be stuck in the
    call it left: they are stopped, not waited for). Each rank's output goes to ``<tmp>/rank<R>.log``. Returns
    each one's exit status (None: killed at a deadline) and the seconds taken."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device.type == "cuda":
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"  # several ranks' symmetric memory on one device
    cmd = [sys.executable, "-m", RANK_MODULE, "--world-size", str(world_size), "--init-file",
           os.path.join(tmp, "store"), "--device", str(device), "--seed", str(seed), "--timeout", str(timeout),
           "--out", tmp, "--first", str(first)]
    started = time.monotonic()
    deadline = started + budget
    setup_by = started + min(SETUP_BUDGET_S[device.type], budget)
    procs = []
    for r in range(world_size):
        with open(os.path.join(tmp, f"rank{r}.log"), "wb") as log:
            procs.append(subprocess.Popen([*cmd, "--rank", str(r)], env=env, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            if setup_by and time.monotonic() > setup_by:
                reported = [read_records(Path(tmp) / f"rank{r}.jsonl") for r in range(world_size)]
                if not all(any(rec["kind"] == "setup" for rec in records) for records in reported):
                    break  # a set-up that hangs: kill the ranks; the set-up test reports it
                setup_by = 0.0
            time.sleep(0.2)
    finally:
        killed = []
        for p in procs:
            if p.poll() is None:
                p.kill()  # one of the processes started above, by its own handle
                killed.append(p)
        for p in killed:
            p.wait(timeout=30)
    return [None if p in killed else p.returncode for p in procs], time.monotonic() - started


def read_records(path: Path) -> list[dict]:
    """The records one rank wrote (none if it never started); a half-written last line is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_CHARS:] if path.exists() else ""


class Worlds:
    """The runs of the ranks this module's tests read, one per world size, each made once on first use.

    ``W=2`` skips where the GPU's compute mode takes one process at a time. ``W=1`` always runs on the CPU; on a
    GPU it is the fallback: it runs where two processes cannot share the GPU, where their set-up failed, or where
    no ``W=2`` test is selected."""

    def __init__(self, device: torch.device, seed: int, budget_s: float, two_selected: bool = True):
        self.device, self.seed, self.budget_s, self.two_selected = device, seed, budget_s, two_selected
        self.runs: dict[int, World] = {}
        self._mode: list[str | None] = []  # the compute mode's problem, once asked

    def mode_problem(self) -> str | None:
        """Why two processes cannot share the GPU (its compute mode), or None; None on the CPU."""
        if self.device.type != "cuda":
            return None
        if not self._mode:
            self._mode.append(compute_mode_problem(gpu_facts()))
        return self._mode[0]

    def world(self, world_size: int) -> World:
        if world_size not in self.runs:
            why = self.why_not(world_size)
            self.runs[world_size] = (World.not_run(why) if why is not None
                                     else run_world(world_size, self.device, self.seed, self.budget_s))
        return self.runs[world_size]

    def why_not(self, world_size: int) -> str | None:
        """Why the ranks of `world_size` do not run here, or None."""
        mode = self.mode_problem()
        if world_size > 1:
            return None if mode is None else f"two processes cannot share this GPU: {mode}"
        if self.device.type == "cpu" or mode is not None or not self.two_selected:
            return None
        if self.world(2).setup.status == "PASS":
            return ("the two processes set up on this GPU: the one-rank fallback runs only where they cannot "
                    "(or where no W=2 test is selected)")
        return None


# ==============================================================================================
# The tests
# ==============================================================================================


@pytest.fixture(scope="module")
def worlds(request) -> Worlds:
    """One run of the ranks per world size, shared by every test of this module."""
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")  # the parent makes no CUDA context
    seed = int(os.environ.get("OVERLAP_TEST_SEED", random.randrange(2**31)))
    print(f"[seed] the ops on one device: OVERLAP_TEST_SEED={seed}")
    one_queue = CUDA and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    budget = ONE_QUEUE_BUDGET_S if one_queue else RUN_BUDGET_S[device.type]
    # the GPU check's pass ends at OVERLAP_GPU_TESTS_UNTIL (wall time): the ranks' runs fit before it
    until = float(os.environ.get("OVERLAP_GPU_TESTS_UNTIL", "inf"))
    budget = min(budget, max(30.0, (until - time.time()) / 2 - 5.0))  # W=2, then W=1 where it runs
    here = Path(__file__).resolve()
    two = any(item.path.resolve() == here and "[W=2" in item.nodeid for item in request.session.items)
    return Worlds(device, seed, budget, two_selected=two)


def _reported(worlds: Worlds, world_size: int, outcome: Outcome) -> None:
    """Skip, fail or note `outcome` (the run's seed and the hardware queues among its figures)."""
    if outcome.status == "SKIP":
        pytest.skip(outcome.message)
    if outcome.status != "PASS":
        raise AssertionError(outcome.message)
    note(outcome.message, **outcome.figures, seed=worlds.seed,
         cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))


def _world(worlds: Worlds, world_size: int) -> World:
    world = worlds.world(world_size)
    if world.skipped is not None:
        pytest.skip(world.skipped)
    return world


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"W={w}")
def test_the_ranks_set_up_their_process_group_and_heap(worlds, world_size):
    """The ranks form their group, overlap sees it compute on the device, and ``overlap.reserve`` makes the heap."""
    _reported(worlds, world_size, _world(worlds, world_size).setup)


@pytest.mark.parametrize("world_size, case", [pytest.param(w, name, id=f"W={w}-{name}")
                                              for w in WORLD_SIZES for name in CASES])
def test_op_matches_float64_and_repeats_bitwise(worlds, world_size, case):
    """The op's results on every rank lie within their rounding bound of the float64 oracle, and a second
    identical call gives bitwise the same results."""
    _reported(worlds, world_size, _world(worlds, world_size).case(case))


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"W={w}")
def test_the_ranks_exit_cleanly(worlds, world_size):
    """Every rank that ran all its cases released its heap, tore its group down and exited with status 0 (a rank
    killed at a deadline fails here even where every case it reported passed)."""
    _reported(worlds, world_size, _world(worlds, world_size).exit)
