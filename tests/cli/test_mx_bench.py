"""MX fp8 beyond the ops: ``overlap bench --dtype mxfp8`` (the ``fp8="mxfp8"`` recipe on bf16 leaves, for the
tensor-parallel ops and the weight gather), the bytes the op table and the cost model count for it (``k`` fp8 bytes
and ``k/32`` scale bytes a gathered row, against rowwise's ``k + 4``), its workloads and ``torch`` rows, and
``overlap tune`` on MX shapes: a plan-file key of its own (dtype ``mxfp8``) that the op's call looks up. The
rowwise recipe's counterparts: `test_fp8_bench`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from overlap.benchmarks.cases import OPS, Case, default_cases, preset_cases
from overlap.cli.tune import parse_model, parse_shape
from overlap.ops import fp8 as ops_fp8
from overlap.plans import (
    MX_DTYPE,
    Plan,
    PlanFile,
    Problem,
    costmodel,
    fp8_dtype,
    fp8_granularity,
    gathered_row_bytes,
    op_spec,
    presets,
    wire_sizes,
)
from overlap.plans.optable import MX_BLOCK, torch_dtype
from overlap.workloads import SeededDraw, workload

MX, FP8 = "mxfp8", "float8_e4m3fn"
TP_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul")


# ---- names and bytes ----------------------------------------------------------------------------------------------


def test_mx_is_a_dtype_of_its_own_with_blocks_of_32_along_k():
    assert MX_DTYPE == MX and MX_BLOCK == ops_fp8.MX_BLOCK  # (the table imports no torch: one number, twice)
    assert fp8_dtype("mxfp8") == MX and fp8_dtype("rowwise") == fp8_dtype("tensorwise") == FP8
    assert fp8_granularity(MX) == "mxfp8" and fp8_granularity(FP8) == "rowwise"
    with pytest.raises(ValueError, match="not an fp8 dtype"):
        fp8_granularity("bfloat16")
    assert torch_dtype(MX) == torch.float8_e4m3fn  # its elements
    for op in TP_OPS:
        assert Problem(op, 4, 64, 8, MX).key == f"{op}:4x64x8:mxfp8:fwd"
        with pytest.raises(ValueError, match="multiple of 32"):
            Problem(op, 4, 40, 8, MX)
    assert Problem("moe", 4, 64, 8, MX, experts=4, top_k=2).key.startswith("moe:4x64x8:")  # the dispatch's MX
    with pytest.raises(ValueError, match="multiple of 32"):
        Problem("moe", 4, 40, 8, MX, experts=4, top_k=2)


def test_a_gathered_row_moves_its_fp8_bytes_and_its_scales():
    assert gathered_row_bytes(MX, 64) == 64 + 2 and gathered_row_bytes(MX, 4096) == 4096 + 128
    assert gathered_row_bytes(FP8, 40) == 44 and gathered_row_bytes("bfloat16", 40) == 80
    assert wire_sizes(Problem("all_gather_matmul", 4, 64, 8, MX)) == (1 + 1 / 32, 4.0, 2.0)
    assert wire_sizes(Problem("all_gather_weight_matmul", 4, 64, 8, FP8)) == (1 + 4 / 64, 4.0, 2.0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [FP8, MX])
def test_fp8_problems_count_exact_bytes_with_their_scales(world_size, dtype):
    """Bytes one rank receives, exact integers: a gathered row (of ``a``, or a column of the weight shard) is its
    ``k`` fp8 bytes plus 4 scale bytes (rowwise) or ``k/32`` (MX); reductions move float32 partials; the backward
    bf16. ``k = 96``: ``4/k`` is no binary fraction, the count still exact."""
    W, m, k, n = world_size, 7, 96, 24
    row = k + (k // 32 if dtype == MX else 4)
    per_peer = {  # forward, forward and backward
        "all_gather_matmul": (m * row, m * row + 2 * m * k * 2),  # again in bf16, plus grad_a's reduce-scatter
        "matmul_reduce_scatter": (m * n * 4, m * n * 4 + m * n * 2),
        "matmul_all_reduce": (2 * m * n * 4, 2 * m * n * 4),
        "all_gather_weight_matmul": (n * row, n * row + 2 * k * n * 2),  # the weight again and its gradient, bf16
    }
    for op, (fwd, fwd_bwd) in per_peer.items():
        for backward, want in ((False, fwd), (True, fwd_bwd)):
            p = Problem(op, m, k, n, dtype, backward)
            got = op_spec(op).comm_bytes(p, W)
            assert isinstance(got, int) and got == (W - 1) * want, (op, dtype, backward, got)
            assert Case.of(op, m, k, n, dtype, backward).comm_bytes(W) == got  # the GB/s column's bytes


def test_cost_model_counts_mx_scales_and_mx_gemms_run_where_the_gpu_multiplies_blocks():
    """A scale byte per 32 elements against 4 bytes a row: MX moves fewer bytes than rowwise below ``k = 128``
    and more above, the gather and the weight gather alike. A preset's MX GEMM runs at the FP8 rate on Blackwell
    (block-scaled tensor cores), at the FP32 rate elsewhere (dequantized)."""
    topo = costmodel.Topology("cpu", 2, 1, 2, (("shm", 1),))
    profile = costmodel.default_profile("cpu")

    def comm(op, dtype, k):
        return costmodel.predict(Problem(op, 512, k, 512, dtype), Plan("reference"), topo, profile).comm_s

    for op in ("all_gather_matmul", "all_gather_weight_matmul"):
        assert comm(op, MX, 64) < comm(op, FP8, 64) and comm(op, MX, 256) > comm(op, FP8, 256), op
        assert 0.5 < comm(op, MX, 1024) / comm(op, "bfloat16", 1024) < 0.55, op
    assert comm("matmul_reduce_scatter", MX, 64) == comm("matmul_reduce_scatter", FP8, 64)  # float32 partials
    b200, h100 = presets.profile_of(presets.machine("b200")), presets.profile_of(presets.machine("h100-sxm"))
    assert b200.gemm[MX] == b200.gemm[FP8] and h100.gemm[MX] == h100.gemm["float32"]
    c = presets.cluster("h100-sxm")

    def gemm(dtype):
        p = Problem("all_gather_matmul", 1024, 8192, 3584, dtype)
        return costmodel.predict(p, Plan("reference"), c.topology, c.profile).compute_s

    assert gemm(MX) > gemm("bfloat16") > gemm(FP8)


# ---- workloads ----------------------------------------------------------------------------------------------------


def _mx_dequantized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` quantized in MX blocks of 32 along `dim` (power-of-two scales, rounded up), in float64."""
    x = t.float().movedim(dim, -1)
    blocks = x.unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448.0)))
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()
    return q.flatten(-2).movedim(-1, dim)


@pytest.mark.parametrize("op", TP_OPS)
def test_mx_workloads_ask_for_the_mx_recipe_and_their_oracle_quantizes_blocks(op):
    """An mxfp8 problem's leaves are bf16 and its call passes ``fp8="mxfp8"``; its forward oracle is the float64
    product of the leaves quantized in blocks of 32 along ``k`` on their owners (``a`` along its rows, the weight
    along its columns), within bf16's rounding; its gradients are the bf16 problem's."""
    W, rank = 3, 1
    p8, p16 = Problem(op, 5, 64, 12, MX, True), Problem(op, 5, 64, 12, "bfloat16", True)
    draw = SeededDraw(7, 0, "cpu", p8.torch_dtype)
    every = [workload(op).inputs(p8, W, draw.for_rank(q)) for q in range(W)]
    assert [t.dtype for t in every[0].leaves] == [torch.bfloat16] * 2 and every[0].options == {"fp8": "mxfp8"}
    got = workload(op).oracle(p8, every, rank)
    deq = [type(e)((_mx_dequantized(e.leaves[0], -1), _mx_dequantized(e.leaves[1], 0)), e.grad_out) for e in every]
    want = workload(op).oracle(Problem(op, 5, 64, 12, "float64", False), deq, rank)[0].value
    assert got[0].value.dtype == torch.bfloat16
    torch.testing.assert_close(got[0].value.double(), want, rtol=2**-8, atol=1e-6)
    rowwise = workload(op).oracle(Problem(op, 5, 64, 12, FP8, False), every, rank)[0].value
    assert not torch.equal(got[0].value, rowwise)  # the blocks, not the rows, were quantized
    for g8, g16 in zip(got[1:], workload(op).oracle(p16, every, rank)[1:], strict=True):
        assert g8.what == g16.what and torch.equal(g8.value, g16.value)


# ---- cases --------------------------------------------------------------------------------------------------------


def test_mx_cases_need_k_a_multiple_of_32_and_the_defaults_leave_the_others_out():
    case = Case.of("all_gather_weight_matmul", 8, 64, 16, MX, backward=True)
    assert case.name == "all_gather_weight_matmul 8x64x16 mxfp8 fwd+bwd" and case.torch_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="multiple of 32"):
        Case.of("all_gather_matmul", 8, 40, 16, MX)
    left_out: list[str] = []
    cases = default_cases(OPS + ("moe",), "cpu", MX, world_size=2, left_out=left_out)
    assert {c.op for c in cases} == {*TP_OPS, "moe"} and all(c.dtype == MX and c.problem.k % 32 == 0 for c in cases)
    assert not left_out, left_out  # every default MoE preset's hidden size divides by 32
    # on 8 ranks llama3-8b's mlp-down reduces over 896 / 8 = 112 per rank: left out of the defaults, with the reason
    left_out = []
    cases = default_cases(("matmul_reduce_scatter",), "cpu", MX, world_size=8, left_out=left_out)
    assert not any(c.layer == "mlp-down" and c.preset.startswith("llama3-8b") for c in cases), cases
    assert any(c.layer == "mlp-down" and c.preset == "llama3-70b-decode" for c in cases)  # 1792 / 8 = 7 * 32
    assert "matmul_reduce_scatter llama3-8b/mlp-down: mxfp8 needs k a multiple of 32, got 112" in left_out, left_out
    with pytest.raises(ValueError, match="got 112"):  # asked for by name (--shape): an error
        preset_cases("llama3-8b", "matmul_reduce_scatter", 8, MX)


CASES = [Case.of(op, m, 64, 32, MX, backward=backward) for op in TP_OPS for m, backward in ((4, False), (2, True))]


def check_mx_cases(rank, world_size, seed):
    import torch.distributed as dist

    from overlap import world
    from overlap.benchmarks.cases import BenchConfig
    from overlap.benchmarks.checks import check_case

    pg = dist.group.WORLD
    info = world.group_info(pg, 60.0)
    config = BenchConfig(ops=TP_OPS, cases=tuple(CASES), strategies=("reference", "pipelined", "symm", "auto"),
                         timeout=60.0, progress=False)
    verdicts = []
    for i, case in enumerate(CASES):
        checked = check_case(case, i, config, seed, info, pg)
        outs = {label: checked.fns[label]() for label in ("torch", "reference")}
        checked.fns[checked.work.comm_label]()  # the collectives alone run (fp8 rows packed with their scales)
        verdicts.append((case.name, checked.labels, checked.failed, checked.plans["torch"],
                         [t.dtype for t in outs["torch"]], [t.dtype for t in outs["reference"]],
                         checked.work.comm_bytes))
    return verdicts


def test_mx_cases_pass_their_checks(pools, seed):
    """``reference`` and the ``torch`` row (MX casts, the plain gathers of the fp8 bytes and of the scale bytes,
    ``torch._scaled_mm`` or its dequantized product) against the oracle of the MX-quantized leaves (and the bf16
    gradients), every strategy against ``reference``, on 2 ranks; outputs and gradients in bf16; the GB/s column's
    bytes are the table's."""
    for verdicts in pools(2).run(check_mx_cases, seed, timeout=300):
        for (name, labels, failed, torch_plan, torch_dtypes, ref_dtypes, nbytes), case in zip(verdicts, CASES):
            assert labels == ["torch", "reference", "pipelined", "symm", "auto"] and not failed, (name, failed)
            assert torch_plan == "torch.distributed + torch._scaled_mm"
            assert torch_dtypes == ref_dtypes == [torch.bfloat16] * len(ref_dtypes), name
            assert nbytes == case.comm_bytes(2), name


# ---- tune and plan files ------------------------------------------------------------------------------------------


def test_tune_takes_mx_shapes_and_models():
    p = parse_shape("all_gather_matmul:8x64x32:mxfp8:fwd", True)
    assert p == Problem("all_gather_matmul", 8, 64, 32, MX, False) and ":mxfp8:" in p.key
    assert parse_shape("all_gather_weight_matmul:8x64x32:mxfp8", True).dtype == MX
    with pytest.raises(ValueError, match="multiple of 32"):
        parse_shape("matmul_reduce_scatter:8x40x32:mxfp8", True)
    assert {q.dtype for q in parse_model("hidden=64,ffn=128,tokens=16,dtype=mxfp8", 2, True)} == {MX}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def tune_mx_task(rank, world_size, tmp):
    """`tune` writes an ``mxfp8`` entry; a plan file with an ``mxfp8`` entry and a ``float8_e4m3fn`` one of the same
    shape gives the MX call the first and the rowwise call the second (the log says which)."""
    import overlap
    from overlap.plans import PlanFile, Topology
    from overlap.plans.planfile import Entry
    from overlap.tune.search import tune

    mx = Problem("all_gather_matmul", 16, 64, 32, MX)
    pf, _ = tune([mx], measure=1, repeats=1, warmup=0)
    keys = sorted(pf.entries)
    files = PlanFile.new(Topology("cpu", world_size, 1, world_size, (("shm", world_size - 1),)), world_size)
    for problem, chunks in ((mx, 3), (Problem("all_gather_matmul", 16, 64, 32, FP8), 2)):
        files.add(Entry(problem, Plan("pipelined", num_chunks={"shm": chunks}), 1.0, 2.0, None))
    path = os.path.join(tmp, "plans.json")
    if rank == 0:
        files.save(path)
    torch.distributed.barrier()
    log = logging.getLogger("overlap")
    handler, level = _Capture(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    try:
        chosen = {}
        for recipe in ("mxfp8", "rowwise"):
            handler.lines.clear()
            overlap.all_gather_matmul(a, b, fp8=recipe, plan=path, timeout=60)
            chosen[recipe] = [line for line in handler.lines if "auto chose" in line]
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return keys, chosen


def test_tune_writes_an_mx_key_that_the_mx_call_finds(pools, tmp_path):
    for keys, chosen in pools(2).run(tune_mx_task, str(tmp_path), timeout=300):
        assert keys == ["all_gather_matmul:16x64x32:mxfp8:fwd"], keys
        assert chosen["mxfp8"] and "pipelined[shm=3]" in chosen["mxfp8"][0], chosen
        assert "plan file" in chosen["mxfp8"][0], chosen
        assert chosen["rowwise"] and "pipelined[shm=2]" in chosen["rowwise"][0], chosen


# ---- the command line ---------------------------------------------------------------------------------------------


def _overlap(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m overlap.cli ARGS`` with this interpreter, one torch thread, a deadline."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "overlap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    from overlap.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("command", ["bench", "tune", "predict"])
def test_help_shows_the_fp8_dtypes(capsys, command):
    code, out, _ = _main(capsys, command, "--help")
    text = " ".join(out.split())
    assert code == 0 and "float8_e4m3fn" in text and "mxfp8" in text, out


def test_bench_mxfp8_runs_the_gather_and_the_weight_gather(tmp_path):
    """``overlap bench --dtype mxfp8`` on 2 ranks: both gathers checked and timed; the JSON's rows are mxfp8 and
    the collectives alone move the table's bytes (fp8 bytes and scale bytes)."""
    path = tmp_path / "mx.json"
    proc = _overlap("bench", "--nproc", "2", "--dtype", "mxfp8", "--op", "all_gather_matmul,all_gather_weight_matmul",
                    "--shape", "8x64x32", "--mode", "fwd", "--iters", "2", "--warmup", "0", "--strategies",
                    "reference,symm", "--timeout", "60", "--json", str(path), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(path.read_text())["results"]
    for op, nbytes in (("all_gather_matmul", 8 * 66), ("all_gather_weight_matmul", 32 * 66)):
        case = f"{op} 8x64x32 mxfp8 fwd"
        mine = {r["strategy"]: r for r in rows if r["case"] == case and r.get("status")}
        assert set(mine) == {"torch", "reference", "symm"}, mine
        for r in mine.values():  # GB/s of the collectives alone: the bytes they move
            assert r["status"] == "ok" and r["dtype"] == MX, r
            assert r["comm_gbps"] * r["t_comm_ms"] * 1e6 == pytest.approx(nbytes, rel=1e-9), (case, r)
    bad = _overlap("bench", "--nproc", "2", "--dtype", "mxfp8", "--shape", "8x40x32", "--op", "all_gather_matmul")
    assert bad.returncode == 2 and "multiple of 32" in bad.stderr, bad.stderr


def test_predict_and_tune_machine_take_mx_shapes(capsys, tmp_path, monkeypatch):
    """On a described cluster: an MX GEMM at the FP8 rate on B200, dequantized on H100 (the GEMMs alone take longer
    than bf16's there); ``tune --machine`` writes an ``mxfp8`` entry."""
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    gemms = {}
    for machine in ("b200", "h100-sxm"):
        for dtype in ("bfloat16", MX):
            code, out, err = _main(capsys, "predict", "--machine", machine, "--op", "all_gather_weight_matmul",
                                   "--shape", "4096x8192x3584", "--dtype", dtype, "--mode", "fwd", "--json", "-")
            assert code == 0, err
            (p,) = json.loads(out)["predictions"]
            assert f":{dtype}:fwd" in p["problem"], p
            gemms[machine, dtype] = p["gemm_alone_s"]
    assert gemms["b200", MX] < gemms["b200", "bfloat16"] and gemms["h100-sxm", MX] > gemms["h100-sxm", "bfloat16"]
    out_path = tmp_path / "plans.json"
    code, out, err = _main(capsys, "tune", "--machine", "h100-sxm", "--shape", "all_gather_matmul:1024x8192x3584:mxfp8",
                           "--out", str(out_path))
    assert code == 0, err
    assert list(PlanFile.load(out_path).entries) == ["all_gather_matmul:1024x8192x3584:mxfp8:fwd+bwd"]
