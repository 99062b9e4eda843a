"""Batch-first ops: ``all_gather_matmul(..., gather_dim=d)``, ``matmul_reduce_scatter(..., scatter_dim=d)`` and one
gather feeding several weights, on every strategy, forward and backward, against float64 autograd.

The oracle: every rank regenerates every rank's inputs from the seed and runs the unfused math in float64 with
torch's autograd: ``A = cat_s(a_s, dim)``, ``y_{r,i} = A @ b_{r,i}`` (gather), or ``P = sum_s a_s @ b_s``,
``y_r = chunk(P, W, dim)[r]`` (scatter), and the loss ``sum_r <y_r, g_r>`` (plus ``<A, h_r>`` where the gathered
input is returned), so its gradients are exactly the ones each rank must get.
"""

from __future__ import annotations

import os

import pytest
import torch

from overlap.ops.tp.rows import Rows, of
from tests.support import nodes
from tests.support.tp_oracle import TOL, compare, expect_error

# (local shape of a without k, dim): batch of one and odd batches, odd per-rank lengths, 3-D and 4-D, dim 0 too.
GATHER_CASES = [((3, 5), 1), ((1, 7), 1), ((2, 3, 3), 1), ((3, 2, 5), 2), ((2, 5, 3), -2), ((5, 3), 0)]
FUSED_CASES = [((3, 5), 1), ((2, 3, 2), 2)]
K, NS = 12, (7, 4, 4)  # one weight's n; several weights (grouped-query q, k, v): different n


def _inputs(seed, rank, shape, k, ns, dtype):
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    a = torch.randn((*shape, k), generator=gen, dtype=torch.float64)
    ws = [torch.randn((n, k), generator=gen, dtype=torch.float64) for n in ns]
    return a.to(dtype), [w.to(dtype) for w in ws], gen


def gather_oracle(seed, W, shape, dim, ns, dtype, keep):
    """Every rank's (a, ws, gs, h) and this group's float64 (ys, grad_a, grad_ws) per rank."""
    d = dim % (len(shape) + 1)
    inputs = []
    for r in range(W):
        a, ws, gen = _inputs(seed, r, shape, K, ns, dtype)
        full_shape = (*shape[:d], W * shape[d], *shape[d + 1 :])
        gs = [torch.randn((*full_shape, n), generator=gen, dtype=torch.float64).to(dtype) for n in ns]
        h = torch.randn((*full_shape, K), generator=gen, dtype=torch.float64).to(dtype) if keep else None
        inputs.append((a, ws, gs, h))
    leaves_a = [x[0].double().requires_grad_() for x in inputs]
    leaves_w = [[w.double().requires_grad_() for w in x[1]] for x in inputs]
    A = torch.cat(leaves_a, dim=d)
    loss, ys = 0, []
    for r in range(W):
        y = [A @ w.t() for w in leaves_w[r]]
        ys.append([t.detach() for t in y])
        loss = loss + sum((t * g.double()).sum() for t, g in zip(y, inputs[r][2]))
        if keep:
            loss = loss + (A * inputs[r][3].double()).sum()
    loss.backward()
    return inputs, ys, [x.grad for x in leaves_a], [[w.grad for w in ws] for ws in leaves_w], A.detach()


def gather_run(a, ws, gs, h, strategy, dim, many, keep, timeout=60.0, **kw):
    import overlap

    a = a.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in ws]
    bs = [w.t() for w in ws] if many else ws[0].t()
    out = overlap.all_gather_matmul(a, bs, strategy=strategy, timeout=timeout, gather_dim=dim, return_gathered=keep,
                                    **kw)
    full, ys = out if keep else (None, out)
    ys = ys if many else [ys]
    loss = sum((y * g).sum() for y, g in zip(ys, gs))
    if keep:
        loss = loss + (full * h).sum()
    loss.backward()
    return [y.detach() for y in ys], a.grad, [w.grad for w in ws], full


def check_gather(rank, W, strategy, seed, cases, dtype=torch.float32, many_modes=(False, True)):
    done = []
    for i, (shape, dim) in enumerate(cases):
        for many in many_modes:
            keep = many  # the list form also returns the gathered input (and takes a gradient through it)
            ns = NS if many else NS[:1]
            inputs, ys, grad_as, grad_ws, A = gather_oracle(seed + i, W, shape, dim, ns, dtype, keep)
            a, ws, gs, h = inputs[rank]
            got_ys, got_ga, got_gws, full = gather_run(a, ws, gs, h, strategy, dim, many, keep)
            ctx = (f"rank {rank}/{W} {strategy} {dtype} a={tuple(a.shape)} gather_dim={dim} weights={len(ns)} "
                   f"seed={seed}")
            if dtype == torch.float32:
                compare(ctx, (*got_ys, got_ga, *got_gws), (*ys[rank], grad_as[rank], *grad_ws[rank]), dtype,
                        labels=[*(f"y{j}" for j in range(len(ns))), "grad_a", *(f"grad_w{j}" for j in range(len(ns)))])
                if keep:
                    compare(ctx, (full,), (A,), dtype, labels=("gathered",))
            else:
                for label, x, y in [*(("y", x, y) for x, y in zip(got_ys, ys[rank])), ("grad_a", got_ga, grad_as[rank]),
                                    *(("grad_w", x, y) for x, y in zip(got_gws, grad_ws[rank]))]:
                    rel = ((x.double() - y).norm() / y.norm()).item()
                    assert rel < 2e-2, f"{ctx}: {label} is {rel:.3g} away from the float64 oracle"
            done.append(ctx)
    return done


def scatter_oracle(seed, W, shape, dim, dtype):
    """``shape``: the output's per-rank shape without n; a is that with ``W *`` at `dim`, and ``k``."""
    d = dim % (len(shape) + 1)
    full_shape = (*shape[:d], W * shape[d], *shape[d + 1 :])
    inputs = []
    for r in range(W):
        a, ws, gen = _inputs(seed, r, full_shape, K, NS[:1], dtype)
        g = torch.randn((*shape, NS[0]), generator=gen, dtype=torch.float64).to(dtype)
        inputs.append((a, ws[0], g))
    la = [x[0].double().requires_grad_() for x in inputs]
    lw = [x[1].double().requires_grad_() for x in inputs]
    P = sum(a @ w.t() for a, w in zip(la, lw))
    ys = list(P.chunk(W, dim=d))
    loss = sum((y * x[2].double()).sum() for y, x in zip(ys, inputs))
    loss.backward()
    return inputs, [y.detach() for y in ys], [x.grad for x in la], [w.grad for w in lw]


def check_scatter(rank, W, strategy, seed, cases, dtype=torch.float32):
    import overlap

    done = []
    for i, (shape, dim) in enumerate(cases):
        inputs, ys, grad_as, grad_ws = scatter_oracle(seed + i, W, shape, dim, dtype)
        a, w, g = inputs[rank]
        a = a.detach().clone().requires_grad_()
        w = w.detach().clone().requires_grad_()
        y = overlap.matmul_reduce_scatter(a, w.t(), strategy=strategy, timeout=60.0, scatter_dim=dim)
        y.backward(g)
        ctx = f"rank {rank}/{W} {strategy} {dtype} a={tuple(a.shape)} scatter_dim={dim} seed={seed}"
        if dtype == torch.float32:
            compare(ctx, (y.detach(), a.grad, w.grad), (ys[rank], grad_as[rank], grad_ws[rank]), dtype)
        else:
            for label, x, want in (("y", y, ys[rank]), ("grad_a", a.grad, grad_as[rank]), ("grad_w", w.grad,
                                                                                          grad_ws[rank])):
                rel = ((x.detach().double() - want).norm() / want.norm()).item()
                assert rel < 2e-2, f"{ctx}: {label} is {rel:.3g} away from the float64 oracle"
        done.append(ctx)
    return done


def both(rank, W, strategy, seed, cases, dtype=torch.float32, many_modes=(False, True)):
    return (check_gather(rank, W, strategy, seed, cases, dtype, many_modes)
            + check_scatter(rank, W, strategy, seed, cases, dtype))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "auto"])
def test_matches_float64(pools, seed, world_size, strategy):
    reports = pools(world_size).run(both, strategy, seed, GATHER_CASES, timeout=300)
    assert all(len(r) == 3 * len(GATHER_CASES) for r in reports)


def test_bf16_matches_float64(pools, seed):
    for strategy in ("pipelined", "symm"):
        reports = pools(3).run(both, strategy, seed, GATHER_CASES[:3], torch.bfloat16, timeout=300)
        assert all(len(r) == 9 for r in reports)


def test_fused_interpreted_matches_float64(pools, seed):
    reports = pools(2).run(both, "fused", seed, FUSED_CASES, torch.float32, timeout=600)
    assert all(len(r) == 3 * len(FUSED_CASES) for r in reports)


def across_nodes(rank, W, seed):
    group = nodes.spanning_group(rank, 2, "bfnode")
    try:
        import overlap

        done = []
        for i, (shape, dim) in enumerate([((3, 5), 1), ((2, 3, 3), 2)]):
            inputs, ys, grad_as, grad_ws, _ = gather_oracle(seed + i, W, shape, dim, NS, torch.float32, False)
            a, ws, gs, _h = inputs[rank]
            a = a.clone().requires_grad_()
            wl = [w.clone().requires_grad_() for w in ws]
            out = overlap.all_gather_matmul(a, [w.t() for w in wl], group=group, strategy="hierarchical",
                                            gather_dim=dim)
            sum((y * g).sum() for y, g in zip(out, gs)).backward()
            ctx = f"rank {rank} hierarchical gather_dim={dim}"
            compare(ctx, (*out, a.grad, *(w.grad for w in wl)), (*ys[rank], grad_as[rank], *grad_ws[rank]),
                    torch.float32, labels=("y0", "y1", "y2", "grad_a", "gw0", "gw1", "gw2"))
            s_inputs, s_ys, s_ga, s_gw = scatter_oracle(seed + i, W, shape, dim, torch.float32)
            a, w, g = s_inputs[rank]
            a, w = a.clone().requires_grad_(), w.clone().requires_grad_()
            y = overlap.matmul_reduce_scatter(a, w.t(), group=group, strategy="hierarchical", scatter_dim=dim)
            y.backward(g)
            compare(ctx + " scatter", (y.detach(), a.grad, w.grad), (s_ys[rank], s_ga[rank], s_gw[rank]),
                    torch.float32)
            done.append(ctx)
        return done
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_hierarchical_across_nodes(pools, seed):
    assert all(len(r) == 2 for r in pools(4).run(across_nodes, seed, timeout=300))


# ----------------------------------------------------------------------------------------------
# One gather, several weights: the same as separate calls, and the bytes of one gather
# ----------------------------------------------------------------------------------------------


def several_vs_separate(rank, W, seed):
    import overlap

    gen = torch.Generator().manual_seed(seed + rank)
    a = torch.randn(3, 5, K, generator=gen)
    ws = [torch.randn(n, K, generator=gen) for n in NS]
    gs = [torch.randn(3, 5 * W, n, generator=gen) for n in NS]
    for strategy in ("reference", "pipelined", "symm", "fused"):
        a1 = a.clone().requires_grad_()
        w1 = [w.clone().requires_grad_() for w in ws]
        ys = overlap.all_gather_matmul(a1, [w.t() for w in w1], strategy=strategy, gather_dim=1, timeout=60.0)
        sum((y * g).sum() for y, g in zip(ys, gs)).backward()
        sep_ys, sep_ga, sep_gw = [], torch.zeros_like(a), []
        for w, g in zip(ws, gs):
            a2 = a.clone().requires_grad_()
            w2 = w.clone().requires_grad_()
            y = overlap.all_gather_matmul(a2, w2.t(), strategy=strategy, gather_dim=1, timeout=60.0)
            (y * g).sum().backward()
            sep_ys.append(y.detach())
            sep_ga += a2.grad
            sep_gw.append(w2.grad)
        for j in range(len(NS)):  # the same GEMMs on the same rows: bitwise
            assert torch.equal(ys[j], sep_ys[j]), (strategy, j)
            assert torch.equal(w1[j].grad, sep_gw[j]), (strategy, j)
        # grad_a: one reduce-scatter of the summed partials against a sum of three (other rounding)
        torch.testing.assert_close(a1.grad, sep_ga, rtol=1e-5, atol=1e-5)
    return True


def test_several_weights_equal_separate_calls(pools, seed):
    assert pools(2).run(several_vs_separate, seed, timeout=300) == [True, True]


def network_bytes(rank, W):
    import overlap
    from overlap import comm

    group = nodes.spanning_group(rank, 1, "bytenode")  # every peer on another node: every byte counted
    try:
        a = torch.randn(2, 3, K)
        ws = [torch.randn(n, K) for n in NS]
        counts = {}
        for label, bs in (("one", ws[0].t()), ("three", [w.t() for w in ws])):
            for strategy in ("pipelined", "hierarchical"):
                before = comm.network_bytes_sent()
                overlap.all_gather_matmul(a, bs, group=group, strategy=strategy, gather_dim=1)
                counts[label, strategy] = comm.network_bytes_sent() - before
        return counts
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.exact
def test_several_weights_move_the_bytes_of_one_gather(pools):
    for counts in pools(2).run(network_bytes):
        one = 2 * 3 * K * 4  # this rank's rows, to the one other rank
        assert counts == {("one", "pipelined"): one, ("three", "pipelined"): one, ("one", "hierarchical"): one,
                          ("three", "hierarchical"): one}, counts


# ----------------------------------------------------------------------------------------------
# Bad arguments raise on every rank before any data moves; ranks that disagree on the dim
# ----------------------------------------------------------------------------------------------


def bad_arguments(rank, W):
    import overlap

    a = torch.randn(2, 3, K)
    b = torch.randn(K, 5)
    AG, RS = overlap.all_gather_matmul, overlap.matmul_reduce_scatter
    cases = [
        ("last", lambda: AG(a, b, gather_dim=2), "ValueError", ["gather_dim=2", "(2, 3, 12)"]),
        ("minus one", lambda: AG(a, b, gather_dim=-1), "ValueError", ["gather_dim=-1"]),
        ("out of range", lambda: AG(a, b, gather_dim=5), "ValueError", ["gather_dim=5", "(2, 3, 12)"]),
        ("below", lambda: RS(a, b, scatter_dim=-4), "ValueError", ["scatter_dim=-4"]),
        ("not an int", lambda: AG(a, b, gather_dim=1.0), "TypeError", ["gather_dim", "float"]),
        ("a bool", lambda: RS(a, b, scatter_dim=True), "TypeError", ["scatter_dim", "bool"]),
        ("indivisible", lambda: RS(torch.randn(2, 3, K), b, scatter_dim=1), "ValueError", ["divide", "3"]),
        ("empty list", lambda: AG(a, []), "ValueError", ["empty list"]),
        ("other k", lambda: AG(a, [b, torch.randn(K + 1, 5)]), "ValueError", ["inner dims"]),
        ("other dtype", lambda: AG(a, [b, torch.randn(K, 5, dtype=torch.float64)]), "TypeError", ["dtype"]),
        ("list to scatter", lambda: RS(a, [b]), "TypeError", ["list"]),
        ("flag", lambda: AG(a, b, return_gathered=1), "TypeError", ["return_gathered"]),
    ]
    if W % 2 == 0:
        cases.append(("even rows ok", lambda: RS(torch.randn(2, 2 * W, K), b, scatter_dim=1), None, []))
    results = []
    for name, call, kind, words in cases:
        got, msg, _ = expect_error(call)
        assert got == kind, (name, got, msg)
        for word in words:
            assert word in msg, (name, word, msg)
        results.append(name)
    # One rank alone with a bad dim: it raises its ValueError, its peers OverlapMismatchError, none hangs.
    got, msg, seconds = expect_error(AG, a, b, gather_dim=2 if rank == 0 else 1, timeout=20.0)
    assert (got, seconds < 15) == (("ValueError" if rank == 0 else "OverlapMismatchError"), True), (got, msg)
    # Ranks that agree on every shape but not on the dim: the signature differs, every rank raises.
    sq = torch.randn(3, 3, K)
    got, msg, seconds = expect_error(AG, sq, b, gather_dim=rank % 2, strategy="symm", timeout=20.0)
    assert got == "OverlapMismatchError" and seconds < 15, (got, msg)
    got, msg, seconds = expect_error(RS, torch.randn(2 * W, 2 * W, K), b, scatter_dim=rank % 2,
                                     strategy="pipelined", timeout=20.0)
    assert got == "OverlapMismatchError" and seconds < 15, (got, msg)
    # The group is still usable.
    y = AG(a, b, gather_dim=1)
    assert y.shape == (2, 3 * W, 5)
    return results


def test_bad_arguments_raise_on_every_rank(pools):
    reports = pools(2).run(bad_arguments, timeout=240)
    assert all(len(r) == 13 for r in reports), reports


# ----------------------------------------------------------------------------------------------
# torch.compile: no graph break, the same numbers as eager
# ----------------------------------------------------------------------------------------------


def compiled(rank, W, seed):
    import overlap

    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(2, 3, K, generator=gen)
    ws = [torch.randn(n, K, generator=gen) for n in NS]
    wo = torch.randn(K, sum(NS), generator=gen)

    def block(x, ws, wo):
        full, (q, k, v) = overlap.all_gather_matmul(x, [w.t() for w in ws], gather_dim=1, strategy="symm",
                                                    return_gathered=True)
        h = torch.cat([q, k.relu(), v], dim=-1)
        return overlap.matmul_reduce_scatter(h, wo.t(), scatter_dim=1, strategy="symm") + full[:, : x.shape[1]]

    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        xs = x.clone().requires_grad_()
        wl = [w.clone().requires_grad_() for w in ws]
        wol = wo.clone().requires_grad_()
        y = fn(xs, wl, wol)
        y.square().sum().backward()
        results.append([y.detach(), xs.grad, *(w.grad for w in wl), wol.grad])
    for e, c in zip(*results):
        torch.testing.assert_close(c, e, **TOL[torch.float32])
    return True


def test_compile_fullgraph_equals_eager(pools, seed):
    assert pools(2).run(compiled, seed, timeout=600) == [True, True]


# ----------------------------------------------------------------------------------------------
# The layout itself
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dim,world", [((3, 5, 4), 1, 2), ((2, 3, 2, 4), 2, 3), ((4, 4), 0, 4),
                                             ((1, 7, 4), 1, 3), ((2, 3, 2, 4), 1, 2)])
def test_rows_place_every_rank_where_cat_puts_it(shape, dim, world):
    """`Rows.split` against ``torch.cat(dim)``: every local row of every rank lands where cat puts it, once."""
    shards = [torch.arange(r * 1000, r * 1000 + torch.Size(shape[:-1]).numel()).reshape(shape[:-1]) for r in
              range(world)]
    want = torch.cat(shards, dim=dim).reshape(-1)
    ro = of(shape, dim, world, scatter=False)
    got = torch.full_like(want, -1)
    for r, shard in enumerate(shards):
        flat = shard.reshape(-1)
        for lo, hi, f_lo, f_hi in ro.split(r, 0, ro.m):
            assert (got[f_lo:f_hi] == -1).all()
            got[f_lo:f_hi] = flat[lo:hi]
        # any sub-run splits the same way
        pieces = ro.split(r, 1, ro.m - 1)
        assert sum(hi - lo for lo, hi, _, _ in pieces) == ro.m - 2
    assert torch.equal(got, want)
    assert Rows.flat(world, 5).split(2, 1, 4) == [(1, 4, 11, 14)]
