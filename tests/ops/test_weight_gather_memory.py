"""Memory of all_gather_weight_matmul on CPU ranks, measured with torch's profiler (`tests.support.memory`): forward
and forward+backward, every strategy against ``reference`` (which materializes the whole weight and its whole
gradient); the symmetric heap reported beside (shared memory, not in the profiler's figures): its size (4 slots)
and the bytes of their slots the calls of one forward+backward touched (`tests.support.memory.HeapUse`).

Run with ``-s`` to see the table ``docs/results/memory.md`` records. The assertions are on bytes, never on
times: ``symm`` and ``fused`` hold at most two shards of the weight outside the heap (one at two ranks) and
never the whole weight or the whole weight gradient (no allocation larger than the gather's two local shards;
fp32: bounds on the peak too); in the heap, a forward+backward touches at most two shards (the forward's, the backward's
re-gather's) and two chunk regions (the weight gradient's ring), in slots of one shard (fp32 and bf16);
``reference`` holds the whole weight and its whole gradient.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from tests.support.memory import HeapUse, peak_allocated, profile
from tests.support.weight_oracle import b_of, oracle

ROWS, K, N = 16, 256, 128  # per rank: a [16, 256], one shard [256, 128] fp32 = 128 KiB
SHARD = K * N * 4
CALLS = ("forward", "backward's re-gather", "grad_b ring")  # the heap calls of one forward+backward
STRATEGIES = ("reference", "pipelined", "symm")


def memory_task(rank, world_size, seed):
    import overlap

    case = (ROWS, (), K, N, "weight.t()")
    inputs, want = oracle(seed, world_size, case, torch.float32)
    a, w, g = inputs[rank]
    figures = {}
    for strategy in STRATEGIES:
        a_leaf, w_leaf = a.clone().requires_grad_(), w.clone().requires_grad_()
        overlap.all_gather_weight_matmul(a_leaf, b_of(w_leaf, "weight.t()"), strategy=strategy).backward(g)
        with torch.no_grad():  # heap sized, first-call work done: now the forward alone
            fwd = peak_allocated(lambda s=strategy: overlap.all_gather_weight_matmul(a, w.t(), strategy=s))
        a_leaf.grad = w_leaf.grad = None

        def step(a_leaf=a_leaf, w_leaf=w_leaf, s=strategy):
            overlap.all_gather_weight_matmul(a_leaf, w_leaf.t(), strategy=s).backward(g)

        both = peak_allocated(step)
        torch.testing.assert_close(w_leaf.grad.t(), want[rank][2].float(), rtol=1e-4, atol=1e-4)
        figures[strategy] = (fwd[0], both[0])
    return figures


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 4])
def test_weight_never_whole_under_symm(pools, seed, world_size):
    results = pools(world_size).run(memory_task, seed, timeout=120)
    whole = world_size * SHARD
    print(f"\n[memory] all_gather_weight_matmul W={world_size}, a [{ROWS}, {K}], shard [{K}, {N}] fp32 "
          f"({SHARD // 1024} KiB, whole weight {whole // 1024} KiB); peak bytes allocated per rank")
    for rank, figures in enumerate(results):
        for strategy in STRATEGIES:
            fwd, both = figures[strategy]
            print(f"[memory]   rank {rank} {strategy:9s} forward {fwd / 1024:8.1f} KiB   "
                  f"forward+backward {both / 1024:8.1f} KiB")
        ref_fwd, ref_both = figures["reference"]
        assert ref_fwd >= whole and ref_both >= 2 * whole, figures  # the whole weight, then its whole gradient
        _assert_outside_heap(rank, world_size, *figures["symm"], figures)


def _assert_outside_heap(rank, world_size, fwd, both, figures, size=4, region=0):
    """symm and fused outside the heap (elements of `size` bytes; `region`: the bytes of one fp32 chunk of the
    weight gradient's ring, for 16-bit dtypes): no whole-size weight nor weight gradient."""
    shard = K * N * size
    ring = min(2, world_size - 1) * shard
    out = ROWS * world_size * N * size
    assert fwd <= ring + out + 4096, (rank, figures)  # two shards at most (one at two ranks), and the output
    # backward: the gather's ring again, this rank's gradient shard, activation-sized buffers (output, grad_a,
    # a's gradient), grad_a's fp32 sum, chunk temporaries (16-bit: a chunk's partial and its fp32 upcast, summed
    # into the ring's fp32 region); no whole-size weight nor weight gradient (fewer bytes from four ranks)
    chunk = 8192 + (region + region * size // 4 if size < 4 else 0)
    assert both <= ring + shard + 3 * out + ROWS * K * 4 + chunk, (rank, figures)
    # fp32: fewer bytes in all than the whole weight from four ranks (16-bit: the fp32 sums weigh twice their
    # elements, so the whole 16-bit weight is no yardstick; the callers' largest-allocation bound is the guard)
    assert size < 4 or world_size < 4 or both < world_size * shard, (rank, figures)


def heap_task(rank, world_size, strategy, dtype, inject=None):
    """Forward and forward+backward on a fresh group (its heap sized by these calls alone): peak bytes
    allocated, the heap's slot size, the bytes of its slot each call of one forward+backward touched, the
    largest allocation, and the sizes of the temporaries `inject` made (`_injected`)."""
    import torch.distributed as dist

    import overlap
    from overlap import Plan, symm, world
    from overlap.ops.tp import grad_ring as _grad_ring

    group = dist.new_group(backend="gloo")
    injected = []
    try:
        lay = _grad_ring.layout(Plan(strategy), world.group_info(group), N, K, dtype)
        a, w, g = (torch.randn(shape).to(dtype) for shape in ((ROWS, K), (N, K), (ROWS, world_size * N)))
        a_leaf, w_leaf = a.clone().requires_grad_(), w.clone().requires_grad_()

        def step():
            overlap.all_gather_weight_matmul(a_leaf, w_leaf.t(), group=group, strategy=strategy).backward(g)

        with _injected(inject, world_size, injected):
            step()  # heap created and sized, first-call work done
            with torch.no_grad():
                fwd, _ = peak_allocated(lambda: overlap.all_gather_weight_matmul(a, w.t(), group=group,
                                                                                 strategy=strategy))
            a_leaf.grad = w_leaf.grad = None
            with HeapUse() as use:
                both, _, largest = profile(step)
        every_a = [torch.empty(ROWS, K, dtype=dtype) for _ in range(world_size)]
        every_g = [torch.empty(ROWS, world_size * N, dtype=dtype) for _ in range(world_size)]
        dist.all_gather(every_a, a, group=group)
        dist.all_gather(every_g, g, group=group)
        block = slice(rank * N, (rank + 1) * N)
        want = sum(ga.double().t() @ aa.double() for ga, aa in zip(every_g, every_a))[block]
        if dtype == torch.float32:
            torch.testing.assert_close(w_leaf.grad.double(), want, rtol=1e-4, atol=1e-4)
        else:  # each partial rounded once to bf16 and the fp32 sum once: within 2^-7 of the terms' magnitudes
            scale = sum(ga.double().abs().t() @ aa.double().abs() for ga, aa in zip(every_g, every_a))[block]
            err = (w_leaf.grad.double() - want).abs()
            assert bool((err <= 2**-7 * scale).all()), float((err / scale).max())
        slot = symm.heap_for(group).slot_bytes
        return fwd, both, slot, use.calls, (len(lay.bounds), lay.region_bytes), largest, injected
    finally:
        overlap.release(group)
        dist.destroy_process_group(group)


@contextlib.contextmanager
def _injected(kind, world_size, sizes):
    """Faults for the check of the check (`test_bound_counts_the_op_not_the_gemm_library`):

    * ``"gemm_workspace"``: every CPU ``aten::mm`` allocates and frees, inside the call, a temporary larger than
      both its operands (as a BLAS path that packs or upcasts them does; a bigger one than the shard the
      bound allows), then computes by ``bmm``; `sizes` gets each temporary's bytes;
    * ``"whole_weight"``: the op holds a whole weight's worth of bytes (``world_size`` shards) outside its
      GEMMs: the shard as rows is a view of such a buffer.
    """
    if kind is None:
        yield
    elif kind == "gemm_workspace":

        def workspace(x, y):
            nbytes = (x.numel() + y.numel()) * 4 + 6144
            sizes.append(nbytes)
            torch.empty(nbytes, dtype=torch.uint8)  # freed at once, still inside the GEMM's call

        def mm(x, y):
            workspace(x, y)
            return torch.bmm(x[None], y[None])[0]

        def mm_out(x, y, *, out):
            workspace(x, y)
            return out.copy_(torch.bmm(x[None], y[None])[0])

        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            lib.impl("mm", mm, "CPU")
            lib.impl("mm.out", mm_out, "CPU")
        try:
            yield
        finally:
            lib._destroy()  # torch's own kernels again
    elif kind == "whole_weight":
        from overlap.ops.tp import all_gather_weight_matmul as agwm

        rows_of = agwm._rows_of

        def whole(b):
            rows = rows_of(b)
            return torch.empty((world_size * rows.shape[0], rows.shape[1]), dtype=rows.dtype)[: rows.shape[0]].copy_(
                rows)

        agwm._rows_of = whole
        try:
            yield
        finally:
            agwm._rows_of = rows_of
    else:
        raise AssertionError(kind)


def check_heap(world_size, strategy, dtype, results):
    """The bounds of `test_heap_holds_two_shards_plus_chunks` on every rank's `heap_task` figures."""
    from overlap import symm

    size = torch.empty((), dtype=dtype).element_size()
    shard, out = K * N * size, ROWS * world_size * N * size
    num_chunks, region = results[0][4]
    chunks = 2 * region
    print(f"\n[memory] {strategy} {str(dtype)[6:]} W={world_size}, shard {shard // 1024} KiB, weight-gradient ring of "
          f"{num_chunks} chunks per block: two regions of {region // 1024} KiB")
    for rank, (fwd, both, slot, calls, _lay, largest, _injected) in enumerate(results):
        used = sum(nbytes for _op, nbytes in calls)
        print(f"[memory]   rank {rank} {strategy:5s} forward {fwd / 1024:7.1f} KiB  forward+backward "
              f"{both / 1024:7.1f} KiB (largest allocation {largest / 1024:.0f})  heap "
              f"{symm.NUM_SLOTS * slot / 1024:.0f} KiB (4 slots of {slot / 1024:.0f});"
              f" touched in forward+backward {used / 1024:.0f} KiB: "
              + ", ".join(f"{what} {n / 1024:.0f}" for what, (_op, n) in zip(CALLS, calls)))
        assert slot == shard, (rank, slot)  # one shard per slot: the ring's pair of chunks fits in it
        assert [n for _op, n in calls] == [shard, shard, chunks], (rank, calls)  # forward, re-gather, grad ring
        assert used <= 2 * shard + chunks and chunks <= shard, (rank, calls)
        # No whole-size weight or weight gradient: no allocation holds more than the gather's two local shards.
        assert largest <= min(2, world_size - 1) * shard < world_size * shard, (rank, largest)
        _assert_outside_heap(rank, world_size, fwd, both, (fwd, both), size, region)
        if strategy == "fused":
            assert fwd <= out + 4096, (rank, fwd, out)


@pytest.mark.exact
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["symm", "fused"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_heap_holds_two_shards_plus_chunks(pools, world_size, strategy, dtype):
    """symm and fused (interpreted) forward+backward: one shard per heap slot; the calls of one forward+backward
    touch at most two shards (the forward's own, the backward re-gather's own) and two chunk regions (the weight
    gradient's ring); outside the heap, no whole-size weight nor weight gradient (fused's forward: the output
    alone, its kernel reads every shard in place). bf16: the ring's regions hold fp32 sums, so it has twice the
    chunks of fp32 and the same bytes."""
    timeout = 300 if strategy == "fused" else 120
    check_heap(world_size, strategy, dtype, pools(world_size).run(heap_task, strategy, dtype, timeout=timeout))


@pytest.mark.exact
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bound_counts_the_op_not_the_gemm_library(pools, dtype):
    """The bounds count what the op allocates, whatever the CPU's GEMM library allocates inside a call: a
    temporary larger than a shard, made and freed inside every ``aten::mm``, leaves them green; a whole weight
    held by the op outside its GEMMs fails them."""
    with_workspace = pools(2).run(heap_task, "symm", dtype, "gemm_workspace")
    shard = K * N * torch.empty((), dtype=dtype).element_size()
    assert max(max(r[-1]) for r in with_workspace) > shard, "the injected temporaries are smaller than the bound"
    check_heap(2, "symm", dtype, with_workspace)
    with pytest.raises(AssertionError):
        check_heap(2, "symm", dtype, pools(2).run(heap_task, "symm", dtype, "whole_weight"))
