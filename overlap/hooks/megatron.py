"""Megatron-core integration: its parallel linear layers and MoE layer, overlapped; patch a built model; build
new ones.

``ColumnParallelLinear`` and ``RowParallelLinear`` (defined in `overlap.hooks.megatron_linear`) take
Megatron-core's constructor arguments (``config=``, ``init_method=``, ...) and return ``(output,
output_bias)`` as Megatron's do. ``patch(model)`` replaces, in place, every Megatron-core
``ColumnParallelLinear`` and ``RowParallelLinear`` of `model` by them, sharing the very same parameter
tensors (so the optimizer, the distributed-data-parallel buffers and checkpoints keep working), and
returns what it replaced; ``unpatch(model, replaced)`` puts the originals back. Every ``MoELayer`` is
replaced too, by ``OverlapMoELayer`` (`overlap.hooks.megatron_moe`). Only those two exact
classes are replaced: subclasses and Transformer Engine's layers may do more than their base, so they
are left alone and named in a warning. Hooks registered on a replaced module do not carry over.

For new models, `OverlapSpecProvider` is Megatron-core's local backend with these layers,
and `replace_in_spec` rewrites any ``ModuleSpec`` tree (e.g. ``get_gpt_layer_local_spec()``)::

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from overlap.hooks.megatron import replace_in_spec
    spec = replace_in_spec(get_gpt_layer_local_spec())

fp8: every layer takes its recipe from its Megatron config (``config.fp8``, ``config.fp8_recipe``: the mapping is
`overlap.hooks.megatron_linear`'s), unless ``patch(model, fp8=...)`` or ``replace_in_spec(spec, fp8=...)`` names
one (``"rowwise"``, ``"tensorwise"``, ``"mxfp8"``, an `overlap.Fp8Recipe`, or None for none) for every layer. A MoE
layer quantizes its tokens before the dispatch (``"rowwise"``, ``"mxfp8"``, and from the config ``"blockwise"`` as
``"block128"``: `overlap.hooks.megatron_moe`); ``"tensorwise"`` is refused there.

`patch`, `unpatch`, `replace_in_spec`, `OverlapSpecProvider` and ``REPLACEMENTS`` need megatron-core
(tested with 0.16.1), imported when one of them is first used, not with this module: importing
megatron-core warns where Transformer Engine and Apex are missing, and a user of the plain layers
(`overlap.nn`) should not see that.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch

from ..ops.fp8_recipe import Fp8Recipe, recipe_of
from ..plans import Plan
from .megatron_linear import FP8_FROM_CONFIG, ColumnParallelLinear, RowParallelLinear
from .megatron_moe import MoESettings, check_moe_layer, moe_layer_class, moe_recipe, replace_moe_layer

# REPLACEMENTS, OverlapSpecProvider and OverlapMoELayer are made on first use (`__getattr__`).
__all__ = ["ColumnParallelLinear", "Replaced", "RowParallelLinear", "patch", "replace_in_spec", "unpatch"]


def _replacements() -> dict[type, type]:
    """Megatron-core class -> overlap's replacement (imports megatron-core)."""
    try:
        from megatron.core.tensor_parallel import layers
    except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
        raise ImportError("overlap.hooks.megatron needs megatron-core (pip install megatron-core)") from exc
    return {layers.ColumnParallelLinear: ColumnParallelLinear, layers.RowParallelLinear: RowParallelLinear}


def _spec_provider() -> type:
    """`OverlapSpecProvider`, a subclass of megatron-core's ``LocalSpecProvider``."""
    _replacements()  # the clear ImportError without megatron-core
    from megatron.core.models.backends import LocalSpecProvider

    class OverlapSpecProvider(LocalSpecProvider):
        """Megatron-core's local (non-Transformer-Engine) backend, with overlap's parallel linear layers."""

        def column_parallel_linear(self) -> type:
            return ColumnParallelLinear

        def row_parallel_linear(self) -> type:
            return RowParallelLinear

    OverlapSpecProvider.__module__ = __name__
    return OverlapSpecProvider


def _moe_layer() -> type:
    """`OverlapMoELayer` (`overlap.hooks.megatron_moe`), a subclass of megatron-core's ``MoELayer``."""
    _replacements()  # the clear ImportError without megatron-core
    return moe_layer_class()


_MADE: dict[str, Any] = {}
_MAKERS = {"REPLACEMENTS": _replacements, "OverlapSpecProvider": _spec_provider, "OverlapMoELayer": _moe_layer}


def __getattr__(name: str) -> Any:
    """``REPLACEMENTS`` (Megatron-core class -> overlap's), ``OverlapSpecProvider`` and ``OverlapMoELayer``,
    made on first use."""
    if name not in _MAKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _MADE:
        _MADE[name] = _MAKERS[name]()
    return _MADE[name]


@dataclasses.dataclass
class Replaced:
    """One replacement made by `patch`: the module's dotted name, Megatron's module and overlap's."""

    name: str
    original: torch.nn.Module
    replacement: torch.nn.Module


def _parent(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _explicit_fp8(fp8: Any, what: str) -> bool:
    """Whether `fp8` names a recipe (not `FP8_FROM_CONFIG`, not None); a bad one raises naming `what`."""
    if isinstance(fp8, str) and fp8 == FP8_FROM_CONFIG:
        return False
    return recipe_of(what, fp8) is not None


def patch(model: torch.nn.Module, plan: Plan | dict | None = None, strategy: str = "auto",
          timeout: float | None = None, max_tokens_per_rank: int | None = None,
          fp8: str | Fp8Recipe | None = FP8_FROM_CONFIG) -> list[Replaced]:
    """Replace, in place, every Megatron-core ``ColumnParallelLinear``/``RowParallelLinear`` of `model` by
    overlap's, and every ``MoELayer`` by an ``OverlapMoELayer`` (`overlap.hooks.megatron_moe`: its dispatch,
    experts and combine on overlap's fused MoE ops; its router, shared experts and parameters Megatron's).

    Args:
        model: a built Megatron-core model (or any module containing those layers).
        plan, strategy, timeout: passed to every replaced layer's ops (``plan`` wins over
            ``strategy``, as for the ops).
        max_tokens_per_rank: for the MoE layers: None (exact row counts), or the most tokens (``s * b``) a
            rank passes to one MoE layer, the same on every rank: the MoE ops then run with static shapes
            (`overlap.ops.moe.bound`, for CUDA graphs and torch.compile).
        fp8: the linear layers' fp8 recipe: ``"config"`` (default: each layer's Megatron config, see
            `overlap.hooks.megatron_linear`), None (none, whatever the config says), ``"rowwise"``,
            ``"tensorwise"``, ``"mxfp8"`` or an `overlap.Fp8Recipe`.

    Returns:
        What was replaced, in module order; pass it to `unpatch` to undo.

    Raises:
        NotImplementedError: a MoE layer with an option the replacement does not implement (named), a config fp8
            recipe with no counterpart here (for a MoE layer: ``tensorwise`` too); before anything is replaced.
        ValueError, TypeError: a bad `fp8`; ``"mxfp8"`` on a layer whose GEMM's k is not a multiple of 32; before
            anything is replaced.

    The experts' own linear layers (``is_expert=True``) are left in place (the MoE replacement reads their
    weights), as are subclasses of the replaced classes and the linear layers of overlapped shared experts
    (Megatron's dispatcher drives their communication): subclasses and expert layers outside a MoE layer are
    named in a warning.
    """
    replacements = __getattr__("REPLACEMENTS")
    moe_class = __getattr__("OverlapMoELayer")
    moe_base = moe_class.__mro__[1]  # megatron-core's MoELayer
    if isinstance(model, tuple(replacements)) or type(model) is moe_base:
        raise ValueError("overlap.hooks.megatron.patch: pass the model that contains the layer, not the layer")
    settings = MoESettings(strategy=strategy, plan=plan, timeout=timeout, max_tokens_per_rank=max_tokens_per_rank)
    _explicit_fp8(fp8, "hooks.megatron.patch")  # (a bad fp8 raises before anything is replaced)
    modules = list(model.named_modules())
    moe_names = [name for name, module in modules if type(module) is moe_base]
    moe_settings = {}
    for name in moe_names:  # every refusal before any replacement
        layer = model.get_submodule(name)
        check_moe_layer(layer)
        moe_settings[name] = dataclasses.replace(settings, fp8=moe_recipe(fp8, layer.config))
    skipped: list[str] = []
    inside_moe = tuple(f"{name}." for name, module in modules if isinstance(module, moe_base))
    skipped += [f"{name} ({type(module).__name__}: a subclass of MoELayer)" for name, module in modules
                if isinstance(module, moe_base) and type(module) not in (moe_base, moe_class)]
    linears: list[Replaced] = []  # built first: a layer's refusal (its fp8) raises before any replacement
    for name, module in modules:
        target = replacements.get(type(module))
        if target is None:
            if isinstance(module, tuple(replacements)):
                skipped.append(f"{name} ({type(module).__name__}: a subclass)")
            continue
        if getattr(module, "is_expert", False) or getattr(module, "explicit_expert_comm", False):
            if not name.startswith(inside_moe):
                skipped.append(f"{name} (is_expert=True)")
            continue
        new = target.from_megatron(module, strategy=strategy, plan=plan, timeout=timeout, fp8=fp8)
        new.train(module.training)
        linears.append(Replaced(name, module, new))
    done: list[Replaced] = []
    for name in moe_names:
        original = model.get_submodule(name)
        new = replace_moe_layer(original, moe_settings[name])
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, new)
        done.append(Replaced(name, original, new))
    for r in linears:
        parent, leaf = _parent(model, r.name)
        setattr(parent, leaf, r.replacement)
        done.append(r)
    if skipped:
        warnings.warn("overlap.hooks.megatron.patch left these layers as they are: " + ", ".join(skipped),
                      stacklevel=2)
    return done


def unpatch(model: torch.nn.Module, replaced: list[Replaced]) -> None:
    """Put back the modules `patch` replaced (they share the parameters, so training carries over)."""
    for r in reversed(replaced):
        parent, leaf = _parent(model, r.name)
        current = getattr(parent, leaf)
        if current is not r.replacement:
            raise ValueError(f"overlap.hooks.megatron.unpatch: {r.name} is no longer the module patch put there")
        r.original.train(current.training)
        setattr(parent, leaf, r.original)


def replace_in_spec(spec: Any, max_tokens_per_rank: int | None = None,
                    fp8: str | Fp8Recipe | None = FP8_FROM_CONFIG) -> Any:
    """A copy of a Megatron-core ``ModuleSpec`` tree with overlap's layers in place of Megatron's.

    Walks ``ModuleSpec.module`` and ``.submodules`` (a dataclass of specs or classes), recursively. A
    ``MoELayer`` spec becomes an ``OverlapMoELayer`` spec (`max_tokens_per_rank` as for `patch`) whose
    submodules (router, experts, shared experts) stay Megatron's: the replacement reads the experts' weights
    from them, and Megatron's dispatcher-side protocol of overlapped shared experts drives their linears.
    `fp8` as for `patch`: other than ``"config"`` (the default: the class alone, its recipe from the config the
    model is built with), every linear layer and MoE layer becomes a ``ModuleSpec`` of overlap's class with
    ``params={"fp8": fp8}`` (a granularity a MoE layer does not take raises here).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    MoESettings(max_tokens_per_rank=max_tokens_per_rank)  # a bad bound raises here
    explicit_fp8 = _explicit_fp8(fp8, "hooks.megatron.replace_in_spec")
    replacements = __getattr__("REPLACEMENTS")
    moe = __getattr__("OverlapMoELayer")
    moe_base = moe.__mro__[1]  # megatron-core's MoELayer
    fp8_params = {} if isinstance(fp8, str) and fp8 == FP8_FROM_CONFIG else {"fp8": fp8}

    def walk(spec: Any) -> Any:
        if isinstance(spec, type):
            target = replacements.get(spec)
            if target is None:
                return spec
            return ModuleSpec(module=target, params=dict(fp8_params)) if fp8_params else target
        if isinstance(spec, ModuleSpec):
            module = spec.module
            if module is moe_base or (isinstance(module, functools.partial) and module.func is moe_base):
                params = dict(spec.params or {})
                if explicit_fp8:
                    moe_recipe(fp8, None)  # (a granularity the MoE ops do not take raises here)
                    params["fp8"] = fp8
                if max_tokens_per_rank is not None:
                    params["max_tokens_per_rank"] = max_tokens_per_rank
                if isinstance(module, functools.partial):  # megatron-core's newer specs (untested here)
                    return dataclasses.replace(spec, module=functools.partial(moe, *module.args, **module.keywords),
                                               params=params)
                return dataclasses.replace(spec, module=moe, params=params)
            subs = None if spec.submodules is None else walk(spec.submodules)
            if isinstance(module, type) and module in replacements:
                return dataclasses.replace(spec, module=replacements[module],
                                           params={**(spec.params or {}), **fp8_params}, submodules=subs)
            return dataclasses.replace(spec, module=walk(module), submodules=subs)
        if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
            return dataclasses.replace(spec, **{f.name: walk(getattr(spec, f.name)) for f in dataclasses.fields(spec)})
        if isinstance(spec, (list, tuple)):
            return type(spec)(walk(s) for s in spec)
        return spec

    return walk(spec)
