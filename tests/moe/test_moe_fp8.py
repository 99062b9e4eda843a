"""The MoE dispatch in fp8 (`overlap.ops.moe.fp8`): tokens quantized once on their owner, their scales in the same
rows, the first grouped GEMM on fp8 tokens and fp8 expert weights.

Every strategy (``reference``, ``pipelined``, ``symm``, ``fused``; ``hierarchical`` and migration on emulated
nodes; a bounded dispatch) at each granularity, forward and backward, against two float64 oracles built on every rank
from the same seed: the dequantized oracle (every rank's tokens and ``w1`` quantized as the op quantizes them, then
the dense layer in float64: the op must match it up to float32 accumulation and the output's rounding), and the
unquantized one, within fp8's own bound (each product of an e4m3 token and an e4m3 weight is off by at most
``2u + u^2`` of its size, ``u = 2^-4``). World sizes 1-4, top-k 1-8, uneven and empty token counts, empty experts,
skewed routing. Bad recipes raise on every rank before any communication. The packed rows' bytes are exact.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import nodes
from tests.support.moe_oracle import Case, close, expected_rows, make_inputs

# (tokens per rank, cycled), hidden, ffn, experts per rank, top_k, routing
_SPECS = [
    ((5, 3, 0, 7), 64, 48, 2, 2, "random"),
    ((6, 2, 9), 64, 32, 4, 4, "skewed"),
    ((4, 3), 64, 32, 4, 2, "empty"),
    ((3, 5), 64, 16, 2, 2, "one"),
    ((7, 0, 4), 64, 32, 2, 1, "skewed"),  # top-1
]
#: block128 also on a hidden size with a partial last block that is no multiple of 16
_BLOCK_SPEC = ((4, 6, 1), 200, 24, 2, 2, "random")
_TOP8 = ((9, 4), 32, 16, 8, 8, "random")  # top-k 8 of 8 local experts a rank (world size 1: 8 experts)

#: e4m3's unit roundoff
_U = 2.0**-4


def cases_for(world_size: int, granularity: str) -> list[Case]:
    specs = list(_SPECS) + ([_BLOCK_SPEC] if granularity == "block128" else [])
    if world_size == 1:
        specs.append(_TOP8)
    return [Case(t, h, f, e * world_size, k, routing) for t, h, f, e, k, routing in specs]


def _quantized(xs, w1, granularity: str):
    """Every rank's tokens and every expert's ``w1`` as the op quantizes them, float64."""
    from overlap.ops.moe import fp8 as moe_fp8

    fmt = moe_fp8.RowFormat(granularity, w1.shape[1])
    xq = [moe_fp8.dequantize_rows(moe_fp8.pack(x, fmt), fmt, torch.float64) for x in xs]
    wq = moe_fp8.Fp8Experts.quantize(w1, fmt)
    w1q = torch.stack([wq.dense(e) for e in range(w1.shape[0])]).to(torch.float64)
    return xq, w1q


def _oracle(xq, idxs, weights, grads, w1, w1q, w2, rank: int):
    """The float64 layer ``sum_k w * gelu(xq @ w1q[e]) @ w2[e]`` over every rank's dequantized tokens `xq`, and its
    gradients as the op's recipe takes them: ``(y of this rank, grad x, grad w1 [E], grad w2 [E], grad weights)``.
    The backward is the dense recipe's with high-precision gradients: the tokens' gradient through the
    quantization as through the identity, times the unquantized `w1`; ``w1``'s gradient from the dequantized
    tokens (what reached the expert's rank)."""
    x64 = [t.detach().to(torch.float64).requires_grad_(True) for t in xq]
    wt64 = [t.detach().to(torch.float64).requires_grad_(True) for t in weights]
    w1_64 = w1.detach().to(torch.float64).requires_grad_(True)
    w2_64 = w2.detach().to(torch.float64).requires_grad_(True)
    shift = w1q.to(torch.float64) - w1_64.detach()  # forward with w1q, d/dx with w1, d/dw1 with xq
    loss, ys = 0, []
    for x, idx, wt, g in zip(x64, idxs, wt64, grads, strict=True):
        y = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
        for k in range(idx.shape[1]):
            e = idx[:, k]
            h = (torch.bmm(x.unsqueeze(1), w1_64[e]) + torch.bmm(x.detach().unsqueeze(1), shift[e])).squeeze(1)
            y = y + wt[:, k : k + 1] * torch.bmm(torch.nn.functional.gelu(h).unsqueeze(1), w2_64[e]).squeeze(1)
        ys.append(y)
        loss = loss + (y * g.to(torch.float64)).sum()
    loss.backward()
    return ys[rank].detach(), x64[rank].grad, w1_64.grad, w2_64.grad, wt64[rank].grad


def check_fp8(rank: int, world_size: int, strategy, granularity: str, dtype: torch.dtype, seed: int,
              cases: list[Case], group=None, bound_slack: int | None = None) -> list[str]:
    """Each case through ``dispatch_grouped_matmul(fp8=...)``, gelu, ``grouped_matmul_combine`` and back, and through
    plain ``dispatch(fp8=...)``, against the oracles (module docstring). Returns what was checked. A plan that
    migrates experts: the layer's output and gradients (``h`` then holds the hosted experts' rows; no plain form)."""
    import overlap

    done = []
    for i, case in enumerate(cases):
        xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed + i, world_size, dtype)
        E, L = case.experts, case.experts // world_size
        ctx = f"rank {rank}/{world_size} {strategy} fp8={granularity} {dtype} case={case}"
        how = {"plan": strategy} if isinstance(strategy, overlap.Plan) else {"strategy": strategy}
        bound = None if bound_slack is None else max(case.tokens) + bound_slack
        xq, w1q = _quantized(xs, w1, granularity)
        mine = slice(rank * L, (rank + 1) * L)

        x = xs[rank].clone().requires_grad_(True)
        w1_r, w2_r = w1[mine].clone().requires_grad_(True), w2[mine].clone().requires_grad_(True)
        wt = weights[rank].clone().requires_grad_(True)
        h_all, handle = overlap.moe.dispatch_grouped_matmul(x, idxs[rank], w1_r, E, group=group, fp8=granularity,
                                                            max_tokens_per_rank=bound, **how)
        assert h_all.dtype == dtype, ctx
        n = sum(handle.tokens_per_expert) if bound is None else int(handle.num_recv)
        assert not h_all[n:].any(), f"{ctx}: padding rows not zero"
        h = h_all[:n]
        migrates = isinstance(strategy, overlap.Plan) and bool(strategy.migrate)
        # forward against the dequantized oracle: the op's rows, their expert, one float32 GEMM
        rows_q, ids = expected_rows(xq, idxs, rank, L)
        if migrates:
            ids = []
        want_h = (torch.bmm(rows_q.unsqueeze(1), w1q[ids]).squeeze(1) if ids
                  else torch.empty(0, w1.shape[2], dtype=torch.float64))
        if not migrates:
            close("h (dequantized oracle)", h, want_h, dtype, ctx)
        # ... and the unquantized one within fp8's bound
        rows, _ = expected_rows([t.to(torch.float64) for t in xs], idxs, rank, L)
        if ids:
            exact = torch.bmm(rows.unsqueeze(1), w1[ids].to(torch.float64)).squeeze(1)
            allowed = (2 * _U + _U * _U) * torch.bmm(rows.abs().unsqueeze(1),
                                                     w1[ids].to(torch.float64).abs()).squeeze(1)
            slack = torch.finfo(dtype).eps * exact.abs() + 1e-6
            err = (h.detach().to(torch.float64) - exact).abs()
            assert bool((err <= allowed + slack).all()), f"{ctx}: beyond fp8's bound by {float((err - allowed).max())}"
        y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h_all), w2_r, wt, handle, **how)
        y.backward(grads[rank])
        want_y, gx, gw1, gw2, gwt = _oracle(xq, idxs, weights, grads, w1, w1q, w2, rank)
        close("y", y, want_y, dtype, ctx)
        close("grad x (straight through)", x.grad, gx, dtype, ctx)
        close("grad w1", w1_r.grad, gw1[mine], dtype, ctx)
        close("grad w2", w2_r.grad, gw2[mine], dtype, ctx)
        close("grad topk_weights", wt.grad, gwt, dtype, ctx)

        if migrates:
            done.append(f"{case.tokens}:{case.routing}")
            continue
        # plain dispatch: the values of the fp8 rows, in x's dtype; its backward straight through
        x2 = xs[rank].clone().requires_grad_(True)
        x_recv, handle2 = overlap.moe.dispatch(x2, idxs[rank], E, group=group, fp8=granularity, **_plain(how))
        assert x_recv.dtype == dtype, ctx
        close("x_recv", x_recv, rows_q, dtype, ctx)
        back = overlap.moe.combine(x_recv * 2, weights[rank], handle2, **_plain(how))
        back.backward(grads[rank])
        close("plain grad x", x2.grad, 2 * grads[rank].to(torch.float64), dtype, ctx)
        done.append(f"{case.tokens}:{case.routing}")
    return done


def _plain(how: dict) -> dict:
    """Plain dispatch/combine have no fused form: ``fused`` runs as ``symm`` there."""
    return {"strategy": "symm"} if how.get("strategy") == "fused" else how


@pytest.mark.parametrize("granularity", ["rowwise", "block128", "mxfp8"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp8_dispatch_matches_float64(pools, seed, world_size, strategy, granularity):
    cases = cases_for(world_size, granularity)
    done = pools(world_size).run(check_fp8, strategy, granularity, torch.float32, seed, cases, timeout=240)
    assert all(len(d) == len(cases) for d in done), done


@pytest.mark.parametrize("granularity", ["rowwise", "mxfp8"])
def test_fp8_dispatch_bf16_matches_float64(pools, seed, granularity):
    cases = cases_for(2, granularity)
    done = pools(2).run(check_fp8, "symm", granularity, torch.bfloat16, seed, cases, timeout=240)
    assert all(len(d) == len(cases) for d in done), done


def hierarchical_task(rank: int, world_size: int, granularity: str, seed: int, migrate: bool) -> list[str]:
    import overlap

    with nodes.spanning(rank, 2, "f8node") as group:
        E = 2 * world_size
        plan = overlap.Plan("hierarchical", migrate=((0, 1),)) if migrate else "hierarchical"
        cases = [Case((5, 3, 0, 7), 64, 32, E, 2, "random"), Case((6, 2), 64, 16, E, 2, "skewed")]
        return check_fp8(rank, world_size, plan, granularity, torch.float32, seed, cases, group=group)


@pytest.mark.parametrize("migrate", [False, True], ids=["hierarchical", "migration"])
@pytest.mark.parametrize("granularity", ["rowwise", "block128"])
def test_fp8_dispatch_across_nodes(pools, seed, granularity, migrate):
    done = pools(4).run(hierarchical_task, granularity, seed, migrate, timeout=240)
    assert all(len(d) == 2 for d in done), done


@pytest.mark.parametrize("strategy", ["pipelined", "symm"])
def test_fp8_dispatch_bounded(pools, seed, strategy):
    """``max_tokens_per_rank``: static shapes, the padding rows zero, the same numbers."""
    cases = cases_for(3, "rowwise")[:2]
    done = pools(3).run(check_fp8, strategy, "mxfp8", torch.float32, seed, cases, None, 2, timeout=240)
    assert all(len(d) == len(cases) for d in done), done


def module_task(rank: int, world_size: int, granularity: str, seed: int) -> str:
    """`overlap.nn.ExpertParallelMLP(fp8=...)`: its output and expert gradients against the oracle, built from the
    module's own routing and every rank's experts."""
    import torch.distributed as dist

    import overlap

    torch.manual_seed(seed)  # the replicated router: equal on every rank
    H, F, E, K = 64, 32, 2 * world_size, 2
    mlp = overlap.nn.ExpertParallelMLP(H, F, E, K, fp8=granularity)
    assert f"fp8={granularity!r}" in repr(mlp)
    gen = torch.Generator().manual_seed(seed + 1)
    counts = (5, 3, 0, 7)
    xs = [torch.randn(counts[s % 4], H, generator=gen) for s in range(world_size)]
    grads = [torch.randn(counts[s % 4], H, generator=gen) for s in range(world_size)]
    x = xs[rank].clone().requires_grad_(True)
    mlp(x).backward(grads[rank])
    y = mlp(xs[rank]).detach()
    full = []
    for w in (mlp.w1, mlp.w2):
        parts = [torch.empty_like(w) for _ in range(world_size)]
        dist.all_gather(parts, w.detach().contiguous())
        full.append(torch.cat(parts))
    w1, w2 = full
    with torch.no_grad():
        routes = [mlp.route(t) for t in xs]
    idxs, weights = [r[0] for r in routes], [r[1] for r in routes]
    xq, w1q = _quantized(xs, w1, granularity)
    want_y, _gx, gw1, gw2, _gwt = _oracle(xq, idxs, weights, grads, w1, w1q, w2, rank)
    L = E // world_size
    mine = slice(rank * L, (rank + 1) * L)
    ctx = f"rank {rank} ExpertParallelMLP fp8={granularity}"
    close("y", y, want_y, torch.float32, ctx)
    close("grad w1", mlp.w1.grad, gw1[mine], torch.float32, ctx)
    close("grad w2", mlp.w2.grad, gw2[mine], torch.float32, ctx)
    return granularity


@pytest.mark.parametrize("granularity", ["rowwise", "block128", "mxfp8"])
def test_expert_parallel_mlp_fp8(pools, seed, granularity):
    assert pools(2).run(module_task, granularity, seed, timeout=120) == [granularity] * 2


def bad_recipe_task(rank: int, world_size: int) -> dict:
    """Bad ``fp8=`` on one rank (or every rank) raises on every rank before any row moves; the group still works."""
    import overlap

    x = torch.randn(4, 64)
    idx = torch.randint(0, 2 * world_size, (4, 2))
    w1 = torch.randn(2, 64, 16)
    out = {}
    for name, fp8, where in (("tensorwise", "tensorwise", None), ("grads", "rowwise+grads", None),
                             ("unknown", "e5m2", 1), ("type", 8, 0), ("mxfp8 hidden", "mxfp8", None),
                             ("fp8 tokens", "rowwise", 1)):
        xi = {"mxfp8 hidden": torch.randn(4, 48), "fp8 tokens": x.to(torch.float8_e4m3fn) if rank == 1 else x}.get(
            name, x)
        wi = torch.randn(2, 48, 16) if name == "mxfp8 hidden" else w1
        try:
            overlap.moe.dispatch_grouped_matmul(xi, idx, wi, 2 * world_size, strategy="symm",
                                                fp8=fp8 if where in (None, rank) else None)
            out[name] = None
        except (TypeError, ValueError, NotImplementedError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    h, _ = overlap.moe.dispatch_grouped_matmul(x, idx, w1, 2 * world_size, strategy="symm", fp8="rowwise")
    out["after"] = tuple(h.shape)
    return out


def test_bad_recipes_raise_on_every_rank(pools):
    for rank, res in enumerate(pools(2).run(bad_recipe_task, timeout=120)):
        assert res["tensorwise"][0] == "ValueError" and "per token or per block" in res["tensorwise"][1], res
        assert res["grads"][0] == "NotImplementedError", res
        assert res["mxfp8 hidden"][0] == "ValueError" and "48" in res["mxfp8 hidden"][1], res
        for name, culprit in (("unknown", 1), ("type", 0), ("fp8 tokens", 1)):
            kind, message = res[name]
            if rank == culprit:
                assert kind in ("ValueError", "TypeError") and ("fp8" in message or "float8" in message), (name, res)
            else:  # the peer is told at once
                assert f"rank {culprit}" in message, (name, res)
        assert res["after"][1] == 16, res


def plan_file_task(rank: int, world_size: int) -> dict:
    """``auto`` with a plan file: an fp8 call finds the entry of its recipe's dtype (its bytes differ from the
    leaves'), not the leaves' one; the combine after it the same entry."""
    import overlap
    from overlap import world
    from overlap.plans import Entry, PlanFile, Problem, default_profile, topology_of

    T, H, F, E, K = 6, 64, 16, 2 * world_size, 2
    pf = PlanFile.new(topology_of(world.group_info()), world_size, default_profile("cpu"))
    for dtype, strategy in (("float32", "reference"), ("float8_e4m3fn", "pipelined"), ("mxfp8", "symm")):
        pf.add(Entry(Problem("moe", T, H, F, dtype, True, E, K), overlap.Plan(strategy)))
    gen = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    out = {}
    for fp8 in (None, "rowwise", "mxfp8"):
        x = torch.randn(T, H, generator=gen).requires_grad_()
        w1 = torch.randn(E // world_size, H, F, generator=gen).requires_grad_()
        w2 = torch.randn(E // world_size, F, H, generator=gen).requires_grad_()
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, plan=pf, fp8=fp8)
        y = overlap.moe.grouped_matmul_combine(torch.nn.functional.gelu(h), w2, torch.rand(T, K), handle, plan=pf)
        y.sum().backward()
        out[fp8 or "none"] = handle.plan.strategy
    return out


def test_auto_keys_an_fp8_dispatch_by_its_recipe(pools):
    for res in pools(2).run(plan_file_task, timeout=120):
        assert res == {"none": "reference", "rowwise": "pipelined", "mxfp8": "symm"}, res
