"""Checks i: the ops' own GPU code on one GPU, through the public API, in several processes.

The other one-GPU checks launch the kernels on virtual ranks of one process; only the torchrun section runs the
ops themselves, and it needs a GPU per rank. This section runs every op of the op table (``overlap.plans.OPS``:
``all_gather_matmul``, ``matmul_reduce_scatter``, ``matmul_all_reduce`` and its ``one_shot`` variant, the weight-side
``all_gather_weight_matmul``, the MoE
layer ``dispatch_grouped_matmul`` + gelu + ``grouped_matmul_combine``) x {``symm``, ``fused``} x {forward under
``no_grad``, forward and backward} on ranks that are **processes sharing one GPU**, so that everything between
an op call and its kernels runs as it does in training: the symmetric heap in torch's CUDA symmetric memory
(``empty``, ``rendezvous``, ``get_buffer`` of a peer), the flag words and the pinned error words, the
stream-ordered waits and writes, the ``symm`` side-stream pipelines (peer pulls and copies behind waits on
another process's flags), the MoE dispatch and combine CUDA kernels with their tables, and every backward.

Each rank (`gpu_check_ops_rank`, one process each) draws every rank's inputs from the seed
(``Workload.inputs``, ``SeededDraw``), computes its own results with the workload's oracle (``Workload.oracle``) on
float64 copies, makes each call twice and requires bitwise the same results (the determinism claim of
docs/design.md), and checks the first against the oracle: TP ops within a rounding bound from the oracle on the
inputs' magnitudes, MoE within docs/design.md's tolerance (c). A case passes if it passes on every rank.

How ranks share the GPU: the process group is ``cpu:gloo,cuda:nccl`` (overlap reads the group's device from
its backend's name; no NCCL communicator is ever created, see `gpu_check_ops_rank`) and torch's CUDA
symmetric-memory backend maps every process's allocation into every other, on the same device, once
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` lifts its one-device-per-rank check (no multicast, which overlap
does not use). Without MPS the processes' kernels time-slice the GPU: a kernel spinning on a peer's flag runs
until the peer's context gets its slice, hence small sizes and deadlines of a minute. On a GPU the section runs
``W=2`` processes; where their set-up smoke (process group, group facts, ``overlap.reserve``) fails, that is
reported and a **one-rank fallback** runs the same cases. One rank does not short-circuit to ``reference``: its
forced ``symm``/``fused`` calls still allocate and rendezvous the heap, write and wait on their own flags
(stream-ordered and in-kernel) and run every kernel, but every loop over peers is empty (no peer buffer, no
side-stream pull or copy to a peer, no wait on another process), so only ``W=2`` proves the cross-process path.

``--cpu-smoke``: the same code on CPU ranks (gloo, POSIX shared memory, ``fused`` under the Triton interpreter,
tiny sizes), ``W=2`` and then ``W=1``, so CI runs both paths of this section.

Every rank process has a deadline: past it the section kills it and reports what it had written.

Imports overlap only in the rank processes; this module imports nothing of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_common import Report
from gpu_check_preflight import compute_mode_problem, gpu_facts

RANK_SCRIPT = Path(__file__).resolve().with_name("gpu_check_ops_rank.py")
PREFIX = "i.ops"
#: per-call deadline (every wait on a peer), seconds: time-sliced GPU processes; loaded CI machines
CALL_TIMEOUT_S = {"cuda": 60.0, "cpu": 30.0}
#: the most a run of all ranks may take, seconds (less where --time-limit leaves less)
RUN_BUDGET_S = {"cuda": 180.0, "cpu": 120.0}
#: the same under one hardware queue (group ops1), seconds: Triton's on-disk cache holds what the ops group
#: compiled, and the run must leave the timing groups time within the check's 480 s
ONE_QUEUE_BUDGET_S = 120.0
#: the most the ranks may take to start, form the group and create the heap (the set-up smoke), seconds
SETUP_BUDGET_S = {"cuda": 120.0, "cpu": 60.0}
GRACE_S = 15.0  # after a rank failed, how long its peers get to report before the run is stopped


def run_ops(rep: Report, device: torch.device, prefix: str = PREFIX, budget_s: float | None = None) -> None:
    """The section: on a GPU two processes on `device`, and one (the labelled fallback) where their set-up
    failed or only the fallback is selected (``--only``); on the CPU (``--cpu-smoke``) two CPU ranks, then one.
    Its sections' names start with `prefix`; each run of the ranks takes at most `budget_s` (default
    `RUN_BUDGET_S`)."""
    kind = device.type
    seed = int(torch.randint(0, 2**31 - 1, ()))  # reproducible from the check's --seed
    two, one = f"{prefix} W=2", f"{prefix} W=1" + ("" if kind == "cpu" else " fallback")
    setup_failed = None

    def run_two() -> None:
        nonlocal setup_failed
        setup_failed = run_world(rep, 2, device, seed, label=two, budget_s=budget_s)

    mode = compute_mode_problem(gpu_facts()) if kind == "cuda" and rep.dry is None else None
    rep.run(f"{two} processes on one {kind}", run_two, skip=mode)
    if mode is not None:
        setup_failed = mode
    if rep.dry is not None or kind == "cpu" or setup_failed is not None or not rep.selected(two):
        rep.run(one, lambda: run_world(rep, 1, device, seed, label=one, budget_s=budget_s))


def run_ops_section(rep: Report, dev) -> None:
    """The ``ops`` group's entry (`gpu_check_groups.GROUPS`): `run_ops` on the group's device (a listing lists
    the one-rank fallback too)."""
    run_ops(rep, dev.device)


def run_ops_section_one_queue(rep: Report, dev) -> None:
    """The ``ops1`` group's entry: the same section under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (the group's
    environment, which the rank processes inherit: every stream of a rank in one hardware queue), its sections
    named ``i.ops 1-queue ...``. The setting only changes a GPU's queues, so on the CPU it is one SKIP (the
    ``ops`` group runs the CPU ranks)."""
    prefix = f"{PREFIX} 1-queue"
    if dev.cuda:
        run_ops(rep, dev.device, prefix, budget_s=ONE_QUEUE_BUDGET_S)
    else:
        rep.run(prefix, lambda: None, skip="no CUDA: CUDA_DEVICE_MAX_CONNECTIONS=1 changes only a GPU's queues; "
                                           "the CPU ranks run in the ops group")


def run_world(rep: Report, world_size: int, device: torch.device, seed: int, label: str,
              budget_s: float | None = None) -> str | None:
    """Run `world_size` rank processes on `device` and add their merged results to `rep` under `label`.

    A case whose call raises ends that run of the ranks (the group may be unusable after it): the ranks are
    stopped and fresh ones start at the next case, so a failure costs one case, not every later one. Returns
    None if the ranks' set-up smoke passed (or the run was skipped), else why it did not (the results then hold
    a FAIL)."""
    kind = device.type
    timeout = CALL_TIMEOUT_S[kind]
    end = time.monotonic() + min(budget_s or RUN_BUDGET_S[kind], rep.time_limit - (time.time() - rep.started) - 10.0)
    if end - time.monotonic() < 30.0:
        rep.add(label, "SKIP", f"{end - time.monotonic():.0f} s left of --time-limit {rep.time_limit:.0f} s")
        return None
    ranks: list[list[dict]] = [[] for _ in range(world_size)]
    first, codes, elapsed = 0, [], 0.0
    while True:
        tmp = tempfile.mkdtemp(prefix="gpu_check_ops-")
        try:
            codes, took = spawn(world_size, device, seed, timeout, end - time.monotonic(), tmp, first)
            run = [read_records(Path(tmp) / f"rank{r}.jsonl") for r in range(world_size)]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        elapsed += took
        for q in range(world_size):
            ranks[q] += run[q] if first == 0 else [r for r in run[q] if r["kind"] == "case"]
        names = next((r["names"] for records in run for r in records if r["kind"] == "cases"), [])
        raised = [names.index(r["name"]) for records in run for r in records if r["kind"] == "case" and r.get("error")]
        set_up = all(any(r["kind"] == "setup" and r["status"] == "PASS" for r in records) for records in run)
        if not raised or not set_up or min(raised) + 1 >= len(names) or end - time.monotonic() < 30.0:
            break
        first = min(raised) + 1
        rep.log(f"{label}: the ranks stopped at {names[first - 1]}; fresh ranks go on from {names[first]}")
    return merge(rep, label, ranks, codes, elapsed)


def spawn(world_size: int, device: torch.device, seed: int, timeout: float, budget: float,
          tmp: str, first: int = 0) -> tuple[list[int | None], float]:
    """Start the rank processes at case `first` and wait for them: at most `budget` seconds, `SETUP_BUDGET_S`
    until every rank has reported its set-up, and `GRACE_S` after a rank failed (its peers may be stuck in the
    call it left: they are stopped, not waited for). Returns each one's exit status (None: killed at a
    deadline) and the seconds taken."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device.type == "cuda":
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"  # several ranks' symmetric memory on one device
    cmd = [sys.executable, str(RANK_SCRIPT), "--world-size", str(world_size), "--init-file",
           os.path.join(tmp, "store"), "--device", str(device), "--seed", str(seed), "--timeout", str(timeout),
           "--out", tmp, "--first", str(first)]
    started = time.monotonic()
    deadline = started + budget
    setup_by = started + min(SETUP_BUDGET_S[device.type], budget)
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(world_size)]
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            if setup_by and time.monotonic() > setup_by:
                reported = [read_records(Path(tmp) / f"rank{r}.jsonl") for r in range(world_size)]
                if not all(any(rec["kind"] == "setup" for rec in records) for records in reported):
                    break  # a set-up that hangs: kill the ranks, the caller reports it and falls back
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


def merge(rep: Report, label: str, ranks: list[list[dict]], codes: list[int | None], elapsed: float) -> str | None:
    """Add one result for the set-up smoke and one per case (PASS only if every rank passed it) to `rep`.
    Returns None if every rank's set-up passed, else why not."""
    W = len(ranks)
    names = next((r["names"] for records in ranks for r in records if r["kind"] == "cases"), [])
    setups = [next((r for r in records if r["kind"] == "setup"), None) for records in ranks]
    fate = [("killed at the section's deadline" if c is None else f"exit status {c}") for c in codes]
    bad_setup = [f"rank {q}: {s['value'] if s else 'no set-up reported (' + fate[q] + ')'}"
                 for q, s in enumerate(setups) if s is None or s["status"] != "PASS"]
    if bad_setup:
        why = "; ".join(bad_setup)
        rep.add(f"{label} setup", "FAIL", why)
        return why
    rep.add(f"{label} setup", "PASS", setups[0]["value"])
    per_rank = [{r["name"]: r for r in records if r["kind"] == "case"} for records in ranks]
    ended = None  # the first case whose error ended a rank's run: later cases may lack that rank's result
    for name in names:
        got = [results.get(name) for results in per_rank]
        if all(g is None for g in got):
            why = ended or f"ranks ended ({', '.join(fate)}) after {elapsed:.0f} s"
            rep.add(f"{label} {name}", "SKIP", f"not run: {why}")
            continue
        failing = [(q, g) for q, g in enumerate(got) if g is None or g["status"] != "PASS"]
        if failing:
            q, g = min(failing, key=lambda f: f[1] is None)  # a rank's own report before a missing one
            value = f"rank {q}: " + (g["value"] if g else f"no result ({fate[q]})")
            if ended and any(x is None for x in got):  # a rank stopped before it: why its peers failed
                value += f" ({ended})"
            ended = ended or next((f"rank {p} stopped at {name}" for p, h in failing if h and h.get("error")), None)
            rep.add(f"{label} {name}", "FAIL", value, ranks_failed=[p for p, _ in failing])
            continue
        worst = max(float(g["max_err"]) for g in got)
        seconds = max(g.get("seconds", 0.0) for g in got)
        rep.add(f"{label} {name}", "PASS", f"{got[0]['value']}; max over {W} rank(s) {worst:.1e}, {seconds:.1f} s",
                max_err=worst, seconds=seconds)
    if any(c != 0 for c in codes) and not any(r["status"] == "FAIL" for rs in per_rank for r in rs.values()):
        rep.add(f"{label} exit", "FAIL", ", ".join(f"rank {q}: {f}" for q, f in enumerate(fate)))
    return None


if __name__ == "__main__":
    sys.exit("gpu_check_ops: run bench/gpu_check.py (this module is one of its sections)")
