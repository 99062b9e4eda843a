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

Row coordinates are those of the gathered tensor ``[W*m, k]``: rank ``p``'s rows are
``p*m ... (p+1)*m``. The caller has made the call's handshake (`CallContext.begin`) with
`heap_bytes` bytes; `Gather.close` ends the call (always, also on error paths). The call's
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
from .hierarchical import HierGather


def heap_bytes(kind: str, x2: torch.Tensor) -> int:
    """Bytes of a heap slot a gather of `x2` needs (``hierarchical``, across nodes: the least the node's slot
    gets, `start`'s `need`; its gather adds what it needs itself)."""
    return x2.numel() * x2.element_size() if kind in ("symm", "hierarchical") else 0


class Gather:
    """A gather in flight. `chunks` yields ``(row_lo, row_hi, rows)``; `close` ends the call."""

    own_rows_in_full = False  # the transport leaves this rank's rows in x2 only

    def __init__(self, call, x2: torch.Tensor, cc: CallContext):
        self.call, self.x2, self.cc, self.info = call, x2, cc, cc.info
        self.m = x2.shape[0]
        self.full: torch.Tensor | None = None
        self.pending: list = []  # what chunks() waits on, in yield order
        self.futures: list = []  # CPU copy-engine futures (drained by close)
        self.finished = False

    def chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        raise NotImplementedError

    def gathered(self) -> torch.Tensor:
        """The whole gathered tensor ``[W*m, k]``, once `chunks` has been consumed."""
        r, m = self.info.rank, self.m
        if not self.own_rows_in_full:
            self.full[r * m : (r + 1) * m].copy_(self.x2)
        return self.full

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
        W = self.info.world_size
        self.full = self.x2.new_empty((W * self.m, self.x2.shape[1]))
        self.work = comm.all_gather_async(self.full, self.x2, self.cc.pg)

    def chunks(self):
        self.cc.wait(self.work, "any", "all_gather")
        yield 0, self.full.shape[0], self.full


class _Pipelined(Gather):
    exchange: p2p.Exchange | None = None

    def post(self) -> None:
        cc, info, x2, m = self.cc, self.info, self.x2, self.m
        W, r = info.world_size, info.rank
        self.full = full = x2.new_empty((W * m, x2.shape[1]))
        if p2p.tagged(self.call):  # CPU ranks of one node: tagged messages with headers (`overlap.symm.p2p`)
            ex = self.exchange = p2p.Exchange(self.call, cc)
            for i in range(1, W):
                src, dst = (r + i) % W, (r - i) % W
                ex.send(x2, dst)
                ex.expect(full[src * m : (src + 1) * m], src)
            ex.arm(block=False)
            return
        for i in range(1, W):
            src, dst = (r + i) % W, (r - i) % W
            posted = comm.exchange_chunked(x2, dst, full[src * m : (src + 1) * m], src, cc.plan.chunks_for, info,
                                           cc.pg, cc.op)
            self.pending.extend((src, j, got, works) for j, got, works in posted)

    def chunks(self):
        r, m = self.info.rank, self.m
        yield r * m, (r + 1) * m, self.x2
        if self.exchange is not None:
            for i in range(1, self.info.world_size):
                src = (r + i) % self.info.world_size
                for _j, (lo, hi) in self.exchange.arrivals(src):
                    yield src * m + lo, src * m + hi, self.full[src * m + lo : src * m + hi]
            self.exchange.close()
            return
        for src, j, bounds, works in self.pending:
            for work, peer in works:  # the send of the same step too: its buffer is the caller's
                self.cc.wait(work, peer, j)
            if bounds is not None:
                lo, hi = bounds
                yield src * m + lo, src * m + hi, self.full[src * m + lo : src * m + hi]


def _pull(call: symm.Call, peer: int, lo: int, hi: int, dst: torch.Tensor, m: int, first: bool) -> None:
    if first:
        call.wait_ready(peer)
    src = call.buffer(peer, dst.dtype, (m, dst.shape[1]))
    dst.copy_(src[lo:hi])


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
            inline = (W - 1) * x2.numel() * x2.element_size() <= comm.INLINE_COPY_BYTES
            engine = None if inline else comm.copy_engine()
            for i in range(1, W):
                p = (r + i) % W
                for j, (lo, hi) in enumerate(comm.chunk_bounds(m, chunks_for(info.link_class(p)))):
                    args = (call, p, lo, hi, full[p * m + lo : p * m + hi], m, j == 0)
                    if inline:
                        self.pending.append((p * m + lo, p * m + hi, functools.partial(_pull, *args)))
                        continue
                    fut = engine.submit(_pull, *args)
                    self.futures.append(fut)
                    self.pending.append((p * m + lo, p * m + hi, fut))
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
                    full[p * m + lo : p * m + hi].copy_(src[lo:hi], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    self.pending.append((p * m + lo, p * m + hi, ev))
            call.finish(stream=side)
            self.finished = True
        full.record_stream(side)

    def chunks(self):
        r, m = self.info.rank, self.m
        yield r * m, (r + 1) * m, self.x2
        for lo, hi, handle in self.pending:
            if self.x2.is_cuda:
                torch.cuda.current_stream().wait_event(handle)
            elif isinstance(handle, functools.partial):  # an inline pull (a small gather)
                handle()
            else:
                comm.result(handle, self.cc.timeout)
            yield lo, hi, self.full[lo:hi]


def start(kind: str, call, x2: torch.Tensor, cc: CallContext, need: int = 0) -> Gather:
    """Post the gather of `x2` (``[m, k]`` contiguous) over the group; see the module docstring.

    ``hierarchical`` (a group spanning nodes; on one node the plan is ``symm``): the rows through
    `overlap.ops.tp.hierarchical.HierGather`, whose node slot holds `need` bytes at least (a call made while the
    gather is in flight fits in it)."""
    if kind == "hierarchical":
        m = x2.shape[0]
        return HierGather(cc, x2, [(p * m, (p + 1) * m) for p in range(cc.world_size)], need=need)
    if kind == "reference":
        g = _Reference(call, x2, cc)
        g.post()
    elif kind in ("pipelined", "symm"):
        g = (_Pipelined if kind == "pipelined" else _Symm)(call, x2, cc)
        try:
            g.post()
        except BaseException:
            g.close()
            raise
    else:
        raise AssertionError(kind)
    return g
