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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import Parameter

from .. import comm, envs, world
from ..ops.tp.all_gather_weight_matmul import all_gather_weight_matmul
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

    Raises:
        ValueError: sizes that are not positive ints, ``out_features`` not divisible by the group's size, a
            bad strategy/plan/timeout (here, before any communication); the op's errors in forward.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 *, strategy: str = "auto", plan: Plan | dict | None = None, timeout: float | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"overlap.nn.ShardedLinear: {name} must be a positive int, got {value!r}")
        as_plan(strategy, plan)  # a bad strategy or plan raises here, not at the first forward
        if timeout is not None:
            envs.resolve_timeout(timeout)
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
        if self.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_gather_weight_matmul(x, self.weight.t(), **self._op_kwargs())
        if self.bias is None:
            return y
        one = torch.ones((1, 1), dtype=self.bias.dtype, device=self.bias.device)
        bias = all_gather_weight_matmul(one, self.bias.view(1, -1), **self._op_kwargs()).view(-1)
        return y + bias.to(y.dtype)

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
                f"shards={self.world_size}, strategy={self.strategy!r}")
