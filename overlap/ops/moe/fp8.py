"""fp8 tokens of the MoE dispatch: quantized once on their owner, before routing copies them, with their scales in
the same rows (`RowFormat`, `pack`), so that one transfer moves both at about half of bf16's bytes; and the experts'
first GEMM on them (`Fp8Experts`: fp8 tokens times fp8 expert weights, the scales applied per row or block).

``fp8=`` of `overlap.moe.dispatch`/`dispatch_grouped_matmul` (and `overlap.nn.ExpertParallelMLP`) takes a granularity
or an `overlap.Fp8Recipe` (`check`):

==========  ===========================================  ===============================================
granularity a token's scales (in its row)                an expert weight ``w[e]`` ``[H, N]``'s scales
==========  ===========================================  ===============================================
rowwise     one float32 per token                        one float32 per column (along ``H``)
block128    one float32 per 128 columns (DeepSeek-V3's   one float32 per 128 x 128 block
            1 x 128; the last block may be partial)
mxfp8       one e8m0 per 32 columns (OCP MX; ``H`` a     one e8m0 per 32 rows of each column
            multiple of 32)
==========  ===========================================  ===============================================

A packed row is `overlap.ops.fp8_rows.Packed`'s (the TP ops' fp8 gathers use it too): the ``H`` e4m3 bytes, then the
scales (16-byte rows on GPUs, for the dispatch kernel). Every strategy moves such rows as it moves any other (the
heap's regions, the point-to-point pieces, the network hop of ``hierarchical``), and the GEMM reads each block's rows
as they land (`Fp8Experts.mm`).

The GEMM: `overlap.ops.fp8.scaled_mm` per expert block for ``rowwise`` and ``mxfp8`` (`torch._scaled_mm` where the
installed torch takes it on that device, as probed there; else dequantized); ``torch._scaled_grouped_mm`` for a
whole ``rowwise`` grouped GEMM where the device has it (probed once; CUDA sm_90+; never run here); ``block128``
dequantized to float32 and multiplied (no scaled GEMM here takes 1 x 128 by 128 x 128 scales); under ``fused``, the
Triton grouped GEMM's fp8 form for ``rowwise`` and ``mxfp8`` (`Fp8Experts.fused`;
`overlap.kernels.dispatch_grouped_matmul`). The result has the weights' dtype. The combine moves and multiplies in
that dtype, as without fp8.

Autograd: the tokens' gradient is the straight-through one (the quantization's derivative taken as 1), travelling
back in the weights' dtype; ``w1``'s gradient multiplies the dequantized rows that arrived (what the forward
multiplied) by the output gradient. Both backward GEMMs run in the weights' dtype (the dense recipe's
``grads=False``, the default) or, with an `overlap.Fp8Recipe` of ``grads=True`` (``"rowwise+grads"``...), in fp8
(`backward_operands`, `grad_gemm`), each operand e4m3 along the GEMM's reduction at the dispatch's granularity:

* ``rowwise``: the input gradient ``grad_h [R, N] @ w1[e].T`` with one scale per row of ``grad_h`` and of
  ``w1[e]``; ``w1``'s gradient ``rows_e.T @ grad_h_e`` with one scale per column of each (along the tokens).
* ``block128``: ``grad_h`` in 1 x 128 blocks and ``w1[e].T`` in 128 x 128 (DeepSeek-V3's); for ``w1``'s
  gradient blocks of 128 tokens per column of each.
* ``mxfp8``: MX blocks of 32 along ``N`` (a multiple of 32: `check_width`); for ``w1``'s gradient MX blocks of 32
  tokens per column, float32 for an expert whose token count is not a multiple of 32 (the dense recipe's rule).

The output gradient's rows are quantized once on the expert's rank and packed as the tokens were (`RowFormat` of
``N`` columns); each block's GEMM gives the weights' dtype as it leaves, so what travels back is what travels
without fp8 gradients. ``block128`` is dequantized and multiplied in float32 (no scaled GEMM here takes its blocks);
``w1``'s gradient is float32 rounded once to the weights' dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ...stages import timed
from ..fp8 import MIN_SCALE, MX_BLOCK, OPERAND_DTYPE, dequantize, quantize_fp8, scaled_mm
from ..fp8_matmul import grad_gemm as fp8_grad_gemm
from ..fp8_recipe import Fp8Recipe, recipe_among, recipe_of
from ..fp8_rows import Packed

#: the granularities of an MoE dispatch's tokens
GRANULARITIES = ("rowwise", "block128", "mxfp8")
#: the columns of a ``block128`` scale (tokens), and the rows and columns of a weight's
BLOCK = 128


# ----------------------------------------------------------------------------------------------
# The recipe of a call
# ----------------------------------------------------------------------------------------------


def recipe_for(op: str, fp8: object, hidden: int | None = None) -> Fp8Recipe | None:
    """``fp8=`` of an MoE call or layer (tokens of `hidden` columns where known): None, or its recipe; raises
    (TypeError, ValueError, NotImplementedError) naming `op` for one the MoE ops do not take."""
    recipe = recipe_among(op, fp8, GRANULARITIES, "a dispatch quantizes each token on its owner: its scales are per "
                          "token or per block")
    if recipe is None:
        return None
    if recipe.granularity == "mxfp8" and hidden is not None and hidden % MX_BLOCK:
        raise ValueError(f"overlap.{op}: fp8='mxfp8' quantizes blocks of {MX_BLOCK} along the hidden size, which "
                         f"is {hidden}: it must be a multiple of {MX_BLOCK} (or use 'rowwise' or 'block128')")
    return recipe


def check_width(op: str, recipe: Fp8Recipe | None, width: int) -> None:
    """An ``mxfp8`` recipe with fp8 gradients needs an expert width (``w1``'s columns, the input gradient's
    reduction) that is a multiple of 32; raises ValueError naming `op` otherwise."""
    if recipe is not None and recipe.grads and recipe.granularity == "mxfp8" and width % MX_BLOCK:
        raise ValueError(f"overlap.{op}: fp8={recipe.text!r} quantizes the output gradient in blocks of {MX_BLOCK} "
                         f"along the experts' width, which is {width}: it must be a multiple of {MX_BLOCK} (or drop "
                         "'+grads', or use 'rowwise' or 'block128')")


def check(op: str, fp8: object, x: torch.Tensor) -> Fp8Recipe | None:
    """`recipe_for` of a dispatch whose tokens are `x` ``[T, H]``, which must be float32, bfloat16 or float16;
    before any communication."""
    recipe = recipe_for(f"moe.{op}", fp8, x.shape[1])
    if recipe is not None and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"overlap.moe.{op}: fp8={recipe.text!r} quantizes float32, bfloat16 or float16 tokens, got "
                        f"{x.dtype}")
    return recipe


# ----------------------------------------------------------------------------------------------
# Packed rows: fp8 bytes, then the scales
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """The packed row of a token of `hidden` columns at `granularity` on a device of `device_type` (module
    docstring; the bytes are `overlap.ops.fp8_rows.Packed`'s); `grads`: the call's backward GEMMs run in fp8 too."""

    granularity: str
    hidden: int
    device_type: str = "cpu"
    grads: bool = False

    @functools.cached_property
    def packed(self) -> Packed:
        g = self.granularity
        return Packed(self.hidden, torch.device(self.device_type), mx=g == "mxfp8",
                      block=BLOCK if g == "block128" else None)

    @property
    def cols(self) -> int:
        """The packed row's bytes."""
        return self.packed.width

    def __str__(self) -> str:
        return f"{self.granularity} ({self.cols} bytes a row for {self.hidden} columns)"


def row_format(recipe: Fp8Recipe | None, hidden: int, device: torch.device) -> RowFormat | None:
    return None if recipe is None else RowFormat(recipe.granularity, hidden, device.type, recipe.grads)


def quantize_rows(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8 [T, H] e4m3, scales [T, blocks])`` of tokens `x` ``[T, H]`` (amax-based, saturating: `overlap.ops.fp8`);
    ``block128``'s last block may be partial (its amax over the columns it has)."""
    if granularity == "rowwise":
        return quantize_fp8(x, "rowwise")
    if granularity == "mxfp8":
        return quantize_fp8(x, "mxfp8")
    T, H = x.shape
    nb = -(-H // BLOCK)
    xf = x.detach().float()
    if nb * BLOCK != H:
        xf = torch.cat([xf, xf.new_zeros((T, nb * BLOCK - H))], dim=1)
    blocks = xf.view(T, nb, BLOCK)
    fmax = torch.finfo(OPERAND_DTYPE).max
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_SCALE * fmax) / fmax
    q = (blocks / scale).clamp(-fmax, fmax).to(OPERAND_DTYPE).view(T, nb * BLOCK)[:, :H]
    return q, scale.view(T, nb)


@timed("fp8 cast")
def pack(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Tokens `x` ``[T, H]`` as packed rows ``[T, fmt.cols]`` uint8 (quantized once, here)."""
    if x.shape[0] == 0:
        return torch.zeros((0, fmt.cols), dtype=torch.uint8, device=x.device)
    return fmt.packed.pack(*quantize_rows(x, fmt.granularity))


def unpack(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8 [R, H] e4m3, scales [R, blocks])`` of packed `rows` (a view of the data, a copy of the scales)."""
    return fmt.packed.unpack(rows)


def dequantize_rows(rows: torch.Tensor, fmt: RowFormat, dtype: torch.dtype) -> torch.Tensor:
    """Packed `rows` as the values they stand for, ``[R, H]`` in `dtype`."""
    x8, scale = unpack(rows, fmt)
    return _dequantize_tokens(x8, scale, fmt).to(dtype)


def _block_values(x: torch.Tensor) -> torch.Tensor:
    """The values of `x` ``[m, r]`` quantized in 1 x 128 blocks along ``r``, float32."""
    x8, scale = quantize_rows(x, "block128")
    return x8.float() * scale.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]


def _dequantize_tokens(x8: torch.Tensor, scale: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    if fmt.granularity == "block128":
        return x8.float() * scale.repeat_interleave(BLOCK, dim=1)[:, : fmt.hidden]
    return dequantize(x8, scale, -1)


def kept_rows(x, w, grads: str, fp8: str, rows) -> torch.Tensor:
    """The fake of the rows a dispatch keeps for its weight gradient: ``[rows, H]`` in ``x``'s dtype, packed fp8
    rows (uint8) with `fp8`, 0 elements where no weight gradient is asked for."""
    if w is None or grads[1] != "1":
        return x.new_empty((0,))
    recipe = recipe_of("moe.dispatch", fp8)
    if recipe is None:
        return x.new_empty((rows, x.shape[1]))
    return x.new_empty((rows, RowFormat(recipe.granularity, x.shape[1], x.device.type).cols), dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------
# fp8 gradients (``+grads``)
# ----------------------------------------------------------------------------------------------


@timed("fp8 cast")
def backward_operands(grad: torch.Tensor, w_t: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, Fp8Experts]:
    """The input gradient's operands with fp8 gradients: the output gradient's rows `grad` ``[R, N]`` packed along
    ``N`` at `fmt`'s granularity, and ``w1.T`` `w_t` ``[L, N, H]`` quantized along ``N`` to match."""
    gfmt = RowFormat(fmt.granularity, grad.shape[1], fmt.device_type)
    return pack(grad, gfmt), Fp8Experts.quantize(w_t, gfmt)


def grad_gemm(x: torch.Tensor, y: torch.Tensor, granularity: str) -> torch.Tensor:
    """``x [m, r] @ y [r, n]`` in float32 for ``w1``'s gradient with fp8 gradients: both operands e4m3 along ``r``
    (the tokens) at `granularity` (module docstring)."""
    if granularity != "block128":
        return fp8_grad_gemm(x, y, Fp8Recipe(granularity, grads=True), grad="y")
    return torch.mm(_block_values(x), _block_values(y.t()).t())


# ----------------------------------------------------------------------------------------------
# The experts' weights and their GEMM
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Fp8Experts:
    """Expert weights ``[L, H, N]`` quantized along ``H`` at a `RowFormat`'s granularity, for the GEMMs of the
    packed rows: `w8` e4m3 ``[L, H, N]``; `scale` ``[L, 1, N]`` (rowwise), ``[L, ceil(H/128), ceil(N/128)]``
    (block128) or ``[L, H/32, N]`` e8m0 (mxfp8); `dtype` the result's (the weights' own)."""

    w8: torch.Tensor
    scale: torch.Tensor
    fmt: RowFormat
    dtype: torch.dtype
    _dense: dict = dataclasses.field(default_factory=dict)

    @classmethod
    @timed("fp8 cast")
    def quantize(cls, w: torch.Tensor, fmt: RowFormat) -> Fp8Experts:
        L, H, N = w.shape
        g = fmt.granularity
        if g == "block128":
            nh, nn = -(-H // BLOCK), -(-N // BLOCK)
            wf = torch.zeros((L, nh * BLOCK, nn * BLOCK), dtype=torch.float32, device=w.device)
            wf[:, :H, :N] = w.detach().float()
            blocks = wf.view(L, nh, BLOCK, nn, BLOCK)
            fmax = torch.finfo(OPERAND_DTYPE).max
            scale = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=MIN_SCALE * fmax) / fmax
            q = (blocks / scale).clamp(-fmax, fmax).to(OPERAND_DTYPE).view(L, nh * BLOCK, nn * BLOCK)
            return cls(q[:, :H, :N], scale.view(L, nh, nn), fmt, w.dtype)
        wt8, st = quantize_fp8(w.transpose(1, 2), "rowwise" if g == "rowwise" else "mxfp8")  # along H
        return cls(wt8.transpose(1, 2), st.transpose(1, 2), fmt, w.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.w8.shape

    @property
    def fused(self) -> bool:
        """Whether the fused Triton grouped GEMM takes these scales (rowwise, MX; not 128 x 128 blocks)."""
        return self.fmt.granularity != "block128"

    @property
    def device(self) -> torch.device:
        return self.w8.device

    def dense(self, e: int) -> torch.Tensor:
        """Expert `e`'s weight as the values it stands for, float32 ``[H, N]`` (kept for the call)."""
        if e not in self._dense:
            w8, s = self.w8[e], self.scale[e]
            if self.fmt.granularity == "block128":
                H, N = w8.shape
                full = s.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:H, :N]
                self._dense[e] = w8.float() * full
            else:
                self._dense[e] = dequantize(w8, s, 0)
        return self._dense[e]

    def mm(self, rows: torch.Tensor, e: int, out: torch.Tensor) -> torch.Tensor:
        """``out = rows @ w[e]``: `rows` packed (uint8), the scales applied per row or block."""
        if not rows.shape[0]:
            return out
        x8, sx = unpack(rows, self.fmt)
        if self.fmt.granularity == "block128":
            return out.copy_(torch.mm(_dequantize_tokens(x8, sx, self.fmt), self.dense(e)))
        return scaled_mm(x8, self.w8[e], sx, self.scale[e], out.dtype, out=out)

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Consecutive blocks of `counts` packed rows, block ``i`` times ``w[i]``: ``[sum(counts), N]``."""
        n = sum(counts)
        out = _scaled_grouped(rows[:n], self, counts)
        if out is not None:
            return out
        out = torch.empty((n, self.shape[2]), dtype=self.dtype, device=rows.device)
        at = 0
        for e, c in enumerate(counts):
            if c:
                self.mm(rows[at : at + c], e, out[at : at + c])
            at += c
        return out


#: `_grouped_native`'s answers, per device and dtype
_PROBED: dict[tuple, bool] = {}


def _scaled_grouped(rows: torch.Tensor, w: Fp8Experts, counts: list[int]) -> torch.Tensor | None:
    """``torch._scaled_grouped_mm`` of a ``rowwise`` call where the device takes it (probed once), else None."""
    if w.fmt.granularity != "rowwise" or rows.device.type != "cuda" or not sum(counts):
        return None
    if not _grouped_native(rows.device, w.dtype):
        return None
    x8, sx = unpack(rows, w.fmt)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)
    b = w.w8.transpose(1, 2).contiguous().transpose(1, 2)  # column-major per expert
    return torch._scaled_grouped_mm(x8.contiguous(), b, sx.reshape(-1).contiguous(),
                                    w.scale.reshape(w.shape[0], -1).contiguous(), offs=offs, out_dtype=w.dtype)


def _grouped_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_grouped_mm`` takes rowwise e4m3 on `device` and gives the dequantized product
    (tried once on a small problem; never while torch.compile traces)."""
    key = (device, dtype)
    if key not in _PROBED:
        if torch.compiler.is_compiling() or not hasattr(torch, "_scaled_grouped_mm"):
            return False
        gen = torch.Generator().manual_seed(0)
        fmt = RowFormat("rowwise", 64, device.type)
        x = torch.randn((32, 64), generator=gen).to(device)
        w = Fp8Experts.quantize(torch.randn((2, 64, 32), generator=gen).to(device, dtype), fmt)
        rows = pack(x, fmt)
        try:
            _PROBED[key] = True
            got = _scaled_grouped(rows, w, [16, 16]).float()
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
            _PROBED[key] = False
            return False
        xd = dequantize_rows(rows, fmt, torch.float32)
        want = torch.cat([xd[:16] @ w.dense(0), xd[16:] @ w.dense(1)])
        _PROBED[key] = bool(((got - want).abs() <= 2.0**-6 * want.abs() + 1e-3 * want.abs().max()).all())
    return _PROBED[key]
