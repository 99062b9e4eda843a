"""Communication under deadlines: the layer between the world and symmetric memory.

* waits on ``torch.distributed`` work with a deadline, and blame: a timeout or a dead peer becomes an
  `OverlapTimeout` / `OverlapError` naming the op, this rank and the peer (`wait_work`); the collectives
  under the names of the installed torch (`all_gather_async`, `reduce_scatter_async`, `all_reduce_async`),
  which a plain call can record per group and a rank leaving that call replay with zeros (`record_on`,
  `replay`: `overlap.symm.plain`);
* chunked point-to-point exchanges: one pairwise step cut into chunks per link class (`exchange_chunked`,
  `chunk_bounds`);
* the copy engines that let copies run beside GEMMs: on CPU ranks one worker thread per process
  (`copy_engine`, `result`, `drain`), on GPUs a high-priority side stream per device (`side_stream`).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import world
from .errors import OverlapError, OverlapTimeout
from .stages import timed

# ----------------------------------------------------------------------------------------------
# Collectives and bounded waits on torch.distributed work
# ----------------------------------------------------------------------------------------------


#: Per group (``id(pg)``): the list that records the collectives issued on it, while a plain call records them.
_RECORDING: dict[int, list] = {}


def record_on(pg, into: list | None) -> None:
    """From now on append every collective issued on `pg` through this module to `into` (None: stop), as
    ``(issue function, ((shape, dtype) of each tensor argument))``: what `replay` issues again."""
    if into is None:
        _RECORDING.pop(id(pg), None)
    else:
        _RECORDING[id(pg)] = into


def stop_recording(pg, into: list) -> None:
    """Stop recording on `pg` if `into` is what records there (a later call may have started its own)."""
    if _RECORDING.get(id(pg)) is into:
        del _RECORDING[id(pg)]


def _note(pg, issue: Callable, *tensors: torch.Tensor) -> None:
    into = _RECORDING.get(id(pg)) if _RECORDING else None
    if into is not None:
        into.append((issue, tuple((tuple(t.shape), t.dtype) for t in tensors)))


def replay(recorded: list, pg, device: torch.device) -> list:
    """Issue the recorded collectives again on `pg`, in order, on zero tensors of the same shapes and dtypes
    (what a rank that leaves a plain call sends so that the peers' collectives of that call complete);
    returns their works."""
    return [issue(*(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in metas), pg)
            for issue, metas in recorded]


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, pg):
    """``all_gather_into_tensor`` under the name of the installed torch (renamed in 2.12+)."""
    _note(pg, all_gather_async, out, inp)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=pg, async_op=True)


def all_reduce_async(out: torch.Tensor, pg):
    """``all_reduce`` (sum) of `out` in place."""
    _note(pg, all_reduce_async, out)
    return dist.all_reduce(out, group=pg, async_op=True)


def all_to_all_async(out: torch.Tensor, inp: torch.Tensor, pg):
    """``all_to_all_single`` with equal splits: block ``d`` of `inp` (dim 0 cut in world-size blocks) to rank ``d``,
    block ``s`` of `out` from rank ``s``. On CPU (gloo) bounded as `reduce_scatter_async`'s work is (`PolledWork`)."""
    _note(pg, all_to_all_async, out, inp)
    work = dist.all_to_all_single(out, inp, group=pg, async_op=True)
    return work if out.is_cuda else PolledWork(work)


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, pg):
    """``reduce_scatter_tensor`` (sum) under the name of the installed torch.

    On CPU (gloo) the work's ``wait(timeout=...)`` ignores its timeout (torch 2.13: the collective
    runs inside ``wait()``), so it comes back as a `PolledWork`, which `wait_work` bounds."""
    _note(pg, reduce_scatter_async, out, inp)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(out, inp, group=pg, async_op=True)
    return work if out.is_cuda else PolledWork(work)


class PolledWork:
    """A torch.distributed work whose ``wait(timeout=...)`` does not bound the wait (gloo's
    reduce-scatter runs the collective inside ``wait()``): `wait_work` has ``wait()`` called on the
    process's waiter thread (`_Waiter`) and waits for it within the deadline. The caller issues no other
    collective on the group meanwhile (it is blocked in the wait), so the order of collectives stays the
    same on every rank. Past the deadline that thread stays blocked until the process group's own
    timeout (the group is unusable by then anyway) and later waits get a new one."""

    def __init__(self, work):
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return _wait_polled(self, None if timeout is None else timeout.total_seconds())


class _Waiter:
    """A daemon thread that runs the blocking ``wait()`` of polled works, one after another: started once per
    process, not per wait (a thread's start cost ~0.1-0.3 ms per reduce-scatter on a 2-core machine)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="overlap-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            work, done, failure = self.jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failure.append(exc)
            finally:
                done.set()


_WAITER: list[_Waiter | None] = [None]


def _wait_polled(work: PolledWork, timeout: float | None) -> bool:
    """``work.wait()`` on the process's waiter thread; True once it returned, False if `timeout` seconds
    passed (that thread is then left to the blocked wait, and the next wait starts a new one). An error
    raised by the wait is raised here."""
    done = threading.Event()
    failure: list[BaseException] = []
    waiter = _WAITER[0]
    if waiter is None or waiter.pid != os.getpid():
        waiter = _WAITER[0] = _Waiter()
    waiter.jobs.put((work.work, done, failure))
    if not done.wait(timeout):
        _WAITER[0] = None
        return False
    if failure:
        raise failure[0]
    return True


#: Fraction of its deadline after which a transfer whose connection a live peer closed counts as timed out
#: (`wait_work`).
CLOSED_AT_DEADLINE = 0.9


@timed("wait")
def wait_work(work, op: str, rank: int, peer: int | str, chunk: int | str, timeout: float,
              where: torch.device | world.GroupInfo | None = None) -> None:
    """``work.wait`` with a deadline; timeouts and dead peers become overlap errors.

    `where` is the tensors' device, or the group's `GroupInfo` (the ops pass it): then a failure names
    a peer of this node whose process is gone instead of `peer` (collectives have no single peer: "any").

    On GPUs the wait is stream-ordered (the current stream waits for the transfer, the host does
    not): NCCL's ``wait(timeout=...)`` would block the host. The deadline there is the process
    group's own timeout, enforced by NCCL's watchdog.
    """
    info = where if isinstance(where, world.GroupInfo) else None
    device = info.device if info is not None else where
    start = time.monotonic()
    try:
        if device is not None and device.type == "cuda":
            work.wait()
            return
        # CPU ranks: the backend's thread that runs the transfer was just woken; give it this core now rather
        # than when this thread blocks (2-core VM, an 8 KiB all-gather after an op's Python: ~0.43 -> ~0.28 ms)
        os.sched_yield()
        ok = _wait_polled(work, timeout) if isinstance(work, PolledWork) else work.wait(
            timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        text = str(exc)
        peer = _blame(info, peer)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise OverlapTimeout(op, rank, peer, chunk, timeout, "torch.distributed transfer") from exc
        if time.monotonic() - start >= CLOSED_AT_DEADLINE * timeout and not (
                info is not None and isinstance(peer, int) and info.gone(peer)):
            # A live peer that waited on this rank's group for as long gave up on its own deadline, and its backend
            # closed the connection a moment before this rank's deadline fired: the same stall, seen from here.
            raise OverlapTimeout(op, rank, peer, chunk, timeout,
                                 "torch.distributed transfer; the peer closed it as its own deadline passed") from exc
        raise OverlapError(f"overlap.{op}: rank {rank}: transfer with peer {peer} (chunk {chunk}) failed: {text}. "
                           "The peer probably died; destroy and re-create the group.") from exc
    if ok is False:
        raise OverlapTimeout(op, rank, _blame(info, peer), chunk, timeout, "torch.distributed transfer")


def _blame(info: world.GroupInfo | None, peer: int | str) -> int | str:
    """`peer`, or where it is not one rank ("any") the first peer of this node whose process is gone.

    A killed peer's sockets close while its process is still being torn down, so the backend can
    report the closed connection a moment before the process shows as gone: look again for up to a
    second (this runs on an error path only)."""
    if info is None or isinstance(peer, int):
        return peer
    deadline = time.monotonic() + 1.0
    while True:
        gone = info.gone_peers()
        if gone or time.monotonic() > deadline:
            return gone[0] if gone else peer
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# Chunked point-to-point exchanges
# ----------------------------------------------------------------------------------------------


def chunk_bounds(rows: int, num_chunks: int) -> list[tuple[int, int]]:
    """Split `rows` into at most `num_chunks` near-equal non-empty ranges."""
    num_chunks = max(1, min(num_chunks, rows))
    base, extra = divmod(rows, num_chunks)
    bounds, start = [], 0
    for i in range(num_chunks):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


@timed("send")
def exchange_chunked(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, chunks_for: Callable[[str], int],
                     info: world.GroupInfo, pg, op: str) -> list[tuple[int, tuple[int, int] | None, list]]:
    """Post one pairwise step, `send` to group rank `dst` and `recv` from `src`, each cut along dim 0
    into ``chunks_for(link class)`` pieces (a plan's `chunks_for`) and posted in pairs (chunk j of
    both in one batch).

    Returns ``(j, rows of recv's chunk j or None, [(work, peer), ...])`` per pair, in order; the caller
    waits each work (the send too: its buffer must outlive it) naming its own peer. A backend error
    while posting (a peer already gone) becomes an `OverlapError` naming the op, this rank and both peers.
    """
    # An empty transfer posts nothing (both ends know it is empty: NCCL need not see zero-size messages).
    send_bounds = chunk_bounds(send.shape[0], chunks_for(info.link_class(dst))) if send.shape[0] else []
    count_sent(info, dst, send.numel() * send.element_size())
    recv_bounds = chunk_bounds(recv.shape[0], chunks_for(info.link_class(src))) if recv.shape[0] else []
    posted = []
    for j in range(max(len(send_bounds), len(recv_bounds))):
        ops, peers = [], []
        got = recv_bounds[j] if j < len(recv_bounds) else None
        if got is not None:
            ops.append(dist.P2POp(dist.irecv, recv[got[0] : got[1]], info.global_ranks[src], pg))
            peers.append(src)
        if j < len(send_bounds):
            lo, hi = send_bounds[j]
            ops.append(dist.P2POp(dist.isend, send[lo:hi], info.global_ranks[dst], pg))
            peers.append(dst)
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            gone = [p for p in (src, dst) if info.gone(p)]
            who = f"peer {gone[0]} (its process is gone)" if gone else f"peers {src} (receive) and {dst} (send)"
            raise OverlapError(f"overlap.{op}: rank {info.rank}: posting chunk {j} of the step with {who} "
                               f"failed: {exc}. A peer probably died; destroy and re-create the group.") from exc
        posted.append((j, got, list(zip(works, peers, strict=True))))
    return posted


# Payload bytes this process has posted to peers on other nodes (point-to-point sends of `exchange_chunked`
# and of the hierarchical strategy; not the plain collectives, whose algorithm the backend picks, nor the
# handshakes' signature headers). The emulated cluster's figures and the tests read it per call.
_NETWORK_SENT = [0]


def count_sent(info: world.GroupInfo, peer: int, nbytes: int) -> None:
    """Count `nbytes` posted to group rank `peer` if it is on another node."""
    if info.nodes[peer] != info.nodes[info.rank]:
        _NETWORK_SENT[0] += nbytes


def network_bytes_sent() -> int:
    """Payload bytes this process has posted point-to-point to ranks of other nodes since it started."""
    return _NETWORK_SENT[0]


# ----------------------------------------------------------------------------------------------
# Copy engines: one worker thread per process on CPU ranks (copies overlap GEMMs as on a GPU side
# stream), a high-priority side stream per device on GPUs
# ----------------------------------------------------------------------------------------------

_ENGINE: ThreadPoolExecutor | None = None
_ENGINE_PID = -1
_ENGINE_LOCK = threading.Lock()


#: CPU ranks: a `symm` gather that pulls at most this many bytes from its peers copies them on the calling
#: thread (as the consumer reaches each chunk) instead of the copy engine's: the engine's wake-up (tens of
#: microseconds, more on a busy machine) costs more than it hides below this size.
INLINE_COPY_BYTES = 256 * 1024


def pulls_inline(nbytes: int) -> bool:
    """Whether a CPU rank copies `nbytes` from or to its peers on the calling thread (`INLINE_COPY_BYTES`)."""
    return nbytes <= INLINE_COPY_BYTES


def copy_engine() -> ThreadPoolExecutor:
    global _ENGINE, _ENGINE_PID
    with _ENGINE_LOCK:
        if _ENGINE is None or _ENGINE_PID != os.getpid():
            _ENGINE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-copy")
            _ENGINE_PID = os.getpid()
        return _ENGINE


def result(fut: Future, timeout: float):
    """A copy-engine future's result (its own waits are bounded; this bound is a backstop)."""
    return fut.result(timeout=timeout + 5.0)


def drain(futures: list[Future]) -> None:
    """Wait for every submitted copy before leaving a call, even on an error path."""
    for f in futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - the first error was raised already
            pass


_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device):
    """This process's copy-engine stream on `device` (high priority, so copies are not starved)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SIDE[index]
