"""The all-gather half shared by the ops: every rank's rows of one tensor, arriving chunk by chunk.

`start` posts the whole gather at once and returns a `Gather`; `Gather.chunks` then yields the
gathered rows in a fixed order (this rank's own rows first, then ``rank+1``, ``rank+2``, ... and
each peer's chunks in order), each only once it has arrived. A consumer runs a GEMM per chunk while
the rest is in flight: ``all_gather_matmul``'s forward (one output row block per chunk), the weight
gradients of ``all_gather_matmul`` and ``matmul_reduce_scatter`` (one partial ``rows.T @ g`` per
chunk, summed in that fixed order, so the result is bitwise reproducible).

A consumer that needs every row at once (a weight gradient, which must round like one GEMM over
all rows) takes `Gather.gathered` after the chunks; the gather itself was still hidden behind the
GEMMs that ran while it was in flight.

Kinds (a strategy's transport):

* ``reference``: one ``all_gather_into_tensor``; a single chunk holding every row.
* ``pipelined``: a pairwise exchange (step i: receive from ``rank+i``, send to ``rank-i``, a shift,
  so every send meets its receive at the same step even where a backend serializes steps, as NCCL
  does), each step cut into ``num_chunks[link]`` pieces, all posted at once. On CPU ranks of one node the
  messages carry the call's tag and a header (`overlap.symm.p2p`: the steady state's check in the data).
* ``symm``: this rank's rows are copied into its heap slot and flagged; a copy engine (a worker
  thread on CPU ranks, a side stream on GPUs) pulls every peer's chunks into a local buffer. On CPU
  ranks a gather of at most `overlap.comm.INLINE_COPY_BYTES` is pulled by the calling thread instead,
  each chunk when `Gather.chunks` reaches it (a thread's wake-up costs more than such a copy).

Row coordinates are those of the gathered tensor ``[W*m, k]``: rank ``p``'s rows are ``p*m ... (p+1)*m``, or,
gathering a dim past the first, interleaved in runs (`overlap.ops.tp.rows.Rows`: every transfer lands in its
runs, and `Gather.chunks` yields one run at a time). The caller has made the call's handshake
(`CallContext.begin`) with `heap_bytes` bytes; `Gather.close` ends the call (always, also on error paths). The call's
`overlap.ops.context.CallContext` gives the group, the plan (its chunks per link), the deadline and the
op's name for errors.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import torch

from ... import comm, symm
from ...symm import p2p
from ..context import CallContext
from .hierarchical_gather import HierGather
from .rows import Rows


def heap_bytes(kind: str, x2: torch.Tensor) -> int:
    """Bytes of a heap slot a gather of `x2` needs (``hierarchical``, across nodes: the least the node's slot
    gets, `start`'s `need`; its gather adds what it needs itself)."""
    return x2.numel() * x2.element_size() if kind in ("symm", "hierarchical") else 0


class Gather:
    """A gather in flight. `chunks` yields ``(row_lo, row_hi, rows)``; `close` ends the call."""

    own_rows_in_full = False  # the transport leaves this rank's rows in x2 only

    def __init__(self, call, x2: torch.Tensor, cc: CallContext, rows: Rows | None = None):
        self.call, self.x2, self.cc, self.info = call, x2, cc, cc.info
        self.ro = Rows.flat(cc.world_size, x2.shape[0]) if rows is None else rows
        self.m = x2.shape[0]
        self.full: torch.Tensor | None = None
        self.pending: list = []  # what chunks() waits on, in yield order
        self.futures: list = []  # CPU copy-engine futures (drained by close)
        self.finished = False

    def chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        raise NotImplementedError

    def gathered(self) -> torch.Tensor:
        """The whole gathered tensor ``[W*m, k]``, once `chunks` has been consumed."""
        if not self.own_rows_in_full:
            for lo, hi, f_lo, f_hi in self.runs(self.info.rank):
                self.full[f_lo:f_hi].copy_(self.x2[lo:hi])
        return self.full

    def runs(self, p: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int, int]]:
        """Rank `p`'s rows ``lo ... hi`` as runs ``(lo, hi, full_lo, full_hi)`` of the gathered tensor."""
        return self.ro.split(p, lo, self.m if hi is None else hi)

    def own(self):
        """This rank's rows, run by run, from `x2` (they are not copied into the gathered tensor)."""
        for lo, hi, f_lo, f_hi in self.runs(self.info.rank):
            yield f_lo, f_hi, self.x2[lo:hi]

    def close(self) -> None:
        exchange = getattr(self, "exchange", None)
        if exchange is not None:  # (pipelined: what is left of its messages, on an error path; `overlap.symm.p2p`)
            exchange.abandon(sys.exc_info()[1])
        comm.drain(self.futures)
        if not self.finished:
            self.finished = True
            self.call.finish()


class _Reference(Gather):
    own_rows_in_full = True
    def post(self) -> None:
        W, ro, x2 = self.info.world_size, self.ro, self.x2
        self.full = full = x2.new_empty((W * self.m, x2.shape[1]))
        # One collective per outer block (each is rank-major): the rows land in place.
        self.works = [comm.all_gather_async(full[slice(*ro.block(o))], x2[o * ro.rows : (o + 1) * ro.rows],
                                            self.cc.pg) for o in range(ro.outer)]

    def chunks(self):
        for work in self.works:
            self.cc.wait(work, "any", "all_gather")
        yield 0, self.full.shape[0], self.full


class _Pipelined(Gather):
    """One message segment per run (a gather dim past the first: one per outer block, the plan's chunks shared
    among them), each cut into chunks for its link."""

    exchange: p2p.Exchange | None = None

    def post(self) -> None:
        cc, info, x2, m = self.cc, self.info, self.x2, self.m
        W, r, outer = info.world_size, info.rank, self.ro.outer
        self.full = full = x2.new_empty((W * m, x2.shape[1]))

        def chunks_for(link: str) -> int:
            return max(1, -(-cc.plan.chunks_for(link) // outer))

        if p2p.tagged(self.call):  # CPU ranks of one node: tagged messages with headers (`overlap.symm.p2p`)
            ex = self.exchange = p2p.Exchange(self.call, cc)
            for i in range(1, W):
                src, dst = (r + i) % W, (r - i) % W
                for lo, hi, _, _ in self.runs(dst):
                    ex.send(x2[lo:hi], dst, self._bounds(hi - lo, dst, chunks_for))
                for lo, hi, f_lo, f_hi in self.runs(src):
                    ex.expect(full[f_lo:f_hi], src, self._bounds(hi - lo, src, chunks_for))
            ex.arm(block=False)
            return
        for i in range(1, W):
            src, dst = (r + i) % W, (r - i) % W
            for (lo, hi, _, _), (_, _, f_lo, f_hi) in zip(self.runs(dst), self.runs(src), strict=True):
                posted = comm.exchange_chunked(x2[lo:hi], dst, full[f_lo:f_hi], src, chunks_for, info, cc.pg, cc.op)
                self.pending.extend((f_lo, j, got, works) for j, got, works in posted)

    def _bounds(self, rows: int, peer: int, chunks_for) -> list[tuple[int, int]] | None:
        if self.ro.outer == 1:
            return None  # (the plan's chunks for the link: `overlap.symm.p2p.Exchange`)
        return comm.chunk_bounds(rows, chunks_for(self.info.link_class(peer))) if rows else []

    def chunks(self):
        r, W = self.info.rank, self.info.world_size
        yield from self.own()
        if self.exchange is not None:
            for i in range(1, W):
                src = (r + i) % W
                for s, (_, _, base, _) in enumerate(self.runs(src)):
                    for _j, (lo, hi) in self.exchange.arrivals(src, s):
                        yield base + lo, base + hi, self.full[base + lo : base + hi]
            self.exchange.close()
            return
        for base, j, bounds, works in self.pending:
            for work, peer in works:  # the send of the same step too: its buffer is the caller's
                self.cc.wait(work, peer, j)
            if bounds is not None:
                lo, hi = bounds
                yield base + lo, base + hi, self.full[base + lo : base + hi]


def _pull(call: symm.Call, peer: int, runs: list, full: torch.Tensor, m: int, first: bool) -> None:
    if first:
        call.wait_ready(peer)
    src = call.buffer(peer, full.dtype, (m, full.shape[1]))
    for lo, hi, f_lo, f_hi in runs:
        full[f_lo:f_hi].copy_(src[lo:hi])


class _Symm(Gather):
    def post(self) -> None:
        call, info, x2, m = self.call, self.info, self.x2, self.m
        chunks_for = self.cc.plan.chunks_for
        W, r, k = info.world_size, info.rank, x2.shape[1]
        cuda = x2.is_cuda
        main = torch.cuda.current_stream() if cuda else None
        call.wait_slot_free(main)
        call.buffer(r, x2.dtype, (m, k)).copy_(x2)
        call.signal_ready(stream=main)
        self.full = full = x2.new_empty((W * m, k))
        if not cuda:
            # A small gather is pulled by this thread as `chunks` reaches each piece: handing it to the copy
            # engine's thread would cost more (a wake-up) than the copy it hides (`comm.INLINE_COPY_BYTES`).
            inline = comm.pulls_inline((W - 1) * x2.numel() * x2.element_size())
            engine = None if inline else comm.copy_engine()
            for i in range(1, W):
                p = (r + i) % W
                for j, (lo, hi) in enumerate(comm.chunk_bounds(m, chunks_for(info.link_class(p)))):
                    runs = self.runs(p, lo, hi)
                    args = (call, p, runs, full, m, j == 0)
                    if inline:
                        self.pending.append((runs, functools.partial(_pull, *args)))
                        continue
                    fut = engine.submit(_pull, *args)
                    self.futures.append(fut)
                    self.pending.append((runs, fut))
            return
        # GPU: copy-engine pulls on a side stream behind stream-ordered, bounded flag waits; the side
        # stream also ends the call (done flags) once every pull has been issued.
        side = comm.side_stream(x2.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for i in range(1, W):
                p = (r + i) % W
                call.wait_ready(p, stream=side)
                src = call.buffer(p, x2.dtype, (m, k))
                for lo, hi in comm.chunk_bounds(m, chunks_for(info.link_class(p))):
                    runs = self.runs(p, lo, hi)
                    for s_lo, s_hi, f_lo, f_hi in runs:
                        full[f_lo:f_hi].copy_(src[s_lo:s_hi], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    self.pending.append((runs, ev))
            call.finish(stream=side)
            self.finished = True
        full.record_stream(side)

    def chunks(self):
        yield from self.own()
        for runs, handle in self.pending:
            if self.x2.is_cuda:
                torch.cuda.current_stream().wait_event(handle)
            elif isinstance(handle, functools.partial):  # an inline pull (a small gather)
                handle()
            else:
                comm.result(handle, self.cc.timeout)
            for _, _, lo, hi in runs:
                yield lo, hi, self.full[lo:hi]


class _Blocks:
    """``hierarchical`` gathering a dim past the first: one `HierGather` per outer block (each block is rank-major),
    each begun when `chunks` reaches it. Not hidden across blocks (each block's node call has its own handshake),
    nor behind calls made before `chunks` (a backward's input gradient: its own calls take the heap's slots)."""

    def __init__(self, cc: CallContext, xcall, x2: torch.Tensor, ro: Rows, need: int):
        self.cc, self.xcall, self.x2, self.ro, self.need = cc, xcall, x2, ro, need
        self.full = x2.new_empty((ro.outer * ro.world * ro.rows, x2.shape[1]))
        self.current: HierGather | None = None

    def _begin(self, o: int) -> HierGather:
        ro, W = self.ro, self.ro.world
        lo, hi = ro.block(o)
        return HierGather(self.cc, self.xcall, self.x2[o * ro.rows : (o + 1) * ro.rows],
                          [(p * ro.rows, (p + 1) * ro.rows) for p in range(W)], full=self.full[lo:hi], need=self.need)

    def chunks(self):
        for o in range(self.ro.outer):
            if self.current is None:
                self.current = self._begin(o)
            base = self.ro.block(o)[0]
            for lo, hi, rows in self.current.chunks():
                yield base + lo, base + hi, rows
            self.current.close()
            self.current = None

    def gathered(self) -> torch.Tensor:
        return self.full

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
        self.xcall.finish()


def start(kind: str, call, x2: torch.Tensor, cc: CallContext, need: int = 0, rows: Rows | None = None) -> Gather:
    """Post the gather of `x2` (``[m, k]`` contiguous) over the group, its rows laid out as `rows` (default: rank
    ``p``'s at ``p*m``); see the module docstring.

    ``hierarchical`` (a group spanning nodes; on one node the plan is ``symm``): the rows through
    `overlap.ops.tp.hierarchical_gather.HierGather`, whose node slot holds `need` bytes at least (a call made while the
    gather is in flight fits in it)."""
    m = x2.shape[0]
    ro = Rows.flat(cc.world_size, m) if rows is None else rows
    if kind == "hierarchical":
        if ro.outer > 1:
            return _Blocks(cc, call, x2, ro, need)
        return HierGather(cc, call, x2, [(p * m, (p + 1) * m) for p in range(cc.world_size)], need=need, ends_call=True)
    if kind == "reference":
        g = _Reference(call, x2, cc, ro)
        g.post()
    elif kind in ("pipelined", "symm"):
        g = (_Pipelined if kind == "pipelined" else _Symm)(call, x2, cc, ro)
        try:
            g.post()
        except BaseException:
            g.close()
            raise
    else:
        raise AssertionError(kind)
    return g
