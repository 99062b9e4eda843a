"""Megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear``, overlapped (public as
`overlap.hooks.megatron`'s classes of the same names; the plain-torch layers are `overlap.nn`'s).

They take Megatron-core's constructor arguments, create the same parameters (names, shapes,
dtypes, tensor-parallel attributes, initial values from the same random draws), keep the same
``state_dict``/``sharded_state_dict`` keys, and return ``(output, output_bias)`` as Megatron's do;
the collectives run through the overlapped ops:

======================================  =====================================================
Megatron mode                           here
======================================  =====================================================
column, sequence parallel               `overlap.all_gather_matmul` (backward: its overlapped
                                        reduce-scatter of the input gradient)
column, no sequence parallel            local GEMM; backward: all-reduce of the input
                                        gradient in flight during the weight-gradient GEMM
column, ``gather_output=True``          the above, then an all-gather along the last dim
row, sequence parallel                  `overlap.matmul_reduce_scatter`
row, no sequence parallel               `overlap.matmul_all_reduce`
row, ``input_is_parallel=False``        the input split along its last dim first
======================================  =====================================================

Weight gradients go into ``weight.main_grad`` when ``config.gradient_accumulation_fusion`` is set and
the parameter has one (Megatron's distributed optimizer sets it up), with Megatron's
``grad_added_to_main_grad`` protocol; otherwise into ``.grad`` as usual. Megatron-core is not needed
to import or use the modules (``config`` is read by attribute: a ``ModelParallelConfig``, a
``TransformerConfig`` or any object with those fields); ``sharded_state_dict`` and the default
``tp_group`` (Megatron's tensor-parallel group) use it where it is installed.

fp8 (docs/fp8.md): the layers run the fp8 training recipe of `overlap.nn.fp8_linear` on every mode of the table
(the fused ops take it; a local GEMM is `overlap.fp8_matmul`). Which recipe: the ``fp8=`` keyword (``"rowwise"``,
``"tensorwise"``, ``"mxfp8"``, an `overlap.Fp8Recipe`, or None for none) where given, else ``"config"`` (the
default): Megatron's ``config.fp8`` / ``config.fp8_recipe``, mapped by `config_recipe`:

===========================  =====================================================================================
``config.fp8_recipe``        here (``config.fp8`` ``"e4m3"`` or ``"hybrid"``; ``config.fp8=None``: no fp8)
===========================  =====================================================================================
``"tensorwise"``             ``"tensorwise"``: Transformer Engine's current per-tensor scaling, the same scales
``"mxfp8"``                  ``"mxfp8"``: 1x32 blocks along k, power-of-two scales, as Transformer Engine's MXFP8
``"delayed"``                refused: its scales come from an amax history of earlier steps, which no recipe here
                             keeps (set ``fp8_recipe="tensorwise"``: the same format with current scales)
``"blockwise"``              refused: 1x128 activation and 128x128 weight blocks; ``"rowwise"`` (one scale per
                             row of k) would be coarser, not the same numbers (set ``"mxfp8"``: finer blocks)
``"custom"``                 refused: a quantizer factory of Transformer Engine's
===========================  =====================================================================================

Gradients: Transformer Engine also runs the backward GEMMs in fp8 (e4m3, or e5m2 gradients with ``"hybrid"``);
the mapped recipe keeps them in the parameters' dtype (``grads=False``, torchao's high-precision gradients), and
says so once: pass ``fp8=overlap.Fp8Recipe(granularity, grads=True)`` for fp8 gradients (torchao's convention for
the granularity). ``config.fp8_param``, ``config.first_last_layers_bf16`` and ``config.fp4`` are refused with the
config's recipe (the parameters stay in ``params_dtype``; a layer does not know its depth; no fp4 recipe here); an
explicit ``fp8=`` replaces the config's quantization settings altogether.

Arguments whose effect is not implemented raise ``NotImplementedError`` naming them
(``is_expert=True``: expert layers belong to `overlap`'s MoE ops; deferred embedding weight
gradients; CPU activation offloading). ``tp_comm_buffer_name`` is accepted and unused, as in
Megatron's own modules; ``config.tp_comm_overlap`` (Transformer Engine's userbuffers) is replaced by
`overlap`'s own overlap, with a warning once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Parameter

from .. import envs
from ..errors import warn_once
from ..nn.fp8_linear import fp8_linear, layer_recipe
from ..ops.fp8_recipe import Fp8Recipe
from ..ops.tp.all_gather_matmul import all_gather_matmul
from ..ops.tp.collectives import gather_last_dim, linear_all_reduce_dgrad, split_last_dim
from ..ops.tp.matmul_all_reduce import matmul_all_reduce
from ..ops.tp.matmul_reduce_scatter import matmul_reduce_scatter
from ..plans import Plan


def _cfg(config: Any, name: str, default: Any) -> Any:
    return getattr(config, name, default)


#: ``fp8=`` of the layers and of `overlap.hooks.megatron.patch`: take the recipe from Megatron's config
FP8_FROM_CONFIG = "config"

#: Megatron's ``config.fp8_recipe`` -> the granularity of the same numbers here (the module docstring)
CONFIG_RECIPES = {"tensorwise": "tensorwise", "mxfp8": "mxfp8"}
_REFUSED_RECIPES = {
    "delayed": "Transformer Engine's delayed scaling takes its scales from an amax history of earlier steps",
    "blockwise": "Transformer Engine's 1x128 and 128x128 blocks have no recipe of the same numbers here",
    "custom": "a custom quantizer factory is Transformer Engine's",
}


def _value(option: Any) -> Any:
    return getattr(option, "value", option)  # Megatron's enums are str enums


def config_recipe(config: Any, what: str, recipes: dict[str, str] = CONFIG_RECIPES,
                  refused: dict[str, str] = _REFUSED_RECIPES) -> Fp8Recipe | None:
    """The fp8 recipe of Megatron's `config` (``fp8``, ``fp8_recipe``) for the layer `what` (see the module
    docstring's table; `recipes` and `refused`: another layer's mapping, the MoE layers'), or None where
    ``config.fp8`` is unset.

    Raises:
        NotImplementedError: a Megatron recipe with no counterpart here (``delayed``, ``blockwise``, ``custom``),
            ``fp8_param``, ``first_last_layers_bf16``, or ``fp4``: one line naming the option and what to use.
        ValueError: an ``fp8`` format or ``fp8_recipe`` Megatron does not know either.
    """
    where = f"overlap.hooks.megatron.{what}"
    instead = (f"or pass fp8={'|'.join(repr(g) for g in dict.fromkeys(('rowwise', *recipes.values())))} to the "
               "layer (overlap.hooks.megatron.patch(model, fp8=...)) to override the config")
    if _cfg(config, "fp4", None):
        raise NotImplementedError(f"{where}: config.fp4 is not supported (no fp4 recipe here): unset it, {instead}")
    fmt = _value(_cfg(config, "fp8", None))
    if not fmt:
        return None
    if fmt not in ("e4m3", "hybrid"):
        raise ValueError(f"{where}: config.fp8 must be 'e4m3', 'hybrid' or None, got {fmt!r}")
    recipe = _value(_cfg(config, "fp8_recipe", "delayed"))
    if recipe in refused:
        raise NotImplementedError(f"{where}: config.fp8_recipe={recipe!r} is not supported ({refused[recipe]}): set "
                                  f"config.fp8_recipe={' or '.join(map(repr, recipes))}, {instead}")
    if recipe not in recipes:
        raise ValueError(f"{where}: config.fp8_recipe must be one of {sorted([*recipes, *refused])}, got {recipe!r}")
    for option, why in (("fp8_param", "the parameters stay in params_dtype, quantized at each forward"),
                        ("first_last_layers_bf16", "a layer does not know its depth")):
        if _cfg(config, option, False):
            raise NotImplementedError(f"{where}: config.{option} is not supported ({why}): unset it, {instead}")
    granularity = recipes[recipe]
    warn_once(f"overlap.hooks.megatron: config.fp8={fmt!r} with fp8_recipe={recipe!r} runs the forward GEMMs in "
              f"fp8 (overlap's {granularity!r} recipe) and the backward GEMMs in the parameters' dtype (Transformer "
              f"Engine runs them in fp8): pass fp8=overlap.Fp8Recipe({granularity!r}, grads=True) for fp8 gradients",
              key="megatron config fp8 gradients")
    return Fp8Recipe(granularity)


def resolve_fp8(what: str, fp8: Any, config: Any, k: int, k_name: str, dtype: torch.dtype) -> Fp8Recipe | None:
    """The recipe of a layer `what` built with ``fp8=`` `fp8` (`FP8_FROM_CONFIG`: `config_recipe`), checked as
    `overlap.nn.fp8_linear.layer_recipe` checks it (GEMM reduction `k`, named `k_name`; parameters of `dtype`)."""
    if isinstance(fp8, str) and fp8 == FP8_FROM_CONFIG:
        fp8 = config_recipe(config, what)
    return layer_recipe(f"hooks.megatron.{what}", fp8, k, k_name, dtype)


def _default_tp_group(is_expert: bool) -> dist.ProcessGroup:
    """Megatron's tensor-parallel group where Megatron's parallel state is initialized, else the world."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return dist.group.WORLD
    if not parallel_state.model_parallel_is_initialized():
        return dist.group.WORLD
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _set_tp_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def _init_cpu(weight: Parameter, full_shape: tuple[int, int], dim: int, init_method: Callable, stride: int,
              rank: int, world_size: int, params_dtype: torch.dtype) -> torch.Tensor:
    """Megatron's CPU initialization: draw the whole fp32 master weight, keep this rank's strided part.

    The same draws as Megatron-core's, so a model built with these modules starts from the same
    numbers as one built with Megatron's. Returns the master weight.
    """
    master = torch.empty(full_shape, dtype=torch.float)
    init_method(master)
    master = master.to(params_dtype)
    per_stride = weight.shape[dim] // stride
    pieces = torch.split(master, per_stride, dim=dim)[rank::world_size]
    with torch.no_grad():
        weight.copy_(torch.cat(pieces, dim=dim))
    return master


def _init_device(weight: Parameter, init_method: Callable, is_expert: bool) -> None:
    """Megatron's device initialization: under its CUDA RNG tracker where Megatron is installed."""
    try:
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker,
            get_expert_parallel_rng_tracker_name,
        )
    except ImportError:
        init_method(weight)
        return
    name = get_expert_parallel_rng_tracker_name() if is_expert else None
    with get_cuda_rng_tracker().fork(*(() if name is None else (name,))):
        init_method(weight)


# ----------------------------------------------------------------------------------------------
# Autograd pieces
# ----------------------------------------------------------------------------------------------


class _IntoMainGrad(torch.autograd.Function):
    """Identity on the weight; its gradient is added to ``weight.main_grad`` (Megatron's protocol)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        weight.main_grad.add_(grad.to(weight.main_grad.dtype))
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        # Megatron's DDP reads grad_added_to_main_grad and ignores .grad; a dummy keeps its hooks
        # on the main backward thread, as Megatron's own layers do.
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(weight.main_grad.shape, dtype=grad.dtype, device=grad.device)


# ----------------------------------------------------------------------------------------------
# The modules
# ----------------------------------------------------------------------------------------------


class _ParallelLinear(torch.nn.Module):
    """What both modules share: config checks, the group, the plan, main_grad, state-dict extras."""

    _partition_dim: int  # of the weight

    def _setup(self, input_size: int, output_size: int, config: Any, is_expert: bool, tp_group,
               skip_bias_add: bool, strategy: str, plan: Plan | dict | None, timeout: float | None,
               unsupported: dict[str, bool]) -> None:
        name = type(self).__name__
        if is_expert:
            unsupported["is_expert=True (expert layers run through overlap's MoE ops)"] = True
        if _cfg(config, "cpu_offloading", False):
            unsupported["config.cpu_offloading"] = True
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"overlap.hooks.megatron.{name}: not implemented: {', '.join(bad)}")
        if _cfg(config, "tp_comm_overlap", False):
            warn_once(f"overlap.hooks.megatron.{name}: config.tp_comm_overlap (Transformer Engine's userbuffers) "
                      "is not used; overlap's own ops overlap the communication instead", key="tp_comm_overlap")
        self.input_size, self.output_size = input_size, output_size
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = _cfg(config, "expert_model_parallel_size", 1) > 1
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp_group if tp_group is not None else _default_tp_group(is_expert)
        self.world_size = dist.get_world_size(self.tp_group)
        self.rank = dist.get_rank(self.tp_group)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.gradient_accumulation_fusion = bool(_cfg(config, "gradient_accumulation_fusion", False))
        self.sequence_parallel = bool(_cfg(config, "sequence_parallel", False))
        if self.sequence_parallel and self.world_size <= 1:
            warnings.warn(f"overlap.hooks.megatron.{name}: sequence_parallel is set with a tensor-parallel size of 1; "
                          "disabling sequence parallelism", stacklevel=3)
            self.sequence_parallel = False
        self._default_extra_state()

    def _default_extra_state(self) -> None:
        """Megatron's modules give checkpoints an empty ``_extra_state`` (Transformer Engine
        compatibility): a checkpoint without the key loads too."""
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state")
        )

    def _placement(self) -> tuple[torch.dtype, torch.device, bool]:
        """``(dtype, device, cpu_init)`` of new parameters, as Megatron's config asks (CPU without a GPU)."""
        cpu_init = _cfg(self.config, "use_cpu_initialization", False) or not torch.cuda.is_available()
        device = torch.device("cpu") if cpu_init else torch.device("cuda", torch.cuda.current_device())
        return _cfg(self.config, "params_dtype", torch.float32), device, cpu_init

    def _make_weight(self, shape: tuple[int, int], full_shape: tuple[int, int], init_method: Callable,
                     stride: int, keep_master_weight_for_test: bool) -> Parameter:
        config = self.config
        dtype, device, cpu_init = self._placement()
        weight = Parameter(torch.empty(shape, dtype=dtype, device=device))
        _set_tp_attributes(weight, True, self._partition_dim, stride)
        if _cfg(config, "perform_initialization", True):
            if cpu_init:
                master = _init_cpu(weight, full_shape, self._partition_dim, init_method, stride, self.rank,
                                   self.world_size, dtype)
                if keep_master_weight_for_test:
                    self.master_weight = master
            else:
                _init_device(weight, init_method, self.is_expert)
        weight.allreduce = not (self.is_expert and self.expert_parallel)
        return weight

    def _make_bias(self, size: int) -> Parameter:
        dtype, device, _ = self._placement()
        bias = Parameter(torch.empty(size, dtype=dtype, device=device))
        if _cfg(self.config, "perform_initialization", True):
            with torch.no_grad():
                bias.zero_()  # Megatron always starts biases at zero
        bias.allreduce = not (self.is_expert and self.expert_parallel)
        return bias

    def _set_fp8(self, fp8: Any, dtype: torch.dtype) -> None:
        """``self.fp8``, the recipe (`resolve_fp8`) of this layer's GEMM: its reduction is the whole input of a
        column layer, this rank's part of a row layer's."""
        column = self._partition_dim == 0
        k = self.input_size if column else self.input_size // self.world_size
        self.fp8 = resolve_fp8(type(self).__name__, fp8, self.config, k,
                               "input_size" if column else "input_size/tp", dtype)

    def _weight_for_op(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight`, routed into ``main_grad`` where Megatron's gradient accumulation fusion asks for it."""
        if self.gradient_accumulation_fusion and weight.requires_grad and hasattr(weight, "main_grad"):
            return _IntoMainGrad.apply(weight)
        return weight

    def _op_kwargs(self) -> dict[str, Any]:
        return {"group": self.tp_group, "strategy": self.strategy, "plan": self.plan, "timeout": self.timeout,
                "fp8": self.fp8}

    def _sharded_state_dict(self, prefix: str, axes: dict[str, int], sharded_offsets, metadata):
        try:
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        except ImportError as exc:
            raise ImportError(f"overlap.hooks.megatron.{type(self).__name__}.sharded_state_dict needs "
                              "megatron-core") from exc
        state_dict = self.state_dict(prefix="", keep_vars=True)
        kwargs = {"tp_group": self.tp_group}
        if metadata is not None and "dp_cp_group" in metadata:
            kwargs["dp_cp_group"] = metadata["dp_cp_group"]
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, axes, sharded_offsets, **kwargs)

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (as Megatron's modules do)."""

    def get_extra_state(self) -> None:
        """None, as Megatron's modules (keeps the ``_extra_state`` key of their checkpoints)."""
        return None

    def backward_dw(self) -> None:
        """Megatron's deferred weight-gradient hook: weight gradients are never deferred here."""

    def _resolve_timeout(self) -> float:
        return envs.resolve_timeout(self.timeout)

    @classmethod
    def from_megatron(cls, original: torch.nn.Module, strategy: str = "auto", plan=None,
                      timeout: float | None = None, fp8: Any = FP8_FROM_CONFIG) -> _ParallelLinear:
        """This module in place of Megatron's `original`, sharing its very parameters (no copy, no init); `fp8`
        as for the constructor (default: from `original`'s config)."""
        if getattr(original, "is_expert", False):
            raise NotImplementedError(f"overlap.hooks.megatron.{cls.__name__}: is_expert=True layers are not replaced")
        return cls._adopt(original, strategy, plan, timeout, fp8)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, "
                f"TP={self.world_size}, sequence_parallel={self.sequence_parallel}, strategy={self.strategy!r}, "
                f"fp8={None if self.fp8 is None else self.fp8.text!r}")

    @classmethod
    def _adopt(cls, original: torch.nn.Module, strategy: str, plan, timeout, fp8: Any) -> _ParallelLinear:
        """A new module of this class sharing `original`'s parameters (no copy, no initialization)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        for key, value in vars(original).items():
            if key.startswith("_"):
                continue
            setattr(new, key, value)
        for name in ("weight", "bias"):  # the very Parameter objects (or None)
            new.register_parameter(name, getattr(original, name, None))
        if _cfg(new.config, "defer_embedding_wgrad_compute", False) and cls is ColumnParallelLinear:
            raise NotImplementedError(f"overlap.hooks.megatron.{cls.__name__}: not implemented: "
                                      "config.defer_embedding_wgrad_compute")
        new.world_size = dist.get_world_size(new.tp_group)
        new.rank = dist.get_rank(new.tp_group)
        new.strategy, new.plan, new.timeout = strategy, plan, timeout
        weight = getattr(original, "weight", None)
        new._set_fp8(fp8, weight.dtype if weight is not None else _cfg(new.config, "params_dtype", torch.float32))
        new.gradient_accumulation_fusion = bool(_cfg(new.config, "gradient_accumulation_fusion", False))
        new._default_extra_state()
        return new


class ColumnParallelLinear(_ParallelLinear):
    """Megatron-core's ``ColumnParallelLinear`` (``Y = X A + b``, ``A`` split along its columns),
    its collectives overlapped with its GEMMs. See the module docstring for the modes.

    Args: those of Megatron-core's ``ColumnParallelLinear`` (``input_size, output_size, *, config,
    init_method, bias, gather_output, stride, keep_master_weight_for_test, skip_bias_add,
    skip_weight_param_allocation, embedding_activation_buffer, grad_output_buffer, is_expert,
    tp_comm_buffer_name, disable_grad_reduce, tp_group``), then `overlap`'s: ``strategy``, ``plan``,
    ``timeout`` of the ops (defaults: ``"auto"``, none, ``OVERLAP_TIMEOUT_S``) and ``fp8`` (the module docstring;
    default ``"config"``: Megatron's ``config.fp8``/``fp8_recipe``; with ``"mxfp8"``, ``input_size`` must be a
    multiple of 32).

    Input: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism). Returns ``(output, output_bias)``:
    ``output`` is ``[s, b, output_size/tp]`` (``[s, b, output_size]`` when gathered), ``output_bias``
    the bias when ``skip_bias_add`` else None.
    """

    _partition_dim = 0

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, embedding_activation_buffer: list | None = None,
                 grad_output_buffer: list | None = None, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, disable_grad_reduce: bool = False, tp_group=None,
                 strategy: str = "auto", plan: Plan | dict | None = None, timeout: float | None = None,
                 fp8: str | Fp8Recipe | None = FP8_FROM_CONFIG):
        super().__init__()
        defer = bool(_cfg(config, "defer_embedding_wgrad_compute", False))
        self._setup(input_size, output_size, config, is_expert, tp_group, skip_bias_add, strategy, plan, timeout,
                    {"config.defer_embedding_wgrad_compute (embedding_activation_buffer, grad_output_buffer)": defer})
        del tp_comm_buffer_name, embedding_activation_buffer, grad_output_buffer  # unused, as in Megatron
        self.gather_output = gather_output
        self.disable_grad_reduce = disable_grad_reduce
        if output_size % self.world_size:
            raise ValueError(f"overlap.hooks.megatron.ColumnParallelLinear: output_size={output_size} is not "
                             f"divisible by the tensor-parallel size {self.world_size}")
        self.output_size_per_partition = output_size // self.world_size
        self._set_fp8(fp8, self._placement()[0])
        self.explicit_expert_comm = False
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = self._make_weight((self.output_size_per_partition, input_size), (output_size, input_size),
                                            init_method, stride, keep_master_weight_for_test)
        if bias:
            self.bias = self._make_bias(self.output_size_per_partition)
            _set_tp_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.allreduce_dgrad = self.world_size > 1 and not self.sequence_parallel and not disable_grad_reduce

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is None:
            if self.weight is None:
                raise RuntimeError("overlap.hooks.megatron.ColumnParallelLinear: weight was not supplied to forward "
                                   "and skip_weight_param_allocation is True")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError("overlap.hooks.megatron.ColumnParallelLinear: supplied weight's shape is "
                               f"{tuple(weight.shape)}, not {(self.output_size_per_partition, self.input_size)} "
                               "as expected")
        w = self._weight_for_op(weight)
        if self.sequence_parallel:
            out = all_gather_matmul(input_, w.t(), **self._op_kwargs())
        elif self.fp8 is not None:  # the input gradient all-reduced where Megatron's is
            group = self.tp_group if self.allreduce_dgrad else None
            out = fp8_linear(input_, w, self.fp8, group, self._resolve_timeout(), "ColumnParallelLinear")
        elif self.allreduce_dgrad:
            out = linear_all_reduce_dgrad(input_, w, self.tp_group, self._resolve_timeout(), "ColumnParallelLinear")
        else:
            out = torch.matmul(input_, w.t())
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.world_size > 1:
            out = gather_last_dim(out, self.tp_group, self.timeout, "ColumnParallelLinear(gather_output)")
        return out, (self.bias if self.skip_bias_add else None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's: weight and bias sharded along axis 0."""
        return self._sharded_state_dict(prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)


class RowParallelLinear(_ParallelLinear):
    """Megatron-core's ``RowParallelLinear`` (``Y = X A + b``, ``A`` split along its rows), its
    reduction overlapped with its GEMM. See the module docstring for the modes.

    Args: those of Megatron-core's ``RowParallelLinear`` (``input_size, output_size, *, config,
    init_method, bias, input_is_parallel, skip_bias_add, stride, keep_master_weight_for_test,
    is_expert, tp_comm_buffer_name, tp_group``), then ``strategy``, ``plan``, ``timeout`` and ``fp8`` (as for
    `ColumnParallelLinear`; with ``"mxfp8"``, ``input_size / tp`` must be a multiple of 32).

    Input: ``[s, b, input_size/tp]`` (``[s, b, input_size]`` when not ``input_is_parallel``). Returns
    ``(output, output_bias)``: ``[s, b, output_size]`` (``[s/tp, b, output_size]`` with sequence
    parallelism; the bias is then marked ``sequence_parallel`` for Megatron's gradient reduction).
    """

    _partition_dim = 1

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None,
                 strategy: str = "auto", plan: Plan | dict | None = None, timeout: float | None = None,
                 fp8: str | Fp8Recipe | None = FP8_FROM_CONFIG):
        super().__init__()
        self._setup(input_size, output_size, config, is_expert, tp_group, skip_bias_add, strategy, plan, timeout, {})
        del tp_comm_buffer_name
        self.input_is_parallel = input_is_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("overlap.hooks.megatron.RowParallelLinear: sequence_parallel needs "
                               "input_is_parallel=True")
        if input_size % self.world_size:
            raise ValueError(f"overlap.hooks.megatron.RowParallelLinear: input_size={input_size} is not divisible "
                             f"by the tensor-parallel size {self.world_size}")
        self.input_size_per_partition = input_size // self.world_size
        self._set_fp8(fp8, self._placement()[0])
        self.explicit_expert_comm = False
        self.weight = self._make_weight((output_size, self.input_size_per_partition), (output_size, input_size),
                                        init_method, stride, keep_master_weight_for_test)
        if bias:
            self.bias = self._make_bias(output_size)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = input_
        if not self.input_is_parallel and self.world_size > 1:
            x = split_last_dim(x, self.tp_group, self.timeout, "RowParallelLinear(input_is_parallel=False)")
        w = self._weight_for_op(self.weight)
        if self.sequence_parallel:
            out = matmul_reduce_scatter(x, w.t(), **self._op_kwargs())
        else:
            out = matmul_all_reduce(x, w.t(), **self._op_kwargs())
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's: weight sharded along axis 1, bias replicated."""
        return self._sharded_state_dict(prefix, {"weight": 1}, sharded_offsets, metadata)

