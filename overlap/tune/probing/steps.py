"""The measuring steps of `probe` on one rank (the package `overlap.tune.probing` runs them and says, in its
docstring, what each measures and how the ranks combine): links, GEMMs, interference and chunking, each
recording this rank's medians in a `Probe` (the group, its deadline, the store rendezvous and the bounded
posts and waits every step uses); what they measure per device type and depth is `config_for`'s.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import comm, rendezvous, symm
from ...errors import OverlapError, OverlapTimeout
from ...plans.auto import gpu_symmetric_memory
from ...world import LINK_CLASSES, GroupInfo

OP = "probe"
KiB, MiB = 1024, 1024 * 1024
CHUNKS = 8  # the chunked exchange of the chunking probe


# ----------------------------------------------------------------------------------------------
# What is measured, per device type and depth
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
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


def config_for(device: torch.device, quick: bool) -> Config:
    """What a probe measures on `device`: the quick (``quick=True``) or the full set."""
    if device.type == "cuda":
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
        if quick:
            return Config(link_sizes=(64 * KiB, MiB, 16 * MiB), link_reps=3, gemm_dtypes=dtypes,
                          gemm_sizes=(1024, 2048, 4096), gemm_reps=3, busy_dtype=torch.bfloat16, busy_n=4096,
                          busy_bytes=16 * MiB, busy_reps=5, busy_s=0.1, chunk_bytes=16 * MiB, chunk_reps=3)
        return Config(link_sizes=(4 * KiB, 64 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB), link_reps=20,
                      gemm_dtypes=dtypes, gemm_sizes=(1024, 2048, 4096, 8192), gemm_reps=10,
                      busy_dtype=torch.bfloat16, busy_n=8192, busy_bytes=64 * MiB, busy_reps=20, busy_s=1.0,
                      chunk_bytes=64 * MiB, chunk_reps=15)
    dtypes = (torch.float32, torch.bfloat16)
    if quick:
        return Config(link_sizes=(4 * KiB, 64 * KiB, MiB), link_reps=2, gemm_dtypes=dtypes, gemm_sizes=(64, 128, 256),
                      gemm_reps=2, busy_dtype=torch.float32, busy_n=192, busy_bytes=256 * KiB, busy_reps=5,
                      busy_s=0.1, chunk_bytes=MiB, chunk_reps=3)
    return Config(link_sizes=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB), link_reps=20,
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


class Probe:
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
        return rendezvous.exchange(self.pg, f"probe-{tag}", value, self.timeout)

    def barrier(self) -> None:
        rendezvous.exchange(self.pg, "probe-barrier", None, self.timeout)

    def wait(self, work: Any, peer: int, what: str) -> None:
        comm.wait_work(work, OP, self.info.rank, peer, what, self.timeout, self.info)

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
        posted = comm.exchange_chunked(send, (r + 1) % w, recv, (r - 1) % w, lambda _link: num_chunks, info,
                                       self.pg, OP)
        for j, _rows, works in posted:
            for work, peer in works:
                self.wait(work, peer, f"{what}, chunk {j}")
        _sync(info.device, stream)


# ----------------------------------------------------------------------------------------------
# 1. Links
# ----------------------------------------------------------------------------------------------


def link_pairs(rows: Sequence[Sequence[str]]) -> dict[str, tuple[int, int]]:
    """The first rank pair in rank order per link class, from every rank's view of its peers."""
    pairs: dict[str, tuple[int, int]] = {}
    for i, row in enumerate(rows):
        for j in range(i + 1, len(rows)):
            pairs.setdefault(row[j], (i, j))
    return {c: pairs[c] for c in LINK_CLASSES if c in pairs}


def _role(p: Probe, pair: tuple[int, int]) -> tuple[bool, int] | None:
    """(this rank leads, its peer) within `pair`, or None where this rank is not in it."""
    if p.info.rank not in pair:
        return None
    lead = p.info.rank == pair[0]
    return lead, pair[1] if lead else pair[0]


def _pingpong_p2p(p: Probe, pair: tuple[int, int], nbytes: int, reps: int) -> list[float]:
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


def _pingpong_copy(p: Probe, heap: symm.SymmHeap, pair: tuple[int, int], nbytes: int, reps: int) -> list[float]:
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


def measure_links(p: Probe, cfg: Config, pairs: dict[str, tuple[int, int]]) -> None:
    """Step 1: ping-pong over p2p for every link class in `pairs`, then through the heap ("copy")."""
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


def measure_gemms(p: Probe, cfg: Config) -> None:
    """Step 2: every rank times its GEMMs at once."""
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


def _exchanges(p: Probe, nbytes: int, count: int, stream: Any = None,
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


def measure_interference(p: Probe, cfg: Config) -> None:
    """Step 3: GEMMs and ring exchanges alone, then side by side (the exchanges on a helper thread)."""
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


def measure_chunking(p: Probe, cfg: Config) -> None:
    """Step 4: the ring exchange whole and in `CHUNKS` chunks, interleaved."""
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
# 5. The fixed cost of a call
# ----------------------------------------------------------------------------------------------

#: the problem whose calls the call-cost step times: ``all_gather_matmul``, so few rows that its transfers and
#: GEMMs cost about their latencies and overheads (which the links' and GEMMs' fits price apart)
CALL_PROBLEM = (16, 64, 64)
#: calls per timed batch of the call-cost step (back to back, as a training loop issues them)
CALL_BATCH = 10
#: untimed calls before each batch: after another strategy's batch, the first two `reference` calls are not
#: predicted (`overlap.symm.plain`) and make a full handshake, which a training loop's repeated calls do not
CALL_LEAD = 2


def call_strategies(info: GroupInfo) -> tuple[str, ...]:
    """The strategies whose per-call cost the probe times on this group: those `auto` and the tuner may run here."""
    if info.world_size == 1:
        return ()
    if not info.single_node:
        return ("reference", "pipelined") + (("hierarchical",) if info.device.type == "cpu" else ())
    if info.device.type == "cuda":
        return ("reference", "pipelined") + (("symm", "fused") if gpu_symmetric_memory() else ())
    return ("reference", "pipelined", "symm")


def measure_calls(p: Probe, cfg: Config) -> None:
    """Step 5: back-to-back forward calls of `CALL_PROBLEM` per strategy (`call_strategies`), interleaved
    against drift; records ``call/<strategy>``, the median seconds per call (`probing` subtracts what the
    fitted links and GEMMs predict for it, leaving the fixed cost `Profile.call_s`)."""
    from ...ops.tp.all_gather_matmul import all_gather_matmul  # (this layer sits above the ops)

    strategies = call_strategies(p.info)
    if not strategies:
        return
    m, k, n = CALL_PROBLEM
    dtype = torch.bfloat16 if p.info.device.type == "cuda" else torch.float32
    a = torch.randn(m, k, dtype=dtype, device=p.info.device)
    b = torch.randn(k, n, dtype=dtype, device=p.info.device)
    p.say(f"calls: {m}x{k}x{n} all_gather_matmul, {', '.join(strategies)}")
    times: dict[str, list[float]] = {s: [] for s in strategies}
    reps = max(3, cfg.chunk_reps)
    for s in strategies:  # the first call of a signature handshakes in full: warm each up
        for _ in range(3):
            all_gather_matmul(a, b, group=p.pg, strategy=s, timeout=p.timeout)
    _sync(p.info.device)
    p.barrier()
    for _ in range(reps):
        for s in strategies:
            for _ in range(CALL_LEAD):
                all_gather_matmul(a, b, group=p.pg, strategy=s, timeout=p.timeout)
            t0 = time.perf_counter()
            for _ in range(CALL_BATCH):
                all_gather_matmul(a, b, group=p.pg, strategy=s, timeout=p.timeout)
            _sync(p.info.device)
            times[s].append((time.perf_counter() - t0) / CALL_BATCH)
    for s, ts in times.items():
        p.record(f"call/{s}", ts)
