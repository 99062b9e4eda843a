"""Tier 3: the Triton kernels compile ahead of time for Hopper (sm_90) with no GPU, as their launchers launch
them (the same specialization): GEMMs on wgmma fed by 16-byte loads, flags with system-scope acquire/release,
waits bounded by %globaltimer that every warp leaves on the same iteration (`tests.support.ptx_flow`). Also
without a GPU: the kernels' launchers refuse bad arguments (ValueError with the values) before launching, and
the MoE tile tables (`overlap.ops.moe.layout`) cover every row once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

WAITING = ("all_gather_matmul_kernel", "all_gather_weight_matmul_kernel", "reduce_chunks_kernel",
           "grouped_matmul_wait_kernel", "gather_blocks_kernel", "all_to_all_matmul_kernel")
GEMMS = ("all_gather_matmul_kernel", "all_gather_weight_matmul_kernel", "matmul_scatter_kernel",
         "grouped_matmul_wait_kernel", "grouped_matmul_scatter_kernel", "matmul_all_to_all_kernel",
         "all_to_all_matmul_kernel")
ALL = ("all_gather_matmul_kernel", "all_gather_weight_matmul_kernel", "matmul_scatter_kernel", "reduce_chunks_kernel",
       "grouped_matmul_wait_kernel", "grouped_matmul_scatter_kernel", "matmul_all_to_all_kernel",
       "gather_blocks_kernel", "all_to_all_matmul_kernel")


@pytest.fixture
def report(aot_report) -> list[dict]:
    """The session's one compile run (tests/conftest.py)."""
    return aot_report


def _of(report: list[dict], kernel: str) -> list[dict]:
    rows = [r for r in report if r["kernel"] == kernel]
    assert rows, f"{kernel} missing from the AOT report: {[r['kernel'] for r in report]}"
    return rows


def test_all_gather_matmul_compiles_for_sm90_with_wgmma(report):
    rows = _of(report, "all_gather_matmul_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp16", "fp32", "fp8"} and {r["num_warps"] for r in rows} == {4, 8}
    for r in rows:
        assert r["wgmma"], f"no wgmma in the PTX of {r}"
        assert r["globaltimer"], f"the bounded wait does not read %globaltimer: {r}"
        assert r["flag_acquire_sys"], f"the flag load is not a system-scope acquire: {r}"
        assert r["cubin_bytes"] > 0, r


def test_all_gather_weight_matmul_compiles_for_sm90_with_wgmma(report):
    """The weight-side gather's kernel: its shards loaded from the owners' buffers feed wgmma (fp8: the packed rows'
    bytes, rowwise, tensorwise and MX scales)."""
    rows = _of(report, "all_gather_weight_matmul_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp32", "fp8"}
    wgmma_type = {"bf16": "bf16", "fp32": "tf32", "fp8": "e4m3"}
    for r in rows:
        assert r["wgmma"] and r["wgmma_types"] == [wgmma_type[r["dtype"]]], f"GEMM not on wgmma {r['dtype']}: {r}"
        assert r["globaltimer"], f"the bounded wait does not read %globaltimer: {r}"
        assert r["flag_acquire_sys"], f"the flag load is not a system-scope acquire: {r}"
        assert r["cubin_bytes"] > 0, r


def test_matmul_scatter_compiles_for_sm90_with_wgmma_and_release_flags(report):
    rows = _of(report, "matmul_scatter_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp16", "fp32", "fp8"}
    wgmma_type = {"bf16": "bf16", "fp16": "f16", "fp32": "tf32", "fp8": "e4m3"}  # fp32: TF32 (docs/strategies.md)
    for r in rows:
        assert r["wgmma"] and r["wgmma_types"] == [wgmma_type[r["dtype"]]], f"GEMM not on wgmma {r['dtype']}: {r}"
        assert r["count_acq_rel_sys"], f"the chunk count is not a system-scope acq_rel atomic: {r}"
        assert r["flag_release_sys"], f"the ready flag is not published by a system-scope release: {r}"
        assert r["bar_sync"] and r["debug_barrier"], f"no CTA barrier (tl.debug_barrier) before the count: {r}"
        assert r["cubin_bytes"] > 0, r


def test_reduce_chunks_compiles_for_sm90_with_bounded_acquire_wait(report):
    rows = _of(report, "reduce_chunks_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    for r in rows:
        assert r["flag_acquire_sys"], f"the flag wait is not a system-scope acquire: {r}"
        assert r["globaltimer"], f"the bounded wait does not read %globaltimer: {r}"
        assert r["loads"]["vector"] > 0, f"the partials are not read with vector loads: {r}"
        assert r["cubin_bytes"] > 0, r


def test_moe_wait_kernel_compiles_for_sm90_with_wgmma_and_bounded_acquire_wait(report):
    rows = _of(report, "grouped_matmul_wait_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp32", "fp8"}
    assert {r.get("scales") for r in rows if r["dtype"] == "fp8"} == {"rowwise", "mxfp8"}  # the MoE fp8 dispatch
    wgmma_type = {"bf16": "bf16", "fp32": "tf32", "fp8": "e4m3"}
    for r in rows:
        assert r["wgmma"] and r["wgmma_types"] == [wgmma_type[r["dtype"]]], f"GEMM not on wgmma {r['dtype']}: {r}"
        assert r["flag_acquire_sys"], f"the block's flag wait is not a system-scope acquire: {r}"
        assert r["globaltimer"], f"the bounded wait does not read %globaltimer: {r}"
        assert r["cubin_bytes"] > 0, r


def test_moe_scatter_kernel_compiles_for_sm90_with_wgmma_and_release_flags(report):
    rows = _of(report, "grouped_matmul_scatter_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    wgmma_type = {"bf16": "bf16", "fp32": "tf32"}
    for r in rows:
        assert r["wgmma"] and r["wgmma_types"] == [wgmma_type[r["dtype"]]], f"GEMM not on wgmma {r['dtype']}: {r}"
        assert r["count_acq_rel_sys"], f"the tile count is not a system-scope acq_rel atomic: {r}"
        assert r["flag_release_sys"], f"the flag is not published by a system-scope release: {r}"
        assert r["bar_sync"] and r["debug_barrier"], f"no CTA barrier (tl.debug_barrier) before the count: {r}"
        assert r["cubin_bytes"] > 0, r


def test_sequence_parallel_producer_compiles_for_sm90_with_wgmma_and_release_flags(report):
    """`matmul_all_to_all_kernel`: each destination's columns of the product on wgmma, stored into its slot, each chunk
    counted and released at system scope after a CTA barrier."""
    rows = _of(report, "matmul_all_to_all_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"} and {r["weight"] for r in rows} == {"row-major",
                                                                                               "column-major"}
    wgmma_type = {"bf16": "bf16", "fp32": "tf32"}
    for r in rows:
        assert r["wgmma"] and r["wgmma_types"] == [wgmma_type[r["dtype"]]], f"GEMM not on wgmma {r['dtype']}: {r}"
        assert r["count_acq_rel_sys"], f"the chunk count is not a system-scope acq_rel atomic: {r}"
        assert r["flag_release_sys"], f"the ready flag is not published by a system-scope release: {r}"
        assert r["bar_sync"] and r["debug_barrier"], f"no CTA barrier (tl.debug_barrier) before the count: {r}"
        assert r["cubin_bytes"] > 0, r


def test_sequence_parallel_consumers_compile_for_sm90_with_bounded_acquire_waits(report):
    """`gather_blocks_kernel` (the copy out of the slot, vector loads) and `all_to_all_matmul_kernel` (every source's
    block on wgmma into one accumulator): each wait a system-scope acquire bounded by %globaltimer."""
    for r in _of(report, "gather_blocks_kernel"):
        assert r["loads"]["vector"] > 0 and r["loads"]["scalar_16bit"] == 0, f"the regions are not read wide: {r}"
    rows = _of(report, "all_to_all_matmul_kernel")
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    for r in rows:
        assert r["wgmma"] and r["wgmma_types"] == [{"bf16": "bf16", "fp32": "tf32"}[r["dtype"]]], r
    for r in [*rows, *_of(report, "gather_blocks_kernel")]:
        assert r["flag_acquire_sys"], f"the flag wait is not a system-scope acquire: {r}"
        assert r["globaltimer"], f"the bounded wait does not read %globaltimer: {r}"
        assert r["cubin_bytes"] > 0, r


# ----------------------------------------------------------------------------------------------
# Waits that every warp leaves together; GEMM loads that stay wide
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", WAITING)
def test_every_warp_leaves_a_wait_on_the_same_iteration(report, kernel):
    """The wait loop holds barriers and the GEMM after it reuses its shared memory: whether to leave it must
    be decided the same way in every thread (a barrier reduction), never from a thread's own clock or load."""
    for r in _of(report, kernel):
        assert not r["divergent"], (
            f"{kernel} {r['dtype']}: a branch around a barrier (the wait's exit) on a per-thread predicate: "
            f"{r['divergent']}")
        assert r["bar_red"] >= 1, f"{kernel} {r['dtype']}: no CTA-wide reduction decides when the wait ends: {r}"


@pytest.mark.parametrize("kernel", ["all_gather_matmul_kernel", "all_gather_weight_matmul_kernel",
                                    "reduce_chunks_kernel", "grouped_matmul_wait_kernel", "matmul_scatter_kernel",
                                    "grouped_matmul_scatter_kernel", "matmul_all_to_all_kernel",
                                    "gather_blocks_kernel", "all_to_all_matmul_kernel", "_occupy"])
def test_no_atomic_on_a_host_word(report, kernel):
    """The error word and the GPU check's marks are pinned host memory, where a system-scope atomic over PCIe is
    not atomic with respect to the host: plain stores there; the only atomics are the flag protocol's (the
    acquire load, the tile count's acq_rel add, the flag's release exchange)."""
    for r in _of(report, kernel):
        assert r["other_atomics"] == [], f"{kernel}: {r['other_atomics']}"
        assert r["cubin_bytes"] > 0, r


def test_the_analysis_finds_a_per_thread_exit(report):
    """The analysis behind the test above finds what overlap's wait did before issue 17: the loop left on
    each thread's own %globaltimer and its own volatile load of the error word."""
    (r,) = _of(report, "per_thread_wait_kernel")
    sources = {s for d in r["divergent"] for s in d["sources"]}
    assert {"%globaltimer", "ld.volatile.global"} <= sources, r["divergent"]


@pytest.mark.parametrize("kernel", ALL)
def test_no_branch_takes_warps_past_different_barriers_in_any_kernel(report, kernel):
    for r in _of(report, kernel):
        assert not r["divergent"], (kernel, r["dtype"], r["divergent"])


@pytest.mark.parametrize("kernel", GEMMS)
def test_gemm_operands_load_in_16_byte_copies(report, kernel):
    """Sizes and strides stay specialized (divisible by 16, unit strides constant): without that the operands
    load one element at a time and the GEMM is not pipelined (`do_not_specialize` covers only the values
    that differ between ranks and calls, tests/gpu/cpu/test_kernel_specialization.py)."""
    for r in _of(report, kernel):
        assert r["loads"]["cp_async_16"] > 0 and r["loads"]["scalar_16bit"] == 0, (kernel, r["dtype"], r["loads"])


# ----------------------------------------------------------------------------------------------
# Offsets of 2^31 elements and more: every index times a stride in 64 bits
# ----------------------------------------------------------------------------------------------

#: the stride between a weight's columns (``K`` for a column-major weight, ``w.t()``), per GEMM kernel that takes one
WEIGHT_COLUMN_STRIDES = {"all_gather_matmul_kernel": "stride_bn", "matmul_scatter_kernel": "stride_bn",
                         "grouped_matmul_wait_kernel": "stride_wn", "grouped_matmul_scatter_kernel": "stride_wn",
                         "matmul_all_to_all_kernel": "stride_bn", "all_to_all_matmul_kernel": "stride_bn"}


def _ptx_and_ttir(ops: list[str]) -> bool:
    """Whether `ops` (one stride's products in `stride_products`) hold a PTX instruction and a TTIR ``arith.muli``."""
    return any(op.startswith("ttir:") for op in ops) and any(not op.startswith("ttir:") for op in ops)


@pytest.mark.parametrize("kernel, stride", sorted(WEIGHT_COLUMN_STRIDES.items()))
def test_a_column_major_weight_is_addressed_with_64_bit_offsets(report, kernel, stride):
    """A weight of 2^31 elements or more passed as ``w.t()`` (column-major, as ``nn.Linear``'s): a column's offset
    ``n * stride_bn`` passes 2^31 elements, and wraps in 32 bits. The column stride is multiplied in 64 bits in the
    PTX (``mul.wide.s32``, ``mul.lo.s64``; no ``mul.lo.s32``, ``mad.lo.s32``, ``shl.b32``) and in the TTIR
    (``arith.muli`` on i64), like every other stride (`tests.support.aot_compile.stride_products`)."""
    rows = [r for r in _of(report, kernel) if r.get("weight") == "column-major"]
    assert rows, f"{kernel}: not compiled with a column-major weight"
    for r in rows:
        products = r["stride_products"]
        assert not products["narrow"], f"{kernel} {r['dtype']}: strides multiplied in 32 bits: {products['narrow']}"
        assert _ptx_and_ttir(products["wide"].get(stride, [])), (
            f"{kernel} {r['dtype']}: {stride} is not multiplied in 64 bits in both the PTX and the TTIR: {products}")


@pytest.mark.parametrize("kernel", ALL)
def test_every_index_times_a_stride_is_64_bit(report, kernel):
    """Every compiled variant: row-major weights too (``k * stride_bk`` and the K loop's step ``BLOCK_K *
    stride_bk``), the operands' rows, the outputs' rows and columns. No product of an index and a ``stride_*``
    argument in 32 bits, where an offset of 2^31 elements or more would wrap."""
    for r in _of(report, kernel):
        assert not r["stride_products"]["narrow"], (kernel, r["dtype"], r.get("weight"), r["stride_products"])


def test_the_analysis_finds_32_bit_index_times_stride(report):
    """The analysis behind the two tests above finds the int32 weight offsets the GEMMs had before (a kernel
    compiled with them: `narrow_offsets_kernel`), in the PTX and in the TTIR."""
    (r,) = _of(report, "narrow_offsets_kernel")
    narrow = r["stride_products"]["narrow"]
    for stride in ("stride_bk", "stride_bn"):
        assert _ptx_and_ttir(narrow.get(stride, [])), (stride, r["stride_products"])


# ----------------------------------------------------------------------------------------------
# The launchers refuse bad arguments before launching; the MoE tile tables cover every row once
# ----------------------------------------------------------------------------------------------


def _launch_with_bad_argument(case: str) -> None:
    from overlap.ops.fused import kernels as kernel_modules

    k = kernel_modules()
    ag, rs = k.all_gather_matmul, k.matmul_reduce_scatter
    gwait, gscatter = k.dispatch_grouped_matmul, k.grouped_matmul_combine
    i64, i32 = torch.int64, torch.int32
    table, word, epoch = torch.zeros(2, dtype=i64), torch.zeros(1, dtype=i32), torch.ones(1, dtype=i32)
    b = torch.randn(32, 16)
    if case == "epoch as an int":
        ag.launch_all_gather_matmul(b, table, table, rows=4, epoch=1, rank=0, err=word, timeout_ns=1,
                                         block=(32, 32, 32))
    elif case == "epoch of another dtype":
        rs.launch_reduce_chunks(torch.empty(8, 16), table, table, block_rows=8, num_chunks=1,
                                     epoch=torch.ones(1, dtype=i64), err=word, timeout_ns=1, block=(32, 32))
    elif case == "rank outside the tables":
        ag.launch_all_gather_matmul(b, table, table, rows=4, epoch=epoch, rank=2, err=word, timeout_ns=1,
                                         block=(32, 32, 32))
    elif case == "tile not a power of two":
        ag.launch_all_gather_matmul(b, table, table, rows=4, epoch=epoch, rank=0, err=word, timeout_ns=1,
                                         block=(48, 32, 32))
    elif case == "out of the wrong shape":
        ag.launch_all_gather_matmul(b, table, table, rows=4, epoch=epoch, rank=0, err=word, timeout_ns=1,
                                         block=(32, 32, 32), out=torch.empty(9, 16))
    elif case == "rows past the blocks":
        rs.launch_matmul_scatter(torch.randn(9, 32), b, table, torch.zeros(8, dtype=i32), table, block_rows=4,
                                      num_chunks=1, flag_stride=4, epoch=epoch, rank=0, block=(32, 32, 32))
    elif case == "flags of two destinations overlap":
        rs.launch_matmul_scatter(torch.randn(64, 32), b, table, torch.zeros(8, dtype=i32), table,
                                      block_rows=32, num_chunks=1, flag_stride=0, epoch=epoch, rank=0,
                                      block=(16, 32, 32))
    elif case == "reduction of more rows than a block":
        rs.launch_reduce_chunks(torch.empty(9, 16), table, table, block_rows=8, num_chunks=1, epoch=epoch,
                                     err=word, timeout_ns=1, block=(32, 32))
    elif case == "fp8 weight without its scale":
        ag.launch_all_gather_matmul(b.to(torch.float8_e4m3fn), table, table, rows=4, epoch=epoch, rank=0, err=word,
                                    timeout_ns=1, block=(32, 32, 32), scale_offset=32)
    elif case == "fp8 scale of the wrong shape":
        rs.launch_matmul_scatter(torch.randn(8, 32).to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), table,
                                 torch.zeros(8, dtype=i32), table, block_rows=4, num_chunks=1, flag_stride=4,
                                 epoch=epoch, rank=0, block=(32, 32, 32), a_scale=torch.ones(7, 1),
                                 b_scale=torch.ones(1, 16))
    elif case == "fp8 scale offset inside the row":
        ag.launch_all_gather_matmul(b.to(torch.float8_e4m3fn), table, table, rows=4, epoch=epoch, rank=0, err=word,
                                    timeout_ns=1, block=(32, 32, 32), b_scale=torch.ones(()), scale_offset=8)
    elif case == "tile table of 5 columns":
        gwait.launch_grouped_matmul_wait(table, table, torch.zeros(3, 5, dtype=i32), torch.randn(2, 8, 16),
                                           torch.empty(4, 16), torch.empty(4, 8), epoch=epoch, err=word, timeout_ns=1,
                                           block=(32, 32, 32))
    elif case == "fp8 expert scales of the wrong shape":
        gwait.launch_grouped_matmul_wait(table, table, torch.zeros(3, 6, dtype=i32),
                                           torch.randn(2, 32, 16).to(torch.float8_e4m3fn), torch.empty(4, 16), None,
                                           epoch=epoch, err=word, timeout_ns=1, block=(32, 32, 32),
                                           w_scale=torch.ones(2, 16), scale_offset=32)
    elif case == "weights of another inner dim":
        gscatter.launch_grouped_matmul_scatter(torch.randn(4, 8), torch.randn(2, 9, 16), torch.zeros(1, 7, dtype=i32),
                                              table, torch.zeros(8, dtype=i32), table, epoch=epoch, rank=0,
                                              block=(32, 32, 32))


@pytest.mark.parametrize("case, message", [
    ("epoch as an int", r"epoch must be an int32 word on cpu .*epoch_word\(1, device\)\), got the int 1"),
    ("epoch of another dtype", r"epoch must be an int32 tensor of at least one word, got torch.int64 \(1,\)"),
    ("rank outside the tables", r"rank must be an int in \[0, 2\), got 2"),
    ("tile not a power of two", "BLOCK_M must be a power of two >= 16, got 48"),
    ("out of the wrong shape", r"out must be torch.float32 \[8, 16\].*got torch.float32 \[9, 16\]"),
    ("rows past the blocks", "a's 9 rows do not fit 2 blocks of 4 rows"),
    ("flags of two destinations overlap", "flag_stride 0 < num_chunks 1"),
    ("reduction of more rows than a block", r"block_rows must be an int in \[9, .*got 8"),
    ("fp8 weight without its scale", r"b_scale must be float32, one element or \[1, 16\], on cpu; got NoneType"),
    ("fp8 scale of the wrong shape", r"a_scale must be float32, one element or \[8, 1\] contiguous.*\[7, 1\]"),
    ("fp8 scale offset inside the row", "scale_offset must be a multiple of 4 at least K=32, got 8"),
    ("tile table of 5 columns", r"tile_table must be torch.int32 \[n, 6\], got torch.int32 \[3, 5\]"),
    ("weights of another inner dim", r"w must be torch.float32 \[L, 8, N\].*got torch.float32 \[2, 9, 16\]"),
    ("fp8 expert scales of the wrong shape",
     r"w_scale must be float32 \[2, 1, 16\] or e8m0 .*got torch.float32 \[2, 16\]"),
])
def test_launchers_refuse_bad_arguments_with_their_values(case, message):
    with pytest.raises(ValueError, match=message):
        _launch_with_bad_argument(case)


def _handles(world_size: int, tokens: list[int], top_k: int, num_local_experts: int):
    """Every rank's MoE handle of one routing, ``recv_counts`` from the senders' counts (no group needed)."""
    from overlap.ops.context import CallContext
    from overlap.ops.moe import entry, layout

    gen = torch.Generator().manual_seed(world_size * 100 + top_k)
    E = world_size * num_local_experts
    handles = []
    for t in tokens:
        topk = torch.randint(0, max(E - 1, 1), (t, top_k), generator=gen)  # the last expert is never picked
        order, send_counts = entry.route("test", topk, E, world_size)
        context = CallContext("test", None, None, 1.0)
        handles.append(layout.MoELayout(context, E, num_local_experts, top_k, t, send_counts, order))
    for r, h in enumerate(handles):
        h.recv_counts = [handles[s].send_counts[r] for s in range(world_size)]
    return handles


@pytest.mark.parametrize("world_size, tokens, top_k, num_local_experts", [
    (1, [7], 1, 3), (2, [13, 0], 2, 2), (3, [33, 5, 40], 3, 5), (2, [50, 20], 2, 200),
])
def test_moe_tile_tables_cover_every_row_once(world_size, tokens, top_k, num_local_experts):
    from overlap.kernels import dispatch_grouped_matmul, grouped_matmul_combine, slots

    W, L, bm, tiles_n = world_size, num_local_experts, 16, 3
    F, G = slots.flags_per_peer(W), slots.expert_groups(L, W)
    for r, h in enumerate(_handles(W, tokens, top_k, L)):
        wait = dispatch_grouped_matmul.dispatch_tile_table(h.recv_counts, r, bm, torch.device("cpu"))
        scatter = grouped_matmul_combine.combine_tile_table(h.recv_counts, r, bm, tiles_n, torch.device("cpu"))
        assert wait.dtype == scatter.dtype == torch.int32 and wait.shape[1] == 6 and scatter.shape[1] == 7
        # sources in the order the kernels visit them: ours first (dispatch), ours last (combine)
        for table, sign, shift in ((wait, -1, r), (scatter, 1, -r - 1)):
            steps = [(sign * s + shift) % W for s in table[:, 0].tolist()]
            assert steps == sorted(steps), (r, table[:, 0].tolist())
            assert all(1 <= n <= bm for n in table[:, 4].tolist()), table
        covered = torch.zeros(h.num_recv, dtype=torch.int32)
        for s, e, src_row, out_row, n, flag in wait.tolist():
            covered[out_row : out_row + n] += 1
            assert h.expert_offsets[e][s] <= out_row and out_row + n <= h.expert_offsets[e][s] + h.recv_counts[s][e]
            assert src_row - h.within_source(s, e) == out_row - h.expert_offsets[e][s]
            assert flag == r * F + 1 + slots.group_of(e, L, G)
        assert bool((covered == 1).all()), f"rank {r}: expert rows covered {covered.tolist()}"
        entries: dict[int, int] = {}
        for s, e, y_row, dst_row, _n, flag, _target in scatter.tolist():
            assert flag == s * F + 1 + slots.group_of(e, L, G)
            assert dst_row - h.within_source(s, e) == y_row - h.expert_offsets[e][s]
            entries[flag] = entries.get(flag, 0) + 1
        assert all(target == entries[flag] * tiles_n for *_, flag, target in scatter.tolist())
        assert sorted(map(tuple, scatter[:, :5].tolist())) == sorted(
            (s, e, y, d, n) for s, e, d, y, n, _ in wait.tolist())  # the same tiles, both directions
