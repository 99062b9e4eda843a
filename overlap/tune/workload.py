"""Inputs and one call of a tuning problem: what `overlap.tune.search` times for each candidate plan.

The inputs of a `overlap.plans.Problem` are its op's workload's (`overlap.workloads.Workload.inputs`:
standard normal values, weights scaled by ``1/sqrt(fan_in)``, MoE routing like a trained router's,
uneven loads), seeded per rank and identical for every candidate of a problem, so each candidate's
result can be compared with ``reference``'s. The call is the workload's too (`Workload.call`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..plans import Plan, Problem
from ..workloads import SeededDraw, workload


def build(problem: Problem, plan: Plan, pg, info, timeout: float, seed: int) -> tuple[Callable[[], object],
                                                                                          Callable[[object], list]]:
    """``(fn, result)``: ``fn()`` runs one call (and its backward when ``problem.backward``) with `plan`;
    ``result(fn())`` is the list of tensors to compare with reference's (output, then gradients)."""
    draw = SeededDraw(seed, info.rank, info.device, problem.torch_dtype)
    work = workload(problem.op)
    inputs = work.inputs(problem, info.world_size, draw)
    if problem.backward:
        for t in inputs.leaves:
            t.requires_grad_(True)

    def fn() -> list[torch.Tensor]:
        for t in inputs.leaves:
            t.grad = None
        y = work.call(inputs, pg, plan=plan, timeout=timeout)
        if not problem.backward:
            return [y]
        y.backward(inputs.grad_out)
        return [y.detach()] + [t.grad for t in inputs.leaves]

    return fn, lambda out: out
