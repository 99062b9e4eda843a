"""What the benchmark computes for each op: inputs, the local oracle, the collectives and GEMMs alone.

One builder per op (`WORKLOADS`), each with the same shape: draw this rank's inputs, compute the
expected results locally, and define the op's plain collectives alone and its GEMMs alone, the
``T_comm`` and ``T_compute`` of the overlap efficiency. A new op is added by copying a sibling.

Inputs are seeded per rank, case and tensor, so every rank can regenerate every rank's inputs and
compute the collective's result on its own (the oracle that ``reference`` is checked against).
``a`` is standard normal; ``b`` standard normal scaled by ``1/sqrt(reduction length)`` like an
initialized weight (``k`` for ``all_gather_matmul``, ``W*k`` for the row-parallel ops), so
forward outputs are of order 1 whatever the shape and absolute tolerances keep their meaning;
``grad_out`` is standard normal (the same on every rank for ``matmul_all_reduce``, whose output
and loss are replicated). Never zeros. Sums over ranks in the oracle are accumulated in fp32.

What "alone" means (the overlap efficiency's denominators, see `runner`):

* ``fwd``: the op's plain collective on a tensor of its size (``all_gather`` of ``a``,
  ``reduce_scatter`` or ``all_reduce`` of the output-sized partial) and its one GEMM
  ``[W*m, k] @ [k, n]``.
* ``fwd+bwd``: every plain collective of the unfused forward and backward, back to back
  (``all_gather_matmul``: all_gather of ``a`` twice, reduce_scatter of ``grad_a``'s partial;
  ``matmul_reduce_scatter``: reduce_scatter, then all_gather of ``grad_out``;
  ``matmul_all_reduce``: the one all_reduce), and the three GEMMs (output, ``grad_a``,
  ``grad_b``) with the operand layouts the backward uses.

The MoE layer (op ``moe``, `definitions.MoECase`): ``x`` ``[T, H]`` standard normal per rank; the
routing of every rank drawn like a trained router's: logits ``[T, E]`` standard normal plus a
per-expert popularity (normal, standard deviation `MOE_POPULARITY`, the same on every rank), each
token's top ``K`` experts (distinct), ``topk_weights`` the softmax of their logits (fp32, as routers
keep them), so expert loads are uneven; ``w1`` ``[E, H, F]`` scaled by ``1/sqrt(H)``, ``w2``
``[E, F, H]`` by ``1/sqrt(F)`` (rank ``r`` holds experts ``r*L ... (r+1)*L - 1``); ``grad_out``
``[T, H]`` standard normal. Its oracle is the layer computed densely on every rank for the tokens
of all ranks (one GEMM per expert over the rows routed to it, gelu, the fp32 weighted sum), in the
case's dtype, with autograd for the gradients of ``x``, ``w1``, ``w2`` and ``topk_weights`` (the
loss is the sum over ranks of ``<y_r, grad_out_r>``). Alone:

* ``fwd``: the counts' ``all_to_all_single`` and the rows' two (dispatch, combine) with this
  routing's split sizes; the two grouped GEMMs (one ``torch.mm`` per local expert) on this rank's
  received rows. ``fwd+bwd``: also the backward's two transfers of ``H``-wide rows (output gradient
  to the experts, input gradient back) and the four backward grouped GEMMs (input and weight
  gradients of both).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import comm, moe, world
from ..ops.all_gather_matmul import all_gather_matmul
from ..ops.matmul_all_reduce import matmul_all_reduce
from ..ops.matmul_reduce_scatter import matmul_reduce_scatter
from ..ops.moe_layout import prefix_sums
from ..plans import Plan
from .definitions import AnyCase, Case, MoECase, label_plan

#: standard deviation of the per-expert popularity added to the MoE routing logits (uneven loads)
MOE_POPULARITY = 0.15


@dataclasses.dataclass
class Expected:
    """One tensor the op must produce: `what` (``out``, ``grad_a``, ``grad_b``; moe: ``out``, ``grad_x``,
    ``grad_w1``, ``grad_w2``, ``grad_topk_weights``), its oracle value, and the length of the dot
    products behind it (the fp32 tolerance grows with it; chained GEMMs add their lengths)."""

    what: str
    value: torch.Tensor
    reduction: int


@dataclasses.dataclass
class Workload:
    """One case's tensors on this rank and the functions the runner checks and times."""

    op: Callable[..., torch.Tensor]  # op(*inputs, strategy=, plan=, timeout=): overlap.<op>, or the MoE layer
    inputs: tuple[torch.Tensor, ...]  # leaves that require grad in fwd+bwd: (a, b); moe: (x, w1, w2, topk_weights)
    grad_out: torch.Tensor | None  # fwd+bwd only
    expected: list[Expected]  # out, then in fwd+bwd the gradient of each input, in order
    comm: Callable[[], None]  # the plain collectives alone
    compute: Callable[[], None]  # the GEMMs alone
    comm_label: str
    compute_label: str
    comm_bytes: int  # bytes one rank receives in the plain collectives (the GB/s column)
    notes: list[str] = dataclasses.field(default_factory=list)  # facts about the case worth a footnote


def _generator(device: torch.device, seed: int, case_index: int, tensor_id: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + case_index * 10_007 + tensor_id) % (2**63))
    return gen


class _Draw:
    """Draws the seeded tensors of one case: ``a`` of rank q is tensor q, ``b`` is W+q, ``grad_out`` 2W+q
    (moe: ``x`` q, routing logits W+q, ``grad_out`` 2W+q, expert popularity 3W, ``w1`` 3W+1, ``w2`` 3W+2)."""

    def __init__(self, case: AnyCase, seed: int, case_index: int, info: world.GroupInfo):
        self.case, self.seed, self.index = case, seed, case_index
        self.W, self.device = info.world_size, info.device

    def fp32(self, tensor_id: int, *shape: int) -> torch.Tensor:
        """Standard normal fp32 values."""
        return torch.randn(*shape, generator=_generator(self.device, self.seed, self.index, tensor_id),
                           device=self.device)

    def normal(self, tensor_id: int, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        x = self.fp32(tensor_id, rows, cols)
        return (x * scale if scale != 1.0 else x).to(self.case.torch_dtype)

    def a(self, q: int, rows: int) -> torch.Tensor:
        return self.normal(q, rows, self.case.k)

    def b(self, q: int, reduction: int) -> torch.Tensor:
        return self.normal(self.W + q, self.case.k, self.case.n, 1 / math.sqrt(reduction))

    def grad(self, q: int, rows: int) -> torch.Tensor:
        return self.normal(2 * self.W + q, rows, self.case.n)


def _leaf(x: torch.Tensor, backward: bool) -> torch.Tensor:
    return x.requires_grad_(True) if backward else x


def _workload(case: Case, fn, a: torch.Tensor, b: torch.Tensor, grad_out, expected: list[Expected],
              comm: Callable[[], None], comm_label: str, x: torch.Tensor, g, world_size: int) -> Workload:
    """The `Workload` of one op: its GEMMs alone are ``x @ b`` and, in fwd+bwd, the backward's
    ``g @ b.T`` and ``x.T @ g`` (``x``: the full input rows, ``g``: the output gradient they meet)."""

    def compute() -> None:
        torch.mm(x, b)
        if case.backward:
            torch.mm(g, b.t())
            torch.mm(x.t(), g)

    inputs = (_leaf(a, case.backward), _leaf(b, case.backward))
    return Workload(fn, inputs, grad_out, expected, comm, compute, comm_label,
                    "(GEMMs alone)" if case.backward else "(GEMM alone)", case.comm_bytes(world_size))


def _wait(work, what: str, info: world.GroupInfo, timeout: float) -> None:
    comm.wait_work(work, f"bench {what}", info.rank, "any", "all", timeout, info.device)


def _all_gather(out: torch.Tensor, x: torch.Tensor, pg, info, timeout: float) -> None:
    _wait(comm.all_gather_async(out, x, pg), "all_gather", info, timeout)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, pg, info, timeout: float) -> None:
    _wait(comm.reduce_scatter_async(out, x, pg), "reduce_scatter", info, timeout)


def _fp32_sum(parts) -> torch.Tensor:
    total = None
    for p in parts:
        total = p.float() if total is None else total.add_(p.float())
    return total


# ----------------------------------------------------------------------------------------------
# One builder per op: (case, draw, info, pg, timeout) -> Workload
# ----------------------------------------------------------------------------------------------


def _all_gather_matmul(case: Case, draw: _Draw, info: world.GroupInfo, pg, timeout: float) -> Workload:
    W, r, m, k, n, dt = info.world_size, info.rank, case.m, case.k, case.n, case.torch_dtype
    full_MK = torch.cat([draw.a(q, m) for q in range(W)])  # every rank's a: the gathered input
    b_KN = draw.b(r, k)
    a_MK = full_MK[r * m : (r + 1) * m].clone()
    expected = [Expected("out", full_MK @ b_KN, k)]
    grad_out = None
    if case.backward:
        grad_out = draw.grad(r, W * m)
        # grad_a = reduce_scatter(grad_out @ b.T): this rank's rows of every rank's partial.
        parts = (draw.grad(q, W * m)[r * m : (r + 1) * m] @ draw.b(q, k).t() for q in range(W))
        expected.append(Expected("grad_a", _fp32_sum(parts).to(dt), W * n))
        expected.append(Expected("grad_b", full_MK.t() @ grad_out, W * m))
    # Zeros in the buffers of the collectives alone: values that stay put, never denormal garbage.
    gathered = torch.zeros_like(full_MK)
    partial_MK = torch.zeros_like(full_MK)
    grad_a_MK = torch.zeros_like(a_MK)

    def comm() -> None:
        _all_gather(gathered, a_MK, pg, info, timeout)
        if case.backward:  # backward gathers a again, then reduce-scatters grad_a's partial
            _all_gather(gathered, a_MK, pg, info, timeout)
            _reduce_scatter(grad_a_MK, partial_MK, pg, info, timeout)

    label = "(comm alone)" if case.backward else "(all_gather alone)"
    return _workload(case, all_gather_matmul, a_MK, b_KN, grad_out, expected, comm, label, full_MK, grad_out,
                     W)


def _matmul_reduce_scatter(case: Case, draw: _Draw, info: world.GroupInfo, pg, timeout: float) -> Workload:
    W, r, m, k, n, dt = info.world_size, info.rank, case.m, case.k, case.n, case.torch_dtype
    rows = slice(r * m, (r + 1) * m)
    a_MK, b_KN = draw.a(r, W * m), draw.b(r, W * k)
    # out = this rank's rows of the sum of every rank's partial a_q @ b_q.
    parts = ((a_MK if q == r else draw.a(q, W * m))[rows] @ (b_KN if q == r else draw.b(q, W * k)) for q in range(W))
    expected = [Expected("out", _fp32_sum(parts).to(dt), W * k)]
    grad_out = full_grad = None
    if case.backward:
        full_grad = torch.cat([draw.grad(q, m) for q in range(W)])  # backward all-gathers grad_out
        grad_out = full_grad[rows].clone()
        expected.append(Expected("grad_a", full_grad @ b_KN.t(), n))
        expected.append(Expected("grad_b", a_MK.t() @ full_grad, W * m))
    partial = a_MK.new_zeros((W * m, n))  # zeros: see all_gather_matmul
    out = a_MK.new_zeros((m, n))

    def comm() -> None:
        _reduce_scatter(out, partial, pg, info, timeout)
        if case.backward:
            _all_gather(partial, out, pg, info, timeout)

    label = "(comm alone)" if case.backward else "(reduce_scatter alone)"
    return _workload(case, matmul_reduce_scatter, a_MK, b_KN, grad_out, expected, comm, label, a_MK,
                     full_grad, W)


def _matmul_all_reduce(case: Case, draw: _Draw, info: world.GroupInfo, pg, timeout: float) -> Workload:
    W, r, m, k, n, dt = info.world_size, info.rank, case.m, case.k, case.n, case.torch_dtype
    a_MK, b_KN = draw.a(r, W * m), draw.b(r, W * k)
    parts = ((a_MK if q == r else draw.a(q, W * m)) @ (b_KN if q == r else draw.b(q, W * k)) for q in range(W))
    expected = [Expected("out", _fp32_sum(parts).to(dt), W * k)]
    grad_out = None
    if case.backward:
        grad_out = draw.grad(W, W * m)  # replicated output and loss: one gradient for every rank
        expected.append(Expected("grad_a", grad_out @ b_KN.t(), n))
        expected.append(Expected("grad_b", a_MK.t() @ grad_out, W * m))
    # Zeros: the timed all_reduce runs in place again and again, and any other values would grow.
    partial = a_MK.new_zeros((W * m, n))

    def comm() -> None:  # the backward passes the gradient through: nothing more in fwd+bwd
        _wait(dist.all_reduce(partial, group=pg, async_op=True), "all_reduce", info, timeout)

    return _workload(case, matmul_all_reduce, a_MK, b_KN, grad_out, expected, comm, "(all_reduce alone)",
                     a_MK, grad_out, W)


def _moe(case: MoECase, draw: _Draw, info: world.GroupInfo, pg, timeout: float) -> Workload:
    W, r, dt, device = info.world_size, info.rank, case.torch_dtype, info.device
    T, H, F, E, K = dataclasses.astuple(case.dims)
    L = E // W
    mine = slice(r * L, (r + 1) * L)  # this rank's experts
    # Every rank's tokens and routing (tensor ids: `_Draw`).
    popularity = draw.fp32(3 * W, E)
    xs, idxs, wts = [], [], []
    for q in range(W):
        xs.append(draw.normal(q, T, H))
        top = torch.topk(draw.fp32(W + q, T, E) + MOE_POPULARITY * popularity, K, dim=1)
        idxs.append(top.indices)
        wts.append(torch.softmax(top.values, dim=1))
    w1_EHF = draw.normal(3 * W + 1, E * H, F, 1 / math.sqrt(H)).view(E, H, F)
    w2_EFH = draw.normal(3 * W + 2, E * F, H, 1 / math.sqrt(F)).view(E, F, H)
    x_TH, idx_TK, wt_TK = xs[r], idxs[r], wts[r]
    w1, w2 = w1_EHF[mine].clone(), w2_EFH[mine].clone()

    # Routing facts: rows per (source, expert), the layout of this rank's received rows.
    flat = torch.cat(idxs).view(W, T * K)
    per_source = torch.stack([torch.bincount(flat[q], minlength=E) for q in range(W)])  # [W, E] rows
    per_expert = per_source.sum(0)
    rows_of = per_expert.view(W, L).sum(1)  # rows each rank's experts receive
    off_rank = int(per_source.sum()) - sum(int(per_source[q, q * L : (q + 1) * L].sum()) for q in range(W))
    send_splits = per_source[r].view(W, L).sum(1).tolist()
    recv_splits = per_source[:, mine].sum(1).tolist()
    local_rows = per_expert[mine].tolist()

    # The oracle: the layer over every rank's tokens, densely, with autograd in fwd+bwd.
    grads = [draw.normal(2 * W + q, T, H) for q in range(W)] if case.backward else []
    with torch.enable_grad():
        leaves = [torch.cat(xs), torch.cat(wts), w1_EHF, w2_EFH]
        if case.backward:
            leaves = [t.clone().requires_grad_(True) for t in leaves]
        x_all, wt_all, w1_all, w2_all = leaves
        y_all, x_recv = _dense_moe(x_all, torch.cat(idxs), wt_all, w1_all, w2_all, range(mine.start, mine.stop))
        rows = slice(r * T, (r + 1) * T)
        expected = [Expected("out", y_all[rows].detach(), H + F)]
        if case.backward:
            g_x, g_wt, g_w1, g_w2 = torch.autograd.grad(y_all, leaves, torch.cat(grads))
            busiest = max(local_rows) if L else 1
            expected += [
                Expected("grad_x", g_x[rows], K * (H + F)),
                Expected("grad_w1", g_w1[mine], busiest + H),
                Expected("grad_w2", g_w2[mine], busiest),
                Expected("grad_topk_weights", g_wt[rows], H + F),
            ]
    x_recv = x_recv.detach()

    def layer(x, w1, w2, topk_weights, *, strategy, plan, timeout):
        # Looked up on the package at each call, like the tensor-parallel ops (tests replace them).
        kwargs = {"strategy": strategy, "plan": plan, "timeout": timeout}
        h, handle = moe.dispatch_grouped_matmul(x, idx_TK, w1, E, group=pg, **kwargs)
        return moe.grouped_matmul_combine(torch.nn.functional.gelu(h), w2, topk_weights, handle, **kwargs)

    # Alone: buffers of this routing's sizes (zeros: values that stay put).
    counts_send = torch.tensor(per_source[r].tolist(), dtype=torch.int64, device=device)
    counts_recv = torch.zeros_like(counts_send)
    pairs = x_TH.new_zeros((T * K, H))
    stage = x_TH.new_zeros((sum(recv_splits), H))

    def to_experts(out: torch.Tensor, inp: torch.Tensor) -> None:
        _wait(dist.all_to_all_single(out, inp, recv_splits, send_splits, group=pg, async_op=True), "all_to_all", info,
              timeout)

    def to_tokens(out: torch.Tensor, inp: torch.Tensor) -> None:
        _wait(dist.all_to_all_single(out, inp, send_splits, recv_splits, group=pg, async_op=True), "all_to_all", info,
              timeout)

    def comm() -> None:
        _wait(dist.all_to_all_single(counts_recv, counts_send, group=pg, async_op=True), "all_to_all", info, timeout)
        to_experts(stage, pairs)  # dispatch
        to_tokens(pairs, stage)  # combine
        if case.backward:
            to_experts(stage, pairs)  # combine's backward: the output gradient's rows to the experts
            to_tokens(pairs, stage)  # dispatch's backward: the input gradient's rows back

    h = torch.cat([x_recv.new_empty(0, F), *(
        x_recv[a : a + n] @ w1[e] for e, (a, n) in enumerate(zip(prefix_sums(local_rows), local_rows)) if n)])
    act = torch.nn.functional.gelu(h)

    def compute() -> None:  # operands of the right shapes: rows x, gelu(h), and gradients of the same sizes
        for e, (a, n) in enumerate(zip(prefix_sums(local_rows), local_rows)):
            if not n:
                continue
            x_e, h_e, a_e = x_recv[a : a + n], h[a : a + n], act[a : a + n]
            torch.mm(x_e, w1[e])
            torch.mm(a_e, w2[e])
            if case.backward:  # x_e stands for the output gradient's rows, h_e for gelu's input gradient
                torch.mm(x_e, w2[e].t())
                torch.mm(a_e.t(), x_e)
                torch.mm(h_e, w1[e].t())
                torch.mm(x_e.t(), h_e)

    inputs = tuple(_leaf(t, case.backward) for t in (x_TH.clone(), w1, w2, wt_TK.clone()))
    comm_bytes = (4 if case.backward else 2) * off_rank * H * dt.itemsize // W
    mean = W * T * K
    note = (f"{case.name}: routed rows per rank max/mean {W * int(rows_of.max()) / mean:.2f}, per expert "
            f"{E * int(per_expert.max()) / mean:.2f} (busiest of {E}), {off_rank / mean:.0%} to other ranks")
    return Workload(layer, inputs, grads[r] if case.backward else None, expected, comm, compute,
                    "(comm alone)" if case.backward else "(all_to_alls alone)", "(GEMMs alone)", comm_bytes, [note])


def _dense_moe(x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """``y[t] = sum_k wt[t, k] * gelu(x[t] @ w1[e]) @ w2[e]`` (``e = idx[t, k]``) for every token, one GEMM
    per expert over its rows (token order), the sum in fp32 (``k`` in order); also the rows of `experts`
    in expert order (the ``x_recv`` of the ranks holding them). Autograd-able."""
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
        pieces.append(torch.nn.functional.gelu(rows @ w1[e]) @ w2[e])
        where.append(pairs)
    order = torch.cat(where)
    back = torch.cat(pieces).index_select(0, torch.argsort(order))  # pair order: t*K + k
    acc = back.view(N, K, -1).float() * wt.float().unsqueeze(-1)
    y = acc.sum(dim=1).to(x.dtype)
    return y, torch.cat([x.new_empty(0, x.shape[1]), *recv])


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "all_gather_matmul": _all_gather_matmul,
    "matmul_reduce_scatter": _matmul_reduce_scatter,
    "matmul_all_reduce": _matmul_all_reduce,
    "moe": _moe,
}


def build(case: AnyCase, seed: int, case_index: int, info: world.GroupInfo, pg, timeout: float) -> Workload:
    """This rank's `Workload` of `case` (collective-free: every rank computes its own oracle)."""
    with torch.no_grad():
        w = WORKLOADS[case.op](case, _Draw(case, seed, case_index, info), info, pg, timeout)
    # The collectives and GEMMs alone read the inputs, leaves that require grad in fwd+bwd: no autograd.
    w.comm, w.compute = torch.no_grad()(w.comm), torch.no_grad()(w.compute)
    return w


def strategy_fn(w: Workload, case: AnyCase, label: str, timeout: float | None) -> Callable[[], list[torch.Tensor]]:
    """One timed call of strategy `label`: ``[out]``, or in fwd+bwd ``[out, gradient of each input]`` (the
    backward of a fresh output with the fixed `Workload.grad_out`, gradients not accumulated)."""
    strategy, fields = label_plan(case.op, label)
    kwargs = {"strategy": strategy, "plan": Plan(strategy, **fields) if fields else None, "timeout": timeout}
    if not case.backward:
        return lambda: [w.op(*w.inputs, **kwargs)]

    def forward_backward() -> list[torch.Tensor]:
        out = w.op(*w.inputs, **kwargs)
        return [out.detach(), *torch.autograd.grad(out, w.inputs, w.grad_out)]

    return forward_backward
