"""The ``symm`` strategy's GPU pipeline of `all_gather_matmul` (`_symm_cuda`), rebuilt on virtual ranks
(tp_ranks.GatherGroup) from the primitives it uses: each rank's main stream copies its shard into its symmetric
buffer and flags it; a side stream waits on each peer's flag (the ops' bounded wait, `Device.wait_flag`), copies
the peer's shard chunk by chunk into a local gathered tensor and records an event per chunk; the main stream runs
the local GEMM, then each chunk's GEMM after that chunk's event.

What it checks: every rank's output matches the float64 product and no wait timed out, while the peers really
wait (each producer starts after a delay that depends on its rank). The buffers start as NaN, so a copy that
outran its flag shows in the output. CUDA only (stream-ordered waits and events); the producers are issued first,
behind a host-released gate (virtual.py says why). tests/gpu/cpu/test_gpu_check_order.py replays its device work
(``torch.mm`` included) on a model of the queues.
"""

from __future__ import annotations

import pytest
import torch

from overlap import comm
from tests.gpu.tp_ranks import GatherGroup, judge_consumers, new_consumer
from tests.gpu.virtual import Device

pytestmark = pytest.mark.cuda


def check_symm_pipeline(dev: Device, world_size: int, shape: tuple[int, int, int], dtype: torch.dtype,
                        num_chunks: int = 2) -> None:
    """Producers first, in host order, each held by a gate: rank r's main stream (after a rank-dependent delay,
    so peers really wait) copies its shard into its buffer and flags it. Then the waiters: each side stream
    waits on each peer's flag, copies the peer's chunks into a local gathered tensor and records an event per
    chunk; each main stream runs the local GEMM, then each chunk's GEMM after that chunk's event. Then the gate
    opens. A wait that timed out shows in its error word."""
    m, k, n = shape
    what = f"symm pipeline W={world_size} {m}x{k}x{n} chunks={num_chunks}"
    dev.spin_guard(3 * world_size, 2 * world_size)  # gates, delays, side waits
    epoch = 11
    g = GatherGroup.create(dev, world_size, m, k, n, dtype, stale=epoch - 1)
    ref = g.reference()
    sides = [dev.stream() for _ in range(world_size)]
    dev.distinct([*g.streams, *sides])
    consumers = [new_consumer(g) for _ in range(world_size)]
    fulls = [torch.empty(world_size * m, k, device=dev.device, dtype=dtype) for _ in range(world_size)]
    errs = torch.zeros(world_size, dtype=torch.int32, device=dev.device)
    dev.idle(what)
    bounds = comm.chunk_bounds(m, num_chunks)

    def gemms() -> None:  # every GEMM shape the waiters run (cuBLAS picks its kernel per shape)
        scratch = torch.empty_like(consumers[0].out)
        torch.mm(g.shards[0], g.b, out=scratch[:m])
        for rows in sorted({hi - lo for lo, hi in bounds}):
            torch.mm(fulls[0][:rows], g.b, out=scratch[:rows])

    dev.warm(what, gemms)  # loaded before any gate (`Device.warm`)
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
    dev.settle([*g.streams, *sides], g.flags, what)
    timed_out = [r for r, e in enumerate(errs.tolist()) if e]
    judge_consumers(consumers, ref, problems=[f"ranks {timed_out}: a bounded wait timed out"] if timed_out else [])


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"W={w}-bf16-256x512x384-chunks=2")
def test_symm_pipeline_gathers_every_shard_once_its_flag_is_set(dev, world_size):
    check_symm_pipeline(dev, world_size, (256, 512, 384), torch.bfloat16)
