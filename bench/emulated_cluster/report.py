"""The report of `bench.emulated_cluster`: each rate's raw results (rank 0's) summarized per problem
(`summarize`) and printed as a table (`format_table`). Pure Python: the parent and the tests use it.

Report, per rate and problem (medians over the repeats, spreads ``[min..max]``):

* ``pick``: the tuner's choice (the most frequent one; every pick is in the JSON); ``net``/``shm``:
  its chunk counts per link class (``-`` where the plan does not chunk that class);
* ``best``: the grid's fastest plan (grid times pooled over the repeats: the median per plan);
* ``regret``: the pick's time / the grid best's time - 1 in that repeat's duel (0 where they are the
  same plan; negative where the pick won the duel); target <= 5%. ``grid``: the pick's grid time / the
  best grid time - 1, judged on the grid that chose the best (biased up: the best of ~17 noisy times
  is biased low); ``pooled``: the same on the grid pooled over repeats. ``noise``: the grid regret of
  exhaustive search itself, its pick of one repeat judged on another repeat's grid (the floor that
  timing noise sets on the grid columns);
* ``tune/grid``: the tuner's wall time / the grid's (target <= 25%). The probe, paid once per machine
  and shared by every problem, is reported on its own line;
* ``ref/best``: reference's pooled grid time / the best's (> 1.1: overlap pays);
* ``err pick``, ``err grid``: the model's error, median ``|predicted / measured - 1|`` of the pick (as
  the tuner measured it) and over every grid plan.
"""

from __future__ import annotations

import collections
import math
import os
import statistics
from typing import Any

# ----------------------------------------------------------------------------------------------
# Summary (pure Python: the parent and the tests use it)
# ----------------------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite)}


def _duel_regret(rep: dict[str, Any]) -> float:
    """The pick's duel time / the grid best's - 1; 0 where the tuner picked the grid's best."""
    pick, best, duel = rep["pick"]["text"], rep.get("best"), rep.get("duel", {})
    if best is None:  # results written before duels were run
        return math.nan
    if pick == best:
        return 0.0
    return duel.get(pick, math.nan) / duel.get(best, math.nan) - 1


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per problem of one rate's raw results: regret, tuning time share, chunks, model error (see the
    module docstring); medians and ``[min, max]`` over the repeats."""
    problems = []
    for res in raw["problems"]:
        reps = res["repeats"]
        regrets, grid_regrets, shares, err_pick, err_grid = [], [], [], [], []
        pooled_times: dict[str, list[float]] = collections.defaultdict(list)
        grids = [{k: v["measured_s"] for k, v in rep["grid"].items() if not v["error"]} for rep in reps]
        # The noise floor: exhaustive search's own pick of one repeat judged on another repeat's grid.
        floor = [gj.get(min(gi, key=gi.get), math.nan) / min(gj.values()) - 1
                 for i, gi in enumerate(grids) for j, gj in enumerate(grids) if i != j]
        for rep, grid in zip(reps, grids, strict=True):
            best = min(grid.values())
            grid_regrets.append(grid.get(rep["pick"]["text"], math.nan) / best - 1)
            regrets.append(_duel_regret(rep))
            shares.append(rep["tune_s"] / rep["grid_s"])
            err_pick.append(abs(rep["pick_predicted_s"] / rep["pick_measured_s"] - 1))
            err_grid += [abs(res["predicted"][k] / t - 1) for k, t in grid.items()
                         if math.isfinite(res["predicted"][k])]
            for k, t in grid.items():
                pooled_times[k].append(t)
        pooled = {k: statistics.median(v) for k, v in pooled_times.items()}
        best_plan = min(pooled, key=pooled.get)
        picks = collections.Counter(rep["pick"]["text"] for rep in reps)
        pick = picks.most_common(1)[0][0]
        pick_chunks = next(rep["pick"] for rep in reps if rep["pick"]["text"] == pick)
        ref = pooled.get("reference[]", math.nan)
        best_overlap = min((t for k, t in pooled.items() if not k.startswith("reference")), default=math.nan)
        problems.append({
            "key": res["key"], "grid_size": res["grid_size"], "pick": pick, "picks": dict(picks),
            "pick_strategy": pick_chunks["strategy"], "pick_chunks": pick_chunks["chunks"],
            "model_pick": res["model_pick"]["text"], "model_chunks": res["model_pick"]["chunks"],
            "best": best_plan, "best_s": pooled[best_plan], "reference_s": ref,
            "reference_over_best": ref / pooled[best_plan], "reference_over_best_overlap": ref / best_overlap,
            "regret": _spread(regrets), "regret_grid": _spread(grid_regrets),
            "regret_pooled": pooled.get(pick, math.nan) / pooled[best_plan] - 1,
            "regret_noise": _spread(floor),
            "tune_share": _spread(shares), "tune_s": _spread([r["tune_s"] for r in reps]),
            "grid_s": _spread([r["grid_s"] for r in reps]),
            "model_error_pick": _spread(err_pick),
            "model_error_grid": statistics.median(err_grid) if err_grid else math.nan,
        })
    net = raw["profile"]["links"].get("network", {}).get("p2p", {})
    return {"rate": raw["rate"], "topology": raw["topology"], "probe": raw["probe"], "probe_s": raw["probe_s"],
            "network_MBps": net.get("bandwidth_Bps", math.nan) / 1e6,
            "network_latency_us": net.get("latency_s", math.nan) * 1e6,
            "node_check": raw["node_check"]["symm"], "load": raw.get("load", [math.nan, math.nan]),
            "problems": problems}


def _pct(s: dict[str, float]) -> str:
    return f"{s['median'] * 100:4.1f}% [{s['min'] * 100:.0f}..{s['max'] * 100:.0f}]"


def _chunks(chunks: dict[str, int], link: str) -> str:
    return str(chunks[link]) if link in chunks else "-"


def format_table(summaries: list[dict[str, Any]]) -> str:
    """The report: a line per rate (link, probe, load), a line per problem (columns: the module docstring)."""
    kw = max([44] + [len(p["key"]) for s in summaries for p in s["problems"]])  # the problem column's width
    head = (f"{'rate':>8}  {'problem':<{kw}} {'pick':<28} {'net':>3} {'shm':>3}  {'grid best':<28} {'regret':<20} "
            f"{'grid':>6} {'pooled':>6} {'noise':>6}  {'tune/grid':<20} {'ref/best':>8} {'err pick':>8} "
            f"{'err grid':>8}")
    lines = [head, "-" * len(head)]
    worst_regret, worst_share = [], []
    for s in summaries:
        lines.append(f"{s['rate']:>8}  {s['topology']}; probe ({s['probe']}) {s['probe_s']:.1f} s: network "
                     f"{s['network_MBps']:.1f} MB/s + {s['network_latency_us']:.0f} us; node-local symm "
                     f"{s['node_check']}; load {s['load'][0]:.1f} -> {s['load'][1]:.1f} on {os.cpu_count()} cores")
        for p in s["problems"]:
            lines.append(
                f"{s['rate']:>8}  {p['key']:<{kw}} {p['pick']:<28} {_chunks(p['pick_chunks'], 'network'):>3} "
                f"{_chunks(p['pick_chunks'], 'shm'):>3}  {p['best']:<28} {_pct(p['regret']):<20} "
                f"{p['regret_grid']['median'] * 100:5.1f}% {p['regret_pooled'] * 100:5.1f}% "
                f"{p['regret_noise']['median'] * 100:5.1f}%  "
                f"{_pct(p['tune_share']):<20} {p['reference_over_best']:8.2f} "
                f"{p['model_error_pick']['median'] * 100:7.0f}% {p['model_error_grid'] * 100:7.0f}%")
            worst_regret.append(p["regret"]["median"])
            worst_share.append(p["tune_share"]["median"])
    if worst_regret:
        lines.append(f"targets: regret <= 5% (median duel per problem; worst {max(worst_regret) * 100:.1f}%), "
                     f"tuning time <= 25% of the grid's (worst {max(worst_share) * 100:.1f}%)")
    return "\n".join(lines)
