"""The tensor-parallel ops as the op table (`optable`) describes them for a plan: which links each strategy
chunks for, and the cost of one call. One function of each kind per op; `optable` assembles them into entries.

Shapes are a `Problem`'s ``m x k x n``: every rank's GEMM is ``[W*m, k] @ [k, n]``.

* ``all_gather_matmul``: ``a`` ``[m, k]`` per rank (sharded on rows), ``b`` ``[k, n]``, out ``[W*m, n]``;
* ``matmul_reduce_scatter``: ``a`` ``[W*m, k]``, ``b`` ``[k, n]`` (the rank's slice of the reduction), out
  ``[m, n]``: this rank's rows of the sum over ranks;
* ``matmul_all_reduce``: as matmul_reduce_scatter, out ``[W*m, n]``: the whole sum, replicated;
* ``all_gather_weight_matmul`` (the weight-side gather of FSDP): ``a`` ``[m, k]`` per rank (its own data),
  ``b`` ``[k, n]`` this rank's block of the weight's columns, out ``[m, W*n]`` = ``a @ cat_q(b_q, dim=1)``.

Inputs, oracles and the plain collectives of these ops: `overlap.workloads.tp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the cost model imports this module)
    from .costmodel import Schedule
    from .optable import Problem

# ----------------------------------------------------------------------------------------------
# Which links a strategy chunks for (`Plan.num_chunks` entries it reads), forward and backward
# ----------------------------------------------------------------------------------------------


def _pairwise(topology) -> tuple[str, ...]:
    return tuple(c for c, _ in topology.links)  # each peer's transfer chunked for the link to it


def chunked_all_gather_matmul(strategy: str, backward: bool, topology) -> tuple[str, ...]:
    if strategy == "reference":
        return ()
    # fused forward: one flag per rank (its backward's reduce-scatter reads pairwise chunks)
    return _pairwise(topology) if strategy in ("pipelined", "symm", "hierarchical") or backward else ()


def chunked_matmul_reduce_scatter(strategy: str, backward: bool, topology) -> tuple[str, ...]:
    if strategy == "reference":
        return ()
    if strategy in ("pipelined", "hierarchical") or (strategy == "symm" and backward):  # (the backward's gather)
        return _pairwise(topology)
    return (topology.slowest_link,)  # flagged chunks of one reduction


def chunked_all_gather_weight_matmul(strategy: str, backward: bool, topology) -> tuple[str, ...]:
    if strategy == "reference" or (strategy == "fused" and not backward):  # fused: one flag per shard
        return ()
    links = _pairwise(topology)  # each peer's shard pulled or exchanged in chunks for the link to it
    if backward and strategy != "pipelined":  # grad_b's flagged reduce-scatter: the slowest link's count
        links = tuple(dict.fromkeys((*links, topology.slowest_link)))
    return links


def chunked_matmul_all_reduce(strategy: str, backward: bool, topology) -> tuple[str, ...]:
    if strategy == "hierarchical":  # node copies and network transfers, each chunked for its link
        return _pairwise(topology)
    return () if strategy == "reference" else (topology.slowest_link,)


# ----------------------------------------------------------------------------------------------
# Costs: each drives the cost model's pipelines (`costmodel.Schedule`) for one call
# ----------------------------------------------------------------------------------------------


def cost_all_gather_matmul(x: Schedule, p: Problem) -> None:
    x.ag_mm(p.m, p.k, p.n)
    if p.backward:  # re-gather a (posted first) beside grad_a = matmul_reduce_scatter, then grad_b
        x.backward()
        x.mm_rs(p.m, p.n, p.k, lead=x.gather_again(p.m, p.k))
        x.serial(gemm=x.weight_gradient(p.m, p.k, p.n))


def cost_matmul_reduce_scatter(x: Schedule, p: Problem) -> None:
    x.mm_rs(p.m, p.k, p.n)
    if p.backward:  # grad_a = all_gather_matmul(grad_out, b.T), then grad_b over the same rows
        x.backward()
        x.ag_mm(p.m, p.n, p.k)
        x.serial(gemm=x.weight_gradient(p.m, p.k, p.n))


def cost_all_gather_weight_matmul(x: Schedule, p: Problem) -> None:
    # The gathered operand is the weight ([n, k] per peer), the GEMM per peer shard [m, k] @ [k, n]:
    # all_gather_matmul's pipeline with the roles of m and n swapped.
    x.ag_mm(p.n, p.k, p.m)
    if p.backward:  # re-gather the weight (posted first) beside grad_b = reduce_scatter(g.T @ a), then grad_a
        x.backward()
        x.mm_rs(p.n, p.m, p.k, lead=x.gather_again(p.n, p.k))
        x.serial(gemm=x.weight_gradient(p.m, p.k, p.n))


def cost_matmul_all_reduce(x: Schedule, p: Problem) -> None:
    x.mm_ar(p.m, p.k, p.n)
    if p.backward:  # the gradient passes through: two local GEMMs
        x.serial(gemm=2 * x.weight_gradient(p.m, p.k, p.n))
