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

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every rank;
``a`` and ``b_shard`` are only read; the output is a new tensor.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from ...errors import OverlapTimeout
from ...plans import Plan
from .. import fused, library
from ..context import CallContext, describe, no_autocast, record
from . import entry, gather, grad_ring, hierarchical_weight, scatter_gemm, shard_ring
from .rows import Product, Rows

OP = "all_gather_weight_matmul"

BYTES_FROM_PEERS: collections.Counter[str] = collections.Counter()
"""Bytes this process pulled or received from peers' shards, by strategy (``symm``, ``pipelined``,
``reference``), forward and backward gathers together: ``(W - 1)`` shards per gather."""


def all_gather_weight_matmul(
    a: torch.Tensor,
    b_shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """``a @ all_gather(b_shard, dim=1)`` over `group`, overlapping the weight's gather with the GEMM.

    Args:
        a: ``[m, ..., k]``, this rank's own input (data parallel: not gathered).
        b_shard: ``[k, n]``, this rank's block of columns of the weight, any strides (a weight
            ``w[W*n, k]`` sharded by rows is passed as ``w_shard.t()``); the same shape on every rank.
        group: process group (default: the world); every rank of it must make the same call.
        strategy: ``"auto"`` (default), ``"reference"``, ``"pipelined"``, ``"symm"`` or ``"fused"``.
        plan: an `overlap.Plan` (overrides `strategy`'s defaults, e.g. chunk counts), or a plan file.
        timeout: seconds any wait on a peer may take (default ``OVERLAP_TIMEOUT_S``, 300).

    Returns:
        ``[m, ..., W*n]``: rank p's block of columns at ``p*n ... (p+1)*n - 1``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, plan), on this rank before any data
            moves; peers already in the call raise `OverlapMismatchError` at once.
        OverlapMismatchError (a ValueError): ranks made different calls (shapes of ``a`` or ``b_shard``,
            dtype, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    return entry.tp_call(_op, entry.TpCall(OP, group, strategy, plan, timeout), a, b_shard)


def heap_bytes(chosen: Plan, b: torch.Tensor) -> int:
    """Bytes of one heap slot a forward call needs (0: the strategy uses no symmetric memory)."""
    return b.numel() * b.element_size() if chosen.strategy in ("symm", "fused", "hierarchical") else 0


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


def run(a2: torch.Tensor, b: torch.Tensor, cc: CallContext) -> torch.Tensor:
    """One forward call on every rank: the handshake, then each block of columns as its shard is there."""
    call = cc.begin(heap_bytes(cc.plan, b), steady=cc.plan.strategy in ("symm", "pipelined"),
                    in_data=cc.plan.strategy == "hierarchical",
                    plain=cc.plan.strategy == "reference")
    try:
        if cc.plan.strategy == "fused":
            return _fused(cc, call, a2, b)
        g = _start_gather(cc.plan.strategy, call, _rows_of(b), cc)
        try:
            out = a2.new_empty((a2.shape[0], cc.world_size * b.shape[1]))
            for lo, hi, rows in g.chunks():  # reference: one chunk, the whole weight
                torch.mm(a2, rows.t(), out=out[:, lo:hi])
            return out
        finally:
            g.close()
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls


def _forward(a, b, group, strategy, plan, timeout, needs_grad):
    """``overlap::all_gather_weight_matmul``: the whole call (checks, plan, handshake, strategy) on this rank."""
    cc = entry.tp_context(entry.TpCall(OP, group, strategy, plan, timeout), a, b, needs_grad)
    with record(OP), no_autocast(cc.info.device.type):
        out2 = run(a.reshape(-1, a.shape[-1]), b, cc)
        out = out2.view(*a.shape[:-1], cc.world_size * b.shape[1])
    return out, library.context_out(cc, needs_grad)


def _fake(a, b, group, strategy, plan, timeout, needs_grad):
    out = a.new_empty((*a.shape[:-1], library.world_size(group) * b.shape[-1]))
    return out, library.context_fake(needs_grad)


def _grad_b_layout(b: torch.Tensor) -> bool:
    """Whether grad_b is returned as the transpose of a contiguous ``[n, k]`` (b is ``w_shard.t()``)."""
    return b.t().is_contiguous()


def _backward_fake(grad, a, b, context, need_a, need_b):
    grad_a = a.new_empty(a.shape if need_a else (0,))
    if not need_b:
        return grad_a, b.new_empty((0,))
    return grad_a, (b.new_empty((b.shape[1], b.shape[0])).t() if _grad_b_layout(b) else b.new_empty(b.shape))


def _backward(grad_out, a, b, context, need_a, need_b):
    """``overlap::all_gather_weight_matmul_backward``: ``(grad_a, grad_b)`` in the forward's call context."""
    cc = library.kept(context, f"{OP}.backward").derive(op=f"{OP}.backward")
    k, n = b.shape
    with record(cc.op), no_autocast(cc.info.device.type):
        grad_a2, grad_b_NK = _overlapped_backward(cc, a.reshape(-1, k), b, grad_out.reshape(-1, cc.world_size * n),
                                                  need_a, need_b)
    grad_a = grad_a2.view(a.shape) if need_a else None
    grad_b = None
    if need_b:
        grad_b = grad_b_NK.t() if _grad_b_layout(b) else grad_b_NK.t().contiguous()
    return library.grads_out(grad_a, grad_b, a, b)


_backward_op = library.define(f"{OP}_backward", entry.TP_BACKWARD_SCHEMA, _backward, _backward_fake)
_op = library.define(OP, entry.PLAIN_SCHEMA, _forward, _fake, entry.tp_backward(_backward_op), entry.tp_save)


def _overlapped_backward(cc: CallContext, a2, b, g2, need_a, need_b):
    """The weight's re-gather in flight while grad_b's reduce-scatter runs; then grad_a by blocks.

    Returns ``(grad_a [M, k], grad_b as [n, k])`` (None where not asked)."""
    chosen = cc.plan
    heap_ring = chosen.strategy in ("symm", "fused")  # grad_b through the ring of two chunk regions
    kind = "symm" if heap_ring else chosen.strategy  # fused gathers the weight as symm does
    shard_NK = _rows_of(b)
    k, n = b.shape
    lay = grad_ring.layout(chosen, cc.info, n, k, g2.dtype) if heap_ring and need_b else None
    gather = None
    grad_a = grad_b = None
    try:
        if need_a:
            gather_cc = cc.derive(signature=f"{cc.op}.gather(b={describe(b)}, plan={chosen.describe()})")
            # The heap cannot grow while this gather is in flight: size it for grad_b's call too.
            need = heap_bytes(chosen, b)
            if lay is not None:
                need = max(need, grad_ring.heap_bytes(lay, cc.world_size))
            elif need_b:
                need = max(need, scatter_gemm.heap_bytes(chosen, g2.shape[1] // cc.world_size, a2.shape[1], a2.dtype,
                                                         cc.world_size))
            gather_call = gather_cc.begin(need, steady=kind in ("symm", "pipelined"), plain=kind == "reference",
                                          in_data=kind == "hierarchical")
            gather = _start_gather(kind, gather_call, shard_NK, gather_cc, need)
        if need_b:
            grad_cc = cc.derive(signature=f"{cc.op}.grad_b(g={describe(g2)}, a={describe(a2)}, "
                                          f"plan={chosen.describe()})")
            if lay is None:  # grad_w = g.T @ a ([W*n, k]) reduce-scattered by rows: this rank's [n, k]
                rows = Rows.flat(cc.world_size, g2.shape[1] // cc.world_size)
                grad_b = scatter_gemm.run(Product([(g2.t().contiguous(), a2.contiguous())], rows), grad_cc)
            else:
                grad_b = _ring_grad_b(grad_cc, g2, a2, n, lay)
        if need_a:
            grad_a = _blocks_times(g2, gather)
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


def _fused(cc: CallContext, call, a2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fused kernel: this rank's shard into its heap slot, flagged once; tiles read every shard in place."""
    kernels = fused.kernels().all_gather_weight_matmul
    r, timeout = cc.rank, cc.timeout
    shard = _rows_of(b)
    n, k = shard.shape
    heap = call.heap
    call.wait_slot_free()
    call.buffer(r, shard.dtype, (n, k)).copy_(shard)
    call.signal_ready()
    BYTES_FROM_PEERS["fused"] += (cc.world_size - 1) * shard.numel() * shard.element_size()
    # GPU: the kernel's error word is pinned host memory, checked by the next call without a sync. CPU
    # (interpreted): checked right after the kernel.
    err = heap.kernel_err() if a2.is_cuda else torch.zeros(1, dtype=torch.int32)
    tile = fused.fused_tiles(cc.plan.block_m, cc.plan.block_n, cc.plan.block_k, fused.interpreted(), a2.dtype)
    a_rows = a2 if a2.shape[1] == 1 or a2.stride(1) == 1 else a2.contiguous()
    tables = heap.tables
    out = kernels.launch_all_gather_weight_matmul(a_rows, tables.ptr_table(call.slot), tables.flag_table(call.slot, 0),
                                                  n=n, epoch=call.epoch_word(), rank=r, err=err,
                                                  timeout_ns=int(timeout * 1e9), block=tile)
    bad = 0 if a2.is_cuda else int(err.item())
    if bad:
        raise OverlapTimeout(cc.op, r, bad - 1, f"shard {bad - 1}", timeout, "fused kernel tile wait")
    return out
