"""torchao's float8 training under overlap's torch TP styles: which `Fp8Recipe` a torchao ``Float8Linear`` trains with.

``torchao.float8.convert_to_float8_training`` swaps a model's ``nn.Linear`` layers for ``Float8Linear`` (an
``nn.Linear`` subclass) whose ``config`` (a ``Float8LinearConfig``) says how each of the layer's three GEMMs casts
its operands. Overlap's ``ColwiseParallel``/``RowwiseParallel`` (`overlap.hooks.torch_tp`) take such a layer where
torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel`` would: `float8_linear_recipe` reads the recipe from the
config, and the styles run overlap's fp8 ops with it, so a sequence-parallel gather moves fp8 bytes (with rowwise
scales too, which torchao's styles do not take). torchao is never imported here: a ``Float8Linear`` is recognized by
its class's name and module.

torchao's recipes (``Float8LinearConfig.from_recipe_name``) and the recipe each trains with here:

* ``"tensorwise"``: ``Fp8Recipe("tensorwise", grads=True)`` (all three GEMMs in fp8, one scale per tensor).
* ``"rowwise"``: ``Fp8Recipe("rowwise", grads=True)`` (all three GEMMs in e4m3, scales along each reduction).
* ``"rowwise_with_gw_hp"``: ``Fp8Recipe("rowwise")``, with a warning: the forward is the same; the weight gradient's
  GEMM runs in high precision in both; the input gradient's runs in high precision here, where torchao multiplies
  the e4m3 rowwise output gradient by the tensorwise e4m3 weight. No recipe here puts one backward GEMM in fp8 and
  the other not: this is the closest, and never less precise than torchao's.

The rule behind that list, for any ``Float8LinearConfig``: the forward's casts (``cast_config_input``,
``cast_config_weight``: dynamic, e4m3fn, one granularity: ``tensorwise`` -> ``"tensorwise"``, ``axiswise`` ->
``"rowwise"``) give the granularity, and ``grads=True`` where both backward GEMMs cast their operands (the output
gradient, the weight for the input gradient, the input for the weight gradient), else ``grads=False``. A config
whose backward the recipe does not express (one backward GEMM in fp8 and the other not, a backward granularity
other than the forward's, an output gradient cast to another fp8 dtype than `Fp8Recipe.grad_dtype`) maps to that
closest recipe with a warning (once per config) naming what differs.

Differences at rounding level, not warned:

* scales: overlap's is ``amax / 448`` (`overlap.quantize_fp8`); torchao's rowwise recipes round theirs down to a
  power of two (``round_scales_to_power_of_2``). The same e4m3 grid, overlap's scale at most one binade finer.
* tensorwise: overlap quantizes a tensor on the rank that owns it, one scale per rank's shard of the activation
  and of the weight; torchao's ``DTensor`` casts reduce the amax over the whole tensor (an all-reduce per cast).
* what moves in backward: overlap's ops move gradients in their dtype (docs/fp8.md); torchao's styles cast a
  row-wise layer's output gradient to fp8 before its all-gather.
* GEMM settings (``use_fast_accum``, ``emulate``, ``pad_inner_dim``) do not apply: overlap's scaled GEMM is
  ``torch._scaled_mm`` where it takes the scales, else a dequantized float32 GEMM.

Refused with ``ValueError`` naming the config: a forward that does not cast to fp8 (``ScalingType.DISABLED``), an
input and a weight cast at different granularities or to another dtype than ``float8_e4m3fn`` (ROCm's ``fnuz``), a
weight kept as torchao's FSDP float8 tensor (``enable_fsdp_float8_all_gather``: overlap's styles shard plain
parameters), a config without the cast fields this module reads (another torchao version's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import warn_once
from ..ops.fp8_recipe import Fp8Recipe

__all__ = ["float8_linear_recipe", "is_float8_linear"]

#: torchao's granularity names (``ScalingGranularity`` values) -> overlap's
_GRANULARITY = {"tensorwise": "tensorwise", "axiswise": "rowwise"}
#: the casts of the backward's GEMMs: (what torchao names the cast config, what it is)
_BACKWARD = (("cast_config_grad_output", "the output gradient (input gradient's GEMM)"),
             ("cast_config_weight_for_grad_input", "the weight (input gradient's GEMM)"),
             ("cast_config_grad_output_for_grad_weight", "the output gradient (weight gradient's GEMM)"),
             ("cast_config_input_for_grad_weight", "the input (weight gradient's GEMM)"))


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` is torchao's ``Float8Linear`` (by its class's name and module: torchao is not imported)."""
    return any(cls.__name__ == "Float8Linear" and cls.__module__.split(".")[0] == "torchao"
               for cls in type(module).__mro__)


def _cast(config: Any, field: str) -> tuple[bool, str, torch.dtype | None]:
    """``(cast to fp8?, granularity value, target dtype)`` of one ``CastConfig`` of `config`."""
    cast = getattr(config, field, None)
    kind = getattr(getattr(cast, "scaling_type", None), "value", None)
    granularity = getattr(getattr(cast, "scaling_granularity", None), "value", None)
    if kind not in ("dynamic", "disabled") or granularity not in _GRANULARITY:
        raise ValueError(f"overlap: torchao's Float8LinearConfig.{field} is {cast!r}: not a CastConfig this version of "
                         "overlap reads (dynamic or disabled scaling, tensorwise or axiswise granularity)")
    return kind == "dynamic", granularity, getattr(cast, "target_dtype", None)


def float8_linear_recipe(module: nn.Module, where: str) -> Fp8Recipe:
    """The `Fp8Recipe` a torchao ``Float8Linear`` `module` trains with under overlap's styles (module docstring).

    Raises:
        ValueError: a config the recipes cannot express (module docstring), naming `where` (the style) and it.
    """
    config = getattr(module, "config", None)
    # (not the module's repr: torchao's prints its config, which may be what is wrong)
    what = (f"overlap's {where}: torchao's {type(module).__name__}(in_features={module.in_features}, "
            f"out_features={module.out_features})")
    fwd = [_cast(config, f) for f in ("cast_config_input", "cast_config_weight")]
    if not all(cast for cast, _, _ in fwd):
        raise ValueError(f"{what}: its forward does not cast to fp8 (config {config!r}); use a plain nn.Linear")
    if fwd[0][1] != fwd[1][1] or any(dtype != torch.float8_e4m3fn for _, _, dtype in fwd):
        raise ValueError(f"{what}: the input and the weight must both be cast to float8_e4m3fn at one granularity "
                         f"for an overlap recipe, got {[(g, d) for _, g, d in fwd]}")
    if getattr(config, "enable_fsdp_float8_all_gather", False):
        raise ValueError(f"{what}: enable_fsdp_float8_all_gather keeps the weight as torchao's FSDP float8 tensor; "
                         "overlap's styles shard plain parameters: convert with it off")
    granularity = _GRANULARITY[fwd[0][1]]
    backward = [_cast(config, f) for f, _ in _BACKWARD]
    grads = all(cast for cast, _, _ in backward)
    recipe = Fp8Recipe(granularity, grads=grads)
    differs = []
    if not grads and any(cast for cast, _, _ in backward):
        differs += [f"{name} is cast to fp8 by torchao, kept in high precision here"
                    for (_, name), (cast, _, _) in zip(_BACKWARD, backward, strict=True) if cast]
    if grads:
        differs += [f"{name} is cast {g} by torchao, {granularity} here"
                    for (_, name), (_, g, _) in zip(_BACKWARD, backward, strict=True) if _GRANULARITY[g] != granularity]
        go_dtype = backward[0][2]
        if go_dtype != recipe.grad_dtype:
            differs.append(f"the output gradient is cast to {go_dtype} by torchao, to {recipe.grad_dtype} here")
    if differs:
        warn_once(f"{what} trains with overlap's closest recipe {recipe}: " + "; ".join(differs),
                  key=f"torchao_float8:{config!r}", stacklevel=3)
    return recipe
