"""Expert parallelism: MoE token dispatch and combine, alone or fused with the experts' grouped GEMMs.

``overlap.moe`` re-exports the MoE ops (`overlap.ops.moe.dispatch`, `overlap.ops.moe.combine`; the
layout and the handle: `overlap.ops.moe.layout`)::

    h, handle = overlap.moe.dispatch_grouped_matmul(x, topk_idx, w1, num_experts)  # h_e = x_e @ w1[e]
    y = overlap.moe.grouped_matmul_combine(act(h), w2, topk_weights, handle)       # sum_k w_k * (.. @ w2[e])

    x_recv, handle = overlap.moe.dispatch(x, topk_idx, num_experts)                # rows alone
    y = overlap.moe.combine(expert_fn(x_recv), topk_weights, handle)

With ``max_tokens_per_rank=B`` the dispatches return ``W * B * min(K, L)`` rows (zero padding after the
received ones) and the handle's counts as tensors: static shapes for torch.compile (`overlap.ops.moe.bound`).
Across nodes, ``plan=Plan(..., migrate=((expert, node), ...))`` moves those experts' weights to those nodes'
tokens instead of the tokens to the experts (grouped forms only: `overlap.ops.moe.migration`).
"""

from .ops.moe.combine import combine, grouped_matmul_combine
from .ops.moe.dispatch import dispatch, dispatch_grouped_matmul
from .ops.moe.handle import MoEHandle

__all__ = ["MoEHandle", "combine", "dispatch", "dispatch_grouped_matmul", "grouped_matmul_combine"]
