"""The MoE layer as the op table (`optable`) describes it for a plan: which links each strategy chunks for, and
the cost of one call (op ``moe``: ``overlap.moe.dispatch_grouped_matmul``, gelu, ``grouped_matmul_combine``).
Its inputs, oracle and plain all-to-alls: `overlap.workloads.moe`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the cost model imports this module)
    from .costmodel import Schedule
    from .optable import Problem


def chunked(strategy: str, backward: bool, topology) -> tuple[str, ...]:
    """pipelined: each peer's rows chunked for the link to it; symm/fused: one chunk per expert group;
    hierarchical: the transfers between nodes chunked for the network (the node's copies one per area)."""
    if strategy == "hierarchical":
        return ("network",)
    return tuple(c for c, _ in topology.links) if strategy == "pipelined" else ()


def cost(x: Schedule, p: Problem) -> None:
    x.moe(p)
