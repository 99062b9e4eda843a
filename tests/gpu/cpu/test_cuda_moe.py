"""The MoE all-to-all CUDA kernels (csrc/cuda/moe_a2a.cu) without a GPU.

* nvcc compiles them for sm_80 and sm_90a; the dispatch kernel's PTX/SASS publishes each block's flag
  with a system-scope fence, acquire-release counter and release store; the combine kernel has no fused
  multiply-add (it must round like `overlap.ops.moe.grouped.weighted_sum`).
* `overlap._C`'s launchers check their arguments (ValueError with the values) and fail clearly
  (RuntimeError) where no GPU or no CUDA half exists.
* `overlap.ops.moe.cuda` builds its tables from a handle and passes them to `_C` correctly: the launches
  run against an emulation of the kernels (the same index math, on CPU memory through the raw addresses
  the launches pass) and are compared with what the CPU path writes and sums.

What this cannot prove: the kernels on a GPU (ordering across GPUs, speed). `tests/gpu/check.py` runs them.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import types
import warnings
from pathlib import Path

import pytest
import torch
from overlap.kernels import slots

from overlap import _C, envs, errors, symm
from overlap.ops.context import CallContext, warn_device_connections
from overlap.ops.moe import cuda as moe_cuda
from overlap.ops.moe import entry, grouped, layout
from overlap.symm.tables import AddressTables
from tests.support.cuda_tools import cuobjdump

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "csrc" / "cuda" / "moe_a2a.cu"


# ---- compiled for sm_80 and sm_90a ----------------------------------------------------------------


def _entries(ptx: str) -> dict[str, str]:
    """PTX body of every kernel entry, by mangled name."""
    parts = re.split(r"^\.visible \.entry (\S+)\(", ptx, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_moe_kernels_compile(tmp_path, arch):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    ptx, cubin = tmp_path / "moe_a2a.ptx", tmp_path / "moe_a2a.cubin"
    _run([nvcc, f"-arch={arch}", "-ptx", "-I", str(ROOT / "csrc" / "include"), str(SOURCE), "-o", str(ptx)])
    _run([nvcc, f"-arch={arch}", "-cubin", str(ptx), "-o", str(cubin)])
    assert cubin.stat().st_size > 0

    entries = _entries(ptx.read_text())
    dispatch = [body for name, body in entries.items() if "moe_dispatch_rows_kernel" in name]
    combine = {name: body for name, body in entries.items() if "moe_combine_rows_kernel" in name}
    assert len(dispatch) == 1, sorted(entries)
    assert len(combine) == 3, f"one combine kernel per dtype (fp32, bf16, fp16), got {sorted(combine)}"
    body = dispatch[0]
    # Publication of a block (csrc/include/overlap/moe_a2a.cuh): every thread's fence at system scope,
    # the block counter acq_rel at system scope, the flag a release store at system scope, in that order.
    fence = re.search(r"fence\.sc\.sys|membar\.sys", body)
    counter = body.find("atom.acq_rel.sys.global.add")
    flag = body.find("st.release.sys.global.b32")
    assert fence and counter >= 0 and flag >= 0, "the dispatch kernel lost a system-scope publication step"
    assert fence.start() < counter < flag, (fence.start(), counter, flag)
    assert "ld.global.nc.v4" in body and re.search(r"st(\.global)?\.v4", body), "copies are not 16-byte vectors"
    for name, text in combine.items():
        assert "fma" not in text, f"{name}: a fused multiply-add rounds differently from weighted_sum"
        assert "mul.rn.f32" in text and "add.rn.f32" in text, name

    tool = cuobjdump()
    if tool is None:
        return
    sass = subprocess.run([tool, "-sass", str(cubin)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert sass.returncode == 0, sass.stderr
    functions = re.split(r"\n\s*Function : ", sass.stdout)
    dispatch_sass = [f for f in functions if f.startswith("_ZN7overlap4cuda24moe_dispatch_rows_kernel")]
    assert len(dispatch_sass) == 1, sass.stdout[:2000]
    code = dispatch_sass[0]
    assert "MEMBAR.SC.SYS" in code, "fence.sc.sys did not reach the SASS"
    assert re.search(r"ATOMG\.E\.ADD\.S32\.STRONG\.SYS", code), "the block counter is not a system-scope atomic"
    assert re.search(r"STG\.E\.STRONG\.SYS", code), "the flag store is not a system-scope strong store"


# ---- the launchers without a GPU --------------------------------------------------------------------


def _dispatch_args(**over):
    args = dict(src_rows=4096, row_index=8, num_sends=4, row_bytes=32, dst_table=8, block_offsets=8,
                chunk_offsets=8, num_blocks=4, groups_per_dest=2, num_chunks=2, rows_per_chunk=2,
                counters=4, flag_addrs=8, epoch=3, stream=0)
    args.update(over)
    return args


def _combine_args(**over):
    args = dict(back_table=8, send_offsets=8, world_size=2, pos=8, weights=4, out=16, num_tokens=3, top_k=2,
                hidden=5, dtype=1, stream=0)
    args.update(over)
    return args


BAD_DISPATCH = [
    (dict(row_bytes=24), r"row_bytes=24 must be a positive multiple of 16"),
    (dict(row_bytes=0), r"row_bytes=0"),
    (dict(num_blocks=5), r"num_blocks=5 must be .* groups_per_dest=2"),
    (dict(num_blocks=2 * 129, groups_per_dest=2), r"destinations <= 128"),
    (dict(num_chunks=5), r"num_chunks=5 is outside \[0, 4\]"),
    (dict(num_chunks=0), r"num_chunks=0 with num_sends=4"),
    (dict(rows_per_chunk=0), r"rows_per_chunk=0"),
    (dict(epoch=2**31), r"epoch=2147483648 is outside the int32 range"),
    (dict(src_rows=4104), r"src_rows=0x1008 is not 16-byte aligned \(src_rows % 16 = 8\)"),
    (dict(flag_addrs=0), r"flag_addrs is a null address"),
    (dict(counters=6), r"counters=0x6 is not 4-byte aligned"),
]

BAD_COMBINE = [
    (dict(dtype=3), r"dtype=3 is not one of 0 \(float32\), 1 \(bfloat16\), 2 \(float16\)"),
    (dict(world_size=0), r"world_size=0 is outside \[1, 128\]"),
    (dict(top_k=0), r"top_k=0"),
    (dict(hidden=0), r"hidden=0"),
    (dict(num_tokens=-1), r"num_tokens=-1"),
    (dict(out=17), r"out=0x11 is not 2-byte aligned"),
    (dict(out=18, dtype=0), r"out=0x12 is not 4-byte aligned"),
    (dict(pos=0), r"pos is a null address"),
]


def _needs_cuda_half():
    if not _C.has_cuda:
        pytest.skip("overlap._C has no CUDA half (its MoE exports are stubs: see test_fail_clearly)")


@pytest.mark.parametrize("over,message", BAD_DISPATCH, ids=[m for _, m in BAD_DISPATCH])
def test_dispatch_launcher_checks_arguments(over, message):
    _needs_cuda_half()  # (the checks run before any device call, so they are testable here)
    with pytest.raises(ValueError, match=message):
        _C.moe_dispatch_rows(**_dispatch_args(**over))


@pytest.mark.parametrize("over,message", BAD_COMBINE, ids=[m for _, m in BAD_COMBINE])
def test_combine_launcher_checks_arguments(over, message):
    _needs_cuda_half()
    with pytest.raises(ValueError, match=message):
        _C.moe_combine_rows(**_combine_args(**over))


def test_empty_launches_do_nothing():
    _needs_cuda_half()
    _C.moe_dispatch_rows(**_dispatch_args(num_sends=0, num_chunks=0, src_rows=0))  # no device needed
    _C.moe_combine_rows(**_combine_args(num_tokens=0, out=0))


@pytest.mark.parametrize("name", ["moe_dispatch_rows", "moe_combine_rows"])
def test_fail_clearly_without_a_gpu(name):
    if _C.has_cuda and _C.cuda_device_count() > 0:
        pytest.skip("a CUDA device is usable here (the arguments are fake addresses)")
    args = _dispatch_args() if name == "moe_dispatch_rows" else _combine_args()
    pattern = "no usable CUDA device" if _C.has_cuda else "built without CUDA"
    with pytest.raises(RuntimeError, match=rf"overlap\._C\.{name}: .*{pattern}"):
        getattr(_C, name)(**args)


# ---- the tables and the launches, against an emulation of the kernels --------------------------------


def _i64(addr: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(addr))


def _last_at_or_below(offsets: list[int], n: int, value: int) -> int:
    lo, hi = 0, n  # as moe_a2a.cuh's last_at_or_below
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if offsets[mid] <= value else (lo, mid)
    return lo


class EmulatedKernels:
    """`overlap._C`'s two MoE launchers run on CPU memory with the kernels' index math (moe_a2a.cuh)."""

    def __init__(self):
        self.has_cuda = True
        self.launches = 0

    def cuda_stream_write_value32(self, addr, value, stream):  # (in stream order: after the kernel above)
        assert stream == 0
        ctypes.c_int32.from_address(addr).value = value

    def moe_dispatch_rows(self, src_rows, row_index, num_sends, row_bytes, dst_table, block_offsets,
                          chunk_offsets, num_blocks, groups_per_dest, num_chunks, rows_per_chunk, counters,
                          flag_addrs, epoch, stream):
        self.launches += 1
        assert row_bytes % 16 == 0 and src_rows % 16 == 0 and stream == 0
        rows = _i64(row_index, num_sends)
        dst = _i64(dst_table, num_blocks // groups_per_dest)
        blocks = _i64(block_offsets, num_blocks + 1)
        chunks = _i64(chunk_offsets, num_blocks + 1)
        flags = _i64(flag_addrs, num_blocks)
        count = (ctypes.c_int32 * num_blocks).from_address(counters)
        assert num_chunks == chunks[-1] and blocks[-1] == num_sends
        for chunk in range(num_chunks):  # one CTA each
            block = _last_at_or_below(chunks, num_blocks, chunk)
            dest = block // groups_per_dest
            begin = blocks[block] + (chunk - chunks[block]) * rows_per_chunk
            end = min(begin + rows_per_chunk, blocks[block + 1])
            assert begin < end, (chunk, block, begin, end)
            first = blocks[dest * groups_per_dest]
            for pos in range(begin, end):
                ctypes.memmove(dst[dest] + (pos - first) * row_bytes, src_rows + rows[pos] * row_bytes, row_bytes)
            count[block] += 1
            if count[block] == chunks[block + 1] - chunks[block]:
                count[block] = 0
                ctypes.c_int32.from_address(flags[block]).value = epoch

    def moe_combine_rows(self, back_table, send_offsets, world_size, pos, weights, out, num_tokens, top_k,
                         hidden, dtype, stream):
        self.launches += 1
        torch_dtype = {v: k for k, v in moe_cuda.DTYPE_CODES.items()}[dtype]
        size = torch.empty((), dtype=torch_dtype).element_size()
        table = _i64(back_table, world_size)
        offsets = _i64(send_offsets, world_size + 1)
        positions = _i64(pos, num_tokens * top_k)
        w = list((ctypes.c_float * (num_tokens * top_k)).from_address(weights))

        def row(addr: int) -> torch.Tensor:
            raw = (ctypes.c_uint8 * (hidden * size)).from_address(addr)
            return torch.frombuffer(bytearray(raw), dtype=torch_dtype)

        result = torch.empty((num_tokens, hidden), dtype=torch_dtype)
        for t in range(num_tokens):
            acc = torch.zeros(hidden, dtype=torch.float32)
            for k in range(top_k):  # k in order; each product rounded, then added
                p = positions[t * top_k + k]
                d = _last_at_or_below(offsets, world_size, p)
                x = row(table[d] + (p - offsets[d]) * hidden * size).to(torch.float32)
                acc = acc + torch.tensor(w[t * top_k + k], dtype=torch.float32) * x
            result[t] = acc.to(torch_dtype)
        ctypes.memmove(out, result.data_ptr(), result.numel() * size)


class _Flags:
    def __init__(self, world_size: int):
        self.tensors = [torch.zeros(symm.layout.CTRL_WORDS, dtype=torch.int32) for _ in range(world_size)]

    def addrs(self, word: int) -> list[int]:
        return [t.data_ptr() + 4 * word for t in self.tensors]


def _fake_call(h: layout.MoELayout, need: int, epoch: int) -> symm.Call:
    """A `symm.Call` of rank ``h.info.rank`` over a `symm.SymmHeap` whose W buffers are CPU tensors of this
    process (the heap's own address-table code runs unchanged)."""
    W = h.info.world_size
    heap = object.__new__(symm.SymmHeap)
    heap.rank, heap.world_size, heap.device = h.info.rank, W, torch.device("cpu")
    heap.slot_bytes = (need + 4095) // 4096 * 4096
    heap.data = [torch.zeros(symm.NUM_SLOTS * heap.slot_bytes, dtype=torch.uint8) for _ in range(W)]
    heap.tables, heap._cuda_flags = AddressTables(heap), _Flags(W)
    heap._pads = _Flags(W)  # the control pads as the device sees them (`SymmHeap.pad_device_addr`)
    heap._pad_dev = [t.data_ptr() for t in heap._pads.tensors]
    return symm.Call(heap, "test", epoch, 1.0, uses_heap=True, need=need)


def _handle(world_size: int, rank: int, num_tokens: int, top_k: int, num_local_experts: int,
            gen: torch.Generator) -> layout.MoELayout:
    E = world_size * num_local_experts
    # Skewed routing: expert 0 is hot, the last expert is never picked (an empty block).
    topk = torch.randint(0, max(E - 1, 1), (num_tokens, top_k), generator=gen)
    topk[: num_tokens // 2, 0] = 0
    order, send_counts = entry.route("test", topk, E, world_size)
    info = types.SimpleNamespace(world_size=world_size, rank=rank, device=torch.device("cpu"))
    context = CallContext("test", None, info, 1.0)
    return layout.MoELayout(context, E, num_local_experts, top_k, num_tokens, send_counts, order)


SHAPES = [  # world size, rank, tokens, top_k, local experts
    (1, 0, 7, 1, 3),
    (2, 1, 13, 2, 2),
    (3, 2, 33, 3, 5),
    (4, 1, 64, 4, 4),
    (4, 3, 0, 2, 2),  # no tokens
    (2, 0, 50, 2, 200),  # more experts than flags: expert groups of several experts
]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_dispatch_blocks_match_the_torch_path(shape):
    W, r, T, K, L = shape
    h = _handle(W, r, T, K, L, torch.Generator().manual_seed(sum(shape)))
    G = slots.expert_groups(L, W)
    blocks = moe_cuda.dispatch_blocks(h)
    assert len(blocks) == W * G + 1 and blocks[-1] == T * K
    assert blocks == sorted(blocks)
    for d in range(W):
        assert blocks[d * G] == h.send_offsets[d]
        for g in range(G):  # the rows _produced.write() index_selects for (d, g)
            experts = slots.group_experts(g, L, G)
            base = h.send_offsets[d]
            assert (blocks[d * G + g], blocks[d * G + g + 1]) == (
                base + h.within_dest(d, experts.start), base + h.within_dest(d, experts.stop))
    for per_chunk in (1, 2, 7):
        chunks = moe_cuda.chunk_offsets(blocks, per_chunk)
        for i in range(W * G):
            assert chunks[i + 1] - chunks[i] == -(-(blocks[i + 1] - blocks[i]) // per_chunk)
    F = slots.flags_per_peer(W)
    assert moe_cuda.block_flags(h) == [d * F + 1 + g for d in range(W) for g in range(G)]
    assert max(moe_cuda.block_flags(h)) < symm.MAX_FLAGS


@pytest.mark.exact
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_dispatch_launch_writes_what_the_torch_path_writes(monkeypatch, shape, dtype):
    W, r, T, K, L = shape
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    h = _handle(W, r, T, K, L, gen)
    H = 24 if dtype != torch.float32 else 12  # 48 bytes per row: three 16-byte vectors
    x = torch.randn(T, H, generator=gen).to(dtype)
    row_bytes = H * x.element_size()
    need = layout.heap_need("symm", T, K, L, h.send_splits, row_bytes, W)
    epoch = 5
    call = _fake_call(h, need, epoch)
    fake = EmulatedKernels()
    monkeypatch.setattr(moe_cuda, "_c", lambda: fake)
    monkeypatch.setattr(moe_cuda, "CHUNK_BYTES", 2 * row_bytes)  # two rows per CTA: blocks of several CTAs
    assert moe_cuda.dispatch_rows(call, h, x, h.token_of)
    assert fake.launches == (1 if T else 0)

    G, F = slots.expert_groups(L, W), slots.flags_per_peer(W)
    heap = call.heap
    for d in range(W):
        n = h.send_splits[d]
        region = layout.region(call, h, d, r, dtype, H)
        lo = h.send_offsets[d]
        expected = x.index_select(0, h.token_of[lo : lo + n])
        assert torch.equal(region[:n], expected), f"destination {d}: rows differ (W={W}, rank {r})"
        for g in range(G):
            experts = slots.group_experts(g, L, G)
            rows = sum(h.send_counts[d][e] for e in experts)
            word = heap._cuda_flags.tensors[r][heap.ready_word(call.slot, d * F + 1 + g)]
            assert int(word) == (epoch if rows else 0), f"flag of block ({d}, {g}) with {rows} rows: {int(word)}"
            # ... and mirrored into the control pad, where the symm consumers' stream-ordered waits read it
            pad = heap._pads.tensors[r][heap.ready_word(call.slot, d * F + 1 + g)]
            assert int(pad) == (epoch if rows else 0), f"pad flag of block ({d}, {g}) with {rows} rows: {int(pad)}"
    assert not heap.tables.counters(call.slot).any(), "the block counters were not left at zero"


def test_dispatch_falls_back_on_unaligned_rows(monkeypatch):
    h = _handle(2, 0, 5, 2, 2, torch.Generator().manual_seed(3))
    x = torch.randn(5, 3)  # 12 bytes per row
    call = _fake_call(h, layout.heap_need("symm", 5, 2, 2, h.send_splits, 12, 2), 1)
    monkeypatch.setattr(moe_cuda, "_c", lambda: EmulatedKernels())
    monkeypatch.setattr(errors, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="multiple of 16 bytes"):
        assert not moe_cuda.dispatch_rows(call, h, x, h.token_of)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_combine_launch_sums_what_the_torch_path_sums(monkeypatch, shape, dtype):
    W, r, T, K, L = shape
    gen = torch.Generator().manual_seed(sum(shape) + 2)
    h = _handle(W, r, T, K, L, gen)
    H = 9
    need = layout.heap_need("symm", T, K, L, h.send_splits, H * torch.empty((), dtype=dtype).element_size(), W)
    call = _fake_call(h, need, 2)
    for d in range(W):  # what rank d wrote into our buffer: its results for our rows, in our send order
        n = h.send_splits[d]
        layout.region(call, h, r, d, dtype, H)[:n] = torch.randn(n, H, generator=gen).to(dtype)
    weights = torch.rand(T, K, generator=gen).to(dtype)
    fake = EmulatedKernels()
    monkeypatch.setattr(moe_cuda, "_c", lambda: fake)
    out = moe_cuda.combine_rows(call, h, dtype, H, weights)
    assert fake.launches == (1 if T else 0)

    # The torch path: moe_combine._collect's copies, run()'s un-permutation, then the weighted sum.
    back = torch.empty((T * K, H), dtype=dtype)
    for d in range(W):
        n = h.send_splits[d]
        back[h.send_offsets[d] : h.send_offsets[d] + n] = layout.region(call, h, r, d, dtype, H)[:n]
    expected = grouped.weighted_sum(back.index_select(0, h.inv_order), weights, dtype)
    # Same operations in the same order (fp32 products, k in order, one cast): equal up to torch's
    # own reduction order inside weighted_sum's sum over k.
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_combine_positions_locate_every_pair():
    h = _handle(3, 1, 20, 3, 2, torch.Generator().manual_seed(7))
    pos, offsets = moe_cuda.combine_positions(h)
    assert offsets == [*h.send_offsets, 60]
    for p, send_position in enumerate(pos.tolist()):
        d = _last_at_or_below(offsets, 3, send_position)
        assert offsets[d] <= send_position < offsets[d + 1], (p, d, offsets)
        assert h.order[send_position] == p  # the pair's own row


def test_sums_on_device_only_for_gpu_symm_without_grad():
    plan = types.SimpleNamespace(strategy="symm")
    y, w = torch.randn(4, 8), torch.rand(2, 2)
    assert not moe_cuda.sums_on_device(y, w, plan, False)  # CPU rows: the torch path


# ---- CUDA_DEVICE_MAX_CONNECTIONS ----------------------------------------------------------------------


@pytest.mark.parametrize("value,warns", [(None, True), ("8", True), ("1", False), ("x", True)])
def test_device_connections_warn_once(monkeypatch, value, warns):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    monkeypatch.setattr(errors, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_device_connections("moe.dispatch")
        warn_device_connections("moe.dispatch")
    texts = [str(w.message) for w in caught if "CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message)]
    assert len(texts) == (1 if warns else 0), texts
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in envs.VARIABLES
    assert envs.cuda_device_max_connections() == (int(value) if value and value.isdigit() else None)
