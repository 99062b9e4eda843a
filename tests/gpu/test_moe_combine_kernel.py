"""The combine direction of the fused MoE grouped GEMM on virtual ranks (`grouped_matmul_scatter_kernel`, with
`combine_tile_table` and `launch_grouped_matmul_scatter`, called as `moe_ranks.scatter_call` and `launch_scatter`
call them): each expert rank's kernel multiplies its rows by their experts' weights and stores the results into
the sources' regions, releasing each expert group's flag in its own pad once the group's last tile is stored; the
sources then collect their rows.

Two calls on the same slots with the flags and results checked after each (the flags of the groups with rows at the
call's epoch, every other flag untouched, the kernel's flag counters back at 0: what a second call relies on), and
the race the fused strategy runs: the sources wait on the flags while the scatter kernels run later. Each source's
rows, back in pair order, are compared against float64 ``y_pair @ w2[expert of the pair]``.

`launch_scatter` and `signals` are looked up in this module at each call, so that tests/gpu/cpu/test_gpu_check_order.py
can stand in for them.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest
import torch
from overlap.kernels import slots

from overlap import signals
from tests.gpu.moe_ranks import (
    Config,
    MoEGroup,
    ScatterCall,
    expert_weights,
    launch_scatter,
    ordered_cases,
    ordered_config,
    racing_config,
    scatter_call,
)
from tests.gpu.tolerance import compare, err_text, verdict
from tests.gpu.virtual import Device

# ==============================================================================================
# Inputs, the sources' collection, the judges
# ==============================================================================================


@dataclasses.dataclass
class CombineInputs:
    y_pairs: list[torch.Tensor]  # [P_s, F]: what each source's pair p comes back as, before w2
    w2: list[torch.Tensor]  # [L, F, H] each expert rank's weights
    calls: list[ScatterCall]


def combine_inputs(g: MoEGroup) -> CombineInputs:
    """Fresh rows and weights; each expert rank's rows in expert order straight from ``topk_idx``."""
    d, cfg = g.dev.device, g.cfg
    y_pairs = [torch.randn(t.numel(), cfg.ffn, device=d).to(cfg.dtype) for t in g.topk]
    w2 = [expert_weights(cfg, cfg.ffn, cfg.hidden, d) for _ in range(g.world_size)]
    calls = []
    for r in range(g.world_size):
        src, pair, _ = g.expert_rows(r)
        y = g.gather(y_pairs, src, pair, by_token=False)
        calls.append(scatter_call(g, r, y, w2[r]))
    return CombineInputs(y_pairs, w2, calls)


def collect(g: MoEGroup, s: int, into: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
    """The copies at source `s`: rank d's results for our rows, region d of our slot, in send order."""
    h = g.routes[s]
    with g.dev.on(stream):
        for i in range(g.world_size):
            d = (s - i) % g.world_size
            n = h.send_splits[d]
            if n:
                into[h.send_offsets[d] : h.send_offsets[d] + n].copy_(g.region(s, d)[:n])


def judge_combine(g: MoEGroup, ci: CombineInputs, backs: list[torch.Tensor],
                  problems: list[str]) -> tuple[float, float]:
    """Each source's rows (back in pair order) against float64 ``y_pair @ w2[expert of the pair]``; every rank's
    counters at 0."""
    worst_err = worst_rel = 0.0
    L = g.cfg.num_local_experts
    for s, back in enumerate(backs):
        if not back.shape[0]:
            continue
        flat = g.topk[s].flatten()
        got = back.index_select(0, g.routes[s].inv_order)
        want = torch.empty((back.shape[0], g.cfg.hidden), dtype=torch.float64, device=back.device)
        for ex in flat.unique().tolist():
            mask = flat == ex
            want[mask] = ci.y_pairs[s][mask].double() @ ci.w2[ex // L][ex % L].double()
        ok, max_err, rel = compare(got, want)
        if not ok:
            max_err, rel = (max_err, rel) if math.isfinite(max_err) else (math.inf, math.inf)
            problems.append(f"source {s}: rows off ({err_text(max_err, rel)})")
        worst_err, worst_rel = max(worst_err, max_err), max(worst_rel, rel)
    for r in range(g.world_size):
        if int(g.counters[r].abs().sum()):
            problems.append(f"rank {r}: flag counters not reset: {g.counters[r].nonzero().flatten().tolist()}")
    return worst_err, worst_rel


def check_combine_flags(g: MoEGroup, epoch: int, stale: int, problems: list[str]) -> None:
    """Every flag of an expert group with rows at `epoch` in its expert rank's pad; every other word `stale`."""
    F = g.flags_per_peer
    for d in range(g.world_size):
        want = torch.full_like(g.pads[d], stale)
        for s in range(g.world_size):
            want[g.group_flags(s, d, s * F)] = epoch  # d's results for source s
        if not torch.equal(g.pads[d], want):
            bad = (g.pads[d] != want).nonzero().flatten()
            first = bad[:6].tolist()
            problems.append(f"rank {d}: {bad.numel()} flags off, e.g. {first} are {g.pads[d][first].tolist()}, "
                            f"expected {want[first].tolist()}")


# ==============================================================================================
# The checks
# ==============================================================================================


def check_combine_ordered(dev: Device, cfg: Config) -> None:
    """Every expert rank's scatter kernel, then every source collects its rows; twice on the same slots (epochs 7
    and 8: fresh inputs, the regions keep the first call's results)."""
    what = f"MoE combine ordered {cfg.describe()}"
    g = MoEGroup.create(dev, cfg, stale=6)
    problems: list[str] = []
    worst_err = worst_rel = 0.0
    for call, epoch in enumerate((7, 8)):
        ci = combine_inputs(g)
        dev.idle(what)
        for c in ci.calls:
            with dev.on(g.streams[c.rank]):
                launch_scatter(g, c, epoch)
        dev.settle(g.streams, g.combine_flags(), what)
        backs = [torch.full((t.numel(), cfg.hidden), math.nan, device=dev.device, dtype=cfg.dtype) for t in g.topk]
        for s in range(cfg.world_size):
            collect(g, s, backs[s])
        here: list[str] = []
        err, rel = judge_combine(g, ci, backs, here)
        check_combine_flags(g, epoch, 6, here)
        problems += [f"call {call + 1}: {p}" for p in here]
        worst_err, worst_rel = max(worst_err, err), max(worst_rel, rel)
    verdict(problems, f"{cfg.describe()}: {err_text(worst_err, worst_rel)}; 2 calls, flags at the epoch, counters at 0",
            max_err=worst_err, rel=worst_rel)


def check_combine_racing(dev: Device, cfg: Config) -> None:
    """The sources wait and copy; the scatter kernels run 20 ms later, rank W-1 first, rank 0 last (GPU: the
    scatters are issued first, held by a gate until the sources' bounded waits are issued; CPU: host waits in
    threads)."""
    what = f"MoE combine racing {cfg.describe()}"
    epoch, stale, W, F = 9, 8, cfg.world_size, slots.flags_per_peer(cfg.world_size)
    g = MoEGroup.create(dev, cfg, stale=stale)
    ci = combine_inputs(g)
    backs = [torch.full((t.numel(), cfg.hidden), math.nan, device=dev.device, dtype=cfg.dtype) for t in g.topk]
    errs = torch.zeros(W, dtype=torch.int32, device=dev.device)
    dev.idle(what)
    first_delay_s, gap_s = 0.02, 0.002
    needs0 = [bool(g.routes[s].send_splits[0]) for s in range(W)]
    problems: list[str] = []
    after: list[float] = []
    if not dev.cuda:
        ends, failed, last_due = [math.inf] * W, [], math.inf

        def source(s: int) -> None:  # a CPU source: host waits, then the copies
            for i in range(W):
                d = (s - i) % W
                for index in g.group_flags(s, d, s * F):
                    if not signals.signal_wait(g.flag(d, index).data_ptr(), epoch, 10.0):
                        failed.append(f"source {s}: flag {index} of rank {d} never reached {epoch}")
            collect(g, s, backs[s])
            ends[s] = time.perf_counter()

        threads = [threading.Thread(target=source, args=(s,), daemon=True) for s in range(W)]
        for t in threads:
            t.start()
        time.sleep(first_delay_s)
        for d in reversed(range(W)):
            time.sleep(gap_s)
            if d == 0:
                last_due = time.perf_counter()
            launch_scatter(g, ci.calls[d], epoch)
        for t in threads:
            t.join(timeout=15.0)
        problems += failed + [f"source {s} finished before rank 0's scatter started" for s in range(W)
                              if needs0[s] and ends[s] <= last_due]
        timing = "host waits in threads"
    else:
        dev.spin_guard(W + 1, W + 1)  # a wait per source at a time + the publisher's delay
        pub = dev.stream()
        dev.distinct([*g.streams, pub])
        # the kernel loaded before any gate (`Device.warm`), at the stale epoch; the regions it wrote poisoned again
        dev.warm(what, lambda: launch_scatter(g, ci.calls[0], stale))
        g.poison_regions()
        # The scatter kernels first, in host order (held by a gate until every source's waits are issued), then
        # the sources' bounded waits, copies and end events (tests/gpu/virtual.py says why).
        gate = dev.gate()
        gate.hold(pub)
        last_due = torch.cuda.Event(enable_timing=True)
        dev.delay(pub, int(first_delay_s * 1e9))
        with dev.on(pub):
            for i, d in enumerate(reversed(range(W))):
                if i:
                    dev.delay(pub, int(gap_s * 1e9))
                if d == 0:
                    last_due.record(pub)
                launch_scatter(g, ci.calls[d], epoch)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(W)]
        for s in range(W):  # a GPU source: the ops' bounded stream-ordered waits, then the copies
            stream = g.streams[s]
            for i in range(W):
                d = (s - i) % W
                for index in g.group_flags(s, d, s * F):
                    dev.wait_flag(g.flag(d, index), epoch, stream, errs[s : s + 1])
            collect(g, s, backs[s], stream)
            ends[s].record(stream)
        gate.open()
        dev.settle([*g.streams, pub], g.combine_flags(), what)
        after = [last_due.elapsed_time(ends[s]) for s in range(W) if needs0[s]]
        problems += [f"a source finished {-t:.3f} ms before rank 0's scatter started" for t in after if t <= 0]
        if int(errs.abs().sum()):
            problems.append(f"bounded waits timed out: {errs.tolist()}")
        timing = f"sources ended {min(after):.3f}-{max(after):.3f} ms after rank 0's scatter started" if after else ""
    err, rel = judge_combine(g, ci, backs, problems)
    check_combine_flags(g, epoch, stale, problems)
    figures = {"min_after_ms": min(after), "max_after_ms": max(after)} if after else {}
    verdict(problems, f"{cfg.describe()}: {err_text(err, rel)}; {timing}", max_err=err, rel=rel, **figures)


# ==============================================================================================
# The tests
# ==============================================================================================


@pytest.mark.parametrize("case", ordered_cases())
def test_combine_kernel_stores_into_the_sources_regions_twice_on_the_same_slots(dev, case):
    check_combine_ordered(dev, ordered_config(dev, case))


def test_sources_collect_the_combine_kernels_rows_as_their_flags_arrive(dev):
    check_combine_racing(dev, racing_config(dev))
