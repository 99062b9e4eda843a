"""Where a rank's rows sit when the gathered (or scattered) dim is not the first: `Rows`, the dim's checks
(`of`), and the GEMM of a scatter's destination block over that layout (`Product`).

The TP ops see an activation as rows ``[..., k]`` flattened to ``[M, k]``. Gathering dim 0 of ``[s, b, h]`` puts
rank ``p``'s rows in one run, ``p*m ... (p+1)*m``. Gathering dim ``d`` of any other shape (``[b, s, h]`` with the
sequence on dim 1) interleaves them: with ``outer = prod(shape[:d])`` blocks of ``rows = shape[d] *
prod(shape[d+1:-1])`` rows per rank, rank ``p``'s local row ``f`` is row ``(f // rows) * W * rows + p * rows + f %
rows`` of the gathered tensor. `Rows.split` cuts any run of a rank's rows into the contiguous runs it lands in,
so every strategy copies and multiplies whole row runs straight into the output (no transpose, no copy of the
whole tensor). ``outer == 1`` (dim 0, or a batch of one) is the single run of today's layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from .operands import Gemm


@dataclasses.dataclass(frozen=True)
class Rows:
    """The layout of a gathered tensor ``[outer * world * rows, k]`` (flattened): `outer` blocks, each holding
    every rank's `rows` rows in rank order."""

    outer: int
    world: int
    rows: int

    @classmethod
    def flat(cls, world: int, rows: int) -> Rows:
        """Rank ``p``'s rows in one run (dim 0)."""
        return cls(1, world, rows)

    @property
    def m(self) -> int:
        """Rows of one rank."""
        return self.outer * self.rows

    def split(self, p: int, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """Rank `p`'s rows ``lo ... hi`` as ``(lo, hi, full_lo, full_hi)`` runs: local rows and where they are in
        the gathered tensor."""
        runs = []
        while lo < hi:
            o, f = divmod(lo, self.rows)
            end = min(hi, (o + 1) * self.rows)
            at = (o * self.world + p) * self.rows + f
            runs.append((lo, end, at, at + end - lo))
            lo = end
        return runs

    def block(self, o: int) -> tuple[int, int]:
        """Rows of outer block `o` in the gathered tensor."""
        span = self.world * self.rows
        return o * span, (o + 1) * span


def normalize_dim(op: str, name: str, dim, shape: Sequence[int]) -> int:
    """`dim` (an int, may be negative) of an activation of `shape`, any dim but the last."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"overlap.{op}: {name} must be an int, got {type(dim).__name__}")
    nd = len(shape)
    d = dim + nd if dim < 0 else dim
    if not 0 <= d < nd - 1:
        raise ValueError(f"overlap.{op}: {name}={dim} is out of range for an activation of shape {tuple(shape)}: "
                         f"any dim but the last (the inner dim k), from {-nd} to {nd - 2} except -1")
    return d


def of(shape: Sequence[int], dim: int, world: int, scatter: bool) -> Rows:
    """The layout of an activation of `shape` gathered (this rank's shard) or scattered (every row: `shape`'s `dim`
    divides by `world`, checked by the op) along the normalized `dim`."""
    inner = math.prod(shape[dim + 1 : -1])
    per_rank = shape[dim] // world if scatter else shape[dim]
    return Rows(math.prod(shape[:dim]), world, per_rank * inner)


def resized(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    """`shape` with dim `dim` set to `size`."""
    return (*shape[:dim], size, *shape[dim + 1 :])


class Product:
    """``sum_i a_i @ b_i (+ extra)`` over rows laid out as `rows` (each ``a_i`` ``[outer*W*rows, k_i]``
    contiguous, ``extra`` ``[outer*W*rows, n]``): the partial sums a reduce-scatter sends, one destination block
    at a time. One pair and no extra (a plain ``matmul_reduce_scatter``) is one GEMM per run; more pairs (the
    input gradient of a gather that fed several weights) add into it, in pair order. A pair is ``(a, b)`` or a
    `overlap.ops.tp.operands.Gemm` (fp8: float32 partials)."""

    def __init__(self, pairs: Sequence[Gemm | tuple[torch.Tensor, torch.Tensor]], rows: Rows,
                 extra: torch.Tensor | None = None):
        self.gemms, self.rows, self.extra = [Gemm.of(p) for p in pairs], rows, extra
        self.pairs = [(g.a, g.b) for g in self.gemms]
        g0 = self.gemms[0]
        self.n, self.dtype, self.device = g0.n, g0.dtype, g0.device
        self.simple = len(self.pairs) == 1 and extra is None

    @property
    def m(self) -> int:
        """Rows of one destination's block."""
        return self.rows.m

    def into(self, d: int, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``lo ... hi`` of destination `d`'s block into `out` (``[hi - lo, n]``, contiguous); returns it."""
        for s_lo, s_hi, f_lo, f_hi in self.rows.split(d, lo, hi):
            piece = out[s_lo - lo : s_hi - lo]
            g0, *rest = self.gemms
            g0.into(f_lo, f_hi, piece)
            for g in rest:
                g.add_into(f_lo, f_hi, piece)
            if self.extra is not None:
                piece.add_(self.extra[f_lo:f_hi])
        return out

    def block(self, d: int) -> torch.Tensor:
        """Destination `d`'s whole block, a new ``[m, n]`` tensor."""
        return self.into(d, 0, self.m, torch.empty((self.m, self.n), dtype=self.dtype, device=self.device))

    def whole(self) -> torch.Tensor:
        """Every row, ``[outer*W*rows, n]``, in the gathered layout (one GEMM per pair)."""
        g0, *rest = self.gemms
        out = g0.whole()
        for g in rest:
            g.add_into(0, g.a.shape[0], out)
        if self.extra is not None:
            out.add_(self.extra)
        return out

    def outer_block(self, o: int) -> Product:
        """Outer block `o` alone, as a dim-0 product (`overlap.ops.tp.hierarchical_reduce` takes one at a time)."""
        lo, hi = self.rows.block(o)
        extra = self.extra[lo:hi] if self.extra is not None else None
        return Product([g.sliced(lo, hi) for g in self.gemms], Rows.flat(self.rows.world, self.rows.rows), extra)

    def only(self) -> Gemm:
        """The one pair of a simple product (the fused kernel's operands)."""
        assert self.simple
        return self.gemms[0]
