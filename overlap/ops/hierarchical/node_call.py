"""Groups that span nodes: the plumbing that ``hierarchical`` shares between the TP ops
(`overlap.ops.tp.hierarchical_gather`, `overlap.ops.tp.hierarchical_reduce`) and the MoE ops
(`overlap.ops.moe.hierarchical`, `overlap.ops.moe.migration`): the node's call on its heap, waits on the node's
flags, failures.

Topology (`overlap.ops.hierarchical.nodes.Layout`). The group's nodes, ordered by their lowest group rank; the ranks of
a node in group rank order; ``(node, local)`` names a rank. ``hierarchical`` needs every node to hold the same number of
ranks ``L`` (ValueError otherwise, from `overlap.plans.auto.fit_plan`, in the preamble). Rank ``(n, l)``'s
**counterparts** are the ranks ``(n', l)`` of the other nodes: all network traffic is between counterparts,
chunked for the ``network`` link (`Plan.chunks_for("network")`); traffic within a node goes through the node's
heap, chunked for the node's link (``shm`` on CPU ranks).

The node's heap belongs to the **node group** (`overlap.ops.hierarchical.nodes.node_group`). A call makes the group's
handshake (`CallContext.begin`: across nodes `overlap.ops.hierarchical.agreement`, for the TP ops in their data), then
the node's handshake (`begin_node`, the same signature; the TP ops' in its steady state) and runs on a slot of the node
heap. Every slot starts with a `HEADER_BYTES` header (int64 ``dead + 1``: a failed remote rank this rank saw, else 0;
the kind of an error that ended the call on this rank and its text); the op's areas follow.

Failures. Every wait has the call's deadline. A network wait that fails (the counterpart's process died:
its connection closed) or times out on a rank whose process is gone writes ``dead + 1`` in this rank's
header, raises every flag this rank owns in the call (so its node's peers stop waiting for it and read the
header) and records the dead rank in the process group's store (`report_dead`); an error raised in a
hierarchical call names the dead rank recorded there, whichever rank it reached first (`guard`; a rank whose wait
timed out first gives its peers `REPORT_GRACE_S` to record one: the peer it waited for may be stuck on the dead
rank). Any other
error that ends a TP op's call on a rank is written in its header the same way (`Poison.error`; its node's
waiters raise it, a mismatch as `OverlapMismatchError`) and in its trailer to its counterparts.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ... import comm, symm
from ...errors import OverlapError, OverlapMismatchError, OverlapTimeout
from ..context import CallContext
from .agreement import FAILED, MISMATCH, Counterparts, get_text, put_text
from .nodes import Layout, dead_key, layout_of, node_heap, report_dead

#: bytes of a slot's header: int64 ``dead + 1`` (a failed remote rank this rank saw, else 0), the kind of an error
#: that ended the call on this rank (`overlap.ops.hierarchical.agreement.MISMATCH` or ``FAILED``, else 0), its text's
#: length, then the text
HEADER_BYTES = 512
_TEXT_AT = 32

#: Seconds a rank whose wait timed out gives its peers to record a dead rank before it raises (`guard`): the peer it
#: waited for may itself be stuck on the dead rank, and learn so a moment later (at most the call's deadline).
REPORT_GRACE_S = 2.0


def begin_node(cc: CallContext, lay: Layout, need: int, steady: bool = False) -> symm.Call:
    """The node's handshake for this call (after the group's): a slot of at least `need` bytes (the header
    included); its header cleared once the slot is free. `steady`: the node's steady state (a warmed signature
    posts and goes on; the op waits on its node's flags through the call, `need` fixed by the signature)."""
    heap = node_heap(cc.info, lay, cc.timeout)
    call = heap.begin(cc.op, cc.signature, max(need, HEADER_BYTES), cc.timeout, steady=steady)
    try:
        call.wait_slot_free()
        header(call, call.rank)[:3].zero_()
    except BaseException:
        call.finish()
        raise
    return call


def header(call: symm.Call, peer: int) -> torch.Tensor:
    return call.buffer(peer, torch.int64, (HEADER_BYTES // 8,))


def wait_local(cc: CallContext, lay: Layout, call: symm.Call, peer: int, index: int, chunk) -> None:
    """Wait for local rank `peer`'s flag `index`, then check its header; errors name group ranks (the node
    heap's own are node-local)."""
    try:
        call.wait_ready(peer, index, chunk=chunk)
    except OverlapTimeout as exc:
        raise OverlapTimeout(cc.op, cc.rank, lay.rank(lay.node, peer), chunk, cc.timeout,
                             "data never signalled ready by this node's rank") from exc
    check_header(cc, lay, call, peer)


def check_header(cc: CallContext, lay: Layout, call: symm.Call, peer: int) -> None:
    """After a flag of local rank `peer`: raise if it flagged because a remote rank failed or the call ended there
    with an error (a mismatch, from any rank, stays `OverlapMismatchError`)."""
    words = header(call, peer)
    dead, kind = int(words[0]), int(words[1])
    if dead:
        raise OverlapError(_dead_text(cc, lay, dead - 1, f"local rank {lay.rank(lay.node, peer)} saw it fail"))
    if kind:
        text = get_text(words.view(torch.uint8)[_TEXT_AT:], int(words[2]))
        text = f"overlap.{cc.op}: rank {cc.rank}: rank {lay.rank(lay.node, peer)} of this node left the call: {text}"
        raise (OverlapMismatchError if kind == MISMATCH else OverlapError)(text)


def _dead_text(cc: CallContext, lay: Layout, dead: int, how: str) -> str:
    node = next(n for n, ranks in enumerate(lay.nodes) if dead in ranks)
    return (f"overlap.{cc.op}: rank {cc.rank}: rank {dead} on node {lay.names[node]!r} failed during the call "
            f"({how}). The peer probably died; destroy and re-create the group.")


# ----------------------------------------------------------------------------------------------
# Point-to-point between counterparts (bytes to other nodes counted by `overlap.comm`): the MoE ops' (after the
# full handshake); the TP ops' go through their call's `overlap.ops.hierarchical.agreement.Counterparts`
# ----------------------------------------------------------------------------------------------


def isend(cc: CallContext, tensor: torch.Tensor, peer: int):
    comm.count_sent(cc.info, peer, tensor.numel() * tensor.element_size())
    return _post(cc, dist.isend, tensor, peer)


def irecv(cc: CallContext, tensor: torch.Tensor, peer: int):
    return _post(cc, dist.irecv, tensor, peer)


def _post(cc: CallContext, fn, tensor: torch.Tensor, peer: int):
    try:
        return fn(tensor, cc.info.global_ranks[peer], group=cc.pg)
    except RuntimeError as exc:
        raise OverlapError(f"overlap.{cc.op}: rank {cc.rank}: posting a transfer with rank {peer} failed: {exc}. "
                           "The peer probably died; destroy and re-create the group.") from exc


class Poison:
    """What a rank does when a network wait fails: mark its header, raise every flag it owns in the call
    (`flags`: the indices), record the dead rank in the store; then the error is raised. `error`: the same for any
    other error that ends the call on this rank (its kind and text in the header). `cp`: the call's counterparts
    (`overlap.ops.hierarchical.agreement.Counterparts`), whose waits also read the peer's trailer."""

    def __init__(self, cc: CallContext, lay: Layout, call: symm.Call, flags: list[int],
                 cp: Counterparts | None = None):
        self.cc, self.lay, self.call, self.flags, self.cp = cc, lay, call, flags, cp
        self.fired = False

    def wait(self, work, peer: int, chunk) -> None:
        try:
            if self.cp is not None:
                self.cp.wait(work, peer, chunk)
            else:
                self.cc.wait(work, peer, chunk)
        except OverlapError as exc:
            if not isinstance(exc, OverlapTimeout) or self.cc.info.gone(peer):
                self.fire(peer)
            raise

    def fire(self, dead: int) -> None:
        with contextlib.suppress(Exception):  # best effort on an error path
            header(self.call, self.call.rank)[0] = dead + 1
            self._raise_flags()
        report_dead(self.cc.info, dead)

    def error(self, exc: BaseException) -> None:
        """The call ends here with `exc`: tell the node's ranks that wait for this rank's flags."""
        if self.fired:
            return
        with contextlib.suppress(Exception):  # best effort on an error path
            words = header(self.call, self.call.rank)
            raw = f"{type(exc).__name__}: {exc}".encode()[: HEADER_BYTES - _TEXT_AT]
            put_text(words.view(torch.uint8)[_TEXT_AT:], raw)
            words[2] = len(raw)
            words[1] = MISMATCH if isinstance(exc, OverlapMismatchError) else FAILED
            self._raise_flags()

    def _raise_flags(self) -> None:
        self.fired = True
        for index in self.flags:
            self.call.signal_ready(index)


@contextlib.contextmanager
def guard(cc: CallContext, lay: Layout | None = None):
    """Around a hierarchical call: an `OverlapError` becomes one naming the dead rank a peer recorded."""
    lay = lay if lay is not None else layout_of(cc.info)
    try:
        yield
    except OverlapError as exc:
        grace = min(REPORT_GRACE_S, cc.timeout) if isinstance(exc, OverlapTimeout) else 0.0
        text = _recorded_dead(cc.info, grace)
        if not text or f"rank {text.split(':')[0]} on node" in str(exc):
            raise
        dead, seen_by = (int(v) for v in text.split(":"))
        raise OverlapError(_dead_text(cc, lay, dead, f"rank {seen_by} saw it fail") + f" Here: {exc}") from exc


def _recorded_dead(info, grace: float) -> str:
    """The dead rank recorded in the store (``"dead:seen_by"``, `report_dead`), waiting up to `grace` seconds for
    one; "" if none (or no store)."""
    end = time.monotonic() + grace
    try:
        store = c10d._get_default_store()
        key = dead_key(info)
        while not store.check([key]):
            if time.monotonic() >= end:
                return ""
            time.sleep(0.05)
        return store.get(key).decode()
    except Exception:  # noqa: BLE001 - no store: keep the original error
        return ""


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to 16: every area of a node slot starts 16-byte aligned."""
    return (nbytes + 15) // 16 * 16
