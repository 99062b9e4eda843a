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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

import overlap

from .. import world
from ..ops import _common
from ..plan import Plan
from .cases import Case, label_plan


@dataclasses.dataclass
class Expected:
    """One tensor the op must produce: `what` (``out``, ``grad_a``, ``grad_b``), its oracle value,
    and the length of the dot products behind it (the fp32 tolerance grows with it)."""

    what: str
    value: torch.Tensor
    reduction: int


@dataclasses.dataclass
class Workload:
    """One case's tensors on this rank and the functions the runner checks and times."""

    op: Callable[..., torch.Tensor]  # overlap.<op>
    a: torch.Tensor  # a leaf that requires grad in fwd+bwd
    b: torch.Tensor
    grad_out: torch.Tensor | None  # fwd+bwd only
    expected: list[Expected]  # out, then grad_a, grad_b in fwd+bwd
    comm: Callable[[], None]  # the plain collectives alone
    compute: Callable[[], None]  # the GEMMs alone
    comm_label: str
    compute_label: str


def _generator(device: torch.device, seed: int, case_index: int, tensor_id: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + case_index * 10_007 + tensor_id) % (2**63))
    return gen


class _Draw:
    """Draws the seeded tensors of one case: ``a`` of rank q is tensor q, ``b`` is W+q, ``grad_out`` 2W+q."""

    def __init__(self, case: Case, seed: int, case_index: int, info: world.GroupInfo):
        self.case, self.seed, self.index = case, seed, case_index
        self.W, self.device = info.world_size, info.device

    def normal(self, tensor_id: int, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        gen = _generator(self.device, self.seed, self.index, tensor_id)
        x = torch.randn(rows, cols, generator=gen, device=self.device)
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
              comm: Callable[[], None], comm_label: str, x: torch.Tensor, g) -> Workload:
    """The `Workload` of one op: its GEMMs alone are ``x @ b`` and, in fwd+bwd, the backward's
    ``g @ b.T`` and ``x.T @ g`` (``x``: the full input rows, ``g``: the output gradient they meet)."""

    def compute() -> None:
        torch.mm(x, b)
        if case.backward:
            torch.mm(g, b.t())
            torch.mm(x.t(), g)

    return Workload(fn, _leaf(a, case.backward), _leaf(b, case.backward), grad_out, expected, comm, compute,
                    comm_label, "(GEMMs alone)" if case.backward else "(GEMM alone)")


def _wait(work, what: str, info: world.GroupInfo, timeout: float) -> None:
    _common.wait_work(work, f"bench {what}", info.rank, "any", "all", timeout, info.device)


def _all_gather(out: torch.Tensor, x: torch.Tensor, pg, info, timeout: float) -> None:
    _wait(_common.all_gather_async(out, x, pg), "all_gather", info, timeout)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, pg, info, timeout: float) -> None:
    _wait(_common.reduce_scatter_async(out, x, pg), "reduce_scatter", info, timeout)


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
    return _workload(case, overlap.all_gather_matmul, a_MK, b_KN, grad_out, expected, comm, label, full_MK, grad_out)


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
    return _workload(case, overlap.matmul_reduce_scatter, a_MK, b_KN, grad_out, expected, comm, label, a_MK,
                     full_grad)


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

    return _workload(case, overlap.matmul_all_reduce, a_MK, b_KN, grad_out, expected, comm, "(all_reduce alone)",
                     a_MK, grad_out)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "all_gather_matmul": _all_gather_matmul,
    "matmul_reduce_scatter": _matmul_reduce_scatter,
    "matmul_all_reduce": _matmul_all_reduce,
}


def build(case: Case, seed: int, case_index: int, info: world.GroupInfo, pg, timeout: float) -> Workload:
    """This rank's `Workload` of `case` (collective-free: every rank computes its own oracle)."""
    with torch.no_grad():
        w = WORKLOADS[case.op](case, _Draw(case, seed, case_index, info), info, pg, timeout)
    # The collectives and GEMMs alone read a and b, leaves that require grad in fwd+bwd: no autograd.
    w.comm, w.compute = torch.no_grad()(w.comm), torch.no_grad()(w.compute)
    return w


def strategy_fn(w: Workload, case: Case, label: str, timeout: float | None) -> Callable[[], list[torch.Tensor]]:
    """One timed call of strategy `label`: ``[out]``, or ``[out, grad_a, grad_b]`` in fwd+bwd (the
    backward of a fresh output with the fixed `Workload.grad_out`, gradients not accumulated)."""
    strategy, fields = label_plan(case.op, label)
    kwargs = {"strategy": strategy, "plan": Plan(strategy, **fields) if fields else None, "timeout": timeout}
    if not case.backward:
        return lambda: [w.op(w.a, w.b, **kwargs)]

    def forward_backward() -> list[torch.Tensor]:
        out = w.op(w.a, w.b, **kwargs)
        grad_a, grad_b = torch.autograd.grad(out, (w.a, w.b), w.grad_out)
        return [out.detach(), grad_a, grad_b]

    return forward_backward
