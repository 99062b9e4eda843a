"""fp8 with `torch._scaled_mm`'s conventions: quantizing (`quantize_fp8`), the checks of an op's scales
(`check_scales`), and the scaled GEMM the ops run on fp8 operands (`scaled_mm`).

A quantized tensor is a pair ``(x_fp8, scale)`` with ``x ~= x_fp8.float() * scale``:

* ``rowwise``: one float32 scale per row, ``scale`` of shape ``x.shape[:-1] + (1,)``; a weight ``b`` ``[k, n]``
  has one per column, ``[1, n]`` (`quantize_fp8` of ``b.t()`` gives ``[n, 1]``: pass its ``.t()``);
* ``tensorwise``: one float32 scale for the whole tensor (any one-element tensor; `quantize_fp8` makes it 0-dim);
* ``mxfp8`` (OCP MX): one power-of-two scale per block of 32 consecutive elements along the last dim (``k``), as
  ``torch.float8_e8m0fnu``: ``scale`` of shape ``x.shape[:-1] + (k // 32,)``; a weight ``b`` ``[k, n]`` has
  ``[k // 32, n]`` (blocks along ``k`` in each column).

Quantizing is amax-based with saturation: ``scale = amax / max(dtype)`` (amax over the row or the tensor, in
float32; an all-zero row gets the smallest positive scale), ``x_fp8 = clamp(x / scale)`` cast to `dtype`. An MX
block's scale is that value rounded up to a power of two (``2 ** ceil(log2(amax / max))``, clamped to e8m0's
range: no element of the block overflows, the "RCEIL" rounding of cuBLAS and torchao).

`scaled_mm` multiplies with `torch._scaled_mm` where the installed torch takes those operands and scales on
that device (probed once per kind of call on a tiny problem: torch 2.13 on CPU takes tensorwise and rowwise
scales at any size; CUDA needs sm_89+, sizes that are multiples of 16 and both scales of one kind), and
otherwise dequantizes to float32 and runs `torch.mm` (the same value up to the accumulation order).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: the fp8 dtype of the ops' operands (e5m2 is for gradients: `quantize_fp8` makes it, the ops refuse it)
OPERAND_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("rowwise", "tensorwise", "mxfp8")
#: the MX block: elements along ``k`` sharing one e8m0 scale
MX_BLOCK = 32
MX_SCALE_DTYPE = torch.float8_e8m0fnu
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the smallest scale `quantize_fp8` gives (an all-zero row or tensor)
MIN_SCALE = 1e-12


@dataclasses.dataclass(frozen=True)
class Fp8Args:
    """A TP call's fp8 arguments as its custom op takes them: `a_scale` (or None), one `b_scales` entry per weight,
    `out_dtype` (or None) with fp8 operands; or the `recipe` (``"rowwise"``, ``"tensorwise"``; ``""``: none) on
    high-precision operands. Their values are checked by the op (`check_scales`, `check_recipe`), not here."""

    a_scale: Any = None
    b_scales: tuple = ()
    out_dtype: Any = None
    recipe: Any = ""

    @property
    def scales(self) -> tuple:
        """Every scale given (the activation's first), None left out."""
        return tuple(s for s in (self.a_scale, *self.b_scales) if s is not None)


def is_fp8(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, granularity: str = "rowwise",
                 dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` with ``x ~= x_fp8.float() * scale`` (module docstring: amax-based, saturating).

    Args:
        x: a floating tensor ``[..., k]`` (rowwise: at least 1-D; any size but empty).
        granularity: ``"rowwise"`` (one scale per row: ``x.shape[:-1] + (1,)``), ``"tensorwise"`` (one 0-dim
            scale) or ``"mxfp8"`` (one e8m0 scale per 32 elements of the last dim: ``x.shape[:-1] + (k // 32,)``).
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Raises:
        TypeError: `x` is not a floating tensor (or is fp8 already), `dtype` is not an fp8 dtype.
        ValueError: an unknown `granularity`, an empty or 0-dim `x` with rowwise scales, a last dim that is not a
            multiple of 32 with ``"mxfp8"``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"overlap.quantize_fp8: x must be a floating tensor that is not fp8 already, got {what}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"overlap.quantize_fp8: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"overlap.quantize_fp8: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if x.numel() == 0 or (granularity != "tensorwise" and x.dim() == 0):
        raise ValueError(f"overlap.quantize_fp8: cannot quantize a tensor of shape {tuple(x.shape)} "
                         f"{granularity}")
    if granularity == "mxfp8":
        return _quantize_mx(x, dtype)
    xf = x.detach().float()
    if granularity == "rowwise":
        amax = xf.abs().amax(dim=-1, keepdim=True)
    else:
        amax = xf.abs().amax()
    scale = amax.clamp(min=MIN_SCALE * torch.finfo(dtype).max) / torch.finfo(dtype).max
    fmax = torch.finfo(dtype).max
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


def quantize_weight(b: torch.Tensor, granularity: str,
                    dtype: torch.dtype = OPERAND_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b_fp8, b_scale)`` of ``b`` ``[k, n]`` (a GEMM's right operand: a weight) quantized along ``k``: rowwise
    one scale per column, ``[1, n]``; mxfp8 ``[k/32, n]``; tensorwise one."""
    if granularity == "tensorwise":
        return quantize_fp8(b, "tensorwise", dtype)
    bt, s = quantize_fp8(b.t(), granularity, dtype)
    return bt.t(), s.t()


def _quantize_mx(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"overlap.quantize_fp8: mxfp8 quantizes blocks of {MX_BLOCK} along the last dim, which is "
                         f"{k} (shape {tuple(x.shape)}): it must be a multiple of {MX_BLOCK}")
    fmax = torch.finfo(dtype).max
    blocks = x.detach().float().reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # the smallest power of two at least amax / fmax, within e8m0's exponents (2^-127 ... 2^127)
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0 ** -126 * fmax) / fmax)).clamp(-127, 127)
    scale = torch.exp2(exponent)
    q = (blocks / scale).clamp(-fmax, fmax).to(dtype).reshape(x.shape)
    return q, scale.reshape(*x.shape[:-1], k // MX_BLOCK).to(MX_SCALE_DTYPE)


def is_mx_scale(scale: object) -> bool:
    return isinstance(scale, torch.Tensor) and scale.dtype == MX_SCALE_DTYPE


def dequantize(x: torch.Tensor, scale: torch.Tensor, blocks_along: int = -1) -> torch.Tensor:
    """``x_fp8 * scale`` in float32: rowwise/tensorwise scales broadcast; MX scales (e8m0) expanded over their blocks
    of 32 along dim `blocks_along` (the last for an activation ``[m, k]``, 0 for a weight ``[k, n]``)."""
    if is_mx_scale(scale):
        return x.float() * scale.float().repeat_interleave(MX_BLOCK, dim=blocks_along)
    return x.float() * (scale.reshape(()) if scale.numel() == 1 else scale)


# ----------------------------------------------------------------------------------------------
# An op's scales: checked on this rank before any communication
# ----------------------------------------------------------------------------------------------


def check_out_dtype(op: str, out_dtype: object) -> None:
    """None (bfloat16) or one of `OUT_DTYPES`."""
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"overlap.{op}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def check_operands(op: str, a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    """fp8 operands: both e4m3, neither requiring grad (the ops are forward-only on fp8 tensors)."""
    if not is_fp8(a):
        raise TypeError(f"overlap.{op}: b is fp8 but a is {a.dtype}; both operands must be fp8 (quantize a with "
                        "overlap.quantize_fp8) or neither")
    for name, x in (("a", a), *((f"b[{i}]" if len(bs) > 1 else "b", b) for i, b in enumerate(bs))):
        if not is_fp8(x):
            raise TypeError(f"overlap.{op}: a is fp8 ({a.dtype}), so every operand must be: {name} is {x.dtype} "
                            "(quantize it with overlap.quantize_fp8)")
        if x.dtype != OPERAND_DTYPE:
            raise TypeError(f"overlap.{op}: {name} is {x.dtype}; the operands must be {OPERAND_DTYPE} (e5m2 is a "
                            "gradient format)")
        if x.requires_grad:
            raise TypeError(f"overlap.{op}: {name} is an fp8 tensor that requires grad; with fp8 operands the op is "
                            "forward-only (train with fp8='rowwise' or 'tensorwise' on high-precision tensors)")


def check_scale(op: str, name: str, scale: object, like: torch.Tensor, rowwise_shape: tuple[int, ...],
                mx_shape: tuple[int, ...] | None = None) -> str:
    """`scale` of an operand like `like`: on its device, float32 of ``rowwise_shape`` (rowwise) or one element
    (tensorwise), positive (checked on CPU tensors only: a GPU check would read the device); or e8m0 of `mx_shape`
    (MX blocks, where the operand's ``k`` divides by 32). Returns its granularity."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"overlap.{op}: {name} must be a float32 (or, MX, float8_e8m0fnu) tensor, got "
                        f"{type(scale).__name__}")
    if scale.dtype not in (torch.float32, MX_SCALE_DTYPE):
        raise TypeError(f"overlap.{op}: {name} must be float32 (or, MX, float8_e8m0fnu), got {scale.dtype}")
    if scale.device != like.device:
        raise ValueError(f"overlap.{op}: {name} is on {scale.device}, its operand on {like.device}")
    if scale.requires_grad:
        raise TypeError(f"overlap.{op}: {name} requires grad; with fp8 operands the op is forward-only")
    if scale.dtype == MX_SCALE_DTYPE:
        if mx_shape is None or tuple(scale.shape) != tuple(mx_shape):
            want = (f"{tuple(mx_shape)} (one per {MX_BLOCK} elements along k)" if mx_shape is not None
                    else f"none: k is not a multiple of {MX_BLOCK}")
            raise ValueError(f"overlap.{op}: {name} is an MX scale of shape {tuple(scale.shape)}; expected {want}")
        return "mxfp8"
    if scale.numel() == 1 and tuple(scale.shape) != tuple(rowwise_shape):
        granularity = "tensorwise"
    elif tuple(scale.shape) == tuple(rowwise_shape):
        granularity = "rowwise"
    else:
        raise ValueError(f"overlap.{op}: {name} has shape {tuple(scale.shape)}; expected {tuple(rowwise_shape)} "
                         "(rowwise) or one element (tensorwise)")
    if scale.device.type == "cpu" and not bool((scale > 0).all()):
        raise ValueError(f"overlap.{op}: {name} has non-positive values (min {scale.min().item()}); scales must "
                         "be positive")
    return granularity


def check_scales(op: str, a: torch.Tensor, bs: list[torch.Tensor], a_scale: object, b_scales: list,
                 out_dtype: object) -> tuple[str, list[str]]:
    """Every check of an fp8 call's operands and scales; returns the granularities ``(a's, [each b's])``. MX scales
    come on both operands or on neither."""
    check_operands(op, a, bs)
    check_out_dtype(op, out_dtype)
    if len(b_scales) != len(bs):
        raise ValueError(f"overlap.{op}: b_scale must be a list of {len(bs)} scales (one per weight), got "
                         f"{len(b_scales)}")
    k = a.shape[-1]
    mx = k % MX_BLOCK == 0
    a_kind = check_scale(op, "a_scale", a_scale, a, (*a.shape[:-1], 1),
                         (*a.shape[:-1], k // MX_BLOCK) if mx else None)
    b_kinds = [check_scale(op, "b_scale" if len(bs) == 1 else f"b_scale[{i}]", s, b, (1, b.shape[1]),
                           (b.shape[0] // MX_BLOCK, b.shape[1]) if mx else None)
               for i, (b, s) in enumerate(zip(bs, b_scales, strict=True))]
    if (a_kind == "mxfp8") != all(kind == "mxfp8" for kind in b_kinds) or (
            a_kind != "mxfp8" and "mxfp8" in b_kinds):
        raise ValueError(f"overlap.{op}: MX block scales (float8_e8m0fnu) must be given for a and every b, or for "
                         f"none; got a_scale {a_kind}, b_scale {'/'.join(b_kinds)}")
    return a_kind, b_kinds


def check_no_scales(op: str, a: torch.Tensor, a_scale: object, b_scale: object, out_dtype: object) -> None:
    """A call whose `a` is not fp8 takes no scales and no out_dtype."""
    given = [n for n, v in (("a_scale", a_scale), ("b_scale", b_scale), ("out_dtype", out_dtype)) if v is not None]
    if given:
        raise TypeError(f"overlap.{op}: {', '.join(given)} given but a is {a.dtype}, not fp8 (quantize the operands "
                        "with overlap.quantize_fp8, or pass fp8='rowwise' or 'tensorwise' to train in fp8)")


# ----------------------------------------------------------------------------------------------
# The scaled GEMM
# ----------------------------------------------------------------------------------------------


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)`` in `out_dtype` (into `out` where given): `a` ``[m, k]`` and `b` ``[k, n]``
    fp8 (e4m3, or e5m2 for a gradient), `a_scale` ``[m, 1]`` or one element and `b_scale` ``[1, n]`` or one
    element, or MX scales on both (``[m, k/32]`` and ``[k/32, n]``, e8m0) (module docstring)."""
    mx = is_mx_scale(a_scale)
    kind = "mx" if mx else "/".join("row" if s.numel() != 1 else "tensor" for s in (a_scale, b_scale))
    if _native(a.device, kind, a.dtype, b.dtype, out_dtype, _aligned(a, b, mx)):
        if mx:
            a_scale, b_scale = to_blocked(a_scale), to_blocked(b_scale.t())
        else:
            a_scale = a_scale.reshape(()) if a_scale.numel() == 1 else a_scale.contiguous()
            b_scale = b_scale.reshape(()) if b_scale.numel() == 1 else b_scale.contiguous()
        # row-major a, column-major b: what CUDA needs, and what inductor's CPU lowering checks too
        a = a.contiguous()
        b = b.t().contiguous().t()
        if out is None:
            return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
        return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype, out=out)
    y = torch.mm(dequantize(a, a_scale, -1), dequantize(b, b_scale, 0))
    if out is None:
        return y.to(out_dtype)
    return out.copy_(y)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """MX scales ``[rows, k/32]`` in the tiled layout cuBLAS reads (rows padded to 128, columns to 4, with the
    smallest scale; each 128 x 4 tile stored as 32 x 16, row ``r`` of the tile at ``(r % 32, (r // 32) * 4 + c)``;
    tiles row-block major), flattened."""
    rows, cols = scale.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scale.new_zeros((pr, pc)) if (pr, pc) != (rows, cols) else scale
    if padded is not scale:
        padded[:rows, :cols] = scale
    tiles = padded.view(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)  # [row block, col block, 128, 4]
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).contiguous()


def _aligned(a: torch.Tensor, b: torch.Tensor, mx: bool) -> bool:
    if mx:
        return a.shape[0] % 128 == 0 and a.shape[1] % 128 == 0 and b.shape[1] % 128 == 0
    return a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


#: `_native`'s answers, per kind of call
_PROBED: dict[tuple, bool] = {}


def _native(device: torch.device, kind: str, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
            aligned: bool) -> bool:
    """Whether `torch._scaled_mm` takes such a call on `device` and gives the dequantized product (tried once on a
    tiny problem with random scales, so that a layout it reads otherwise is caught too). While torch.compile
    traces, a kind of call not probed yet is dequantized (a probe cannot run inside a trace; the same numbers up
    to float32 rounding)."""
    if device.type == "cuda" and not aligned:
        return False
    key = (device, kind, a_dtype, b_dtype, out_dtype)
    if key not in _PROBED:
        if torch.compiler.is_compiling():
            return False
        _PROBED[key] = _probe(device, kind, a_dtype, b_dtype, out_dtype)
    return _PROBED[key]


def _probe(device: torch.device, kind: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
           out_dtype: torch.dtype) -> bool:
    m = n = k = 128 if kind == "mx" else 16
    gen = torch.Generator().manual_seed(0)
    a = torch.randn((m, k), generator=gen)
    b = torch.randn((k, n), generator=gen)
    if kind == "mx":
        (a8, sa), (bt8, sbt) = quantize_fp8(a * torch.rand((m, k), generator=gen) * 8, "mxfp8", a_dtype), \
            quantize_fp8(b.t().contiguous(), "mxfp8", b_dtype)
        b8, sb = bt8.t(), sbt.t()
    else:
        a_row, b_row = kind.split("/")
        a8, sa = quantize_fp8(a, "rowwise" if a_row == "row" else "tensorwise", a_dtype)
        bt8, sbt = quantize_fp8(b.t().contiguous(), "rowwise" if b_row == "row" else "tensorwise", b_dtype)
        b8, sb = bt8.t(), sbt.t() if sbt.dim() else sbt
    want = torch.mm(dequantize(a8, sa, -1), dequantize(b8, sb, 0))
    try:
        a8, b8 = a8.to(device), b8.t().contiguous().t().to(device)
        if kind == "mx":
            sa, sb = to_blocked(sa.to(device)), to_blocked(sb.t().contiguous().to(device))
        else:
            sa, sb = sa.to(device), sb.to(device)
        y = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype).float().cpu()
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
        return False
    tol = 2.0 ** -7 if out_dtype == torch.bfloat16 else 2.0 ** -10
    return bool(((y - want).abs() <= tol * want.abs() + 1e-3 * want.abs().max()).all())
