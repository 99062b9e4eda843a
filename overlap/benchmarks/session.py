"""The benchmark cases on a standing pool of local ranks, one call at a time: what the
pytest-benchmark wrappers in ``bench/`` run.

`overlap.pool.RankPool` starts N local ranks once (gloo on CPU; NCCL with a GPU each where there are
enough, as `world.launch`) and runs module-level functions on all of them. `BenchSession` checks a case
on the ranks with the runner's own `checks.check_case` (every strategy against ``reference``,
before any timing) and then times one call of one label at a time: every rank times it between
barriers (`timing.timed_call`) and the call's time is the slowest rank's, as in ``overlap bench``.

`RankClock` hands those times to pytest-benchmark. Given as the benchmark's timer
(``@pytest.mark.benchmark(timer=clock)``, a documented option of the marker), it reads the sum of
the rank-measured times so far, and `BenchSession.call` advances it by each call's time: a
``benchmark.pedantic(session.call, ...)`` round, timed by pytest-benchmark as ``timer()`` after
minus ``timer()`` before, is then exactly the ranks' time of that call. The parent's own costs
(pipes, pickling, the barrier before the call) are in none of the statistics.

What differs from ``overlap bench``: pytest-benchmark runs the rounds of one (case, strategy)
test back to back, where ``overlap bench`` interleaves the repeats of every label of a case, so
slow drift of the machine can show up here between tests; ``overlap bench`` is the reference
methodology and its table the one to quote.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from ..pool import RankPool
from .cases import BenchConfig
from .definitions import BENCH_OPS, MODES, TORCH, AnyCase, all_bench_labels, bench_labels, label_plan
from .timing import INTERPRETED_ITERS, summarize

#: the test-facing names of the two context labels (their table labels differ per op and mode)
COMM_ALONE, COMPUTE_ALONE = "comm-alone", "compute-alone"


def device_type_for(nproc: int) -> str:
    """The device type `nproc` local ranks compute on (`world.init_rank`'s rule)."""
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu"


def case_labels(case: AnyCase, device_type: str) -> list[str]:
    """What a session can time for `case`: the two context labels, ``torch``, ``reference``, every strategy
    label of its op, ``auto`` (interpreted ``fused`` only where the case fits the interpreter, as the runner)."""
    import torch

    from .checks import fused_interpreted

    interpreted = fused_interpreted(torch.device(device_type))
    labels = [
        label for label in bench_labels(case.op)
        if label_plan(case.op, label)[0] != "fused" or not interpreted or case.fits_interpreted_fused
    ]
    return [COMM_ALONE, COMPUTE_ALONE, *labels]


# ----------------------------------------------------------------------------------------------
# What the ranks run (module level: the pool's tasks are pickled by name)
# ----------------------------------------------------------------------------------------------

#: this rank's case at hand: "case" and its `checks.Checked` ("checked"); one case at a time
_CURRENT: dict[str, Any] = {}


def _rank_check(case: AnyCase, case_index: int, config: BenchConfig, seed: int) -> dict[str, Any]:
    from .. import world
    from .checks import check_case

    _CURRENT.clear()  # the previous case's tensors go before this case's are made
    pg = world.resolve_group(None)
    info = world.group_info(pg)
    checked = check_case(case, case_index, config, seed, info, pg)
    _CURRENT.update(case=case, checked=checked)
    w = checked.work
    return {
        "labels": list(checked.labels),
        "failed": dict(checked.failed),
        "timed": list(checked.fns),
        "interpreted": sorted(checked.slow),
        "comm_label": w.comm_label,
        "compute_label": w.compute_label,
        "comm_bytes": w.comm_bytes,
        "flops": case.flops(info.world_size),
        "notes": list(checked.notes),
    }


def _rank_call(case: AnyCase, label: str) -> float:
    from .. import world
    from .timing import timed_call

    assert _CURRENT.get("case") == case, "a call of a case that is not the one checked last"
    pg = world.resolve_group(None)
    return timed_call(_CURRENT["checked"].fns[label], world.group_info(pg).device, pg)


# ----------------------------------------------------------------------------------------------
# The session the wrappers use
# ----------------------------------------------------------------------------------------------


class RankClock:
    """A timer for pytest-benchmark that reads the rank-measured time: the sum of the times passed
    to `advance` (seconds). See the module docstring."""

    __name__ = "rank_clock"  # how pytest-benchmark names the timer in its JSON

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclasses.dataclass
class CaseState:
    """What the session knows of one case: the ranks' verdicts (`_rank_check`'s dict) and the
    rank-measured times of every label timed so far (seconds per call, warm-up calls included)."""

    check: dict[str, Any]
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # label -> `summarize` of its rounds


class BenchSession:
    """Check and time benchmark cases on a `RankPool` of `nproc` ranks, one call at a time.

    `check` runs a case's correctness check (once per case; a new case drops the previous one's
    tensors on the ranks), `call` times one call of a label on every rank and advances `clock` by
    the slowest rank's time, `record` keeps the statistics of a test's rounds and `extra_info` says
    what they mean against the case's reference and its collectives and GEMMs alone.
    """

    def __init__(self, nproc: int = 2, seed: int | None = None, timeout: float | None = 120.0,
                 clock: RankClock | None = None):
        self.nproc = nproc
        self.seed = random.SystemRandom().randrange(2**31) if seed is None else seed
        self.clock = clock if clock is not None else RankClock()
        self.config = BenchConfig(ops=BENCH_OPS, modes=MODES, strategies=all_bench_labels(), timeout=timeout,
                                  progress=False)
        self.pool = RankPool(nproc)
        self.cases: dict[AnyCase, CaseState] = {}
        self._current: AnyCase | None = None  # the case the ranks hold

    def close(self) -> None:
        self.pool.close()

    def check(self, case: AnyCase) -> CaseState:
        """The case's state, checking it on the ranks first if it is not the case at hand."""
        state = self.cases.get(case)
        if state is None or self._current != case:
            problem = case.world_problem(self.nproc)
            if problem:
                raise ValueError(problem)
            index = list(self.cases).index(case) if state is not None else len(self.cases)  # the same inputs again
            check = self.pool.run(_rank_check, case, index, self.config, self.seed)[0]
            state = self.cases[case] = CaseState(check) if state is None else dataclasses.replace(state, check=check)
            self._current = case
        return state

    def label(self, case: AnyCase, label: str) -> str:
        """The runner's label of a test label (`COMM_ALONE` and `COMPUTE_ALONE` differ per op and mode)."""
        check = self.check(case).check
        return {COMM_ALONE: check["comm_label"], COMPUTE_ALONE: check["compute_label"]}.get(label, label)

    def rounds(self, case: AnyCase, label: str, rounds: int, warmup: int) -> tuple[int, int]:
        """(rounds, warm-up rounds) for `label`: interpreted fused gets at most INTERPRETED_ITERS, no warm-up."""
        if self.label(case, label) in self.check(case).check["interpreted"]:
            return min(rounds, INTERPRETED_ITERS), 0
        return rounds, warmup

    def call(self, case: AnyCase, label: str) -> float:
        """One call of `label` of `case` on every rank; its time (the slowest rank's, seconds), which
        also advances `clock`."""
        seconds = max(self.pool.run(_rank_call, case, self.label(case, label)))
        self.check(case).times.setdefault(label, []).append(seconds)
        self.clock.advance(seconds)
        return seconds

    def record(self, case: AnyCase, label: str, rounds: int) -> dict[str, Any]:
        """The `summarize` statistics of the last `rounds` calls of `label` (the measured rounds)."""
        state = self.check(case)
        state.stats[label] = summarize(state.times[label][-rounds:])
        return state.stats[label]

    def extra_info(self, case: AnyCase, label: str) -> dict[str, Any]:
        """What the rounds of `label` mean: the ranks' median and spread, TFLOP/s or GB/s, and, where this
        session has timed them, the speedup over torch and over reference and the overlap efficiency (`runner`)."""
        state = self.check(case)
        check, stats = state.check, state.stats.get(label)
        info: dict[str, Any] = {
            "case": case.name,
            "strategy": self.label(case, label),
            "world_size": self.nproc,
            "seed": self.seed,
            "timer": "rank-measured: the slowest rank's time per call, between barriers",
        }
        if stats is None:
            return info
        t = stats["median_ms"]
        info.update(rank_median_ms=t, rank_p25_ms=stats["p25_ms"], rank_p75_ms=stats["p75_ms"],
                    rank_times_ms=stats["times_ms"])
        if label == COMM_ALONE:
            info["gbps"] = check["comm_bytes"] / (t * 1e-3) / 1e9
            return info
        info["tflops"] = check["flops"] / (t * 1e-3) / 1e12
        if label == COMPUTE_ALONE:
            return info
        info["interpreted"] = label in check["interpreted"]
        ref, base = state.stats.get("reference"), state.stats.get(TORCH)
        if base is not None:
            info["speedup"] = base["median_ms"] / t
        if ref is not None:
            info["speedup_vs_reference"] = ref["median_ms"] / t
            comm, compute = state.stats.get(COMM_ALONE), state.stats.get(COMPUTE_ALONE)
            if comm is not None and compute is not None:
                smaller = min(comm["median_ms"], compute["median_ms"])
                info["efficiency"] = (ref["median_ms"] - t) / smaller
        return info
