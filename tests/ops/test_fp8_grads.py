"""fp8 gradients: the recipe's ``grads=True`` (``fp8="rowwise+grads"``, ``overlap.Fp8Recipe(g, grads=True)``) runs
the backward's GEMMs of the three TP ops in fp8 (`overlap.ops.fp8_matmul.grad_gemm`'s convention); without
``grads`` the backward stays bitwise the plain op's.

Checks, every strategy, world sizes 1 to 4, gather/scatter dims 0 and 1, bf16 leaves, granularities rowwise
(e4m3), tensorwise (e5m2) and mxfp8 (e4m3, blocks of 32; a reduction not a multiple of 32 is a float32 product):

* ``grads=True``: each gradient against the high-precision backward, the float64 product of the unquantized
  leaves (every rank regenerates every rank's leaves), within fp8's bound below; the weight gradient, one GEMM
  over the gathered rows on every strategy, bitwise ``grad_gemm`` of the gathered leaves; ``matmul_all_reduce``'s
  input gradient bitwise ``grad_gemm(g, b.T)``; and a gradient that goes through fp8 differs from the plain op's
  (the recipe is not ignored).
* ``grads=False``: the gradients bitwise those of the op without ``fp8=``.

The bound. A gradient is ``X @ Y`` summed over a reduction of length ``r`` (``n`` for an input gradient, the
tokens for a weight gradient), perhaps over ranks. Each operand is quantized along ``r`` by rounding to nearest
in the gradient dtype after an amax-based scaling (a power of two with MX): a normal value changes by at most
``eps = 2^-(p+1)`` of itself, ``p`` the mantissa bits (e4m3: ``p = 3``, ``eps = 2^-4``; e5m2: ``p = 2``,
``eps = 2^-3``). So ``|x^ y^ - x y| <= (2 eps + eps^2) |x| |y|`` per term, and over the sum, elementwise,
``|G^ - G| <= (2 eps + eps^2) S`` with ``S = |X| @ |Y|`` (summed over ranks where the gradient is). On top:
float32 accumulation (at most ``(r + W) 2^-24``, taken as ``2^-16``) and one rounding to the leaves' dtype (``u``,
``2^-8`` for bf16), each relative to ``|G^| <= (1 + eps)^2 S``:
``c = 2 eps + eps^2 + (u + 2^-16) (1 + eps)^2``. A value below the smallest normal (times the scale) rounds to the
subnormal step instead: an absolute error of at most half a step, ``2^-10`` (e4m3) or ``2^-17`` (e5m2) times the
scale, itself at most ``2 amax / max`` (MX rounds up to a power of two); the test adds that term,
``tau (2 + eps) r max|X| max|Y|`` (``tau``: that bound over ``amax``), negligible at these sizes. A float32 product
(MX, ``r`` not a multiple of 32) is held to ``eps = 0``.
"""

from __future__ import annotations

import math

import pytest
import torch

import overlap
from overlap.ops.fp8_matmul import grad_gemm
from overlap.ops.fp8_recipe import recipe_of
from tests.support import nodes
from tests.support.tp_oracle import assert_bitwise

K = 32
DTYPE = torch.bfloat16
U = 2.0**-8  # bf16's unit roundoff: the one rounding of a gradient to the leaves' dtype
GRANULARITIES = ("rowwise", "tensorwise", "mxfp8")
AGM, MRS, MAR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"
# (op, this rank's a without k (matmul_reduce_scatter: its output's), dim, n). n = 32: an input gradient
# that MX quantizes; 32 tokens: a weight gradient that MX quantizes (matmul_all_reduce's 32 rows; on 2 ranks
# all_gather_matmul's 16 per rank gathered, on 4 matmul_reduce_scatter's 8 per rank), else a float32 product.
CASES = [(AGM, (16,), 0, 12), (AGM, (2, 3), 1, 32), (MRS, (8,), 0, 32), (MRS, (2, 3), 1, 12),
         (MAR, (32,), 0, 12), (MAR, (3, 2), 0, 32)]


def _inputs(seed: int, case, rank: int, W: int):
    """Rank `rank`'s leaves ``(a, w [n, k], g)`` (bf16) of `case`."""
    op, shape, dim, n = case
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    a_shape = shape if op != MRS else (*shape[:dim], W * shape[dim], *shape[dim + 1 :])
    y_shape = shape if op != AGM else (*shape[:dim], W * shape[dim], *shape[dim + 1 :])
    a = torch.randn((*a_shape, K), generator=gen).to(DTYPE)
    w = torch.randn((n, K), generator=gen).to(DTYPE)
    g = torch.randn((*y_shape, n), generator=gen).to(DTYPE)
    return a, w, g


def _oracle(op: str, dim: int, every: list, rank: int, W: int, f=lambda t: t):
    """Rank `rank`'s ``(grad_a, grad_w)`` in float64 (with `f` = abs: the sums of the terms' magnitudes ``S``)."""
    a, w, g = (f(t.double()) for t in every[rank])
    n = w.shape[0]
    if op == AGM:
        A = torch.cat([f(e[0].double()) for e in every], dim=dim)
        grad_a = sum((f(e[2].double()) @ f(e[1].double())).chunk(W, dim=dim)[rank] for e in every)
        return grad_a, g.reshape(-1, n).t() @ A.reshape(-1, K)
    if op == MRS:
        G = torch.cat([f(e[2].double()) for e in every], dim=dim)
        return G @ w, G.reshape(-1, n).t() @ a.reshape(-1, K)
    return g @ w, g.reshape(-1, n).t() @ a.reshape(-1, K)


def _grads(op: str, a, w, g, dim: int, strategy: str, fp8, group=None):
    """One forward and backward on fresh leaves (``b = w.t()``): ``(grad_a, grad_w)``."""
    a = a.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    kw = dict(group=group, strategy=strategy, timeout=60.0, fp8=fp8)
    if op == AGM:
        y = overlap.all_gather_matmul(a, w.t(), gather_dim=dim, **kw)
    elif op == MRS:
        y = overlap.matmul_reduce_scatter(a, w.t(), scatter_dim=dim, **kw)
    else:
        y = overlap.matmul_all_reduce(a, w.t(), **kw)
    y.backward(g)
    return a.grad, w.grad


def _eps(granularity: str, r: int) -> tuple[float, float]:
    """``(eps, tau / amax)`` of an operand quantized along a reduction of `r` for `granularity`'s gradients."""
    if granularity == "mxfp8" and r % 32:
        return 0.0, 0.0  # (a float32 product)
    dtype = recipe_of("test", granularity + "+grads").grad_dtype
    eps, half_step = (2.0**-4, 2.0**-10) if dtype == torch.float8_e4m3fn else (2.0**-3, 2.0**-17)
    return eps, half_step * 2 / torch.finfo(dtype).max


def _check_bound(ctx: str, got: torch.Tensor, want, S, eps: float, tau: float, r: int, max_x: float,
                 max_y: float, terms: int = 1) -> None:
    c = 2 * eps + eps**2 + (U + 2.0**-16) * (1 + eps) ** 2
    sub = terms * tau * (2 + eps) * r * max_x * max_y  # (subnormals: the module docstring)
    err = (got.double() - want).abs()
    bound = c * S + sub + 1e-30
    worst = (err / bound).max().item()
    if worst > 1.0:
        i = int((err / bound).argmax())
        raise AssertionError(f"{ctx}: element {i} = {got.flatten()[i].item():.6g}, float64 "
                             f"{want.flatten()[i].item():.6g}: err {err.flatten()[i].item():.3g} = {worst:.2f} x the "
                             f"bound (c = {c:.4g}, S = {S.flatten()[i].item():.4g})")


def grads_task(rank: int, W: int, strategy: str, seed: int, granularities=GRANULARITIES, cases=CASES, group=None):
    """Every case of `cases` on this rank: the plain op, the recipe without and with fp8 gradients. Returns what
    was checked (one line per case and granularity)."""
    done = []
    for i, case in enumerate(cases):
        op, shape, dim, n = case
        every = [_inputs(seed + i, case, r, W) for r in range(W)]
        a, w, g = every[rank]
        plain = _grads(op, a, w, g, dim, strategy, None, group)
        want = _oracle(op, dim, every, rank, W)
        S = _oracle(op, dim, every, rank, W, f=torch.abs)
        max_a = max(e[0].abs().max().item() for e in every)
        max_w = max(e[1].abs().max().item() for e in every)
        max_g = max(e[2].abs().max().item() for e in every)
        for granularity in granularities:
            ctx = f"rank {rank}/{W} {strategy} {op} a={tuple(a.shape)} dim={dim} n={n} {granularity}"
            # grads=False: bitwise the plain op's backward
            assert_bitwise(ctx + " grads=False", _grads(op, a, w, g, dim, strategy, granularity, group), plain,
                           labels=("grad_a", "grad_w"))
            # grads=True (the recipe object for rowwise, its text otherwise)
            fp8 = overlap.Fp8Recipe(granularity, grads=True) if granularity == "rowwise" else granularity + "+grads"
            grad_a, grad_w = _grads(op, a, w, g, dim, strategy, fp8, group)
            assert grad_a.dtype == DTYPE and grad_w.dtype == DTYPE, ctx
            recipe = recipe_of("test", fp8)
            # the weight gradient: one grad_gemm over the gathered rows, on every strategy
            if op == AGM:
                x, y = torch.cat([e[0] for e in every], dim=dim).reshape(-1, K).t(), g.reshape(-1, n)
            elif op == MRS:
                x, y = a.reshape(-1, K).t(), torch.cat([e[2] for e in every], dim=dim).reshape(-1, n)
            else:
                x, y = a.reshape(-1, K).t(), g.reshape(-1, n)
            tokens = x.shape[1]
            assert_bitwise(ctx + " grad_w = grad_gemm(a.T, g)", (grad_w,),
                           (grad_gemm(x, y, recipe, grad="y").to(DTYPE).t(),), labels=("grad_w",))
            if op == MAR:
                assert_bitwise(ctx + " grad_a = grad_gemm(g, b.T)", (grad_a,),
                               (grad_gemm(g.reshape(-1, n), w, recipe).to(DTYPE).view(a.shape),), labels=("grad_a",))
            # both within fp8's bound of the float64 backward of the unquantized leaves
            eps_a, tau_a = _eps(granularity, n)
            _check_bound(ctx + " grad_a", grad_a, want[0], S[0], eps_a, tau_a, n, max_g, max_w,
                         terms=W if op == AGM else 1)
            eps_w, tau_w = _eps(granularity, tokens)
            _check_bound(ctx + " grad_w", grad_w, want[1], S[1], eps_w, tau_w, tokens, max_a, max_g)
            # the recipe is not ignored: a gradient quantized to fp8 is not the plain one
            for label, got, ref, eps in (("grad_a", grad_a, plain[0], eps_a), ("grad_w", grad_w, plain[1], eps_w)):
                if eps:
                    assert not torch.equal(got, ref), f"{ctx}: {label} is the plain op's: no fp8 gradient"
            done.append(ctx)
    return done


def _count(granularities=GRANULARITIES, cases=CASES) -> int:
    return len(cases) * len(granularities)


# (world size, strategy): every strategy; 1 to 4 ranks
RUNS = [(1, "auto"), (2, "reference"), (2, "pipelined"), (2, "symm"), (2, "auto"), (3, "reference"),
        (3, "pipelined"), (3, "symm"), (4, "pipelined"), (4, "symm")]


@pytest.mark.parametrize(("world_size", "strategy"), RUNS)
def test_fp8_grads_within_bound_and_plain_recipe_bitwise(pools, seed, world_size, strategy):
    reports = pools(world_size).run(grads_task, strategy, seed, timeout=300)
    assert all(len(r) == _count() for r in reports)


def test_fp8_grads_fused_interpreted(pools, seed):
    """``fused``: the reduce-scatter kernel where it takes the gradients (e4m3, rowwise or MX scales), torch's GEMMs
    under the same protocol where not (e5m2; matmul_reduce_scatter's gathered rows, quantized as they land)."""
    cases = [(AGM, (2, 3), 1, 32), (MRS, (8,), 0, 32), (MAR, (3, 2), 0, 32)]
    reports = pools(2).run(grads_task, "fused", seed, GRANULARITIES, cases, timeout=600)
    assert all(len(r) == _count(GRANULARITIES, cases) for r in reports)


def overlap_task(rank: int, W: int, strategy: str, seed: int) -> list:
    """What the backward with fp8 gradients runs, in order: all_gather_matmul posts the gather of ``a`` before its
    input gradient's reduce-scatter (which strategy runs it: ``fused``'s kernel takes e4m3, rowwise or MX, not e5m2);
    matmul_reduce_scatter multiplies each gathered chunk as it lands (one call per chunk, before the gather ends)."""
    from overlap.ops.tp import all_gather_matmul as agm_module
    from overlap.ops.tp import gather, gather_gemm, scatter_gemm
    from overlap.ops.tp import matmul_reduce_scatter as mrs_module

    events: list[str] = []
    patched = [(gather, "start"), (scatter_gemm, "run"), (gather_gemm, "run"), (mrs_module._GradWeights, "multiply")]
    saved = [getattr(owner, name) for owner, name in patched]

    def recording(owner, name, fn):
        def run(*args, **kwargs):
            if name == "start":
                events.append(f"gather:{args[0]}")
            elif name == "run" and owner is scatter_gemm:
                events.append(f"reduce_scatter:{args[1].plan.strategy}")
            elif name == "run":
                events.append(f"gather_gemm:{args[2].plan.strategy}")
            else:
                events.append("chunk")
            return fn(*args, **kwargs)
        return run

    out = []
    try:
        for (owner, name), fn in zip(patched, saved, strict=True):
            setattr(owner, name, recording(owner, name, fn))
        for granularity in GRANULARITIES:
            for op, shape, dim, n in [(AGM, (2, 3), 1, 32), (MRS, (8,), 0, 32)]:
                a, w, g = _inputs(seed, (op, shape, dim, n), rank, W)
                a, w = a.requires_grad_(), w.requires_grad_()
                module = agm_module if op == AGM else mrs_module
                fn = module.all_gather_matmul if op == AGM else module.matmul_reduce_scatter
                kw = dict(gather_dim=dim) if op == AGM else dict(scatter_dim=dim)
                y = fn(a, w.t(), strategy=strategy, timeout=60.0, fp8=granularity + "+grads", **kw)
                events.clear()
                y.backward(g)
                out.append((op, granularity, list(events)))
    finally:
        for (owner, name), fn in zip(patched, saved, strict=True):
            setattr(owner, name, fn)
    return out


@pytest.mark.parametrize("strategy", ["pipelined", "symm", "fused"])
def test_fp8_grads_keep_the_overlap(pools, seed, strategy):
    W = 3
    for rank, report in enumerate(pools(W).run(overlap_task, strategy, seed, timeout=600)):
        for op, granularity, events in report:
            ctx = f"rank {rank}/{W} {strategy} {op} {granularity}+grads: {events}"
            if op == AGM:
                kind = "symm" if strategy == "fused" else strategy
                e5m2 = granularity == "tensorwise"  # (no kernel takes it)
                grad_a = "symm" if strategy == "fused" and e5m2 else strategy
                assert events == [f"gather:{kind}", f"reduce_scatter:{grad_a}"], ctx
            else:
                # the gather runs as symm's under fused (its kernel cannot quantize what it loads); a chunk's GEMM
                # per landed chunk, at least one per rank
                kind = "symm" if strategy == "fused" else strategy
                assert events[:2] == [f"gather_gemm:{kind}", f"gather:{kind}"], ctx
                assert len(events) - 2 >= W and set(events[2:]) == {"chunk"}, ctx


def grads_across_nodes(rank: int, W: int, seed: int):
    with nodes.spanning(rank, 2, "f8grads") as group:
        return grads_task(rank, W, "hierarchical", seed, GRANULARITIES, CASES, group=group)


def test_fp8_grads_hierarchical_across_nodes(pools, seed):
    assert all(len(r) == _count() for r in pools(4).run(grads_across_nodes, seed, timeout=300))


COMPILED = [(AGM, (2, 3), 1, 32, "rowwise"), (MRS, (8,), 0, 32, "tensorwise"), (MAR, (3, 2), 0, 32, "rowwise"),
            (MAR, (3, 2), 0, 32, "tensorwise"), (MAR, (32,), 0, 32, "mxfp8")]


def compile_task(rank: int, W: int, seed: int) -> list:
    """Ops with fp8 gradients compiled (``aot_eager``, ``fullgraph=True``: a graph break raises) before any eager
    call (nothing the backward's scaled GEMMs probe is known yet: the compiler must not trace the probe), then
    against eager: bitwise."""
    import torch._dynamo

    from overlap.ops import fp8 as fp8s
    from tests.support.compile_tasks import _grads

    out = []
    for i, (op, shape, dim, n, granularity) in enumerate(COMPILED):
        fn_op = getattr(overlap, op)
        kw = {AGM: dict(gather_dim=dim), MRS: dict(scatter_dim=dim), MAR: {}}[op]
        a, w, _ = _inputs(seed + i, (op, shape, dim, n), rank, W)
        inputs = (a.requires_grad_(), w.requires_grad_())

        def fn(a, w, fn_op=fn_op, kw=kw, fp8=granularity + "+grads"):
            return fn_op(a, w.t(), strategy="symm", fp8=fp8, **kw)

        fp8s._PROBED.clear()
        torch._dynamo.reset()
        got = _grads(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, seed)
        torch._dynamo.reset()
        want = _grads(fn, inputs, seed)
        same = all(torch.equal(x, y) for x, y in zip((got[0], *got[1]), (want[0], *want[1]), strict=True))
        out.append((op, granularity, same))
    return out


def test_fp8_grads_compile_bitwise(pools, seed):
    for rank, cases in enumerate(pools(2).run(compile_task, seed, timeout=300)):
        assert len(cases) == len(COMPILED)
        for op, granularity, same in cases:
            assert same, f"rank {rank} {op} {granularity}+grads: compiled differs from eager"


def opcheck_task(rank: int, W: int, seed: int) -> dict:
    """`torch.library.opcheck` (autograd registration, fake against real) of each op with fp8 gradients."""
    from tests.support.compile_tasks import opcheck_all

    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    ops = torch.ops.overlap
    a3 = torch.randn(2 * W, 2, K, generator=gen, requires_grad=True)
    b = torch.randn(K, 6, generator=gen, requires_grad=True)
    tp = ("", "symm", "", None, True)
    none = (None, None, None)
    return opcheck_all({
        "all_gather_matmul": (ops.all_gather_matmul.default, (a3, [b], 1, False, *tp, *none, "rowwise+grads")),
        "matmul_reduce_scatter": (ops.matmul_reduce_scatter.default, (a3, b, 0, *tp, *none, "tensorwise+grads")),
        "matmul_all_reduce": (ops.matmul_all_reduce.default, (a3, b, *tp, *none, "mxfp8+grads")),
        "matmul_all_reduce_backward": (ops.matmul_all_reduce_backward.default,
                                       (torch.randn(2 * W, 2, 6, generator=gen), a3.detach(), b.detach(), True, True,
                                        "rowwise+grads")),
    })


def test_fp8_grads_opcheck(pools, seed):
    for rank, results in enumerate(pools(2).run(opcheck_task, seed, timeout=300)):
        bad = {name: r for name, r in results.items() if r != "ok"}
        assert not bad, f"rank {rank}: {bad}"


def test_bound_constants():
    """The bound's constants: half an ulp at 1 of each gradient dtype (the relative rounding of a normal value)."""
    for dtype, eps in ((torch.float8_e4m3fn, 2.0**-4), (torch.float8_e5m2, 2.0**-3)):
        one_plus_ulp = torch.tensor(1.0 + 2 * eps).to(dtype).float().item()
        assert one_plus_ulp == 1.0 + 2 * eps and torch.tensor(1.0 + eps * 0.99).to(dtype).float().item() == 1.0
    assert math.isclose(_eps("mxfp8", 31)[0], 0.0) and _eps("tensorwise", 5)[0] == 2.0**-3
