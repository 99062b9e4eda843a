"""The fp8 training recipe in the tensor-parallel linear layers: what ``fp8=`` resolves to, and the paths where no
communication is fused with the GEMM.

`overlap.nn`'s ``ColumnParallelLinear``/``RowParallelLinear`` and `overlap.hooks.megatron`'s take ``fp8=None |
"rowwise" | "tensorwise" | "mxfp8" | overlap.Fp8Recipe`` (`overlap.ops.fp8_recipe`). Where a fused op runs (the
sequence-parallel column layer, every row layer of a group of two or more), the layer passes the recipe to it.
Elsewhere the GEMM is `overlap.fp8_matmul`, the same recipe on one rank:

* one rank (a group of one): ``fp8_matmul(x, w.T)``;
* a column layer's replicated input (no sequence parallelism): ``fp8_matmul(x, w.T)`` on the whole input, whose
  gradient is summed over the group (`overlap.ops.tp.collectives.all_reduce_grad`, Megatron's "copy to
  tensor-parallel region"): the gradient convention of the layer without fp8. Without fp8 that all-reduce is in
  flight during the weight-gradient GEMM (`linear_all_reduce_dgrad`); here it follows it.

`layer_recipe` checks ``fp8=`` where a layer is built, before any communication: an unknown recipe, parameters
that the recipe cannot take (float64), and with ``"mxfp8"`` a GEMM reduction ``k`` (``in_features`` of a column
layer, ``in_features / W`` of a row layer) that is not a multiple of the MX block, 32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..ops.context import autocast_inputs
from ..ops.fp8 import GRANULARITIES, MX_BLOCK
from ..ops.fp8_matmul import fp8_matmul
from ..ops.fp8_recipe import TP_ONLY, Fp8Recipe, recipe_among
from ..ops.tp.collectives import all_reduce_grad

#: the parameter dtypes a recipe quantizes (`overlap.fp8_matmul`'s and the ops' leaves)
FP8_LEAF_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_recipe(what: str, fp8: Any, k: int, k_name: str, dtype: torch.dtype | None) -> Fp8Recipe | None:
    """The recipe ``fp8=`` names for the layer `what` (``"nn.ColumnParallelLinear"``), whose GEMMs reduce over `k`
    (described as `k_name`) with parameters of `dtype` (None: torch's default).

    Raises:
        TypeError: `fp8` is not None, a granularity or an `Fp8Recipe`; parameters of a dtype the recipe cannot
            quantize from (float64).
        ValueError: an unknown granularity, or ``"block128"`` (the MoE dispatch's); ``"mxfp8"`` with `k` not a
            multiple of 32.
    """
    recipe = recipe_among(what, fp8, GRANULARITIES, TP_ONLY)
    if recipe is None:
        return None
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in FP8_LEAF_DTYPES:
        raise TypeError(f"overlap.{what}: fp8={recipe.text!r} quantizes float32, bfloat16 or float16 parameters, "
                        f"got {dtype}")
    if recipe.granularity == "mxfp8" and k % MX_BLOCK:
        raise ValueError(f"overlap.{what}: fp8='mxfp8' quantizes blocks of {MX_BLOCK} along the GEMM's k, which is "
                         f"{k_name}={k} here: it must be a multiple of {MX_BLOCK}")
    return recipe


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, group: dist.ProcessGroup | None = None,
               timeout: float | None = None, what: str = "fp8_linear") -> torch.Tensor:
    """``x [..., k] @ weight[n, k].T`` trained with `recipe` (`overlap.fp8_matmul`), no bias.

    With a `group`, `x` is replicated over it (a column-parallel layer without sequence parallelism) and its gradient
    is the sum over the group; None: one rank. Under autocast both operands are cast first (torch's rule for
    matmul) and the GEMM runs outside autocast, as the ops' do. `what` names the caller in a timeout's message.
    """
    x, weight = autocast_inputs(x, weight)
    if group is not None:
        x = all_reduce_grad(x, group, timeout, what)
    with torch.autocast(x.device.type, enabled=False):
        return fp8_matmul(x, weight.t(), recipe)
