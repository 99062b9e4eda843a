"""The benchmark suite around ``overlap bench``: Llama-3 presets, --plot, --compare, the progress bar,
the per-op geometric means, and the pytest-benchmark wrappers in bench/ (run as a user runs them)."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys

import pytest

from overlap.benchmarks import compare as cmp
from overlap.benchmarks.cases import OPS, SUITES, Case, default_cases, preset_cases, suite_cases
from overlap.benchmarks.models import LLAMA3_8B, LLAMA3_70B, TP_PRESETS, tp_problems
from overlap.progress import ProgressBar

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAR = r"^\[[#.]{24}\]\s+\d+% \d+/\d+ "  # a progress-bar line (the per-case lines start "[i/N]")


def overlap_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "overlap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


# ----------------------------------------------------------------------------------------------
# Presets from real models (no ranks)
# ----------------------------------------------------------------------------------------------


def test_llama_models_are_the_real_ones():
    assert (LLAMA3_8B.hidden, LLAMA3_8B.ffn, LLAMA3_8B.heads, LLAMA3_8B.kv_heads, LLAMA3_8B.head_dim) == (
        4096, 14336, 32, 8, 128)
    assert (LLAMA3_70B.hidden, LLAMA3_70B.ffn, LLAMA3_70B.heads, LLAMA3_70B.kv_heads, LLAMA3_70B.head_dim) == (
        8192, 28672, 64, 8, 128)
    assert TP_PRESETS["llama3-8b-full"][0] == LLAMA3_8B and TP_PRESETS["llama3-70b-full"][0] == LLAMA3_70B
    for name, real in (("llama3-8b", LLAMA3_8B), ("llama3-70b", LLAMA3_70B)):
        cpu, about = TP_PRESETS[name]
        # widths (hidden, FFN, head dim) at 1/16, tokens at 1/4, heads kept; the description says so
        assert (cpu.hidden * 16, cpu.ffn * 16, cpu.head_dim * 16, cpu.tokens * 4) == (
            real.hidden, real.ffn, real.head_dim, real.tokens)
        assert (cpu.heads, cpu.kv_heads, cpu.gated) == (real.heads, real.kv_heads, True)
        assert str(real.hidden) in about and str(real.ffn) in about and "1/16" in about and "1/4" in about


def test_llama_full_size_tensor_parallel_shapes():
    """Llama-3 8B at TP=8, 4096 tokens (512 per rank), grouped-query attention: the Megatron shards."""
    problems = {(layer, op): dims for layer, op, dims in tp_problems(LLAMA3_8B, 8)}
    assert problems == {
        ("qkv", "all_gather_matmul"): (512, 4096, (4096 + 2 * 8 * 128) // 8),  # Q + K + V columns, sharded
        ("attn-out", "matmul_reduce_scatter"): (512, 4096 // 8, 4096),
        ("attn-out", "matmul_all_reduce"): (512, 4096 // 8, 4096),
        ("mlp-up", "all_gather_matmul"): (512, 4096, 2 * 14336 // 8),  # gate and up fused
        ("mlp-down", "matmul_reduce_scatter"): (512, 14336 // 8, 4096),
        ("mlp-down", "matmul_all_reduce"): (512, 14336 // 8, 4096),
        # FSDP: every projection's weight sharded by rows (its output features), each rank its own tokens
        ("qkv", "all_gather_weight_matmul"): (512, 4096, (4096 + 2 * 8 * 128) // 8),
        ("attn-out", "all_gather_weight_matmul"): (512, 4096, 4096 // 8),
        ("mlp-up", "all_gather_weight_matmul"): (512, 4096, 2 * 14336 // 8),
        ("mlp-down", "all_gather_weight_matmul"): (512, 14336, 4096 // 8),
    }
    seventy = {layer: dims for layer, op, dims in tp_problems(LLAMA3_70B, 8)
               if op not in ("matmul_all_reduce", "all_gather_weight_matmul")}
    assert seventy == {"qkv": (1024, 8192, 1280), "attn-out": (1024, 1024, 8192), "mlp-up": (1024, 8192, 7168),
                       "mlp-down": (1024, 3584, 8192)}


def test_preset_cases_expand_for_every_op_and_mode():
    cases = preset_cases("llama3-8b", OPS, world_size=2)
    got = [(c.op, c.layer, (c.m, c.k, c.n), c.mode) for c in cases]
    want = [
        (op, layer, dims, mode)
        for op, layers in (("all_gather_matmul", (("qkv", (512, 256, 192)), ("mlp-up", (512, 256, 896)))),
                           ("matmul_reduce_scatter", (("attn-out", (512, 128, 256)), ("mlp-down", (512, 448, 256)))),
                           ("matmul_all_reduce", (("attn-out", (512, 128, 256)), ("mlp-down", (512, 448, 256)))),
                           ("all_gather_weight_matmul", (("qkv", (512, 256, 192)), ("attn-out", (512, 256, 128)),
                                                         ("mlp-up", (512, 256, 896)), ("mlp-down", (512, 896, 128)))))
        for layer, dims in layers
        for mode in ("fwd", "fwd+bwd")
    ]
    assert got == want
    assert all(c.preset == "llama3-8b" and c.tp == 2 and c.dtype == "float32" for c in cases)
    assert cases[0].name == "all_gather_matmul llama3-8b/qkv:512x256x192 float32 fwd"
    # one op, one mode, another size: the same layers at TP=4
    four = preset_cases("llama3-8b", "matmul_reduce_scatter", world_size=4, dtype="bfloat16", modes=("fwd",))
    assert [(c.layer, c.m, c.k, c.n, c.dtype) for c in four] == [
        ("attn-out", 256, 64, 256, "bfloat16"), ("mlp-down", 256, 224, 256, "bfloat16")]
    assert preset_cases("llama3-8b", "moe", world_size=2) == []  # not a tensor-parallel op: nothing
    assert four[0].world_problem(4) is None and "cut for 4 ranks, not 2" in four[0].world_problem(2)
    with pytest.raises(ValueError, match="heads \\(32\\).*do not divide by the tensor-parallel size 3"):
        preset_cases("llama3-8b", OPS, world_size=3)
    with pytest.raises(ValueError, match="unknown preset"):
        preset_cases("llama3-7b", OPS)
    with pytest.raises(ValueError, match="a preset case needs"):
        Case.of("all_gather_matmul", 8, 8, 8, preset="llama3-8b", layer="mlp-down", tp=2)  # not a layer of that op


SMALL = ("llama3-8b-decode", "llama3-70b-decode", "llama3-8b-prefill")


def test_default_cases_are_the_llama_layer_a_tiny_shape_and_small_calls():
    cases = [c for c in default_cases(OPS, "cpu", world_size=2) if not c.batch]  # (batch-first: test_bench_layouts)
    for op in OPS:
        mine = [c for c in cases if c.op == op and c.preset not in SMALL]
        layers = 4 if op == "all_gather_weight_matmul" else 2  # FSDP: every projection; TP: two per op
        assert [c.mode for c in mine] == ["fwd", "fwd+bwd"] * (layers + 1), mine
        assert [c.preset for c in mine[:2 * layers]] == ["llama3-8b"] * 2 * layers and not mine[2 * layers].preset
        assert [c.fits_interpreted_fused for c in mine] == [False] * 2 * layers + [True] * 2
        small = [c for c in cases if c.op == op and c.preset in SMALL]
        if op == "all_gather_weight_matmul":  # (the weight gather of FSDP has no decode cases)
            assert not small
            continue
        # decode: forward only, 8 rows per rank (16 sequences on 2 ranks); the short prompt: 64 rows, both modes
        assert [(c.preset, c.mode, c.m) for c in small] == (
            [("llama3-8b-decode", "fwd", 8)] * 2 + [("llama3-70b-decode", "fwd", 8)] * 2
            + [("llama3-8b-prefill", mode, 64) for _ in range(2) for mode in ("fwd", "fwd+bwd")]), small
    assert len(default_cases(world_size=2)) == 64  # and the 6 MoE cases and 6 batch-first ones
    left_out: list[str] = []
    three = default_cases(OPS, "cpu", world_size=3, left_out=left_out)
    assert all(not c.preset for c in three) and len(three) == 8, three  # only the tiny shape fits 3 ranks
    assert left_out[0] == ("llama3-8b: heads (32), kv_heads (8), ffn (896), tokens (1024) do not divide by the "
                           "tensor-parallel size 3 (the ranks)")
    assert [line.split(":")[0] for line in left_out[1:]] == list(SMALL), left_out
    gpu = [c for c in default_cases("all_gather_matmul", "cuda", world_size=8) if not c.batch]
    assert {c.preset for c in gpu} == {"llama3-8b-full", "llama3-70b-full", "", "llama3-8b-full-decode",
                                       "llama3-70b-full-decode"}
    assert {c.m for c in gpu if c.preset.endswith("decode")} == {2}  # 16 sequences over 8 GPUs
    quick, tiny = suite_cases("quick"), suite_cases("tiny")
    assert set(SUITES) == {"quick", "default", "tiny"} and suite_cases("default") == default_cases()
    assert all(c.mode == "fwd" and not c.fits_interpreted_fused for c in quick) and len(quick) == 33
    assert all(c.mode == "fwd" and c.fits_interpreted_fused for c in tiny) and len(tiny) == 5


def test_shape_argument_takes_presets(capsys):
    from overlap.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--shape", "Llama3-8B", "16x8x8", "mixtral"])
    assert args.shape[0] == ("preset", "llama3-8b") and args.shape[1] == (16, 8, 8)
    for argv, message in ((["bench", "--shape", "llama3-7b"], "llama3-8b"),  # the error lists the presets
                          (["bench", "--nproc", "3", "--shape", "llama3-70b"], "does not apply to 3 ranks"),
                          (["bench", "--op", "moe", "--shape", "llama3-8b"], "no shape for moe")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


# ----------------------------------------------------------------------------------------------
# --compare, --plot, progress (no ranks)
# ----------------------------------------------------------------------------------------------


def _row(case: str, strategy: str, median: float, spread: float = 0.05, **extra) -> dict:
    return {"case": case, "strategy": strategy, "label": strategy, "median_ms": median,
            "p25_ms": median * (1 - spread), "p75_ms": median * (1 + spread), **extra}


def _payload(rows: list[dict], world_size: int = 2) -> dict:
    return {"machine": {"description": "test machine", "world_size": world_size, "device_type": "cpu"},
            "results": rows}


def test_compare_marks_changes_beyond_the_spreads():
    a, b, gone, new = "op 8x8x8 float32 fwd", "op 16x8x8 float32 fwd", "op 4x4x4 float32 fwd", "op 2x2x2 float32 fwd"
    earlier = _payload([_row(a, "reference", 100.0), _row(a, "symm", 10.0), _row(a, "pipelined", 10.0),
                        _row(b, "reference", 5.0), _row(gone, "reference", 1.0)])
    now = _payload([_row(a, "reference", 10.0), _row(a, "symm", 10.2), _row(a, "pipelined", 20.0),
                    _row(b, "reference", 5.0), _row(b, "symm", 4.0), _row(new, "reference", 1.0)])
    lines = cmp.compare(earlier, now, "before.json", wide=True)  # one line per case and strategy
    assert lines[0] == "compared with before.json:"
    by = {tuple(re.split(r"\s{2,}", ln.strip())[:2]): ln for ln in lines[2:] if ln.startswith("op ")}
    assert by[(a, "reference")].endswith("-90.0%  faster"), by  # the much slower earlier reference
    assert by[(a, "pipelined")].endswith("+100.0%  slower"), by
    assert by[(a, "symm")].rstrip().endswith("+2.0%"), by  # within the spreads: unmarked
    assert "100.000 [95.00..105.00]" in by[(a, "reference")] and "10.000 [9.50..10.50]" in by[(a, "reference")]
    assert "4 timings in both runs: 1 faster, 1 slower, 2 within the spreads" in "\n".join(lines)
    assert f"warning: 1 case(s) in the earlier run only: {gone}" in lines
    assert f"warning: 1 case(s) in this run only: {new}" in lines
    assert any(ln.startswith("warning: 1 strategy timing(s)") and f"{b} symm" in ln for ln in lines), lines
    narrow = cmp.compare(earlier, now, "before.json")  # the default: each case's name over its strategies
    col = lines[1].index("strategy")  # the wide form's lines from the strategy on
    assert narrow[1:3] == ["case", "  " + lines[1][col:]], narrow
    assert narrow[3:6] == [a, "  " + by[(a, "reference")][col:], "  " + by[(a, "symm")][col:]], narrow
    assert narrow[7:9] == [b, "  " + by[(b, "reference")][col:]], narrow
    assert narrow[9:] == lines[len(lines) - len(narrow) + 9:], narrow  # the counts and warnings as in the wide form
    other = cmp.compare(_payload([_row(a, "reference", 1.0)], world_size=4), now)
    assert any("differ in ranks (4 then 2)" in ln for ln in other), other


def test_compare_load_rejects_what_is_not_a_bench_file(tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    (tmp_path / "y.json").write_text("not json")
    for name, message in (("x.json", "no 'results' list"), ("y.json", "not a JSON file"), ("z.json", "no such file")):
        with pytest.raises(ValueError, match=message):
            cmp.load(str(tmp_path / name))


def test_plot_without_matplotlib_is_a_clear_usage_error(monkeypatch, capsys, tmp_path):
    from overlap.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--plot", str(tmp_path / "out.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and 'pip install ".[plot]"' in err, err  # the extra that installs it


def test_demo_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    from overlap.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--plot", str(tmp_path / "demo.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and 'pip install ".[plot]"' in err, err


def test_plot_extra_installs_matplotlib():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["plot"] == ["matplotlib"], project["optional-dependencies"]


def test_plot_draws_times_and_speedups_over_torch(tmp_path):
    pytest.importorskip("matplotlib")
    from overlap.benchmarks.plot import plot

    case = "all_gather_matmul 8x8x8 float32 fwd"
    rows = [_row(case, "torch", 10.0, speedup=1.0), _row(case, "reference", 12.0, speedup=0.83),
            _row(case, "symm", 8.0, speedup=1.25), _row(case, "pipelined", 1.0, speedup=10.0),
            _row(case, "fused", 900.0, speedup=0.01, interpreted=True),
            _row(case, "auto", 8.0, speedup=1.25, plan="symm (shm x1)"),
            _row(case, "(all_gather alone)", 4.0, context="comm")]
    plot(_payload(rows), str(tmp_path / "p.svg"))
    svg = (tmp_path / "p.svg").read_text()
    assert "speedup over torch" in svg and "10.0x" in svg  # the clipped speedup is labelled with its value
    assert "auto: symm (shm x1)" in svg and "left off" in svg  # auto's plan; interpreted fused not drawn
    assert "overlap efficiency" not in svg
    with pytest.raises(ValueError, match="nothing to plot"):
        plot(_payload([]), str(tmp_path / "q.png"))
    with pytest.raises(ValueError, match="nothing to plot"):  # interpreted fused alone: nothing to draw
        plot(_payload([_row(case, "fused", 900.0, interpreted=True)]), str(tmp_path / "q.png"))


def test_auto_slower_than_torch_counts_cases_beyond_a_tenth_or_half_the_wider_spread():
    from overlap.benchmarks.report import auto_vs_torch, auto_vs_torch_line

    a, b, c, d, e, f = (f"op {n}x8x8 float32 fwd" for n in (1, 2, 3, 4, 5, 6))
    rows = [
        _row(a, "torch", 10.0, spread=0.05), _row(a, "auto", 11.2, spread=0.05),  # 1.2 > max(1.0, 0.56): slower
        _row(b, "torch", 10.0, spread=0.05), _row(b, "auto", 10.9, spread=0.05),  # 0.9 < 1.0: within a tenth
        _row(c, "torch", 10.0, spread=0.05), _row(c, "auto", 5.0, spread=0.05),  # faster
        _row(d, "torch", 10.0), {"case": d, "strategy": "auto", "status": "FAILED"},  # not timed: not compared
        _row(e, "torch", 10.0, spread=0.1), _row(e, "auto", 11.5, spread=0.2),  # 1.5 < max(1.0, 4.6 / 2): noise
        _row(f, "torch", 10.0, spread=0.3), _row(f, "auto", 13.5, spread=0.05),  # 3.5 > max(1.0, 6 / 2): slower
        _row(a, "(comm alone)", 99.0, context="comm"),
    ]
    result = auto_vs_torch(rows)
    assert result == {"slower": 2, "compared": 5, "cases": [a, f]}
    assert auto_vs_torch_line(result) == (
        f"auto slower than torch beyond max(10%, half the wider p25..p75 spread) in 2 of 5 case(s): {a}; {f}")
    none = auto_vs_torch(rows[2:6])
    assert none == {"slower": 0, "compared": 2, "cases": []}
    assert auto_vs_torch_line(none).endswith("in 0 of 2 case(s) (goal: none)")


def test_summary_is_over_torch_and_includes_reference_and_auto():
    from overlap.benchmarks.report import summary

    case = "all_gather_matmul 8x8x8 float32 fwd"
    base = {"op": "all_gather_matmul", "mode": "fwd", "in_summary": True}
    rows = [dict(base, case=case, strategy="torch", speedup=1.0, speedup_vs_reference=2.0),
            dict(base, case=case, strategy="reference", speedup=0.5, speedup_vs_reference=1.0),
            dict(base, case=case, strategy="auto", speedup=2.0, speedup_vs_reference=4.0),
            dict(base, case=case, strategy="fused", speedup=0.01, speedup_vs_reference=0.02, in_summary=False)]
    out = summary(rows)
    assert list(out) == ["reference", "auto"], out
    assert out["auto"]["geomean_speedup"] == 2.0 and out["auto"]["geomean_speedup_vs_reference"] == 4.0


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_throttles_in_logs_and_redraws_on_terminals():
    log = _Stream(tty=False)
    bar = ProgressBar(total=4, stream=log, interval_s=60.0)
    bar.update(0.0, "case a: checking reference")  # the first is always shown
    bar.update(0.5, "case b: timing symm (3/10)")  # too soon after: not shown in a log
    bar.line("[2/4] case b: reference, symm")  # lines of their own are never throttled
    bar.finish("done in 1.0 s")
    lines = log.getvalue().splitlines()
    assert re.match(BAR + r"case a: checking reference \(\d+ s\)$", lines[0]) and lines[0].startswith("[....")
    assert lines[1:] == ["[2/4] case b: reference, symm", "[" + "#" * 24 + "] 100% 4/4 done in 1.0 s"], lines

    term = _Stream(tty=True)
    bar = ProgressBar(total=2, stream=term)
    bar.update(0.5, "case b: timing symm (1/10)")
    bar.line("[2/2] case b")
    assert term.getvalue().startswith("\r\033[K[############............]  50% 1/2 case b: timing symm (1/10)")
    assert term.getvalue().endswith("\r\033[K[2/2] case b\n")  # the bar erased, the line in its place
    ProgressBar(enabled=False, stream=term).update(0.1, "x")  # silent on other ranks
    assert term.getvalue().endswith("[2/2] case b\n")


# ----------------------------------------------------------------------------------------------
# overlap bench end to end: presets, progress, per-op geomean, --json, --compare, --plot
# ----------------------------------------------------------------------------------------------


def test_bench_presets_progress_compare_and_plot(tmp_path):
    first, slow, second, png = (tmp_path / n for n in ("a.json", "slow.json", "b.json", "out.png"))
    args = ("bench", "--nproc", "2", "--mode", "fwd", "--strategies", "reference,symm", "--iters", "3",
            "--warmup", "1", "--timeout", "60")
    proc = overlap_cmd(*args, "--shape", "llama3-8b", "16x24x8", "--op", "all_gather_matmul,matmul_reduce_scatter",
                       "--json", str(first))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    cases = re.findall(r"^\[\d+/6\] (.*?): torch, reference, symm \(", proc.stderr, re.M)
    assert cases == [
        "all_gather_matmul llama3-8b/qkv:512x256x192 float32 fwd",
        "all_gather_matmul llama3-8b/mlp-up:512x256x896 float32 fwd",
        "all_gather_matmul 16x24x8 float32 fwd",
        "matmul_reduce_scatter llama3-8b/attn-out:512x128x256 float32 fwd",
        "matmul_reduce_scatter llama3-8b/mlp-down:512x448x256 float32 fwd",
        "matmul_reduce_scatter 16x24x8 float32 fwd",
    ], proc.stderr
    # the bar names the case and what is being checked or timed, and ends full
    assert re.search(BAR + r"all_gather_matmul llama3-8b/qkv:512x256x192 float32 fwd: checking reference", proc.stderr,
                     re.M), proc.stderr
    assert re.search(r"^\[#{24}\] 100% 6/6 done in [\d.]+ s$", proc.stderr, re.M), proc.stderr
    geomeans = [ln for ln in proc.stdout.splitlines() if ln.startswith("geomean speedup")]
    for op, line in (("all_gather_matmul", geomeans[-2]), ("matmul_reduce_scatter", geomeans[-1])):
        assert re.match(rf"geomean speedup over torch, op {op}, fwd: reference \S+x \(3\), symm \S+x \(3\)$", line)
    data = json.loads(first.read_text())
    rows = [r for r in data["results"] if r["strategy"] == "symm"]
    assert [(r["preset"], r["layer"]) for r in rows][:2] == [("llama3-8b", "qkv"), ("llama3-8b", "mlp-up")]
    assert data["summary"]["symm"]["by_op"]["matmul_reduce_scatter"]["cases"] == 3

    # An earlier run whose reference was a million times slower (no load makes this run's as slow: the
    # comparison's verdict is certain), one case it did not have, one it had and this one lacks.
    earlier = copy.deepcopy(data)
    gone = "all_gather_matmul 16x24x8 float32 fwd"
    earlier["results"] = [r for r in earlier["results"] if r["case"] != gone]
    for r in earlier["results"]:
        if r["strategy"] == "reference":
            for key in ("median_ms", "p25_ms", "p75_ms"):
                r[key] *= 1e6
    earlier["results"].append(dict(earlier["results"][0], case="all_gather_matmul 8x8x8 float32 fwd"))
    slow.write_text(json.dumps(earlier))
    proc = overlap_cmd(*args, "--shape", "llama3-8b", "16x24x8", "--op", "all_gather_matmul,matmul_reduce_scatter",
                       "--json", str(second), "--compare", str(slow), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout[proc.stdout.index(f"compared with {slow}:"):]
    for case in ("all_gather_matmul llama3-8b/qkv:512x256x192 float32 fwd",
                 "matmul_reduce_scatter llama3-8b/mlp-down:512x448x256 float32 fwd"):
        block = out[out.index(f"\n{case}\n") + len(case) + 2:].split("\n" + case.split()[0])[0]  # its rows
        assert re.search(r"^  reference\s+.*-\d+\.\d%  faster$", block, re.M), out
        assert re.search(r"^  symm\s+[\d.]+ \[", block, re.M), out
    assert f"warning: 1 case(s) in this run only: {gone}" in out, out
    assert "warning: 1 case(s) in the earlier run only: all_gather_matmul 8x8x8 float32 fwd" in out, out
    if png.exists() or "matplotlib" not in proc.stderr:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in proc.stdout


# ----------------------------------------------------------------------------------------------
# The pytest-benchmark wrappers, as a user runs them
# ----------------------------------------------------------------------------------------------


def test_pytest_benchmark_wrappers_report_rank_measured_times(tmp_path):
    pytest.importorskip("pytest_benchmark")
    out = tmp_path / "pb.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/", "--benchmark-only", "-q", "-p", "no:cacheprovider",
         "--overlap-suite", "tiny", "--overlap-op", "all_gather_matmul,matmul_all_reduce", "--overlap-rounds", "2",
         "--overlap-warmup", "1", f"--benchmark-json={out}"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b19 passed\b", proc.stdout), proc.stdout[-2000:]  # 8 labels + 11 (with +one_shot)
    benchmarks = json.loads(out.read_text())["benchmarks"]
    by = {b["param"]: b for b in benchmarks}
    assert len(by) == 19, sorted(by)
    for b in benchmarks:
        info, stats = b["extra_info"], b["stats"]
        # pytest-benchmark's statistics are the ranks' own: the slowest rank's time of each round
        assert stats["median"] == pytest.approx(info["rank_median_ms"] / 1e3, rel=1e-9), b["param"]
        assert stats["rounds"] == len(info["rank_times_ms"]) and b["group"] == info["case"]
    ag = "all_gather_matmul-32x64x64-float32-fwd-"
    assert by[ag + "symm"]["extra_info"]["speedup"] > 0 and "efficiency" in by[ag + "symm"]["extra_info"]
    assert by[ag + "symm"]["extra_info"]["speedup_vs_reference"] > 0
    assert by[ag + "torch"]["extra_info"]["speedup"] == 1.0 and by[ag + "auto"]["extra_info"]["speedup"] > 0
    assert by[ag + "comm-alone"]["extra_info"]["strategy"] == "(all_gather alone)"
    fused = by[ag + "fused"]
    assert fused["extra_info"]["interpreted"] and fused["stats"]["rounds"] == 2
    assert "matmul_all_reduce-32x64x64-float32-fwd-symm+one_shot" in by
