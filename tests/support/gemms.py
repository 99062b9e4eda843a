"""The GEMMs a piece of code runs, in order, as torch's profiler records them: which kernel, on what shapes, strides and
dtypes.

Two computations that run the same GEMMs on the same shapes in the same order, and sum their results in
the same order, give bitwise the same numbers on every CPU (whatever its ISA or BLAS path picks, it picks it
for both). Two that run different GEMMs may agree on one CPU and differ by a rounding on another. A test that
asserts bitwise equality of two strategies therefore asserts equal `gemm_calls` first: that fails on any CPU
when the strategies' paths part, where the bitwise comparison alone fails only on some.

The profiler sees inside the custom ops (their GEMMs run inside ``overlap::<op>``) and the backward's (on CPU
the autograd engine runs on the calling thread). Calls are listed per thread in start order, so GEMMs of two
threads cannot interleave differently from run to run.
"""

from __future__ import annotations

import torch

GEMM_KERNELS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv",
                          "aten::_grouped_mm", "aten::_scaled_mm"})
"""The aten ops that call a GEMM library directly (no aten op inside them)."""
GEMM_OPS = GEMM_KERNELS | {"aten::matmul", "aten::linear", "aten::einsum"}
"""`GEMM_KERNELS` and the composites that reach them."""


def gemm_calls(fn) -> list[tuple[int, str, list, list, list]]:
    """``[(thread, op, input dims, input strides, input dtypes), ...]`` of every GEMM `fn` runs (``thread``:
    the profiler's thread id, the calls of each thread in start order); ops nested in another (``aten::matmul``
    calls ``aten::mm``) are listed each. Strides are listed because a transposed operand takes another BLAS
    path than a contiguous one."""
    from overlap.demo.memory import trace_events

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = sorted((e for e in trace_events(prof) if e.get("ph") == "X" and e.get("name") in GEMM_OPS),
                    key=lambda e: (e["tid"], e["ts"]))
    return [(e["tid"], e["name"], e["args"].get("Input Dims"), e["args"].get("Input Strides"),
             e["args"].get("Input type")) for e in events]
