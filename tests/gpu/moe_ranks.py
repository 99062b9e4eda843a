"""Virtual MoE ranks on one device, which the MoE kernel tests (dispatch, combine, all-to-all) and the GPU check's
MoE timings start from: a routing built on the host and W virtual ranks whose slots are laid out as
`overlap.kernels.slots` says, with the calls of the two fused grouped-GEMM kernels.

As in tests/gpu/virtual.py: W virtual ranks in one process, each with its own stream, its own slot (a plain device
tensor: a header of ``W x L`` int32 counts, then ``W`` regions of `slots.region_stride` bytes, NaN until written),
its own flag pad (int32 ``[MAX_FLAGS]`` at the previous call's epoch: producer ``s`` flags ``d * F`` for its counts
and ``d * F + 1 + g`` for its rows of expert group ``g`` for rank ``d``) and its own flag counters.

The routing is the tests' own, in plain torch from each rank's top-k ids (`Routing`): random top-k with uneven
loads (a ramp on the logits, or two hot experts per rank), uneven token counts (0 included), one expert nobody
picks. The rows a test expects are worked out a second way, straight from ``topk_idx`` (`MoEGroup.expert_rows`),
and the kernels' results are checked against float64 on those rows.

The kernels are called as the fused strategies call them: the tile tables of `dispatch_tile_table` and
`combine_tile_table`, launched through `launch_grouped_matmul_wait` and `launch_grouped_matmul_scatter`
(`launch_wait`, `launch_scatter`: module level, so that tests/gpu/cpu/test_gpu_check_order.py can stand in for them).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from overlap.kernels import slots
from overlap.kernels.dispatch_grouped_matmul import dispatch_tile_table, launch_grouped_matmul_wait
from overlap.kernels.grouped_matmul_combine import combine_tile_table, launch_grouped_matmul_scatter
from overlap.kernels.host import cdiv, fused_tiles, grouped_matmul_grid

from overlap import symm
from tests.gpu.tolerance import dtype_name
from tests.gpu.virtual import Device, EpochWords, Tile

# ==============================================================================================
# Configurations and routing
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


# The routings every kernel test runs: GPU sizes, or small ones for the Triton interpreter (32x32x32 tiles).
# A case with no CPU configuration runs on GPUs only (its tests carry the `cuda` mark).
_BF16, _F16, _F32 = torch.bfloat16, torch.float16, torch.float32
ORDERED = {
    "uneven": (Config(4, (200, 96, 333, 150), 512, 384, 8, 2, _BF16),
               Config(2, (20, 13), 32, 24, 4, 2, _F32)),
    # GPU: L = 1, so rank 1 (whose only expert nobody picks) receives nothing; CPU: rank 1 has no tokens
    "idle-rank": (Config(8, (256, 100, 180, 77), 256, 512, 8, 2, _BF16, "transposed"),
                  Config(3, (17, 0, 9), 40, 24, 6, 2, _BF16, "transposed")),
    # more local experts than flags per peer (L = 32 > 31 groups at W = 8; L = 64 > 63 at W = 4): shared flags
    "more-experts-than-flags": (Config(8, (64, 40, 100, 23), 256, 128, 256, 8, _BF16, hot=2.0),
                                Config(4, (8, 5, 11, 6), 32, 16, 256, 4, _F32, hot=2.0)),
    "odd-widths": (Config(4, (90, 130, 17, 60), 200, 136, 16, 4, _F16, "transposed"), None),
}
RACING = (Config(4, (64, 48, 80, 32), 256, 256, 8, 2, _BF16), Config(2, (12, 9), 32, 32, 4, 2, _F32))
TIMEOUT = (Config(2, (64, 48), 256, 128, 4, 2, _BF16), Config(2, (12, 9), 32, 32, 4, 2, _F32))


def ordered_cases() -> list:
    """The keys of `ORDERED` as pytest parameters, those without a CPU configuration marked `cuda`."""
    return [pytest.param(case, id=case, marks=[pytest.mark.cuda] if cpu is None else [])
            for case, (_, cpu) in ORDERED.items()]


def ordered_config(dev: Device, case: str) -> Config:
    """The configuration of `case` (a key of `ORDERED`) on `dev`."""
    cfg = ORDERED[case][0 if dev.cuda else 1]
    assert cfg is not None, f"{case} has no configuration for the CPU: its tests must carry the cuda mark"
    return cfg


def racing_config(dev: Device) -> Config:
    return RACING[0 if dev.cuda else 1]


def timeout_config(dev: Device) -> Config:
    return TIMEOUT[0 if dev.cuda else 1]


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


@dataclasses.dataclass(eq=False)
class Routing:
    """Where one virtual rank's (token, expert) pairs go (pair ``p = t * K + k``). Send order: the pairs sorted
    by global expert, stably (so by destination rank, then local expert, then token); rank ``d``'s rows are the
    run ``send_offsets[d] ... + send_splits[d]``. Expert order (the grouped GEMMs' rows): by local expert, then
    source rank, then the source's send order. Host values unless noted."""

    num_local_experts: int  # L
    top_k: int  # K
    num_tokens: int  # T
    order: torch.Tensor  # int64 [P] on the tokens' device: the pair at each send position
    send_counts: list[list[int]]  # [W][L]: rows this rank sends to rank d's local expert e
    recv_counts: list[list[int]] = dataclasses.field(default_factory=list)  # [W][L]: rows source s sends here

    @classmethod
    def of(cls, topk: torch.Tensor, num_experts: int, world_size: int) -> Routing:
        """The routing of top-k ids ``[T, K]`` (``recv_counts`` is set once every rank's routing is known)."""
        flat = topk.reshape(-1).to(torch.int64)
        L = num_experts // world_size
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        order = torch.argsort(flat, stable=True)
        return cls(L, topk.shape[1], topk.shape[0], order, [counts[d * L : (d + 1) * L] for d in range(world_size)])

    @property
    def send_splits(self) -> list[int]:
        return [sum(row) for row in self.send_counts]

    @property
    def send_offsets(self) -> list[int]:
        return [sum(self.send_splits[:d]) for d in range(len(self.send_counts))]

    @property
    def recv_splits(self) -> list[int]:
        return [sum(row) for row in self.recv_counts]

    @property
    def tokens_per_expert(self) -> list[int]:
        return [sum(row[e] for row in self.recv_counts) for e in range(self.num_local_experts)]

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    def within_source(self, s: int, e: int) -> int:
        """First row of block ``(s, e)`` among the rows source ``s`` sends to this rank."""
        return sum(self.recv_counts[s][:e])

    def within_dest(self, d: int, e: int) -> int:
        """First row of block ``(d, e)`` among the rows this rank sends to ``d``."""
        return sum(self.send_counts[d][:e])

    @functools.cached_property
    def token_of(self) -> torch.Tensor:
        """Token of the pair at each send position (``order // K``), on the tokens' device."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")

    @functools.cached_property
    def inv_order(self) -> torch.Tensor:
        """Send position of each pair (the permutation back), on the tokens' device."""
        inv = torch.empty_like(self.order)
        inv[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return inv

    @property
    def staging_of_expert_row(self) -> torch.Tensor:
        """Row of each expert-order row among the received rows in staging order (by source, then the source's
        send order), on the tokens' device."""
        W = len(self.recv_counts)
        starts = [sum(self.recv_splits[:s]) for s in range(W)]
        parts = []
        for e in range(self.num_local_experts):
            for s in range(W):
                lo = starts[s] + self.within_source(s, e)
                parts.append(torch.arange(lo, lo + self.recv_counts[s][e]))
        idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return idx.to(self.order.device)


# ==============================================================================================
# The virtual ranks
# ==============================================================================================


@dataclasses.dataclass
class MoEGroup:
    """W virtual ranks: tokens, routing, slots, flag pads, counters, one stream each."""

    dev: Device
    cfg: Config
    xs: list[torch.Tensor]  # [T_r, H] each rank's tokens
    topk: list[torch.Tensor]  # [T_r, K]
    routes: list[Routing]  # each rank's routing; recv_counts from the senders' counts (host values)
    stride: int  # bytes between regions (`slots.region_stride` of the largest need of any rank)
    bufs: list[torch.Tensor | None]  # uint8 [header + W * stride] each rank's slot (None: not made)
    pads: list[torch.Tensor]  # int32 [MAX_FLAGS] each rank's ready flags
    counters: list[torch.Tensor]  # int32 [MAX_FLAGS] each rank's flag counters (the scatter kernel's)
    flag_table: torch.Tensor  # int64 [W]: every pad's address
    streams: list[torch.cuda.Stream | None]
    epochs: EpochWords  # the words of epochs stale .. stale + 2, made here (before any gate)

    @classmethod
    def create(cls, dev: Device, cfg: Config, stale: int, owners: list[int] | None = None) -> MoEGroup:
        """Flags start at `stale`; slots only for `owners` (default: every rank)."""
        d, W, L, K, E = dev.device, cfg.world_size, cfg.num_local_experts, cfg.top_k, cfg.experts
        assert E % W == 0 and K < E, cfg
        xs, topk, routes = [], [], []
        for r in range(W):
            T = cfg.tokens[r % len(cfg.tokens)]
            xs.append(torch.randn(T, cfg.hidden, device=d).to(cfg.dtype))
            topk.append(make_topk(cfg, T, d))
            routes.append(Routing.of(topk[r], E, W))
        for r, h in enumerate(routes):
            h.recv_counts = [routes[s].send_counts[r] for s in range(W)]
        # Regions for the worst case of any source (T * min(K, L) rows, K distinct experts per token), as the
        # ops size them: a routing that varies between calls never outgrows its slot.
        rows = max(max(h.num_tokens * min(K, L), *h.send_splits) for h in routes)
        row_bytes = cfg.hidden * xs[0].element_size()
        stride = slots.region_stride(slots.moe_slot_bytes(rows, row_bytes, W, L), W, L)
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
        g = cls(dev, cfg, xs, topk, routes, stride, bufs, pads,
                [torch.zeros(symm.MAX_FLAGS, dtype=torch.int32, device=d) for _ in range(W)],
                torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=d),
                [dev.stream() for _ in range(W)], EpochWords(stale, d))
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
        """Region `source` of `owner`'s slot as ``[capacity, H]`` rows."""
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
        counts = self.routes[source].send_counts[dest]
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
    h = g.routes[s]
    lo = h.send_offsets[d]
    return g.xs[s].index_select(0, h.token_of[lo : lo + h.send_splits[d]])


def op_tile(dev: Device, dtype: torch.dtype) -> tuple[int, int, int]:
    """The fused kernels' default tiles (no plan tiles): `overlap.kernels.host.fused_tiles`."""
    return fused_tiles(0, 0, 0, not dev.cuda, dtype)


# ==============================================================================================
# What the tests do on the ranks: the sources' copies, the kernels' calls
# ==============================================================================================


def write_counts(g: MoEGroup, s: int, epoch: int) -> None:
    """Source `s`'s counts into row `s` of every rank's header, each flagged (flag ``d * F``)."""
    W, F = g.world_size, g.flags_per_peer
    with g.dev.on(g.streams[s]):
        mine = torch.tensor(g.routes[s].send_counts, dtype=torch.int32, device=g.dev.device)
        for i in range(W):
            d = (s + i) % W
            g.header(d)[s].copy_(mine[d])
            g.dev.publish(g.flag(s, d * F), epoch, g.streams[s])


def write_rows(g: MoEGroup, s: int, d: int, epoch: int | None, staged: torch.Tensor | None = None,
               stream: torch.cuda.Stream | None = None) -> None:
    """Source `s`'s rows for `d` into region `s` of `d`'s slot, expert group by group, each flagged after its
    rows (no flag with `epoch` None). From `staged` (the rows in send order, contiguous: a plain copy, which a GPU
    runs as a memcpy) or gathered from the tokens with ``index_select``, as the ops' producers do."""
    h, L, F, G = g.routes[s], g.cfg.num_local_experts, g.flags_per_peer, g.num_groups
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
    tile: Tile | None  # None: the default tiles and launch options; else a timing variant
    blocks: tuple[int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K: the table and the grid are built for them
    src_table: torch.Tensor  # int64 [W]: the regions of this rank's slot
    table: torch.Tensor  # int32 [tiles, 6] (no rows: [0, 6], nothing launched)
    grid: int
    out: torch.Tensor  # [R, F]
    recv: torch.Tensor  # [R, H]
    err: torch.Tensor  # int32 [1]
    abort: torch.Tensor  # int32 [1]; the error word itself on GPUs, as the ops pass it

    @property
    def runs(self) -> bool:
        return bool(self.table.shape[0])


def wait_call(g: MoEGroup, r: int, w: torch.Tensor, tile: Tile | None = None) -> WaitCall:
    """Rank `r`'s call: the kernel's tile table (`dispatch_tile_table`) from its ``recv_counts``."""
    d, W, L = g.dev.device, g.world_size, g.cfg.num_local_experts
    h, dtype = g.routes[r], g.cfg.dtype
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
                               epoch=g.epochs(epoch), err=c.err, timeout_ns=timeout_ns,
                               block=c.blocks, abort=c.abort, watchdog=watchdog, **options)


@dataclasses.dataclass
class ScatterCall:
    """One expert rank's scatter kernel: its rows (expert order), weights and tables."""

    rank: int
    y: torch.Tensor  # [R, F]
    w: torch.Tensor  # [L, F, H], any strides
    table: torch.Tensor  # int32 [tiles, 7] (no rows: [0, 7], nothing launched)
    dst_table: torch.Tensor  # int64 [W]: this rank's region in every rank's slot


def scatter_call(g: MoEGroup, r: int, y: torch.Tensor, w: torch.Tensor, dst: list[int] | None = None) -> ScatterCall:
    """Rank `r`'s call: the kernel's tile table (`combine_tile_table`: peers from r + 1, own rows last)."""
    W, L = g.world_size, g.cfg.num_local_experts
    bm, bn, _ = op_tile(g.dev, g.cfg.dtype)
    d = g.dev.device
    table = combine_tile_table(g.routes[r].recv_counts, r, bm, cdiv(w.shape[2], bn), d)
    if dst is None:
        hb = slots.header_bytes(W, L)
        dst = [g.bufs[p].data_ptr() + hb + r * g.stride for p in range(W)]
    return ScatterCall(r, y, w, table, torch.tensor(dst, dtype=torch.int64, device=d))


def launch_scatter(g: MoEGroup, c: ScatterCall, epoch: int) -> None:
    """The scatter kernel on the current stream, through the launcher `grouped_matmul_combine`'s fused strategy
    calls."""
    launch_grouped_matmul_scatter(c.y, c.w, c.table, c.dst_table, g.counters[c.rank], g.flag_table,
                                  epoch=g.epochs(epoch), rank=c.rank, block=op_tile(g.dev, g.cfg.dtype))
