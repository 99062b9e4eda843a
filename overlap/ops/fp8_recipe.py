"""The fp8 training recipe: one vocabulary for the ops' ``fp8=``, `overlap.nn`'s layers, the Megatron hooks, the torch
styles and the MoE experts.

``fp8=`` takes a granularity, ``"rowwise"``, ``"tensorwise"`` or ``"mxfp8"`` (`overlap.ops.fp8`), or an `Fp8Recipe`
that adds fp8 gradients. With a recipe, the forward's operands (high-precision leaves) are quantized on their owner
to e4m3 at that granularity (so a gather moves fp8 bytes) and multiplied by scaled GEMMs; the result has the
leaves' dtype. The backward's GEMMs run in the leaves' dtype (``grads=False``, the default: torchao's float8 training
with high-precision gradients), or in fp8 (``grads=True``) with torchao's convention for the granularity:

============  ===============================================================================================
granularity   fp8 gradients (``grads=True``): the output gradient and the operand it meets
============  ===============================================================================================
tensorwise    the output gradient e5m2, the operand it meets e4m3, one scale per tensor (torchao's ``tensorwise``)
rowwise       e4m3, one scale per row along the GEMM's reduction (torchao's ``rowwise`` recipe)
mxfp8         e4m3, MX blocks of 32 along the GEMM's reduction (torchao's MX training); a reduction that is not a
              multiple of 32 (a token count) is multiplied in float32 instead
============  ===============================================================================================

Either way a backward GEMM's result is float32 and what moves between ranks is what moves without fp8: the
reduce-scatter of an input gradient, the gathers of the weight path, in the leaves' dtype or float32.

A custom op takes the recipe as its text (`Fp8Recipe.text`: ``"rowwise"``, ``"rowwise+grads"``; ``""`` for none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .fp8 import GRANULARITIES, is_fp8

GRADS_SUFFIX = "+grads"
#: 1 x 128 token blocks, 128 x 128 weight blocks (DeepSeek-V3): the MoE dispatch's (`overlap.ops.moe.fp8`) alone
BLOCK128 = "block128"
#: what a recipe may name: the TP ops take `GRANULARITIES`, the MoE ops rowwise, block128 and mxfp8
RECIPE_GRANULARITIES = (*GRANULARITIES, BLOCK128)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """An fp8 training recipe: the forward's `granularity` and whether the backward's GEMMs run in fp8 (`grads`).

    Raises:
        ValueError: an unknown granularity. TypeError: `grads` not a bool.
    """

    granularity: str = "rowwise"
    grads: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in RECIPE_GRANULARITIES:
            raise ValueError(f"overlap.Fp8Recipe: granularity must be one of {RECIPE_GRANULARITIES}, got "
                             f"{self.granularity!r}")
        if not isinstance(self.grads, bool):
            raise TypeError(f"overlap.Fp8Recipe: grads must be a bool, got {type(self.grads).__name__}")

    @property
    def text(self) -> str:
        """What a custom op takes: the granularity, ``+grads`` with fp8 gradients."""
        return self.granularity + (GRADS_SUFFIX if self.grads else "")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The fp8 dtype of the output gradient in the backward's GEMMs (``grads=True``): e5m2 tensorwise, e4m3
        otherwise; the operand it meets (a weight, a saved input) is e4m3."""
        return torch.float8_e5m2 if self.granularity == "tensorwise" else torch.float8_e4m3fn


def _expected(op: str) -> str:
    return (f"overlap.{op}: fp8 must be None, one of {', '.join(repr(g) for g in RECIPE_GRANULARITIES)} or an "
            "overlap.Fp8Recipe")


def recipe_of(op: str, fp8: Any) -> Fp8Recipe | None:
    """The recipe `fp8` names (None, a granularity, a recipe's `text`, or an `Fp8Recipe`); raises TypeError or
    ValueError naming `op` for anything else."""
    if fp8 is None or fp8 == "":
        return None
    if isinstance(fp8, Fp8Recipe):
        return fp8
    if not isinstance(fp8, str):
        raise TypeError(f"{_expected(op)}, got {type(fp8).__name__}")
    granularity = fp8.removesuffix(GRADS_SUFFIX)
    if granularity not in RECIPE_GRANULARITIES:
        raise ValueError(f"{_expected(op)}, got {fp8!r}")
    return Fp8Recipe(granularity, fp8.endswith(GRADS_SUFFIX))


def recipe_among(op: str, fp8: Any, allowed: tuple[str, ...], why: str) -> Fp8Recipe | None:
    """`recipe_of` for a call or layer that takes the granularities `allowed` alone; another raises ValueError naming
    `op`, the recipe, `why` and what to use instead."""
    recipe = recipe_of(op, fp8)
    if recipe is not None and recipe.granularity not in allowed:
        raise ValueError(f"overlap.{op}: fp8={recipe.text!r} is not taken here ({why}): use one of "
                         f"{', '.join(map(repr, allowed))}")
    return recipe


#: why the TP ops, their layers and `fp8_matmul` refuse `BLOCK128`
TP_ONLY = "block128 is the MoE dispatch's granularity: its tokens' 1 x 128 blocks"


def text_of(fp8: Any) -> Any:
    """`fp8` as a custom op takes it: an `Fp8Recipe`'s text; anything else as it is (the op's checks judge it)."""
    return fp8.text if isinstance(fp8, Fp8Recipe) else fp8


def check_recipe(op: str, fp8: Any, a: torch.Tensor) -> Fp8Recipe | None:
    """``fp8=`` of a call whose activation is `a`: a recipe (`recipe_of`), on high-precision operands. Returns it."""
    recipe = recipe_among(op, fp8, GRANULARITIES, TP_ONLY)
    if recipe is None:
        return None
    if is_fp8(a):
        raise TypeError(f"overlap.{op}: fp8={recipe.text!r} quantizes high-precision operands; a is {a.dtype} "
                        "already (pass a_scale and b_scale instead)")
    if a.dtype == torch.float64:
        raise TypeError(f"overlap.{op}: fp8={recipe.text!r} takes float32, bfloat16 or float16 operands, got "
                        "float64")
    return recipe
