"""The sequence-parallel ops (`overlap.matmul_all_to_all`, `overlap.all_to_all_matmul`) on CPU ranks: every strategy
against the unparallelized layer in float64, forward and backward, sequence-first and batch-first, one weight and
GQA's three; bad inputs raising on every rank before any data moves. The oracle: `tests.support.sp_oracle`."""

from __future__ import annotations

import pytest
import torch

from overlap.plans import OPS
from tests.support import sp_oracle


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_float64(pools, seed, world_size, dtype, strategy):
    done = pools(world_size).run(sp_oracle.check_cases, strategy, dtype, seed)
    assert done == [sp_oracle.count_cases()] * world_size


def test_bad_inputs_raise_on_every_rank_before_any_data_moves(pools):
    """A rank's own mistake raises there and, at once, OverlapMismatchError on its peers; mistakes every rank makes
    raise ValueError everywhere; the pool stays usable (no call was left half-way)."""
    seen = pools(3).run(sp_oracle.bad_inputs)
    assert seen[1][0][0] == "ValueError" and "x" in seen[1][0][1], seen[1][0]
    for r in (0, 2):
        assert seen[r][0][0] == "OverlapMismatchError" and seen[r][0][2] < 30, seen[r][0]
    for r in range(3):
        kinds = [(kind, message) for kind, message, _ in seen[r][1:]]
        assert kinds[0][0] == "ValueError" and "do not divide by the world size" in kinds[0][1], kinds[0]
        assert kinds[1][0] == "ValueError" and "pad the sequence" in kinds[1][1], kinds[1]
        assert kinds[2][0] == "ValueError" and "not implemented" in kinds[2][1], kinds[2]
        assert kinds[3][0] == "ValueError" and "one head count per weight" in kinds[3][1], kinds[3]
    assert pools(3).run(sp_oracle.check_cases, "pipelined", torch.float32, 5) == [sp_oracle.count_cases()] * 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_workloads_and_torch_rows_match_their_oracle(pools, seed, world_size):
    """What ``overlap tune`` and the GPU check run (each op's workload) and the plain-torch row agree with the
    workload's oracle in float64."""
    want = 2 * len([s for s in OPS[sp_oracle.MA2A].strategies if s != "fused"]) + 2  # (two ops, each with torch)
    assert pools(world_size).run(sp_oracle.workload_rows, seed) == [want] * world_size


def test_compiled_whole_matches_eager(pools, seed):
    assert pools(2).run(sp_oracle.compiled_layer, seed, timeout=300) == [True, True]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_interpreted_matches_float64(pools, seed, world_size, dtype):
    """``fused`` (the Triton kernels, interpreted on CPU ranks) against the float64 oracle, forward and backward."""
    done = pools(world_size).run(sp_oracle.check_cases, "fused", dtype, seed, timeout=300)
    assert done == [sp_oracle.count_cases()] * world_size


@pytest.mark.parametrize("op", [sp_oracle.MA2A, sp_oracle.A2AM])
@pytest.mark.parametrize("strategy", ["pipelined", "symm"])
def test_silent_peer_times_out(op, strategy):
    """A peer that stays in the call but sends nothing: every other rank raises OverlapTimeout at the call's deadline,
    naming the op and a chunk (symm: the silent rank itself, whose flags never come)."""
    from tests.support.harness import LATE_S, run_isolated

    results = run_isolated(3, sp_oracle.silent_peer, op, strategy, timeout=90)
    for rank in (0, 2):
        kind, msg, secs = results[rank]
        assert kind == "OverlapTimeout" and op in msg and "chunk" in msg, (rank, results[rank])
        assert 1.5 < secs <= 2.0 + LATE_S, (rank, secs)
        if strategy == "symm":
            assert "peer 1" in msg, (rank, msg)


@pytest.mark.parametrize("strategy", ["symm", "fused"])
def test_varying_sequence_lengths_reuse_the_heap(pools, strategy):
    """Shards of 6, 2, 4, 6 positions in turn: every call right, the heap's slot sized once for the longest and
    never re-allocated after (shorter calls use part of it)."""
    for sizes in pools(2).run(sp_oracle.varying_lengths, strategy, timeout=300):
        assert sizes[1:] == [sizes[0]] * 3, sizes
