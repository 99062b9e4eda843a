"""The rank side of `bench.emulated_cluster`: what each rank process runs inside its node's namespace
(``python -m bench.emulated_cluster --rank-entry spec.json``, started by the parent's
`bench.emulated_cluster.run.run_rate`).

On the ranks, per rate: a probe (`overlap.tune.probe_cached`, quick unless ``--probe full``, cached
in a fresh temporary ``OVERLAP_CACHE_DIR`` so no rate reuses another's; ``--profiles FILE`` gives a
recorded profile per rate instead, and the model's ranking is then fixed by the inputs), a check that the node-local
subgroups see ``shm`` links and that a ``symm`` call over shared memory matches ``reference``, then
per problem and repeat, interleaved: (1) the tuner, `overlap.tune.search.tune` with the probed
profile (the model's ``--measure`` best plans and ``reference`` measured); (2) the exhaustive grid,
`overlap.tune.search.measure` over every plan `overlap.plans.candidates` lists. Both measure with the
same ``--tune-repeats`` and ``--warmup`` and time themselves by wall clock on rank 0. (3) A duel: the
tuner's pick and the grid's best timed again side by side (with ``reference``), interleaved, twice as
many calls each, so neither is judged on the times it was selected by. Rank 0 writes the raw results
to the spec's ``out`` file for the parent.

Imports torch and overlap only inside the functions: the parent imports this module too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.emulated_cluster.config import Config

# ----------------------------------------------------------------------------------------------
# On the ranks
# ----------------------------------------------------------------------------------------------


def rank_entry(spec_path: str) -> None:
    """One rank's whole run from the parent's spec file: join the gloo group, compare, rank 0 writes the results."""
    import datetime

    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    cfg = Config(**spec["config"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    try:
        result = _compare(cfg, spec, rank, world_size)
        if rank == 0:
            tmp = Path(spec["out"] + ".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, spec["out"])
        dist.barrier()  # every rank is done before any tears its connections down
    finally:
        dist.destroy_process_group()


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def _node_check(cfg: Config, info: Any, rank: int) -> dict[str, Any]:
    """Every rank's node is the one the launcher gave it; within each node's subgroup the link class is
    ``shm`` and a ``symm`` call (POSIX shared memory between the namespaces' processes) matches
    ``reference``. Raises RuntimeError otherwise (and AssertionError where the results differ)."""
    import torch
    import torch.distributed as dist

    import overlap
    from overlap import world

    rpn = cfg.ranks_per_node
    want = tuple("ab"[r // rpn] for r in range(info.world_size))
    if info.nodes != want:
        raise RuntimeError(f"rank {rank}: overlap sees the nodes {info.nodes}, the ranks were launched on {want}")
    classes = info.link_classes()
    if any(c != ("network" if want[p] != want[rank] else "shm") for p, c in classes.items()):
        raise RuntimeError(f"rank {rank}: link classes {classes} for nodes {want}")
    out = {"nodes": list(info.nodes), "link_classes": {str(p): c for p, c in classes.items()}, "symm": "skipped"}
    subgroups = [dist.new_group([n * rpn + i for i in range(rpn)]) for n in range(2)]  # collective: every rank
    if not cfg.symm_check or rpn < 2:
        return out
    pg = subgroups[rank // rpn]
    sub = world.group_info(pg)
    if not sub.single_node or set(sub.link_classes().values()) != {"shm"}:
        raise RuntimeError(f"rank {rank}: node {want[rank]}'s subgroup is not one node of shm links: {sub}")
    gen = torch.Generator().manual_seed(17 + rank)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(32, 24, generator=torch.Generator().manual_seed(5))
    got = overlap.all_gather_matmul(a, b, group=pg, strategy="symm")
    want_y = overlap.all_gather_matmul(a, b, group=pg, strategy="reference")
    torch.testing.assert_close(got, want_y, rtol=1e-5, atol=1e-5)
    overlap.release(pg)
    out["symm"] = "matches reference"
    return out


def _compare(cfg: Config, spec: dict, rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from overlap import world
    from overlap.plans import Plan, Problem, Profile, candidates, predict, rank_candidates, topology_of
    from overlap.tune import probe_cached
    from overlap.tune.search import measure, tune

    info = world.group_info()
    topology = topology_of(info)
    _say(rank, f"{world_size} ranks up, nodes {''.join(info.nodes)}, topology {topology.signature}")
    node = _node_check(cfg, info, rank)
    _say(rank, f"node check: {node['symm']} within each node")
    t0 = time.perf_counter()
    if spec["rate"] in cfg.profiles:
        profile = Profile.from_json(cfg.profiles[spec["rate"]])
        _say(rank, "probe: none, the profile was given")
    else:
        profile = probe_cached(refresh=True, quick=cfg.probe == "quick",
                               progress=(lambda text: _say(rank, f"probe: {text}")))
    probe_s = time.perf_counter() - t0
    net = profile.links.get("network", {}).get("p2p")
    _say(rank, f"probe: {probe_s:.1f} s; network {net.bandwidth_Bps / 1e6:.1f} MB/s, "
               f"{net.latency_s * 1e6:.0f} us" if net else f"probe: {probe_s:.1f} s")

    if cfg.figures:
        from bench.emulated_cluster.figures import run_figures

        figures, plan_file = run_figures(cfg, spec, rank, world_size, profile)
        return {"rate": spec["rate"], "link": spec["link"], "topology": topology.signature, "world_size": world_size,
                "ranks_per_node": cfg.ranks_per_node, "node_check": node, "probe_s": probe_s,
                "profile": profile.to_json(), "figures": figures, "plan_file": plan_file}
    if cfg.moe_figures:
        from bench.emulated_cluster.moe import run_moe_figures

        figures, plan_file = run_moe_figures(cfg, spec, rank, world_size, profile)
        return {"rate": spec["rate"], "link": spec["link"], "topology": topology.signature, "world_size": world_size,
                "ranks_per_node": cfg.ranks_per_node, "node_check": node, "probe_s": probe_s,
                "profile": profile.to_json(), "moe_figures": figures, "plan_file": plan_file}
    problems = [Problem(**p) for p in cfg.problems]
    for p in problems:  # first calls (imports, allocator, gloo pairs) stay out of both timings
        measure(p, [Plan("reference"), Plan("pipelined")], repeats=1, warmup=1)

    def timed(fn) -> tuple[Any, float]:
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    def plan_dict(plan: Plan) -> dict[str, Any]:
        return {"text": plan.describe(), "strategy": plan.strategy, "chunks": dict(plan.num_chunks)}

    results = []
    for p in problems:
        grid_plans = candidates(p, topology)
        model = rank_candidates(p, topology, profile)
        predicted = {plan.describe(): predict(p, plan, topology, profile).total_s for plan in grid_plans}
        results.append({"problem": dataclasses.asdict(p), "key": p.key, "grid_size": len(grid_plans),
                        "model_pick": plan_dict(model[0][0]), "predicted": predicted, "repeats": []})
    for rep in range(cfg.repeats):
        for p, res in zip(problems, results, strict=True):
            _say(rank, f"repeat {rep + 1}/{cfg.repeats}, {p.key}: tuner")
            (_, outcomes), tune_s = timed(lambda p=p: tune([p], profile=profile, measure=cfg.measure,
                                                           repeats=cfg.tune_repeats, warmup=cfg.warmup))
            o = outcomes[0]
            _say(rank, f"  picked {o.chosen.plan.describe()} in {tune_s:.2f} s; grid of {res['grid_size']}")
            grid, grid_s = timed(lambda p=p: measure(p, candidates(p, topology), repeats=cfg.tune_repeats,
                                                     warmup=cfg.warmup))
            best = min((t for t in grid if not t.error), key=lambda t: t.measured_s)
            _say(rank, f"  grid best {best.plan.describe()} in {grid_s:.2f} s")
            duel = {}
            if best.plan.describe() != o.chosen.plan.describe():  # reference first: the others are checked on it
                contenders = [Plan("reference")] + [t.plan for t in (o.chosen, best) if t.plan.strategy != "reference"]
                duel = {t.plan.describe(): t.measured_s for t in measure(p, contenders, repeats=2 * cfg.tune_repeats,
                                                                         warmup=cfg.warmup) if not t.error}
                _say(rank, "  duel " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in duel.items()))
            res["repeats"].append({
                "tune_s": tune_s, "grid_s": grid_s,
                "pick": plan_dict(o.chosen.plan), "pick_measured_s": o.chosen.measured_s,
                "best": best.plan.describe(), "duel": duel,
                "pick_predicted_s": o.chosen.predicted_s, "reference_measured_s": o.reference.measured_s,
                "tuner_trials": [{"plan": t.plan.describe(), "predicted_s": t.predicted_s, "measured_s": t.measured_s,
                                  "error": t.error} for t in o.trials],
                "grid": {t.plan.describe(): {"measured_s": t.measured_s, "spread_s": t.spread_s, "error": t.error}
                         for t in grid},
            })
    return {"rate": spec["rate"], "link": spec["link"], "topology": topology.signature, "world_size": world_size,
            "ranks_per_node": cfg.ranks_per_node, "node_check": node, "probe": cfg.probe, "probe_s": probe_s,
            "profile": profile.to_json(), "problems": results}
