"""The GEMMs a piece of code runs, in order, as torch's profiler records them: which kernel, on what shapes.

Two computations that run the same GEMMs on the same shapes in the same order, and sum their results in
the same order, give bitwise the same numbers on every CPU (whatever its ISA or BLAS path picks, it picks it
for both). Two that run different GEMMs may agree on one CPU and differ by a rounding on another. A test that
asserts bitwise equality of two strategies therefore asserts equal `gemm_calls` first: that fails on any CPU
when the strategies' paths part, where the bitwise comparison alone fails only on some.

The profiler sees inside the custom ops (their GEMMs run inside ``overlap::<op>``) and the backward's (on CPU
the autograd engine runs on the calling thread). Calls are listed per thread (torch's thread serial) in start
order, so GEMMs of two threads cannot interleave differently from run to run.
"""

from __future__ import annotations

import torch

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                      "aten::addmv", "aten::mv", "aten::_grouped_mm", "aten::_scaled_mm", "aten::einsum"})


def gemm_calls(fn) -> list[tuple[int, str, tuple]]:
    """``[(thread, op, input shapes), ...]`` of every GEMM `fn` runs (``thread``: torch's serial of the thread,
    the caller's first); ops nested in another (``aten::matmul`` calls ``aten::mm``) are listed each."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.name in GEMM_OPS), key=lambda e: (e.thread, e.time_range.start))
    return [(e.thread, e.name, _shapes(e.input_shapes)) for e in events]


def _shapes(shapes) -> tuple:
    return tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in shapes)
