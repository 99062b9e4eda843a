"""The figures of the ``hierarchical`` strategy on the emulated cluster
(``python -m bench.emulated_cluster --figures``).

On 2 nodes x 2 ranks, per rate (default 100 Mbit/s, 1 Gbit/s, 10 Gbit/s): for each tensor-parallel op with a
``hierarchical`` strategy (the op table's), forward and forward+backward, at one shape (`FIGURE_SHAPE`): the
tuner's pick (`overlap.tune.search.tune` with the rate's probed profile: the model's best plans and
``reference`` measured, the fastest kept: what ``overlap tune`` writes in a plan file), then ``reference``,
the model's best ``pipelined`` and ``hierarchical`` plans and that pick timed side by side
(`overlap.tune.search.measure`: interleaved, checked against ``reference``, the slowest rank's median), then
one more call of each with its network bytes counted:

* **payload**: the bytes the ranks posted point-to-point to the other node in that call, summed over the ranks,
  as the transfer layer counts them (`overlap.comm.network_bytes_sent`). Plain collectives (``reference``, and
  ``pipelined``'s all-reduce pieces) are the backend's own algorithm and not counted: shown as ``-``.
* **veth**: the bytes the two veth ends transmitted during the call (``/sys/class/net/<dev>/statistics/tx_bytes``
  read in each node's namespace, both directions summed), less what two barriers alone transmit: the
  payload plus TCP/IP headers, acknowledgements and the per-call signature handshake.

Imports torch and overlap only inside the functions: the parent imports this module too.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

#: the rates of a figures run
FIGURE_RATES = ("100mbit", "1gbit", "10gbit")
#: per rank ``m x k x n`` (`overlap.plans.Problem`): a 256 KiB fp32 block, shard or partial per rank to move, GEMMs of a
#: few ms on one core: the link is the bottleneck at 100 Mbit/s, the GEMMs at 10 Gbit/s
FIGURE_SHAPE = {"m": 256, "k": 256, "n": 256}


def figure_problems() -> list[dict[str, Any]]:
    """Every TP op of the op table with a ``hierarchical`` strategy, forward and forward+backward."""
    from overlap.plans import OPS

    return [{"op": name, **FIGURE_SHAPE, "backward": bw} for name, spec in OPS.items()
            if spec.family == "tp" and "hierarchical" in spec.strategies for bw in (False, True)]


def placement(spec: dict, rank: int, world_size: int) -> tuple[Any, Any, bool, str]:
    """On a rank: ``(group info, topology, whether it reads its node's veth, that veth's name)``."""
    from overlap import world
    from overlap.plans import topology_of

    info = world.group_info()
    node = info.nodes[rank]
    leader = rank == min(r for r in range(world_size) if info.nodes[r] == node)
    return info, topology_of(info), leader, spec["link"]["dev"]["ab".index(node)] if node in "ab" else ""


def tuned(cfg: Any, problem: Any, profile: Any, plan_file: Any, routing: Any = None) -> tuple[Any, list]:
    """``overlap tune``'s work for one problem (its plan file entry added to `plan_file`, or a new plan file where
    it is None) and its outcomes; `routing`: a MoE problem's (``overlap tune --routing``), where the tuner takes
    one."""
    import inspect

    from overlap.tune.search import tune

    given = {"routing": routing} if routing is not None and "routing" in inspect.signature(tune).parameters else {}
    pf, outcomes = tune([problem], profile=profile, measure=cfg.measure, repeats=cfg.tune_repeats, warmup=cfg.warmup,
                        **given)
    if plan_file is None:
        return pf, outcomes
    for entry in pf.entries.values():
        plan_file.add(entry)
    return plan_file, outcomes


def run_figures(cfg: Any, spec: dict, rank: int, world_size: int, profile: Any) -> tuple[list[dict[str, Any]], Any]:
    """On every rank: the figures of every problem of `cfg` and the plan file the tuner wrote for them (its
    JSON: what ``overlap tune`` writes; rank 0's return value is the record)."""
    import torch.distributed as dist

    from overlap.plans import Plan, Problem, rank_candidates
    from overlap.tune.search import measure

    info, topology, leader, dev = placement(spec, rank, world_size)
    out, plan_file = [], None
    for fields in cfg.problems:
        p = Problem(**fields)
        plan_file, outcomes = tuned(cfg, p, profile, plan_file)
        pick = outcomes[0].chosen.plan
        ranked = rank_candidates(p, topology, profile)
        best = {}
        for plan, pred in ranked:
            best.setdefault(plan.strategy, (plan, pred.total_s))
        rows = {"reference": Plan("reference"), "pipelined": best["pipelined"][0],
                "hierarchical": best["hierarchical"][0], "pick": pick}
        trials = measure(p, list(rows.values()), repeats=cfg.tune_repeats, warmup=cfg.warmup)
        record = {"problem": fields, "key": p.key, "rows": {}}
        for (label, plan), trial in zip(rows.items(), trials, strict=True):
            payload, veth = _bytes(p, plan, info, leader, dev, cfg.timeout_s)
            record["rows"][label] = {"plan": plan.describe(), "strategy": plan.strategy,
                                     "label": plan.label(tuple(c for c, _ in topology.links)),
                                     "measured_s": trial.measured_s, "error": trial.error,
                                     "predicted_s": next((x for q, x in ((q, pr.total_s) for q, pr in ranked)
                                                          if q == plan), float("nan")),
                                     "payload_bytes": payload, "veth_bytes": veth}
        if rank == 0:
            ms = {k: f"{v['measured_s'] * 1e3:.1f}" for k, v in record["rows"].items()}
            print(f"{spec['rate']} {p.key}: {ms} pick {pick.describe()}", flush=True)
        out.append(record)
        dist.barrier()
    return out, (plan_file.to_json() if plan_file is not None else None)


def _tx_bytes(dev: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())


def _bytes(problem: Any, plan: Any, info: Any, leader: bool, dev: str, timeout: float) -> tuple[int, int]:
    """``(payload, veth)`` bytes of one call of `plan`, summed over the ranks (see the module docstring)."""
    from overlap.workloads.trial import trial_call

    fn, _ = trial_call(problem, plan, None, info, timeout, seed=99)
    return call_bytes(fn, leader, dev)


def call_bytes(fn: Any, leader: bool, dev: str) -> tuple[int, int]:
    """``(payload, veth)`` bytes of one call of `fn` (a collective: every rank calls it), summed over the
    ranks: the transfer layer's count, and the veth ends' transmitted bytes (read by each node's `leader` on
    its end `dev`) less what two barriers alone transmit. A first call warms up unmeasured.

    Every read of the counters is fenced by barriers on both sides: a rank leaves a barrier while its node's
    leader may not have read the counters yet, so without the fence the call's first messages (another rank
    of the node that went ahead) could land in the barriers' window and be subtracted."""
    import torch
    import torch.distributed as dist

    from overlap import comm

    fn()  # warm: first-call set-up (node groups, heaps, gloo pairs) is not what a call costs

    def counters() -> list[int]:
        return [comm.network_bytes_sent(), _tx_bytes(dev) if leader and dev else 0]

    dist.barrier()
    c0 = counters()
    dist.barrier()
    dist.barrier()
    c1 = counters()
    dist.barrier()  # the fence: no rank's call starts before its leader read c1
    fn()
    dist.barrier()
    c2 = counters()
    total = torch.tensor([c2[0] - c1[0], (c2[1] - c1[1]) - (c1[1] - c0[1])], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total[0]), int(total[1])


# ----------------------------------------------------------------------------------------------
# The table (parent side)
# ----------------------------------------------------------------------------------------------


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}"


def format_figures(raws: list[dict[str, Any]]) -> str:
    """One markdown table over every rate: times, speedups, the pick, bytes per call."""
    head = ("| rate | op | mode | reference ms | pipelined ms | hierarchical ms | hier. vs pipel. | tuner's pick (ms) "
            "| payload KiB pipel. / hier. | veth KiB ref. / pipel. / hier. |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for raw in raws:
        for rec in raw["figures"]:
            r, fields = rec["rows"], rec["problem"]
            t = {k: v["measured_s"] for k, v in r.items()}
            speed = t["pipelined"] / t["hierarchical"] if t["hierarchical"] > 0 else float("nan")
            pay = " / ".join(_kib(r[k]["payload_bytes"]) if r[k]["payload_bytes"] else "-"
                             for k in ("pipelined", "hierarchical"))
            veth = " / ".join(_kib(r[k]["veth_bytes"]) for k in ("reference", "pipelined", "hierarchical"))
            mode = "fwd+bwd" if fields.get("backward") else "fwd"
            lines.append(f"| {raw['rate']} | {fields['op']} | {mode} | {t['reference'] * 1e3:.1f} | "
                         f"{t['pipelined'] * 1e3:.1f} | {t['hierarchical'] * 1e3:.1f} | {speed:.2f}x | "
                         f"{r['pick']['label']} ({t['pick'] * 1e3:.1f}) | {pay} | {veth} |")
    return "\n".join(lines)


def summarize_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """Per rate: the median over problems of hierarchical's speedup over pipelined (for the progress line)."""
    speedups = [rec["rows"]["pipelined"]["measured_s"] / rec["rows"]["hierarchical"]["measured_s"]
                for rec in raw["figures"]]
    return {"rate": raw["rate"], "median_hier_vs_pipelined": statistics.median(speedups) if speedups else None,
            "load": raw.get("load"), "pid": os.getpid()}
