"""The collectives of `overlap.nn`'s linear layers that meet no GEMM, each one small autograd function.

Where a collective meets a GEMM the layers call the ops (`overlap.all_gather_matmul`,
`overlap.matmul_reduce_scatter`, `overlap.matmul_all_reduce`). What is left is here, so that each can
later be swapped for a traceable op without touching the layers:

* `AllReduceInBackward`: identity forward, the gradient summed over the group in backward. The
  column-parallel layer without sequence parallelism puts it on its (replicated) input; the
  row-parallel layer with sequence parallelism puts it on its (replicated) bias, whose rows are
  split over the ranks.
* `GatherLastDim`: all-gather along the last dim forward (``gather_output=True``), this rank's
  slice of the gradient backward.
* `SplitLastDim`: this rank's slice of the last dim forward (``input_is_parallel=False``), an
  all-gather of the gradient along it backward.

`overlap.hooks.megatron`'s layers use the last two as well. Every wait is deadlined
(`overlap.comm.wait_work`) and names the layer that waited.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm, envs


def _wait(work, group, what: str, timeout: float | None, device: torch.device) -> None:
    comm.wait_work(work, what, dist.get_rank(group), "all", "all", envs.resolve_timeout(timeout), device)


def _all_gather_last_dim(x: torch.Tensor, group, timeout: float | None, what: str) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))  # rank q's tensor at rows q*len ...
    _wait(comm.all_gather_async(out, x, group), group, what, timeout, x.device)
    return torch.cat(out.chunk(world_size, dim=0), dim=-1)


def _own_last_dim_slice(x: torch.Tensor, group) -> torch.Tensor:
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    size = x.shape[-1] // world_size
    return x[..., rank * size : (rank + 1) * size].contiguous()


class AllReduceInBackward(torch.autograd.Function):
    """``apply(x, group, timeout, what)``: ``x`` forward; backward: the gradient summed over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, timeout: float | None, what: str) -> torch.Tensor:
        ctx.group, ctx.timeout, ctx.what = group, timeout, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # never reduce in place into a gradient someone else holds
        work = dist.all_reduce(grad, group=ctx.group, async_op=True)
        _wait(work, ctx.group, ctx.what, ctx.timeout, grad.device)
        return grad, None, None, None


class GatherLastDim(torch.autograd.Function):
    """``apply(x, group, timeout, what)``: every rank's `x` side by side along the last dim (rank order);
    backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, timeout: float | None, what: str) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last_dim(x, group, timeout, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_last_dim_slice(grad, ctx.group), None, None, None


class SplitLastDim(torch.autograd.Function):
    """``apply(x, group, timeout, what)``: this rank's slice of the last dim; backward: the gradient
    all-gathered along it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, timeout: float | None, what: str) -> torch.Tensor:
        ctx.group, ctx.timeout, ctx.what = group, timeout, what
        return _own_last_dim_slice(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_last_dim(grad, ctx.group, ctx.timeout, ctx.what), None, None, None
