"""`Call`: one call's view of a group's symmetric heap: its epoch, its slot, and the flag operations on them.

CPU ranks: host stores and bounded host waits on the control pads. GPU ranks: stream-ordered writes
and bounded waits (``overlap._C``) on the device flag words, so the host never blocks on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OverlapTimeout
from .layout import NUM_SLOTS, signals


class Call:
    """One call's view of the heap: its epoch, its slot, and the flag operations on them.

    Calls that use no heap data (``uses_heap`` False) make every flag operation a no-op. `heap` is the
    group's `overlap.symm.heap.SymmHeap` (which creates its calls, so this module does not import it).
    """

    def __init__(self, heap: Any, op: str, epoch: int, timeout: float, uses_heap: bool = True,
                 prev_data_epoch: int = 0, need: int = 0):
        self.heap, self.op, self.epoch, self.timeout = heap, op, epoch, timeout
        # The largest slot size any rank asked for in this call (the same on every rank): ops whose
        # ranks need different amounts (MoE: token counts differ) lay the slot out from it.
        self.need = need
        self.word = epoch  # the int32 flag value of this call (< REBASE_EPOCH)
        self.slot = epoch % NUM_SLOTS
        self.rank, self.world_size = heap.rank, heap.world_size
        self.uses_heap, self.prev_data_epoch = uses_heap, prev_data_epoch
        self._finished = False

    def buffer(self, peer: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        return self.heap.slot_tensor(peer, self.slot, dtype, shape, offset)

    def epoch_word(self) -> torch.Tensor:
        """This call's epoch as the int32 ``[1]`` tensor on the heap's device that the fused kernels read.

        Written now on the current stream (a fill; on CPU a plain store), so launch the kernels on this
        stream. It is the slot's word: call it after `wait_slot_free` (the next call on the slot rewrites it
        only once every rank, this one included, has finished this call, after its kernels in stream order).
        """
        word = self.heap.epoch_words[self.slot : self.slot + 1]
        word.fill_(self.word)
        return word

    # Flag operations. CPU ranks: host stores and bounded host waits on the control pads.
    # GPU ranks: stream-ordered writes and waits (``overlap._C``) on the device flag words, on
    # `stream` (default: the current stream), so the host never blocks on the device.
    def _cuda(self) -> bool:
        return self.heap.device.type == "cuda"

    def _flag_addr(self, owner: int, word: int) -> int:
        h = self.heap
        return h._cuda_flags.addrs(word)[owner] if self._cuda() else h.ctrl_addr(owner, word)

    def wait_slot_free(self, stream: Any = None) -> None:
        """Wait until every rank has finished the previous call that used this slot's data."""
        prev = self.prev_data_epoch
        if prev <= 0 or not self.uses_heap:
            return
        h = self.heap
        addrs = [self._flag_addr(h.rank, h.done_word(self.slot, q)) for q in range(self.world_size)]
        if self._cuda():
            for q, addr in enumerate(addrs):
                self._bounded_wait(addr, prev, q, stream)
            return
        missing = signals().signal_wait_all(addrs, prev, self.timeout)
        if missing >= 0:
            raise OverlapTimeout(self.op, self.rank, missing, f"slot {self.slot}", self.timeout,
                                 "the peer did not finish the slot's previous call")

    def _bounded_wait(self, addr: int, value: int, peer: int, stream: Any) -> None:
        # A one-thread kernel that spins with a %globaltimer limit and, past it, records the
        # failure in pinned memory (checked by the next call) instead of blocking the stream forever.
        signals().cuda_wait_flag_bounded(addr, value, int(self.timeout * 1e9), self.heap.err_addr(peer),
                                    stream_handle(stream))

    def signal_ready(self, index: int = 0, stream: Any = None) -> None:
        h = self.heap
        addr = self._flag_addr(h.rank, h.ready_word(self.slot, index))
        if self._cuda():
            signals().cuda_stream_write_value32(addr, self.word, stream_handle(stream))
        else:
            signals().signal_store(addr, self.word)

    def wait_ready(self, peer: int, index: int = 0, stream: Any = None, chunk: int | None = None) -> None:
        """Wait for `peer`'s ready flag `index` of this call; a timeout names `chunk` (default: `index`)."""
        h = self.heap
        addr = self._flag_addr(peer, h.ready_word(self.slot, index))
        if self._cuda():
            self._bounded_wait(addr, self.word, peer, stream)
        elif not signals().signal_wait(addr, self.word, self.timeout):
            raise OverlapTimeout(self.op, self.rank, peer, index if chunk is None else chunk, self.timeout,
                                 "data never signalled ready")

    def finish(self, stream: Any = None) -> None:
        """Tell every rank (this one included) that this rank is done with the slot.

        Once per call: later calls are no-ops (a strategy that ends the call on a side stream, after
        its last read of a peer's buffer, must not be followed by an earlier-ordered write).
        """
        if self._finished or not self.uses_heap:
            return
        self._finished = True
        self.heap.in_flight -= 1
        h = self.heap
        for q in range(self.world_size):
            addr = self._flag_addr(q, h.done_word(self.slot, self.rank))
            if self._cuda():
                signals().cuda_stream_write_value32(addr, self.word, stream_handle(stream))
            else:
                signals().signal_store(addr, self.word)


def stream_handle(stream: Any) -> int:
    """The raw handle of `stream` (default: the current stream) for ``overlap._C``'s stream-ordered calls."""
    if stream is None:
        stream = torch.cuda.current_stream()
    return int(stream.cuda_stream)
