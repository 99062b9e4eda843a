"""all_gather_matmul: ``all_gather(a, dim=0) @ b``, with the gather hidden behind the GEMM.

Problem. In a column-parallel layer with sequence parallelism every rank holds ``a_MK`` (its
slice of the sequence) and a column shard ``b_KN`` of the weight; the layer needs
``[a_0; a_1; ...; a_{W-1}] @ b``. Gathering first and multiplying after leaves the GEMM idle
during the gather. Each rank's block of output rows only needs that rank's chunk, so the GEMM
can start on the local chunk at once and take every peer's chunk as it arrives.

Strategies (same results; `reference` is the oracle):

* ``reference``: ``all_gather_into_tensor``, then one GEMM.
* ``pipelined``: a pairwise exchange (step i: receive from ``rank+i``, send to ``rank-i``), each
  step split into ``num_chunks[link]`` pieces, all posted at once; the local GEMM runs while they
  fly, then each piece's GEMM as soon as it is received. Any backend, any topology.
* ``symm``: every rank copies its shard into its slot of the symmetric heap and flags it; a copy
  engine (a side stream on GPUs, a worker thread on CPU ranks) pulls peers' chunks into a local
  buffer, and the GEMM of each chunk waits only for that chunk. Ranks of one node.
* ``fused``: one Triton kernel (`overlap.kernels.ag_matmul`); each tile waits on the flag of the
  rank chunk it reads and loads it straight from that rank's buffer. Ranks of one node; on CPU
  ranks it runs interpreted (correct, slow: for tests at small sizes).

Autograd (Megatron's convention): ``grad_a = reduce_scatter(grad_out @ b.T)`` (sum),
``grad_b = all_gather(a).T @ grad_out`` for this rank's own shard ``b``. Like Megatron's sequence
parallelism, only the local shard is saved and it is gathered again in backward. The backward uses
plain collectives in this version.

Concurrency and aliasing: calls on one group are issued by one thread, in the same order on every
rank; ``a`` and ``b`` may alias each other and any other tensor (they are only read); the output is
a new tensor. A rank's shard is copied into the heap, so ``a`` may be modified once the call returns.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .. import plan as plan_mod
from .. import symm, world
from ..errors import OverlapTimeout
from ..plan import Plan
from . import _common as C

OP = "all_gather_matmul"


def all_gather_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    plan: Plan | dict | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """``all_gather(a, dim=0) @ b`` over `group`, overlapping the gather with the GEMM.

    Args:
        a: ``[m, ..., k]``, this rank's slice of dim 0 (the sequence of Megatron's ``[s, b, h]``).
        b: ``[k, n]``, any strides (a weight ``w[n, k]`` is passed as ``w.t()``).
        group: process group (default: the world); every rank of it must make the same call.
        strategy: ``"auto"`` (default), ``"reference"``, ``"pipelined"``, ``"symm"`` or ``"fused"``.
        plan: an `overlap.Plan` (overrides `strategy`'s defaults, e.g. chunk counts).
        timeout: seconds any wait on a peer may take (default ``OVERLAP_TIMEOUT_S``, 300).

    Returns:
        ``[world_size * m, ..., n]``: rank r's rows at ``r*m ... (r+1)*m - 1``.

    Raises:
        TypeError / ValueError: bad arguments (dims, dtypes, devices, plan), on this rank before
            any data moves; peers already in the call raise `OverlapMismatchError` at once.
        OverlapMismatchError: ranks made different calls (shapes, dtype, plan), on every rank.
        ValueError: ``symm``/``fused`` forced on a group that spans nodes.
        OverlapTimeout: a peer did not answer within `timeout`; the group is then unusable.
    """
    pg = world.resolve_group(group)
    error, chosen, sig = None, None, ""
    try:
        timeout = C.resolve_timeout(timeout)
    except ValueError as exc:
        error, timeout = C.InputError(exc), C.resolve_timeout(None)
    info = world.group_info(pg, timeout)
    # Everything below is local; a mistake is passed on to the peers through the handshake
    # (`begin_call` with `error`) so that no rank is left waiting in a call another rank left.
    try:
        if error is not None:
            raise error.exc
        a, b = C.autocast_inputs(a, b)
        C.check_matmul_operands(OP, a, b, info.device)
        chosen = plan_mod.as_plan(strategy, plan)
        rows = math.prod(a.shape[:-1])
        shape_sig = f"a={C.describe(a)}, b={tuple(b.shape)}"
        if chosen is None:
            chosen = plan_mod.resolve_auto(OP, shape_sig, info, rows, str(a.dtype).removeprefix("torch."))
        plan_mod.check_plan_fits(OP, chosen, info)
        if chosen.strategy == "fused":
            if a.dtype not in C.FUSED_DTYPES:
                raise TypeError(f"overlap.{OP}: the fused kernel supports {C.FUSED_DTYPES}, got {a.dtype}")
            try:
                C.kernels()  # import (and define) the Triton kernels before the handshake
            except RuntimeError as exc:
                raise ValueError(f"overlap.{OP}: strategy 'fused' is unavailable here: {exc}") from exc
        sig = f"{OP}({shape_sig}, plan={chosen.describe()})"
    except (TypeError, ValueError) as exc:
        error = C.InputError(exc)
    if error is not None:
        C.begin_call(OP, pg, info, sig, 0, timeout, error=error)  # raises error.exc
    with C.record(OP), torch.autocast(info.device.type, enabled=False):
        return _AllGatherMatmul.apply(a, b, pg, info, chosen, timeout, sig)


def _heap_bytes(chosen: Plan, a: torch.Tensor) -> int:
    """Bytes of one heap slot this call needs (0: the strategy uses no symmetric memory)."""
    return a.numel() * a.element_size() if chosen.strategy in ("symm", "fused") else 0


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, pg, info, chosen: Plan, timeout: float, sig: str):
        # The handshake comes first: nothing that can fail locally runs between it and the data.
        call = C.begin_call(OP, pg, info, sig, _heap_bytes(chosen, a), timeout)
        try:
            a2 = a.reshape(-1, a.shape[-1]).contiguous()
            out2 = STRATEGIES[chosen.strategy](call, a2, b, pg, info, chosen, timeout)
        except BaseException:
            call.finish()  # idempotent; keeps the slot protocol whole for the peers' next calls
            raise
        ctx.save_for_backward(a, b)
        ctx.pg, ctx.info, ctx.timeout = pg, info, timeout
        return out2.view(info.world_size * a.shape[0], *a.shape[1:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        pg, info, timeout = ctx.pg, ctx.info, ctx.timeout
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k, n = b.shape
        sig = f"{OP}.backward(a={C.describe(a)}, b={tuple(b.shape)}, grads={int(need_a)}{int(need_b)})"
        op = f"{OP}.backward"
        call = C.begin_call(op, pg, info, sig, 0, timeout)
        g2 = grad_out.reshape(-1, n)
        a2 = a.reshape(-1, k).contiguous()
        grad_a = grad_b = None
        with C.record(op):
            try:
                if need_b:
                    full = a2.new_empty((info.world_size * a2.shape[0], k))
                    work = C.all_gather_async(full, a2, pg)
                if need_a:
                    partial = torch.mm(g2, b.t())
                    grad_a2 = a2.new_empty(a2.shape)
                    rs = C.reduce_scatter_async(grad_a2, partial, pg)
                if need_b:
                    C.wait_work(work, op, info.rank, "any", "all_gather of a", timeout, info.device)
                    grad_b = torch.mm(full.t(), g2)
                if need_a:
                    C.wait_work(rs, op, info.rank, "any", "reduce_scatter of grad_a", timeout, info.device)
                    grad_a = grad_a2.view(a.shape)
            finally:
                call.finish()
        return grad_a, grad_b, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Forward strategies: (a2 [m, k] contiguous, b [k, n]) -> out [W*m, n]
# ----------------------------------------------------------------------------------------------


def _reference(call, a2, b, pg, info, chosen, timeout):
    try:
        full = a2.new_empty((info.world_size * a2.shape[0], a2.shape[1]))
        work = C.all_gather_async(full, a2, pg)
        C.wait_work(work, OP, info.rank, "any", "all_gather", timeout, info.device)
        return torch.mm(full, b)
    finally:
        call.finish()


def _pipelined(call, a2, b, pg, info, chosen, timeout):
    W, r, m = info.world_size, info.rank, a2.shape[0]
    full = a2.new_empty((W * m, a2.shape[1]))
    out = a2.new_empty((W * m, b.shape[1]))
    steps = []
    try:
        # Pairwise exchange: at step i every rank receives from r+i and sends to r-i (a shift, so
        # every send has its receive at the same step, also when a backend serializes steps, as
        # NCCL does). Each step is split into chunks for its link; all steps are posted at once and
        # the GEMM of a chunk waits only for that chunk.
        for i in range(1, W):
            src, dst = (r + i) % W, (r - i) % W
            recv_bounds = C.chunk_bounds(m, chosen.chunks_for(info.link_class(src)))
            send_bounds = C.chunk_bounds(m, chosen.chunks_for(info.link_class(dst)))
            for j in range(max(len(recv_bounds), len(send_bounds))):
                ops = []
                if j < len(recv_bounds):
                    lo, hi = recv_bounds[j]
                    ops.append(dist.P2POp(dist.irecv, full[src * m + lo : src * m + hi], info.global_ranks[src], pg))
                if j < len(send_bounds):
                    lo, hi = send_bounds[j]
                    ops.append(dist.P2POp(dist.isend, a2[lo:hi], info.global_ranks[dst], pg))
                works = dist.batch_isend_irecv(ops)
                steps.append((src, j, recv_bounds[j] if j < len(recv_bounds) else None, works))
        torch.mm(a2, b, out=out[r * m : (r + 1) * m])
        for src, j, bounds, works in steps:
            for work in works:
                C.wait_work(work, OP, r, src, j, timeout, info.device)
            if bounds is not None:
                lo, hi = bounds
                torch.mm(full[src * m + lo : src * m + hi], b, out=out[src * m + lo : src * m + hi])
        return out
    finally:
        call.finish()


def _pull(call: symm.Call, peer: int, lo: int, hi: int, dst: torch.Tensor, m: int, first: bool) -> None:
    if first:
        call.wait_ready(peer)
    src = call.buffer(peer, dst.dtype, (m, dst.shape[1]))
    dst.copy_(src[lo:hi])


def _symm(call, a2, b, pg, info, chosen, timeout):
    if info.device.type == "cuda":
        return _symm_cuda(call, a2, b, pg, info, chosen, timeout)
    W, r, (m, k) = info.world_size, info.rank, a2.shape
    futures = []
    try:
        call.wait_slot_free()
        call.buffer(r, a2.dtype, (m, k)).copy_(a2)
        call.signal_ready()
        full = a2.new_empty((W * m, k))
        out = a2.new_empty((W * m, b.shape[1]))
        engine = C.copy_engine()
        for i in range(1, W):
            p = (r + i) % W
            for j, (lo, hi) in enumerate(C.chunk_bounds(m, chosen.chunks_for(info.link_class(p)))):
                dst = full[p * m + lo : p * m + hi]
                futures.append((p, lo, hi, engine.submit(_pull, call, p, lo, hi, dst, m, j == 0)))
        torch.mm(a2, b, out=out[r * m : (r + 1) * m])
        for p, lo, hi, fut in futures:
            C.result(fut, timeout)
            torch.mm(full[p * m + lo : p * m + hi], b, out=out[p * m + lo : p * m + hi])
        return out
    finally:
        C.drain([f for *_, f in futures])
        call.finish()


def _symm_cuda(call, a2, b, pg, info, chosen, timeout):
    """GPU: copy-engine pulls on a side stream, stream-ordered flags and bounded waits.

    Not yet run on a GPU. A wait that passes its deadline is reported by the next call on the group.
    """
    W, r, (m, k) = info.world_size, info.rank, a2.shape
    main = torch.cuda.current_stream()
    side = _side_stream(a2.device)
    finished = False
    try:
        call.wait_slot_free(main)
        call.buffer(r, a2.dtype, (m, k)).copy_(a2)
        call.signal_ready(stream=main)
        full = a2.new_empty((W * m, k))
        out = a2.new_empty((W * m, b.shape[1]))
        side.wait_stream(main)
        events = []
        with torch.cuda.stream(side):
            for i in range(1, W):
                p = (r + i) % W
                call.wait_ready(p, stream=side)
                src = call.buffer(p, a2.dtype, (m, k))
                for lo, hi in C.chunk_bounds(m, chosen.chunks_for(info.link_class(p))):
                    full[p * m + lo : p * m + hi].copy_(src[lo:hi], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    events.append((p, lo, hi, ev))
            call.finish(stream=side)
            finished = True
        full.record_stream(side)
        torch.mm(a2, b, out=out[r * m : (r + 1) * m])
        for p, lo, hi, ev in events:
            main.wait_event(ev)
            torch.mm(full[p * m + lo : p * m + hi], b, out=out[p * m + lo : p * m + hi])
        return out
    finally:
        if not finished:  # keep the slot protocol whole so peers do not wait on us four calls later
            call.finish(stream=main)


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SIDE[index]


def _fused_tiles(chosen: Plan, interpreted: bool, dtype: torch.dtype) -> tuple[int, int, int]:
    if chosen.block_m:
        return chosen.block_m, chosen.block_n or chosen.block_m, chosen.block_k or 32
    if interpreted:
        return 32, 32, 32
    return (128, 128, 64) if dtype != torch.float32 else (128, 64, 32)


def _fused(call, a2, b, pg, info, chosen, timeout):
    kernel = C.kernels().all_gather_matmul_kernel
    interpreted = C.interpreted()
    W, r, (m, k), n = info.world_size, info.rank, a2.shape, b.shape[1]
    heap = call.heap
    try:
        call.wait_slot_free()
        call.buffer(r, a2.dtype, (m, k)).copy_(a2)
        call.signal_ready()
        out = a2.new_empty((W * m, n))
        # GPU: the kernel's error word is pinned host memory, checked by the next call without a
        # sync. CPU (interpreted): checked right after the kernel.
        err = heap.kernel_err() if a2.is_cuda else torch.zeros(1, dtype=torch.int32)
        abort = torch.zeros(1, dtype=torch.int32, device=a2.device)
        bm, bn, bk = _fused_tiles(chosen, interpreted, a2.dtype)
        grid = (W * triton_cdiv(m, bm) * triton_cdiv(n, bn),)
        guard = C.Watchdog(abort, timeout) if interpreted else contextlib.nullcontext()
        with guard:
            kernel[grid](
                out, b,
                heap.ptr_table(call.slot), heap.flag_table(call.slot, 0),
                call.word, r, W, abort, err, int(timeout * 1e9),
                m, n, k,
                k,
                b.stride(0), b.stride(1),
                out.stride(0), out.stride(1),
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                UPCAST=interpreted and a2.dtype == torch.bfloat16, INTERPRETED=interpreted,
            )
        bad = 0 if a2.is_cuda else int(err.item())
        if bad:
            raise OverlapTimeout(OP, r, bad - 1, f"rank chunk {bad - 1}", timeout, "fused kernel tile wait")
        return out
    finally:
        call.finish()


def triton_cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


STRATEGIES = {"reference": _reference, "pipelined": _pipelined, "symm": _symm, "fused": _fused}
