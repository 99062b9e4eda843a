"""all_gather_weight_matmul: ``a @ all_gather(b_shard, dim=1)``, the weight-side gather hidden behind the GEMM.

Problem. Fully sharded data parallelism (ZeRO-3, torch FSDP2) keeps each layer's weight sharded over the
ranks and gathers it before the GEMM that uses it; every rank has its own input ``a`` (data parallel, not
gathered). Gathering first leaves the GEMM idle during the gather and holds the whole weight. Each block
of output columns needs only one rank's shard, so the GEMM can start on the local shard at once and take
every peer's shard as it arrives; a block whose GEMMs have run is no longer needed.

Shapes: ``a`` ``[m, ..., k]``; ``b_shard`` ``[k, n]``, this rank's block of columns of the whole
``[k, W*n]`` (a weight ``w[W*n, k]`` sharded by rows is passed as ``w_shard.t()``); the result is
``[m, ..., W*n]``, rank ``p``'s block at columns ``p*n ... (p+1)*n``. Every rank's ``a`` and ``b_shard``
have the same shapes (the values of ``a`` differ): a difference raises `OverlapMismatchError` (a
ValueError) on every rank before any data moves.

Strategies (same results; `reference` is the oracle):

* ``reference``: ``all_gather_into_tensor`` of the shard (the whole weight), then one GEMM.
* ``pipelined``: a pairwise exchange of the shards (`overlap.ops.tp.gather`, step i: receive from ``rank+i``,
  send to ``rank-i``), each in ``num_chunks[link]`` pieces, all posted at once; the local block's GEMM runs
  while they fly, then each piece's columns as soon as it is received. Any backend, any topology.
* ``symm``: the shard is copied into the symmetric heap once and flagged; a copy engine streams every
  peer's shard through a two-shard local ring (`overlap.ops.tp.shard_ring`), the GEMMs of one shard running
  while the next is pulled: no whole-size weight outside the heap. Ranks of one node.
* ``fused``: one Triton kernel (`overlap.kernels.all_gather_weight_matmul`): tiles of output columns wait on the
  flag of the shard they read and load it straight from the owner's symmetric buffer, the tiles of one
  shard scheduled together, this rank's first: the whole weight is never materialized. Ranks of one node;
  on CPU ranks it runs interpreted (correct, slow: for tests at small sizes). Its backward is ``symm``'s.

Each peer's shard is read from that peer once per forward call (`bytes_from_peers` counts it: ``(W-1)``
shards) and once more in backward (the re-gather, as FSDP does: only the local shard is saved).

Autograd (the design's convention, a sum): ``grad_a = grad_out @ all_gather(b_shard, 1).T``;
``grad_b_shard`` = this rank's block of columns of ``sum over ranks of a_r.T @ grad_out_r`` (a
reduce-scatter with sum). torch's FSDP2 averages gradients over the data-parallel ranks by default: for
its mean, scale the loss (or ``grad_b_shard``) by ``1/W``. Backward posts the re-gather of the weight first,
computes ``grad_b_shard`` while it flies, then ``grad_a`` block by block as the shards are there, 16-bit
partials summed in fp32 in a fixed order. ``grad_b_shard``: under ``symm`` and ``fused`` through a ring of
two chunk regions in the heap (`overlap.ops.tp.grad_ring`, its own call beside the re-gather's: each block's
accumulator travels round the ring, each rank adding its partial, its GEMM hidden behind the transfer; no
whole-size weight gradient anywhere, two chunks of it in the heap); under ``pipelined`` by
`overlap.ops.tp.scatter_gemm` with the forward's plan. ``reference`` does the same with plain collectives (the
whole weight and the whole weight gradient, each in flight during the other's GEMM).

fp8 (``fp8="rowwise" | "tensorwise" | "mxfp8"`` or an `overlap.Fp8Recipe`, `overlap.ops.fp8_recipe`): the shard is
quantized on its owner along ``k`` (`quantize_shard`: as rows of ``w``, ``[n, k]``, one scale per row = per column
of ``b``, one for the whole shard, or MX blocks of 32), and its rows travel packed with their scales
(`overlap.ops.fp8_rows.Packed`: ``k`` e4m3 bytes and 4 scale bytes a row, ``k / 32`` with MX; a tensorwise
shard's one scale on each of its rows, so every shard keeps its own), about half of bf16's bytes, through every
strategy's transport unchanged; ``a`` is quantized here along ``k``; each landed block of columns is a scaled
GEMM in float32 rounded once to ``a``'s dtype (``fused``: the kernel's fp8 ``tl.dot``, the scales in its
epilogue, MX ones per block of 32 in its K loop). A caller that runs several forwards per optimizer step passes the
shard quantized once (``b_fp8``, `overlap.nn.ShardedLinear` caches it). Backward with ``grads=False`` (the default)
is exactly the op's without fp8 (the leaves re-gathered in their dtype); with ``grads=True`` both gradients are
`overlap.ops.fp8_matmul.grad_gemm`'s: ``grad_b_shard`` reduce-scattered in float32 by `matmul_reduce_scatter`'s
strategies (``symm``'s regions, ``fused``'s kernel for e4m3 gradients and ``symm``'s for e5m2, not the ring: the
ring multiplies in the leaves' dtype), ``grad_a`` once every shard of the re-gather is there (its quantization along
``W*n`` needs the whole weight: one ``[W*n, k]`` buffer).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every rank;
``a`` and ``b_shard`` are only read; the output is a new tensor.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ...errors import OverlapTimeout
from ...plans import Plan
from .. import fused, library
from ..context import CallContext, autocast_inputs, describe, no_autocast, record
from ..fp8 import Fp8Args, quantize_fp8, scaled_mm
from ..fp8_matmul import grad_gemm
from ..fp8_recipe import Fp8Recipe, recipe_of
from ..fp8_rows import Packed
from . import entry, gather, grad_ring, hierarchical_weight, scatter_gemm, shard_ring
from .operands import grad_operands, kernel_takes, kernel_tile
from .rows import Product, Rows

OP = "all_gather_weight_matmul"

BYTES_FROM_PEERS: collections.Counter[str] = collections.Counter()
"""Bytes this process pulled or received from peers' shards, by strategy (``symm``, ``pipelined``,
``reference``), forward and backward gathers together: ``(W - 1)`` shards per gather (fp8: packed shards)."""


def all_gather_weight_matmul(
    a: torch.Tensor,
    b_shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
    *,
    fp8: str | Fp8Recipe | None = None,
    b_fp8: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ all_gather(b_shard, dim=1)`` over `group`, overlapping the weight's gather with the GEMM.

    Args:
        a: ``[m, ..., k]``, this rank's own input (data parallel: not gathered).
        b_shard: ``[k, n]``, this rank's block of columns of the weight, any strides (a weight
            ``w[W*n, k]`` sharded by rows is passed as ``w_shard.t()``); the same shape on every rank.
        group: process group (default: the world); every rank of it must make the same call.
        strategy: ``"auto"`` (default), ``"reference"``, ``"pipelined"``, ``"symm"``, ``"fused"`` or
            ``"hierarchical"``.
        plan: an `overlap.Plan` (overrides `strategy`'s defaults, e.g. chunk counts), or a plan file.
        timeout: seconds any wait on a peer may take (default ``OVERLAP_TIMEOUT_S``, 300).
        fp8: the fp8 training recipe (``"rowwise"``, ``"tensorwise"``, ``"mxfp8"`` or an `overlap.Fp8Recipe`; float32,
            bfloat16 or float16 leaves): the shard quantized on its owner along ``k`` and gathered in fp8, ``a``
            quantized here, scaled GEMMs; the result has `a`'s dtype (module docstring). ``"mxfp8"`` needs ``k % 32
            == 0``.
        b_fp8: with `fp8`, this rank's shard already quantized, as `quantize_shard` ``(b_shard, fp8)`` returns it
            (a layer that runs several forwards per optimizer step quantizes once: `overlap.nn.ShardedLinear`). It
            must hold `b_shard`'s values: the op multiplies by it and differentiates `b_shard`.

    Returns:
        ``[m, ..., W*n]``: rank p's block of columns at ``p*n ... (p+1)*n - 1``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, plan, fp8 recipe, a `b_fp8` of another shape or
            dtype), on this rank before any data moves; peers already in the call raise `OverlapMismatchError` at
            once.
        OverlapMismatchError (a ValueError): ranks made different calls (shapes of ``a`` or ``b_shard``,
            dtype, plan, recipe), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    call = _call(group, strategy, plan, timeout, fp8, b_fp8)
    args, scaled = entry.call_args(call, a, [b_shard], fp8=(None, None, None, fp8))
    if b_fp8 is not None and (not isinstance(b_fp8, torch.Tensor) or b_fp8.device != a.device):
        entry.prepare(call, a, b_shard, scaled=scaled)  # (the op's check raises it, peers told)
    a, b_shard = autocast_inputs(a, b_shard)
    return _op(a, b_shard, *args, library.needs_grad(a, b_shard), b_fp8, scaled.recipe)[0]


def _call(group, strategy, plan, timeout, fp8: Any, b_fp8: Any) -> entry.TpCall:
    return entry.TpCall(OP, group, strategy, plan, timeout, _check_fp8_shard(fp8, b_fp8))


def _check_fp8_shard(fp8: Any, b_fp8: Any):
    """The op's own check (`entry.TpCall.check`, after the recipe's): `b_fp8` is what `quantize_shard` gives."""

    def check(a: torch.Tensor, b: torch.Tensor, info) -> None:
        if b_fp8 is None:
            return
        if not isinstance(b_fp8, torch.Tensor):
            raise TypeError(f"overlap.{OP}: b_fp8 must be a tensor (quantize_shard's), got {type(b_fp8).__name__}")
        recipe = recipe_of(OP, fp8)
        if recipe is None:
            raise TypeError(f"overlap.{OP}: b_fp8 is given without fp8=: pass the recipe it was quantized with")
        k, n = b.shape
        want = (n, wire(k, recipe.granularity, b.device).width)
        if b_fp8.dtype != torch.uint8 or tuple(b_fp8.shape) != want or b_fp8.device != b.device:
            raise ValueError(f"overlap.{OP}: b_fp8 must be quantize_shard(b_shard, {recipe.text!r}): uint8 "
                             f"{list(want)} on {b.device}, got {b_fp8.dtype} {list(b_fp8.shape)} on {b_fp8.device}")
        if b_fp8.requires_grad:
            raise TypeError(f"overlap.{OP}: b_fp8 requires grad; the gradient goes to b_shard")

    return check


# ----------------------------------------------------------------------------------------------
# fp8: the shard quantized on its owner and packed with its scales; a quantized here; a scaled GEMM per block
# ----------------------------------------------------------------------------------------------


def wire(k: int, granularity: str, device: torch.device) -> Packed:
    """How a quantized shard's rows (rows of ``w``, ``k`` long) travel: `Packed` with their scales."""
    return Packed(k, device, mx=granularity == "mxfp8")


def quantize_shard(b_shard: torch.Tensor, fp8: str | Fp8Recipe) -> torch.Tensor:
    """This rank's shard ``[k, n]`` quantized as `all_gather_weight_matmul` gathers it with the recipe `fp8`: along
    ``k`` (per column of ``b_shard``, per shard, or MX blocks of 32), as rows of ``w`` packed with their scales,
    uint8 ``[n, width]`` (`overlap.ops.fp8_rows.Packed`). Computes no gradient.

    Raises:
        TypeError / ValueError: `fp8` names no recipe; ``"mxfp8"`` with ``k % 32 != 0``.
    """
    recipe = recipe_of(OP, fp8)
    if recipe is None:
        raise TypeError(f"overlap.{OP}: quantize_shard needs a recipe, got fp8={fp8!r}")
    with torch.no_grad():
        x8, scale = quantize_fp8(b_shard.detach().t(), recipe.granularity)
    return wire(b_shard.shape[0], recipe.granularity, b_shard.device).pack(x8, scale)


class _Fp8Forward:
    """A forward call's fp8 operands: the packed shard (`shard`: this rank's, to gather), ``a`` quantized (`a8`,
    `a_scale`), and the scaled GEMM of a landed block of columns (`multiply`)."""

    def __init__(self, a2: torch.Tensor, b: torch.Tensor, recipe: Fp8Recipe, b_fp8: torch.Tensor | None):
        self.granularity = recipe.granularity
        self.wire = wire(b.shape[0], self.granularity, b.device)
        self.n = b.shape[1]
        self.shard = b_fp8 if b_fp8 is not None else quantize_shard(b, recipe)
        self.a8, self.a_scale = quantize_fp8(a2, self.granularity)
        self.out_dtype = a2.dtype

    def multiply(self, rows: torch.Tensor, out: torch.Tensor, lo: int, hi: int) -> None:
        """``out[:, lo:hi] = a @ b[:, lo:hi]`` from the landed packed `rows` of ``w`` (``lo ... hi``), shard by shard
        (`reference` lands every shard at once; a tensorwise shard's scale is one value, its own)."""
        x8, scale = self.wire.unpack(rows)
        start = lo
        while start < hi:
            end = min(hi, (start // self.n + 1) * self.n) if self.granularity == "tensorwise" else hi
            i, j = start - lo, end - lo
            b_scale = scale[i : i + 1, 0] if self.granularity == "tensorwise" else scale[i:j].t()
            out[:, start:end].copy_(scaled_mm(self.a8, x8[i:j].t(), self.a_scale, b_scale, self.out_dtype))
            start = end


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def heap_bytes(chosen: Plan, shard: torch.Tensor) -> int:
    """Bytes of one heap slot a gather of `shard` needs (0: the strategy uses no symmetric memory)."""
    return shard.numel() * shard.element_size() if chosen.strategy in ("symm", "fused", "hierarchical") else 0


def _rows_of(b: torch.Tensor) -> torch.Tensor:
    """The shard as rows of the weight, ``[n, k]`` contiguous (no copy for ``w_shard.t()``)."""
    return b.t().contiguous()


def _start_gather(kind: str, call, shard_NK: torch.Tensor, cc: CallContext, need: int = 0):
    BYTES_FROM_PEERS[kind] += (cc.world_size - 1) * shard_NK.numel() * shard_NK.element_size()
    if kind == "hierarchical":
        return hierarchical_weight.start(shard_NK, cc, call, need)
    if kind == "symm":
        return shard_ring.start(call, shard_NK, cc)
    return gather.start(kind, call, shard_NK, cc)


def run(a2: torch.Tensor, b: torch.Tensor, cc: CallContext, scaled: _Fp8Forward | None = None) -> torch.Tensor:
    """One forward call on every rank: the handshake, then each block of columns as its shard is there (`scaled`:
    fp8, the packed shards gathered and each block a scaled GEMM)."""
    shard = _rows_of(b) if scaled is None else scaled.shard
    call = cc.begin(heap_bytes(cc.plan, shard), steady=cc.plan.strategy in ("symm", "pipelined"),
                    in_data=cc.plan.strategy == "hierarchical",
                    plain=cc.plan.strategy == "reference")
    try:
        if cc.plan.strategy == "fused":
            return _fused(cc, call, a2, shard, scaled)
        g = _start_gather(cc.plan.strategy, call, shard, cc)
        try:
            out = a2.new_empty((a2.shape[0], cc.world_size * b.shape[1]))
            for lo, hi, rows in g.chunks():  # reference: one chunk, the whole weight
                if scaled is None:
                    torch.mm(a2, rows.t(), out=out[:, lo:hi])
                else:
                    scaled.multiply(rows, out, lo, hi)
            return out
        finally:
            g.close()
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls


def _forward(a, b, group, strategy, plan, timeout, needs_grad, b_fp8=None, fp8=""):
    """``overlap::all_gather_weight_matmul``: the whole call (checks, plan, handshake, strategy) on this rank."""
    call = _call(group, strategy, plan, timeout, fp8, b_fp8)
    cc = entry.tp_context(call, a, b, needs_grad, Fp8Args(recipe=fp8))
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1])
        scaled = _Fp8Forward(a2, b, recipe_of(OP, fp8), b_fp8) if fp8 else None
        out2 = run(a2, b, cc, scaled)
        out = out2.view(*a.shape[:-1], cc.world_size * b.shape[1])
    return out, library.context_out(cc, needs_grad)


def _fake(a, b, group, strategy, plan, timeout, needs_grad, b_fp8=None, fp8=""):
    out = a.new_empty((*a.shape[:-1], library.world_size(group) * b.shape[-1]))
    return out, library.context_fake(needs_grad)


def _save(ctx: Any, inputs: tuple, output: Any) -> None:
    entry.tp_save(ctx, inputs, output)
    ctx.extra = (inputs[-1],)  # the recipe's text: its backward's


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _grad_b_layout(b: torch.Tensor) -> bool:
    """Whether grad_b is returned as the transpose of a contiguous ``[n, k]`` (b is ``w_shard.t()``)."""
    return b.t().is_contiguous()


def _backward_fake(grad, a, b, context, need_a, need_b, fp8=""):
    grad_a = a.new_empty(a.shape if need_a else (0,))
    if not need_b:
        return grad_a, b.new_empty((0,))
    return grad_a, (b.new_empty((b.shape[1], b.shape[0])).t() if _grad_b_layout(b) else b.new_empty(b.shape))


def _backward(grad_out, a, b, context, need_a, need_b, fp8=""):
    """``overlap::all_gather_weight_matmul_backward``: ``(grad_a, grad_b)`` in the forward's call context."""
    cc = library.kept(context, f"{OP}.backward").derive(op=f"{OP}.backward")
    recipe = recipe_of(OP, fp8)
    k, n = b.shape
    with record(cc.op), no_autocast(cc.info.device.type):
        grad_a2, grad_b_NK = _overlapped_backward(cc, a.reshape(-1, k), b, grad_out.reshape(-1, cc.world_size * n),
                                                  need_a, need_b, recipe if recipe is not None and recipe.grads
                                                  else None)
    grad_a = grad_a2.view(a.shape) if need_a else None
    grad_b = None
    if need_b:
        grad_b = grad_b_NK.t() if _grad_b_layout(b) else grad_b_NK.t().contiguous()
    return library.grads_out(grad_a, grad_b, a, b)


SCHEMA = ("(Tensor a, Tensor b, str group, str strategy, str plan, float? timeout, bool needs_grad, "
          "Tensor? b_fp8=None, str fp8=\"\") -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad, Tensor a, Tensor b, Tensor context, bool need_a, bool need_b, str fp8=\"\") "
                   "-> (Tensor, Tensor)")
_backward_op = library.define(f"{OP}_backward", BACKWARD_SCHEMA, _backward, _backward_fake)
_op = library.define(OP, SCHEMA, _forward, _fake, entry.tp_backward(_backward_op), _save)


def _overlapped_backward(cc: CallContext, a2, b, g2, need_a, need_b, grads: Fp8Recipe | None = None):
    """The weight's re-gather in flight while grad_b's reduce-scatter runs; then grad_a by blocks (`grads`: the
    recipe of fp8 gradients, module docstring).

    Returns ``(grad_a [M, k], grad_b as [n, k])`` (None where not asked)."""
    chosen = cc.plan
    kind = "symm" if chosen.strategy in ("symm", "fused") else chosen.strategy  # fused gathers as symm does
    heap_ring = kind == "symm" and grads is None  # grad_b through the ring of two chunk regions
    # fp8 gradients: grad_gemm's operands of grad_w = g.T @ a ([W*n, k]), reduce-scattered by matmul_reduce_scatter's
    # strategies; fused's kernel takes e4m3 (rowwise, MX), symm's copies the rest (tensorwise's e5m2)
    pair = grad_operands(g2.t().contiguous(), a2, grads) if grads is not None and need_b else None
    grad_plan = chosen
    if pair is not None and chosen.strategy == "fused" and not kernel_takes(pair):
        grad_plan = dataclasses.replace(chosen, strategy="symm")
    shard_NK = _rows_of(b)
    k, n = b.shape
    lay = grad_ring.layout(chosen, cc.info, n, k, g2.dtype) if heap_ring and need_b else None
    gather = None
    grad_a = grad_b = None
    fp8_sig = f", fp8={grads.text}" if grads is not None else ""
    try:
        if need_a:
            gather_cc = cc.derive(signature=f"{cc.op}.gather(b={describe(b)}, plan={chosen.describe()})")
            # The heap cannot grow while this gather is in flight: size it for grad_b's call too.
            need = heap_bytes(chosen, b)
            if lay is not None:
                need = max(need, grad_ring.heap_bytes(lay, cc.world_size))
            elif need_b:
                need = max(need, scatter_gemm.heap_bytes(grad_plan, g2.shape[1] // cc.world_size, a2.shape[1],
                                                         a2.dtype if grads is None else torch.float32,
                                                         cc.world_size))
            gather_call = gather_cc.begin(need, steady=kind in ("symm", "pipelined"), plain=kind == "reference",
                                          in_data=kind == "hierarchical")
            gather = _start_gather(kind, gather_call, shard_NK, gather_cc, need)
        if need_b:
            grad_cc = cc.derive(signature=f"{cc.op}.grad_b(g={describe(g2)}, a={describe(a2)}, "
                                          f"plan={chosen.describe()}{fp8_sig})", plan=grad_plan)
            rows = Rows.flat(cc.world_size, g2.shape[1] // cc.world_size)
            if pair is not None:  # float32 partials
                grad_b = scatter_gemm.run(Product([pair], rows), grad_cc).to(b.dtype)
            elif lay is None:  # grad_w = g.T @ a ([W*n, k]) reduce-scattered by rows: this rank's [n, k]
                grad_b = scatter_gemm.run(Product([(g2.t().contiguous(), a2.contiguous())], rows), grad_cc)
            else:
                grad_b = _ring_grad_b(grad_cc, g2, a2, n, lay)
        if need_a:
            grad_a = _blocks_times(g2, gather) if grads is None else _fp8_grad_a(g2, gather, grads, k)
    finally:
        if gather is not None:
            gather.close()
    return grad_a, grad_b


def _ring_grad_b(cc: CallContext, g2, a2, n: int, lay) -> torch.Tensor:
    """``grad_b_shard`` (``[n, k]``) through `grad_ring`: its own call, two chunk regions of the heap."""
    call = cc.begin(grad_ring.heap_bytes(lay, cc.world_size), steady=True)  # (host waits, fused too)
    try:
        return grad_ring.reduce_scatter(cc, call, g2, a2.contiguous(), n, lay)
    finally:
        call.finish()


def _blocks_times(g2: torch.Tensor, gather) -> torch.Tensor:
    """``grad_a = sum over blocks of g2[:, block] @ rows`` in the gather's fixed order; 16-bit partials are
    summed in fp32 and rounded once."""
    low = g2.dtype in (torch.float16, torch.bfloat16)
    acc = None
    for lo, hi, rows in gather.chunks():
        part = torch.mm(g2[:, lo:hi], rows)
        if acc is None:
            acc = part.float() if low else part
        else:
            acc += part
    return acc.to(g2.dtype) if low else acc


def _fp8_grad_a(g2: torch.Tensor, gather, recipe: Fp8Recipe, k: int) -> torch.Tensor:
    """``grad_a = grad_gemm(g2, w)`` (fp8 gradients): the re-gathered rows of ``w`` collected into ``[W*n, k]``
    (quantized along ``W*n``, they are needed all at once)."""
    w = torch.empty((g2.shape[1], k), dtype=g2.dtype, device=g2.device)
    for lo, hi, rows in gather.chunks():
        w[lo:hi].copy_(rows)
    return grad_gemm(g2, w, recipe).to(g2.dtype)


def _fused(cc: CallContext, call, a2: torch.Tensor, shard: torch.Tensor, scaled: _Fp8Forward | None) -> torch.Tensor:
    """The fused kernel: this rank's shard (fp8: packed) into its heap slot, flagged once; tiles read every shard in
    place."""
    kernels = fused.kernels().all_gather_weight_matmul
    r, timeout = cc.rank, cc.timeout
    n = shard.shape[0]
    heap = call.heap
    call.wait_slot_free()
    call.buffer(r, shard.dtype, tuple(shard.shape)).copy_(shard)
    call.signal_ready()
    BYTES_FROM_PEERS["fused"] += (cc.world_size - 1) * shard.numel() * shard.element_size()
    # GPU: the kernel's error word is pinned host memory, checked by the next call without a sync. CPU
    # (interpreted): checked right after the kernel.
    err = heap.kernel_err() if a2.is_cuda else torch.zeros(1, dtype=torch.int32)
    a_op, fp8 = a2, {}
    if scaled is not None:  # the shard's rows packed with their scales; a's scales beside it
        a_op = scaled.a8
        fp8 = {"a_scale": scaled.a_scale, "out_dtype": scaled.out_dtype, "scale_offset": scaled.wire.scale_offset,
               "row_bytes": scaled.wire.width}
    tile = kernel_tile(fused.fused_tiles(cc.plan.block_m, cc.plan.block_n, cc.plan.block_k, fused.interpreted(),
                                         a_op.dtype), scaled is not None and scaled.wire.mx)
    a_rows = a_op if a_op.shape[1] == 1 or a_op.stride(1) == 1 else a_op.contiguous()
    tables = heap.tables
    out = kernels.launch_all_gather_weight_matmul(a_rows, tables.ptr_table(call.slot), tables.flag_table(call.slot, 0),
                                                  n=n, epoch=call.epoch_word(), rank=r, err=err,
                                                  timeout_ns=int(timeout * 1e9), block=tile, **fp8)
    bad = 0 if a2.is_cuda else int(err.item())
    if bad:
        raise OverlapTimeout(cc.op, r, bad - 1, f"shard {bad - 1}", timeout, "fused kernel tile wait")
    return out
