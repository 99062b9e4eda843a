"""Tensor-parallel linear layers in plain torch: no Megatron config, a tensor out, ``nn.Linear``'s numbers.

``ColumnParallelLinear`` splits ``out_features`` over the group (rank ``r`` holds output features
``r*out/W ... (r+1)*out/W - 1``: rows of the weight, and of the bias); ``RowParallelLinear`` splits
``in_features`` (columns of the weight; the bias is whole on every rank and added once, after the
reduction). Stacked column then row, they are a Megatron-style tensor-parallel MLP::

    up = overlap.nn.ColumnParallelLinear(1024, 4096, sequence_parallel=True)
    down = overlap.nn.RowParallelLinear(4096, 1024, sequence_parallel=True)
    y = down(torch.nn.functional.gelu(up(x)))  # x, y: [s/W, b, 1024], this rank's slice of the sequence

Activations are ``[s, b, h]`` (Megatron's layout: the sequence is dim 0); ``[tokens, h]`` works too.
What runs (``W`` ranks, ``w`` this rank's weight shard):

=========================================  ===========================================================
layer                                      forward; backward
=========================================  ===========================================================
column, ``sequence_parallel=True``          `overlap.all_gather_matmul` of ``[s/W, b, in]``: ``[s, b, out/W]``;
                                            its overlapped reduce-scatter of the input gradient
column, ``sequence_parallel=False``         ``x @ w.T`` on the whole ``[s, b, in]``; the input gradient
                                            all-reduced during the weight-gradient GEMM
                                            (`overlap.ops.tp.collectives.linear_all_reduce_dgrad`)
column, ``gather_output=True``              then every rank's columns gathered: ``[s, b, out]``
row, ``sequence_parallel=True``             `overlap.matmul_reduce_scatter` of ``[s, b, in/W]``:
                                            ``[s/W, b, out]``; the bias gradient all-reduced
row, ``sequence_parallel=False``            `overlap.matmul_all_reduce`: ``[s, b, out]`` on every rank
row, ``input_is_parallel=False``            the whole ``[s, b, in]`` in, this rank's columns taken first
one rank (a group of one)                   ``x @ w.T``: ``F.linear``
=========================================  ===========================================================

fp8 (``fp8="rowwise" | "tensorwise" | "mxfp8"`` or an `overlap.Fp8Recipe`, docs/fp8.md) is a training mode of
every row of the table: the fused ops take the recipe (the gather moves fp8 bytes), and where no op is fused with
the GEMM (one rank; a column layer's replicated input) `overlap.fp8_matmul` runs the same recipe on the rank, its
input gradient all-reduced as above (after the weight-gradient GEMM rather than during it:
`overlap.nn.fp8_linear`). Bias and ``gather_output`` are as without fp8. ``fp8=`` is checked in ``__init__``: with
``"mxfp8"`` the GEMM's ``k`` (``in_features`` of a column layer, ``in_features / W`` of a row layer) must be a
multiple of 32.

Initialization: exactly the slice of ``torch.nn.Linear(in_features, out_features, bias, device=device,
dtype=dtype)`` built from the same random state (the layer builds that whole layer once, then keeps its
part), so seeding every rank alike (``torch.manual_seed(s)``) gives the same numbers as a single-process
``nn.Linear`` built after the same seed. After backward, each parameter's ``.grad`` is the matching slice
of that ``nn.Linear``'s gradient (the loss being the sum over ranks of each rank's part of the output's
loss, as with any data split), with no extra reduction: the row-parallel bias under sequence parallelism
is all-reduced inside backward.

The Megatron-core-compatible layers (``config=``, ``init_method=``, ``(output, bias)`` out) are
`overlap.hooks.megatron`'s. Passing ``config=`` here still builds one of those, with a
``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import Parameter

from .. import envs, world
from ..ops.fp8_recipe import Fp8Recipe
from ..ops.tp.all_gather_matmul import all_gather_matmul
from ..ops.tp.collectives import all_reduce_grad, gather_last_dim, linear_all_reduce_dgrad, split_last_dim
from ..ops.tp.matmul_all_reduce import matmul_all_reduce
from ..ops.tp.matmul_reduce_scatter import matmul_reduce_scatter
from ..plans import Plan
from ..plans.auto import as_plan
from .fp8_linear import fp8_linear, layer_recipe


def _megatron_layer(name: str, args: tuple, kwargs: dict[str, Any]) -> torch.nn.Module:
    """The deprecated ``config=`` path: `overlap.hooks.megatron`'s layer of the same name."""
    warnings.warn(f"overlap.nn.{name}(..., config=...) is deprecated and will be removed in the next release: "
                  f"use overlap.hooks.megatron.{name} for Megatron-core's arguments (it returns (output, bias)), "
                  f"or overlap.nn.{name} without config", DeprecationWarning, stacklevel=3)
    from ..hooks import megatron_linear

    return getattr(megatron_linear, name)(*args, **kwargs)


def _positive_int(layer: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"overlap.nn.{layer}: {name} must be a positive int, got {value!r}")
    return value


class _TensorParallelLinear(torch.nn.Module):
    """What both layers share: the checks, the group, the slice of a full ``nn.Linear``, the op arguments."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if kwargs.get("config") is not None:
            return _megatron_layer(cls.__name__, args, kwargs)
        return super().__new__(cls)

    def _setup(self, in_features: int, out_features: int, split: int, group, sequence_parallel: bool,
               strategy: str, plan: Plan | dict | None, timeout: float | None, fp8: Any, dtype) -> None:
        name = type(self).__name__
        self.in_features = _positive_int(name, "in_features", in_features)
        self.out_features = _positive_int(name, "out_features", out_features)
        as_plan(strategy, plan)  # a bad strategy or plan raises here, not at the first forward
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.group = world.resolve_group(group)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.sequence_parallel = bool(sequence_parallel)
        which = "out_features" if split == 0 else "in_features"
        size = out_features if split == 0 else in_features
        if size % self.world_size:
            raise ValueError(f"overlap.nn.{name}: {which}={size} must divide by the group's size {self.world_size}")
        # the GEMM's reduction: the whole input of a column layer, this rank's columns of a row layer's
        k, k_name = (in_features, "in_features") if split == 0 else (in_features // self.world_size, "in_features/W")
        self.fp8 = layer_recipe(f"nn.{name}", fp8, k, k_name, dtype)

    def _parameters_from_linear(self, bias: bool, split: int, dtype, device) -> None:
        """This rank's slice (rows for ``split=0``, columns for ``1``) of a freshly built full ``nn.Linear``."""
        full = torch.nn.Linear(self.in_features, self.out_features, bias=bias, device=device, dtype=dtype)
        part = full.weight.shape[split] // self.world_size
        own = slice(self.rank * part, (self.rank + 1) * part)
        with torch.no_grad():
            weight = full.weight[own] if split == 0 else full.weight[:, own]
            self.weight = Parameter(weight.clone())
            if bias:
                self.bias = Parameter((full.bias[own] if split == 0 else full.bias).clone())
            else:
                self.register_parameter("bias", None)

    def _op_kwargs(self) -> dict[str, Any]:
        return {"group": self.group, "strategy": self.strategy, "plan": self.plan, "timeout": self.timeout,
                "fp8": self.fp8}

    def _local(self, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """``x @ w.T`` with no op fused (one rank, or a replicated input whose gradient is summed over `group`),
        in fp8 with a recipe; no bias."""
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.fp8, group, self.timeout, self._what())
        if group is None:
            return F.linear(x, self.weight)
        return linear_all_reduce_dgrad(x, self.weight, group, self.timeout, self._what())

    def _what(self) -> str:
        return f"overlap.nn.{type(self).__name__}"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"TP={self.world_size}, sequence_parallel={self.sequence_parallel}, strategy={self.strategy!r}, "
                f"fp8={None if self.fp8 is None else self.fp8.text!r}")


class ColumnParallelLinear(_TensorParallelLinear):
    """``y = x @ W.T + b`` with ``W``'s rows (``out_features``) split over `group` (see the module docstring).

    Args:
        in_features, out_features: of the whole layer (``out_features`` must divide by the group's size).
        bias: add a bias (this rank's ``out_features/W`` part).
        group: the tensor-parallel group (default: the world).
        sequence_parallel: the input is this rank's slice of the sequence ``[s/W, b, in]`` (dim 0),
            gathered by `overlap.all_gather_matmul` behind the GEMM; otherwise the whole ``[s, b, in]``,
            the same on every rank.
        gather_output: return ``[s, b, out]`` (every rank's columns) instead of ``[s, b, out/W]``.
        strategy, plan, timeout: of the op (defaults: ``"auto"``, none, ``OVERLAP_TIMEOUT_S``).
        fp8: None, or the fp8 training recipe (``"rowwise"``, ``"tensorwise"``, ``"mxfp8"``, an
            `overlap.Fp8Recipe`) of the layer's GEMM, on every path (the module docstring).
        dtype, device: of the parameters (defaults: torch's, CPU), as for ``nn.Linear``.

    Returns a tensor. ``config=`` (deprecated) builds `overlap.hooks.megatron.ColumnParallelLinear` instead.

    Raises:
        ValueError: sizes that are not positive ints, ``out_features`` not divisible by the group's size,
            a bad strategy/plan/timeout, an unknown fp8 granularity, ``fp8="mxfp8"`` with ``in_features`` not a
            multiple of 32 (here, before any communication); the op's errors in forward.
        TypeError: ``fp8`` of another type; fp8 with float64 parameters (here).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False, gather_output: bool = False, *, strategy: str = "auto",
                 plan: Plan | dict | None = None, timeout: float | None = None,
                 fp8: str | Fp8Recipe | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self._setup(in_features, out_features, 0, group, sequence_parallel, strategy, plan, timeout, fp8, dtype)
        self.gather_output = bool(gather_output)
        self.out_features_per_partition = out_features // self.world_size
        self._parameters_from_linear(bias, 0, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parallel = self.world_size > 1
        if not parallel and self.fp8 is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            if parallel and self.sequence_parallel:
                y = all_gather_matmul(x, self.weight.t(), **self._op_kwargs())
            else:  # one rank, or a replicated input whose gradient is all-reduced over the group
                y = self._local(x, self.group if parallel else None)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        if parallel and self.gather_output:
            y = gather_last_dim(y, self.group, self.timeout, f"{self._what()}(gather_output=True)")
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gather_output={self.gather_output}"


class RowParallelLinear(_TensorParallelLinear):
    """``y = x @ W.T + b`` with ``W``'s columns (``in_features``) split over `group` (see the module docstring).

    Args:
        in_features, out_features: of the whole layer (``in_features`` must divide by the group's size).
        bias: add a bias (whole, replicated; added once after the reduction).
        group: the tensor-parallel group (default: the world).
        sequence_parallel: return this rank's slice of the sequence ``[s/W, b, out]``, reduce-scattered
            by `overlap.matmul_reduce_scatter` (``s`` must divide by the group's size); otherwise the
            whole ``[s, b, out]``, all-reduced by `overlap.matmul_all_reduce`, the same on every rank.
        input_is_parallel: the input is this rank's features ``[s, b, in/W]`` (as a column-parallel
            layer leaves them); ``False``: the whole ``[s, b, in]``, of which this rank takes its part
            (not with sequence parallelism).
        strategy, plan, timeout: of the op (defaults: ``"auto"``, none, ``OVERLAP_TIMEOUT_S``).
        fp8: None, or the fp8 training recipe (``"rowwise"``, ``"tensorwise"``, ``"mxfp8"``, an
            `overlap.Fp8Recipe`) of the layer's GEMM, on every path (the module docstring).
        dtype, device: of the parameters (defaults: torch's, CPU), as for ``nn.Linear``.

    Returns a tensor. ``config=`` (deprecated) builds `overlap.hooks.megatron.RowParallelLinear` instead.

    Raises:
        ValueError: sizes that are not positive ints, ``in_features`` not divisible by the group's size,
            ``sequence_parallel`` with ``input_is_parallel=False``, a bad strategy/plan/timeout, an unknown fp8
            granularity, ``fp8="mxfp8"`` with ``in_features / W`` not a multiple of 32 (here); the op's errors
            in forward.
        TypeError: ``fp8`` of another type; fp8 with float64 parameters (here).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, *, strategy: str = "auto",
                 plan: Plan | dict | None = None, timeout: float | None = None,
                 fp8: str | Fp8Recipe | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self._setup(in_features, out_features, 1, group, sequence_parallel, strategy, plan, timeout, fp8, dtype)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("overlap.nn.RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel = bool(input_is_parallel)
        self.in_features_per_partition = in_features // self.world_size
        self._parameters_from_linear(bias, 1, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            if self.fp8 is None:
                return F.linear(x, self.weight, self.bias)
            y = self._local(x, None)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group, self.timeout, f"{self._what()}(input_is_parallel=False)")
        op = matmul_reduce_scatter if self.sequence_parallel else matmul_all_reduce
        y = op(x, self.weight.t(), **self._op_kwargs())
        if self.bias is None:
            return y
        bias = self.bias
        if self.sequence_parallel:  # each rank adds it to its own rows: the gradient is the sum over ranks
            bias = all_reduce_grad(bias, self.group, self.timeout, f"{self._what()}(bias gradient)")
        return y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"
