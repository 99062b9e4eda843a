"""What a benchmark case is: the ops, modes, dtypes and strategy labels a case is drawn from, and
the two kinds of case with the FLOPs and bytes of one call. `cases` selects the cases a run
benchmarks (presets, defaults, suites) and is where the rest of the project imports all of this from.

A `Case` is one op at one shape and dtype, timed forward only (mode ``fwd``) or forward plus
backward (``fwd+bwd``): the op table's `overlap.plans.Problem` with the run's layout and labels.

Shapes. ``m x k x n`` means the same GEMM on every rank for all three ops, ``[W*m, k] @ [k, n]``
(``W`` the world size, ``2*W*m*k*n`` FLOPs per rank forward), so that one shape costs the same
compute whichever op runs it and the ops' rows can be compared. ``m`` is always this rank's slice
of the sequence in Megatron's sequence-parallel layout:

* ``all_gather_matmul``: ``a`` is ``[m, k]`` per rank, ``b`` ``[k, n]`` (a column shard), the
  output ``[W*m, n]``; its collective is the all-gather of ``a``: ``(W-1)*m*k`` elements in.
* ``matmul_reduce_scatter``: ``a`` is ``[W*m, k]``, ``b`` ``[k, n]`` (a row shard), the output
  ``[m, n]`` (``m`` = output rows per rank); its collective is the reduce-scatter of the
  ``[W*m, n]`` partial: ``(W-1)*m*n`` elements in.
* ``matmul_all_reduce``: ``a`` is ``[W*m, k]``, ``b`` ``[k, n]`` (a row shard), the output
  ``[W*m, n]``; its collective is the all-reduce of the ``[W*m, n]`` partial: ``2*(W-1)*m*n``
  elements in (a ring: reduce-scatter, then all-gather).

For the two row-parallel ops ``k`` is this rank's slice of the reduced dim (the full reduction is
``W*k`` long); ``matmul_all_reduce`` is tensor parallelism without sequence parallelism, whose
sequence is the whole ``W*m``. "Elements in" counts what one rank receives in a ring or pairwise
implementation, the basis of the GB/s column.

fp8 (dtype ``float8_e4m3fn`` or ``mxfp8``; the tensor-parallel ops of the op table, the weight gather included):
the op's ``fp8="rowwise"`` or ``fp8="mxfp8"`` training recipe on bfloat16 leaves (`overlap.workloads.tp`):
quantized on each operand's owner (``a`` per row or per block of 32 along ``k``, the weight per column or per
block along ``k``), the gathers moving fp8 rows with their scales (``all_gather_weight_matmul``: the weight's
columns) and the reductions float32 partials, scaled GEMMs forward, the backward in bfloat16; the ``torch`` row
casts, runs the plain collectives of the fp8 bytes and of the scales and ``torch._scaled_mm``, its backward the
bfloat16 one. The GB/s column counts those bytes, scales included (`overlap.plans.wire_sizes`: ``k + 4`` bytes a
gathered row rowwise, ``k + k/32`` MX). An ``mxfp8`` case needs ``k`` a multiple of 32. The MoE layer's fp8 cases:
below.

Modes. ``fwd+bwd`` times the forward and the backward of a fresh output: three GEMMs
(``6*W*m*k*n`` FLOPs) and, per Megatron's conventions (docs/conventions.md), more communication:
``all_gather_matmul`` gathers ``a`` again and reduce-scatters ``grad_a`` (``+2*(W-1)*m*k``),
``matmul_reduce_scatter`` all-gathers ``grad_out`` (``+(W-1)*m*n``), ``matmul_all_reduce`` passes
the gradient through (no more).

Strategy labels: the four strategies, and for ``matmul_all_reduce`` their ``+one_shot`` variants
(`VARIANTS`: every rank sums every rank's whole partial in one step; the plain labels are the
two-shot reduce-scatter + all-gather).

A case made from a layer of a `models.TP_PRESETS` preset (`cases.preset_cases`) carries the preset,
the layer and ``tp``: they only label it (in its name), and it runs only on ``tp`` ranks
(`Case.world_problem`).

Batch-first and several weights (`layouts`; same FLOPs and bytes as the case without them): ``batch=B`` runs
``all_gather_matmul`` / ``matmul_reduce_scatter`` on batch-first ``[B, m/B, k]`` activations with
``gather_dim=1`` / ``scatter_dim=1`` (name suffix ``/bsh<B>``); ``split=(n_1, ...)`` runs ``all_gather_matmul``
with the weight's columns as several weights, one gather feeding each (``/split<n_1>+...``: q, k and v).

Sequence parallelism (ops ``matmul_all_to_all`` and ``all_to_all_matmul``, `SpCase`): DeepSpeed-Ulysses attention's
two projections with their all-to-alls, in the op table's ``m x k x n`` (`overlap.plans.sp_ops`; not the
tensor-parallel convention above): ``matmul_all_to_all``'s ``a`` is ``[m, k]`` (this rank's sequence shard), ``b``
``[k, n]`` (every head), the output ``[W*m, n/W]`` (this rank's heads over the whole sequence); ``all_to_all_matmul``'s
``a`` is ``[W*m, k/W]``, ``b`` ``[k, n]``, the output ``[m, n]``. FLOPs ``2*m*k*n`` forward (``6*m*k*n`` in
``fwd+bwd``), bytes in ``(W-1)*m*n/W`` (``all_to_all_matmul``: ``(W-1)*m*k/W``) elements, twice that in ``fwd+bwd``
(the backward's reverse exchange). The workload gives each rank one head (``n/W`` or ``k/W`` columns), so those must
divide by ``W`` (`SpCase.world_problem`). The ``torch`` row: the projection, ``all_to_all_single``, the layout copies
around it; the strategies the ops implement (``reference``, ``pipelined``) and ``auto``. The presets
(`models.SP_PRESETS`): Llama-3 8B's attention over a 32k- or 128k-token sequence.

MoE (op ``moe``, `MoECase`): one MoE layer's expert part on the expert-parallel group,
``h, handle = overlap.moe.dispatch_grouped_matmul(x, topk_idx, w1)``, ``a = gelu(h)``,
``y = overlap.moe.grouped_matmul_combine(a, w2, topk_weights, handle)``. Its shape is
``T,H,F,E,K``: ``T`` tokens per rank, hidden ``H``, expert FFN width ``F``, ``E`` experts (split
evenly over the ``W`` ranks, ``L = E/W`` each; ``E`` must divide by ``W``), ``K`` experts per token.
The routing is fixed per case and drawn like a trained router's (`case_data`): loads are uneven, so
``R``, the rows a rank's experts receive, varies between ranks and experts; it averages ``T*K``.

* FLOPs per rank (`MoECase.flops`): the mean over ranks of ``2*R*H*F`` per grouped GEMM, i.e.
  ``4*T*K*H*F`` forward (``h = x_e @ w1[e]``, ``y_e = a_e @ w2[e]``) and ``12*T*K*H*F`` in
  ``fwd+bwd`` (each GEMM's input and weight gradients too). The gelu, the permutations and the
  weighted sum are not counted.
* Bytes (GB/s of the transfers alone): the mean over ranks of the rows it receives from other ranks,
  times ``H`` elements: dispatch (the rows of its experts' pairs from peers) plus combine (its own
  pairs' results from peers), and in ``fwd+bwd`` the two backward transfers again (the output
  gradient's rows to the experts, the input gradient's rows back; all four carry ``H`` columns).
  This depends on the routing, so the workload computes it (`case_data.CaseData.comm_bytes`); with
  uniform routing it is about ``2*T*K*(W-1)/W*H*itemsize`` forward.
* fp8 (dtype ``float8_e4m3fn`` or ``mxfp8``): the dispatch's ``fp8="rowwise"`` or ``fp8="mxfp8"`` on bfloat16
  leaves (`overlap.workloads.moe`): each token quantized once on its owner (per row, or per block of 32 along
  ``H`` with e8m0 scales) and dispatched as a packed row of bytes with its scales, the first grouped GEMM on fp8
  tokens and fp8 ``w1`` (quantized per column along ``H``, or per block), gelu, the second GEMM, the combine and
  the backward in bfloat16. The bytes count the dispatched rows packed (`overlap.plans.dispatch_row_bytes`:
  ``H + 4`` rowwise, ``H + H/32`` MX, for ``H`` a multiple of 4; a GPU pads them to 16, not counted) and every
  other transfer's ``2*H``. The ``torch`` row quantizes on the owner, runs the plain all-to-all of the packed
  bytes and ``torch._scaled_mm`` per expert (dequantized where the device does not take the scales), the rest as
  without fp8. An ``mxfp8`` case needs ``H`` a multiple of 32.

MoE presets (`MOE_PRESETS`): the proportions of real models, scaled down so that a case runs in
milliseconds to tens of milliseconds on 2 CPU ranks (one torch thread each):

* ``mixtral``: Mixtral-8x7B (hidden 4096, expert FFN 14336, 8 experts, top-2) with hidden and FFN
  at 1/32 (128, 448) and the 8 experts, top-2 kept: ``512,128,448,8,2``.
* ``deepseek-v3``: DeepSeek-V3 (hidden 7168, routed-expert FFN 2048, 256 routed experts, top-8; its
  one shared expert is not expert-parallel and is left out) with hidden and FFN at 1/32 (224, 64), top-8
  kept and the experts cut to 32 (1/8): 256 experts on 2 ranks would be 128 GEMMs of ~16 rows per
  rank and pass, a benchmark of the host loop rather than of overlap (DeepSeek-V3 trains with 64-way
  expert parallelism, 4 experts per rank). ``512,224,64,32,8``. What makes it differ from Mixtral is
  kept: each token goes to 8 experts with a narrow FFN, so a layer moves 4x Mixtral's rows per token
  for a quarter of the FLOPs per row.
* ``tiny``: ``32,32,64,4,2``, every dim <= `INTERPRETED_FUSED_MAX_DIM`, for interpreted ``fused``
  (a call costs ~0.2-0.3 s forward, ~0.4-1 s forward and backward even there).
* ``mixtral-full``, ``deepseek-v3-full``: the real widths (DeepSeek-V3 with its 256 experts), 4096
  tokens per rank, the GPU defaults (not yet measured on a GPU).

The balance of compute and communication: per token the layer does ``4*K*H*F`` FLOPs and moves
``2*K*H`` elements (dispatch and combine), ``2*F/itemsize`` FLOPs per byte whatever ``H``, ``K``
and ``E``: 14336 for Mixtral-8x7B in bf16 and 2048 for DeepSeek-V3. A GPU of ~800 bf16 TFLOP/s
does ~2000 FLOPs per byte of NVLink (~400 GB/s) and ~16000 per byte of a 400 Gb/s network link:
Mixtral-8x7B is compute-bound within a node, DeepSeek-V3 about balanced there and
communication-bound across nodes. Scaling ``F`` by 1/32 and running in fp32 divides the ratio by
64 (224 and 32), which is what 2 CPU ranks need for the transfers to matter against their
~40-100 GFLOP/s GEMMs and gloo's latency-bound all-to-alls of ~0.1-0.7 GB/s. Measured on the build
machine (2 ranks, forward), the transfers alone and the GEMMs alone take ~1.5-2.5 and ~3-3.5 ms
for ``mixtral`` and ~5-6.5 and ~4-5 ms for ``deepseek-v3`` (whose narrow GEMMs also run slower):
the scaled Mixtral is the compute-heavier, the scaled DeepSeek-V3 the communication-heavier,
as the real models are, and each has enough of both for overlap to matter. The CPU presets run
in fp32: bf16 GEMMs use AMX on the build machine, several times faster, and would take a
negligible share of the layer at these widths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..plans import FP8_DTYPES, Problem
from ..plans import OPS as OP_TABLE
from ..plans.optable import MX_BLOCK, MX_DTYPE, torch_dtype
from .models import LAYERS, SP_LAYERS, SP_PRESETS, TP_PRESETS
from .names import (
    AUTO,
    BENCH_OPS,
    DEFAULT_OPS,
    DTYPE_NAMES,
    INTERPRETED_FUSED_MAX_DIM,
    MODES,
    MOE_OPS,
    MOE_PRESETS,
    SP_OPS,
    STRATEGY_NAMES,
    TORCH,
    TP_OPS,
    VARIANT_FLAGS,
    MoEShape,
    all_bench_labels,
    all_strategy_labels,
    bench_labels,
    parse_moe_shape,
    parse_shape,
    strategy_labels,
    variant_labels,
)

__all__ = [
    "AUTO", "BENCH_OPS", "DEFAULT_OPS", "DTYPES", "FP8_DTYPES", "FP8_OPS", "INTERPRETED_FUSED_MAX_DIM", "MODES",
    "MOE_OPS", "MOE_PRESETS", "OPS", "SP_OPS", "TORCH", "VARIANTS", "AnyCase", "Case", "MoECase", "MoEShape", "SpCase",
    "all_bench_labels",
    "all_strategy_labels", "bench_labels", "label_plan", "parse_moe_shape", "parse_shape", "strategy_labels",
]

#: the dtypes a case may have (`DTYPE_NAMES`), as torch's
DTYPES: dict[str, torch.dtype] = {name: torch_dtype(name) for name in DTYPE_NAMES}

#: the tensor-parallel ops of the op table, each benchmarked as ``overlap.<op>`` at a shape ``m x k x n``
#: (`Case`; bench/soak.py runs these too, by that name)
OPS = TP_OPS
#: the ops with fp8 cases (dtype in `FP8_DTYPES`: the ``fp8="rowwise"`` or ``fp8="mxfp8"`` recipe; the MoE layer's
#: on its dispatch)
FP8_OPS = tuple(name for name in BENCH_OPS if OP_TABLE[name].fp8)

#: strategy labels beyond `plan.STRATEGIES`, per op: label -> (strategy, fields of its `overlap.Plan`)
#: (an op's `OpSpec.variants`: ``matmul_all_reduce``'s ``one_shot``)
VARIANTS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    op: {label: (s, {flag: True}) for label, (s, flag) in variant_labels(op).items()} for op in VARIANT_FLAGS
}


def label_plan(op: str, label: str) -> tuple[str, dict[str, Any]]:
    """``(strategy, Plan fields)`` of a row label of `op` (``torch`` and ``auto`` are their own strategy);
    raises ValueError for an unknown label."""
    if label in STRATEGY_NAMES or label in (TORCH, AUTO):
        return label, {}
    if label in VARIANTS.get(op, {}):
        return VARIANTS[op][label]
    raise ValueError(f"{op} has no strategy label {label!r}; known: {bench_labels(op)}")


class _CaseNames:
    """What both kinds of case read from their `problem` (the op table's `Problem`: op, shape, dtype, mode)."""

    problem: Problem

    @property
    def op(self) -> str:
        return self.problem.op

    @property
    def dtype(self) -> str:
        return self.problem.dtype

    @property
    def backward(self) -> bool:
        return self.problem.backward

    @property
    def mode(self) -> str:
        return MODES[int(self.backward)]

    @property
    def name(self) -> str:
        return f"{self.op} {self.shape} {self.dtype} {self.mode}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def flops(self, world_size: int) -> int:
        """Floating-point operations of one call on one rank (the op table's: see the module docstring)."""
        return self.problem.spec.flops(self.problem, world_size)


def _check_mode(dtype: Any, backward: Any, dtypes: tuple[str, ...], what: str = "dtype") -> None:
    if dtype not in dtypes:
        raise ValueError(f"{what} must be one of {dtypes}, got {dtype!r}")
    if not isinstance(backward, bool):
        raise ValueError(f"backward must be a bool, got {backward!r}")


class _GemmCase(_CaseNames):
    """What the cases of one GEMM ``m x k x n`` per rank (the tensor- and sequence-parallel ops) read from their
    `problem`."""

    @staticmethod
    def check_dims(m: Any, k: Any, n: Any) -> None:
        for name, v in (("m", m), ("k", k), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    @property
    def m(self) -> int:
        return self.problem.m

    @property
    def k(self) -> int:
        return self.problem.k

    @property
    def n(self) -> int:
        return self.problem.n

    def comm_bytes(self, world_size: int) -> int:
        """Bytes one rank receives in one call's plain collectives (the op table's; the module docstring)."""
        return self.problem.spec.comm_bytes(self.problem, world_size)

    @property
    def fits_interpreted_fused(self) -> bool:
        return max(self.m, self.k, self.n) <= INTERPRETED_FUSED_MAX_DIM


@dataclasses.dataclass(frozen=True)
class Case(_GemmCase):
    """One benchmark case of a tensor-parallel op: its `problem` (op, per-rank shape ``m x k x n`` (see the module
    docstring), dtype, forward only or forward plus backward) and how the run lays it out and labels it. Made by
    `Case.of`, which names the problem's fields."""

    problem: Problem
    preset: str = ""  # a `models.TP_PRESETS` name, with `layer` and `tp`: the problem of that model's layer
    layer: str = ""  # ... at tensor-parallel size `tp` (`preset_cases`); they only label the case
    tp: int = 0
    batch: int = 0  # batch-first [batch, m/batch, k], the sequence on dim 1 (`layouts`); 0: sequence-first [m, k]
    split: tuple[int, ...] = ()  # all_gather_matmul: the weight's n columns as several weights (`layouts`)

    @classmethod
    def of(cls, op: str, m: int, k: int, n: int, dtype: str = "float32", backward: bool = False, **labels: Any) -> Case:
        """The case of `op` at ``m x k x n`` in `dtype` (a name of `DTYPES`), `backward` or not, with the
        layout and labels of the fields above. Raises ValueError naming the field that is wrong."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known: {OPS}")
        cls.check_dims(m, k, n)
        _check_mode(dtype, backward, tuple(DTYPES))
        if dtype in FP8_DTYPES and op not in FP8_OPS:
            raise ValueError(f"{dtype} (the fp8 recipe) is benchmarked for {FP8_OPS}, sequence-first with one "
                             f"weight: got {op}")
        return cls(Problem(op, m, k, n, dtype, backward), **labels)

    def __post_init__(self) -> None:
        if not isinstance(self.problem, Problem) or self.problem.op not in OPS:
            raise ValueError(f"a Case's problem is a Problem of one of {OPS}, got {self.problem!r}")
        object.__setattr__(self, "split", tuple(self.split))
        spec = self.problem.spec
        if self.batch and (isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 0
                           or not spec.dim_arg or self.m % self.batch):
            raise ValueError(f"batch must be an int >= 1 dividing m={self.m}, for an op with a gather or scatter "
                             f"dim, got {self.batch!r} ({self.op})")
        if self.split and (not spec.several_weights or sum(self.split) != self.n
                           or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.split)):
            raise ValueError(f"split must be ints >= 1 summing to n={self.n}, for an op taking several weights, "
                             f"got {self.split!r} ({self.op})")
        if self.preset or self.layer or self.tp:
            layers = [name for name, ops in LAYERS if self.op in ops]
            if self.preset not in TP_PRESETS or self.layer not in layers or not isinstance(self.tp, int) or self.tp < 1:
                raise ValueError(
                    f"a preset case needs preset in {tuple(TP_PRESETS)}, a layer of {self.op} in {layers} and tp >= 1, "
                    f"got preset={self.preset!r}, layer={self.layer!r}, tp={self.tp!r}"
                )
        _check_mode(self.dtype, self.backward, tuple(DTYPES))
        if self.dtype in FP8_DTYPES and (self.op not in FP8_OPS or self.batch or self.split):
            raise ValueError(f"{self.dtype} (the fp8 recipe) is benchmarked for {FP8_OPS}, sequence-first with one "
                             "weight: "
                             f"got {self.op}" + (f", batch={self.batch}" if self.batch else "")
                             + (f", split={self.split}" if self.split else ""))

    @property
    def shape(self) -> str:
        dims = f"{self.m}x{self.k}x{self.n}"
        dims += f"/bsh{self.batch}" if self.batch else ""
        dims += f"/split{'+'.join(map(str, self.split))}" if self.split else ""
        return f"{self.preset}/{self.layer}:{dims}" if self.preset else dims

    def shape_fields(self) -> dict[str, Any]:
        """The shape as fields of a result row."""
        return {"m": self.m, "k": self.k, "n": self.n, "preset": self.preset or None, "layer": self.layer or None,
                "batch": self.batch or None, "split": list(self.split) or None}

    def record(self) -> dict[str, Any]:
        """The case as the JSON record of a run names it (the arguments of `of`)."""
        return {"op": self.op, "m": self.m, "k": self.k, "n": self.n, "dtype": self.dtype, "backward": self.backward,
                "preset": self.preset, "layer": self.layer, "tp": self.tp, "batch": self.batch,
                "split": list(self.split)}

    def world_problem(self, world_size: int) -> str | None:
        """Why the case cannot run on `world_size` ranks, or None: any shape runs on any number of ranks,
        but a preset's shapes are its layer's at one tensor-parallel size."""
        if self.tp and self.tp != world_size:
            return f"{self.name}: the {self.preset} shapes were cut for {self.tp} ranks, not {world_size}"
        return None


@dataclasses.dataclass(frozen=True)
class MoECase(_CaseNames):
    """One MoE benchmark case: its `problem` (op ``moe``: ``m, k, n`` = tokens per rank, hidden, expert FFN, with
    its experts and top-k; dtype; forward only or forward plus backward). `preset` names a `MOE_PRESETS` entry
    (empty for a custom shape); it only labels the case. Made by `MoECase.of` from an `MoEShape`."""

    problem: Problem
    preset: str = ""

    @classmethod
    def of(cls, dims: MoEShape, dtype: str = "float32", backward: bool = False, preset: str = "") -> MoECase:
        """The case of the MoE layer at `dims` in `dtype` (a name of `DTYPES`; fp8: the dispatch's recipe, ``mxfp8``
        with a hidden size that divides by 32). Raises ValueError."""
        if not isinstance(dims, MoEShape):
            raise ValueError(f"dims must be an MoEShape, got {dims!r}")
        _check_mode(dtype, backward, tuple(DTYPES), "an MoE case's dtype")
        if dtype == MX_DTYPE and dims.hidden % MX_BLOCK:
            raise ValueError(f"{MX_DTYPE} needs the hidden size a multiple of {MX_BLOCK}, got {dims.hidden}")
        d = dims
        return cls(Problem(MOE_OPS[0], d.tokens, d.hidden, d.ffn, dtype, backward, d.experts, d.top_k), preset)

    def __post_init__(self) -> None:
        if not isinstance(self.problem, Problem) or self.problem.op not in MOE_OPS:
            raise ValueError(f"an MoECase's problem is a Problem of one of {MOE_OPS}, got {self.problem!r}")
        _check_mode(self.dtype, self.backward, tuple(DTYPES), "an MoE case's dtype")
        if self.preset and self.preset not in MOE_PRESETS:
            raise ValueError(f"unknown MoE preset {self.preset!r}; known: {tuple(MOE_PRESETS)}")

    @property
    def dims(self) -> MoEShape:
        """The layer's ``T,H,F,E,K`` (`problem`'s tokens, hidden, FFN, experts, top-k)."""
        p = self.problem
        return MoEShape(p.m, p.k, p.n, p.experts, p.top_k)

    @property
    def shape(self) -> str:
        return f"{self.preset}:{self.dims.spec}" if self.preset else self.dims.spec

    @property
    def fits_interpreted_fused(self) -> bool:
        m = self.dims
        return max(m.tokens, m.hidden, m.ffn) <= INTERPRETED_FUSED_MAX_DIM

    def shape_fields(self) -> dict[str, Any]:
        """The shape as fields of a result row."""
        return {"preset": self.preset or None, **dataclasses.asdict(self.dims)}

    def record(self) -> dict[str, Any]:
        """The case as the JSON record of a run names it (the arguments of `of`, and the op)."""
        return {"dims": dataclasses.asdict(self.dims), "dtype": self.dtype, "backward": self.backward,
                "preset": self.preset, "op": self.op}

    def world_problem(self, world_size: int) -> str | None:
        """Why the case cannot run on `world_size` ranks (experts that do not split evenly), or None."""
        if self.dims.experts % world_size:
            return f"{self.name}: {self.dims.experts} experts do not split evenly over {world_size} ranks"
        return None


@dataclasses.dataclass(frozen=True)
class SpCase(_GemmCase):
    """One benchmark case of a sequence-parallel op (``matmul_all_to_all``, ``all_to_all_matmul``): its `problem`
    (the op's ``m x k x n``, `overlap.plans.sp_ops`: ``m`` rows of this rank's sequence shard, the projection
    ``[k, n]``; dtype; forward only or forward plus backward). `preset`, `layer` and `sp` label a case of a
    `models.SP_PRESETS` layer cut for `sp` ranks (`cases.sp_preset_cases`), which runs only there. Made by
    `SpCase.of`."""

    problem: Problem
    preset: str = ""
    layer: str = ""
    sp: int = 0

    @classmethod
    def of(cls, op: str, m: int, k: int, n: int, dtype: str = "float32", backward: bool = False,
           **labels: Any) -> SpCase:
        """The case of `op` at ``m x k x n`` in `dtype` (no fp8: the family has no recipe), `backward` or not.
        Raises ValueError naming the field that is wrong."""
        if op not in SP_OPS:
            raise ValueError(f"unknown sequence-parallel op {op!r}; known: {SP_OPS}")
        cls.check_dims(m, k, n)
        _check_mode(dtype, backward, tuple(d for d in DTYPES if d not in FP8_DTYPES),
                    "a sequence-parallel case's dtype (no fp8 recipe)")
        return cls(Problem(op, m, k, n, dtype, backward), **labels)

    def __post_init__(self) -> None:
        if not isinstance(self.problem, Problem) or self.problem.op not in SP_OPS:
            raise ValueError(f"an SpCase's problem is a Problem of one of {SP_OPS}, got {self.problem!r}")
        if self.preset or self.layer or self.sp:
            layers = [name for name, op in SP_LAYERS if op == self.op]
            if self.preset not in SP_PRESETS or self.layer not in layers or isinstance(self.sp, bool) \
                    or not isinstance(self.sp, int) or self.sp < 1:
                raise ValueError(
                    f"a preset case needs preset in {tuple(SP_PRESETS)}, a layer of {self.op} in {layers} and sp >= 1, "
                    f"got preset={self.preset!r}, layer={self.layer!r}, sp={self.sp!r}")

    @property
    def shape(self) -> str:
        dims = f"{self.m}x{self.k}x{self.n}"
        return f"{self.preset}/{self.layer}:{dims}" if self.preset else dims

    def shape_fields(self) -> dict[str, Any]:
        """The shape as fields of a result row."""
        return {"m": self.m, "k": self.k, "n": self.n, "preset": self.preset or None, "layer": self.layer or None}

    def record(self) -> dict[str, Any]:
        """The case as the JSON record of a run names it (the arguments of `of`)."""
        return {"op": self.op, "m": self.m, "k": self.k, "n": self.n, "dtype": self.dtype, "backward": self.backward,
                "preset": self.preset, "layer": self.layer, "sp": self.sp}

    def world_problem(self, world_size: int) -> str | None:
        """Why the case cannot run on `world_size` ranks, or None: a preset's shapes are its layer's at one
        sequence-parallel size; the heads' columns (``matmul_all_to_all``'s ``n``, ``all_to_all_matmul``'s ``k``) must
        divide by the ranks (the workload gives each rank one head of ``n/W`` or ``k/W`` columns)."""
        if self.sp and self.sp != world_size:
            return f"{self.name}: the {self.preset} shapes were cut for {self.sp} ranks, not {world_size}"
        why = self.problem.spec.split_problem(self.problem, world_size)
        return f"{self.name}: {why}" if why else None


AnyCase = Case | MoECase | SpCase


