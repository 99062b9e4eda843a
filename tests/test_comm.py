"""Tier 1, the comm layer without ranks: how a chunked exchange splits rows (`overlap.comm.chunk_bounds`)."""

from __future__ import annotations

import pytest

from overlap import comm


@pytest.mark.parametrize("rows,chunks", [(1, 4), (7, 3), (12, 4), (5, 1), (3, 7)])
def test_chunk_bounds_cover_rows_exactly(rows, chunks):
    bounds = comm.chunk_bounds(rows, chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len(bounds) == min(rows, chunks)
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1
