"""The supported Triton versions' interpreters run the project's kernels: `overlap.kernels.compat`.

On Triton 3.6 with numpy >= 2.4 a loaded value used as a loop bound or index failed in the interpreter
("only 0-dimensional arrays can be converted to Python scalars"); the CI leg of that stack (`.ci/run`)
runs this file there, and the interpreted ``fused`` tests, which index with loaded counts throughout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from overlap.kernels import compat

import overlap  # noqa: F401  (sets TRITON_INTERPRET=1 where no GPU exists)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter (no GPU here)")


@triton.jit
def _count(n_ptr, out_ptr):
    n = tl.load(n_ptr)  # a one-element tensor used as a Python index: its __index__
    acc = 0
    for _ in range(n):
        acc += 1
    tl.store(out_ptr, acc)


@pytest.mark.parametrize("n", [0, 1, 7])
def test_a_loaded_value_bounds_a_loop(n):
    counts, out = torch.tensor([n], dtype=torch.int32), torch.full((1,), -1, dtype=torch.int32)
    _count[(1,)](counts, out)
    assert out.item() == n, (triton.__version__, np.__version__, out)


def test_the_fix_applies_where_needed_and_only_there():
    below = compat._version() < compat.UNSQUEEZED_INDEX_BELOW
    assert compat.fix_interpreter_index() is below, (triton.__version__, compat._version())
    assert compat.fix_interpreter_index() is below  # idempotent: installed once


def test_versions_parse():
    for text, want in (("3.6.0", (3, 6)), ("3.9.0+git1234", (3, 9)), ("3.10.1rc1", (3, 10))):
        triton_version, triton.__version__ = triton.__version__, text
        try:
            assert compat._version() == want
        finally:
            triton.__version__ = triton_version
