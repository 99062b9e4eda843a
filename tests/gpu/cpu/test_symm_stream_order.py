"""The GPU ``symm`` pipelines issue every flag a peer waits for before this rank's waits of the same phase.

With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream of a process feeds one hardware queue in host order, and a
stream-ordered wait blocks the queue until its flag arrives: a wait issued before this rank's own publish of
the same phase would hold that publish back from the peers waiting for it (a deadlock that only the watchdog
ends). Each op's CUDA branch runs here on CPU tensors that say they are on a GPU, with `overlap.signals`
replaced by a recorder (tests/support/gpu_order.py), for every rank of several world sizes; the recorded host
order of flag operations must follow the rule (`gpu_order.check_order`).
"""

import types

import pytest
import torch

from overlap import symm
from overlap.ops.context import CallContext
from overlap.ops.moe import cuda as moe_cuda
from overlap.ops.moe import entry, layout, to_experts, to_sources
from overlap.ops.tp import gather as _gather
from overlap.ops.tp import grad_ring as _grad_ring
from overlap.ops.tp import matmul_all_reduce, scatter_gemm
from overlap.ops.tp import shard_ring as _shard_ring
from overlap.ops.tp.operands import Gemm
from overlap.ops.tp.rows import Product, Rows
from tests.support import gpu_order
from tests.support.gpu_order import check_order, gpu_call, gpu_heap, on_gpu

RANKS = [(W, r) for W in (2, 3, 4) for r in range(W)]
IDS = [f"W{W}-r{r}" for W, r in RANKS]


def _context(W: int, r: int, one_shot: bool = False) -> CallContext:
    info = types.SimpleNamespace(world_size=W, rank=r, device=torch.device("cpu"), slowest_link="nvlink",
                                 link_class=lambda peer: "nvlink")
    plan = types.SimpleNamespace(chunks_for=lambda link: 3, one_shot=one_shot)
    return CallContext("test", None, info, 5.0, plan=plan)


def _record(monkeypatch, heap, call):
    rec = gpu_order.Recorder(heap, call.slot)
    monkeypatch.setattr(symm.call, "signals", lambda: rec)
    return rec


def _nontrivial(ops, W):
    kinds = {op[:2] for op in ops}
    assert ("write", "ready") in kinds and ("wait", "done") in kinds, ops
    if W > 1:
        assert ("wait", "ready") in kinds, ops


@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_all_gather(monkeypatch, W, r):
    heap = gpu_heap(W, r, 1 << 16)
    call = gpu_call(heap)
    rec = _record(monkeypatch, heap, call)
    with gpu_order.fake_cuda(monkeypatch):
        g = _gather._Symm(call, on_gpu(torch.randn(6, 4)), _context(W, r))
        g.post()
    check_order(rec.ops)
    _nontrivial(rec.ops, W)
    assert ("write", "done") in {op[:2] for op in rec.ops}


@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_weight_shard_ring(monkeypatch, W, r):
    """all_gather_weight_matmul's symm: the shard published first; each peer's pulls issued as the ring goes
    round (after the GEMMs of the buffer they refill), the done flags after the last."""
    heap = gpu_heap(W, r, 1 << 16)
    call = gpu_call(heap)
    rec = _record(monkeypatch, heap, call)
    with gpu_order.fake_cuda(monkeypatch):
        ring = _shard_ring.start(call, on_gpu(torch.randn(5, 4)), _context(W, r))
        blocks = [(lo, hi) for lo, hi, _ in ring.chunks()]
        ring.close()
    check_order(rec.ops)
    _nontrivial(rec.ops, W)
    edges = sorted(blocks)  # every row of the whole weight once, this rank's own block first
    assert blocks[0] == (5 * r, 5 * r + 5) and edges[0][0] == 0 and edges[-1][1] == 5 * W
    assert all(a[1] == b[0] for a, b in zip(edges, edges[1:])), blocks
    assert ("write", "done") in {op[:2] for op in rec.ops}


@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_weight_gradient_ring(monkeypatch, W, r):
    """all_gather_weight_matmul's symm/fused backward, the weight gradient's ring: one phase per send ``t``
    (its data flag ``t`` and the release of the region it read, flag ``T + t - 1``), each issued after the waits
    of its own operation only (the successor's release of send ``t - 2``, the predecessor's send ``t - 1``)."""
    heap = gpu_heap(W, r, 1 << 16)
    call = gpu_call(heap)
    rec = _record(monkeypatch, heap, call)
    cc = _context(W, r)
    n, k = 5, 4
    lay = _grad_ring.layout(cc.plan, cc.info, n, k, torch.float32)
    with gpu_order.fake_cuda(monkeypatch):
        _grad_ring.reduce_scatter(cc, call, on_gpu(torch.randn(6, W * n)), on_gpu(torch.randn(6, k)), n, lay)
    sends = len(lay.bounds) * (W - 1)
    check_order(rec.ops, phase=lambda index: index + 1 if index < sends else index - sends + 2)
    _nontrivial(rec.ops, W)
    waits = [op[3] for op in rec.ops if op[:2] == ("wait", "ready")]
    # every send but the first two waits for a released region; every step but the first of a chunk for data
    assert sorted(waits) == sorted([sends + t for t in range(sends - 2)] + list(range(sends))), waits


@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_matmul_reduce_scatter(monkeypatch, W, r):
    heap = gpu_heap(W, r, 1 << 16)
    call = gpu_call(heap)
    rec = _record(monkeypatch, heap, call)
    with gpu_order.fake_cuda(monkeypatch):
        a2, b = on_gpu(torch.randn(5 * W, 4)), on_gpu(torch.randn(4, 3))
        scatter_gemm._symm(_context(W, r), call, Product([(a2, b)], Rows.flat(W, 5)))
    check_order(rec.ops)
    _nontrivial(rec.ops, W)


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_matmul_all_reduce(monkeypatch, W, r, one_shot):
    heap = gpu_heap(W, r, 1 << 16)
    call = gpu_call(heap)
    rec = _record(monkeypatch, heap, call)
    with gpu_order.fake_cuda(monkeypatch):
        matmul_all_reduce._symm(_context(W, r, one_shot), call, Gemm(on_gpu(torch.randn(7 * W, 4)),
                                                                     on_gpu(torch.randn(4, 3))))
    stride = symm.MAX_FLAGS // (W + 1)
    # Two-shot: the reduced chunks (flags W*stride + j) need the partials' waits first: a second phase.
    check_order(rec.ops, phase=(lambda index: 1) if one_shot else (lambda index: 2 if index >= W * stride else 1))
    _nontrivial(rec.ops, W)


def _handles(W: int, T: int, K: int, L: int, seed: int) -> list[layout.MoELayout]:
    handles = []
    for s in range(W):
        gen = torch.Generator().manual_seed(seed + s)
        E = W * L
        topk = torch.randint(0, E, (T, K), generator=gen)
        order, send_counts = entry.route("test", topk, E, W)
        info = types.SimpleNamespace(world_size=W, rank=s, device=torch.device("cpu"))
        handles.append(layout.MoELayout(CallContext("test", None, info, 5.0), E, L, K, T, send_counts, order))
    return handles


def _moe_heap(h: layout.MoELayout, H: int):
    W, r = h.info.world_size, h.info.rank
    need = layout.heap_need("symm", h.num_tokens, h.top_k, h.num_local_experts, h.send_splits, 4 * H, W)
    heap = gpu_heap(W, r, need + (1 << 12))
    return heap, gpu_call(heap)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-writes", "dispatch-kernel"])
@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_moe_dispatch(monkeypatch, W, r, kernel):
    T, K, L, H = 9, 2, 2, 4
    hs = _handles(W, T, K, L, seed=10 * W)
    h = hs[r]
    heap, call = _moe_heap(h, H)
    # What the peers' counts will be once read (rank r's row is written by the call itself).
    counts = call.buffer(r, torch.int32, (W, L))
    for s in range(W):
        counts[s] = torch.tensor(hs[s].send_counts[r], dtype=torch.int32)
    rec = _record(monkeypatch, heap, call)

    class Kernels:  # `overlap._C`'s dispatch kernel as moe_cuda launches it: only its flag writes matter here
        has_cuda = kernel

        def moe_dispatch_rows(self, *args):
            rec.ops.append(("kernel-release",))

        def cuda_stream_write_value32(self, addr, value, stream):
            rec.cuda_stream_write_value32(addr, value, stream)

    monkeypatch.setattr(moe_cuda, "_c", Kernels)
    monkeypatch.setattr(moe_cuda, "_stream", lambda device: 0)
    monkeypatch.setattr(moe_cuda, "warn_once", lambda *a, **k: None)
    x = on_gpu(torch.randn(T, H))
    with gpu_order.fake_cuda(monkeypatch):
        to_experts._symm(_context(W, r), call, h, x, h.token_of, None, True, None)
    check_order([op for op in rec.ops if op[0] != "kernel-release"])
    _nontrivial(rec.ops, W)
    if kernel:  # the kernel's flags are mirrored into the pads after it, before any wait
        at = rec.ops.index(("kernel-release",))
        assert any(op[:2] == ("write", "ready") for op in rec.ops[at:]), rec.ops
    assert h.recv_counts == [hs[s].send_counts[r] for s in range(W)]


@pytest.mark.parametrize("W,r", RANKS, ids=IDS)
def test_moe_combine(monkeypatch, W, r):
    T, K, L, H = 9, 2, 2, 4
    hs = _handles(W, T, K, L, seed=10 * W + 1)
    h = hs[r]
    h.recv_counts = [hs[s].send_counts[r] for s in range(W)]
    heap, call = _moe_heap(h, H)
    rec = _record(monkeypatch, heap, call)
    y = on_gpu(torch.randn(h.num_recv, H))
    with gpu_order.fake_cuda(monkeypatch):
        to_sources._symm(_context(W, r), call, h, y, None, None)
    check_order(rec.ops)
    _nontrivial(rec.ops, W)


def test_check_order_fails_on_a_wait_before_a_publish_of_its_phase():
    ops = [("wait", "done", 0, 0), ("wait", "ready", 1, 0), ("write", "ready", 0, 0), ("write", "done", 1, 0)]
    with pytest.raises(AssertionError, match="issued after the waits"):
        check_order(ops)
    # A publish of a later phase may follow an earlier phase's waits (it needs their data), not its own.
    ops = [("wait", "done", 0, 0), ("write", "ready", 0, 0), ("wait", "ready", 1, 0), ("write", "ready", 0, 9),
           ("wait", "ready", 1, 9), ("write", "done", 1, 0)]
    check_order(ops, phase=lambda index: 2 if index >= 9 else 1)
    with pytest.raises(AssertionError, match="issued after the waits"):
        check_order(ops)
