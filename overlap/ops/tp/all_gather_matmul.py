"""all_gather_matmul: ``all_gather(a, dim) @ b``, with the gather hidden behind the GEMM; one gather may feed
several weights (q/k/v, gate/up).

Problem. In a column-parallel layer with sequence parallelism every rank holds ``a_MK`` (its
slice of the sequence) and a column shard ``b_KN`` of the weight; the layer needs
``[a_0; a_1; ...; a_{W-1}] @ b``. Gathering first and multiplying after leaves the GEMM idle
during the gather. Each rank's block of output rows only needs that rank's chunk, so the GEMM
can start on the local chunk at once and take every peer's chunk as it arrives.

Strategies: `overlap.ops.tp.gather_gemm` (``reference``, ``pipelined``, ``symm``, ``fused``, and
``hierarchical`` across nodes), which the input gradient of `matmul_reduce_scatter` runs too.

Autograd (Megatron's convention): ``grad_a = reduce_scatter(grad_out @ b.T)`` (sum),
``grad_b = all_gather(a).T @ grad_out`` for this rank's own shard ``b``. Like Megatron's sequence
parallelism, only the local shard is saved and it is gathered again in backward. ``reference``
does exactly that with plain collectives (the gather in flight during the input-gradient GEMM, the
reduce-scatter during the weight-gradient GEMM). The other strategies overlap both: the gather of
``a`` is posted first (`overlap.ops.tp.gather`; ``fused`` gathers as ``symm`` does), the input
gradient is computed by `overlap.ops.tp.scatter_gemm` with the forward's plan (its own transfers hidden
behind its GEMMs) while the gather flies, then the weight gradient is one GEMM over the gathered
rows (so it rounds exactly like the unfused one).

fp8 gradients (a recipe with ``grads``, ``fp8="rowwise+grads"``: `overlap.ops.fp8_recipe`): the backward's GEMMs
follow `overlap.ops.fp8_matmul.grad_gemm`. Each partial of the input gradient is an fp8 GEMM ``g @ b.T`` (``g``
per row, ``b.T`` per column, quantized along ``n`` to the recipe's gradient dtype) into float32; the float32
partials are reduce-scattered by the same strategies (summed in their fixed rank order) and cast once to ``a``'s
dtype. ``a`` is gathered again in its own dtype, as without fp8, and ``grad_b = grad_gemm(a_full.T, g)`` (quantized
along the gathered rows). ``fused``'s kernel multiplies e4m3 operands only: e5m2 (``tensorwise``) gradients are
multiplied by torch and copied as ``symm`` does, under the same heap protocol.

Batch-first code gathers another dim (``gather_dim=1`` of ``[b, s, h]``): every rank's rows land in place in
the output, in runs (`overlap.ops.tp.rows`); no transpose, no copy of the whole tensor. Several weights: each
gathered chunk is multiplied by every weight as it arrives (``fused``: one kernel launch per weight); backward
sums every output's input gradient into one reduce-scatter (and the gradient of a returned gathered input).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` may alias each other and any other tensor (they are only read); the output is
a new tensor. A rank's shard is copied into the heap, so ``a`` may be modified once the call returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ...plans import Plan
from .. import library
from ..context import CallContext, autocast_inputs, describe, no_autocast, record
from ..fp8 import Fp8Args
from ..fp8_matmul import grad_gemm
from ..fp8_recipe import Fp8Recipe, recipe_of
from . import entry, gather, gather_gemm, operands, scatter_gemm
from .rows import Product, normalize_dim, of, resized

OP = "all_gather_matmul"
DIM = "gather_dim"


def all_gather_matmul(
    a: torch.Tensor,
    b: torch.Tensor | list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
    *,
    gather_dim: int = 0,
    return_gathered: bool = False,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | list[torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    fp8: str | None = None,
) -> Any:
    """``all_gather(a, gather_dim) @ b`` over `group`, overlapping the gather with the GEMM.

    Args:
        a: ``[..., m, ..., k]``, this rank's slice of `gather_dim` (the sequence: dim 0 of Megatron's ``[s, b, h]``,
            dim 1 of batch-first ``[b, s, h]``).
        b: ``[k, n]``, any strides (a weight ``w[n, k]`` is passed as ``w.t()``), or a list of them (one ``k`` and
            dtype, any ``n``: q, k and v of grouped-query attention): every gathered chunk is read once for all.
        group: process group (default: the world); every rank of it must make the same call.
        strategy: ``"auto"`` (default), ``"reference"``, ``"pipelined"``, ``"symm"``, ``"fused"`` or ``"hierarchical"``.
        plan: an `overlap.Plan` (overrides `strategy`'s defaults, e.g. chunk counts).
        timeout: seconds any wait on a peer may take (default ``OVERLAP_TIMEOUT_S``, 300).
        gather_dim: the dim of `a` that is gathered, any but the last (negative counts from the end).
        return_gathered: also return the gathered ``a`` (a caller that keeps it for its own weight gradient; not
            with fp8).
        a_scale, b_scale: fp8 operands (``a`` and ``b`` ``torch.float8_e4m3fn``, `overlap.quantize_fp8`): ``a``'s
            float32 scale, ``a.shape[:-1] + (1,)`` (rowwise: it travels with its rows) or one element (tensorwise),
            and ``b``'s, ``[1, n]`` or one element (a list of them where `b` is a list). The op computes
            ``all_gather(a * a_scale) @ (b * b_scale)`` with scaled GEMMs, forward only.
        out_dtype: the result's dtype with fp8 operands (default ``torch.bfloat16``).
        fp8: ``"rowwise"``, ``"tensorwise"`` or ``"mxfp8"``, or an `overlap.Fp8Recipe`: the fp8 training recipe on
            high-precision operands (quantized on their owner, so the gather moves fp8 bytes; forward GEMMs scaled;
            backward in the operands' dtype, as without it, or with ``grads=True`` (``"rowwise+grads"``) fp8 GEMMs:
            docs/fp8.md). The result has `a`'s dtype.

    Returns:
        ``y``: `a`'s shape with ``world_size * m`` at `gather_dim` and ``n`` last, rank r's slice at
        ``r*m ... (r+1)*m - 1`` of `gather_dim`; a list of them where `b` is a list; ``(a_full, y)`` with
        `return_gathered`.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, plan, an empty list of weights), on this
            rank before any data moves; peers already in the call raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, gather_dim, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    many = isinstance(b, (list, tuple))
    weights = list(b) if many else [b]
    check = _check_flag(return_gathered, fp8 is not None or a_scale is not None)
    call = entry.TpCall(OP, group, strategy, plan, timeout, check, gather_dim, DIM, multi=True)
    args, scaled = entry.call_args(call, a, weights, fp8=(a_scale, b_scale, out_dtype, fp8))
    if not isinstance(return_gathered, bool) or (return_gathered and (scaled.a_scale is not None or scaled.recipe)):
        # (call_args let it through: the op's check raises it, peers told)
        entry.prepare(call, a, b, scaled=scaled)
    a, *weights = autocast_inputs(a, *weights)
    ys, full, _ = _op(a, weights, gather_dim, return_gathered, *args, library.needs_grad(a, *weights), scaled.a_scale,
                      list(scaled.b_scales) or None, scaled.out_dtype, scaled.recipe)
    ys = list(ys) if many else ys[0]
    return (full, ys) if return_gathered else ys


def _check_flag(return_gathered: Any, fp8: bool = False):
    def check(a, b, info) -> None:
        if not isinstance(return_gathered, bool):
            raise TypeError(f"overlap.{OP}: return_gathered must be a bool, got {type(return_gathered).__name__}")
        if return_gathered and fp8:
            raise ValueError(f"overlap.{OP}: return_gathered is not supported with fp8 (the gather moves fp8 rows)")

    return check


def _weights(bs: list[torch.Tensor]) -> Any:
    """`bs` as the preamble takes it: one weight alone (the signature of a call with one tensor)."""
    return bs[0] if len(bs) == 1 else bs


def _forward(a, bs, dim, keep, group, strategy, plan, timeout, needs_grad, a_scale=None, b_scales=None,
             out_dtype=None, fp8=""):
    """``overlap::all_gather_matmul``: the whole call (checks, plan, handshake, strategy) on this rank."""
    scaled = Fp8Args(a_scale, tuple(b_scales or ()), out_dtype, fp8)
    check = _check_flag(keep, bool(fp8 or a_scale is not None))
    call = entry.TpCall(OP, group, strategy, plan, timeout, check, dim, DIM, multi=True)
    cc = entry.tp_context(call, a, _weights(bs), needs_grad, scaled)
    d = normalize_dim(OP, DIM, dim, a.shape)
    W = cc.world_size
    # The handshake comes first (in `run`): nothing that can fail locally runs before the data.
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        act = operands.activation(a2, scaled)
        weights = bs
        if act is not None:  # fp8: the rows move packed with their scales, the GEMMs are scaled
            b8s, b_scales = operands.weights(bs, scaled)
            weights = operands.Weights(b8s, b_scales, entry.out_dtype_of(a, scaled))
            a2 = weights.packed.pack(*act)
        outs, gathered = gather_gemm.run(a2, weights, cc, keep_gathered=keep, rows=of(a.shape, d, W, scatter=False))
        shape = resized(a.shape, d, W * a.shape[d])
        ys = [out.view(*shape[:-1], b.shape[1]) for out, b in zip(outs, bs, strict=True)]
        full = gathered.view(shape) if keep else a.new_empty(0)
    return ys, full, library.context_out(cc, needs_grad)


def _fake(a, bs, dim, keep, group, strategy, plan, timeout, needs_grad, a_scale=None, b_scales=None,
          out_dtype=None, fp8=""):
    W = library.world_size(group)
    try:
        shape = resized(a.shape, normalize_dim(OP, DIM, dim, a.shape), W * a.shape[dim])
    except (TypeError, ValueError):  # (the op raises it, on every rank, when it runs)
        shape = a.shape
    dtype = entry.out_dtype_of(a, Fp8Args(a_scale, (), out_dtype, fp8))
    ys = [a.new_empty((*shape[:-1], b.shape[-1]), dtype=dtype) for b in bs]
    return ys, a.new_empty(shape if keep else (0,)), library.context_fake(needs_grad)


def _save(ctx: Any, inputs: tuple, output: Any) -> None:
    a, bs, dim, keep, *_ = inputs
    ctx.save_for_backward(a, *bs, output[2])
    ctx.dim, ctx.keep, ctx.need_b = normalize_dim(OP, DIM, dim, a.shape), keep, [b.requires_grad for b in bs]
    ctx.shapes = [y.shape for y in output[0]]
    ctx.fp8 = inputs[-1]  # (the recipe's text: its backward runs in fp8 with ``+grads``)
    ctx.rest = len(inputs) - 2
    ctx.set_materialize_grads(False)  # (an unused gathered input: no gradient of zeros to add in backward)


def _autograd_backward(ctx: Any, grads: list, grad_full: torch.Tensor | None, _grad_context: Any):
    a, *bs, context = ctx.saved_tensors
    need_a = ctx.needs_input_grad[0]
    need_b = ctx.need_b
    grads = [g if g is not None else a.new_zeros(shape) for g, shape in zip(grads, ctx.shapes, strict=True)]
    full = grad_full if ctx.keep and grad_full is not None else a.new_empty(0)
    grad_a, grad_bs = _backward_op(grads, full, a, bs, context, ctx.dim, need_a, need_b, ctx.fp8)
    return (grad_a if need_a else None, [g if need else None for g, need in zip(grad_bs, need_b, strict=True)],
            *(None,) * ctx.rest)


def _backward(grads, grad_full, a, bs, context, dim, need_a, need_b, fp8=""):
    """``overlap::all_gather_matmul_backward``: ``(grad_a, grad_bs)`` in the forward's call context; `fp8`: the
    forward's recipe (its text), whose backward GEMMs run in fp8 where it has ``+grads``."""
    cc = library.kept(context, f"{OP}.backward").derive(op=f"{OP}.backward")
    W, k = cc.world_size, a.shape[-1]
    recipe = _grad_recipe(fp8)
    ro = of(a.shape, dim, W, scatter=False)
    g2s = [g.reshape(-1, b.shape[1]).contiguous() for g, b in zip(grads, bs, strict=True)]
    extra = grad_full.reshape(-1, k).contiguous() if grad_full.numel() else None
    assert recipe is None or extra is None  # (return_gathered is refused with fp8)
    prod = None
    if need_a:
        prod = Product([(g2, b.t()) if recipe is None else operands.grad_operands(g2, b.t(), recipe)
                        for g2, b in zip(g2s, bs, strict=True)], ro, extra)
    with no_autocast(cc.info.device.type):
        run = _reference_backward if cc.plan.strategy == "reference" else _overlapped_backward
        grad_a, full = run(cc, a, prod, any(need_b), ro)
    # One GEMM over every gathered row: it rounds exactly as the unfused weight gradient does.
    grad_bs = [(torch.mm(full.t(), g2) if recipe is None else grad_gemm(full.t(), g2, recipe, grad="y").to(b.dtype))
               if need else b.new_empty(0) for g2, b, need in zip(g2s, bs, need_b, strict=True)]
    if grad_a is None:
        return a.new_empty(0), grad_bs
    return grad_a.to(a.dtype).view(a.shape), grad_bs  # (fp8 gradients: float32 sums, rounded once here)


def _grad_recipe(fp8: str) -> Fp8Recipe | None:
    """The forward's recipe where its backward runs in fp8 (``+grads``), else None."""
    recipe = recipe_of(OP, fp8)
    return recipe if recipe is not None and recipe.grads else None


def _backward_fake(grads, grad_full, a, bs, context, dim, need_a, need_b, fp8=""):
    return (a.new_empty(a.shape if need_a else (0,)),
            [b.new_empty(b.shape if need else (0,)) for b, need in zip(bs, need_b, strict=True)])


BACKWARD_SCHEMA = ("(Tensor[] grads, Tensor grad_full, Tensor a, Tensor[] bs, Tensor context, int dim, bool need_a, "
                   "bool[] need_b, str fp8) -> (Tensor, Tensor[])")
SCHEMA = ("(Tensor a, Tensor[] bs, int dim, bool keep, str group, str strategy, str plan, float? timeout, "
          "bool needs_grad, Tensor? a_scale, Tensor[]? b_scales, ScalarType? out_dtype, str fp8) "
          "-> (Tensor[], Tensor, Tensor)")
_backward_op = library.define(f"{OP}_backward", BACKWARD_SCHEMA, _backward, _backward_fake)
_op = library.define(OP, SCHEMA, _forward, _fake, _autograd_backward, _save)


def _reference_backward(cc: CallContext, a, prod: Product | None, need_b: bool, rows):
    """Megatron's sequence-parallel backward with plain collectives (the baseline): the gather of ``a`` in flight
    while the input gradient's GEMMs run and its reduce-scatter is posted. Returns ``(grad_a2, gathered a)``."""
    k = a.shape[-1]
    cc = cc.derive(signature=f"{cc.op}(a={describe(a)}, grads={int(prod is not None)}{int(need_b)}, "
                             f"{_terms(prod)}, reference)")
    call = cc.begin(plain=True)
    a2 = a.reshape(-1, k).contiguous()
    grad_a = full = g = None
    with record(cc.op):
        try:
            if need_b:
                g = gather.start("reference", call, a2, cc, rows=rows)
            if prod is not None:
                grad_a, works, _partial = scatter_gemm.post_reference(cc, prod)
            if need_b:
                for _ in g.chunks():
                    pass
                full = g.gathered()
            if prod is not None:
                for work in works:
                    cc.wait(work, "any", "reduce_scatter of grad_a")
        finally:
            if g is not None:
                g.close()
            call.finish()
    return grad_a, full


def _terms(prod: Product | None) -> str:
    """The input gradient's terms in a backward's signature (ranks must agree on them)."""
    if prod is None:
        return "terms=0"
    return f"terms={[tuple(b.shape) for _, b in prod.pairs]}+{int(prod.extra is not None)}, rows={prod.rows}"


def _overlapped_backward(cc: CallContext, a, prod: Product | None, need_b: bool, rows):
    """The gather of ``a`` in flight while `matmul_reduce_scatter`'s strategies compute grad_a; then the gathered
    rows for the weight gradients (one GEMM each over every row: they round exactly as the unfused ones do)."""
    chosen = cc.plan
    k = a.shape[-1]
    a2 = a.reshape(-1, k).contiguous()
    kind = "symm" if chosen.strategy == "fused" else chosen.strategy
    grad_a = full = None
    gathered = None
    with record(cc.op):
        try:
            if need_b:
                gather_cc = cc.derive(signature=f"{cc.op}.gather(a={describe(a)}, rows={rows}, "
                                                f"plan={chosen.describe()})")
                # The heap cannot grow while this gather is in flight: size it for grad_a's call too.
                need = gather.heap_bytes(kind, a2)
                if prod is not None:
                    need = max(need, scatter_gemm.heap_bytes(chosen, prod.m, prod.n, prod.dtype, cc.world_size))
                gather_call = gather_cc.begin(need, steady=kind in ("symm", "pipelined"),
                                              in_data=kind == "hierarchical")
                gathered = gather.start(kind, gather_call, a2, gather_cc, need=need, rows=rows)
            if prod is not None:
                grad_cc = cc.derive(signature=f"{cc.op}.grad_a(a={describe(a)}, {_terms(prod)}, "
                                              f"plan={chosen.describe()})")
                if chosen.strategy == "fused" and not all(operands.kernel_takes(g) for g in prod.gemms):
                    # The kernel takes e4m3 operands only: e5m2 gradients are multiplied by torch and copied as
                    # ``symm`` does, under the same heap protocol (the same slot bytes).
                    grad_cc = grad_cc.derive(plan=dataclasses.replace(chosen, strategy="symm"))
                grad_a = scatter_gemm.run(prod, grad_cc)
            if need_b:
                for _ in gathered.chunks():  # arrived during grad_a's GEMMs, most of it
                    pass
                full = gathered.gathered()
        finally:
            if gathered is not None:
                gathered.close()
    return grad_a, full
