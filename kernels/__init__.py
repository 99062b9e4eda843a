"""Triton device code of `overlap`, installed as ``overlap.kernels``.

One kernel file per op that has a fused form, named as the op (`all_gather_matmul`, `matmul_reduce_scatter`, whose
kernels `matmul_all_reduce` runs too, `all_gather_weight_matmul`, `dispatch_grouped_matmul`,
`grouped_matmul_combine`); `flags` holds the device-side waits and releases they share. Kernels take
peer-pointer tables and flag pointers, so the same code runs on GPUs and, interpreted (``TRITON_INTERPRET=1``,
set by `overlap` where no GPU exists), on CPU ranks over POSIX shared memory. Beside each kernel is its host
launcher (``launch_*``: checks the arguments, allocates what belongs to the launch, computes the grid,
launches); the ops and the GPU check call the launchers, never a kernel directly. What the launchers share: `host`;
`compat` adapts the supported Triton versions (applied here, before any kernel is defined).
"""

from overlap import envs as _envs

_envs.set_triton_interpret()  # where no GPU exists: before Triton is imported and any kernel below defined

from .compat import fix_interpreter_index

fix_interpreter_index()

# ruff: noqa: E402  (the kernels below are defined after the fix)

from .all_gather_matmul import all_gather_matmul_grid, all_gather_matmul_kernel, launch_all_gather_matmul
from .all_gather_weight_matmul import (
    all_gather_weight_matmul_grid,
    all_gather_weight_matmul_kernel,
    launch_all_gather_weight_matmul,
)
from .dispatch_grouped_matmul import grouped_matmul_wait_kernel, launch_grouped_matmul_wait
from .grouped_matmul_combine import grouped_matmul_scatter_kernel, launch_grouped_matmul_scatter
from .host import Watchdog, epoch_word, grouped_matmul_grid
from .matmul_reduce_scatter import (
    chunk_count,
    launch_matmul_scatter,
    launch_reduce_chunks,
    matmul_scatter_grid,
    matmul_scatter_kernel,
    reduce_chunks_grid,
    reduce_chunks_kernel,
)

__all__ = [
    "Watchdog",
    "all_gather_matmul_grid",
    "all_gather_matmul_kernel",
    "all_gather_weight_matmul_grid",
    "all_gather_weight_matmul_kernel",
    "chunk_count",
    "epoch_word",
    "grouped_matmul_grid",
    "grouped_matmul_scatter_kernel",
    "grouped_matmul_wait_kernel",
    "launch_all_gather_matmul",
    "launch_all_gather_weight_matmul",
    "launch_grouped_matmul_scatter",
    "launch_grouped_matmul_wait",
    "launch_matmul_scatter",
    "launch_reduce_chunks",
    "matmul_scatter_grid",
    "matmul_scatter_kernel",
    "reduce_chunks_grid",
    "reduce_chunks_kernel",
]
