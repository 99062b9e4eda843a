"""Sums of partial results in a fixed order: one rounding, bitwise repeatable (the reduce-scatters and
all-reduces of `matmul_reduce_scatter`, `matmul_all_reduce` and `hierarchical_reduce`; the output projection of
`all_to_all_matmul`)."""

from __future__ import annotations

import torch

LOW = (torch.float16, torch.bfloat16)


def sum_in_order(parts: list[torch.Tensor], out: torch.Tensor, lo: int, hi: int) -> None:
    """``out[lo:hi] = sum_i parts[i][lo:hi]`` in the order of `parts` (in fp32 for 16-bit dtypes, rounded once
    into `out`)."""
    if parts[0].dtype in LOW:
        acc = parts[0][lo:hi].float()
        for part in parts[1:]:
            acc += part[lo:hi]
        out[lo:hi].copy_(acc)
        return
    out[lo:hi].copy_(parts[0][lo:hi])
    for part in parts[1:]:
        out[lo:hi] += part[lo:hi]
