"""One GPU, virtual ranks: the checks a-c and e and the timings of the fused all-gather GEMM kernel
(`overlap.kernels.all_gather_matmul`), as bench/gpu_check.py's docstring tells, and check a of the weight-side one
(`overlap.kernels.all_gather_weight_matmul`, ``all_gather_weight_matmul``'s fused strategy: the virtual ranks' shards
are rows of the weight); its virtual ranks are
`gpu_check_tp_group.GatherGroup`. Its entries run three groups (`gpu_check_groups.GROUPS`): "ag" (a-c),
"streams" (the checks d of the virtual ranks' primitives, `gpu_check_virtual`, and e) and "time_ag" (the
signal and copy timings, then the kernel against cuBLAS). The racing checks issue their producers before
their waiters, behind a host-released gate (`gpu_check_virtual`'s docstring says why).

NCCL refuses two ranks of one communicator on one GPU, so W virtual ranks live in this process, each
with its own stream, its own symmetric buffer (a plain device tensor) and its own int32 flag word; the
fused kernel is launched with tables of their ``data_ptr()``. On the CPU (``--cpu-smoke``) the same
checks run under the Triton interpreter at tiny sizes.

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch
from gpu_check_common import Report, bench_shapes, compare, do_bench, dtype_name, err_text, matmul_tflops
from gpu_check_tp_group import Consumer, GatherGroup, gather_grid, launch_gather, new_consumer
from gpu_check_virtual import (
    KERNEL_TIMEOUT_NS,
    SHORT_TIMEOUT_NS,
    Device,
    Tile,
    check_flag_wait_kernel,
    check_stream_wait,
    time_copy,
    time_signals,
)
from overlap.kernels.all_gather_weight_matmul import launch_all_gather_weight_matmul
from overlap.kernels.host import Watchdog, epoch_word

from overlap import comm


def judge(rep: Report, name: str, consumers: list[Consumer], ref: torch.Tensor, expect_err: int = 0,
          problems: list[str] | None = None, note: str = "") -> None:
    """PASS if every consumer's output matches `ref` and its error word is `expect_err`."""
    problems = list(problems or [])
    worst_err, worst_rel = 0.0, 0.0
    for r, c in enumerate(consumers):
        ok, max_err, rel = compare(c.out, ref)
        if not ok and not math.isfinite(max_err):
            max_err, rel = math.inf, math.inf  # NaN left in the output: a tile was never written
        worst_err, worst_rel = max(worst_err, max_err), max(worst_rel, rel)
        if not ok:
            problems.append(f"rank {r}: output off ({err_text(max_err, rel)})")
        if int(c.err.item()) != expect_err:
            problems.append(f"rank {r}: err word {int(c.err.item())}, expected {expect_err}")
    value = err_text(worst_err, worst_rel) + (f"; {note}" if note else "")
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, max_err=worst_err, rel=worst_rel)


# ==============================================================================================
# Checks a-c and e
# ==============================================================================================


def check_ordered(rep: Report, dev: Device, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype,
                  b_layout: str) -> None:
    """a. Every shard copied and flagged before any consumer launches; each rank's output vs reference."""
    m, k, n = shape
    name = f"a.ordered W={world_size} {dtype_name(dtype)} {m}x{k}x{n} b={b_layout}"
    epoch = 7
    g = GatherGroup.create(dev, world_size, m, k, n, dtype, stale=epoch - 1, b_layout=b_layout)
    ref = g.reference()
    consumers = [new_consumer(g) for _ in range(world_size)]
    for r in range(world_size):
        g.produce(r, epoch)
    dev.settle(g.streams, g.flags, name)  # the flags and the poisoned outputs are in place before any launch
    for r, c in enumerate(consumers):
        with dev.on(g.streams[r]):
            launch_gather(g, r, c, epoch, KERNEL_TIMEOUT_NS, dev.tile)
    dev.settle(g.streams, g.flags, name)
    judge(rep, name, consumers, ref)


def check_weight_ordered(rep: Report, dev: Device, world_size: int, shape: tuple[int, int, int],
                         dtype: torch.dtype) -> None:
    """a. The weight-side kernel: every shard (``[n, k]``, rows of the weight) copied and flagged before any
    consumer launches; each rank's ``a @ cat(shards).T`` against float64 (one ``a`` for every virtual rank)."""
    m, k, n = shape
    name = f"a.weight-ordered W={world_size} {dtype_name(dtype)} {m}x{k}x{n}"
    epoch, d = 7, dev.device
    g = GatherGroup.create(dev, world_size, n, k, 16, dtype, stale=epoch - 1)  # its shards: n rows each
    a = torch.randn(m, k, device=d, dtype=dtype)
    ref = a.double() @ torch.cat(g.shards).double().t()
    consumers = [Consumer(torch.full((m, world_size * n), math.nan, device=d, dtype=dtype),
                          torch.zeros(1, dtype=torch.int32, device=d), torch.zeros(1, dtype=torch.int32, device=d))
                 for _ in range(world_size)]
    for r in range(world_size):
        g.produce(r, epoch)
    dev.settle(g.streams, g.flags, name)
    for r, c in enumerate(consumers):
        with dev.on(g.streams[r]):
            launch_weight_gather(g, r, c, a, epoch, KERNEL_TIMEOUT_NS, dev.tile)
    dev.settle(g.streams, g.flags, name)
    judge(rep, name, consumers, ref)


def launch_weight_gather(g: GatherGroup, rank: int, c: Consumer, a: torch.Tensor, epoch: int, timeout_ns: int,
                         tile: Tile) -> None:
    """Virtual rank `rank`'s weight-side kernel on the current stream, through the launcher the op calls (its
    shards: the group's, rows of the weight)."""
    launch_all_gather_weight_matmul(a, g.ptr_table, g.flag_table, n=g.shards[0].shape[0],
                                    epoch=epoch_word(epoch, a.device), rank=rank, err=c.err, timeout_ns=timeout_ns,
                                    block=(tile.block_m, tile.block_n, tile.block_k), out=c.out, abort=c.abort,
                                    watchdog=False, num_warps=tile.num_warps, num_stages=tile.num_stages)


def check_racing(rep: Report, dev: Device, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """b. Consumers spin; the flags come later from another stream (a thread on CPU).

    The data is in place beforehand, so only the flags gate the tiles. On a GPU the publisher
    needs no SM (stream memory ops, plus one-thread gate and delay kernels); all consumer CTAs must
    co-reside, or a spinning grid could keep the others from starting (`Device.spin_guard`).
    """
    m, k, n = shape
    name = f"b.racing W={world_size} {dtype_name(dtype)} {m}x{k}x{n}"
    epoch = 9
    g = GatherGroup.create(dev, world_size, m, k, n, dtype, stale=epoch - 1)
    ref = g.reference()
    consumers = [new_consumer(g) for _ in range(world_size)]
    g.fill_buffers()  # (and waits for the poisoned outputs)
    first_delay_s, gap_s = 0.02, 0.002
    if not dev.cuda:
        last_due = [math.inf]  # just before the last flag is published: every consumer needs that flag

        def publisher() -> None:
            time.sleep(first_delay_s)
            for i, r in enumerate(reversed(range(world_size))):
                time.sleep(gap_s if i else 0.0)
                last_due[0] = time.perf_counter()
                dev.publish(g.flags[r], epoch, None)

        thread = threading.Thread(target=publisher, daemon=True)
        abort = consumers[0].abort  # one abort word: the watchdog bounds every interpreted spin
        with Watchdog(abort, 10.0):
            thread.start()
            for r, c in enumerate(consumers):
                c.abort = abort
                launch_gather(g, r, c, epoch, KERNEL_TIMEOUT_NS, dev.tile)
            finished = time.perf_counter()
        thread.join(timeout=5.0)
        early = [] if finished > last_due[0] else ["consumers finished before the last flag was published"]
        judge(rep, name, consumers, ref, problems=early, note="thread publisher")
        return
    cells = world_size * gather_grid(g, dev.tile) + 1  # + the publisher's gate or delay kernel
    if dev.spin_guard(rep, name, cells, world_size + 1):
        return
    pub = dev.stream()
    dev.distinct([*g.streams, pub])  # a consumer sharing the publisher's stream would wait for itself
    # the kernel loaded before any gate (`Device.warm`): on the stale flags it waits for nothing
    dev.warm(name, lambda: launch_gather(g, 0, new_consumer(g), epoch - 1, KERNEL_TIMEOUT_NS, dev.tile))
    # The publisher first, in host order (held by a gate until every consumer is issued), then the consumers
    # and their end events: no consumer can sit in a hardware queue in front of the flags it waits for.
    gate = dev.gate()
    gate.hold(pub)
    last_due = torch.cuda.Event(enable_timing=True)  # just before the last flag: every consumer needs it
    dev.delay(pub, int(first_delay_s * 1e9))
    for i, r in enumerate(reversed(range(world_size))):  # rank 0's flag last
        if i:
            dev.delay(pub, int(gap_s * 1e9))
        if i == world_size - 1:
            last_due.record(pub)
        dev.publish(g.flags[r], epoch, pub)
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(world_size)]
    for r, c in enumerate(consumers):
        with dev.on(g.streams[r]):
            launch_gather(g, r, c, epoch, KERNEL_TIMEOUT_NS, dev.tile)
            ends[r].record()
    gate.open()
    dev.settle([*g.streams, pub], g.flags, name)
    after_ms = [last_due.elapsed_time(e) for e in ends]  # > 0 unless a tile ignored its flag
    early = [f"rank {r} finished {-t:.3f} ms before the last flag" for r, t in enumerate(after_ms) if t <= 0]
    judge(rep, name, consumers, ref, problems=early,
          note=f"ended {min(after_ms):.3f}-{max(after_ms):.3f} ms after the last flag was due")


def check_timeout(rep: Report, dev: Device, dtype: torch.dtype) -> None:
    """c. Rank 1 never flags its chunk: rank 0's kernel returns after ~timeout with err == src + 1 == 2."""
    m, k, n = (64, 256, 128) if dev.cuda else (16, 32, 32)
    name = f"c.timeout W=2 {dtype_name(dtype)} {m}x{k}x{n}"
    epoch = 5
    g = GatherGroup.create(dev, 2, m, k, n, dtype, stale=epoch - 1)
    ref = g.reference()
    c = new_consumer(g)
    g.fill_buffers()
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    if dev.spin_guard(rep, name, gather_grid(g, dev.tile), 1):
        return
    if dev.cuda:
        dev.publish(g.flags[0], epoch, g.streams[0])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with dev.on(g.streams[0]):
            start.record()
            launch_gather(g, 0, c, epoch, SHORT_TIMEOUT_NS, dev.tile)
            end.record()
        dev.settle(g.streams, g.flags, name)  # the kernel's own limit must end it long before this deadline
        waited = start.elapsed_time(end) / 1e3
    else:
        dev.publish(g.flags[0], epoch, None)
        t0 = time.perf_counter()
        with Watchdog(c.abort, timeout_s):  # the interpreter's abort word stands in for %globaltimer
            launch_gather(g, 0, c, epoch, SHORT_TIMEOUT_NS, dev.tile)
        waited = time.perf_counter() - t0
    problems = []
    if int(c.err.item()) != 2:
        problems.append(f"err word {int(c.err.item())}, expected 2 (src 1 + 1)")
    if not 0.5 * timeout_s <= waited <= 10 * timeout_s:
        problems.append(f"returned after {waited:.3f} s, expected about {timeout_s} s")
    ok, max_err, rel = compare(c.out[:m], ref[:m])  # its own chunk needed no peer
    if not ok:
        problems.append(f"own rows off ({err_text(max_err, rel)})")
    value = f"bounded wait fired after {waited:.3f} s, err={int(c.err.item())}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, waited_s=waited)


def check_symm_pipeline(rep: Report, dev: Device, world_size: int, shape: tuple[int, int, int],
                        dtype: torch.dtype, num_chunks: int = 2) -> None:
    """e. The ``symm`` strategy's GPU pipeline (`_symm_cuda`) on virtual ranks.

    Producers first, in host order, each held by a gate: rank r's main stream (after a rank-dependent delay,
    so peers really wait) copies its shard into its buffer and flags it. Then the waiters: each side stream
    waits (the ops' bounded wait, `Device.wait_flag`) on each peer's flag, copies the peer's chunks into a
    local gathered tensor and records an event per chunk; each main stream runs the local GEMM, then each
    chunk's GEMM after that chunk's event. Then the gate opens. Buffers start as NaN, so a copy that outran
    its flag shows in the output; a wait that timed out shows in its error word.
    """
    m, k, n = shape
    name = f"e.symm-pipeline W={world_size} {dtype_name(dtype)} {m}x{k}x{n} chunks={num_chunks}"
    if dev.spin_guard(rep, name, 3 * world_size, 2 * world_size):  # gates, delays, side waits
        return
    epoch = 11
    g = GatherGroup.create(dev, world_size, m, k, n, dtype, stale=epoch - 1)
    ref = g.reference()
    sides = [dev.stream() for _ in range(world_size)]
    dev.distinct([*g.streams, *sides])
    consumers = [new_consumer(g) for _ in range(world_size)]
    fulls = [torch.empty(world_size * m, k, device=dev.device, dtype=dtype) for _ in range(world_size)]
    errs = torch.zeros(world_size, dtype=torch.int32, device=dev.device)
    dev.idle(name)
    bounds = comm.chunk_bounds(m, num_chunks)

    def gemms() -> None:  # every GEMM shape the waiters run (cuBLAS picks its kernel per shape)
        scratch = torch.empty_like(consumers[0].out)
        torch.mm(g.shards[0], g.b, out=scratch[:m])
        for rows in sorted({hi - lo for lo, hi in bounds}):
            torch.mm(fulls[0][:rows], g.b, out=scratch[:rows])

    dev.warm(name, gemms)  # loaded before any gate (`Device.warm`)
    gate = dev.gate()
    for r in range(world_size):  # the producers
        gate.hold(g.streams[r])
        dev.delay(g.streams[r], (world_size - r) * 1_000_000)
        g.produce(r, epoch)
    for r in range(world_size):  # the waiters
        main, side, out, full = g.streams[r], sides[r], consumers[r].out, fulls[r]
        side.wait_stream(main)
        events = []
        with dev.on(side):
            for i in range(1, world_size):
                p = (r + i) % world_size
                dev.wait_flag(g.flags[p], epoch, side, errs[r : r + 1])
                for lo, hi in bounds:
                    full[p * m + lo : p * m + hi].copy_(g.buffers[p][lo:hi], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(side)
                    events.append((p, lo, hi, ev))
        with dev.on(main):
            torch.mm(g.shards[r], g.b, out=out[r * m : (r + 1) * m])
            for p, lo, hi, ev in events:
                main.wait_event(ev)
                torch.mm(full[p * m + lo : p * m + hi], g.b, out=out[p * m + lo : p * m + hi])
    gate.open()
    dev.settle([*g.streams, *sides], g.flags, name)
    timed_out = [r for r, e in enumerate(errs.tolist()) if e]
    judge(rep, name, consumers, ref, problems=[f"ranks {timed_out}: a bounded wait timed out"] if timed_out else [])


# ==============================================================================================
# Timings (one GPU)
# ==============================================================================================

TILES = (Tile(128, 128, 64, 4, 3), Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3), Tile(256, 128, 64, 8, 3))


def time_fused_vs_cublas(rep: Report, dev: Device, label: str, world_size: int, m: int, k: int, n: int) -> None:
    """The fused kernel with every flag pre-set vs torch.matmul (cuBLAS) on the gathered tensor, bf16."""
    dtype, epoch = torch.bfloat16, 3
    g = GatherGroup.create(dev, world_size, m, k, n, dtype, stale=epoch)  # flags already at the epoch
    g.fill_buffers()
    full = torch.cat(g.shards)
    ref = full.double() @ g.b.double()
    rows = world_size * m
    cublas_out = torch.matmul(full, g.b)
    ok, max_err, rel = compare(cublas_out, ref)
    t_cublas = do_bench(lambda: torch.matmul(full, g.b))
    rep.add(f"time cuBLAS {label} {rows}x{k}x{n}", "PASS" if ok else "FAIL",
            f"{t_cublas:.3f} ms ({err_text(max_err, rel)})", tflops=matmul_tflops(rows, n, k, t_cublas), ms=t_cublas)
    c = new_consumer(g)
    best: tuple[float, Tile] | None = None
    per_tile: dict[str, Any] = {}
    for tile in TILES:
        try:
            c.out.fill_(math.nan)
            c.err.zero_()
            launch_gather(g, 0, c, epoch, KERNEL_TIMEOUT_NS, tile)
            dev.idle(f"fused {label} {tile.describe()}")
            ok, max_err, rel = compare(c.out, ref)
            if not ok or int(c.err.item()):
                per_tile[tile.describe()] = f"wrong: {err_text(max_err, rel)}, err={int(c.err.item())}"
                rep.add(f"time fused {label} [{tile.describe()}]", "FAIL", per_tile[tile.describe()])
                continue
            t = do_bench(lambda tile=tile: launch_gather(g, 0, c, epoch, KERNEL_TIMEOUT_NS, tile))
        except Exception as exc:  # noqa: BLE001 - e.g. a tile that needs more shared memory than there is
            per_tile[tile.describe()] = f"{type(exc).__name__}: {exc}"[:200]
            rep.log(f"tile {tile.describe()} failed: {per_tile[tile.describe()]}")
            dev.idle(f"fused {label} {tile.describe()}")
            continue
        per_tile[tile.describe()] = t
        rep.log(f"fused {label} [{tile.describe()}]: {t:.3f} ms, {matmul_tflops(rows, n, k, t):.0f} TFLOP/s")
        if best is None or t < best[0]:
            best = (t, tile)
    if best is None:
        rep.add(f"time fused {label} {rows}x{k}x{n}", "FAIL", "no tile configuration ran", tiles=per_tile)
        return
    t, tile = best
    rep.add(f"time fused {label} {rows}x{k}x{n}", "PASS", f"{t:.3f} ms [{tile.describe()}]",
            tflops=matmul_tflops(rows, n, k, t), ratio=t_cublas / t, ms=t, cublas_ms=t_cublas, tiles=per_tile)


# ==============================================================================================
# Entries (gpu_check_groups.GROUPS): the groups "ag", "streams" and "time_ag"
# ==============================================================================================


def shape_name(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def run_all_gather_checks(rep: Report, dev: Device) -> None:
    """Group "ag": the all-gather sections a-c (the kernel's correctness), in order."""
    if dev.cuda:
        dtypes = (torch.bfloat16,)
        shapes = (((256, 1024, 512), "w.t()"), ((100, 1000, 300), "row-major"))
        race_shape = (128, 512, 256)
    else:
        dtypes = (torch.float32, torch.bfloat16)
        shapes = (((16, 32, 24), "w.t()"), ((24, 40, 64), "row-major"))
        race_shape = (16, 32, 32)
    for dtype in dtypes:
        for world_size in (2, 4):
            for shape, layout in shapes:
                rep.run(f"a.ordered W={world_size} {dtype_name(dtype)} {shape_name(shape)}",
                        lambda w=world_size, s=shape, d=dtype, lay=layout: check_ordered(rep, dev, w, s, d, lay))
    weight_shape = (256, 1024, 384) if dev.cuda else (20, 32, 24)
    for world_size in (2, 4):
        rep.run(f"a.weight-ordered W={world_size} {dtype_name(dtypes[0])} {shape_name(weight_shape)}",
                lambda w=world_size: check_weight_ordered(rep, dev, w, weight_shape, dtypes[0]))
    for world_size in (2, 4) if dev.cuda else (2,):
        rep.run(f"b.racing W={world_size}", lambda w=world_size: check_racing(rep, dev, w, race_shape, dtypes[0]))
    rep.run("c.timeout", lambda: check_timeout(rep, dev, dtypes[0]))


def run_stream_checks(rep: Report, dev: Device) -> None:
    """Group "streams": the checks d (overlap.signals' waits) and e (the symm pipeline); GPU only."""
    gpu_only = None if dev.cuda else "GPU only"
    rep.run("d.cuda_wait_flag_bounded", lambda: check_flag_wait_kernel(rep, dev), skip=gpu_only)
    rep.run("d.cuda_stream_wait_value32", lambda: check_stream_wait(rep, dev), skip=gpu_only)
    for world_size in (2, 4):
        rep.run(f"e.symm-pipeline W={world_size}",
                lambda w=world_size: check_symm_pipeline(rep, dev, w, (256, 512, 384), torch.bfloat16), skip=gpu_only)


def run_all_gather_timings(rep: Report, dev: Device) -> None:
    """Group "time_ag": copy bandwidth, the cost of a signal, the fused kernel against cuBLAS; GPU only."""
    gpu_only = None if dev.cuda else "GPU only"
    rep.run("time d2d copy", lambda: time_copy(rep, dev), skip=gpu_only)
    rep.run("time signal", lambda: time_signals(rep, dev), skip=gpu_only)
    for label, s in bench_shapes(8):  # W=8 virtual ranks
        rep.run(f"time fused vs cuBLAS {label}",
                lambda a=(label, 8, s["m"], s["k"], s["n"]): time_fused_vs_cublas(rep, dev, *a), skip=gpu_only)
