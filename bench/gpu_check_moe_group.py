"""The virtual MoE ranks of the one-GPU check (`gpu_check_moe`): a routing built on the host and W virtual
ranks with the slot layout of the MoE ops, which every MoE section (dispatch, combine, a2a, timings) starts from.

As in gpu_check_virtual: W virtual ranks in one process, each with its own stream, its own slot (a plain device
tensor laid out as `overlap.kernels.slots` says: a header of ``W x L`` int32 counts, then ``W`` regions of
`slots.region_stride` bytes, NaN until written), its own flag pad (int32 ``[MAX_FLAGS]`` at the previous call's
epoch: producer ``s`` flags ``d * F`` for its counts and ``d * F + 1 + g`` for its rows of expert group ``g``
for rank ``d``) and its own flag counters. The routing is built on the host: random top-k with uneven loads
(a ramp on the logits, or two hot experts per rank), uneven token counts (0 included), one expert nobody
picks. The layout math is the ops' own (`overlap.ops.moe.layout`: `route`, `MoELayout`, `heap_need`,
`region_stride`, `group_of`, ...); the expected rows are not:
they come straight from ``topk_idx`` (expert, then source rank, then pair order).

Also here: what several sections share besides the ranks (the float64 reference of a grouped GEMM, the rows a
source sends, the ops' default tiles), and what they do on the ranks: a source's copies of its counts and rows
(as the op's ``symm``/``fused`` producer does), and the calls of the two grouped-GEMM kernels with the ops' own
tile tables (`dispatch_tile_table`, `combine_tile_table`) through the ops' launchers
(`overlap.kernels.launch_grouped_matmul_wait`, `launch_grouped_matmul_scatter`).

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from gpu_check_common import dtype_name
from gpu_check_virtual import Device, Tile
from overlap.kernels import slots
from overlap.kernels.dispatch_grouped_matmul import dispatch_tile_table, launch_grouped_matmul_wait
from overlap.kernels.grouped_matmul_combine import combine_tile_table, launch_grouped_matmul_scatter
from overlap.kernels.host import epoch_word, grouped_matmul_grid

from overlap import symm
from overlap.ops import fused
from overlap.ops.context import CallContext
from overlap.ops.moe import layout
from overlap.plans import Plan

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
    handles: list[layout.MoELayout]  # each rank's layout; recv_counts from the senders' counts (host values)
    stride: int  # bytes between regions (`overlap.kernels.slots.region_stride` of the largest need of any rank)
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
            order, send_counts = layout.route("gpu_check", topk[r], E, W)
            context = CallContext("gpu_check", None, None, 30.0, Plan("fused"))  # no group: virtual ranks
            handles.append(layout.MoELayout(context, E, L, K, T, send_counts, order))
        for r, h in enumerate(handles):
            h.recv_counts = [handles[s].send_counts[r] for s in range(W)]
        row_bytes = cfg.hidden * xs[0].element_size()
        need = max(layout.heap_need("fused", h.num_tokens, K, L, h.send_splits, row_bytes, W) for h in handles)
        stride = slots.region_stride(need, W, L)
        hb = slots.header_bytes(W, L)
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

    def poison_regions(self) -> None:
        """Every slot's regions NaN again (after a warm-up wrote rows there)."""
        hb = slots.header_bytes(self.world_size, self.cfg.num_local_experts)
        for b in self.bufs:
            if b is not None:
                b[hb:].view(self.cfg.dtype).fill_(math.nan)
        self.dev.idle("regions poisoned again")

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @property
    def flags_per_peer(self) -> int:
        return slots.flags_per_peer(self.world_size)

    @property
    def num_groups(self) -> int:
        return slots.expert_groups(self.cfg.num_local_experts, self.world_size)

    def region(self, owner: int, source: int) -> torch.Tensor:
        """Region `source` of `owner`'s slot as ``[capacity, H]`` rows (`layout.region`)."""
        W, L, H = self.world_size, self.cfg.num_local_experts, self.cfg.hidden
        row_bytes = H * self.xs[0].element_size()
        at, cap = slots.header_bytes(W, L) + source * self.stride, self.stride // row_bytes
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
        return [base + 1 + gi for gi in range(G) if sum(counts[e] for e in slots.group_experts(gi, L, G))]

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


def staged_rows(g: MoEGroup, s: int, d: int) -> torch.Tensor:
    """Source `s`'s rows for rank `d`, in send order and contiguous (what `write_rows` copies from `staged`)."""
    h = g.handles[s]
    lo = h.send_offsets[d]
    return g.xs[s].index_select(0, h.token_of[lo : lo + h.send_splits[d]])


def op_tile(dev: Device, dtype: torch.dtype) -> tuple[int, int, int]:
    """The ops' default tiles (no plan tiles): `fused.fused_tiles`."""
    return fused.fused_tiles(0, 0, 0, not dev.cuda, dtype)


# ==============================================================================================
# What the sections do on the ranks: the sources' copies, the kernels' calls (the ops' tile tables and
# launchers: `overlap.ops.moe.tiles.dispatch_tile_table`, `combine_tile_table`,
# `overlap.kernels.dispatch_grouped_matmul`, `grouped_matmul_combine`)
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
            experts = slots.group_experts(gi, L, G)
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
    """Rank `r`'s call: the op's own tile table (`dispatch_tile_table`) from ``h.recv_counts``."""
    d, W, L = g.dev.device, g.world_size, g.cfg.num_local_experts
    h, dtype = g.handles[r], g.cfg.dtype
    blocks = op_tile(g.dev, dtype) if tile is None else (tile.block_m, tile.block_n, tile.block_k)
    bm, bn, _ = blocks
    table = dispatch_tile_table(h.recv_counts, r, bm, d)
    hb = slots.header_bytes(W, L)
    src = [g.bufs[r].data_ptr() + hb + s * g.stride for s in range(W)] if g.bufs[r] is not None else [0] * W
    err = torch.zeros(1, dtype=torch.int32, device=d)
    return WaitCall(r, w, tile, blocks, torch.tensor(src, dtype=torch.int64, device=d), table,
                    grouped_matmul_grid(table.shape[0], w.shape[2], bn),
                    torch.full((h.num_recv, w.shape[2]), math.nan, device=d, dtype=dtype),
                    torch.full((h.num_recv, g.cfg.hidden), math.nan, device=d, dtype=dtype),
                    err, err if g.dev.cuda else torch.zeros(1, dtype=torch.int32, device=d))


def launch_wait(g: MoEGroup, c: WaitCall, epoch: int, timeout_ns: int, watchdog: bool = True) -> None:
    """The wait kernel on the current stream, through the launcher `dispatch_grouped_matmul`'s fused strategy calls.
    Interpreted, its spins end when the abort word is set: a watchdog sets it after `timeout_ns` (as the op's
    launch does), unless the caller bounds the launch itself (`watchdog=False`)."""
    tile = c.tile
    options = {} if tile is None else {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    launch_grouped_matmul_wait(c.src_table, g.flag_table, c.table, c.w, c.out, c.recv,
                               epoch=epoch_word(epoch, c.out.device), err=c.err, timeout_ns=timeout_ns,
                               block=c.blocks, abort=c.abort, watchdog=watchdog, **options)


@dataclasses.dataclass
class ScatterCall:
    """One expert rank's scatter kernel: its rows (expert order), weights and tables."""

    rank: int
    y: torch.Tensor  # [R, F]
    w: torch.Tensor  # [L, F, H], any strides
    table: torch.Tensor  # int32 [tiles, 7] (no rows: [0, 7], nothing launched)
    dst_table: torch.Tensor  # int64 [W]: this rank's region in every rank's slot, as `heap.ptr_table`


def scatter_call(g: MoEGroup, r: int, y: torch.Tensor, w: torch.Tensor, dst: list[int] | None = None) -> ScatterCall:
    """Rank `r`'s call: the op's own tile table (`combine_tile_table`: peers from r + 1, own rows last)."""
    W, L = g.world_size, g.cfg.num_local_experts
    bm, bn, _ = op_tile(g.dev, g.cfg.dtype)
    d = g.dev.device
    table = combine_tile_table(g.handles[r].recv_counts, r, bm, fused.cdiv(w.shape[2], bn), d)
    if dst is None:
        hb = slots.header_bytes(W, L)
        dst = [g.bufs[p].data_ptr() + hb + r * g.stride for p in range(W)]
    return ScatterCall(r, y, w, table, torch.tensor(dst, dtype=torch.int64, device=d))


def launch_scatter(g: MoEGroup, c: ScatterCall, epoch: int) -> None:
    """The scatter kernel on the current stream, through the launcher `grouped_matmul_combine`'s fused strategy
    calls."""
    launch_grouped_matmul_scatter(c.y, c.w, c.table, c.dst_table, g.counters[c.rank], g.flag_table,
                                  epoch=epoch_word(epoch, c.y.device), rank=c.rank, block=op_tile(g.dev, g.cfg.dtype))
