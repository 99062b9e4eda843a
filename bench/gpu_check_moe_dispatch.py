"""The dispatch direction of the MoE GPU check (`gpu_check_moe`): the producers' copies of counts and rows
(`_produced`) and the receivers' wait kernel (`grouped_matmul_wait_kernel`, launched with the arguments of
`dispatch_grouped_matmul`'s fused strategy, `_consume_fused`); checks g ordered, racing (rows copied in and
flagged later from another stream) and timeout (a block never flagged).

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import torch
from gpu_check_common import Report, compare, err_text
from gpu_check_device import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device, Tile
from gpu_check_moe_group import Config, MoEGroup, expert_mm64, expert_weights, op_tile, shared_queues, staged_rows
from overlap.kernels import Watchdog, grouped_matmul_grid, launch_grouped_matmul_wait

from overlap.ops import moe_layout as layout

# ==============================================================================================
# The dispatch direction: producers' copies, the wait kernel (`_consume_fused`)
# ==============================================================================================


def write_counts(g: MoEGroup, s: int, epoch: int) -> None:
    """Source `s`'s counts into row `s` of every rank's header, each flagged (`_produced`)."""
    W, F = g.world_size, g.flags_per_peer
    with g.dev.on(g.streams[s]):
        mine = torch.tensor(g.handles[s].send_counts, dtype=torch.int32, device=g.dev.device)
        for i in range(W):
            d = (s + i) % W
            g.header(d)[s].copy_(mine[d])
            g.dev.publish(g.flag(s, d * F), epoch, g.streams[s])


def write_rows(g: MoEGroup, s: int, d: int, epoch: int | None, staged: torch.Tensor | None = None,
               stream: torch.cuda.Stream | None = None) -> None:
    """Source `s`'s rows for `d` into region `s` of `d`'s slot, expert group by group, each flagged after its
    rows (`_produced.write`; no flag with `epoch` None). From `staged` (the rows in send order, contiguous:
    a plain copy, which a GPU runs as a memcpy) or gathered from the tokens with ``index_select`` as the op does."""
    h, L, F, G = g.handles[s], g.cfg.num_local_experts, g.flags_per_peer, g.num_groups
    stream = g.streams[s] if stream is None else stream
    region, base = g.region(d, s), h.send_offsets[d]
    with g.dev.on(stream):
        for gi in range(G):
            experts = layout.group_experts(gi, L, G)
            lo, hi = h.within_dest(d, experts.start), h.within_dest(d, experts.stop)
            if hi <= lo:
                continue
            if staged is not None:
                region[lo:hi].copy_(staged[lo:hi])
            else:
                torch.index_select(g.xs[s], 0, h.token_of[base + lo : base + hi], out=region[lo:hi])
            if epoch is not None:
                g.dev.publish(g.flag(s, d * F + 1 + gi), epoch, stream)


@dataclasses.dataclass
class WaitCall:
    """One receiver's wait kernel: its tiles, tables, NaN-poisoned outputs and error words."""

    rank: int
    w: torch.Tensor  # [L, H, F], any strides
    tile: Tile | None  # None: the op's default tiles and launch options; else a timing variant
    blocks: tuple[int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K: the table and the grid are built for them
    src_table: torch.Tensor  # int64 [W]: the regions of this rank's slot, as `heap.region_table`
    table: torch.Tensor  # int32 [tiles, 6] (no rows: [0, 6], nothing launched)
    grid: int
    out: torch.Tensor  # [R, F]
    recv: torch.Tensor  # [R, H]
    err: torch.Tensor  # int32 [1]
    abort: torch.Tensor  # int32 [1]; the error word itself on GPUs, as the op passes it

    @property
    def runs(self) -> bool:
        return bool(self.table.shape[0])


def wait_call(g: MoEGroup, r: int, w: torch.Tensor, tile: Tile | None = None) -> WaitCall:
    """Rank `r`'s call: the op's own tile table (`layout.dispatch_tile_table`) from ``h.recv_counts``."""
    d, W, L = g.dev.device, g.world_size, g.cfg.num_local_experts
    h, dtype = g.handles[r], g.cfg.dtype
    blocks = op_tile(g.dev, dtype) if tile is None else (tile.block_m, tile.block_n, tile.block_k)
    bm, bn, _ = blocks
    table = layout.dispatch_tile_table(h, r, bm, d)
    hb = layout.header_bytes(W, L)
    src = [g.bufs[r].data_ptr() + hb + s * g.stride for s in range(W)] if g.bufs[r] is not None else [0] * W
    err = torch.zeros(1, dtype=torch.int32, device=d)
    return WaitCall(r, w, tile, blocks, torch.tensor(src, dtype=torch.int64, device=d), table,
                    grouped_matmul_grid(table.shape[0], w.shape[2], bn),
                    torch.full((h.num_recv, w.shape[2]), math.nan, device=d, dtype=dtype),
                    torch.full((h.num_recv, g.cfg.hidden), math.nan, device=d, dtype=dtype),
                    err, err if g.dev.cuda else torch.zeros(1, dtype=torch.int32, device=d))


def launch_wait(g: MoEGroup, c: WaitCall, epoch: int, timeout_ns: int, watchdog: bool = True) -> None:
    """The wait kernel on the current stream, through the launcher `_consume_fused` calls. Interpreted, its spins
    end when the abort word is set: a watchdog sets it after `timeout_ns` (as `_consume_fused` does), unless the
    caller bounds the launch itself (`watchdog=False`)."""
    tile = c.tile
    options = {} if tile is None else {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    launch_grouped_matmul_wait(c.src_table, g.flag_table, c.table, c.w, c.out, c.recv, epoch=epoch, err=c.err,
                               timeout_ns=timeout_ns, block=c.blocks, abort=c.abort, watchdog=watchdog, **options)


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
    return sum(g.handles[r].recv_counts[0]) > 0


# ==============================================================================================
# Checks g
# ==============================================================================================


def check_dispatch_ordered(rep: Report, dev: Device, cfg: Config) -> None:
    """g. Every source's counts and rows written and flagged; then every receiver reads its header and runs."""
    name = f"g.moe dispatch ordered {cfg.describe()}"
    epoch = 7
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    W = cfg.world_size
    for s in range(W):
        write_counts(g, s, epoch)
        for i in range(W):  # own rows first, then peers from s + 1 (`_produced`)
            write_rows(g, s, (s + i) % W, epoch)
    dev.settle(g.streams, [*g.dispatch_flags(), *[g.flag(s, d * g.flags_per_peer) for s in range(W) for d in range(W)]],
               name)
    problems: list[str] = []
    for r in range(W):  # the counts as `_read_counts` reads them: this call's tile tables come from them
        got = g.header(r).tolist()
        if got != g.handles[r].recv_counts:
            problems.append(f"rank {r}: header {got}, the senders sent {g.handles[r].recv_counts}")
        g.handles[r].recv_counts = got
    if problems:
        rep.add(name, "FAIL", "; ".join(problems))
        return
    calls = [wait_call(g, r, expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)) for r in range(W)]
    dev.idle(name)  # the poisoned outputs are in place before any launch
    for c in calls:
        with dev.on(g.streams[c.rank]):
            launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS)
    dev.settle(g.streams, g.dispatch_flags(), name)
    worst = [judge_wait(g, c, problems) for c in calls]
    rows = [c.recv.shape[0] for c in calls]
    value = f"{err_text(max(e for e, _ in worst), max(r for _, r in worst))}; rows per rank {rows}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value)


def check_dispatch_racing(rep: Report, dev: Device, cfg: Config) -> None:
    """g. The wait kernels launch first and spin; the rows are copied in and flagged later, rank 0's last."""
    name = f"g.moe dispatch racing {cfg.describe()}"
    epoch, W = 9, cfg.world_size
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    calls = [wait_call(g, r, expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)) for r in range(W)]
    staged = [[staged_rows(g, s, d) for d in range(W)] for s in range(W)]
    dev.idle(name)
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
        note = "thread publisher"
    else:
        cells = sum(c.grid for c in calls) + 1  # + the publisher's delay kernel
        if cells >= dev.sm_count:
            rep.add(name, "SKIP", f"{cells} spinning CTAs would leave no SM for the copies ({dev.sm_count} SMs)")
            return
        if shared_queues(rep, name, W):
            return
        pub = dev.stream()
        dev.distinct([*g.streams, pub])
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(W)]
        for c in calls:
            with dev.on(g.streams[c.rank]):
                launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS)
                ends[c.rank].record()
        last_due = torch.cuda.Event(enable_timing=True)  # before rank 0's first copy
        dev.delay(pub, int(first_delay_s * 1e9))
        for i, s in enumerate(reversed(range(W))):
            if i:
                dev.delay(pub, int(gap_s * 1e9))
            if s == 0:
                last_due.record(pub)
            for d in range(W):  # plain copies (memcpy, no SM needed) and stream-ordered flag writes
                write_rows(g, s, d, epoch, staged=staged[s][d], stream=pub)
        dev.settle([*g.streams, pub], g.dispatch_flags(), name)
        after = [last_due.elapsed_time(ends[r]) for r in range(W) if needs_rank0(g, r) and calls[r].runs]
        problems += [f"a receiver finished {-t:.3f} ms before rank 0's rows were written" for t in after if t <= 0]
        note = f"ended {min(after):.3f}-{max(after):.3f} ms after rank 0's rows were due" if after else ""
    worst = [judge_wait(g, c, problems) for c in calls]
    value = f"{err_text(max(e for e, _ in worst), max(r for _, r in worst))}; {note}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value)


def check_dispatch_timeout(rep: Report, dev: Device, cfg: Config) -> None:
    """g. Rank 1's rows are in rank 0's slot but never flagged: rank 0's kernel returns after about its
    timeout with ``err == src + 1 == 2``; the rows from rank 0 itself are right."""
    name = f"g.moe dispatch timeout {cfg.describe()}"
    epoch = 5
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    c = wait_call(g, 0, expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device))
    write_rows(g, 0, 0, epoch)
    write_rows(g, 1, 0, None)
    dev.idle(name)
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    if dev.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with dev.on(g.streams[0]):
            start.record()
            launch_wait(g, c, epoch, SHORT_TIMEOUT_NS)
            end.record()
        dev.settle(g.streams, g.dispatch_flags(), name)  # the kernel's own limit must end it long before this deadline
        waited = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        with Watchdog(c.abort, timeout_s):  # the interpreter's abort word stands in for %globaltimer
            launch_wait(g, c, epoch, SHORT_TIMEOUT_NS, watchdog=False)
        waited = time.perf_counter() - t0
    problems: list[str] = []
    if not sum(g.handles[0].recv_counts[1]) or not sum(g.handles[0].recv_counts[0]):
        problems.append(f"the routing sends rank 0 no rows from rank 0 or 1: {g.handles[0].recv_counts}")
    if not 0.5 * timeout_s <= waited <= 10 * timeout_s:
        problems.append(f"returned after {waited:.3f} s, expected about {timeout_s} s")
    judge_wait(g, c, problems, expect_err=2, only_source=0)
    value = f"bounded wait fired after {waited:.3f} s, err={int(c.err.item())}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value, waited_s=waited)
