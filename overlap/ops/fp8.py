"""fp8 with `torch._scaled_mm`'s conventions: quantizing (`quantize_fp8`), the checks of an op's scales
(`check_scales`), and the scaled GEMM the ops run on fp8 operands (`scaled_mm`).

A quantized tensor is a pair ``(x_fp8, scale)`` with ``x ~= x_fp8.float() * scale``:

* ``rowwise``: one float32 scale per row, ``scale`` of shape ``x.shape[:-1] + (1,)``; a weight ``b`` ``[k, n]``
  has one per column, ``[1, n]`` (`quantize_fp8` of ``b.t()`` gives ``[n, 1]``: pass its ``.t()``);
* ``tensorwise``: one float32 scale for the whole tensor (any one-element tensor; `quantize_fp8` makes it 0-dim).

Quantizing is amax-based with saturation: ``scale = amax / max(dtype)`` (amax over the row or the tensor, in
float32; an all-zero row gets the smallest positive scale), ``x_fp8 = clamp(x / scale)`` cast to `dtype`.

`scaled_mm` multiplies with `torch._scaled_mm` where the installed torch takes those operands and scales on
that device (probed once per kind of call on a tiny problem: torch 2.13 on CPU takes tensorwise and rowwise
scales at any size; CUDA needs sm_89+, sizes that are multiples of 16 and both scales of one kind), and
otherwise dequantizes to float32 and runs `torch.mm` (the same value up to the accumulation order).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: the fp8 dtype of the ops' operands (e5m2 is for gradients: `quantize_fp8` makes it, the ops refuse it)
OPERAND_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("rowwise", "tensorwise")
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
        granularity: ``"rowwise"`` (one scale per row: ``x.shape[:-1] + (1,)``) or ``"tensorwise"`` (one 0-dim
            scale).
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Raises:
        TypeError: `x` is not a floating tensor (or is fp8 already), `dtype` is not an fp8 dtype.
        ValueError: an unknown `granularity`, an empty or 0-dim `x` with rowwise scales.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in FP8_DTYPES:
        what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"overlap.quantize_fp8: x must be a floating tensor that is not fp8 already, got {what}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"overlap.quantize_fp8: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"overlap.quantize_fp8: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if x.numel() == 0 or (granularity == "rowwise" and x.dim() == 0):
        raise ValueError(f"overlap.quantize_fp8: cannot quantize a tensor of shape {tuple(x.shape)} "
                         f"{granularity}")
    xf = x.detach().float()
    if granularity == "rowwise":
        amax = xf.abs().amax(dim=-1, keepdim=True)
    else:
        amax = xf.abs().amax()
    scale = amax.clamp(min=MIN_SCALE * torch.finfo(dtype).max) / torch.finfo(dtype).max
    fmax = torch.finfo(dtype).max
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


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


def check_scale(op: str, name: str, scale: object, like: torch.Tensor, rowwise_shape: tuple[int, ...]) -> str:
    """`scale` of an operand like `like`: float32 on its device, ``rowwise_shape`` (rowwise) or one element
    (tensorwise), positive (checked on CPU tensors only: a GPU check would read the device). Returns its
    granularity."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"overlap.{op}: {name} must be a float32 tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"overlap.{op}: {name} must be float32, got {scale.dtype}")
    if scale.device != like.device:
        raise ValueError(f"overlap.{op}: {name} is on {scale.device}, its operand on {like.device}")
    if scale.requires_grad:
        raise TypeError(f"overlap.{op}: {name} requires grad; with fp8 operands the op is forward-only")
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
    """Every check of an fp8 call's operands and scales; returns the granularities ``(a's, [each b's])``."""
    check_operands(op, a, bs)
    check_out_dtype(op, out_dtype)
    if len(b_scales) != len(bs):
        raise ValueError(f"overlap.{op}: b_scale must be a list of {len(bs)} scales (one per weight), got "
                         f"{len(b_scales)}")
    a_kind = check_scale(op, "a_scale", a_scale, a, (*a.shape[:-1], 1))
    b_kinds = [check_scale(op, "b_scale" if len(bs) == 1 else f"b_scale[{i}]", s, b, (1, b.shape[1]))
               for i, (b, s) in enumerate(zip(bs, b_scales, strict=True))]
    return a_kind, b_kinds


def check_no_scales(op: str, a: torch.Tensor, a_scale: object, b_scale: object, out_dtype: object) -> None:
    """A call whose `a` is not fp8 takes no scales and no out_dtype."""
    given = [n for n, v in (("a_scale", a_scale), ("b_scale", b_scale), ("out_dtype", out_dtype)) if v is not None]
    if given:
        raise TypeError(f"overlap.{op}: {', '.join(given)} given but a is {a.dtype}, not fp8 (quantize the operands "
                        "with overlap.quantize_fp8, or pass fp8='rowwise' or 'tensorwise' to train in fp8)")


def check_recipe(op: str, fp8: object, a: torch.Tensor) -> None:
    """``fp8=`` (the training recipe): a granularity, on high-precision operands."""
    if fp8 is None:
        return
    if not isinstance(fp8, str):
        raise TypeError(f"overlap.{op}: fp8 must be None, 'rowwise' or 'tensorwise', got {type(fp8).__name__}")
    if fp8 not in GRANULARITIES:
        raise ValueError(f"overlap.{op}: fp8 must be None, 'rowwise' or 'tensorwise', got {fp8!r}")
    if is_fp8(a):
        raise TypeError(f"overlap.{op}: fp8={fp8!r} quantizes high-precision operands; a is {a.dtype} already "
                        "(pass a_scale and b_scale instead)")
    if a.dtype == torch.float64:
        raise TypeError(f"overlap.{op}: fp8={fp8!r} takes float32, bfloat16 or float16 operands, got float64")


# ----------------------------------------------------------------------------------------------
# The scaled GEMM
# ----------------------------------------------------------------------------------------------


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)`` in `out_dtype` (into `out` where given): `a` ``[m, k]`` and `b` ``[k, n]``
    fp8, `a_scale` ``[m, 1]`` or one element, `b_scale` ``[1, n]`` or one element (module docstring)."""
    if _native(a.device, a_scale.numel() != 1, b_scale.numel() != 1, out_dtype, _aligned(a, b)):
        a_scale = a_scale.reshape(()) if a_scale.numel() == 1 else a_scale.contiguous()
        b_scale = b_scale.reshape(()) if b_scale.numel() == 1 else b_scale.contiguous()
        if a.device.type == "cuda":  # (row-major a, column-major b)
            a = a.contiguous()
            b = b.t().contiguous().t()
        if out is None:
            return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
        return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype, out=out)
    y = torch.mm(a.float() * a_scale.reshape(-1, 1) if a_scale.numel() != 1 else a.float() * a_scale.reshape(()),
                 b.float() * (b_scale.reshape(1, -1) if b_scale.numel() != 1 else b_scale.reshape(())))
    if out is None:
        return y.to(out_dtype)
    return out.copy_(y)


def _aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0


@functools.lru_cache(maxsize=64)
def _native(device: torch.device, a_rowwise: bool, b_rowwise: bool, out_dtype: torch.dtype, aligned: bool) -> bool:
    """Whether `torch._scaled_mm` takes such a call on `device` (tried once on a tiny problem)."""
    if device.type == "cuda" and not aligned:
        return False
    m = n = k = 16
    try:
        a = torch.ones((m, k), device=device).to(OPERAND_DTYPE)
        b = torch.ones((n, k), device=device).to(OPERAND_DTYPE).t()
        sa = torch.ones((m, 1) if a_rowwise else (), device=device)
        sb = torch.ones((1, n) if b_rowwise else (), device=device)
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        return bool(y.float().sub(k).abs().max().item() == 0)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
        return False
