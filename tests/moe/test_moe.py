"""overlap.moe on CPU ranks: every strategy against a dense float64 oracle, forward and backward; layout,
input errors, disagreement, back-to-back calls with changing routings, determinism, deadlines.

The oracle (`moe_oracle`) rebuilds every rank's tokens, routing and weights from one seed and runs all
experts in one process. Routings: balanced, random (uneven), skewed, half of the experts empty, every
pair on one expert (a token naming the same expert K times); token counts differ per rank, 0 included.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S, LATE_S, RankError, run_isolated
from tests.support.moe_oracle import Case, check_moe, make_inputs

# (tokens per rank, cycled over ranks), hidden, ffn, experts per rank, top_k, routing
_SPECS = [
    ((5, 3, 0, 7), 16, 24, 2, 2, "random"),
    ((4,), 8, 12, 1, 1, "balanced"),
    ((6, 2, 9), 12, 8, 4, 4, "skewed"),
    ((3, 5), 8, 16, 2, 2, "one"),
    ((4, 3), 8, 8, 4, 2, "empty"),
    ((1, 11), 24, 16, 3, 2, "random"),
]
_FUSED_SPECS = [
    ((5, 0, 3), 16, 24, 2, 2, "random"),
    ((4, 6), 8, 12, 1, 1, "balanced"),
    ((3, 2), 12, 8, 2, 4, "skewed"),
]


def cases_for(world_size: int, specs=_SPECS) -> list[Case]:
    return [Case(t, h, f, e * world_size, k, routing) for t, h, f, e, k, routing in specs]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_dense_oracle(pools, seed, world_size, dtype, strategy):
    cases = cases_for(world_size)
    done = pools(world_size).run(check_moe, strategy, dtype, seed, cases, timeout=180)
    assert all(len(d) == 2 * len(cases) for d in done)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_interpreted_matches_dense_oracle(pools, seed, world_size, dtype):
    cases = cases_for(world_size, _FUSED_SPECS)
    done = pools(world_size).run(check_moe, "fused", dtype, seed, cases, ("grouped",), timeout=240)
    assert all(len(d) == len(cases) for d in done)


def plans_task(rank, world_size, seed):
    """Chunked pipelined transfers, bucketed expert flags (more local experts than flags per peer),
    fused tiles of 16 rows, a silu-free activation."""
    import overlap

    done = []
    for chunks in (2, 3, 7):
        done += check_moe(rank, world_size, overlap.Plan("pipelined", num_chunks={"shm": chunks}), torch.float32,
                          seed + chunks, cases_for(world_size, [((7, 4), 8, 8, 2, 2, "random")]))
    many = [((9, 5), 8, 8, 70, 3, "random")]  # 70 local experts > 256 / W - 1 flags per peer at W=4
    done += check_moe(rank, world_size, "symm", torch.float32, seed, cases_for(world_size, many), act="relu")
    done += check_moe(rank, world_size, overlap.Plan("fused", block_m=16, block_n=16, block_k=16), torch.float32,
                      seed, cases_for(world_size, [((20, 3), 24, 40, 2, 2, "skewed")]), ("grouped",))
    return len(done)


def test_chunked_plans_and_bucketed_flags(pools, seed):
    assert pools(4).run(plans_task, seed, timeout=240) == [9] * 4


def single_rank(rank, world_size, seed):
    done = []
    for strategy in ("reference", "pipelined", "symm", "fused", "auto"):
        forms = ("grouped",) if strategy == "fused" else ("plain", "grouped")
        done += check_moe(rank, world_size, strategy, torch.float32, seed,
                          cases_for(1, [((6,), 8, 12, 3, 2, "random")]), forms)
    return len(done)


def test_single_rank_group(pools, seed):
    assert pools(1).run(single_rank, seed) == [9]


# ----------------------------------------------------------------------------------------------
# Layout, steady state, determinism
# ----------------------------------------------------------------------------------------------


def layout_task(rank, world_size, seed):
    """The handle's counts and offsets match the routing; x_recv is grouped by expert, then source."""
    import overlap

    case = Case((5, 7, 2), 8, 8, 3 * world_size, 2, "random")
    xs, idxs, *_ = make_inputs(case, seed, world_size, torch.float32)
    L = case.experts // world_size
    _, h = overlap.moe.dispatch(xs[rank], idxs[rank], case.experts, strategy="symm")
    for s in range(world_size):
        for e in range(L):
            want = int((idxs[s] == rank * L + e).sum())
            assert h.recv_counts[s][e] == want, (rank, s, e, h.recv_counts, want)
    for d in range(world_size):
        for e in range(L):
            assert h.send_counts[d][e] == int((idxs[rank] == d * L + e).sum())
    at = 0
    for e in range(L):
        for s in range(world_size):
            assert h.expert_offsets[e][s] == at
            at += h.recv_counts[s][e]
    assert at == h.num_recv == sum(h.tokens_per_expert)
    return at


def test_handle_layout(pools, seed):
    pools(3).run(layout_task, seed)


def handle_lifetime_task(rank, world_size, seed):
    """A dispatch's host layout lives while its handle or a saved backward holds the key, no longer."""
    import gc

    import overlap
    from overlap.ops.moe import handle as moe_handle

    case = Case((5, 7, 2)[:world_size], 8, 8, 2 * world_size, 2, "random")
    xs, idxs, *_ = make_inputs(case, seed, world_size, torch.float32)
    gc.collect()
    before = moe_handle.live_layouts()
    x = xs[rank].clone().requires_grad_()
    rows, h = overlap.moe.dispatch(x, idxs[rank], case.experts, strategy="symm")
    y = overlap.moe.combine(rows * 2.0, torch.ones(x.shape[0], 2), h, strategy="symm")
    held = moe_handle.live_layouts() - before
    del h, rows
    gc.collect()
    by_graph = moe_handle.live_layouts() - before  # the autograd graph still holds the key
    y.sum().backward()
    del y
    gc.collect()
    return held, by_graph, moe_handle.live_layouts() - before, torch.equal(x.grad, torch.full_like(x, 4.0))


@pytest.mark.exact
def test_handle_lifetime(pools, seed):
    for rank, (held, by_graph, after, grad_ok) in enumerate(pools(2).run(handle_lifetime_task, seed)):
        assert (held, by_graph, after) == (1, 1, 0), f"rank {rank}: layouts held {held}, {by_graph}, then {after}"
        assert grad_ok, f"rank {rank}: d(sum 2 * combine(dispatch(x)))/dx with unit weights is not 2 * top_k"


def steady_state(rank, world_size, seed):
    """Back-to-back calls with changing routings, token counts and strategies; after the first calls
    at the largest token count, the symmetric heap never grows again (buffers sized for the worst case)."""
    import overlap
    from overlap import symm

    rng = random.Random(seed)  # the same sequence of calls on every rank
    strategies = ["symm", "fused", "pipelined", "reference", overlap.Plan("symm")]
    generations = []
    for i in range(14):
        strategy = strategies[i % len(strategies)]
        tokens = tuple(rng.choice([0, 2, 5, 8]) for _ in range(world_size)) if i else (8,) * world_size
        routing = rng.choice(["random", "skewed", "empty", "balanced"])
        case = Case(tokens, 8, 8, 2 * world_size, 2, routing)
        forms = ("grouped",) if strategy == "fused" else ("plain", "grouped")
        if i < 4 and strategy == "fused":
            forms = ("plain", "grouped")  # (plain forms fall back to symm: sizes the heap for both)
        if rng.random() < 0.3 and rank == rng.randrange(world_size):
            time.sleep(0.05)  # this rank falls behind
        check_moe(rank, world_size, strategy, torch.float32, seed + i, [case], forms)
        generations.append(symm.heap_for().generation)
    assert generations[-1] == generations[5], f"the heap grew on the steady-state path: {generations}"
    return generations


def test_back_to_back_changing_counts_do_not_regrow(pools, seed):
    pools(3).run(steady_state, seed, timeout=240)


def determinism(rank, world_size, seed):
    import overlap

    case = Case((6, 3, 9), 16, 16, 2 * world_size, 2, "random")
    xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed, world_size, torch.bfloat16)
    L = case.experts // world_size
    for strategy in ("reference", "pipelined", "symm", "fused"):
        runs = []
        for _ in range(2):
            x = xs[rank].clone().requires_grad_(True)
            a = w1[rank * L : (rank + 1) * L].clone().requires_grad_(True)
            b = w2[rank * L : (rank + 1) * L].clone().requires_grad_(True)
            h, handle = overlap.moe.dispatch_grouped_matmul(x, idxs[rank], a, case.experts, strategy=strategy)
            y = overlap.moe.grouped_matmul_combine(torch.relu(h), b, weights[rank], handle, strategy=strategy)
            y.backward(grads[rank])
            runs.append((y, x.grad, a.grad, b.grad))
        for first, second in zip(*runs, strict=True):
            assert torch.equal(first, second), f"rank {rank}: {strategy} is not bitwise repeatable"
    return True


@pytest.mark.exact
def test_bitwise_repeatable(pools, seed):
    pools(2).run(determinism, seed, timeout=120)


def strided_task(rank, world_size, seed):
    """Views with any strides (transposed tokens, rows, weights) give what contiguous inputs give."""
    import overlap

    case = Case((7, 4), 16, 24, 2 * world_size, 2, "random")
    xs, idxs, weights, _, w1, w2 = make_inputs(case, seed, world_size, torch.float32)
    L = case.experts // world_size
    a, b = w1[rank * L : (rank + 1) * L], w2[rank * L : (rank + 1) * L]
    a_t, b_t = a.transpose(1, 2).contiguous().transpose(1, 2), b.transpose(1, 2).contiguous().transpose(1, 2)
    x_t = xs[rank].t().contiguous().t()
    h, handle = overlap.moe.dispatch_grouped_matmul(xs[rank], idxs[rank], a, case.experts, strategy="reference")
    want = overlap.moe.grouped_matmul_combine(h, b, weights[rank], handle, strategy="reference")
    for strategy in ("pipelined", "symm", "fused"):
        h2, handle2 = overlap.moe.dispatch_grouped_matmul(x_t, idxs[rank], a_t, case.experts, strategy=strategy)
        torch.testing.assert_close(h2, h, rtol=1e-5, atol=1e-5)
        y = overlap.moe.grouped_matmul_combine(h2.t().contiguous().t(), b_t, weights[rank], handle2, strategy=strategy)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=lambda m, s=strategy: f"{s}: {m}")
    return True


def test_strided_inputs(pools, seed):
    pools(2).run(strided_task, seed, timeout=120)


# ----------------------------------------------------------------------------------------------
# Bad input, disagreement
# ----------------------------------------------------------------------------------------------


def bad_input_task(rank, world_size):
    import overlap
    from overlap import OverlapMismatchError

    E, H = 2 * world_size, 8
    x = torch.randn(5, H)
    idx = torch.randint(0, E, (5, 2))
    w1 = torch.randn(2, H, 4)
    seen = []

    def expect(exc_type, fn, text):
        try:
            fn()
        except exc_type as exc:
            assert text in str(exc), (text, str(exc))
            seen.append(type(exc).__name__)
            return
        raise AssertionError(f"rank {rank}: expected {exc_type.__name__} ({text})")

    # The same mistake on every rank: every rank raises ValueError locally.
    expect(ValueError, lambda: overlap.moe.dispatch(x, idx, E + 1), "must divide by the expert-parallel world size")
    expect(ValueError, lambda: overlap.moe.dispatch(x, idx, E, strategy="fused"), "plain dispatch")
    # num_experts and the weights swapped: the error names the tensor's shape, not its values
    expect(ValueError, lambda: overlap.moe.dispatch_grouped_matmul(x, idx, E, w1),
           f"got a tensor of shape {tuple(w1.shape)} (arguments in the wrong order?)")
    # One rank's mistake: it raises ValueError/TypeError, its peers OverlapMismatchError, at once.
    cases = [
        (ValueError, lambda: overlap.moe.dispatch(x, idx + (E if rank == 1 else 0), E), "expert ids"),
        (ValueError, lambda: overlap.moe.dispatch(x, idx[:4] if rank == 1 else idx, E), "topk_idx must be"),
        (TypeError, lambda: overlap.moe.dispatch(x, idx.float() if rank == 1 else idx, E), "int64 or int32"),
        (ValueError, lambda: overlap.moe.dispatch_grouped_matmul(x, idx, w1[:1] if rank == 1 else w1, E), "w1"),
        (TypeError, lambda: overlap.moe.dispatch_grouped_matmul(x, idx, w1.double() if rank == 1 else w1, E),
         "one dtype"),
    ]
    for exc_type, fn, text in cases:
        start = time.monotonic()
        if rank == 1:
            expect(exc_type, fn, text)
        else:
            expect(OverlapMismatchError, fn, "invalid input on rank 1")
        assert time.monotonic() - start < FALLBACK_TIMEOUT_S, "a local mistake must fail its peers at once"
    # combine: rows or weights that do not match the handle
    x_recv, handle = overlap.moe.dispatch(x, idx, E, strategy="symm")
    wts = torch.rand(5, 2)
    bad_rows = torch.randn(x_recv.shape[0] + 1, H) if rank == 0 else x_recv
    if rank == 0:
        expect(ValueError, lambda: overlap.moe.combine(bad_rows, wts, handle), "rows")
    else:
        expect(OverlapMismatchError, lambda: overlap.moe.combine(bad_rows, wts, handle), "invalid input on rank 0")
    bad_w = torch.rand(4, 2) if rank == 0 else wts
    if rank == 0:
        expect(ValueError, lambda: overlap.moe.combine(x_recv, bad_w, handle), "topk_weights must be")
    else:
        expect(OverlapMismatchError, lambda: overlap.moe.combine(x_recv, bad_w, handle), "invalid input")
    # Ranks that disagree on the hidden size: OverlapMismatchError on every rank, naming both calls.
    xh = torch.randn(5, H + rank)
    expect(OverlapMismatchError, lambda: overlap.moe.dispatch(xh, idx, E, strategy="pipelined"), "h=")
    # Ranks that disagree on which inputs need gradients (the backward would leave some waiting).
    xg = torch.randn(5, H, requires_grad=rank == 1)
    expect(OverlapMismatchError, lambda: overlap.moe.dispatch_grouped_matmul(xg, idx, w1, E), "grads=")
    # The group is still usable.
    y = overlap.moe.combine(x_recv, wts, handle)
    want = sum(wts[:, k : k + 1] * x for k in range(2))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    return seen


def test_bad_input_raises_on_every_rank_and_group_recovers(pools):
    seen = pools(3).run(bad_input_task, timeout=120)
    assert all(len(s) == 12 for s in seen), seen


# ----------------------------------------------------------------------------------------------
# Deadlines: a stalled or killed rank fails the others in time, naming it
# ----------------------------------------------------------------------------------------------

DEADLINE = 2.0


def stall_task(rank, world_size, strategy, absent, kill):
    """Rank `absent` never makes the call (or dies inside it with SIGKILL); the others must raise
    OverlapTimeout/OverlapError within the deadline, naming it."""
    import overlap
    from overlap import OverlapError

    E = 2 * world_size
    x = torch.randn(6, 8)
    idx = torch.randint(0, E, (6, 2))
    w1 = torch.randn(2, 8, 8)
    # A first call with a patient deadline: heaps exist, so the failing call is purely the data wait.
    overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy=strategy, timeout=60)
    if rank == absent:
        if kill:
            from overlap.ops.context import CallContext

            real = CallContext.begin

            def die_after_handshake(*args, **kwargs):
                call = real(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
                return call

            CallContext.begin = die_after_handshake
            overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy=strategy, timeout=60)
        time.sleep(DEADLINE + 4)
        return "absent"
    start = time.monotonic()
    try:
        overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy=strategy, timeout=DEADLINE)
    except OverlapError as exc:
        elapsed = time.monotonic() - start
        return (type(exc).__name__, str(exc), elapsed)
    raise AssertionError(f"rank {rank}: the call returned although rank {absent} never made it")


@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
def test_stalled_rank_times_out_naming_it(strategy):
    results = run_isolated(3, stall_task, strategy, 2, False, timeout=90,
                           env={"OVERLAP_TIMEOUT_S": "60"})
    for rank, res in enumerate(results[:2]):
        name, text, elapsed = res
        assert name == "OverlapTimeout", (rank, res)
        assert elapsed <= DEADLINE + LATE_S, f"rank {rank} took {elapsed:.1f} s past a {DEADLINE} s deadline"
        assert "moe.dispatch_grouped_matmul" in text and ("peer 2" in text or "peer any" in text), text


@pytest.mark.parametrize("strategy", ["pipelined", "symm", "fused"])
def test_killed_rank_fails_survivors_fast(strategy):
    try:
        results = run_isolated(3, stall_task, strategy, 2, True, timeout=90, env={"OVERLAP_TIMEOUT_S": "60"})
    except RankError as exc:  # rank 2 died, as intended: the survivors' results are still there
        assert "rank 2 died" in str(exc), str(exc)
        results = exc.results
    for rank in (0, 1):
        name, text, elapsed = results[rank]
        assert elapsed <= DEADLINE + LATE_S, f"rank {rank} took {elapsed:.1f} s after its peer died"
        assert "peer 2" in text, text
