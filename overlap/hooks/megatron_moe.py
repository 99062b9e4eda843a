"""Megatron-core's ``MoELayer`` with its routed experts on overlap's MoE ops (public through
`overlap.hooks.megatron`: `patch` replaces every ``MoELayer``, `replace_in_spec` rewrites MoE layer specs).

The replacement, ``OverlapMoELayer``, is a subclass of Megatron's ``MoELayer`` that keeps Megatron's
``forward`` (recompute included), its router (top-k, score function, expert bias, capacity and token dropping,
the auxiliary and z losses, ``moe_router_topk_scaling_factor``), its shared experts and its experts' parameters
in Megatron's own modules: the same ``state_dict()`` keys, shapes and dtypes, the same parameter tensors. What
it replaces is the token dispatcher's all-to-alls and the experts' per-expert GEMMs between the router and the
output::

    routing_map, probs (Megatron's router, [T, E])
      -> topk_idx, topk_weights [T, K]
      -> overlap.moe.dispatch_grouped_matmul(x, topk_idx, w1)   # dispatch fused with the first GEMMs
      -> the experts' activation (Megatron's: gated or not, clamp and offset as configured)
      -> overlap.moe.grouped_matmul_combine(h, w2, topk_weights) # second GEMMs fused with the combine

over the layer's expert-parallel group. ``w1``/``w2`` are read from the experts in place: ``SequentialMLP``'s
per-expert ``linear_fc1``/``linear_fc2`` weights stacked (one copy of the weights per forward; their gradients
flow back into Megatron's parameters, zeros for an expert that got no token) or the legacy ``GroupedMLP``'s
``weight1``/``weight2`` viewed as ``[L, H, F]``/``[L, F, H]`` (no copy). The routing weights multiply each
expert's output, where Megatron multiplies the activation: equal up to rounding, the second GEMM being linear.

A slot the router dropped (capacity) is not sent: it goes to this rank's first local expert with weight 0 (the
shapes stay static; its rows cost a local GEMM row, no transfer, and contribute nothing, gradients included).
With ``moe_apply_probs_on_input`` (top-1) the tokens are scaled before the dispatch and the weights are 1.

Raises ``NotImplementedError`` at patch (or build) time naming the option, for what is not implemented: expert
tensor parallelism (``expert_tensor_parallel_size > 1``), experts with biases, Transformer Engine's experts
and activation functions, fp4, fp8 recipes with no counterpart (below), latent MoE projections,
``moe_pad_expert_input_to_capacity``.

fp8 (``fp8=`` of `overlap.hooks.megatron.patch`/``replace_in_spec``/the layer, else ``config.fp8``): the tokens are
quantized before the dispatch and the first GEMM runs on fp8 tokens and fp8 ``w1`` (`overlap.ops.moe.fp8`); the
activation, the second GEMM and the combine in the parameters' dtype, the backward too. ``fp8=``: ``"rowwise"``,
``"block128"``, ``"mxfp8"`` or an `overlap.Fp8Recipe` of one (`moe_recipe`); from the config (`MOE_CONFIG_RECIPES`):
``fp8_recipe="blockwise"`` is ``"block128"`` (Transformer Engine's 1 x 128 activation and 128 x 128 weight blocks),
``"mxfp8"`` is ``"mxfp8"``; ``"tensorwise"`` is refused for the MoE layers (a token is quantized on its own rank,
before anything tells it every rank's amax), as ``"delayed"`` and ``"custom"`` are everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..ops.fp8_recipe import Fp8Recipe
from ..ops.moe import fp8 as moe_fp8
from ..ops.moe.combine import grouped_matmul_combine
from ..ops.moe.dispatch import dispatch_grouped_matmul
from ..plans.auto import as_plan
from .megatron_linear import FP8_FROM_CONFIG, config_recipe

__all__ = ["MOE_CONFIG_RECIPES", "MoESettings", "check_moe_layer", "moe_layer_class", "moe_recipe",
           "replace_moe_layer"]

#: Megatron's ``config.fp8_recipe`` -> the MoE dispatch's granularity (the module docstring)
MOE_CONFIG_RECIPES = {"blockwise": "block128", "mxfp8": "mxfp8"}
_MOE_REFUSED = {
    "tensorwise": "a token is quantized on its own rank before the dispatch, where no per-tensor amax of every "
                  "rank is known",
    "delayed": "Transformer Engine's delayed scaling takes its scales from an amax history of earlier steps",
    "custom": "a custom quantizer factory is Transformer Engine's",
}


def moe_recipe(fp8: Any, config: Any) -> Fp8Recipe | None:
    """The fp8 recipe of a MoE layer built or patched with ``fp8=`` `fp8` (`FP8_FROM_CONFIG`: Megatron's `config`,
    mapped by `MOE_CONFIG_RECIPES`); raises naming the option for one the MoE ops do not take."""
    if isinstance(fp8, str) and fp8 == FP8_FROM_CONFIG:
        fp8 = config_recipe(config, "MoE layer", MOE_CONFIG_RECIPES, _MOE_REFUSED)
    return moe_fp8.recipe_for("hooks.megatron MoE layer", fp8, getattr(config, "hidden_size", None))


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """What `patch` passes to every replaced MoE layer's ops (`overlap.moe.dispatch_grouped_matmul`)."""

    strategy: str = "auto"
    plan: Any = None
    timeout: float | None = None
    max_tokens_per_rank: int | None = None
    fp8: Fp8Recipe | None = None  # the dispatch's (`moe_recipe`)

    def __post_init__(self):
        as_plan(self.strategy, self.plan)  # a bad strategy or plan raises at patch time
        m = self.max_tokens_per_rank
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"overlap.hooks.megatron: max_tokens_per_rank must be a positive int or None, got {m!r}")

    def op_kwargs(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "plan": self.plan, "timeout": self.timeout}


def _experts_kind(experts: torch.nn.Module) -> str:
    from megatron.core.transformer.moe import experts as mexperts

    if type(experts) is mexperts.SequentialMLP:
        return "sequential"
    if type(experts) is getattr(mexperts, "GroupedMLP", None):
        return "grouped"
    return type(experts).__name__


def check_moe_layer(layer: Any) -> None:
    """Raise ``NotImplementedError`` naming the first option of `layer` (a Megatron ``MoELayer``) that the
    replacement does not implement."""
    cfg = layer.config
    name = "overlap.hooks.megatron: MoE layer"

    def refuse(option: str, why: str) -> None:
        raise NotImplementedError(f"{name}: {option} is not supported ({why})")

    kind = _experts_kind(layer.experts)
    if kind not in ("sequential", "grouped"):
        refuse(f"experts of type {kind}", "SequentialMLP's and the legacy GroupedMLP's weights are read in place")
    if (getattr(cfg, "expert_tensor_parallel_size", None) or 1) > 1:
        refuse(f"expert_tensor_parallel_size={cfg.expert_tensor_parallel_size}",
               "each expert must sit whole on one rank of the expert-parallel group")
    if getattr(cfg, "fp4", None):
        refuse("fp4", "the experts run in the parameters' dtype")
    if getattr(cfg, "moe_latent_size", None):
        refuse("moe_latent_size", "latent projections need Transformer Engine")
    if getattr(cfg, "moe_pad_expert_input_to_capacity", False):
        refuse("moe_pad_expert_input_to_capacity", "use patch(..., max_tokens_per_rank=...) for static shapes")
    if getattr(cfg, "use_te_activation_func", False):
        refuse("use_te_activation_func", "Transformer Engine's activation is not available to the replacement")
    if getattr(cfg, "moe_apply_probs_on_input", False) and cfg.moe_router_topk != 1:
        refuse("moe_apply_probs_on_input with moe_router_topk > 1", "Megatron allows it with top-1 only")
    if kind == "sequential":
        for i, expert in enumerate(layer.experts.local_experts):
            if expert.linear_fc1.bias is not None or expert.linear_fc2.bias is not None:
                refuse(f"biases in the experts (local expert {i}; add_bias_linear)", "Megatron's MoE has none either")
    elif getattr(cfg, "add_bias_linear", False):
        refuse("add_bias_linear in grouped experts", "Megatron's MoE has none either")


def _activation(layer: Any, h: torch.Tensor) -> torch.Tensor:
    """Megatron's expert activation of the first GEMM's output: the legacy ``GroupedMLP``'s function
    (``act(gate) * linear`` where gated), written here: its own is wrapped in Megatron's ``jit_fuser``
    (``torch.compile``), whose CPU code gave garbage under ``ATEN_CPU_CAPABILITY=avx2``; else
    `megatron.core.transformer.mlp.MLP`'s unfused path (its fused kernels compute the same)."""
    experts = layer.experts
    if _experts_kind(experts) == "grouped":
        func = experts.config.activation_func
        if not experts.config.gated_linear_unit:
            return func(h)
        gate, linear = torch.chunk(h, 2, dim=-1)
        return func(gate) * linear
    config, func = experts.config, experts.local_experts[0].activation_func
    if not config.gated_linear_unit:
        return func(h)
    gate, linear = torch.chunk(h, 2, dim=-1)
    clamp = getattr(config, "activation_func_clamp_value", None)
    if clamp is not None:
        gate = gate.clamp(min=None, max=clamp)
        linear = linear.clamp(min=-clamp, max=clamp)
    return func(gate) * (linear + getattr(config, "glu_linear_offset", 0.0))


def _routing(routing_map: torch.Tensor, probs: torch.Tensor, top_k: int,
             spare_expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, K], topk_weights [T, K], kept [T, K])`` of Megatron's ``routing_map``/``probs``
    ``[T, E]``: each token's selected experts in ascending order; a slot the router dropped (not `kept`) goes to
    `spare_expert` with weight 0. No device-to-host transfer."""
    order = torch.sort(routing_map.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :top_k]
    kept = routing_map.gather(1, order)
    weights = torch.where(kept, probs.gather(1, order), torch.zeros((), dtype=probs.dtype, device=probs.device))
    idx = torch.where(kept, order, torch.full_like(order, spare_expert))
    return idx, weights, kept


def _w1(layer: Any) -> torch.Tensor:
    """The experts' first weights ``[L, H, F']``, read from Megatron's modules (see the module docstring)."""
    experts, L, H = layer.experts, layer.num_local_experts, layer.config.hidden_size
    if _experts_kind(experts) == "grouped":
        return experts.weight1.view(L, H, -1)
    return torch.stack([e.linear_fc1.weight.t() for e in experts.local_experts])


def _w2(layer: Any) -> torch.Tensor:
    """The experts' second weights ``[L, F, H]``, read from Megatron's modules."""
    experts, L, H = layer.experts, layer.num_local_experts, layer.config.hidden_size
    if _experts_kind(experts) == "grouped":
        return experts.weight2.view(L, -1, H)
    return torch.stack([e.linear_fc2.weight.t() for e in experts.local_experts])


@functools.cache
def moe_layer_class() -> type:
    """``OverlapMoELayer``: the subclass of Megatron's ``MoELayer`` described in the module docstring, made on
    first use (it needs megatron-core)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class OverlapMoELayer(MoELayer):
        """Megatron's ``MoELayer`` whose dispatch, experts and combine run on overlap's fused MoE ops (see
        `overlap.hooks.megatron_moe`). Built from a spec (`overlap.hooks.megatron.replace_in_spec`) or made
        from a built layer by `overlap.hooks.megatron.patch`."""

        def __init__(self, *args: Any, max_tokens_per_rank: int | None = None, fp8: Any = FP8_FROM_CONFIG,
                     **kwargs: Any):
            super().__init__(*args, **kwargs)
            check_moe_layer(self)
            self.overlap_settings = MoESettings(max_tokens_per_rank=max_tokens_per_rank,
                                                fp8=moe_recipe(fp8, self.config))

        # Megatron's forward calls these stages in order: shared experts, route, preprocess, dispatch,
        # routed_experts_compute, combine, postprocess.

        def shared_experts_compute(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            if not (self.use_shared_expert and self.shared_expert_overlap):
                return super().shared_experts_compute(hidden_states)
            # Megatron runs the overlapped shared experts inside its dispatcher, in these steps
            shared = self.shared_experts
            shared.pre_forward_comm(hidden_states)
            shared.linear_fc1_forward_and_act()
            shared.linear_fc2_forward()
            shared.post_forward_comm()
            return shared.get_output()

        def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
            self._overlap_shape = hidden_states.shape
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            spare = self.local_expert_indices[0]
            idx, weights, kept = _routing(routing_map, probs, self.config.moe_router_topk, spare)
            if getattr(self.config, "moe_apply_probs_on_input", False):  # top-1: the token scaled, weight 1
                x = x * weights.to(x.dtype)
                weights = kept.to(weights.dtype)
            return x, (idx, weights)

        def dispatch(self, hidden_states: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor]):
            idx, weights = routing
            s = self.overlap_settings
            h, handle = dispatch_grouped_matmul(hidden_states, idx, _w1(self), self.config.num_moe_experts,
                                                group=self.ep_group, max_tokens_per_rank=s.max_tokens_per_rank,
                                                fp8=s.fp8, **s.op_kwargs())
            return h, (handle, weights)

        def routed_experts_compute(self, hidden_states: torch.Tensor, state: tuple[Any, torch.Tensor]):
            handle, weights = state
            a = _activation(self, hidden_states)
            return grouped_matmul_combine(a, _w2(self), weights, handle, **self.overlap_settings.op_kwargs()), None

        def combine(self, output: torch.Tensor) -> torch.Tensor:
            return output  # combined in routed_experts_compute

        def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None) -> torch.Tensor:
            output = output.view(self._overlap_shape)
            return output if shared_expert_output is None else output + shared_expert_output

    OverlapMoELayer.__module__ = __name__
    OverlapMoELayer.__qualname__ = "OverlapMoELayer"
    return OverlapMoELayer


def replace_moe_layer(layer: Any, settings: MoESettings) -> Any:
    """An ``OverlapMoELayer`` sharing everything of the built `layer` (a Megatron ``MoELayer`` that
    `check_moe_layer` passed: submodules, parameters, groups; its hooks' dicts copied), with `settings`; `layer`
    is left as it was (for `overlap.hooks.megatron.unpatch`)."""
    cls = moe_layer_class()
    new = cls.__new__(cls)
    for key, value in vars(layer).items():
        # a module's own registries are copied: adding to one must not add to the other
        new.__dict__[key] = type(value)(value) if isinstance(value, (dict, set)) else value
    new.overlap_settings = settings
    return new
