r"""The sequence-parallel ops' workloads: one rank's inputs for a `Problem`, the call, the oracle, the plain collectives
and the op in plain torch. One function of each kind per op; `overlap.workloads` assembles them into `Workload`\ s.

Shapes are a `Problem`'s ``m x k x n`` (`overlap.plans.sp_ops`), sequence-first 2-D operands, one head per rank (the
op splits columns by heads; one head of ``n/W`` columns per rank is the coarsest split, and any finer one moves the
same bytes):

* ``matmul_all_to_all``: ``a`` ``[m, k]`` (this rank's sequence shard), ``b`` ``[k, n]``, out ``[W*m, n/W]``;
* ``all_to_all_matmul``: ``a`` ``[W*m, k/W]`` (this rank's heads for the whole sequence), ``b`` ``[W*(k/W), n]``, out
  ``[m, n]``.

Inputs: standard normal, ``b`` scaled by ``1/sqrt(its rows)``; ``grad_out`` standard normal. The oracle computes this
rank's results from every rank's inputs (16-bit: each product in fp32, rounded once). Alone (`plain_*`): the
``all_to_all_single`` of the forward (and in fwd+bwd the backward's reverse one), and the GEMMs. The torch row
(`torch_*`): the projection, ``all_to_all_single``, the layout copies a user writes around it; backward through an
autograd `Function` with the reverse exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import comm
from ..ops.sp import all_to_all_matmul, matmul_all_to_all
from .data import Expected, OpInputs, Plain, SeededDraw


def _cols(n: int, W: int) -> int:
    return max(1, n // W)


def inputs_matmul_all_to_all(p, world_size: int, draw: SeededDraw) -> OpInputs:
    a = draw.normal("a", p.m, p.k)
    b = draw.normal("b", p.k, world_size * _cols(p.n, world_size), scale=p.k**-0.5, shared=True)
    g = draw.normal("grad_out", world_size * p.m, _cols(p.n, world_size)) if p.backward else None
    return OpInputs((a, b), g)


def inputs_all_to_all_matmul(p, world_size: int, draw: SeededDraw) -> OpInputs:
    c = _cols(p.k, world_size)
    a = draw.normal("a", world_size * p.m, c)
    b = draw.normal("b", world_size * c, p.n, scale=(world_size * c) ** -0.5, shared=True)
    g = draw.normal("grad_out", p.m, p.n) if p.backward else None
    return OpInputs((a, b), g)


def call_matmul_all_to_all(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    return matmul_all_to_all.matmul_all_to_all(*inputs.leaves, heads=dist.get_world_size(group), group=group,
                                               **kwargs)


def call_all_to_all_matmul(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    return all_to_all_matmul.all_to_all_matmul(*inputs.leaves, group=group, **kwargs)


def _mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` with fp32 sums, in `x`'s dtype (the oracle's products)."""
    return (x.float() @ y.float()).to(x.dtype) if x.dtype in (torch.float16, torch.bfloat16) else x @ y


def oracle_matmul_all_to_all(p, every: list[OpInputs], rank: int) -> list[Expected]:
    W, (a, b) = len(every), every[rank].leaves
    c = b.shape[1] // W
    mine = slice(rank * c, (rank + 1) * c)
    expected = [Expected("out", torch.cat([_mm(e.leaves[0], b[:, mine]) for e in every]), p.k)]
    if p.backward:  # the gradient of this rank's rows, every rank's heads
        g = torch.cat([e.grad_out[rank * p.m : (rank + 1) * p.m] for e in every], dim=1)
        expected += [Expected("grad_a", _mm(g, b.t()), b.shape[1]), Expected("grad_b", _mm(a.t(), g), p.m)]
    return expected


def oracle_all_to_all_matmul(p, every: list[OpInputs], rank: int) -> list[Expected]:
    a, b = every[rank].leaves
    c = a.shape[1]
    rows = slice(rank * p.m, (rank + 1) * p.m)
    gathered = torch.cat([e.leaves[0][rows] for e in every], dim=1)  # every rank's heads of this rank's shard
    expected = [Expected("out", _mm(gathered, b), b.shape[0])]
    if p.backward:
        mine = b[rank * c : (rank + 1) * c]
        grad_a = torch.cat([_mm(e.grad_out, mine.t()) for e in every])
        expected += [Expected("grad_a", grad_a, p.n), Expected("grad_b", _mm(gathered.t(), every[rank].grad_out), p.m)]
    return expected


def _a2a(out: torch.Tensor, inp: torch.Tensor, group, info, timeout: float) -> None:
    comm.wait_work(comm.all_to_all_async(out, inp, group), "bench all_to_all", info.rank, "any", "all", timeout,
                   info.device)


def _plain(p, every: list[OpInputs], rank: int, group, info, timeout: float, comm_bytes: int, rows: int,
           cols: int) -> Plain:
    """The forward's ``all_to_all_single`` of ``W`` blocks of ``rows x cols`` (and the backward's reverse one), and
    the op's GEMMs: ``a @ b`` and, in fwd+bwd, ``g @ b.T`` and ``a.T @ g`` on the layouts the op multiplies."""
    W, (a, b) = len(every), every[rank].leaves
    sent = a.new_zeros((W * rows, cols))  # zeros: values that stay put
    got = torch.zeros_like(sent)
    a2 = a if a.shape[1] == b.shape[0] else a.new_zeros((rows, b.shape[0]))  # (the output side: gathered rows)
    g = a2.new_zeros((a2.shape[0], b.shape[1])) if p.backward else None

    def comm_fn() -> None:
        _a2a(got, sent, group, info, timeout)
        if p.backward:
            _a2a(sent, got, group, info, timeout)

    def compute() -> None:
        torch.mm(a2, b)
        if p.backward:
            torch.mm(g, b.t())
            torch.mm(a2.t(), g)

    return Plain(comm_fn, compute, "(all_to_all alone)" if not p.backward else "(comm alone)",
                 "(GEMMs alone)" if p.backward else "(GEMM alone)", comm_bytes)


def plain_matmul_all_to_all(p, every, rank, group, info, timeout, comm_bytes) -> Plain:
    return _plain(p, every, rank, group, info, timeout, comm_bytes, p.m, every[rank].leaves[1].shape[1] // len(every))


def plain_all_to_all_matmul(p, every, rank, group, info, timeout, comm_bytes) -> Plain:
    return _plain(p, every, rank, group, info, timeout, comm_bytes, p.m, every[rank].leaves[0].shape[1])


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` of `x`'s ``W`` blocks of rows (plain torch, its own timeout)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _heads_to_rows(y: torch.Tensor, W: int) -> torch.Tensor:
    """``[m, W*c]`` -> ``[W*m, c]``: destination ``d``'s columns as block ``d`` (the copy a user writes)."""
    m = y.shape[0]
    return y.view(m, W, -1).transpose(0, 1).reshape(W * m, -1)


def _rows_to_heads(x: torch.Tensor, W: int) -> torch.Tensor:
    """``[W*m, c]`` -> ``[m, W*c]``: source ``s``'s block as columns ``s``."""
    return x.view(W, -1, x.shape[1]).transpose(0, 1).reshape(x.shape[0] // W, -1)


class _ToHeads(torch.autograd.Function):
    """``all_to_all`` of a projection's columns to their heads' ranks; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(_heads_to_rows(y, dist.get_world_size(group)), group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _rows_to_heads(_exchange(g, ctx.group), dist.get_world_size(ctx.group)), None


class _ToRows(torch.autograd.Function):
    """``all_to_all`` of every head's rows back to their sequence shard; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _rows_to_heads(_exchange(x, group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _exchange(_heads_to_rows(g, dist.get_world_size(ctx.group)), ctx.group), None


def torch_matmul_all_to_all(group, routing=None, num_experts: int = 0) -> Callable[..., torch.Tensor]:
    """``a @ b`` then ``all_to_all_single`` to the heads' ranks."""
    return lambda a, b: _ToHeads.apply(torch.matmul(a, b), group)


def torch_all_to_all_matmul(group, routing=None, num_experts: int = 0) -> Callable[..., torch.Tensor]:
    """``all_to_all_single`` back to the sequence shard, then ``@ b``."""
    return lambda a, b: torch.matmul(_ToRows.apply(a, group), b)
