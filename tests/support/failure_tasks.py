"""Rank-side tasks of `test_failures`: one world per op variant, every kind of failure injected in it.

World layout (global ranks; every group has world size 3, group ranks sorted by global rank):

* ranks 0 and 1 survive everything (the *survivors*);
* rank 2 is the *staller* and the rank with the local error: it shares one group per strategy with
  the survivors for the stalls (it passes the call's handshake, then sleeps past the deadline and
  leaves the call; in the strategies of ``stall_backward``, the same in a backward) and one group for
  the local errors; afterwards it is the victim of the last kill round, on the group that had the
  local errors (so that group is also shown to fail cleanly later);
* ranks 3, 4, ... are the other *victims*, one per kill round, each on its own group ``{0, 1, v}``.

The survivors' kill rounds run one after the other, each victim waiting (`PATIENT`) in its call's
handshake until the survivors get there. The process-group (gloo) timeout of every group under test
is `BACKSTOP`, well past `DEADLINE`: it only bounds a wait that ignores overlap's deadline.

A victim kills itself with ``os.kill(getpid(), SIGKILL or SIGTERM)`` (the default handlers: no
Python code runs) at one point of the call, chosen by a hook installed just before it:

* ``"mid-op"``: right after the call's handshake (every rank has posted it, so the survivors are
  past it and waiting for data the victim never sends);
* ``"backward"``: the same, in the backward's first handshake; for `matmul_all_reduce`, whose
  backward communicates nothing, at the start of its backward (a hook on the output);
* ``"ctrl-segment"`` / ``"data-segment"``: inside the group's first call, right after the victim
  has created its control pad (``ctrl``) or its first data heap (``g1``) in ``OVERLAP_SHM_DIR``,
  before its peers have mapped it (the one window in which a segment is linked).

Every wait of a failing call on a survivor or the staller has `DEADLINE`; the calls that must not
fail (first calls, and every call of a victim, which dies anyway) have `PATIENT`. Every result is
recorded, never raised, so one failure does not hide the others: the test asserts on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import torch

from tests.support.harness import LATE_S
from tests.support.tp_oracle import b_of, compare, expect_error, forward_backward, oracle, rank_inputs

VARIANTS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_reduce/one_shot")
STRATEGIES = ("reference", "pipelined", "symm", "fused")
WORLD = 3  # size of every group under test
DEADLINE = 2.0  # timeout= of every call that is expected to fail
PATIENT = 120.0  # timeout= of the calls that must not fail on their own
TEARDOWN_LIMIT = 30.0  # seconds `overlap.release` / `destroy_process_group` may take after a failure (else: hung)
# (rows, middle dims, k, n, layout) of `tp_oracle`: every dim <= 32 (interpreted `fused`).
CASE = (2, (), 16, 8, "contiguous")
STALLER = 2
STALL = DEADLINE + 0.75  # how long the staller sleeps inside its call
BACKSTOP = DEADLINE + LATE_S + 8.0  # process-group (gloo) timeout of the groups under test: past any bound asserted


@dataclasses.dataclass(frozen=True)
class Kill:
    """One kill round: `victim` (global rank) dies at `when` of a `strategy` call with `sig`."""

    victim: int
    strategy: str
    when: str = "mid-op"  # "mid-op", "backward", "ctrl-segment", "data-segment"
    sig: int = signal.SIGKILL

    @property
    def label(self) -> str:
        return f"{self.strategy}-{self.when}-{signal.Signals(self.sig).name}"


def op_of(variant: str) -> str:
    return variant.split("/")[0]


def plan_of(variant: str, strategy: str):
    import overlap

    return overlap.Plan(strategy, one_shot=variant.endswith("/one_shot"))


def inputs(variant: str, group_rank: int, seed: int):
    """This group rank's ``(a, b, param, g)`` for `CASE` (float32)."""
    a, param, g = rank_inputs(op_of(variant), seed, group_rank, WORLD, CASE, torch.float32)
    return a, b_of(param, CASE[4]), param, g


def run_call(variant, strategy, group, group_rank, seed, timeout, backward=False):
    """One forward (and backward) of `variant` on `group`; returns the output."""
    op = op_of(variant)
    a, b, param, g = inputs(variant, group_rank, seed)
    if not backward:
        import overlap

        return getattr(overlap, op)(a, b, group=group, plan=plan_of(variant, strategy), timeout=timeout)
    return forward_backward(op, plan_of(variant, strategy), a, param, CASE[4], g, group=group, timeout=timeout)


# ----------------------------------------------------------------------------------------------
# Bounded teardown, shared-memory listing
# ----------------------------------------------------------------------------------------------


def bounded(fn, *args, limit: float = TEARDOWN_LIMIT) -> dict:
    """Run ``fn(*args)`` in a daemon thread for at most `limit` s: ``{done, seconds, error}``."""
    box: dict = {}

    def body():
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - recorded
            box["error"] = f"{type(exc).__name__}: {exc}"

    t0 = time.monotonic()
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(limit)
    return {"done": not thread.is_alive(), "seconds": round(time.monotonic() - t0, 3), "error": box.get("error")}


def teardown(group) -> dict:
    """`overlap.release` then `destroy_process_group` of `group`, each bounded."""
    import torch.distributed as dist

    import overlap

    return {"release": bounded(overlap.release, group), "destroy": bounded(dist.destroy_process_group, group)}


def shm_dir() -> str:
    return os.environ.get("OVERLAP_SHM_DIR", "/dev/shm")


def segments(pids) -> list[str]:
    """Names of the segments in this user's folder of `shm_dir` created by one of `pids`."""
    from overlap.shm import segment_names

    return sorted(str(n) for n in segment_names() if n.pid in pids)


# ----------------------------------------------------------------------------------------------
# Injection: self-kill hooks, a stall
# ----------------------------------------------------------------------------------------------


class Stalled(Exception):
    """Raised by the staller when it wakes up, long after its peers gave up on it."""


def die(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(30)  # (a signal sent to oneself is delivered before kill() returns; never reached)
    raise AssertionError(f"still alive after signal {sig}")


def wait_dead(pid: int, limit: float = 60.0, reaped: bool = False) -> bool:
    """Wait until process `pid` has died (a zombie will do unless `reaped`); False past `limit` s.

    Victims are children of the test process, not of their peers: only it reaps them."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X") and not reaped:
            return True
        time.sleep(0.005)
    return False


@contextlib.contextmanager
def after_handshake(target: str, action):
    """Run ``action()`` when a call named `target` has passed its handshake (on this rank)."""
    from overlap import symm

    begin = symm.SymmHeap.begin

    def begin_then_act(self, op, *args, **kwargs):
        call = begin(self, op, *args, **kwargs)
        if op == target:
            action()
        return call

    symm.SymmHeap.begin = begin_then_act
    try:
        yield
    finally:
        symm.SymmHeap.begin = begin


def die_after_creating(kind: str, sig: int) -> None:
    """From now on, die right after creating a ``-<kind>-`` segment (``ctrl`` or ``g1``)."""
    from overlap import shm

    create = shm.create_segment

    def create_then_die(path, nbytes):
        t = create(path, nbytes)
        if f"-{kind}-" in os.path.basename(path):
            die(sig)
        return t

    shm.create_segment = create_then_die


# ----------------------------------------------------------------------------------------------
# The world
# ----------------------------------------------------------------------------------------------


def op_world(rank: int, world_size: int, variant: str, kills: list[Kill], stall_backward: list[str], seed: int) -> dict:
    """Everything of one op variant (module docstring). Returns what this rank saw; the survivors'
    results also hold the staller's (``"staller"``), which it cannot return once killed."""
    import datetime

    import torch.distributed as dist

    import overlap

    op = op_of(variant)
    fn = getattr(overlap, op)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    trio = [0, 1, STALLER]
    # Every rank creates every group, in one order (torch's rule for new_group). The groups under
    # test get a process-group timeout of `BACKSTOP` s: gloo's own deadline, which must never be
    # the one that fires (overlap's `DEADLINE` comes first), but bounds a wait that ignores it.
    backstop = datetime.timedelta(seconds=BACKSTOP)

    def group(ranks):
        return dist.new_group(sorted(ranks), timeout=backstop)

    g_err = group(trio)
    g_sync = dist.new_group(trio, timeout=datetime.timedelta(seconds=PATIENT))
    g_pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=PATIENT))
    g_stall = {s: group(trio) for s in STRATEGIES}
    g_stall_bwd = {s: group(trio) for s in stall_backward}
    g_kill = [g_err if k.victim == STALLER else group({0, 1, k.victim}) for k in kills]
    g_next = [group([0, 1]) for _ in range(2)]
    out: dict = {"pid": os.getpid(), "pids": pids}
    mine = [i for i, k in enumerate(kills) if k.victim == rank]
    survivor = rank in (0, 1)

    def sync(group) -> None:
        # Ranks enter a failing call together, so only the injected failure can exhaust its deadline.
        dist.barrier(group=group)

    # ---- first calls: every group's heap exists and works (except where set-up is the target) ----
    if rank in trio:
        for s in STRATEGIES:
            run_call(variant, s, g_stall[s], rank, seed, PATIENT)
        for s in stall_backward:
            run_call(variant, s, g_stall_bwd[s], rank, seed, PATIENT, backward=True)
    for i, k in enumerate(kills):
        if (survivor or i in mine) and k.victim != STALLER and not k.when.endswith("-segment"):
            grank = sorted({0, 1, k.victim}).index(rank)
            run_call(variant, k.strategy, g_kill[i], grank, seed, PATIENT, backward=k.when == "backward")

    # ---- (c) a local error on one rank, then a correct call on the same group --------------------
    if rank in trio:
        out["local"] = {}
        _, want = oracle(op, seed, WORLD, CASE, torch.float32)
        for j, s in enumerate(STRATEGIES):
            bad = j % WORLD
            a, b, param, g = inputs(variant, rank, seed)
            if rank == bad:
                b = torch.randn(b.shape[0] + 1, b.shape[1])  # inner dims differ, on this rank only
            sync(g_sync)
            err = expect_error(fn, a, b, group=g_err, plan=plan_of(variant, s), timeout=DEADLINE)
            then = "ok"
            try:
                got = forward_backward(op, plan_of(variant, s), a, param, CASE[4], g, group=g_err, timeout=PATIENT)
                compare(f"{variant} {s} rank {rank} after a local error on rank {bad}", got, want[rank], torch.float32)
            except Exception as exc:  # noqa: BLE001 - recorded
                then = f"{type(exc).__name__}: {exc}"
            out["local"][s] = {"bad_rank": bad, "error": err, "then": then}

    # ---- (b) the staller passes the handshake, then sleeps past the deadline -----------------------
    def stall():
        time.sleep(STALL)
        raise Stalled(f"rank {rank} slept {STALL} s inside the call")

    if rank in trio:
        out["stall"] = {}
        for s in STRATEGIES:
            sync(g_sync)
            with after_handshake(op, stall) if rank == STALLER else contextlib.nullcontext():
                err = expect_error(run_call, variant, s, g_stall[s], rank, seed, DEADLINE)
            sync(g_sync)  # the staller stays alive and in the group until the others are done
            out["stall"][s] = {"error": err, "teardown": teardown(g_stall[s]), "segments": segments(pids)}
        # The same inside the backward: the forward completes, the staller sleeps in the backward.
        out["stall_backward"] = {}
        for s in stall_backward:
            a, b, param, g = inputs(variant, rank, seed)
            a.requires_grad_()
            sync(g_sync)
            y = fn(a, b, group=g_stall_bwd[s], plan=plan_of(variant, s), timeout=DEADLINE)
            with after_handshake(f"{op}.backward", stall) if rank == STALLER else contextlib.nullcontext():
                err = expect_error(y.backward, g)
            sync(g_sync)
            out["stall_backward"][s] = {"error": err, "teardown": teardown(g_stall_bwd[s]), "segments": segments(pids)}
        every = [None] * WORLD
        dist.all_gather_object(every, {k: out[k] for k in ("pid", "local", "stall", "stall_backward")}, group=g_sync)
        if survivor:
            out["staller"] = every[STALLER]

    # ---- (a) kill rounds: the victim dies inside the call, the survivors record what they see -------
    if survivor:
        out["kill"] = {}
    for i, k in enumerate(kills):
        if i in mine:
            return {**out, "victim_survived": victim(k, variant, op, g_kill[i], seed)}
        if survivor:
            sync(g_pair)
            out["kill"][k.label] = survive(k, variant, op, g_kill[i], rank, seed, pids)

    # ---- after the kills: the next heap creations on the machine ------------------------------------
    if survivor:
        from overlap.shm import SegmentName, private_dir

        dead = {pids[k.victim] for k in kills}
        out["stale_before"] = segments(dead)
        # A dead process stays a zombie until the test process reaps it, and remove_stale_segments
        # (rightly) counts a zombie as alive: wait for the reaping of the creators of what is left.
        creators = {SegmentName.parse(name).pid for name in out["stale_before"]}
        out["creators_reaped"] = all(wait_dead(pid, reaped=True) for pid in creators)
        # A heap creation right away (remove_stale_segments with its default minimum age).
        out["next_heap"] = expect_error(run_call, variant, "reference", g_next[0], rank, seed, PATIENT)
        out["stale_after_next_heap"] = segments(dead)
        # The same once the segments are older than that minimum age (60 s, faked with their mtime).
        old = time.time() - 120
        for name in out["stale_after_next_heap"]:
            with contextlib.suppress(OSError):
                os.utime(os.path.join(private_dir(), name), (old, old))
        sync(g_pair)
        out["later_heap"] = expect_error(run_call, variant, "reference", g_next[1], rank, seed, PATIENT)
        out["stale_after_later_heap"] = segments(dead)
        out["segments_at_end"] = segments(pids)
    return out


def victim(k: Kill, variant: str, op: str, group, seed: int) -> str:
    """The victim's side of a kill round (group rank 2): make the call and die at `k.when` of it."""
    import overlap

    a, b, param, g = inputs(variant, 2, seed)
    a.requires_grad_()
    plan = plan_of(variant, k.strategy)
    fn = getattr(overlap, op)
    if k.when.endswith("-segment"):
        die_after_creating("ctrl" if k.when == "ctrl-segment" else "g1", k.sig)
        fn(a, b, group=group, plan=plan, timeout=PATIENT)
    elif k.when == "mid-op":
        with after_handshake(op, lambda: die(k.sig)):
            fn(a, b, group=group, plan=plan, timeout=PATIENT)
    elif op == "matmul_all_reduce":  # its backward communicates nothing: die as it starts
        y = fn(a, b, group=group, plan=plan, timeout=PATIENT)
        y.register_hook(lambda grad: die(k.sig))
        y.backward(g)
    else:
        y = fn(a, b, group=group, plan=plan, timeout=PATIENT)
        with after_handshake(f"{op}.backward", lambda: die(k.sig)):
            y.backward(g)
    return k.label  # not reached when the hook fired


def survive(k: Kill, variant: str, op: str, group, rank: int, seed: int, pids: list[int]) -> dict:
    """A survivor's side of a kill round: the failing call (`DEADLINE`), then teardown and /dev/shm.

    Past its handshake the survivor waits until the victim is really dead (plus a moment for gloo's
    event loop to see the closed sockets): every strategy then meets the same failure, a peer that
    died after the handshake and before any data moved, and the outcome does not depend on a race.
    """
    import overlap

    waited = [0.0]  # how long the survivor waited for the victim's death inside its call

    def victim_gone():
        # On a loaded machine the victim can take seconds to reach its own kill after the handshake.
        start = time.monotonic()
        assert wait_dead(pids[k.victim]), f"victim {k.victim} still alive"
        time.sleep(0.5)
        waited[0] = time.monotonic() - start

    a, b, param, g = inputs(variant, rank, seed)
    a.requires_grad_()
    fn = getattr(overlap, op)
    plan = plan_of(variant, k.strategy)
    res: dict = {}
    before = set(segments(pids))  # (what earlier rounds left, if anything, is not this round's)
    if k.when.endswith("-segment"):
        res["error"] = expect_error(fn, a, b, group=group, plan=plan, timeout=DEADLINE)
    elif k.when == "mid-op":
        with after_handshake(op, victim_gone):
            res["error"] = expect_error(fn, a, b, group=group, plan=plan, timeout=DEADLINE)
    else:
        y = fn(a, b, group=group, plan=plan, timeout=DEADLINE)
        with after_handshake(f"{op}.backward", victim_gone):
            res["error"] = expect_error(y.backward, g)
        if res["error"][0] is None:  # (matmul_all_reduce) nothing to wait for: the next call must fail
            res["backward_ok"] = True
            res["error"] = expect_error(fn, a.detach(), b, group=group, plan=plan, timeout=DEADLINE)
            waited[0] = 0.0  # (the hook ran in the backward, not in this call)
    kind, msg, secs = res["error"]
    res["error"] = (kind, msg, secs - waited[0])  # the call's own time: its deadline started after the wait
    res["segments_after_error"] = sorted(set(segments(pids)) - before)
    res["teardown"] = teardown(group)
    res["segments_after_teardown"] = sorted(set(segments(pids)) - before)
    return res
