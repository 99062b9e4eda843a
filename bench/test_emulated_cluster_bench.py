"""The emulated two-node cluster (`python -m bench.emulated_cluster`), reachable from the benchmark suite:
``pytest bench/ --benchmark-only --overlap-emulated 100mbit,2gbit`` (root; skipped otherwise).

One benchmark per rate and problem: its time is the tuner's measured pick (the slowest rank's
median), and ``extra_info`` carries what the script reports: the exhaustive grid's best, the regret
(duel and grid), the tuning time against the grid's, the chunks chosen per link class, the model's
error and how much overlap pays (reference / best overlapped plan). These measured outcomes are what the
CI tests leave out (`tests/emulated/test_emulated_cluster.py` asserts the model's choices from recorded profiles).
"""

from __future__ import annotations

import pytest

from bench import emulated_cluster as ec


@pytest.fixture(scope="module")
def emulated(request):
    rates = request.config.getoption("--overlap-emulated")
    if not rates:
        pytest.skip("the emulated cluster runs with --overlap-emulated RATES (root)")
    reason = ec.probe_emulation()
    if reason is not None:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    cfg = ec.Config(rates=tuple(r.strip() for r in rates.split(",") if r.strip()), repeats=2, verbose=False)
    results = ec.run(cfg)
    print("\n" + ec.format_table([r["summary"] for r in results]))
    return results


class _Clock:
    """A timer that reads the measured time, so pytest-benchmark's statistics are the ranks' own."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_CLOCK = _Clock()


@pytest.mark.benchmark(group="emulated-cluster", timer=_CLOCK)
def test_tuner_against_grid_on_the_emulated_cluster(benchmark, emulated):
    rows = [(r["summary"]["rate"], p) for r in emulated for p in r["summary"]["problems"]]
    assert rows, "the emulated run measured nothing"
    # One round per problem: its time is the pooled grid time of the tuner's pick (the slowest rank's median).
    times = [p["best_s"] * (1 + p["regret_pooled"]) for _, p in rows]
    state = {"i": 0}

    def one_round() -> None:
        _CLOCK.now += times[state["i"] % len(times)]
        state["i"] += 1

    benchmark.pedantic(one_round, rounds=len(times), iterations=1)
    benchmark.extra_info["problems"] = [
        {"rate": rate, "problem": p["key"], "pick": p["pick"], "grid_best": p["best"], "regret": p["regret"],
         "regret_grid": p["regret_grid"],
         "tune_share": p["tune_share"], "chunks": p["pick_chunks"], "model_error_pick": p["model_error_pick"],
         "reference_over_best_overlap": p["reference_over_best_overlap"]}
        for rate, p in rows
    ]
