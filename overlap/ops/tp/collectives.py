"""The collectives of the layers that meet no GEMM: each a custom op under a small autograd function.

Where a collective meets a GEMM the layers call the fused ops. What is left is here, for `overlap.nn`,
`overlap.hooks.megatron` and `overlap.hooks.torch_tp` alike:

* `all_reduce_grad`: identity forward, the gradient summed over the group in backward (Megatron's "copy to
  tensor-parallel region"): the replicated input of a column-parallel layer without sequence parallelism,
  or a bias each rank added to its own rows only.
* `gather_last_dim`: every rank's tensor side by side along the last dim, in rank order (a column-parallel
  layer's ``gather_output``); backward: this rank's slice of the gradient.
* `split_last_dim`: this rank's slice of the last dim (a row-parallel layer's ``input_is_parallel=False``);
  backward: the gradient gathered along it.
* `linear_all_reduce_dgrad`: ``x @ w.T`` with a replicated input; backward all-reduces the input gradient
  while the weight-gradient GEMM runs (Megatron's column-parallel layer without sequence parallelism).

The transfers are the custom ops ``overlap::all_reduce`` and ``overlap::all_gather_last_dim`` (bounded waits
naming the layer that waited; ordered like the other ops under torch.compile); the slicing around them is
plain torch code the compiler traces. Groups travel as their names, so the autograd functions trace too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm, envs
from .. import library
from ..context import autocast_inputs


def all_reduce_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None, timeout: float | None = None,
                    what: str = "all_reduce_grad") -> torch.Tensor:
    """`x` (a view); its gradient is the sum of every rank's over `group`. `what` names the caller in a
    timeout's message."""
    return _AllReduceGrad.apply(x, _name(group, what), timeout, what)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None = None, timeout: float | None = None,
                    what: str = "gather_last_dim") -> torch.Tensor:
    """Every rank's `x` side by side along the last dim (rank order); backward: this rank's slice."""
    return _GatherLastDim.apply(x, _name(group, what), timeout, what, _where(group))


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None = None, timeout: float | None = None,
                   what: str = "split_last_dim") -> torch.Tensor:
    """This rank's slice of the last dim of `x` (which divides by the group's size); backward: the gradient
    gathered along it."""
    return _SplitLastDim.apply(x, _name(group, what), timeout, what, _where(group))


def linear_all_reduce_dgrad(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None = None,
                            timeout: float | None = None, what: str = "linear_all_reduce_dgrad") -> torch.Tensor:
    """``x @ weight.T``; backward: ``grad_x`` summed over `group` (in flight during the weight-gradient GEMM).
    Under autocast both operands are cast first (torch's rule for matmul), so forward and backward agree."""
    x, weight = autocast_inputs(x, weight)
    return _LinearAllReduceDgrad.apply(x, weight, _name(group, what), timeout, what)


def _name(group, what: str) -> str:
    name = library.group_arg(group)
    if name is None:
        raise TypeError(f"{what}: group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return name


def _where(group) -> tuple[int, int]:
    """``(rank, world size)`` in `group` (read where the compiler folds them to constants)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _own_slice(x: torch.Tensor, where: tuple[int, int]) -> torch.Tensor:
    rank, world_size = where
    size = x.shape[-1] // world_size
    return x[..., rank * size : (rank + 1) * size].contiguous()


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, timeout: float | None, what: str):
        ctx.call_args = (group, timeout, what)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_op(grad, *ctx.call_args), None, None, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, timeout: float | None, what: str, where: tuple[int, int]):
        ctx.where = where
        return _gather_op(x, group, timeout, what)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.where), None, None, None, None


class _SplitLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, timeout: float | None, what: str, where: tuple[int, int]):
        ctx.call_args = (group, timeout, what)
        return _own_slice(x, where)

    @staticmethod
    def backward(ctx, grad):
        return _gather_op(grad, *ctx.call_args), None, None, None, None


class _LinearAllReduceDgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group: str, timeout: float | None, what: str):
        ctx.save_for_backward(x, weight)
        ctx.call_args = (group, timeout, what)
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _dgrad_op(grad_out, x, weight, *ctx.call_args, ctx.needs_input_grad[1])
        return grad_x, grad_w if ctx.needs_input_grad[1] else None, None, None, None


# ----------------------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------------------


def _wait(work, pg, what: str, timeout: float | None, device: torch.device) -> None:
    comm.wait_work(work, what, dist.get_rank(pg), "any", "all", envs.resolve_timeout(timeout), device)


def _all_reduce(x: torch.Tensor, group: str, timeout: float | None, what: str) -> torch.Tensor:
    """``overlap::all_reduce``: the sum over the group into a new tensor (never in place into a gradient
    someone else holds)."""
    pg = library.group_of(group)
    out = x.contiguous().clone()
    _wait(dist.all_reduce(out, group=pg, async_op=True), pg, what, timeout, out.device)
    return out


def _all_gather_last_dim(x: torch.Tensor, group: str, timeout: float | None, what: str) -> torch.Tensor:
    """``overlap::all_gather_last_dim``: every rank's `x` side by side along the last dim, in rank order."""
    pg = library.group_of(group)
    world_size = dist.get_world_size(pg)
    x = x.contiguous()
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))  # rank q's tensor at rows q*len ...
    _wait(comm.all_gather_async(out, x, pg), pg, what, timeout, x.device)
    return torch.cat(out.chunk(world_size, dim=0), dim=-1)


def _linear_dgrad(grad_out, x, weight, group: str, timeout: float | None, what: str, need_w: bool):
    """``overlap::linear_all_reduce_dgrad``: ``(sum over ranks of grad_out @ w, grad_out.T @ x)``, the
    all-reduce in flight while the weight gradient is computed (0 elements where it is not needed)."""
    pg = library.group_of(group)
    with torch.autocast(grad_out.device.type, enabled=False):  # the operands are in the forward's dtype
        grad_out = grad_out.to(weight.dtype)
        grad_x = grad_out.matmul(weight)
        work = dist.all_reduce(grad_x, group=pg, async_op=True)
        grad_w = weight.new_empty(0)
        if need_w:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        _wait(work, pg, what, timeout, grad_x.device)
    return grad_x, grad_w


def _linear_dgrad_fake(grad_out, x, weight, group, timeout, what, need_w):
    return (grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1])),
            weight.new_empty(weight.shape if need_w else (0,)))


def _same_shape(x, group, timeout, what):
    return x.new_empty(x.shape)


def _gathered_shape(x, group, timeout, what):
    return x.new_empty((*x.shape[:-1], library.world_size(group) * x.shape[-1]))


_SCHEMA = "(Tensor x, str group, float? timeout, str what) -> Tensor"
_all_reduce_op = library.define("all_reduce", _SCHEMA, _all_reduce, _same_shape)
_gather_op = library.define("all_gather_last_dim", _SCHEMA, _all_gather_last_dim, _gathered_shape)
_dgrad_op = library.define(
    "linear_all_reduce_dgrad",
    "(Tensor grad_out, Tensor x, Tensor weight, str group, float? timeout, str what, bool need_w) -> (Tensor, Tensor)",
    _linear_dgrad, _linear_dgrad_fake)
