"""matmul_reduce_scatter: ``reduce_scatter(a @ b, dim)`` (sum), with the scatter hidden behind the GEMM.

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

fp8 gradients (a recipe with ``grads``, ``fp8="rowwise+grads"``: `overlap.ops.fp8_recipe`): the output gradient is
gathered in its own dtype, as without fp8, and the backward's GEMMs follow `overlap.ops.fp8_matmul.grad_gemm`:
``grad_a = grad_gemm(g_full, b.T)`` chunk by chunk as the gathered rows land (``b.T`` quantized along ``n`` once,
each chunk of ``g`` along ``n`` as it arrives, float32 products rounded once to ``a``'s dtype; ``tensorwise``: one
scale per gathered chunk, since the whole tensor's amax is known only once every chunk is there, and a finer scale
is never less precise), then ``grad_b = grad_gemm(a.T, g_full)`` over every gathered row. ``fused``'s kernel
multiplies the rows of peers' buffers as they are, unquantized: with fp8 gradients the chunks are multiplied by
torch as they land, the gather being ``symm``'s under the same heap protocol.

Batch-first code scatters another dim (``scatter_dim=1`` of ``[b, s, h]``): each destination's rows are runs of
``a`` (`overlap.ops.tp.rows`), multiplied in place; the backward's gather lands in the same runs.

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` are only read; the output is a new tensor.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ...plans import Plan
from .. import library
from ..context import describe, no_autocast, record
from ..fp8 import MX_BLOCK, OPERAND_DTYPE, Fp8Args, quantize_fp8, quantize_weight, scaled_mm
from ..fp8_matmul import grad_gemm
from ..fp8_recipe import Fp8Recipe, recipe_of
from . import entry, gather_gemm, operands, scatter_gemm
from .rows import Product, normalize_dim, of, resized

OP = "matmul_reduce_scatter"
DIM = "scatter_dim"


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
    *,
    scatter_dim: int = 0,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """``reduce_scatter(a @ b, scatter_dim)`` (sum) over `group`, overlapping the scatter with the GEMM.

    Args:
        a: ``[..., M, ..., k]``: every row, this rank's slice ``k`` of the inner dim (a row-parallel
            layer's input). ``M`` (`scatter_dim`, the sequence) must divide by the world size.
        b: ``[k, n]``, this rank's rows of the weight, any strides (``w[n, k]`` is passed as ``w.t()``).
        group, strategy, plan, timeout: as for `overlap.all_gather_matmul`.
        scatter_dim: the dim of the product that is scattered, any but the last (dim 0 of ``[s, b, h]``, dim 1
            of batch-first ``[b, s, h]``; negative counts from the end).
        a_scale, b_scale, out_dtype, fp8: as for `overlap.all_gather_matmul` (fp8 operands: forward-only; the
            partial sums and their reduction are float32; a recipe with ``grads``: fp8 backward GEMMs).

    Returns:
        `a`'s shape with ``M / world_size`` at `scatter_dim` and ``n`` last: slice ``r*M/W ... (r+1)*M/W - 1``
        of ``sum over ranks of a @ b``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, ``M`` not divisible by the world
            size, plan), on this rank before any data moves; peers raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, scatter_dim, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    call = entry.TpCall(OP, group, strategy, plan, timeout, _check_rows(scatter_dim), scatter_dim, DIM)
    return entry.tp_call(_op, call, a, b, fp8=(a_scale, b_scale, out_dtype, fp8))


def _check_rows(dim: int):
    def check(a: torch.Tensor, b: torch.Tensor, info) -> None:
        d = normalize_dim(OP, DIM, dim, a.shape)
        if a.shape[d] % info.world_size:
            raise ValueError(f"overlap.{OP}: dim {d} of a ({a.shape[d]}, from a={describe(a)}, scatter_dim={dim}) "
                             f"must divide by the world size {info.world_size}; pad the sequence (overlap does not "
                             "pad silently)")

    return check


def _forward(a, b, dim, group, strategy, plan, timeout, needs_grad, a_scale=None, b_scale=None, out_dtype=None,
             fp8=""):
    """``overlap::matmul_reduce_scatter``: the whole call (checks, plan, handshake, strategy) on this rank."""
    scaled = Fp8Args(a_scale, () if b_scale is None else (b_scale,), out_dtype, fp8)
    cc = entry.tp_context(entry.TpCall(OP, group, strategy, plan, timeout, _check_rows(dim), dim, DIM), a, b,
                          needs_grad, scaled)
    d = normalize_dim(OP, DIM, dim, a.shape)
    W = cc.world_size
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        out = scatter_gemm.run(Product([operands.gemm(a2, b, scaled)], of(a.shape, d, W, scatter=True)), cc)
        out = out.view(*resized(a.shape, d, a.shape[d] // W)[:-1], b.shape[1])
    return out.to(entry.out_dtype_of(a, scaled)), library.context_out(cc, needs_grad)


def _fake(a, b, dim, group, strategy, plan, timeout, needs_grad, a_scale=None, b_scale=None, out_dtype=None,
          fp8=""):
    try:
        d = normalize_dim(OP, DIM, dim, a.shape)
    except (TypeError, ValueError):  # (the op raises it, on every rank, when it runs)
        d = 0
    shape = resized(a.shape, d, a.shape[d] // library.world_size(group))
    dtype = entry.out_dtype_of(a, Fp8Args(a_scale, (), out_dtype, fp8))
    return a.new_empty((*shape[:-1], b.shape[-1]), dtype=dtype), library.context_fake(needs_grad)


def _save(ctx, inputs: tuple, output) -> None:
    entry.tp_save(ctx, inputs, output)
    a, _b, dim, *_ = inputs
    ctx.extra = (normalize_dim(OP, DIM, dim, a.shape), inputs[-1])  # (the recipe's text: fp8 backward with +grads)


def _backward(grad_out, a, b, context, need_a, need_b, dim, fp8=""):
    """``overlap::matmul_reduce_scatter_backward``: ``(grad_a, grad_b)`` in the forward's call context; `fp8`: the
    forward's recipe (its text), whose backward GEMMs run in fp8 where it has ``+grads``."""
    cc = library.kept(context, f"{OP}.backward")
    recipe = _grad_recipe(fp8)
    k, n = b.shape
    g2 = grad_out.reshape(-1, n).contiguous()
    a2 = a.reshape(-1, k)
    op = f"{OP}.backward"
    dim_sig = f", {DIM}={dim}" if dim else ""
    cc = cc.derive(op=op, signature=f"{op}(g={describe(g2)}, a={describe(a)}, b={tuple(b.shape)}{dim_sig}, "
                                    f"grads={int(need_a)}{int(need_b)}, plan={cc.plan.describe()})")
    rows = of(grad_out.shape, dim, cc.world_size, scatter=False)
    weights = [b.t()] if need_a else []
    if recipe is not None and need_a:
        weights = _GradWeights(b.t(), recipe)
        if cc.plan.strategy == "fused":  # (module docstring: the kernel cannot quantize what it loads)
            cc = cc.derive(plan=dataclasses.replace(cc.plan, strategy="symm"))
    with record(op), no_autocast(cc.info.device.type):
        outs, gathered = gather_gemm.run(g2, weights, cc, keep_gathered=need_b, rows=rows)
        # One GEMM over every gathered row: it rounds exactly as the unfused weight gradient does.
        grad_b = None
        if need_b:
            grad_b = (torch.mm(a2.t(), gathered) if recipe is None
                      else grad_gemm(a2.t(), gathered, recipe, grad="y").to(b.dtype))
    grad_a = outs[0].to(a.dtype).view(a.shape) if need_a else None  # (fp8 gradients: float32, rounded once here)
    return library.grads_out(grad_a, grad_b, a, b)


def _grad_recipe(fp8: str) -> Fp8Recipe | None:
    """The forward's recipe where its backward runs in fp8 (``+grads``), else None."""
    recipe = recipe_of(OP, fp8)
    return recipe if recipe is not None and recipe.grads else None


class _GradWeights(operands.Weights):
    """``b.T`` ``[n, k]`` for ``grad_a = all_gather(g) @ b.T`` with fp8 gradients (`grad_gemm`'s convention, chunk by
    chunk): ``b.T`` quantized along ``n`` once (e4m3), each gathered chunk of ``g`` along ``n`` as it lands (the
    gradient format), float32
    products (MX with ``n`` not a multiple of 32: the float32 product)."""

    def __init__(self, bt: torch.Tensor, recipe: Fp8Recipe):
        super().__init__([bt])
        self.granularity, self.dtype = recipe.granularity, recipe.grad_dtype
        self.in_float32 = self.granularity == "mxfp8" and bt.shape[0] % MX_BLOCK != 0
        self.right = (bt.float(), None) if self.in_float32 else quantize_weight(bt, self.granularity, OPERAND_DTYPE)

    def outputs(self, rows: int, like: torch.Tensor) -> list[torch.Tensor]:
        return [torch.empty((rows, self.bs[0].shape[1]), dtype=torch.float32, device=like.device)]

    def multiply(self, chunk: torch.Tensor, outs: list[torch.Tensor], lo: int, hi: int) -> None:
        b, b_scale = self.right
        if self.in_float32:
            torch.mm(chunk.float(), b, out=outs[0][lo:hi])
            return
        x8, x_scale = quantize_fp8(chunk, self.granularity, self.dtype)
        scaled_mm(x8, b, x_scale, b_scale, torch.float32, out=outs[0][lo:hi])


SCHEMA = ("(Tensor a, Tensor b, int dim, str group, str strategy, str plan, float? timeout, bool needs_grad, "
          f"{entry.FP8_SCHEMA}) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad, Tensor a, Tensor b, Tensor context, bool need_a, bool need_b, int dim, str fp8) "
                   "-> (Tensor, Tensor)")
_backward_op = library.define(f"{OP}_backward", BACKWARD_SCHEMA, _backward, entry.tp_backward_fake)
_op = library.define(OP, SCHEMA, _forward, _fake, entry.tp_backward(_backward_op), _save)
