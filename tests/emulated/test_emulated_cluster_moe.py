"""The MoE figures of the emulated cluster (`python -m bench.emulated_cluster --moe-figures`,
`bench.emulated_cluster.moe`).

The pure parts run everywhere: the routings (deterministic, balanced or a few hot experts), the loads per node
and expert, the forced migration pairs, the verdicts and the table on recorded numbers. One run of 2 nodes x 2
ranks at 1 Gbit/s at a small shape (root and iproute2; skipped otherwise, ~30 s on 2 cores) checks every column
against ``reference`` and asserts bytes only, never a timing.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
from pathlib import Path

import pytest

from bench import emulated_cluster as ec
from bench.emulated_cluster import __main__ as cli
from bench.emulated_cluster import moe


@pytest.mark.exact
def test_routings_are_deterministic_and_skewed_where_asked():
    T, E, K = 256, 8, 2
    for kind in moe.ROUTINGS:
        idx, wt = moe.routing(kind, T, E, K, rank=1)
        again, wt_again = moe.routing(kind, T, E, K, rank=1)
        assert idx.equal(again) and wt.equal(wt_again), kind  # the same in every plan's run
        assert not idx.equal(moe.routing(kind, T, E, K, rank=2)[0]), kind  # each rank its own tokens
        assert idx.shape == (T, K) and all(len(set(row)) == K for row in idx.tolist()), kind  # distinct experts
        assert 0 <= int(idx.min()) and int(idx.max()) < E, kind
        assert wt.shape == (T, K) and math.isclose(float(wt.sum()), T, rel_tol=1e-5), kind
    every = {kind: [moe.routing(kind, T, E, K, r)[0] for r in range(4)] for kind in moe.ROUTINGS}
    share = {}
    for kind, idx in every.items():
        node_loads = moe.loads(idx, E, ranks_per_node=2)
        assert [sum(n) for n in node_loads] == [2 * T * K] * 2, node_loads
        share[kind] = sum(n[e] for n in node_loads for e in moe.HOT_EXPERTS) / (4 * T * K)
    assert 0.2 < share["balanced"] < 0.3, share  # 2 of 8 experts: a quarter of the pairs
    assert share["skewed"] > 0.65, share  # a few hot experts take most pairs
    with pytest.raises(ValueError, match="routing"):
        moe.routing("zipf", T, E, K, rank=0)


def test_loads_count_pairs_per_node_and_expert():
    import torch

    idx = [torch.tensor([[0, 1]]), torch.tensor([[0, 3]]), torch.tensor([[2, 3]]), torch.tensor([[3, 0]])]
    assert moe.loads(idx, 4, ranks_per_node=2) == [[2, 1, 0, 1], [1, 0, 1, 2]]
    assert moe.loads(idx, 4, ranks_per_node=1) == [[1, 1, 0, 0], [1, 0, 0, 1], [0, 0, 1, 1], [1, 0, 0, 1]]


def test_hot_pairs_send_each_hot_expert_to_the_nodes_without_it():
    assert moe.hot_pairs((0, 4), 8, 4, 2) == ((0, 1), (4, 0))  # expert 0 lives on node 0, expert 4 on node 1
    assert moe.hot_pairs((0, 1), 8, 4, 2) == ((0, 1), (1, 1))
    assert moe.hot_pairs((0,), 8, 8, 2) == ((0, 1), (0, 2), (0, 3))


def test_the_models_migration_for_the_figures_routings_from_recorded_profiles():
    """The figures' problem and routings, the recorded emulated profiles (`tests/emulated/data/emulated_profiles.json`),
    2 nodes x 2 ranks: the model migrates the hot experts only on the skewed routing at 100 Mbit/s (forward and
    forward+backward: each node's hot expert to the other node, relieving both directions of the link); never on
    the balanced one or at 2 Gbit/s."""
    import json

    from overlap.plans import Problem, Profile

    profiles = json.loads((Path(__file__).resolve().parent / "data" / "emulated_profiles.json").read_text())
    nodes = ((0, 1), (2, 3))
    for rate, recorded in profiles.items():
        for fields in moe.moe_problems():
            p = Problem(**fields)
            for kind in moe.ROUTINGS:
                idx = [moe.routing(kind, p.m, p.experts, p.top_k, r)[0] for r in range(4)]
                chosen = moe.model_migration(p, Profile.from_json(recorded), nodes, moe.model_loads(idx, nodes, 8))
                want = ((0, 1), (4, 0)) if (rate, kind) == ("100mbit", "skewed") else ()
                assert chosen == want, (rate, p.key, kind, chosen)


def _row(ms: float, payload: int = 0, veth: int = 0, label: str = "x", error: str = "") -> dict:
    return {"measured_s": ms / 1e3, "spread_s": 0.0, "error": error, "label": label, "payload_bytes": payload,
            "veth_bytes": veth, "strategy": label.split(" ")[0] if label != "x" else "hierarchical"}


def _record(routing: str, hot_ms: float, model: list | None, model_ms: float | None = None,
            backward: bool = False) -> dict:
    loads = [[300, 40, 40, 40, 300, 40, 40, 24], [300, 40, 40, 40, 300, 40, 40, 24]]
    rows = {"reference": _row(150.0, 0, 3_000_000, "reference"), "pipelined": _row(120.0, 2_121_728, 2_150_000),
            "hierarchical": _row(100.0, 1_867_776, 1_900_000), "hot": _row(hot_ms, 1_200_000, 1_250_000),
            "hot_pipelined": _row(hot_ms + 10, 1_400_000, 1_450_000),
            "pick": {**_row(100.0, 1_867_776, 1_900_000, "hierarchical (shm x1, network x2)"),
                     "same_as": "hierarchical"}}
    if model:
        rows["model"] = _row(model_ms, 1_300_000, 1_350_000)
    return {"problem": {"op": "moe", **moe.MOE_SHAPE, "backward": backward}, "key": "k", "routing": routing,
            "loads": loads, "model_migrate": model, "rows": rows}


def test_verdicts_where_migration_wins_and_loses_and_whether_the_model_chose_right():
    # the plans that stay: reference 150, pipelined 120, hierarchical 100 ms; hot pipelined = hot hier. + 10 ms
    won = moe.summarize_case(_record("skewed", 80.0, []))  # hot experts migrated: 100 / 80 ms
    assert math.isclose(won["hot_speedup"], 1.25) and math.isclose(won["migration_speedup"], 1.25)
    assert won["migration"] == "wins" and won["model_right"] is False  # the model said no: wrong
    assert won["fastest"] == "hot" and math.isclose(won["hot_share"], 1200 / 1648)
    lost = moe.summarize_case(_record("balanced", 125.0, []))
    assert lost["migration"] == "loses" and math.isclose(lost["migration_speedup"], 0.8)
    assert lost["model_right"] is True  # no, and migrating lost
    chose = moe.summarize_case(_record("skewed", 80.0, [[0, 1], [4, 0]], model_ms=90.0))
    assert chose["migration"] == "wins" and chose["model_right"] is True
    bad = moe.summarize_case(_record("skewed", 130.0, [[0, 1]], model_ms=120.0))  # the model's own plan: 100 / 120
    assert bad["migration"] == "loses" and bad["model_right"] is False and bad["fastest"] == "hierarchical"
    tie = moe.summarize_case(_record("skewed", 95.0, []))  # 100 / 95: within TIE
    assert tie["migration"] == "tie" and tie["model_right"] is None
    absent = moe.summarize_case(_record("skewed", 80.0, None))  # no migration model in this overlap
    assert absent["migration"] == "wins" and absent["model_right"] is None


def test_the_table_on_recorded_numbers():
    raws = [{"rate": "100mbit", "load": [3.0, 4.5], "moe_figures": [
        _record("balanced", 125.0, []), _record("skewed", 80.0, [[0, 1], [4, 0]], model_ms=90.0, backward=True),
        _record("skewed", 80.0, None)]}]
    table = moe.format_moe_figures(raws)
    lines = table.splitlines()
    assert lines[0].startswith("| rate | routing (hot share) | mode |") and lines[1].startswith("|---|")
    assert lines[0].count("|") == lines[2].count("|") == lines[3].count("|") == lines[4].count("|"), table
    assert ("| 100mbit | balanced (73%) | fwd | 150.0 | 120.0 | 100.0 | 125.0 / 135.0 | loses 0.80x | hierarchical "
            "| none | yes |") in lines[2], lines[2]
    assert "| skewed (73%) | fwd+bwd |" in lines[3], lines[3]
    assert "| wins 1.25x | hot hier. | hierarchical 0@1+4@0 (90.0) | yes |" in lines[3], lines[3]
    assert "| wins 1.25x | hot hier. | n/a | - |" in lines[4], lines[4]
    assert "| 2072 / 1824 / 1172 / 1367 | 2930 / 2100 / 1855 / 1221 |" in lines[2], lines[2]
    assert "load (1 min)" in table and "100mbit 3.0 -> 4.5" in table
    assert "noise" not in table  # rows recorded without their halves
    raws[0]["moe_figures"][0]["rows"]["reference"]["halves_s"] = [0.100, 0.125]
    assert "differs by 25% (median), 25% (max)" in moe.format_moe_figures(raws)
    failed = _record("skewed", 80.0, [])
    failed["rows"]["hot"]["error"] = "differs from reference"
    assert "| tie 1.05x | hot hier. | none | (tie) |" in moe.format_moe_figures(
        [{"rate": "1gbit", "moe_figures": [_record("skewed", 95.0, [])]}])
    assert "| failed / 90.0 | wins 1.11x |" in moe.format_moe_figures([{"rate": "1gbit", "moe_figures": [failed]}])
    s = moe.summarize_moe(raws[0])
    assert [c["rate"] for c in s["cases"]] == ["100mbit"] * 3


def test_command_line_and_config():
    cfg, _, _, _ = cli._parse(["--moe-figures", "--quiet"])
    assert cfg.moe_figures and not cfg.figures and cfg.rates == moe.MOE_RATES
    assert [p["backward"] for p in cfg.problems] == [False, True] and cfg.problems[0]["op"] == "moe"
    with pytest.raises(SystemExit):
        cli._parse(["--plans", "d"])
    with pytest.raises(ValueError, match="one at a time"):
        ec.Config(figures=True, moe_figures=True)
    with pytest.raises(ValueError, match="figures need 2 ranks per node"):
        ec.Config(moe_figures=True, ranks_per_node=1, problems=tuple(moe.moe_problems()))


# ----------------------------------------------------------------------------------------------
# A run over the veth pair (root)
# ----------------------------------------------------------------------------------------------


def _our_namespaces(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"ovl-{pid}-")]


@pytest.mark.exact
def test_moe_figures_over_the_veth_pair():
    """2 nodes x 2 ranks at 1 Gbit/s, one timed call per plan, both routings, forward and forward+backward:
    every column agrees with ``reference`` (output and gradients); ``hierarchical`` posts fewer payload bytes
    than ``pipelined`` (a token crosses once per node); the wire carries at least the payload. Where overlap
    has its migration runtime the hot experts' plan moves other bytes than plain ``hierarchical``."""
    reason = ec.probe_emulation()
    if reason is not None:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    problems = tuple({"op": "moe", "m": 32, "k": 32, "n": 32, "experts": 8, "top_k": 2, "backward": bw}
                     for bw in (False, True))
    cfg = ec.Config(rates=("1gbit",), ranks_per_node=2, moe_figures=True, problems=problems, measure=1,
                    tune_repeats=1, warmup=0, repeats=1, symm_check=False, verbose=False, timeout_s=60,
                    deadline_s=240)
    raw = ec.run(cfg)[0]["raw"]
    assert [(r["routing"], r["problem"]["backward"]) for r in raw["moe_figures"]] == [
        (k, bw) for bw in (False, True) for k in moe.ROUTINGS]
    migrating = importlib.util.find_spec("overlap.ops.moe.migration") is not None
    for rec in raw["moe_figures"]:
        rows, case = rec["rows"], (rec["routing"], rec["problem"]["backward"])
        assert not any(r["error"] for r in rows.values()), (case, rows)
        assert 0 < rows["hierarchical"]["payload_bytes"] < rows["pipelined"]["payload_bytes"], (case, rows)
        for label in ("pipelined", "hierarchical", "hot", "hot_pipelined"):
            assert rows[label]["veth_bytes"] >= rows[label]["payload_bytes"], (case, label, rows[label])
        assert rows["hot"]["migrate"] == rows["hot_pipelined"]["migrate"] == [[0, 1], [4, 0]], rows["hot"]
        if migrating:
            assert rows["hot"]["payload_bytes"] != rows["hierarchical"]["payload_bytes"], (case, rows)
            assert rows["hot_pipelined"]["payload_bytes"] != rows["pipelined"]["payload_bytes"], (case, rows)
    assert "| 1gbit | skewed" in moe.format_moe_figures([raw])
    assert _our_namespaces(os.getpid()) == []
