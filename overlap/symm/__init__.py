"""Symmetric memory: equal buffers on every rank of a node, addressable by every rank, and flags.

Per group (created lazily by the first call, through a bounded rendezvous on the process group's
store):

* a **control pad** per rank in host POSIX shared memory (CPU and GPU alike): the per-call
  handshake words (epoch, signature, bytes needed, a readable copy of the signature) and the data
  flags of `Call` (GPU ranks register every pad as mapped host memory: the ``symm`` pipelines'
  stream-ordered waits poll them, and the host watchdog can release them; see `overlap.symm.call`);
* a **data heap** per rank, split into a ring of `NUM_SLOTS` equal slots. CPU: a POSIX shared
  memory segment (`overlap.shm`) mapped by every local rank. CUDA: torch's ``_symmetric_memory``,
  with the fused kernels' flag words in a separate symmetric allocation (flags never move when the heap
  grows; their in-kernel waits are atomics, which need device memory);
* a per-process table of peer addresses (`overlap.symm.tables.AddressTables`), which Triton kernels take.

The buffer protocol (docs/protocol.md) as implemented here:

* **Handshake.** Every call on a group (any strategy, any op) starts with `SymmHeap.begin`:
  the group's epoch advances by one and each rank posts ``(signature, bytes needed)`` under the
  new epoch. In a **full handshake** it then waits until every peer has posted the same epoch and
  compares every peer's signature with its own, so a disagreement raises `OverlapMismatchError` on
  every rank, with every signature in the message; nothing else has been exchanged, so the group
  stays usable. A **steady-state** call (``symm`` strategies of the TP ops on CPU ranks, once this
  rank has seen the signature pass a full handshake) posts and goes on: its signature is checked in
  the data waits (`overlap.symm.handshake`), and a peer that made another call still makes it raise
  `OverlapMismatchError`. A ``reference`` call of a TP op that the group's recent calls predict goes
  ahead too: it issues its plain collectives at once and compares the peers' signatures once they
  complete; a disagreeing rank answers them with zeros before it raises (`overlap.symm.plain`). A
  rank whose own arguments are wrong posts a poisoned signature without waiting (``post_only``) and
  raises; its peers raise at once. Ranks can run several calls
  ahead, so every call first waits until its peers are within the ring (a peer that posted epoch
  ``E - 3`` has read every entry of ``E - 4``): a ring of four entries per rank is never
  overwritten before it is read.
* **Growth.** After a full handshake all ranks know the same ``need``; if a slot is smaller, every rank grows
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
* **Epoch words.** The fused kernels read the call's epoch from its slot's int32 device word
  (`Call.epoch_word`, written on the current stream after that wait): like the slot's data, it is
  rewritten only once every rank has finished the previous call on the slot.
* **Re-base.** Flags are int32: the call that reaches `REBASE_EPOCH` (2^30) clears every flag
  of the group and restarts from epoch 1, all ranks together (`SymmHeap._rebase`).

Memory ordering: a producer writes its data with ordinary stores, then publishes the flag with
a release store; a consumer reads the flag with an acquire load before it reads the data
(``overlap._C`` on CPU, system-scope acquire in Triton, stream writes with a memory barrier in CUDA).
On GPUs a `Call` publish writes both its pad word and its device word; a kernel's release of a flag that
a ``symm`` consumer waits for is mirrored into the pad after the kernel, in stream order.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import torch

from .. import envs, world
from ..errors import OverlapTimeout
from . import handshake
from .call import Call
from .heap import SymmHeap
from .layout import MAX_FLAGS, MAX_PEERS, MAX_SLOT_BYTES, NUM_SLOTS, REBASE_EPOCH, signature_hash

log = logging.getLogger("overlap")

__all__ = ["MAX_FLAGS", "MAX_PEERS", "NUM_SLOTS", "REBASE_EPOCH", "Call", "SymmHeap", "heap_for", "heap_if_open",
           "host_sync_counts", "release", "reserve", "signature_hash"]


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


def heap_if_open(group: Any = None) -> SymmHeap | None:
    """The group's heap in this process if a call has created it and it is open, else None; never creates
    one and never communicates (for monitoring: `SymmHeap.data_bytes`)."""
    pg = world.resolve_group(group)
    entry = _HEAPS.get(id(pg))
    return entry[1] if entry is not None and entry[0] is pg and not entry[1].closed else None


def host_sync_counts() -> dict[str, int]:
    """This process's host synchronizations between ranks so far, by kind (`overlap.symm.handshake.COUNTS`):
    ``rendezvous`` (full handshakes: the call waited on the host until every peer had started it),
    ``steady`` (calls that skipped it: a warmed signature, checked in the data; a predicted ``reference`` call,
    checked after its collectives, `overlap.symm.plain`), ``ring_wait`` (steady calls
    that waited for a peer more than three calls behind)."""
    return {k: handshake.COUNTS[k] for k in ("rendezvous", "steady", "ring_wait")}


def reserve(group: Any = None, nbytes: int = 0, timeout: float | None = None) -> None:
    """Grow `group`'s symmetric heap so every slot holds at least `nbytes` (every rank calls it)."""
    error = None
    try:
        timeout = envs.resolve_timeout(timeout)
    except ValueError as exc:
        error = exc
    if error is not None:  # (outside the handler: a bad OVERLAP_TIMEOUT_S raises alone, not chained to `error`)
        timeout = envs.timeout_s()
    if error is None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= MAX_SLOT_BYTES):
        error = ValueError(f"overlap.reserve: nbytes must be an int from 0 to {MAX_SLOT_BYTES}, got {nbytes!r}")
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
