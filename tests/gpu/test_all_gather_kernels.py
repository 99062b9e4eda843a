"""The fused all-gather GEMM kernels on virtual ranks (tp_ranks.GatherGroup): `overlap.kernels.all_gather_matmul`
(`all_gather_matmul`'s fused strategy: every rank's kernel multiplies every rank's shard of ``a`` by ``b``, each
shard's tiles once that shard's ready flag holds the call's epoch) and the weight-side
`overlap.kernels.all_gather_weight_matmul` (`all_gather_weight_matmul`'s fused strategy: the shards are rows of
the weight).

What they check: with every shard copied and flagged before any kernel starts, every rank's output matches the
float64 product (for both layouts of ``b``, shapes that are and are not multiples of the tiles); with the flags
published while the kernels already spin (from another stream behind a host-released gate on a GPU, from a
thread on the CPU), no rank ends before the last flag and every output is right; with one shard never flagged,
the kernel gives up after its timeout, names that shard in its error word (``src + 1``) and still computes the
rows it had.

The flags start at the previous call's epoch, so a kernel that took a stale flag for this call's would read the
NaN the buffers start as. The racing test issues its publisher before its consumers (virtual.py says why), and
tests/gpu/cpu/test_gpu_check_order.py replays every test's device work on a model of the queues: `launch_gather` and
`launch_weight_gather` are looked up here, as module globals, so that it can replace them.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from overlap.kernels.all_gather_weight_matmul import launch_all_gather_weight_matmul
from overlap.kernels.host import Watchdog

from tests.gpu.tolerance import compare, err_text, verdict
from tests.gpu.tp_ranks import (
    B_IDS,
    CPU,
    DTYPE_IDS,
    GPU,
    Consumer,
    GatherGroup,
    gather_grid,
    judge_consumers,
    launch_gather,
    new_consumer,
    shape_id,
    sized_for,
    sized_params,
)
from tests.gpu.virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device, Tile

BF16, FP32 = torch.bfloat16, torch.float32

# (sized for, world size, (m, k, n), dtype, b layout): m rows per rank. On a GPU bf16 only (a fp32 dot is TF32
# there, outside fp32's tolerance); the second shape of each is no multiple of the tiles.
ORDERED = [(GPU, w, shape, BF16, layout) for w in (2, 4)
           for shape, layout in (((256, 1024, 512), "w.t()"), ((100, 1000, 300), "row-major"))]
ORDERED += [(CPU, w, shape, dtype, layout) for dtype in (FP32, BF16) for w in (2, 4)
            for shape, layout in (((16, 32, 24), "w.t()"), ((24, 40, 64), "row-major"))]
# (sized for, world size, (m, k, n), dtype, b layout, runs): a gather dim past the first (batch-first ``[B, s, h]``,
# the sequence on dim 1): each shard lands in runs of ``runs = s`` rows, ``m / runs`` of them (the second of each is
# no multiple of the tiles, its runs cut through row tiles).
RUNS = [(GPU, 2, (256, 1024, 512), BF16, "w.t()", 64), (GPU, 4, (100, 1000, 300), BF16, "row-major", 25),
        (CPU, 2, (24, 40, 64), FP32, "w.t()", 8), (CPU, 3, (15, 32, 24), FP32, "row-major", 5)]
# (sized for, world size, (m, k, n), dtype): the weight-side kernel's shards are n rows of the weight each.
WEIGHT_ORDERED = [(GPU, w, (256, 1024, 384), BF16) for w in (2, 4)] + [(CPU, 2, (20, 32, 24), FP32),
                                                                         (CPU, 4, (20, 32, 24), FP32)]
# (sized for, world size, (m, k, n), dtype): the racing tests (one interpreted run takes seconds: W=2 alone).
RACING = [(GPU, 2, (128, 512, 256), BF16), (GPU, 4, (128, 512, 256), BF16), (CPU, 2, (16, 32, 32), FP32)]


def describe(world_size: int, shape: tuple[int, int, int], dtype: torch.dtype, b_layout: str | None = None,
             runs: int = 0) -> str:
    return (f"W={world_size}-{DTYPE_IDS[dtype]}-{shape_id(shape)}" + (f"-{B_IDS[b_layout]}" if b_layout else "")
            + (f"-runs={runs}" if runs else ""))


# ==============================================================================================
# The checks (a test's device work, in the order tests/gpu/cpu/test_gpu_check_order.py proves)
# ==============================================================================================


def check_ordered(dev: Device, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype,
                  b_layout: str, runs: int = 0) -> None:
    """Every shard copied and flagged before any consumer launches; each rank's output against float64 (`runs`:
    the shards interleaved in runs of that many rows, `GatherGroup.reference`)."""
    m, k, n = shape
    what = f"all-gather ordered W={world_size} {shape_id(shape)}" + (f" runs={runs}" if runs else "")
    epoch = 7
    g = GatherGroup.create(dev, world_size, m, k, n, dtype, stale=epoch - 1, b_layout=b_layout, runs=runs)
    ref = g.reference()
    consumers = [new_consumer(g) for _ in range(world_size)]
    for r in range(world_size):
        g.produce(r, epoch)
    dev.settle(g.streams, g.flags, what)  # the flags and the poisoned outputs are in place before any launch
    for r, c in enumerate(consumers):
        with dev.on(g.streams[r]):
            launch_gather(g, r, c, epoch, KERNEL_TIMEOUT_NS, dev.tile)
    dev.settle(g.streams, g.flags, what)
    judge_consumers(consumers, ref)


def check_weight_ordered(dev: Device, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The weight-side kernel: every shard (``[n, k]``, rows of the weight) copied and flagged before any consumer
    launches; each rank's ``a @ cat(shards).T`` against float64 (one ``a`` for every virtual rank)."""
    m, k, n = shape
    what = f"weight all-gather ordered W={world_size} {shape_id(shape)}"
    epoch, d = 7, dev.device
    g = GatherGroup.create(dev, world_size, n, k, 16, dtype, stale=epoch - 1)  # its shards: n rows each
    a = torch.randn(m, k, device=d, dtype=dtype)
    ref = a.double() @ torch.cat(g.shards).double().t()
    consumers = [Consumer(torch.full((m, world_size * n), math.nan, device=d, dtype=dtype),
                          torch.zeros(1, dtype=torch.int32, device=d), torch.zeros(1, dtype=torch.int32, device=d))
                 for _ in range(world_size)]
    for r in range(world_size):
        g.produce(r, epoch)
    dev.settle(g.streams, g.flags, what)
    for r, c in enumerate(consumers):
        with dev.on(g.streams[r]):
            launch_weight_gather(g, r, c, a, epoch, KERNEL_TIMEOUT_NS, dev.tile)
    dev.settle(g.streams, g.flags, what)
    judge_consumers(consumers, ref)


def launch_weight_gather(g: GatherGroup, rank: int, c: Consumer, a: torch.Tensor, epoch: int, timeout_ns: int,
                         tile: Tile) -> None:
    """Virtual rank `rank`'s weight-side kernel on the current stream, through the launcher the op calls (its
    shards: the group's, rows of the weight)."""
    launch_all_gather_weight_matmul(a, g.ptr_table, g.flag_table, n=g.shards[0].shape[0],
                                    epoch=g.epochs(epoch), rank=rank, err=c.err, timeout_ns=timeout_ns,
                                    block=(tile.block_m, tile.block_n, tile.block_k), out=c.out, abort=c.abort,
                                    watchdog=False, num_warps=tile.num_warps, num_stages=tile.num_stages)


def check_racing(dev: Device, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Consumers spin; the flags come later from another stream (a thread on the CPU), rank 0's last.

    The data is in place beforehand, so only the flags gate the tiles. On a GPU the publisher needs no SM (stream
    memory ops, plus one-thread gate and delay kernels); all consumer CTAs must co-reside, or a spinning grid could
    keep the others from starting (`Device.spin_guard`).
    """
    m, k, n = shape
    what = f"all-gather racing W={world_size} {shape_id(shape)}"
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
        judge_consumers(consumers, ref, problems=early, note="thread publisher")
        return
    cells = world_size * gather_grid(g, dev.tile) + 1  # + the publisher's gate or delay kernel
    dev.spin_guard(cells, world_size + 1)
    pub = dev.stream()
    dev.distinct([*g.streams, pub])  # a consumer sharing the publisher's stream would wait for itself
    # the kernel loaded before any gate (`Device.warm`): on the stale flags it waits for nothing
    dev.warm(what, lambda: launch_gather(g, 0, new_consumer(g), epoch - 1, KERNEL_TIMEOUT_NS, dev.tile))
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
    dev.settle([*g.streams, pub], g.flags, what)
    after_ms = [last_due.elapsed_time(e) for e in ends]  # > 0 unless a tile ignored its flag
    early = [f"rank {r} finished {-t:.3f} ms before the last flag" for r, t in enumerate(after_ms) if t <= 0]
    judge_consumers(consumers, ref, problems=early,
                    note=f"ended {min(after_ms):.3f}-{max(after_ms):.3f} ms after the last flag was due")


def check_timeout(dev: Device, dtype: torch.dtype) -> None:
    """Rank 1 never flags its shard: rank 0's kernel returns after about its timeout with err == src + 1 == 2."""
    m, k, n = (64, 256, 128) if dev.cuda else (16, 32, 32)
    what = "all-gather timeout W=2"
    epoch = 5
    g = GatherGroup.create(dev, 2, m, k, n, dtype, stale=epoch - 1)
    ref = g.reference()
    c = new_consumer(g)
    g.fill_buffers()
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    dev.spin_guard(gather_grid(g, dev.tile), 1)
    if dev.cuda:
        dev.publish(g.flags[0], epoch, g.streams[0])
        took = dev.timed(g.streams[0], lambda: launch_gather(g, 0, c, epoch, SHORT_TIMEOUT_NS, dev.tile))
        dev.settle(g.streams, g.flags, what)  # the kernel's own limit must end it long before this deadline
        waited = took()
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
    ok, max_err, rel = compare(c.out[:m], ref[:m])  # its own shard needed no peer
    if not ok:
        problems.append(f"own rows off ({err_text(max_err, rel)})")
    verdict(problems, f"bounded wait fired after {waited:.3f} s, err={int(c.err.item())}", waited_s=waited)


# ==============================================================================================
# The tests
# ==============================================================================================


@pytest.mark.parametrize("case", sized_params(ORDERED, describe))
def test_all_gather_kernel_matches_float64_with_every_shard_flagged_first(dev, case):
    check_ordered(dev, *sized_for(dev, case))


@pytest.mark.parametrize("case", sized_params(RUNS, describe))
def test_all_gather_kernel_lands_each_shard_in_runs_for_a_gather_dim_past_the_first(dev, case):
    check_ordered(dev, *sized_for(dev, case))


@pytest.mark.parametrize("case", sized_params(WEIGHT_ORDERED, describe))
def test_weight_gather_kernel_matches_float64_with_every_shard_flagged_first(dev, case):
    check_weight_ordered(dev, *sized_for(dev, case))


@pytest.mark.parametrize("case", sized_params(RACING, describe))
def test_all_gather_kernel_waits_for_flags_published_while_it_spins(dev, case):
    check_racing(dev, *sized_for(dev, case))


def test_all_gather_kernel_gives_up_on_a_shard_never_flagged_and_names_it(dev):
    check_timeout(dev, BF16 if dev.cuda else FP32)
