"""Memory of all_gather_weight_matmul on CPU ranks, measured with torch's profiler (`support.memory`): forward
and forward+backward, every strategy against ``reference`` (which materializes the whole weight and its whole
gradient); the symmetric heap reported beside (shared memory, not in the profiler's figures).

Run with ``-s`` to see the table the README quotes. The assertions are on bytes, never on times: ``symm``
holds at most two shards of the weight outside the heap (one at two ranks) and never the whole weight or
the whole weight gradient; ``reference`` holds both.
"""

from __future__ import annotations

import pytest
import torch
from support.memory import peak_allocated
from support.weight_oracle import b_of, oracle

ROWS, K, N = 16, 256, 128  # per rank: a [16, 256], one shard [256, 128] fp32 = 128 KiB
STRATEGIES = ("reference", "pipelined", "symm")


def memory_task(rank, world_size, seed):
    import overlap
    from overlap import symm

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
    heap = symm.heap_for(None)
    figures["heap"] = symm.NUM_SLOTS * heap.slot_bytes
    return figures


@pytest.mark.parametrize("world_size", [2, 4])
def test_weight_never_whole_under_symm(pools, seed, world_size):
    results = pools(world_size).run(memory_task, seed, timeout=120)
    shard = K * N * 4
    whole = world_size * shard
    print(f"\n[memory] all_gather_weight_matmul W={world_size}, a [{ROWS}, {K}], shard [{K}, {N}] fp32 "
          f"({shard // 1024} KiB, whole weight {whole // 1024} KiB); peak bytes allocated per rank")
    for rank, figures in enumerate(results):
        for strategy in STRATEGIES:
            fwd, both = figures[strategy]
            print(f"[memory]   rank {rank} {strategy:9s} forward {fwd / 1024:8.1f} KiB   "
                  f"forward+backward {both / 1024:8.1f} KiB")
        print(f"[memory]   rank {rank} symmetric heap (all 4 slots): {figures['heap'] / 1024:.1f} KiB")
        ref_fwd, ref_both = figures["reference"]
        assert ref_fwd >= whole and ref_both >= 2 * whole, figures  # the whole weight, then its whole gradient
        fwd, both = figures["symm"]
        ring = min(2, world_size - 1) * shard
        out = ROWS * world_size * N * 4
        assert fwd <= ring + out + 4096, (rank, figures)  # two shards at most (one at two ranks), and the output
        # backward: the ring again, this rank's gradient shard, activation-sized buffers (output, its
        # gradient transposed, grad_a); no whole-size weight nor weight gradient (fewer bytes from four ranks)
        assert both <= ring + shard + 3 * out + ROWS * K * 4 + 8192, (rank, figures)
        assert world_size < 4 or both < whole, (rank, figures)


def fused_task(rank, world_size):
    """The fused forward on a fresh group (its heap sized by this call alone): peak bytes, heap bytes."""
    import torch.distributed as dist

    import overlap
    from overlap import symm

    group = dist.new_group(backend="gloo")
    try:
        a, w = torch.randn(ROWS, K), torch.randn(N, K)
        with torch.no_grad():
            overlap.all_gather_weight_matmul(a, w.t(), group=group, strategy="fused")  # heap created and sized
            peak, _ = peak_allocated(lambda: overlap.all_gather_weight_matmul(a, w.t(), group=group, strategy="fused"))
            y = overlap.all_gather_weight_matmul(a, w.t(), group=group, strategy="fused")
        own = slice(rank * N, (rank + 1) * N)
        torch.testing.assert_close(y[:, own], a @ w.t(), rtol=1e-5, atol=1e-4)  # this rank's block
        return peak, symm.NUM_SLOTS * symm.heap_for(group).slot_bytes
    finally:
        overlap.release(group)
        dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_forward_holds_the_output_alone(pools, world_size):
    """Interpreted fused forward: nothing allocated but the output (the kernel reads every shard in place), one
    shard per heap slot."""
    out, shard = ROWS * world_size * N * 4, K * N * 4
    for rank, (peak, heap) in enumerate(pools(world_size).run(fused_task, timeout=300)):
        print(f"\n[memory]   rank {rank} fused forward {peak / 1024:.1f} KiB, heap {heap / 1024:.1f} KiB (4 slots)")
        assert peak <= out + 4096, (rank, peak, out)
        assert heap == 4 * shard, (rank, heap, shard)
