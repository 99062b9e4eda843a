"""Autocast: the ops and layers cast their operands as torch's matmul does, forward under autocast and backward
outside it (the usual training step), on CPU ranks with bfloat16.

An op under autocast must give what it gives on operands cast by hand, bitwise, gradients included (they flow
back through the casts to the fp32 leaves); a layer must run its forward and backward (no dtype mismatch
between the bf16 gradient and fp32 saved tensors) and match its fp32 self within bf16's tolerance.
"""

from __future__ import annotations

import pytest
import torch

BF16 = dict(rtol=1.6e-2, atol=1e-2)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def ops_task(rank, world_size, seed):
    import overlap

    g = torch.Generator().manual_seed(seed + rank)
    out = {}
    for name, rows in (("all_gather_matmul", 3), ("matmul_reduce_scatter", 3 * world_size),
                       ("matmul_all_reduce", 5)):
        op = getattr(overlap, name)
        a0, w0 = torch.randn(rows, 2, 8, generator=g), torch.randn(6, 8, generator=g)
        up = torch.randn(op(a0, w0.t(), strategy="reference").shape, generator=g)
        a, w = _leaf(a0), _leaf(w0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = op(a, w.t(), strategy="symm")
        y.float().backward(up)  # outside autocast
        a_ref, w_ref = _leaf(a0), _leaf(w0)
        y_ref = op(a_ref.bfloat16(), w_ref.bfloat16().t(), strategy="symm")
        y_ref.float().backward(up)
        out[name] = (y.dtype == torch.bfloat16, a.grad.dtype == torch.float32, torch.equal(y, y_ref),
                     torch.equal(a.grad, a_ref.grad), torch.equal(w.grad, w_ref.grad))
    return out


def layers_task(rank, world_size, seed):
    from torch import nn

    from overlap.nn import ColumnParallelLinear, RowParallelLinear

    out = {}
    for name, kw_col, kw_row, rows in (("replicated", {}, {}, 4), ("sequence_parallel", {"sequence_parallel": True},
                                                                      {"sequence_parallel": True}, 2)):
        torch.manual_seed(seed)
        model = nn.Sequential(ColumnParallelLinear(8, 6 * world_size, **kw_col), nn.GELU(),
                              RowParallelLinear(6 * world_size, 8, **kw_row))
        x = torch.randn(rows, 2, 8, generator=torch.Generator().manual_seed(seed + rank))
        grads = []
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = model(x)
            y.float().square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        dtypes_ok = all(gr.dtype == torch.float32 for gr in grads[1])
        err = None
        try:
            for g32, g16 in zip(grads[0], grads[1], strict=True):
                torch.testing.assert_close(g16, g32, rtol=5e-2, atol=5e-2)
        except AssertionError as exc:
            err = str(exc)[:300]
        out[name] = (dtypes_ok, err)
    return out


@pytest.mark.exact
def test_ops_cast_as_matmul_does(pools, seed):
    for rank, res in enumerate(pools(2).run(ops_task, seed)):
        for name, checks in res.items():
            assert all(checks), f"rank {rank} {name}: (bf16 out, fp32 grad, out, grad a, grad w) = {checks}"


def test_layers_forward_under_autocast_backward_outside(pools, seed):
    for rank, res in enumerate(pools(2).run(layers_task, seed)):
        for name, (dtypes_ok, err) in res.items():
            assert dtypes_ok and err is None, f"rank {rank} {name}: fp32 grads {dtypes_ok}, {err}"
