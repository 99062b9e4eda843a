"""matmul_all_reduce on CPU ranks: every strategy against the unfused computation, forward and backward.

Each rank holds ``a_r`` (``[M, ..., k_local]``) and ``b_r`` (``[k_local, n]``); every rank gets
``sum_s a_s @ b_s``, bitwise the same on every rank. Any M works (no divisibility by the world size),
M below the world size included. The backward passes the output gradient through (`tp_oracle`).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S, LATE_S
from tests.support.tp_oracle import AGM, MAR, MRS, check_op, expect_error, silence

# (M, middle dims, k_local, n, b layout): M not divisible by 2, 3 or 4, M below the world size,
# odd sizes, 3-D inputs, transposed weight views.
CASES = [
    (5, (), 7, 3, "weight.t()"),
    (1, (), 16, 9, "contiguous"),
    (2, (3,), 13, 11, "weight.t()"),
    (12, (), 31, 17, "contiguous"),
    (3, (2,), 64, 40, "weight.t()"),
]
FUSED_CASES = [(5, (), 24, 19, "weight.t()"), (2, (2,), 48, 40, "contiguous"), (1, (), 7, 3, "contiguous")]


def check_identical_across_ranks(outputs, what):
    """Every rank's output of every case is bitwise the same as rank 0's."""
    for i, out0 in enumerate(outputs[0]):
        for rank, outs in enumerate(outputs[1:], start=1):
            same = torch.equal(outs[i], out0)
            err = (outs[i].double() - out0.double()).abs().max().item() if outs[i].shape == out0.shape else None
            assert same, f"{what} case {i} shape {tuple(out0.shape)}: rank {rank} differs from rank 0 (max {err})"


def with_plans(rank, world_size, strategy, dtype, seed, cases, one_shot, timeout=FALLBACK_TIMEOUT_S):
    import overlap

    plan = overlap.Plan(strategy, one_shot=one_shot) if strategy != "auto" else "auto"
    return check_op(rank, world_size, MAR, plan, dtype, seed, cases, timeout=timeout)


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_unfused(pools, seed, world_size, dtype, strategy):
    outputs = pools(world_size).run(check_op, MAR, strategy, dtype, seed, CASES)
    assert all(len(r) == len(CASES) for r in outputs)
    check_identical_across_ranks(outputs, f"{strategy} {dtype} W={world_size}")


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["pipelined", "symm"])
def test_one_shot_matches_unfused(pools, seed, world_size, dtype, strategy):
    outputs = pools(world_size).run(with_plans, strategy, dtype, seed, CASES, True)
    check_identical_across_ranks(outputs, f"{strategy} one_shot {dtype} W={world_size}")


# Interpreted fused is slow: fp32 everywhere, bf16 on a covering subset.
FUSED_MATRIX = [(w, torch.float32, s) for w in (2, 3, 4) for s in (False, True)] + [
    (2, torch.bfloat16, False),
    (3, torch.bfloat16, True),
    (4, torch.bfloat16, False),
    (4, torch.bfloat16, True),
]


@pytest.mark.exact
@pytest.mark.parametrize(
    "world_size, dtype, one_shot",
    FUSED_MATRIX,
    ids=[f"W{w}-{str(d)[6:]}-{'one' if s else 'two'}_shot" for w, d, s in FUSED_MATRIX],
)
def test_fused_interpreted_matches_unfused(pools, seed, world_size, dtype, one_shot):
    outputs = pools(world_size).run(with_plans, "fused", dtype, seed, FUSED_CASES, one_shot, timeout=60.0)
    check_identical_across_ranks(outputs, f"fused one_shot={one_shot} {dtype} W={world_size}")


def reference_ignores_one_shot(rank, world_size, seed):
    import overlap

    return check_op(rank, world_size, MAR, overlap.Plan("reference", one_shot=True), torch.float32, seed, CASES[:2])


@pytest.mark.exact
def test_reference_ignores_one_shot(pools, seed):
    check_identical_across_ranks(pools(3).run(reference_ignores_one_shot, seed), "reference one_shot")


def other_dtypes(rank, world_size, seed):
    """float16 on the strategies that support it (fused included) and float64 (no fused kernel)."""
    import overlap

    done = []
    cases = [(5, (), 24, 19, "weight.t()"), (2, (2,), 40, 8, "contiguous")]
    for strategy in ("pipelined", "symm", "fused"):
        for one_shot in (False, True):
            plan = overlap.Plan(strategy, one_shot=one_shot)
            done.append(check_op(rank, world_size, MAR, plan, torch.float16, seed, cases))
    for strategy in ("reference", "pipelined", "symm", "auto"):
        done.append(check_op(rank, world_size, MAR, strategy, torch.float64, seed, cases))
    return [t for outs in done for t in outs]


@pytest.mark.exact
def test_float16_and_float64(pools, seed):
    outputs = pools(3).run(other_dtypes, seed, timeout=120)
    assert all(len(r) == 20 for r in outputs)
    check_identical_across_ranks(outputs, "float16/float64")


def single_rank(rank, world_size, seed):
    import overlap

    cases = [(5, (), 24, 19, "weight.t()"), (3, (2,), 16, 8, "contiguous")]
    plans = [
        "reference",
        "pipelined",
        "symm",
        "fused",
        "auto",
        overlap.Plan("pipelined", one_shot=True),
        overlap.Plan("symm", one_shot=True),
        overlap.Plan("fused", one_shot=True),
    ]
    return sum(len(check_op(rank, world_size, MAR, p, torch.float32, seed, cases)) for p in plans)


def test_single_rank_group(pools, seed):
    assert pools(1).run(single_rank, seed) == [16]


def plans_task(rank, world_size, seed):
    """Chunk counts that split the rows unevenly (more chunks than rows included), one- and two-shot."""
    import overlap

    outs = []
    cases = [(5, (), 12, 7, "contiguous"), (7, (2,), 9, 5, "weight.t()"), (2, (), 6, 4, "contiguous")]
    for strategy in ("pipelined", "symm"):
        for chunks in (2, 3, 7):
            for one_shot in (False, True):
                plan = overlap.Plan(strategy, num_chunks={"shm": chunks}, one_shot=one_shot)
                outs += check_op(rank, world_size, MAR, plan, torch.float32, seed + chunks, cases)
    return outs


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [3, 4])
def test_chunked_plans(pools, seed, world_size):
    outputs = pools(world_size).run(plans_task, seed)
    assert all(len(r) == 36 for r in outputs)
    check_identical_across_ranks(outputs, f"chunked plans W={world_size}")


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
        overlap.Plan("pipelined", one_shot=True),
        overlap.Plan("symm", one_shot=True, num_chunks={"shm": 2}),
        overlap.Plan("fused", one_shot=True),
    ]
    outs = []
    for i in range(calls):
        strategy = strategies[i % len(strategies)]
        fused = not isinstance(strategy, str) and strategy.strategy == "fused" or strategy == "fused"
        m = rng.choice([1, 2, 5, 8, 17]) if not fused else rng.choice([1, 2, 5])
        k = rng.choice([8, 24, 100]) if not fused else rng.choice([8, 24])
        n, mid = rng.choice([5, 32]), rng.choice([(), (2,)])
        if rng.random() < 0.3 and rank == rng.randrange(world_size):
            time.sleep(0.05)  # this rank falls behind
        outs += check_op(rank, world_size, MAR, strategy, torch.float32, seed + i, [(m, mid, k, n, "contiguous")])
    return outs


@pytest.mark.exact
def test_back_to_back_calls_with_changing_shapes(pools, seed):
    outputs = pools(3).run(back_to_back, seed, 16, timeout=240)
    assert all(len(r) == 16 for r in outputs)
    check_identical_across_ranks(outputs, "back to back")


# ----------------------------------------------------------------------------------------------
# Bad input: raises on every rank, within seconds, and the group stays usable
# ----------------------------------------------------------------------------------------------


def bad_inputs(rank, world_size, strategy):
    import overlap

    fn = overlap.matmul_all_reduce
    results = {}
    a, b = torch.randn(5, 8), torch.randn(8, 3)
    results["k_mismatch"] = expect_error(fn, a, torch.randn(7, 3), strategy=strategy)
    results["dtype_mismatch"] = expect_error(fn, a, b.double(), strategy=strategy)
    results["one_dim"] = expect_error(fn, torch.randn(8), b, strategy=strategy)
    results["bad_timeout"] = expect_error(fn, a, b, strategy=strategy, timeout=-1)
    results["strategy_contradicts_plan"] = expect_error(
        fn,
        a,
        b,
        strategy="reference" if strategy != "reference" else "symm",
        plan=overlap.Plan(strategy, one_shot=True),
    )
    # One rank with a different M: every rank raises, with every signature.
    results["shape_differs"] = expect_error(fn, torch.randn(5 + rank, 8), b, strategy=strategy, timeout=20)
    # Ranks disagree on one_shot (part of the plan, so of the signature).
    plan = overlap.Plan(strategy, one_shot=rank == 0)
    results["one_shot_differs"] = expect_error(fn, a, b, plan=plan, timeout=20)
    # One rank's local mistake: it raises ValueError, the others learn it at once.
    b_r = torch.randn(8 if rank else 9, 3)
    results["one_rank_bad"] = expect_error(fn, a, b_r, strategy=strategy, timeout=20)
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
        assert res["k_mismatch"][0] == "ValueError" and "k=7" in res["k_mismatch"][1], (ctx, res["k_mismatch"])
        assert res["dtype_mismatch"][0] == "TypeError", (ctx, res["dtype_mismatch"])
        assert res["one_dim"][0] == "ValueError", (ctx, res["one_dim"])
        assert res["bad_timeout"][0] == "ValueError", (ctx, res["bad_timeout"])
        assert res["strategy_contradicts_plan"][0] == "ValueError", (ctx, res["strategy_contradicts_plan"])
        kind, msg, secs = res["shape_differs"]
        assert kind == "OverlapMismatchError" and secs < FALLBACK_TIMEOUT_S, (ctx, res["shape_differs"])
        assert all(f"({5 + r}, 8)" in msg for r in range(world_size)), (ctx, msg)
        kind, msg, secs = res["one_shot_differs"]
        if strategy == "reference":  # reference ignores the flag: either agreement or a clear mismatch
            assert kind in (None, "OverlapMismatchError") and secs < FALLBACK_TIMEOUT_S, \
                (ctx, res["one_shot_differs"])
        else:
            assert kind == "OverlapMismatchError" and "one_shot" in msg and secs < FALLBACK_TIMEOUT_S, \
                (ctx, res["one_shot_differs"])
        kind, msg, secs = res["one_rank_bad"]
        want = "ValueError" if rank == 0 else "OverlapMismatchError"
        assert kind == want and secs < FALLBACK_TIMEOUT_S, (ctx, res["one_rank_bad"])
        assert res["then_ok"][1] == "(5, 3)", (ctx, res["then_ok"])


def one_shot_elsewhere(rank, world_size):
    """The one_shot flag belongs to matmul_all_reduce: the other ops refuse it, on every rank."""
    import overlap

    results = {}
    a, b = torch.randn(2 * world_size, 8), torch.randn(8, 3)
    for op in (AGM, MRS):
        for strategy in ("reference", "pipelined", "symm", "fused"):
            results[op, strategy] = expect_error(
                getattr(overlap, op), a, b, plan=overlap.Plan(strategy, one_shot=True), timeout=20
            )
    # ... and both still work on this group afterwards.
    overlap.all_gather_matmul(a, b, strategy="symm")
    overlap.matmul_reduce_scatter(a, b, strategy="symm")
    return results


def test_one_shot_refused_by_other_ops(pools):
    for rank, res in enumerate(pools(2).run(one_shot_elsewhere)):
        for (op, strategy), (kind, msg, secs) in res.items():
            assert kind == "ValueError" and "one_shot" in msg and secs < FALLBACK_TIMEOUT_S, \
                (rank, op, strategy, kind, msg)


# ----------------------------------------------------------------------------------------------
# Deadlines: a peer that never publishes its data
# ----------------------------------------------------------------------------------------------


def silent_peer(rank, world_size, plan_kwargs):
    """Rank 1 makes the call but never publishes its data; the others must time out naming it."""
    import overlap

    plan = overlap.Plan(**plan_kwargs)
    a, b = torch.randn(5, 8), torch.randn(8, 3)
    overlap.matmul_all_reduce(a, b, plan=plan)  # heap exists, everyone healthy
    silence(1, rank)
    result = expect_error(overlap.matmul_all_reduce, a, b, plan=plan, timeout=2.0)
    if rank == 1:
        time.sleep(3.0)  # stay alive until the others have timed out
    return result


SILENT_PLANS = [dict(strategy="pipelined"), dict(strategy="symm"), dict(strategy="symm", one_shot=True)]


@pytest.mark.parametrize("plan_kwargs", SILENT_PLANS, ids=["pipelined", "symm", "symm-one_shot"])
def test_silent_peer_times_out(plan_kwargs):
    from tests.support.harness import run_isolated

    results = run_isolated(3, silent_peer, plan_kwargs, timeout=90)
    for rank in (0, 2):
        kind, msg, secs = results[rank]
        assert kind == "OverlapTimeout", (rank, plan_kwargs, results[rank])
        assert "matmul_all_reduce" in msg and "chunk" in msg, (rank, plan_kwargs, msg)
        assert 1.5 < secs <= 2.0 + LATE_S, (rank, plan_kwargs, secs)
        if plan_kwargs["strategy"] == "symm":  # flags name their producer (a collective cannot)
            assert "peer 1" in msg, (rank, plan_kwargs, msg)
