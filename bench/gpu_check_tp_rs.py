"""One GPU, virtual ranks: checks f and timings of the fused reduce-scatter kernels
(`overlap.kernels.matmul_reduce_scatter`: `matmul_scatter_kernel`, then `reduce_chunks_kernel`), as
`matmul_reduce_scatter` and `matmul_all_reduce` launch them (`scatter_and_reduce`, `reduce_sources`).

The virtual ranks, their layouts (``rs``, ``ar2``, ``ar1``) and the kernels' launches are
`gpu_check_tp_group`'s (`ScatterGroup`). Its entries run the groups "rs" (the checks) and "time_rs".

Checks, against float64 sums with a rounding bound (`gpu_check_common.compare_bound`):
f. ordered: every scatter has finished before any reduction starts; then a second call on the same
   slots (fresh inputs, next epoch: the counters the first call reset, flags left at its epoch and its
   partials still in the slots must not pass for this call's). Also: counters back at 0, flags at the epoch.
f. racing: the reductions spin; the scatters run later on another stream, rank 0's last (GPU: issued before
   the reductions, behind a host-released gate; CPU: a thread plays the producers chunk by chunk: copy the
   rows, then publish the flag).
f. timeout: rank 1 never scatters; rank 0's reduction gives up after its timeout with ``err == 2``.
Timings (GPU): rank 0's scatter + reduction (peers' partials already delivered) against ``torch.mm``
plus ``torch.sum`` of the received blocks, for the reduce-scatter and the one-shot all-reduce.

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import math
import threading
import time

import torch
from gpu_check_common import (
    Report,
    all_reduce_shapes,
    compare_bound,
    do_bench,
    dtype_name,
    matmul_tflops,
    row_parallel_shapes,
)
from gpu_check_tp_group import (
    KINDS,
    Layout,
    ScatterGroup,
    check_protocol_state,
    judge_outputs,
    launch_reduce,
    launch_scatter,
    reduce_grid,
)
from gpu_check_virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device
from overlap.kernels.host import Watchdog

from overlap import signals
from overlap.ops import fused

# ==============================================================================================
# Checks f
# ==============================================================================================


def check_ordered(rep: Report, dev: Device, kind: str, world_size: int, shape: tuple[int, int, int],
                  dtype: torch.dtype, b_layout: str = "w.t()", num_chunks: int = 2) -> None:
    """f. ordered: scatters, settle, reductions; twice (epochs 7 and 8) on the same slots and counters."""
    rows, k, n = shape
    lay = Layout(kind, world_size, rows)
    g = ScatterGroup.create(dev, lay, k, n, dtype, num_chunks, stale=6, b_layout=b_layout)
    tf32 = " tf32" if g.tf32 else ""
    name = f"f.{kind} ordered W={world_size} {dtype_name(dtype)}{tf32} {rows}x{k}x{n} b={b_layout} chunks={g.nch}"
    problems: list[str] = []
    worst_err = worst_rel = 0.0
    for call, epoch in enumerate((7, 8)):
        if call:
            g.new_inputs(k, n)  # the slots keep the first call's partials: stale data must not be read
        for r in range(world_size):
            with dev.on(g.streams[r]):
                launch_scatter(g, r, epoch)
        dev.settle(g.streams, g.all_flag_words(), name)  # every partial and flag in place before any reduction
        for r in range(world_size):
            with dev.on(g.streams[r]):
                launch_reduce(g, r, epoch, KERNEL_TIMEOUT_NS)
        dev.settle(g.streams, g.all_flag_words(), name)
        here: list[str] = []
        err, rel = judge_outputs(g, here)
        check_protocol_state(g, epoch, here)
        problems += [f"call {call + 1}: {p}" for p in here]
        worst_err, worst_rel = max(worst_err, err), max(worst_rel, rel)
    value = f"max {worst_err:.1e}, worst block rel {worst_rel:.1e}; 2 calls, {KINDS[kind]}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, max_err=worst_err, rel=worst_rel)


def check_racing(rep: Report, dev: Device, kind: str, world_size: int, shape: tuple[int, int, int],
                 dtype: torch.dtype) -> None:
    """f. racing: the reductions spin; the producers come later, rank 0's last.

    GPU: one publisher stream, issued first and held by a gate until the reductions are issued, waits
    20 ms (a one-thread delay kernel), then runs every rank's scatter kernel (rank W-1 first); every
    reduction needs rank 0's flags, so none may end before rank 0's scatter starts. The spinning
    reductions must co-reside and leave SMs for the scatters (`Device.spin_guard`).
    CPU: see `racing_on_cpu`."""
    rows, k, n = shape
    name = f"f.{kind} racing W={world_size} {dtype_name(dtype)} {rows}x{k}x{n}"
    epoch = 9
    g = ScatterGroup.create(dev, Layout(kind, world_size, rows), k, n, dtype, num_chunks=2, stale=epoch - 1)
    first_delay_s, gap_s = 0.02, 0.002
    if not dev.cuda:
        racing_on_cpu(rep, g, name, epoch, first_delay_s, gap_s)
        return
    cells = world_size * reduce_grid(g) + 1  # + the publisher's gate or delay kernel
    if dev.spin_guard(rep, name, cells, world_size + 1):
        return
    pub = dev.stream()
    dev.distinct([*g.streams, pub])  # a reduction sharing the publisher's stream would wait for itself
    dev.warm(name, lambda: warm_up(g, epoch - 1))  # both kernels loaded before any gate (`Device.warm`)
    g.poison()
    # The producers first, in host order (held by a gate until every reduction is issued), then the reductions
    # and their end events (gpu_check_virtual's docstring: no waiter in a hardware queue before its producer).
    gate = dev.gate()
    gate.hold(pub)
    last_due = torch.cuda.Event(enable_timing=True)  # just before rank 0's scatter: every reduction needs it
    dev.delay(pub, int(first_delay_s * 1e9))
    with dev.on(pub):
        for i, p in enumerate(reversed(range(world_size))):
            if i:
                dev.delay(pub, int(gap_s * 1e9))
            if p == 0:
                last_due.record(pub)
            launch_scatter(g, p, epoch)
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(world_size)]
    for r in range(world_size):
        with dev.on(g.streams[r]):
            launch_reduce(g, r, epoch, KERNEL_TIMEOUT_NS)
            ends[r].record()
    gate.open()
    dev.settle([*g.streams, pub], g.all_flag_words(), name)
    after_ms = [last_due.elapsed_time(e) for e in ends]  # > 0 unless a tile ignored a flag
    problems = [f"rank {r} finished {-t:.3f} ms before rank 0's scatter" for r, t in enumerate(after_ms) if t <= 0]
    err, rel = judge_outputs(g, problems)
    check_protocol_state(g, epoch, problems)
    value = (f"max {err:.1e}, worst block rel {rel:.1e}; ended {min(after_ms):.3f}-{max(after_ms):.3f} ms "
             "after rank 0's scatter started")
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, max_err=err, rel=rel)


def warm_up(g: ScatterGroup, stale: int) -> None:
    """Rank 0's scatter and reduction at the epoch the flags already hold: no wait, the kernels loaded."""
    launch_scatter(g, 0, stale)
    launch_reduce(g, 0, stale, KERNEL_TIMEOUT_NS)


def chunk_rows(g: ScatterGroup, chunk: int) -> tuple[int, int]:
    """Rows of a block that chunk `chunk` covers: row tile t is in chunk ``t * nch // tiles_m``."""
    bm = g.tile[0]
    tiles_m = fused.cdiv(g.lay.block_rows, bm)
    first = fused.cdiv(chunk * tiles_m, g.nch)
    last = fused.cdiv((chunk + 1) * tiles_m, g.nch)
    return min(first * bm, g.lay.block_rows), min(last * bm, g.lay.block_rows)


def racing_on_cpu(rep: Report, g: ScatterGroup, name: str, epoch: int, first_delay_s: float, gap_s: float) -> None:
    """f. racing, interpreted: the scatters run first (the interpreter runs one kernel at a time), their
    partials are staged aside and the slots poisoned again; then a thread plays the producers, chunk by
    chunk, rank W-1 first: it copies a chunk's rows into each owner's slot, then publishes that chunk's flag,
    while the reductions spin. Rank 0's last chunk comes 50 ms after its others, so a tile that reads a
    chunk before its own flag reads NaN, and a reduction that ends before that flag is reported."""
    W = g.world_size
    for r in range(W):
        launch_scatter(g, r, epoch)
    staged = [s.clone() for s in g.slots]
    for s in g.slots:
        s.view(g.dtype).fill_(math.nan)
    for f in g.flags:
        f.fill_(epoch - 1)
    owners = [0] if g.lay.kind == "ar1" else list(range(W))
    last_due: dict[int, float] = {}  # owner rank whose reduction needs it -> when rank 0's last chunk was flagged

    def publisher() -> None:
        time.sleep(first_delay_s)
        for p in reversed(range(W)):
            for c in range(g.nch):
                time.sleep(0.05 if (p, c) == (0, g.nch - 1) and g.nch > 1 else gap_s)
                lo, hi = chunk_rows(g, c)
                for q in owners:
                    owner, dest = (p, 0) if g.lay.kind == "ar1" else (q, q)
                    region = g.region(owner, p)
                    start = region.data_ptr() - g.slots[owner].data_ptr()
                    saved = staged[owner][start : start + region.numel() * region.element_size()]
                    region[lo:hi].copy_(saved.view(g.dtype).view(region.shape)[lo:hi])
                    if (p, c) == (0, g.nch - 1):
                        last_due[dest] = time.perf_counter()
                    signals.signal_store(g.flags[p][g.lay.flag_index(dest) + c :].data_ptr(), epoch)

    thread = threading.Thread(target=publisher, daemon=True)
    abort = g.aborts[0]  # one abort word: the watchdog bounds every interpreted spin
    ends = []
    with Watchdog(abort, 10.0):
        thread.start()
        for r in range(W):
            g.aborts[r] = abort
            launch_reduce(g, r, epoch, KERNEL_TIMEOUT_NS, watchdog=False)
            ends.append(time.perf_counter())
    thread.join(timeout=5.0)
    # ar1: every rank sums the chunks flagged for destination 0; rs/ar2: rank r sums those for r.
    due = [last_due.get(0 if g.lay.kind == "ar1" else r, math.inf) for r in range(W)]
    problems = [f"rank {r} finished before rank 0's last chunk for it was published" for r, t in enumerate(ends)
                if t <= due[r]]
    err, rel = judge_outputs(g, problems)
    value = f"max {err:.1e}, worst block rel {rel:.1e}; thread publisher, {g.nch} chunks"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, max_err=err, rel=rel)


def check_timeout(rep: Report, dev: Device, dtype: torch.dtype) -> None:
    """f. timeout: rank 1 never scatters (its flags stay at the previous epoch); rank 0's reduction returns
    after about its timeout with ``err == src + 1 == 2``."""
    m, k, n = (128, 256, 256) if dev.cuda else (16, 32, 32)
    name = f"f.rs timeout W=2 {dtype_name(dtype)} {2 * m}x{k}x{n}"
    epoch = 5
    g = ScatterGroup.create(dev, Layout("rs", 2, 2 * m), k, n, dtype, num_chunks=1, stale=epoch - 1)
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    if dev.spin_guard(rep, name, reduce_grid(g), 1):
        return
    if dev.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with dev.on(g.streams[0]):
            launch_scatter(g, 0, epoch)
            start.record()
            launch_reduce(g, 0, epoch, SHORT_TIMEOUT_NS)
            end.record()
        dev.settle(g.streams, g.all_flag_words(), name)  # the kernel's own limit must end it long before this
        waited = start.elapsed_time(end) / 1e3
    else:
        launch_scatter(g, 0, epoch)
        t0 = time.perf_counter()
        with Watchdog(g.aborts[0], timeout_s):  # the interpreter's abort word stands in for %globaltimer
            launch_reduce(g, 0, epoch, SHORT_TIMEOUT_NS, watchdog=False)
        waited = time.perf_counter() - t0
    problems = []
    got = int(g.errs[0].item())
    if got != 2:
        problems.append(f"err word {got}, expected 2 (src 1 + 1)")
    if not 0.5 * timeout_s <= waited <= 10 * timeout_s:
        problems.append(f"returned after {waited:.3f} s, expected about {timeout_s} s")
    if not bool((g.flags[0][g.flag_words(0)] == epoch).all()):
        problems.append(f"rank 0's own flags {g.flags[0][g.flag_words(0)].tolist()}, expected {epoch}")
    value = f"bounded wait fired after {waited:.3f} s, err={got}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, waited_s=waited)


# ==============================================================================================
# Timings (one GPU): rank 0's call with every peer's partial already delivered
# ==============================================================================================


def time_fused_vs_torch(rep: Report, dev: Device, kind: str, label: str, world_size: int, rows: int, k: int,
                        n: int) -> None:
    """Rank 0's scatter + reduction (bf16, the op's default tiles, one chunk as on NVLink) against
    ``torch.mm`` of the same partial plus ``torch.sum`` of the ``W`` blocks it reduces."""
    dtype, epoch = torch.bfloat16, 3
    g = ScatterGroup.create(dev, Layout(kind, world_size, rows), k, n, dtype, num_chunks=1, stale=epoch - 1)
    lo, hi = g.lay.block(0)
    for p in range(1, world_size):  # the peers have delivered their partials for rank 0, and flagged them
        region = g.region(p, 0) if kind == "ar1" else g.region(0, p)
        torch.mm(g.a[p][lo:hi], g.b[p], out=region[: hi - lo])
        g.flags[p][g.lay.flag_index(0) : g.lay.flag_index(0) + g.nch] = epoch
    dev.idle("timing setup")

    def fused() -> None:
        launch_scatter(g, 0, epoch)
        launch_reduce(g, 0, epoch, KERNEL_TIMEOUT_NS)

    fused()
    dev.idle(f"time {kind} {label}")
    exact, bound = g.exact(0)
    ok, max_err, rel = compare_bound(g.outs[0], exact, bound, g.block_rtol())
    if not ok or int(g.errs[0].item()):
        rep.add(f"time fused {kind} {label}", "FAIL",
                f"wrong: max {max_err:.1e}, worst block rel {rel:.1e}, err={int(g.errs[0].item())}")
        return
    t_fused = do_bench(fused)
    t_scatter = do_bench(lambda: launch_scatter(g, 0, epoch))
    partial = torch.empty(rows, n, device=dev.device, dtype=dtype)
    received = torch.stack([g.region(p, 0) if kind == "ar1" else g.region(0, p) for p in range(world_size)])
    reduced = torch.empty(received.shape[1:], device=dev.device, dtype=dtype)

    def baseline() -> None:
        torch.mm(g.a[0], g.b[0], out=partial)
        torch.sum(received, dim=0, out=reduced)

    t_torch = do_bench(baseline)
    t_mm = do_bench(lambda: torch.mm(g.a[0], g.b[0], out=partial))
    rep.add(f"time fused {kind} {label} W={world_size} {rows}x{k}x{n}", "PASS",
            f"{t_fused:.3f} ms (scatter {t_scatter:.3f}) vs torch mm+sum {t_torch:.3f} ms (mm {t_mm:.3f})",
            tflops=matmul_tflops(rows, n, k, t_fused), ratio=t_torch / t_fused, ms=t_fused, scatter_ms=t_scatter,
            torch_ms=t_torch, mm_ms=t_mm, max_err=max_err)


# ==============================================================================================
# Entries (gpu_check_groups.GROUPS): the groups "rs" and "time_rs"
# ==============================================================================================


def run_reduce_scatter_checks(rep: Report, dev: Device) -> None:
    """Group "rs": the sections f, in order."""
    bf16 = torch.bfloat16
    if dev.cuda:
        ordered = [("rs", w, (w * 256, 512, 384), bf16, "w.t()") for w in (2, 3, 4)]
        ordered += [("rs", 4, (400, 1000, 300), bf16, "row-major"), ("rs", 2, (512, 512, 384), torch.float16, "w.t()"),
                    ("rs", 2, (512, 512, 384), torch.float32, "w.t()"),
                    ("ar2", 3, (1000, 512, 384), bf16, "w.t()"), ("ar2", 4, (130, 256, 200), bf16, "row-major"),
                    ("ar1", 2, (256, 512, 384), bf16, "w.t()"), ("ar1", 4, (100, 1000, 300), bf16, "row-major")]
        racing = [("rs", 2, (512, 512, 256)), ("rs", 4, (1024, 512, 256)), ("ar1", 4, (256, 512, 256))]
    else:  # interpreted, 32x32x32 tiles: two row tiles per block, so two chunks
        ordered = [("rs", 2, (80, 32, 24), torch.float32, "w.t()"), ("rs", 3, (72, 40, 40), bf16, "row-major"),
                   ("ar2", 3, (100, 32, 24), torch.float32, "w.t()"), ("ar1", 2, (40, 32, 24), bf16, "w.t()")]
        racing = [("rs", 2, (128, 32, 32)), ("ar1", 2, (64, 32, 32))]
    for kind, w, shape, dtype, layout in ordered:
        rep.run(f"f.{kind} ordered W={w} {dtype_name(dtype)} {'x'.join(map(str, shape))}",
                lambda a=(kind, w, shape, dtype, layout): check_ordered(rep, dev, *a))
    for kind, w, shape in racing:
        rep.run(f"f.{kind} racing W={w}", lambda a=(kind, w, shape): check_racing(rep, dev, *a, bf16 if dev.cuda
                                                                                  else torch.float32))
    rep.run("f.rs timeout", lambda: check_timeout(rep, dev, bf16 if dev.cuda else torch.float32))


def run_reduce_scatter_timings(rep: Report, dev: Device) -> None:
    """Group "time_rs": the reduce-scatter and one-shot all-reduce timings; GPU only."""
    gpu_only = None if dev.cuda else "GPU only"
    for label, s in row_parallel_shapes(8):  # W=8 virtual ranks
        rows = 8 * s["m"]
        rep.run(f"time fused rs {label}",
                lambda a=(label, rows, s["k"], s["n"]): time_fused_vs_torch(rep, dev, "rs", a[0], 8, *a[1:]),
                skip=gpu_only)
    for label, s in all_reduce_shapes(8, one_shot=True):
        rep.run(f"time fused ar1 {label}",
                lambda a=(label, s["m"], s["k"], s["n"]): time_fused_vs_torch(rep, dev, "ar1", a[0], 8, *a[1:]),
                skip=gpu_only)
