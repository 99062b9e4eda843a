"""The symmetric-memory buffer protocol of `overlap.symm` on CPU ranks, driven through all_gather_matmul.

What is tested is the protocol, not the op (whose strategies, shapes, bad input and deadlines are
tested in test_all_gather_matmul.py): a heap reserved ahead does not grow and a released one is
re-created; flag epochs re-base and calls stay right across it; a local failure on one rank (its heap
growth, its Triton import, its reserve size) raises on every rank at once, through the handshake, and
the group stays usable. Each call's output is checked against the float64 oracle of `tests.support.tp_oracle`.
In one process: the hash of a call's signature, which the handshake compares, tells signatures apart.
"""

from __future__ import annotations

import pytest
import torch

from overlap import symm
from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.tp_oracle import AGM, b_of, compare, expect_error, oracle

# ----------------------------------------------------------------------------------------------
# Heap lifetime: reserve ahead, no growth afterwards; release and re-create
# ----------------------------------------------------------------------------------------------


def reserve_then_release(rank, world_size, seed):
    import torch.distributed as dist

    import overlap
    from overlap import symm

    group = dist.new_group(list(range(world_size)))
    overlap.reserve(group, 1 << 16)
    heap = symm.heap_for(group)
    generation, slot_bytes = heap.generation, heap.slot_bytes
    assert slot_bytes >= 1 << 16, slot_bytes
    cases = [(8, (), 64, 16, "contiguous"), (30, (), 500, 4, "weight.t()")]
    done = check_strategy_on(group, rank, world_size, seed, cases)
    assert (heap.generation, heap.slot_bytes) == (generation, slot_bytes), "a reserved heap grew"
    with pytest.raises(ValueError):
        overlap.reserve(group, -1)
    overlap.release(group)
    assert heap.closed
    done += check_strategy_on(group, rank, world_size, seed + 1, [(4, (), 8, 3, "contiguous")])  # a fresh heap
    assert symm.heap_for(group) is not heap
    overlap.release(group)
    return done


def check_strategy_on(group, rank, world_size, seed, cases):
    import overlap

    done = 0
    for m, mid, k, n, layout in cases:
        inputs, want = oracle(AGM, seed, world_size, (m, mid, k, n, layout), torch.float32)
        a, param, _ = inputs[rank]
        b = b_of(param, layout)
        for strategy in ("symm", "fused" if k <= 128 else "pipelined"):
            y = overlap.all_gather_matmul(a, b, group=group, strategy=strategy)
            # fp32 against the float64 oracle (|y| ~ sqrt(k), k=500 here: the tolerance scales with it).
            compare(f"rank {rank} {strategy} k={k} seed={seed}", [y], [want[rank][0]], torch.float32, labels=("out",))
            done += 1
    return done


@pytest.mark.exact
def test_reserve_and_release(pools, seed):
    assert pools(2).run(reserve_then_release, seed) == [6, 6]


def across_epoch_rebase(rank, world_size, seed):
    """Flags are int32: every REBASE_EPOCH calls the group resets them; calls stay right across it."""
    import torch.distributed as dist

    from overlap import symm
    from overlap.symm import heap as symm_heap

    group = dist.new_group(list(range(world_size)))
    symm_heap.REBASE_EPOCH = 7  # (where the heap reads it) as if after a billion calls, several times over
    done = 0
    strategies = ["symm", "fused", "reference", "symm", "fused", "pipelined", "symm", "fused"] * 3
    for i, strategy in enumerate(strategies):
        inputs, want = oracle(AGM, seed + i, world_size, (3, (), 16, 5, "contiguous"), torch.float32)
        a, b, _ = inputs[rank]  # "contiguous": b is the parameter itself
        y = overlap_call(a, b, group, strategy)
        compare(f"call {i} {strategy} rank {rank} seed={seed + i}", [y], [want[rank][0]], torch.float32,
                labels=("out",))
        done += 1
    assert symm.heap_for(group)._rebases == 3, symm.heap_for(group)._rebases
    symm_heap.REBASE_EPOCH = symm.REBASE_EPOCH
    symm.release(group)
    return done


def overlap_call(a, b, group, strategy):
    import overlap

    return overlap.all_gather_matmul(a, b, group=group, strategy=strategy)


def test_epochs_rebase(pools, seed):
    assert pools(3).run(across_epoch_rebase, seed) == [24, 24, 24]


# ----------------------------------------------------------------------------------------------
# Local failures on one rank after the first call: every rank fails fast, the group stays usable
# ----------------------------------------------------------------------------------------------


def one_rank_fails_locally(rank, world_size):
    import overlap
    from overlap import shm, symm
    from overlap.ops import fused

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    overlap.all_gather_matmul(a, b, strategy="symm")  # the heap exists
    # Rows whose gathered copy outgrows the heap, however large earlier tests on this pool left it.
    grow_rows = symm.heap_for(None).slot_bytes // (8 * 4) + 1
    results = {}
    # Heap growth fails on rank 1 only (as when its /dev/shm is full).
    create = shm.create_segment
    if rank == 1:
        def no_space(path, nbytes):
            raise OSError(28, "No space left on device")

        shm.create_segment = no_space
    results["growth"] = expect_error(overlap.all_gather_matmul, torch.randn(grow_rows, 8), b, strategy="symm",
                                     timeout=20)
    shm.create_segment = create
    # Triton cannot be imported on rank 1 only.
    kernels = fused.kernels
    if rank == 1:
        def broken():
            raise RuntimeError("the 'fused' strategy needs Triton, which failed to import: (test)")

        fused.kernels = broken
    results["fused_unavailable"] = expect_error(overlap.all_gather_matmul, a, b, strategy="fused", timeout=20)
    fused.kernels = kernels
    # reserve() with a bad size on rank 1 only.
    results["reserve"] = expect_error(overlap.reserve, None, -5 if rank == 1 else 1024, timeout=20)
    # The group still works, on every strategy, for more calls than the slot ring holds.
    for strategy in ["symm", "fused", "reference", "pipelined"] * 2:
        y = overlap.all_gather_matmul(a, b, strategy=strategy, timeout=20)
        assert y.shape == (4 * world_size, 3)
    results["then_ok"] = True
    return results


def test_one_rank_local_failures_fail_fast_everywhere(pools):
    for rank, res in enumerate(pools(2).run(one_rank_fails_locally, timeout=120)):
        kind, msg, secs = res["growth"]
        assert kind == "OSError" and secs < FALLBACK_TIMEOUT_S, (rank, res["growth"])
        kind, msg, secs = res["fused_unavailable"]
        want = "ValueError" if rank == 1 else "OverlapMismatchError"
        assert kind == want and secs < FALLBACK_TIMEOUT_S, (rank, msg)
        kind, msg, secs = res["reserve"]
        want = "ValueError" if rank == 1 else "OverlapMismatchError"
        assert kind == want and secs < FALLBACK_TIMEOUT_S, (rank, msg)
        assert res["then_ok"]


# ----------------------------------------------------------------------------------------------
# Single process: the hash of a call's signature, which the handshake compares
# ----------------------------------------------------------------------------------------------


def test_signature_hash_separates_signatures():
    a = symm.signature_hash("all_gather_matmul(a=(4, 8):float32, b=(8, 5), plan=symm[])")
    b = symm.signature_hash("all_gather_matmul(a=(5, 8):float32, b=(8, 5), plan=symm[])")
    assert a != b and a == symm.signature_hash("all_gather_matmul(a=(4, 8):float32, b=(8, 5), plan=symm[])")
