"""``all_reduce_grad``: identity forward, the gradient summed over the group in backward.

Megatron's "copy to tensor-parallel region": a replicated input of a column-parallel layer (each rank's
gradient covers only its columns) or a bias that each rank added to its own rows only. The backward's
all-reduce is the custom op ``overlap::all_reduce`` (bounded wait, ordered like the other ops under
torch.compile); the forward is a view the compiler traces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm, envs
from . import library


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str, timeout: float | None, what: str):
        ctx.call_args = (group, timeout, what)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _op(grad, *ctx.call_args), None, None, None


def all_reduce_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None, timeout: float | None = None,
                    what: str = "all_reduce_grad") -> torch.Tensor:
    """`x` (a view); its gradient is the sum of every rank's over `group`. `what` names the caller in a
    timeout's message."""
    name = library.group_arg(group)
    if name is None:
        raise TypeError(f"{what}: group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return _AllReduceGrad.apply(x, name, timeout, what)


def _all_reduce(x: torch.Tensor, group: str, timeout: float | None, what: str) -> torch.Tensor:
    """``overlap::all_reduce``: the sum over the group, into a new tensor (never in place into a gradient
    someone else holds), with the call's deadline."""
    pg = library.group_of(group)
    out = x.contiguous().clone()
    work = dist.all_reduce(out, group=pg, async_op=True)
    comm.wait_work(work, what, dist.get_rank(pg), "any", "gradient all-reduce", envs.resolve_timeout(timeout),
                   out.device)
    return out


def _fake(x, group, timeout, what):
    return x.new_empty(x.shape)


_op = library.define("all_reduce", "(Tensor x, str group, float? timeout, str what) -> Tensor", _all_reduce, _fake)
