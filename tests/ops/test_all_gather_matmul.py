"""all_gather_matmul on CPU ranks: every strategy against the unfused computation, forward and backward.

The oracle is computed on every rank in float64 from every rank's inputs, which each rank
regenerates from the shared seed: ``y = cat(a_0..a_{W-1}) @ b_r``; with a different output
gradient ``g_r`` on every rank the loss is ``sum_r <y_r, g_r>``, so
``grad a_j = sum_r (g_r @ b_r.T)[rows of j]`` and ``grad b_r = cat(a).T @ g_r``.

The symmetric-memory buffer protocol under the op (reserve and release, epoch re-base, one rank's
local failures) is tested in test_symm_protocol.py.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S, LATE_S
from tests.support.tp_oracle import TOL, compare, expect_error, scaled, silence

# (rows per rank, middle dims, k, n, b layout): odd sizes, one row, 3-D inputs, transposed weight views.
CASES = [
    (5, (), 7, 3, "weight.t()"),
    (1, (), 16, 9, "contiguous"),
    (4, (3,), 13, 11, "weight.t()"),
    (3, (2,), 31, 17, "contiguous"),
    (8, (), 64, 40, "weight.t()"),
]
FUSED_CASES = [(5, (), 24, 19, "weight.t()"), (4, (2,), 48, 40, "contiguous")]


def make_inputs(seed: int, rank: int, m: int, mid: tuple, k: int, n: int, layout: str, dtype):
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    a = torch.randn((m, *mid, k), generator=gen, dtype=torch.float64)
    w = torch.randn((n, k), generator=gen, dtype=torch.float64)
    b = w.t() if layout == "weight.t()" else w.t().contiguous()
    return a.to(dtype), b.to(dtype), gen


def oracle(seed: int, world_size: int, m, mid, k, n, layout, dtype):
    """Every rank's inputs and the float64 results of rank-by-rank unfused math."""
    inputs = []
    for r in range(world_size):
        a, b, gen = make_inputs(seed, r, m, mid, k, n, layout, dtype)
        g = torch.randn((world_size * m, *mid, n), generator=gen, dtype=torch.float64).to(dtype)
        inputs.append((a, b, g))
    a_full = torch.cat([x[0].double() for x in inputs]).reshape(-1, k)
    outs, grad_bs = [], []
    grad_a_full = torch.zeros_like(a_full)
    for _a, b, g in inputs:
        outs.append((a_full @ b.double()).reshape(world_size * m, *mid, n))
        g2 = g.double().reshape(-1, n)
        grad_a_full += g2 @ b.double().t()
        grad_bs.append(a_full.t() @ g2)
    grad_as = [grad_a_full[r * a_full.shape[0] // world_size : (r + 1) * a_full.shape[0] // world_size]
               for r in range(world_size)]
    return inputs, outs, grad_as, grad_bs


def run_case(strategy, a, b_layout_w, layout, g, timeout):
    """One forward and backward; returns (y, grad_a, grad_b) with b's gradient in b's layout."""
    import overlap

    a = a.detach().clone().requires_grad_()
    w = b_layout_w.detach().clone().requires_grad_()
    b = w.t() if layout == "weight.t()" else w
    if isinstance(strategy, overlap.Plan):
        y = overlap.all_gather_matmul(a, b, plan=strategy, timeout=timeout)
    else:
        y = overlap.all_gather_matmul(a, b, strategy=strategy, timeout=timeout)
    y.backward(g)
    return y.detach(), a.grad, (w.grad.t() if layout == "weight.t()" else w.grad)


def check_strategy(rank, world_size, strategy, dtype, seed, cases, timeout=FALLBACK_TIMEOUT_S):
    """`strategy` against the float64 oracle (fp32), or against `reference` and the oracle (bf16)."""
    import overlap

    report = []
    for m, mid, k, n, layout in cases:
        inputs, outs, grad_as, grad_bs = oracle(seed, world_size, m, mid, k, n, layout, dtype)
        a, b, g = inputs[rank]
        w = b.t() if layout == "weight.t()" else b
        got = run_case(strategy, a, w, layout, g, timeout)
        name = strategy.describe() if isinstance(strategy, overlap.Plan) else strategy
        ctx = f"rank {rank}/{world_size} {name} {dtype} a={tuple(a.shape)} n={n} {layout} seed={seed}"
        want = (outs[rank], grad_as[rank].reshape(a.shape), grad_bs[rank])
        if dtype in (torch.float32, torch.float64):
            compare(ctx, got, want, dtype)
        else:
            # bf16: each strategy rounds like `reference` does (DESIGN's tolerance against it);
            # `reference` itself is within bf16 rounding of the float64 oracle (relative norm).
            # grad_a is a sum over ranks of 16-bit partials: strategies sum them in different
            # (fixed) orders, so it is checked against the oracle with a bound relative to the
            # summed magnitudes of the partials (the reference reduction meets the same bound).
            ref = run_case("reference", a, w, layout, g, timeout)
            compare(ctx + " vs reference", (got[0], got[2]), (ref[0], ref[2]), dtype, labels=("out", "grad_b"))
            mag = grad_a_magnitude(inputs, rank, k, n).reshape(a.shape)
            for label, x in (("grad_a", got[1]), ("reference grad_a", ref[1])):
                check_reduced(ctx, label, x, grad_as[rank].reshape(a.shape), mag, world_size)
            for label, x, y in zip(("out", "grad_a", "grad_b"), ref, want):
                rel = ((x.double() - y).norm() / y.norm()).item()
                assert rel < 2e-2, f"{ctx}: reference {label} is {rel:.3g} away from the float64 oracle"
        report.append(ctx)
    return report


def grad_a_magnitude(inputs, rank, k, n):
    """``sum_r |g_r @ b_r.T|`` for this rank's rows of grad_a (float64): the scale of its partials."""
    total = None
    for _a, b, g in inputs:
        part = (g.double().reshape(-1, n) @ b.double().t()).abs()
        total = part if total is None else total + part
    rows = total.shape[0] // len(inputs)
    return total[rank * rows : (rank + 1) * rows]


def check_reduced(ctx, label, got, want, magnitude, world_size):
    """A 16-bit sum of `world_size` partials against the float64 oracle: each partial is rounded once when
    stored and each of the ``world_size - 1`` additions (gloo adds bf16 in bf16) rounds again, by at most
    u = 2^-8 of the summed magnitudes, so ``|err| <= (world_size + 1) u S`` (S: `magnitude`). DESIGN's
    ``atol=1e-2, rtol=1.6e-2`` relative to S where that is wider (two ranks). A missing or stale partial is
    off by about its own size."""
    err = (got.double() - want).abs()
    bound = 1e-2 + max(1.6e-2, (world_size + 1) * 2.0**-8) * magnitude
    worst = (err - bound).max().item()
    assert worst <= 0, f"{ctx}: {label} exceeds the bound by {worst:.3g} (max abs err {err.max().item():.3g})"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_unfused(pools, seed, world_size, dtype, strategy):
    reports = pools(world_size).run(check_strategy, strategy, dtype, seed, CASES)
    assert all(len(r) == len(CASES) for r in reports)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_interpreted_matches_unfused(pools, seed, world_size, dtype):
    reports = pools(world_size).run(check_strategy, "fused", dtype, seed, FUSED_CASES, timeout=60.0)
    assert all(len(r) == len(FUSED_CASES) for r in reports)


def plans_task(rank, world_size, seed):
    """Chunk counts that split each peer's rows unevenly (more chunks than rows included)."""
    import overlap

    done = []
    for strategy in ("pipelined", "symm"):
        for chunks in (2, 3, 7):
            plan = overlap.Plan(strategy, num_chunks={"shm": chunks})
            done += check_strategy(rank, world_size, plan, torch.float32, seed + chunks, [(5, (), 12, 7, "contiguous")])
    return done


def test_chunked_plans(pools, seed):
    assert all(len(r) == 6 for r in pools(3).run(plans_task, seed))


# ----------------------------------------------------------------------------------------------
# Many calls back to back, changing shapes (heap growth), ranks out of step, calls in flight
# ----------------------------------------------------------------------------------------------


def back_to_back(rank, world_size, seed, calls):
    rng = random.Random(seed)  # same sequence of calls on every rank
    strategies = ["reference", "pipelined", "symm", "auto", "fused"]
    for i in range(calls):
        strategy = strategies[i % len(strategies)]
        m = rng.choice([1, 3, 8, 17]) if strategy != "fused" else rng.choice([2, 5])
        k, n = rng.choice([8, 24, 100]), rng.choice([5, 32])
        if rng.random() < 0.3 and rank == rng.randrange(world_size):
            time.sleep(0.05)  # this rank falls behind
        check_strategy(rank, world_size, strategy, torch.float32, seed + i, [(m, (), k, n, "contiguous")])
    return calls


def test_back_to_back_calls_with_growth(pools, seed):
    assert pools(3).run(back_to_back, seed, 14, timeout=240) == [14] * 3


def two_in_flight(rank, world_size, seed):
    import overlap

    gen = torch.Generator().manual_seed(seed + rank)
    a1 = torch.randn(4, 16, generator=gen, requires_grad=True)
    b1 = torch.randn(16, 8, generator=gen, requires_grad=True)
    a2 = torch.randn(3, 2, 8, generator=gen, requires_grad=True)
    b2 = torch.randn(8, 6, generator=gen, requires_grad=True)
    # Two forwards of different layers in flight, then both backwards (reverse order), mixed strategies.
    y1 = overlap.all_gather_matmul(a1, b1, strategy="symm")
    y2 = overlap.all_gather_matmul(a2, b2, strategy="pipelined")
    y3 = overlap.all_gather_matmul(a1, b1, strategy="reference")
    loss = (y1 * y3).sum() + y2.square().sum()
    loss.backward()
    got = [a1.grad.clone(), b1.grad.clone(), a2.grad.clone(), b2.grad.clone()]
    for t in (a1, b1, a2, b2):
        t.grad = None
    r1 = overlap.all_gather_matmul(a1, b1, strategy="reference")
    r2 = overlap.all_gather_matmul(a2, b2, strategy="reference")
    ((r1 * r1.detach()).sum() * 2 + r2.square().sum()).backward()
    want = [a1.grad, b1.grad, a2.grad, b2.grad]
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, **scaled(TOL[torch.float32], y))
    return True


def test_calls_in_flight(pools, seed):
    assert pools(2).run(two_in_flight, seed) == [True, True]


def determinism(rank, world_size, seed):
    import overlap

    gen = torch.Generator().manual_seed(seed + rank)
    a = torch.randn(6, 33, generator=gen)
    b = torch.randn(33, 10, generator=gen)
    for strategy in ("reference", "pipelined", "symm", "fused"):
        first = overlap.all_gather_matmul(a, b, strategy=strategy)
        again = overlap.all_gather_matmul(a, b, strategy=strategy)
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    return True


@pytest.mark.exact
def test_bitwise_repeatable(pools, seed):
    assert all(pools(2).run(determinism, seed))


# ----------------------------------------------------------------------------------------------
# Bad input: raises on every rank before any deadline, and the group stays usable
# ----------------------------------------------------------------------------------------------


def bad_inputs(rank, world_size, strategy):
    import overlap

    results = {}
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    results["k_mismatch"] = expect_error(overlap.all_gather_matmul, a, torch.randn(7, 5), strategy=strategy)
    results["dtype_mismatch"] = expect_error(overlap.all_gather_matmul, a, b.double(), strategy=strategy)
    results["one_dim"] = expect_error(overlap.all_gather_matmul, torch.randn(8), b, strategy=strategy)
    results["bad_strategy"] = expect_error(overlap.all_gather_matmul, a, b, strategy="fastest")
    results["bad_timeout"] = expect_error(overlap.all_gather_matmul, a, b, strategy=strategy, timeout=-1)
    # One rank with a different shape: every rank raises, with both signatures.
    a_r = torch.randn(4 + rank, 8)
    results["shape_differs"] = expect_error(overlap.all_gather_matmul, a_r, b, strategy=strategy, timeout=20)
    # One rank's local mistake: that rank raises ValueError, the others learn it at once.
    b_r = torch.randn(8 if rank == 0 else 9, 5)
    results["one_rank_bad"] = expect_error(overlap.all_gather_matmul, a, b_r, strategy=strategy, timeout=20)
    # Ranks choose different strategies.
    other = "pipelined" if strategy != "pipelined" else "symm"
    results["strategy_differs"] = expect_error(overlap.all_gather_matmul, a, b, timeout=20,
                                               strategy=strategy if rank == 0 else other)
    # The group still works.
    y = overlap.all_gather_matmul(a, b, strategy=strategy)
    results["then_ok"] = (None, str(tuple(y.shape)), 0.0)
    return results


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
def test_bad_input_raises_on_every_rank(pools, strategy):
    results = pools(3).run(bad_inputs, strategy, timeout=120)
    for rank, res in enumerate(results):
        assert res["k_mismatch"][0] == "ValueError" and "k=7" in res["k_mismatch"][1], res["k_mismatch"]
        assert res["dtype_mismatch"][0] == "TypeError", res["dtype_mismatch"]
        assert res["one_dim"][0] == "ValueError", res["one_dim"]
        assert res["bad_strategy"][0] == "ValueError" and "fastest" in res["bad_strategy"][1]
        assert res["bad_timeout"][0] == "ValueError", res["bad_timeout"]
        kind, msg, secs = res["shape_differs"]
        assert kind == "OverlapMismatchError", res["shape_differs"]
        assert all(f"a=({4 + r}, 8)" in msg for r in range(3)) and secs < FALLBACK_TIMEOUT_S, res["shape_differs"]
        kind, msg, secs = res["one_rank_bad"]
        want = "ValueError" if rank else "OverlapMismatchError"
        assert kind == want and secs < FALLBACK_TIMEOUT_S, (rank, res["one_rank_bad"])
        assert res["strategy_differs"][0] == "OverlapMismatchError", res["strategy_differs"]
        assert res["then_ok"][1] == "(12, 5)"


def spans_nodes(rank, world_size):
    import torch.distributed as dist

    import overlap

    os.environ["OVERLAP_NODE_ID"] = f"node{rank}"
    try:
        group = dist.new_group(list(range(world_size)))
        a, b = torch.randn(3, 4), torch.randn(4, 2)
        forced = expect_error(overlap.all_gather_matmul, a, b, group=group, strategy="symm")
        # Across nodes, auto and pipelined work (signatures travel by a collective there).
        y_auto = overlap.all_gather_matmul(a, b, group=group)
        y_ref = overlap.all_gather_matmul(a, b, group=group, strategy="reference")
        torch.testing.assert_close(y_auto, y_ref)
        mismatch = expect_error(overlap.all_gather_matmul, torch.randn(3 + rank, 4), b, group=group,
                                strategy="pipelined", timeout=10)
        overlap.release(group)
        return forced, mismatch
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_symm_across_nodes_raises_and_auto_picks_pipelined(pools):
    for forced, mismatch in pools(2).run(spans_nodes):
        assert forced[0] == "ValueError" and "node0" in forced[1] and "node1" in forced[1], forced
        assert mismatch[0] == "OverlapMismatchError", mismatch


# ----------------------------------------------------------------------------------------------
# Deadlines: a peer that never signals, a peer that never comes, a peer that is killed
# ----------------------------------------------------------------------------------------------


def silent_peer(rank, world_size, strategy):
    """Rank 1 makes the call but never publishes its data; the others must time out naming it."""
    import overlap

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    overlap.all_gather_matmul(a, b, strategy=strategy)  # heap exists, everyone healthy
    silence(1, rank)  # no ready flags, no sends from rank 1 from now on
    result = expect_error(overlap.all_gather_matmul, a, b, strategy=strategy, timeout=2.0)
    if rank == 1:
        time.sleep(3.0)  # stay alive until the others have timed out
    return result


@pytest.mark.parametrize("strategy", ["pipelined", "symm", "fused"])
def test_silent_peer_times_out(strategy):
    from tests.support.harness import run_isolated

    results = run_isolated(3, silent_peer, strategy, timeout=90)
    for rank in (0, 2):
        kind, msg, secs = results[rank]
        assert kind == "OverlapTimeout", (rank, results[rank])
        assert "peer 1" in msg and "chunk" in msg, msg
        assert 1.5 < secs <= 2.0 + LATE_S, (rank, secs)


def absent_peer(rank, world_size):
    import overlap

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    overlap.all_gather_matmul(a, b, strategy="symm")
    if rank == 2:
        time.sleep(4.0)
        return None
    return expect_error(overlap.all_gather_matmul, a, b, strategy="symm", timeout=2.0)


def test_absent_peer_times_out():
    from tests.support.harness import run_isolated

    results = run_isolated(3, absent_peer, timeout=60)
    for rank in (0, 1):
        kind, msg, secs = results[rank]
        assert kind == "OverlapTimeout" and "peer 2" in msg and "handshake" in msg, results[rank]
        assert 1.5 < secs <= 2.0 + LATE_S, secs


def killed_peer(rank, world_size, shm_dir):
    import signal

    import overlap

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    overlap.all_gather_matmul(a, b, strategy="symm")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    result = expect_error(overlap.all_gather_matmul, a, b, strategy="symm", timeout=2.0)
    left = [n for n in os.listdir(shm_dir) if n.startswith("overlap-")]
    return result, left


def test_killed_peer_times_out_and_leaves_no_segment():
    from tests.support.harness import RankError, RankPool

    shm = os.environ.get("OVERLAP_SHM_DIR", "/dev/shm")
    before = {n for n in os.listdir(shm) if n.startswith("overlap-")}
    pool = RankPool(3)
    try:
        pool.send(killed_peer, shm)
        with pytest.raises(RankError, match="rank 2 died") as info:
            pool.collect(60, "killed_peer")
    finally:
        pool.close()
    for rank in (0, 1):
        (kind, msg, secs), left = info.value.results[rank]
        assert kind == "OverlapTimeout" and "peer 2" in msg, (rank, kind, msg)
        assert secs <= 2.0 + LATE_S, secs
        assert not (set(left) - before), f"segments visible while the group was alive: {left}"
    after = {n for n in os.listdir(shm) if n.startswith("overlap-")}
    assert not (after - before), f"segments left after a killed rank: {sorted(after - before)}"


# ----------------------------------------------------------------------------------------------
# Other dtypes, and a group of one rank
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pipelined", "symm", "fused"])
def test_float16(pools, seed, strategy):
    cases = [(5, (), 24, 19, "weight.t()"), (3, (2,), 40, 8, "contiguous")]
    reports = pools(3).run(check_strategy, strategy, torch.float16, seed, cases)
    assert all(len(r) == len(cases) for r in reports)


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_float64(pools, seed, strategy):
    cases = [(5, (), 24, 19, "weight.t()"), (3, (2,), 40, 8, "contiguous")]
    reports = pools(2).run(check_strategy, strategy, torch.float64, seed, cases)
    assert all(len(r) == len(cases) for r in reports)


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused", "auto"])
def test_single_rank_group(pools, seed, strategy):
    cases = [(5, (), 24, 19, "weight.t()"), (3, (2,), 16, 8, "contiguous")]
    assert len(pools(1).run(check_strategy, strategy, torch.float32, seed, cases)[0]) == len(cases)
