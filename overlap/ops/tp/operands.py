"""How the TP ops multiply and move their operands, plain or fp8: the GEMM of one operand pair over a range of rows
(`Gemm`), and fp8 rows packed with their scales for a gather (`Packed`).

A plain `Gemm` is ``a @ b`` by `torch.mm` in the operands' dtype. An fp8 one (``a`` and ``b`` e4m3 with their
scales, `overlap.ops.fp8`: rowwise, tensorwise or MX blocks) is a scaled GEMM in float32: the partial sums that a
reduce-scatter or an all-reduce sends and adds are float32, and the op casts its result to the caller's
``out_dtype`` at the end.

An fp8 all-gather moves each row's fp8 bytes with its scales in one row of bytes (`Packed`, `overlap.ops.fp8_rows`,
which the MoE dispatch packs its tokens with too), so every gather transport (collective, messages, shared memory,
the fused kernel) moves them as it moves any rows, with no second collective: a row's scales travel with it, in the
layout of a gather dim past the first too.
"""

from __future__ import annotations

import torch

from ..fp8 import (
    MX_BLOCK,
    OPERAND_DTYPE,
    Fp8Args,
    is_fp8,
    is_mx_scale,
    quantize_fp8,
    quantize_weight,
    scaled_mm,
)
from ..fp8_matmul import grad_quantized
from ..fp8_recipe import recipe_of
from ..fp8_rows import Packed


class Gemm:
    """``a @ b`` (``a`` ``[M, k]``, ``b`` ``[k, n]``) row range by row range; with `a_scale` and `b_scale` an fp8
    GEMM (``a_scale`` ``[M, 1]`` or one element, ``b_scale`` ``[1, n]`` or one element; MX: ``[M, k/32]`` and
    ``[k/32, n]``, e8m0) whose partials are float32."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None = None,
                 b_scale: torch.Tensor | None = None):
        self.a, self.b, self.a_scale, self.b_scale = a, b, a_scale, b_scale
        self.scaled = a_scale is not None
        self.mx = self.scaled and is_mx_scale(a_scale)  # (MX block scales on both operands: `check_scales`)
        self.n = b.shape[1]
        self.dtype = torch.float32 if self.scaled else a.dtype
        self.device = a.device

    @classmethod
    def of(cls, pair: Gemm | tuple[torch.Tensor, torch.Tensor]) -> Gemm:
        return pair if isinstance(pair, Gemm) else cls(*pair)

    def _scale(self, lo: int, hi: int) -> torch.Tensor:
        return self.a_scale[lo:hi] if per_row(self.a_scale) else self.a_scale

    def into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """``out = a[lo:hi] @ b`` (`out` ``[hi - lo, n]`` of `dtype`)."""
        if self.scaled:
            return scaled_mm(self.a[lo:hi], self.b, self._scale(lo, hi), self.b_scale, self.dtype, out=out)
        return torch.mm(self.a[lo:hi], self.b, out=out)

    def add_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """``out += a[lo:hi] @ b``."""
        if self.scaled:
            return out.add_(scaled_mm(self.a[lo:hi], self.b, self._scale(lo, hi), self.b_scale, self.dtype))
        return out.addmm_(self.a[lo:hi], self.b)

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """``a[lo:hi] @ b``, a new tensor."""
        return self.into(lo, hi, torch.empty((hi - lo, self.n), dtype=self.dtype, device=self.device))

    def whole(self) -> torch.Tensor:
        return self.rows(0, self.a.shape[0])

    def sliced(self, lo: int, hi: int) -> Gemm:
        """Rows ``lo ... hi`` alone."""
        s = self.a_scale
        if s is not None and per_row(s):
            s = s[lo:hi]
        return Gemm(self.a[lo:hi], self.b, s, self.b_scale)

    def flat(self) -> Gemm:
        """The same GEMM with ``a`` ``[M, k]`` (and a rowwise ``a_scale`` ``[M, 1]``, an MX one ``[M, k/32]``)
        flattened from ``[..., k]``."""
        a = self.a.reshape(-1, self.a.shape[-1]).contiguous()
        s = self.a_scale
        if s is not None and per_row(s):
            s = s.reshape(-1, s.shape[-1]).contiguous()
        return Gemm(a, self.b, s, self.b_scale)


def per_row(scale: torch.Tensor) -> bool:
    """Whether an activation's `scale` has a row per row of it (rowwise or MX), not one value (tensorwise)."""
    return is_mx_scale(scale) or scale.numel() != 1


class Weights:
    """The weights a gathered operand is multiplied by, chunk by chunk as it arrives: plain ``[k, n_i]``, or fp8
    with their scales (the gathered rows are then `Packed`, with MX block scales where the weights' are; the outputs
    `out_dtype`)."""

    def __init__(self, bs: list[torch.Tensor], b_scales: list[torch.Tensor] | None = None,
                 out_dtype: torch.dtype | None = None):
        self.bs, self.b_scales = bs, b_scales
        self.packed = (Packed(bs[0].shape[0], bs[0].device, mx=is_mx_scale(b_scales[0]))
                       if b_scales is not None and bs else None)
        self.out_dtype = out_dtype

    def outputs(self, rows: int, like: torch.Tensor) -> list[torch.Tensor]:
        """One new ``[rows, n_i]`` output per weight."""
        dtype = self.out_dtype if self.packed is not None else like.dtype
        return [torch.empty((rows, b.shape[1]), dtype=dtype, device=like.device) for b in self.bs]

    def multiply(self, chunk: torch.Tensor, outs: list[torch.Tensor], lo: int, hi: int) -> None:
        """``outs[i][lo:hi] = chunk @ bs[i]`` for every weight (`chunk`: gathered rows, packed where fp8)."""
        if self.packed is None:
            for b, out in zip(self.bs, outs, strict=True):
                torch.mm(chunk, b, out=out[lo:hi])
            return
        x, s = self.packed.unpack(chunk)
        for b, b_scale, out in zip(self.bs, self.b_scales, outs, strict=True):
            scaled_mm(x, b, s, b_scale, self.out_dtype, out=out[lo:hi])


def kernel_tile(tile: tuple[int, int, int], mx: bool) -> tuple[int, int, int]:
    """A fused kernel's tile ``(BLOCK_M, BLOCK_N, BLOCK_K)``; with MX scales its K step whole 32-wide blocks
    (``BLOCK_K`` at least 32: a power of two, so then a multiple of 32)."""
    bm, bn, bk = tile
    return (bm, bn, max(bk, MX_BLOCK)) if mx else tile


# ----------------------------------------------------------------------------------------------
# An op's fp8 operands: given (with their scales), or quantized on their owner by the fp8 recipe
# ----------------------------------------------------------------------------------------------


def activation(a2: torch.Tensor, scaled: Fp8Args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a_fp8 [M, k], a_scale)`` of an fp8 call's activation `a2` ``[M, k]``, the scale ``[M, 1]`` or one element
    (MX: ``[M, k/32]``) (fp8 operands: their scale flattened; with the recipe: quantized here), None for a plain
    call."""
    a_scale, recipe = scaled.a_scale, scaled.recipe
    if is_fp8(a2):
        if is_mx_scale(a_scale):
            return a2, a_scale.reshape(-1, a_scale.shape[-1]).contiguous()
        return a2, (a_scale.reshape(-1, 1).contiguous() if a_scale.numel() != 1 else a_scale.reshape(()))
    if recipe:
        return quantize_fp8(a2, recipe_of("", recipe).granularity)
    return None


def weights(bs: list[torch.Tensor], scaled: Fp8Args) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """``([b_fp8...], [b_scale...])`` of an fp8 call's weights (given, or quantized by the recipe), None for a plain
    call."""
    b_scales, recipe = scaled.b_scales, scaled.recipe
    if bs and is_fp8(bs[0]):
        return bs, list(b_scales)
    if recipe:
        pairs = [quantize_weight(b, recipe_of("", recipe).granularity) for b in bs]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return None


def gemm(a2: torch.Tensor, b: torch.Tensor, scaled: Fp8Args) -> Gemm:
    """The `Gemm` of a call whose activation rows are `a2` ``[M, k]`` and weight `b` (fp8 per `scaled`, or plain)."""
    act = activation(a2, scaled)
    if act is None:
        return Gemm(a2, b)
    (b8,), (b_scale,) = weights([b], scaled)
    return Gemm(act[0], b8, act[1], b_scale)


def grad_operands(x: torch.Tensor, y: torch.Tensor, recipe, grad: str = "x") -> Gemm:
    """``x [m, r] @ y [r, n]`` of a backward with fp8 gradients as `overlap.ops.fp8_matmul.grad_gemm` multiplies it
    (`grad_quantized`'s operands, float32 partials; else the float32 product), as a `Gemm` a reduce-scatter runs
    row range by row range."""
    q = grad_quantized(x, y, recipe, grad)
    return Gemm(x.float(), y.float()) if q is None else Gemm(q[0], q[2], q[1], q[3])


def kernel_takes(g: Gemm) -> bool:
    """Whether ``fused``'s kernels multiply `g`: plain operands, or e4m3 ones (float32 or MX scales); not e5m2
    gradients, which torch multiplies within the same protocol."""
    return not g.scaled or (g.a.dtype == OPERAND_DTYPE and g.b.dtype == OPERAND_DTYPE)
