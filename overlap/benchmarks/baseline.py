"""The ``torch`` row of every benchmark case: the op written with torch alone (`overlap.workloads.plain_torch`,
through its workload), the baseline of every speedup. No code of this project is on its timed path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..workloads import workload

__all__ = ["torch_call"]


def torch_call(op: str, group, routing: torch.Tensor | None = None, num_experts: int = 0, **options
               ) -> Callable[..., torch.Tensor]:
    """``fn(*leaves) -> out``: `op` in plain torch on `group` (the leaves as its workload orders them: TP
    ``(a, b)``, moe ``(x, w1, w2, topk_weights)`` with `routing` and `num_experts`; `options`: the call's
    keywords that the case sets, ``fp8``)."""
    return workload(op).plain_torch(group, routing, num_experts, **options)
