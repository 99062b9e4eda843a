"""One GPU, virtual ranks: checks g and timings of the fused MoE kernels (`overlap.kernels.moe`), launched with
the arguments of `dispatch_grouped_matmul`'s fused strategy (`grouped_matmul_wait_kernel`, `_consume_fused`)
and of `grouped_matmul_combine`'s (`grouped_matmul_scatter_kernel`, `moe_combine._fused`).

As in gpu_check_virtual: W virtual ranks in one process, each with its own stream, its own slot (a plain device
tensor laid out as `overlap.ops._moe` lays out a slot: a header of ``W x L`` int32 counts, then ``W`` regions of
`M.region_stride` bytes, NaN until written), its own flag pad (int32 ``[MAX_FLAGS]`` at the previous call's
epoch: producer ``s`` flags ``d * F`` for its counts and ``d * F + 1 + g`` for its rows of expert group ``g``
for rank ``d``) and its own flag counters. The routing is built on the host: random top-k with uneven loads
(a ramp on the logits, or two hot experts per rank), uneven token counts (0 included), one expert nobody
picks. The layout math is the ops' own
(`M.route`, `MoEHandle`, `M.heap_need`, `M.region_stride`, `M.group_of`, ...); the expected rows are not:
they come straight from ``topk_idx`` (expert, then source rank, then pair order).

Checks (outputs and received rows NaN-poisoned; GEMMs against float64, received rows bitwise):
g. dispatch ordered: every source writes its counts and its rows into every receiver's regions
   (``index_select`` as `_produced` does) and flags them; then each receiver reads its header, builds its
   tile table and runs the wait kernel.
g. dispatch racing: the wait kernels launch first and spin; the rows are copied in and flagged 20 ms later
   from another stream, rank 0's last (GPU: plain copies and `_C` stream writes; the spinning grids leave
   SMs free; CPU: a thread).
g. dispatch timeout: rank 1's rows are in place but never flagged: rank 0's kernel gives up after its
   timeout with ``err == 2``, its own rows right.
g. combine ordered: every expert rank's scatter kernel, then every source collects its rows (send order,
   then pair order) against float64; twice (epochs 7 and 8: fresh inputs, the same regions and counters).
   After each call every flag of a group with rows is at the epoch, every other flag untouched, every
   counter back at 0.
g. combine racing: the sources' waits and copies are issued first (GPU: stream-ordered one-thread bounded
   waits, as `Call.wait_ready` does on GPUs; CPU: host waits in threads); the scatter kernels run 20 ms
   later, rank 0's last.
Timings (GPU, bf16, W=8, 4096 tokens per rank, `moe_shapes`): rank 0's wait kernel with every flag set,
against one ``torch.mm`` per local expert over the same rows (and torch's ``_grouped_mm`` where it runs);
rank 0's scatter kernel against the same loop.

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
import types

import torch
from gpu_check_common import Report, compare, dtype_name, err_text, moe_shapes
from gpu_check_virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device, Tile
from overlap.kernels.moe import grouped_matmul_wait_kernel

from overlap import symm
from overlap.ops import _common as common
from overlap.ops import _moe as M
from overlap.plan import Plan

# ==============================================================================================
# Routing and virtual ranks with the slot layout of the MoE ops
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class Config:
    """``W`` ranks with ``tokens[r]`` tokens, ``E`` experts, top-``K``; rows ``H`` wide (the regions' rows in
    both directions), expert GEMMs ``H -> F`` (dispatch) and ``F -> H`` (combine)."""

    world_size: int
    tokens: tuple[int, ...]
    hidden: int
    ffn: int
    experts: int
    top_k: int
    dtype: torch.dtype
    w_layout: str = "stacked"  # or "transposed": w[e] a transposed view (the backward's w.transpose(1, 2))
    skew: float = 2.0  # a ramp on the logits: low expert ids are picked more often
    hot: float = 0.0  # a bump on every rank's local experts 0 and 1 (expert group 0 where L > F - 1 has both)
    empty: bool = True  # expert L (rank 1's first; with L = 1 rank 1 receives nothing) is never picked

    @property
    def num_local_experts(self) -> int:
        return self.experts // self.world_size

    def describe(self) -> str:
        return (f"W={self.world_size} E={self.experts} top{self.top_k} T={'/'.join(map(str, self.tokens))} "
                f"{self.hidden}x{self.ffn} {dtype_name(self.dtype)} w={self.w_layout}")


def make_topk(cfg: Config, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[T, K]`` distinct expert ids per token: random logits plus a ramp, one expert never chosen."""
    logits = torch.randn(num_tokens, cfg.experts) + torch.linspace(cfg.skew, 0.0, cfg.experts)
    logits[:, torch.arange(cfg.experts) % cfg.num_local_experts < 2] += cfg.hot
    if cfg.empty:
        logits[:, min(cfg.num_local_experts, cfg.experts - 1)] = -math.inf
    return torch.topk(logits, cfg.top_k, dim=1).indices.to(device)


def expert_weights(cfg: Config, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``[L, rows, cols]`` stacked, or a transposed view of ``[L, cols, rows]``."""
    L, scale = cfg.num_local_experts, 1.0 / math.sqrt(rows)
    if cfg.w_layout == "transposed":
        return (torch.randn(L, cols, rows, device=device) * scale).to(cfg.dtype).transpose(1, 2)
    return (torch.randn(L, rows, cols, device=device) * scale).to(cfg.dtype)


@dataclasses.dataclass
class MoEGroup:
    """W virtual ranks: tokens, routing, handles, slots, flag pads, counters, one stream each."""

    dev: Device
    cfg: Config
    xs: list[torch.Tensor]  # [T_r, H] each rank's tokens
    topk: list[torch.Tensor]  # [T_r, K]
    handles: list[M.MoEHandle]  # each rank's layout; recv_counts from the senders' counts (host values)
    stride: int  # bytes between regions (`M.region_stride` of the largest need of any rank)
    bufs: list[torch.Tensor | None]  # uint8 [header + W * stride] each rank's slot (None: not made)
    pads: list[torch.Tensor]  # int32 [MAX_FLAGS] each rank's ready flags
    counters: list[torch.Tensor]  # int32 [MAX_FLAGS] each rank's flag counters (the scatter kernel's)
    flag_table: torch.Tensor  # int64 [W]: every pad, as `heap.flag_table(slot, 0)`
    streams: list[torch.cuda.Stream | None]

    @classmethod
    def create(cls, dev: Device, cfg: Config, stale: int, owners: list[int] | None = None) -> MoEGroup:
        """Flags start at `stale`; slots only for `owners` (default: every rank)."""
        d, W, L, K, E = dev.device, cfg.world_size, cfg.num_local_experts, cfg.top_k, cfg.experts
        assert E % W == 0 and K < E, cfg
        xs, topk, handles = [], [], []
        for r in range(W):
            T = cfg.tokens[r % len(cfg.tokens)]
            xs.append(torch.randn(T, cfg.hidden, device=d).to(cfg.dtype))
            topk.append(make_topk(cfg, T, d))
            order, send_counts = M.route("gpu_check", topk[r], E, W)
            handles.append(M.MoEHandle(None, None, E, L, K, T, send_counts, order, Plan("fused"), 30.0))
        for r, h in enumerate(handles):
            h.recv_counts = [handles[s].send_counts[r] for s in range(W)]
        row_bytes = cfg.hidden * xs[0].element_size()
        need = max(M.heap_need("fused", h.num_tokens, K, L, h.send_splits, row_bytes, W) for h in handles)
        stride = M.region_stride(types.SimpleNamespace(need=need), W, L)
        hb = M.header_bytes(W, L)
        bufs: list[torch.Tensor | None] = []
        for r in range(W):
            if owners is not None and r not in owners:
                bufs.append(None)
                continue
            b = torch.empty(hb + W * stride, dtype=torch.uint8, device=d)
            assert b.data_ptr() % 16 == 0, "the kernels assume 16-byte aligned slots"
            b[:hb].view(torch.int32).fill_(-1)
            b[hb:].view(cfg.dtype).fill_(math.nan)
            bufs.append(b)
        pads = [torch.full((symm.MAX_FLAGS,), stale, dtype=torch.int32, device=d) for _ in range(W)]
        g = cls(dev, cfg, xs, topk, handles, stride, bufs, pads,
                [torch.zeros(symm.MAX_FLAGS, dtype=torch.int32, device=d) for _ in range(W)],
                torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=d),
                [dev.stream() for _ in range(W)])
        dev.idle("setting up virtual MoE ranks")  # the streams below must see these writes
        return g

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @property
    def flags_per_peer(self) -> int:
        return M.flags_per_peer(self.world_size)

    @property
    def num_groups(self) -> int:
        return M.expert_groups(self.cfg.num_local_experts, self.world_size)

    def region(self, owner: int, source: int) -> torch.Tensor:
        """Region `source` of `owner`'s slot as ``[capacity, H]`` rows (`M.region`)."""
        W, L, H = self.world_size, self.cfg.num_local_experts, self.cfg.hidden
        row_bytes = H * self.xs[0].element_size()
        at, cap = M.header_bytes(W, L) + source * self.stride, self.stride // row_bytes
        return self.bufs[owner][at : at + cap * row_bytes].view(self.cfg.dtype).view(cap, H)

    def header(self, owner: int) -> torch.Tensor:
        W, L = self.world_size, self.cfg.num_local_experts
        return self.bufs[owner][: W * L * 4].view(torch.int32).view(W, L)

    def flag(self, producer: int, index: int) -> torch.Tensor:
        return self.pads[producer][index : index + 1]

    def group_flags(self, source: int, dest: int, base: int) -> list[int]:
        """``base + 1 + g`` for every expert group ``g`` with rows from `source` for `dest`'s experts: the
        dispatch flags them in `source`'s pad (``base = dest * F``), the combine in `dest`'s (``source * F``)."""
        L, G = self.cfg.num_local_experts, self.num_groups
        counts = self.handles[source].send_counts[dest]
        return [base + 1 + gi for gi in range(G) if sum(counts[e] for e in M.group_experts(gi, L, G))]

    def dispatch_flags(self) -> list[torch.Tensor]:
        """One-word views of every awaited dispatch flag (what a settle watchdog writes to release waits)."""
        W, F = self.world_size, self.flags_per_peer
        return [self.flag(s, i) for s in range(W) for d in range(W) for i in self.group_flags(s, d, d * F)]

    def combine_flags(self) -> list[torch.Tensor]:
        W, F = self.world_size, self.flags_per_peer
        return [self.flag(d, i) for d in range(W) for s in range(W) for i in self.group_flags(s, d, s * F)]

    def expert_rows(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank `rank`'s rows in expert order, straight from ``topk_idx``: (source, pair, local expert) of
        each row, int64 on the CPU, sorted by local expert, then source, then pair."""
        W, L = self.world_size, self.cfg.num_local_experts
        srcs, pairs, experts = [], [], []
        for s in range(W):
            flat = self.topk[s].flatten().cpu()
            p = (flat // L == rank).nonzero().flatten()
            srcs.append(torch.full_like(p, s))
            pairs.append(p)
            experts.append(flat[p] - rank * L)
        s, p, e = torch.cat(srcs), torch.cat(pairs), torch.cat(experts)
        span = max([t.numel() for t in self.topk] + [1])
        idx = torch.argsort((e * W + s) * span + p)
        return s[idx], p[idx], e[idx]

    def gather(self, per_source: list[torch.Tensor], src: torch.Tensor, pair: torch.Tensor,
               by_token: bool) -> torch.Tensor:
        """Row i = ``per_source[src[i]][pair[i]]`` (or its token's row, ``pair // K``, with `by_token`)."""
        d = per_source[0].device
        out = torch.empty((src.numel(), per_source[0].shape[1]), dtype=per_source[0].dtype, device=d)
        for s in range(self.world_size):
            mask = src == s
            if bool(mask.any()):
                at = pair[mask] // self.cfg.top_k if by_token else pair[mask]
                out[mask.to(d)] = per_source[s][at.to(d)]
        return out


def expert_mm64(rows: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """float64 ``rows[i] @ w[experts[i]]``, one GEMM per expert."""
    out = torch.empty((rows.shape[0], w.shape[2]), dtype=torch.float64, device=rows.device)
    experts = experts.to(rows.device)
    for e in range(w.shape[0]):
        mask = experts == e
        if bool(mask.any()):
            out[mask] = rows[mask].double() @ w[e].double()
    return out


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
            experts = M.group_experts(gi, L, G)
            lo, hi = h.within_dest(d, experts.start), h.within_dest(d, experts.stop)
            if hi <= lo:
                continue
            if staged is not None:
                region[lo:hi].copy_(staged[lo:hi])
            else:
                torch.index_select(g.xs[s], 0, h.token_of[base + lo : base + hi], out=region[lo:hi])
            if epoch is not None:
                g.dev.publish(g.flag(s, d * F + 1 + gi), epoch, stream)


def staged_rows(g: MoEGroup, s: int, d: int) -> torch.Tensor:
    h = g.handles[s]
    lo = h.send_offsets[d]
    return g.xs[s].index_select(0, h.token_of[lo : lo + h.send_splits[d]])


@dataclasses.dataclass
class WaitCall:
    """One receiver's wait kernel: its tiles, tables, NaN-poisoned outputs and error words."""

    rank: int
    w: torch.Tensor  # [L, H, F], any strides
    tile: Tile | None  # None: the op's default tiles and launch options; else a timing variant
    blocks: tuple[int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K: the table and the grid are built for them
    src_table: torch.Tensor  # int64 [W]: the regions of this rank's slot, as `heap.region_table`
    table: torch.Tensor | None  # int32 [tiles, 6] (None: no rows)
    grid: int
    out: torch.Tensor  # [R, F]
    recv: torch.Tensor  # [R, H]
    err: torch.Tensor  # int32 [1]
    abort: torch.Tensor  # int32 [1]; the error word itself on GPUs, as the op passes it


def op_tile(dev: Device, dtype: torch.dtype) -> tuple[int, int, int]:
    """The ops' default tiles (no plan tiles): `common.fused_tiles`."""
    return common.fused_tiles(0, 0, 0, not dev.cuda, dtype)


def wait_call(g: MoEGroup, r: int, w: torch.Tensor, tile: Tile | None = None) -> WaitCall:
    """Rank `r`'s tile table exactly as `_consume_fused` builds it from ``h.recv_counts``."""
    d, W, L, G, F = g.dev.device, g.world_size, g.cfg.num_local_experts, g.num_groups, g.flags_per_peer
    h, dtype = g.handles[r], g.cfg.dtype
    blocks = op_tile(g.dev, dtype) if tile is None else (tile.block_m, tile.block_n, tile.block_k)
    bm, bn, _ = blocks
    tiles = []  # (source, expert, row in the source's region, row in out, rows, flag index)
    for i in range(W):
        s = (r - i) % W
        for e in range(L):
            c = h.recv_counts[s][e]
            lo, at = h.within_source(s, e), h.expert_offsets[e][s]
            for t in range(0, c, bm):
                tiles.append((s, e, lo + t, at + t, min(bm, c - t), r * F + 1 + M.group_of(e, L, G)))
    hb = M.header_bytes(W, L)
    src = [g.bufs[r].data_ptr() + hb + s * g.stride for s in range(W)] if g.bufs[r] is not None else [0] * W
    err = torch.zeros(1, dtype=torch.int32, device=d)
    return WaitCall(r, w, tile, blocks, torch.tensor(src, dtype=torch.int64, device=d),
                    torch.tensor(tiles, dtype=torch.int32, device=d) if tiles else None,
                    len(tiles) * common.cdiv(w.shape[2], bn),
                    torch.full((h.num_recv, w.shape[2]), math.nan, device=d, dtype=dtype),
                    torch.full((h.num_recv, g.cfg.hidden), math.nan, device=d, dtype=dtype),
                    err, err if g.dev.cuda else torch.zeros(1, dtype=torch.int32, device=d))


def launch_wait(g: MoEGroup, c: WaitCall, epoch: int, timeout_ns: int, watchdog: bool = True) -> None:
    """The wait kernel on the current stream with `_consume_fused`'s arguments. Interpreted, its spins end
    when the abort word is set: a watchdog sets it after `timeout_ns` (as `_consume_fused` does), unless the
    caller bounds the launch itself (`watchdog=False`)."""
    if c.table is None:
        return
    interpreted, dtype, w = not g.dev.cuda, g.cfg.dtype, c.w
    bm, bn, bk = c.blocks
    tile = c.tile
    options = {} if tile is None or interpreted else {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    guard = common.Watchdog(c.abort, timeout_ns / 1e9) if watchdog and interpreted else contextlib.nullcontext()
    with guard:
        grouped_matmul_wait_kernel[(c.grid,)](
            c.src_table, g.flag_table, c.table,
            w, c.out, c.recv,
            epoch, c.abort, c.err, timeout_ns,
            w.shape[2], g.cfg.hidden,
            w.stride(0), w.stride(1), w.stride(2),
            c.out.stride(0), c.recv.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=interpreted,
            UPCAST=interpreted and dtype == torch.bfloat16,
            **options,
        )


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


def shared_queues(rep: Report, name: str, world_size: int) -> bool:
    """SKIP (True) where the racing checks' streams may share hardware queues: a spinning consumer or a
    held stream would then block the publisher queued behind it."""
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if connections is None or int(connections) >= world_size + 2:
        return False
    rep.add(name, "SKIP", f"CUDA_DEVICE_MAX_CONNECTIONS={connections}: streams share hardware queues, so a "
                          "waiting stream would block the publisher")
    return True


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
        with common.Watchdog(abort, 10.0):
            thread.start()
            for c in calls:
                c.abort = abort
                launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS, watchdog=False)
                ends.append(time.perf_counter())
        thread.join(timeout=5.0)
        problems += [f"rank {r} finished before rank 0's rows were written" for r, t in enumerate(ends)
                     if needs_rank0(g, r) and calls[r].table is not None and t <= last_due[0]]
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
        after = [last_due.elapsed_time(ends[r]) for r in range(W) if needs_rank0(g, r) and calls[r].table is not None]
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
        with common.Watchdog(c.abort, timeout_s):  # the interpreter's abort word stands in for %globaltimer
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


# ==============================================================================================
# Entry: after the reduce-scatter checks of gpu_check_tp.run_tp_virtual
# ==============================================================================================


def run_moe_virtual(rep: Report, dev: Device) -> None:
    gpu_only = None if dev.cuda else "GPU only"
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    if dev.cuda:
        ordered = [Config(4, (200, 96, 333, 150), 512, 384, 8, 2, bf16),
                   Config(8, (256, 100, 180, 77), 256, 512, 8, 2, bf16, "transposed"),  # L = 1: rank 1 gets nothing
                   Config(8, (64, 40, 100, 23), 256, 128, 256, 8, bf16, hot=2.0),  # L = 32 > 31 groups
                   Config(4, (90, 130, 17, 60), 200, 136, 16, 4, f16, "transposed")]  # odd widths
        racing = Config(4, (64, 48, 80, 32), 256, 256, 8, 2, bf16)
        timeout = Config(2, (64, 48), 256, 128, 4, 2, bf16)
    else:  # interpreted, 32x32x32 tiles
        ordered = [Config(2, (20, 13), 32, 24, 4, 2, f32),
                   Config(3, (17, 0, 9), 40, 24, 6, 2, bf16, "transposed"),  # a rank without tokens
                   Config(4, (8, 5, 11, 6), 32, 16, 256, 4, f32, hot=2.0)]  # L = 64 > 63 expert groups
        racing = Config(2, (12, 9), 32, 32, 4, 2, f32)
        timeout = Config(2, (12, 9), 32, 32, 4, 2, f32)
    for cfg in ordered:
        rep.run(f"g.moe dispatch ordered {cfg.describe()}", lambda c=cfg: check_dispatch_ordered(rep, dev, c))
    rep.run(f"g.moe dispatch racing {racing.describe()}", lambda: check_dispatch_racing(rep, dev, racing))
    rep.run(f"g.moe dispatch timeout {timeout.describe()}", lambda: check_dispatch_timeout(rep, dev, timeout))
    from gpu_check_moe_a2a import check_a2a_kernels
    from gpu_check_moe_combine import check_combine_ordered, check_combine_racing

    for cfg in ordered:
        rep.run(f"h.moe a2a kernels {cfg.describe()}", lambda c=cfg: check_a2a_kernels(rep, dev, c), skip=gpu_only)

    for cfg in ordered:
        rep.run(f"g.moe combine ordered {cfg.describe()}", lambda c=cfg: check_combine_ordered(rep, dev, c))
    rep.run(f"g.moe combine racing {racing.describe()}", lambda: check_combine_racing(rep, dev, racing))
    from gpu_check_moe_timing import time_combine, time_dispatch, timing_config

    for label, shape in moe_shapes(8):  # W = 8 virtual ranks
        cfg = timing_config(shape, 8)
        rep.run(f"time moe fused dispatch {label}", lambda a=(label, cfg): time_dispatch(rep, dev, *a), skip=gpu_only)
        rep.run(f"time moe fused combine {label}", lambda a=(label, cfg): time_combine(rep, dev, *a), skip=gpu_only)
