"""The sequence-parallel ops as the op table (`optable`) describes them for a plan: which links each strategy chunks
for, and the cost of one call. One function of each kind per op; `optable` assembles them into entries.

Shapes are a `Problem`'s ``m x k x n``: ``m`` rows of this rank's sequence shard, the projection ``[k, n]``.

* ``matmul_all_to_all``: ``x`` ``[m, k]`` per rank, ``w`` ``[k, n]`` (every head), out ``[W*m, n/W]``: this rank's
  heads for the whole sequence; each peer receives ``m x n/W`` of its product;
* ``all_to_all_matmul``: ``ctx`` ``[W*m, k/W]`` (this rank's heads, the whole sequence), ``w_o`` ``[k, n]``, out
  ``[m, n]``: this rank's sequence shard; each peer sends ``m x k/W``.

Inputs, oracles and the plain collectives of these ops: `overlap.workloads.sp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the cost model imports this module)
    from .costmodel import Schedule
    from .optable import Problem


def chunked(strategy: str, backward: bool, topology) -> tuple[str, ...]:
    """pipelined: each peer's block chunked for the link to it; symm: the slowest link's count (one chunking of the
    rows for every peer, flagged per chunk)."""
    if strategy == "pipelined":
        return tuple(c for c, _ in topology.links)
    return (topology.slowest_link,) if strategy in ("symm", "fused") else ()


def cost_matmul_all_to_all(x: Schedule, p: Problem) -> None:
    x.mm_a2a(p.m, p.k, p.n)
    if p.backward:  # grad_x = the reverse exchange met by w.T, then the weights' gradient over the gathered rows
        x.backward()
        x.a2a_mm(p.m, p.n, p.k)
        x.serial(gemm=x.mm(p.m, p.k, p.n))


def cost_all_to_all_matmul(x: Schedule, p: Problem) -> None:
    x.a2a_mm(p.m, p.k, p.n)
    if p.backward:  # grad_ctx = grad_out @ w_o.T sent per destination, then w_o's gradient over the gathered rows
        x.backward()
        x.mm_a2a(p.m, p.n, p.k)
        x.serial(gemm=x.mm(p.m, p.k, p.n))
