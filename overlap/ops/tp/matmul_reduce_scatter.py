"""matmul_reduce_scatter: ``reduce_scatter(a @ b, dim=0)`` (sum), with the scatter hidden behind the GEMM.

Problem. In a row-parallel layer with sequence parallelism every rank holds ``a_[W*m]K`` (all rows,
its slice ``K`` of the inner dim) and the matching row shard ``b_KN`` of the weight; rank ``d``
needs rows ``d*m ... (d+1)*m`` of ``sum_r a_r @ b_r``. Multiplying first and reduce-scattering after
leaves the links idle during the GEMM and the GEMM idle during the transfer. Each destination's
block of rows is its own GEMM, so the partial for one destination can travel while the next is
computed.

Strategies: `overlap.ops.tp.scatter_gemm` (``reference``, ``pipelined``, ``symm``, ``fused``, and
``hierarchical`` across nodes), which the input gradient of `all_gather_matmul` runs too.

Autograd (Megatron's convention): the scatter's backward is an all-gather of the output gradient:
``grad_a = all_gather(g) @ b.T`` is computed by `overlap.ops.tp.gather_gemm` with the forward's plan (the
gather hidden behind its chunk GEMMs), and ``grad_b = a.T @ all_gather(g)`` takes the same gathered
rows, in one GEMM so that it rounds exactly like the unfused weight gradient (``a`` is saved, as
Megatron saves the layer input).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` are only read; the output is a new tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...plans import Plan
from .. import library
from ..context import describe, no_autocast, record
from . import entry, gather_gemm, scatter_gemm

OP = "matmul_reduce_scatter"


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """``reduce_scatter(a @ b, dim=0)`` (sum) over `group`, overlapping the scatter with the GEMM.

    Args:
        a: ``[M, ..., k]``: every row, this rank's slice ``k`` of the inner dim (a row-parallel
            layer's input). ``M`` (dim 0, the sequence of ``[s, b, h]``) must divide by the world size.
        b: ``[k, n]``, this rank's rows of the weight, any strides (``w[n, k]`` is passed as ``w.t()``).
        group, strategy, plan, timeout: as for `overlap.all_gather_matmul`.

    Returns:
        ``[M / world_size, ..., n]``: rows ``r*M/W ... (r+1)*M/W - 1`` of ``sum over ranks of a @ b``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, ``M`` not divisible by the world
            size, plan), on this rank before any data moves; peers raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    return entry.tp_call(_op, OP, a, b, group, strategy, plan, timeout, check=_check_rows)


def _check_rows(a: torch.Tensor, b: torch.Tensor, info) -> None:
    if a.shape[0] % info.world_size:
        raise ValueError(f"overlap.{OP}: dim 0 of a ({a.shape[0]}, from a={describe(a)}) must divide by the "
                         f"world size {info.world_size}; pad the sequence (overlap does not pad silently)")


def _forward(a, b, group, strategy, plan, timeout, needs_grad):
    """``overlap::matmul_reduce_scatter``: the whole call (checks, plan, handshake, strategy) on this rank."""
    cc = entry.tp_context(OP, a, b, group, strategy, plan, timeout, needs_grad, _check_rows)
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        out = scatter_gemm.run(a2, b, cc).view(a.shape[0] // cc.world_size, *a.shape[1:-1], b.shape[1])
    return out, library.context_out(cc, needs_grad)


def _fake(a, b, group, strategy, plan, timeout, needs_grad):
    out = a.new_empty((a.shape[0] // library.world_size(group), *a.shape[1:-1], b.shape[-1]))
    return out, library.context_fake(needs_grad)


def _backward(grad_out, a, b, context, need_a, need_b):
    """``overlap::matmul_reduce_scatter_backward``: ``(grad_a, grad_b)`` in the forward's call context."""
    cc = library.kept(context, f"{OP}.backward")
    k, n = b.shape
    g2 = grad_out.reshape(-1, n).contiguous()
    a2 = a.reshape(-1, k)
    op = f"{OP}.backward"
    cc = cc.derive(op=op, signature=f"{op}(g={describe(g2)}, a={describe(a)}, b={tuple(b.shape)}, "
                                    f"grads={int(need_a)}{int(need_b)}, plan={cc.plan.describe()})")
    with record(op), no_autocast(cc.info.device.type):
        out2, gathered = gather_gemm.run(g2, b.t() if need_a else None, cc, keep_gathered=need_b)
        # One GEMM over every gathered row: it rounds exactly as the unfused weight gradient does.
        grad_b = torch.mm(a2.t(), gathered) if need_b else None
    return library.grads_out(out2.view(a.shape) if need_a else None, grad_b, a, b)


_backward_op = library.define(f"{OP}_backward", entry.TP_BACKWARD_SCHEMA, _backward, entry.tp_backward_fake)
_op = library.define(OP, entry.TP_SCHEMA, _forward, _fake, entry.tp_backward(_backward_op), entry.tp_save)
