"""`Call`: one call's view of a group's symmetric heap: its epoch, its slot, and the flag operations on them.

CPU ranks: host stores and bounded host waits on the control pads. GPU ranks: stream-ordered writes and
waits (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``, no SM, no kernel) on the same control-pad words,
registered as mapped host memory, so the host never blocks on the device; each wait is bounded by the host
watchdog (``overlap._C.watchdog_arm``), which at the deadline reports the peer and releases the stream by
writing the word itself (a GPU queue blocked by a stream wait is released by nothing else).

Ordering (docs/protocol.md, "Waits on GPUs"): with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream of a
process feeds one hardware queue in host order, so a wait enqueued before this rank's own publish of the same
phase would hold that publish back. Every GPU pipeline enqueues the publishes of a phase before any wait of that
phase (`overlap.ops` pipelines; tests/gpu/cpu/test_symm_stream_order.py records it).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..errors import OverlapError, OverlapTimeout
from . import handshake
from .layout import NUM_SLOTS, W_ASYNC_ERR, signals


class Call:
    """One call's view of the heap: its epoch, its slot, and the flag operations on them.

    Calls that use no heap data (``uses_heap`` False) make every flag operation a no-op. `heap` is the
    group's `overlap.symm.heap.SymmHeap` (which creates its calls, so this module does not import it).
    """

    def __init__(self, heap: Any, op: str, epoch: int, timeout: float, uses_heap: bool = True,
                 prev_data_epoch: int = 0, need: int = 0, check: handshake.SignatureCheck | None = None,
                 signature: str = "", sig: tuple[int, int] = (0, 0)):
        self.heap, self.op, self.epoch, self.timeout = heap, op, epoch, timeout
        # The call's signature as every rank agreed on it (its text and 64-bit hash as two int32 words): the
        # point-to-point messages of `overlap.symm.p2p` carry the hash.
        self.signature, self.sig = signature, sig
        # The largest slot size any rank asked for in this call (the same on every rank): ops whose
        # ranks need different amounts (MoE: token counts differ) lay the slot out from it.
        self.need = need
        self.word = epoch  # the int32 flag value of this call (< REBASE_EPOCH)
        self.slot = epoch % NUM_SLOTS
        self.rank, self.world_size = heap.rank, heap.world_size
        self.uses_heap, self.prev_data_epoch = uses_heap, prev_data_epoch
        # A steady-state call (no rendezvous at its start) checks the peers' signatures in its waits.
        self.check = check
        # A plain call (`overlap.symm.plain`), and its collectives while they are recorded for drains.
        self.plain = False
        self.recording: list | None = None
        self._outer = sys.exc_info()[1]  # (an exception handled around the call, if any: not the call's own)
        self._finished = False
        self._cuda = heap.device.type == "cuda"  # (read by every flag operation)

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
    # GPU ranks: stream-ordered writes and waits (``overlap._C``) on the control pads' words through
    # their device addresses, on `stream` (default: the current stream), each wait bounded by the
    # host watchdog, so the host never blocks on the device.
    def _flag_addr(self, owner: int, word: int) -> int:
        h = self.heap
        return h.pad_device_addr(owner, word) if self._cuda else h.ctrl_addr(owner, word)

    def wait_slot_free(self, stream: Any = None) -> None:
        """Wait until every rank has finished the previous call that used this slot's data."""
        prev = self.prev_data_epoch
        if prev <= 0 or not self.uses_heap:
            return
        h = self.heap
        if self._cuda:
            for q in range(self.world_size):
                self._bounded_wait(h.rank, h.done_word(self.slot, q), prev, q, stream)
            return
        addrs = [self._flag_addr(h.rank, h.done_word(self.slot, q)) for q in range(self.world_size)]
        missing = handshake.wait_checked(self.check, addrs, prev, self.timeout)
        if missing >= 0:
            self._raise_unstarted(missing)
            raise OverlapTimeout(self.op, self.rank, missing, f"slot {self.slot}", self.timeout,
                                 "the peer did not finish the slot's previous call")

    def _raise_unstarted(self, peer: int) -> None:
        """A steady-state wait timed out on a peer that never posted this call: say so, as a full handshake
        would have (the handshake moved into the data waits)."""
        if self.check is not None and not handshake.posted(self.heap, peer, self.epoch):
            raise OverlapTimeout(self.op, self.rank, peer, "handshake", self.timeout,
                                 "the peer never started this call")

    def _bounded_wait(self, owner: int, word: int, value: int, peer: int, stream: Any) -> None:
        # A stream-ordered wait (no SM: a main-stream GEMM cannot starve it) on `owner`'s pad word, then the
        # watchdog entry that bounds it: past the deadline a host thread records the peer in the pinned
        # error word and in this rank's pad (every rank's next call raises) and writes the word itself.
        h = self.heap
        c = signals()
        c.cuda_stream_wait_value32(h.pad_device_addr(owner, word), value, stream_handle(stream))
        c.watchdog_arm(h.ctrl_addr(owner, word), value, self.timeout, h.err_addr(peer),
                       h.ctrl_addr(h.rank, W_ASYNC_ERR), peer)

    def signal_ready(self, index: int = 0, stream: Any = None) -> None:
        """Publish this rank's ready flag `index` of this call (after the work enqueued before it on `stream`).

        GPU ranks write two words: the pad's (for the stream-ordered waits of `wait_ready`) and the device
        flag word (for the fused kernels' in-kernel waits, which poll device memory with atomics)."""
        h = self.heap
        word = h.ready_word(self.slot, index)
        addr = self._flag_addr(h.rank, word)
        if self._cuda:
            handle = stream_handle(stream)
            signals().cuda_stream_write_value32(addr, self.word, handle)
            signals().cuda_stream_write_value32(h.kernel_flag_addr(h.rank, word), self.word, handle)
        else:
            signals().signal_store(addr, self.word)

    def wait_ready(self, peer: int, index: int = 0, stream: Any = None, chunk: int | None = None) -> None:
        """Wait for `peer`'s ready flag `index` of this call; a timeout names `chunk` (default: `index`)."""
        h = self.heap
        word = h.ready_word(self.slot, index)
        if self._cuda:
            self._bounded_wait(peer, word, self.word, peer, stream)
            return
        if handshake.wait_checked(self.check, [self._flag_addr(peer, word)], self.word, self.timeout) >= 0:
            self._raise_unstarted(peer)
            raise OverlapTimeout(self.op, self.rank, peer, index if chunk is None else chunk, self.timeout,
                                 "data never signalled ready")
        if self.check is not None:  # the peer's entry of this call was posted before this flag
            self.check.verify(peer)

    def finish(self, stream: Any = None) -> None:
        """Tell every rank (this one included) that this rank is done with the slot.

        Once per call: later calls are no-ops (a strategy that ends the call on a side stream, after
        its last read of a peer's buffer, must not be followed by an earlier-ordered write).
        """
        if self._finished:
            return
        self._finished = True
        h = self.heap
        # (called from `finally` blocks: an exception other than one handled around the call is the call's own)
        exc = sys.exc_info()[1]
        failing = exc not in (None, self._outer)
        if self.plain:
            h.plain.in_flight -= 1
        if self.recording is not None:  # (kept where the call did not fail)
            h.plain.recorded(h, self.sig, self.recording, keep=not failing)
        check = self.check
        if check is not None and check.ahead and not isinstance(exc, OverlapError):
            # A plain call that went ahead: every peer has posted by now (its side of the collectives, real or
            # a drain, came after its entry); a difference raises before any result of this call is returned
            # (also on another error path: the mismatch is then the better error; a timeout is the error).
            for p in range(self.world_size):
                if p != self.rank:
                    check.verify(p)
            if not check.agreed and not failing:  # (an entry gone before it was compared: the peer moved on)
                others = sorted(set(range(self.world_size)) - check.compared - {self.rank})
                raise OverlapError(f"overlap.{self.op}: rank {self.rank} could not compare the signature of "
                                   f"rank(s) {others} in call {self.epoch} of this group, which it issued without a "
                                   "rendezvous; its result is not returned")
        if check is not None:
            if check.pending:
                h.defer_check(check)
            elif check.agreed:
                h.plain.agreement.add(self.epoch, self.sig)
        if not self.uses_heap:
            return
        h.in_flight -= 1
        for q in range(self.world_size):
            addr = self._flag_addr(q, h.done_word(self.slot, self.rank))
            if self._cuda:
                signals().cuda_stream_write_value32(addr, self.word, stream_handle(stream))
            else:
                signals().signal_store(addr, self.word)


def stream_handle(stream: Any) -> int:
    """The raw handle of `stream` (default: the current stream) for ``overlap._C``'s stream-ordered calls."""
    if stream is None:
        stream = torch.cuda.current_stream()
    return int(stream.cuda_stream)
