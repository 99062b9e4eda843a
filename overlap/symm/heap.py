"""`SymmHeap`: the symmetric heap, control pads and flags of one group on one node.

The handshake of every call, growth and re-base of the heap, and views of its slots (the protocol:
`overlap.symm`'s docstring); the address tables the Triton kernels take are `overlap.symm.tables`'. CPU ranks map
each peer's POSIX shared-memory segments; GPU ranks use torch's ``_symmetric_memory`` (`overlap.symm.cuda_memory`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import envs, shm, world
from ..errors import OverlapError, OverlapMismatchError, OverlapTimeout
from . import handshake, plain
from .call import Call
from .cuda_memory import CudaFlags, cuda_data
from .layout import (
    ALIGN,
    CTRL_WORDS,
    HS_RING,
    MAX_FLAGS,
    MAX_PEERS,
    MAX_SLOT_BYTES,
    NUM_SLOTS,
    REBASE_EPOCH,
    SLOT_BASE,
    SLOT_STRIDE,
    W_ASYNC_ERR,
    W_GEN_FAILED,
    W_GEN_MAPPED,
    W_GEN_READY,
    W_HS_EPOCH,
    W_REBASE_DONE,
    W_REBASE_QUIET,
    signals,
    signature_hash,
)
from .segments import Segments
from .tables import AddressTables

log = logging.getLogger("overlap")


class SymmHeap:
    """Symmetric heap, control pads and flags of one group on one node.

    Not thread-safe: calls on one group are issued by one thread, as collectives are.
    Use `heap_for(group)`; free with `release(group)` (on every rank) or at exit.
    """

    def __init__(self, group: dist.ProcessGroup, info: world.GroupInfo, timeout: float):
        if not info.single_node:
            raise ValueError(f"symmetric memory needs the ranks of one node; this group spans nodes {info.node_names}")
        if info.world_size > MAX_PEERS:
            raise ValueError(f"symmetric memory supports at most {MAX_PEERS} ranks per group, got {info.world_size}")
        self.group, self.info = group, info
        self.rank, self.world_size = info.rank, info.world_size
        self.device = info.device
        self.epoch = 0
        self._rebases = 0  # (`rebases`)
        self.plain = plain.Plain()  # plain calls that go ahead without a rendezvous
        self.generation = 0
        self.slot_bytes = 0
        self.closed = False
        # Epoch of the last call that used each slot's data (identical on every rank: every rank
        # makes the same calls, and whether a call uses the heap is part of its signature).
        self.last_data_epoch = [0] * NUM_SLOTS
        # Each slot's epoch word: the epoch of the call using the slot, which the fused kernels read (a word,
        # not an int argument, so that Triton compiles one variant for every epoch). `Call.epoch_word` writes
        # it in stream order; like the slot's data it is rewritten only once the slot is free again.
        self.epoch_words = torch.zeros(NUM_SLOTS, dtype=torch.int32, device=self.device)
        self.in_flight = 0  # calls of this process that use heap data and have not finished
        shm.remove_stale_segments()
        # Bounded rendezvous through the store: agree on the run id (rank 0's 128 random bits: segment names
        # nobody else can foresee), and check that every rank runs the same layout and _C build; then create
        # this rank's pad, map every peer's, and unlink ours.
        self.segments = Segments(group, info, timeout)
        self.ctrl = [t.view(torch.int32) for t in self.segments.map_all("ctrl", CTRL_WORDS * 4, timeout)]
        self._ctrl_np = [t.numpy() for t in self.ctrl]
        self._ctrl_addr = [t.data_ptr() for t in self.ctrl]
        self.data = []  # (the setter: `slot_tensor`'s views start over with every new heap)
        self.tables = AddressTables(self)  # what the kernels take: addresses of slots, regions, flags
        # Where asynchronous (stream-ordered, in-kernel) waits report a missed deadline: word p
        # is set when a wait on peer p gave up. Pinned host memory on GPUs, so the host reads it
        # without synchronizing; `begin` checks it at the next call.
        self.async_errors = torch.zeros(MAX_PEERS + 1, dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        self.warmed = handshake.Warmed()  # signatures of this rank's full handshakes (the steady state)
        self.pending: list[handshake.SignatureCheck] = []
        # GPU ranks: the flags of `Call` (the side-stream pipelines' stream-ordered waits and writes) are the
        # control pads' words, registered here as mapped host memory (`_pad_dev`: each pad's device address)
        # so that the host watchdog can read and release them; the fused kernels' in-kernel waits use device
        # flag words in torch's symmetric memory (`_cuda_flags`: their atomics need device memory). Both are
        # created with the first data heap: calls that use no heap never need them, nor the CUDA half of _C.
        self._cuda_flags: CudaFlags | None = None
        self._pad_dev: list[int] | None = None

    @property
    def rebases(self) -> int:
        """Epoch re-bases so far (a call's number across them: `overlap.symm.p2p.call_number`)."""
        return self._rebases

    @property
    def data(self) -> list[torch.Tensor]:
        """Every rank's data heap (uint8, every slot; empty before the first call that needs data)."""
        return self._data

    @data.setter
    def data(self, tensors: list[torch.Tensor]) -> None:
        self._data = tensors
        # Each peer's heap as elements of a dtype, with its storage offset in them (`slot_tensor`), made on first
        # use per (peer, dtype): new buffers drop them with the old ones.
        self._typed: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int]] = {}

    @property
    def data_bytes(self) -> int:
        """Bytes of this rank's data heap (every slot; 0 before the first call that needs data)."""
        return self.slot_bytes * NUM_SLOTS if self.data else 0

    # -- addresses of control words ---------------------------------------------------------
    def ctrl_addr(self, peer: int, word: int) -> int:
        return self._ctrl_addr[peer] + 4 * word

    def pad_device_addr(self, peer: int, word: int) -> int:
        """Device address of `word` of `peer`'s control pad (GPU ranks, once the heap has data)."""
        return self._pad_dev[peer] + 4 * word

    def kernel_flag_addr(self, peer: int, word: int) -> int:
        """Address of `word` of `peer`'s flags as the fused kernels see them (`AddressTables.flag_table`): the device
        flag word where the heap has them (GPU ranks), else the control pad's word (CPU ranks)."""
        return self._cuda_flags.addrs(word)[peer] if self._cuda_flags is not None else self.ctrl_addr(peer, word)

    def ready_word(self, slot: int, index: int) -> int:
        assert 0 <= index < MAX_FLAGS, index
        return SLOT_BASE + slot * SLOT_STRIDE + index

    def done_word(self, slot: int, reader: int) -> int:
        return SLOT_BASE + slot * SLOT_STRIDE + MAX_FLAGS + reader

    # -- the per-call handshake ---------------------------------------------------------------
    def pad(self, peer: int):
        """`peer`'s control pad as a numpy int32 array (this process's mapping)."""
        return self._ctrl_np[peer]

    def begin(self, op: str, signature: str, need_bytes: int, timeout: float, post_only: bool = False,
              steady: bool = False, plain: bool = False) -> Call:
        """Start a call: advance the epoch, agree on the signature, grow if needed (`overlap.symm.handshake`).

        ``need_bytes`` is what one slot must hold for this call; 0 means the call uses no heap
        data (reference, pipelined), and then it touches no data flag either. ``post_only``
        publishes the signature and returns None without waiting (a rank that is about to raise
        on its own bad input uses it, so its peers fail fast too). ``steady``: the caller's strategy
        checks the signature in its data waits (`Call.wait_ready`) and ``need_bytes`` is fixed by the
        signature, so once the signature has passed a full handshake on this rank, later calls skip the
        rendezvous (CPU ranks; GPU ranks always run the full handshake). ``plain``: the call runs only plain
        collectives through `overlap.comm` (a TP op's ``reference``; no heap data): where the group's recent calls
        predict its signature it goes ahead without the rendezvous (`overlap.symm.plain`).
        """
        if self.closed:
            raise RuntimeError("overlap: this group's symmetric heap was released; it cannot be used again")
        if not post_only and need_bytes > MAX_SLOT_BYTES:  # (the pad's words hold less; no tmpfs holds it)
            error = ValueError(f"overlap.{op}: the call needs {need_bytes} bytes of symmetric memory per slot, more "
                               f"than the {MAX_SLOT_BYTES} a heap may hold; split the call")
            self.begin(op, f"<invalid input on rank {self.rank}: {error}>", 0, timeout, post_only=True)
            raise error
        self.check_async_errors(op, timeout)
        self.plain.check()
        if steady:  # the bytes are part of what ranks agree on (they are not compared in the steady state)
            signature = f"{signature} [slot={need_bytes}]"
        lo, hi = signature_hash(signature)
        if not post_only and world.capturing():
            raise self._capture_error(op, (lo, hi, need_bytes) in self.warmed, need_bytes)
        live = (not post_only and self.device.type == "cpu" and not envs.check_every_call()
                and self.epoch + 1 < REBASE_EPOCH)
        fast = steady and live and (lo, hi, need_bytes) in self.warmed
        plain = plain and need_bytes == 0 and not steady
        self.epoch += 1
        epoch = self.epoch
        peers = [p for p in range(self.world_size) if p != self.rank]
        self._ring_guard(op, epoch, peers, timeout, fast)
        try:
            if not post_only:  # (a rank with bad input raises its own error)
                self._resolve_pending()
        except OverlapMismatchError:
            # Tell the peers at once (they raise at this call), leave the slot whole, then raise.
            handshake.post(self, epoch, 0, 0, 0, f"<rank {self.rank}: ranks disagreed on an earlier call>")
            handshake.abandon(self, epoch)
            self.plain.recording(self, None)
            self.plain.drain(self, op, epoch, timeout)
            raise
        recording = self.plain.recording(self, (lo, hi) if plain and not post_only else None)
        ahead = plain and live and self.plain.goes_ahead((lo, hi), epoch)
        handshake.post(self, epoch, lo, hi, need_bytes, signature, handshake.AHEAD if ahead else 0)
        if post_only:
            handshake.abandon(self, epoch)
            self.plain.drain(self, op, epoch, timeout)
            return None
        if fast:
            return self._steady(op, epoch, lo, hi, signature, need_bytes, timeout, peers)
        if ahead:
            return self._ahead(op, epoch, lo, hi, signature, timeout)
        handshake.COUNTS["rendezvous"] += 1
        missing = signals().signal_wait_all([self.ctrl_addr(p, W_HS_EPOCH) for p in peers], epoch, timeout)
        if missing >= 0:
            raise OverlapTimeout(op, self.rank, peers[missing], "handshake", timeout,
                                 "the peer never started this call")
        need = need_bytes
        differ = {}
        for p in peers:
            got = handshake.entry_of(self, p, epoch)
            if got is None or got[:2] != (lo, hi):
                differ[p] = handshake.text_of(self, p, epoch)
            else:
                need = max(need, got[2])
        if differ:  # nothing was exchanged and no slot was used: the group stays usable
            handshake.abandon(self, epoch)
            self.plain.recording(self, None)  # (nothing of this call is kept; the drain is not recorded)
            self.plain.drain(self, op, epoch, timeout)
            raise OverlapMismatchError.of(op, epoch, self.rank, signature, differ)
        self.plain.agreement.add(epoch, (lo, hi))
        if need == need_bytes:
            self.warmed.add(lo, hi, need)
        if epoch >= REBASE_EPOCH and self.in_flight == 0 and self.plain.in_flight == 0:  # (same on every rank)
            epoch = self._rebase(op, timeout)
        if need > self.slot_bytes:
            # Growth replaces every buffer: no call of this process may still have data in the heap
            # (an op that nests calls, like an overlapped backward, sizes its first call for both).
            assert self.in_flight == 0, f"overlap.{op}: heap growth with {self.in_flight} call(s) in flight"
            self._grow(need, op, timeout)
        return self._open(op, epoch, timeout, need, signature=signature, sig=(lo, hi), plain=plain,
                          recording=recording)

    def _ahead(self, op: str, epoch: int, lo: int, hi: int, signature: str, timeout: float) -> Call:
        """A plain call that goes ahead (`overlap.symm.plain`): no rendezvous; every peer's entry is compared
        when the call finishes (after its collectives), or at this rank's next call if that starts first."""
        handshake.COUNTS["steady"] += 1
        check = handshake.SignatureCheck(self, op, epoch, lo, hi, signature, timeout)
        check.ahead = True
        self.pending.append(check)
        # Agreed for the next calls' predictions until a difference is found: every rank that predicts the next
        # call has this one as agreed or went ahead with it too, with the same signature (the same prediction).
        self.plain.agreement.add(epoch, (lo, hi))
        return self._open(op, epoch, timeout, 0, check, signature, (lo, hi), plain=True)

    def _capture_error(self, op: str, warmed: bool, need: int) -> RuntimeError:
        """Why this call cannot run under CUDA graph capture, and what to do (checked before the handshake:
        every rank captures the same calls, so every rank raises the same error)."""
        if need > self.slot_bytes:
            what = (f"it needs a heap slot of {need} bytes (now {self.slot_bytes}), and growth is a host "
                    f"rendezvous; call overlap.reserve(group, {need}) before capturing")
        elif not warmed:
            what = "this is its first call with this signature; make a warm-up call with the same arguments first"
        else:
            what = ("its epochs are host integers that a replay would reuse; replaying overlap calls needs "
                    "epochs advanced on the device, which this version does not have")
        return RuntimeError(f"overlap.{op}: cannot be captured in a CUDA graph: {what}. "
                            "Run overlap's ops outside the captured region for now.")

    def _open(self, op: str, epoch: int, timeout: float, need: int, check=None, signature: str = "",
              sig: tuple[int, int] = (0, 0), plain: bool = False, recording: list | None = None) -> Call:
        slot = epoch % NUM_SLOTS
        prev = self.last_data_epoch[slot]
        if need > 0:
            self.last_data_epoch[slot] = epoch
            self.in_flight += 1
        call = Call(self, op, epoch, timeout, uses_heap=need > 0, prev_data_epoch=prev, need=need, check=check,
                    signature=signature, sig=sig)
        if plain:  # (`overlap.symm.plain`: counted until it finishes; its collectives recorded where new)
            call.plain, call.recording = True, recording
            self.plain.in_flight += 1
        return call

    def _steady(self, op: str, epoch: int, lo: int, hi: int, signature: str, need: int, timeout: float,
                peers: list[int]) -> Call:
        """A warmed signature: no rendezvous. The peers that have already posted this call are compared now,
        the others in the data waits (`overlap.symm.handshake`)."""
        handshake.COUNTS["steady"] += 1
        check = handshake.SignatureCheck(self, op, epoch, lo, hi, signature, timeout)
        try:
            for p in peers:
                check.verify(p)
        except OverlapMismatchError:
            handshake.abandon(self, epoch)
            raise
        return self._open(op, epoch, timeout, need, check, signature, (lo, hi))

    def _ring_guard(self, op: str, epoch: int, peers: list[int], timeout: float, fast: bool) -> None:
        """Never overwrite a handshake entry a peer has yet to read.

        A rank that skipped waiting (post_only: its own input was bad; or the steady state) can be several
        calls ahead of a peer: before posting epoch E it waits until every peer has posted E - HS_RING + 1
        (a peer that posted it has read every entry before it). Free in the steady state unless a peer is
        that far behind."""
        if epoch <= HS_RING - 1:
            return
        oldest = epoch - HS_RING + 1
        if all(int(self._ctrl_np[p][W_HS_EPOCH]) >= oldest for p in peers):
            return
        if fast:
            handshake.COUNTS["ring_wait"] += 1
        missing = signals().signal_wait_all([self.ctrl_addr(p, W_HS_EPOCH) for p in peers], oldest, timeout)
        if missing >= 0:
            raise OverlapTimeout(op, self.rank, peers[missing], "handshake", timeout,
                                 f"the peer is more than {HS_RING - 1} calls behind")

    def _resolve_pending(self) -> None:
        """Compare the entries of earlier steady calls' peers this rank never waited on (raises on a
        difference); forget the calls whose peers are all compared."""
        pending, self.pending = self.pending, []
        for check in pending:
            try:
                if not check.resolve():
                    self.pending.append(check)
                elif check.agreed:
                    self.plain.agreement.add(check.epoch, (check.lo, check.hi))
            except OverlapMismatchError:
                self.pending = []
                raise
        del self.pending[: max(0, len(self.pending) - 2 * HS_RING)]

    def defer_check(self, check) -> None:
        """A steady call ended before comparing some peers' entries: compare them at the next call."""
        self.pending.append(check)

    def err_addr(self, peer: int) -> int:
        """Address of the error word of waits on `peer` (device-visible on GPUs)."""
        return self.async_errors.data_ptr() + 4 * peer

    def kernel_err(self) -> torch.Tensor:
        """Error word of in-kernel waits (a kernel stores ``peer + 1`` there)."""
        return self.async_errors[MAX_PEERS:]

    def check_async_errors(self, op: str, timeout: float) -> None:
        """Raise if an earlier call's asynchronous wait gave up (the group is then unusable).

        Also when a peer's watchdog released one of its waits (its pad's `W_ASYNC_ERR` word): that release
        may have let this rank's own wait on the same word through without data, so every rank raises."""
        words = self.async_errors.numpy()  # (pinned host memory on GPUs: read without a device synchronization)
        bad = words[:MAX_PEERS].nonzero()[0]
        kernel = int(words[MAX_PEERS])
        if len(bad) or kernel:
            peer = int(bad[0]) if len(bad) else kernel - 1
            raise OverlapTimeout(op, self.rank, peer, "of an earlier call", timeout,
                                 "a stream-ordered or in-kernel wait passed its deadline")
        for p, pad in enumerate(self._ctrl_np):
            released = int(pad[W_ASYNC_ERR])
            if released:
                where = "this rank" if p == self.rank else f"rank {p}"
                raise OverlapTimeout(op, self.rank, released - 1, "of an earlier call", timeout,
                                     f"the host watchdog of {where} released a stream-ordered wait at its deadline")

    # -- re-basing epochs ---------------------------------------------------------------------
    def _rebase(self, op: str, timeout: float) -> int:
        """Reset every flag of the group to 0 and this call's epoch to 1 (all ranks together).

        Flags are int32 and compared as such, so epochs must never approach 2^31; once every
        2^30 calls, inside the handshake of the call that reaches `REBASE_EPOCH` (the same call
        on every rank), the ranks stop touching flags, each clears its own, and all restart
        from epoch 1. Two shared-memory barriers, no collective.
        """
        c = signals()
        self._rebases += 1
        peers = [p for p in range(self.world_size) if p != self.rank]

        def barrier(word: int, what: str) -> None:
            c.signal_store(self.ctrl_addr(self.rank, word), self._rebases)
            missing = c.signal_wait_all([self.ctrl_addr(p, word) for p in peers], self._rebases, timeout)
            if missing >= 0:
                raise OverlapTimeout(op, self.rank, peers[missing], "epoch re-base", timeout, what)

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no queued wait or signal of ours is left
            self._cancel_watchdog()  # (entries whose words are about to be cleared: all have arrived)
        # Every rank has passed this call's handshake wait (so nobody reads our epoch word any
        # more) and has finished every earlier call (so nobody writes our flags any more).
        barrier(W_REBASE_QUIET, "peer did not quiesce for the epoch re-base")
        self._ctrl_np[self.rank][SLOT_BASE:CTRL_WORDS] = 0
        if self._cuda_flags is not None:
            self._cuda_flags.tensors[self.rank].zero_()
            torch.cuda.synchronize(self.device)
        c.signal_store(self.ctrl_addr(self.rank, W_HS_EPOCH), 1)
        barrier(W_REBASE_DONE, "peer did not finish the epoch re-base")
        self.epoch = 1
        self.last_data_epoch = [0] * NUM_SLOTS
        self.pending = []  # (every rank passed this call's full handshake: earlier calls are all agreed)
        self.plain.clear()
        log.info("overlap: re-based the epochs of a group (every %d calls)", REBASE_EPOCH)
        return 1

    # -- growth --------------------------------------------------------------------------------
    def _grow(self, need: int, op: str, timeout: float) -> None:
        c = signals()
        slot_bytes = max(need, 2 * self.slot_bytes)
        slot_bytes = (slot_bytes + ALIGN - 1) // ALIGN * ALIGN
        log.info("overlap: growing symmetric heap to %d bytes per slot (%d slots)", slot_bytes, NUM_SLOTS)
        self.generation += 1
        gen = self.generation
        peers = [p for p in range(self.world_size) if p != self.rank]

        def barrier(word: int, what: str) -> None:
            c.signal_store(self.ctrl_addr(self.rank, word), gen)
            missing = c.signal_wait_all([self.ctrl_addr(p, word) for p in peers], gen, timeout)
            if missing >= 0:
                raise OverlapTimeout(op, self.rank, peers[missing], "heap growth", timeout, what)

        if self.device.type == "cuda":
            # Every rank is in this call, so all earlier calls are enqueued; the old buffers may
            # still be read by the device: wait for it before dropping them.
            torch.cuda.synchronize(self.device)
            if self._cuda_flags is None:
                self._cuda_flags = CudaFlags(self.group, self.world_size)
            if self._pad_dev is None:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                self._pad_dev = [c.cuda_host_register(addr, CTRL_WORDS * 4, index) for addr in self._ctrl_addr]
            self.data = cuda_data(self.group, NUM_SLOTS * slot_bytes, self.device)
        else:
            name = self.segments.name(f"g{gen}", self.rank)
            with self.segments.watching(f"g{gen}"):
                try:
                    own = shm.create_segment(name, NUM_SLOTS * slot_bytes)
                except (OSError, OverlapError):
                    # Arrive anyway, marked failed, so the peers raise at once too (not at their deadline).
                    c.signal_store(self.ctrl_addr(self.rank, W_GEN_FAILED), gen)
                    barrier(W_GEN_READY, "peer did not create its segment")
                    raise
                try:
                    barrier(W_GEN_READY, "peer did not create its segment")
                    failed = [p for p in peers if int(self._ctrl_np[p][W_GEN_FAILED]) == gen]
                    if failed:
                        raise OSError(f"overlap.{op}: rank(s) {failed} could not allocate {NUM_SLOTS * slot_bytes} "
                                      f"bytes of shared memory in {envs.shm_dir()}; the heap keeps its old size")
                    self.data = [own if p == self.rank else
                                 shm.attach_segment(self.segments.name(f"g{gen}", p), NUM_SLOTS * slot_bytes)
                                 for p in range(self.world_size)]
                    barrier(W_GEN_MAPPED, "peer did not map the segments")
                except BaseException:  # a peer that died inside the window leaves its segment: remove it
                    self.segments.remove_dead(f"g{gen}")
                    raise
                finally:
                    shm.unlink(name)
        self.slot_bytes = slot_bytes
        self.tables.clear()

    def reserve(self, nbytes: int, timeout: float) -> None:
        self.begin("reserve", f"reserve(bytes={nbytes})", nbytes, timeout).finish()

    # -- buffers --------------------------------------------------------------------------------
    def slot_tensor(self, peer: int, slot: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0):
        """View of `shape` elements of `dtype` in `peer`'s slot, starting `offset` bytes in."""
        # One view op (a slice and two views cost several times more, and MoE calls take many such views).
        numel, step, strides = 1, 1, []
        for s in reversed(shape):
            strides.append(step)  # (torch's contiguous strides)
            numel, step = numel * s, step * max(s, 1)
        size = dtype.itemsize
        nbytes = numel * size
        assert offset % 16 == 0 and offset + nbytes <= self.slot_bytes, (offset, nbytes, self.slot_bytes)
        typed = self._typed.get((peer, dtype))
        if typed is None:
            whole = self._data[peer].view(dtype)
            typed = self._typed[peer, dtype] = (whole, whole.storage_offset())
        whole, base = typed
        return whole.as_strided(shape, strides[::-1], base + (slot * self.slot_bytes + offset) // size)

    def _cancel_watchdog(self) -> None:
        c = signals()
        for addr in self._ctrl_addr:
            c.watchdog_cancel(addr, CTRL_WORDS * 4)
        c.watchdog_cancel(self.async_errors.data_ptr(), self.async_errors.numel() * 4)

    def close(self) -> None:
        if not self.closed and self._pad_dev is not None:
            # Nothing may touch the pads once unmapped: drop the watchdog's entries, then the registrations.
            self._cancel_watchdog()
            for addr in self._ctrl_addr:
                try:
                    signals().cuda_host_unregister(addr)
                except RuntimeError as exc:  # (at exit the CUDA context may be gone already)
                    log.debug("overlap: cudaHostUnregister of a control pad: %s", exc)
            self._pad_dev = None
        self.closed = True
        self.data = []
        self.ctrl = []
        self._ctrl_np = []
        self.tables.clear()
