"""The workloads: for each op of the table (`overlap.plans.OPS`), what it takes to run it on made-up data and to
check and time it. The layer between the ops and their users: `overlap tune`, `overlap bench`, ``bench/soak.py``,
the GPU check and the tests import it; it imports the ops' public functions directly.

A `Workload` per op in `WORKLOADS` (`workload`):

* inputs: ``(p, W, draw) -> OpInputs`` of the rank `draw` is for (`data.SeededDraw`: any rank can draw any
  rank's inputs; moe also takes ``shares=``, the experts' weights for that rank's tokens);
* call: ``(inputs, group, **kwargs) -> out``: the public op on those inputs (kwargs: ``strategy``, ``plan``,
  ``timeout``);
* oracle: ``(p, every rank's OpInputs, rank) -> [Expected]``: this rank's results, computed locally in the
  inputs' dtype with fp32 sums;
* plain: ``(p, every, rank, group, info, timeout, comm_bytes) -> Plain``: the op's plain collectives and GEMMs
  alone (``T_comm`` and ``T_compute`` of the benchmark's overlap efficiency);
* plain_torch: ``(group, routing, num_experts, **options) -> fn(*leaves)``: the op written with torch alone
  (`plain_torch`), every benchmark's baseline (`options`: the inputs' `OpInputs.options`, ``fp8``).

A problem in an fp8 dtype (`overlap.plans.FP8_DTYPES`; the tensor-parallel ops, the weight gather included, and the
MoE layer's dispatch) is the op's ``fp8=`` recipe on bf16 leaves: ``float8_e4m3fn`` ``fp8="rowwise"``, ``mxfp8``
``fp8="mxfp8"`` (`leaf_dtype`; `tp` and `moe` say what each function does with it, `plain_torch` what its torch row
does).

The tensor-parallel ops' functions: `tp`; the MoE layer's: `moe`; the sequence-parallel ops' (their torch rows
included): `sp`; the plain-torch baselines: `plain_torch`; seeded
inputs and the oracles' sums: `data`; a plan's trial call of a problem (what the tuner times): `trial`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import moe, plain_torch, sp, tp
from .data import Expected, OpInputs, Plain, SeededDraw, leaf_dtype, summed


@dataclasses.dataclass(frozen=True)
class Workload:
    """One op's workload (see the module docstring for each function's signature)."""

    name: str
    inputs: Callable[..., OpInputs]
    call: Callable[..., torch.Tensor]
    oracle: Callable[..., list[Expected]]
    plain: Callable[..., Plain]
    plain_torch: Callable[..., Callable[..., torch.Tensor]]


#: every op's workload, by the op table's name
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("all_gather_matmul", tp.inputs, tp.call_all_gather_matmul, tp.oracle_all_gather_matmul,
             tp.plain_all_gather_matmul, plain_torch.torch_all_gather_matmul),
    Workload("matmul_reduce_scatter", tp.inputs, tp.call_matmul_reduce_scatter, tp.oracle_matmul_reduce_scatter,
             tp.plain_matmul_reduce_scatter, plain_torch.torch_matmul_reduce_scatter),
    Workload("matmul_all_reduce", tp.inputs, tp.call_matmul_all_reduce, tp.oracle_matmul_all_reduce,
             tp.plain_matmul_all_reduce, plain_torch.torch_matmul_all_reduce),
    Workload("all_gather_weight_matmul", tp.inputs, tp.call_all_gather_weight_matmul,
             tp.oracle_all_gather_weight_matmul, tp.plain_all_gather_weight_matmul,
             plain_torch.torch_all_gather_weight_matmul),
    Workload("moe", moe.inputs, moe.call, moe.oracle, moe.plain, plain_torch.torch_moe),
    Workload("matmul_all_to_all", sp.inputs_matmul_all_to_all, sp.call_matmul_all_to_all, sp.oracle_matmul_all_to_all,
             sp.plain_matmul_all_to_all, sp.torch_matmul_all_to_all),
    Workload("all_to_all_matmul", sp.inputs_all_to_all_matmul, sp.call_all_to_all_matmul, sp.oracle_all_to_all_matmul,
             sp.plain_all_to_all_matmul, sp.torch_all_to_all_matmul),
)}


def workload(name: str) -> Workload:
    """The workload of op `name`; raises ValueError for an op without one."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown op {name!r}; known: {tuple(WORKLOADS)}")
    return WORKLOADS[name]


__all__ = ["WORKLOADS", "Expected", "OpInputs", "Plain", "SeededDraw", "Workload", "leaf_dtype", "summed", "workload"]
