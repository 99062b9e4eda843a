"""The fused reduce-scatter kernels on virtual ranks (tp_ranks.ScatterGroup): `overlap.kernels.matmul_reduce_scatter`'s
`matmul_scatter_kernel` (each rank's GEMM partial, stored block by block into its owners' slots, each chunk
flagged) and then `reduce_chunks_kernel` (each owner sums its blocks' partials in rank order, each chunk once its
flags hold the call's epoch), as `matmul_reduce_scatter` and `matmul_all_reduce` launch them, in the three
layouts of tp_ranks (``rs``, ``ar2``, ``ar1``).

What they check, against float64 sums with a rounding bound (`tolerance.compare_bound`):

* with every scatter finished before any reduction starts, every output is right, and so is a second call on
  the same slots (fresh inputs, the next epoch: the counters the first call reset, the flags left at its epoch
  and its partials still in the slots must not pass for this call's); after each call every chunk counter is
  back at 0 and every awaited flag holds the epoch;
* with the reductions spinning before the producers come (from another stream behind a host-released gate on a
  GPU, rank 0's scatter last; from a thread playing the producers chunk by chunk on the CPU), no reduction ends
  before the last flag it needs and every output is right;
* with one rank never scattering, rank 0's reduction gives up after its timeout and names that rank in its
  error word (``src + 1``).

The racing test issues its producers before its waiters (virtual.py says why), and tests/gpu/cpu/test_gpu_check_order.py
replays every test's device work on a model of the queues: `launch_scatter`, `launch_reduce` and `signals` are
looked up here, as module globals, so that it can replace them.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from overlap.kernels.host import Watchdog, cdiv

from overlap import signals
from tests.gpu.tolerance import verdict
from tests.gpu.tp_ranks import (
    B_IDS,
    CPU,
    DTYPE_IDS,
    GPU,
    KINDS,
    Layout,
    ScatterGroup,
    check_protocol_state,
    judge_outputs,
    launch_reduce,
    launch_scatter,
    reduce_grid,
    shape_id,
    sized_for,
    sized_params,
)
from tests.gpu.virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (sized for, layout kind, world size, (rows, k, n), dtype, b layout): rows of every rank's ``a``. On a GPU a fp32
# dot is TF32 (the rounding bound allows for it). Interpreted (32x32x32 tiles) every block has two row tiles, so
# two chunks.
ORDERED = [(GPU, "rs", w, (w * 256, 512, 384), BF16, "w.t()") for w in (2, 3, 4)]
ORDERED += [(GPU, "rs", 4, (400, 1000, 300), BF16, "row-major"), (GPU, "rs", 2, (512, 512, 384), FP16, "w.t()"),
            (GPU, "rs", 2, (512, 512, 384), FP32, "w.t()"),
            (GPU, "ar2", 3, (1000, 512, 384), BF16, "w.t()"), (GPU, "ar2", 4, (130, 256, 200), BF16, "row-major"),
            (GPU, "ar1", 2, (256, 512, 384), BF16, "w.t()"), (GPU, "ar1", 4, (100, 1000, 300), BF16, "row-major")]
ORDERED += [(CPU, "rs", 2, (80, 32, 24), FP32, "w.t()"), (CPU, "rs", 3, (72, 40, 40), BF16, "row-major"),
            (CPU, "ar2", 3, (100, 32, 24), FP32, "w.t()"), (CPU, "ar1", 2, (40, 32, 24), BF16, "w.t()")]
# (sized for, layout kind, world size, (rows, k, n), dtype, b layout, runs): a scatter dim past the first (batch-first
# ``[B, W*s, h]``, the sequence on dim 1): every destination's rows are runs of ``runs = s`` rows of ``a``.
RUNS = [(GPU, "rs", 2, (512, 512, 384), BF16, "w.t()", 64), (GPU, "rs", 4, (400, 1000, 300), BF16, "row-major", 20),
        (CPU, "rs", 2, (80, 32, 24), FP32, "w.t()", 8), (CPU, "rs", 3, (72, 40, 40), FP32, "row-major", 6)]
# (sized for, layout kind, world size, (rows, k, n), dtype)
RACING = [(GPU, "rs", 2, (512, 512, 256), BF16), (GPU, "rs", 4, (1024, 512, 256), BF16),
          (GPU, "ar1", 4, (256, 512, 256), BF16), (CPU, "rs", 2, (128, 32, 32), FP32),
          (CPU, "ar1", 2, (64, 32, 32), FP32)]


def describe(kind: str, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype,
             b_layout: str | None = None, runs: int = 0) -> str:
    return (f"{kind}-W={world_size}-{DTYPE_IDS[dtype]}-{shape_id(shape)}" + (f"-{B_IDS[b_layout]}" if b_layout else "")
            + (f"-runs={runs}" if runs else ""))


# ==============================================================================================
# The checks (a test's device work, in the order tests/gpu/cpu/test_gpu_check_order.py proves)
# ==============================================================================================


def check_ordered(dev: Device, kind: str, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype,
                  b_layout: str = "w.t()", runs: int = 0, num_chunks: int = 2) -> None:
    """Scatters, settle, reductions; twice (epochs 7 and 8) on the same slots and counters (`runs`: each
    destination's rows of ``a`` in runs of that many, `Layout.rows_of`)."""
    rows, k, n = shape
    lay = Layout(kind, world_size, rows, runs)
    g = ScatterGroup.create(dev, lay, k, n, dtype, num_chunks, stale=6, b_layout=b_layout)
    what = f"{kind} ordered W={world_size} {shape_id(shape)} chunks={g.nch}" + (f" runs={runs}" if runs else "")
    problems: list[str] = []
    worst_err = worst_rel = 0.0
    for call, epoch in enumerate((7, 8)):
        if call:
            g.new_inputs(k, n)  # the slots keep the first call's partials: stale data must not be read
        for r in range(world_size):
            with dev.on(g.streams[r]):
                launch_scatter(g, r, epoch)
        dev.settle(g.streams, g.all_flag_words(), what)  # every partial and flag in place before any reduction
        for r in range(world_size):
            with dev.on(g.streams[r]):
                launch_reduce(g, r, epoch, KERNEL_TIMEOUT_NS)
        dev.settle(g.streams, g.all_flag_words(), what)
        here: list[str] = []
        err, rel = judge_outputs(g, here)
        check_protocol_state(g, epoch, here)
        problems += [f"call {call + 1}: {p}" for p in here]
        worst_err, worst_rel = max(worst_err, err), max(worst_rel, rel)
    tf32 = " (tf32)" if g.tf32 else ""
    verdict(problems, f"max {worst_err:.1e}, worst block rel {worst_rel:.1e}; 2 calls, {KINDS[kind]}{tf32}, "
                      f"{g.nch} chunks", max_err=worst_err, rel=worst_rel)


def check_racing(dev: Device, kind: str, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The reductions spin; the producers come later, rank 0's last.

    GPU: one publisher stream, issued first and held by a gate until the reductions are issued, waits 20 ms (a
    one-thread delay kernel), then runs every rank's scatter kernel (rank W-1 first); every reduction needs rank
    0's flags, so none may end before rank 0's scatter starts. The spinning reductions must co-reside and leave
    SMs for the scatters (`Device.spin_guard`). CPU: see `racing_on_cpu`."""
    rows, k, n = shape
    what = f"{kind} racing W={world_size} {shape_id(shape)}"
    epoch = 9
    g = ScatterGroup.create(dev, Layout(kind, world_size, rows), k, n, dtype, num_chunks=2, stale=epoch - 1)
    first_delay_s, gap_s = 0.02, 0.002
    if not dev.cuda:
        racing_on_cpu(g, epoch, first_delay_s, gap_s)
        return
    cells = world_size * reduce_grid(g) + 1  # + the publisher's gate or delay kernel
    dev.spin_guard(cells, world_size + 1)
    pub = dev.stream()
    dev.distinct([*g.streams, pub])  # a reduction sharing the publisher's stream would wait for itself
    dev.warm(what, lambda: warm_up(g, epoch - 1))  # both kernels loaded before any gate (`Device.warm`)
    g.poison()
    # The producers first, in host order (held by a gate until every reduction is issued), then the reductions
    # and their end events (virtual.py's docstring: no waiter in a hardware queue before its producer).
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
    dev.settle([*g.streams, pub], g.all_flag_words(), what)
    after_ms = [last_due.elapsed_time(e) for e in ends]  # > 0 unless a tile ignored a flag
    problems = [f"rank {r} finished {-t:.3f} ms before rank 0's scatter" for r, t in enumerate(after_ms) if t <= 0]
    err, rel = judge_outputs(g, problems)
    check_protocol_state(g, epoch, problems)
    verdict(problems, f"max {err:.1e}, worst block rel {rel:.1e}; ended {min(after_ms):.3f}-{max(after_ms):.3f} ms "
                      "after rank 0's scatter started", max_err=err, rel=rel)


def warm_up(g: ScatterGroup, stale: int) -> None:
    """Rank 0's scatter and reduction at the epoch the flags already hold: no wait, the kernels loaded."""
    launch_scatter(g, 0, stale)
    launch_reduce(g, 0, stale, KERNEL_TIMEOUT_NS)


def chunk_rows(g: ScatterGroup, chunk: int) -> tuple[int, int]:
    """Rows of a block that chunk `chunk` covers: row tile t is in chunk ``t * nch // tiles_m``."""
    bm = g.tile[0]
    tiles_m = cdiv(g.lay.block_rows, bm)
    first = cdiv(chunk * tiles_m, g.nch)
    last = cdiv((chunk + 1) * tiles_m, g.nch)
    return min(first * bm, g.lay.block_rows), min(last * bm, g.lay.block_rows)


def racing_on_cpu(g: ScatterGroup, epoch: int, first_delay_s: float, gap_s: float) -> None:
    """The racing check, interpreted: the scatters run first (the interpreter runs one kernel at a time), their
    partials are staged aside and the slots poisoned again; then a thread plays the producers, chunk by chunk,
    rank W-1 first: it copies a chunk's rows into each owner's slot, then publishes that chunk's flag, while the
    reductions spin. Rank 0's last chunk comes 50 ms after its others, so a tile that reads a chunk before its own
    flag reads NaN, and a reduction that ends before that flag is reported."""
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
    verdict(problems, f"max {err:.1e}, worst block rel {rel:.1e}; thread publisher, {g.nch} chunks", max_err=err,
            rel=rel)


def check_timeout(dev: Device, dtype: torch.dtype) -> None:
    """Rank 1 never scatters (its flags stay at the previous epoch); rank 0's reduction returns after about its
    timeout with ``err == src + 1 == 2``."""
    m, k, n = (128, 256, 256) if dev.cuda else (16, 32, 32)
    what = f"rs timeout W=2 {2 * m}x{k}x{n}"
    epoch = 5
    g = ScatterGroup.create(dev, Layout("rs", 2, 2 * m), k, n, dtype, num_chunks=1, stale=epoch - 1)
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    dev.spin_guard(reduce_grid(g), 1)
    if dev.cuda:
        with dev.on(g.streams[0]):
            launch_scatter(g, 0, epoch)
        took = dev.timed(g.streams[0], lambda: launch_reduce(g, 0, epoch, SHORT_TIMEOUT_NS))
        dev.settle(g.streams, g.all_flag_words(), what)  # the kernel's own limit must end it long before this
        waited = took()
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
    verdict(problems, f"bounded wait fired after {waited:.3f} s, err={got}", waited_s=waited)


# ==============================================================================================
# The tests
# ==============================================================================================


@pytest.mark.parametrize("case", sized_params(ORDERED, describe))
def test_reduction_matches_float64_sums_over_two_calls_with_every_scatter_done_first(dev, case):
    check_ordered(dev, *sized_for(dev, case))


@pytest.mark.parametrize("case", sized_params(RUNS, describe))
def test_scatter_reads_each_destination_in_runs_for_a_scatter_dim_past_the_first(dev, case):
    check_ordered(dev, *sized_for(dev, case))


@pytest.mark.parametrize("case", sized_params(RACING, describe))
def test_reduction_waits_for_chunks_scattered_while_it_spins(dev, case):
    check_racing(dev, *sized_for(dev, case))


def test_reduction_gives_up_on_a_rank_that_never_scatters_and_names_it(dev):
    check_timeout(dev, BF16 if dev.cuda else FP32)
