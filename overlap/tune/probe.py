"""Probes: what a machine's links, GEMMs and their interference cost, fitted into a `plan.Profile`.

`probe` is a collective: every rank of the group calls it and returns the same Profile. Its steps,
separated by bounded store barriers so that none overlaps the next:

1. **Links.** The ranks exchange the link class each sees to every peer (`GroupInfo.link_class`).
   For every class present, the first rank pair in rank order linked by it ping-pongs messages of
   several sizes; the lower rank times round trips (one-way = half; the first round trip per size
   is a warm-up). Transports: ``"p2p"`` (torch.distributed isend/irecv: gloo or NCCL) and, in a
   group of one node, ``"copy"``: through the group's symmetric heap (`overlap.symm`) a rank copies
   the message into its peer's slot and sets a ready flag; the peer waits on it and answers the same
   way (a memcpy through POSIX shared memory on CPU ranks, a peer-to-peer copy on GPUs).
   ``t = latency + bytes / bandwidth`` is fitted to the median one-way time per size (`fit_link`).
2. **GEMMs.** All ranks at once time ``torch.mm`` of ``n x n`` operands at a few ``n`` per dtype
   (float32, bfloat16 on CPU; bfloat16, float16, float32 on GPUs, float32 under the user's TF32
   setting); ``t = overhead + flops / peak`` is fitted (`fit_gemm`). Square shapes only: the
   Profile holds one fit per dtype.
3. **Interference.** Every rank exchanges a message with its ring neighbours (send to rank+1,
   receive from rank-1, p2p) again and again on a helper thread (its own stream on GPUs), alone and
   while the main thread runs GEMMs back to back; GEMMs are timed alone too. gemm_slowdown = GEMM
   time beside the exchanges / alone, comm_slowdown = exchange time beside GEMMs / alone (medians,
   clamped to >= 1).
4. **Chunking.** That ring exchange posted whole and in 8 chunks at once, as ``pipelined`` posts them
   (`_common.exchange_chunked`): per_chunk_s = (t8 - t1) / 7, clamped to >= 0.

**Combining the ranks.** Each rank publishes the median of each of its measurements through the
store (`world.store_exchange`); a measurement's value is the MAXIMUM over ranks (a collective runs
at its slowest rank's pace; ranks that took no part, like the responder of a ping-pong, report
nothing). Every rank then fits the same numbers with the same pure-Python arithmetic (`fit_line`),
so the Profiles are equal bit for bit; device and machine are rank 0's.

**No hang.** Every wait on a peer has the deadline `timeout` (default ``OVERLAP_TIMEOUT_S``): store
rendezvous, heap handshakes and flags, torch.distributed work (`_common.wait_work`), the helper
thread. A dead or absent peer raises `OverlapTimeout` or `OverlapError` naming op ``probe``; the
group is unusable afterwards, as after any failed call. On GPUs, NCCL waits are stream-ordered and
bounded by the process group's timeout (NCCL's watchdog), as in the ops.

**Side effects.** The copy probe sizes the group's heap for its largest message; a heap the probe
created is released at the end (`overlap.release`, which also forgets the group's `GroupInfo`: the
group's next `world.group_info` is a collective rendezvous again).

**Cache.** One JSON file per machine configuration (`cache_path`) under ``OVERLAP_CACHE_DIR``, else
``~/.cache/overlap``. `probe_cached` reads it on rank 0 and hands rank 0's answer to every rank, or
probes and saves (rank 0 writes, atomically).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import envs, symm, world
from ..errors import OverlapError, OverlapTimeout
from ..ops import _common as C
from ..plan import LinkFit, Plan, Profile, gpu_symmetric_memory
from ..planfile import write_atomic
from ..world import LINK_CLASSES, GroupInfo
from .fits import TRANSPORTS, fit_gemm, fit_line, fit_link, format_profile

__all__ = ["cache_dir", "cache_path", "fit_gemm", "fit_line", "fit_link", "format_profile", "load_cached", "probe",
           "probe_cached", "save_cached"]  # the fits and format_profile live in `fits`

log = logging.getLogger("overlap")

OP = "probe"
KiB, MiB = 1024, 1024 * 1024
CHUNKS = 8  # the chunked exchange of the chunking probe


# ----------------------------------------------------------------------------------------------
# What is measured, per device type and depth
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    link_sizes: tuple[int, ...]  # bytes per ping-pong message
    link_reps: int  # timed round trips per size (after one warm-up)
    gemm_dtypes: tuple[torch.dtype, ...]
    gemm_sizes: tuple[int, ...]  # n of the n x n x n GEMMs
    gemm_reps: int
    busy_dtype: torch.dtype  # interference: the GEMM beside the exchanges
    busy_n: int
    busy_bytes: int  # the message of the ring exchange
    busy_reps: int  # GEMMs and exchanges timed alone
    busy_s: float  # about how long the exchanges beside the GEMMs run
    chunk_bytes: int
    chunk_reps: int


def _config(device: torch.device, quick: bool) -> _Config:
    if device.type == "cuda":
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
        if quick:
            return _Config(link_sizes=(64 * KiB, MiB, 16 * MiB), link_reps=3, gemm_dtypes=dtypes,
                           gemm_sizes=(1024, 2048, 4096), gemm_reps=3, busy_dtype=torch.bfloat16, busy_n=4096,
                           busy_bytes=16 * MiB, busy_reps=5, busy_s=0.1, chunk_bytes=16 * MiB, chunk_reps=3)
        return _Config(link_sizes=(4 * KiB, 64 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB), link_reps=20,
                       gemm_dtypes=dtypes, gemm_sizes=(1024, 2048, 4096, 8192), gemm_reps=10,
                       busy_dtype=torch.bfloat16, busy_n=8192, busy_bytes=64 * MiB, busy_reps=20, busy_s=1.0,
                       chunk_bytes=64 * MiB, chunk_reps=15)
    dtypes = (torch.float32, torch.bfloat16)
    if quick:
        return _Config(link_sizes=(4 * KiB, 64 * KiB, MiB), link_reps=2, gemm_dtypes=dtypes, gemm_sizes=(64, 128, 256),
                       gemm_reps=2, busy_dtype=torch.float32, busy_n=192, busy_bytes=256 * KiB, busy_reps=5,
                       busy_s=0.1, chunk_bytes=MiB, chunk_reps=3)
    return _Config(link_sizes=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB), link_reps=20,
                   gemm_dtypes=dtypes, gemm_sizes=(128, 256, 384, 512, 768), gemm_reps=10, busy_dtype=torch.float32,
                   busy_n=384, busy_bytes=4 * MiB, busy_reps=20, busy_s=1.0, chunk_bytes=4 * MiB, chunk_reps=15)


# ----------------------------------------------------------------------------------------------
# One probe's state and the primitives every step uses
# ----------------------------------------------------------------------------------------------


def _sync(device: torch.device, stream: Any = None) -> None:
    """Wait for the queued device work of `stream` (default: the current one); nothing on CPU."""
    if device.type == "cuda":
        (stream if stream is not None else torch.cuda.current_stream(device)).synchronize()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _size_text(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _chunks_plan(num_chunks: int) -> Plan:
    return Plan("pipelined", num_chunks={c: num_chunks for c in LINK_CLASSES})


class _Probe:
    """The group, its deadline, and this rank's measurements: key -> median of its repeats (s)."""

    def __init__(self, pg: dist.ProcessGroup, info: GroupInfo, timeout: float,
                 progress: Callable[[str], None] | None):
        self.pg, self.info, self.timeout, self.progress = pg, info, timeout, progress
        self.values: dict[str, float] = {}

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def record(self, key: str, times: list[float]) -> None:
        if times:
            self.values[key] = statistics.median(times)

    def exchange(self, tag: str, value: Any) -> list[Any]:
        """Every rank's JSON `value`, in rank order (a bounded store rendezvous)."""
        raw = world.store_exchange(self.pg, f"probe-{tag}", json.dumps(value).encode(), self.timeout)
        return [json.loads(v) for v in raw]

    def barrier(self) -> None:
        world.store_exchange(self.pg, "probe-barrier", b"", self.timeout)

    def wait(self, work: Any, peer: int, what: str) -> None:
        C.wait_work(work, OP, self.info.rank, peer, what, self.timeout, self.info)

    def post(self, fn: Callable, tensor: torch.Tensor, peer: int, what: str) -> Any:
        try:
            return fn(tensor, self.info.global_ranks[peer], group=self.pg)
        except RuntimeError as exc:
            raise OverlapError(f"overlap.{OP}: rank {self.info.rank}: posting {what} with peer {peer} failed: {exc}. "
                               "The peer probably died; destroy and re-create the group.") from exc

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor, num_chunks: int, what: str,
                      stream: Any = None) -> None:
        """Send `send` to rank+1 and receive `recv` from rank-1 in `num_chunks` chunks; wait for all."""
        info = self.info
        w, r = info.world_size, info.rank
        posted = C.exchange_chunked(send, (r + 1) % w, recv, (r - 1) % w, _chunks_plan(num_chunks), info, self.pg, OP)
        for j, _rows, works in posted:
            for work, peer in works:
                self.wait(work, peer, f"{what}, chunk {j}")
        _sync(info.device, stream)


# ----------------------------------------------------------------------------------------------
# 1. Links
# ----------------------------------------------------------------------------------------------


def _link_pairs(rows: Sequence[Sequence[str]]) -> dict[str, tuple[int, int]]:
    """The first rank pair in rank order per link class, from every rank's view of its peers."""
    pairs: dict[str, tuple[int, int]] = {}
    for i, row in enumerate(rows):
        for j in range(i + 1, len(rows)):
            pairs.setdefault(row[j], (i, j))
    return {c: pairs[c] for c in LINK_CLASSES if c in pairs}


def _role(p: _Probe, pair: tuple[int, int]) -> tuple[bool, int] | None:
    """(this rank leads, its peer) within `pair`, or None where this rank is not in it."""
    if p.info.rank not in pair:
        return None
    lead = p.info.rank == pair[0]
    return lead, pair[1] if lead else pair[0]


def _pingpong_p2p(p: _Probe, pair: tuple[int, int], nbytes: int, reps: int) -> list[float]:
    """One-way times of `reps` round trips of `nbytes` over isend/irecv (the leader's; [] elsewhere)."""
    role = _role(p, pair)
    if role is None:
        return []
    lead, peer = role
    buf = torch.empty(nbytes, dtype=torch.uint8, device=p.info.device)
    times = []
    for i in range(reps + 1):  # round trip 0 is a warm-up (and, on NCCL, connects the pair)
        t0 = time.perf_counter()
        if lead:
            p.wait(p.post(dist.isend, buf, peer, f"ping {i}"), peer, f"ping {i}")
            p.wait(p.post(dist.irecv, buf, peer, f"pong {i}"), peer, f"pong {i}")
        else:
            p.wait(p.post(dist.irecv, buf, peer, f"ping {i}"), peer, f"ping {i}")
            p.wait(p.post(dist.isend, buf, peer, f"pong {i}"), peer, f"pong {i}")
        _sync(p.info.device)
        if i:
            times.append((time.perf_counter() - t0) / 2)
    return times if lead else []


def _pingpong_copy(p: _Probe, heap: symm.SymmHeap, pair: tuple[int, int], nbytes: int, reps: int) -> list[float]:
    """One-way times of `reps` round trips of `nbytes` through the symmetric heap (the leader's).

    One heap call (every rank of the group takes part in its handshake): each message is copied into
    the peer's slot, then announced by this rank's ready flag number ``i`` (a release store after the
    copy, stream-ordered on GPUs); the peer waits on it (bounded) and answers the same way.
    """
    assert reps + 1 <= symm.MAX_FLAGS, reps
    info = p.info
    call = heap.begin(OP, f"probe(copy,pair={pair[0]}-{pair[1]},bytes={nbytes},reps={reps})", nbytes, p.timeout)
    times: list[float] = []
    try:
        call.wait_slot_free()
        role = _role(p, pair)
        if role is not None:
            lead, peer = role
            src = torch.empty(nbytes, dtype=torch.uint8, device=info.device)
            dst = call.buffer(peer, torch.uint8, (nbytes,))
            for i in range(reps + 1):  # round trip 0 is a warm-up
                t0 = time.perf_counter()
                if lead:
                    dst.copy_(src)
                    call.signal_ready(i)
                    call.wait_ready(peer, i, chunk=f"pong {i}")
                    _sync(info.device)
                    if i:
                        times.append((time.perf_counter() - t0) / 2)
                else:
                    call.wait_ready(peer, i, chunk=f"ping {i}")
                    dst.copy_(src)
                    call.signal_ready(i)
            _sync(info.device)
    finally:
        call.finish()
    return times


def _measure_links(p: _Probe, cfg: _Config, pairs: dict[str, tuple[int, int]]) -> None:
    sizes = f"{_size_text(cfg.link_sizes[0])} ... {_size_text(cfg.link_sizes[-1])}"
    for cls, pair in pairs.items():
        p.say(f"links: p2p over {cls} between ranks {pair[0]} and {pair[1]} ({sizes})")
        for n in cfg.link_sizes:
            p.record(f"p2p/{cls}/{n}", _pingpong_p2p(p, pair, n, cfg.link_reps))
        p.barrier()  # the next pair starts once this one is done
    info = p.info
    local = {c: pair for c, pair in pairs.items() if c != "network"}
    if not (local and info.single_node and (info.device.type != "cuda" or gpu_symmetric_memory())):
        return
    heap = symm.heap_for(p.pg, p.timeout)
    fresh = heap.epoch == 0 and heap.slot_bytes == 0  # created here: released again below
    heap.reserve(max(cfg.link_sizes), p.timeout)
    for cls, pair in local.items():
        p.say(f"links: copy over {cls} between ranks {pair[0]} and {pair[1]} ({sizes})")
        for n in cfg.link_sizes:
            p.record(f"copy/{cls}/{n}", _pingpong_copy(p, heap, pair, n, cfg.link_reps))
    _sync(info.device)
    heap.check_async_errors(OP, p.timeout)  # a GPU flag wait that gave up (its times would be wrong)
    if fresh:
        p.barrier()  # every rank's last flag write has landed before any rank unmaps the heap
        symm.release(p.pg)


# ----------------------------------------------------------------------------------------------
# 2. GEMMs
# ----------------------------------------------------------------------------------------------


class _Gemm:
    """``torch.mm`` of fresh random ``n x n`` operands into a preallocated output, timed."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        self.a = torch.randn(n, n, device=device).to(dtype)
        self.b = torch.randn(n, n, device=device).to(dtype)
        self.out = torch.empty(n, n, dtype=dtype, device=device)
        self.device = device
        self()  # warm-up

    def __call__(self) -> float:
        t0 = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        _sync(self.device)
        return time.perf_counter() - t0


def _measure_gemms(p: _Probe, cfg: _Config) -> None:
    for dtype in cfg.gemm_dtypes:
        name = _dtype_name(dtype)
        p.say(f"GEMM {name}: n = {', '.join(map(str, cfg.gemm_sizes))}")
        p.barrier()  # every rank computes at once, as in training
        for n in cfg.gemm_sizes:
            gemm = _Gemm(n, dtype, p.info.device)
            p.record(f"gemm/{name}/{n}", [gemm() for _ in range(cfg.gemm_reps)])


# ----------------------------------------------------------------------------------------------
# 3. Interference, 4. chunking
# ----------------------------------------------------------------------------------------------


def _exchanges(p: _Probe, nbytes: int, count: int, stream: Any = None,
               started: threading.Event | None = None) -> list[float]:
    """Times of `count` ring exchanges of `nbytes`, after one warm-up (which absorbs the ranks' skew)."""
    send = torch.empty(nbytes, dtype=torch.uint8, device=p.info.device)
    recv = torch.empty_like(send)
    times = []
    for i in range(count + 1):
        t0 = time.perf_counter()
        p.ring_exchange(send, recv, 1, f"exchange {i}", stream)
        if i:
            times.append(time.perf_counter() - t0)
        elif started is not None:
            started.set()
    return times


def _measure_interference(p: _Probe, cfg: _Config) -> None:
    info = p.info
    p.say(f"interference: GEMM {_dtype_name(cfg.busy_dtype)} n={cfg.busy_n} beside "
          f"{_size_text(cfg.busy_bytes)} ring exchanges")
    gemm = _Gemm(cfg.busy_n, cfg.busy_dtype, info.device)
    p.barrier()
    p.record("busy/gemm_alone", [gemm() for _ in range(cfg.busy_reps)])
    p.barrier()
    alone = _exchanges(p, cfg.busy_bytes, cfg.busy_reps)
    p.record("busy/comm_alone", alone)
    # Every rank must post the same number of exchanges: agree on a count from the slowest rank.
    slowest = max(p.exchange("count", statistics.median(alone)))
    count = max(10, min(5000, math.ceil(cfg.busy_s / slowest)))

    outcome: dict[str, Any] = {}
    started, done = threading.Event(), threading.Event()

    def side() -> None:
        try:
            if info.device.type == "cuda":
                torch.cuda.set_device(info.device)  # the current device is per thread
                stream = torch.cuda.Stream(info.device)
                with torch.cuda.stream(stream):
                    outcome["times"] = _exchanges(p, cfg.busy_bytes, count, stream, started)
            else:
                outcome["times"] = _exchanges(p, cfg.busy_bytes, count, None, started)
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            outcome["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=side, name="overlap-probe", daemon=True)
    # The exchange thread's own waits have the deadline; this one is a backstop for the whole loop.
    deadline = time.monotonic() + p.timeout + 4 * cfg.busy_s
    beside, last = [], 0.0
    thread.start()
    while True:
        was_started = started.is_set()
        last = gemm()
        finished = done.is_set()
        if was_started and not finished:  # a GEMM that ran wholly beside the exchanges
            beside.append(last)
        if finished:
            break
        if time.monotonic() > deadline:
            raise OverlapTimeout(OP, info.rank, "any", "interference", p.timeout,
                                 "the exchanges beside the GEMMs did not finish")
    thread.join(p.timeout)
    if "error" in outcome:
        raise outcome["error"]
    p.record("busy/gemm_beside", beside or [last])
    p.record("busy/comm_beside", outcome["times"])


def _measure_chunking(p: _Probe, cfg: _Config) -> None:
    p.say(f"chunking: {_size_text(cfg.chunk_bytes)} ring exchange in 1 and {CHUNKS} chunks")
    send = torch.empty(cfg.chunk_bytes, dtype=torch.uint8, device=p.info.device)
    recv = torch.empty_like(send)
    times: dict[int, list[float]] = {1: [], CHUNKS: []}
    p.barrier()
    for i in range(cfg.chunk_reps + 1):  # repeat 0 is a warm-up; the two are interleaved against drift
        for n, ts in times.items():
            t0 = time.perf_counter()
            p.ring_exchange(send, recv, n, f"chunking {i}")
            if i:
                ts.append(time.perf_counter() - t0)
    p.record("chunk/1", times[1])
    p.record(f"chunk/{CHUNKS}", times[CHUNKS])


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _profile(values: dict[str, float], pairs: dict[str, tuple[int, int]], facts: list[dict],
             info: GroupInfo) -> Profile:
    """Fit the combined measurements (the same on every rank, hence the same Profile)."""
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, t in values.items():
        kind, what, size = (key.split("/") + ["", ""])[:3]
        if kind in TRANSPORTS or kind == "gemm":
            points.setdefault((kind, what), []).append((int(size), t))
    links: dict[str, dict[str, LinkFit]] = {}
    for cls in pairs:
        for transport in TRANSPORTS:
            pts = sorted(points.get((transport, cls), []))
            if len(pts) >= 2:
                links.setdefault(cls, {})[transport] = fit_link([n for n, _ in pts], [t for _, t in pts])
    gemm = {}
    for (kind, name), pts in sorted(points.items()):
        if kind == "gemm" and len(pts) >= 2:
            pts.sort()
            gemm[name] = fit_gemm([2.0 * n**3 for n, _ in pts], [t for _, t in pts])

    def ratio(beside: str, alone: str) -> float:
        b, a = values.get(beside, 0.0), values.get(alone, 0.0)
        return max(1.0, b / a) if a > 0 else 1.0

    t1, tn = values.get("chunk/1", 0.0), values.get(f"chunk/{CHUNKS}", 0.0)
    first = facts[0]
    machine = f"{first['host']}: {info.world_size} rank(s) on {len(set(info.nodes))} node(s), {info.backend}"
    if info.device.type != "cuda":
        machine += f", {first['threads']} torch thread(s) per rank"
    return Profile(
        links=links, gemm=gemm,
        gemm_slowdown=ratio("busy/gemm_beside", "busy/gemm_alone"),
        comm_slowdown=ratio("busy/comm_beside", "busy/comm_alone"),
        per_chunk_s=max(0.0, (tn - t1) / (CHUNKS - 1)) if t1 > 0 and tn > 0 else 0.0,
        device=first["device"], machine=machine,
    )


def probe(group: dist.ProcessGroup | None = None, *, quick: bool = False, timeout: float | None = None,
          progress: Callable[[str], None] | None = None) -> Profile:
    """Measure this group's links, GEMM rates, interference and chunking cost (see the module docstring).

    A collective: every rank of `group` (default: the default group) calls it, and every rank
    returns the same `plan.Profile`. ``quick=True`` measures fewer sizes with fewer repeats (about
    1 s on 2 CPU ranks; for tests); the default takes a few seconds there (3-6 s on a 2-core VM). `timeout` bounds every
    wait on a peer (default ``OVERLAP_TIMEOUT_S``). ``progress(text)`` is called on this rank before
    each step with what it measures. A group of one rank measures GEMMs only (no links, factors 1).

    Raises ValueError for a bad `timeout`, `OverlapTimeout`/`OverlapError` where a peer is dead or
    does not take part (the group is unusable afterwards).
    """
    pg = world.resolve_group(group)
    timeout = C.resolve_timeout(timeout)
    token = world.CALLER.set(OP)
    try:
        start = time.perf_counter()
        info = world.group_info(pg, timeout)
        cfg = _config(info.device, quick)
        p = _Probe(pg, info, timeout, progress)
        classes = [info.link_class(q) if q != info.rank else "" for q in range(info.world_size)]
        facts = p.exchange("facts", {"links": classes, "host": socket.gethostname(),
                                     "device": _device_name(info.device), "threads": torch.get_num_threads()})
        pairs = _link_pairs([f["links"] for f in facts])
        with torch.no_grad():
            if info.world_size > 1:
                _measure_links(p, cfg, pairs)
            _measure_gemms(p, cfg)
            if info.world_size > 1:
                _measure_interference(p, cfg)
                _measure_chunking(p, cfg)
        p.say("combining the ranks' measurements")
        values: dict[str, float] = {}
        for row in p.exchange("values", p.values):
            for key, t in row.items():
                values[key] = max(values.get(key, 0.0), t)
        profile = _profile(values, pairs, facts, info)
        log.info("overlap.probe: measured %s in %.1f s", profile.machine, time.perf_counter() - start)
        return profile
    finally:
        world.CALLER.reset(token)


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``OVERLAP_CACHE_DIR`` if set, else ``~/.cache/overlap`` (`overlap.envs.cache_dir`)."""
    return Path(envs.cache_dir())


def _info(group: GroupInfo | dist.ProcessGroup | None, timeout: float | None = None) -> GroupInfo:
    return group if isinstance(group, GroupInfo) else world.group_info(group, timeout)


def cache_path(info: GroupInfo | dist.ProcessGroup | None = None, *, quick: bool = False) -> Path:
    """The profile file of this machine for a group: `cache_dir` / ``profile-HOST-DEVICE-wW-LINKS.json``.

    HOST is this machine's hostname, DEVICE ``cpu-tN`` (N torch threads per rank: GEMM rates depend
    on it) or the GPU's name, W the group's world size, LINKS the link classes this rank sees to its
    peers (``none`` for one rank); quick probes go to their own ``-quick`` file. `info` is the
    group's `GroupInfo`, or a group (then `world.group_info`, a collective on a group's first use).
    """
    info = _info(info)
    device = _device_name(info.device) if info.device.type == "cuda" else f"cpu-t{torch.get_num_threads()}"
    present = set(info.link_classes().values())
    links = "+".join(c for c in LINK_CLASSES if c in present) or "none"
    name = f"profile-{socket.gethostname()}-{device}-w{info.world_size}-{links}{'-quick' if quick else ''}"
    return cache_dir() / (re.sub(r"[^A-Za-z0-9._+-]+", "_", name) + ".json")


def _read(path: Path) -> Profile | None:
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("overlap: ignoring the machine profile %s (%s); it will be probed again", path, exc)
        return None


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, text)


def load_cached(group: GroupInfo | dist.ProcessGroup | None = None, *, quick: bool = False) -> Profile | None:
    """This machine's cached profile for `group` (`cache_path`), or None where there is none or it is
    unreadable or of another version (logged). Local: no communication beyond `world.group_info`;
    ranks on other nodes than rank 0 look on their own machine (use `probe_cached` for one answer)."""
    return _read(cache_path(_info(group), quick=quick))


def save_cached(profile: Profile, group: GroupInfo | dist.ProcessGroup | None = None, *,
                quick: bool = False) -> Path:
    """Write `profile` to `cache_path` on group rank 0 (atomically: a temporary file, then a rename);
    other ranks write nothing. Returns the path on every rank."""
    info = _info(group)
    path = cache_path(info, quick=quick)
    if info.rank == 0:
        _write_atomic(path, json.dumps(profile.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def probe_cached(group: dist.ProcessGroup | None = None, *, refresh: bool = False, quick: bool = False,
                 timeout: float | None = None, progress: Callable[[str], None] | None = None) -> Profile:
    """The group's cached profile, else a fresh `probe` saved to the cache. A collective.

    Rank 0 reads its machine's file (unless `refresh`) and hands what it found, or "none", to every
    rank through the store, so every rank returns the same Profile and all probe or none does.
    After a probe rank 0 writes the file (`save_cached`). Raises as `probe`.
    """
    pg = world.resolve_group(group)
    timeout = C.resolve_timeout(timeout)
    token = world.CALLER.set(OP)
    try:
        info = world.group_info(pg, timeout)
        text = ""
        if info.rank == 0 and not refresh:
            cached = _read(cache_path(info, quick=quick))
            text = json.dumps(cached.to_json()) if cached is not None else ""
        shared = world.store_exchange(pg, "probe-cache", text.encode(), timeout)[0].decode()
    finally:
        world.CALLER.reset(token)
    if shared:
        if progress is not None:
            progress("machine profile from the cache")
        return Profile.from_json(json.loads(shared))
    profile = probe(pg, quick=quick, timeout=timeout, progress=progress)
    # (the probe may have released a heap it created, and with it the group's GroupInfo: rendezvous)
    save_cached(profile, world.group_info(pg, timeout), quick=quick)
    return profile
