"""Inputs and one call of a tuning problem: what `overlap.tune.search` times for each candidate plan.

Shapes follow `overlap.plans.Problem` (the ``m x k x n`` convention of `overlap.benchmarks.cases`: the
per-rank GEMM is ``[W*m, k] @ [k, n]`` for the three TP ops; MoE: ``m`` tokens per rank of hidden ``k``,
experts of ffn ``n``). Inputs are seeded per rank and identical for every candidate of a problem, so each
candidate's result can be compared with ``reference``'s. Standard normal values, weights scaled by
``1/sqrt(fan_in)``; MoE routing: top-k of random logits (uneven loads, as in training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import moe
from ..ops.all_gather_matmul import all_gather_matmul
from ..ops.matmul_all_reduce import matmul_all_reduce
from ..ops.matmul_reduce_scatter import matmul_reduce_scatter
from ..plans import Plan, Problem

TP_OPS = {f.__name__: f for f in (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build(problem: Problem, plan: Plan, pg, info, timeout: float, seed: int) -> tuple[Callable[[], object],
                                                                                          Callable[[object], list]]:
    """``(fn, result)``: ``fn()`` runs one call (and its backward when ``problem.backward``) with `plan`;
    ``result(fn())`` is the list of tensors to compare with reference's (output, then gradients)."""
    W, r = info.world_size, info.rank
    dtype = DTYPES[problem.dtype]
    gen = torch.Generator(device=info.device).manual_seed(seed * 7919 + r)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=info.device) * scale
        return x.to(dtype)

    m, k, n = problem.m, problem.k, problem.n
    if problem.op == "moe":
        E, K = problem.experts, problem.top_k
        L = E // W
        x = draw(m, k)
        logits = torch.randn(m, E, generator=gen, device=info.device)
        vals, idx = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        wts = vals / vals.sum(-1, keepdim=True)
        w1, w2 = draw(L, k, n, scale=k**-0.5), draw(L, n, k, scale=n**-0.5)
        g = draw(m, k)
        leaves = [x, w1, w2]

        def call() -> torch.Tensor:
            h, handle = moe.dispatch_grouped_matmul(leaves[0], idx, leaves[1], E, group=pg, plan=plan,
                                                    timeout=timeout)
            return moe.grouped_matmul_combine(torch.nn.functional.gelu(h), leaves[2], wts, handle,
                                              plan=plan, timeout=timeout)
    else:
        op = TP_OPS[problem.op]
        rows = m if problem.op == "all_gather_matmul" else W * m
        reduction = k if problem.op == "all_gather_matmul" else W * k
        a, b = draw(rows, k), draw(k, n, scale=reduction**-0.5)
        out_rows = W * m if problem.op != "matmul_reduce_scatter" else m
        g = draw(out_rows, n)
        leaves = [a, b]

        def call() -> torch.Tensor:
            return op(leaves[0], leaves[1], group=pg, plan=plan, timeout=timeout)

    if problem.backward:
        leaves = [t.requires_grad_(True) for t in leaves]

    def fn() -> list[torch.Tensor]:
        for t in leaves:
            t.grad = None
        y = call()
        if not problem.backward:
            return [y]
        y.backward(g)
        return [y.detach()] + [t.grad for t in leaves]

    return fn, lambda out: out
