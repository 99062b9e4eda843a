"""The grouped GEMMs of the MoE ops on the host (``reference``, ``pipelined``, ``symm``, ``hierarchical``): a fixed
number of torch ops per call whatever the number of experts where `torch._grouped_mm` serves, one GEMM per
(expert, source) block otherwise; the weight gradients and the weighted sum of the combine. Row orders:
`overlap.ops.moe.layout`.
"""

from __future__ import annotations

import itertools

import torch

from ...stages import timed
from .fp8 import Fp8Experts, grad_gemm
from .layout import MoELayout

#: The dtypes `torch._grouped_mm` takes on CPU ranks. GPU ranks keep one GEMM per block for now (their grouped
#: GEMMs are the fused Triton kernels; `torch._grouped_mm` on CUDA has not run on a GPU here).
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_ok(*tensors: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: CPU, one dtype it has, 16-byte aligned data and
    strides (one of the last two dims contiguous)."""
    t0 = tensors[0]
    if t0.device.type != "cpu" or t0.dtype not in _GROUPED_DTYPES or not hasattr(torch, "_grouped_mm"):
        return False
    size = t0.element_size()
    for t in tensors:
        if t.dtype != t0.dtype or t.data_ptr() % 16 or 1 not in t.stride()[-2:]:
            return False
        if any(s != 1 and s * size % 16 for s in t.stride()):
            return False
    return True


def _ends(counts: list[int]) -> torch.Tensor:
    """The int32 end offsets of consecutive blocks of `counts` rows (`torch._grouped_mm`'s ``offs``)."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)


def _grouped(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """`torch._grouped_mm` of `a` and `b` in consecutive blocks of `counts`, or None where it does not take them
    (the caller then runs a GEMM per block)."""
    if not sum(counts) or not _grouped_ok(a, b):
        return None
    try:
        return torch._grouped_mm(a, b, offs=_ends(counts))
    except RuntimeError:  # (an operand this torch refuses after all)
        return None


@timed("gemm")
def block_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x``'s rows as consecutive blocks of ``counts[i]`` rows, block ``i`` times ``w[i]`` (``len(counts) ==
    w.shape[0]``; a block may be empty): ``[sum(counts), N]``. One grouped GEMM where `torch._grouped_mm` takes
    the operands (the same products as one GEMM per block), else one GEMM per block."""
    n = sum(counts)
    x = x[:n]
    out = _grouped(x, w, counts)
    if out is not None:
        return out
    out = x.new_empty((n, w.shape[2]))
    at = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(x[at : at + c], w[e], out=out[at : at + c])
        at += c
    return out


@timed("gemm")
def grouped_mm(x: torch.Tensor, w: torch.Tensor | Fp8Experts, handle: MoELayout) -> torch.Tensor:
    """``out_e = x_e @ w[e]`` for the expert-order blocks of ``x`` (packed fp8 rows where `w` is `Fp8Experts`)."""
    if isinstance(w, Fp8Experts):
        return w.grouped(x, handle.tokens_per_expert)
    return block_mm(x, w, handle.tokens_per_expert)


@timed("gemm")
def expert_mm(rows: torch.Tensor, w: torch.Tensor | Fp8Experts, e: int, out: torch.Tensor) -> torch.Tensor:
    """``out = rows @ w[e]``, one block of expert `e` as it lands (packed fp8 rows where `w` is `Fp8Experts`)."""
    return mm_into(rows, w, e, out)


def mm_into(rows: torch.Tensor, w: torch.Tensor | Fp8Experts, e: int, out: torch.Tensor) -> torch.Tensor:
    """`expert_mm` outside any stage (for a caller that times its own)."""
    if isinstance(w, Fp8Experts):
        return w.mm(rows, e, out)
    return torch.mm(rows, w[e], out=out)


def out_dtype(w: torch.Tensor | Fp8Experts | None, rows_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a GEMM's result on rows of `rows_dtype` (of the rows themselves where no `w` multiplies them):
    the weights' for fp8 rows, else the rows'."""
    return w.dtype if isinstance(w, Fp8Experts) else rows_dtype


@timed("gemm")
def rows_for(h: MoELayout, y: torch.Tensor, w: torch.Tensor | Fp8Experts | None, s: int, into: torch.Tensor) -> None:
    """`into` = the rows of source `s` (in `s`'s send order), each block times its expert's weight (a GEMM per
    block, straight into `into`: on CPU ranks cheaper than a grouped GEMM's separate output and its copy; packed
    fp8 rows where `w` is `Fp8Experts`)."""
    for e in range(h.num_local_experts):
        c = h.recv_counts[s][e]
        if not c:
            continue
        lo, at = h.within_source(s, e), h.expert_offsets[e][s]
        if w is not None:
            mm_into(y[at : at + c], w, e, into[lo : lo + c])
        else:
            into[lo : lo + c].copy_(y[at : at + c])


@timed("gemm")
def grouped_weight_grad(x: torch.Tensor, grad: torch.Tensor, handle: MoELayout, like: torch.Tensor,
                        fp8: str | None = None) -> torch.Tensor:
    """``grad_w[e] = x_e.T @ grad_e`` over every row of local expert ``e`` (zeros for an expert with none); with
    `fp8` (a granularity: fp8 gradients) each in fp8 along the tokens (`overlap.ops.moe.fp8.grad_gemm`)."""
    counts = handle.tokens_per_expert
    n = sum(counts)
    grad_w = _grouped(x[:n].t(), grad[:n], counts) if like.dtype == x.dtype and fp8 is None else None
    if grad_w is not None:
        return grad_w
    grad_w = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    at = 0
    for e, c in enumerate(counts):
        if c and fp8 is not None:
            grad_w[e].copy_(grad_gemm(x[at : at + c].t(), grad[at : at + c], fp8))
        elif c:
            torch.mm(x[at : at + c].t(), grad[at : at + c], out=grad_w[e])
        at += c
    return grad_w


@timed("sum")
def weighted_sum(back: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * back[t*K + k]`` in fp32 (fp64 for fp64; k in order), cast to `out_dtype`.
    Autograd-able: it gives ``topk_weights`` the dot products and the rows ``w``-weighted gradients."""
    T, K = topk_weights.shape
    acc_dtype = torch.float64 if torch.float64 in (back.dtype, topk_weights.dtype) else torch.float32
    rows, wts = back.view(T, K, back.shape[-1]), topk_weights.to(acc_dtype)
    acc = rows[:, 0].to(acc_dtype) * wts[:, :1]
    for k in range(1, K):  # (one row of each token at a time: no [T, K, N] temporary)
        acc.addcmul_(rows[:, k].to(acc_dtype), wts[:, k : k + 1])
    return acc.to(out_dtype)
