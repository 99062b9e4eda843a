"""What the kernels' launchers would compile on a Hopper GPU, found without one.

`recording()` puts a `Recorder` in place of every Triton kernel of ``overlap.kernels`` and makes the
launchers run as on a GPU (not interpreted). A launcher call then launches nothing: the recorder binds the
arguments the way Triton's own launch does (``create_function_from_signature``, for a CUDA sm_90 backend
that needs no driver) and keeps a `Launch`: the specialization key Triton would look its compiled
variant up by, and what `compile` needs to build that very variant ahead of time (signature, constexprs,
the divisibility attributes of the arguments, the options). Two launches with the same key share one
compilation; a key that changes with the epoch or the rank is a recompilation per call or per rank.

Works on Triton 3.6 and 3.9, in a process with or without ``TRITON_INTERPRET`` (interpreted kernels are
rebuilt as JIT functions with the same ``do_not_specialize`` lists). Used by tests/gpu/cpu/test_kernel_specialization.py
and tests/support/aot_compile.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
#: the modules of overlap.kernels with kernels, and their kernels
KERNELS = {
    "all_gather_matmul": ("all_gather_matmul_kernel",),
    "all_gather_weight_matmul": ("all_gather_weight_matmul_kernel",),
    "matmul_reduce_scatter": ("matmul_scatter_kernel", "reduce_chunks_kernel"),
    "dispatch_grouped_matmul": ("grouped_matmul_wait_kernel",),
    "grouped_matmul_combine": ("grouped_matmul_scatter_kernel",),
    "matmul_all_to_all": ("matmul_all_to_all_kernel", "gather_blocks_kernel"),
    "all_to_all_matmul": ("all_to_all_matmul_kernel",),
}


@dataclasses.dataclass
class Launch:
    """One recorded launch: the cache key, and the compile inputs of its variant."""

    kernel: str
    key: str
    grid: Any
    bound: dict[str, Any]  # the arguments by parameter name
    specialization: list  # (type, attribute) per parameter, as Triton's binder returns it
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: dict[str, Any]
    jit: JITFunction

    def spec_of(self, name: str) -> tuple:
        """The (type, attribute) Triton specialized parameter `name` to."""
        return tuple(self.specialization[[p.name for p in self.jit.params].index(name)])


def as_jit(kernel: Any) -> JITFunction:
    """`kernel` as a JIT function (an interpreted one is rebuilt from its function and decorator arguments)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **getattr(kernel, "kwargs", {}))


def run_options(jit: JITFunction, kwargs: dict) -> dict:
    """The keyword arguments as ``JITFunction.run`` completes them before it binds (3.6 and 3.9)."""
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kwargs


def specialize(jit: JITFunction, grid: Any, args: tuple, kwargs: dict, backend: CUDABackend = BACKEND) -> Launch:
    """The `Launch` of ``jit[grid](*args, **kwargs)`` on a GPU of `backend`'s target (default sm_90)."""
    kwargs = run_options(jit, kwargs)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    opts, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return Launch(jit.fn.__name__, key, grid, dict(bound), [tuple(s) for s in specialization], signature, constexprs,
                  attrs, dict(opts.__dict__), jit)


class Recorder:
    """Stands in for a kernel: ``recorder[grid](*args, **kwargs)`` records a `Launch` and runs nothing."""

    def __init__(self, kernel: Any, backend: CUDABackend = BACKEND):
        self.jit, self.backend = as_jit(kernel), backend
        self.launches: list[Launch] = []

    def __getitem__(self, grid: Any):
        def launch(*args, **kwargs) -> None:
            self.launches.append(specialize(self.jit, grid, args, kwargs, self.backend))

        return launch


@contextlib.contextmanager
def recording(backend: CUDABackend = BACKEND):
    """Every kernel of overlap.kernels replaced by a `Recorder` (for a GPU of `backend`'s target, default sm_90) and
    the launchers told they run on a GPU; yields the recorders by kernel name. Everything is put back on exit."""
    import importlib

    from overlap.kernels import host

    saved: list[tuple[Any, str, Any]] = [(host, "interpreted", host.interpreted)]
    recorders: dict[str, Recorder] = {}
    try:
        host.interpreted = lambda: False
        for module_name, names in KERNELS.items():
            module = importlib.import_module(f"overlap.kernels.{module_name}")
            for name in names:
                saved.append((module, name, getattr(module, name)))
                recorders[name] = Recorder(getattr(module, name), backend)
                setattr(module, name, recorders[name])
        yield recorders
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
