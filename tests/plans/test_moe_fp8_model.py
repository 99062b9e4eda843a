"""The MoE layer in fp8 as the plans layer counts it (``fp8=`` of the dispatch: a `Problem` of op ``moe`` in
``float8_e4m3fn`` or ``mxfp8``): a dispatched row moves as the dispatch packs it (`dispatch_row_bytes`, the
ops' `RowFormat` row), the combine and the backward in the leaves' bf16 (`moe_row_bytes`); the op table's bytes,
the cost model's transfers (flat, ``hierarchical``) and GEMMs (the first at the fp8 rate), and expert migration's
bytes. The benchmark's side: tests/cli/test_moe_fp8_bench.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from overlap.plans import Plan, Problem, costmodel, dispatch_row_bytes, migration, moe_row_bytes, op_spec
from overlap.plans.machine import GemmFit

FP8, MX = "float8_e4m3fn", "mxfp8"


@pytest.mark.parametrize("granularity", ["rowwise", "block128", "mxfp8"])
def test_a_dispatched_row_is_the_ops_packed_row(granularity):
    """`dispatch_row_bytes` (the plans layer imports no op) is `overlap.ops.moe.fp8.RowFormat`'s row on CPU ranks;
    a GPU pads that row to 16 bytes."""
    from overlap.ops.moe.fp8 import RowFormat

    sizes = (32, 64, 96, 128, 224, 4096, 7168) + (() if granularity == "mxfp8" else (1, 30, 130, 200, 257))
    for hidden in sizes:
        got = dispatch_row_bytes(granularity, hidden)
        assert got == RowFormat(granularity, hidden).cols, (granularity, hidden)
        assert RowFormat(granularity, hidden, "cuda").cols == -(-got // 16) * 16, (granularity, hidden)
    with pytest.raises(ValueError, match="granularity"):
        dispatch_row_bytes("tensorwise", 64)


def test_an_fp8_moe_problem_dispatches_packed_rows_and_returns_bf16():
    H = 96
    assert moe_row_bytes(Problem("moe", 8, H, 32, FP8, False, 4, 2)) == (H + 4, 2 * H)
    assert moe_row_bytes(Problem("moe", 8, H, 32, MX, True, 4, 2)) == (H + H // 32, 2 * H)
    assert moe_row_bytes(Problem("moe", 8, H, 32, "bfloat16", False, 4, 2)) == (2 * H, 2 * H)
    assert moe_row_bytes(Problem("moe", 8, H, 32, "float32", False, 4, 2)) == (4 * H, 4 * H)
    assert Problem("moe", 8, H, 32, MX, False, 4, 2).key == "moe:8x96x32:mxfp8:fwd:experts=4:top_k=2"
    with pytest.raises(ValueError, match="multiple of 32"):
        Problem("moe", 8, 48, 32, MX, False, 4, 2)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [FP8, MX])
def test_the_op_table_counts_the_fp8_dispatch_exactly(world_size, dtype):
    """Bytes one rank receives (uniform routing, ``T*K/W`` rows from each peer): the dispatch's packed rows and the
    combine's bf16 rows forward; the backward adds two bf16 transfers. Below the bf16 problem's."""
    W, T, H, F, K = world_size, 64, 96, 32, 2
    rows = T * K // W
    row = H + (H // 32 if dtype == MX else 4)
    spec = op_spec("moe")
    for backward, want in ((False, row + 2 * H), (True, row + 3 * 2 * H)):
        p = Problem("moe", T, H, F, dtype, backward, 4 * W, K)
        assert spec.comm_bytes(p, W) == (W - 1) * rows * want, backward
        bf16 = spec.comm_bytes(Problem("moe", T, H, F, "bfloat16", backward, 4 * W, K), W)
        assert bf16 == (W - 1) * rows * (4 if backward else 2) * 2 * H and spec.comm_bytes(p, W) < bf16


def _profile(fp8_peak: float | None = 4e11):
    profile = costmodel.default_profile("cpu")
    gemm = dict(profile.gemm)
    if fp8_peak is not None:
        gemm[FP8] = GemmFit(fp8_peak, 20e-6)
    return dataclasses.replace(profile, gemm=gemm)


@pytest.mark.parametrize("backward", [False, True])
def test_the_cost_model_moves_the_packed_dispatch_and_runs_the_first_gemm_at_the_fp8_rate(backward):
    """``reference`` on 2 ranks: the transfers cost what bf16's cost less the bytes the packed dispatch saves (its
    backward transfers are bf16's); the GEMMs are the first grouped GEMM at the fp8 fit's rate and the others at
    bf16's. Without an fp8 fit a CPU's GEMM runs at float32's (dequantized)."""
    topo = costmodel.Topology("cpu", 2, 1, 2, (("shm", 1),))
    profile = _profile()
    T, H, F, E, K = 512, 128, 448, 8, 2
    p8, p16 = (Problem("moe", T, H, F, d, backward, E, K) for d in (FP8, "bfloat16"))
    got, bf16 = (costmodel.predict(p, Plan("reference"), topo, profile) for p in (p8, p16))
    rows, bandwidth = T * K / 2, profile.links["shm"]["p2p"].bandwidth_Bps
    assert got.comm_s == pytest.approx(bf16.comm_s - rows * (2 * H - (H + 4)) / bandwidth, rel=1e-12)
    L, flops = E // 2, 2 * T * K * H * F
    first = L * 20e-6 + flops / 4e11
    every = L * profile.gemm["bfloat16"].overhead_s + flops / profile.gemm["bfloat16"].peak_flops
    assert got.compute_s == pytest.approx(first + (5 if backward else 1) * every, rel=1e-12)
    assert bf16.compute_s == pytest.approx((6 if backward else 2) * every, rel=1e-12)
    dequantized = costmodel.predict(p8, Plan("reference"), topo, _profile(None)).compute_s
    f32 = profile.gemm["float32"]
    assert dequantized == pytest.approx(L * f32.overhead_s + flops / f32.peak_flops + (5 if backward else 1) * every)
    for plan in (Plan("pipelined", (("shm", 2),)), Plan("symm")):  # the overlapped pipelines move fewer bytes too
        got, bf16 = (costmodel.predict(p, plan, topo, profile) for p in (p8, p16))
        assert got.comm_s < bf16.comm_s and math.isfinite(got.total_s), plan


def test_hierarchical_and_migration_count_the_packed_dispatch():
    """Across 2 nodes of 2 CPU ranks: ``hierarchical``'s transfers move fewer bytes in fp8; expert migration's pair
    bytes are the packed rows to the expert, the bf16 rows back (and the backward's), the weights in bf16."""
    topo = costmodel.Topology("cpu", 4, 2, 2, (("shm", 1), ("network", 2)))
    profile = costmodel.default_profile("cpu")
    T, H, F, E, K = 256, 128, 64, 8, 2
    for backward in (False, True):
        p8, p16 = (Problem("moe", T, H, F, d, backward, E, K) for d in (MX, "bfloat16"))
        got, bf16 = (costmodel.predict(p, Plan("hierarchical"), topo, profile) for p in (p8, p16))
        assert got.comm_s < bf16.comm_s and math.isfinite(got.total_s), backward
        rows, passes = 10.0, 2 if backward else 1
        tokens, weights = migration.pair_bytes(p8, rows)
        assert tokens == rows * (H + H // 32 + (2 * passes - 1) * 2 * H)
        assert weights == 2 * passes * H * F * 2 == migration.pair_bytes(p16, rows)[1]
        assert migration.pair_bytes(p16, rows)[0] == 2 * passes * rows * H * 2
    # every expert's rows from the other node (experts 0-3 live on node 0), far more than F: worth migrating
    loads = tuple((0.0, 200.0) if e < 4 else (200.0, 0.0) for e in range(E))
    slow = dataclasses.replace(profile, links={**profile.links, "network": {"p2p": costmodel.LinkFit(150e-6, 1e6)}})
    assert migration.choose_migration(Problem("moe", T, H, F, FP8, False, E, K), slow, topo, loads)
