"""The MoE figures on the emulated cluster (``python -m bench.emulated_cluster --moe-figures``).

On 2 nodes x 2 ranks, per rate (default 100 Mbit/s, 1 Gbit/s, 10 Gbit/s), the MoE layer of the op table's
``moe`` op (``h, handle = overlap.moe.dispatch_grouped_matmul(x, topk_idx, w1, E, plan=...)``, ``gelu``,
``overlap.moe.grouped_matmul_combine(a, w2, topk_weights, handle, plan=...)``) at one shape (`MOE_SHAPE`),
forward and forward+backward, on two routings (`routing`, the same for every plan of a case):

* **balanced**: each token's ``K`` experts drawn uniformly without replacement (every expert ~1/E of the pairs);
* **skewed**: the same draw with the `HOT_EXPERTS` weighted `HOT_WEIGHT` times the others (a few hot experts
  take most pairs; one hot expert per node at 2 x 2).

Both are deterministic from `ROUTING_SEED` and the rank. The plans, timed side by side (interleaved, a barrier
before every call, each rank's median of 2 x ``--tune-repeats`` calls, the slowest rank's; each plan's output
and gradients checked against ``reference``'s first), then one more call each with its bytes counted
(`bench.emulated_cluster.figures.call_bytes`: payload posted point-to-point to the other node, veth bytes):

* ``reference``; the cost model's best ``pipelined`` and ``hierarchical`` plans (the rate's probed profile);
* ``hot``: ``hierarchical`` with the hot experts migrated to the node that does not hold them
  (``Plan(..., migrate=((e, n), ...))``: that node's tokens routed to ``e`` are computed there on a copy of
  ``e``'s weights, which travel instead of the tokens), on both routings: where migration wins and loses;
  ``hot_pipelined``: the same pairs with ``pipelined`` for the tokens that still travel;
* ``model``: ``hierarchical`` with the cost model's migration (`overlap.plans.migration.choose_migration`
  given this routing's loads per node and expert); empty where the model says not to migrate;
* ``pick``: the tuner's (`overlap.tune.search.tune` with the rate's profile: what ``overlap tune`` writes),
  tuned for the case's routing (``overlap tune --routing``: its pairs per node and expert as the shares; the
  plan file keeps the last routing's pick, as a plan file has no routing).

Imports torch and overlap only inside the functions: the parent imports this module too.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

from bench.emulated_cluster.figures import FIGURE_RATES

#: the rates of a MoE figures run
MOE_RATES = FIGURE_RATES
#: ``moe`` problem fields (`overlap.plans.Problem`): T=256 tokens per rank, H=256, F=256, 8 experts, top-2, fp32.
#: A token row is 1 KiB, an expert's weights (w1 and w2) 512 KiB. Balanced, half of a rank's 512 pairs name an
#: expert on the other node: ~1 MiB per transfer (dispatch, combine) crosses the link, half each way, ~40 ms at
#: 100 Mbit/s against GEMMs of a few ms per rank: the link rules there, the GEMMs at 10 Gbit/s.
MOE_SHAPE = {"m": 256, "k": 256, "n": 256, "experts": 8, "top_k": 2}
ROUTINGS = ("balanced", "skewed")
#: one hot expert per node at 2 x 2 (rank r holds experts 2r, 2r+1): expert 0 on node 0, expert 4 on node 1
HOT_EXPERTS = (0, 4)
#: a hot expert's weight in the draw against 1 for the others (~3/4 of the pairs on the hot experts)
HOT_WEIGHT = 12.0
ROUTING_SEED = 7
#: the columns of a case, in table order, and their names in the table's verdicts
COLUMNS = ("reference", "pipelined", "hierarchical", "hot", "hot_pipelined", "model", "pick")
NAMES = {"hot": "hot hier.", "hot_pipelined": "hot pipel.", "model": "model's", "pick": "tuner's pick"}
#: the columns that do not migrate and those that do (the tuner's pick may be either: left out)
STAY, MOVE = ("reference", "pipelined", "hierarchical"), ("hot", "hot_pipelined", "model")
#: migration wins or loses where the fastest of one side beats the other's by more than this share, else a tie
#: (the noise of a median of 10 calls on the loaded 2-core machine is about this large)
TIE = 0.10


def moe_problems() -> list[dict[str, Any]]:
    """The ``moe`` problem at `MOE_SHAPE`, forward and forward+backward."""
    return [{"op": "moe", **MOE_SHAPE, "backward": bw} for bw in (False, True)]


def routing(kind: str, tokens: int, experts: int, top_k: int, rank: int, seed: int = ROUTING_SEED,
            hot: tuple[int, ...] = HOT_EXPERTS, hot_weight: float = HOT_WEIGHT):
    """``(topk_idx [T, K] int64, topk_weights [T, K] fp32)`` of `rank` for routing `kind` (``balanced`` or
    ``skewed``): each token's experts drawn without replacement in proportion to a weight per expert (1, or
    `hot_weight` for `hot` in ``skewed``; Gumbel top-k), its weights the softmax of normal logits. A function
    of the arguments alone (its own generator)."""
    import torch

    if kind not in ROUTINGS:
        raise ValueError(f"routing: kind in {ROUTINGS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    weight = torch.ones(experts)
    if kind == "skewed":
        weight[list(hot)] = hot_weight
    gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen).clamp_min(1e-12)))
    idx = torch.topk(weight.log() + gumbel, top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    return idx, weights


def loads(idx_per_rank: list, experts: int, ranks_per_node: int) -> list[list[int]]:
    """Pairs per (node, expert): ``loads[n][e]`` pairs of node `n`'s tokens routed to expert `e` (nodes of
    `ranks_per_node` consecutive ranks)."""
    nodes = len(idx_per_rank) // ranks_per_node
    out = [[0] * experts for _ in range(nodes)]
    for r, idx in enumerate(idx_per_rank):
        for e in idx.reshape(-1).tolist():
            out[r // ranks_per_node][e] += 1
    return out


def hot_pairs(hot: tuple[int, ...], experts: int, world_size: int, ranks_per_node: int) -> tuple[tuple[int, int], ...]:
    """Migration pairs ``(expert, node)``: every hot expert to every node that does not hold it."""
    per_rank = experts // world_size
    nodes = world_size // ranks_per_node
    return tuple(sorted((e, n) for e in hot for n in range(nodes) if (e // per_rank) // ranks_per_node != n))


def model_loads(idx_per_rank: list, where: Any, experts: int) -> Any:
    """The routing's exact loads as the migration model reads them (``loads[e][m]``,
    `overlap.plans.migration.measured_loads`); None where this version of overlap has no migration model."""
    try:
        from overlap.plans.migration import measured_loads
    except ImportError:
        return None
    return measured_loads(idx_per_rank, where, experts)


def model_migration(problem: Any, profile: Any, where: Any, exact: Any) -> tuple | None:
    """The cost model's migration pairs for the loads `exact` (`model_loads`) on the group `where` (its
    `GroupInfo`): `overlap.plans.migration.choose_migration`; ``()`` where it says not to migrate; None where
    this version of overlap has no migration model."""
    if exact is None:
        return None
    from overlap.plans.migration import choose_migration

    return tuple(sorted((int(e), int(n)) for e, n in choose_migration(problem, profile, where, loads=exact)))


# ----------------------------------------------------------------------------------------------
# On the ranks
# ----------------------------------------------------------------------------------------------


def run_moe_figures(cfg: Any, spec: dict, rank: int, world_size: int, profile: Any) -> tuple[list[dict], Any]:
    """On every rank: every MoE problem of `cfg` on every routing; rank 0's return value is the record (and the
    tuner's plan file, as ``overlap tune`` writes it)."""
    import torch.distributed as dist

    from bench.emulated_cluster.figures import call_bytes, placement, tuned
    from overlap.plans import Plan, Problem, rank_candidates

    info, topology, leader, dev = placement(spec, rank, world_size)
    rpn, links = cfg.ranks_per_node, tuple(c for c, _ in topology.links)
    out, plan_file = [], None
    for fields in cfg.problems:
        p = Problem(**fields)
        ranked = [(plan, pred) for plan, pred in rank_candidates(p, topology, profile) if not plan.migrate]
        best = {}
        for plan, _ in ranked:
            best.setdefault(plan.strategy, plan)
        hier = best["hierarchical"]
        for kind in ROUTINGS:
            every = [routing(kind, p.m, p.experts, p.top_k, r) for r in range(world_size)]
            node_loads = loads([idx for idx, _ in every], p.experts, rpn)
            exact = model_loads([idx for idx, _ in every], info, p.experts)
            shares = tuple(tuple(node_loads[n][e] for n in range(len(node_loads))) for e in range(p.experts))
            plan_file, outcomes = tuned(cfg, p, profile, plan_file, shares)
            chosen = model_migration(p, profile, info, exact)
            hot = hot_pairs(HOT_EXPERTS, p.experts, world_size, rpn)
            plans = {"reference": Plan("reference"), "pipelined": best["pipelined"], "hierarchical": hier,
                     "hot": Plan("hierarchical", hier.num_chunks, migrate=hot),
                     "hot_pipelined": Plan("pipelined", best["pipelined"].num_chunks, migrate=hot),
                     "model": _model_plan(p, (best["pipelined"], hier), chosen, topology, profile, exact),
                     "pick": outcomes[0].chosen.plan}
            plans = {k: v for k, v in plans.items() if v is not None}
            first = {}  # a plan that two columns share (the pick is often one of the others) is timed once
            for label, plan in plans.items():
                first.setdefault(plan.describe(), label)
            fns = {label: _layer(p, every[rank], plans[label], info, cfg.timeout_s) for label in first.values()}
            timed = _time(fns, 2 * cfg.tune_repeats, cfg.warmup)  # twice the tuner's calls: timing noise is large
            counted = {label: (0, 0) if timed[label]["error"] else call_bytes(fn, leader, dev)
                       for label, fn in fns.items()}
            record = {"problem": fields, "key": p.key, "routing": kind, "loads": node_loads,
                      "model_migrate": None if chosen is None else [list(x) for x in chosen], "rows": {}}
            for label, plan in plans.items():
                same = first[plan.describe()]
                record["rows"][label] = {"plan": plan.describe(), "strategy": plan.strategy, "label": plan.label(links),
                                         "migrate": [list(x) for x in plan.migrate], **timed[same],
                                         "same_as": same if same != label else "",
                                         "predicted_s": _predicted(p, plan, topology, profile, exact),
                                         "payload_bytes": counted[same][0], "veth_bytes": counted[same][1]}
            if rank == 0:
                ms = {k: f"{v['measured_s'] * 1e3:.1f}" for k, v in record["rows"].items()}
                print(f"{spec['rate']} {p.key} {kind}: {ms}; model migrates {record['model_migrate']}; "
                      f"pick {outcomes[0].chosen.plan.describe()}", flush=True)
            out.append(record)
            dist.barrier()
    return out, (plan_file.to_json() if plan_file is not None else None)


def _model_plan(problem: Any, bases: tuple, chosen: tuple | None, topology: Any, profile: Any, exact: Any):
    """The model's migration on the token strategy it predicts faster with it for these loads (of `bases`:
    the best ``pipelined`` and ``hierarchical`` plans; ``hierarchical`` where it cannot tell); None where the
    model migrates nothing."""
    import dataclasses

    if not chosen:
        return None
    plans = [dataclasses.replace(b, migrate=chosen) for b in bases]
    times = [_predicted(problem, plan, topology, profile, exact) for plan in plans]
    return min(zip(times, plans, strict=True), key=lambda tp: tp[0])[1] if all(x == x for x in times) else plans[-1]


def _predicted(problem: Any, plan: Any, topology: Any, profile: Any, exact: Any) -> float:
    """The cost model's time for `plan` (for this routing's loads where the model takes them); nan where it has
    none (a migrating plan before the model knew migration)."""
    from overlap.plans import predict

    try:
        if exact is not None:
            return predict(problem, plan, topology, profile, loads=exact).total_s
        return math.nan if plan.migrate else predict(problem, plan, topology, profile).total_s
    except (ValueError, NotImplementedError, TypeError):
        return math.nan


def _layer(problem: Any, routed: tuple, plan: Any, info: Any, timeout: float):
    """``fn()``: one call of the MoE layer with `plan` on this rank's routing (and its backward for a forward+
    backward problem); returns the output and the gradients of ``x``, ``w1``, ``w2``, ``topk_weights``."""
    import torch

    import overlap
    from overlap.workloads import SeededDraw

    T, H, F, E = problem.m, problem.k, problem.n, problem.experts
    L = E // info.world_size
    draw = SeededDraw(1234, info.rank, info.device, problem.torch_dtype)
    x = draw.normal("x", T, H)
    w1 = draw.normal("w1", L * H, F, scale=H**-0.5).view(L, H, F)
    w2 = draw.normal("w2", L * F, H, scale=F**-0.5).view(L, F, H)
    idx, wt = routed
    g = draw.normal("grad_out", T, H) if problem.backward else None
    leaves = [x, w1, w2, wt.clone()]
    if problem.backward:
        leaves = [t.detach().requires_grad_(True) for t in leaves]
    x, w1, w2, wt = leaves

    def fn() -> list:
        for t in leaves:
            t.grad = None
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, plan=plan, timeout=timeout)
        y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h), w2, wt, handle, plan=plan,
                                               timeout=timeout)
        if not problem.backward:
            return [y]
        y.backward(g)
        return [y.detach()] + [t.grad for t in leaves]

    return fn


def _differs(got: list, want: list) -> str:
    import torch

    for name, a, b in zip(("out", "grad_x", "grad_w1", "grad_w2", "grad_topk_weights"), got, want, strict=False):
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        try:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale)
        except AssertionError as exc:
            return f"{name} differs from reference: {str(exc).splitlines()[0]}"
    return ""


def _time(fns: dict, repeats: int, warmup: int) -> dict[str, dict[str, Any]]:
    """Each fn checked against ``reference``'s result (the first), warmed up, then timed in interleaved rounds
    (a barrier before every call); ``{label: {measured_s, spread_s, error}}``, the slowest rank's medians."""
    import time

    import torch
    import torch.distributed as dist

    labels = list(fns)
    want = fns[labels[0]]()
    errors = {labels[0]: ""}
    for label in labels[1:]:
        try:
            errors[label] = _differs(fns[label](), want)
        except Exception as exc:  # noqa: BLE001 - a plan that fails is reported in its row, the others go on
            errors[label] = f"{type(exc).__name__}: {exc}"
    ok = torch.tensor([0.0 if errors[k] else 1.0 for k in labels])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # a plan wrong on any rank is dropped on every rank
    live = [k for k, good in zip(labels, ok.tolist(), strict=True) if good]
    for label in live:
        for _ in range(warmup):
            fns[label]()
    times = {k: [] for k in live}
    for _ in range(repeats):
        for label in live:
            dist.barrier()
            start = time.perf_counter()
            fns[label]()
            times[label].append(time.perf_counter() - start)
    def row(x: list[float]) -> list[float]:  # the median, the spread, the medians of even and odd rounds
        return [statistics.median(x), max(x) - min(x), statistics.median(x[0::2]), statistics.median(x[1::2] or x)]

    stats = torch.tensor([row(times[k]) if k in times else [math.inf, 0.0, math.inf, math.inf] for k in labels],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {k: {"measured_s": s[0], "spread_s": s[1], "halves_s": s[2:],
                "error": errors[k] or ("" if k in times else "wrong on another rank")}
            for k, s in zip(labels, stats.tolist(), strict=True)}


def self_noise(row: dict[str, Any]) -> float:
    """A plan timed against itself: its even rounds' median over its odd rounds' (the larger over the smaller,
    - 1): how far two medians of the same plan lie apart at this load (of half as many calls as a column's)."""
    a, b = row.get("halves_s") or (math.nan, math.nan)
    return max(a, b) / min(a, b) - 1 if min(a, b) > 0 else math.nan


# ----------------------------------------------------------------------------------------------
# The table (parent side, pure Python)
# ----------------------------------------------------------------------------------------------


def _ms(row: dict | None) -> str:
    if row is None:
        return "-"
    return "failed" if row.get("error") else f"{row['measured_s'] * 1e3:.1f}"


def _kib(row: dict | None, key: str) -> str:
    return "-" if row is None or not row[key] else f"{row[key] / 1024:.0f}"


def _pairs(pairs: list) -> str:
    return "+".join(f"{e}@{n}" for e, n in pairs)


def summarize_case(rec: dict[str, Any]) -> dict[str, Any]:
    """One case's verdict: the hot experts' share of the pairs; ``hot_speedup``, ``hierarchical`` over its hot
    migration (like for like); ``migration_speedup``, the fastest plan that does not migrate (`STAY`) over the
    fastest that does (`MOVE`): migration ``wins`` or ``loses`` by more than `TIE`, else a ``tie``; and whether
    the model chose right: it migrated where migration wins, did not where it loses (None on a tie, or where
    overlap has no migration model)."""
    rows = rec["rows"]
    t = {k: v["measured_s"] for k, v in rows.items() if not v.get("error")}
    total = sum(sum(n) for n in rec["loads"])
    hot = sum(n[e] for n in rec["loads"] for e in HOT_EXPERTS) / total if total else math.nan
    own = {k: v for k, v in t.items() if not rows[k].get("same_as")}  # a column timed once
    stay, move = [t[k] for k in STAY if k in t], [t[k] for k in MOVE if k in t]
    speed = min(stay) / min(move) if stay and move else math.nan
    verdict = "wins" if speed > 1 + TIE else "loses" if speed < 1 - TIE else "tie" if speed == speed else ""
    out = {"rate": None, "key": rec["key"], "routing": rec["routing"], "hot_share": hot,
           "fastest": min(own, key=own.get) if own else "",
           "hot_speedup": t["hierarchical"] / t["hot"] if "hot" in t and "hierarchical" in t else math.nan,
           "migration_speedup": speed, "migration": verdict,
           "model_migrate": rec.get("model_migrate"), "model_right": None}
    if rec.get("model_migrate") is not None and verdict in ("wins", "loses"):
        out["model_right"] = bool(rec["model_migrate"]) == (verdict == "wins")
    return out


def summarize_moe(raw: dict[str, Any]) -> dict[str, Any]:
    """Per rate: every case's verdict (`summarize_case`) and the machine's load around the run."""
    cases = []
    for rec in raw["moe_figures"]:
        case = summarize_case(rec)
        case["rate"] = raw["rate"]
        cases.append(case)
    return {"rate": raw["rate"], "cases": cases, "load": raw.get("load"), "pid": os.getpid()}


def format_moe_figures(raws: list[dict[str, Any]]) -> str:
    """One markdown table over every rate: times per column, migration's verdict, bytes per call."""
    head = ("| rate | routing (hot share) | mode | reference ms | pipelined ms | hierarchical ms "
            "| migrate hot ms hier. / pipel. | migration | fastest | model's migration (ms) | model right? "
            "| tuner's pick (ms) | payload KiB pipel. / hier. / hot hier. / hot pipel. "
            "| veth KiB ref. / pipel. / hier. / hot hier. |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for raw in raws:
        for rec in raw["moe_figures"]:
            r, case = rec["rows"], summarize_case(rec)
            mode = "fwd+bwd" if rec["problem"].get("backward") else "fwd"
            model = rec.get("model_migrate")
            if model is None:
                model_cell, right = "n/a", "-"
            else:
                base = r["model"]["strategy"] + " " if model and "model" in r else ""
                model_cell = f"{base}{_pairs(model)} ({_ms(r.get('model'))})" if model else "none"
                right = {True: "yes", False: "no", None: "(tie)"}[case["model_right"]]
            pay = " / ".join(_kib(r.get(k), "payload_bytes") for k in ("pipelined", "hierarchical", "hot",
                                                                        "hot_pipelined"))
            veth = " / ".join(_kib(r.get(k), "veth_bytes") for k in ("reference", "pipelined", "hierarchical", "hot"))
            lines.append(
                f"| {raw['rate']} | {rec['routing']} ({case['hot_share'] * 100:.0f}%) | {mode} | "
                f"{_ms(r['reference'])} | {_ms(r.get('pipelined'))} | {_ms(r.get('hierarchical'))} | "
                f"{_ms(r.get('hot'))} / {_ms(r.get('hot_pipelined'))} | "
                f"{case['migration']} {case['migration_speedup']:.2f}x | "
                f"{NAMES.get(case['fastest'], case['fastest'])} | "
                f"{model_cell} | {right} | "
                f"{r['pick']['label']} ({_ms(r['pick'])}) | {pay} | {veth} |")
    noise = [self_noise(r) for raw in raws for rec in raw["moe_figures"] for k, r in rec["rows"].items()
             if not r.get("same_as") and not r.get("error")]
    noise = [x for x in noise if math.isfinite(x)]
    if noise:
        lines.append(f"\nnoise: each plan's median of its even calls against its odd calls' differs by "
                     f"{statistics.median(noise) * 100:.0f}% (median), {max(noise) * 100:.0f}% (max)")
    loads = [f"{raw['rate']} {raw['load'][0]:.1f} -> {raw['load'][1]:.1f}" for raw in raws if raw.get("load")]
    if loads:
        lines.append(f"\nload (1 min) around each rate's run on {os.cpu_count()} cores: {', '.join(loads)}")
    return "\n".join(lines)
