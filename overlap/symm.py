"""Symmetric memory: equal buffers on every rank of a node, addressable by every rank, and flags.

Per group (created lazily by the first call, through a bounded rendezvous on the process group's
store):

* a **control pad** per rank in host POSIX shared memory (CPU and GPU alike): the per-call
  handshake words (epoch, signature, bytes needed, a readable copy of the signature) and, on CPU
  ranks, the data flags;
* a **data heap** per rank, split into a ring of `NUM_SLOTS` equal slots. CPU: a POSIX shared
  memory segment (`overlap.shm`) mapped by every local rank. CUDA: torch's ``_symmetric_memory``,
  with the data flags in a separate symmetric allocation (flags never move when the heap grows);
* a per-process table of peer addresses (`SymmHeap.ptr_table`), which Triton kernels take.

The buffer protocol (DESIGN.md) as implemented here:

* **Handshake.** Every call on a group (any strategy, any op) starts with `SymmHeap.begin`:
  the group's epoch advances by one, each rank posts ``(signature, bytes needed)`` under the
  new epoch and waits until every peer has posted the same epoch. Each rank then compares every
  peer's signature with its own, so a disagreement raises `OverlapMismatchError` on every rank,
  on every call, with every signature in the message; nothing else has been exchanged, so the
  group stays usable. A rank whose own arguments are wrong posts a poisoned signature without
  waiting (``post_only``) and raises; its peers raise at once. Such a rank can run several calls
  ahead, so every call first waits until its peers are within the ring (a peer that posted epoch
  ``E - 3`` has read every entry of ``E - 4``): a ring of four entries per rank is never
  overwritten before it is read.
* **Growth.** All ranks now know the same ``need``; if a slot is smaller, every rank grows
  together (a shared-memory rendezvous on the control pad): new segments are created, mapped by
  every peer, then unlinked at once, so ``/dev/shm`` holds nothing even if a rank is later killed.
  A rank that cannot allocate says so in its pad and every rank raises, keeping the old heap.
  `overlap.reserve` grows ahead of time.
* **Flags carry epochs and are never reset** (except by the re-base below). A consumer waits for
  ``flag >= epoch``. ``ready[slot][i]`` lives in the producer's pad; ``done[slot][q]`` lives in
  every rank's pad and is written by rank ``q`` when it has finished everything it does with slot
  ``slot`` in that call (reading peers' buffers and its own). Only calls that use heap data
  (``symm``, ``fused``) touch flags. Before such a call at epoch ``E`` writes into slot ``s``, it
  waits until ``done[s][q]`` has reached the epoch of the previous data call on ``s`` for every
  ``q``; that epoch is the same on every rank, since every rank makes the same calls.
* **Re-base.** Flags are int32: the call that reaches `REBASE_EPOCH` (2^30) clears every flag
  of the group and restarts from epoch 1, all ranks together (`SymmHeap._rebase`).

Memory ordering: a producer writes its data with ordinary stores, then publishes the flag with
a release store; a consumer reads the flag with an acquire load before it reads the data
(``overlap._C`` on CPU, system-scope acquire in Triton, ``st.release``-like stream writes in CUDA).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

from . import envs, shm, world
from .errors import OverlapMismatchError, OverlapTimeout

log = logging.getLogger("overlap")

NUM_SLOTS = 4
_MAX_TABLES = 256  # cached address tables per heap (see SymmHeap._table)
MAX_PEERS = 128
MAX_FLAGS = 256  # ready flags per slot (chunks a producer can publish in one call)
_HS_RING = 4
_SIG_TEXT_BYTES = 240

# Control pad layout, in int32 words.
_W_HS_EPOCH = 0  # epoch of the last handshake this rank posted
_W_GEN_READY = 1  # heap generation this rank has created
_W_GEN_MAPPED = 2  # heap generation this rank has mapped from every peer
_W_REBASE_QUIET = 3  # re-base rounds in which this rank has stopped touching flags
_W_REBASE_DONE = 4  # re-base rounds in which this rank has cleared its own flags
_W_GEN_FAILED = 5  # heap generation this rank failed to create (it still arrives at the barrier)

#: Epochs stay below this: the call that reaches it re-bases every flag of the group to zero, so
#: flags and epochs are always int32 values far apart from wrapping (see `SymmHeap._rebase`).
REBASE_EPOCH = 2**30
_HS_BASE = 16
_HS_STRIDE = 4 + _SIG_TEXT_BYTES // 4  # sig_lo, sig_hi, need_lo, need_hi, text
_SLOT_BASE = 512
_SLOT_STRIDE = MAX_FLAGS + MAX_PEERS  # ready[MAX_FLAGS], done[MAX_PEERS]
_CTRL_WORDS = _SLOT_BASE + NUM_SLOTS * _SLOT_STRIDE
_ALIGN = 4096



def _c():
    from . import _C

    return _C


# ----------------------------------------------------------------------------------------------
# Signatures
# ----------------------------------------------------------------------------------------------


def signature_hash(text: str) -> tuple[int, int]:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    lo = int.from_bytes(digest[:4], "little", signed=True)
    hi = int.from_bytes(digest[4:], "little", signed=True)
    return lo, hi


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
        self.generation = 0
        self.slot_bytes = 0
        self.closed = False
        # Epoch of the last call that used each slot's data (identical on every rank: every rank
        # makes the same calls, and whether a call uses the heap is part of its signature).
        self.last_data_epoch = [0] * NUM_SLOTS
        self._counters: dict[int, torch.Tensor] = {}
        self.in_flight = 0  # calls of this process that use heap data and have not finished
        shm.remove_stale_segments()
        # Bounded rendezvous through the store: agree on a run id so segment names are
        # predictable from (pid, rank), create, map every peer's pad, then unlink our own.
        token = f"{os.getpid():x}{secrets.token_hex(4)}".encode()
        self._uid = world.store_exchange(group, "heap-uid", token, timeout)[0].decode()
        path = self._path("ctrl", self.rank)
        shm.CREATED.add(path)
        own = shm.create_segment(path, _CTRL_WORDS * 4)
        try:
            world.store_exchange(group, "ctrl-created", b"", timeout)
            self.ctrl = [own.view(torch.int32) if p == self.rank else
                         shm.attach_segment(self._path("ctrl", p), _CTRL_WORDS * 4).view(torch.int32)
                         for p in range(self.world_size)]
            world.store_exchange(group, "ctrl-mapped", b"", timeout)
        finally:  # mapped by every peer, or the set-up failed (a peer died or timed out): never left behind
            shm.unlink(path)
        self._ctrl_np = [t.numpy() for t in self.ctrl]
        self._ctrl_addr = [t.data_ptr() for t in self.ctrl]
        self.data: list[torch.Tensor] = []
        self._ptr_tables: dict[tuple[int, Any], torch.Tensor] = {}
        # Where asynchronous (stream-ordered, in-kernel) waits report a missed deadline: word p
        # is set when a wait on peer p gave up. Pinned host memory on GPUs, so the host reads it
        # without synchronizing; `begin` checks it at the next call.
        self.async_errors = torch.zeros(MAX_PEERS + 1, dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        # GPU flag words live in torch's symmetric memory, created with the first data heap:
        # calls that use no heap (reference, pipelined) never need them, nor the CUDA half of _C.
        self._cuda_flags: _CudaFlags | None = None

    # -- names ------------------------------------------------------------------------------
    def _path(self, kind: str, rank: int) -> str:
        pid = self.info.pids[rank]
        return os.path.join(envs.shm_dir(), f"overlap-{self._uid}-{pid}-{kind}-r{rank}")

    # -- addresses of control words ---------------------------------------------------------
    def ctrl_addr(self, peer: int, word: int) -> int:
        return self._ctrl_addr[peer] + 4 * word

    def ready_word(self, slot: int, index: int) -> int:
        assert 0 <= index < MAX_FLAGS, index
        return _SLOT_BASE + slot * _SLOT_STRIDE + index

    def done_word(self, slot: int, reader: int) -> int:
        return _SLOT_BASE + slot * _SLOT_STRIDE + MAX_FLAGS + reader

    # -- the per-call handshake ---------------------------------------------------------------
    def begin(self, op: str, signature: str, need_bytes: int, timeout: float, post_only: bool = False) -> Call:
        """Start a call: advance the epoch, check signatures on every rank, grow if needed.

        ``need_bytes`` is what one slot must hold for this call; 0 means the call uses no heap
        data (reference, pipelined), and then it touches no data flag either. ``post_only``
        publishes the signature and returns None without waiting (a rank that is about to raise
        on its own bad input uses it, so its peers fail fast too).
        """
        if self.closed:
            raise RuntimeError("overlap: this group's symmetric heap was released; it cannot be used again")
        self.check_async_errors(op, timeout)
        c = _c()
        self.epoch += 1
        epoch = self.epoch
        peers = [p for p in range(self.world_size) if p != self.rank]
        if epoch > _HS_RING - 1:
            # A rank that skipped waiting (post_only: its own input was bad) in earlier calls can be
            # several calls ahead, also in the valid call that follows: never overwrite a ring entry a
            # slower peer has yet to read (a peer that posted `oldest` has read every entry before it).
            oldest = epoch - _HS_RING + 1
            missing = c.signal_wait_all([self.ctrl_addr(p, _W_HS_EPOCH) for p in peers], oldest, timeout)
            if missing >= 0:
                raise OverlapTimeout(op, self.rank, peers[missing], "handshake", timeout,
                                     f"the peer is more than {_HS_RING - 1} calls behind")
        entry = _HS_BASE + (epoch % _HS_RING) * _HS_STRIDE
        lo, hi = signature_hash(signature)
        text = signature.encode()[:_SIG_TEXT_BYTES].ljust(_SIG_TEXT_BYTES, b"\0")
        mine = self._ctrl_np[self.rank]
        mine[entry : entry + 4] = (lo, hi, need_bytes & 0x7FFFFFFF, need_bytes >> 31)
        mine[entry + 4 : entry + _HS_STRIDE].view("u1")[:] = list(text)
        # Release: the entry above is visible to a peer that sees the new epoch.
        c.signal_store(self.ctrl_addr(self.rank, _W_HS_EPOCH), epoch)
        if post_only:
            return None
        missing = c.signal_wait_all([self.ctrl_addr(p, _W_HS_EPOCH) for p in peers], epoch, timeout)
        if missing >= 0:
            raise OverlapTimeout(op, self.rank, peers[missing], "handshake", timeout,
                                 "the peer never started this call")
        need = need_bytes
        differ = {}
        for p in peers:
            words = self._ctrl_np[p][entry : entry + 4].copy()
            if (int(words[0]), int(words[1])) != (lo, hi):
                raw = bytes(self._ctrl_np[p][entry + 4 : entry + _HS_STRIDE].view("u1"))
                differ[p] = raw.rstrip(bytes(1)).decode(errors="replace")
            need = max(need, int(words[2]) | (int(words[3]) << 31))
        if differ:  # nothing was exchanged and no slot was used: the group stays usable
            raise OverlapMismatchError.of(op, epoch, self.rank, signature, differ)
        if epoch >= REBASE_EPOCH and self.in_flight == 0:  # (same on every rank: same calls in flight)
            epoch = self._rebase(op, timeout)
        if need > self.slot_bytes:
            # Growth replaces every buffer: no call of this process may still have data in the heap
            # (an op that nests calls, like an overlapped backward, sizes its first call for both).
            assert self.in_flight == 0, f"overlap.{op}: heap growth with {self.in_flight} call(s) in flight"
            self._grow(need, op, timeout)
        slot = epoch % NUM_SLOTS
        prev = self.last_data_epoch[slot]
        if need > 0:
            self.last_data_epoch[slot] = epoch
            self.in_flight += 1
        return Call(self, op, epoch, timeout, uses_heap=need > 0, prev_data_epoch=prev, need=need)

    def err_addr(self, peer: int) -> int:
        """Address of the error word of waits on `peer` (device-visible on GPUs)."""
        return self.async_errors.data_ptr() + 4 * peer

    def kernel_err(self) -> torch.Tensor:
        """Error word of in-kernel waits (a kernel stores ``peer + 1`` there)."""
        return self.async_errors[MAX_PEERS:]

    def check_async_errors(self, op: str, timeout: float) -> None:
        """Raise if an earlier call's asynchronous wait gave up (the group is then unusable)."""
        bad = torch.nonzero(self.async_errors[:MAX_PEERS]).flatten().tolist()
        kernel = int(self.async_errors[MAX_PEERS])
        if bad or kernel:
            peer = bad[0] if bad else kernel - 1
            raise OverlapTimeout(op, self.rank, peer, "of an earlier call", timeout,
                                 "a stream-ordered or in-kernel wait passed its deadline")

    # -- re-basing epochs ---------------------------------------------------------------------
    def _rebase(self, op: str, timeout: float) -> int:
        """Reset every flag of the group to 0 and this call's epoch to 1 (all ranks together).

        Flags are int32 and compared as such, so epochs must never approach 2^31; once every
        2^30 calls, inside the handshake of the call that reaches `REBASE_EPOCH` (the same call
        on every rank), the ranks stop touching flags, each clears its own, and all restart
        from epoch 1. Two shared-memory barriers, no collective.
        """
        c = _c()
        self._rebases = getattr(self, "_rebases", 0) + 1
        peers = [p for p in range(self.world_size) if p != self.rank]

        def barrier(word: int, what: str) -> None:
            c.signal_store(self.ctrl_addr(self.rank, word), self._rebases)
            missing = c.signal_wait_all([self.ctrl_addr(p, word) for p in peers], self._rebases, timeout)
            if missing >= 0:
                raise OverlapTimeout(op, self.rank, peers[missing], "epoch re-base", timeout, what)

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no queued wait or signal of ours is left
        # Every rank has passed this call's handshake wait (so nobody reads our epoch word any
        # more) and has finished every earlier call (so nobody writes our flags any more).
        barrier(_W_REBASE_QUIET, "peer did not quiesce for the epoch re-base")
        self._ctrl_np[self.rank][_SLOT_BASE:_CTRL_WORDS] = 0
        if self._cuda_flags is not None:
            self._cuda_flags.tensors[self.rank].zero_()
            torch.cuda.synchronize(self.device)
        c.signal_store(self.ctrl_addr(self.rank, _W_HS_EPOCH), 1)
        barrier(_W_REBASE_DONE, "peer did not finish the epoch re-base")
        self.epoch = 1
        self.last_data_epoch = [0] * NUM_SLOTS
        log.info("overlap: re-based the epochs of a group (every %d calls)", REBASE_EPOCH)
        return 1

    # -- growth --------------------------------------------------------------------------------
    def _grow(self, need: int, op: str, timeout: float) -> None:
        c = _c()
        slot_bytes = max(need, 2 * self.slot_bytes)
        slot_bytes = (slot_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
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
                self._cuda_flags = _CudaFlags(self.group, self.world_size)
            self.data = _cuda_data(self.group, NUM_SLOTS * slot_bytes, self.device)
        else:
            path = self._path(f"g{gen}", self.rank)
            shm.CREATED.add(path)
            try:
                own = shm.create_segment(path, NUM_SLOTS * slot_bytes)
            except OSError:
                # Arrive anyway, marked failed, so the peers raise at once too (not at their deadline).
                c.signal_store(self.ctrl_addr(self.rank, _W_GEN_FAILED), gen)
                barrier(_W_GEN_READY, "peer did not create its segment")
                raise
            try:
                barrier(_W_GEN_READY, "peer did not create its segment")
                failed = [p for p in peers if int(self._ctrl_np[p][_W_GEN_FAILED]) == gen]
                if failed:
                    raise OSError(f"overlap.{op}: rank(s) {failed} could not allocate {NUM_SLOTS * slot_bytes} bytes "
                                  f"of shared memory in {envs.shm_dir()}; the heap keeps its old size")
                self.data = [own if p == self.rank else
                             shm.attach_segment(self._path(f"g{gen}", p), NUM_SLOTS * slot_bytes)
                             for p in range(self.world_size)]
                barrier(_W_GEN_MAPPED, "peer did not map the segments")
            finally:
                shm.unlink(path)
        self.slot_bytes = slot_bytes
        self._ptr_tables.clear()

    def reserve(self, nbytes: int, timeout: float) -> None:
        self.begin("reserve", f"reserve(bytes={nbytes})", nbytes, timeout).finish()

    # -- buffers --------------------------------------------------------------------------------
    def slot_tensor(self, peer: int, slot: int, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0):
        """View of `shape` elements of `dtype` in `peer`'s slot, starting `offset` bytes in."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert offset % 16 == 0 and offset + nbytes <= self.slot_bytes, (offset, nbytes, self.slot_bytes)
        start = slot * self.slot_bytes + offset
        return self.data[peer][start : start + nbytes].view(dtype).view(shape)

    def ptr_table(self, slot: int, offset: int = 0) -> torch.Tensor:
        """int64 ``[world]`` tensor of every peer's slot address (+offset) in this process."""
        return self._table((slot, offset), lambda: [t.data_ptr() + slot * self.slot_bytes + offset for t in self.data])

    def _table(self, key: Any, addresses: Any) -> torch.Tensor:
        """The cached int64 device tensor of `key`, made from ``addresses()`` on first use.

        Bounded: keys depend on shapes (region sizes, offsets), so a run of ever-changing shapes
        would grow the cache without end; past `_MAX_TABLES` it starts over (tables are tiny and
        cheap to rebuild; a dropped one still in use by a queued kernel stays alive through the
        allocator's stream semantics)."""
        table = self._ptr_tables.get(key)
        if table is None:
            if len(self._ptr_tables) >= _MAX_TABLES:
                self._ptr_tables.clear()
            table = torch.tensor(addresses(), dtype=torch.int64, device=self.device)
            self._ptr_tables[key] = table
        return table

    def region_table(self, slot: int, peer: int, region_bytes: int, count: int, offset: int = 0) -> torch.Tensor:
        """int64 ``[count]`` tensor of the addresses of `count` consecutive regions of `peer`'s slot,
        the first `offset` bytes in."""
        assert region_bytes % 16 == 0 and offset + count * region_bytes <= self.slot_bytes, (region_bytes, count)
        base = self.data[peer].data_ptr() + slot * self.slot_bytes + offset
        return self._table((slot, f"regions{peer},{region_bytes},{count},{offset}"),
                           lambda: [base + i * region_bytes for i in range(count)])

    def counters(self, slot: int) -> torch.Tensor:
        """This rank's `MAX_FLAGS` int32 chunk counters of `slot` (zero between calls: kernels reset them)."""
        table = self._counters.get(slot)
        if table is None:
            table = torch.zeros(MAX_FLAGS, dtype=torch.int32, device=self.device)
            self._counters[slot] = table
        return table

    def flag_table(self, slot: int, index: int) -> torch.Tensor:
        """int64 ``[world]`` tensor of the address of ``ready[slot][index]`` in every peer's pad."""
        word = self.ready_word(slot, index)

        def addresses() -> list[int]:
            if self.device.type == "cuda":
                return self._cuda_flags.addrs(word)
            return [self.ctrl_addr(p, word) for p in range(self.world_size)]

        return self._table((slot, f"ready{index}"), addresses)

    def close(self) -> None:
        self.closed = True
        self.data = []
        self.ctrl = []
        self._ctrl_np = []
        self._ptr_tables.clear()


class Call:
    """One call's view of the heap: its epoch, its slot, and the flag operations on them.

    Calls that use no heap data (``uses_heap`` False) make every flag operation a no-op.
    """

    def __init__(self, heap: SymmHeap, op: str, epoch: int, timeout: float, uses_heap: bool = True,
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
        missing = _c().signal_wait_all(addrs, prev, self.timeout)
        if missing >= 0:
            raise OverlapTimeout(self.op, self.rank, missing, f"slot {self.slot}", self.timeout,
                                 "the peer did not finish the slot's previous call")

    def _bounded_wait(self, addr: int, value: int, peer: int, stream: Any) -> None:
        # A one-thread kernel that spins with a %globaltimer limit and, past it, records the
        # failure in pinned memory (checked by the next call) instead of blocking the stream forever.
        _c().cuda_wait_flag_bounded(addr, value, int(self.timeout * 1e9), self.heap.err_addr(peer),
                                    _stream_handle(stream))

    def signal_ready(self, index: int = 0, stream: Any = None) -> None:
        h = self.heap
        addr = self._flag_addr(h.rank, h.ready_word(self.slot, index))
        if self._cuda():
            _c().cuda_stream_write_value32(addr, self.word, _stream_handle(stream))
        else:
            _c().signal_store(addr, self.word)

    def wait_ready(self, peer: int, index: int = 0, stream: Any = None, chunk: int | None = None) -> None:
        """Wait for `peer`'s ready flag `index` of this call; a timeout names `chunk` (default: `index`)."""
        h = self.heap
        addr = self._flag_addr(peer, h.ready_word(self.slot, index))
        if self._cuda():
            self._bounded_wait(addr, self.word, peer, stream)
        elif not _c().signal_wait(addr, self.word, self.timeout):
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
                _c().cuda_stream_write_value32(addr, self.word, _stream_handle(stream))
            else:
                _c().signal_store(addr, self.word)


def _stream_handle(stream: Any) -> int:
    if stream is None:
        stream = torch.cuda.current_stream()
    return int(stream.cuda_stream)


# ----------------------------------------------------------------------------------------------
# CUDA backing (torch's symmetric memory). Compiled and imported everywhere, run only on GPUs.
# ----------------------------------------------------------------------------------------------


def _cuda_data(group: dist.ProcessGroup, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(local, group)
    rank = dist.get_rank(group)
    return [local if p == rank else handle.get_buffer(p, (nbytes,), torch.uint8)
            for p in range(dist.get_world_size(group))]


class _CudaFlags:
    """Device flag words (same layout as the control pad's slot area) in symmetric memory."""

    def __init__(self, group: dist.ProcessGroup, world_size: int):
        self.tensors = _cuda_data(group, _CTRL_WORDS * 4, world.group_device(group))
        self.tensors[dist.get_rank(group)].zero_()
        torch.cuda.synchronize()
        world.store_exchange(group, "cuda-flags", b"", envs.timeout_s())

    def addrs(self, word: int) -> list[int]:
        return [t.data_ptr() + 4 * word for t in self.tensors]


# ----------------------------------------------------------------------------------------------
# Per-group registry
# ----------------------------------------------------------------------------------------------

_HEAPS: dict[int, tuple[Any, SymmHeap]] = {}


def heap_for(group: Any = None, timeout: float | None = None) -> SymmHeap:
    """The group's heap, created on first use (every rank of the group must call; bounded by `timeout`)."""
    pg = world.resolve_group(group)
    entry = _HEAPS.get(id(pg))
    if entry is not None and entry[0] is pg and not entry[1].closed:
        return entry[1]
    timeout = envs.timeout_s() if timeout is None else timeout
    heap = SymmHeap(pg, world.group_info(pg, timeout), timeout)
    _HEAPS[id(pg)] = (pg, heap)
    return heap


def reserve(group: Any = None, nbytes: int = 0, timeout: float | None = None) -> None:
    """Grow `group`'s symmetric heap so every slot holds at least `nbytes` (every rank calls it)."""
    from .ops import _common

    error = None
    try:
        timeout = _common.resolve_timeout(timeout)
    except ValueError as exc:
        error, timeout = exc, envs.timeout_s()
    if error is None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
        error = ValueError(f"overlap.reserve: nbytes must be a non-negative int, got {nbytes!r}")
    heap = heap_for(group, timeout)
    if error is not None:  # tell the peers at once, then raise here
        heap.begin("reserve", f"<invalid input on rank {heap.rank}: {error}>", 0, timeout, post_only=True)
        raise error
    heap.reserve(nbytes, timeout)


def release(group: Any = None) -> None:
    """Free `group`'s heap in this process. Call it on every rank of the group, not mid-call."""
    pg = world.resolve_group(group)
    entry = _HEAPS.pop(id(pg), None)
    if entry is not None:
        heap = entry[1]
        if heap.device.type == "cuda" and not heap.closed:
            torch.cuda.synchronize(heap.device)  # queued work may still read the buffers
            try:
                heap.check_async_errors("release", 0.0)
            except OverlapTimeout as exc:
                log.warning("overlap.release: %s", exc)
        heap.close()
    world.forget_group(pg)


@atexit.register
def _release_all() -> None:
    for _pg, heap in list(_HEAPS.values()):
        heap.close()
    _HEAPS.clear()
