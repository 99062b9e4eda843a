"""Agreement across nodes without a collective: the node's handshake, and messages between counterparts.

A group of CPU ranks that spans nodes has no memory every rank can read, so its ranks cannot all read each other's
call entries as the ranks of one node do (`overlap.symm.handshake`). Instead each rank agrees with two kinds of
peers, and together they cover the group:

* **its node**: the node's symmetric heap (a process group of the node's ranks, `node_group`) and its handshake
  entries, as on one node;
* **its counterparts**: rank ``(n, l)``'s counterparts are the ranks ``(n', l)`` of the other nodes (`Layout`).
  Every call of the group exchanges a fixed-size **header** with each counterpart (the call's number, its
  signature's hash and text, a kind: agreed, a node that disagreed, a rank's bad input) and, at its end, a
  **trailer** (the call went well, or the error that ended it on that rank). Both travel point-to-point under
  tags made from the call's number, and a call's data under tags hashed from its number, signature and sizes
  (`Tags`), so a message of one call is never matched by another call's receive, nor by a differing rank's.

Every node holds the same number of ranks, so every rank of the group is the counterpart of one rank of each node:
a rank that agrees with its node, whose node's ranks all agree with their counterparts, agrees with the group.

Two ways to use it (`begin`):

* **Full** (every strategy that moves data between any two ranks: ``pipelined``, ``reference``, the MoE ops): the
  node's full handshake; the header to each counterpart (kind: the node agreed, or it did not); the counterparts'
  headers; then a **verdict** in the node's control pads (`W_NODE_VERDICT`: this rank's counterparts agreed, or
  not), read from every rank of the node. A rank that passes has seen the whole group agree; a difference anywhere
  raises `OverlapMismatchError` on every rank, before any data moves. Host rendezvous: counted as one.
* **In the data** (``hierarchical``: every datum crosses the network between counterparts only): the header is
  posted at the start and the call goes on; the node's handshake is its steady state
  (`overlap.ops.hierarchical.node_call.begin_node`), and a counterpart's data is used only once its header has arrived
  and agreed (`Counterparts.wait`). Every wait on a counterpart's data also reads its trailer, so a peer that left the
  call with an error ends the wait at once (`Counterparts.wait`); a rank that leaves a call with an error tells its
  node through the node slot's header (`overlap.ops.hierarchical.node_call.Poison`) and its counterparts through its
  trailer. No host rendezvous once warmed.

A rank's own bad input (`announce_failure`) posts a poisoned entry in its node's pads and a poisoned header to its
counterparts, which both ways read. GPU groups across nodes keep the collective handshake
(`overlap.ops.context`).
"""


from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import os
import struct
import sys

import torch
import torch.distributed as dist

from ... import comm, envs, symm, world
from ...errors import OverlapError, OverlapMismatchError, OverlapTimeout
from ...symm.layout import W_NODE_VERDICT, signals, signature_hash
from .nodes import Layout, layout_of, node_heap, report_dead

# ----------------------------------------------------------------------------------------------
# Headers and trailers between counterparts
# ----------------------------------------------------------------------------------------------

#: Kinds of a header or trailer.
AGREED, NODE_DIFFERS, BAD_INPUT, MISMATCH, FAILED = 0, 1, 2, 3, 4
_WORDS = 48  # int64: number, signature hash lo, hi, rank, kind, text bytes, then the text (336 bytes)
_TEXT_AT, _TEXT_BYTES = 6, (48 - 6) * 8
_SPAN = 1 << 26


@dataclasses.dataclass(frozen=True)
class Tags:
    """The point-to-point tags of one call (the same on every rank: calls are numbered per group): its header, its
    trailer, and its data. A data message's tag is a hash of the call's number, its signature, its sub-call (a call
    runs several node calls, one per outer block) and its size: two ranks whose calls differ never match each
    other's data (so a receive can be posted before the sender's header is read, and never meets a message of
    another size), and neither do two calls."""

    number: int
    sig: tuple[int, int] = (0, 0)

    @property
    def header(self) -> int:
        return (1 << 28) + self.number % _SPAN

    @property
    def trailer(self) -> int:
        return (1 << 28) + _SPAN + self.number % _SPAN

    def data(self, sub: int, nbytes: int) -> int:
        key = struct.pack("<qiiqq", self.number, *self.sig, sub, nbytes)
        return (1 << 30) | int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") & ((1 << 30) - 1)


_NUMBERS: dict[int, tuple[object, itertools.count]] = {}


def next_number(pg) -> int:
    """This group's next call number (every rank numbers the same calls alike; a new group object starts at 1
    even where it reuses a released one's id)."""
    entry = _NUMBERS.get(id(pg))
    if entry is None or entry[0] is not pg:
        entry = _NUMBERS[id(pg)] = (pg, itertools.count(1))
    return next(entry[1])


#: The header and trailer receives of calls that ended, kept (with their buffers) until they complete: a
#: counterpart's trailer may arrive after this rank's call returned. A receive whose message never comes (a dead
#: peer) is dropped from here eventually (gloo keeps only a weak reference to its buffer).
_LATE: collections.deque = collections.deque(maxlen=1024)


class _Watcher:
    """Threads that wait for transfers (gloo's point-to-point works report completion only to a ``wait()``,
    which cannot be interrupted): a wait on a counterpart's data runs here, so that the caller can watch that
    counterpart's trailer at the same time. One pool per process, its threads made as needed and reused."""

    def __init__(self):
        self.pid = os.getpid()
        # (a wait whose message never comes, a receive of a call a peer left, holds its thread until the deadline)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="overlap-across")

    def watch(self, work, op: str, rank: int, peer: int, what, timeout: float, info) -> concurrent.futures.Future:
        return self.pool.submit(comm.wait_work, work, op, rank, peer, what, timeout, info)


_WATCHER: list[_Watcher | None] = [None]


def _watcher() -> _Watcher:
    w = _WATCHER[0]
    if w is None or w.pid != os.getpid():
        w = _WATCHER[0] = _Watcher()
    return w


def _message(number: int, sig: tuple[int, int], rank: int, kind: int, text: str) -> torch.Tensor:
    msg = torch.zeros(_WORDS, dtype=torch.int64)
    raw = text.encode()[:_TEXT_BYTES]
    msg[:_TEXT_AT] = torch.tensor([number, sig[0], sig[1], rank, kind, len(raw)])
    put_text(msg.view(torch.uint8)[_TEXT_AT * 8 :], raw)
    return msg


def put_text(dst: torch.Tensor, raw: bytes) -> None:
    """`raw` into the start of the uint8 tensor `dst`."""
    if raw:
        dst[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def get_text(src: torch.Tensor, n: int) -> str:
    """The text `put_text` wrote (`n` bytes) at the start of the uint8 tensor `src`."""
    return bytes(src[:n].tolist()).decode(errors="replace")


def _text(msg: torch.Tensor) -> str:
    return get_text(msg.view(torch.uint8)[_TEXT_AT * 8 :], int(msg[5]))


class Counterparts:
    """One call's messages with this rank's counterparts: headers, trailers and (in the data) tagged transfers.

    Construction posts the receives of every counterpart's header and trailer (fixed sizes: they match any call's)
    and has them watched (`_Watcher`); `announce` sends this rank's header, `finish` its trailer (once, either
    way). A wait on a counterpart's data first reads its header (`agreed`).

    A post that fails (the counterpart's connection closed: its process died) records the counterpart as dead
    (`report_dead`). A header's post that fails is raised by the first wait on that counterpart, not at once: the
    op is then inside its node's call, and tells its node (`overlap.ops.hierarchical.node_call.Poison`)."""

    def __init__(self, op: str, pg, info: world.GroupInfo, lay: Layout, signature: str, timeout: float):
        timeout = envs.network_timeout_s(timeout)  # (every wait here is on a rank of another node)
        self.op, self.pg, self.info, self.lay, self.timeout = op, pg, info, lay, timeout
        self.signature, self.sig = signature, signature_hash(signature)
        self.number = next_number(pg)
        self.tags = Tags(self.number, self.sig)
        self.peers = lay.counterparts()
        self.headers = {p: torch.empty(_WORDS, dtype=torch.int64) for p in self.peers}
        self.trailers = {p: torch.empty(_WORDS, dtype=torch.int64) for p in self.peers}
        watcher = _watcher()
        self.header_futs, self.trailer_futs = {}, {}
        for p in self.peers:
            try:
                work = self._post(dist.irecv, self.headers[p], p, self.tags.header, "header")
                self.header_futs[p] = watcher.watch(work, op, info.rank, p, "header", timeout, info)
                work = self._post(dist.irecv, self.trailers[p], p, self.tags.trailer, "trailer")
                self.trailer_futs[p] = watcher.watch(work, op, info.rank, p, "trailer", timeout, info)
            except OverlapError as exc:
                self._broken(p, exc)
        self.checked: set[int] = set()
        self.sends: list = []  # (work, tensor) of the headers and trailers: waited at the end
        self.data: list = []  # (work, tensor) of the data sends (the op waits for them): kept alive until the end
        self.received: list[_Recv] = []  # kept alive until the call ends
        self.subs = 0
        self.announced = self.finished = False
        self._outer = sys.exc_info()[1]

    # ---- posting ---------------------------------------------------------------------------------
    def _post(self, fn, tensor: torch.Tensor, peer: int, tag: int, what):
        try:
            return fn(tensor, self.info.global_ranks[peer], group=self.pg, tag=tag)
        except RuntimeError as exc:
            report_dead(self.info, peer)
            raise OverlapError(f"overlap.{self.op}: rank {self.info.rank}: posting the {what} to or from rank {peer} "
                               f"failed: {exc}. The peer probably died; destroy and re-create the group.") from exc

    def _broken(self, peer: int, exc: OverlapError) -> None:
        """`peer`'s header and trailer will never come: the next wait on either raises `exc`."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_exception(exc)
        self.header_futs[peer] = self.trailer_futs[peer] = fut

    def announce(self, kind: int = AGREED, text: str | None = None) -> None:
        """Send this rank's header to every counterpart (once)."""
        if self.announced:
            return
        self.announced = True
        msg = _message(self.number, self.sig, self.info.rank, kind, self.signature if text is None else text)
        for p in self.peers:
            try:
                self.sends.append((self._post(dist.isend, msg, p, self.tags.header, "header"), msg))
            except OverlapError as exc:
                self._broken(p, exc)

    def sub(self) -> int:
        """The next sub-call's index (its data tag)."""
        self.subs += 1
        return self.subs - 1

    def send(self, tensor: torch.Tensor, peer: int, sub: int):
        """Post `tensor` to counterpart `peer` (sub-call `sub`); counted as network bytes."""
        comm.count_sent(self.info, peer, tensor.numel() * tensor.element_size())
        work = self._post(dist.isend, tensor, peer, self.tags.data(sub, tensor.numel() * tensor.element_size()), "data")
        self.data.append((work, tensor))
        return work

    def recv(self, tensor: torch.Tensor, peer: int, sub: int, chunk) -> _Recv:
        """Post `tensor`'s receive from counterpart `peer` (sub-call `sub`; `chunk` names it in errors), watched;
        its data is used only once the peer's header has agreed (`wait`)."""
        work = self._post(dist.irecv, tensor, peer, self.tags.data(sub, tensor.numel() * tensor.element_size()), "data")
        r = _Recv(tensor, work, _watcher().watch(work, self.op, self.info.rank, peer, chunk, self.timeout, self.info))
        self.received.append(r)
        return r

    # ---- agreement -------------------------------------------------------------------------------
    def agreed(self, peer: int) -> None:
        """Wait for `peer`'s header (within the deadline); raise where it differs."""
        if peer not in self.checked:
            differ = self._difference(peer)
            if differ is not None:
                raise OverlapMismatchError.of(self.op, self.number, self.info.rank, self.signature, {peer: differ})
            self.checked.add(peer)

    def _difference(self, peer: int) -> str | None:
        """Wait for `peer`'s header: None where it agrees, else its text."""
        self.header_futs[peer].result()  # (the watched wait has the deadline; its error is raised here)
        got = self.headers[peer]
        kind, text = int(got[4]), _text(got)
        if kind == AGREED and (int(got[1]), int(got[2])) == self.sig and int(got[0]) == self.number:
            return None
        return f"<its node's ranks disagree: {text}>" if kind == NODE_DIFFERS else text

    def differing(self) -> dict[int, str]:
        """Every counterpart's header, waited for: the texts of those that differ (empty: all agree)."""
        differ = {p: self._difference(p) for p in self.peers}
        self.checked.update(p for p, text in differ.items() if text is None)
        return {p: text for p, text in differ.items() if text is not None}

    def _trailer(self, peer: int) -> None:
        """`peer`'s trailer, arrived: raise what ended the call there (nothing where it went well)."""
        self.trailer_futs[peer].result()
        got = self.trailers[peer]
        kind = int(got[4])
        if kind == AGREED:
            return
        text = (f"overlap.{self.op}: rank {self.info.rank}: rank {peer} (node {self.info.nodes[peer]!r}) left call "
                f"{self.number} of this group with an error: {_text(got)}")
        raise (OverlapMismatchError if kind in (MISMATCH, BAD_INPUT) else OverlapError)(text)

    def wait(self, work, peer: int, chunk) -> None:
        """Wait for a transfer with counterpart `peer` (a send's work or a `recv`) within the deadline, watching
        its trailer meanwhile: a peer that left the call with an error ends the wait with that error."""
        if isinstance(work, _Recv):
            self.agreed(peer)
            fut = work.fut
        else:
            fut = _watcher().watch(work, self.op, self.info.rank, peer, chunk, self.timeout, self.info)
        trailer = self.trailer_futs[peer]
        concurrent.futures.wait([fut, trailer], timeout=self.timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        if not fut.done() and trailer.done():
            self._trailer(peer)  # (raises where the peer failed; else its data is on its way)
        fut.result(timeout=self.timeout)

    # ---- the end ---------------------------------------------------------------------------------
    def finish(self, exc: BaseException | None = None) -> None:
        """Send the trailer (once): the call went well (`exc` None), or how it ended here. On the success path
        every send is waited for (their tensors are the caller's)."""
        if self.finished:
            return
        self.finished = True
        if not self.announced:
            self.announce(FAILED, f"<rank {self.info.rank} failed before its header: {exc}>")
        if exc is None:
            kind, text = AGREED, ""
        else:
            kind = MISMATCH if isinstance(exc, OverlapMismatchError) else FAILED
            text = f"{type(exc).__name__}: {exc}"
        msg = _message(self.number, self.sig, self.info.rank, kind, text)
        trailers = []
        for p in self.peers:
            # (a counterpart that died after its part of a call that went well here needs no trailer: it was
            # recorded as dead, and the next call raises)
            with contextlib.suppress(OverlapError):
                trailers.append((self._post(dist.isend, msg, p, self.tags.trailer, "trailer"), msg))
        if exc is None:  # (every data transfer was waited for by the op: only the headers and trailers are left)
            for work, _ in self.sends:
                comm.wait_work(work, self.op, self.info.rank, "a counterpart", "a header", self.timeout, self.info)
            for work, _ in trailers:
                with contextlib.suppress(OverlapError):
                    comm.wait_work(work, self.op, self.info.rank, "a counterpart", "a trailer", self.timeout, self.info)
            self.sends, self.data, self.received = [], [], []
        else:
            self.sends += trailers
        futs = [*self.header_futs.values(), *self.trailer_futs.values()]
        # (kept until the counterparts' headers and trailers are in; an error path keeps its transfers' tensors too)
        _LATE.append((futs, self.headers, self.trailers, self.sends, self.data, self.received))
        while _LATE and all(f.done() for f in _LATE[0][0]):
            _LATE.popleft()

    def finish_here(self) -> None:
        """`finish` from a ``finally`` block: the exception on its way out, if any, is the call's own."""
        exc = sys.exc_info()[1]
        self.finish(None if exc is self._outer else exc)


class _Recv:
    """A receive from a counterpart and its watched wait (`fut`)."""

    def __init__(self, tensor: torch.Tensor, work, fut: concurrent.futures.Future):
        self.tensor, self.work, self.fut = tensor, work, fut

    def done(self) -> bool:
        return self.fut.done()


# ----------------------------------------------------------------------------------------------
# The call's begin
# ----------------------------------------------------------------------------------------------


class Agreed:
    """A full cross-node handshake's result (nothing left to do at the end)."""

    def __init__(self, number: int):
        self.epoch = number

    def finish(self) -> None:
        pass


class InData:
    """A call whose agreement travels with its data (``hierarchical``): its `Counterparts`; `finish` sends the
    trailer (the call's own exception, if one is on its way out, says how it ended)."""

    def __init__(self, cp: Counterparts):
        self.cp = cp
        self.epoch = cp.number

    def finish(self) -> None:
        self.cp.finish_here()


def begin(op: str, pg, info: world.GroupInfo, signature: str, timeout: float, in_data: bool):
    """The group's handshake across nodes (CPU ranks): `InData` where `in_data`, else the full one (`Agreed`)."""
    lay = layout_of(info)
    cp = Counterparts(op, pg, info, lay, signature, timeout)
    if in_data:
        cp.announce()
        return InData(cp)
    symm.handshake.COUNTS["rendezvous"] += 1
    try:
        heap = node = None
        if lay.ranks_per_node > 1:
            heap = node_heap(info, lay, timeout)
            try:
                node = heap.begin(op, signature, 0, timeout)
            except OverlapMismatchError as exc:
                cp.announce(NODE_DIFFERS, " ".join(str(exc).split()))
                raise
            node.finish()
            symm.handshake.COUNTS["rendezvous"] -= 1  # (one rendezvous for the call: the node's counted itself)
        cp.announce()
        differ = cp.differing()
        if node is not None:
            _verdict(op, heap, node.epoch, lay, differ, timeout)
        if differ:
            raise OverlapMismatchError.of(op, cp.number, info.rank, signature, differ)
    except BaseException as exc:
        cp.finish(exc)
        raise
    cp.finish()
    return Agreed(cp.number)


def _verdict(op: str, heap, epoch: int, lay: Layout, differ: dict[int, str], timeout: float) -> None:
    """Tell the node whether this rank's counterparts agreed (``2 * epoch``, plus one where not), then read every
    node rank's word: a node rank whose counterparts differ fails the call here too."""
    c = signals()
    c.signal_store(heap.ctrl_addr(heap.rank, W_NODE_VERDICT), 2 * epoch + (1 if differ else 0))
    peers = [q for q in range(heap.world_size) if q != heap.rank]
    missing = c.signal_wait_all([heap.ctrl_addr(q, W_NODE_VERDICT) for q in peers], 2 * epoch, timeout)
    if missing >= 0:
        raise OverlapTimeout(op, lay.rank(lay.node, lay.local), lay.rank(lay.node, peers[missing]), "verdict", timeout,
                             "the node's rank never read its counterparts' headers")
    if differ:
        return
    bad = [lay.rank(lay.node, q) for q in peers if c.signal_load(heap.ctrl_addr(q, W_NODE_VERDICT)) & 1]
    if bad:
        raise OverlapMismatchError(f"overlap.{op}: rank {lay.rank(lay.node, lay.local)}: ranks disagree on this call: "
                                   f"the counterparts on other nodes of rank(s) {bad} of this node made another call "
                                   "(their errors list the signatures); every rank of a group must make the same "
                                   "calls with the same shapes, dtypes and plans")


def announce_failure(op: str, pg, info: world.GroupInfo, signature: str, timeout: float) -> None:
    """A rank's own bad input (`signature` poisoned): a poisoned entry in its node's pads and a poisoned header
    and failed trailer to its counterparts, which every other rank learns of through them."""
    lay = layout_of(info)
    cp = Counterparts(op, pg, info, lay, signature, timeout)
    try:
        cp.announce(BAD_INPUT)
        if lay.ranks_per_node > 1:
            node_heap(info, lay, timeout).begin(op, signature, 0, timeout, post_only=True)
    finally:
        cp.finish(OverlapMismatchError(signature))
