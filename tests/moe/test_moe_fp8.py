"""The MoE dispatch in fp8 (`overlap.ops.moe.fp8`): tokens quantized once on their owner, their scales in the same
rows, the first grouped GEMM on fp8 tokens and fp8 expert weights.

Every strategy (``reference``, ``pipelined``, ``symm``, ``fused``; ``hierarchical`` and migration on emulated
nodes; a bounded dispatch) at each granularity, forward and backward, against two float64 oracles built on every rank
from the same seed: the dequantized oracle (every rank's tokens and ``w1`` quantized as the op quantizes them, then
the dense layer in float64: the op must match it up to float32 accumulation and the output's rounding), and the
unquantized one, within fp8's own bound (each product of an e4m3 token and an e4m3 weight is off by at most
``2u + u^2`` of its size, ``u = 2^-4``). World sizes 1-4, top-k 1-8, uneven and empty token counts, empty experts,
skewed routing. Bad recipes raise on every rank before any communication. The packed rows' bytes are exact.

With fp8 gradients (``+grads``) both backward GEMMs of the first grouped GEMM run in fp8: each rank's output gradient
``grad_h`` is taken from the layer as it ran and every rank's gathered, and the input and weight gradients are
checked against float64 products of its quantized operands (quantized by `overlap.ops.fp8`'s quantizers, tested on
their own), and those products against the unquantized ones within fp8's bound.
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


#: fp8 gradients: experts with 32 and 64 rows, so that mxfp8's weight gradient runs in fp8 too (else float32)
_FULL_BLOCKS = ((32,), 64, 32, 2, 1, "one")


def cases_for(world_size: int, granularity: str) -> list[Case]:
    """The cases of a recipe: `granularity`, ``+grads`` for fp8 gradients (then with expert widths that are
    multiples of 32, which mxfp8 needs, and `_FULL_BLOCKS`)."""
    base, grads = granularity.removesuffix("+grads"), granularity.endswith("+grads")
    specs = list(_SPECS) + ([_BLOCK_SPEC] if base == "block128" else []) + ([_FULL_BLOCKS] if grads else [])
    if world_size == 1:
        specs.append(_TOP8)
    if grads:
        specs = [(t, h, -(-f // 32) * 32, e, k, routing) for t, h, f, e, k, routing in specs]
    return [Case(t, h, f, e * world_size, k, routing) for t, h, f, e, k, routing in specs]


def _quantized(xs, w1, granularity: str):
    """Every rank's tokens and every expert's ``w1`` as the op quantizes them, float64."""
    from overlap.ops.moe import fp8 as moe_fp8

    fmt = moe_fp8.RowFormat(granularity, w1.shape[1])
    xq = [moe_fp8.dequantize_rows(moe_fp8.pack(x, fmt), fmt, torch.float64) for x in xs]
    wq = moe_fp8.Fp8Experts.quantize(w1, fmt)
    w1q = torch.stack([wq.dense(e) for e in range(w1.shape[0])]).to(torch.float64)
    return xq, w1q


def _mirror(x: torch.Tensor, y: torch.Tensor, granularity: str) -> torch.Tensor:
    """``x [m, r] @ y [r, n]`` in float64 as a backward GEMM with fp8 gradients takes it: both operands quantized
    along ``r`` by `overlap.ops.fp8`'s quantizers (tested on their own), then multiplied exactly."""
    from overlap.ops.fp8 import dequantize, quantize_fp8
    from overlap.ops.moe import fp8 as moe_fp8

    x, y = x.float(), y.float()
    if granularity == "mxfp8" and x.shape[1] % 32:  # (the dense recipe: float32 instead)
        return x.double() @ y.double()
    if granularity == "block128":
        fmt = moe_fp8.RowFormat("block128", x.shape[1])
        xv = moe_fp8.dequantize_rows(moe_fp8.pack(x, fmt), fmt, torch.float64)
        yv = moe_fp8.dequantize_rows(moe_fp8.pack(y.t().contiguous(), fmt), fmt, torch.float64).t()
        return xv @ yv
    xv = dequantize(*quantize_fp8(x, granularity), -1).double()
    yv = dequantize(*quantize_fp8(y.t().contiguous(), granularity), -1).double().t()
    return xv @ yv


def _fp8_bound(what: str, got: torch.Tensor, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, ctx: str) -> None:
    """`got` within fp8's bound of the exact ``x @ y``: each product of two e4m3 values is off by at most
    ``2u + u^2`` of its size (and a float32 GEMM's, or the result's dtype's, rounding on top)."""
    x, y = x.double(), y.double()
    exact = x @ y
    allowed = (2 * _U + _U * _U) * (x.abs() @ y.abs()) + torch.finfo(dtype).eps * exact.abs() + 1e-6
    err = (got.detach().double() - exact).abs()
    assert bool((err <= allowed).all()), f"{ctx}: {what} beyond fp8's bound by {float((err - allowed).max())}"


def _near(what: str, got: torch.Tensor, want: torch.Tensor, ctx: str) -> None:
    """`got` within fp8's error of the high-precision gradient `want` as a whole: a relative Frobenius error of at
    most ``2 (2u + u^2)`` (a dropped, doubled or misrouted term is off by about its own size)."""
    err = float((got.detach().double() - want).norm())
    assert err <= 2 * (2 * _U + _U * _U) * float(want.norm()) + 1e-6, f"{ctx}: {what} off by {err} (norm)"


def _fp8_grads_oracle(granularity: str, rows_q, ids, gh_all, idxs, w1, rank: int, L: int, tokens: int, ctx: str,
                      dtype: torch.dtype):
    """``(grad x, grad w1 of this rank's experts)`` with fp8 gradients, from the output gradients ``grad_h`` the
    layer gave every rank's experts (`gh_all`, rows in expert order): ``grad_x[t] = sum_k Q(grad_h[t, k]) @
    Q(w1[e].T)`` (straight through the tokens' quantization; ``grad_h`` along ``N`` at the granularity, ``w1``
    to match, as the dispatch packs tokens), ``grad_w1[e] = rows_e.T @ grad_h_e`` both quantized along the tokens.
    Each also checked against the unquantized product within fp8's bound."""
    from overlap.ops.moe import fp8 as moe_fp8

    W, N, H = len(idxs), w1.shape[2], w1.shape[1]
    fmt = moe_fp8.RowFormat(granularity, N)
    wq = moe_fp8.Fp8Experts.quantize(w1.transpose(1, 2), fmt)  # [E, N, H] along N
    gx = torch.zeros(tokens, H, dtype=torch.float64)
    g_mine = []  # the unquantized terms of this rank's tokens, for the bound
    for q in range(W):
        g = gh_all[q]
        gq = moe_fp8.dequantize_rows(moe_fp8.pack(g, fmt), fmt, torch.float64)
        i = 0
        for e in range(q * L, (q + 1) * L):
            for s in range(W):
                for t, _k in (idxs[s] == e).nonzero().tolist():
                    if s == rank:
                        gx[t] += gq[i] @ wq.dense(e).double()
                        g_mine.append((t, g[i], e))
                    i += 1
    exact = torch.zeros(tokens, H, dtype=torch.float64)
    allowed = torch.zeros(tokens, H, dtype=torch.float64)
    for t, g, e in g_mine:
        exact[t] += g.double() @ w1[e].double().t()
        allowed[t] += (2 * _U + _U * _U) * (g.double().abs() @ w1[e].double().abs().t())
    err = (gx - exact).abs()
    assert bool((err <= allowed + 1e-6).all()), f"{ctx}: the grad x oracle beyond fp8's bound"
    mine = gh_all[rank]
    gw1 = torch.zeros(L, H, N, dtype=torch.float64)
    for j, e in enumerate(range(rank * L, (rank + 1) * L)):
        sel = [i for i, d in enumerate(ids) if d == e]
        if sel:
            x_e, g_e = rows_q[sel[0] : sel[-1] + 1], mine[sel[0] : sel[-1] + 1]
            gw1[j] = _mirror(x_e.t(), g_e, granularity)
            _fp8_bound(f"grad w1[{e}]", gw1[j], x_e.t(), g_e, dtype, ctx)
    return gx, gw1


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
    import torch.distributed as dist

    import overlap

    done = []
    recipe, granularity = granularity, granularity.removesuffix("+grads")  # (+grads: fp8 gradients)
    for i, case in enumerate(cases):
        xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed + i, world_size, dtype)
        E, L = case.experts, case.experts // world_size
        ctx = f"rank {rank}/{world_size} {strategy} fp8={recipe} {dtype} case={case}"
        how = {"plan": strategy} if isinstance(strategy, overlap.Plan) else {"strategy": strategy}
        bound = None if bound_slack is None else max(case.tokens) + bound_slack
        xq, w1q = _quantized(xs, w1, granularity)
        mine = slice(rank * L, (rank + 1) * L)

        x = xs[rank].clone().requires_grad_(True)
        w1_r, w2_r = w1[mine].clone().requires_grad_(True), w2[mine].clone().requires_grad_(True)
        wt = weights[rank].clone().requires_grad_(True)
        h_all, handle = overlap.moe.dispatch_grouped_matmul(x, idxs[rank], w1_r, E, group=group, fp8=recipe,
                                                            max_tokens_per_rank=bound, **how)
        grad_h = []
        h_all.register_hook(grad_h.append)  # the output gradient the dispatch's backward gets
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
        if recipe != granularity and migrates:  # (hosted experts' rows: the layer's gradients near high precision's)
            _near("grad x (fp8 gradients)", x.grad, gx, ctx)
            _near("grad w1 (fp8 gradients)", w1_r.grad, gw1[mine], ctx)
        else:
            if recipe != granularity:  # fp8 gradients: from every rank's grad_h, both backward GEMMs in fp8
                gh_all = [None] * world_size
                dist.all_gather_object(gh_all, grad_h[0][:n].detach(), group=group)
                gx, gw1[mine] = _fp8_grads_oracle(granularity, rows_q, ids, gh_all, idxs, w1, rank, L, x.shape[0],
                                                  ctx, dtype)
            close("grad x (straight through)", x.grad, gx, dtype, ctx)
            close("grad w1", w1_r.grad, gw1[mine], dtype, ctx)
        close("grad w2", w2_r.grad, gw2[mine], dtype, ctx)
        close("grad topk_weights", wt.grad, gwt, dtype, ctx)

        if migrates:
            done.append(f"{case.tokens}:{case.routing}")
            continue
        # plain dispatch: the values of the fp8 rows, in x's dtype; its backward straight through
        x2 = xs[rank].clone().requires_grad_(True)
        x_recv, handle2 = overlap.moe.dispatch(x2, idxs[rank], E, group=group, fp8=recipe, **_plain(how))
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


@pytest.mark.parametrize("granularity", ["rowwise", "block128", "mxfp8"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm", "fused"])
def test_fp8_gradients_match_float64(pools, seed, strategy, granularity):
    """``+grads``: both backward GEMMs in fp8, on 1 to 3 ranks (the world size cycles with the parameters)."""
    world_size = 1 + (["reference", "pipelined", "symm", "fused"].index(strategy) + len(granularity)) % 3
    cases = cases_for(world_size, granularity + "+grads")
    done = pools(world_size).run(check_fp8, strategy, granularity + "+grads", torch.float32, seed, cases,
                                 timeout=240)
    assert all(len(d) == len(cases) for d in done), done


@pytest.mark.parametrize("granularity", ["rowwise", "mxfp8", "block128+grads"])
def test_fp8_dispatch_bf16_matches_float64(pools, seed, granularity):
    cases = cases_for(2, granularity)
    done = pools(2).run(check_fp8, "symm", granularity, torch.bfloat16, seed, cases, timeout=240)
    assert all(len(d) == len(cases) for d in done), done


def hierarchical_task(rank: int, world_size: int, granularity: str, seed: int, migrate: bool) -> list[str]:
    import overlap

    with nodes.spanning(rank, 2, "f8node") as group:
        E = 2 * world_size
        plan = overlap.Plan("hierarchical", migrate=((0, 1),)) if migrate else "hierarchical"
        narrow = 32 if granularity.endswith("+grads") else 16  # (mxfp8's fp8 gradients: a multiple of 32)
        cases = [Case((5, 3, 0, 7), 64, 32, E, 2, "random"), Case((6, 2), 64, narrow, E, 2, "skewed")]
        return check_fp8(rank, world_size, plan, granularity, torch.float32, seed, cases, group=group)


@pytest.mark.parametrize("migrate", [False, True], ids=["hierarchical", "migration"])
@pytest.mark.parametrize("granularity", ["rowwise", "block128", "mxfp8+grads"])
def test_fp8_dispatch_across_nodes(pools, seed, granularity, migrate):
    done = pools(4).run(hierarchical_task, granularity, seed, migrate, timeout=240)
    assert all(len(d) == 2 for d in done), done


@pytest.mark.parametrize("strategy", ["pipelined", "symm"])
def test_fp8_dispatch_bounded(pools, seed, strategy):
    """``max_tokens_per_rank``: static shapes, the padding rows zero, the same numbers (symm: fp8 gradients)."""
    recipe = "mxfp8+grads" if strategy == "symm" else "mxfp8"
    cases = cases_for(3, recipe)[:2]
    done = pools(3).run(check_fp8, strategy, recipe, torch.float32, seed, cases, None, 2, timeout=240)
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
    xq, w1q = _quantized(xs, w1, granularity.removesuffix("+grads"))
    want_y, _gx, gw1, gw2, _gwt = _oracle(xq, idxs, weights, grads, w1, w1q, w2, rank)
    L = E // world_size
    mine = slice(rank * L, (rank + 1) * L)
    ctx = f"rank {rank} ExpertParallelMLP fp8={granularity}"
    close("y", y, want_y, torch.float32, ctx)
    if granularity.endswith("+grads"):  # (the ops' tests check fp8 gradients exactly; here: passed through)
        _near("grad w1 (fp8 gradients)", mlp.w1.grad, gw1[mine], ctx)
    else:
        close("grad w1", mlp.w1.grad, gw1[mine], torch.float32, ctx)
    close("grad w2", mlp.w2.grad, gw2[mine], torch.float32, ctx)
    return granularity


@pytest.mark.parametrize("granularity", ["rowwise", "block128", "mxfp8", "rowwise+grads"])
def test_expert_parallel_mlp_fp8(pools, seed, granularity):
    assert pools(2).run(module_task, granularity, seed, timeout=120) == [granularity] * 2


def bad_recipe_task(rank: int, world_size: int) -> dict:
    """Bad ``fp8=`` on one rank (or every rank) raises on every rank before any row moves; the group still works."""
    import overlap

    x = torch.randn(4, 64)
    idx = torch.randint(0, 2 * world_size, (4, 2))
    w1 = torch.randn(2, 64, 16)
    out = {}
    for name, fp8, where in (("tensorwise", "tensorwise", None), ("mxfp8 grads width", "mxfp8+grads", None),
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
        assert res["mxfp8 grads width"][0] == "ValueError" and "16" in res["mxfp8 grads width"][1], res
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
