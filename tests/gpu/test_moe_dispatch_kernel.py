"""The dispatch direction of the fused MoE grouped GEMM on virtual ranks (`grouped_matmul_wait_kernel`, with
`dispatch_tile_table` and `launch_grouped_matmul_wait`, called as `moe_ranks.wait_call` and `launch_wait` call
them): every source copies its counts and rows into the receivers' slots and flags them, expert group by
expert group, and each receiver's kernel waits per block for the flag of the rows it reads.

Three ways the rows arrive: all of them flagged before the kernel starts (on several routings), copied in and
flagged while the kernels spin (the race the fused strategy runs), and one source's rows in place but never
flagged (the kernel must give up after its timeout and say which source it waited for). Received rows are
compared bitwise with the rows ``topk_idx`` names, outputs against float64, both NaN-poisoned beforehand.

`launch_wait` is looked up in this module at each call, so that tests/gpu/cpu/test_gpu_check_order.py can stand in for
it.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from overlap.kernels.host import Watchdog

from tests.gpu.moe_ranks import (
    Config,
    MoEGroup,
    WaitCall,
    expert_mm64,
    expert_weights,
    launch_wait,
    ordered_cases,
    ordered_config,
    racing_config,
    staged_rows,
    timeout_config,
    wait_call,
    write_counts,
    write_rows,
)
from tests.gpu.tolerance import compare, err_text, verdict
from tests.gpu.virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device

# ==============================================================================================
# The receivers' results
# ==============================================================================================


def judge_wait(g: MoEGroup, c: WaitCall, problems: list[str], expect_err: int = 0,
               only_source: int | None = None) -> tuple[float, float]:
    """Rank c.rank's received rows (bitwise) and outputs (float64) against the rows ``topk_idx`` names;
    with `only_source`, only the rows of that source. Returns (max error, relative error)."""
    src, pair, experts = g.expert_rows(c.rank)
    got_err = int(c.err.item())
    if got_err != expect_err:
        problems.append(f"rank {c.rank}: err word {got_err}, expected {expect_err}")
    if src.numel() != c.recv.shape[0]:
        problems.append(f"rank {c.rank}: {c.recv.shape[0]} rows laid out, topk_idx names {src.numel()}")
        return math.inf, math.inf
    if not src.numel():
        return 0.0, 0.0
    want = g.gather(g.xs, src, pair, by_token=True)
    ref = expert_mm64(want, c.w, experts)
    keep = (src == only_source).to(want.device) if only_source is not None else slice(None)
    if not torch.equal(c.recv[keep], want[keep]):
        bad = int((c.recv[keep] != want[keep]).any(dim=1).sum())
        problems.append(f"rank {c.rank}: {bad} received rows differ from the rows topk_idx names")
    ok, max_err, rel = compare(c.out[keep], ref[keep])
    if not ok:
        max_err, rel = (max_err, rel) if math.isfinite(max_err) else (math.inf, math.inf)
        problems.append(f"rank {c.rank}: output off ({err_text(max_err, rel)})")
    return max_err, rel


def needs_rank0(g: MoEGroup, r: int) -> bool:
    return sum(g.routes[r].recv_counts[0]) > 0


# ==============================================================================================
# The checks
# ==============================================================================================


def check_dispatch_ordered(dev: Device, cfg: Config) -> None:
    """Every source's counts and rows written and flagged; then every receiver reads its header, builds its tile
    table from it and runs."""
    what = f"MoE dispatch, rows flagged first, {cfg.describe()}"
    epoch = 7
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    W = cfg.world_size
    for s in range(W):
        write_counts(g, s, epoch)
        for i in range(W):  # own rows first, then peers from s + 1 (as the ops' producers)
            write_rows(g, s, (s + i) % W, epoch)
    dev.settle(g.streams, [*g.dispatch_flags(), *[g.flag(s, d * g.flags_per_peer) for s in range(W) for d in range(W)]],
               what)
    problems: list[str] = []
    for r in range(W):  # the counts as a receiver reads them: this call's tile tables come from them
        got = g.header(r).tolist()
        if got != g.routes[r].recv_counts:
            problems.append(f"rank {r}: header {got}, the senders sent {g.routes[r].recv_counts}")
        g.routes[r].recv_counts = got
    if problems:
        raise AssertionError("; ".join(problems))
    calls = [wait_call(g, r, expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)) for r in range(W)]
    dev.idle(what)  # the poisoned outputs are in place before any launch
    for c in calls:
        with dev.on(g.streams[c.rank]):
            launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS)
    dev.settle(g.streams, g.dispatch_flags(), what)
    worst = [judge_wait(g, c, problems) for c in calls]
    max_err, rel = max(e for e, _ in worst), max(r for _, r in worst)
    rows = [c.recv.shape[0] for c in calls]
    verdict(problems, f"{cfg.describe()}: {err_text(max_err, rel)}; rows per rank {rows}", max_err=max_err, rel=rel)


def check_dispatch_racing(dev: Device, cfg: Config) -> None:
    """The wait kernels spin; the rows are copied in and flagged later, rank 0's last (GPU: the copies are issued
    first, held by a gate until the wait kernels are issued; CPU: a thread copies them)."""
    what = f"MoE dispatch racing {cfg.describe()}"
    epoch, W = 9, cfg.world_size
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    calls = [wait_call(g, r, expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)) for r in range(W)]
    staged = [[staged_rows(g, s, d) for d in range(W)] for s in range(W)]
    dev.idle(what)
    first_delay_s, gap_s = 0.02, 0.002
    problems: list[str] = []
    if not dev.cuda:
        last_due = [math.inf]  # when rank 0's rows started to be written

        def publisher() -> None:
            time.sleep(first_delay_s)
            for s in reversed(range(W)):
                time.sleep(gap_s)
                if s == 0:
                    last_due[0] = time.perf_counter()
                for d in range(W):
                    write_rows(g, s, d, epoch, staged=staged[s][d])

        thread = threading.Thread(target=publisher, daemon=True)
        abort = calls[0].abort  # one abort word: the watchdog bounds every interpreted spin
        ends = []
        with Watchdog(abort, 10.0):
            thread.start()
            for c in calls:
                c.abort = abort
                launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS, watchdog=False)
                ends.append(time.perf_counter())
        thread.join(timeout=5.0)
        problems += [f"rank {r} finished before rank 0's rows were written" for r, t in enumerate(ends)
                     if needs_rank0(g, r) and calls[r].runs and t <= last_due[0]]
        timing = "thread publisher"
        after = []
    else:
        cells = sum(c.grid for c in calls) + 1  # + the publisher's gate or delay kernel
        dev.spin_guard(cells, W + 1)
        pub = dev.stream()
        dev.distinct([*g.streams, pub])
        runs = next((c for c in calls if c.runs), None)  # the kernel loaded before any gate (`Device.warm`)
        if runs is not None:  # (on the stale flags it waits for nothing; its own scratch outputs)
            dev.warm(what, lambda: launch_wait(g, wait_call(g, runs.rank, runs.w), epoch - 1, KERNEL_TIMEOUT_NS))
        # The copies first, in host order (held by a gate until every wait kernel is issued), then the wait
        # kernels and their end events (tests/gpu/virtual.py says why).
        gate = dev.gate()
        gate.hold(pub)
        last_due = torch.cuda.Event(enable_timing=True)  # before rank 0's first copy
        dev.delay(pub, int(first_delay_s * 1e9))
        for i, s in enumerate(reversed(range(W))):
            if i:
                dev.delay(pub, int(gap_s * 1e9))
            if s == 0:
                last_due.record(pub)
            for d in range(W):  # plain copies (memcpy, no SM needed) and stream-ordered flag writes
                write_rows(g, s, d, epoch, staged=staged[s][d], stream=pub)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(W)]
        for c in calls:
            with dev.on(g.streams[c.rank]):
                launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS)
                ends[c.rank].record()
        gate.open()
        dev.settle([*g.streams, pub], g.dispatch_flags(), what)
        after = [last_due.elapsed_time(ends[r]) for r in range(W) if needs_rank0(g, r) and calls[r].runs]
        problems += [f"a receiver finished {-t:.3f} ms before rank 0's rows were written" for t in after if t <= 0]
        timing = f"ended {min(after):.3f}-{max(after):.3f} ms after rank 0's rows were due" if after else ""
    worst = [judge_wait(g, c, problems) for c in calls]
    max_err, rel = max(e for e, _ in worst), max(r for _, r in worst)
    figures = {"min_after_ms": min(after), "max_after_ms": max(after)} if after else {}
    verdict(problems, f"{cfg.describe()}: {err_text(max_err, rel)}; {timing}", max_err=max_err, rel=rel, **figures)


def check_dispatch_timeout(dev: Device, cfg: Config) -> None:
    """Rank 1's rows are in rank 0's slot but never flagged: rank 0's kernel returns after about its timeout with
    ``err == src + 1 == 2``; the rows from rank 0 itself are right."""
    what = f"MoE dispatch timeout {cfg.describe()}"
    epoch = 5
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    c = wait_call(g, 0, expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device))
    write_rows(g, 0, 0, epoch)
    write_rows(g, 1, 0, None)
    dev.idle(what)
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    dev.spin_guard(c.grid, 1)
    if dev.cuda:
        took = dev.timed(g.streams[0], lambda: launch_wait(g, c, epoch, SHORT_TIMEOUT_NS))
        dev.settle(g.streams, g.dispatch_flags(), what)  # the kernel's own limit must end it long before this deadline
        waited = took()
    else:
        t0 = time.perf_counter()
        with Watchdog(c.abort, timeout_s):  # the interpreter's abort word stands in for %globaltimer
            launch_wait(g, c, epoch, SHORT_TIMEOUT_NS, watchdog=False)
        waited = time.perf_counter() - t0
    problems: list[str] = []
    if not sum(g.routes[0].recv_counts[1]) or not sum(g.routes[0].recv_counts[0]):
        problems.append(f"the routing sends rank 0 no rows from rank 0 or 1: {g.routes[0].recv_counts}")
    if not 0.5 * timeout_s <= waited <= 10 * timeout_s:
        problems.append(f"returned after {waited:.3f} s, expected about {timeout_s} s")
    judge_wait(g, c, problems, expect_err=2, only_source=0)
    verdict(problems, f"{cfg.describe()}: bounded wait fired after {waited:.3f} s, err={int(c.err.item())}",
            waited_s=waited)


# ==============================================================================================
# The tests
# ==============================================================================================


@pytest.mark.parametrize("case", ordered_cases())
def test_dispatch_kernel_matches_float64_with_every_block_flagged_first(dev, case):
    check_dispatch_ordered(dev, ordered_config(dev, case))


def test_dispatch_kernel_waits_for_rows_copied_in_while_it_spins(dev):
    check_dispatch_racing(dev, racing_config(dev))


def test_dispatch_kernel_times_out_on_a_block_never_flagged_and_names_its_source(dev):
    check_dispatch_timeout(dev, timeout_config(dev))
