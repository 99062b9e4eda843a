"""all_gather_weight_matmul (the weight-side gather of FSDP) on CPU ranks: every strategy against float64,
forward and backward; agreement, bad input on one rank, silent and killed peers; bytes read from peers.

The oracle (`tests.support.weight_oracle`) is computed on every rank in float64 from every rank's inputs:
``y_r = a_r @ cat_q(b_q, dim=1)``, ``grad a_r = g_r @ B.T``, ``grad b_r = sum_q a_q.T @ g_q[:, cols of r]``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S, LATE_S
from tests.support.tp_oracle import expect_error, silence
from tests.support.weight_oracle import check, oracle

OP = "all_gather_weight_matmul"

# (rows, middle dims, k, n per shard, b layout): odd sizes, one row, 3-D inputs, transposed weight views.
CASES = [
    (5, (), 7, 3, "weight.t()"),
    (1, (), 16, 9, "contiguous"),
    (4, (3,), 13, 11, "weight.t()"),
    (3, (2,), 31, 17, "contiguous"),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_float64(pools, seed, world_size, dtype, strategy):
    results = pools(world_size).run(check, strategy, dtype, seed, CASES)
    assert all(len(r) == len(CASES) for r in results)


def engine_task(rank, world_size, seed, inline_bytes):
    """`check` of symm with the weight's peer shards pulled inline (small) or by the copy engine's thread (every
    pull, `INLINE_COPY_BYTES` 0); returns the checked cases and the pulls the engine ran."""
    from overlap import comm
    from tests.support.weight_oracle import check as check_here

    limit, engine = comm.INLINE_COPY_BYTES, comm.copy_engine
    submitted = [0]

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def submit(self, *args, **kwargs):
            submitted[0] += 1
            return self.inner.submit(*args, **kwargs)

    comm.INLINE_COPY_BYTES = inline_bytes
    comm.copy_engine = lambda: Counting(engine())
    try:
        return check_here(rank, world_size, "symm", torch.float32, seed, CASES), submitted[0]
    finally:
        comm.INLINE_COPY_BYTES, comm.copy_engine = limit, engine


@pytest.mark.parametrize("world_size", [2, 3])
def test_symm_weight_pulls_inline_or_by_the_copy_engine_alike(pools, seed, world_size):
    """Small weights are pulled on the calling thread; with the limit at 0 every pull goes through the copy engine's
    thread: both match float64, forward and backward."""
    for inline_bytes, engine_used in ((256 * 1024, False), (0, True)):
        for checked, submitted in pools(world_size).run(engine_task, seed, inline_bytes):
            assert len(checked) == len(CASES)
            assert (submitted > 0) == engine_used, (inline_bytes, submitted)


FUSED_CASES = [(5, (), 24, 19, "weight.t()"), (4, (2,), 48, 40, "contiguous")]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_interpreted_matches_float64(pools, seed, world_size, dtype):
    """The Triton kernel (interpreted on CPU ranks): tiles read each shard from its owner's buffer."""
    results = pools(world_size).run(check, "fused", dtype, seed, FUSED_CASES, timeout=60.0)
    assert all(len(r) == len(FUSED_CASES) for r in results)


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm"])
def test_float64(pools, seed, strategy):
    assert all(len(r) == 2 for r in pools(2).run(check, strategy, torch.float64, seed, CASES[:2]))


def chunked_task(rank, world_size, seed):
    """Chunk counts that split each shard unevenly (more chunks than rows included); bitwise repeatable (symm and
    fused: the weight gradient's ring sums each block in one fixed order)."""
    import overlap

    done = 0
    for strategy in ("pipelined", "symm", "fused"):
        for chunks in (2, 3, 7):
            plan = overlap.Plan(strategy, num_chunks={"shm": chunks})
            first = check(rank, world_size, plan, torch.float32, seed + chunks, [(5, (), 12, 5, "contiguous")])[0]
            again = check(rank, world_size, plan, torch.float32, seed + chunks, [(5, (), 12, 5, "contiguous")])[0]
            assert all(torch.equal(x, y) for x, y in zip(first, again)), (strategy, chunks)
            done += 1
    return done


@pytest.mark.exact
def test_chunked_plans_and_repeatable(pools, seed):
    assert pools(3).run(chunked_task, seed, timeout=120) == [9] * 3


def bytes_task(rank, world_size):
    """Each peer's shard is read once per forward (and once more by the backward's re-gather)."""
    import overlap
    from overlap.ops.tp import all_gather_weight_matmul as mod

    a, b = torch.randn(4, 32), torch.randn(32, 16)
    shard = 32 * 16 * 4

    def read(fn) -> float:
        before = sum(mod.BYTES_FROM_PEERS.values())
        fn()
        return (sum(mod.BYTES_FROM_PEERS.values()) - before) / shard

    out = {}
    for strategy in ("pipelined", "symm", "fused"):
        fwd = read(lambda s=strategy: overlap.all_gather_weight_matmul(a, b, strategy=s))
        a2, b2 = a.clone().requires_grad_(), b.clone().requires_grad_()
        both = read(lambda s=strategy, a2=a2, b2=b2: overlap.all_gather_weight_matmul(a2, b2, strategy=s).sum()
                    .backward())
        out[strategy] = (fwd, both)
    return out


@pytest.mark.exact
def test_each_peer_shard_read_once_per_gather(pools):
    for res in pools(3).run(bytes_task):
        assert res == {"pipelined": (2.0, 4.0), "symm": (2.0, 4.0), "fused": (2.0, 4.0)}, res


def one_gradient_task(rank, world_size, seed):
    """Only the weight's gradient (symm, fused: the ring's call alone, no re-gather), then only the input's."""
    import overlap

    case = (6, (), 20, 7, "weight.t()")
    inputs, want = oracle(seed, world_size, case, torch.float32)
    a, w, g = inputs[rank]
    for strategy in ("pipelined", "symm", "fused"):
        w_leaf = w.clone().requires_grad_()
        overlap.all_gather_weight_matmul(a, w_leaf.t(), strategy=strategy).backward(g)
        torch.testing.assert_close(w_leaf.grad.t().double(), want[rank][2], rtol=1e-4, atol=1e-4)
        a_leaf = a.clone().requires_grad_()
        overlap.all_gather_weight_matmul(a_leaf, w.t(), strategy=strategy).backward(g)
        torch.testing.assert_close(a_leaf.grad.double(), want[rank][1], rtol=1e-4, atol=1e-4)
    return True


def test_one_gradient_at_a_time(pools, seed):
    assert pools(3).run(one_gradient_task, seed, timeout=120) == [True] * 3


# ----------------------------------------------------------------------------------------------
# Bad input: raises on every rank before any data moves, and the group stays usable
# ----------------------------------------------------------------------------------------------


def bad_inputs(rank, world_size, strategy):
    import overlap

    f = overlap.all_gather_weight_matmul
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    res = {
        "k_mismatch": expect_error(f, a, torch.randn(7, 5), strategy=strategy),
        "dtype_mismatch": expect_error(f, a, b.double(), strategy=strategy),
        "bad_strategy": expect_error(f, a, b, strategy="fastest"),
        "fused_fp64": expect_error(f, a.double(), b.double(), strategy="fused"),
        # One rank's shard has another shape: every rank raises a ValueError (OverlapMismatchError is one).
        "shard_differs": expect_error(f, a, torch.randn(8, 5 + (rank == 1)), strategy=strategy, timeout=20),
        # One rank's local mistake: that rank raises ValueError, the others learn it at once.
        "one_rank_bad": expect_error(f, a, torch.randn(8 if rank else 9, 5), strategy=strategy, timeout=20),
    }
    y = f(a, b, strategy=strategy)
    res["then_ok"] = (None, str(tuple(y.shape)), 0.0)
    return res


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
def test_bad_input_raises_on_every_rank(pools, strategy):
    for rank, res in enumerate(pools(3).run(bad_inputs, strategy, timeout=120)):
        assert res["k_mismatch"][0] == "ValueError" and "k=7" in res["k_mismatch"][1], res["k_mismatch"]
        assert res["dtype_mismatch"][0] == "TypeError", res["dtype_mismatch"]
        assert res["bad_strategy"][0] == "ValueError" and "fastest" in res["bad_strategy"][1]
        assert res["fused_fp64"][0] == "TypeError" and "fused" in res["fused_fp64"][1], res["fused_fp64"]
        kind, msg, secs = res["shard_differs"]
        assert kind == "OverlapMismatchError" and issubclass(_mismatch(), ValueError), res["shard_differs"]
        assert "b=(8, 5)" in msg and "b=(8, 6)" in msg and secs < FALLBACK_TIMEOUT_S, res["shard_differs"]
        kind, msg, secs = res["one_rank_bad"]
        assert kind == ("OverlapMismatchError" if rank else "ValueError") and secs < FALLBACK_TIMEOUT_S, res
        assert res["then_ok"][1] == "(4, 15)"


def _mismatch():
    from overlap import OverlapMismatchError

    return OverlapMismatchError


# ----------------------------------------------------------------------------------------------
# Deadlines: a peer that never signals, a peer that is killed
# ----------------------------------------------------------------------------------------------


def silent_peer(rank, world_size, strategy, backward):
    """Rank 1 makes the call but never publishes its shard; the others time out naming it."""
    import overlap

    a, b = torch.randn(4, 8, requires_grad=backward), torch.randn(8, 3, requires_grad=backward)
    overlap.all_gather_weight_matmul(a, b, strategy=strategy)  # heap exists, everyone healthy
    y = overlap.all_gather_weight_matmul(a, b, strategy=strategy, timeout=2.0) if backward else None
    silence(1, rank)

    def call():
        if backward:
            y.sum().backward()
        else:
            overlap.all_gather_weight_matmul(a, b, strategy=strategy, timeout=2.0)

    result = expect_error(call)
    if rank == 1:
        time.sleep(3.0)  # stay alive until the others have timed out
    return result


@pytest.mark.parametrize(("strategy", "backward"),
                         [("pipelined", False), ("symm", False), ("symm", True), ("fused", False), ("fused", True)])
def test_silent_peer_times_out(strategy, backward):
    """Backward (symm, fused): the weight gradient's ring stalls at rank 1; rank 2 (its successor) waits for its
    accumulator, rank 0 for rank 2's, which waits for rank 1: both name rank 1."""
    from tests.support.harness import run_isolated

    results = run_isolated(3, silent_peer, strategy, backward, timeout=90)
    for rank in (0, 2):
        kind, msg, secs = results[rank]
        print(f"[silent] {strategy} backward={backward} rank {rank}: {kind} after {secs:.2f} s: {msg[:200]}")
        assert kind == "OverlapTimeout" and "peer 1" in msg, (rank, results[rank])
        assert 1.5 < secs <= 2.0 + LATE_S, (rank, secs)


def killed_peer(rank, world_size, strategy, backward):
    """Rank 2 dies before a forward, or (backward) inside the backward's weight-gradient ring, after its
    handshake: the ring's first rank to miss its accumulator is rank 0, and rank 1 waits for rank 0."""
    import signal

    import overlap
    from overlap.ops.tp import grad_ring as _grad_ring

    a, b = torch.randn(4, 8, requires_grad=backward), torch.randn(8, 3, requires_grad=backward)
    overlap.all_gather_weight_matmul(a, b, strategy=strategy)
    if backward:
        y = overlap.all_gather_weight_matmul(a, b, strategy=strategy, timeout=2.0)
        if rank == 2:
            _grad_ring._Ring.run = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        return expect_error(y.sum().backward)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return expect_error(overlap.all_gather_weight_matmul, a, b, strategy=strategy, timeout=2.0)


@pytest.mark.parametrize(("strategy", "backward"), [("symm", False), ("symm", True), ("fused", True)])
def test_killed_peer_times_out(strategy, backward):
    from tests.support.harness import RankError, RankPool

    pool = RankPool(3)
    try:
        pool.send(killed_peer, strategy, backward)
        with pytest.raises(RankError, match="rank 2 died") as info:
            pool.collect(60, "killed_peer")
    finally:
        pool.close()
    for rank in (0, 1):
        kind, msg, secs = info.value.results[rank]
        assert kind == "OverlapTimeout" and "peer 2" in msg, (rank, kind, msg)
        assert not backward or "weight gradient's ring" in msg, (rank, msg)
        assert secs <= 2.0 + LATE_S, secs
