"""Expert migration (``Plan.migrate``, `overlap.ops.moe.migration`) on groups that span nodes, emulated as in
tests/moe/test_moe_hierarchical.py (``OVERLAP_NODE_ID``; 2 nodes x 2 ranks and 2 x 1 on the pooled CPU ranks).

The MoE layer (`dispatch_grouped_matmul` -> gelu -> `grouped_matmul_combine`, forward and backward) with a
migration plan over each token strategy against ``reference`` without migration on fresh random inputs
(uneven token counts, empty experts, a token naming one expert twice), the migrated pairs drawn from the seed;
``h`` row for row against the hosted layout the module docstring defines; bf16 against the float64 oracle;
repeated calls bitwise equal; `ExpertParallelMLP` with a migration plan; the payload bytes per call over the
network exactly; the errors (plain ops, a combine that disagrees, bad pairs, one node, a bound, ranks with
different plans); a rank killed on the other node named. No timings.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.moe.test_moe_hierarchical import cases_for, spanning_group
from tests.support.harness import RankError, run_isolated
from tests.support.moe_oracle import Case, close, dense, make_inputs
from tests.support.nodes import assert_dead_named
from tests.support.tp_oracle import expect_error

TOKEN_STRATEGIES = ("reference", "pipelined", "hierarchical")


def remote_pairs(E: int, nodes: list[list[int]], L: int) -> list[tuple[int, int]]:
    """Every ``(expert, node)`` pair whose node does not hold the expert."""
    return [(e, m) for e in range(E) for m, ranks in enumerate(nodes) if e // L not in ranks]


def draw_pairs(seed: int, E: int, nodes: list[list[int]], L: int) -> tuple[tuple[int, int], ...]:
    """About half of the remote pairs (at least one), from the seed: the same on every rank."""
    every = remote_pairs(E, nodes, L)
    rng = random.Random(seed)
    picked = [p for p in every if rng.random() < 0.5] or [rng.choice(every)]
    return tuple(picked)


def layer(how, group, x, idx, wt, w1, w2, g, E: int):
    """``(h, handle, y, grad x, grad w1, grad w2, grad topk_weights)`` of the grouped layer; `how` a strategy
    name or a Plan."""
    import overlap

    kw = {"strategy": how} if isinstance(how, str) else {"plan": how}
    x, w1, w2, wt = (t.clone().requires_grad_(True) for t in (x, w1, w2, wt))
    h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, group=group, **kw)
    y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h), w2, wt, handle, **kw)
    y.backward(g)
    return h.detach(), handle, y.detach(), x.grad, w1.grad, w2.grad, wt.grad


def hosted_rows(xs, idxs, w1, rank: int, L: int, nodes, pairs) -> tuple[list[int], torch.Tensor]:
    """What `h` must hold on `rank` (float64): per hosted expert (own, then its node's copies), the rows
    ``x @ w1[e]`` of its pairs by source rank, then token, then k; and the hosted experts' ids."""
    node = next(m for m, ranks in enumerate(nodes) if rank in ranks)
    node_of = {r: m for m, ranks in enumerate(nodes) for r in ranks}
    migrated = set(pairs)
    copies = sorted(e for e, m in migrated if m == node)
    rows = []
    for e in list(range(rank * L, (rank + 1) * L)):
        for s in range(len(xs)):
            if (e, node_of[s]) in migrated:
                continue
            rows += [xs[s][t] @ w1[e] for t in range(idxs[s].shape[0]) for k in range(idxs[s].shape[1])
                     if idxs[s][t, k] == e]
    for e in copies:
        rows += [xs[rank][t] @ w1[e] for t in range(idxs[rank].shape[0]) for k in range(idxs[rank].shape[1])
                 if idxs[rank][t, k] == e]
    width = w1.shape[2]
    return list(range(rank * L, (rank + 1) * L)) + copies, torch.stack(rows) if rows else torch.empty(0, width)


def against_reference(rank: int, world_size: int, ranks_per_node: int, seed: int) -> list[str]:
    import overlap

    group = spanning_group(rank, ranks_per_node)
    nodes = [list(range(n, min(n + ranks_per_node, world_size))) for n in range(0, world_size, ranks_per_node)]
    strategies = TOKEN_STRATEGIES if world_size % ranks_per_node == 0 else ("reference", "pipelined")  # (nodes
    done = []  # of different sizes: no hierarchical)
    try:
        for i, case in enumerate(cases_for(world_size)):
            xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed + i, world_size, torch.float32)
            E, L = case.experts, case.experts // world_size
            mine = (xs[rank], idxs[rank], weights[rank], w1[rank * L : (rank + 1) * L],
                    w2[rank * L : (rank + 1) * L], grads[rank], E)
            pairs = draw_pairs(seed + i, E, nodes, L)
            ref = layer("reference", group, *mine)
            ids, want_h = hosted_rows([x.double() for x in xs], idxs, w1.double(), rank, L, nodes, pairs)
            for strategy in strategies:
                plan = overlap.Plan(strategy, migrate=pairs)
                ctx = f"rank {rank}/{world_size} ({ranks_per_node} per node) {case} {plan.describe()}"
                got, again = layer(plan, group, *mine), layer(plan, group, *mine)
                h, handle = got[0], got[1]
                assert handle.migration.hosted_experts()[: len(ids)] == ids, ctx
                assert set(handle.migration.hosted_experts()[len(ids) :]) <= {-1}, ctx
                assert h.shape[0] == sum(handle.tokens_per_expert), ctx
                close("h", h, want_h, torch.float32, ctx)
                names = ("y", "grad x", "grad w1", "grad w2", "grad topk_weights")
                for name, a, b, c in zip(names, got[2:], ref[2:], again[2:], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5,
                                               msg=lambda m, where=ctx, n=name: f"{where}: {n}: {m}")
                    assert torch.equal(a, c), f"{ctx}: {name} not bitwise repeatable"
                done.append(ctx)
        overlap.release(group)
        return done
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (2, 1), (3, 1), (3, 2)])
def test_migration_against_reference(pools, seed, world_size, ranks_per_node):
    done = pools(world_size).run(against_reference, ranks_per_node, seed, timeout=300)
    strategies = len(TOKEN_STRATEGIES) if world_size % ranks_per_node == 0 else 2
    assert all(len(d) == strategies * len(cases_for(world_size)) for d in done), done


def bf16_against_oracle(rank: int, world_size: int, seed: int) -> int:
    import overlap

    group = spanning_group(rank, 2)
    nodes = [[0, 1], [2, 3]]
    try:
        case = Case((7, 3, 5), 16, 12, 8, 2, "skewed")
        xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed, world_size, torch.bfloat16)
        E, L = case.experts, case.experts // world_size
        plan = overlap.Plan("hierarchical", migrate=draw_pairs(seed, E, nodes, L))
        got = layer(plan, group, xs[rank], idxs[rank], weights[rank], w1[rank * L : (rank + 1) * L],
                    w2[rank * L : (rank + 1) * L], grads[rank], E)
        x64 = [t.double().requires_grad_(True) for t in xs]
        wt64 = [t.double().requires_grad_(True) for t in weights]
        w1_64, w2_64 = w1.double().requires_grad_(True), w2.double().requires_grad_(True)
        outs = dense(x64, idxs, wt64, w1_64, w2_64, torch.nn.functional.gelu)
        sum((o * g.double()).sum() for o, g in zip(outs, grads, strict=True)).backward()
        ctx = f"rank {rank} bf16 {plan.describe()}"
        close("y", got[2], outs[rank], torch.bfloat16, ctx)
        close("grad x", got[3], x64[rank].grad, torch.bfloat16, ctx)
        close("grad w1", got[4], w1_64.grad[rank * L : (rank + 1) * L], torch.bfloat16, ctx)
        close("grad w2", got[5], w2_64.grad[rank * L : (rank + 1) * L], torch.bfloat16, ctx)
        overlap.release(group)
        return len(plan.migrate)
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_bf16_against_the_oracle(pools, seed):
    assert all(n > 0 for n in pools(4).run(bf16_against_oracle, seed, timeout=240))


def module_with_migration(rank: int, world_size: int, seed: int) -> None:
    import overlap

    group = spanning_group(rank, 2)
    try:
        pairs = draw_pairs(seed, 8, [[0, 1], [2, 3]], 2)
        outs = []
        for plan in (overlap.Plan("reference"), overlap.Plan("pipelined", migrate=pairs)):
            torch.manual_seed(seed)
            mlp = overlap.nn.ExpertParallelMLP(16, 24, 8, 2, group=group, plan=plan)
            x = torch.randn(3 + rank, 2, 16, generator=torch.Generator().manual_seed(seed + rank),
                            requires_grad=True)
            y = mlp(x)
            y.square().sum().backward()
            outs.append((y.detach(), x.grad, mlp.w1.grad, mlp.w2.grad, mlp.router.weight.grad))
        for name, a, b in zip(("y", "grad x", "grad w1", "grad w2", "grad router"), *outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"rank {rank}: {n}: {m}")
        overlap.release(group)
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_expert_parallel_mlp_with_migration(pools, seed):
    pools(4).run(module_with_migration, seed, timeout=240)


# ----------------------------------------------------------------------------------------------
# Exact bytes over the network
# ----------------------------------------------------------------------------------------------


def network_bytes(rank: int, world_size: int, ranks_per_node: int, seed: int) -> dict[str, int]:
    """``pipelined`` + migration, forward and backward: every token row of a pair that is not migrated and
    whose expert is on another node crosses four times (x, y, and their gradients), H wide; each migrated
    pair's ``w1`` and ``w2`` cross once from their owner, and their gradients once from the receiver."""
    import overlap
    from overlap import comm

    group = spanning_group(rank, ranks_per_node)
    Q, N = ranks_per_node, world_size // ranks_per_node
    nodes = [list(range(n * Q, (n + 1) * Q)) for n in range(N)]
    node_of = {r: r // Q for r in range(world_size)}
    try:
        case = Case((6, 4, 9), 8, 12, 4 * world_size, 2, "skewed")
        xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed, world_size, torch.float32)
        E, L, H, F = case.experts, case.experts // world_size, case.hidden, case.ffn
        pairs = draw_pairs(seed, E, nodes, L)
        migrated = set(pairs)

        def crossing(s: int, d: int) -> int:  # pairs of source s to experts of rank d that travel as tokens
            return sum(1 for e in idxs[s].reshape(-1).tolist() if e // L == d and (e, node_of[s]) not in migrated)

        rows = sum(crossing(rank, d) + crossing(d, rank) for d in range(world_size) if node_of[d] != node_of[rank])
        owned = sum(1 for e, _ in pairs if e // L == rank)
        received = sum(1 for e, m in pairs if m == node_of[rank]
                       and nodes[m][nodes[node_of[e // L]].index(e // L) % Q] == rank)
        want = 2 * rows * H * 4 + 2 * (owned + received) * H * F * 4
        before = comm.network_bytes_sent()
        layer(overlap.Plan("pipelined", migrate=pairs), group, xs[rank], idxs[rank], weights[rank],
              w1[rank * L : (rank + 1) * L], w2[rank * L : (rank + 1) * L], grads[rank], E)
        sent = comm.network_bytes_sent() - before
        assert sent == want, f"rank {rank}: {sent} network bytes, want {want} ({rows} rows, {owned} owned, " \
                             f"{received} received, pairs {pairs})"
        overlap.release(group)
        return {"sent": sent, "owned": owned, "received": received}
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (2, 1)])
def test_network_bytes_are_exact(pools, seed, world_size, ranks_per_node):
    results = pools(world_size).run(network_bytes, ranks_per_node, seed)
    assert sum(r["owned"] for r in results) == sum(r["received"] for r in results) > 0, results


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def errors(rank: int, world_size: int) -> list[tuple[str, str]]:
    """Each mistake made by every rank: each raises ValueError before any data moves, and the group then
    computes right. Then rank 0 migrates other pairs than its peers: every rank raises a mismatch."""
    import torch.distributed as dist

    import overlap

    group = spanning_group(rank, 2)
    try:
        x, idx = torch.randn(4, 8), torch.randint(0, 8, (4, 2))
        w1, w2, wt = torch.randn(2, 8, 6), torch.randn(2, 6, 8), torch.rand(4, 2)
        mig = overlap.Plan("pipelined", migrate=((0, 1),))
        got = [expect_error(overlap.moe.dispatch, x, idx, 8, group=group, plan=mig)[:2]]
        for bad in (((0, 0),), ((8, 1),), ((0, 2),)):  # the owner's node; expert and node out of range
            got.append(expect_error(overlap.moe.dispatch_grouped_matmul, x, idx, w1, 8, group=group,
                                    plan=overlap.Plan("pipelined", migrate=bad))[:2])
        got.append(expect_error(overlap.moe.dispatch_grouped_matmul, x, idx, w1, 8, group=group, plan=mig,
                                max_tokens_per_rank=8)[:2])
        node_id = os.environ.pop("OVERLAP_NODE_ID")
        one_node = dist.new_group(list(range(world_size)))  # its node is read at its first call: one node
        got.append(expect_error(overlap.moe.dispatch_grouped_matmul, x, idx, w1, 8, group=one_node, plan=mig)[:2])
        os.environ["OVERLAP_NODE_ID"] = node_id
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, 8, group=group, plan=mig)
        got.append(expect_error(overlap.moe.combine, torch.randn(h.shape[0], 8), wt, handle,
                                strategy="pipelined")[:2])  # the plain combine of a migrating dispatch
        other = overlap.Plan("pipelined", migrate=((1, 1),))
        got.append(expect_error(overlap.moe.grouped_matmul_combine, h, w2, wt, handle, plan=other)[:2])
        y = overlap.moe.grouped_matmul_combine(h, w2, wt, handle, strategy="pipelined")  # follows the dispatch
        h_ref, handle_ref = overlap.moe.dispatch_grouped_matmul(x, idx, w1, 8, group=group, strategy="reference")
        want = overlap.moe.grouped_matmul_combine(h_ref, w2, wt, handle_ref, strategy="reference")
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        mine = mig if rank else overlap.Plan("pipelined", migrate=((0, 1), (1, 1)))
        got.append(expect_error(overlap.moe.dispatch_grouped_matmul, x, idx, w1, 8, group=group, plan=mine)[:2])
        overlap.release(group)
        return got
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_errors(pools):
    for rank, got in enumerate(pools(4).run(errors, timeout=240)):
        *local, mismatch = got
        assert all(kind == "ValueError" for kind, _ in local), (rank, local)
        for (_, msg), words in zip(local, ("grouped-matmul", "holds expert 0", "expert 8 >=", "node 2 >=",
                                           "max_tokens_per_rank", "one node", "only grouped_matmul_combine",
                                           "differs from the dispatch"), strict=True):
            assert words in msg, (rank, msg)
        assert mismatch[0] == "OverlapMismatchError" and "migrate" in mismatch[1], (rank, mismatch)


def killed_remote(rank: int, world_size: int, victim: int) -> tuple[str, str, float]:
    """`victim` (node 1) dies when the weights should move, after the call's handshake."""
    import signal
    import time

    import overlap
    from overlap.ops.moe import migration as moe_migration

    group = spanning_group(rank, 2)
    try:
        x, idx, w1 = torch.randn(5, 8), torch.randint(0, 8, (5, 2)), torch.randn(2, 8, 6)
        plan = overlap.Plan("pipelined", migrate=((0, 1), (6, 0)))
        overlap.moe.dispatch_grouped_matmul(x, idx, w1, 8, group=group, plan=plan)  # healthy first
        if rank == victim:
            moe_migration._exchange = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        kind, msg, _ = expect_error(overlap.moe.dispatch_grouped_matmul, x, idx, w1, 8, group=group, plan=plan,
                                    timeout=3.0)
        return kind, msg, time.monotonic() - start
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_killed_rank_on_the_other_node_is_named():
    victim = 3
    with pytest.raises(RankError) as failed:
        run_isolated(4, killed_remote, victim, timeout=90.0)
    assert_dead_named(failed.value, victim, deadline=3.0)
