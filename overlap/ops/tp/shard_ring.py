"""Every rank's shard of a weight, streamed through a two-shard local ring (the ``symm`` weight gather).

`all_gather_weight_matmul` multiplies by every rank's block of a weight, one block after another, and needs no
block once its GEMMs have run. So ``symm`` never materializes the whole weight: this rank's shard ``x2``
(``[n, k]``, rows of the weight ``w``) is copied into its heap slot and flagged once; a copy engine (a worker thread on
CPU ranks, or the calling thread itself for a small weight, `overlap.comm.pulls_inline`; a side stream on GPUs)
pulls peer ``rank+1``'s shard, in chunks for the link to it, into one of two local buffers while the GEMMs read
the other, then ``rank+2``'s into the first once its GEMMs are done, and so on (two ranks: one buffer, there is
one peer). Each peer's shard is read from that peer once per call.

`ShardRing.chunks` yields ``(lo, hi, rows)`` in a fixed order: this rank's own rows first (``x2`` itself),
then each peer's chunks from ``rank+1`` on, each only once it has arrived; ``lo, hi`` are rows of the
whole weight ``[W*n, k]`` (rank ``p``'s at ``p*n ... (p+1)*n``). A yielded ``rows`` is valid until the
consumer asks for the chunks of the peer after next (the buffer is then refilled). The caller made the
call's handshake with `heap_bytes`; `ShardRing.close` ends the call (always, also on error paths).

The rows may be of any dtype: with the fp8 recipe they are the shard's rows packed with their scales (uint8,
`overlap.ops.fp8_rows.Packed`), and each pull moves a row's scales with it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from ... import comm, symm
from ..context import CallContext


def heap_bytes(x2: torch.Tensor) -> int:
    """Bytes of a heap slot the ring of `x2` needs: this rank's shard."""
    return x2.numel() * x2.element_size()


def _pull(call: symm.Call, peer: int, lo: int, hi: int, dst: torch.Tensor, n: int, first: bool) -> None:
    if first:
        call.wait_ready(peer)
    dst.copy_(call.buffer(peer, dst.dtype, (n, dst.shape[1]))[lo:hi])


class ShardRing:
    """The gather in flight. `chunks` yields ``(lo, hi, rows)``; `bytes_from_peers` counts what was pulled."""

    def __init__(self, call, x2: torch.Tensor, cc: CallContext):
        self.call, self.x2, self.cc, self.info = call, x2, cc, cc.info
        self.n, self.k = x2.shape
        self.cuda = x2.is_cuda
        self.ring = x2.new_empty((min(2, cc.world_size - 1), self.n, self.k)) if cc.world_size > 1 else None
        # CPU ranks: a small weight is pulled by this thread as `chunks` reaches each piece: handing it to the copy
        # engine's thread would cost more (a wake-up) than the copy it hides (`comm.pulls_inline`).
        self.inline = not self.cuda and comm.pulls_inline((cc.world_size - 1) * x2.numel() * x2.element_size())
        self.futures: list = []  # CPU copy-engine futures (drained by close)
        self.finished = False
        self.bytes_from_peers = 0

    def post(self) -> None:
        call, r = self.call, self.info.rank
        main = torch.cuda.current_stream() if self.cuda else None
        call.wait_slot_free(main)
        call.buffer(r, self.x2.dtype, (self.n, self.k)).copy_(self.x2)
        call.signal_ready(stream=main)
        self.side = comm.side_stream(self.x2.device) if self.cuda else None
        self.pending = {1: self._issue(1)} if self.cc.world_size > 1 else {}

    def _issue(self, i: int) -> list:
        """Issue the pulls of peer ``rank+i`` into its ring buffer: ``[(lo, hi, handle)]``."""
        info, call, n = self.info, self.call, self.n
        p = (info.rank + i) % info.world_size
        dst = self._buffer(i)
        bounds = comm.chunk_bounds(n, self.cc.plan.chunks_for(info.link_class(p)))
        self.bytes_from_peers += self.x2.numel() * self.x2.element_size()
        out = []
        if not self.cuda:
            engine = None if self.inline else comm.copy_engine()
            for j, (lo, hi) in enumerate(bounds):
                args = (call, p, lo, hi, dst[lo:hi], n, j == 0)
                if self.inline:
                    out.append((p * n + lo, p * n + hi, functools.partial(_pull, *args)))
                    continue
                fut = engine.submit(_pull, *args)
                self.futures.append(fut)
                out.append((p * n + lo, p * n + hi, fut))
            return out
        # GPU: the buffer is free once the main stream's GEMMs of peer i-2 (issued already) are done.
        main, side = torch.cuda.current_stream(), self.side
        side.wait_stream(main)
        with torch.cuda.stream(side):
            call.wait_ready(p, stream=side)
            src = call.buffer(p, self.x2.dtype, (n, self.k))
            for lo, hi in bounds:
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
                out.append((p * n + lo, p * n + hi, ev))
            if i == info.world_size - 1:  # every pull issued: this rank is done with the slot
                call.finish(stream=side)
                self.finished = True
        self.ring.record_stream(side)
        return out

    def _buffer(self, i: int) -> torch.Tensor:
        """The ring buffer of peer ``rank+i`` (``i >= 1``): peers i and i+1 never share one."""
        return self.ring[(i - 1) % self.ring.shape[0]]

    def chunks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        W, r, n = self.info.world_size, self.info.rank, self.n
        yield r * n, (r + 1) * n, self.x2
        for i in range(1, W):
            mine = self.pending.pop(i)
            if i + 1 < W:  # the next peer's pulls go into the other buffer, whose GEMMs have all been issued
                self.pending[i + 1] = self._issue(i + 1)
            base = ((r + i) % W) * n
            for lo, hi, handle in mine:
                if self.cuda:
                    torch.cuda.current_stream().wait_event(handle)
                elif self.inline:
                    handle()
                else:
                    comm.result(handle, self.cc.timeout)
                yield lo, hi, self._buffer(i)[lo - base : hi - base]

    def close(self) -> None:
        comm.drain(self.futures)
        if not self.finished:
            self.finished = True
            self.call.finish()


def start(call, x2: torch.Tensor, cc: CallContext) -> ShardRing:
    """Post the ring gather of `x2` (``[n, k]`` contiguous, this rank's rows of the weight)."""
    ring = ShardRing(call, x2, cc)
    try:
        ring.post()
    except BaseException:
        ring.close()
        raise
    return ring
