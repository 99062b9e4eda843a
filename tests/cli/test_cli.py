"""The ``overlap`` command, run as a user runs it: in a subprocess, with a deadline on each run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

from overlap import world

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul")
MODES = ("fwd", "fwd+bwd")
MOE_GRADS = ("grad_x", "grad_w1", "grad_w2", "grad_topk_weights")
STRATEGY_LABELS = ("torch", "reference", "pipelined", "symm", "fused (interpreted)", "auto")
ONE_SHOT_LABELS = ("pipelined+one_shot", "symm+one_shot", "fused+one_shot (interpreted)")


def labels_of(op: str) -> tuple[str, ...]:
    """The strategy labels a default ``--strategies`` runs for `op` at a tiny shape on CPU ranks."""
    return STRATEGY_LABELS + (ONE_SHOT_LABELS if op == "matmul_all_reduce" else ())


def table(stdout: str) -> str:
    """The table of ``overlap bench``'s `stdout` one line per row, ``case  strategy  columns`` (``--wide``'s form),
    from its default form: each case's name on a line of its own, its rows below it indented by two spaces (a plan
    wrapped onto lines indented further, left out here)."""
    out, case = [], None
    for line in stdout.splitlines():
        if re.match(r"  \S", line) and case is not None:
            out.append(f"{case}  {line.strip()}")
        elif line and not line[0].isspace():
            case = line
            out.append(line)
    return "\n".join(out)


def result_lines(stdout: str, case: str, label: str) -> list[str]:
    """The table lines of `case` (``"op MxKxN dtype mode"``) and strategy `label` that carry a time."""
    return [ln for ln in table(stdout).splitlines() if re.match(rf"{re.escape(case)}\s+{re.escape(label)}\s+\d", ln)]


def overlap_cmd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m overlap.cli ARGS`` with this interpreter, one torch thread, a deadline."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_info_two_ranks():
    proc = overlap_cmd("info", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "torch " in out and "triton" in out and "overlap._C" in out and "TRITON_INTERPRET" in out, out
    assert "backend: gloo" in out, out
    rank_rows = [line.split() for line in out.splitlines() if re.match(r"^[01]\s+\d+\s", line)]
    assert sorted(row[0] for row in rank_rows) == ["0", "1"], out
    assert len({row[1] for row in rank_rows}) == 2, f"two ranks need two pids:\n{out}"
    # The link matrix: 0 -> 1 and 1 -> 0 are both shared memory on CPU ranks of one node.
    matrix = [line.split() for line in out.splitlines() if re.match(r"^\s*[01]\s+(-|shm)\s+(-|shm)\s*$", line)]
    assert matrix == [["0", "-", "shm"], ["1", "shm", "-"]], out


def test_bench_every_op_and_mode_with_json(tmp_path):
    """The defaults at a tiny shape: every op, forward and forward+backward, every strategy label."""
    path = tmp_path / "bench.json"
    args = ("--shape", "16x24x8", "--iters", "3", "--warmup", "1", "--json", str(path), "--timeout", "60")
    proc = overlap_cmd("bench", "--nproc", "2", *args, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for op in OPS:
        for mode in MODES:
            for label in labels_of(op):
                lines = result_lines(proc.stdout, f"{op} 16x24x8 float32 {mode}", label)
                assert len(lines) == 1, f"want one line for {op} {mode} {label}:\n{proc.stdout}"
    assert "symm+one_shot" not in proc.stdout.split("matmul_all_reduce")[0], proc.stdout  # not for other ops
    for scope in ("fwd", "fwd+bwd", "all"):
        line = rf"geomean speedup over torch, {re.escape(scope)}: reference .* auto "
        assert re.search(line, proc.stdout), proc.stdout
    slower = (r"^auto slower than torch beyond max\(10%, half the wider p25..p75 spread\) in "
              rf"\d+ of {2 * len(OPS)} case\(s\)")
    assert re.search(slower, proc.stdout, re.M), proc.stdout
    assert "machine: CPU" in proc.stdout and "note: fwd+bwd:" in proc.stdout, proc.stdout
    assert "[1/8] all_gather_matmul 16x24x8 float32 fwd:" in proc.stderr, proc.stderr
    assert "[6/8] matmul_all_reduce 16x24x8 float32 fwd+bwd:" in proc.stderr, proc.stderr
    assert "[8/8] all_gather_weight_matmul 16x24x8 float32 fwd+bwd:" in proc.stderr, proc.stderr
    assert re.search(r"^cases: all 8 ran$", proc.stdout, re.M), proc.stdout
    assert proc.stdout.splitlines()[-1] == f"wrote {path}", proc.stdout  # as demo and tune say what they wrote

    data = json.loads(path.read_text())
    assert data["cases"] == {"ran": 8, "asked": 8}, data["cases"]
    assert data["machine"]["world_size"] == 2 and data["machine"]["backend"] == "gloo"
    assert data["config"]["ops"] == list(OPS) and data["config"]["modes"] == list(MODES)
    rows = {(r["op"], r["mode"], r["strategy"]): r for r in data["results"]}
    assert len(rows) == len(data["results"]), "one row per op, mode and strategy"
    for op in OPS:
        for mode in MODES:
            strategies = [label.removesuffix(" (interpreted)") for label in labels_of(op)]
            for s in strategies:
                r = rows[(op, mode, s)]
                assert r["status"] == "ok", r
                assert r["speedup"] > 0 and r["median_ms"] > 0 and len(r["times_ms"]) == 3, r
                assert (r["m"], r["k"], r["n"], r["backward"]) == (16, 24, 8, mode == "fwd+bwd"), r
                want = {"out", "grad_a", "grad_b"} if mode == "fwd+bwd" else {"out"}
                assert set(r["tolerance"]) == want, r  # the gradients are checked too
            assert rows[(op, mode, "torch")]["speedup"] == 1.0
            assert rows[(op, mode, "reference")]["speedup_vs_reference"] == 1.0
            assert rows[(op, mode, "torch")]["plan"] == "torch.distributed + torch.matmul"
            assert rows[(op, mode, "symm")]["plan"] == "symm (shm x1)"
            assert rows[(op, mode, "auto")]["plan"].startswith("symm (shm x1"), rows[(op, mode, "auto")]  # CPU ranks
            fused = rows[(op, mode, "fused")]
            assert fused["interpreted"] and not fused["in_summary"], fused
            assert rows[(op, mode, "symm")]["in_summary"]
            here = [r for r in data["results"] if (r["op"], r["mode"]) == (op, mode)]
            context = {r["context"]: r for r in here if "context" in r}
            assert set(context) == {"comm", "compute"}, context
            assert context["comm"]["median_ms"] > 0 and context["compute"]["median_ms"] > 0
    assert rows[("matmul_all_reduce", "fwd", "symm+one_shot")]["plan_fields"] == {"one_shot": True}
    assert rows[("all_gather_matmul", "fwd", "(all_gather alone)")]["context"] == "comm"
    assert rows[("matmul_reduce_scatter", "fwd", "(reduce_scatter alone)")]["context"] == "comm"
    assert rows[("matmul_all_reduce", "fwd", "(all_reduce alone)")]["context"] == "comm"
    assert rows[("all_gather_matmul", "fwd+bwd", "(comm alone)")]["context"] == "comm"
    assert rows[("matmul_reduce_scatter", "fwd+bwd", "(GEMMs alone)")]["context"] == "compute"

    summary = data["summary"]  # interpreted fused is left out; reference and auto are in (over torch)
    assert set(summary) == {"reference", "pipelined", "symm", "auto", "pipelined+one_shot", "symm+one_shot"}, summary
    cases = 2 * len(OPS)  # every TP op, fwd and fwd+bwd
    assert summary["symm"]["cases"] == cases and summary["symm"]["by_mode"]["fwd+bwd"]["cases"] == len(OPS), summary
    assert summary["symm+one_shot"]["cases"] == 2, summary
    assert summary["auto"]["cases"] == cases and summary["auto"]["geomean_speedup_vs_reference"] > 0, summary
    slower = data["auto_vs_torch"]
    assert slower["compared"] == cases and slower["slower"] == len(slower["cases"]), slower


def test_bench_op_mode_strategy_selection():
    """--op repeated and comma-separated, one --mode, a variant label that applies to one op only."""
    proc = overlap_cmd(
        "bench",
        "--nproc",
        "2",
        "--op",
        "matmul_all_reduce",
        "--op",
        "all_gather_matmul,matmul_all_reduce",
        "--mode",
        "fwd+bwd",
        "--shape",
        "8x16x8",
        "12x8x16",
        "--dtype",
        "bfloat16",
        "--strategies",
        "symm+one_shot,pipelined",
        "--iters",
        "1",
        "--warmup",
        "0",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = re.findall(r"^\[\d+/(\d+)\] (.*):", proc.stderr, re.M)
    assert [case for _, case in progress] == [
        "all_gather_matmul 8x16x8 bfloat16 fwd+bwd",
        "all_gather_matmul 12x8x16 bfloat16 fwd+bwd",
        "matmul_all_reduce 8x16x8 bfloat16 fwd+bwd",
        "matmul_all_reduce 12x8x16 bfloat16 fwd+bwd",
    ], proc.stderr
    for shape in ("8x16x8", "12x8x16"):
        for op, labels in (
            ("all_gather_matmul", ("torch", "reference", "pipelined")),
            ("matmul_all_reduce", ("torch", "reference", "pipelined", "symm+one_shot")),
        ):
            case = f"{op} {shape} bfloat16 fwd+bwd"
            for label in labels:
                assert len(result_lines(proc.stdout, case, label)) == 1, f"{case} {label}:\n{proc.stdout}"
            assert not result_lines(proc.stdout, case, "symm"), proc.stdout  # not asked for
            assert not result_lines(proc.stdout, case, "auto"), proc.stdout
    assert "matmul_reduce_scatter" not in proc.stdout and " fwd " not in proc.stdout, proc.stdout
    assert re.search(r"geomean speedup over torch, fwd\+bwd: .*symm\+one_shot \S+x \(2\)", proc.stdout)
    assert "over torch, all:" not in proc.stdout, proc.stdout  # one mode: no overall line


def test_bench_rank_error_exits_1(tmp_path):
    """An exception on the ranks reaches stderr with its traceback, and the exit code is 1. (A bad variable is
    caught before the ranks start, exit 2: `tests/cli/test_config_errors.py`; a plan file of another topology is
    found only on the ranks, which know their topology.)"""
    from overlap.plans import PlanFile

    plans = tmp_path / "plans.json"
    PlanFile(topology="cpu:nodes=1:ranks=3:links=shm*1", world_size=3).save(plans)
    env = dict(os.environ, OMP_NUM_THREADS="1", OVERLAP_PLAN=str(plans))
    proc = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "bench", "--nproc", "2", "--shape", "8x8x8", "--iters", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "overlap bench: rank" in proc.stderr and "Traceback" in proc.stderr, proc.stderr
    assert f"plan file {plans} was tuned on topology" in proc.stderr, proc.stderr


def test_bench_json_folder_missing_exits_2(tmp_path):
    proc = overlap_cmd("bench", "--json", str(tmp_path / "missing" / "out.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
    assert "overlap bench" in proc.stderr, proc.stderr  # the usage of the subcommand


_WRONG_SYMM = """
    import sys
    import torch.distributed as dist
    from overlap.cli import main
    from overlap.ops.tp import all_gather_matmul as module

    right = module.all_gather_matmul

    def wrong(a, b, *args, strategy="auto", **kwargs):
        out = right(a, b, *args, strategy=strategy, **kwargs)
        # Wrong on one rank only: every rank must still agree not to time it.
        if strategy == "symm" and dist.get_rank() == 1:
            out[0, 0] += 1.0
        return out

    module.all_gather_matmul = wrong  # where the benchmark's calls look the op up (overlap.workloads.tp)
    sys.exit(main(["bench", "--op", "all_gather_matmul", "--mode", "fwd", "--shape", "16x8x8",
                   "--strategies", "reference,symm,pipelined", "--warmup", "0", "--iters", "2", "--timeout", "30"]))
"""


# The output is right, the gradient of a is not: (a - a.detach()).sum() is 0 with gradient 1.
_WRONG_GRAD = _WRONG_SYMM.replace("out[0, 0] += 1.0", "out = out + (a - a.detach()).sum()").replace(
    '"--mode", "fwd"', '"--mode", "fwd+bwd"'
)


def _run_torchrun(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "wrong_symm.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(world.free_port())  # torchrun's --master-port 0 hangs its workers' rendezvous
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    return proc


def test_bench_mismatch_under_torchrun_fails(tmp_path):
    """A wrong strategy is reported FAILED and the command exits 1 (ranks started by torchrun, in place)."""
    proc = _run_torchrun(tmp_path, _WRONG_SYMM)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    rows = table(proc.stdout)  # one line per row
    assert re.search(r"16x8x8 float32 fwd\s+symm\s+FAILED\s+rank 1: symm vs reference \(out\)", rows), (
        proc.stdout
    )
    assert re.search(r"16x8x8 float32 fwd\s+pipelined\s+\d", rows), proc.stdout
    assert "did not match reference" in proc.stderr, proc.stderr


_WRONG_TORCH = """
    import sys

    import torch.distributed as dist

    from overlap.benchmarks import case_data
    from overlap.cli import main

    right = case_data.torch_call

    def wrong(op, group, *args):
        fn = right(op, group, *args)

        def call(*leaves):
            out = fn(*leaves)
            return out + 1.0 if dist.get_rank() == 0 else out  # wrong on one rank: every rank must agree

        return call

    case_data.torch_call = wrong  # where the case's data builds its torch row
    sys.exit(main(["bench", "--op", "matmul_all_reduce", "--mode", "fwd", "--shape", "16x8x8",
                   "--strategies", "reference,symm", "--warmup", "0", "--iters", "2", "--timeout", "30"]))
"""


def test_bench_torch_row_is_checked_against_the_oracle(tmp_path):
    """The torch row is checked against the op's result computed locally, like reference: a wrong one fails."""
    proc = _run_torchrun(tmp_path, _WRONG_TORCH)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    rows = table(proc.stdout)  # one line per row
    case = "matmul_all_reduce 16x8x8 float32 fwd"
    assert re.search(rf"{case}\s+torch\s+FAILED\s+rank 0: torch vs the local matmul_all_reduce \(out\)", rows), (
        proc.stdout)
    assert re.search(rf"{case}\s+symm\s+\d", rows), proc.stdout  # the others are still checked and timed


def test_bench_gradient_mismatch_fails(tmp_path):
    """fwd+bwd checks the gradients too: a right output with a wrong grad_a fails the strategy."""
    proc = _run_torchrun(tmp_path, _WRONG_GRAD)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    rows = table(proc.stdout)  # one line per row
    assert re.search(r"16x8x8 float32 fwd\+bwd\s+symm\s+FAILED\s+rank 1: symm vs reference \(grad_a\)", rows), (
        proc.stdout
    )
    assert re.search(r"16x8x8 float32 fwd\+bwd\s+pipelined\s+\d", rows), proc.stdout


# ----------------------------------------------------------------------------------------------
# The MoE layer (op "moe")
# ----------------------------------------------------------------------------------------------


def test_moe_presets_keep_real_proportions():
    """The CPU presets are the real models at 1/32 width, top-k kept (DeepSeek-V3's experts cut to 32),
    the GPU ones the real widths; the defaults for CPU ranks are those presets plus one tiny enough
    for interpreted fused, in both modes."""
    from overlap.benchmarks.cases import MOE_PRESETS, MoEShape, default_cases

    mixtral, deepseek = MOE_PRESETS["mixtral"][0], MOE_PRESETS["deepseek-v3"][0]
    assert (mixtral.hidden * 32, mixtral.ffn * 32, mixtral.experts, mixtral.top_k) == (4096, 14336, 8, 2)
    assert (deepseek.hidden * 32, deepseek.ffn * 32, deepseek.experts, deepseek.top_k) == (7168, 2048, 32, 8)
    assert MOE_PRESETS["mixtral-full"][0] == MoEShape(4096, 4096, 14336, 8, 2)
    assert MOE_PRESETS["deepseek-v3-full"][0] == MoEShape(4096, 7168, 2048, 256, 8)
    cases = default_cases("moe", "cpu")
    assert [(c.preset, c.mode) for c in cases] == [(p, m) for p in ("mixtral", "deepseek-v3", "tiny") for m in MODES], (
        cases
    )
    assert [c.fits_interpreted_fused for c in cases] == [False] * 4 + [True] * 2
    assert {c.dims.experts % 2 for c in cases} == {0}  # every default runs on 2 ranks
    assert all(c.preset.endswith("-full") for c in default_cases("moe", "cuda"))


def test_moe_shape_arguments():
    """--shape takes MxKxN for the tensor-parallel ops and T,H,F,E,K or a preset for moe, in one list."""
    from overlap.benchmarks.cases import MoEShape
    from overlap.cli import build_parser

    args = build_parser().parse_args(["bench", "--shape", "Mixtral", "16x8x8", "24,16,40,4,2"])
    assert args.shape == [(MoEShape(512, 128, 448, 8, 2), "mixtral"), (16, 8, 8), (MoEShape(24, 16, 40, 4, 2), "")]


def test_bench_moe_every_strategy_with_json(tmp_path):
    """The MoE layer end to end on 2 CPU ranks at a tiny shape: both modes, every strategy (fused
    interpreted), gradients of all four inputs checked, the transfers and GEMMs alone for context."""
    path = tmp_path / "moe.json"
    args = ("--op", "moe", "--shape", "24,16,40,4,2", "--iters", "2", "--warmup", "1", "--json", str(path))
    proc = overlap_cmd("bench", "--nproc", "2", *args, "--timeout", "60", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in MODES:
        case = f"moe 24,16,40,4,2 float32 {mode}"
        for label in STRATEGY_LABELS:
            assert len(result_lines(proc.stdout, case, label)) == 1, f"want one line for {case} {label}:\n{proc.stdout}"
        alone = "(all_to_alls alone)" if mode == "fwd" else "(comm alone)"
        for label in (alone, "(GEMMs alone)"):
            assert len(result_lines(proc.stdout, case, label)) == 1, f"{case} {label}:\n{proc.stdout}"
        assert re.search(rf"note: {re.escape(case)}: routed rows per rank max/mean \d", proc.stdout), proc.stdout
    assert "all_gather_matmul" not in proc.stdout and "one_shot" not in proc.stdout, proc.stdout
    assert "note: moe: one MoE layer's experts" in proc.stdout, proc.stdout
    assert "[2/2] moe 24,16,40,4,2 float32 fwd+bwd: torch, reference, pipelined, symm, fused, auto" in proc.stderr, (
        proc.stderr)

    data = json.loads(path.read_text())
    assert data["config"]["ops"] == ["moe"] and data["config"]["cases"][0]["dims"]["experts"] == 4
    rows = {(r["mode"], r["strategy"]): r for r in data["results"]}
    for mode in MODES:
        for s in ("torch", "reference", "pipelined", "symm", "fused", "auto"):
            r = rows[(mode, s)]
            assert r["status"] == "ok" and r["speedup"] > 0 and r["median_ms"] > 0, r
            assert (r["tokens"], r["hidden"], r["ffn"], r["experts"], r["top_k"]) == (24, 16, 40, 4, 2), r
            want = {"out", *MOE_GRADS} if mode == "fwd+bwd" else {"out"}
            assert set(r["tolerance"]) == want, r  # the gradients of x, w1, w2 and topk_weights are checked
        assert rows[(mode, "fused")]["interpreted"] and not rows[(mode, "fused")]["in_summary"]
        context = {r["context"]: r for r in data["results"] if r["mode"] == mode and "context" in r}
        assert context["comm"]["comm_gbps"] > 0 and context["compute"]["compute_tflops"] > 0, context
    assert set(data["summary"]) == {"reference", "pipelined", "symm", "auto"}, data["summary"]
    assert data["summary"]["symm"]["by_family"]["moe"]["cases"] == 2, data["summary"]


def test_bench_moe_experts_must_split_over_ranks():
    """Given MoE cases whose experts do not split evenly over the ranks: a one-line usage error before any rank
    starts (exit 2), as overlap tune and overlap demo give."""
    proc = overlap_cmd("bench", "--nproc", "3", "--op", "moe", "--shape", "8,8,8,4,2", "--iters", "1", timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == ("overlap bench: error: --shape: cannot run on 3 ranks: moe 8,8,8,4,2 "
                                            "float32: 4 experts do not split evenly over 3 ranks"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr


def test_bench_counts_the_default_cases_left_out():
    """Default cases that do not fit the ranks are left out with a note, and the last line counts them."""
    proc = overlap_cmd("bench", "--ranks", "3", "--op", "matmul_all_reduce", "--mode", "fwd", "--strategies",
                       "reference", "--iters", "1", "--warmup", "0", "--timeout", "60", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # the Llama-3 presets' matmul_all_reduce layers (2 each: training, two decode steps, a short prompt) do not
    # split over 3 ranks; the tiny shape does
    for preset in ("llama3-8b", "llama3-8b-decode", "llama3-70b-decode", "llama3-8b-prefill"):
        assert f"note: left out: {preset}: heads" in proc.stdout, proc.stdout
    last = "cases: 1 of 9 ran; 8 left out on these ranks (the notes above say why)"
    assert proc.stdout.splitlines()[-1] == last, proc.stdout


_WRONG_MOE = """
    import sys
    import torch.distributed as dist
    import overlap
    from overlap.cli import main

    right_dispatch, right_combine = overlap.moe.dispatch_grouped_matmul, overlap.moe.grouped_matmul_combine

    def wrong_dispatch(x, topk_idx, w1, *args, strategy="auto", **kwargs):
        h, handle = right_dispatch(x, topk_idx, w1, *args, strategy=strategy, **kwargs)
        if strategy == "symm" and dist.get_rank() == 1:
            h = h + (w1 - w1.detach()).sum()  # the same h, a wrong gradient of w1
        return h, handle

    def wrong_combine(h, w2, topk_weights, handle, *args, strategy="auto", **kwargs):
        y = right_combine(h, w2, topk_weights, handle, *args, strategy=strategy, **kwargs)
        if strategy == "pipelined" and dist.get_rank() == 1:
            y = y + 1e-3  # a wrong output, on one rank only: every rank must still agree not to time it
        return y

    # where the benchmark's calls look the ops up (overlap.workloads.moe)
    overlap.ops.moe.dispatch.dispatch_grouped_matmul = wrong_dispatch
    overlap.ops.moe.combine.grouped_matmul_combine = wrong_combine
    sys.exit(main(["bench", "--op", "moe", "--mode", "fwd+bwd", "--shape", "16,8,12,4,2",
                   "--strategies", "reference,pipelined,symm", "--warmup", "0", "--iters", "2", "--timeout", "30"]))
"""


def test_bench_moe_mismatch_fails(tmp_path):
    """A wrong MoE output or a wrong expert-weight gradient fails its strategy; reference is still timed."""
    proc = _run_torchrun(tmp_path, _WRONG_MOE)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    rows = table(proc.stdout)  # one line per row
    case = re.escape("moe 16,8,12,4,2 float32 fwd+bwd")
    assert re.search(rf"{case}\s+pipelined\s+FAILED\s+rank 1: pipelined vs reference \(out\)", rows), proc.stdout
    assert re.search(rf"{case}\s+symm\s+FAILED\s+rank 1: symm vs reference \(grad_w1\)", rows), proc.stdout
    assert re.search(rf"{case}\s+reference\s+\d", rows), proc.stdout
    assert "did not match reference" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------------
# overlap tune, overlap info --probe
# ----------------------------------------------------------------------------------------------


def test_tune_two_ranks_end_to_end(tmp_path):
    """``overlap tune`` on 2 CPU ranks: progress, predicted against measured, a plan file that `auto` reads."""
    out = tmp_path / "plans.json"
    env_cache = dict(OVERLAP_CACHE_DIR=str(tmp_path / "cache"))
    os.environ.update(env_cache)
    try:
        proc = overlap_cmd("tune", "--nproc", "2", "--shape", "all_gather_matmul:64x128x128",
                           "--model", "hidden=64,ffn=128,tokens=64,experts=4,topk=2", "--probe", "quick",
                           "--repeats", "2", "--measure", "2", "--out", str(out), timeout=240)
    finally:
        for k in env_cache:
            os.environ.pop(k, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\[#+\] +\d+% \d+/\d+ done", proc.stderr), proc.stderr[-2000:]  # the progress bar ends full
    assert "checking reference (" in proc.stderr, proc.stderr[-2000:]  # names the candidate at hand
    # plans written as overlap bench writes them (symm (shm x1)), never as in signatures (symm[shm=1])
    assert not re.search(r"\b(reference|pipelined|symm|fused|hierarchical)\[", proc.stdout + proc.stderr), proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if re.match(r"^(all_gather_matmul|matmul_reduce_scatter|moe):", ln)]
    keys = [r.split()[0] for r in rows]
    assert len(keys) == len(set(keys)) == 4, proc.stdout  # the model's 3 problems + 1 shape, none twice
    for r in rows:
        assert re.search(r"\d+\.\d+ms\s+\d+\.\d+ms\s+\d+\.\d+ms\s+\d+\.\d+x$", r), r  # predicted measured ref
    assert "model error" in proc.stdout and f"wrote {out}" in proc.stdout, proc.stdout

    from overlap.plans import PlanFile

    pf = PlanFile.load(out)
    assert set(pf.entries) == set(keys) and pf.profile is not None
    assert pf.topology == "cpu:nodes=1:ranks=2:links=shm*1", pf.topology
    for e in pf.entries.values():
        assert e.measured_s is not None and e.reference_s is not None and e.measured_s <= e.reference_s


def test_tune_model_that_does_not_fit_the_ranks_exits_2(tmp_path):
    """A one-line usage error before any rank starts, as overlap bench's cases and overlap demo's model."""
    proc = overlap_cmd("tune", "--nproc", "2", "--model", "hidden=63,ffn=128,tokens=64", "--probe", "none",
                       "--out", str(tmp_path / "p.json"), timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.splitlines()[-1] == ("overlap tune: error: --model: hidden (63) must divide by the "
                                            "tensor-parallel size 2 (the ranks)"), proc.stderr[-2000:]
    assert not (tmp_path / "p.json").exists()


def test_info_probe_prints_the_profile(tmp_path):
    os.environ["OVERLAP_CACHE_DIR"] = str(tmp_path)
    try:
        proc = overlap_cmd("info", "--nproc", "2", "--probe", "--quick", timeout=180)
    finally:
        os.environ.pop("OVERLAP_CACHE_DIR", None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^shm\s+p2p\s+[\d.]+\s+[\d.]+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^shm\s+copy\s+[\d.]+\s+[\d.]+", proc.stdout, re.M), proc.stdout
    assert "interference" in proc.stdout and "float32" in proc.stdout, proc.stdout
