"""Plain calls without a rendezvous: a ``reference`` call of a TP op issues its collectives as soon as it starts.

A ``reference`` call runs only ``torch.distributed`` collectives; its full handshake (a host rendezvous before
them) is what keeps a disagreement between ranks from reaching those collectives, where it would pair one rank's
all-gather with another's of another size (gloo aborts the process) or deliver another call's data. Plain
collectives carry no tag and no header, so a call that has been issued cannot be taken back: the safety has to
come before it, and without a wait. It comes from three rules.

* **Agreed calls.** An epoch of the group is *agreed* on this rank once every peer's entry of it was read and
  found alike (a full handshake, a steady call's checks), or while a call that went ahead in it has found no
  difference (it was the prediction: every rank that predicts the next call has the same signature for it).
  Every rank that holds an epoch as agreed holds the same signature for it.
* **Prediction.** Where the last `WINDOW` epochs are all agreed on this rank, the next call is predicted from
  them: the signature that followed the latest earlier occurrence of the last one (a training step repeats its
  calls: layer after layer, step after step). Every rank that predicts predicts the same signature. A plain call
  *goes ahead* only when its signature is the prediction and this rank has run it before (its collectives are
  recorded, `overlap.comm.record_on`); every other call makes its full handshake as before.
* **Drains.** A rank that leaves a call without running it (its signature differs, its own input is bad, a
  steady call found a mismatch) while a peer went ahead (the `AHEAD` flag of that peer's entry) issues the
  peer's recorded collectives itself, on zeros, before it raises (`drain`). To know, it waits for every peer's
  entry of the call, within the call's deadline (an error path only). Every rank's stream of collectives
  stays paired: every rank issues the predicted call's collectives exactly once, for real or as a drain. Where
  a drain cannot be done (a peer never posted, the collectives were not recorded here, the replay failed) the
  group is marked unusable and every later call on it raises `OverlapError` (`Plain.check`), rather than pair
  its collectives with a peer's stale one.

What a disagreeing rank gets: a rank that went ahead compares every peer's entry once its collectives complete
(a peer issues its side, real or drain, only after posting its entry) and raises `OverlapMismatchError` before
any result is returned (`OverlapError` where an entry is gone before it could be compared); the other ranks
raise it as a full handshake does. The group stays usable, and the next `WINDOW` calls make full handshakes
(the disagreeing epoch is not agreed). A peer that never comes is an `OverlapTimeout` of the collective's wait,
as for any plain collective. The epoch re-base waits for a moment with no plain call in flight.

CPU ranks only for now: on GPUs a plain call's collectives complete in stream order, after the host has
returned the result, so the check after them would come too late; GPU ranks always make the full handshake.
"""

from __future__ import annotations

import collections
import logging
import time

from .. import comm
from ..errors import OverlapError
from . import handshake
from .layout import W_HS_EPOCH, signals

log = logging.getLogger("overlap")

#: Agreed epochs a prediction needs (and how far back it looks): longer than the period of a training step's
#: calls on one group per layer (forward and backward), short enough that a disagreement costs few handshakes.
WINDOW = 16

#: Signatures whose collectives are remembered per group; past it the memory starts over on every rank alike (the
#: same calls record the same signatures in the same order), as `overlap.symm.handshake.Warmed` does.
_MAX_RECIPES = 4096

#: Slice of a drain's wait for the peers' entries between two looks for a peer whose process is gone.
_SLICE_S = 0.05


class Agreement:
    """The signatures of the group's recent agreed epochs on this rank, and the prediction they give."""

    def __init__(self):
        self._agreed: dict[int, tuple[int, int]] = {}

    def add(self, epoch: int, key: tuple[int, int]) -> None:
        self._agreed[epoch] = key
        if len(self._agreed) > 4 * WINDOW:
            for old in [e for e in self._agreed if e < epoch - 2 * WINDOW]:
                del self._agreed[old]

    def predict(self, epoch: int) -> tuple[int, int] | None:
        """The signature call `epoch` is expected to have, or None where an epoch of the window is not agreed
        or the last signature has no earlier occurrence in it."""
        window = [self._agreed.get(e) for e in range(epoch - WINDOW, epoch)]
        if None in window:
            return None
        last = window[-1]
        for i in range(WINDOW - 2, -1, -1):
            if window[i] == last:
                return window[i + 1]
        return None

    def forget(self, epoch: int) -> None:
        """A difference was found in `epoch` (which a call that went ahead held as agreed)."""
        self._agreed.pop(epoch, None)

    def clear(self) -> None:
        self._agreed.clear()


class Plain:
    """One heap's plain calls: the agreement window, the recorded collectives per signature, the drains done."""

    def __init__(self):
        self.agreement = Agreement()
        self.recipes: dict[tuple[int, int], list] = {}
        self._drained: collections.deque[int] = collections.deque(maxlen=64)
        self.in_flight = 0  # plain calls of this process not finished (the same on every rank: the same calls)
        # Why the group's collectives can no longer be trusted to pair (a drain that could not be done), or None.
        self.broken: str | None = None

    def clear(self) -> None:
        """The epochs start over (`overlap.symm.heap.SymmHeap._rebase`): forget the agreed and drained ones."""
        self.agreement.clear()
        self._drained.clear()

    def goes_ahead(self, key: tuple[int, int], epoch: int) -> bool:
        """Whether a plain call of signature `key` issues its collectives without a rendezvous at `epoch`."""
        return key in self.recipes and self.agreement.predict(epoch) == key

    def recording(self, heap, key: tuple[int, int] | None) -> list | None:
        """At a call's start: record the collectives of a plain call (`key`) not recorded yet, and stop recording
        any earlier call's (a call's collectives are those issued before the group's next call starts)."""
        into = [] if key is not None and key not in self.recipes else None
        comm.record_on(heap.group, into)
        return into

    def recorded(self, heap, key: tuple[int, int], into: list, keep: bool) -> None:
        """At a plain call's end: stop recording it; `keep` (it succeeded) what it issued."""
        comm.stop_recording(heap.group, into)
        if not keep:
            return
        if len(self.recipes) >= _MAX_RECIPES:
            self.recipes.clear()
        self.recipes[key] = into

    def drain(self, heap, op: str, epoch: int, timeout: float) -> None:
        """This rank leaves call `epoch` without running it: first issue, on zeros, the collectives of any peer
        that went ahead in it, so that they complete and every rank's collectives stay paired. It must know
        whether any did: it waits for every peer's entry of the call (within `timeout`, the call's deadline; an
        error path only), less where a missing peer's process is gone. Once per epoch; nothing where no plain
        call was ever recorded here (then no peer can go ahead: its prediction is a signature every rank ran).

        Where it cannot answer (a peer never posted, a collective this rank has not recorded, the replay
        failed), the group's collectives can no longer be trusted to pair: `broken` says why, and every later
        call on the group raises it (`check`) instead of pairing its collectives with a peer's stale one."""
        if not self.recipes or epoch in self._drained or heap.device.type != "cpu":  # (GPU ranks never go ahead)
            return
        self._drained.append(epoch)
        peers = [p for p in range(heap.world_size) if p != heap.rank]
        missing = _wait_posted(heap, peers, epoch, timeout)
        if missing:
            self.broken = (f"overlap.{op}: rank {heap.rank} left call {epoch} of this group without knowing whether "
                           f"rank(s) {missing} issued its collectives (they never started it within {timeout:g} s)")
            return
        keys = {key for p in peers if (key := handshake.went_ahead(heap, p, epoch)) is not None}
        for key in sorted(keys):  # (one: every rank that goes ahead has the same prediction)
            into = self.recipes.get(key)
            try:
                if into is None:
                    raise OverlapError("this rank has not recorded that call's collectives")
                for work in comm.replay(into, heap.group, heap.device):
                    comm.wait_work(work, op, heap.rank, "any", "drain", timeout, heap.info)
            except OverlapError as exc:  # (raised by every later call: the mismatch is this call's error)
                self.broken = (f"overlap.{op}: rank {heap.rank} could not answer the collectives that its peers "
                               f"issued ahead in call {epoch} of this group ({exc})")
                log.warning("%s", self.broken)

    def check(self) -> None:
        """At a call's start: raise if a drain could not be done (the group is unusable)."""
        if self.broken is not None:
            raise OverlapError(f"{self.broken}. This group is now unusable: destroy and re-create it "
                               "(torch.distributed.destroy_process_group, overlap.release).")


def _wait_posted(heap, peers: list[int], epoch: int, timeout: float) -> list[int]:
    """Wait until every peer has posted `epoch`, within `timeout`, in slices (a peer whose process is gone
    ends the wait); returns the peers that have not."""
    addrs = {p: heap.ctrl_addr(p, W_HS_EPOCH) for p in peers}
    deadline = time.monotonic() + timeout
    while True:
        missing = [p for p in peers if not handshake.posted(heap, p, epoch)]
        left = deadline - time.monotonic()
        if not missing or left <= 0 or heap.info.gone_peers():
            return missing
        signals().signal_wait_all([addrs[p] for p in missing], epoch, min(_SLICE_S, left))
