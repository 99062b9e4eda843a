"""The fp8 recipe's GEMMs on one rank: `fp8_matmul` (``a @ b`` trained in fp8, where no communication is fused with
it: a layer on one rank, a column-parallel layer's replicated input, an expert's GEMM) and `grad_gemm` (a backward
GEMM of a recipe with fp8 gradients, which the TP ops' backward runs too).

`fp8_matmul` gives the numbers of the TP ops' recipe (`overlap.ops.fp8_recipe`): ``a`` quantized along ``k``
(per row, per tensor, or in MX blocks), ``b`` along ``k`` (per column, per tensor, or MX blocks), the scaled GEMM
in float32 rounded once to ``a``'s dtype; backward in ``a``'s dtype, or `grad_gemm` with fp8 gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8 import GRANULARITIES, MX_BLOCK, OPERAND_DTYPE, quantize_fp8, quantize_weight, scaled_mm
from .fp8_recipe import TP_ONLY, Fp8Recipe, recipe_among


def forward_gemm(a2: torch.Tensor, b: torch.Tensor, granularity: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The recipe's forward GEMM ``a2 [m, k] @ b [k, n]``: both quantized to e4m3 along ``k``."""
    a8, sa = quantize_fp8(a2, granularity)
    b8, sb = quantize_weight(b, granularity)
    return scaled_mm(a8, b8, sa, sb, out_dtype)


def grad_quantized(x: torch.Tensor, y: torch.Tensor, recipe: Fp8Recipe, grad: str = "x") -> tuple | None:
    """``(x8, x_scale, y8, y_scale)``: the operands of a backward GEMM ``x [m, r] @ y [r, n]`` with fp8 gradients,
    both quantized along ``r``, the output gradient (`grad`: ``"x"`` or ``"y"``) to the recipe's `grad_dtype`, the
    other operand to e4m3 (`overlap.ops.fp8_recipe`); None where the GEMM runs in float32 instead (an MX recipe
    whose ``r`` is not a multiple of 32)."""
    g = recipe.granularity
    if g == "mxfp8" and x.shape[1] % MX_BLOCK:
        return None
    x8, sx = quantize_fp8(x, g, recipe.grad_dtype if grad == "x" else OPERAND_DTYPE)
    y8, sy = quantize_weight(y, g, recipe.grad_dtype if grad == "y" else OPERAND_DTYPE)
    return x8, sx, y8, sy


def grad_gemm(x: torch.Tensor, y: torch.Tensor, recipe: Fp8Recipe, grad: str = "x") -> torch.Tensor:
    """``x [m, r] @ y [r, n]`` in float32 for a backward with fp8 gradients: the scaled GEMM of `grad_quantized`'s
    operands, or the float32 product where it gives none."""
    q = grad_quantized(x, y, recipe, grad)
    if q is None:
        return torch.mm(x.float(), y.float())
    x8, sx, y8, sy = q
    return scaled_mm(x8, y8, sx, sy, torch.float32)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.recipe = recipe
        a2 = a.reshape(-1, a.shape[-1])
        return forward_gemm(a2, b, recipe.granularity, a.dtype).view(*a.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        recipe = ctx.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        a2 = a.reshape(-1, a.shape[-1])
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = (grad_gemm(g2, b.t(), recipe).to(a.dtype) if recipe.grads else g2 @ b.t()).view(a.shape)
        if ctx.needs_input_grad[1]:
            grad_b = grad_gemm(a2.t(), g2, recipe, grad="y").to(b.dtype) if recipe.grads else a2.t() @ g2
        return grad_a, grad_b, None


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, fp8: Any) -> torch.Tensor:
    """``a [..., k] @ b [k, n]`` trained with the fp8 recipe `fp8` (a granularity or an `Fp8Recipe`) on one rank.

    Raises:
        TypeError: `a` and `b` of different dtypes, or not float32/bfloat16/float16; a bad `fp8`.
        ValueError: ``k`` not a multiple of 32 with ``"mxfp8"``; shapes that do not multiply.
    """
    recipe = recipe_among("fp8_matmul", fp8, GRANULARITIES, TP_ONLY)
    if recipe is None:
        raise TypeError("overlap.fp8_matmul: fp8 must name a recipe, got None")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"overlap.fp8_matmul: a and b must share a dtype of float32, bfloat16 or float16, got "
                        f"{a.dtype} and {b.dtype}")
    if b.dim() != 2 or a.dim() < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"overlap.fp8_matmul: a [..., k] and b [k, n] needed, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if recipe.granularity == "mxfp8" and a.shape[-1] % MX_BLOCK:
        raise ValueError(f"overlap.fp8_matmul: fp8='mxfp8' quantizes blocks of {MX_BLOCK} along k, which is "
                         f"{a.shape[-1]}: it must be a multiple of {MX_BLOCK}")
    return _Fp8Matmul.apply(a, b, recipe)
