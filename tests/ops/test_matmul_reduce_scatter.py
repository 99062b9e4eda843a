"""matmul_reduce_scatter on CPU ranks: every strategy against the unfused computation, forward and backward.

Each rank holds ``a_r`` (``[M, ..., k_local]``, its slice of the contraction dim) and ``b_r``
(``[k_local, n]``); the op returns rank r's rows ``r*M/W ... (r+1)*M/W - 1`` of ``sum_s a_s @ b_s``.
The float64 oracle and the gradient convention are in `tp_oracle`.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S, LATE_S
from tests.support.tp_oracle import MRS, check_op, expect_error, silence

# (rows per rank of the output, middle dims, k_local, n, b layout): odd sizes, one row per rank,
# 3-D inputs, transposed weight views.
CASES = [
    (1, (), 7, 3, "weight.t()"),
    (3, (), 7, 3, "contiguous"),
    (4, (3,), 13, 11, "weight.t()"),
    (2, (2,), 31, 17, "contiguous"),
    (8, (), 64, 40, "weight.t()"),
]
FUSED_CASES = [(3, (), 24, 19, "weight.t()"), (2, (2,), 48, 40, "contiguous"), (1, (), 7, 3, "contiguous")]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_unfused(pools, seed, world_size, dtype, strategy):
    outputs = pools(world_size).run(check_op, MRS, strategy, dtype, seed, CASES)
    assert all(len(r) == len(CASES) for r in outputs)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_interpreted_matches_unfused(pools, seed, world_size, dtype):
    outputs = pools(world_size).run(check_op, MRS, "fused", dtype, seed, FUSED_CASES, timeout=60.0)
    assert all(len(r) == len(FUSED_CASES) for r in outputs)


def other_dtypes(rank, world_size, seed):
    """float16 on the strategies that support it (fused included) and float64 (no fused kernel)."""
    done = []
    cases = [(3, (), 24, 19, "weight.t()"), (2, (2,), 40, 8, "contiguous")]
    for strategy in ("pipelined", "symm", "fused"):
        done += check_op(rank, world_size, MRS, strategy, torch.float16, seed, cases)
    for strategy in ("reference", "pipelined", "symm", "auto"):
        done += check_op(rank, world_size, MRS, strategy, torch.float64, seed, cases)
    return len(done)


def test_float16_and_float64(pools, seed):
    assert pools(3).run(other_dtypes, seed, timeout=120) == [14] * 3


def single_rank(rank, world_size, seed):
    cases = [(5, (), 24, 19, "weight.t()"), (3, (2,), 16, 8, "contiguous")]
    return sum(
        len(check_op(rank, world_size, MRS, s, torch.float32, seed, cases))
        for s in ("reference", "pipelined", "symm", "fused", "auto")
    )


def test_single_rank_group(pools, seed):
    assert pools(1).run(single_rank, seed) == [10]


def plans_task(rank, world_size, seed):
    """Chunk counts that split each peer's rows unevenly (more chunks than rows included)."""
    import overlap

    done = []
    for strategy in ("pipelined", "symm"):
        for chunks in (2, 3, 7):
            plan = overlap.Plan(strategy, num_chunks={"shm": chunks})
            cases = [(5, (), 12, 7, "contiguous"), (4, (2,), 9, 5, "weight.t()")]
            done += check_op(rank, world_size, MRS, plan, torch.float32, seed + chunks, cases)
    return len(done)


@pytest.mark.parametrize("world_size", [3, 4])
def test_chunked_plans(pools, seed, world_size):
    assert pools(world_size).run(plans_task, seed) == [12] * world_size


# ----------------------------------------------------------------------------------------------
# Many calls back to back, changing shapes (heap growth), ranks out of step
# ----------------------------------------------------------------------------------------------


def back_to_back(rank, world_size, seed, calls):
    import overlap

    rng = random.Random(seed)  # same sequence of calls on every rank
    strategies = [
        "reference",
        "pipelined",
        "symm",
        "auto",
        "fused",
        overlap.Plan("pipelined", num_chunks={"shm": 3}),
        overlap.Plan("symm", num_chunks={"shm": 2}),
    ]
    for i in range(calls):
        strategy = strategies[i % len(strategies)]
        m = rng.choice([1, 3, 8, 17]) if strategy != "fused" else rng.choice([1, 2, 5])
        k = rng.choice([8, 24, 100]) if strategy != "fused" else rng.choice([8, 24])
        n, mid = rng.choice([5, 32]), rng.choice([(), (2,)])
        if rng.random() < 0.3 and rank == rng.randrange(world_size):
            time.sleep(0.05)  # this rank falls behind
        check_op(rank, world_size, MRS, strategy, torch.float32, seed + i, [(m, mid, k, n, "contiguous")])
    return calls


def test_back_to_back_calls_with_changing_shapes(pools, seed):
    assert pools(3).run(back_to_back, seed, 16, timeout=240) == [16] * 3


# ----------------------------------------------------------------------------------------------
# Bad input: raises on every rank, within seconds, and the group stays usable
# ----------------------------------------------------------------------------------------------


def bad_inputs(rank, world_size, strategy):
    import overlap

    fn = overlap.matmul_reduce_scatter
    results = {}
    a, b = torch.randn(2 * world_size, 8), torch.randn(8, 5)
    results["rows_not_divisible"] = expect_error(fn, torch.randn(2 * world_size + 1, 8), b, strategy=strategy)
    results["rows_less_than_world"] = expect_error(fn, torch.randn(world_size - 1, 8), b, strategy=strategy)
    results["k_mismatch"] = expect_error(fn, a, torch.randn(7, 5), strategy=strategy)
    results["dtype_mismatch"] = expect_error(fn, a, b.double(), strategy=strategy)
    results["one_dim"] = expect_error(fn, torch.randn(8), b, strategy=strategy)
    results["one_shot"] = expect_error(fn, a, b, plan=overlap.Plan(strategy, one_shot=True))
    results["bad_timeout"] = expect_error(fn, a, b, strategy=strategy, timeout=0)
    # One rank with a different n: every rank raises, with both signatures.
    results["shape_differs"] = expect_error(fn, a, torch.randn(8, 5 + rank), strategy=strategy, timeout=20)
    # One rank's local mistake (rows not divisible on rank 0 only): it raises ValueError, the others
    # learn it at once.
    a_r = torch.randn(2 * world_size + (1 if rank == 0 else 0), 8)
    results["one_rank_bad"] = expect_error(fn, a_r, b, strategy=strategy, timeout=20)
    # The group still works.
    y = fn(a, b, strategy=strategy)
    results["then_ok"] = (None, str(tuple(y.shape)), 0.0)
    return results


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
def test_bad_input_raises_on_every_rank(pools, strategy):
    world_size = 3
    results = pools(world_size).run(bad_inputs, strategy, timeout=120)
    for rank, res in enumerate(results):
        ctx = f"rank {rank} {strategy}"
        slow = {key: secs for key, (_, _, secs) in res.items() if secs >= FALLBACK_TIMEOUT_S}
        assert not slow, f"{ctx}: errors waited for a deadline: {slow}"
        for key in ("rows_not_divisible", "rows_less_than_world"):
            kind, msg, secs = res[key]
            assert kind == "ValueError" and secs < FALLBACK_TIMEOUT_S, (ctx, key, res[key])
        assert "7" in res["rows_not_divisible"][1], (ctx, res["rows_not_divisible"])  # names the rows
        assert res["k_mismatch"][0] == "ValueError" and "k=7" in res["k_mismatch"][1], (ctx, res["k_mismatch"])
        assert res["dtype_mismatch"][0] == "TypeError", (ctx, res["dtype_mismatch"])
        assert res["one_dim"][0] == "ValueError", (ctx, res["one_dim"])
        assert res["one_shot"][0] == "ValueError" and "one_shot" in res["one_shot"][1], (ctx, res["one_shot"])
        assert res["bad_timeout"][0] == "ValueError", (ctx, res["bad_timeout"])
        kind, msg, secs = res["shape_differs"]
        assert kind == "OverlapMismatchError" and secs < FALLBACK_TIMEOUT_S, (ctx, res["shape_differs"])
        assert all(f"({8}, {5 + r})" in msg for r in range(world_size)), (ctx, msg)
        kind, msg, secs = res["one_rank_bad"]
        want = "ValueError" if rank == 0 else "OverlapMismatchError"
        assert kind == want and secs < FALLBACK_TIMEOUT_S, (ctx, res["one_rank_bad"])
        assert res["then_ok"][1] == "(2, 5)", (ctx, res["then_ok"])


# ----------------------------------------------------------------------------------------------
# Deadlines: a peer that never publishes its data, a peer that is killed
# ----------------------------------------------------------------------------------------------


def silent_peer(rank, world_size, strategy):
    """Rank 1 makes the call but never publishes its data; the others must time out naming it."""
    import overlap

    a, b = torch.randn(2 * world_size, 8), torch.randn(8, 3)
    overlap.matmul_reduce_scatter(a, b, strategy=strategy)  # heap exists, everyone healthy
    silence(1, rank)
    result = expect_error(overlap.matmul_reduce_scatter, a, b, strategy=strategy, timeout=2.0)
    if rank == 1:
        time.sleep(3.0)  # stay alive until the others have timed out
    return result


@pytest.mark.parametrize("strategy", ["pipelined", "symm"])
def test_silent_peer_times_out(strategy):
    from tests.support.harness import run_isolated

    results = run_isolated(3, silent_peer, strategy, timeout=90)
    for rank in (0, 2):
        kind, msg, secs = results[rank]
        assert kind == "OverlapTimeout", (rank, strategy, results[rank])
        assert "matmul_reduce_scatter" in msg and "chunk" in msg, (rank, strategy, msg)
        assert 1.5 < secs <= 2.0 + LATE_S, (rank, strategy, secs)
    # symm waits on every producer's flags, so every rank names the silent one; in the ring
    # (pipelined) rank 2 receives from rank 1 and names it, rank 0 names the neighbour it waits on.
    for rank in (0, 2) if strategy == "symm" else (2,):
        assert "peer 1" in results[rank][1], (rank, strategy, results[rank][1])


def killed_peer(rank, world_size, shm_dir):
    import signal

    import overlap

    a, b = torch.randn(2 * world_size, 8), torch.randn(8, 3)
    overlap.matmul_reduce_scatter(a, b, strategy="symm")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    result = expect_error(overlap.matmul_reduce_scatter, a, b, strategy="symm", timeout=2.0)
    return result


def test_killed_peer_times_out():
    from tests.support.harness import RankError, RankPool

    pool = RankPool(3)
    try:
        pool.send(killed_peer, os.environ.get("OVERLAP_SHM_DIR", "/dev/shm"))
        with pytest.raises(RankError, match="rank 2 died") as info:
            pool.collect(60, "killed_peer")
    finally:
        pool.close()
    for rank in (0, 1):
        kind, msg, secs = info.value.results[rank]
        assert kind == "OverlapTimeout" and "peer 2" in msg, (rank, kind, msg)
        assert secs <= 2.0 + LATE_S, (rank, secs)
