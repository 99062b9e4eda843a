"""Parallel styles for torch's tensor-parallel API whose ``nn.Linear`` layers run through the fused ops.

``ColwiseParallel`` and ``RowwiseParallel`` here take the keyword arguments of torch's styles of the
same names (``torch.distributed.tensor.parallel``), with the same defaults and meaning, plus
``strategy``/``plan``/``timeout`` for the ops; pass them to ``parallelize_module`` in place of torch's::

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel
    parallelize_module(block, tp_mesh, {
        "up": ColwiseParallel(input_layouts=Shard(0)),     # all_gather_matmul
        "down": RowwiseParallel(output_layouts=Shard(0)),  # matmul_reduce_scatter
    })

Activations are in Megatron's ``[s, b, h]`` layout: the sequence is dim 0, the dim the ops gather
and scatter. What each style runs, ``w`` being this rank's shard of the weight ``[out, in]``:

* ``ColwiseParallel(input_layouts=Shard(0))``: ``all_gather_matmul(x, w.t())``; the input gradient
  is reduce-scattered (overlapped by the op's backward).
* ``ColwiseParallel()`` (replicated input, torch's default): ``x @ w.t()`` with no communication; the
  input gradient is all-reduced in backward, as with torch's style.
* ``RowwiseParallel(output_layouts=Shard(0))``: ``matmul_reduce_scatter(x, w.t())``; the output
  gradient is all-gathered (overlapped by the op's backward).
* ``RowwiseParallel()`` (replicated output, torch's default): ``matmul_all_reduce(x, w.t())``; no
  communication in backward (the output gradient is replicated).

Each adds the local bias after the op. Parameters are sharded as torch's styles shard them, as
``DTensor`` parameters (column-wise: weight and bias ``Shard(0)``; row-wise: weight ``Shard(1)``, bias
``Replicate()``), so a ``state_dict``, a distributed checkpoint or an optimizer sees the same
tensors as with torch's styles, and the parameters' gradients are ``DTensor`` s with the same
placements and values. The row-wise bias with a sequence-sharded output sees only this rank's rows
in backward: its gradient is all-reduced over the mesh (as torch's own arrangement yields), one
small extra collective.

Inputs are local tensors holding this rank's part (the layout given by ``input_layouts``), or
``DTensor`` s on the same mesh with exactly that placement (they are taken with ``to_local()``; their
gradient comes back as a ``DTensor``). Outputs are local tensors unless ``use_local_output=False``.

Not supported (``ValueError``/``TypeError`` when the style is constructed or applied, or in forward for
inputs; never a silent fallback):
modules other than ``nn.Linear`` (torch's styles also shard ``nn.Embedding``); meshes of more than
one dim (pass the tensor-parallel sub-mesh, ``mesh["tp"]``, as with torch's styles); sequence
sharding on a dim other than 0 (transpose to ``[s, b, h]``); column-wise outputs other than
``Shard(-1)``, row-wise inputs other than ``Shard(-1)``; ``DTensor`` inputs whose placement differs
from ``input_layouts`` (torch's styles would redistribute them; here ``x.redistribute(...)`` it
first); features that do not divide by the mesh size (torch's styles shard them unevenly). Only
``input`` is taken from the module's arguments, as ``nn.Linear.forward`` takes it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from .. import envs
from ..ops.tp.all_gather_matmul import all_gather_matmul
from ..ops.tp.collectives import all_reduce_grad
from ..ops.tp.matmul_all_reduce import matmul_all_reduce
from ..ops.tp.matmul_reduce_scatter import matmul_reduce_scatter
from ..plans import Plan
from ..plans.auto import as_plan

__all__ = ["ColwiseParallel", "RowwiseParallel"]


def _norm(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` -> ``Shard(ndim - 1)``; other placements as they are."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


class _LinearStyle(ParallelStyle):
    """What both styles share: argument checks, parameter sharding, input and output handling."""

    _param_placements: dict[str, Placement]

    def __init__(self, input_layouts: Placement, output_layouts: Placement, use_local_output: bool,
                 strategy: str, plan: Plan | dict | None, timeout: float | None):
        super().__init__()
        for name, value in (("input_layouts", input_layouts), ("output_layouts", output_layouts)):
            if not isinstance(value, Placement):
                raise TypeError(f"overlap's {type(self).__name__}: {name} must be a Placement "
                                f"(Shard(d) or Replicate()), got {value!r}")
        as_plan(strategy, plan)  # raises on a bad strategy or plan now, not at the first forward
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.input_layouts = (input_layouts,)
        self.output_layouts = (output_layouts,)
        self.use_local_output = use_local_output
        self.strategy, self.plan, self.timeout = strategy, plan, timeout

    # ------------------------------------------------------------------------------------------
    # parallelize_module's entry point
    # ------------------------------------------------------------------------------------------

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if not isinstance(module, nn.Linear):
            raise TypeError(f"overlap's {name} supports nn.Linear only, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"overlap's {name} needs a 1-D mesh (the tensor-parallel one, e.g. mesh['tp']), "
                             f"got a mesh of shape {tuple(device_mesh.shape)}")
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            raise ValueError(f"overlap's {name}: {module} is already parallelized (its parameters are DTensors)")
        world_size = device_mesh.size()
        sharded = module.out_features if self._param_placements["weight"] == Shard(0) else module.in_features
        if sharded % world_size:
            raise ValueError(f"overlap's {name}: {module} shards {sharded} features over {world_size} ranks; "
                             "they must divide evenly (torch's styles would shard them unevenly)")

        def partition(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dparam = distribute_tensor(param, mesh, [self._param_placements[pname]],
                                           src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

        distribute_module(module, device_mesh, partition)
        pg = device_mesh.get_group()

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            if len(args) + len(kwargs) != 1 or (kwargs and "input" not in kwargs):
                raise TypeError(f"overlap's {name}: the linear layer takes one tensor, got {len(args)} positional "
                                f"and keyword arguments {sorted(kwargs)}")
            x = args[0] if args else kwargs["input"]
            return self._forward(mod, self._local_input(x, device_mesh), pg, device_mesh)

        # An instance attribute shadows nn.Linear.forward; nn.Module.__call__ (and its hooks) call it.
        module.forward = types.MethodType(forward, module)
        return module

    # ------------------------------------------------------------------------------------------
    # Inputs and outputs
    # ------------------------------------------------------------------------------------------

    def _local_input(self, x: Any, mesh: DeviceMesh) -> torch.Tensor:
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(f"overlap's {type(self).__name__}: the input DTensor lives on {x.device_mesh}, "
                                 f"the layer on {mesh}")
            want = _norm(self.input_layouts[0], x.ndim)
            got = tuple(_norm(p, x.ndim) for p in x.placements)
            if got != (want,):
                raise ValueError(f"overlap's {type(self).__name__}(input_layouts={self.input_layouts[0]!r}): the input "
                                 f"DTensor has placements {x.placements}; redistribute it to [{want!r}] first, or "
                                 "construct the style with the input_layouts it has")
            return x.to_local()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"overlap's {type(self).__name__}: input must be a tensor or DTensor, "
                            f"got {type(x).__name__}")
        return x

    def _output(self, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.use_local_output:
            return y
        return DTensor.from_local(y, mesh, [_norm(self.output_layouts[0], y.ndim)], run_check=False)

    def _op_kwargs(self, pg) -> dict[str, Any]:
        return dict(group=pg, strategy=self.strategy, plan=self.plan, timeout=self.timeout)

    def _forward(self, mod: nn.Linear, x: torch.Tensor, pg, mesh: DeviceMesh) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts[0]!r}, "
                f"output_layouts={self.output_layouts[0]!r}, use_local_output={self.use_local_output}, "
                f"strategy={self.strategy!r}, plan={self.plan!r}, timeout={self.timeout!r})")


class ColwiseParallel(_LinearStyle):
    """Column-wise ``nn.Linear``: each rank holds ``out_features / W`` rows of the weight (and bias).

    Keyword Args:
        input_layouts: ``Shard(0)``: the input is this rank's slice of the sequence, ``[s/W, ..., in]``,
            gathered by `overlap.all_gather_matmul` behind the GEMM (sequence parallelism).
            ``Replicate()`` (default, as torch's): the whole input ``[s, ..., in]`` on every rank; a
            plain local GEMM whose input gradient is all-reduced in backward.
        output_layouts: ``Shard(-1)`` only (default): the output is ``[s, ..., out/W]``, this rank's
            columns, as a row-wise layer wants it.
        use_local_output: return a local tensor (default) or a ``DTensor`` (``Shard(-1)``).
        strategy, plan, timeout: passed to `overlap.all_gather_matmul` (default ``"auto"``).

    Raises:
        TypeError / ValueError: a layout other than those above, a bad strategy/plan/timeout (here);
            a module other than ``nn.Linear``, a mesh of more than one dim, ``out_features`` not
            divisible by the mesh size (when applied); an input ``DTensor`` on another mesh or with
            other placements (in forward).
    """

    _param_placements = {"weight": Shard(0), "bias": Shard(0)}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None):
        super().__init__(input_layouts or Replicate(), output_layouts or Shard(-1), use_local_output,
                         strategy, plan, timeout)
        if self.input_layouts[0] not in (Replicate(), Shard(0)):
            raise ValueError(f"overlap's ColwiseParallel: input_layouts must be Shard(0) (sequence-parallel "
                             f"[s, b, h]) or Replicate(), got {self.input_layouts[0]!r}")
        if self.output_layouts[0] != Shard(-1):
            raise ValueError(f"overlap's ColwiseParallel: output_layouts must be Shard(-1), got "
                             f"{self.output_layouts[0]!r} (redistribute the output yourself)")

    def _forward(self, mod: nn.Linear, x: torch.Tensor, pg, mesh: DeviceMesh) -> torch.Tensor:
        w_NK = mod.weight.to_local()  # backward: this rank's gradient, a Shard(0) DTensor
        bias = mod.bias.to_local() if mod.bias is not None else None
        if self.input_layouts[0] == Shard(0):
            y = all_gather_matmul(x, w_NK.t(), **self._op_kwargs(pg))
            if bias is not None:
                y = y + bias.to(y.dtype)
        else:
            if mesh.size() > 1:
                x = all_reduce_grad(x, pg, self.timeout, "torch_tp.ColwiseParallel")
            y = F.linear(x, w_NK, bias)
        return self._output(y, mesh)


class RowwiseParallel(_LinearStyle):
    """Row-wise ``nn.Linear``: each rank holds ``in_features / W`` columns of the weight; the bias is replicated.

    Keyword Args:
        input_layouts: ``Shard(-1)`` only (default): the input is ``[s, ..., in/W]``, this rank's
            features, as a column-wise layer leaves them.
        output_layouts: ``Shard(0)``: the output is this rank's slice of the sequence,
            ``[s/W, ..., out]``, reduce-scattered by `overlap.matmul_reduce_scatter` (sequence
            parallelism; ``s`` must divide by the mesh size). ``Replicate()`` (default, as torch's):
            the whole output on every rank, all-reduced by `overlap.matmul_all_reduce`.
        use_local_output: return a local tensor (default) or a ``DTensor`` with ``output_layouts``.
        strategy, plan, timeout: passed to the op (default ``"auto"``).

    The bias is added once, after the reduction. With ``Shard(0)`` its gradient is all-reduced over
    the mesh in backward (each rank sees only its rows), so it equals torch's own styles' gradient.

    Raises:
        TypeError / ValueError: a layout other than those above, a bad strategy/plan/timeout (here);
            a module other than ``nn.Linear``, a mesh of more than one dim, ``in_features`` not
            divisible by the mesh size (when applied); an input ``DTensor`` on another mesh or with
            other placements (in forward).
    """

    _param_placements = {"weight": Shard(1), "bias": Replicate()}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None):
        super().__init__(input_layouts or Shard(-1), output_layouts or Replicate(), use_local_output,
                         strategy, plan, timeout)
        if self.input_layouts[0] != Shard(-1):
            raise ValueError(f"overlap's RowwiseParallel: input_layouts must be Shard(-1), "
                             f"got {self.input_layouts[0]!r}")
        if self.output_layouts[0] not in (Replicate(), Shard(0)):
            raise ValueError(f"overlap's RowwiseParallel: output_layouts must be Shard(0) (sequence-parallel "
                             f"[s, b, h]) or Replicate(), got {self.output_layouts[0]!r}")

    def _forward(self, mod: nn.Linear, x: torch.Tensor, pg, mesh: DeviceMesh) -> torch.Tensor:
        w_NK = mod.weight.to_local()  # [out, in/W]; backward: a Shard(1) DTensor
        sequence_parallel = self.output_layouts[0] == Shard(0)
        op = matmul_reduce_scatter if sequence_parallel else matmul_all_reduce
        y = op(x, w_NK.t(), **self._op_kwargs(pg))
        if mod.bias is not None:
            bias = mod.bias.to_local()
            if sequence_parallel and mesh.size() > 1:
                # Each rank adds the bias to its own rows only: the full gradient is the sum over ranks.
                bias = all_reduce_grad(bias, pg, self.timeout, "torch_tp.RowwiseParallel")
            y = y + bias.to(y.dtype)
        return self._output(y, mesh)
