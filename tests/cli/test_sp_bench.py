"""``overlap bench`` and ``overlap tune`` for the sequence-parallel ops (``matmul_all_to_all``, ``all_to_all_matmul``;
issue 63, part 3): the long-context presets and their cases (on request, not in the default run), every strategy the
ops implement checked against ``reference`` and the ``torch`` row on 2 ranks at tiny shapes, the report's rows, the
command line's shapes, and a tuned plan-file entry that ``auto`` takes. Deterministic asserts only (no timing)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from overlap.benchmarks.cases import (
    BENCH_OPS,
    DEFAULT_OPS,
    SP_OPS,
    BenchConfig,
    SpCase,
    default_cases,
    sp_preset_cases,
)
from overlap.benchmarks.models import LLAMA3_8B, SP_PRESETS, sp_problem, sp_problems
from overlap.benchmarks.names import bench_labels, strategy_labels
from overlap.plans import Plan, Problem
from overlap.plans.optable import OPS

# ---- presets and cases --------------------------------------------------------------------------------------------


def test_sp_presets_are_llama3_8b_attention_over_long_sequences():
    full = SP_PRESETS["llama3-8b-128k-full"][0]
    assert (full.hidden, full.heads, full.kv_heads, full.head_dim, full.tokens) == (4096, 32, 8, 128, 131072)
    assert LLAMA3_8B.hidden == 4096
    # the QKV side: m = tokens per rank, k = hidden, n = (32 + 8 + 8) * 128; the output side: k = 32 * 128, n = 4096
    assert sp_problems(full, 8) == [("qkv", "matmul_all_to_all", (16384, 4096, 6144)),
                                    ("attn-out", "all_to_all_matmul", (16384, 4096, 4096))]
    assert sp_problems(SP_PRESETS["llama3-8b-32k-full"][0], 8)[0][2] == (4096, 4096, 6144)
    cpu = SP_PRESETS["llama3-8b-32k"][0]  # widths at 1/16, tokens at 1/32
    assert (cpu.hidden, cpu.head_dim, cpu.heads, cpu.kv_heads, cpu.tokens) == (256, 8, 32, 8, 1024)
    assert sp_problems(cpu, 2) == [("qkv", "matmul_all_to_all", (512, 256, 384)),
                                   ("attn-out", "all_to_all_matmul", (512, 256, 256))]
    assert SP_PRESETS["llama3-8b-128k"][0].tokens == 4096
    for preset, (model, _) in SP_PRESETS.items():  # every dim divides by 1, 2, 4 and 8 ranks; not by 3
        for w in (1, 2, 4, 8):
            assert sp_problem(model, w) is None, (preset, w)
            for _, _, (m, k, n) in sp_problems(model, w):
                assert m * w == model.tokens and n % w == 0 and k % w == 0
        assert "heads (32), kv_heads (8)" in sp_problem(model, 3)
    with pytest.raises(ValueError, match="sequence-parallel size 3"):
        sp_problems(cpu, 3)


def test_sp_cases_are_on_request_with_the_strategies_the_ops_have():
    assert set(SP_OPS) == {"matmul_all_to_all", "all_to_all_matmul"} and set(SP_OPS) <= set(BENCH_OPS)
    assert not set(SP_OPS) & set(DEFAULT_OPS)  # on request: --op, or a preset of theirs in --shape
    assert not [c for c in default_cases(world_size=2) if c.op in SP_OPS]
    for op in SP_OPS:  # the op table's strategies (never hierarchical: not benchmarked), torch first, auto last
        labels = bench_labels(op)
        assert labels == ("torch", *strategy_labels(op), "auto") and "hierarchical" not in labels
        assert set(strategy_labels(op)) == set(OPS[op].strategies) - {"hierarchical"}
    for w in (1, 2, 4):
        cases = default_cases(SP_OPS, "cpu", world_size=w)
        assert [(c.op, c.layer, c.mode) for c in cases] == [
            ("matmul_all_to_all", "qkv", "fwd"), ("matmul_all_to_all", "qkv", "fwd+bwd"),
            ("all_to_all_matmul", "attn-out", "fwd"), ("all_to_all_matmul", "attn-out", "fwd+bwd")], cases
        assert all(isinstance(c, SpCase) and c.preset == "llama3-8b-32k" and c.sp == w and c.m == 1024 // w
                   and c.dtype == "float32" and not c.world_problem(w) for c in cases)
    case = default_cases("matmul_all_to_all", "cpu", world_size=2)[0]
    assert case.name == "matmul_all_to_all llama3-8b-32k/qkv:512x256x384 float32 fwd"
    assert case.comm_bytes(2) == 512 * 384 // 2 * 4  # one peer's block of this rank's product
    left_out: list[str] = []
    assert default_cases(SP_OPS, "cpu", world_size=3, left_out=left_out) == []
    assert left_out == ["llama3-8b-32k: heads (32), kv_heads (8), tokens (1024) do not divide by the "
                        "sequence-parallel size 3 (the ranks)"], left_out
    gpu = default_cases(SP_OPS, "cuda", world_size=8)
    assert {(c.preset, c.dtype, c.mode) for c in gpu} == {
        ("llama3-8b-32k-full", "bfloat16", "fwd"), ("llama3-8b-32k-full", "bfloat16", "fwd+bwd"),
        ("llama3-8b-128k-full", "bfloat16", "fwd")}
    # an fp8 dtype leaves them out with the reason (no fp8 recipe in the family)
    left_out = []
    assert default_cases(SP_OPS, "cpu", "float8_e4m3fn", world_size=2, left_out=left_out) == []
    assert any(line.startswith("matmul_all_to_all: no float8_e4m3fn cases") for line in left_out), left_out
    # the heads' columns must divide by the ranks (the workload gives each rank one head)
    assert "n (6, the heads' columns) does not divide by 4" in SpCase.of("matmul_all_to_all", 8, 8, 6).world_problem(4)
    assert SpCase.of("all_to_all_matmul", 8, 6, 8).world_problem(4).endswith("k (6, the heads' columns) does not "
                                                                              "divide by 4 ranks")
    assert "cut for 2 ranks, not 4" in sp_preset_cases("llama3-8b-32k", "matmul_all_to_all", 2)[0].world_problem(4)
    with pytest.raises(ValueError, match="no fp8 recipe"):
        SpCase.of("matmul_all_to_all", 8, 8, 8, "mxfp8")
    with pytest.raises(ValueError, match="a layer of matmul_all_to_all"):
        SpCase.of("matmul_all_to_all", 8, 8, 8, preset="llama3-8b-32k", layer="attn-out", sp=2)
    with pytest.raises(ValueError, match="strategies .* apply to none"):
        BenchConfig(ops=SP_OPS, strategies=("reference", "symm+one_shot"))


def test_command_line_shapes_for_the_sp_ops(capsys):
    from overlap.cli import build_parser, main
    from overlap.cli.bench import cases_of

    parser = build_parser()
    args = parser.parse_args(["bench", "--shape", "llama3-8b-32k", "16x24x8"])
    ops, cases = cases_of(None, ("fwd",), args.shape, None, 2)
    # the preset is the sp ops'; a bare MxKxN is the tensor-parallel ops' (the sp ops' m x k x n is their own)
    assert set(ops) == {*DEFAULT_OPS[:4], *SP_OPS}, ops
    assert {c.op for c in cases if isinstance(c, SpCase)} == set(SP_OPS)
    assert all(c.preset == "llama3-8b-32k" for c in cases if isinstance(c, SpCase))
    ops, cases = cases_of(["matmul_all_to_all"], ("fwd", "fwd+bwd"), args.shape, None, 2)
    assert [c.name for c in cases] == [
        "matmul_all_to_all llama3-8b-32k/qkv:512x256x384 float32 fwd",
        "matmul_all_to_all llama3-8b-32k/qkv:512x256x384 float32 fwd+bwd",
        "matmul_all_to_all 16x24x8 float32 fwd", "matmul_all_to_all 16x24x8 float32 fwd+bwd"]
    with pytest.raises(ValueError, match="does not apply to 3 ranks: heads"):
        cases_of(None, ("fwd",), parser.parse_args(["bench", "--shape", "llama3-8b-128k"]).shape, None, 3)
    with pytest.raises(ValueError, match="cannot run on 3 ranks: all_to_all_matmul 8x16x8 float32: k"):
        cases_of(["all_to_all_matmul"], ("fwd",), [(8, 16, 8)], None, 3)
    with pytest.raises(ValueError, match="gives no shape for matmul_all_to_all"):
        cases_of(["matmul_all_to_all"], ("fwd",), parser.parse_args(["bench", "--shape", "llama3-8b"]).shape, None, 2)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "llama3-8b-128k-full" in text and "matmul_all_to_all" in text and "on request" in text


# ---- the checks and the run on 2 ranks -----------------------------------------------------------------------------

TINY = [SpCase.of(op, m, 16, 8, backward=backward) for op in SP_OPS for m, backward in ((8, False), (4, True))]


def run_sp_cases(rank, world_size, seed, tmp):
    """The runner on this rank; returns its rows and what it printed (captured here: a pool made by an earlier test
    writes to that test's stdout, not this one's)."""
    import contextlib
    import io

    import torch.distributed as dist

    from overlap.benchmarks import runner

    labels = tuple(dict.fromkeys(label for op in SP_OPS for label in bench_labels(op)))
    config = BenchConfig(ops=SP_OPS, cases=tuple(TINY), strategies=labels, timeout=240.0, progress=False,
                         warmup=0, iters=1, seed=seed, json_path=os.path.join(tmp, "sp.json"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = runner.run(config, dist.group.WORLD)
    return rows, printed.getvalue()


def test_sp_cases_check_every_strategy_and_the_torch_row_and_report(pools, seed, tmp_path):
    """Each tiny case, both ops and modes, through the runner: ``reference`` and ``torch`` checked against the local
    oracle, every strategy the op has and ``auto`` against ``reference`` (output and gradients), none failed; the
    plans, the bytes column (the op table's), the family's geometric mean, the footnote and the JSON file."""
    results = pools(2).run(run_sp_cases, seed, str(tmp_path), timeout=600)
    for rows, _printed in results:
        ran = {(r["case"], r["strategy"]): r for r in rows if "context" not in r}
        assert {c for c, _ in ran} == {c.name for c in TINY}
        for case in TINY:
            mine = {s: r for (c, s), r in ran.items() if c == case.name}
            assert list(mine) == ["torch", *strategy_labels(case.op), "auto"], mine
            assert all(r["status"] == "ok" for r in mine.values()), mine
            assert all(r["in_summary"] != r["interpreted"] for r in mine.values()), mine  # (interpreted fused: apart)
            assert mine["fused"]["interpreted"], mine
            want = {"out", "grad_a", "grad_b"} if case.backward else {"out"}
            assert all(set(r["tolerance"]) == want for r in mine.values()), mine  # the gradients are checked too
            assert mine["torch"]["plan"] == "torch.distributed + torch.matmul"
            assert mine["reference"]["plan"] == "reference" and mine["pipelined"]["plan"] == "pipelined (shm x1)"
            assert mine["auto"]["plan"].split(" ")[0] in strategy_labels(case.op), mine["auto"]
            r = mine["auto"]
            assert (r["m"], r["k"], r["n"], r["layer"], r["op"]) == (case.m, 16, 8, None, case.op), r
            (comm,) = [r for r in rows if r["case"] == case.name and r.get("context") == "comm"]
            cols = 8 if case.op == "matmul_all_to_all" else 16  # the heads' columns: n, or all_to_all_matmul's k
            nbytes = (2 if case.backward else 1) * case.m * cols // 2 * 4  # one peer's block (and the backward's)
            assert nbytes == case.comm_bytes(2)
            assert comm["comm_gbps"] * comm["t_comm_ms"] * 1e6 == pytest.approx(nbytes, rel=1e-9), comm
    data = json.loads((tmp_path / "sp.json").read_text())
    assert data["cases"] == {"ran": 4, "asked": 4}
    assert [c["op"] for c in data["config"]["cases"]] == [c.op for c in TINY]
    auto = data["summary"]["auto"]
    assert auto["by_family"] == {"sequence-parallel": {"geomean_speedup": pytest.approx(auto["geomean_speedup"]),
                                                      "cases": 4}}, auto
    out = results[0][1]  # (rank 0 prints the report)
    assert "note: matmul_all_to_all, all_to_all_matmul: sequence parallelism" in out, out
    assert "matmul_all_to_all 8x16x8 float32 fwd" in out and "cases: all 4 ran" in out, out


# ---- tune and plan files --------------------------------------------------------------------------------------------


def test_tune_takes_sp_shapes():
    from overlap.cli.tune import TuneConfig, parse_shape, problems_of

    p = parse_shape("matmul_all_to_all:16x32x8:fwd", True)
    assert p == Problem("matmul_all_to_all", 16, 32, 8) and p.key == "matmul_all_to_all:16x32x8:float32:fwd"
    assert parse_shape("all_to_all_matmul:16x32x8:bfloat16", True).backward
    assert problems_of(TuneConfig(["all_to_all_matmul:16x32x8"], None, "x"), 4)[0].k == 32
    with pytest.raises(ValueError, match=r"k \(30, the heads' columns\) does not divide by 4 ranks"):
        problems_of(TuneConfig(["all_to_all_matmul:16x30x8"], None, "x"), 4)
    with pytest.raises(ValueError, match="fp8 only for"):
        parse_shape("matmul_all_to_all:16x32x8:float8_e4m3fn", True)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _calls(world_size: int):
    """Forward calls whose problems are ``op:16x32x8:float32:fwd`` (the ones tuned below)."""
    import overlap

    x, w = torch.randn(16, 32), torch.randn(32, 8)
    ctx, w_o = torch.randn(world_size * 16, 32 // world_size), torch.randn(32, 8)
    return {"matmul_all_to_all": lambda plan: overlap.matmul_all_to_all(x, w, heads=world_size, plan=plan, timeout=60),
            "all_to_all_matmul": lambda plan: overlap.all_to_all_matmul(ctx, w_o, plan=plan, timeout=60)}


def tune_sp_task(rank, world_size, tmp):
    """`tune` writes an entry per sp problem that survives a save and a load; the ops' ``auto`` calls take the file's
    entry (the tuned file's, and a hand-made file's distinctive chunk count), and the log says so."""
    import torch.distributed as dist

    from overlap.plans import PlanFile, Topology
    from overlap.plans.planfile import Entry
    from overlap.tune.search import tune

    problems = [Problem(op, 16, 32, 8) for op in SP_OPS]
    pf, outcomes = tune(problems, measure=1, repeats=1, warmup=0, timeout=60)
    tuned = os.path.join(tmp, "tuned.json")
    made = os.path.join(tmp, "made.json")
    files = PlanFile.new(Topology("cpu", world_size, 1, world_size, (("shm", world_size - 1),)), world_size)
    for p in problems:
        files.add(Entry(p, Plan("pipelined", num_chunks={"shm": 3}), 1.0, 2.0, None))
    if rank == 0:
        pf.save(tuned)
        files.save(made)
    dist.barrier()
    loaded = PlanFile.load(tuned)
    round_trip = {p.key: (pf.lookup(p), loaded.lookup(p)) for p in problems}
    log = logging.getLogger("overlap")
    handler, level = _Capture(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    chosen = {}
    try:
        for path in (tuned, made):
            for op, call in _calls(world_size).items():
                handler.lines.clear()
                call(path)
                chosen[(os.path.basename(path), op)] = [line for line in handler.lines if "auto chose" in line]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return sorted(pf.entries), round_trip, chosen, [o.chosen.plan.strategy for o in outcomes]


def test_tune_writes_sp_entries_that_auto_takes(pools, tmp_path):
    for keys, round_trip, chosen, strategies in pools(2).run(tune_sp_task, str(tmp_path), timeout=300):
        assert keys == ["all_to_all_matmul:16x32x8:float32:fwd", "matmul_all_to_all:16x32x8:float32:fwd"], keys
        for key, (tuned, loaded) in round_trip.items():
            assert tuned is not None and tuned == loaded, (key, tuned, loaded)
        assert set(strategies) <= set(OPS["matmul_all_to_all"].strategies)
        for op in SP_OPS:
            key = f"{op}:16x32x8:float32:fwd"
            (line,) = chosen[("tuned.json", op)]
            assert f"auto chose {round_trip[key][0].describe()} " in line and "(plan file " in line, line
            (line,) = chosen[("made.json", op)]
            assert "auto chose pipelined[shm=3]" in line and "(plan file " in line, line
