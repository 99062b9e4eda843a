r"""The tensor-parallel ops' workloads: one rank's inputs for a `Problem`, the call, the oracle and the plain
collectives. One function of each kind per op; `overlap.workloads` assembles them into `Workload`\ s.

Shapes are a `Problem`'s ``m x k x n``: every rank's GEMM is ``[W*m, k] @ [k, n]``.

* ``all_gather_matmul``: ``a`` ``[m, k]`` per rank (sharded on rows), ``b`` ``[k, n]``, out ``[W*m, n]``;
* ``matmul_reduce_scatter``: ``a`` ``[W*m, k]``, ``b`` ``[k, n]`` (the rank's slice of the reduction), out
  ``[m, n]``: this rank's rows of the sum over ranks;
* ``matmul_all_reduce``: as matmul_reduce_scatter, out ``[W*m, n]``: the whole sum, replicated;
* ``all_gather_weight_matmul`` (the weight-side gather of FSDP): ``a`` ``[m, k]`` per rank (its own data),
  ``b`` ``[k, n]`` this rank's block of the weight's columns, out ``[m, W*n]`` = ``a @ cat_q(b_q, dim=1)``.

Inputs (`inputs`): ``a`` standard normal; ``b`` standard normal scaled by ``1/sqrt(reduction length)`` like
an initialized weight (``k`` for all_gather_matmul, ``W*k`` for the row-parallel ops), so outputs are of
order 1 whatever the shape; ``grad_out`` standard normal (the same on every rank for matmul_all_reduce,
whose output and loss are replicated). The oracle (`oracle_*`) computes this rank's results from every
rank's inputs, sums over ranks in fp32. "Alone" (`plain_*`): the op's plain collectives on tensors of
their size (``fwd+bwd``: every collective of the unfused forward and backward, back to back) and its
GEMMs with the operand layouts the backward uses.

An fp8 problem (`overlap.plans.FP8_DTYPES`) is the op's ``fp8=`` recipe on bf16 leaves (`data.leaf_dtype`):
``float8_e4m3fn`` runs ``fp8="rowwise"``, ``mxfp8`` runs ``fp8="mxfp8"`` (`overlap.plans.fp8_granularity`; the
``fp8`` keyword travels in `OpInputs.options`). Its oracle's forward multiplies the leaves as the recipe quantizes
them on their owners (dequantized, in fp32: ``a`` per row or per block of 32 along ``k``, ``b`` per column or per
block along ``k``; the weight gather's shards each on its owner), its gradients are the leaves' own (the recipe's
backward runs in their dtype); alone, its forward collective moves the fp8 rows with their scales (the all-gather
of ``a``, or of the weight's columns) or float32 partials (reductions), its forward GEMM is the scaled GEMM, its
backward is the bf16 one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import comm
from ..ops.fp8 import dequantize, quantize_fp8, quantize_weight, scaled_mm
from ..ops.tp import all_gather_matmul, all_gather_weight_matmul, matmul_all_reduce, matmul_reduce_scatter
from ..ops.tp.operands import Packed
from ..plans import FP8_DTYPES, MX_DTYPE, fp8_granularity, op_spec
from .data import Expected, OpInputs, Plain, SeededDraw, summed

# ----------------------------------------------------------------------------------------------
# Inputs of one rank, and the call
# ----------------------------------------------------------------------------------------------


#: the length of the reduction behind each output element, ``(k, W) -> length``: ``b``'s scale
REDUCTION = {"all_gather_matmul": lambda k, W: k, "matmul_reduce_scatter": lambda k, W: W * k,
             "matmul_all_reduce": lambda k, W: W * k, "all_gather_weight_matmul": lambda k, W: k}
#: the ops whose output (hence its gradient) is the same on every rank
REPLICATED = ("matmul_all_reduce",)


def _fp8(p) -> bool:
    return getattr(p, "dtype", None) in FP8_DTYPES  # (a test's problem may be any object with the dims)


def _recipe(p) -> str:
    """The ``fp8=`` recipe an fp8 problem runs (`overlap.plans.fp8_granularity`)."""
    return fp8_granularity(p.dtype)


def inputs(p, world_size: int, draw: SeededDraw) -> OpInputs:
    """This rank's ``(a, b)`` and output gradient, from the op table's row and column counts."""
    spec = op_spec(p.op)
    a = draw.normal("a", spec.in_rows(p.m, world_size), p.k)
    b = draw.normal("b", p.k, p.n, scale=REDUCTION[p.op](p.k, world_size) ** -0.5)
    cols = spec.out_cols(p.n, world_size)
    g = (draw.normal("grad_out", spec.out_rows(p.m, world_size), cols, shared=p.op in REPLICATED)
         if p.backward else None)
    return OpInputs((a, b), g, options={"fp8": _recipe(p)} if _fp8(p) else {})


# The calls look the op up on its module when called (a test's wrong op, put there, is the one called).


def call_all_gather_matmul(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    return all_gather_matmul.all_gather_matmul(*inputs.leaves, group=group, **inputs.options, **kwargs)


def call_matmul_reduce_scatter(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    return matmul_reduce_scatter.matmul_reduce_scatter(*inputs.leaves, group=group, **inputs.options, **kwargs)


def call_matmul_all_reduce(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    return matmul_all_reduce.matmul_all_reduce(*inputs.leaves, group=group, **inputs.options, **kwargs)


def call_all_gather_weight_matmul(inputs: OpInputs, group, **kwargs) -> torch.Tensor:
    return all_gather_weight_matmul.all_gather_weight_matmul(*inputs.leaves, group=group, **inputs.options,
                                                             **kwargs)


# ----------------------------------------------------------------------------------------------
# Oracles: this rank's expected results from every rank's inputs
# ----------------------------------------------------------------------------------------------


def _quantized(x: OpInputs, granularity: str) -> OpInputs:
    """A rank's ``(a, b)`` as the fp8 recipe at `granularity` quantizes them on their owner (``a`` along its rows,
    ``b`` along its columns: both along ``k``), dequantized to fp32."""
    a, b = x.leaves
    (a8, sa), (b8, sb) = quantize_fp8(a, granularity), quantize_weight(b, granularity)
    return OpInputs((dequantize(a8, sa, -1), dequantize(b8, sb, 0)), x.grad_out)


def _fp8_forward(oracle: Callable[..., list[Expected]]) -> Callable[..., list[Expected]]:
    """`oracle`, answering an fp8 problem too: the forward of the quantized leaves (`_quantized`), in the
    leaves' dtype; the gradients of the leaves themselves."""

    @functools.wraps(oracle)
    def fn(p, every: list[OpInputs], rank: int) -> list[Expected]:
        if not _fp8(p):
            return oracle(p, every, rank)
        out = oracle(dataclasses.replace(p, backward=False), [_quantized(e, _recipe(p)) for e in every], rank)[0]
        grads = oracle(p, every, rank)[1:] if p.backward else []
        return [dataclasses.replace(out, value=out.value.to(every[rank].leaves[0].dtype)), *grads]

    return fn


@_fp8_forward
def oracle_all_gather_matmul(p, every: list[OpInputs], rank: int) -> list[Expected]:
    W, m = len(every), p.m
    full_MK = torch.cat([e.leaves[0] for e in every])  # every rank's a: the gathered input
    b_KN = every[rank].leaves[1]
    expected = [Expected("out", full_MK @ b_KN, p.k)]
    if p.backward:
        grad_out = every[rank].grad_out
        # grad_a = reduce_scatter(grad_out @ b.T): this rank's rows of every rank's partial.
        parts = (e.grad_out[rank * m : (rank + 1) * m] @ e.leaves[1].t() for e in every)
        expected.append(summed("grad_a", parts, full_MK.dtype, W * p.n))
        expected.append(Expected("grad_b", full_MK.t() @ grad_out, W * m))
    return expected


@_fp8_forward
def oracle_matmul_reduce_scatter(p, every: list[OpInputs], rank: int) -> list[Expected]:
    W, m = len(every), p.m
    rows = slice(rank * m, (rank + 1) * m)
    a_MK, b_KN = every[rank].leaves
    # out = this rank's rows of the sum of every rank's partial a_q @ b_q.
    parts = (e.leaves[0][rows] @ e.leaves[1] for e in every)
    expected = [summed("out", parts, a_MK.dtype, W * p.k)]
    if p.backward:
        full_grad = torch.cat([e.grad_out for e in every])  # backward all-gathers grad_out
        expected.append(Expected("grad_a", full_grad @ b_KN.t(), p.n))
        expected.append(Expected("grad_b", a_MK.t() @ full_grad, W * m))
    return expected


@_fp8_forward
def oracle_matmul_all_reduce(p, every: list[OpInputs], rank: int) -> list[Expected]:
    W = len(every)
    a_MK, b_KN = every[rank].leaves
    parts = (e.leaves[0] @ e.leaves[1] for e in every)
    expected = [summed("out", parts, a_MK.dtype, W * p.k)]
    if p.backward:
        grad_out = every[rank].grad_out  # replicated output and loss: one gradient for every rank
        expected.append(Expected("grad_a", grad_out @ b_KN.t(), p.n))
        expected.append(Expected("grad_b", a_MK.t() @ grad_out, W * p.m))
    return expected


@_fp8_forward
def oracle_all_gather_weight_matmul(p, every: list[OpInputs], rank: int) -> list[Expected]:
    W, n = len(every), p.n
    a_MK = every[rank].leaves[0]
    full_KN = torch.cat([e.leaves[1] for e in every], dim=1)  # every rank's shard: the whole weight
    expected = [Expected("out", a_MK @ full_KN, p.k)]
    if p.backward:
        grad_out = every[rank].grad_out
        expected.append(Expected("grad_a", grad_out @ full_KN.t(), W * n))
        # grad_b = this rank's columns of sum_q a_q.T @ g_q (a reduce-scatter with sum).
        parts = (e.leaves[0].t() @ e.grad_out[:, rank * n : (rank + 1) * n] for e in every)
        expected.append(summed("grad_b", parts, a_MK.dtype, W * p.m))
    return expected


# ----------------------------------------------------------------------------------------------
# Alone: the plain collectives and the GEMMs of one call
# ----------------------------------------------------------------------------------------------


def _wait(work, what: str, info, timeout: float) -> None:
    comm.wait_work(work, f"bench {what}", info.rank, "any", "all", timeout, info.device)


def _gemms(p, x: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None, reduced: bool) -> Callable[[], None]:
    """``x @ b`` (an fp8 problem: the scaled GEMM of their quantized values, in float32 where the output is
    `reduced` across ranks) and, in fwd+bwd, the backward's ``g @ b.T`` and ``x.T @ g`` (``x``: the full input
    rows, ``g``: the output gradient they meet)."""
    forward = functools.partial(torch.mm, x, b)
    if _fp8(p):
        (x8, sx), (b8, sb) = quantize_fp8(x, _recipe(p)), quantize_weight(b, _recipe(p))
        forward = functools.partial(scaled_mm, x8, b8, sx, sb, torch.float32 if reduced else x.dtype)

    def compute() -> None:
        forward()
        if p.backward:
            torch.mm(g, b.t())
            torch.mm(x.t(), g)

    return compute


def _plain(p, comm_fn, comm_label: str, x, b, g, comm_bytes: int, same_in_backward: bool = False,
           reduced: bool = False) -> Plain:
    """`Plain` of a TP op: its collectives are labelled `comm_label` forward (and in fwd+bwd where the backward
    adds none: `same_in_backward`), ``(comm alone)`` otherwise; `reduced`: its output is a sum over ranks."""
    label = comm_label if same_in_backward or not p.backward else "(comm alone)"
    return Plain(comm_fn, _gemms(p, x, b, g, reduced), label, "(GEMMs alone)" if p.backward else "(GEMM alone)",
                 comm_bytes)


def _partials(p, like: torch.Tensor, *shape: int) -> torch.Tensor:
    """Zeros for a forward reduction's partial: the leaves' dtype, an fp8 problem's float32."""
    return like.new_zeros(shape, dtype=torch.float32 if _fp8(p) else like.dtype)


def _packed_rows(p, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sent, got)`` of an fp8 problem's forward all-gather of `x` (``[r, k]`` rows) into `rows` rows: zeros,
    rows of bytes as the op packs them with their scales (`overlap.ops.tp.operands.Packed`: rowwise or MX)."""
    width = Packed(p.k, x.device, mx=p.dtype == MX_DTYPE).width
    return x.new_zeros((x.shape[0], width), dtype=torch.uint8), x.new_zeros((rows, width), dtype=torch.uint8)


def plain_all_gather_matmul(p, every: list[OpInputs], rank: int, group, info, timeout: float,
                            comm_bytes: int) -> Plain:
    a_MK, b_KN = every[rank].leaves
    full_MK = torch.cat([e.leaves[0] for e in every])
    # Zeros in the buffers of the collectives alone: values that stay put, never denormal garbage.
    gathered, partial_MK, grad_a_MK = torch.zeros_like(full_MK), torch.zeros_like(full_MK), torch.zeros_like(a_MK)
    sent, got = _packed_rows(p, a_MK, full_MK.shape[0]) if _fp8(p) else (a_MK, gathered)

    def comm_fn() -> None:
        _wait(comm.all_gather_async(got, sent, group), "all_gather", info, timeout)
        if p.backward:  # backward gathers a again, then reduce-scatters grad_a's partial
            _wait(comm.all_gather_async(gathered, a_MK, group), "all_gather", info, timeout)
            _wait(comm.reduce_scatter_async(grad_a_MK, partial_MK, group), "reduce_scatter", info, timeout)

    return _plain(p, comm_fn, "(all_gather alone)", full_MK, b_KN, every[rank].grad_out, comm_bytes)


def plain_matmul_reduce_scatter(p, every: list[OpInputs], rank: int, group, info, timeout: float,
                                comm_bytes: int) -> Plain:
    a_MK, b_KN = every[rank].leaves
    partial, out = a_MK.new_zeros((a_MK.shape[0], p.n)), a_MK.new_zeros((p.m, p.n))  # zeros: see above
    sent, got = _partials(p, a_MK, a_MK.shape[0], p.n), _partials(p, a_MK, p.m, p.n)
    full_grad = torch.cat([e.grad_out for e in every]) if p.backward else None

    def comm_fn() -> None:
        _wait(comm.reduce_scatter_async(got, sent, group), "reduce_scatter", info, timeout)
        if p.backward:
            _wait(comm.all_gather_async(partial, out, group), "all_gather", info, timeout)

    return _plain(p, comm_fn, "(reduce_scatter alone)", a_MK, b_KN, full_grad, comm_bytes, reduced=True)


def plain_matmul_all_reduce(p, every: list[OpInputs], rank: int, group, info, timeout: float,
                            comm_bytes: int) -> Plain:
    a_MK, b_KN = every[rank].leaves
    # Zeros: the timed all_reduce runs in place again and again, and any other values would grow.
    partial = _partials(p, a_MK, a_MK.shape[0], p.n)

    def comm_fn() -> None:  # the backward passes the gradient through: nothing more in fwd+bwd
        _wait(dist.all_reduce(partial, group=group, async_op=True), "all_reduce", info, timeout)

    return _plain(p, comm_fn, "(all_reduce alone)", a_MK, b_KN, every[rank].grad_out, comm_bytes,
                  same_in_backward=True, reduced=True)


def plain_all_gather_weight_matmul(p, every: list[OpInputs], rank: int, group, info, timeout: float,
                                   comm_bytes: int) -> Plain:
    a_MK, b_KN = every[rank].leaves
    full_KN = torch.cat([e.leaves[1] for e in every], dim=1)
    shard_NK = b_KN.t().contiguous()
    gathered = torch.zeros((len(every) * p.n, p.k), dtype=a_MK.dtype, device=a_MK.device)  # zeros: see above
    partial, grad_shard = torch.zeros_like(gathered), torch.zeros_like(shard_NK)
    # the forward gathers the shard's columns as rows (fp8: packed with their scales); the backward in bf16
    sent, got = _packed_rows(p, shard_NK, gathered.shape[0]) if _fp8(p) else (shard_NK, gathered)

    def comm_fn() -> None:
        _wait(comm.all_gather_async(got, sent, group), "all_gather", info, timeout)
        if p.backward:  # backward gathers the weight again, then reduce-scatters its gradient
            _wait(comm.all_gather_async(gathered, shard_NK, group), "all_gather", info, timeout)
            _wait(comm.reduce_scatter_async(grad_shard, partial, group), "reduce_scatter", info, timeout)

    return _plain(p, comm_fn, "(all_gather alone)", a_MK, full_KN, every[rank].grad_out, comm_bytes)
