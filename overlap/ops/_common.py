"""What every op shares: argument checks, the per-call handshake, bounded waits, autocast, ranges."""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from .. import envs, symm, world
from .. import plan as plan_mod
from ..errors import OverlapError, OverlapMismatchError, OverlapTimeout

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class InputError(Exception):
    """A local mistake found by an op's checks; carries the exception to raise (ValueError/TypeError)."""

    def __init__(self, exc: Exception):
        super().__init__(str(exc))
        self.exc = exc


def resolve_timeout(timeout: float | None) -> float:
    if timeout is None:
        return envs.timeout_s()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast floating inputs to the autocast dtype where autocast is on (torch's rule for matmul)."""
    device_type = tensors[0].device.type if isinstance(tensors[0], torch.Tensor) else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    # torch's autocast casts fp32/fp16/bf16 matmul inputs and leaves float64 alone.
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16,
                                                                             torch.bfloat16) else t
                 for t in tensors)


def check_matmul_operands(op: str, a: Any, b: Any, device: torch.device) -> None:
    """Checks shared by the TP ops: ``a`` is ``[..., k]``, ``b`` is ``[k, n]``, same float dtype/device."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"overlap.{op}: a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dim() < 2:
        raise ValueError(f"overlap.{op}: a must be [..., k] with at least 2 dims (dim 0 is gathered or scattered), "
                         f"got {describe(a)}")
    if b.dim() != 2:
        raise ValueError(f"overlap.{op}: b must be [k, n] (pass a weight w[n, k] as w.t()), got {describe(b)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"overlap.{op}: inner dims differ: a is {describe(a)} (k={a.shape[-1]}), "
                         f"b is {describe(b)} (k={b.shape[0]})")
    if a.dtype != b.dtype:
        raise TypeError(f"overlap.{op}: a and b must have one dtype outside autocast, got {a.dtype} and {b.dtype}")
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"overlap.{op}: dtype must be one of {FLOAT_DTYPES}, got {a.dtype}")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"overlap.{op}: empty operands are not supported: a is {describe(a)}, b is {describe(b)}")
    if a.device != b.device:
        raise ValueError(f"overlap.{op}: a is on {a.device}, b on {b.device}")
    if a.device.type != device.type or (device.type == "cuda" and a.device.index != device.index):
        raise ValueError(f"overlap.{op}: this rank's group computes on {device} but the inputs are on {a.device}")


def prepare(op: str, a: Any, b: Any, group, strategy: str, plan, timeout: float | None,
            check: Callable[[torch.Tensor, torch.Tensor, world.GroupInfo], None] | None = None):
    """An op's local preamble: checks, autocast, plan and signature, identical for every TP op.

    Returns ``(a, b, pg, info, chosen_plan, timeout, signature)``. A local mistake is posted to the
    peers through the handshake (`begin_call` with `error`), so that no rank is left waiting in a
    call another rank left, and then raised here (ValueError / TypeError).
    """
    pg = world.resolve_group(group)
    world.CALLER.set(op)  # set-up rendezvous of this call (group facts, heap) name the op on timeout
    error, chosen, sig = None, None, ""
    try:
        timeout = resolve_timeout(timeout)
    except ValueError as exc:
        error, timeout = InputError(exc), resolve_timeout(None)
    info = world.group_info(pg, timeout)
    try:
        if error is not None:
            raise error.exc
        a, b = autocast_inputs(a, b)
        check_matmul_operands(op, a, b, info.device)
        if check is not None:
            check(a, b, info)
        chosen = plan_mod.as_plan(strategy, plan)
        shape_sig = f"a={describe(a)}, b={tuple(b.shape)}"
        if chosen is None:
            rows = math.prod(a.shape[:-1])
            dtype = str(a.dtype).removeprefix("torch.")
            chosen = plan_mod.resolve_auto(op, shape_sig, info, rows, dtype,
                                           out_bytes=rows * b.shape[1] * a.element_size(),
                                           problem=tp_problem(op, rows, a, b, info.world_size),
                                           plan_file=plan_mod.plan_source(plan))
        plan_mod.check_plan_fits(op, chosen, info)
        if chosen.strategy == "fused":
            check_fused_available(op, a.dtype)
        sig = f"{op}({shape_sig}, plan={chosen.describe()}, ring={info.slowest_link})"
    except (TypeError, ValueError) as exc:
        error = InputError(exc)
    if error is not None:
        begin_call(op, pg, info, sig, 0, timeout, error=error)  # raises error.exc
    return a, b, pg, info, chosen, timeout, sig


def tp_problem(op: str, rows: int, a: torch.Tensor, b: torch.Tensor, world_size: int) -> plan_mod.Problem | None:
    """The `overlap.plan.Problem` of a TP call (plan files are keyed by it), None where it has none."""
    m = rows if op == "all_gather_matmul" else rows // world_size
    if m < 1 or (op != "all_gather_matmul" and rows % world_size):
        return None
    backward = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    try:
        return plan_mod.Problem(op, m, a.shape[-1], b.shape[1], str(a.dtype).removeprefix("torch."), backward)
    except ValueError:  # a call the model does not describe: no plan file entry can match it
        return None


# ----------------------------------------------------------------------------------------------
# The per-call handshake (signature check and heap sizing), on one node or across nodes
# ----------------------------------------------------------------------------------------------


class _CollectiveCall:
    """Handshake result for groups that span nodes (no symmetric heap)."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def finish(self) -> None:
        pass


_EPOCHS: dict[int, int] = {}
_HEADER_BYTES = 256


def _collective_handshake(op: str, pg, info: world.GroupInfo, signature: str, timeout: float,
                          post_only: bool) -> _CollectiveCall:
    epoch = _EPOCHS.get(id(pg), 0) + 1
    _EPOCHS[id(pg)] = epoch
    raw = signature.encode()[:_HEADER_BYTES].ljust(_HEADER_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(info.device)
    every = torch.empty(info.world_size * _HEADER_BYTES, dtype=torch.uint8, device=info.device)
    work = all_gather_async(every, mine, pg)
    wait_work(work, op, info.rank, "any", "signature", timeout, info)  # host-side check: needs the data
    if post_only:
        return _CollectiveCall(epoch)
    rows = [bytes(row) for row in every.view(info.world_size, _HEADER_BYTES).cpu().numpy()]
    differ = {p: row.rstrip(b"\0").decode(errors="replace") for p, row in enumerate(rows) if row != raw}
    if differ:
        raise OverlapMismatchError.of(op, epoch, info.rank, signature, differ)
    return _CollectiveCall(epoch)


def begin_call(op: str, pg, info: world.GroupInfo, signature: str, need_bytes: int, timeout: float,
               error: InputError | None = None):
    """Start a call on every rank: check signatures and size the heap, or pass on a local error.

    With `error` (this rank's arguments are wrong) the rank posts a poisoned signature, so that
    peers already waiting in this call raise at once instead of at their deadline, and then
    raises the error itself without waiting for anyone.
    """
    world.CALLER.set(op)
    if error is not None:
        signature = f"<invalid input on rank {info.rank}: {error.exc}>"
    if error is not None:
        try:
            if info.single_node:
                symm.heap_for(pg, timeout).begin(op, signature, 0, timeout, post_only=True)
            else:
                _collective_handshake(op, pg, info, signature, timeout, post_only=True)
        except OverlapTimeout:
            pass  # the peers are stuck elsewhere; the user's own mistake is still the error to see
        raise error.exc
    if info.single_node:
        if need_bytes > 0 and info.device.type == "cuda":
            warn_device_connections(op)
        return symm.heap_for(pg, timeout).begin(op, signature, need_bytes, timeout)
    return _collective_handshake(op, pg, info, signature, timeout, post_only=False)


_WARNED_CONNECTIONS = False


def warn_device_connections(op: str) -> None:
    """Warn once per process, at the first GPU call that uses the symmetric heap (``symm``, ``fused``),
    where CUDA_DEVICE_MAX_CONNECTIONS is not 1. overlap reads it and never sets it: it must be set before
    CUDA initializes, and it changes every stream of the process, the user's own included."""
    global _WARNED_CONNECTIONS
    if _WARNED_CONNECTIONS:
        return
    _WARNED_CONNECTIONS = True
    value = envs.cuda_device_max_connections()
    if value == 1:
        return
    now = "unset (the driver's default: several hardware queues)" if value is None else f"{value}"
    warnings.warn(
        f"overlap.{op}: CUDA_DEVICE_MAX_CONNECTIONS is {now}. overlap's GPU symm/fused paths issue copies and "
        "stream-ordered flag waits on a high-priority side stream while GEMMs run on the current stream, and "
        "rely on the GPU starting them in the order they were issued "
        "so that a transfer (which peers wait for) is not queued behind a GEMM that took every SM. Only "
        "CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) makes the GPU start kernels of different streams in "
        "issue order; with more queues the transfers may start late (less overlap; results are the same). Set it "
        "to 1 in the launch environment, before CUDA is initialized, as Megatron-core requires for its own "
        "tensor-parallel overlap; note that one queue also makes unrelated streams of the process wait for each "
        "other. overlap never sets it itself. (Shown once per process.)",
        RuntimeWarning,
        stacklevel=3,
    )


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, pg):
    """``all_gather_into_tensor`` under the name of the installed torch (renamed in 2.12+)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=pg, async_op=True)


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, pg):
    """``reduce_scatter_tensor`` (sum) under the name of the installed torch.

    On CPU (gloo) the work's ``wait(timeout=...)`` ignores its timeout (torch 2.13: the collective
    runs inside ``wait()``), so it comes back as a `PolledWork`, which `wait_work` bounds."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(out, inp, group=pg, async_op=True)
    return work if out.is_cuda else PolledWork(work)


class PolledWork:
    """A torch.distributed work whose ``wait(timeout=...)`` does not bound the wait (gloo's
    reduce-scatter runs the collective inside ``wait()``): `wait_work` calls ``wait()`` on a helper
    thread and waits for that thread within the deadline. The caller issues no other collective on
    the group meanwhile (it is blocked in the wait), so the order of collectives stays the same on
    every rank. Past the deadline the helper thread stays blocked until the process group's own
    timeout; the group is unusable by then anyway."""

    def __init__(self, work):
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return _wait_polled(self, None if timeout is None else timeout.total_seconds())


def _wait_polled(work: PolledWork, timeout: float | None) -> bool:
    """``work.wait()`` on a helper thread; True once it returned, False if `timeout` seconds passed.
    An error raised by the wait is raised here."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work.work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="overlap-wait", daemon=True).start()
    if not done.wait(timeout):
        return False
    if failure:
        raise failure[0]
    return True


# ----------------------------------------------------------------------------------------------
# Bounded waits on torch.distributed work
# ----------------------------------------------------------------------------------------------


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
    try:
        if device is not None and device.type == "cuda":
            work.wait()
            return
        ok = _wait_polled(work, timeout) if isinstance(work, PolledWork) else work.wait(
            timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        text = str(exc)
        peer = _blame(info, peer)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise OverlapTimeout(op, rank, peer, chunk, timeout, "torch.distributed transfer") from exc
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
# CPU "copy engine": one worker thread per process, so copies overlap GEMMs as on a GPU side stream
# ----------------------------------------------------------------------------------------------

_ENGINE: ThreadPoolExecutor | None = None
_ENGINE_PID = -1
_ENGINE_LOCK = threading.Lock()


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


# ----------------------------------------------------------------------------------------------
# Triton kernels (interpreted where no GPU exists)
# ----------------------------------------------------------------------------------------------


def interpreted() -> bool:
    return envs.triton_interpret()


@functools.cache
def kernels():
    try:
        from .. import kernels as k
    except ImportError as exc:
        raise RuntimeError(f"overlap: the 'fused' strategy needs Triton, which failed to import: {exc}") from exc
    return k


class Watchdog:
    """Sets ``abort[0] = 1`` after `timeout` seconds, releasing interpreted in-kernel spins."""

    def __init__(self, abort: torch.Tensor, timeout: float):
        self._timer = threading.Timer(timeout, lambda: abort.fill_(1))
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def record(name: str) -> contextlib.AbstractContextManager:
    return torch.profiler.record_function(f"overlap.{name}")


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



_SIDE: dict[int, torch.cuda.Stream] = {}


def exchange_chunked(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, chosen: plan_mod.Plan,
                     info: world.GroupInfo, pg, op: str) -> list[tuple[int, tuple[int, int] | None, list]]:
    """Post one pairwise step, `send` to group rank `dst` and `recv` from `src`, each cut along dim 0
    into its link's `Plan.chunks_for` pieces and posted in pairs (chunk j of both in one batch).

    Returns ``(j, rows of recv's chunk j or None, [(work, peer), ...])`` per pair, in order; the caller
    waits each work (the send too: its buffer must outlive it) naming its own peer. A backend error
    while posting (a peer already gone) becomes an `OverlapError` naming the op, this rank and both peers.
    """
    # An empty transfer posts nothing (both ends know it is empty: NCCL need not see zero-size messages).
    send_bounds = chunk_bounds(send.shape[0], chosen.chunks_for(info.link_class(dst))) if send.shape[0] else []
    recv_bounds = chunk_bounds(recv.shape[0], chosen.chunks_for(info.link_class(src))) if recv.shape[0] else []
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


def side_stream(device: torch.device):
    """This process's copy-engine stream on `device` (high priority, so copies are not starved)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SIDE[index]


def fused_tiles(block_m: int, block_n: int, block_k: int, interpreted: bool,
                dtype: torch.dtype) -> tuple[int, int, int]:
    """Tile shape of a fused GEMM kernel: the plan's, else a default per dtype (small when interpreted)."""
    if block_m:
        return block_m, block_n or block_m, block_k or 32
    if interpreted:
        return 32, 32, 32
    return (128, 128, 64) if dtype != torch.float32 else (128, 64, 32)


def cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def check_fused_available(op: str, dtype: torch.dtype) -> None:
    """Raise (before the handshake) where the fused strategy cannot run: dtype, or Triton missing."""
    if dtype not in FUSED_DTYPES:
        raise TypeError(f"overlap.{op}: the fused kernel supports {FUSED_DTYPES}, got {dtype}")
    try:
        kernels()  # import (and define) the Triton kernels before the handshake
    except RuntimeError as exc:
        raise ValueError(f"overlap.{op}: strategy 'fused' is unavailable here: {exc}") from exc
