"""Agreement between the ranks of a group: the handshake entries in the control pads, the warmed signatures of
the steady state, and the checks that travel with the data.

Every call posts an entry ``(epoch, signature hash, bytes needed, the signature's text)`` in its rank's pad,
in a ring of `HS_RING` entries, then stores its epoch in ``W_HS_EPOCH`` (a release: a peer that reads that
epoch sees the whole entry). What happens next depends on the call:

* **Full handshake** (the first call of a signature on this rank, heap growth, the epoch re-base, every call
  of a strategy without a steady state, ``OVERLAP_CHECK_EVERY_CALL=1``): wait until every peer has posted
  the epoch, compare every peer's hash with this rank's, agree on the bytes needed. A host rendezvous.
* **Steady state** (a signature this rank has already seen pass a full handshake, whose bytes are fixed by
  its text): post and go on. The signature is checked in the data: a peer's ready flag of this epoch is
  stored after its entry, so once a wait on that flag passes, the peer's entry is there to compare
  (`SignatureCheck.verify`); a wait that is not yet satisfied looks at the peers' entries between slices of
  its deadline, so a peer that made another call is reported as `OverlapMismatchError`, not as a timeout. A
  peer this rank never waited on is compared at this rank's next call (`SignatureCheck.resolve`). A
  ``pipelined`` call (no slot, no flag) checks the entries before it posts its receives and carries the
  signature on its point-to-point messages (`overlap.symm.p2p`).
* **Ahead** (a ``reference`` call of a TP op whose signature the group's recent calls predict,
  `overlap.symm.plain`): post with the `AHEAD` flag and issue the plain collectives at once; the peers' entries
  are compared once they complete. A rank that leaves a call where a peer went ahead issues that peer's
  collectives with zeros first (`overlap.symm.plain.drain`).

A rank that leaves a call without using its slot (a mismatch, its own bad input) stores its "done" flags of
the slot as if it had used it (`abandon`), since a peer in the steady state may have counted the call as one
that used the slot; the ring of the heap stays whole either way.
"""

from __future__ import annotations

import collections
import functools
import time

import numpy as np

from ..errors import OverlapMismatchError
from ..stages import timed
from .layout import HS_BASE, HS_RING, HS_STRIDE, NUM_SLOTS, SIG_TEXT_BYTES, W_HS_EPOCH, signals

#: Host synchronizations of this process, by kind: ``rendezvous`` (a full handshake: this rank waited until
#: every peer had posted the call, or a full handshake across nodes, `overlap.ops.hierarchical.agreement`: one per
#: call), ``steady`` (calls that posted their entry and went on; across nodes a hierarchical TP call's node handshake),
#: ``ring_wait`` (steady calls that had to wait for a peer more than `HS_RING` - 1 calls behind). Read with
#: `overlap.symm.host_sync_counts`.
COUNTS: collections.Counter = collections.Counter()

#: Words of an entry: epoch tag, signature hash (lo, hi), bytes needed (lo, hi), flags, then the text.
_TAG, _LO, _HI, _NEED_LO, _NEED_HI, _FLAGS, _TEXT = 0, 1, 2, 3, 4, 5, 6
#: Flag of an entry: the rank issued the call's collectives without a rendezvous (`overlap.symm.plain`).
AHEAD = 1

#: Signatures remembered as warmed per heap; past it the set starts over (a run of ever-new shapes then
#: pays the full handshake, which it pays anyway for new shapes).
_MAX_WARMED = 4096

#: Slice of a steady-state wait between two looks at the peers' entries.
_SLICE_S = 0.01

#: How long a rank that found a mismatch in the steady state waits for the other peers' entries, so that its
#: message lists every signature that differs (a peer that never posts is left out).
_COMPLETE_S = 2.0


def entry_word(epoch: int) -> int:
    return HS_BASE + (epoch % HS_RING) * HS_STRIDE


def post(heap, epoch: int, lo: int, hi: int, need: int, signature: str, flags: int = 0) -> None:
    """Write this rank's entry of `epoch`, then publish the epoch (release)."""
    entry = entry_word(epoch)
    mine = heap.pad(heap.rank)
    mine[entry + _LO : entry + _TEXT] = (lo, hi, need & 0x7FFFFFFF, need >> 31, flags)
    mine[entry + _TEXT : entry + HS_STRIDE] = _text_words(signature)
    mine[entry + _TAG] = epoch
    signals().signal_store(heap.ctrl_addr(heap.rank, W_HS_EPOCH), epoch)


@functools.lru_cache(maxsize=1024)
def _text_words(signature: str) -> np.ndarray:
    """The signature's readable copy as the entry's int32 words (truncated, zero-padded)."""
    raw = signature.encode()[:SIG_TEXT_BYTES].ljust(SIG_TEXT_BYTES, b"\0")
    return np.frombuffer(raw, dtype=np.int32)


def posted(heap, peer: int, epoch: int) -> bool:
    """Whether `peer` has published its entry of `epoch` (or a later one)."""
    return int(heap.pad(peer)[W_HS_EPOCH]) >= epoch


def _words(heap, peer: int, epoch: int):
    """A copy of the numeric words of `peer`'s entry of `epoch`, or None if it has not posted it (or, impossible
    while the ring rule holds, has overwritten it)."""
    if not posted(heap, peer, epoch):
        return None
    words = heap.pad(peer)[entry_word(epoch) : entry_word(epoch) + _TEXT].copy()
    return words if int(words[_TAG]) == epoch else None


def entry_of(heap, peer: int, epoch: int) -> tuple[int, int, int] | None:
    """``(lo, hi, need)`` of `peer`'s entry of `epoch`, or None (`_words`)."""
    words = _words(heap, peer, epoch)
    if words is None:
        return None
    return int(words[_LO]), int(words[_HI]), int(words[_NEED_LO]) | (int(words[_NEED_HI]) << 31)


def went_ahead(heap, peer: int, epoch: int) -> tuple[int, int] | None:
    """The signature hash of `peer`'s entry of `epoch` if that rank issued the call's collectives without a
    rendezvous (`AHEAD`), else None (not that, or not posted)."""
    words = _words(heap, peer, epoch)
    if words is None or not int(words[_FLAGS]) & AHEAD:
        return None
    return int(words[_LO]), int(words[_HI])


def text_of(heap, peer: int, epoch: int) -> str:
    entry = entry_word(epoch)
    raw = bytes(heap.pad(peer)[entry + _TEXT : entry + HS_STRIDE].view("u1"))
    return raw.rstrip(bytes(1)).decode(errors="replace")


def differing(heap, epoch: int, lo: int, hi: int, peers) -> dict[int, str]:
    """The peers among `peers` that have posted an entry of `epoch` with another signature, with its text."""
    out = {}
    for p in peers:
        got = entry_of(heap, p, epoch)
        if got is not None and got[:2] != (lo, hi):
            out[p] = text_of(heap, p, epoch)
    return out


def abandon(heap, epoch: int) -> None:
    """Store this rank's "done" flags of `epoch`'s slot in every pad: it leaves the call without using the slot.

    CPU heaps only (the steady state runs there; on GPUs a host store could overtake a queued stream write of
    the same flag). Harmless to peers: this rank has finished every earlier call (host order)."""
    if heap.device.type != "cpu" or heap.closed:
        return
    slot = epoch % NUM_SLOTS
    c = signals()
    for q in range(heap.world_size):
        c.signal_store(heap.ctrl_addr(q, heap.done_word(slot, heap.rank)), epoch)


class Warmed:
    """The ``(signature hash, bytes)`` pairs this rank has seen pass a full handshake on one heap."""

    def __init__(self):
        self._seen: set[tuple[int, int, int]] = set()

    def add(self, lo: int, hi: int, need: int) -> None:
        if len(self._seen) >= _MAX_WARMED:
            self._seen.clear()
        self._seen.add((lo, hi, need))

    def __contains__(self, key: tuple[int, int, int]) -> bool:
        return key in self._seen

    def clear(self) -> None:
        self._seen.clear()


class SignatureCheck:
    """The signature check of one steady-state call: which peers' entries are still to compare."""

    def __init__(self, heap, op: str, epoch: int, lo: int, hi: int, signature: str, timeout: float):
        self.heap, self.op, self.epoch, self.lo, self.hi, self.signature = heap, op, epoch, lo, hi, signature
        self.timeout = timeout
        self.unverified = {p for p in range(heap.world_size) if p != heap.rank}
        self.compared: set[int] = set()  # the peers whose entries were read and found alike
        self.failed: dict[int, str] = {}  # the peers found to differ, with their signatures
        self.ahead = False  # this rank issued the call's collectives without a rendezvous (`overlap.symm.plain`)

    def error(self, differ: dict[int, str], note: str = "") -> OverlapMismatchError:
        """The mismatch error of this call. Once found, every later look (`scan`: other threads of the same
        call wait on other peers) raises it too, and nothing is left to compare at the next call.

        The message lists every peer that differs, as a full handshake's does: on the first find, this rank
        waits a little (at most `_COMPLETE_S`, within the call's deadline) for every peer to post the call.
        A peer that went ahead with its plain collectives gets them answered first (`overlap.symm.plain.drain`)."""
        if not self.failed:
            self.failed = self._every_difference(differ)
            self.heap.plain.agreement.forget(self.epoch)
            if self.ahead:  # (no slot: a peer may have counted the call as one that used it)
                abandon(self.heap, self.epoch)
            else:
                self.heap.plain.drain(self.heap, self.op, self.epoch, self.timeout)
        exc = OverlapMismatchError.of(self.op, self.epoch, self.heap.rank, self.signature, self.failed)
        if note:
            exc.args = (f"{exc.args[0]}\n({note})",)
        return exc

    def _every_difference(self, differ: dict[int, str]) -> dict[int, str]:
        heap, peers = self.heap, [p for p in range(self.heap.world_size) if p != self.heap.rank]
        addrs = [heap.ctrl_addr(p, W_HS_EPOCH) for p in peers]
        signals().signal_wait_all(addrs, self.epoch, min(self.timeout, _COMPLETE_S))  # (best effort)
        return {**differing(heap, self.epoch, self.lo, self.hi, peers), **differ}

    @property
    def agreed(self) -> bool:
        """Whether every peer's entry of this call was read and found alike."""
        return not self.failed and len(self.compared) == self.heap.world_size - 1

    @property
    def pending(self) -> bool:
        """Whether some peer is still to compare (at this rank's next call)."""
        return bool(self.unverified) and not self.failed

    def verify(self, peer: int) -> None:
        """After a wait on `peer`'s flag of this call passed: its entry is there; raise if it differs."""
        if self.failed:
            raise self.error(self.failed)
        if peer not in self.unverified:
            return
        got = entry_of(self.heap, peer, self.epoch)
        if got is None:  # (the flag came from a later call of the peer's: its entry is checked later)
            return
        self.unverified.discard(peer)
        if got[:2] != (self.lo, self.hi):
            raise self.error({peer: text_of(self.heap, peer, self.epoch)})
        self.compared.add(peer)

    def scan(self) -> None:
        """Between slices of a wait: raise if any peer has posted this call with another signature."""
        if self.failed:
            raise self.error(self.failed)
        differ = differing(self.heap, self.epoch, self.lo, self.hi, sorted(self.unverified))
        if differ:
            raise self.error(differ)

    def resolve(self) -> bool:
        """At a later call: compare the peers that have posted since; True once every peer is compared."""
        for p in sorted(self.unverified):
            # (posted before the entry is read: a peer that posts between the two reads is not taken for one
            # whose entry was overwritten)
            was_posted = posted(self.heap, p, self.epoch)
            got = entry_of(self.heap, p, self.epoch)
            if got is None:
                if was_posted:  # overwritten: the peer has moved on since
                    self.unverified.discard(p)
                continue
            self.unverified.discard(p)
            if got[:2] != (self.lo, self.hi):
                raise self.error({p: text_of(self.heap, p, self.epoch)},
                                 "found at this rank's next call on the group: it had not waited on that rank")
            self.compared.add(p)
        return not self.unverified


@timed("wait")
def wait_checked(check: SignatureCheck | None, addrs: list[int], value: int, timeout: float) -> int:
    """`signal_wait_all` on `addrs` for `value` within `timeout`; with a steady-state `check`, in slices, with
    the peers' entries compared between slices. Returns the index of a flag still missing at the deadline, or
    -1."""
    c = signals()
    if check is None:
        return c.signal_wait_all(addrs, value, timeout)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        missing = c.signal_wait_all(addrs, value, max(0.0, min(_SLICE_S, left)))
        if missing < 0:
            return -1
        check.scan()
        if left <= _SLICE_S:
            return missing

