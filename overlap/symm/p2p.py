"""Point-to-point messages that carry their call's agreement: `pipelined` on CPU ranks of one node.

A `pipelined` call of the TP ops moves its data with gloo's point-to-point sends and receives. On CPU ranks of
one node it takes the steady state of `overlap.symm.handshake` (a warmed signature posts its entry in the
control pad and goes on, no rendezvous), and the agreement travels with the data instead:

* **Tags per call.** Every message of a call has a tag made from the call's number (its epoch, counted across
  re-bases: the same on every rank, since every rank makes the same calls in the same order): `HEADER` for the
  header, `DATA` for the data chunks. Two calls never share a tag within `TAG_SPAN` (2^29) calls, so a message
  left pending by an abandoned call can never be matched by a later call's receive (gloo matches a receive to
  the oldest pending send of the same peer and tag; with one tag for every call, the next call would read the
  abandoned call's bytes).
* **A header per peer.** A rank's first message of the call to a peer carries a 4-word header (call number,
  the signature's 64-bit hash as two words, its rank) in front of its first chunk (one message: the header's
  32 bytes, then the chunk's) where that chunk holds at most `PACK_MAX_BYTES` (a copy of it on each side; a
  separate header message costs a gloo round trip), else the header alone before the data. The receiver
  checks it before it uses any data from that peer; a header of another call or signature raises
  `OverlapMismatchError` (the peers' readable signatures from the control pads, where they still are).
* **Receives only once the peers agree.** Sends are posted at once (gloo moves a payload only when the
  receiver has posted the matching receive, so an early send costs nothing and blocks nobody). Receives are
  posted once every peer has posted this call's entry in its pad with this rank's signature (`Exchange.arm`:
  tried without waiting when the sends are posted, else before the first wait for data, a wait the call
  makes anyway): a peer that made another call, or failed on its own input (a poisoned entry), is found in
  the pads, every rank raises `OverlapMismatchError` (every rank sees the same entries), and no receive is
  ever posted for a call the ranks disagree on. A peer that agrees always sends, so no wait on a gloo
  receive can hang on a peer that will not send; a peer that never starts the call is an `OverlapTimeout`
  naming it ("the peer never started this call"). A peer's entry gone from the pad ring (it has moved
  `HS_RING` calls on, which the ops' nesting of at most two calls in flight rules out) is checked by its header
  only.

What happens to the sends of a call the ranks disagree on: they stay pending in gloo's queue of the pair,
under tags no later call uses, and are never transferred (their receiver never posts the receive). This rank
drops its handles of them, which frees their tensors (gloo keeps only a weak reference to the buffer); what
remains is gloo's bookkeeping of the pending message (a few dozen bytes per message on each side, until the
group is destroyed). Nothing waits on them and later calls' messages, under other tags, pass freely.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from .. import comm
from ..errors import OverlapError, OverlapMismatchError, OverlapTimeout
from . import handshake
from .layout import REBASE_EPOCH, W_HS_EPOCH

TAG_BASE = 1 << 30  # (tag 0, the untagged messages of other ops, is never used by a call of this module)
TAG_SPAN = 1 << 29
HEADER_WORDS = 4
HEADER_BYTES = 8 * HEADER_WORDS
#: A first chunk of at most this many bytes carries the header in front of it (one message instead of two,
#: at the price of a copy of the chunk on each side); a larger one is preceded by the header alone.
PACK_MAX_BYTES = 16 * 1024


def tagged(call) -> bool:
    """Whether `call` (what `CallContext.begin` returned) moves its pipelined messages through an `Exchange`:
    CPU ranks of one node (a `overlap.symm.Call` of a CPU heap)."""
    heap = getattr(call, "heap", None)
    return heap is not None and heap.device.type == "cpu"


def call_number(call) -> int:
    """The call's number, counted across the epochs' re-bases (the same on every rank)."""
    return call.heap.rebases * REBASE_EPOCH + call.epoch


def _packs(rows: torch.Tensor, bounds: list[tuple[int, int]]) -> bool:
    """Whether the header travels in front of the first chunk of `rows` cut into `bounds` (the same answer on
    both sides: the peers agree on the signature, hence on the sizes)."""
    return bool(bounds) and (bounds[0][1] - bounds[0][0]) * rows[:1].numel() * rows.element_size() <= PACK_MAX_BYTES


def _pack(header: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The header's bytes followed by those of `rows` (contiguous): the first message to a peer carries both."""
    raw = rows.reshape(-1).view(torch.uint8)
    buf = torch.empty(HEADER_BYTES + raw.numel(), dtype=torch.uint8)
    buf[:HEADER_BYTES].copy_(header.view(torch.uint8))
    buf[HEADER_BYTES:].copy_(raw)
    return buf


class Exchange:
    """The point-to-point messages of one pipelined call: `send`, `expect`, `arm`, `arrivals`, `close`
    (`abandon` on error paths).

    `cc` is the call's `overlap.ops.context.CallContext` (op, group, plan, deadline, the deadlined wait)."""

    def __init__(self, call, cc):
        self.call, self.cc, self.info = call, cc, cc.info
        n = call_number(call) % TAG_SPAN
        self.header_tag, self.data_tag = TAG_BASE + n, TAG_BASE + TAG_SPAN + n
        self.header = torch.tensor([call_number(call), call.sig[0], call.sig[1], call.rank], dtype=torch.int64)
        self._header_np = self.header.numpy()
        self.open: dict[int, tuple] = {}  # id(work) -> (work, peer, chunk): posted, not yet waited
        self.sends: list = []  # (work, peer, chunk), in posting order
        self.headed: set[int] = set()  # peers this rank has sent its header to
        self.expected: dict[int, tuple] = {}  # src -> (header buffer, [(recv tensor, chunk bounds)] in order)
        self.posted: dict[int, list] = {}  # src -> per expected segment, [(j, bounds, work)] of its receives
        self.header_works: dict[int, object] = {}
        self.checked: set[int] = set()  # peers whose header has arrived and matched
        self.agreed = False
        self.disagreed = False  # a peer's entry differs: nobody posts a receive of this call
        self.packed: dict[int, tuple] = {}  # src -> (the rows of its first chunk, the buffer it lands in)

    # -- posting --------------------------------------------------------------------------------
    def _post(self, fn, tensor: torch.Tensor, peer: int, tag: int, chunk):
        try:  # (through batch_isend_irecv, one op a batch, as `overlap.comm.exchange_chunked` posts)
            works = dist.batch_isend_irecv([dist.P2POp(fn, tensor, self.info.global_ranks[peer], self.cc.pg, tag)])
        except RuntimeError as exc:
            gone = " (its process is gone)" if self.info.gone(peer) else ""
            raise OverlapError(f"overlap.{self.cc.op}: rank {self.info.rank}: posting chunk {chunk} with peer "
                               f"{peer}{gone} failed: {exc}. A peer probably died; destroy and re-create the group."
                               ) from exc
        work = works[0] if works else None  # (none: a test's silenced rank posts no send)
        if work is not None:
            self.open[id(work)] = (work, peer, chunk)
        return work

    def _wait(self, work, peer: int, chunk) -> None:
        """Wait for `work` once (a gloo work must not be waited again, even after its wait failed)."""
        if work is not None:
            self.open.pop(id(work), None)
            self.cc.wait(work, peer, chunk)

    def _bounds(self, rows: int, peer: int) -> list[tuple[int, int]]:
        return comm.chunk_bounds(rows, self.cc.plan.chunks_for(self.info.link_class(peer))) if rows else []

    def send(self, tensor: torch.Tensor, dst: int, bounds: list[tuple[int, int]] | None = None) -> None:
        """Post the header (the first send to `dst`), then `tensor` (contiguous rows) cut along dim 0 into
        `bounds` (default: the plan's chunks for the link to `dst`). Sends to one peer arrive in their order:
        the receiver's `expect` calls for this rank follow the same order."""
        first = dst not in self.headed
        self.headed.add(dst)
        bounds = self._bounds(tensor.shape[0], dst) if bounds is None else bounds
        pack = first and _packs(tensor, bounds)
        if first and not pack:  # the header alone (no data, or a first chunk too large to copy)
            self.sends.append((self._post(dist.isend, self.header, dst, self.header_tag, "header"), dst, "header"))
        if not tensor.shape[0]:
            return
        comm.count_sent(self.info, dst, tensor.numel() * tensor.element_size())
        for j, (lo, hi) in enumerate(bounds):
            piece = _pack(self.header, tensor[lo:hi]) if pack and j == 0 else tensor[lo:hi]
            self.sends.append((self._post(dist.isend, piece, dst, self.data_tag, j), dst, j))

    def expect(self, recv: torch.Tensor, src: int, bounds: list[tuple[int, int]] | None = None) -> int:
        """`recv` (contiguous rows) is to be filled from `src`, cut as `src`'s `send` cuts it (`bounds`, default
        the plan's chunks for the link): posted by `arm` once the peers agree. Returns the segment's index for
        `arrivals` (segments of one peer in the order of its sends)."""
        header, segments = self.expected.setdefault(src, (torch.empty(HEADER_WORDS, dtype=torch.int64), []))
        segments.append((recv, self._bounds(recv.shape[0], src) if bounds is None else bounds))
        return len(segments) - 1

    def arm(self, block: bool) -> bool:
        """Post the expected receives once every peer has posted this call with this signature (`block`: wait
        for that, within the deadline). Raises `OverlapMismatchError` where a peer's entry differs."""
        if not self.agreed:
            try:
                if not self._peers_agree(block):
                    return False
            except OverlapMismatchError:
                self.disagreed = True
                raise
            self.agreed = True
            for src, (header, segments) in self.expected.items():
                if not _packs(*segments[0]):  # (the header alone: see `send`)
                    self.header_works[src] = self._post(dist.irecv, header, src, self.header_tag, "header")
                self._post_data(src)
        return True

    def _post_data(self, src: int) -> None:
        self.posted[src] = posted = []
        for s, (recv, bounds) in enumerate(self.expected[src][1]):
            posted.append([])
            for j, (lo, hi) in enumerate(bounds):
                piece = recv[lo:hi]
                if s == 0 and j == 0 and _packs(recv, bounds):  # the header travels in front of the first chunk
                    self.packed[src] = (piece, torch.empty(HEADER_BYTES + piece.numel() * piece.element_size(),
                                                           dtype=torch.uint8))
                    piece = self.packed[src][1]
                posted[-1].append((j, (lo, hi), self._post(dist.irecv, piece, src, self.data_tag, j)))

    def _peers_agree(self, block: bool) -> bool:
        call = self.call
        check = call.check
        if check is None:  # a full handshake compared every peer's entry already
            return True
        heap = call.heap
        peers = [p for p in range(call.world_size) if p != call.rank]
        if block:
            addrs = [heap.ctrl_addr(p, W_HS_EPOCH) for p in peers]
            missing = handshake.wait_checked(check, addrs, call.epoch, call.timeout)
            if missing >= 0:
                raise OverlapTimeout(call.op, call.rank, peers[missing], "handshake", call.timeout,
                                     "the peer never started this call")
        elif not all(handshake.posted(heap, p, call.epoch) for p in peers):
            check.scan()  # (a peer that has posted another signature: raise now)
            return False
        for p in peers:
            check.verify(p)  # raises where the entry differs
        check.unverified.clear()  # (an entry overwritten, its rank moved on: checked by its header only)
        return True

    # -- receiving ------------------------------------------------------------------------------
    def arrivals(self, src: int, segment: int = 0):
        """Yield ``(j, (lo, hi))`` for each chunk of `src`'s data of `segment` once it is in the expected
        tensor; the peer's header is checked first."""
        self.arm(block=True)
        if src not in self.checked:
            if src in self.packed:  # the header in front of the first chunk: check it, then unpack the rows
                piece, buf = self.packed[src]
                self._wait(self.posted[src][0][0][2], src, 0)
                self._check_header(src, buf[:HEADER_BYTES].view(torch.int64))
                piece.reshape(-1).view(torch.uint8).copy_(buf[HEADER_BYTES:])
            else:
                self._wait(self.header_works[src], src, "header")
                self._check_header(src, self.expected[src][0])
            self.checked.add(src)
        for j, bounds, work in self.posted[src][segment]:
            if work is not None and id(work) in self.open:
                self._wait(work, src, j)
            yield j, bounds

    def _check_header(self, src: int, header: torch.Tensor) -> None:
        got = header.numpy()
        if (got[:3] == self._header_np[:3]).all() and int(got[3]) == src:
            return
        call = self.call
        text = (handshake.text_of(call.heap, src, call.epoch) if handshake.entry_of(call.heap, src, call.epoch)
                else f"<a message of call {int(got[0])}, signature hash {int(got[1]) & 0xFFFFFFFF:08x}"
                     f"{int(got[2]) & 0xFFFFFFFF:08x}>")
        raise OverlapMismatchError.of(call.op, call.epoch, call.rank, call.signature, {src: text})

    def close(self) -> None:
        """The success path: wait for every send (their buffers must outlive them)."""
        for work, peer, chunk in self.sends:
            if id(work) in self.open:
                self._wait(work, peer, chunk)

    def abandon(self, exc: BaseException | None) -> None:
        """End the exchange on an error path (`exc`), so that no message of it is left half-way in gloo.

        * The peers disagree (a pad entry differs): nobody posts a receive of this call; its sends stay pending
          under tags no later call uses and are dropped (their tensors freed; module docstring).
        * A timeout or a failed peer (`OverlapError`): the group is unusable; the works are kept alive (a few,
          `_KEPT`) so that gloo never writes into or reads from freed memory.
        * Otherwise (a header of another call, a mismatch or a local error of another call of this rank while
          this one was in flight): every peer agreed on this call, so its messages all arrive: post what is
          left, then wait for every message within the deadline."""
        if not self.open:
            return
        if not self.disagreed and not isinstance(exc, OverlapError):
            try:
                self.arm(block=True)
                for work, peer, chunk in list(self.open.values()):
                    self._wait(work, peer, chunk)
            except OverlapMismatchError:
                pass  # (disagreed: nobody posts a receive of this call)
            except Exception:  # noqa: BLE001 - the first error is the one raised
                _KEPT.append(list(self.open.values()))
        elif not self.disagreed:
            _KEPT.append(list(self.open.values()))
        self.open.clear()


#: The unfinished works of the last calls that failed on a timeout or a dead peer, kept alive (their buffers
#: stay valid while gloo may still touch them; the group is unusable by then).
_KEPT: collections.deque = collections.deque(maxlen=8)
