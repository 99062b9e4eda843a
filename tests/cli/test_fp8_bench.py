"""fp8 beyond the ops: the bytes the op table and the cost model count for an fp8 problem, the fp8 workloads
(``overlap bench --dtype float8_e4m3fn``: the ``fp8="rowwise"`` recipe on bf16 leaves, its ``torch`` row of casts,
plain collectives of fp8 bytes and ``torch._scaled_mm``; the weight gather's too), and ``overlap tune`` on fp8
shapes (the MoE layer's too). MX (``--dtype mxfp8``): `test_mx_bench`; the MoE layer's fp8 cases:
`test_moe_fp8_bench`."""

from __future__ import annotations

import pytest
import torch

from overlap.benchmarks.cases import OPS, Case, MoECase, default_cases
from overlap.benchmarks.names import MOE_PRESETS
from overlap.cli.tune import parse_model, parse_shape
from overlap.plans import Plan, Problem, costmodel, op_spec, wire_sizes
from overlap.workloads import SeededDraw, leaf_dtype, workload

FP8 = "float8_e4m3fn"
FP8_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fp8_problems_count_fp8_rows_float32_partials_and_a_bf16_backward(world_size):
    W, m, k, n = world_size, 6, 40, 24
    per_peer = {  # bytes one rank receives from each peer, forward / forward and backward
        "all_gather_matmul": (m * (k + 4), m * (k + 4) + 2 * m * k * 2),  # fp8 rows + 4 B scale; again in bf16,
        "matmul_reduce_scatter": (m * n * 4, m * n * 4 + m * n * 2),  # ... plus grad_a's reduce-scatter
        "matmul_all_reduce": (2 * m * n * 4, 2 * m * n * 4),
        # the shard's n columns as fp8 rows of k + 4; backward: the weight again and its gradient, in bf16
        "all_gather_weight_matmul": (n * (k + 4), n * (k + 4) + 2 * k * n * 2),
    }
    for op, (fwd, fwd_bwd) in per_peer.items():
        for backward, want in ((False, fwd), (True, fwd_bwd)):
            p = Problem(op, m, k, n, FP8, backward)
            assert op_spec(op).comm_bytes(p, W) == (W - 1) * want, (op, backward)
    assert wire_sizes(Problem("matmul_reduce_scatter", m, k, n, "bfloat16")) == (2.0, 2.0, 2.0)
    # the MoE layer's dispatch takes fp8 too (its bytes: tests/plans/test_moe_fp8_model.py)
    assert Problem("moe", m, k, n, FP8, experts=4, top_k=2).dtype == FP8


def test_cost_model_halves_the_gather_and_doubles_the_partials_in_fp8():
    """With one profile: the fp8 all-gather's link time is about half of bf16's, the fp8 reduce-scatter's (float32
    partials) twice; the backward (bf16) adds what bf16's adds."""
    topo = costmodel.Topology("cpu", 2, 1, 2, (("shm", 1),))
    profile = costmodel.default_profile("cpu")

    def comm(op, dtype, backward=False):
        return costmodel.predict(Problem(op, 512, 1024, 1024, dtype, backward), Plan("reference"), topo,
                                 profile).comm_s

    ag8, ag16 = comm("all_gather_matmul", FP8), comm("all_gather_matmul", "bfloat16")
    assert 0.45 < ag8 / ag16 < 0.6, (ag8, ag16)
    rs8, rs16 = comm("matmul_reduce_scatter", FP8), comm("matmul_reduce_scatter", "bfloat16")
    assert 1.8 < rs8 / rs16 < 2.1, (rs8, rs16)
    back8 = comm("matmul_reduce_scatter", FP8, True) - rs8
    back16 = comm("matmul_reduce_scatter", "bfloat16", True) - rs16
    assert back8 == pytest.approx(back16, rel=1e-9)


def test_fp8_workloads_draw_bf16_leaves_and_ask_for_the_recipe():
    assert leaf_dtype(torch.float8_e4m3fn) == torch.bfloat16 and leaf_dtype(torch.float16) == torch.float16
    p = Problem("all_gather_matmul", 4, 16, 8, FP8, True)
    inputs = workload(p.op).inputs(p, 2, SeededDraw(3, 0, "cpu", p.torch_dtype))
    assert [t.dtype for t in inputs.leaves] == [torch.bfloat16] * 2 and inputs.options == {"fp8": "rowwise"}
    plain = workload(p.op).inputs(Problem(p.op, 4, 16, 8, "bfloat16"), 2, SeededDraw(3, 0, "cpu", torch.bfloat16))
    assert plain.options == {}


@pytest.mark.parametrize("op", FP8_OPS)
def test_fp8_oracle_multiplies_the_quantized_leaves(op):
    """The forward oracle of an fp8 problem is the float64 product of the leaves as the recipe quantizes them
    (rowwise: per row of ``a``, per column of ``b``, on their owners), within bf16's rounding of it; its
    gradients are the bf16 problem's."""
    W, rank = 3, 1
    p8, p16 = Problem(op, 5, 24, 12, FP8, True), Problem(op, 5, 24, 12, "bfloat16", True)
    draw = SeededDraw(7, 0, "cpu", torch.float8_e4m3fn)
    every = [workload(op).inputs(p8, W, draw.for_rank(q)) for q in range(W)]
    got = workload(op).oracle(p8, every, rank)
    plain = workload(op).oracle(p16, every, rank)

    def quantized(t, dim):  # the amax scale along `dim` (float32, as documented), saturating; then in float64
        scale = t.float().abs().amax(dim=dim, keepdim=True) / 448.0
        return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()

    deq = [type(e)((quantized(e.leaves[0], -1), quantized(e.leaves[1], 0)), e.grad_out) for e in every]
    want = workload(op).oracle(Problem(op, 5, 24, 12, "float64", False), deq, rank)[0].value
    assert got[0].value.dtype == torch.bfloat16
    torch.testing.assert_close(got[0].value.double(), want, rtol=2**-8, atol=1e-6)
    unquantized = plain[0].value.double()
    assert (got[0].value.double() - unquantized).abs().max() > 1e-3  # quantizing changed it: not the bf16 oracle
    for g8, g16 in zip(got[1:], plain[1:], strict=True):
        assert g8.what == g16.what and torch.equal(g8.value, g16.value)


def test_fp8_cases_are_the_tensor_parallel_ops_sequence_first_and_moe():
    case = Case.of("matmul_reduce_scatter", 8, 16, 16, FP8, backward=True)
    assert case.name == "matmul_reduce_scatter 8x16x16 float8_e4m3fn fwd+bwd" and case.problem.dtype == FP8
    assert Case.of("all_gather_weight_matmul", 8, 16, 16, FP8).problem.dtype == FP8  # the weight gather in fp8
    for kwargs in (dict(op="all_gather_matmul", batch=2), dict(op="all_gather_matmul", split=(8, 8))):
        with pytest.raises(ValueError, match="fp8 recipe"):
            Case.of(kwargs.pop("op"), 8, 16, 16, FP8, **kwargs)
    assert MoECase.of(MOE_PRESETS["tiny"][0], FP8).dtype == FP8  # the dispatch's recipe (test_moe_fp8_bench)
    left_out: list[str] = []
    cases = default_cases(OPS + ("moe",), "cpu", FP8, world_size=2, left_out=left_out)
    assert {c.op for c in cases} == {*FP8_OPS, "moe"}
    assert not any(c.batch or c.split for c in cases if c.op != "moe")
    assert all(c.dtype == FP8 for c in cases)
    # the weight gather's layers: the four projections of the preset, and the tiny shape
    layers = {c.layer for c in cases if c.op == "all_gather_weight_matmul"}
    assert layers == {"qkv", "attn-out", "mlp-up", "mlp-down", ""}, layers
    assert not left_out, left_out


CASES = [Case.of(op, m, 24, 16, FP8, backward=backward)
         for op in FP8_OPS for m, backward in ((5, False), (4, True))]


def check_fp8_cases(rank, world_size, seed):
    import torch.distributed as dist

    from overlap import world
    from overlap.benchmarks.cases import BenchConfig
    from overlap.benchmarks.checks import check_case

    pg = dist.group.WORLD
    info = world.group_info(pg, 60.0)
    config = BenchConfig(ops=FP8_OPS, cases=tuple(CASES), strategies=("reference", "pipelined", "symm", "auto"),
                         timeout=60.0, progress=False)
    verdicts = []
    for i, case in enumerate(CASES):
        checked = check_case(case, i, config, seed, info, pg)
        outs = {label: checked.fns[label]() for label in ("torch", "reference")}
        verdicts.append((case.name, checked.labels, checked.failed, checked.plans["torch"],
                         [t.dtype for t in outs["torch"]], [t.dtype for t in outs["reference"]]))
    return verdicts


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp8_cases_pass_their_checks(pools, seed, world_size):
    """``reference`` and the ``torch`` row against the oracle of the quantized leaves (and the bf16 gradients),
    every strategy against ``reference``; outputs and gradients in bf16. The weight gather's shards in fp8 too."""
    for verdicts in pools(world_size).run(check_fp8_cases, seed, timeout=300):
        for name, labels, failed, torch_plan, torch_dtypes, ref_dtypes in verdicts:
            assert labels == ["torch", "reference", "pipelined", "symm", "auto"] and not failed, (name, failed)
            assert torch_plan == "torch.distributed + torch._scaled_mm"
            assert torch_dtypes == ref_dtypes == [torch.bfloat16] * len(ref_dtypes), name


def test_tune_takes_fp8_shapes_and_models():
    p = parse_shape("matmul_all_reduce:8x64x32:float8_e4m3fn:fwd", True)
    assert p == Problem("matmul_all_reduce", 8, 64, 32, FP8, False)
    assert parse_shape("all_gather_weight_matmul:8x64x32:float8_e4m3fn", True).key == \
        "all_gather_weight_matmul:8x64x32:float8_e4m3fn:fwd+bwd"
    assert {q.dtype for q in parse_model("hidden=64,ffn=128,tokens=16,dtype=float8_e4m3fn", 2, True)} == {FP8}
    assert parse_shape("moe:16x32x64:4:2:float8_e4m3fn", False) == Problem("moe", 16, 32, 64, FP8, False, 4, 2)
    moe = [q for q in parse_model("hidden=64,ffn=128,tokens=16,experts=4,topk=2,dtype=float8_e4m3fn", 2, True)
           if q.op == "moe"]
    assert moe == [Problem("moe", 8, 64, 128, FP8, True, 4, 2)], moe
    with pytest.raises(ValueError, match="multiple of 32"):
        parse_shape("moe:16x48x64:4:2:mxfp8", False)
