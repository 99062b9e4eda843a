"""Batch-first and several-weight cases (`Case.batch`, `Case.split`): what they change in a case's data.

A case's inputs, oracle and plain collectives are drawn as for the case without them (`case_data.build`: the op's
workload, sequence-first 2-D rows), then `arrange` lays them out as the case calls the op. The same rows, so
the FLOPs, bytes and expected values are those of the plain case, in another order:

* ``batch=B`` (``all_gather_matmul``, ``matmul_reduce_scatter``): a rank's ``m`` rows of the gathered side are
  ``[B, m/B]`` of a batch-first ``[B, s, h]`` activation whose sequence is gathered or scattered on dim 1
  (``gather_dim=1``, ``scatter_dim=1``). The gathered tensor's rows (the all-gather's output and output
  gradient, the reduce-scatter's input and input gradient) move from rank-major ``[W, B, s]`` to ``[B, W, s]``.
* ``split=(n_1, ...)`` (``all_gather_matmul``): the weight's columns as several weights (q, k and v), one gather
  feeding each: the op returns a list, and the expected output and its gradient are cut the same way.

The ``torch`` row of such a case is `overlap.workloads.plain_torch`'s batch-first, several-weight version (one
gather, the dim moved as DTensor does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..workloads import Expected, plain_torch
from .definitions import Case

__all__ = ["Arranged", "arrange"]


@dataclasses.dataclass
class Arranged:
    """A case's leaves, output gradient(s) and expected values as its call takes and gives them, the keywords
    of the op's call, how the call's operands are made from the leaves, and the ``torch`` row's function."""

    leaves: tuple[torch.Tensor, ...]
    grad_out: torch.Tensor | list[torch.Tensor] | None
    expected: list[Expected]
    kwargs: dict
    operands: Callable[..., tuple]
    torch_op: Callable[..., object]


def _batch_first(t: torch.Tensor, W: int, B: int) -> torch.Tensor:
    """Gathered rows ``[W*m, c]`` (rank-major) as batch-first ``[B, W*s, c]``."""
    Wm, c = t.shape
    s = Wm // (W * B)
    return t.view(W, B, s, c).transpose(0, 1).reshape(B, W * s, c).contiguous()


def _local(t: torch.Tensor, B: int) -> torch.Tensor:
    """A rank's rows ``[m, c]`` as batch-first ``[B, m/B, c]`` (the same order)."""
    return t.reshape(B, t.shape[0] // B, t.shape[1]).clone()


def arrange(case: Case, W: int, leaves: tuple[torch.Tensor, ...], grad_out: torch.Tensor | None,
            expected: list[Expected], group) -> Arranged | None:
    """`case`'s data laid out as its call takes it (None for a case with neither `batch` nor `split`)."""
    if not (case.batch or case.split):
        return None
    a, b = leaves
    spec = case.problem.spec
    B, gather = case.batch, spec.in_rows(1, W) == 1  # (gather: a rank's own rows in; else every row, scattered)
    values = {e.what: e.value for e in expected}
    if B and gather:  # a: this rank's rows; out and grad_out: gathered rows
        a = _local(a, B)
        values = {k: _batch_first(v, W, B) if k == "out" else _local(v, B) if k == "grad_a" else v
                  for k, v in values.items()}
        grad_out = _batch_first(grad_out, W, B) if grad_out is not None else None
    elif B:  # reduce-scatter: a and grad_a gathered rows; out and grad_out this rank's
        a = _batch_first(a, W, B)
        values = {k: _batch_first(v, W, B) if k == "grad_a" else _local(v, B) if k == "out" else v
                  for k, v in values.items()}
        grad_out = _local(grad_out, B) if grad_out is not None else None
    expected = [dataclasses.replace(e, value=values[e.what]) for e in expected]
    kwargs = {spec.dim_arg: 1} if B else {}
    dim = 1 if B else 0
    if not case.split:
        torch_op = (plain_torch.torch_all_gather_matmul_on(group, dim) if gather
                    else plain_torch.torch_matmul_reduce_scatter_on(group, dim))
        if gather:
            return Arranged((a, b), grad_out, expected, kwargs, lambda a, b: (a, b),
                            lambda a, b, f=torch_op: f(a, b)[0])
        return Arranged((a, b), grad_out, expected, kwargs, lambda a, b: (a, b), torch_op)
    bounds = [(sum(case.split[:i]), sum(case.split[: i + 1])) for i in range(len(case.split))]
    out = expected[0]
    cut = [Expected(f"out[{i}]", out.value[..., lo:hi].contiguous(), out.reduction, out.magnitude) for i, (lo, hi) in
           enumerate(bounds)]
    grads = [grad_out[..., lo:hi].contiguous() for lo, hi in bounds] if grad_out is not None else None
    gather_on = plain_torch.torch_all_gather_matmul_on(group, dim)
    return Arranged((a, b), grads, cut + expected[1:], kwargs,
                    lambda a, b: (a, [b[:, lo:hi] for lo, hi in bounds]),
                    lambda a, b: list(gather_on(a, *(b[:, lo:hi] for lo, hi in bounds))))
