"""Small things of the command line a user meets on the way: a negative shape's error, an unknown option's usage,
more CPU ranks than cores, the demo's sizes on 3 ranks, the torchrun note once, the demo's ratio label, and
``overlap bench``'s tables (its own, ``--compare``'s) in 120 columns (``--wide``: one line per row).

Everything here is deterministic: argument errors in process, the core count and the ranks' start monkeypatched,
the tables built from a fake report (nothing is timed). Two tests start ranks: torchrun's 2 (the note) and the
demo's suggested sizes on 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from overlap import world
from overlap.cli import main

# ----------------------------------------------------------------------------------------------
# --shape -5x64x64: the shape's own error, not argparse's "expected one argument"
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("bench", "--shape", "-5x64x64"),
        ("bench", "--shape=-5x64x64"),
        ("bench", "--shape", "8x8x8", "-5x64x64"),
        ("bench", "--op", "moe", "--shape", "-8,32,64,4,2"),
        ("predict", "--machine", "h100-sxm", "--shape", "-5x64x64"),
    ],
)
def test_negative_shape_is_the_shapes_own_usage_error(args, capsys, monkeypatch):
    monkeypatch.setattr(world, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"overlap {args[0]}: error: argument --shape: "), err
    assert "-5x64x64" in last or "-8,32,64,4,2" in last, err
    assert "expected" not in last and "preset among" not in last.split("got")[0], err  # no argparse arity, no presets
    if "x" in args[-1]:
        assert "every dim of the shape must be >= 1, got '-5x64x64'" in last, err


def test_negative_shape_as_a_user_types_it():
    """The same in a subprocess, as typed: one usage line, exit 2, before torch is imported."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "overlap.cli", "bench", "--shape", "-5x64x64"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("usage: overlap bench"), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("overlap bench: error: argument --shape: every dim of the shape "
                                                    "must be >= 1, got '-5x64x64'"), proc.stderr


def test_negative_numbers_are_still_checked_as_values(capsys):
    for args, message in ((("bench", "--ranks", "-3"), "expected a positive integer, got -3"),
                          (("bench", "--iters", "-1"), "expected a positive integer, got -1"),
                          (("bench", "--timeout", "-1.5"), "expected a positive number of seconds, got -1.5")):
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, (args, err)


# ----------------------------------------------------------------------------------------------
# overlap bench --bogus: bench's usage, not the top level's
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["bench", "tune", "demo", "info", "predict"])
def test_unknown_option_is_the_commands_usage_error(command, capsys):
    required = ["--machine", "h100-sxm"] if command == "predict" else []  # else that error comes first
    with pytest.raises(SystemExit) as exc:
        main([command, *required, "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith(f"usage: overlap {command} "), err
    assert err.strip().splitlines()[-1] == f"overlap {command}: error: unrecognized arguments: --bogus", err


def test_unknown_option_before_the_command_is_the_top_levels(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", "bench"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip().splitlines()[-1] == "overlap: error: unrecognized arguments: --bogus"


def test_stray_value_after_an_option_is_the_commands_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--iters", "3", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip().splitlines()[-1] == "overlap bench: error: unrecognized arguments: 4"


# ----------------------------------------------------------------------------------------------
# --ranks N beyond the cores: a warning before the ranks start
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_launch(monkeypatch, capsys):
    """`world.launch` that starts nothing and marks on stderr when it was called; 2 cores; CPU ranks."""
    from overlap.cli import ranks

    monkeypatch.setattr(ranks, "cpu_cores", lambda: 2)
    monkeypatch.setattr(world, "ranks_device_type", lambda world_size: "cpu")
    monkeypatch.setattr(world, "launch", lambda fn, nproc, **kw: print(f"LAUNCH {nproc}", file=sys.stderr))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return ranks


@pytest.mark.parametrize("nproc", [3, 100])
def test_more_cpu_ranks_than_cores_warn_once_before_they_start(nproc, fake_launch, capsys):
    assert main(["info", "--ranks", str(nproc)]) == 0
    err = capsys.readouterr().err
    warning = (f"overlap info: warning: {nproc} CPU ranks on 2 cores: oversubscribed, the ranks take turns on the "
               "cores, so start-up and every step run slower")
    assert err.count(warning) == 1, err
    assert err.index(warning) < err.index(f"LAUNCH {nproc}"), err  # before the ranks start
    assert "--ranks 2 or fewer runs at full speed" in err and len(err.splitlines()) == 2, err  # one line


def test_as_many_cpu_ranks_as_cores_do_not_warn(fake_launch, capsys):
    assert main(["info", "--ranks", "2"]) == 0
    assert capsys.readouterr().err == "LAUNCH 2\n"


def test_gpu_ranks_do_not_warn(fake_launch, monkeypatch):
    monkeypatch.setattr(world, "ranks_device_type", lambda world_size: "cuda")
    assert fake_launch.oversubscribed("bench", 8) is None
    monkeypatch.setattr(world, "ranks_device_type", lambda world_size: "cpu")
    assert fake_launch.oversubscribed("bench", 8).startswith("overlap bench: warning: 8 CPU ranks on 2 cores")
    monkeypatch.setattr(fake_launch, "cpu_cores", lambda: 1)
    assert "2 CPU ranks on 1 core:" in fake_launch.oversubscribed("demo", 2)


def test_cpu_cores_is_the_affinity_mask():
    from overlap.cli.ranks import cpu_cores

    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cpu_cores() == expected >= 1


# ----------------------------------------------------------------------------------------------
# Under torchrun: "--ranks N is ignored" once, from rank 0
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_ignored_ranks_note_comes_from_rank_0_only(rank, monkeypatch, capsys):
    import torch.distributed as dist

    from overlap.cli.ranks import on_ranks

    monkeypatch.setattr(world, "init_from_env", lambda: True)  # as under torchrun: the ranks exist
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    assert on_ranks("bench", lambda: "done", (), 4) == (0, "done")
    err = capsys.readouterr().err
    note = "overlap bench: running on the 2 ranks of torchrun; --ranks 4 is ignored"
    assert err.count(note) == (1 if rank == 0 else 0), err


def test_ignored_ranks_note_prints_once_under_torchrun():
    """As a user meets it: torchrun's 2 ranks, ``--ranks 3`` given."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(world.free_port())  # torchrun's --master-port 0 hangs its workers' rendezvous
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, "-m",
         "overlap.cli", "info", "--ranks", "3"], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("--ranks 3 is ignored") == 1, proc.stderr


# ----------------------------------------------------------------------------------------------
# overlap demo --ranks 3: the error names sizes that work, and they do
# ----------------------------------------------------------------------------------------------


def test_demo_on_3_ranks_names_sizes_that_divide(capsys, monkeypatch):
    monkeypatch.setattr(world, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--ranks", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("overlap demo: error: the model does not divide over 3 ranks: attention heads (4)"), err
    assert last.endswith("; these sizes divide over 1, 2 or 4 ranks (--ranks); on 3 ranks, try --heads 6 --hidden 66 "
                         "--ffn 129 --experts 6 --seq-len 33"), err


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_fitted_model_divides_over_the_ranks(world_size):
    from overlap.demo.config import ModelConfig

    for model in (ModelConfig(), ModelConfig(heads=3, hidden=64), ModelConfig(heads=5, ffn=100, seq_len=7)):
        fitted = model.fitted(world_size)
        assert fitted.problems(world_size) == [], (model, world_size, fitted)
        for name in ("heads", "hidden", "ffn", "experts", "seq_len"):  # never smaller, the least multiple
            before, after = getattr(model, name), getattr(fitted, name)
            assert before <= after, (name, model, fitted)
    assert ModelConfig().fitted(2) == ModelConfig()  # nothing to change
    assert ModelConfig().ranks_that_fit() == [1, 2, 4]


def test_demo_hint_is_empty_where_nothing_helps():
    from overlap.cli.demo import sizes_that_fit
    from overlap.demo.config import ModelConfig

    assert sizes_that_fit(ModelConfig(top_k=5), 2) == ""  # top-k beyond the experts: no size to suggest
    assert sizes_that_fit(ModelConfig(heads=3, hidden=64), 2) == "; on 2 ranks, try --heads 4"


def _suggested_demo(rank, world_size):
    from overlap.demo.config import DemoConfig, ModelConfig
    from overlap.demo.train import train

    model = ModelConfig().fitted(world_size)
    return train(DemoConfig(model=model, steps=2, strategy="auto", progress=False))


def test_demo_suggested_sizes_train_on_3_ranks(pools):
    results = pools(3).run(_suggested_demo, timeout=300)
    runs = results[0]["runs"]
    for a, b in zip(runs["torch"]["losses"], runs["overlap"]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), runs


# ----------------------------------------------------------------------------------------------
# The demo's step-time ratio: labelled as the median of the per-step ratios
# ----------------------------------------------------------------------------------------------


def test_demo_ratio_is_labelled_the_median_of_per_step_ratios():
    from overlap.demo import report

    # per-step ratios 0.5, 2.0, 1.5: their median 1.5, while the medians' ratio is 20 / 20 = 1.0
    torch_s, ours_s = [0.040, 0.010, 0.020], [0.020, 0.020, 0.030]
    results = {"world_size": 2, "device": "cpu", "strategy": "auto", "steps": 4, "seed": 0, "lr": 0.01,
               "entropy_rate": 1.0, "memory_method": "m",
               "model": {"vocab": 64, "hidden": 64, "heads": 4, "ffn": 128, "layers": 2, "experts": 4, "top_k": 2,
                         "seq_len": 32, "batch": 8},
               "runs": {"torch": {"losses": [3.0, 2.9, 2.8, 2.7], "step_s": torch_s, "peak_bytes": 2**20},
                        "overlap": {"losses": [3.0, 2.9, 2.8, 2.7], "step_s": ours_s, "peak_bytes": 2**20}}}
    derived = report.summary(results)
    assert derived["step_ratio"][1] == pytest.approx(1.5)
    assert derived["step_ms"]["torch"][1] == pytest.approx(derived["step_ms"]["overlap"][1])  # medians' ratio 1
    lines = report.lines(results, derived)
    ratio = [ln for ln in lines if ln.startswith("step-time ratio")]
    assert ratio == ["step-time ratio overlap/torch, median of the per-step ratios: 1.500 (p25..p75 1.000..1.750; "
                     "below 1 is faster)"], lines


# ----------------------------------------------------------------------------------------------
# overlap bench's table: 120 columns by default, --wide one line per row
# ----------------------------------------------------------------------------------------------

#: plan labels as `overlap.Plan.label` writes them, the longest ones included
PLANS = ("symm (shm x1)", "reference", "pipelined (shm x4, network x2)", "fused (tile 128x128x64, one-shot)",
         "symm (nvlink x2, one-shot)", "symm (shm x2, network x4, migrate 3@1+5@1+7@1)", "")


def fake_rows(case, strategies: tuple[str, ...], interpreted: bool, seed: int) -> list[dict]:
    """What `runner.case_rows` returns for `case`, with made-up figures (wide ones: up to 9999 ms) and one FAILED row
    with a long error."""
    from overlap.benchmarks import report
    from overlap.benchmarks.definitions import bench_labels

    base = {"op": case.op, "mode": case.mode, "case": case.name}
    rows = []
    for i, s in enumerate(s for s in strategies if s in bench_labels(case.op)):
        t = (1 + (seed * 7 + i * 13) % 97) * 10.0 ** ((seed + i) % 5 - 2)  # 0.01 .. 9700 ms
        row = dict(base, strategy=s, label=report.display_label(case.op, s, interpreted), status="ok",
                   median_ms=t, p25_ms=0.9 * t, p75_ms=1.1 * t, tflops=123.0 / t, speedup=1.0 + i / 7,
                   speedup_vs_reference=0.5 + i / 5, efficiency=-1.5 + i / 3, plan=PLANS[(seed + i) % len(PLANS)])
        if i == 3 and seed % 4 == 0:
            row.update(status="FAILED", error=f"rank 1: {s} vs reference (out): max |err| 3.1e+00 at [12, 7] beyond "
                       "atol 1.0e-05 + rtol 1.3e-06 x |expected| (the largest of 4096 elements outside: 17)")
        rows.append(row)
    rows.append(dict(base, strategy="(all_gather alone)", context="comm", median_ms=2.5, p25_ms=2.0, p75_ms=3.0,
                     comm_gbps=12.5))
    rows.append(dict(base, strategy="(GEMMs alone)", context="compute", median_ms=1234.5, p25_ms=1000.0,
                     p75_ms=1500.0, compute_tflops=0.05))
    return rows


def default_tables(wide: bool) -> list[tuple[str, list[str], list[dict]]]:
    """(device, the table's lines, its rows) of the default cases on 2 CPU ranks and on 2 and 8 GPUs."""
    from overlap.benchmarks import report
    from overlap.benchmarks.cases import BenchConfig, default_cases
    from overlap.benchmarks.names import BENCH_OPS, MODES

    out = []
    for device, world_size in (("cpu", 2), ("cuda", 2), ("cuda", 8)):
        cases = tuple(c for c in default_cases(BENCH_OPS, device, None, MODES, world_size, [])
                      if not c.world_problem(world_size))
        config = BenchConfig(ops=BENCH_OPS, cases=cases, wide=wide)
        interpreted = device == "cpu"
        table = report.Table(config.cases, config.strategies, interpreted, wide=wide)
        lines, rows = list(table.header()), []
        for i, case in enumerate(config.cases):
            rows_i = fake_rows(case, config.strategies, interpreted, i)
            rows += rows_i
            lines += table.case_lines(case.name, rows_i)
        out.append((f"{device} x{world_size}", lines, rows))
    return out


def test_default_table_fits_120_columns():
    for device, lines, rows in default_tables(wide=False):
        too_wide = [ln for ln in lines if len(ln) > 120]
        assert not too_wide, (device, too_wide[:3])
        assert lines[0] == "case" and lines[1].split() == ["strategy", "median", "ms", "p25..p75", "ms", "TFLOP/s",
                                                           "GB/s", "speedup", "vs", "ref", "ovl", "eff", "plan"]
        # every row under its case: the case's name alone, then one line per row starting with its label
        names = {r["case"] for r in rows}
        assert names <= set(lines), device
        for r in rows:
            label = r.get("label", r["strategy"])
            assert any(ln.startswith(f"  {label} ") for ln in lines), (device, label)
        # a wrapped plan reads back whole from its column (or from below its row)
        for i, ln in enumerate(lines):
            if "symm (shm x2, n" in ln:
                start = ln.index("symm (shm x2, n")
                rest = []
                for nxt in lines[i + 1:]:
                    if nxt[:start].strip():
                        break
                    rest.append(nxt[start:])
                assert " ".join([ln[start:], *rest]) == PLANS[5], (device, lines[i:i + 4])
        assert any("FAILED  rank 1:" in ln for ln in lines), device


def test_wide_table_is_one_line_per_row_with_every_column():
    from overlap.benchmarks.report import Table

    for device, lines, rows in default_tables(wide=True):
        assert lines[0].split()[:2] == ["case", "strategy"] and lines[0].endswith("overlap eff  plan"), lines[0]
        assert len(lines) == 1 + len(rows), device  # the header, then one line per row
        for line, r in zip(lines[1:], rows, strict=True):
            assert line.startswith(r["case"]), (line, r["case"])
            if r.get("status") == "FAILED":
                assert line.endswith(r["error"]), line
            elif r.get("plan"):
                assert line.endswith(f"{r['efficiency']:+.2f}  {r['plan']}"), line
        assert max(map(len, lines)) > 150, device  # the wide form: about 200 columns
    assert Table.HEADS[-2:] == ("overlap eff", "plan")


def test_wide_option_is_parsed_documented_and_reaches_the_run(monkeypatch):
    from overlap.cli import build_parser
    from overlap.cli import ranks as ranks_module

    parser = build_parser()
    assert parser.parse_args(["bench", "--wide"]).wide is True
    assert parser.parse_args(["bench"]).wide is False
    bench = parser._subparsers._group_actions[0].choices["bench"]  # argparse keeps its subparsers there
    help_text = " ".join(bench.format_help().split())
    assert "--wide" in help_text and "at most 120 columns" in help_text, help_text
    from pathlib import Path

    commands = (Path(__file__).resolve().parents[2] / "docs" / "commands.md").read_text()
    assert "`--wide`" in commands and "120 columns" in commands

    seen = {}

    def fake_on_ranks(command, fn, args, nproc, scratch=None):
        seen["config"] = args[0]
        return 1, None  # as if a rank failed: nothing to read back

    monkeypatch.setattr(ranks_module, "on_ranks", fake_on_ranks)
    for argv, wide in ((["--wide"], True), ([], False)):
        assert main(["bench", "--shape", "8x8x8", "--op", "all_gather_matmul", *argv]) == 1
        assert seen["config"].wide is wide, argv


def test_compare_table_fits_120_columns_and_wide_is_one_line_per_row(tmp_path):
    from overlap.benchmarks import compare
    from overlap.cli.bench import after_run

    for device, _, rows in default_tables(wide=False):
        timed = [r for r in rows if "median_ms" in r and r.get("status") != "FAILED"]
        now = {"machine": {"description": "m", "world_size": 2, "device_type": "cpu"}, "results": timed}
        earlier = {**now, "results": [dict(r, median_ms=2 * r["median_ms"]) for r in timed]}
        narrow = compare.compare(earlier, now, "earlier.json")
        table = narrow[1:narrow.index(next(ln for ln in narrow if ln.endswith("(p25..p75 overlap)")))]
        assert table[0] == "case" and max(map(len, table)) <= 120, (device, max(table, key=len))
        wide = compare.compare(earlier, now, "earlier.json", wide=True)
        assert len(wide) == len(narrow) - len({r["case"] for r in timed}) - 1, device  # no case lines, one header
        assert all(ln.startswith(r["case"]) for ln, r in zip(wide[2:], timed, strict=False)), device
        path = tmp_path / "now.json"
        path.write_text(json.dumps(now))
        assert after_run(str(path), earlier, "earlier.json", None) == (["", *narrow], None)
        assert after_run(str(path), earlier, "earlier.json", None, wide=True) == (["", *wide], None)
