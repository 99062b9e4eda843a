"""What the benchmark computes for a case: inputs, the local oracle, the collectives and GEMMs alone.

All of it is the case's op's workload (`overlap.workloads`: the inputs, oracle and plain collectives of every
op): `build` draws
every rank's inputs of the case (seeded per case, rank and tensor, so every rank can regenerate every
rank's inputs and compute the collective's result on its own: the oracle that ``reference`` is
checked against), and the op's plain collectives alone and its GEMMs alone, the ``T_comm`` and
``T_compute`` of the overlap efficiency (see `runner`). Never zeros as inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .. import world
from ..plans import Plan
from ..workloads import Expected, OpInputs, SeededDraw, workload
from . import layouts
from .baseline import torch_call
from .definitions import TORCH, AnyCase, Case, label_plan

__all__ = ["CaseData", "Expected", "build", "strategy_fn"]


@dataclasses.dataclass
class CaseData:
    """One case's tensors on this rank and the functions the runner checks and times."""

    op: Callable[..., Any]  # op(*inputs, strategy=, plan=, timeout=): the workload's call (a list: `Case.split`)
    torch_op: Callable[..., Any]  # torch_op(*inputs): the op in plain torch (`baseline`), the torch row
    inputs: tuple[torch.Tensor, ...]  # leaves that require grad in fwd+bwd: (a, b); moe: (x, w1, w2, topk_weights)
    grad_out: torch.Tensor | list[torch.Tensor] | None  # fwd+bwd only; one per output
    expected: list[Expected]  # out, then in fwd+bwd the gradient of each input, in order
    comm: Callable[[], None]  # the plain collectives alone
    compute: Callable[[], None]  # the GEMMs alone
    comm_label: str
    compute_label: str
    comm_bytes: int  # bytes one rank receives in the plain collectives (the GB/s column)
    notes: list[str] = dataclasses.field(default_factory=list)  # facts about the case worth a footnote


def build(case: AnyCase, seed: int, case_index: int, info: world.GroupInfo, pg, timeout: float) -> CaseData:
    """This rank's `CaseData` of `case` (collective-free: every rank computes its own oracle)."""
    problem, W, r = case.problem, info.world_size, info.rank
    work = workload(problem.op)
    draw = SeededDraw((seed * 1_000_003 + case_index) % 2**62, r, info.device, case.torch_dtype)
    with torch.no_grad():
        every = [work.inputs(problem, W, draw.for_rank(q)) for q in range(W)]
        expected = work.oracle(problem, every, r)
        plain = work.plain(problem, every, r, pg, info, timeout, problem.spec.comm_bytes(problem, W))
    mine = every[r]
    leaves, grad_out, operands, extra = mine.leaves, mine.grad_out, (lambda *t: t), {}
    torch_op = torch_call(case.op, pg, mine.routing, mine.num_experts, **mine.options)
    laid = layouts.arrange(case, W, leaves, grad_out, expected, pg) if isinstance(case, Case) else None
    if laid is not None:  # batch-first or several weights: the same rows in the order the call takes them
        leaves, grad_out, expected = laid.leaves, laid.grad_out, laid.expected
        operands, extra, torch_op = laid.operands, laid.kwargs, laid.torch_op
    if case.backward:
        for t in leaves:
            t.requires_grad_(True)

    def op(*leaves: torch.Tensor, **kwargs) -> Any:  # timed: no more than the call itself
        return work.call(OpInputs(operands(*leaves), mine.grad_out, mine.routing, mine.num_experts, mine.options),
                         pg, **extra, **kwargs)

    # The collectives and GEMMs alone read the inputs, leaves that require grad in fwd+bwd: no autograd.
    return CaseData(op, torch_op, leaves, grad_out, expected, torch.no_grad()(plain.comm),
                    torch.no_grad()(plain.compute), plain.comm_label, plain.compute_label, plain.comm_bytes,
                    [f"{case.name}: {note}" for note in plain.notes])


def _outputs(out: Any) -> list[torch.Tensor]:
    """A call's outputs as a list (several weights: the op returns one per weight)."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


def strategy_fn(w: CaseData, case: AnyCase, label: str, timeout: float | None) -> Callable[[], list[torch.Tensor]]:
    """One timed call of row `label` (``torch``: `CaseData.torch_op`; ``auto``: ``strategy="auto"``):
    ``[out]``, or in fwd+bwd ``[out, gradient of each input]`` (the backward of a fresh output with the fixed
    `CaseData.grad_out`, gradients not accumulated)."""
    strategy, fields = label_plan(case.op, label)
    kwargs = {"strategy": strategy, "plan": Plan(strategy, **fields) if fields else None, "timeout": timeout}
    if label == TORCH:  # plain torch: nothing of overlap on the timed path
        call, kwargs = w.torch_op, {}
    else:
        call = w.op
    if not case.backward:
        return lambda: _outputs(call(*w.inputs, **kwargs))

    def forward_backward() -> list[torch.Tensor]:
        outs = _outputs(call(*w.inputs, **kwargs))
        grads = w.grad_out if isinstance(w.grad_out, list) else [w.grad_out]
        return [*(o.detach() for o in outs), *torch.autograd.grad(outs, w.inputs, grads)]

    return forward_backward
