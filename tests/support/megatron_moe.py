"""Megatron-core's MoE layer on gloo CPU ranks, for the tests of `overlap.hooks.megatron`'s MoE replacement.

Megatron's MoE code runs on CPU tensors as it is; only its CUDA plumbing is stubbed, and only while
`cuda_plumbing` is entered (the rank processes are reused by other tests):

* ``torch.cuda.Stream``, ``Event``, ``current_stream`` and ``stream``: no-ops (the all-to-all dispatcher makes a
  device-to-host stream and records events on it);
* ``torch.cuda.current_device``: the CPU (the router moves its weight to the current device);
* ``moe_utils.te_general_gemm``: None where Transformer Engine is absent (megatron-core 0.16.1 leaves the name
  undefined then: a ``NameError`` in the router's GEMM);
* ``maybe_move_tensor_to_cpu``: a host tensor becomes what the GPU copy would give (a numpy array where asked
  for one), else ``all_to_all_single`` gets tensors for its split sizes;
* the RNG tracker's ``fork``: a no-op (it switches CUDA RNG states), for the GPT model's dropout.

Nothing of Megatron's MoE logic (router, permutation, capacity, auxiliary losses, experts) is replaced.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from . import megatron_groups


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    __hash__ = object.__hash__

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor):
        return tensor.numpy() if as_numpy else tensor.clone()
    return tensor


@contextlib.contextmanager
def cuda_plumbing() -> Iterator[None]:
    """Megatron's CUDA plumbing stubbed (see the module docstring), put back on exit."""
    warnings.filterwarnings("ignore")
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    saved: list[tuple[Any, str, Any]] = []

    def put(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    put(torch.cuda, "Stream", _Stream)
    put(torch.cuda, "Event", _Event)
    put(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    put(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    put(torch.cuda, "current_device", lambda: torch.device("cpu"))
    if not hasattr(moe_utils, "te_general_gemm"):
        put(moe_utils, "te_general_gemm", None)
    for module in (moe_utils, token_dispatcher):
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            put(module, "maybe_move_tensor_to_cpu", _host_copy)
    tracker = mrandom.get_cuda_rng_tracker()
    put(tracker, "fork", lambda *a, **k: contextlib.nullcontext())
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


_MISSING = object()


def parallel_state(tp: int, ep: int) -> Any:
    """Megatron's parallel state over the gloo world: tensor parallel `tp`, expert parallel `ep`, expert tensor
    parallel 1."""
    from megatron.core import parallel_state as ps

    megatron_groups.reset(ps)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
    return ps


def moe_config(tp: int, ep: int, **options: Any) -> Any:
    """A small fp32 MoE `TransformerConfig` (``options`` override the defaults)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=16, ffn_hidden_size=24, moe_ffn_hidden_size=24, num_attention_heads=4,
                  num_moe_experts=4, moe_router_topk=2, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                  expert_tensor_parallel_size=1, sequence_parallel=tp > 1, use_cpu_initialization=True,
                  add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
                  moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                  params_dtype=torch.float32)
    fields.update(options)
    return TransformerConfig(**fields)


def moe_layer(config: Any, seed: int) -> Any:
    """Megatron's `MoELayer` from its local spec (``SequentialMLP`` experts, shared experts where configured).

    Parameters redrawn from `seed`: the replicated ones alike on every rank, each rank's experts from its own
    generator (Megatron's CPU init draws every rank's local experts from one RNG state: equal experts would hide
    a token sent to the wrong rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    torch.manual_seed(seed)
    layer = build_module(spec, config=config)
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed + 1 + 7919 * ps.get_expert_model_parallel_rank())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            gen = own if ".local_experts." in f".{name}" else shared
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return layer
