"""Triton device code of `overlap`, installed as ``overlap.kernels``.

Kernels take peer-pointer tables and flag pointers, so the same code runs on GPUs and,
interpreted (``TRITON_INTERPRET=1``, set by `overlap` where no GPU exists), on CPU ranks
over POSIX shared memory. `compat` adapts the supported Triton versions (applied here, first).
"""

from .compat import fix_interpreter_index

fix_interpreter_index()

from .ag_matmul import all_gather_matmul_kernel  # noqa: E402
from .mm_rs import matmul_scatter_kernel, reduce_chunks_kernel  # noqa: E402
from .moe import grouped_matmul_scatter_kernel, grouped_matmul_wait_kernel  # noqa: E402

__all__ = [
    "all_gather_matmul_kernel",
    "grouped_matmul_scatter_kernel",
    "grouped_matmul_wait_kernel",
    "matmul_scatter_kernel",
    "reduce_chunks_kernel",
]
