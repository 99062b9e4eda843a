"""Parallel styles for torch's tensor-parallel API whose ``nn.Linear`` layers run through the fused ops.

``ColwiseParallel`` and ``RowwiseParallel`` here are torch's styles of the same names
(``torch.distributed.tensor.parallel``, subclassed: the same keyword arguments, defaults and meaning, plus
``strategy``/``plan``/``timeout`` for the ops and ``fp8`` for the fp8 training recipe). Pass them to
``parallelize_module`` in place of torch's, or let `use_overlap_styles` rebind the names a parallelizing module
imported (torchtitan's ``parallelize_llama``)::

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel
    parallelize_module(block, tp_mesh, {
        "up": ColwiseParallel(input_layouts=Shard(1)),     # all_gather_matmul(x, w.t(), gather_dim=1)
        "down": RowwiseParallel(output_layouts=Shard(1)),  # matmul_reduce_scatter(x, w.t(), scatter_dim=1)
    })

What each style runs for an ``nn.Linear`` (``w`` this rank's shard of the weight ``[out, in]``; the sequence
sharded on any dim ``d`` but the last: 0 for Megatron's ``[s, b, h]``, 1 for batch-first ``[b, s, h]``):

* ``ColwiseParallel(input_layouts=Shard(d))``: ``all_gather_matmul(x, w.t(), gather_dim=d)``; the input
  gradient is reduce-scattered (overlapped by the op's backward).
* ``ColwiseParallel()`` (replicated input, torch's default): ``x @ w.t()`` with no communication; the input
  gradient is all-reduced in backward, as with torch's style.
* ``RowwiseParallel(output_layouts=Shard(d))``: ``matmul_reduce_scatter(x, w.t(), scatter_dim=d)``; the output
  gradient is all-gathered (overlapped by the op's backward).
* ``RowwiseParallel()`` (replicated output, torch's default): ``matmul_all_reduce(x, w.t())``; no communication
  in backward (the output gradient is replicated).

Each adds the local bias after the op. Every other layout torch's styles take is taken as torch takes it: a
column-wise output other than ``Shard(-1)`` (an LM head's ``Replicate()``) is redistributed from ``Shard(-1)``
by ``DTensor`` as torch's style does, after the fused gather; a ``DTensor`` input is used with the placement it
has (redistributed as torch's style would where that is neither a sequence shard nor replicated), a row-wise
input other than ``Shard(-1)`` is redistributed to it. Where nothing is left to fuse, the style is torch's own
(its ``_apply``): an ``nn.Embedding`` (torchtitan's ``tok_embeddings``), a mesh of more than one dim, features
that do not divide by the mesh size (torch shards them unevenly), a row-wise output that is neither
``Replicate()`` nor a sequence shard. An ``nn.Linear`` left so is named in a warning with the reason, once per
shape: fused TP is never silently not applied.

fp8 (``fp8="rowwise" | "tensorwise" | "mxfp8"`` or an `overlap.Fp8Recipe`, checked when the style is made; docs/fp8.md):
every path above trains the layer with the recipe: the fused ones pass it to the op (a gather moves fp8 rows), the
replicated column-wise input multiplies by `overlap.fp8_matmul` (the same numbers on one rank). A layer converted by
torchao's float8 training (``torchao.float8.convert_to_float8_training``: a ``Float8Linear``) trains with its own
config's recipe (`overlap.hooks.torchao_float8`), so these styles stand where torchao's ``Float8ColwiseParallel``/
``Float8RowwiseParallel`` would, and `PrepareModuleInput` where its ``PrepareFloat8ModuleInput`` would. An
``nn.Linear`` left to torch's own style (above) is not trained in fp8: a warning says so.

Parameters are sharded as torch's styles shard them, as ``DTensor`` parameters (column-wise: weight and bias
``Shard(0)``; row-wise: weight ``Shard(1)``, bias ``Replicate()``), so a ``state_dict``, a distributed
checkpoint or an optimizer sees the same tensors as with torch's styles, and the parameters' gradients are
``DTensor`` s with the same placements and values. The row-wise bias with a sequence-sharded output sees only
this rank's rows in backward: its gradient is all-reduced over the mesh (as torch's own arrangement yields), one
small extra collective. Outputs are local tensors unless ``use_local_output=False``. Only ``input`` is taken from
the module's arguments, as ``nn.Linear.forward`` takes it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor import parallel as torch_tp
from torch.distributed.tensor.placement_types import Placement

from .. import envs
from ..errors import warn_once
from ..ops.fp8 import GRANULARITIES, MX_BLOCK
from ..ops.fp8_matmul import fp8_matmul
from ..ops.fp8_recipe import TP_ONLY, Fp8Recipe, recipe_among
from ..ops.tp.all_gather_matmul import all_gather_matmul
from ..ops.tp.collectives import all_reduce_grad
from ..ops.tp.matmul_all_reduce import matmul_all_reduce
from ..ops.tp.matmul_reduce_scatter import matmul_reduce_scatter
from ..plans import Plan
from ..plans.auto import as_plan
from .expert_parallel import ExpertParallel, ExpertTensorParallel
from .torchao_float8 import float8_linear_recipe, is_float8_linear

__all__ = ["ColwiseParallel", "ExpertParallel", "ExpertTensorParallel", "PrepareModuleInput", "RowwiseParallel",
           "use_overlap_styles"]


def _norm(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` -> ``Shard(ndim - 1)``; other placements as they are."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def _sequence_dim(placement: Placement, ndim: int) -> int | None:
    """The dim `placement` shards when that is a sequence dim (any but the last), else None."""
    p = _norm(placement, ndim)
    return p.dim if isinstance(p, Shard) and p.dim < ndim - 1 else None


def own_forward(module: nn.Linear) -> str | None:
    """Where `module`, an ``nn.Linear``, computes otherwise than ``nn.Linear.forward`` (which the fused path
    replaces: the styles leave such a layer to torch's own style), or None: a subclass's own ``forward`` (torchao's
    ``Float8Linear`` aside: its fp8 GEMMs are the recipe overlap's ops run, `overlap.hooks.torchao_float8`), or a
    ``forward`` set on the instance."""
    if "forward" in vars(module):
        return "set on the instance"
    owner = next(c for c in type(module).__mro__ if "forward" in vars(c))
    if owner is nn.Linear or is_float8_linear(module):
        return None
    return f"{owner.__qualname__}.forward"


class _Fused:
    """What both styles add to torch's: the ops' arguments, the fused ``nn.Linear`` path, torch's own elsewhere."""

    _param_placements: dict[str, Placement]
    _sharded_features: str  # the nn.Linear attribute the mesh splits

    def _setup(self, strategy: str, plan: Plan | dict | None, timeout: float | None, fp8: Any) -> None:
        for name in ("input_layouts", "output_layouts"):
            value = getattr(self, name)[0]
            if not isinstance(value, Placement):
                raise TypeError(f"overlap's {type(self).__name__}: {name} must be a Placement "
                                f"(Shard(d), Replicate(), ...), got {value!r}")
        as_plan(strategy, plan)  # raises on a bad strategy or plan now, not at the first forward
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.fp8: Fp8Recipe | None = recipe_among(f"hooks.torch_tp.{type(self).__name__}", fp8, GRANULARITIES, TP_ONLY)
        self.fused: bool | None = None  # set when applied: whether the module runs through overlap's ops

    def _fuses(self, module: nn.Module, device_mesh: DeviceMesh) -> bool:
        """Whether `module` runs through the fused ops (else torch's style applies, unchanged)."""
        return isinstance(module, nn.Linear) and own_forward(module) is None and not self._unfused(module, device_mesh)

    def _unfused(self, module: nn.Linear, device_mesh: DeviceMesh) -> str:
        """Why a plain `module` has no fused form on `device_mesh` ('' where it has one)."""
        features = getattr(module, self._sharded_features)
        if device_mesh.ndim != 1:
            return f"a {device_mesh.ndim}-d mesh (overlap's ops take one dim)"
        if features % device_mesh.size():
            return f"{self._sharded_features}={features} do not divide over {device_mesh.size()} ranks"
        if not self._layouts_fuse():
            return f"its layouts ({self!r}) have no fused form"
        return ""

    def _layouts_fuse(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------------
    # parallelize_module's entry point
    # ------------------------------------------------------------------------------------------

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            raise ValueError(f"overlap's {name}: {module} is already parallelized (its parameters are DTensors)")
        self.fused = self._fuses(module, device_mesh)
        if isinstance(module, nn.Linear) and (where := own_forward(module)) is not None:
            warn_once(f"overlap's {name}: {type(module).__module__}.{type(module).__qualname__} has its own forward "
                      f"({where}), which overlap's ops would replace: torch's own style runs it, unfused",
                      key=f"torch_tp.own_forward:{name}:{type(module).__qualname__}")
        if not self.fused:
            if self.fp8 is not None and isinstance(module, nn.Linear) and not is_float8_linear(module):
                # (an embedding has no GEMM to train in fp8; torchao's layer keeps its own fp8 under torch's style)
                warn_once(f"overlap's {name}(fp8={self.fp8.text!r}): {module} on a {device_mesh.ndim}-d mesh of "
                          f"{device_mesh.size()} runs torch's own style (nothing to fuse): it is not trained in fp8",
                          key=f"torch_tp.unfused_fp8:{name}:{type(module).__name__}")
            elif isinstance(module, nn.Linear) and own_forward(module) is None:
                # (an embedding has nothing to fuse; a layer's own forward was named above)
                warn_once(f"overlap's {name}: {module} runs torch's own style, unfused: "
                          f"{self._unfused(module, device_mesh)}",
                          key=f"torch_tp.unfused:{name}:{module.in_features}x{module.out_features}")
            return super()._apply(module, device_mesh)  # torch's style: nothing of overlap to run here
        recipe = self._recipe(module, device_mesh)
        module._overlap_style = self  # (found by a PrepareModuleInput above it: `PrepareModuleInput`)
        module._overlap_fp8 = recipe  # (per layer: one style may be applied to several)

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
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"overlap's {name}: input must be a tensor or DTensor, got {type(x).__name__}")
            if isinstance(x, DTensor) and x.device_mesh != device_mesh:
                raise ValueError(f"overlap's {name}: the input DTensor lives on {x.device_mesh}, the layer on "
                                 f"{device_mesh}")
            return self._forward(mod, x, pg, device_mesh, recipe)

        # An instance attribute shadows nn.Linear.forward; nn.Module.__call__ (and its hooks) call it.
        module.forward = types.MethodType(forward, module)
        return module

    def _recipe(self, module: nn.Linear, mesh: DeviceMesh) -> Fp8Recipe | None:
        """The fp8 recipe `module` trains with: a torchao ``Float8Linear``'s own (`overlap.hooks.torchao_float8`),
        else the style's `fp8`. Raises ValueError where both name one and they differ, or where ``"mxfp8"`` meets a
        ``k`` (this rank's input features) that is not a multiple of 32."""
        name = type(self).__name__
        recipe = self.fp8
        if is_float8_linear(module):
            recipe = float8_linear_recipe(module, name)
            if self.fp8 is not None and self.fp8 != recipe:
                raise ValueError(f"overlap's {name}(fp8={self.fp8!r}): {module} is torchao's Float8Linear, whose "
                                 f"config trains it with {recipe!r}: leave the style's fp8 out, or convert the layer "
                                 "with the recipe wanted")
        k = module.in_features // (mesh.size() if self._sharded_features == "in_features" else 1)
        if recipe is not None and recipe.granularity == "mxfp8" and k % MX_BLOCK:
            raise ValueError(f"overlap's {name}(fp8='mxfp8'): {module} multiplies k={k} features per rank; MX blocks "
                             f"of {MX_BLOCK} along k need a multiple of {MX_BLOCK}")
        return recipe

    def _op_kwargs(self, pg, recipe: Fp8Recipe | None) -> dict[str, Any]:
        return dict(group=pg, strategy=self.strategy, plan=self.plan, timeout=self.timeout, fp8=recipe)

    def _forward(self, mod: nn.Linear, x: torch.Tensor, pg, mesh: DeviceMesh, recipe: Fp8Recipe | None
                 ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts[0]!r}, "
                f"output_layouts={self.output_layouts[0]!r}, use_local_output={self.use_local_output}, "
                f"strategy={self.strategy!r}, plan={self.plan!r}, timeout={self.timeout!r}, fp8={self.fp8!r})")


def _placed(x: torch.Tensor, placement: Placement, mesh: DeviceMesh) -> tuple[torch.Tensor, Placement]:
    """``(local tensor, its placement)``: a ``DTensor``'s own, a local tensor's the style's input layout."""
    if isinstance(x, DTensor):
        return x.to_local(), x.placements[0]
    return x, placement


def _redistributed(x: torch.Tensor, placement: Placement, want: Placement, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of `x` (local, laid out as `placement`, or a ``DTensor``) laid out as `want`, the way torch's
    styles get there (``DTensor.redistribute``)."""
    dt = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [placement], run_check=False)
    return dt.redistribute(placements=[want]).to_local()


class ColwiseParallel(_Fused, torch_tp.ColwiseParallel):
    """Column-wise ``nn.Linear``: each rank holds ``out_features / W`` rows of the weight (and bias).

    Keyword Args:
        input_layouts: ``Shard(d)``, ``d`` not the last dim: the input is this rank's slice of the sequence on dim
            ``d`` (``Shard(0)`` for ``[s, b, h]``, ``Shard(1)`` for batch-first ``[b, s, h]``), gathered by
            `overlap.all_gather_matmul` behind the GEMM (sequence parallelism). ``Replicate()`` (default, as
            torch's): the whole input on every rank; a plain local GEMM whose input gradient is all-reduced in
            backward. Any other placement: redistributed to ``Replicate()`` first, as torch's style does.
        output_layouts: ``Shard(-1)`` (default): this rank's columns, as a row-wise layer wants them; any other
            (``Replicate()`` for an LM head) is redistributed from ``Shard(-1)`` as torch's style does.
        use_local_output: return a local tensor (default) or a ``DTensor`` (loss parallel: ``Shard(-1)`` logits).
        strategy, plan, timeout: passed to `overlap.all_gather_matmul` (default ``"auto"``).
        fp8: None (default), ``"rowwise"``, ``"tensorwise"``, ``"mxfp8"`` or an `overlap.Fp8Recipe`: the layer trains
            with that recipe, gathered by `overlap.all_gather_matmul` (fp8 rows move) or, with a replicated input,
            multiplied by `overlap.fp8_matmul`. A torchao ``Float8Linear`` trains with its config's recipe.

    Raises:
        TypeError / ValueError: a layout that is not a ``Placement``, a bad strategy/plan/timeout/fp8 (here); a
            module parallelized already, a torchao ``Float8Linear`` whose recipe is not `fp8` (where given) or cannot
            be expressed, ``"mxfp8"`` with input features not a multiple of 32 (when applied); an input ``DTensor``
            on another mesh (in forward).
    """

    _param_placements = {"weight": Shard(0), "bias": Shard(0)}
    _sharded_features = "out_features"

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None, fp8: str | Fp8Recipe | None = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self._setup(strategy, plan, timeout, fp8)
        self.ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(input) -> (input, output without bias)

    def _gathers_into(self) -> bool:
        """Whether a gather in front of this layer may compute its output (a replicated input, fused)."""
        return bool(self.fused) and isinstance(self.input_layouts[0], Replicate)

    def _forward(self, mod: nn.Linear, x: torch.Tensor, pg, mesh: DeviceMesh, recipe: Fp8Recipe | None
                 ) -> torch.Tensor:
        w_NK = mod.weight.to_local()  # backward: this rank's gradient, a Shard(0) DTensor
        bias = mod.bias.to_local() if mod.bias is not None else None
        ready = self.ready.pop(id(x), None)
        local, placement = _placed(x, self.input_layouts[0], mesh)
        dim = _sequence_dim(placement, local.ndim)
        if ready is not None and ready[0] is x:  # computed by the gather in front of this layer (`PrepareModuleInput`)
            y = ready[1] if bias is None else ready[1] + bias.to(ready[1].dtype)
        elif dim is not None:
            y = all_gather_matmul(local, w_NK.t(), gather_dim=dim, **self._op_kwargs(pg, recipe))
            if bias is not None:
                y = y + bias.to(y.dtype)
        else:
            if not isinstance(placement, Replicate):
                local = _redistributed(x, placement, Replicate(), mesh)
            if mesh.size() > 1:
                local = all_reduce_grad(local, pg, self.timeout, "torch_tp.ColwiseParallel")
            if recipe is None:
                y = F.linear(local, w_NK, bias)
            else:  # the same recipe as the fused paths', on one rank
                y = fp8_matmul(local, w_NK.t(), recipe)
                y = y if bias is None else y + bias.to(y.dtype)
        want = _norm(self.output_layouts[0], y.ndim)
        if want == Shard(y.ndim - 1):
            return y if self.use_local_output else DTensor.from_local(y, mesh, [want], run_check=False)
        out = DTensor.from_local(y, mesh, [Shard(y.ndim - 1)], run_check=False).redistribute(placements=[want])
        return out.to_local() if self.use_local_output else out


class RowwiseParallel(_Fused, torch_tp.RowwiseParallel):
    """Row-wise ``nn.Linear``: each rank holds ``in_features / W`` columns of the weight; the bias is replicated.

    Keyword Args:
        input_layouts: ``Shard(-1)`` (default): the input is this rank's features, as a column-wise layer leaves
            them; any other is redistributed to it first, as torch's style does.
        output_layouts: ``Shard(d)``, ``d`` not the last dim: this rank's slice of the sequence on dim ``d``,
            reduce-scattered by `overlap.matmul_reduce_scatter` (sequence parallelism; that dim must divide by the
            mesh size). ``Replicate()`` (default, as torch's): the whole output on every rank, all-reduced by
            `overlap.matmul_all_reduce`. Any other: torch's style.
        use_local_output: return a local tensor (default) or a ``DTensor`` with ``output_layouts``.
        strategy, plan, timeout: passed to the op (default ``"auto"``).
        fp8: None (default), ``"rowwise"``, ``"tensorwise"``, ``"mxfp8"`` or an `overlap.Fp8Recipe`, passed to the op
            (the reduction moves float32 partials: docs/fp8.md). A torchao ``Float8Linear`` trains with its config's
            recipe.

    The bias is added once, after the reduction. With a sequence-sharded output its gradient is all-reduced over
    the mesh in backward (each rank sees only its rows), so it equals torch's own styles' gradient.

    Raises:
        TypeError / ValueError: a layout that is not a ``Placement``, a bad strategy/plan/timeout/fp8 (here); a
            module parallelized already, a torchao ``Float8Linear`` whose recipe is not `fp8` (where given) or cannot
            be expressed, ``"mxfp8"`` with this rank's input features not a multiple of 32 (when applied); an input
            ``DTensor`` on another mesh, a ``Shard(d)`` output whose ``d`` is the last dim of the input (in forward).
    """

    _param_placements = {"weight": Shard(1), "bias": Replicate()}
    _sharded_features = "in_features"

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None, fp8: str | Fp8Recipe | None = None):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self._setup(strategy, plan, timeout, fp8)

    def _layouts_fuse(self) -> bool:
        out = self.output_layouts[0]
        return isinstance(out, Replicate) or (isinstance(out, Shard) and out.dim != -1)

    def _forward(self, mod: nn.Linear, x: torch.Tensor, pg, mesh: DeviceMesh, recipe: Fp8Recipe | None
                 ) -> torch.Tensor:
        w_NK = mod.weight.to_local()  # [out, in/W]; backward: a Shard(1) DTensor
        local, placement = _placed(x, self.input_layouts[0], mesh)
        if _norm(placement, local.ndim) != Shard(local.ndim - 1):
            local = _redistributed(x, placement, Shard(local.ndim - 1), mesh)
        out = self.output_layouts[0]
        dim = _sequence_dim(out, local.ndim)
        if isinstance(out, Shard) and dim is None:
            raise ValueError(f"overlap's RowwiseParallel(output_layouts={out!r}): dim {out.dim} is the last dim of "
                             f"the {local.ndim}-d input (its features); a sequence dim or Replicate() is fused, "
                             "torch's own style takes Shard(-1)")
        if dim is not None:
            y = matmul_reduce_scatter(local, w_NK.t(), scatter_dim=dim, **self._op_kwargs(pg, recipe))
        else:
            y = matmul_all_reduce(local, w_NK.t(), **self._op_kwargs(pg, recipe))
        if mod.bias is not None:
            bias = mod.bias.to_local()
            if dim is not None and mesh.size() > 1:
                # Each rank adds the bias to its own rows only: the full gradient is the sum over ranks.
                bias = all_reduce_grad(bias, pg, self.timeout, "torch_tp.RowwiseParallel")
            y = y + bias.to(y.dtype)
        if self.use_local_output:
            return y
        return DTensor.from_local(y, mesh, [_norm(out, y.ndim)], run_check=False)


# ----------------------------------------------------------------------------------------------
# The gather in front of several column-wise layers, fused into them
# ----------------------------------------------------------------------------------------------


class PrepareModuleInput(torch_tp.PrepareModuleInput):
    """torch's ``PrepareModuleInput``, whose gather of a sequence-sharded input feeds the column-wise layers behind it.

    Where the module's first input goes from ``Shard(d)`` (a sequence dim) to ``Replicate()`` and the module holds
    ``nn.Linear`` layers parallelized by overlap's ``ColwiseParallel()`` (a replicated input: torchtitan's
    ``wq``/``wk``/``wv`` behind ``attention``, ``w1``/``w3`` behind ``feed_forward``), the gather is one
    `overlap.all_gather_matmul` with every such layer's weight: each gathered chunk is multiplied by all of them as
    it arrives, the module gets the gathered input as torch's style gives it, and each layer, called with that
    input, returns its product (its bias added). Backward: the layers' input gradients and the gathered input's
    are summed into one reduce-scatter (torch's arrangement also reduce-scatters once; overlap's layers alone would
    all-reduce once each). A layer that is not called with that input computes as usual (its product here was
    wasted, its gradient zero). Every other input and layout is prepared exactly as torch's style prepares it.
    The ops' arguments: `strategy`, `plan`, `timeout` (default ``"auto"``).

    Layers trained in fp8 (their style's ``fp8``, or torchao's ``Float8Linear``) are left out of that gather: the op
    gathering fp8 rows does not return the gathered input the module needs. They multiply the gathered input
    themselves (`overlap.fp8_matmul`), the gather moving the input in its own dtype (warned once); this is where
    torchao users put ``PrepareFloat8ModuleInput``, whose gather moves fp8.
    """

    def __init__(self, *args: Any, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        as_plan(strategy, plan)
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.module: nn.Module | None = None
        self.mesh: DeviceMesh | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.module, self.mesh = module, device_mesh
        return super()._apply(module, device_mesh)

    def _layers(self) -> list[tuple[nn.Linear, ColwiseParallel]]:
        """The module's layers a gather of its input may compute (found at each call: the plan may apply them after
        this style). Not those trained in fp8: the module needs the gathered input too, which a gather of fp8 rows
        does not return; they multiply the gathered input on their own (`fp8_matmul`), as torch's arrangement does."""
        found = []
        for m in self.module.modules():
            style = getattr(m, "_overlap_style", None)
            if not (isinstance(style, ColwiseParallel) and style._gathers_into()):
                continue
            if m._overlap_fp8 is None:
                found.append((m, style))
            else:
                warn_once(f"overlap's PrepareModuleInput: {m} trains with fp8 {m._overlap_fp8.text!r}: the gather in "
                          "front of it moves the input in its own dtype (a gather of fp8 rows does not return the "
                          "gathered input the module needs), and the layer multiplies the gathered input by itself",
                          key=f"torch_tp.prepare_fp8:{m._overlap_fp8.text}")
        return found

    def _prepare_input_fn(self, inputs, device_mesh):
        layouts, desired = self.input_layouts, self.desired_input_layouts
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if (layouts is None or not inputs or device_mesh.ndim != 1 or len(inputs) != len(layouts)
                or not isinstance(desired[0], Replicate) or not isinstance(inputs[0], torch.Tensor)):
            return super()._prepare_input_fn(inputs, device_mesh)
        x = inputs[0]
        local, placement = _placed(x, layouts[0], device_mesh)
        dim = _sequence_dim(placement, local.ndim) if placement is not None else None
        layers = self._layers() if dim is not None else []
        if not layers:
            return super()._prepare_input_fn(inputs, device_mesh)
        weights = [m.weight.to_local().t() for m, _ in layers]
        full, ys = all_gather_matmul(local, weights, group=device_mesh.get_group(), strategy=self.strategy,
                                     plan=self.plan, timeout=self.timeout, gather_dim=dim, return_gathered=True)
        # The module gets the gathered input as torch's style gives it: replicated, so the gradient that comes back
        # to it is whole (every rank's contributions summed, as DTensor sums them), and this rank's slice of it is
        # its input's (`_Replica`). The layers' outputs bring their own contributions through the op's backward.
        full = _Replica.apply(local, full.detach(), dim, device_mesh.get_local_rank(), device_mesh.size())
        prepared = full if self.use_local_output else DTensor.from_local(full, device_mesh, [Replicate()],
                                                                         run_check=False)
        for (_, style), y in zip(layers, ys, strict=True):
            style.ready = {id(prepared): (prepared, y)}  # (one call's: an earlier one's is dropped)
        rest = [self._prepare_input_arg(inp, device_mesh, il, dl)
                for inp, il, dl in zip(inputs[1:], layouts[1:], desired[1:], strict=True)]
        return (prepared, *rest)


class _Replica(torch.autograd.Function):
    """The gathered input (computed already) as a replicated tensor of `x`: its gradient is whole on every rank, so
    `x`'s is this rank's slice of it along `dim` (torch's ``Replicate() -> Shard(dim)``: no communication)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.world = dim, rank, world
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad.chunk(ctx.world, ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class _PrepareFloat8ModuleInput(PrepareModuleInput):
    """What `use_overlap_styles` puts where torchao's ``PrepareFloat8ModuleInput`` was: overlap's `PrepareModuleInput`
    taking torchao's arguments too. ``float8_dtype`` must be ``torch.float8_e4m3fn`` (torchao's only one);
    ``fwd_config_submodule_fqn`` is taken and not needed (each layer behind casts with its own recipe). torchao's
    casts the input to fp8 before its gather; here layers trained in fp8 multiply the gathered input themselves
    (`PrepareModuleInput`, warned)."""

    def __init__(self, *args: Any, float8_dtype: torch.dtype = torch.float8_e4m3fn,
                 fwd_config_submodule_fqn: str | None = None, **kwargs: Any):
        if float8_dtype != torch.float8_e4m3fn:
            raise ValueError(f"overlap's PrepareModuleInput in place of torchao's PrepareFloat8ModuleInput: "
                             f"float8_dtype must be torch.float8_e4m3fn, got {float8_dtype}")
        super().__init__(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# One call swaps torch's styles for these in a module that imported them
# ----------------------------------------------------------------------------------------------

#: torch's style -> overlap's, by the name a module imports it under
_SWAPS = {"ColwiseParallel": (torch_tp.ColwiseParallel, ColwiseParallel),
          "RowwiseParallel": (torch_tp.RowwiseParallel, RowwiseParallel),
          "PrepareModuleInput": (torch_tp.PrepareModuleInput, PrepareModuleInput)}
#: torchao's float8 styles and torchtitan's expert parallelism -> overlap's, by name (recognized by their class's name
#: and package: neither imported). torchtitan imports torchao's from ``torchao.float8.float8_tensor_parallel`` inside
#: its parallelize function (swap there), its ``ExpertParallel`` where its MoE models parallelize (llama4's module).
_FOREIGN_SWAPS = {"Float8ColwiseParallel": ("torchao", ColwiseParallel),
                  "Float8RowwiseParallel": ("torchao", RowwiseParallel),
                  "PrepareFloat8ModuleInput": ("torchao", _PrepareFloat8ModuleInput),
                  "ExpertParallel": ("torchtitan", ExpertParallel),
                  "ExpertTensorParallel": ("torchtitan", ExpertTensorParallel)}


def _theirs(module: types.ModuleType, name: str) -> type | None:
    """The style `module` holds under `name` where it is torch's, torchao's or torchtitan's of that name, else
    None."""
    value = getattr(module, name, None)
    if name in _SWAPS:
        return value if value is _SWAPS[name][0] else None
    package = _FOREIGN_SWAPS[name][0]
    foreign = isinstance(value, type) and value.__name__ == name and value.__module__.split(".")[0] == package
    return value if foreign else None


def _with_fp8(style: type, fp8: Fp8Recipe) -> type:
    """`style` (a class) whose ``fp8`` defaults to `fp8`."""

    def __init__(self, *args: Any, fp8: Any = fp8, **kwargs: Any) -> None:
        style.__init__(self, *args, fp8=fp8, **kwargs)

    return type(style.__name__, (style,), {"__init__": __init__, "__module__": style.__module__,
                                           "__qualname__": style.__qualname__, "__doc__": style.__doc__})


@contextlib.contextmanager
def use_overlap_styles(*modules: types.ModuleType, fp8: str | Fp8Recipe | None = None) -> Iterator[None]:
    """Within the ``with`` block, the names ``ColwiseParallel``, ``RowwiseParallel`` and ``PrepareModuleInput`` that
    each of `modules` imported from torch are overlap's styles (restored on exit, also on an error), so that code
    parallelizing a model with torch's styles (torchtitan's ``parallelize_llama``) runs overlap's ops unchanged::

        import torchtitan.models.llama3.infra.parallelize as llama_tp
        with overlap.hooks.torch_tp.use_overlap_styles(llama_tp):
            llama_tp.parallelize_llama(model, parallel_dims, job_config)

    torchao's float8 styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``) are
    swapped the same way where a module holds them: pass ``torchao.float8.float8_tensor_parallel`` too for
    torchtitan's float8 tensor parallelism (it imports them from there when it parallelizes); overlap's styles take
    each ``Float8Linear``'s recipe from its config (`overlap.hooks.torchao_float8`). torchtitan's ``ExpertParallel``
    and ``ExpertTensorParallel`` are swapped for overlap's (`overlap.hooks.expert_parallel`) where a module holds
    them: pass ``torchtitan.models.llama4.infra.parallelize`` for its MoE models (DeepSeek-V3, Llama 4, Qwen3).

    `fp8`: the recipe overlap's ``ColwiseParallel``/``RowwiseParallel`` default to within the block (the styles'
    ``fp8=``; default None; a torchao ``Float8Linear`` they meet must name the same). ``SequenceParallel`` stays
    torch's. Raises TypeError for an argument that is not a module, ValueError for a module that imported none of
    those styles; a bad `fp8` as the styles do."""
    recipe = recipe_among("hooks.torch_tp.use_overlap_styles", fp8, GRANULARITIES, TP_ONLY)
    ours = {name: mine for name, (_, mine) in (_SWAPS | _FOREIGN_SWAPS).items()}
    if recipe is not None:
        ours = {name: _with_fp8(mine, recipe) if mine in (ColwiseParallel, RowwiseParallel) else mine
                for name, mine in ours.items()}
    swapped: list[tuple[types.ModuleType, str, type]] = []
    for module in modules:
        if not isinstance(module, types.ModuleType):
            raise TypeError(f"use_overlap_styles takes modules (the one that imports torch's styles), got "
                            f"{type(module).__name__}")
        found = [(module, name, theirs) for name in ours if (theirs := _theirs(module, name)) is not None]
        if not found:
            raise ValueError(f"use_overlap_styles: {module.__name__} imports none of torch's {', '.join(_SWAPS)} "
                             f"or torchao's/torchtitan's {', '.join(_FOREIGN_SWAPS)} under those names: nothing to "
                             "swap")
        swapped += found
    try:
        for module, name, _theirs_style in swapped:
            setattr(module, name, ours[name])
        yield
    finally:
        for module, name, theirs in swapped:
            setattr(module, name, theirs)
