"""Shared helpers of the tensor-parallel op tests: inputs, float64 oracles, comparisons, error capture.

Every rank regenerates every rank's inputs from the test's seed (`rank_inputs`), so each rank computes
the unfused result of the whole group in float64 and checks its own share of it. The oracles state the
gradient conventions of docs/conventions.md explicitly (Megatron's), with a different output gradient ``g_r`` on
every rank:

* ``all_gather_matmul``: ``y_r = cat_s(a_s) @ b_r``; ``grad a_j = sum_r (g_r @ b_r.T)[rows of j]``,
  ``grad b_r = cat_s(a_s).T @ g_r``.
* ``matmul_reduce_scatter``: ``y_r = (sum_s a_s @ b_s)[rows of r]``; ``grad a_r = cat_s(g_s) @ b_r.T``,
  ``grad b_r = a_r.T @ cat_s(g_s)``.
* ``matmul_all_reduce``: ``y_r = sum_s a_s @ b_s`` on every rank; the output gradient passes through:
  ``grad a_r = g_r @ b_r.T``, ``grad b_r = a_r.T @ g_r``.

A case is ``(rows, mid, k, n, layout)``: ``rows`` is dim 0 of this rank's ``a`` for all_gather_matmul and
matmul_all_reduce and the rows per rank of the *output* for matmul_reduce_scatter (its ``a`` has
``world_size * rows``); ``mid`` are middle dims; ``layout`` is ``"weight.t()"`` (``b = w.t()``, a
transposed view of a weight ``w[n, k]``) or ``"contiguous"`` (``b`` is a contiguous ``[k, n]``).
"""

from __future__ import annotations

import math
import time
import types

import torch

from overlap.workloads import OpInputs, workload

from .harness import FALLBACK_TIMEOUT_S

AGM, MRS, MAR = "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}
LABELS = ("out", "grad_a", "grad_b")


def a_rows(op: str, rows: int, world_size: int) -> int:
    return world_size * rows if op == MRS else rows


def g_rows(op: str, rows: int, world_size: int) -> int:
    return world_size * rows if op == AGM else rows


def rank_inputs(op: str, seed: int, rank: int, world_size: int, case, dtype):
    """This rank's ``(a, param, g)``: ``param`` is the leaf that holds ``b`` (``b = param.t()`` for
    the ``"weight.t()"`` layout, else ``b = param``); ``g`` is this rank's output gradient."""
    rows, mid, k, n, layout = case
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    a = torch.randn((a_rows(op, rows, world_size), *mid, k), generator=gen, dtype=torch.float64)
    w = torch.randn((n, k), generator=gen, dtype=torch.float64)
    param = w if layout == "weight.t()" else w.t().contiguous()
    g = torch.randn((g_rows(op, rows, world_size), *mid, n), generator=gen, dtype=torch.float64)
    return a.to(dtype), param.to(dtype), g.to(dtype)


def b_of(param: torch.Tensor, layout: str) -> torch.Tensor:
    return param.t() if layout == "weight.t()" else param


def oracle(op: str, seed: int, world_size: int, case, dtype, magnitudes: bool = False):
    """Every rank's inputs, and every rank's float64 ``(out, grad_a, grad_b)`` (grad_b as ``[k, n]``): the op's
    workload oracle (`overlap.workloads`) on the inputs as 2-D rows, shaped back.

    With `magnitudes`, the same sums of products over the inputs' absolute values: for every output
    element, the sum of the magnitudes of the terms it adds up (what bounds its rounding error)."""
    rows, mid, k, n, layout = case
    inputs = [rank_inputs(op, seed, r, world_size, case, dtype) for r in range(world_size)]
    f = torch.abs if magnitudes else (lambda t: t)
    per = rows * math.prod(mid)  # rows of dim 0 times the middle dims: the rows of a rank's 2-D view
    every = [OpInputs((f(a.double()).reshape(-1, k), f(b_of(param, layout).double())),
                      f(g.double()).reshape(-1, n)) for a, param, g in inputs]
    problem = types.SimpleNamespace(m=per, k=k, n=n, backward=True)  # (m: rows of a rank's slice, flattened)
    want = []
    for r in range(world_size):
        out, grad_a, grad_b = (e.value for e in workload(op).oracle(problem, every, r))
        a_shape = inputs[r][0].shape
        want.append((out.view(-1, *mid, n), grad_a.view(a_shape), grad_b))
    return inputs, want


# ----------------------------------------------------------------------------------------------
# Running an op
# ----------------------------------------------------------------------------------------------


def name_of(strategy) -> str:
    return strategy if isinstance(strategy, str) else strategy.describe()


def call(op: str, a, b, strategy, group=None, timeout=None):
    """``overlap.<op>(a, b, ...)`` with `strategy` a name or an `overlap.Plan`."""
    import overlap

    fn = getattr(overlap, op)
    if isinstance(strategy, str):
        return fn(a, b, group=group, strategy=strategy, timeout=timeout)
    return fn(a, b, group=group, plan=strategy, timeout=timeout)


def forward_backward(op: str, strategy, a, param, layout: str, g, group=None, timeout=None):
    """One forward and backward on fresh leaves; ``(y, grad_a, grad_b)`` with grad_b as ``[k, n]``."""
    a = a.detach().clone().requires_grad_()
    param = param.detach().clone().requires_grad_()
    y = call(op, a, b_of(param, layout), strategy, group=group, timeout=timeout)
    y.backward(g)
    return y.detach(), a.grad, b_of(param.grad, layout)


def context(op, rank, world_size, strategy, dtype, a, b_shape, layout, seed) -> str:
    return (
        f"{op} rank {rank}/{world_size} {name_of(strategy)} {str(dtype).removeprefix('torch.')} "
        f"a={tuple(a.shape)} b={tuple(b_shape)} {layout} seed={seed}"
    )


def scaled(tol: dict, want: torch.Tensor) -> dict:
    """`tol` with ``atol`` multiplied by the RMS of `want` where that exceeds 1.

    An absolute tolerance is meant for values of order 1. Rounding errors scale with the values summed:
    an element of a tensor whose typical size is 20 (a dot product of unscaled ``randn`` over k=500, a
    weight gradient summed over a few dozen rows) can cancel to near 0 and still carry an error of
    ``u * 20 * sqrt(terms)``, past ``atol=1e-5`` while far inside the tensor's own rounding. A wrong,
    missing or stale partial is off by about the tensor's scale, still orders past the scaled bound.
    The benchmark runner checks its outputs the same way (`overlap.benchmarks.runner`)."""
    rms = want.detach().double().pow(2).mean().sqrt().item() if want.numel() else 0.0
    return dict(tol, atol=tol["atol"] * max(1.0, rms))


def compare(ctx: str, got, want, dtype, tol: dict | None = None, labels=LABELS) -> None:
    """``assert_close`` of each of ``got`` against ``want`` (cast to `dtype`) at `tol` (DESIGN's for
    `dtype` by default) `scaled` to ``want``'s size, the max error in the message."""
    for label, x, y in zip(labels, got, want):
        assert x.shape == y.shape, f"{ctx}: {label} shape {tuple(x.shape)} != {tuple(y.shape)}"
        assert x.dtype == dtype, f"{ctx}: {label} dtype {x.dtype} != {dtype}"
        err = (x.double() - y.double()).abs().max().item()
        torch.testing.assert_close(
            x, y.to(dtype), **scaled(tol or TOL[dtype], y),
            msg=lambda s, n=label, e=err: f"{ctx}: {n} differs (max abs err {e:.3g}): {s}",
        )


def assert_bitwise(ctx: str, got, want, labels=LABELS) -> None:
    for label, x, y in zip(labels, got, want):
        if not torch.equal(x, y):
            err = (x.double() - y.double()).abs().max().item()
            raise AssertionError(f"{ctx}: {label} is not bitwise identical (max abs diff {err:.3g})")


def check_relative(ctx: str, got, want, bound: float = 2e-2, labels=LABELS, scale=None) -> None:
    """Relative-norm distance to the oracle below `bound`; with `scale` (the sums of the terms'
    magnitudes) relative to ``||scale||`` instead of ``||want||``, so outputs whose terms cancel (tiny
    shapes) are not held to a bound their rounding cannot meet; a wrong partial is still off by ~1."""
    norms = scale if scale is not None else want
    for label, x, y, n in zip(labels, got, want, norms):
        rel = ((x.double() - y.double()).norm() / n.double().norm()).item()
        assert rel < bound, f"{ctx}: {label} is {rel:.3g} (relative norm) away from the float64 oracle"


def check_op(
    rank: int, world_size: int, op: str, strategy, dtype, seed: int, cases, timeout: float = FALLBACK_TIMEOUT_S,
    group=None,
) -> list:
    """`strategy` against the float64 oracle: DESIGN's tolerance (fp32/fp64), the rounding bound of
    `check_low_precision` (bf16/fp16, `reference` checked alongside).

    Returns this rank's outputs, one per case (to compare across ranks)."""
    outputs = []
    for i, case in enumerate(cases):
        rows, mid, k, n, layout = case
        inputs, want = oracle(op, seed + i, world_size, case, dtype)
        a, param, g = inputs[rank]
        got = forward_backward(op, strategy, a, param, layout, g, group=group, timeout=timeout)
        ctx = context(op, rank, world_size, strategy, dtype, a, (k, n), layout, seed + i)
        if dtype == torch.float64:
            compare(ctx, got, want[rank], dtype)
        elif dtype == torch.float32:
            check_fp32(ctx, got, want[rank], oracle(op, seed + i, world_size, case, dtype, magnitudes=True)[1][rank],
                       world_size)
        else:
            ref = forward_backward(op, "reference", a, param, layout, g, group=group, timeout=timeout)
            scale = oracle(op, seed + i, world_size, case, dtype, magnitudes=True)[1][rank]
            check_low_precision(ctx, got, ref, want[rank], scale, dtype, world_size)
        outputs.append(got[0])
    return outputs


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def check_fp32(ctx: str, got, want, scale, world_size: int, labels=LABELS) -> None:
    """fp32 against the float64 oracle: DESIGN's ``rtol=atol=1e-5``, widened per element by the
    rounding bound of `check_low_precision` at fp32's unit roundoff, ``(world_size + 1) u S``.

    DESIGN's tolerance is meant against `reference`, itself rounded; against the exact result a long
    sum (``S`` of a few hundred, e.g. k=100 on 3 ranks) legitimately rounds past 1e-5. A wrong, missing
    or stale partial is still off by about its own size, orders of magnitude past the bound."""
    u = 2.0**-24
    for label, x, y, s in zip(labels, got, want, scale):
        assert x.shape == y.shape, f"{ctx}: {label} shape {tuple(x.shape)} != {tuple(y.shape)}"
        assert x.dtype == torch.float32, f"{ctx}: {label} dtype {x.dtype} != torch.float32"
        err = (x.double() - y).abs()
        bound = 1e-5 + 1e-5 * y.abs() + (world_size + 1) * u * s
        worst = (err / bound).max().item() if err.numel() else 0.0
        if worst > 1.0:
            i = int((err / bound).argmax())
            raise AssertionError(
                f"{ctx}: {label} differs: element {i} = {x.flatten()[i].item():.8g}, float64 "
                f"{y.flatten()[i].item():.8g} (err {err.flatten()[i].item():.3g} = {worst:.2f} x "
                f"(1e-5 + 1e-5 |y| + (W+1) u S), S = {s.flatten()[i].item():.3g})"
            )


def check_low_precision(ctx: str, got, ref, want, scale, dtype, world_size: int, labels=LABELS) -> None:
    """bf16/fp16: `got` and `reference` both within the rounding bound of the float64 oracle.

    A low-precision result is rounded when each GEMM partial is stored, at each of at most
    ``world_size - 1`` additions of partials across ranks and at the end, each time by at most the unit
    roundoff ``u`` of the sum of the terms' magnitudes ``S``: ``|x - exact| <= (world_size + 1) u S``.
    That bound, not DESIGN's tolerance against `reference`, is the check for reductions: `reference`
    adds partials in the backend's order, rounding every addition (gloo sums bf16 in bf16), so a
    strategy that adds in rank order in fp32 (more accurately) differs from it by up to
    ``(world_size - 1) u S``, past ``atol=1e-2, rtol=1.6e-2`` where terms cancel. A wrong, missing or
    stale partial is off by about ``|partial|``, far past the bound. Both are also within 2e-2 of the
    oracle by relative norm (as in the all_gather_matmul tests)."""
    u = UNIT_ROUNDOFF[dtype]
    for who, result in (("", got), (" (reference)", ref)):
        for label, x, y, s in zip(labels, result, want, scale):
            assert x.shape == y.shape, f"{ctx}{who}: {label} shape {tuple(x.shape)} != {tuple(y.shape)}"
            assert x.dtype == dtype, f"{ctx}{who}: {label} dtype {x.dtype} != {dtype}"
            err = (x.double() - y).abs()
            bound = (world_size + 1) * u * s + 1e-30
            worst = (err / bound).max().item()
            if worst > 1.0:
                i = int((err / bound).argmax())
                raise AssertionError(
                    f"{ctx}{who}: {label} is past the rounding bound: element {i} = {x.flatten()[i].item():.6g}, "
                    f"float64 {y.flatten()[i].item():.6g} (err {err.flatten()[i].item():.3g} = {worst:.2f} x "
                    f"(W+1) u S with S = {s.flatten()[i].item():.3g})"
                )
        check_relative(ctx + who, result, want, labels=labels, scale=scale)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def expect_error(fn, *args, **kwargs):
    """``(exception type name or None, message, seconds)`` of ``fn(*args, **kwargs)``."""
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


class _Done:
    """A `Work` that has 'completed' without moving any data."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def silence(rank_to_silence: int, rank: int) -> None:
    """From now on this rank (if it is `rank_to_silence`) stays in its calls but publishes nothing:
    no ready flags, no point-to-point sends, no part in collectives (they 'complete' at once locally).
    Its peers are left waiting for it, as for a stalled rank."""
    import torch.distributed as dist

    from overlap import symm

    if rank != rank_to_silence:
        return
    symm.Call.signal_ready = lambda self, *args, **kwargs: None
    batch = dist.batch_isend_irecv

    def receive_only(ops):
        ops = [op for op in ops if getattr(op.op, "__name__", "") != "isend"]
        return batch(ops) if ops else []

    dist.batch_isend_irecv = receive_only
    for name in (
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
    ):
        if hasattr(dist, name):
            setattr(dist, name, lambda *args, **kwargs: _Done())
