"""matmul_all_reduce: ``all_reduce(a @ b)`` (sum), with the reduction hidden behind the GEMM.

Problem. A row-parallel layer without sequence parallelism holds ``a_MK`` (every row, its slice of
the inner dim) and the matching rows ``b_KN`` of the weight; every rank needs ``sum_r a_r @ b_r``.
The all-reduce is a reduce-scatter followed by an all-gather; both can travel while GEMMs of other
rows run. For small outputs one step is cheaper than two: every rank takes every rank's whole
partial and sums it (**one-shot**, ``Plan(one_shot=True)``; ``auto`` picks it for outputs up to
`overlap.plans.auto.ONE_SHOT_MAX_BYTES` or fewer than ``2 * world_size`` rows).

Rows need not divide by the world size: the two-shot variants cut the ``M`` rows into ``W`` parts
of ``ceil(M / W)`` rows (the last ones shorter, possibly empty), part ``d`` reduced by rank ``d``.

Strategies (same results up to rounding; `reference` is the oracle). Every one sums in a fixed
order and every rank ends with bitwise the same output; the same inputs and plan give bitwise the
same result run after run:

* ``reference``: one GEMM, then ``all_reduce`` (``one_shot`` is ignored).
* ``pipelined``: the rows cut into ``W * num_chunks[slowest link]`` pieces; each piece's GEMM, then
  its collective posted asynchronously while the next piece's GEMM runs: the backend's
  ``all_reduce`` (two-shot: its own reduce-scatter + all-gather), or, one-shot, an
  ``all_gather_into_tensor`` of the partials summed in rank order. Any backend. On CPU ranks of one node
  point-to-point messages with per-call tags and headers instead (`overlap.symm.p2p`, the steady state):
  two-shot, each part's partial to its owner, summed there in rank order and sent to every rank; one-shot,
  each piece's partial to every rank, summed in rank order.
* ``symm``: two-shot = the ``symm`` reduce-scatter of `overlap.ops.tp.scatter_gemm` (each part's GEMM into
  its owner's buffer, flagged per chunk), the owner sums its part in rank order into its buffer and
  flags it, and every rank pulls every part (copy engine). One-shot: every rank's GEMM into its own
  buffer, flagged per chunk; every rank sums every buffer in rank order, chunk by chunk.
* ``fused``: two-shot = the fused kernels of `overlap.ops.tp.scatter_gemm` (the reduction writes into the
  heap), then the pulls of ``symm``. One-shot: the same GEMM kernel with one destination (its own
  buffer) and the reduction kernel over every rank's buffer.
* ``hierarchical``: groups spanning nodes (`overlap.ops.tp.hierarchical_reduce`): the hierarchical
  reduce-scatter of ``W`` parts, then the hierarchical all-gather of the reduced parts (two-shot;
  ``one_shot`` is ignored across nodes). ``symm`` on one node.

Autograd (Megatron's convention): the output and the loss are replicated, so the backward passes the
output gradient through: ``grad_a = g @ b.T``, ``grad_b = a.T @ g``, local GEMMs with no communication. With fp8
gradients (a recipe with ``grads``, ``fp8="rowwise+grads"``: `overlap.ops.fp8_recipe`) they are
`overlap.ops.fp8_matmul.grad_gemm`'s: ``grad_gemm(g, b.T)`` and ``grad_gemm(a.T, g)``, rounded to the leaves' dtype,
in a custom op of their own (``overlap::matmul_all_reduce_backward``: the compiler does not trace the quantization).

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` are only read; the output is a new tensor.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ... import comm, symm
from ...kernels import slots
from ...plans import Plan
from ...symm import p2p
from .. import fused, library
from ..context import CallContext, no_autocast, record
from ..fp8 import Fp8Args
from ..fp8_matmul import grad_gemm
from ..fp8_recipe import recipe_of
from ..sums import sum_in_order
from . import entry, hierarchical_reduce, operands
from .operands import Gemm
from .scatter_gemm import scatter_and_reduce

OP = "matmul_all_reduce"


def matmul_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
    *,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """``all_reduce(a @ b)`` (sum) over `group`, overlapping the reduction with the GEMM.

    Args:
        a: ``[M, ..., k]``: every row, this rank's slice ``k`` of the inner dim. Any ``M``.
        b: ``[k, n]``, this rank's rows of the weight, any strides (``w[n, k]`` is passed as ``w.t()``).
        group, strategy, timeout: as for `overlap.all_gather_matmul`.
        plan: an `overlap.Plan`; ``one_shot=True`` selects the one-shot variant.
        a_scale, b_scale, out_dtype, fp8: as for `overlap.all_gather_matmul` (fp8 operands: forward-only; the
            partial sums and their reduction are float32; a recipe with ``grads``: fp8 backward GEMMs).

    Returns:
        ``[M, ..., n]``, ``sum over ranks of a @ b``, bitwise the same on every rank.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, plan), on this rank before any
            data moves; peers raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    return entry.tp_call(_op, entry.TpCall(OP, group, strategy, plan, timeout), a, b,
                         fp8=(a_scale, b_scale, out_dtype, fp8))


def _layout(rows: int, n: int, dtype: torch.dtype, world_size: int) -> tuple[int, int, int]:
    """Two-shot heap layout: (rows per part, bytes of a part's region, offset of the reduced part)."""
    part = fused.cdiv(rows, world_size)
    rb = slots.region_bytes(part, n, dtype)
    return part, rb, world_size * rb


def heap_bytes(chosen: Plan, g: Gemm, world_size: int) -> int:
    if chosen.strategy not in ("symm", "fused"):  # (hierarchical: across nodes, no heap of the group's)
        return 0
    rows = g.a.shape[0]
    if chosen.one_shot:
        return slots.region_bytes(rows, g.n, g.dtype)
    part, rb, reduced = _layout(rows, g.n, g.dtype, world_size)
    return reduced + rb


def run(g: Gemm, cc: CallContext) -> torch.Tensor:
    """One call on every rank (`cc`: its op, group, plan, deadline, signature): the handshake, then the
    strategy; returns ``[M, n]`` in `g`'s partials' dtype (`overlap.ops.tp.operands.Gemm`: fp8, float32)."""
    steady = cc.plan.strategy in ("symm", "pipelined")  # (pipelined: checked in its messages, `overlap.symm.p2p`)
    call = cc.begin(heap_bytes(cc.plan, g, cc.world_size), steady=steady, plain=cc.plan.strategy == "reference",
                    in_data=cc.plan.strategy == "hierarchical")
    try:
        return STRATEGIES[cc.plan.strategy](cc, call, g)
    finally:
        call.finish()


def _forward(a, b, group, strategy, plan, timeout, needs_grad, a_scale=None, b_scale=None, out_dtype=None, fp8=""):
    """``overlap::matmul_all_reduce``: the whole call (checks, plan, handshake, strategy) on this rank."""
    scaled = Fp8Args(a_scale, () if b_scale is None else (b_scale,), out_dtype, fp8)
    cc = entry.tp_context(entry.TpCall(OP, group, strategy, plan, timeout), a, b, needs_grad, scaled)
    with record(OP), no_autocast(cc.info.device.type):
        a2 = a.reshape(-1, a.shape[-1]).contiguous()
        out = run(operands.gemm(a2, b, scaled), cc).view(*a.shape[:-1], b.shape[1])
    out = out.to(entry.out_dtype_of(a, scaled))
    return out, torch.empty(0, dtype=torch.int64)  # (its backward communicates nothing: no context kept)


def _fake(a, b, group, strategy, plan, timeout, needs_grad, a_scale=None, b_scale=None, out_dtype=None, fp8=""):
    dtype = entry.out_dtype_of(a, Fp8Args(a_scale, (), out_dtype, fp8))
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=dtype), torch.empty(0, dtype=torch.int64)


def _save(ctx, inputs, output) -> None:
    a, b, *rest = inputs
    ctx.save_for_backward(a, b)
    recipe = recipe_of(OP, inputs[-1])  # (the recipe's text: fp8 backward GEMMs with +grads)
    ctx.fp8 = recipe.text if recipe is not None and recipe.grads else ""
    ctx.rest = len(rest)


def _backward(ctx, grad_out, _grad_context):
    """Output and loss are replicated: the output gradient passes through the all-reduce unchanged, so the
    gradients are local GEMMs (no transfer: plain torch code that the compiler traces; with fp8 gradients the
    custom op ``overlap::matmul_all_reduce_backward``)."""
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.fp8:
        grad_a, grad_b = _fp8_backward_op(grad_out, a, b, need_a, need_b, ctx.fp8)
        return grad_a if need_a else None, grad_b if need_b else None, *(None,) * ctx.rest
    k, n = b.shape
    g2 = grad_out.reshape(-1, n)
    grad_a = torch.mm(g2, b.t()).view(a.shape) if need_a else None
    grad_b = torch.mm(a.reshape(-1, k).t(), g2) if need_b else None
    return grad_a, grad_b, *(None,) * ctx.rest


def _fp8_backward(grad_out, a, b, need_a, need_b, fp8):
    """``overlap::matmul_all_reduce_backward``: ``(grad_gemm(g, b.T), grad_gemm(a.T, g))`` of a recipe `fp8` with fp8
    gradients, in the leaves' dtypes (0 elements where not asked). Its own op: the scaled GEMMs probe what the
    installed torch takes (`overlap.ops.fp8.scaled_mm`) and quantizing is not for the compiler to trace."""
    recipe = recipe_of(OP, fp8)
    k, n = b.shape
    g2 = grad_out.reshape(-1, n)
    grad_a = grad_gemm(g2, b.t(), recipe).to(a.dtype).view(a.shape) if need_a else None
    grad_b = grad_gemm(a.reshape(-1, k).t(), g2, recipe, grad="y").to(b.dtype) if need_b else None
    return library.grads_out(grad_a, grad_b, a, b)


def _fp8_backward_fake(grad_out, a, b, need_a, need_b, fp8):
    return a.new_empty(a.shape if need_a else (0,)), b.new_empty(b.shape if need_b else (0,))


BACKWARD_SCHEMA = "(Tensor grad, Tensor a, Tensor b, bool need_a, bool need_b, str fp8) -> (Tensor, Tensor)"
_fp8_backward_op = library.define(f"{OP}_backward", BACKWARD_SCHEMA, _fp8_backward, _fp8_backward_fake)
_op = library.define(OP, entry.TP_SCHEMA, _forward, _fake, _backward, _save)


# ----------------------------------------------------------------------------------------------
# Forward strategies: g (`overlap.ops.tp.operands.Gemm`, a [M, k]) -> out [M, n]
# ----------------------------------------------------------------------------------------------


def _reference(cc: CallContext, call, g: Gemm):
    out = g.whole()
    cc.wait(comm.all_reduce_async(out, cc.pg), "any", "all_reduce")
    return out


def _empty(g: Gemm, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of `g`'s partials' dtype."""
    return g.a.new_empty(shape, dtype=g.dtype)


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = parts[0] + parts[1] + ...`` in that order (fp32 for 16-bit dtypes)."""
    if out.dtype in (torch.float16, torch.bfloat16):
        acc = parts[0].float()
        for p in parts[1:]:
            acc += p
        out.copy_(acc)
        return
    out.copy_(parts[0])
    for p in parts[1:]:
        out += p


def _pipelined(cc: CallContext, call, g: Gemm):
    if p2p.tagged(call):
        return _pipelined_p2p(cc, call, g)
    chosen, pg = cc.plan, cc.pg
    W, (rows, _), n = cc.world_size, g.a.shape, g.n
    out = _empty(g, (rows, n))
    pieces = comm.chunk_bounds(rows, W * chosen.chunks_for(cc.info.slowest_link))
    posted = []
    for lo, hi in pieces:
        g.into(lo, hi, out[lo:hi])
        if chosen.one_shot:
            every = _empty(g, (W * (hi - lo), n))  # rank-major: rank s's piece at rows s*(hi-lo)...
            posted.append((lo, hi, every, comm.all_gather_async(every, out[lo:hi], pg)))
        else:
            posted.append((lo, hi, None, comm.all_reduce_async(out[lo:hi], pg)))
    for i, (lo, hi, every, work) in enumerate(posted):
        cc.wait(work, "any", f"piece {i}")
        if every is not None:
            _sum_in_rank_order(list(every.view(W, hi - lo, n).unbind(0)), out[lo:hi])
    return out


def _pipelined_p2p(cc: CallContext, call, g: Gemm):
    """`_pipelined` on CPU ranks of one node: point-to-point messages with tags and headers (`overlap.symm.p2p`).

    One-shot: each piece's partial sent to every peer as soon as its GEMM is done; every rank sums every piece
    in rank order. Two-shot: each part's partial sent to its owner (parts of ``ceil(M / W)`` rows), the owner
    sums them in rank order and sends the reduced part to every peer. Bitwise the same on every rank."""
    W, r, (rows, _), n = cc.world_size, cc.rank, g.a.shape, g.n
    out = _empty(g, (rows, n))
    ex = p2p.Exchange(call, cc)
    try:
        if cc.plan.one_shot:
            pieces = comm.chunk_bounds(rows, W * cc.plan.chunks_for(cc.info.slowest_link))
            every = _empty(g, (W, rows, n))  # every[s]: rank s's partial
            for i in range(1, W):
                ex.expect(every[(r + i) % W], (r + i) % W, pieces)
            for lo, hi in pieces:
                g.into(lo, hi, every[r][lo:hi])
                for i in range(1, W):
                    ex.send(every[r][lo:hi], (r - i) % W, [(0, hi - lo)])
                ex.arm(block=False)
            arrivals = [ex.arrivals((r + i) % W) for i in range(1, W)]
            for lo, hi in pieces:
                for it in arrivals:
                    next(it)
                sum_in_order(list(every.unbind(0)), out, lo, hi)  # rank order, one rounding
        else:
            parts = _parts(rows, W)
            mine = parts[r]
            partials = _empty(g, (W, mine[1] - mine[0], n))  # partials[s]: rank s's partial of our part
            for i in range(1, W):
                ex.expect(partials[(r - i) % W], (r - i) % W)
            for i in range(1, W):
                lo, hi = parts[(r - i) % W]
                ex.expect(out[lo:hi], (r - i) % W)  # the reduced part of its owner
            sent = []  # kept alive until sent
            for i in range(1, W):
                d = (r + i) % W
                sent.append(g.rows(parts[d][0], parts[d][1]))
                ex.send(sent[-1], d)
                ex.arm(block=False)
            g.into(mine[0], mine[1], partials[r])
            for i in range(1, W):
                for _ in ex.arrivals((r - i) % W, 0):
                    pass
            sum_in_order(list(partials.unbind(0)), out[mine[0] : mine[1]], 0, mine[1] - mine[0])
            for i in range(1, W):
                ex.send(out[mine[0] : mine[1]], (r + i) % W)
            for i in range(1, W):
                for _ in ex.arrivals((r - i) % W, 1):
                    pass
        ex.close()
    except BaseException as exc:
        ex.abandon(exc)
        raise
    return out


def _one_shot_chunks(chosen: Plan, info, rows: int) -> list[tuple[int, int]]:
    return comm.chunk_bounds(rows, min(chosen.chunks_for(info.slowest_link), symm.MAX_FLAGS))


def _symm(cc: CallContext, call, g: Gemm):
    if cc.plan.one_shot:
        return _symm_one_shot(call, g, cc.info, cc.plan)
    return _symm_two_shot(call, g, cc.info, cc.plan)


def _symm_one_shot(call, g: Gemm, info, chosen):
    W, r, (rows, _), n = info.world_size, info.rank, g.a.shape, g.n
    chosen_chunks = _one_shot_chunks(chosen, info, rows)
    main = torch.cuda.current_stream() if g.a.is_cuda else None
    call.wait_slot_free(main)
    bufs = [call.buffer(p, g.dtype, (rows, n)) for p in range(W)]
    for j, (lo, hi) in enumerate(chosen_chunks):
        g.into(lo, hi, bufs[r][lo:hi])
        call.signal_ready(j, stream=main)
    out = _empty(g, (rows, n))
    for j, (lo, hi) in enumerate(chosen_chunks):
        for p in range(W):
            if p != r:
                call.wait_ready(p, j, stream=main)
        _sum_in_rank_order([buf[lo:hi] for buf in bufs], out[lo:hi])
    call.finish(stream=main)
    return out


def _parts(rows: int, world_size: int) -> list[tuple[int, int]]:
    part = fused.cdiv(rows, world_size)
    return [(min(d * part, rows), min((d + 1) * part, rows)) for d in range(world_size)]


def _symm_two_shot(call, g: Gemm, info, chosen):
    W, r, (rows, _), n, dtype = info.world_size, info.rank, g.a.shape, g.n, g.dtype
    part, rb, reduced_at = _layout(rows, n, dtype, W)
    parts = _parts(rows, W)
    stride = symm.MAX_FLAGS // (W + 1)  # flags d*stride + j: partials for d; W*stride + j: reduced chunks
    nch = min(chosen.chunks_for(info.slowest_link), stride)
    cuda = g.a.is_cuda
    main = torch.cuda.current_stream() if cuda else None
    side = comm.side_stream(g.device) if cuda else None

    def region(owner: int, writer: int, size: int) -> torch.Tensor:
        return call.buffer(owner, dtype, (size, n), offset=writer * rb)

    call.wait_slot_free(main)
    # ---- reduce-scatter: every part's GEMM into our region of its owner's buffer, peers first ------
    for i in range(1, W + 1):
        d = (r + i) % W
        lo_d, hi_d = parts[d]
        if hi_d == lo_d:
            continue
        if not cuda or d == r:
            dst = region(d, r, hi_d - lo_d)
            for j, (lo, hi) in enumerate(comm.chunk_bounds(hi_d - lo_d, nch)):
                g.into(lo_d + lo, lo_d + hi, dst[lo:hi])
                if d != r:
                    call.signal_ready(d * stride + j)
            continue
        staged = g.rows(lo_d, hi_d)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst = region(d, r, hi_d - lo_d)
            for j, (lo, hi) in enumerate(comm.chunk_bounds(hi_d - lo_d, nch)):
                dst[lo:hi].copy_(staged[lo:hi], non_blocking=True)
                call.signal_ready(d * stride + j, stream=side)
        staged.record_stream(side)
    # ---- our part: sum the regions in rank order into the heap, chunk by chunk, and flag it --------
    out = _empty(g, (rows, n))
    lo_r, hi_r = parts[r]
    own = hi_r - lo_r
    if own:
        mine = [region(r, s, own) for s in range(W)]
        reduced = call.buffer(r, dtype, (own, n), offset=reduced_at)
        for j, (lo, hi) in enumerate(comm.chunk_bounds(own, nch)):
            for s in range(W):
                if s != r:
                    call.wait_ready(s, r * stride + j, stream=main, chunk=j)
            _sum_in_rank_order([x[lo:hi] for x in mine], reduced[lo:hi])
            call.signal_ready(W * stride + j, stream=main)
        out[lo_r:hi_r].copy_(reduced)
    # ---- all-gather: pull every peer's reduced part ----------------------------------------------------
    _pull_parts(call, info, out, parts, reduced_at, stride, nch, main, side)
    return out


def _pull_parts(call, info, out, parts, reduced_at, stride, nch, main, side) -> None:
    """Copy every peer's reduced part (flags ``W*stride + j``) into `out`, then end the call.

    CPU (`side` None): copied in place by this thread. GPU: by the copy engine on `side`, each copy
    behind a stream-ordered wait on its chunk's flag.
    """
    W, r, n, dtype = info.world_size, info.rank, out.shape[1], out.dtype
    if side is not None:
        side.wait_stream(main)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for i in range(1, W):
            p = (r + i) % W
            lo_p, hi_p = parts[p]
            if hi_p == lo_p:
                continue
            src = call.buffer(p, dtype, (hi_p - lo_p, n), offset=reduced_at)
            for j, (lo, hi) in enumerate(comm.chunk_bounds(hi_p - lo_p, nch)):
                call.wait_ready(p, W * stride + j, stream=side, chunk=j)
                out[lo_p + lo : lo_p + hi].copy_(src[lo:hi], non_blocking=side is not None)
    if side is None:
        call.finish()
        return
    out.record_stream(side)
    main.wait_stream(side)
    call.finish(stream=main)


def _fused(cc: CallContext, call, g: Gemm):
    info = cc.info
    W, r, (rows, _), n, dtype = info.world_size, info.rank, g.a.shape, g.n, g.dtype
    heap = call.heap
    out = _empty(g, (rows, n))
    if cc.plan.one_shot:
        # One destination (our own buffer), then a reduction over every rank's buffer.
        rb = slots.region_bytes(rows, n, dtype)
        scatter_and_reduce(cc, call, g, out, block_rows=rows, dst_table=heap.tables.region_table(call.slot, r, rb, 1),
                           flag_index=0, src_table=heap.tables.ptr_table(call.slot), max_chunks=symm.MAX_FLAGS)
        return out
    part, rb, reduced_at = _layout(rows, n, dtype, W)
    parts = _parts(rows, W)
    stride = symm.MAX_FLAGS // (W + 1)
    lo_r, hi_r = parts[r]
    reduced = call.buffer(r, dtype, (max(hi_r - lo_r, 1), n), offset=reduced_at)[: hi_r - lo_r]
    scatter_and_reduce(cc, call, g, reduced, block_rows=part, dst_table=heap.tables.ptr_table(call.slot, r * rb),
                       flag_index=r * stride, src_table=heap.tables.region_table(call.slot, r, rb, W),
                       max_chunks=stride, flag_stride=stride)
    main = torch.cuda.current_stream() if g.a.is_cuda else None
    side = comm.side_stream(g.device) if g.a.is_cuda else None
    call.signal_ready(W * stride, stream=main)  # the whole reduced part at once: the kernel is one step
    out[lo_r:hi_r].copy_(reduced)
    _pull_parts(call, info, out, parts, reduced_at, stride, 1, main, side)
    return out


def _hierarchical(cc: CallContext, call, g: Gemm):
    """Across nodes (on one node the plan is ``symm``): `overlap.ops.tp.hierarchical_reduce.all_reduce` (two-shot)."""
    return hierarchical_reduce.all_reduce(cc, call, g)


STRATEGIES = {"reference": _reference, "pipelined": _pipelined, "symm": _symm, "fused": _fused,
              "hierarchical": _hierarchical}
