"""Tier 1: the cost model against published GPU measurements (`bench.published`, docs/results/model-vs-published.md).

Every row stays within the band the page states for it (the goal's, or a wider one with its reason), the held-out
rows meet the goal's share, and the page's table is what the model gives now. A change of the model or of a
preset's constants that moves a row out of its band fails here, naming the row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.published import GOAL_SHARE, ROWS, SPEEDUP_BAND, TIME_BAND, evaluate, evaluate_all, summary, table
from overlap.plans import presets

PAGE = Path(__file__).resolve().parents[2] / "docs" / "results" / "model-vs-published.md"


@pytest.fixture(scope="module")
def outcomes():
    return evaluate_all()


def test_rows_are_well_formed():
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names)), names
    for r in ROWS:
        assert r.source and r.quote and r.note and r.role in ("calibrate", "held-out"), r.name
        assert r.machine in presets.PRESETS, r.name
        assert (r.band and r.why) or not (r.band or r.why), r.name  # a wider band says why
        if r.kind == "bandwidth":
            assert r.fused_s and r.unfused_s is None and not r.problems, r.name
        else:
            assert r.problems and r.published_speedup and r.published_speedup > 0, r.name
    assert sum(r.role == "held-out" for r in ROWS) >= 2 * sum(r.role == "calibrate" for r in ROWS)


def test_every_row_is_within_its_band(outcomes):
    outside = [(o.row.name, o.speedup_error, o.time_errors, o.row.band or (SPEEDUP_BAND, TIME_BAND))
               for o in outcomes if not o.within_band]
    assert not outside, outside


def test_rows_outside_the_goal_state_why(outcomes):
    for o in outcomes:
        if not o.within_goal:
            assert o.row.band and o.row.why, (o.row.name, o.speedup_error, o.time_errors)


def test_held_out_rows_meet_the_goal(outcomes):
    ok, n, speed, times = summary(outcomes, "held-out")
    assert n >= 10 and ok / n >= GOAL_SHARE, (ok, n, speed, times)
    assert speed <= SPEEDUP_BAND and times <= TIME_BAND, (speed, times)


def test_the_page_holds_the_model_of_now(outcomes):
    text = PAGE.read_text()
    assert "\n".join(table(outcomes)) in text, "docs/results/model-vs-published.md is stale: python -m bench.published"


def test_a_wrong_constant_moves_rows_out_of_their_band():
    """The rows constrain the constants: an H800 whose NVLink reached the H100's 450 GB/s, or GEMMs at the full
    dense peak, puts published rows outside their bands."""
    h800 = presets.PRESETS["h800"]
    fast = dataclasses.replace(h800, link_Bps=450e9)
    ideal = dataclasses.replace(h800, efficiency=dataclasses.replace(h800.efficiency, gemm=1.0))
    for wrong in (fast, ideal):
        saved = presets.PRESETS["h800"]
        presets.PRESETS["h800"] = wrong
        try:
            moved = [r.name for r in ROWS if r.machine == "h800" and r.kind != "bandwidth"
                     and not evaluate(r).within_band]
        finally:
            presets.PRESETS["h800"] = saved
        assert moved, wrong
