"""The MoE layer's workload: one rank's inputs for a `Problem`, the call, the oracle and the plain all-to-alls.
Op ``moe``: ``overlap.moe.dispatch_grouped_matmul``, gelu, ``grouped_matmul_combine``.

Shapes are a `Problem`'s: ``m`` tokens ``T`` per rank, hidden ``k`` (``H``), expert FFN ``n`` (``F``),
`experts` ``E`` in all (``L = E / W`` per rank: rank ``r`` holds experts ``r*L ... (r+1)*L - 1``),
`top_k` ``K`` per token.

Inputs (`inputs`): ``x`` ``[T, H]`` standard normal; the routing drawn like a trained router's: logits
``[T, E]`` standard normal plus a per-expert popularity (normal, standard deviation `POPULARITY`, the same
on every rank), each token's top ``K`` experts (distinct), ``topk_weights`` the softmax of their logits
(fp32 as routers keep them; float64 in a float64 problem), so expert loads are uneven; ``w1``
``[L, H, F]`` scaled by ``1/sqrt(H)``, ``w2`` ``[L, F, H]`` by ``1/sqrt(F)``; ``grad_out`` ``[T, H]``
standard normal.

The oracle (`oracle`) is the layer computed densely for the tokens of every rank (one GEMM per expert over
the rows routed to it, gelu, the fp32 weighted sum), in the problem's dtype, with autograd for the
gradients of ``x``, ``w1``, ``w2`` and ``topk_weights`` (the loss is the sum over ranks of
``<y_r, grad_out_r>``). Alone (`plain`): the counts' ``all_to_all_single`` and the rows' two (dispatch,
combine) with this routing's split sizes, the two grouped GEMMs (one ``torch.mm`` per local expert) on
this rank's received rows; ``fwd+bwd`` adds the backward's two transfers of ``H``-wide rows and its four
grouped GEMMs.

An fp8 problem (`overlap.plans.FP8_DTYPES`) is the dispatch's ``fp8=`` recipe on bf16 leaves (`data.leaf_dtype`):
``float8_e4m3fn`` runs ``fp8="rowwise"``, ``mxfp8`` runs ``fp8="mxfp8"`` (`overlap.plans.fp8_granularity`; the
keyword travels in `OpInputs.options`, to the dispatch alone). Its oracle's first GEMM multiplies, in float32, the
tokens and ``w1`` as the dispatch quantizes them (`overlap.ops.moe.fp8`: each token on its owner, ``w1`` along
``H``, dequantized) and rounds the product to the leaves' dtype, as the scaled GEMM does; the rest of the layer is
the bf16 oracle's; the gradients are the recipe's: the tokens' through the quantization as through the identity,
times ``w1`` itself, ``w1``'s from the dequantized tokens. Alone, its dispatch moves the packed fp8 rows
(`overlap.ops.moe.fp8.RowFormat`; the bytes counted: `overlap.plans.moe_row_bytes`) and its first GEMM is the
scaled GEMM; the rest is bf16's.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist

from .. import comm
from ..ops.fp8 import quantize_fp8, quantize_weight, scaled_mm
from ..ops.moe import combine, dispatch
from ..ops.moe import fp8 as moe_fp8
from ..plans import FP8_DTYPES, fp8_granularity, moe_row_bytes
from ..stages import stage
from .data import Expected, OpInputs, Plain, SeededDraw

#: standard deviation of the per-expert popularity added to the routing logits (uneven loads)
POPULARITY = 0.15


def inputs(p, world_size: int, draw: SeededDraw, shares=None) -> OpInputs:
    """One rank's inputs (module docstring). `shares`: ``E`` weights (>= 0) of the experts for this rank's
    tokens instead of the router-like draw: each token's ``K`` experts drawn without replacement in proportion
    to them (Gumbel top-k), its weights the softmax of normal logits."""
    T, H, F, E, K = p.m, p.k, p.n, p.experts, p.top_k
    L = E // world_size
    x = draw.normal("x", T, H)
    if shares is None:
        logits = draw.fp32("logits", T, E) + POPULARITY * draw.fp32("popularity", E, shared=True)
        top = torch.topk(logits, K, dim=1)
        values = top.values
    else:
        weight = torch.tensor([float(s) for s in shares], device=draw.device)
        if weight.numel() != E or bool((weight < 0).any()) or int((weight > 0).sum()) < K:
            raise ValueError(f"moe inputs: shares must be {E} values >= 0, at least top_k={K} of them > 0; "
                             f"got {list(shares)}")
        gumbel = -torch.log(-torch.log(draw.uniform("experts", T, E).clamp(1e-12, 1 - 1e-7)))
        top = torch.topk(weight.log() + gumbel, K, dim=1)
        values = draw.fp32("logits", T, K)
    weights = torch.softmax(values, dim=1).to(torch.promote_types(draw.dtype, torch.float32))
    w1 = draw.normal("w1", L * H, F, scale=H**-0.5).view(L, H, F)
    w2 = draw.normal("w2", L * F, H, scale=F**-0.5).view(L, F, H)
    g = draw.normal("grad_out", T, H) if p.backward else None
    options = {"fp8": fp8_granularity(p.dtype)} if _fp8(p) else {}
    return OpInputs((x, w1, w2, weights), g, routing=top.indices, num_experts=E, options=options)


def _fp8(p) -> bool:
    return getattr(p, "dtype", None) in FP8_DTYPES  # (a test's problem may be any object with the dims)


def call(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    """The layer: ``dispatch_grouped_matmul`` (with the problem's `OpInputs.options`: ``fp8``), gelu,
    ``grouped_matmul_combine`` (each looked up on its module when called)."""
    x, w1, w2, weights = inputs.leaves
    h, handle = dispatch.dispatch_grouped_matmul(x, inputs.routing, w1, inputs.num_experts, group=group,
                                                 **inputs.options, **kwargs)
    return combine.grouped_matmul_combine(_Gelu.apply(h), w2, weights, handle, **kwargs)


class _Gelu(torch.autograd.Function):
    """``torch.nn.functional.gelu`` (the same aten ops, forward and backward), each direction the profile's stage
    ``activation`` (`overlap.stages`): the layer's own compute that the GEMMs alone leave out."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        with stage("activation"):
            return torch.nn.functional.gelu(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        with stage("activation"):
            return torch.ops.aten.gelu_backward(grad, h)


def dense(x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
          experts: range = range(0), act=torch.nn.functional.gelu,
          w1_values: torch.Tensor | None = None,
          sizes: dict[int, ExpertSizes] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense model of an MoE layer: ``y[t] = sum_k wt[t, k] * act(x[t] @ w1[e]) @ w2[e]`` (``e = idx[t, k]``)
    for every token, one GEMM per expert over its rows (token order), the sum in fp32 or wider (``k`` in order);
    also the rows of `experts` in expert order (the ``x_recv`` of the ranks holding them). Autograd-able; in
    float64 it is the oracle of the MoE ops, here and in the tests. `w1_values`: the first GEMM's forward takes
    these weights' values instead (an fp8 recipe's quantized ``w1``), its gradients stay ``w1``'s (the rows'
    through ``w1`` itself, ``w1``'s from the rows). The first GEMM's output is rounded to ``w2``'s dtype (where
    `x` and `w1` are wider: a scaled GEMM's output). `sizes`, where given, gets per expert what bounds the terms of
    its weights' and the top-k weights' gradients (`terms`)."""
    N, K = idx.shape
    flat = idx.reshape(-1)
    pieces, where, recv = [], [], []
    for e in range(w1.shape[0]):
        pairs = (flat == e).nonzero().squeeze(1)
        if not pairs.numel():
            continue
        rows = x.index_select(0, torch.div(pairs, K, rounding_mode="floor"))
        if e in experts:
            recv.append(rows)
        h = rows @ w1[e]
        if w1_values is not None:
            h = h + rows.detach() @ (w1_values[e] - w1[e].detach())
        a = act(h.to(w2.dtype))
        pieces.append(a @ w2[e])
        where.append(pairs)
        if sizes is not None:
            sizes[e] = ExpertSizes.watch(rows, h, a, pieces[-1])
    if not where:  # no token here; the inputs stay in the graph, so their gradients are zeros, not None
        tie = (x.sum() + wt.sum() + w1.sum() + w2.sum()) * 0
        return (x.new_zeros((N, w2.shape[-1])) + tie).to(x.dtype), x.new_empty(0, x.shape[1])
    order = torch.cat(where)
    back = torch.cat(pieces).index_select(0, torch.argsort(order))  # pair order: t*K + k
    wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or float64 for a float64 oracle
    acc = back.view(N, K, -1).to(wide) * wt.to(wide).unsqueeze(-1)
    y = acc.sum(dim=1).to(x.dtype)
    return y, torch.cat([x.new_empty(0, x.shape[1]), *recv])


@dataclasses.dataclass
class ExpertSizes:
    """One expert's magnitudes in the dense model (`dense`'s `sizes`): its rows, ``h``, ``act(h)`` and its output
    ``piece`` in the forward, and the gradients reaching ``h``, ``act(h)`` and ``piece``, filled in by hooks when
    the backward runs; they bound the terms the gradients sum (`terms`)."""

    rows: torch.Tensor
    h: torch.Tensor
    a: torch.Tensor
    piece: torch.Tensor
    grad_h: torch.Tensor | None = None
    grad_a: torch.Tensor | None = None
    grad_piece: torch.Tensor | None = None

    @classmethod
    def watch(cls, rows, h, a, piece) -> ExpertSizes:
        sizes = cls(*(t.detach().abs().double() for t in (rows, h, a, piece)))
        for t, name in ((h, "grad_h"), (a, "grad_a"), (piece, "grad_piece")):
            if t.requires_grad:
                t.register_hook(lambda g, name=name: setattr(sizes, name, g.detach().abs().double()))
        return sizes


def terms(sizes: dict[int, ExpertSizes], idx: torch.Tensor, wt: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
          grad_out: torch.Tensor | None, experts: range, rows: slice) -> dict[str, torch.Tensor]:
    """Per tensor of the MoE layer (``out``, ``grad_x`` and ``grad_topk_weights`` at the tokens `rows`, ``grad_w1``
    and ``grad_w2`` of `experts`; the gradients where `grad_out` is given), the summed magnitudes of each element's
    terms (`Expected.terms`): a strategy whose first GEMM rounds ``h`` otherwise (another order, fp8 tensor cores'
    narrower accumulation, in 16 bits) moves each term by a share of its size, however much their sum cancels.
    ``act(h)`` moves by at most ``|h|`` times that share (gelu's slope stays below 1.13, ``|gelu(h)| <= |h|``):
    ``out[t]`` sums ``wt[t, k] * act @ w2[e]``, ``grad_w1 = rows.T @ grad h``, ``grad_w2 = act.T @ grad piece``,
    ``grad_x`` sums ``grad h @ w1[e].T`` over its pairs and ``grad_wt[t, k] = act @ w2[e] . grad_out[t]``."""
    N, K = idx.shape
    flat = idx.reshape(-1)
    wt_pairs = wt.detach().double().abs().reshape(-1)
    m_out = torch.zeros((N * K, w2.shape[-1]), dtype=torch.float64)
    m1 = torch.zeros((len(experts), *w1.shape[1:]), dtype=torch.float64)
    m2 = torch.zeros((len(experts), *w2.shape[1:]), dtype=torch.float64)
    mx = torch.zeros((N * K, w1.shape[1]), dtype=torch.float64)
    mwt = torch.zeros(N * K, dtype=torch.float64)
    for e, s in sizes.items():
        pairs = (flat == e).nonzero().squeeze(1)
        w2_e = w2[e].detach().double()
        m_out[pairs] = wt_pairs[pairs].unsqueeze(1) * (s.h @ w2_e.abs()) + s.piece
        if grad_out is None or s.grad_h is None:
            continue
        grad_h = s.grad_a * s.h + s.grad_h  # gelu's derivative moves by at most |h| times the share
        if e in experts:
            m1[e - experts.start], m2[e - experts.start] = s.rows.t() @ grad_h, s.h.t() @ s.grad_piece
        mx[pairs] = grad_h @ w1[e].detach().double().abs().t()
        g_rows = grad_out.detach().double().index_select(0, torch.div(pairs, K, rounding_mode="floor"))
        mwt[pairs] = (s.h * (g_rows @ w2_e.t()).abs()).sum(1) + (s.piece * g_rows.abs()).sum(1)
    out = {"out": m_out.view(N, K, -1).sum(1)[rows]}
    if grad_out is not None:
        out.update(grad_x=mx.view(N, K, -1).sum(1)[rows], grad_w1=m1, grad_w2=m2,
                   grad_topk_weights=mwt.view(N, K)[rows])
    return out


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


class _Routing:
    """Rows per (source rank, expert) of every rank's routing, and what follows for rank `rank`."""

    def __init__(self, every: list[OpInputs], rank: int):
        W, E = len(every), every[0].num_experts
        L = E // W
        self.mine = range(rank * L, (rank + 1) * L)
        flat = torch.cat([e.routing for e in every]).view(W, -1)
        self.per_source = torch.stack([torch.bincount(flat[q], minlength=E) for q in range(W)])  # [W, E] rows
        self.per_expert = self.per_source.sum(0)
        self.rows_of = self.per_expert.view(W, L).sum(1)  # rows each rank's experts receive
        self.off_rank = int(self.per_source.sum()) - sum(
            int(self.per_source[q, q * L : (q + 1) * L].sum()) for q in range(W))
        self.send_splits = self.per_source[rank].view(W, L).sum(1).tolist()
        self.recv_splits = self.per_source[:, rank * L : (rank + 1) * L].sum(1).tolist()
        self.local_rows = self.per_expert[rank * L : (rank + 1) * L].tolist()


def _fp8_layer(p, x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor, sizes: dict[int, ExpertSizes]) -> torch.Tensor:
    """The layer of an fp8 problem (module docstring): the first GEMM in float32 on the tokens `x` and the weights
    `w1` as the dispatch quantizes them (the tokens' gradient straight through), its output rounded to the leaves'
    dtype as the scaled GEMM's is; the rest in the leaves' dtype with fp32 sums, as the bf16 oracle; ``y`` in `x`'s
    dtype."""
    fmt = moe_fp8.RowFormat(fp8_granularity(p.dtype), p.k)
    xq = moe_fp8.dequantize_rows(moe_fp8.pack(x.detach(), fmt), fmt, torch.float32)
    w1q = moe_fp8.Fp8Experts.quantize(w1.detach(), fmt)
    w1_values = torch.stack([w1q.dense(e) for e in range(w1.shape[0])])
    x32 = x.float()
    y, _ = dense(x32 + (xq - x32).detach(), idx, wt, w1.float(), w2, w1_values=w1_values, sizes=sizes)
    return y.to(x.dtype)


def oracle(p, every: list[OpInputs], rank: int) -> list[Expected]:
    T, H, F, K = p.m, p.k, p.n, p.top_k
    routing = _Routing(every, rank)
    with torch.enable_grad():
        leaves = [torch.cat([e.leaves[0] for e in every]), torch.cat([e.leaves[3] for e in every]),
                  torch.cat([e.leaves[1] for e in every]), torch.cat([e.leaves[2] for e in every])]
        if p.backward:
            leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        x_all, wt_all, w1_all, w2_all = leaves
        idx_all = torch.cat([e.routing for e in every])
        sizes: dict[int, ExpertSizes] = {}
        if _fp8(p):
            y_all = _fp8_layer(p, x_all, idx_all, wt_all, w1_all, w2_all, sizes)
        else:
            y_all, _ = dense(x_all, idx_all, wt_all, w1_all, w2_all, routing.mine, sizes=sizes)
        rows, mine = slice(rank * T, (rank + 1) * T), slice(routing.mine.start, routing.mine.stop)
        expected = [Expected("out", y_all[rows].detach(), H + F)]
        grad_out = None
        if p.backward:
            grad_out = torch.cat([e.grad_out for e in every])
            g_x, g_wt, g_w1, g_w2 = torch.autograd.grad(y_all, leaves, grad_out)
            busiest = max(routing.local_rows) if routing.local_rows else 1
            expected += [
                Expected("grad_x", g_x[rows], K * (H + F)),
                Expected("grad_w1", g_w1[mine], busiest + H),
                Expected("grad_w2", g_w2[mine], busiest),
                Expected("grad_topk_weights", g_wt[rows], H + F),
            ]
        if x_all.dtype in (torch.bfloat16, torch.float16):  # h rounded in 16 bits (fp32's within tolerance)
            sized = terms(sizes, idx_all, wt_all, w1_all, w2_all, grad_out, routing.mine, rows)
            expected = [dataclasses.replace(e, magnitude=_rms(sized[e.what]), terms=sized[e.what]) for e in expected]
    return expected


def plain(p, every: list[OpInputs], rank: int, group, info, timeout: float, comm_bytes: int) -> Plain:
    """The all-to-alls and grouped GEMMs alone; `comm_bytes` is replaced by this routing's own count."""
    W, T, H, F, E, K = len(every), p.m, p.k, p.n, p.experts, p.top_k
    r = _Routing(every, rank)
    x_TH, w1, w2 = every[rank].leaves[:3]
    with torch.no_grad():
        _, x_recv = dense(torch.cat([e.leaves[0] for e in every]), torch.cat([e.routing for e in every]),
                           torch.cat([e.leaves[3] for e in every]), torch.cat([e.leaves[1] for e in every]),
                           torch.cat([e.leaves[2] for e in every]), r.mine)

    def wait(work) -> None:
        comm.wait_work(work, "bench all_to_all", info.rank, "any", "all", timeout, info.device)

    # Buffers of this routing's sizes (zeros: values that stay put); an fp8 dispatch's rows packed, as bytes.
    counts_send = torch.tensor(r.per_source[rank].tolist(), dtype=torch.int64, device=info.device)
    counts_recv = torch.zeros_like(counts_send)
    pairs = x_TH.new_zeros((T * K, H))
    stage = x_TH.new_zeros((sum(r.recv_splits), H))
    fmt = moe_fp8.RowFormat(fp8_granularity(p.dtype), H, info.device.type) if _fp8(p) else None
    pairs8, stage8 = ((pairs, stage) if fmt is None else
                      (x_TH.new_zeros((T * K, fmt.cols), dtype=torch.uint8),
                       x_TH.new_zeros((stage.shape[0], fmt.cols), dtype=torch.uint8)))

    def to_experts(out: torch.Tensor, inp: torch.Tensor) -> None:
        wait(dist.all_to_all_single(out, inp, r.recv_splits, r.send_splits, group=group, async_op=True))

    def to_tokens(out: torch.Tensor, inp: torch.Tensor) -> None:
        wait(dist.all_to_all_single(out, inp, r.send_splits, r.recv_splits, group=group, async_op=True))

    def comm_fn() -> None:
        wait(dist.all_to_all_single(counts_recv, counts_send, group=group, async_op=True))
        to_experts(stage8, pairs8)  # dispatch
        to_tokens(pairs, stage)  # combine
        if p.backward:
            to_experts(stage, pairs)  # combine's backward: the output gradient's rows to the experts
            to_tokens(pairs, stage)  # dispatch's backward: the input gradient's rows back

    starts = list(itertools.accumulate(r.local_rows, initial=0))
    with torch.no_grad():
        h = torch.cat([x_recv.new_empty(0, F), *(
            x_recv[a : a + n] @ w1[e] for e, (a, n) in enumerate(zip(starts, r.local_rows)) if n)])
        act = torch.nn.functional.gelu(h)
    first = _first_gemm(p, x_recv, w1)

    def compute() -> None:  # operands of the right shapes: rows x, gelu(h), and gradients of the same sizes
        for e, (a, n) in enumerate(zip(starts, r.local_rows)):
            if not n:
                continue
            x_e, h_e, a_e = x_recv[a : a + n], h[a : a + n], act[a : a + n]
            first(e, a, n)
            torch.mm(a_e, w2[e])
            if p.backward:  # x_e stands for the output gradient's rows, h_e for gelu's input gradient
                torch.mm(x_e, w2[e].t())
                torch.mm(a_e.t(), x_e)
                torch.mm(h_e, w1[e].t())
                torch.mm(x_e.t(), h_e)

    # the rows that cross ranks: dispatched (an fp8 problem's packed, `overlap.plans.moe_row_bytes`), then the rest
    dispatched, returned = moe_row_bytes(p) if _fp8(p) else (H * x_TH.element_size(),) * 2
    comm_bytes = r.off_rank * (dispatched + (3 if p.backward else 1) * returned) // W
    mean = W * T * K
    note = (f"routed rows per rank max/mean {W * int(r.rows_of.max()) / mean:.2f}, per expert "
            f"{E * int(r.per_expert.max()) / mean:.2f} (busiest of {E}), {r.off_rank / mean:.0%} to other ranks")
    return Plain(comm_fn, compute, "(comm alone)" if p.backward else "(all_to_alls alone)", "(GEMMs alone)",
                 comm_bytes, [note])


def _first_gemm(p, x_recv: torch.Tensor, w1: torch.Tensor):
    """``fn(e, a, n)``: rows ``a .. a+n`` of the received tokens `x_recv` times ``w1[e]``, the first grouped GEMM
    alone: ``torch.mm``, or an fp8 problem's scaled GEMM of the tokens and ``w1`` quantized as the dispatch
    quantizes them (per row or MX block, ``w1`` along ``H``)."""
    if not _fp8(p) or not x_recv.shape[0]:
        return lambda e, a, n: torch.mm(x_recv[a : a + n], w1[e])
    g = fp8_granularity(p.dtype)
    x8, sx = quantize_fp8(x_recv, g)
    w8 = [quantize_weight(w, g) for w in w1]
    return lambda e, a, n: scaled_mm(x8[a : a + n], w8[e][0], sx[a : a + n], w8[e][1], x_recv.dtype)
