"""The sequence-parallel transfers through the symmetric heap (``symm``): each block goes straight into its
destination's slot and is flagged per chunk of rows, as the tensor-parallel scatter does.

Slot layout (`overlap.kernels.slots.region_bytes`): ``W`` regions of ``[m, C]`` row-major, region ``s`` holding what
source ``s`` sent to this rank. Producer ``s``'s ready flag ``d * F + j`` (``F`` = `slots.flags_per_peer`) says
"chunk ``j`` of my block for ``d`` is in ``d``'s region ``s``"; chunks are runs of rows (`comm.chunk_bounds` of ``m``
into the plan's count for the slowest link, at most ``F``).

* `scatter` (`overlap.matmul_all_to_all`'s forward, `overlap.all_to_all_matmul`'s input gradient): CPU ranks
  compute each destination's columns chunk by chunk straight into its slot (destinations from ``rank + 1``, this
  rank's own block last) and flag each chunk; then wait for every source's chunks and copy the regions out (the
  slot is the next call's). GPU ranks compute each block on the current stream and a side stream copies it into
  the destination's slot and flags it (stream-ordered flags; not yet run on a GPU).
* `gather` (`overlap.all_to_all_matmul`'s forward, `overlap.matmul_all_to_all`'s input gradient): every block is
  copied into its destination's slot and flagged per chunk; this rank multiplies its own block first, then each
  source's chunks as their flags arrive (sources in step order), the partial products summed in rank order (16-bit
  in fp32, rounded once): the same result whatever the order of arrival.
"""

from __future__ import annotations

import contextlib

import torch

from ... import comm
from ...errors import OverlapTimeout
from ...kernels import slots
from .. import fused
from ..context import CallContext
from ..sums import sum_in_order


def slot_bytes(m: int, C: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one heap slot of a call moving ``[m, C]`` blocks between `world_size` ranks."""
    return world_size * slots.region_bytes(m, C, dtype)


class _Slot:
    """One call's view of the slot: regions, flags and chunks (module docstring)."""

    def __init__(self, cc: CallContext, call, m: int, C: int, dtype: torch.dtype):
        self.cc, self.call, self.m, self.C, self.dtype = cc, call, m, C, dtype
        self.W, self.r = cc.world_size, cc.rank
        self.rb = slots.region_bytes(m, C, dtype)
        self.F = slots.flags_per_peer(self.W)
        self.bounds = comm.chunk_bounds(m, min(cc.plan.chunks_for(cc.info.slowest_link), self.F))

    def region(self, owner: int, writer: int) -> torch.Tensor:
        """`writer`'s ``[m, C]`` region in `owner`'s slot."""
        return self.call.buffer(owner, self.dtype, (self.m, self.C), offset=writer * self.rb)

    def signal(self, d: int, j: int, stream=None) -> None:
        self.call.signal_ready(d * self.F + j, stream=stream)

    def wait(self, s: int, j: int, stream=None) -> None:
        self.call.wait_ready(s, self.r * self.F + j, stream=stream, chunk=j)

    def sources(self) -> list[int]:
        """The peers in step order (``r - 1``, ``r - 2``, ...: the order their blocks were sent in)."""
        return [(self.r - i) % self.W for i in range(1, self.W)]


def scatter(cc: CallContext, call, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[W, m, C]``: block ``s`` = source ``s``'s ``a @ b[:, r*C:(r+1)*C]``, through the slots."""
    W = cc.world_size
    sl = _Slot(cc, call, a.shape[0], b.shape[1] // W, a.dtype)
    r, C = sl.r, sl.C

    def cols(d: int) -> torch.Tensor:
        return b[:, d * C : (d + 1) * C]

    out = torch.empty((W, sl.m, C), dtype=a.dtype, device=a.device)
    if a.device.type == "cuda":
        return _scatter_cuda(sl, a, cols, out)
    call.wait_slot_free()
    for i in range(1, W + 1):  # the peers' blocks first, our own last
        d = (r + i) % W
        dst = sl.region(d, r)
        for j, (lo, hi) in enumerate(sl.bounds):
            torch.mm(a[lo:hi], cols(d), out=dst[lo:hi])
            if d != r:
                sl.signal(d, j)
    out[r].copy_(sl.region(r, r))
    for s in sl.sources():
        src = sl.region(r, s)
        for j, (lo, hi) in enumerate(sl.bounds):
            sl.wait(s, j)
            out[s, lo:hi].copy_(src[lo:hi])
    return out


def _scatter_cuda(sl: _Slot, a: torch.Tensor, cols, out: torch.Tensor) -> torch.Tensor:
    """GPU: each block's GEMM on the current stream, a side stream copies it into its destination's slot and flags
    each chunk; the regions copied out once every source's flags have arrived (stream-ordered waits, each bounded
    by the host watchdog). Not yet run on a GPU."""
    call, W, r = sl.call, sl.W, sl.r
    main = torch.cuda.current_stream()
    side = comm.side_stream(a.device)
    call.wait_slot_free(main)
    for i in range(1, W):
        d = (r + i) % W
        part = torch.mm(a, cols(d))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst = sl.region(d, r)
            for j, (lo, hi) in enumerate(sl.bounds):
                dst[lo:hi].copy_(part[lo:hi], non_blocking=True)
                sl.signal(d, j, stream=side)
        part.record_stream(side)
    torch.mm(a, cols(r), out=out[r])
    for s in sl.sources():
        for j, (lo, hi) in enumerate(sl.bounds):
            sl.wait(s, j, stream=main)
            out[s, lo:hi].copy_(sl.region(r, s)[lo:hi])
    main.wait_stream(side)  # our copies into the peers' slots are part of this call too
    call.finish(stream=main)
    return out


def gather(cc: CallContext, call, sends: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [m, n], gathered [W, m, C])``: ``out`` = the gathered rows times ``b`` (row block ``s`` for source
    ``s``), each source's chunks multiplied as their flags arrive, the partials summed in rank order."""
    W, (_, m, C) = cc.world_size, sends.shape
    sl = _Slot(cc, call, m, C, sends.dtype)
    r = sl.r
    main = side = None
    if sends.device.type == "cuda":  # (not yet run on a GPU)
        main, side = torch.cuda.current_stream(), comm.side_stream(sends.device)
    call.wait_slot_free(main)
    for i in range(1, W):  # every block into its destination's slot, flagged per chunk
        d = (r + i) % W
        if side is not None:
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            dst = sl.region(d, r)
            for j, (lo, hi) in enumerate(sl.bounds):
                dst[lo:hi].copy_(sends[d, lo:hi], non_blocking=side is not None)
                sl.signal(d, j, stream=side)
    if side is not None:
        sends.record_stream(side)
    gathered = torch.empty_like(sends)
    parts = torch.empty((W, m, b.shape[1]), dtype=sends.dtype, device=sends.device)
    gathered[r].copy_(sends[r])
    torch.mm(sends[r], b[r * C : (r + 1) * C], out=parts[r])
    for s in sl.sources():
        src, rows = sl.region(r, s), b[s * C : (s + 1) * C]
        for j, (lo, hi) in enumerate(sl.bounds):
            sl.wait(s, j, stream=main)
            torch.mm(src[lo:hi], rows, out=parts[s, lo:hi])
            gathered[s, lo:hi].copy_(src[lo:hi])
    out = torch.empty((m, b.shape[1]), dtype=sends.dtype, device=sends.device)
    sum_in_order(list(parts.unbind(0)), out, 0, m)  # rank order, one rounding
    if side is not None:
        main.wait_stream(side)
        call.finish(stream=main)
    return out, gathered



# ----------------------------------------------------------------------------------------------
# fused: the Triton kernels of `overlap.kernels.matmul_all_to_all` and `overlap.kernels.all_to_all_matmul` on the
# same slot (their chunks: runs of row tiles, `slots.sp_chunk_rows`)
# ----------------------------------------------------------------------------------------------


class _Kernel:
    """What a fused call's launches share: the tile, the chunks, the epoch word, the error word and the tables."""

    def __init__(self, sl: _Slot, like: torch.Tensor):
        cc, call = sl.cc, sl.call
        self.sl, self.heap = sl, call.heap
        plan = cc.plan
        bm, bn, bk = fused.fused_tiles(plan.block_m, plan.block_n, plan.block_k, fused.interpreted(), like.dtype)
        self.block = (bm, bn, bk)
        self.nch = fused.kernels().matmul_all_to_all.chunk_count(plan.chunks_for(cc.info.slowest_link), sl.F, sl.m, bm)
        self.timeout_ns = int(cc.timeout * 1e9)
        # GPU: the error word is pinned host memory, checked by the next call without a sync; CPU (interpreted): here
        self.err = self.heap.kernel_err() if like.is_cuda else torch.zeros(1, dtype=torch.int32)

    def mine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src_table, flag_table)``: the regions of this rank's slot and each source's flag of chunk 0 for it."""
        sl, tables, slot = self.sl, self.heap.tables, self.sl.call.slot
        return tables.region_table(slot, sl.r, sl.rb, sl.W), tables.flag_table(slot, sl.r * sl.F)

    def rows(self, chunk: int) -> range:
        return slots.sp_chunk_rows(self.sl.m, self.block[0], self.nch, chunk)

    def check(self, what: str) -> None:
        bad = 0 if self.err.is_cuda else int(self.err.item())
        if bad:
            cc = self.sl.cc
            raise OverlapTimeout(cc.op, cc.rank, bad - 1, what, cc.timeout, "fused kernel's wait")


def scatter_fused(cc: CallContext, call, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`scatter` in two kernels: the GEMM stores each destination's columns in its slot and flags them per chunk;
    the gather copies every source's region out of this rank's slot as its chunks' flags arrive."""
    W = cc.world_size
    sl = _Slot(cc, call, a.shape[0], b.shape[1] // W, a.dtype)
    k = _Kernel(sl, a)
    kernels = fused.kernels().matmul_all_to_all
    heap, slot = call.heap, call.slot
    call.wait_slot_free()
    counters = heap.tables.counters(slot)
    if not a.is_cuda:
        counters.zero_()  # (an interpreted kernel can stop half-way on an exception; a memset is free here)
    epoch = call.epoch_word()  # (after wait_slot_free: the slot's word)
    kernels.launch_matmul_all_to_all(a.contiguous(), b, heap.tables.ptr_table(slot, sl.r * sl.rb), counters,
                                     heap.tables.flag_table(slot, 0), num_chunks=k.nch, flag_stride=sl.F, epoch=epoch,
                                     rank=sl.r, block=k.block)
    out = torch.empty((W, sl.m, sl.C), dtype=a.dtype, device=a.device)
    src_table, flag_table = k.mine()
    kernels.launch_gather_blocks(out, src_table, flag_table, num_chunks=k.nch, epoch=epoch, err=k.err,
                                 timeout_ns=k.timeout_ns, block=k.block[:2])
    k.check("a block of heads")
    return out


def gather_fused(cc: CallContext, call, sends: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather` with the consumer in one kernel: every block (this rank's own too) copied into its destination's slot
    and flagged per chunk of the kernel's row tiles; the kernel multiplies each source's rows by its rows of ``b``
    once their flag is there, sources in rank order into one fp32 accumulator (bitwise repeatable)."""
    W, (_, m, C) = cc.world_size, sends.shape
    sl = _Slot(cc, call, m, C, sends.dtype)
    k = _Kernel(sl, sends)
    r = sl.r
    main = side = None
    if sends.is_cuda:  # (not yet run on a GPU)
        main, side = torch.cuda.current_stream(), comm.side_stream(sends.device)
    call.wait_slot_free(main)
    epoch = call.epoch_word()
    for i in range(1, W + 1):  # the peers' blocks first, our own last; flagged per chunk of the kernel's rows
        d = (r + i) % W
        if side is not None:
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            dst = sl.region(d, r)
            for j in range(k.nch):
                rows = k.rows(j)
                dst[rows.start : rows.stop].copy_(sends[d, rows.start : rows.stop], non_blocking=side is not None)
                sl.signal(d, j, stream=side)
    if side is not None:
        sends.record_stream(side)
    out = torch.empty((m, b.shape[1]), dtype=sends.dtype, device=sends.device)
    src_table, flag_table = k.mine()
    fused.kernels().all_to_all_matmul.launch_all_to_all_matmul(out, src_table, flag_table, b, num_chunks=k.nch,
                                                               epoch=epoch, err=k.err, timeout_ns=k.timeout_ns,
                                                               block=k.block)
    k.check("a block of heads")
    gathered = torch.empty_like(sends)  # (every flag seen by the kernel: the regions are whole)
    for s in range(W):
        gathered[s].copy_(sl.region(r, s))
    if side is not None:
        main.wait_stream(side)
        call.finish(stream=main)
    return out, gathered
