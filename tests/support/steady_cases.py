"""The small cases of the steady-state tests (`test_pipelined_steady.py`, `test_plain_ahead.py`): every TP op at
one shape and at another that differs in one size (another signature), with this rank's inputs and its float64
oracle, and one forward+backward on fresh leaves."""

from __future__ import annotations

import torch

from tests.support.tp_oracle import forward_backward, oracle

AGWM = "all_gather_weight_matmul"
CASE = (2, (), 8, 6, "contiguous")
OTHER = (2, (), 8, 5, "contiguous")  # another signature (n differs)
WEIGHT_CASE = (4, (), 8, 6, "weight.t()")
WEIGHT_OTHER = (4, (), 8, 5, "weight.t()")
TOL = dict(rtol=1e-4, atol=1e-4)


def case_of(op: str, other: bool = False):
    """The common case of `op`, or (`other`) the one with another signature."""
    if op == AGWM:
        return WEIGHT_OTHER if other else WEIGHT_CASE
    return OTHER if other else CASE


def inputs(op, seed, world_size, rank, case=None):
    """``(a, b, g, want)``: this rank's inputs and its float64 ``(out, grad_a, grad_b)``."""
    if op == AGWM:
        from tests.support import weight_oracle

        every, want = weight_oracle.oracle(seed, world_size, case or WEIGHT_CASE, torch.float32)
        a, w, g = every[rank]
        return a, w.t(), g, want[rank]
    every, want = oracle(op, seed, world_size, case or CASE, torch.float32)
    a, b, g = every[rank]
    return a, b, g, want[rank]


def fb(op, strategy, a, b, g):
    """One forward and backward on fresh leaves: ``(y, grad_a, grad_b)`` (grad_b as b's shape)."""
    if op == AGWM:
        from tests.support import weight_oracle

        return weight_oracle.forward_backward(strategy, a, b.t(), "weight.t()", g)
    return forward_backward(op, strategy, a, b, "contiguous", g)
