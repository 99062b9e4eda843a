"""The all-gather and its GEMMs: every chunk's GEMM as soon as its gathered rows are there. The forward of
`overlap.all_gather_matmul` and the input gradient of `overlap.matmul_reduce_scatter` (the all-gather of the
output gradient times ``b.T``, the gathered rows kept for the weight gradient) run it.

Strategies (same results; `reference` is the oracle):

* ``reference``: ``all_gather_into_tensor``, then one GEMM.
* ``pipelined``: a pairwise exchange (step i: receive from ``rank+i``, send to ``rank-i``), each
  step split into ``num_chunks[link]`` pieces, all posted at once; the local GEMM runs while they
  fly, then each piece's GEMM as soon as it is received. Any backend, any topology.
* ``symm``: every rank copies its shard into its slot of the symmetric heap and flags it; a copy
  engine (a side stream on GPUs, a worker thread on CPU ranks) pulls peers' chunks into a local
  buffer, and the GEMM of each chunk waits only for that chunk. Ranks of one node.
* ``fused``: one Triton kernel (`overlap.kernels.all_gather_matmul`); each tile waits on the flag of the
  rank chunk it reads and loads it straight from that rank's buffer. Ranks of one node; on CPU
  ranks it runs interpreted (correct, slow: for tests at small sizes).
* ``hierarchical``: groups spanning nodes (`overlap.ops.tp.hierarchical_gather`): each block sent once to each other
  node (the rank with the same index there), forwarded within the node by shared memory as each network
  chunk lands; every chunk's GEMM as it arrives. (On one node the plan is ``symm``.)

The gathers themselves (reference, pipelined, symm, hierarchical) are `overlap.ops.tp.gather`'s.
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import OverlapTimeout
from ...plans import Plan
from .. import fused
from ..context import CallContext
from ..hierarchical.node_call import guard
from . import gather
from .operands import Weights, kernel_tile
from .rows import Rows


def heap_bytes(chosen: Plan, a2: torch.Tensor) -> int:
    """Bytes of one heap slot a call needs (0: the strategy uses no symmetric memory)."""
    return a2.numel() * a2.element_size() if chosen.strategy in ("symm", "fused", "hierarchical") else 0


def run(a2: torch.Tensor, bs: list[torch.Tensor] | Weights, cc: CallContext, keep_gathered: bool = False,
        rows: Rows | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One call on every rank (`cc`: its op, group, plan, deadline, signature): the handshake, then the strategy.

    Returns ``(outs, gathered)``: ``outs[i]`` is ``[W*m, n_i]``, the gathered rows times ``bs[i]`` (no weight:
    the call only gathers); every chunk's GEMMs, one per weight, as soon as it is there. ``gathered`` (the whole
    gathered `a2`) is None unless `keep_gathered`: the weight gradients take it from the gather. `rows`: where
    each rank's rows go (`overlap.ops.tp.rows.Rows`; default rank-major, dim 0). `bs` may be a
    `overlap.ops.tp.operands.Weights` (fp8: `a2` holds packed rows, `overlap.ops.fp8_rows.Packed`: each row's fp8
    bytes and its scales, rowwise or MX blocks, so the gather moves them together).
    """
    rows = Rows.flat(cc.world_size, a2.shape[0]) if rows is None else rows
    bs = bs if isinstance(bs, Weights) else Weights(bs)
    call = cc.begin(heap_bytes(cc.plan, a2), steady=cc.plan.strategy in ("symm", "pipelined"),
                    in_data=cc.plan.strategy == "hierarchical",
                    plain=cc.plan.strategy == "reference")
    try:
        return STRATEGIES[cc.plan.strategy](cc, call, a2, bs, keep_gathered, rows)
    finally:
        call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls


# ----------------------------------------------------------------------------------------------
# Forward strategies: (a2 [m, k] contiguous, bs [k, n_i]) -> outs [W*m, n_i]
# ----------------------------------------------------------------------------------------------


def _gathered(cc: CallContext, call, a2, bs, keep_gathered, rows):
    """reference, pipelined, symm: the GEMMs of each gathered chunk as soon as it is there."""
    g = gather.start(cc.plan.strategy, call, a2, cc, rows=rows)
    try:
        outs = bs.outputs(cc.world_size * a2.shape[0], a2)
        for lo, hi, chunk in g.chunks():
            bs.multiply(chunk, outs, lo, hi)
        return outs, (g.gathered() if keep_gathered else None)
    finally:
        g.close()


def _fused(cc: CallContext, call, a2, bs, keep_gathered, rows):
    """One kernel launch per weight; a second launch finds every flag set (the shards stay in the peers' buffers
    until this rank ends the call) and reads them again."""
    chosen, timeout = cc.plan, cc.timeout
    if not bs.bs:  # gather only (a weight gradient's gather): the kernel has no GEMM to run
        return _gathered(cc.derive(plan=dataclasses.replace(chosen, strategy="symm")), call, a2, bs, keep_gathered,
                         rows)
    kernels = fused.kernels().all_gather_matmul
    W, r, (m, k) = cc.world_size, cc.rank, a2.shape
    heap = call.heap
    call.wait_slot_free()
    call.buffer(r, a2.dtype, (m, k)).copy_(a2)
    call.signal_ready()
    # GPU: the kernel's error word is pinned host memory, checked by the next call without a
    # sync. CPU (interpreted): checked right after the kernel.
    err = heap.kernel_err() if a2.is_cuda else torch.zeros(1, dtype=torch.int32)
    packed = bs.packed
    tile = kernel_tile(fused.fused_tiles(chosen.block_m, chosen.block_n, chosen.block_k, fused.interpreted(),
                                         a2.dtype), packed is not None and packed.mx)
    outs = []
    for i, b in enumerate(bs.bs):
        # fp8: the shards are packed rows, each row's scales (one, or MX blocks) from byte scale_offset of the row
        fp8 = {} if packed is None else {"b_scale": bs.b_scales[i], "out_dtype": bs.out_dtype,
                                         "scale_offset": packed.scale_offset, "row_bytes": packed.width}
        outs.append(kernels.launch_all_gather_matmul(
            b, heap.tables.ptr_table(call.slot), heap.tables.flag_table(call.slot, 0), rows=m, epoch=call.epoch_word(),
            rank=r, err=err, timeout_ns=int(timeout * 1e9), block=tile, rows_per_outer=rows.rows, **fp8))
        bad = 0 if a2.is_cuda else int(err.item())
        if bad:
            raise OverlapTimeout(cc.op, r, bad - 1, f"rank chunk {bad - 1}", timeout, "fused kernel tile wait")
    gathered = None
    if keep_gathered:
        # Every peer's shard stays in its buffer until this rank finishes the call (on GPUs in
        # stream order: the kernel has waited for every flag), so the gathered rows are copied out.
        gathered = a2.new_empty((W * m, k))
        for p in range(W):
            shard = call.buffer(p, a2.dtype, (m, k))
            for lo, hi, f_lo, f_hi in rows.split(p, 0, m):
                gathered[f_lo:f_hi].copy_(shard[lo:hi])
    return outs, gathered


def _hierarchical(cc: CallContext, call, a2, bs, keep_gathered, rows):
    """Across nodes: `overlap.ops.tp.hierarchical_gather.HierGather` under `gather` (on one node the plan is ``symm``:
    `overlap.plans.auto.fit_plan`)."""
    with guard(cc):
        return _gathered(cc, call, a2, bs, keep_gathered, rows)


STRATEGIES = {"reference": _gathered, "pipelined": _gathered, "symm": _gathered, "fused": _fused,
              "hierarchical": _hierarchical}
