"""The virtual tensor-parallel ranks of the GPU tests (tests/gpu) and their heap layouts, which the tests of the
all-gather GEMM kernels (test_all_gather_kernels.py), the symm pipeline (test_symm_pipeline.py) and the scatter
and reduction kernels (test_reduce_scatter_kernels.py) start from: their buffers, flags and address tables, the
launches of their kernels (through the launchers the ops call: `overlap.kernels.launch_all_gather_matmul`,
`launch_matmul_scatter`, `launch_reduce_chunks`), and the judges of their results (every rank's output against
float64; a reduction's float64 sums with a rounding bound and the protocol state a call leaves behind).

W virtual ranks live in one process (virtual.py), each with its own stream, its own symmetric buffer (a plain
device tensor, NaN until written) and its own flags (starting at the previous call's epoch); the address tables
are int64 tensors of their ``data_ptr()``, laid out as the ops lay out their heaps.

`GatherGroup`: `all_gather_matmul`'s fused strategy. Every rank's shard ``[m, k]`` in its buffer, one ready
flag per rank; every rank's kernel reads every shard through the table.

`ScatterGroup`: the fused reduce-scatter strategies; a slot of regions per rank, a flag pad (int32
``[MAX_FLAGS]``) and chunk counters. Layouts (`Layout.kind`):

* ``rs``: `matmul_reduce_scatter`'s fused strategy. ``a`` has ``W * m`` rows; rank ``r`` stores block
  ``d`` of its partial into region ``r`` of ``d``'s slot and flags ``d * F + chunk`` in its own pad
  (``F = MAX_FLAGS // W``); rank ``d`` sums its ``W`` regions in rank order.
* ``ar2``: the reduce-scatter half of `matmul_all_reduce`'s two-shot fused strategy: any row count,
  blocks of ``ceil(M / W)`` rows (the last ones short or empty), ``F = MAX_FLAGS // (W + 1)``.
* ``ar1``: the one-shot all-reduce: one destination (the rank's own slot), flags ``0 .. nch-1``; every
  rank sums every rank's slot.

The tests' cases are sized for where they run: a GPU (the kernels' real tiles, sizes that take milliseconds) or
the CPU (the Triton interpreter, 32x32x32 tiles, tiny sizes). `sized_params` makes one pytest parameter of each
case, named by what it runs, and `sized_for` skips a case on the other kind of device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import pytest
import torch
from overlap.kernels.all_gather_matmul import all_gather_matmul_grid, launch_all_gather_matmul
from overlap.kernels.host import cdiv, fused_tiles
from overlap.kernels.matmul_reduce_scatter import (
    chunk_count,
    launch_matmul_scatter,
    launch_reduce_chunks,
    reduce_chunks_grid,
)
from overlap.kernels.slots import region_bytes

from overlap import symm
from tests.gpu.tolerance import (
    BLOCK_RTOL,
    FP32_ACCUMULATE,
    TF32_BLOCK_RTOL,
    TF32_ROUNDOFF,
    UNIT_ROUNDOFF,
    compare,
    compare_bound,
    err_text,
    verdict,
)
from tests.gpu.virtual import Device, EpochWords, Tile

# ==============================================================================================
# Cases sized for a GPU or for the interpreter
# ==============================================================================================

GPU, CPU = "gpu", "cpu"
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
B_IDS = {"w.t()": "b=w.t", "row-major": "b=kn"}  # b a transposed [n, k] weight (as nn.Linear's), or a plain [k, n]


def shape_id(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def sized_params(cases: Sequence[tuple], describe: Callable[..., str]) -> list:
    """One pytest parameter per ``(GPU or CPU, *args)`` case: the args, named ``describe(*args)``; a GPU-sized case
    is marked ``cuda`` (skipped on the CPU)."""
    return [pytest.param(case, id=describe(*case[1:]), marks=[pytest.mark.cuda] if case[0] == GPU else [])
            for case in cases]


def sized_for(dev: Device, case: tuple) -> tuple:
    """A case's args, after skipping an interpreter-sized case on a GPU (which runs the GPU-sized ones)."""
    if case[0] == CPU and dev.cuda:
        pytest.skip("sized for the Triton interpreter: a GPU runs the GPU-sized cases")
    return case[1:]


def cases_for(dev: Device, cases: Sequence[tuple]) -> list[tuple]:
    """The args of every case sized for `dev`'s kind of device, in order."""
    return [case[1:] for case in cases if (case[0] == GPU) == dev.cuda]


KINDS = {"rs": "reduce-scatter", "ar2": "all-reduce two-shot (its reduce-scatter)", "ar1": "all-reduce one-shot"}


# ==============================================================================================
# The all-gather layout: one shard and one ready flag per rank
# ==============================================================================================


@dataclasses.dataclass
class GatherGroup:
    """W virtual ranks: shards, symmetric buffers, flag words, pointer tables, one stream each.

    Shape legend: ``m`` rows per rank, ``k`` inner dim, ``n`` columns; ``b`` is ``[k, n]``.
    """

    dev: Device
    shards: list[torch.Tensor]  # [m, k] the rows each rank contributes (fresh random)
    buffers: list[torch.Tensor]  # [m, k] each rank's symmetric buffer, NaN until its shard is copied in
    flags: list[torch.Tensor]  # int32 [4] each rank's flag word at [0] (own allocation, as on real ranks)
    ptr_table: torch.Tensor  # int64 [W]: buffers[r].data_ptr()
    flag_table: torch.Tensor  # int64 [W]: flags[r].data_ptr()
    b: torch.Tensor
    streams: list[torch.cuda.Stream | None]
    epochs: EpochWords  # the words of epochs stale .. stale + 2, made here (before any gate)
    runs: int = 0  # a gather dim past the first: each shard lands in runs of this many rows (0: one run)

    @classmethod
    def create(cls, dev: Device, world_size: int, m: int, k: int, n: int, dtype: torch.dtype,
               stale: int, b_layout: str = "w.t()", runs: int = 0) -> GatherGroup:
        """Flags start at `stale` (a previous call's epoch), not 0: consumers must wait for >= epoch. `runs`: the
        output interleaves the shards in runs of that many rows (`overlap.ops.tp.rows.Rows`)."""
        d = dev.device
        shards = [torch.randn(m, k, device=d, dtype=dtype) / math.sqrt(k) for _ in range(world_size)]
        b = torch.randn(n, k, device=d, dtype=dtype).t() if b_layout == "w.t()" else torch.randn(k, n, device=d,
                                                                                                 dtype=dtype)
        buffers = [torch.full((m, k), math.nan, device=d, dtype=dtype) for _ in range(world_size)]
        flags = [torch.full((4,), stale, device=d, dtype=torch.int32) for _ in range(world_size)]
        ptr_table = torch.tensor([t.data_ptr() for t in buffers], dtype=torch.int64, device=d)
        flag_table = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=d)
        streams, epochs = [dev.stream() for _ in range(world_size)], EpochWords(stale, d)
        dev.idle("setting up virtual ranks")  # the streams below must see these writes
        return cls(dev, shards, buffers, flags, ptr_table, flag_table, b, streams, epochs, runs)

    @property
    def world_size(self) -> int:
        return len(self.shards)

    def reference(self) -> torch.Tensor:
        """The unfused result ``torch.cat(shards) @ b``, in float64 (with `runs`: ``torch.cat(dim=1)`` of the shards
        seen as ``[m / runs, runs, k]``, as a batch-first gather of the sequence lays them out)."""
        if self.runs:
            full = torch.cat([s.view(-1, self.runs, s.shape[1]) for s in self.shards], dim=1)
            return full.reshape(-1, full.shape[-1]).double() @ self.b.double()
        return torch.cat(self.shards).double() @ self.b.double()

    def produce(self, rank: int, epoch: int) -> None:
        """Rank `rank` copies its shard into its buffer, then flags it (ordered after the copy)."""
        with self.dev.on(self.streams[rank]):
            self.buffers[rank].copy_(self.shards[rank])
        self.dev.publish(self.flags[rank], epoch, self.streams[rank])

    def fill_buffers(self) -> None:
        """Copy every shard into its buffer without flagging it (the racing and timeout checks)."""
        for r in range(self.world_size):
            self.buffers[r].copy_(self.shards[r])
        self.dev.idle("filling buffers")


@dataclasses.dataclass
class Consumer:
    """What one rank's all-gather kernel writes."""

    out: torch.Tensor  # [W*m, n], NaN-poisoned
    err: torch.Tensor  # int32 [1]: src + 1 of a tile whose wait timed out (any of them: a plain store)
    abort: torch.Tensor  # int32 [1]: the interpreter's abort word


def new_consumer(g: GatherGroup) -> Consumer:
    """A rank's NaN-poisoned output ``[W*m, n]`` and zero error and abort words."""
    (m, _), n, d = g.shards[0].shape, g.b.shape[1], g.dev.device
    out = torch.full((g.world_size * m, n), math.nan, device=d, dtype=g.shards[0].dtype)
    return Consumer(out, torch.zeros(1, dtype=torch.int32, device=d), torch.zeros(1, dtype=torch.int32, device=d))


def gather_grid(g: GatherGroup, tile: Tile) -> int:
    """Programs of one rank's kernel (`launch_gather`) at `tile`."""
    (m, _), n = g.shards[0].shape, g.b.shape[1]
    return all_gather_matmul_grid(g.world_size, m, n, tile.block_m, tile.block_n)


def launch_gather(g: GatherGroup, rank: int, c: Consumer, epoch: int, timeout_ns: int, tile: Tile) -> None:
    """Virtual rank `rank`'s fused kernel on the current stream, through the launcher `all_gather_matmul`'s fused
    strategy calls. Interpreted, nothing here bounds its spins: the caller sets the abort word (a watchdog) where
    a flag may never come."""
    launch_all_gather_matmul(g.b, g.ptr_table, g.flag_table, rows=g.shards[0].shape[0],
                             epoch=g.epochs(epoch), rank=rank,
                             err=c.err, timeout_ns=timeout_ns, block=(tile.block_m, tile.block_n, tile.block_k),
                             out=c.out, abort=c.abort, watchdog=False, num_warps=tile.num_warps,
                             num_stages=tile.num_stages, rows_per_outer=g.runs or None)


def judge_consumers(consumers: list[Consumer], ref: torch.Tensor, expect_err: int = 0,
                    problems: list[str] | None = None, note: str = "") -> None:
    """The verdict (tolerance.verdict): every consumer's output within its dtype's tolerance of `ref` (float64), its
    error word `expect_err`, and no problem in `problems` (the caller's)."""
    problems = list(problems or [])
    worst_err, worst_rel = 0.0, 0.0
    for r, c in enumerate(consumers):
        ok, max_err, rel = compare(c.out, ref)
        if not ok and not math.isfinite(max_err):
            max_err, rel = math.inf, math.inf  # NaN left in the output: a tile was never written
        worst_err, worst_rel = max(worst_err, max_err), max(worst_rel, rel)
        if not ok:
            problems.append(f"rank {r}: output off ({err_text(max_err, rel)})")
        if int(c.err.item()) != expect_err:
            problems.append(f"rank {r}: err word {int(c.err.item())}, expected {expect_err}")
    verdict(problems, err_text(worst_err, worst_rel) + (f"; {note}" if note else ""), max_err=worst_err,
            rel=worst_rel)

# ==============================================================================================
# The reduce-scatter layouts: regions per writer, flags per chunk, counters
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a call's partials go: see the module docstring. ``rows`` is dim 0 of every rank's ``a``."""

    kind: str
    world_size: int
    rows: int
    runs: int = 0  # "rs" scattering a dim past the first: the blocks interleave in runs of this many rows

    @property
    def num_dest(self) -> int:
        return 1 if self.kind == "ar1" else self.world_size

    @property
    def block_rows(self) -> int:
        return self.rows if self.kind == "ar1" else cdiv(self.rows, self.world_size)

    @property
    def flag_stride(self) -> int:
        """Flags per destination in a producer's pad (0: one destination)."""
        return {"rs": symm.MAX_FLAGS // self.world_size, "ar2": symm.MAX_FLAGS // (self.world_size + 1),
                "ar1": 0}[self.kind]

    @property
    def max_chunks(self) -> int:
        return symm.MAX_FLAGS if self.kind == "ar1" else self.flag_stride

    def flag_index(self, rank: int) -> int:
        """First ready flag (in every producer's pad) that rank `rank`'s reduction waits on."""
        return rank * self.flag_stride

    def rows_of(self, a: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of `a` (a rank's ``[rows, k]``) whose products rank `rank` reduces."""
        if self.runs:
            return a.view(-1, self.world_size, self.runs, a.shape[1])[:, rank].reshape(-1, a.shape[1])
        lo, hi = self.block(rank)
        return a[lo:hi]

    def block(self, rank: int) -> tuple[int, int]:
        """Rows of the result rank `rank` reduces."""
        if self.kind == "ar1":
            return 0, self.rows
        mb = self.block_rows
        return min(rank * mb, self.rows), min((rank + 1) * mb, self.rows)


@dataclasses.dataclass
class ScatterGroup:
    """W virtual ranks: inputs, slots, flag pads, counters, address tables, outputs, one stream each.

    Shape legend: every rank's ``a`` is ``[rows, k]``, its ``b`` ``[k, n]``; a slot holds `regions` regions
    of ``[block_rows, n]``, each `rb` bytes (16-byte aligned, `region_bytes`)."""

    dev: Device
    lay: Layout
    dtype: torch.dtype
    b_layout: str
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    slots: list[torch.Tensor]  # uint8 [regions * rb]
    flags: list[torch.Tensor]  # int32 [MAX_FLAGS]
    counters: list[torch.Tensor]  # int32 [num_dest * nch]
    outs: list[torch.Tensor]  # [rows of block r, n], NaN-poisoned
    errs: list[torch.Tensor]  # int32 [1]: src + 1 of a wait that timed out
    aborts: list[torch.Tensor]  # int32 [1]: the interpreter's abort word
    dst_tables: list[torch.Tensor]  # int64 [num_dest]: where rank r's block d goes
    src_tables: list[torch.Tensor]  # int64 [W]: what rank r's reduction sums
    flag_base: torch.Tensor  # int64 [W]: every rank's pad (the producers' flag table)
    reduce_flags: list[torch.Tensor]  # int64 [W]: every pad + rank r's first flag
    streams: list[torch.cuda.Stream | None]
    tile: tuple[int, int, int]
    nch: int
    rb: int
    epochs: EpochWords  # the words of epochs stale .. stale + 2, made here (before any gate)

    @classmethod
    def create(cls, dev: Device, lay: Layout, k: int, n: int, dtype: torch.dtype, num_chunks: int, stale: int,
               b_layout: str = "w.t()") -> ScatterGroup:
        d, W = dev.device, lay.world_size
        interpreted = not dev.cuda
        tile = fused_tiles(0, 0, 0, interpreted, dtype)  # the op's default tiles
        nch = chunk_count(num_chunks, lay.max_chunks, lay.block_rows, tile[0])  # as `scatter_and_reduce` counts
        rb = region_bytes(lay.block_rows, n, dtype)
        regions = 1 if lay.kind == "ar1" else W
        slots = [torch.empty(regions * rb, dtype=torch.uint8, device=d) for _ in range(W)]
        for s in slots:
            assert s.data_ptr() % 16 == 0, "the kernels assume 16-byte aligned slots"
            s.view(dtype).fill_(math.nan)
        flags = [torch.full((symm.MAX_FLAGS,), stale, dtype=torch.int32, device=d) for _ in range(W)]
        addr = [s.data_ptr() for s in slots]
        if lay.kind == "ar1":
            dst = [[addr[r]] for r in range(W)]
            src = [addr for _ in range(W)]
        else:
            dst = [[addr[q] + r * rb for q in range(W)] for r in range(W)]
            src = [[addr[r] + s * rb for s in range(W)] for r in range(W)]

        def table(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=d)

        g = cls(
            dev=dev, lay=lay, dtype=dtype, b_layout=b_layout, a=[], b=[], slots=slots, flags=flags,
            counters=[torch.zeros(lay.num_dest * nch, dtype=torch.int32, device=d) for _ in range(W)],
            outs=[], errs=[torch.zeros(1, dtype=torch.int32, device=d) for _ in range(W)],
            aborts=[torch.zeros(1, dtype=torch.int32, device=d) for _ in range(W)],
            dst_tables=[table(x) for x in dst], src_tables=[table(x) for x in src],
            flag_base=table([f.data_ptr() for f in flags]),
            reduce_flags=[table([f.data_ptr() + 4 * lay.flag_index(r) for f in flags]) for r in range(W)],
            streams=[dev.stream() for _ in range(W)], tile=tile, nch=nch, rb=rb, epochs=EpochWords(stale, d),
        )
        g.new_inputs(k, n)
        return g

    def new_inputs(self, k: int, n: int) -> None:
        """Fresh random ``a``, ``b`` on every rank, poisoned outputs, cleared error words."""
        d, dtype = self.dev.device, self.dtype
        self.a = [torch.randn(self.lay.rows, k, device=d, dtype=dtype) / math.sqrt(k)
                  for _ in range(self.lay.world_size)]
        self.b = [torch.randn(n, k, device=d, dtype=dtype).t() if self.b_layout == "w.t()"
                  else torch.randn(k, n, device=d, dtype=dtype) for _ in range(self.lay.world_size)]
        self.outs = []
        for r in range(self.lay.world_size):
            lo, hi = self.lay.block(r)
            self.outs.append(torch.full((hi - lo, n), math.nan, device=d, dtype=dtype))
        for e in self.errs:
            e.zero_()
        self.dev.idle("new inputs")  # the streams below must see these writes

    def poison(self) -> None:
        """Slots and outputs NaN again, error words cleared (after a warm-up wrote them)."""
        for s in self.slots:
            s.view(self.dtype).fill_(math.nan)
        for out in self.outs:
            out.fill_(math.nan)
        for e in self.errs:
            e.zero_()
        self.dev.idle("poisoned again")

    @property
    def world_size(self) -> int:
        return self.lay.world_size

    @property
    def n(self) -> int:
        return self.b[0].shape[1]

    def region(self, owner: int, writer: int) -> torch.Tensor:
        """The ``[block_rows, n]`` region of `owner`'s slot that `writer`'s partial goes to."""
        start = 0 if self.lay.kind == "ar1" else writer * self.rb
        nbytes = self.lay.block_rows * self.n * self.a[0].element_size()
        return self.slots[owner][start : start + nbytes].view(self.dtype).view(self.lay.block_rows, self.n)

    def flag_words(self, producer: int) -> list[int]:
        """Indices of the ready flags in `producer`'s pad that this call's reductions wait on."""
        per_dest = range(self.nch)
        if self.lay.kind == "ar1":
            return list(per_dest)
        return [self.lay.flag_index(q) + c for q in range(self.world_size) for c in per_dest]

    def all_flag_words(self) -> list[torch.Tensor]:
        """One-word views of every awaited flag (what a settle watchdog writes to release waits)."""
        return [self.flags[p][i : i + 1] for p in range(self.world_size) for i in self.flag_words(p)]

    def exact(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s result in float64 and its rounding bound: every partial rounded once when stored,
        added in float32 (``W`` roundings at most) and rounded once more when the sum is stored, each GEMM
        accumulated in float32 (twice the textbook bound: tensor cores may truncate), TF32 inputs where a
        GPU runs a fp32 dot. A partial that is missing, stale or added twice is off by a whole term."""
        mine = [self.lay.rows_of(a, rank).double() for a in self.a]
        parts = [x @ b.double() for x, b in zip(mine, self.b, strict=True)]
        total = sum(parts)
        terms = sum(x.abs() @ b.double().abs() for x, b in zip(mine, self.b, strict=True))
        u = UNIT_ROUNDOFF[self.dtype]
        if not self.dev.cuda and self.dtype == torch.bfloat16:
            u *= 2  # Triton 3.9's interpreter truncates fp32 -> bf16 (`.to`): up to one ulp, not half
        k = self.a[0].shape[1]
        per_term = 2 * (k + 2) * FP32_ACCUMULATE + (2.5 * TF32_ROUNDOFF if self.tf32 else 0.0)
        partials = sum(p.abs() for p in parts)
        bound = (u + self.world_size * FP32_ACCUMULATE) * partials + u * total.abs() + per_term * terms
        return total, bound * 1.01 + 1e-30

    @property
    def tf32(self) -> bool:
        return self.dev.cuda and self.dtype == torch.float32

    def block_rtol(self) -> float:
        return TF32_BLOCK_RTOL if self.tf32 else BLOCK_RTOL[self.dtype]


def reduce_grid(g: ScatterGroup) -> int:
    bm, bn, _ = g.tile
    return reduce_chunks_grid(g.lay.block_rows, g.n, bm, bn)


def launch_scatter(g: ScatterGroup, rank: int, epoch: int) -> None:
    """Rank `rank`'s producer kernel on the current stream, through the launcher `scatter_and_reduce` calls."""
    launch_matmul_scatter(g.a[rank], g.b[rank], g.dst_tables[rank], g.counters[rank], g.flag_base,
                          block_rows=g.lay.block_rows, num_chunks=g.nch, flag_stride=g.lay.flag_stride,
                          epoch=g.epochs(epoch), rank=rank, block=g.tile,
                          rows_per_outer=g.lay.runs or None)


def launch_reduce(g: ScatterGroup, rank: int, epoch: int, timeout_ns: int, watchdog: bool = True) -> None:
    """Rank `rank`'s reduction kernel on the current stream, through the launcher `reduce_sources` calls.

    Interpreted, its spins end when the abort word is set: a watchdog sets it after `timeout_ns` (as
    `reduce_sources` does), unless the caller bounds the launch itself (`watchdog=False`)."""
    bm, bn, _ = g.tile
    launch_reduce_chunks(g.outs[rank], g.src_tables[rank], g.reduce_flags[rank], block_rows=g.lay.block_rows,
                         num_chunks=g.nch, epoch=g.epochs(epoch), err=g.errs[rank],
                         timeout_ns=timeout_ns, block=(bm, bn),
                         abort=g.aborts[rank], watchdog=watchdog)


def judge_outputs(g: ScatterGroup, problems: list[str]) -> tuple[float, float]:
    """Every rank's output against its float64 sum, and its error word (0); (worst error, worst block)."""
    worst_err, worst_rel = 0.0, 0.0
    for r, out in enumerate(g.outs):
        exact, bound = g.exact(r)
        ok, max_err, rel = compare_bound(out, exact, bound, g.block_rtol())
        if not math.isfinite(max_err):
            max_err, rel = math.inf, math.inf  # NaN left in the output: a tile was never written
        worst_err, worst_rel = max(worst_err, max_err), max(worst_rel, rel)
        if not ok:
            over = "" if not math.isfinite(max_err) else f", {int((out.double() - exact).abs().gt(bound).sum())} " \
                                                          "elements past the rounding bound"
            problems.append(f"rank {r}: output off (max {max_err:.1e}, worst 64x64 block rel {rel:.1e}{over})")
        if int(g.errs[r].item()) != 0:
            problems.append(f"rank {r}: err word {int(g.errs[r].item())}, expected 0")
    return worst_err, worst_rel


def check_protocol_state(g: ScatterGroup, epoch: int, problems: list[str]) -> None:
    """After a call: every chunk counter back at 0 (the next call reuses them), every awaited flag at `epoch`."""
    for r in range(g.world_size):
        if int(g.counters[r].abs().sum()):
            problems.append(f"rank {r}: chunk counters not reset: {g.counters[r].tolist()}")
        got = g.flags[r][g.flag_words(r)]
        if not bool((got == epoch).all()):
            problems.append(f"rank {r}: ready flags {got.tolist()}, expected all {epoch}")
