"""A dense float64 oracle for the MoE ops, and rank tasks that check every strategy against it.

Every rank rebuilds every rank's inputs from one seed (tokens, routing, weights), so each can run the
dense computation of the whole group on its own: all experts in one process, float64, plain autograd.
The ops are checked forward (``x_recv``/``h`` rows, outputs) and backward (tokens, routing weights,
expert weights); in bf16 the oracle takes the same routing (there are no routers here: routing is an input).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from overlap.workloads import moe as moe_workload

ROUTINGS = ("balanced", "random", "skewed", "empty", "one")


@dataclasses.dataclass
class Case:
    tokens: tuple[int, ...]  # tokens per rank
    hidden: int
    ffn: int
    experts: int
    top_k: int
    routing: str


def routing_for(kind: str, T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, K]`` expert ids: distinct per token except for "one" (every pair on one expert)."""
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    if kind == "balanced":
        base = torch.arange(T).unsqueeze(1) * K + torch.arange(K).unsqueeze(0)
        return base % E if K <= E else base % E
    if kind == "one":
        e = int(torch.randint(0, E, (1,), generator=gen))
        return torch.full((T, K), e, dtype=torch.int64)
    logits = torch.randn(T, E, generator=gen)
    if kind == "skewed":  # most tokens pick the first experts
        logits += torch.linspace(6.0, 0.0, E)
    if kind == "empty":  # half of the experts (every other one) never chosen
        logits[:, 1::2] = -1e9 if E >= 2 * K else logits[:, 1::2]
    return torch.topk(logits, K, dim=1).indices


def make_inputs(case: Case, seed: int, world_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    E, K, H, F = case.experts, case.top_k, case.hidden, case.ffn
    xs, idxs, weights, grads = [], [], [], []
    for r in range(world_size):
        T = case.tokens[r % len(case.tokens)]
        xs.append(torch.randn(T, H, generator=gen).to(dtype))
        idxs.append(routing_for(case.routing, T, E, K, gen))
        w = torch.rand(T, K, generator=gen) + 0.1
        weights.append(w / w.sum(1, keepdim=True))
        grads.append(torch.randn(T, H, generator=gen).to(dtype))
    w1 = (torch.randn(E, H, F, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, F, H, generator=gen) / F**0.5).to(dtype)
    return xs, idxs, weights, grads, w1, w2


def expert_fn(rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """A row-wise stand-in for an expert (plain dispatch/combine): depends on the expert id."""
    return rows * (1.0 + 0.25 * expert.to(rows.dtype)).unsqueeze(1) + 0.125 * expert.to(rows.dtype).unsqueeze(1)


def dense(xs, idxs, weights, w1, w2, act):
    """Float64 oracle of ``sum_k w[t,k] * act(x[t] @ w1[e]) @ w2[e]`` for every rank's tokens: the workload's dense
    model (`overlap.workloads.moe.dense`), rank by rank (autograd-able)."""
    return [moe_workload.dense(x, idx, wt, w1, w2, act=act)[0] for x, idx, wt in zip(xs, idxs, weights, strict=True)]


def pointwise_terms(act):
    """The rounding scale of ``act(h)`` for an elementwise activation of slope <= 1.13 (gelu, relu, silu):
    its own rounding plus that carried in from ``h``."""
    return lambda h: act(h).abs() + 1.13 * h.abs()


def expert_terms(x: torch.Tensor, e: torch.Tensor, w1, w2, act_terms) -> torch.Tensor:
    """Rounding scale of each element of ``act(x @ w1[e]) @ w2[e]``: the root-sum-square of its terms,
    ``act_terms(h)`` giving the rounding scale of each activation (see `pointwise_terms`)."""
    h = torch.bmm(x.unsqueeze(1), w1[e].to(torch.float64)).squeeze(1)
    a = act_terms(h)
    return torch.bmm((a * a).unsqueeze(1), w2[e].to(torch.float64).square()).squeeze(1).sqrt()


def expected_rows(xs, idxs, rank: int, L: int) -> tuple[torch.Tensor, list[int]]:
    """Rows of this rank's experts in expert order (expert, source, token, k) and their global expert ids."""
    rows, ids = [], []
    for e in range(rank * L, (rank + 1) * L):
        for x, idx in zip(xs, idxs, strict=True):
            for t, _k in (idx == e).nonzero().tolist():
                rows.append(x[t])
                ids.append(e)
    H = xs[0].shape[1]
    return (torch.stack(rows) if rows else torch.empty(0, H, dtype=xs[0].dtype)), ids


def tolerances(dtype: torch.dtype) -> dict:
    # fp32: two chained GEMMs with inner dims <= 64 against float64; bf16: docs/design.md's 16-bit bound,
    # scaled by the size of the values (|y| ~ 1 here).
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}


def close(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ctx: str,
          spread: torch.Tensor | None = None) -> None:
    """`got` against the float64 `want` within `tolerances`, scaled by the size of the values.

    With `spread` (per element, the root-sum-square of the terms it adds up, see `weight_grad_spread`) the
    bound widens by ``6 u spread`` (u: the dtype's unit roundoff). Rounding errors of a long dot product add
    up like a random walk, so a routing weight's gradient whose terms cancel legitimately lands a few
    ``u spread`` off (at most 3.4 in 10^4 sampled bf16 rows) however small it is; a missing, doubled or
    misrouted term is still off by about its own size."""
    tol = tolerances(dtype)
    got64, want64 = got.detach().to(torch.float64), want.detach().to(torch.float64)
    if got64.shape != want64.shape:
        raise AssertionError(f"{ctx}: {what} shape {tuple(got.shape)} != {tuple(want.shape)}")
    scale = max(1.0, float(want64.abs().max())) if want64.numel() else 1.0
    bound = tol["atol"] * scale + tol["rtol"] * want64.abs()
    if spread is not None:
        bound = bound + 6 * (torch.finfo(dtype).eps / 2) * spread
    err = (got64 - want64).abs()
    if err.numel() and not bool((err <= bound).all()):
        i = int((err / bound).flatten().argmax())
        at = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), err.shape))
        raise AssertionError(
            f"{ctx}: {what} differs (max error {float(err.max()):.3g}; worst at {at}: got "
            f"{float(got64.flatten()[i]):.6g}, want {float(want64.flatten()[i]):.6g}, allowed "
            f"{float(bound.flatten()[i]):.3g}; {int((err > bound).sum())}/{err.numel()} elements out)")


def weight_grad_spread(x: torch.Tensor, idx: torch.Tensor, grad: torch.Tensor, terms_of) -> torch.Tensor:
    """``[T, K]`` (float64): for the gradient of routing weight (t, k), the dot product of ``grad[t]`` with
    expert e's output row, ``sqrt(sum_h (grad[t, h] * m[t, h])^2)``, where ``terms_of(x, e)`` gives m, the
    rounding scale of each element of that row."""
    T, K = idx.shape
    out = torch.zeros(T, K, dtype=torch.float64)
    g = grad.to(torch.float64)
    for k in range(K):
        out[:, k] = (g * terms_of(x.to(torch.float64), idx[:, k])).norm(dim=1)
    return out


def router_grad_spread(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, weight_spread: torch.Tensor,
                       experts: int) -> torch.Tensor:
    """``[E, H]`` (float64): the rounding spread of the gradient of a router ``logits = x @ router.T`` whose
    routing weights are the softmax renormalized over each token's chosen experts, given the spread of the
    routing weights' gradients (`weight_grad_spread`). Over the chosen experts ``w = softmax(logits)``, so
    ``d w_k / d logit_j = w_k (delta_kj - w_j)``: a token's logit gradient carries ``sum_k |w_k (delta_kj -
    w_j)| spread_k``, and the router gradient sums those over tokens times ``x`` (a random walk again)."""
    w = weights.detach().to(torch.float64)
    T, K = idx.shape
    jac = (w.unsqueeze(2) * (torch.eye(K, dtype=torch.float64) - w.unsqueeze(1))).abs()  # [T, k, j]
    per_chosen = (jac * weight_spread.unsqueeze(2)).sum(1)  # [T, j]
    logit = torch.zeros(T, experts, dtype=torch.float64).scatter_add_(1, idx, per_chosen)
    return (logit.square().t() @ x.detach().to(torch.float64).square()).sqrt()


def check_moe(rank: int, world_size: int, strategy, dtype: torch.dtype, seed: int, cases: list[Case],
              forms: tuple[str, ...] = ("plain", "grouped"), act: str = "gelu", slack: int | None = None,
              group=None) -> list[str]:
    """Every case through the plain ops (dispatch, expert_fn, combine) and the grouped-GEMM ops, forward
    and backward, against the dense oracle. Returns what was checked.

    `slack`: None, or the ops run with ``max_tokens_per_rank`` = the case's largest token count + `slack`;
    the padding rows are then checked zero, given nonzero values before the combine (the plain expert
    function adds a bias; the grouped form adds a tensor that is nonzero on them only), which must change
    no result, and checked to get a zero gradient (`moe_bound_checks`). `group`: the dispatches' group (None:
    the default group)."""
    import overlap

    from .moe_bound_checks import Bounded

    done = []
    activation = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}[act]
    for i, case in enumerate(cases):
        xs, idxs, weights, grads, w1, w2 = make_inputs(case, seed + i, world_size, dtype)
        E, K = case.experts, case.top_k
        L = E // world_size
        ctx = f"rank {rank}/{world_size} strategy={strategy} dtype={dtype} case={case}"
        x = xs[rank].clone().requires_grad_(True)
        wt = weights[rank].clone().requires_grad_(True)
        want_rows, ids = expected_rows(xs, idxs, rank, L)
        # Oracle in float64: the loss is sum over ranks of <out_r, g_r>.
        x64 = [t.to(torch.float64).requires_grad_(True) for t in xs]
        wt64 = [t.to(torch.float64).requires_grad_(True) for t in weights]
        w1_64 = w1.to(torch.float64).requires_grad_(True)
        w2_64 = w2.to(torch.float64).requires_grad_(True)
        bounded = Bounded(case, slack, world_size, rank, ids, ctx)
        if "plain" in forms:
            x_recv, handle = overlap.moe.dispatch(x, idxs[rank], E, group=group, **_how(_plain(strategy)),
                                                 **bounded.kwargs)
            close("x_recv", bounded.rows(x_recv, handle), want_rows, dtype, ctx)
            assert bounded.host(handle).tokens_per_expert == [ids.count(e) for e in range(rank * L, (rank + 1) * L)]
            local_ids = bounded.expert_ids()
            y = overlap.moe.combine(expert_fn(x_recv, local_ids), wt, handle, **_how(_plain(strategy)))
            # oracle: sum_k w * expert_fn(x, e)
            outs = []
            for xr, idx, w in zip(x64, idxs, wt64, strict=True):
                outs.append(sum(w[:, k : k + 1] * expert_fn(xr, idx[:, k]) for k in range(K)) if K else xr)
            close("combine output", y, outs[rank], dtype, ctx)
            y.backward(grads[rank])
            sum((o * g.to(torch.float64)).sum() for o, g in zip(outs, grads, strict=True)).backward()
            close("grad x (plain)", x.grad, x64[rank].grad, dtype, ctx)
            spread = weight_grad_spread(xs[rank], idxs[rank], grads[rank], lambda xr, e: expert_fn(xr.abs(), e))
            close("grad topk_weights (plain)", wt.grad, wt64[rank].grad, dtype, ctx, spread)
            bounded.zero_grad_on_padding(x_recv)
            done.append(f"plain {case}")
            x.grad = wt.grad = None
            for t in (*x64, *wt64):
                t.grad = None
        if "grouped" in forms:
            w1_local = w1[rank * L : (rank + 1) * L].clone().requires_grad_(True)
            w2_local = w2[rank * L : (rank + 1) * L].clone().requires_grad_(True)
            h, handle = overlap.moe.dispatch_grouped_matmul(x, idxs[rank], w1_local, E, group=group,
                                                            **_how(strategy), **bounded.kwargs)
            want_h = torch.stack([r.to(torch.float64) @ w1[e].to(torch.float64) for r, e in zip(want_rows, ids,
                                                                                                strict=True)]) \
                if ids else torch.empty(0, case.ffn, dtype=torch.float64)
            close("h", bounded.rows(h, handle), want_h, dtype, ctx)
            junk = bounded.junk(h)  # nonzero on the padding rows only (none without a bound)
            y = overlap.moe.grouped_matmul_combine(activation(h) + junk, w2_local, wt, handle, **_how(strategy))
            outs = dense(x64, idxs, wt64, w1_64, w2_64, activation)
            close("grouped output", y, outs[rank], dtype, ctx)
            y.backward(grads[rank])
            sum((o * g.to(torch.float64)).sum() for o, g in zip(outs, grads, strict=True)).backward()
            close("grad x", x.grad, x64[rank].grad, dtype, ctx)
            terms = functools.partial(expert_terms, w1=w1, w2=w2, act_terms=pointwise_terms(activation))
            spread = weight_grad_spread(xs[rank], idxs[rank], grads[rank], terms)
            close("grad topk_weights", wt.grad, wt64[rank].grad, dtype, ctx, spread)
            close("grad w1", w1_local.grad, w1_64.grad[rank * L : (rank + 1) * L], dtype, ctx)
            close("grad w2", w2_local.grad, w2_64.grad[rank * L : (rank + 1) * L], dtype, ctx)
            bounded.zero_grad_on_padding(h, junk)
            done.append(f"grouped {case}")
    return done


def _plain(strategy):
    """Plain dispatch/combine have no fused form: a fused run checks them with symm."""
    import overlap

    if isinstance(strategy, overlap.Plan) and strategy.strategy == "fused":
        return dataclasses.replace(strategy, strategy="symm")
    return "symm" if strategy == "fused" else strategy


def _how(strategy) -> dict:
    """``strategy=`` for a name, ``plan=`` for an `overlap.Plan`."""
    return {"strategy": strategy} if isinstance(strategy, str) else {"plan": strategy}
