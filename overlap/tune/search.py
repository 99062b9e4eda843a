"""The agreed search: the cost model ranks the candidate plans of a problem, the best few are measured on
every rank, and rank 0 decides from the slowest rank's times.

For each problem (`overlap.plans.Problem`):

1. Rank 0 ranks every candidate with the cost model (`overlap.plans.rank_candidates`, on the group's
   topology and machine profile) and broadcasts the list to measure: ``reference``, the ``measure``
   best-predicted others, and the best-predicted plan of every family not among them (a family: a
   strategy, with or without expert migration), so the pick is never a family's loser by the model's
   word alone (the model prices a strategy's fixed costs and contention roughly: flat ``pipelined`` can
   beat ``hierarchical`` where it predicts otherwise). Every rank measures the same plans in the same order.
   For a MoE problem across nodes the model's candidates include expert migration (``Plan.migrate``, the
   pairs `overlap.plans.choose_migration` picks for the `routing` given, balanced where none is).
2. Each candidate is checked once against ``reference`` (same inputs, assert_close with DESIGN's
   tolerances; a candidate that disagrees is dropped and reported), warmed up, then all candidates are
   timed in interleaved rounds (a barrier before every call), ``repeats`` times each.
3. Every rank's medians are combined by a MAX all-reduce (the slowest rank's time is the step's time);
   rank 0 picks the fastest and broadcasts its index, so no rank can end on another plan. A plan
   measured slower than ``reference`` is never picked.

The result is a `overlap.plans.PlanFile` (topology, profile, one entry per problem with the plan,
its measured time, reference's and the model's prediction) that ``OVERLAP_PLAN`` or ``plan=`` loads.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import comm, envs, world
from ..plans import Entry, Plan, PlanFile, Problem, default_profile, expected_loads, rank_candidates, topology_of
from ..plans.auto import gpu_name

#: a MoE routing as `overlap.plans.expected_loads` reads it: ``E`` shares, or ``E`` rows of one share per node
Routing = tuple[float, ...] | tuple[tuple[float, ...], ...]

#: default number of plans measured besides `reference`
MEASURE = 3


@dataclasses.dataclass
class Trial:
    """One measured candidate of one problem (the slowest rank's median)."""

    plan: Plan
    predicted_s: float
    measured_s: float = math.nan
    spread_s: float = 0.0
    error: str = ""


@dataclasses.dataclass
class Outcome:
    """What the search found for one problem."""

    problem: Problem
    trials: list[Trial]
    chosen: Trial
    reference: Trial
    seconds: float  # wall time spent on this problem


def tune(problems: list[Problem], group=None, *, profile=None, measure: int = MEASURE, repeats: int = 5,
         warmup: int = 2, timeout: float | None = None, routing: Routing | None = None,
         progress: Callable[[str, int, int], None] | None = None) -> tuple[Any, list[Outcome]]:
    """Tune every problem on `group` (a collective: every rank calls it with the same problems).

    `routing`: the MoE problems' routing, as `overlap.plans.expected_loads` reads it (``E`` per-expert shares
    of the routed pairs, or ``E`` rows of one share per node, e.g. a model router's measured loads); it
    decides the migration candidates and draws the tokens' experts of every measurement (each token's ``K``
    experts in proportion to its node's shares). None: the workload's own uneven routing, balanced for the
    model. ValueError (on every rank, before any communication) where it does not fit a MoE problem.
    Returns ``(plan_file, outcomes)``; `progress(text, done, total)` is called before every measurement.
    """
    pg = world.resolve_group(group)
    timeout = envs.resolve_timeout(timeout)
    info = world.group_info(pg, timeout)
    topology = topology_of(info)
    if profile is None:
        profile = default_profile(info.device.type, gpu_name(info.device))
    loads = [_loads(p, topology, routing) for p in problems]  # (raises before any communication)
    plans_per_problem = [_agreed_candidates(p, topology, profile, measure, pg, info, ld)
                         for p, ld in zip(problems, loads, strict=True)]
    total = sum(len(c) for c in plans_per_problem)
    done = [0]
    outcomes = []
    for problem, trials in zip(problems, plans_per_problem, strict=True):
        start = time.monotonic()

        def report(text: str, p=problem) -> None:
            if progress is not None:
                progress(f"{p.key}: {text}", done[0], total)

        _measure(problem, trials, pg, info, repeats, warmup, timeout, report, routing)
        done[0] += len(trials)
        outcomes.append(_decide(problem, trials, pg, info, timeout, time.monotonic() - start))
    if progress is not None:
        progress("done", total, total)
    pf = PlanFile.new(topology, info.world_size, profile)
    for o in outcomes:
        pf.add(Entry(o.problem, o.chosen.plan, o.chosen.measured_s, o.reference.measured_s,
                              o.chosen.predicted_s))
    return pf, outcomes


def measure(problem: Problem, plans: list[Plan], group=None, *, repeats: int = 5, warmup: int = 2,
            timeout: float | None = None, routing: Routing | None = None,
            progress: Callable[[str], None] | None = None) -> list[Trial]:
    """Measure `plans` (the first should be ``reference``: the others are checked against it) for
    `problem` on every rank, interleaved, the slowest rank's medians: the exhaustive grid of a
    comparison uses it with every candidate. `routing`: as `tune`'s."""
    pg = world.resolve_group(group)
    timeout = envs.resolve_timeout(timeout)
    info = world.group_info(pg, timeout)
    _loads(problem, topology_of(info), routing)  # (raises before any communication)
    trials = [Trial(p, math.nan) for p in plans]
    _measure(problem, trials, pg, info, repeats, warmup, timeout, progress or (lambda text: None), routing)
    return trials


def _loads(problem: Problem, topology, routing: Routing | None):
    """The expected loads of a MoE problem under `routing` (None: balanced, the model's default)."""
    if routing is None or problem.spec.family != "moe":
        return None
    return expected_loads(problem, topology, routing)


def _agreed_candidates(problem: Problem, topology, profile, measure: int, pg, info, loads=None) -> list[Trial]:
    """Rank 0's model ranking, broadcast: reference first, then the plans `to_measure` picks."""
    chosen = to_measure(rank_candidates(problem, topology, profile, loads), measure)
    payload = [[dataclasses.asdict(t.plan), t.predicted_s] for t in chosen]
    box = [payload]
    dist.broadcast_object_list(box, src=info.global_ranks[0], group=pg)
    return [Trial(Plan(**{**fields, "num_chunks": tuple(tuple(x) for x in fields["num_chunks"])}), pred)
            for fields, pred in box[0]]


def family(plan: Plan) -> tuple[str, bool]:
    """A plan's family: its strategy, and whether it migrates experts."""
    return plan.strategy, bool(plan.migrate)


def to_measure(ranked: list, measure: int) -> list[Trial]:
    """The trials of one problem from the model's ranking (`rank_candidates`, fastest first): ``reference``,
    the `measure` best-predicted others, then the best-predicted plan of every family none of those is of
    (`family`), in the ranking's order."""
    ref = next((pred for plan, pred in ranked if plan.strategy == "reference"), None)
    chosen = [Trial(Plan("reference"), ref.total_s if ref is not None else math.nan)]
    chosen += [Trial(plan, pred.total_s) for plan, pred in ranked if plan.strategy != "reference"][:measure]
    for plan, pred in ranked:
        if family(plan) not in {family(t.plan) for t in chosen}:
            chosen.append(Trial(plan, pred.total_s))
    return chosen


def _sync(pg, info, timeout: float, values: torch.Tensor | None = None, op=dist.ReduceOp.MAX) -> torch.Tensor:
    """A bounded all-reduce (a barrier when `values` is None)."""
    t = values if values is not None else torch.zeros(1, device=info.device)
    work = dist.all_reduce(t, op=op, group=pg, async_op=True)
    comm.wait_work(work, "tune", info.rank, "any", "barrier", timeout, info)
    return t


def _measure(problem: Problem, trials: list[Trial], pg, info, repeats: int, warmup: int, timeout: float,
             report: Callable[[str], None], routing: Routing | None = None) -> None:
    from ..workloads.trial import trial_call

    runs = []
    expected = None
    links = tuple(info.link_classes().values())  # plans are named as overlap bench names them (`Plan.label`)
    for t in trials:
        report(f"checking {t.plan.label(links)}")
        fn, result = trial_call(problem, t.plan, pg, info, timeout, seed=1234, routing=routing)
        got = fn()
        if t.plan.strategy == "reference":
            expected = [result(got)]
        else:
            t.error = _differs(problem, result(got), expected[0])
        ok = torch.tensor([0.0 if t.error else 1.0], device=info.device)
        if _sync(pg, info, timeout, ok, dist.ReduceOp.MIN).item() == 0.0 and not t.error:
            t.error = "wrong on another rank"
        runs.append(fn if not t.error else None)
        for _ in range(warmup if not t.error else 0):
            fn()
    times: list[list[float]] = [[] for _ in trials]
    for rnd in range(repeats):  # interleaved rounds: drift hits every candidate alike
        for i, t in enumerate(trials):
            if runs[i] is None:
                continue
            report(f"measuring {t.plan.label(links)} ({rnd + 1}/{repeats})")
            _sync(pg, info, timeout)
            start = time.perf_counter()
            runs[i]()
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            times[i].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(x) if x else math.inf for x in times], dtype=torch.float64,
                           device=info.device)
    spreads = torch.tensor([(max(x) - min(x)) if x else 0.0 for x in times], dtype=torch.float64, device=info.device)
    _sync(pg, info, timeout, medians)
    _sync(pg, info, timeout, spreads)
    for t, m, s in zip(trials, medians.tolist(), spreads.tolist(), strict=True):
        t.measured_s, t.spread_s = m, s


def _differs(problem: Problem, got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    tol = {"rtol": 1e-4, "atol": 1e-4} if problem.dtype in ("float32", "float64") else {"rtol": 2e-2, "atol": 2e-2}
    for g, w in zip(got, want, strict=True):
        scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
        try:
            torch.testing.assert_close(g.float(), w.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)
        except AssertionError as exc:
            return f"differs from reference: {str(exc).splitlines()[0]}"
    return ""


def _decide(problem: Problem, trials: list[Trial], pg, info, timeout: float, seconds: float) -> Outcome:
    """Rank 0 picks the fastest measured plan (never one slower than reference) and broadcasts it."""
    reference = trials[0]
    best = 0
    for i, t in enumerate(trials):
        if not t.error and t.measured_s < trials[best].measured_s:
            best = i
    choice = torch.tensor([best], dtype=torch.int64, device=info.device)
    work = dist.broadcast(choice, src=info.global_ranks[0], group=pg, async_op=True)
    comm.wait_work(work, "tune", info.rank, 0, "decision", timeout, info)
    chosen = trials[int(choice.item())]
    return Outcome(problem, trials, chosen, reference, seconds)
