"""overlap.moe with ``max_tokens_per_rank`` (`overlap.ops.moe.bound`) on CPU ranks: every strategy against the
dense float64 oracle, forward and backward, with the padding rows checked (zero, never read even when the
expert function makes them nonzero, zero gradient); a rank over the bound, ranks that disagree on it;
`overlap.nn.ExpertParallelMLP` with a bound against itself without one.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.moe_oracle import Case, check_moe

# (tokens per rank, cycled over ranks), hidden, ffn, experts per rank, top_k, routing, slack over the largest T
_SPECS = [
    ((5, 0, 3), 16, 24, 2, 2, "random", 0),  # a rank with no tokens; the bound is tight
    ((4, 3), 8, 8, 4, 2, "empty", 2),  # half of the experts receive nothing
    ((6, 2, 9), 12, 8, 4, 4, "skewed", 1),
    ((3, 7), 8, 12, 1, 2, "random", 3),  # min(K, L) = 1: the capacity is W * B
]


def bounded_task(rank, world_size, strategy, seed):
    done = []
    forms = ("grouped",) if strategy == "fused" else ("plain", "grouped")
    for i, (tokens, h, f, e, k, routing, slack) in enumerate(_SPECS):
        case = Case(tokens, h, f, e * world_size, k, routing)
        done += check_moe(rank, world_size, strategy, torch.float32, seed + i, [case], forms, slack=slack)
    return done


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
def test_bounded_matches_dense_oracle(pools, seed, world_size, strategy):
    forms = 1 if strategy == "fused" else 2
    done = pools(world_size).run(bounded_task, strategy, seed, timeout=300)
    assert all(len(d) == forms * len(_SPECS) for d in done), done


def bf16_task(rank, world_size, seed):
    case = Case((5, 2), 16, 24, 2 * world_size, 2, "random")
    return check_moe(rank, world_size, "auto", torch.bfloat16, seed, [case], slack=1)


def test_bounded_bf16_auto(pools, seed):
    assert all(len(d) == 2 for d in pools(2).run(bf16_task, seed, timeout=120))


# ----------------------------------------------------------------------------------------------
# Over the bound, bad bounds, disagreement
# ----------------------------------------------------------------------------------------------


def over_bound_task(rank, world_size):
    """Rank 1 passes more tokens than the bound: ValueError there, OverlapMismatchError (a ValueError) on its
    peers, at once, before any data moves; the group stays usable."""
    import overlap
    from overlap import OverlapMismatchError

    E, H, B = 2 * world_size, 8, 4
    w1 = torch.randn(2, H, 6)
    seen = []

    def expect(fn, mine: str):
        start = time.monotonic()
        try:
            fn()
        except ValueError as exc:
            text = mine if rank == 1 else "invalid input on rank 1"
            assert text in str(exc), (rank, str(exc))
            assert rank == 1 or isinstance(exc, OverlapMismatchError), (rank, exc)
            assert time.monotonic() - start < FALLBACK_TIMEOUT_S, "the peers must raise at once"
            seen.append(type(exc).__name__)
            return
        raise AssertionError(f"rank {rank}: expected a ValueError ({mine})")

    T = B + 1 if rank == 1 else B
    x, idx = torch.randn(T, H), torch.randint(0, E, (T, 2))
    expect(lambda: overlap.moe.dispatch(x, idx, E, strategy="symm", max_tokens_per_rank=B), "more than max_tokens")
    expect(lambda: overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy="pipelined", max_tokens_per_rank=B),
           "more than max_tokens")
    # A token naming one expert twice sends K rows to one rank: over B * min(K, L) rows with L = 1.
    same = torch.zeros(B, 2, dtype=torch.int64) if rank == 1 else torch.arange(B * 2).view(B, 2) % world_size
    expect(lambda: overlap.moe.dispatch(torch.randn(B, H), same, world_size, strategy="reference",
                                        max_tokens_per_rank=B), "names one expert more than once")
    for bad in (0, -3, True, 2.5, "4"):
        expect(lambda bad=bad: overlap.moe.dispatch(torch.randn(2, H), torch.randint(0, E, (2, 2)), E,
                                                    max_tokens_per_rank=bad if rank == 1 else B),
               "max_tokens_per_rank must be")
    # The group is still usable, with the bound.
    x, idx = torch.randn(B, H), torch.randint(0, E, (B, 2))
    rows, handle = overlap.moe.dispatch(x, idx, E, strategy="symm", max_tokens_per_rank=B)
    y = overlap.moe.combine(rows, torch.full((B, 2), 0.5), handle, strategy="symm")
    torch.testing.assert_close(y, x)
    return seen


def test_over_the_bound_raises_on_every_rank_and_group_recovers(pools):
    seen = pools(3).run(over_bound_task, timeout=120)
    assert seen[1] == ["ValueError"] * 8, seen
    assert seen[0] == seen[2] == ["OverlapMismatchError"] * 8, seen


def mismatch_task(rank, world_size):
    """Ranks that pass different bounds (or a bound and none) make different calls: OverlapMismatchError
    on every rank, naming the bound."""
    import overlap
    from overlap import OverlapMismatchError

    E = 2 * world_size
    x, idx = torch.randn(3, 8), torch.randint(0, E, (3, 2))
    seen = []
    for bounds in ((5, 6), (5, None)):
        try:
            overlap.moe.dispatch(x, idx, E, strategy="symm", max_tokens_per_rank=bounds[rank % 2])
        except OverlapMismatchError as exc:
            assert "max_tokens_per_rank=5" in str(exc), str(exc)
            seen.append(bounds)
    rows, handle = overlap.moe.dispatch(x, idx, E, strategy="symm", max_tokens_per_rank=5)
    assert rows.shape == (world_size * 5 * 2, 8)
    return seen


def test_bound_mismatch_raises_on_every_rank(pools):
    assert pools(2).run(mismatch_task, timeout=120) == [[(5, 6), (5, None)]] * 2


# ----------------------------------------------------------------------------------------------
# ExpertParallelMLP
# ----------------------------------------------------------------------------------------------


def module_task(rank, world_size, seed, strategy):
    """The module with a bound gives what it gives without one (output, input and parameter gradients)."""
    from overlap.nn import ExpertParallelMLP

    results = []
    for bound in (None, 9):
        torch.manual_seed(seed)
        mlp = ExpertParallelMLP(8, 6, 2 * world_size, 2, activation="silu_glu", strategy=strategy,
                                max_tokens_per_rank=bound)
        x = torch.randn(3 * (rank % 2), 3, 8, generator=torch.Generator().manual_seed(seed + rank))
        x.requires_grad_()
        y = mlp(x)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), x.grad] + [p.grad for p in mlp.parameters()])
        if bound is not None:
            assert "max_tokens_per_rank=9" in repr(mlp)
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Rank 1 over the bound (10 tokens of [5, 2, 8]): ValueError on every rank, then the module works on.
    x = torch.randn(5 if rank == 1 else 1, 2, 8)
    with pytest.raises(ValueError, match="more than max_tokens_per_rank=9" if rank == 1 else "invalid input"):
        mlp(x)
    assert mlp(x[:4]).shape == x[:4].shape
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            ExpertParallelMLP(8, 6, 2 * world_size, 2, max_tokens_per_rank=bad)
    return True


@pytest.mark.parametrize("strategy", ["reference", "symm", "fused"])
def test_module_with_bound_matches_without(pools, seed, strategy):
    assert pools(2).run(module_task, seed, strategy, timeout=180) == [True, True]
