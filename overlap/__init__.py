"""overlap: communication/compute overlap for tensor- and expert-parallel training.

Public API (docs/api.md, docs/conventions.md): `all_gather_matmul`, `matmul_reduce_scatter`, `matmul_all_reduce`,
`all_gather_weight_matmul` (the weight-side gather of FSDP), `matmul_all_to_all` and `all_to_all_matmul` (sequence-
parallel attention's projections), `Plan`,
`PlanFile`, `STRATEGIES`, `reserve`, `release`, `OverlapError`, `OverlapTimeout`, `OverlapMismatchError`;
`overlap.moe` (`dispatch`, `combine`, `dispatch_grouped_matmul`, `grouped_matmul_combine`) for expert
parallelism; `overlap.nn` (drop-in modules) and `overlap.hooks` (Megatron-core, torch TP). No init call:
a group's symmetric heap is created by its first call.

The Triton kernels are `overlap.kernels`, whose source is the repository's top-level ``kernels/`` folder (mapped
into this package by ``setup.py``); the C++/CUDA extension is `overlap._C`, built from ``csrc/``.

``import overlap`` is cheap: it sets up the ``overlap`` logger (`overlap.logs`) and nothing else; every name above is
imported when first used (PEP 562 `__getattr__`), so ``overlap --help`` never loads torch.

Where no GPU exists and the user has not set ``TRITON_INTERPRET``, `overlap` sets it to 1 so that the
``fused`` strategy's Triton kernels run interpreted on CPU ranks: at ``import overlap`` where torch is
already imported, else when a module of `overlap` that uses torch is first imported (`overlap.world`,
which they all import first, and `overlap.kernels`), always before Triton is imported by `overlap`
(`envs.set_triton_interpret`). Triton reads the variable when a kernel is
defined, so this also affects Triton kernels defined afterwards.
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys

from . import envs as _envs
from . import logs as _logs
from .version import __version__ as __version__

_logs.configure()  # the ``overlap`` logger: OVERLAP_LOG's level, lines with the rank

if "torch" in _sys.modules:  # torch is loaded already: costs nothing now, and covers Triton kernels defined next
    _envs.set_triton_interpret()

#: public name -> (module, attribute or None for the module itself), imported on first use
_LAZY: dict[str, tuple[str, str | None]] = {
    "all_gather_matmul": (".ops.tp.all_gather_matmul", "all_gather_matmul"),
    "quantize_fp8": (".ops.fp8", "quantize_fp8"),
    "Fp8Recipe": (".ops.fp8_recipe", "Fp8Recipe"),
    "fp8_matmul": (".ops.fp8_matmul", "fp8_matmul"),
    "matmul_reduce_scatter": (".ops.tp.matmul_reduce_scatter", "matmul_reduce_scatter"),
    "matmul_all_reduce": (".ops.tp.matmul_all_reduce", "matmul_all_reduce"),
    "all_gather_weight_matmul": (".ops.tp.all_gather_weight_matmul", "all_gather_weight_matmul"),
    "matmul_all_to_all": (".ops.sp.matmul_all_to_all", "matmul_all_to_all"),
    "all_to_all_matmul": (".ops.sp.all_to_all_matmul", "all_to_all_matmul"),
    "moe": (".moe", None),
    "nn": (".nn", None),
    "hooks": (".hooks", None),
    "Plan": (".plans", "Plan"),
    "PlanFile": (".plans", "PlanFile"),
    "STRATEGIES": (".plans", "STRATEGIES"),
    "reserve": (".symm", "reserve"),
    "release": (".symm", "release"),
    "OverlapError": (".errors", "OverlapError"),
    "OverlapMismatchError": (".errors", "OverlapMismatchError"),
    "OverlapTimeout": (".errors", "OverlapTimeout"),
}

__all__ = sorted(_LAZY)

#: the package's submodules, also imported on first use as attributes (``overlap.world.LINK_CLASSES`` after a bare
#: ``import overlap``, as when the package imported them all)
_SUBMODULES = ("benchmarks", "cli", "comm", "envs", "errors", "kernels", "lazy", "links", "logs", "ops", "plans",
               "pool", "progress", "shm", "signals", "symm", "tune", "version", "workloads", "world")


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = _importlib.import_module(f".{name}", __name__)
        globals()[name] = value
        return value
    if name not in _LAZY:
        raise AttributeError(f"module 'overlap' has no attribute {name!r}")
    module, attr = _LAZY[name]
    if module != ".errors":
        _envs.set_triton_interpret()  # before anything that may define a Triton kernel
    mod = _importlib.import_module(module, __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
