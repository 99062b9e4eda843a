"""The float64 oracle of ``all_gather_weight_matmul`` (the weight-side gather of FSDP) and its checks.

Every rank regenerates every rank's inputs from the test's seed and computes, in float64, with a
different input ``a_r`` and output gradient ``g_r`` on every rank and ``B = cat_q(b_q, dim=1)``:
``y_r = a_r @ B``; ``grad a_r = g_r @ B.T``; ``grad b_r = sum_q a_q.T @ g_q[:, columns of r]`` (a sum over
ranks: the design's convention). A case is ``(rows, mid, k, n, layout)``: ``n`` the columns of one shard,
``layout`` ``"weight.t()"`` (``b = w_shard.t()``, a transposed view) or ``"contiguous"``.
"""

from __future__ import annotations

import math
import types

import torch

from overlap.workloads import OpInputs, workload

from .harness import FALLBACK_TIMEOUT_S
from .tp_oracle import TOL, check_fp32, check_low_precision, compare, name_of

OP = "all_gather_weight_matmul"


def rank_inputs(seed: int, rank: int, world_size: int, case, dtype):
    """This rank's ``(a, w_shard, g)``; ``b = w_shard.t()`` (or its contiguous copy, `b_of`)."""
    rows, mid, k, n, _layout = case
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    a = torch.randn((rows, *mid, k), generator=gen, dtype=torch.float64)
    w = torch.randn((n, k), generator=gen, dtype=torch.float64) * k**-0.5
    g = torch.randn((rows, *mid, world_size * n), generator=gen, dtype=torch.float64)
    return a.to(dtype), w.to(dtype), g.to(dtype)


def b_of(w_shard: torch.Tensor, layout: str) -> torch.Tensor:
    return w_shard.t() if layout == "weight.t()" else w_shard.t().contiguous()


def oracle(seed: int, world_size: int, case, dtype, magnitudes: bool = False):
    """Every rank's inputs and every rank's float64 ``(out, grad_a, grad_b [k, n])``: the op's workload oracle
    (`overlap.workloads`) on the inputs as 2-D rows, shaped back; with `magnitudes` the same sums over the
    terms' absolute values (what bounds their rounding)."""
    rows, mid, k, n, _layout = case
    inputs = [rank_inputs(seed, r, world_size, case, dtype) for r in range(world_size)]
    f = torch.abs if magnitudes else (lambda t: t)
    every = [OpInputs((f(a.double()).reshape(-1, k), f(w.double()).t()), f(g.double()).reshape(-1, world_size * n))
             for a, w, g in inputs]
    problem = types.SimpleNamespace(m=rows * math.prod(mid), k=k, n=n, backward=True)
    want = []
    for r in range(world_size):
        out, grad_a, grad_b = (e.value for e in workload(OP).oracle(problem, every, r))
        want.append((out.view(rows, *mid, world_size * n), grad_a.view(inputs[r][0].shape), grad_b))
    return inputs, want


def forward_backward(strategy, a, w_shard, layout, g, group=None, timeout=None):
    """One forward and backward on fresh leaves: ``(y, grad_a, grad_b [k, n])``."""
    import overlap

    a = a.detach().clone().requires_grad_()
    w = w_shard.detach().clone().requires_grad_()
    b = b_of(w, layout)
    kwargs = dict(strategy=strategy) if isinstance(strategy, str) else dict(plan=strategy)
    y = overlap.all_gather_weight_matmul(a, b, group=group, timeout=timeout, **kwargs)
    y.backward(g)
    return y.detach(), a.grad, w.grad.t()


def check(rank: int, world_size: int, strategy, dtype, seed: int, cases, timeout: float = FALLBACK_TIMEOUT_S,
          group=None):
    """`strategy` against the float64 oracle (the tolerances of `tests.support.tp_oracle.check_op`); returns this
    rank's results, one ``(y, grad_a, grad_b)`` per case."""
    results = []
    for i, case in enumerate(cases):
        rows, mid, k, n, layout = case
        inputs, want = oracle(seed + i, world_size, case, dtype)
        a, w, g = inputs[rank]
        got = forward_backward(strategy, a, w, layout, g, group=group, timeout=timeout)
        ctx = (f"{OP} rank {rank}/{world_size} {name_of(strategy)} {str(dtype).removeprefix('torch.')} "
               f"a={tuple(a.shape)} b=({k}, {n}) {layout} seed={seed + i}")
        if dtype == torch.float64:
            compare(ctx, got, want[rank], dtype, TOL[dtype])
        elif dtype == torch.float32:
            scale = oracle(seed + i, world_size, case, dtype, magnitudes=True)[1][rank]
            check_fp32(ctx, got, want[rank], scale, world_size)
        else:
            ref = forward_backward("reference", a, w, layout, g, group=group, timeout=timeout)
            scale = oracle(seed + i, world_size, case, dtype, magnitudes=True)[1][rank]
            check_low_precision(ctx, got, ref, want[rank], scale, dtype, world_size)
        results.append(got)
    return results
