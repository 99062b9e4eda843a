"""A trial of a plan: the inputs and one call of a problem, what `overlap.tune.search` times for each candidate
plan (and the emulated cluster's figures for each plan of its grid).

The inputs of a `overlap.plans.Problem` are its op's workload's (`overlap.workloads.Workload.inputs`:
standard normal values, weights scaled by ``1/sqrt(fan_in)``, MoE routing like a trained router's,
uneven loads), seeded per rank and identical for every candidate of a problem, so each candidate's
result can be compared with ``reference``'s. The call is the workload's too (`Workload.call`). A MoE problem
tuned for a given routing (`trial_call`'s `routing`) draws each token's experts from its node's shares instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..plans import Plan, Problem
from ..plans.migration import nodes_of
from . import workload
from .data import SeededDraw


def trial_call(problem: Problem, plan: Plan, pg, info, timeout: float, seed: int,
          routing=None) -> tuple[Callable[[], object], Callable[[object], list]]:
    """``(fn, result)``: ``fn()`` runs one call (and its backward when ``problem.backward``) with `plan`;
    ``result(fn())`` is the list of tensors to compare with reference's (output, then gradients). `routing`
    (MoE): ``E`` per-expert shares, or ``E`` rows of one per node (`overlap.tune.search.tune`)."""
    draw = SeededDraw(seed, info.rank, info.device, problem.torch_dtype)
    work = workload(problem.op)
    options = {}
    if routing is not None and problem.spec.family == "moe":
        node = next(m for m, ranks in enumerate(nodes_of(info)) if info.rank in ranks)
        options["shares"] = [float(row[node]) if isinstance(row, Sequence) else float(row) for row in routing]
    inputs = work.inputs(problem, info.world_size, draw, **options)
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
