"""The steady state of the MoE ops: with ``max_tokens_per_rank`` a ``symm`` transfer's slot size is fixed by
the signature, so warmed calls skip the host rendezvous (`overlap.ops.moe.bound.begin`), and ranks that
disagree still raise `OverlapMismatchError` everywhere, found in the data. Exact counts keep the full
handshake (the slot follows the routing). Counts, error kinds and numbers only; no timings.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.moe_oracle import Case, make_inputs
from tests.support.tp_oracle import expect_error

CASE = Case((6, 3, 5), 8, 12, 4, 2, "random")  # experts per rank x W below


def _layer(rank, world_size, seed, bound, backward=False, hidden=None):
    """One MoE layer on `rank` (symm); returns ``y`` (and the gradients)."""
    import overlap

    case = Case(CASE.tokens, hidden or CASE.hidden, CASE.ffn, 2 * world_size, CASE.top_k, CASE.routing)
    xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed, world_size, torch.float32)
    L = case.experts // world_size
    x, w1, w2 = (t.clone().requires_grad_(backward) for t in (xs[rank], w1[rank * L : (rank + 1) * L],
                                                                w2[rank * L : (rank + 1) * L]))
    h, handle = overlap.moe.dispatch_grouped_matmul(x, idxs[rank], w1, case.experts, strategy="symm",
                                                    max_tokens_per_rank=bound, timeout=20)
    y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h), w2, weights[rank], handle,
                                           strategy="symm", timeout=20)
    if not backward:
        return (y,)
    y.backward(grads[rank])
    return y.detach(), x.grad, w1.grad, w2.grad


def steady_task(rank, world_size, seed):
    from overlap import symm

    bound = max(CASE.tokens)
    want = _layer(rank, world_size, seed, None, backward=True)
    for _ in range(2):  # warm-up: each transfer's first call of its signature is a full handshake (which
        _layer(rank, world_size, seed, bound)  # inputs need a gradient is part of the signature)
        _layer(rank, world_size, seed, bound, backward=True)
    deltas = []
    for backward, n in ((False, 50), (True, 10)):
        before = symm.host_sync_counts()
        for _ in range(n):
            got = _layer(rank, world_size, seed, bound, backward=backward)
        after = symm.host_sync_counts()
        deltas.append({k: after[k] - before[k] for k in after})
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    before = symm.host_sync_counts()
    for _ in range(3):
        _layer(rank, world_size, seed, None)
    exact = symm.host_sync_counts()["rendezvous"] - before["rendezvous"]
    return deltas, exact


def test_bounded_symm_calls_are_steady(pools, seed):
    for rank, ((forward, both), exact) in enumerate(pools(2).run(steady_task, seed, timeout=180)):
        assert forward["rendezvous"] == 0 and forward["steady"] == 2 * 50, (rank, forward)
        assert both["rendezvous"] == 0 and both["steady"] == 4 * 10, (rank, both)
        assert exact == 2 * 3, (rank, exact)  # exact counts: a full handshake per transfer


def mismatch_task(rank, world_size, seed, who):
    """Warm the bounded layer; then rank `who` makes a new call (another bound, then another hidden size) while
    the others repeat the warmed one; twice each. Then the group computes right."""
    bound = max(CASE.tokens)
    for _ in range(2):
        _layer(rank, world_size, seed, bound)
    results = {}
    for kind, change in (("bound", {"bound": bound + 1}), ("hidden", {"hidden": CASE.hidden + 2})):
        for attempt in range(2):
            args = {"bound": bound, "hidden": None}
            if rank == who:
                args.update(change)
            results[f"{kind} #{attempt}"] = expect_error(_layer, rank, world_size, seed, args["bound"],
                                                         hidden=args["hidden"])
    want = _layer(rank, world_size, seed + 1, None)
    for _ in range(3):
        torch.testing.assert_close(_layer(rank, world_size, seed + 1, bound)[0], want[0], rtol=1e-5, atol=1e-5)
    return results


@pytest.mark.parametrize("world_size,who", [(2, 1), (3, 0)])
def test_a_new_call_among_warmed_ones_raises_mismatch_everywhere(pools, seed, world_size, who):
    for rank, res in enumerate(pools(world_size).run(mismatch_task, seed, who, timeout=240)):
        for key, (kind, msg, secs) in res.items():
            ctx = f"W={world_size}, {key}, rank {rank}: {kind}: {msg}"
            assert kind == "OverlapMismatchError" and "disagree" in msg, ctx
            assert secs < FALLBACK_TIMEOUT_S, ctx
