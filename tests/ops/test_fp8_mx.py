"""MXFP8 (OCP MX: 1x32 blocks along k, e8m0 scales) in the TP ops: `overlap.quantize_fp8(x, "mxfp8")`, the scaled GEMM
with block scales, the packed rows an MX gather moves (each row's ``k`` fp8 bytes, then its ``k / 32`` scale bytes),
the fused kernels' K loop that scales every 32-wide block, the three ops on MX operands (every strategy, against a
float64 oracle of the dequantized inputs), the recipe ``fp8="mxfp8"`` (forward: that oracle of the inputs quantized as
the ranks quantize them; backward: the op without fp8), and bad MX scales raising on every rank.

The oracle: every rank regenerates every rank's inputs from the seed, quantizes them as the ranks do, and computes
in float64 from the dequantized values: ``y_r = cat_s(deq(a_s), dim) @ deq(b_r)`` (gather),
``chunk(sum_s deq(a_s) @ deq(b_s), W, dim)[r]`` (scatter), the whole sum (all-reduce). Inputs vary in magnitude from
block to block (factors 2^-6 ... 2^6), so a block multiplied by another block's scale is off by far more than the
tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import overlap
from overlap.ops import fp8 as fp8s
from overlap.ops.tp.operands import Packed
from tests.support import nodes
from tests.support.tp_oracle import compare, expect_error

K = 64  # two MX blocks
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


def _blocky(gen: torch.Generator, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """``randn(shape)`` (last dim a multiple of 32) with every 32-wide block along the last dim scaled by its own
    power of two in ``2^-6 ... 2^6``."""
    *lead, k = shape
    x = torch.randn(shape, generator=gen)
    f = torch.exp2(torch.randint(-6, 7, (*lead, k // 32, 1), generator=gen).float())
    return (x.reshape(*lead, k // 32, 32) * f).reshape(shape).to(dtype)


def _mx(x: torch.Tensor):
    return overlap.quantize_fp8(x, "mxfp8")


def _mxw(w: torch.Tensor):
    """A weight ``w`` ``[n, k]`` as the ops take it: ``b = w.t()`` ``[k, n]`` and its MX scale ``[k/32, n]``."""
    wq, s = _mx(w)
    return wq.t(), s.t()


def _deq(x8, s, blocks_along=-1):
    return fp8s.dequantize(x8, s, blocks_along).double()


def _deqw(b8, s):
    return _deq(b8, s, 0)


# ----------------------------------------------------------------------------------------------
# quantize_fp8 "mxfp8", the scaled GEMM, the packed rows (one process)
# ----------------------------------------------------------------------------------------------


def test_mx_quantize_round_trips_within_half_an_e4m3_ulp(seed):
    gen = torch.Generator().manual_seed(seed)
    x = _blocky(gen, (3, 5, 96)) * torch.logspace(-3, 3, 96)
    x[1, 2, 32:64] = 0  # an all-zero block
    x[2, 0, :32] = torch.finfo(torch.float32).tiny * torch.randn(32, generator=gen)  # a block of tiny values
    q, s = overlap.quantize_fp8(x, "mxfp8")
    assert q.dtype == E4M3 and s.dtype == E8M0 and q.shape == x.shape and s.shape == (3, 5, 3)
    sf = s.float()
    # scales are powers of two, in e8m0's range
    assert bool((sf > 0).all()) and torch.equal(torch.exp2(torch.log2(sf).round()), sf)
    fmax = torch.finfo(E4M3).max
    blocks = x.reshape(3, 5, 3, 32)
    amax = blocks.abs().amax(dim=-1)
    # no overflow: every block's amax fits after scaling; and the scale is the smallest power of two that does (where
    # the block is not below e8m0's smallest useful scale)
    assert bool((q.float().isfinite()).all()) and bool((q.float().abs() <= fmax).all())
    assert bool((amax <= fmax * sf).all())
    normal = amax > 2.0**-120
    assert bool((amax[normal] > fmax * sf[normal] / 2).all()), "a block's scale is larger than it needs to be"
    # round to nearest: half a unit in the last place of e4m3 (3 mantissa bits) of each scaled value, or half the
    # subnormal step (2^-9) of its block
    back = fp8s.dequantize(q, s)
    step = sf.repeat_interleave(32, dim=-1)
    err = (back - x).abs()
    assert bool((err <= x.abs() * 2.0**-4 + 2.0**-10 * step).all()), f"max error {err.max().item():.3g}"
    assert bool((back[1, 2, 32:64] == 0).all())


def test_mx_quantize_refuses_a_k_that_is_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        overlap.quantize_fp8(torch.randn(4, 40), "mxfp8")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mx_scaled_mm_matches_the_dequantized_product(seed, out_dtype):
    gen = torch.Generator().manual_seed(seed)
    a8, sa = _mx(_blocky(gen, (7, 96)))
    b8, sb = _mxw(_blocky(gen, (5, 96)))
    want = _deq(a8, sa) @ _deqw(b8, sb)
    got = fp8s.scaled_mm(a8, b8, sa, sb, out_dtype)
    compare("scaled_mm mx", (got,), (want,), out_dtype, labels=("y",))
    out = torch.empty(7, 5, dtype=out_dtype)
    assert fp8s.scaled_mm(a8, b8, sa, sb, out_dtype, out=out) is out
    compare("scaled_mm mx out=", (out,), (want,), out_dtype, labels=("y",))


def test_mx_rows_pack_their_block_scales_after_their_bytes(seed):
    """What an MX gather moves per row: its k fp8 bytes, then its k/32 e8m0 bytes (then, on GPUs, zeros up to 16)."""
    gen = torch.Generator().manual_seed(seed)
    k = 96
    a8, sa = _mx(_blocky(gen, (7, k)))
    packed = Packed(k, mx=True)
    assert (packed.scale_offset, packed.scale_bytes, packed.width) == (k, k // 32, k + k // 32)
    rows = packed.pack(a8, sa)
    assert rows.shape == (7, k + k // 32) and rows.dtype == torch.uint8
    assert torch.equal(rows[:, :k], a8.view(torch.uint8)) and torch.equal(rows[:, k:], sa.view(torch.uint8))
    x, s = packed.unpack(rows)
    assert x.dtype == E4M3 and s.dtype == E8M0 and s.shape == (7, k // 32)
    assert torch.equal(x.view(torch.uint8), a8.view(torch.uint8)) and torch.equal(s.view(torch.uint8),
                                                                                  sa.view(torch.uint8))
    # GPU rows: 16-byte aligned, the padding zeros (the layout is computed without allocating on the device)
    for kk in (32, 96, 512):
        gpu = Packed(kk, torch.device("cuda"), mx=True)
        assert gpu.width == -(-(kk + kk // 32) // 16) * 16 and gpu.scale_offset == kk, (kk, gpu.width)
    # rowwise rows keep their layout: k bytes, zeros to 4, a float32 scale
    assert Packed(19).width == 20 + 4 and Packed(19).scale_offset == 20


# ----------------------------------------------------------------------------------------------
# The fused kernels' K loop (interpreted, one process: the tables hold this process's own buffers)
# ----------------------------------------------------------------------------------------------


def _tables(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def _word(value: int) -> torch.Tensor:
    """An int32 word (an epoch word, an error word)."""
    return torch.full((1,), value, dtype=torch.int32)


@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_fused_kernels_scale_every_32_wide_block(seed, block_k):
    """Both GEMM kernels on MX operands, ``K = 96`` (three blocks: a K step of 64 or 128 masks the blocks past K), a
    column-major weight (``w.t()``) whose scales are column-major too: against float64 of the dequantized inputs."""
    from overlap.ops.fused import kernels

    kern = kernels()
    gen = torch.Generator().manual_seed(seed)
    m, k, n = 5, 96, 20
    a8, sa = _mx(_blocky(gen, (m, k)))
    b8, sb = _mxw(_blocky(gen, (n, k)))
    want = _deq(a8, sa) @ _deqw(b8, sb)
    epoch, err = _word(3), _word(0)
    flag = torch.full((4,), 3, dtype=torch.int32)  # already at the epoch: nothing to wait for
    packed = Packed(k, mx=True)
    rows = packed.pack(a8, sa)
    got = kern.all_gather_matmul.launch_all_gather_matmul(
        b8, _tables(rows), _tables(flag), rows=m, epoch=epoch, rank=0, err=err, timeout_ns=60 * 10**9,
        block=(16, 16, block_k), b_scale=sb, out_dtype=torch.float32, scale_offset=packed.scale_offset,
        row_bytes=packed.width)
    assert int(err.item()) == 0
    compare(f"all_gather_matmul kernel mx block_k={block_k}", (got,), (want,), torch.float32, labels=("y",))
    dst = torch.zeros(m, n)
    counters = torch.zeros(4, dtype=torch.int32)
    own_flags = torch.zeros(4, dtype=torch.int32)
    kern.matmul_reduce_scatter.launch_matmul_scatter(
        a8, b8, _tables(dst), counters, _tables(own_flags), block_rows=m, num_chunks=1, flag_stride=1, epoch=epoch,
        rank=0, block=(16, 16, block_k), a_scale=sa, b_scale=sb)
    compare(f"matmul_scatter kernel mx block_k={block_k}", (dst,), (want,), torch.float32, labels=("y",))
    assert int(own_flags[0]) == 3 and not bool(counters.any())


def _bad_launch(case: str) -> None:
    from overlap.ops.fused import kernels

    kern = kernels()
    ag, rs = kern.all_gather_matmul, kern.matmul_reduce_scatter
    table, word, epoch = torch.zeros(1, dtype=torch.int64), _word(0), _word(1)
    a8, sa = _mx(torch.randn(8, 64))
    b8, sb = _mxw(torch.randn(16, 64))
    gather = dict(rows=4, epoch=epoch, rank=0, err=word, timeout_ns=1, scale_offset=64)
    scatter = dict(block_rows=8, num_chunks=1, flag_stride=1, epoch=epoch, rank=0)
    if case == "b_scale shape":
        ag.launch_all_gather_matmul(b8, table, table, block=(32, 32, 32), b_scale=sb[:1], **gather)
    elif case == "block_k 16":
        ag.launch_all_gather_matmul(b8, table, table, block=(32, 32, 16), b_scale=sb, **gather)
    elif case == "row_bytes":
        ag.launch_all_gather_matmul(b8, table, table, block=(32, 32, 32), b_scale=sb, row_bytes=65, **gather)
    elif case == "a_scale shape":
        rs.launch_matmul_scatter(a8, b8, table, torch.zeros(4, dtype=torch.int32), table, block=(32, 32, 32),
                                 a_scale=sa[:, :1], b_scale=sb, **scatter)
    elif case == "mixed":
        rs.launch_matmul_scatter(a8, b8, table, torch.zeros(4, dtype=torch.int32), table, block=(32, 32, 32),
                                 a_scale=torch.ones(8, 1), b_scale=sb, **scatter)


@pytest.mark.parametrize("case, message", [
    ("b_scale shape", r"MX b_scale must be \[K/32, N\] = \[2, 16\].*got \[1, 16\]"),
    ("block_k 16", "with MX scales BLOCK_K must be a multiple of 32, got 16"),
    ("row_bytes", "row_bytes must be at least scale_offset \\+ 2 = 66, got 65"),
    ("a_scale shape", r"MX a_scale must be \[M, K/32\] = \[8, 2\].*got \[8, 1\]"),
    ("mixed", "MX block scales on both operands or on neither"),
])
def test_mx_launchers_refuse_bad_scales(case, message):
    with pytest.raises(ValueError, match=message):
        _bad_launch(case)


# ----------------------------------------------------------------------------------------------
# The ops on MX operands, every strategy, against float64
# ----------------------------------------------------------------------------------------------


def _rank_inputs(seed, rank, a_shape, ns):
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    a = _blocky(gen, (*a_shape, K))
    return _mx(a), [_mxw(_blocky(gen, (n, K))) for n in ns]


# (a's shape without k, gather dim): odd row counts, dim 0 and 1
GATHER = [((5,), 0), ((3, 5), 1), ((3, 2), 0)]
SCATTER = [((2,), 0), ((3, 2), 1)]  # the output's per-rank shape without n


def mx_ops(rank, W, strategy, seed, out_dtype, gather=GATHER, scatter=SCATTER, group=None, plan=None):
    """Every case on MX operands against float64; `plan` (optional) for every call, its ``one_shot`` for the
    all-reduce only."""
    done = []
    all_reduce_plan, plan = plan, (dataclasses.replace(plan, one_shot=False) if plan is not None else None)
    for i, (shape, dim) in enumerate(gather):
        for ns in ((6,), (6, 3)):
            ins = [_rank_inputs(seed + i, r, shape, ns) for r in range(W)]
            (a8, sa), bqs = ins[rank]
            many = len(ns) > 1
            bs, sbs = [b for b, _ in bqs], [s for _, s in bqs]
            y = overlap.all_gather_matmul(a8, bs if many else bs[0], group=group, strategy=strategy, plan=plan,
                                          timeout=60.0, gather_dim=dim, a_scale=sa, b_scale=sbs if many else sbs[0],
                                          out_dtype=out_dtype)
            A = torch.cat([_deq(*ins[r][0]) for r in range(W)], dim=dim)
            ctx = f"rank {rank}/{W} {strategy} mx gather a={tuple(a8.shape)} dim={dim} n={ns}"
            compare(ctx, y if many else [y], [A @ _deqw(b, s) for b, s in bqs], out_dtype,
                    labels=[f"y{j}" for j in range(len(ns))])
            done.append(ctx)
    for i, (shape, dim) in enumerate(scatter):
        d = dim % (len(shape) + 1)
        full = (*shape[:d], W * shape[d], *shape[d + 1 :])
        ins = [_rank_inputs(seed + 100 + i, r, full, (5,)) for r in range(W)]
        (a8, sa), ((b8, sb),) = ins[rank]
        P = sum(_deq(*ins[r][0]) @ _deqw(*ins[r][1][0]) for r in range(W))
        y = overlap.matmul_reduce_scatter(a8, b8, group=group, strategy=strategy, plan=plan, timeout=60.0,
                                          scatter_dim=dim, a_scale=sa, b_scale=sb, out_dtype=out_dtype)
        ctx = f"rank {rank}/{W} {strategy} mx scatter a={tuple(a8.shape)} dim={dim}"
        compare(ctx, (y,), (P.chunk(W, dim=d)[rank],), out_dtype, labels=("y",))
        y = overlap.matmul_all_reduce(a8, b8, group=group, strategy=strategy, plan=all_reduce_plan, timeout=60.0,
                                      a_scale=sa, b_scale=sb, out_dtype=out_dtype)
        compare(ctx + " all_reduce", (y,), (P,), out_dtype, labels=("y",))
        done.append(ctx)
    return done


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_mx_operands_match_float64(pools, seed, world_size, strategy):
    reports = pools(world_size).run(mx_ops, strategy, seed, torch.float32, timeout=300)
    assert all(len(r) == 2 * len(GATHER) + len(SCATTER) for r in reports)


def test_mx_operands_bf16_out_four_ranks_and_one(pools, seed):
    for strategy in ("pipelined", "symm"):
        reports = pools(4).run(mx_ops, strategy, seed, torch.bfloat16, GATHER[:2], SCATTER[:1], timeout=300)
        assert all(len(r) == 2 * 2 + 1 for r in reports)
    reports = pools(1).run(mx_ops, "auto", seed, torch.float32, GATHER[:2], SCATTER, timeout=300)
    assert all(len(r) == 2 * 2 + 2 for r in reports)


def test_mx_fused_interpreted_matches_float64(pools, seed):
    """The Triton kernels with every 32-wide block's fp8 ``tl.dot`` scaled in the K loop (interpreted): a gather dim
    past the first and the first, one weight and two, a scatter dim past the first; the default tiles and the two-shot
    all-reduce, then a plan's 16 x 16 x 16 tile (its K step raised to one MX block) and the one-shot all-reduce."""
    for plan in (None, overlap.Plan("fused", block_m=16, block_n=16, block_k=16, one_shot=True)):
        reports = pools(2).run(mx_ops, "fused", seed, torch.float32, [((3, 5), 1), ((3,), 0)], [((3, 2), 1)],
                               plan=plan, timeout=600)
        assert all(len(r) == 2 * 2 + 1 for r in reports)


def mx_across_nodes(rank, W, seed):
    with nodes.spanning(rank, 2, "mxnode") as group:
        return mx_ops(rank, W, "hierarchical", seed, torch.float32, GATHER[:2], SCATTER, group=group)


def test_mx_hierarchical_across_nodes(pools, seed):
    assert all(len(r) == 2 * 2 + 2 for r in pools(4).run(mx_across_nodes, seed, timeout=300))


# ----------------------------------------------------------------------------------------------
# The recipe fp8="mxfp8": forward from the inputs quantized in MX blocks, backward as without fp8
# ----------------------------------------------------------------------------------------------


def _recipe_inputs(seed, rank, shape, ns, dtype):
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    return _blocky(gen, (*shape, K), dtype), [_blocky(gen, (n, K), dtype) for n in ns]


def recipe(rank, W, strategy, seed, dtype, group=None):
    """Forward: float64 of the leaves quantized in MX blocks (as every rank quantizes its own), rounded to the leaves'
    dtype; backward: the same call without fp8 (the recipe's backward runs in the leaves' dtype)."""
    done = []
    cases = [("gather", (3, 5), 1, (6, 3)), ("gather", (5,), 0, (6,)), ("scatter", (3, 2 * W), 1, (6,)),
             ("scatter", (2 * W,), 0, (6,)), ("all_reduce", (3, 4), 0, (6,))]
    for i, (kind, shape, dim, ns) in enumerate(cases):
        every = [_recipe_inputs(seed + i, r, shape, ns, dtype) for r in range(W)]
        a0, ws0 = every[rank]
        gen = torch.Generator().manual_seed(seed * 131 + rank)
        runs = []
        for mode in (None, "mxfp8"):
            a = a0.clone().requires_grad_()
            ws = [w.clone().requires_grad_() for w in ws0]
            kw = dict(group=group, strategy=strategy, timeout=60.0, fp8=mode)
            if kind == "gather":
                y = overlap.all_gather_matmul(a, [w.t() for w in ws], gather_dim=dim, **kw)
            elif kind == "scatter":
                y = [overlap.matmul_reduce_scatter(a, ws[0].t(), scatter_dim=dim, **kw)]
            else:
                y = [overlap.matmul_all_reduce(a, ws[0].t(), **kw)]
            if mode is None:
                gs = [torch.randn(t.shape, generator=gen).to(dtype) for t in y]
            sum((t * g).sum() for t, g in zip(y, gs, strict=True)).backward()
            runs.append(([t.detach() for t in y], a.grad, [w.grad for w in ws]))
        (_, ga_hp, gw_hp), (y_8, ga_8, gw_8) = runs
        ctx = f"rank {rank}/{W} {strategy} fp8=mxfp8 {dtype} {kind} a={tuple(a0.shape)} dim={dim}"
        deq_a = [_deq(*_mx(a)) for a, _ in every]
        deq_w = [[_deq(*_mx(w)).t() for w in ws] for _, ws in every]  # b = w.t(): its blocks along k, as w's rows
        if kind == "gather":
            A = torch.cat(deq_a, dim=dim)
            want = [A @ b for b in deq_w[rank]]
        else:
            d = dim % len(shape)
            P = sum(deq_a[r] @ deq_w[r][0] for r in range(W))
            want = [P.chunk(W, dim=d)[rank] if kind == "scatter" else P]
        compare(ctx + " forward", y_8, want, dtype, labels=[f"y{j}" for j in range(len(ns))])
        compare(ctx + " backward", (ga_8, *gw_8), (ga_hp, *gw_hp), dtype,
                labels=("grad_a", *(f"grad_w{j}" for j in range(len(ns)))))
        done.append(ctx)
    return done


@pytest.mark.parametrize("strategy, dtype", [("reference", torch.bfloat16), ("pipelined", torch.float16),
                                             ("symm", torch.bfloat16), ("auto", torch.float32)])
def test_mx_recipe_forward_from_mx_blocks_backward_as_without_fp8(pools, seed, strategy, dtype):
    reports = pools(3).run(recipe, strategy, seed, dtype, timeout=300)
    assert all(len(r) == 5 for r in reports)


def test_mx_recipe_fused_interpreted(pools, seed):
    reports = pools(2).run(recipe, "fused", seed, torch.float32, timeout=600)
    assert all(len(r) == 5 for r in reports)


def recipe_across_nodes(rank, W, seed, dtype):
    with nodes.spanning(rank, 2, "mxrecipe") as group:
        return recipe(rank, W, "hierarchical", seed, dtype, group=group)


def test_mx_recipe_hierarchical_and_one_rank(pools, seed):
    assert all(len(r) == 5 for r in pools(4).run(recipe_across_nodes, seed, torch.bfloat16, timeout=300))
    assert all(len(r) == 5 for r in pools(1).run(recipe, "auto", seed, torch.float16, timeout=300))


# ----------------------------------------------------------------------------------------------
# What an MX gather moves: k fp8 bytes and k/32 scale bytes per row, in one gather
# ----------------------------------------------------------------------------------------------


def gathered_bytes(rank, W, m, k):
    from overlap.ops.tp import gather

    moved = {}
    start = gather.start

    def counting(kind, call, x2, cc, **kw):
        moved.setdefault(kind, []).append((x2.dtype, tuple(x2.shape), x2.numel() * x2.element_size()))
        return start(kind, call, x2, cc, **kw)

    gather.start = counting
    try:
        gen = torch.Generator().manual_seed(rank)
        for strategy in ("reference", "pipelined", "symm"):
            a8, sa = _mx(torch.randn((m, k), generator=gen))
            b8, sb = _mxw(torch.randn((8, k), generator=gen))
            overlap.all_gather_matmul(a8, b8, strategy=strategy, timeout=60.0, a_scale=sa, b_scale=sb)
            bf = torch.randn((m, k), generator=gen, dtype=torch.bfloat16)
            overlap.all_gather_matmul(bf, torch.randn((k, 8), dtype=torch.bfloat16), strategy=strategy,
                                      timeout=60.0, fp8="mxfp8")
    finally:
        gather.start = start
    return moved


def test_mx_gather_moves_fp8_bytes_and_block_scales(pools):
    m, k = 7, 64
    for moved in pools(2).run(gathered_bytes, m, k, timeout=120):
        assert set(moved) == {"reference", "pipelined", "symm"}, moved
        for kind, calls in moved.items():
            # fp8 operands, then the recipe on bf16 leaves: one gather of rows of k fp8 bytes and k/32 scale bytes
            assert calls == [(torch.uint8, (m, k + k // 32), m * (k + k // 32))] * 2, (kind, calls)


# ----------------------------------------------------------------------------------------------
# Bad MX arguments: raised on every rank before any data moves
# ----------------------------------------------------------------------------------------------


def bad_calls(rank, W, bad_rank):
    import overlap as ov

    gen = torch.Generator().manual_seed(5)
    a8, sa = _mx(torch.randn((4, K), generator=gen))
    b8, sb = _mxw(torch.randn((6, K), generator=gen))
    _, sa_row = ov.quantize_fp8(a8.float(), "rowwise")
    wq, sb_row = ov.quantize_fp8(b8.t().float(), "rowwise")
    a40, sa40 = ov.quantize_fp8(torch.randn((4, 40), generator=gen), "rowwise")
    b40, sb40 = ov.quantize_fp8(torch.randn((6, 40), generator=gen), "rowwise")
    bad = rank == bad_rank
    cases = {
        "mx a_scale shape": dict(a_scale=sa[:, :1].contiguous() if bad else sa),
        "mx b_scale shape": dict(b_scale=sb[:1].contiguous() if bad else sb),
        "mx a, rowwise b": dict(b_scale=sb_row.t() if bad else sb),
        "rowwise a, mx b": dict(a_scale=sa_row if bad else sa),
        "mx scales, k=40": dict(a=a40, b=b40.t(), a_scale=sa40.to(E8M0) if bad else sa40,
                                b_scale=sb40.t().to(E8M0) if bad else sb40.t()),
        "mx scale list": dict(b=[b8, b8], b_scale=[sb, sb_row.t()] if bad else [sb, sb]),
    }
    out = {}

    def good() -> None:  # (a good call between the bad ones, as in a program that catches its mistakes)
        ov.matmul_all_reduce(torch.ones(2, K), torch.ones(K, 2), strategy="reference", timeout=20.0)

    for name, kw in cases.items():
        args = dict(a=a8, b=b8, a_scale=sa, b_scale=sb, out_dtype=torch.float32)
        args.update(kw)
        ops = (ov.all_gather_matmul,) if isinstance(args["b"], list) else (ov.all_gather_matmul,
                                                                             ov.matmul_all_reduce)
        for op in ops:
            out[f"{name} {op.__name__}"] = expect_error(op, args["a"], args["b"], a_scale=args["a_scale"],
                                                        b_scale=args["b_scale"], out_dtype=args["out_dtype"],
                                                        timeout=20.0)
            good()
    # the recipe on a k that is not a multiple of 32 (the peers make the plain call: a new signature for them)
    for i, op in enumerate((ov.all_gather_matmul, ov.matmul_reduce_scatter, ov.matmul_all_reduce)):
        kw = dict(fp8="mxfp8") if bad else {}
        x = torch.randn((W * (i + 7), 40), generator=gen)
        out[f"recipe, k=40 {op.__name__}"] = expect_error(op, x, torch.randn((40, 6)), timeout=20.0, **kw)
        good()
    return out


WANT = {"mx a_scale shape": ("ValueError", "a_scale"), "mx b_scale shape": ("ValueError", "b_scale"),
        "mx a, rowwise b": ("ValueError", "MX"), "rowwise a, mx b": ("ValueError", "MX"),
        "mx scales, k=40": ("ValueError", "not a multiple of 32"), "mx scale list": ("ValueError", "MX"),
        "recipe, k=40": ("ValueError", "multiple of 32")}


def test_bad_mx_arguments_raise_on_every_rank(pools):
    W, bad_rank = 3, 1
    reports = pools(W).run(bad_calls, bad_rank, timeout=300)
    for rank, report in enumerate(reports):
        assert len(report) == 2 * 5 + 1 + 3, report
        for name, (kind, msg, secs) in report.items():
            want_kind, want_text = WANT[name.rsplit(" ", 1)[0]]
            if rank == bad_rank:
                assert kind == want_kind and want_text in msg, (rank, name, kind, msg)
            else:
                assert kind == "OverlapMismatchError", (rank, name, kind, msg)
            assert secs < 15, (rank, name, secs)
