"""A fully sharded linear layer (FSDP / ZeRO-3 style) whose weight gather runs through `overlap`.

``ShardedLinear(in_features, out_features)`` is an ``nn.Linear`` whose weight and bias are sharded by rows
over a group: rank ``r`` holds output features ``r*out/W ... (r+1)*out/W - 1`` (``out_features % W != 0``
raises ValueError). Every rank has its own input (data parallel) and gets the whole layer's output::

    layer = overlap.nn.ShardedLinear(4096, 14336)     # each rank holds 14336/W rows of the weight
    y = layer(x)                                        # x [b, s, 4096] -> y [b, s, 14336], x differs by rank

Forward is `overlap.all_gather_weight_matmul` (``x @ all_gather(w_shard.t(), dim=1)``: the weight's gather
hidden behind the GEMM; ``symm`` never materializes the whole weight outside the symmetric heap), the
bias gathered by the same op (a ``[1, 1] @ [1, out/W]`` call, so its gradient is reduce-scattered too).
Backward leaves in ``weight.grad`` / ``bias.grad`` this rank's rows of the **sum over ranks** of the
full layer's gradients (the design's convention); torch's FSDP2 averages by default, so for its numbers
divide the loss (or the gradients) by ``W``.

Initialization equals the rows of ``torch.nn.Linear(in_features, out_features, bias)`` built after the same
random state, at any group size (the layer builds that whole layer once, on `device`, and keeps its rows):
seed every rank alike. ``state_dict()`` holds this rank's shard (``weight`` ``[out/W, in]``, ``bias``
``[out/W]``); `ShardedLinear.full_state_dict` gathers the whole ``nn.Linear`` checkpoint on every rank and
`ShardedLinear.load_full_state_dict` loads one (each rank keeps its rows).

fp8 (``fp8="rowwise" | "tensorwise" | "mxfp8"`` or an `overlap.Fp8Recipe`): the weight's forward is the op's fp8
recipe (its shard gathered in fp8, about half of bf16's bytes; the activation quantized on each rank; the output in
the input's dtype). The shard is quantized **once per optimizer step**: the layer keeps it quantized
(`overlap.ops.tp.all_gather_weight_matmul.quantize_shard`), keyed on the weight parameter's identity, its storage's
address and its ``_version``, which every in-place change bumps (an optimizer's step, ``load_full_state_dict``,
``weight.copy_``), so the forwards of one step (gradient accumulation's micro-batches, activation recomputation)
reuse it and the first forward after a step quantizes again. It holds ``out/W * in`` bytes (plus the scales) per
layer between steps. A change the key cannot see (``weight.data`` replaced by a tensor at the same address):
call `ShardedLinear.drop_fp8_cache`. Under ``torch.compile`` the cache is left out: the op quantizes the shard in the
compiled graph, at every forward. The bias is gathered in its own dtype. Gradients are those of the layer
without fp8 (``grads=False``), or the recipe's fp8 gradients (``Fp8Recipe(..., grads=True)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import Parameter

from .. import comm, envs, world
from ..ops.fp8 import GRANULARITIES, MX_BLOCK
from ..ops.fp8_recipe import TP_ONLY, Fp8Recipe, recipe_among
from ..ops.tp.all_gather_weight_matmul import all_gather_weight_matmul, quantize_shard
from ..plans import Plan
from ..plans.auto import as_plan


class ShardedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` and ``b`` sharded by rows (``out_features``) over `group`.

    Args:
        in_features, out_features: of the whole layer (``out_features`` must divide by the group's size).
        bias: add a bias (sharded like the weight, gathered in forward).
        group: the data-parallel (sharding) group (default: the world).
        strategy, plan, timeout: of the op (defaults: ``"auto"``, none, ``OVERLAP_TIMEOUT_S``).
        dtype, device: of the parameters (defaults: torch's, CPU), as for ``nn.Linear``.
        fp8: the fp8 recipe of the weight's GEMM (``"rowwise"``, ``"tensorwise"``, ``"mxfp8"`` or an
            `overlap.Fp8Recipe`; module docstring), None (default) for none.

    Raises:
        ValueError: sizes that are not positive ints, ``out_features`` not divisible by the group's size, a
            bad strategy/plan/timeout/recipe, ``"mxfp8"`` with ``in_features % 32 != 0`` (here, before any
            communication); the op's errors in forward. TypeError: `fp8` of another type.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 *, strategy: str = "auto", plan: Plan | dict | None = None, timeout: float | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 fp8: str | Fp8Recipe | None = None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"overlap.nn.ShardedLinear: {name} must be a positive int, got {value!r}")
        as_plan(strategy, plan)  # a bad strategy or plan raises here, not at the first forward
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.fp8 = recipe_among("nn.ShardedLinear", fp8, GRANULARITIES, TP_ONLY)
        if self.fp8 is not None and self.fp8.granularity == "mxfp8" and in_features % MX_BLOCK:
            raise ValueError(f"overlap.nn.ShardedLinear: fp8='mxfp8' quantizes blocks of {MX_BLOCK} along "
                             f"in_features={in_features}: it must be a multiple of {MX_BLOCK}")
        self._fp8_cache: tuple[tuple, torch.Tensor] | None = None
        self.in_features, self.out_features = in_features, out_features
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.group = world.resolve_group(group)
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if out_features % self.world_size:
            raise ValueError(f"overlap.nn.ShardedLinear: out_features={out_features} must divide by the group's "
                             f"size {self.world_size}")
        self.out_features_per_shard = out_features // self.world_size
        full = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        own = self._rows()
        with torch.no_grad():
            self.weight = Parameter(full.weight[own].clone())
            if bias:
                self.bias = Parameter(full.bias[own].clone())
            else:
                self.register_parameter("bias", None)

    def _rows(self) -> slice:
        return slice(self.rank * self.out_features_per_shard, (self.rank + 1) * self.out_features_per_shard)

    def _op_kwargs(self) -> dict[str, Any]:
        return {"group": self.group, "strategy": self.strategy, "plan": self.plan, "timeout": self.timeout}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:  # (one rank too: the op quantizes as on many, with the cached shard)
            # (a compiled graph quantizes the shard itself, in the op: the cache is the eager layer's)
            cached = None if torch.compiler.is_compiling() else self._quantized_shard()
            y = all_gather_weight_matmul(x, self.weight.t(), fp8=self.fp8, b_fp8=cached, **self._op_kwargs())
        elif self.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        else:
            y = all_gather_weight_matmul(x, self.weight.t(), **self._op_kwargs())
        if self.bias is None:
            return y
        one = torch.ones((1, 1), dtype=self.bias.dtype, device=self.bias.device)
        bias = all_gather_weight_matmul(one, self.bias.view(1, -1), **self._op_kwargs()).view(-1)
        return y + bias.to(y.dtype)

    def _quantized_shard(self) -> torch.Tensor:
        """The weight's shard quantized by the recipe, once per version of the parameter (module docstring)."""
        w = self.weight
        key = (id(w), w.data_ptr(), w._version, w.dtype, w.device, self.fp8.text)
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            self._fp8_cache = None  # (the old one is not held while the new one is made)
            self._fp8_cache = (key, quantize_shard(w.t(), self.fp8))
        return self._fp8_cache[1]

    def drop_fp8_cache(self) -> None:
        """Forget the quantized shard (the next forward quantizes again): for a weight changed without bumping its
        ``_version`` (``weight.data = ...``)."""
        self._fp8_cache = None

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole layer's checkpoint (``weight`` ``[out, in]``, ``bias`` ``[out]``), gathered on every rank
        (a collective: every rank of the group calls it); the keys of ``nn.Linear``'s ``state_dict``."""
        out = {"weight": self._gather_rows(self.weight)}
        if self.bias is not None:
            out["bias"] = self._gather_rows(self.bias)
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a whole layer's checkpoint (``nn.Linear``'s keys and shapes): each rank copies its rows. Local
        (no communication); raises ValueError for missing keys or other shapes."""
        want = {"weight": (self.out_features, self.in_features)}
        if self.bias is not None:
            want["bias"] = (self.out_features,)
        for key, shape in want.items():
            if key not in state or tuple(state[key].shape) != shape:
                got = tuple(state[key].shape) if key in state else "missing"
                raise ValueError(f"overlap.nn.ShardedLinear.load_full_state_dict: {key} must be {shape}, got {got}")
            getattr(self, key).copy_(state[key][self._rows()])

    def _gather_rows(self, shard: torch.Tensor) -> torch.Tensor:
        shard = shard.detach().contiguous()
        full = shard.new_empty((self.world_size * shard.shape[0], *shard.shape[1:]))
        timeout = envs.resolve_timeout(self.timeout)
        work = comm.all_gather_async(full, shard, self.group)
        comm.wait_work(work, "nn.ShardedLinear.full_state_dict", self.rank, "any", "all_gather", timeout,
                       world.group_info(self.group, timeout))
        return full

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"shards={self.world_size}, strategy={self.strategy!r}"
                + (f", fp8={self.fp8.text!r}" if self.fp8 is not None else ""))
