"""fp8: `overlap.quantize_fp8`, the three TP ops on fp8 operands (every strategy, against a float64 oracle of the
dequantized inputs), the fp8 training recipe (``fp8="rowwise" | "tensorwise"``: forward within fp8's bound of the
bf16 run, backward the bf16 op's), the bytes an fp8 gather moves, and every bad scale raising on every rank.

The oracle: every rank regenerates every rank's inputs from the seed, quantizes them as the ranks do, and computes
in float64 from the dequantized values: ``y_r = cat_s(a8_s * sa_s, dim) @ (b8_r * sb_r)`` (gather),
``chunk(sum_s (a8_s * sa_s) @ (b8_s * sb_s), W, dim)[r]`` (scatter), the whole sum (all-reduce).
"""

from __future__ import annotations

import pytest
import torch

import overlap
from overlap.ops import fp8 as fp8s
from overlap.ops.tp.operands import Packed
from tests.support import nodes
from tests.support.tp_oracle import compare, expect_error

K = 32
E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# quantize_fp8 and the scaled GEMM (one process)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_fp8_round_trips_within_the_format(seed, granularity, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((3, 5, 40), generator=gen) * torch.logspace(-3, 3, 40)
    x[1, 2] = 0  # an all-zero row
    q, s = overlap.quantize_fp8(x, granularity, dtype)
    assert q.dtype == dtype and s.dtype == torch.float32
    assert s.shape == ((3, 5, 1) if granularity == "rowwise" else ())
    assert bool((s > 0).all())
    amax = x.abs().amax(dim=-1, keepdim=True) if granularity == "rowwise" else x.abs().amax()
    fmax = torch.finfo(dtype).max
    # amax-based: the largest magnitude of each row (or the tensor) maps to the format's max
    torch.testing.assert_close(s.expand_as(amax) if granularity == "rowwise" else s,
                               torch.where(amax > 0, amax / fmax, s.expand_as(amax)))
    back = q.float() * s
    # round to nearest: half a unit in the last place (3 or 2 mantissa bits) of the scaled value, or the
    # subnormal step
    mant = 3 if dtype == torch.float8_e4m3fn else 2
    tiny = torch.finfo(dtype).smallest_normal * s
    assert bool(((back - x).abs() <= x.abs() * 2.0 ** -(mant + 1) + tiny).all())
    assert bool((back[1, 2] == 0).all()) if granularity == "rowwise" else True


def test_quantize_fp8_saturates_and_refuses_bad_input():
    x = torch.tensor([[1.0, -3.0, 2.0]])
    q, s = overlap.quantize_fp8(x, "rowwise")
    assert q.float().abs().max().item() == torch.finfo(E4M3).max
    with pytest.raises(TypeError, match="not fp8 already"):
        overlap.quantize_fp8(q)
    with pytest.raises(TypeError, match="floating"):
        overlap.quantize_fp8(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="granularity"):
        overlap.quantize_fp8(x, "columnwise")
    with pytest.raises(TypeError, match="fp8 dtype|one of"):
        overlap.quantize_fp8(x, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot quantize"):
        overlap.quantize_fp8(torch.empty(0, 4))


@pytest.mark.parametrize("a_rowwise", [True, False])
@pytest.mark.parametrize("b_rowwise", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_the_dequantized_product(seed, a_rowwise, b_rowwise, out_dtype):
    """The scaled GEMM (torch._scaled_mm where it takes the call, else dequantized) and the packed rows."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn((7, 19), generator=gen), torch.randn((19, 5), generator=gen)
    a8, sa = overlap.quantize_fp8(a, "rowwise" if a_rowwise else "tensorwise")
    bt8, sb = overlap.quantize_fp8(b.t(), "rowwise" if b_rowwise else "tensorwise")
    b8, sb = bt8.t(), (sb.t() if b_rowwise else sb)
    want = (a8.double() * sa.double()) @ (b8.double() * sb.double())
    got = fp8s.scaled_mm(a8, b8, sa, sb, out_dtype)
    compare("scaled_mm", (got,), (want,), out_dtype, labels=("y",))
    packed = Packed(19)
    rows = packed.pack(a8, sa)
    assert rows.shape == (7, 20 + 4) and rows.dtype == torch.uint8
    x, s = packed.unpack(rows)
    assert torch.equal(x.view(torch.uint8), a8.view(torch.uint8)) and torch.equal(s, sa.expand(7, 1))


# ----------------------------------------------------------------------------------------------
# The ops on fp8 operands, every strategy, against float64
# ----------------------------------------------------------------------------------------------


def _q(x, granularity):
    return overlap.quantize_fp8(x, granularity)


def _qw(w, granularity):
    """A weight ``w`` ``[n, k]`` as the ops take it: ``b = w.t()`` ``[k, n]`` and its scale ``[1, n]`` or one."""
    wq, s = overlap.quantize_fp8(w, granularity)
    return wq.t(), (s.t() if granularity == "rowwise" else s)


def _deq(x8, s):
    return x8.double() * s.double()


def _rank_inputs(seed, rank, a_shape, ns, a_gran, b_gran):
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    a = torch.randn((*a_shape, K), generator=gen) * 3
    ws = [torch.randn((n, K), generator=gen) for n in ns]
    return _q(a, a_gran), [_qw(w, b_gran) for w in ws]


# (a's shape without k, gather dim): odd row counts, dim 0 and 1
GATHER = [((5,), 0), ((3, 5), 1), ((3, 2), 0)]
SCATTER = [((2,), 0), ((3, 2), 1)]  # the output's per-rank shape without n


def fp8_ops(rank, W, strategy, seed, out_dtype, grans, gather=GATHER, scatter=SCATTER, group=None):
    done = []
    for i, (shape, dim) in enumerate(gather):
        for a_gran, b_gran in grans:
            for ns in ((6,), (6, 3, 3)):
                ins = [_rank_inputs(seed + i, r, shape, ns, a_gran, b_gran) for r in range(W)]
                (a8, sa), bqs = ins[rank]
                many = len(ns) > 1
                bs, sbs = [b for b, _ in bqs], [s for _, s in bqs]
                y = overlap.all_gather_matmul(a8, bs if many else bs[0], group=group, strategy=strategy,
                                              timeout=60.0, gather_dim=dim, a_scale=sa,
                                              b_scale=sbs if many else sbs[0], out_dtype=out_dtype)
                ys = y if many else [y]
                A = torch.cat([_deq(*ins[r][0]) for r in range(W)], dim=dim)
                want = [A @ _deq(b, s) for b, s in bqs]
                ctx = f"rank {rank}/{W} {strategy} gather a={tuple(a8.shape)} dim={dim} {a_gran}/{b_gran} n={ns}"
                compare(ctx, ys, want, out_dtype, labels=[f"y{j}" for j in range(len(ns))])
                done.append(ctx)
    for i, (shape, dim) in enumerate(scatter):
        for a_gran, b_gran in grans:
            d = dim % (len(shape) + 1)
            full = (*shape[:d], W * shape[d], *shape[d + 1 :])
            ins = [_rank_inputs(seed + 100 + i, r, full, (5,), a_gran, b_gran) for r in range(W)]
            (a8, sa), ((b8, sb),) = ins[rank]
            P = sum(_deq(*ins[r][0]) @ _deq(*ins[r][1][0]) for r in range(W))
            y = overlap.matmul_reduce_scatter(a8, b8, group=group, strategy=strategy, timeout=60.0,
                                              scatter_dim=dim, a_scale=sa, b_scale=sb, out_dtype=out_dtype)
            ctx = f"rank {rank}/{W} {strategy} scatter a={tuple(a8.shape)} dim={dim} {a_gran}/{b_gran}"
            compare(ctx, (y,), (P.chunk(W, dim=d)[rank],), out_dtype, labels=("y",))
            y = overlap.matmul_all_reduce(a8, b8, group=group, strategy=strategy, timeout=60.0, a_scale=sa,
                                          b_scale=sb, out_dtype=out_dtype)
            compare(ctx + " all_reduce", (y,), (P,), out_dtype, labels=("y",))
            done.append(ctx)
    return done


GRANS = [("rowwise", "rowwise"), ("tensorwise", "tensorwise"), ("rowwise", "tensorwise")]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_fp8_operands_match_float64(pools, seed, world_size, strategy):
    reports = pools(world_size).run(fp8_ops, strategy, seed, torch.float32, GRANS, timeout=300)
    assert all(len(r) == 2 * len(GATHER) * len(GRANS) + len(SCATTER) * len(GRANS) for r in reports)


def test_fp8_operands_bf16_out_and_four_ranks(pools, seed):
    for strategy in ("pipelined", "symm"):
        reports = pools(4).run(fp8_ops, strategy, seed, torch.bfloat16, GRANS[:2], GATHER[:2], SCATTER[:1],
                               timeout=300)
        assert all(len(r) == 2 * 2 * 2 + 2 for r in reports)


def test_fp8_operands_one_rank(pools, seed):
    reports = pools(1).run(fp8_ops, "auto", seed, torch.float32, GRANS[:1], GATHER[:1], SCATTER[:1], timeout=300)
    assert all(len(r) == 3 for r in reports)


def test_fp8_fused_interpreted_matches_float64(pools, seed):
    """The Triton kernels with an fp8 ``tl.dot`` and the scales in their epilogue (interpreted)."""
    reports = pools(2).run(fp8_ops, "fused", seed, torch.float32, GRANS[:2], [((3, 5), 1)], [((3, 2), 1)],
                           timeout=600)
    assert all(len(r) == 2 * 2 + 2 for r in reports)


def fp8_across_nodes(rank, W, seed):
    with nodes.spanning(rank, 2, "f8node") as group:
        return fp8_ops(rank, W, "hierarchical", seed, torch.float32, GRANS[:2], GATHER[:2], SCATTER, group=group)


def test_fp8_hierarchical_across_nodes(pools, seed):
    assert all(len(r) == 2 * 2 * 2 + 2 * 2 for r in pools(4).run(fp8_across_nodes, seed, timeout=300))


# ----------------------------------------------------------------------------------------------
# The training recipe: fp8="rowwise" | "tensorwise" on bf16 leaves
# ----------------------------------------------------------------------------------------------

FP8_BOUND = 2 * 2.0**-4 + 2.0**-8


def recipe(rank, W, strategy, seed, granularity, dtype=torch.bfloat16):
    """Forward: within fp8's bound of the same call in `dtype`; backward: the same call's gradients (the recipe
    keeps the backward in the operands' dtype)."""
    done = []
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    cases = [("gather", (3, 5), 1, (6, 3)), ("gather", (5,), 0, (6,)), ("scatter", (3, 2 * W), 1, (6,)),
             ("scatter", (2 * W,), 0, (6,)), ("all_reduce", (3, 4), 0, (6,))]
    for kind, shape, dim, ns in cases:
        a0 = torch.randn((*shape, K), generator=gen).to(dtype)
        ws0 = [torch.randn((n, K), generator=gen).to(dtype) for n in ns]
        runs = []
        for mode in (None, granularity):
            a = a0.clone().requires_grad_()
            ws = [w.clone().requires_grad_() for w in ws0]
            if kind == "gather":
                y = overlap.all_gather_matmul(a, [w.t() for w in ws], strategy=strategy, timeout=60.0,
                                              gather_dim=dim, fp8=mode)
            elif kind == "scatter":
                y = [overlap.matmul_reduce_scatter(a, ws[0].t(), strategy=strategy, timeout=60.0, scatter_dim=dim,
                                                   fp8=mode)]
            else:
                y = [overlap.matmul_all_reduce(a, ws[0].t(), strategy=strategy, timeout=60.0, fp8=mode)]
            gs = [torch.ones_like(t) * torch.arange(t.shape[-1], dtype=dtype) / t.shape[-1] for t in y]
            sum((t * g).sum() for t, g in zip(y, gs)).backward()
            runs.append(([t.detach() for t in y], a.grad, [w.grad for w in ws]))
        (y_hp, ga_hp, gw_hp), (y_8, ga_8, gw_8) = runs
        ctx = f"rank {rank}/{W} {strategy} fp8={granularity} {kind} a={tuple(a0.shape)} dim={dim}"
        # |y_fp8 - y| <= bound * (|A| @ |B|): the magnitudes' product, from a gather of |a| (this rank's weights)
        for j, (yh, y8) in enumerate(zip(y_hp, y_8, strict=True)):
            assert y8.dtype == dtype and y8.shape == yh.shape, ctx
            if kind == "gather":
                mag = overlap.all_gather_matmul(a0.abs().float(), ws0[j].abs().float().t(), strategy="reference",
                                                gather_dim=dim)
            elif kind == "scatter":
                mag = overlap.matmul_reduce_scatter(a0.abs().float(), ws0[0].abs().float().t(),
                                                    strategy="reference", scatter_dim=dim)
            else:
                mag = overlap.matmul_all_reduce(a0.abs().float(), ws0[0].abs().float().t(), strategy="reference")
            # the bf16 run's own rounding (one bf16 ulp of each output) on top of fp8's bound
            err = (y8.float() - yh.float()).abs()
            bound = FP8_BOUND * mag + 2.0**-7 * yh.float().abs() + 1e-6
            assert bool((err <= bound).all()), f"{ctx}: y{j} off by {(err - bound).max().item():.3g} past the bound"
        compare(ctx + " backward", (ga_8, *gw_8), (ga_hp, *gw_hp), dtype,
                labels=("grad_a", *(f"grad_w{j}" for j in range(len(ns)))))
        done.append(ctx)
    return done


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm"])
def test_recipe_forward_within_fp8_bound_backward_as_bf16(pools, seed, granularity, strategy):
    reports = pools(3).run(recipe, strategy, seed, granularity, timeout=300)
    assert all(len(r) == 5 for r in reports)


def test_recipe_fp32_leaves_two_ranks(pools, seed):
    reports = pools(2).run(recipe, "auto", seed, "rowwise", torch.float32, timeout=300)
    assert all(len(r) == 5 for r in reports)


# ----------------------------------------------------------------------------------------------
# What an fp8 gather moves: k fp8 bytes and a 4-byte scale per row, per peer
# ----------------------------------------------------------------------------------------------


def gathered_bytes(rank, W, strategy, m, k, granularity):
    from overlap.ops.tp import gather

    moved = []
    start = gather.start

    def counting(kind, call, x2, cc, **kw):
        moved.append((x2.dtype, tuple(x2.shape), x2.numel() * x2.element_size()))
        return start(kind, call, x2, cc, **kw)

    gather.start = counting
    try:
        gen = torch.Generator().manual_seed(rank)
        a8, sa = _q(torch.randn((m, k), generator=gen), granularity)
        b8, sb = _qw(torch.randn((8, k), generator=gen), granularity)
        overlap.all_gather_matmul(a8, b8, strategy=strategy, timeout=60.0, a_scale=sa, b_scale=sb)
        bf = torch.randn((m, k), generator=gen, dtype=torch.bfloat16)
        overlap.all_gather_matmul(bf, torch.randn((k, 8), dtype=torch.bfloat16), strategy=strategy, timeout=60.0,
                                  fp8=granularity)
    finally:
        gather.start = start
    return moved


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm"])
def test_fp8_gather_moves_fp8_bytes_and_scales(pools, strategy):
    m, k = 7, 64
    for granularity in ("rowwise", "tensorwise"):
        for moved in pools(2).run(gathered_bytes, strategy, m, k, granularity, timeout=120):
            # fp8 operands, then the recipe on bf16 leaves: rows of bytes, k fp8 bytes and the scale
            assert moved == [(torch.uint8, (m, k + 4), m * k + 4 * m)] * 2, moved


# ----------------------------------------------------------------------------------------------
# Bad fp8 arguments: raised on every rank before any data moves
# ----------------------------------------------------------------------------------------------


def bad_calls(rank, W, bad_rank):
    import overlap as ov

    gen = torch.Generator().manual_seed(5)
    a8, sa = _q(torch.randn((4, K), generator=gen), "rowwise")
    b8, sb = _qw(torch.randn((6, K), generator=gen), "rowwise")
    bad = rank == bad_rank
    cases = {
        "a_scale shape": dict(a_scale=torch.ones(3, 1) if bad else sa),
        "b_scale shape": dict(b_scale=torch.ones(1, 5) if bad else sb),
        "a_scale dtype": dict(a_scale=sa.double() if bad else sa),
        "b_scale dtype": dict(b_scale=sb.half() if bad else sb),
        "a_scale device": dict(a_scale=sa.to("meta") if bad else sa),
        "non-positive": dict(a_scale=-sa if bad else sa),
        "zero b_scale": dict(b_scale=torch.zeros_like(sb) if bad else sb),
        "bf16 b": dict(b=torch.randn(K, 6).bfloat16() if bad else b8),
        "e5m2 a": dict(a=a8.float().to(torch.float8_e5m2) if bad else a8),
        "out_dtype": dict(out_dtype=torch.int8 if bad else torch.float32),
        "fp8 with recipe": dict(fp8="rowwise" if bad else None),
        "requires grad": dict(a=a8.float().to(E4M3).requires_grad_() if bad else a8),
        "scale list": dict(b_scale=[sb, sb] if bad else sb),
    }
    out = {}

    def good() -> None:  # (a good call between the bad ones, as in a program that catches its mistakes)
        ov.matmul_all_reduce(torch.ones(2, K), torch.ones(K, 2), strategy="reference", timeout=20.0)

    for name, kw in cases.items():
        args = dict(a=a8, b=b8, a_scale=sa, b_scale=sb, out_dtype=torch.float32, fp8=None)
        args.update(kw)
        for op in (ov.all_gather_matmul, ov.matmul_all_reduce):
            out[f"{name} {op.__name__}"] = expect_error(op, args["a"], args["b"], a_scale=args["a_scale"],
                                                        b_scale=args["b_scale"], out_dtype=args["out_dtype"],
                                                        fp8=args["fp8"], timeout=20.0)
            good()
    # (each case a new signature for the peers: their first call of it meets the bad rank's poisoned handshake; a
    # mistake after a signature's steady state reaches the peers as a timeout naming the bad rank instead)
    for i, (name, kw) in enumerate({"scales without fp8": dict(a_scale=sa), "bad recipe": dict(fp8="columnwise"),
                                    "recipe type": dict(fp8=8)}.items()):
        kw = kw if bad else {}
        bf = torch.randn((W * (i + 7), K), generator=gen)
        out[name] = expect_error(ov.matmul_reduce_scatter, bf, torch.randn((K, 6)), timeout=20.0, **kw)
        good()
    return out


WANT = {"a_scale shape": ("ValueError", "a_scale"), "b_scale shape": ("ValueError", "b_scale"),
        "a_scale dtype": ("TypeError", "a_scale"), "b_scale dtype": ("TypeError", "b_scale"),
        "a_scale device": ("ValueError", "a_scale"), "non-positive": ("ValueError", "a_scale"),
        "zero b_scale": ("ValueError", "b_scale"), "bf16 b": ("TypeError", "fp8"), "e5m2 a": ("TypeError", "e5m2"),
        "out_dtype": ("TypeError", "out_dtype"), "fp8 with recipe": ("TypeError", "fp8"),
        "requires grad": ("TypeError", "requires grad"), "scale list": ("ValueError", "b_scale"),
        "scales without fp8": ("TypeError", "a_scale"), "bad recipe": ("ValueError", "fp8"),
        "recipe type": ("TypeError", "fp8")}


def test_bad_fp8_arguments_raise_on_every_rank(pools):
    W, bad_rank = 3, 1
    reports = pools(W).run(bad_calls, bad_rank, timeout=300)
    for rank, report in enumerate(reports):
        for name, (kind, msg, secs) in report.items():
            want_kind, want_text = WANT[name.rsplit(" ", 1)[0] if name not in WANT else name]
            if rank == bad_rank:
                assert kind == want_kind and want_text in msg, (rank, name, kind, msg)
            else:
                assert kind == "OverlapMismatchError", (rank, name, kind, msg)
            assert secs < 15, (rank, name, secs)
