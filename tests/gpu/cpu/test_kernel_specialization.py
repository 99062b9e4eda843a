"""Tier 1: Triton compiles one variant of each kernel for every epoch, rank, world size, timeout and row count
(no compilation per call or per rank), and the one-GPU check's launches compile a bounded number of variants.

No GPU: the launchers run with CPU tensors while every kernel is replaced by a recorder that computes the key
Triton looks a compiled variant up by on an sm_90 GPU (`tests.support.launch_specs`). Triton specializes an int
argument on being 1 and on being a multiple of 16, so a plain int epoch compiled again at epochs 1 and 16 and
a plain int rank once per rank class: the epoch is a device word, and ``do_not_specialize`` covers the values
that differ between ranks and calls. Sizes and strides that set the GEMMs' vector loads stay specialized
(tests/gpu/cpu/test_kernels_aot.py shows the 16-byte loads they buy).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from overlap.ops.fused import kernels as _kernel_modules  # noqa: E402
from tests.support.launch_specs import BACKEND, Launch, recording  # noqa: E402

_k = _kernel_modules()  # the kernel files, one per op
ag, agw, rs = _k.all_gather_matmul, _k.all_gather_weight_matmul, _k.matmul_reduce_scatter
gwait, gscatter = _k.dispatch_grouped_matmul, _k.grouped_matmul_combine

ROOT = Path(__file__).resolve().parents[3]
EPOCHS = (1, 16, 17, (1 << 20) + 5)
WORLD_SIZES = (1, 2, 3, 4, 8)
TIMEOUTS_NS = (200_000_000, 10_000_000_000, 30 * 10**9)  # int32 and int64 values: the type must not change
SLOTS = 4  # the heap's epoch words are 4 bytes apart: every pointer alignment mod 16
i32, i64 = torch.int32, torch.int64


def _epoch(value: int, slot: int) -> torch.Tensor:
    """`value` in slot `slot`'s word of a heap-like ``[SLOTS]`` tensor (a view at byte offset ``4 * slot``)."""
    words = torch.zeros(SLOTS, dtype=i32)
    words[slot] = value
    return words[slot : slot + 1]


def _record(kernel: str, calls: list[Callable[[], None]]) -> list[Launch]:
    with recording() as recorders:
        for call in calls:
            call()
    launches = recorders[kernel].launches
    assert len(launches) == len(calls), f"{kernel}: {len(launches)} launches for {len(calls)} calls"
    return launches


def _one_key(kernel: str, calls: list[Callable[[], None]]) -> None:
    launches = _record(kernel, calls)
    keys = {launch.key for launch in launches}
    assert len(keys) == 1, f"{kernel}: {len(keys)} variants over {len(launches)} launches:\n" + "\n".join(sorted(keys))


def _per_call() -> list[tuple[int, int, int, int, int]]:
    """(world size, rank, epoch, slot, timeout) combinations: every world size, its first, second and last
    rank, every epoch class, every slot alignment, both timeout types."""
    out = []
    for w in WORLD_SIZES:
        for r, e, t in itertools.product(sorted({0, min(1, w - 1), w - 1}), EPOCHS, TIMEOUTS_NS):
            out.append((w, r, e, (r + e) % SLOTS, t))
    return out


# ----------------------------------------------------------------------------------------------
# One variant per kernel, whatever the epoch, rank, world size, timeout or row count
# ----------------------------------------------------------------------------------------------


def test_all_gather_matmul_compiles_once_for_every_call_and_rank():
    b = torch.empty(512, 256, dtype=torch.bfloat16)
    calls = [lambda w=w, r=r, e=e, s=s, t=t, m=m: ag.launch_all_gather_matmul(
        b, torch.zeros(w, dtype=i64), torch.zeros(w, dtype=i64), rows=m, epoch=_epoch(e, s), rank=r,
        err=torch.zeros(1, dtype=i32), timeout_ns=t, block=(128, 128, 64))
        for (w, r, e, s, t), m in zip(_per_call(), itertools.cycle((1, 16, 100, 1024)))]
    _one_key("all_gather_matmul_kernel", calls)


def test_all_gather_weight_matmul_compiles_once_for_every_call_and_rank():
    calls = [lambda w=w, r=r, e=e, s=s, t=t, m=m: agw.launch_all_gather_weight_matmul(
        torch.empty(m, 512, dtype=torch.bfloat16), torch.zeros(w, dtype=i64), torch.zeros(w, dtype=i64), n=256,
        epoch=_epoch(e, s), rank=r, err=torch.zeros(1, dtype=i32), timeout_ns=t, block=(128, 128, 64))
        for (w, r, e, s, t), m in zip(_per_call(), itertools.cycle((1, 16, 100, 1024)))]
    _one_key("all_gather_weight_matmul_kernel", calls)


def test_matmul_scatter_compiles_once_for_every_call_rank_and_layout():
    """Reduce-scatter (one block per rank) and one-shot all-reduce (one block), any chunk count and flag
    stride, uneven last blocks."""
    b = torch.empty(256, 512, dtype=torch.bfloat16)
    calls = []
    for (w, r, e, s, _), kind, rows in zip(_per_call(), itertools.cycle(("rs", "ar1")), itertools.cycle((1, 96, 200))):
        dest = 1 if kind == "ar1" else w
        block_rows = rows if kind == "ar1" else -(-rows // w)
        a = torch.empty(rows, 256, dtype=torch.bfloat16)
        nch = 1 + (r + e) % min(4, -(-block_rows // 128))
        calls.append(lambda a=a, w=w, r=r, e=e, s=s, dest=dest, block_rows=block_rows, nch=nch:
                     rs.launch_matmul_scatter(
                         a, b, torch.zeros(dest, dtype=i64), torch.zeros(256, dtype=i32), torch.zeros(w, dtype=i64),
                         block_rows=block_rows, num_chunks=nch, flag_stride=256 // (w + 1), epoch=_epoch(e, s),
                         rank=r, block=(128, 128, 64)))
    _one_key("matmul_scatter_kernel", calls)


def test_reduce_chunks_compiles_once_for_every_call_and_rank():
    """Every source count, chunk count and block; the last rank's block may be shorter (1 row, 17 rows)."""
    calls = []
    for (w, _, e, s, t), rows in zip(_per_call(), itertools.cycle((1, 16, 17, 96))):
        out = torch.empty(rows, 512, dtype=torch.bfloat16)
        calls.append(lambda out=out, w=w, e=e, s=s, t=t: rs.launch_reduce_chunks(
            out, torch.zeros(w, dtype=i64), torch.zeros(w, dtype=i64), block_rows=96, num_chunks=1 + e % 3,
            epoch=_epoch(e, s), err=torch.zeros(1, dtype=i32), timeout_ns=t, block=(32, 128)))
    _one_key("reduce_chunks_kernel", calls)


def test_moe_kernels_compile_once_for_every_call_and_rank():
    w = torch.empty(4, 256, 512, dtype=torch.bfloat16)
    out, rows = torch.empty(300, 512, dtype=torch.bfloat16), torch.empty(300, 256, dtype=torch.bfloat16)
    y = torch.empty(300, 256, dtype=torch.bfloat16)
    waits, scatters = [], []
    for (ws, r, e, s, t), tiles in zip(_per_call(), itertools.cycle((1, 5, 16))):
        def table(width: int, n: int = tiles) -> torch.Tensor:
            return torch.zeros(n, width, dtype=i32)

        waits.append(lambda ws=ws, e=e, s=s, t=t, tt=table(6): gwait.launch_grouped_matmul_wait(
            torch.zeros(ws, dtype=i64), torch.zeros(ws, dtype=i64), tt, w, out, rows, epoch=_epoch(e, s),
            err=torch.zeros(1, dtype=i32), timeout_ns=t, block=(128, 128, 64)))
        scatters.append(lambda ws=ws, r=r, e=e, s=s, tt=table(7): gscatter.launch_grouped_matmul_scatter(
            y, w, tt, torch.zeros(ws, dtype=i64), torch.zeros(256, dtype=i32), torch.zeros(ws, dtype=i64),
            epoch=_epoch(e, s), rank=r, block=(128, 128, 64)))
    _one_key("grouped_matmul_wait_kernel", waits)
    _one_key("grouped_matmul_scatter_kernel", scatters)


def test_sequence_parallel_kernels_compile_once_for_every_call_and_rank():
    """`matmul_all_to_all`'s producer and receiver copy, `all_to_all_matmul`'s consumer GEMM: every world size, rank,
    epoch, slot, timeout, chunk count and row count (0 rows too) share one variant per kernel (``C`` and the weight's
    shape stay specialized: the same here)."""
    from overlap.kernels import all_to_all_matmul as a2a_mm
    from overlap.kernels import matmul_all_to_all as mm_a2a

    producers, copies, gemms = [], [], []
    for (w, r, e, s, t), m in zip(_per_call(), itertools.cycle((0, 1, 17, 96, 1000))):
        nch = 1 + (r + e) % min(4, -(-max(m, 1) // 128))
        a, b = torch.empty(m, 256, dtype=torch.bfloat16), torch.empty(256, w * 128, dtype=torch.bfloat16)
        out, b2 = torch.empty(w, m, 128, dtype=torch.bfloat16), torch.empty(w * 128, 512, dtype=torch.bfloat16)
        table, tables = torch.zeros(w, dtype=i64), torch.zeros(w, dtype=i64)
        producers.append(lambda a=a, b=b, w=w, r=r, e=e, s=s, nch=nch, table=table: mm_a2a.launch_matmul_all_to_all(
            a, b, table, torch.zeros(256, dtype=i32), table, num_chunks=nch, flag_stride=256 // w, epoch=_epoch(e, s),
            rank=r, block=(128, 128, 64)))
        copies.append(lambda out=out, e=e, s=s, t=t, nch=nch, tables=tables: mm_a2a.launch_gather_blocks(
            out, tables, tables, num_chunks=nch, epoch=_epoch(e, s), err=torch.zeros(1, dtype=i32), timeout_ns=t,
            block=(128, 128)))
        gemms.append(lambda m=m, b2=b2, e=e, s=s, t=t, nch=nch, tables=tables: a2a_mm.launch_all_to_all_matmul(
            torch.empty(m, 512, dtype=torch.bfloat16), tables, tables, b2, num_chunks=nch, epoch=_epoch(e, s),
            err=torch.zeros(1, dtype=i32), timeout_ns=t, block=(128, 128, 64)))
    _one_key("matmul_all_to_all_kernel", producers)
    _one_key("gather_blocks_kernel", copies)
    _one_key("all_to_all_matmul_kernel", gemms)


def test_shapes_still_choose_the_variant():
    """What is left specialized on purpose: a K that is not a multiple of 16, or b transposed, is another
    variant (its loads differ); the rows and the epoch are not."""
    def launch(b: torch.Tensor, rows: int = 64, epoch: int = 1) -> Callable[[], None]:
        table = torch.zeros(2, dtype=i64)
        return lambda: ag.launch_all_gather_matmul(b, table, table, rows=rows, epoch=_epoch(epoch, 0), rank=0,
                                                        err=torch.zeros(1, dtype=i32), timeout_ns=1,
                                                        block=(64, 64, 32))

    row_major, ragged_k = torch.empty(1024, 512), torch.empty(1000, 512)
    transposed = torch.empty(512, 1024).t()
    base, other_k, other_layout, other_rows = _record("all_gather_matmul_kernel", [
        launch(row_major), launch(ragged_k), launch(transposed), launch(row_major, rows=17, epoch=16)])
    assert len({base.key, other_k.key, other_layout.key}) == 3
    assert other_rows.key == base.key
    assert base.spec_of("K") == ("i32", "D") and other_k.spec_of("K") == ("i32", "")
    assert base.spec_of("stride_bn") == ("constexpr", 1) and other_layout.spec_of("stride_bk") == ("constexpr", 1)
    for name in ("epoch_ptr", "rank", "world_size", "timeout_ns", "M"):
        assert base.spec_of(name)[1] is None, (name, base.spec_of(name))


# ----------------------------------------------------------------------------------------------
# The one-GPU check: how many variants its launches compile
# ----------------------------------------------------------------------------------------------


def _as_before(launch: Launch) -> str:
    """The key this launch had before issue 17: the epoch an int argument and every value now in
    ``do_not_specialize`` specialized (on 1 and on multiples of 16), as Triton does by default."""
    from triton.runtime.jit import native_specialize_impl

    extra = []
    for p in launch.jit.params:
        if not p.do_not_specialize:
            continue
        value = launch.bound[p.name]
        if p.name == "epoch_ptr":
            value = int(value[0])
        extra.append(tuple(native_specialize_impl(BACKEND, value, False, True, True)))
    return launch.key + repr(extra)


def _gpu_check_launches() -> list[Launch]:
    """Every fused-kernel launch of the GPU check on one GPU, with the arguments it passes: the GPU cases of the
    kernel tests (tests/gpu: test_all_gather_kernels, test_reduce_scatter_kernels, test_moe_*_kernel; keep in
    step with their case tables) and of the timings (tests/gpu/timings.py), through the same launchers, tiles,
    layouts, ranks, epochs and timeouts, on CPU tensors of the same shapes (never touched)."""
    from overlap.benchmarks.names import MOE_PRESETS
    from tests.gpu.timings import AG_TILES, MOE_TILES, MOE_TIMED, tp_shapes
    from tests.gpu.tp_ranks import Layout
    from tests.gpu.virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Tile

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    calls: list[Callable[[], None]] = []
    err = torch.zeros(1, dtype=i32)

    def op_tile(dtype):
        return (128, 128, 64) if dtype != f32 else (128, 64, 32)

    def weight(k: int, n: int, dtype, layout: str) -> torch.Tensor:
        transposed = layout in ("w.t()", "transposed")
        return torch.empty(n, k, dtype=dtype).t() if transposed else torch.empty(k, n, dtype=dtype)

    # -- all-gather GEMM: ordered, racing, timeout; the timings over every tile -------------------------------
    def gather(w, m, k, n, dtype, layout, epoch, timeout, tile, ranks=None):
        b, table = weight(k, n, dtype, layout), torch.zeros(w, dtype=i64)
        for r in range(w) if ranks is None else ranks:
            calls.append(lambda b=b, r=r, table=table: ag.launch_all_gather_matmul(
                b, table, table, rows=m, epoch=_epoch(epoch, 0), rank=r, err=err, timeout_ns=timeout,
                block=(tile.block_m, tile.block_n, tile.block_k), num_warps=tile.num_warps, num_stages=tile.num_stages))

    dev_tile = Tile(128, 128, 64)
    for w, ((m, k, n), layout) in itertools.product((2, 4), (((256, 1024, 512), "w.t()"),
                                                              ((100, 1000, 300), "row-major"))):
        gather(w, m, k, n, bf16, layout, 7, KERNEL_TIMEOUT_NS, dev_tile)
    for w in (2, 4):
        gather(w, 128, 512, 256, bf16, "w.t()", 9, KERNEL_TIMEOUT_NS, dev_tile)
    gather(2, 64, 256, 128, bf16, "w.t()", 5, SHORT_TIMEOUT_NS, dev_tile, ranks=[0])
    for (_, (m, k, n)), tile in itertools.product(tp_shapes()["ag"], AG_TILES):
        gather(8, m, k, n, bf16, "w.t()", 3, KERNEL_TIMEOUT_NS, tile, ranks=[0])

    # -- GEMM + reduce-scatter / all-reduce: ordered twice, racing, timeout; the timings ----------------------
    def scatter_reduce(kind, w, rows, k, n, dtype, layout, epochs, timeout, num_chunks, ranks=None):
        lay, (bm, bn, bk) = Layout(kind, w, rows), op_tile(dtype)
        nch = rs.chunk_count(num_chunks, lay.max_chunks, lay.block_rows, bm)
        a, b = torch.empty(rows, k, dtype=dtype), weight(k, n, dtype, layout)
        tables = torch.zeros(w, dtype=i64)
        for epoch, r in itertools.product(epochs, range(w) if ranks is None else ranks):
            lo, hi = lay.block(r)
            calls.append(lambda a=a, b=b, r=r, epoch=epoch: rs.launch_matmul_scatter(
                a, b, torch.zeros(lay.num_dest, dtype=i64), torch.zeros(256, dtype=i32), tables,
                block_rows=lay.block_rows, num_chunks=nch, flag_stride=lay.flag_stride, epoch=_epoch(epoch, 0),
                rank=r, block=(bm, bn, bk)))
            calls.append(lambda r=r, epoch=epoch, out=torch.empty(hi - lo, n, dtype=dtype):
                         rs.launch_reduce_chunks(out, tables, tables, block_rows=lay.block_rows, num_chunks=nch,
                                                      epoch=_epoch(epoch, 0), err=err, timeout_ns=timeout,
                                                      block=(bm, bn)))

    ordered = [("rs", w, (w * 256, 512, 384), bf16, "w.t()") for w in (2, 3, 4)]
    ordered += [("rs", 4, (400, 1000, 300), bf16, "row-major"), ("rs", 2, (512, 512, 384), f16, "w.t()"),
                ("rs", 2, (512, 512, 384), f32, "w.t()"), ("ar2", 3, (1000, 512, 384), bf16, "w.t()"),
                ("ar2", 4, (130, 256, 200), bf16, "row-major"), ("ar1", 2, (256, 512, 384), bf16, "w.t()"),
                ("ar1", 4, (100, 1000, 300), bf16, "row-major")]
    for kind, w, (rows, k, n), dtype, layout in ordered:
        scatter_reduce(kind, w, rows, k, n, dtype, layout, (7, 8), KERNEL_TIMEOUT_NS, 2)
    for kind, w, (rows, k, n) in (("rs", 2, (512, 512, 256)), ("rs", 4, (1024, 512, 256)),
                                  ("ar1", 4, (256, 512, 256))):
        scatter_reduce(kind, w, rows, k, n, bf16, "w.t()", (9,), KERNEL_TIMEOUT_NS, 2)
    scatter_reduce("rs", 2, 256, 256, 256, bf16, "w.t()", (5,), SHORT_TIMEOUT_NS, 1, ranks=[0])
    for kind in ("rs", "ar1"):
        for _, (rows, k, n) in tp_shapes()[kind]:
            scatter_reduce(kind, 8, rows, k, n, bf16, "w.t()", (3,), KERNEL_TIMEOUT_NS, 1, ranks=[0])

    # -- MoE: dispatch ordered, racing, timeout; combine ordered twice, racing; the timings -----------------
    def moe(w, hidden, ffn, dtype, layout, wait_epochs, timeout, scatter_epochs, ranks=None, tiles=(None,)):
        # one local expert: the strides of w[e] and between experts are those of any L
        w1, w2 = weight(hidden, ffn, dtype, layout).unsqueeze(0), weight(ffn, hidden, dtype, layout).unsqueeze(0)
        out, rows = torch.empty(64, ffn, dtype=dtype), torch.empty(64, hidden, dtype=dtype)
        y, table = torch.empty(64, ffn, dtype=dtype), torch.zeros(w, dtype=i64)
        for _, epoch, tile in itertools.product(range(w) if ranks is None else ranks, wait_epochs, tiles):
            block = op_tile(dtype) if tile is None else (tile.block_m, tile.block_n, tile.block_k)
            options = {} if tile is None else {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
            calls.append(lambda epoch=epoch, block=block, options=options: gwait.launch_grouped_matmul_wait(
                table, table, torch.zeros(3, 6, dtype=i32), w1, out, rows, epoch=_epoch(epoch, 0), err=err,
                timeout_ns=timeout, block=block, **options))
        for r, epoch in itertools.product(range(w) if ranks is None else ranks, scatter_epochs):
            calls.append(lambda r=r, epoch=epoch: gscatter.launch_grouped_matmul_scatter(
                y, w2, torch.zeros(3, 7, dtype=i32), table, torch.zeros(256, dtype=i32), table,
                epoch=_epoch(epoch, 0), rank=r, block=op_tile(dtype)))

    for w, hidden, ffn, dtype, layout in ((4, 512, 384, bf16, "stacked"), (8, 256, 512, bf16, "transposed"),
                                          (8, 256, 128, bf16, "stacked"), (4, 200, 136, f16, "transposed")):
        moe(w, hidden, ffn, dtype, layout, (7,), KERNEL_TIMEOUT_NS, (7, 8))
    moe(4, 256, 256, bf16, "stacked", (9,), KERNEL_TIMEOUT_NS, (9,))  # racing
    moe(2, 256, 128, bf16, "stacked", (5,), SHORT_TIMEOUT_NS, (), ranks=[0])  # timeout
    for name in MOE_TIMED:
        s = MOE_PRESETS[name][0]
        moe(8, s.hidden, s.ffn, bf16, "stacked", (3,), KERNEL_TIMEOUT_NS, (3,), ranks=[0], tiles=(None, *MOE_TILES))

    with recording() as recorders:
        for call in calls:
            call()
    launches = [launch for r in recorders.values() for launch in r.launches]
    assert len(launches) == len(calls)
    return launches


#: Variants the one-GPU check's launches compile: one per kernel, dtype, tile and launch options, and class of
#: shape (sizes divisible by 16 or not, operand layout). The same launches compiled 59 before issue 17, when
#: every epoch, rank, world size, row count and timeout class was one more.
GPU_CHECK_VARIANTS = 22


def test_gpu_check_compiles_a_bounded_number_of_variants():
    launches = _gpu_check_launches()
    now = {(launch.kernel, launch.key) for launch in launches}
    before = {(launch.kernel, _as_before(launch)) for launch in launches}
    by_kernel = {k: sum(1 for kernel, _ in now if kernel == k) for k in sorted({k for k, _ in now})}
    print(f"\n{len(launches)} launches: {len(now)} variants now {by_kernel}, {len(before)} before issue 17")
    assert len(now) <= GPU_CHECK_VARIANTS, f"{len(now)} variants (bound {GPU_CHECK_VARIANTS}): {by_kernel}"
    assert len(now) < len(before), (len(now), len(before))
