"""The benchmark cases: one definition, used by ``overlap bench`` and by the ``bench/`` scripts.

A `Case` is one op at one shape and dtype, timed forward only (mode ``fwd``) or forward plus
backward (``fwd+bwd``).

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

Modes. ``fwd+bwd`` times the forward and the backward of a fresh output: three GEMMs
(``6*W*m*k*n`` FLOPs) and, per Megatron's conventions (DESIGN.md), more communication:
``all_gather_matmul`` gathers ``a`` again and reduce-scatters ``grad_a`` (``+2*(W-1)*m*k``),
``matmul_reduce_scatter`` all-gathers ``grad_out`` (``+(W-1)*m*n``), ``matmul_all_reduce`` passes
the gradient through (no more).

Strategy labels: the four strategies, and for ``matmul_all_reduce`` their ``+one_shot`` variants
(`VARIANTS`: every rank sums every rank's whole partial in one step; the plain labels are the
two-shot reduce-scatter + all-gather).

Default CPU cases (2 gloo ranks on a 2-core machine, one torch thread per rank): the same three
shapes for every op, each forward and forward+backward, 18 cases. The GEMMs are large enough that
a call takes milliseconds to tens of milliseconds, far above timer and barrier noise (~0.1 ms).
There are fewer and smaller shapes per op than the single-op benchmark had (five, up to
1024x1024x2048 in fp32), with the same 3 warm-up calls and 10 repeats, so that the whole default
``overlap bench`` stays within about a minute including rank start-up.
The last shape is small enough (every dim <= `INTERPRETED_FUSED_MAX_DIM`) for the interpreted
``fused`` kernels, whose timings are labelled and left out of the summaries; it is 32x64x64, as an
interpreted call costs ~0.1 s even there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..plan import STRATEGIES

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ops the runner knows how to benchmark
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

#: ``fwd``: the forward alone; ``fwd+bwd``: forward, then backward of the fresh output
MODES = ("fwd", "fwd+bwd")

#: strategy labels beyond `plan.STRATEGIES`, per op: label -> (strategy, fields of its `overlap.Plan`)
VARIANTS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "matmul_all_reduce": {f"{s}+one_shot": (s, {"one_shot": True}) for s in STRATEGIES if s != "reference"},
}

#: the Triton interpreter runs a GEMM tile by tile in numpy: only tiny shapes finish in time
INTERPRETED_FUSED_MAX_DIM = 128


def strategy_labels(op: str) -> tuple[str, ...]:
    """The strategy labels `op` can be benchmarked under, each variant after its strategy."""
    variants = VARIANTS.get(op, {})
    return tuple(label for s in STRATEGIES for label in (s, *(v for v in variants if variants[v][0] == s)))


def all_strategy_labels() -> tuple[str, ...]:
    """Every label of every op, in `plan.STRATEGIES` order, each variant after its strategy."""
    return tuple(
        dict.fromkeys(
            label for s in STRATEGIES for op in OPS for label in strategy_labels(op) if label_plan(op, label)[0] == s
        )
    )


def label_plan(op: str, label: str) -> tuple[str, dict[str, Any]]:
    """``(strategy, Plan fields)`` of a strategy label of `op`; raises ValueError for an unknown label."""
    if label in STRATEGIES:
        return label, {}
    if label in VARIANTS.get(op, {}):
        return VARIANTS[op][label]
    raise ValueError(f"{op} has no strategy label {label!r}; known: {strategy_labels(op)}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: `op` at per-rank shape ``m x k x n`` (see the module docstring) in
    `dtype` (a name of `DTYPES`), forward only or, with `backward`, forward plus backward."""

    op: str
    m: int
    k: int
    n: int
    dtype: str = "float32"
    backward: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {OPS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("m", "k", "n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.backward, bool):
            raise ValueError(f"backward must be a bool, got {self.backward!r}")

    @property
    def mode(self) -> str:
        return MODES[int(self.backward)]

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"

    @property
    def name(self) -> str:
        return f"{self.op} {self.shape} {self.dtype} {self.mode}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def flops(self, world_size: int) -> int:
        """Floating-point operations of one call on one rank: ``2*W*m*k*n`` per GEMM, 3 GEMMs in fwd+bwd."""
        return (3 if self.backward else 1) * 2 * world_size * self.m * self.k * self.n

    def comm_bytes(self, world_size: int) -> int:
        """Bytes one rank receives in one call's plain collectives (see the module docstring)."""
        per_rank = (world_size - 1) * self.m
        if self.op == "all_gather_matmul":
            elements = per_rank * self.k * (3 if self.backward else 1)
        elif self.op == "matmul_reduce_scatter":
            elements = per_rank * self.n * (2 if self.backward else 1)
        else:
            elements = 2 * per_rank * self.n
        return elements * self.torch_dtype.itemsize

    @property
    def fits_interpreted_fused(self) -> bool:
        return max(self.m, self.k, self.n) <= INTERPRETED_FUSED_MAX_DIM


# (m, k, n, dtype, modes) per device type, for every op (one shape costs every op the same GEMMs)
_DEFAULTS: dict[str, list[tuple[int, int, int, str, tuple[str, ...]]]] = {
    "cpu": [
        # fp32 GEMMs run ~5x slower than bf16 on the 2-core machine: a quarter of the rows
        (256, 1024, 1024, "float32", MODES),
        (1024, 1024, 1024, "bfloat16", MODES),
        (32, 64, 64, "float32", MODES),  # small enough for interpreted fused
    ],
    # Projections of 8k-hidden models (per-rank sequence slice x hidden or shard x shard or hidden).
    # Not yet measured on a GPU.
    "cuda": [
        (1024, 8192, 8192, "bfloat16", MODES),
        (2048, 8192, 3584, "bfloat16", ("fwd",)),
        (4096, 8192, 8192, "bfloat16", MODES),
        (4096, 8192, 8192, "float16", ("fwd",)),
    ],
}


def default_cases(
    op: str | Sequence[str] = OPS,
    device_type: str = "cpu",
    dtype: str | None = None,
    modes: Sequence[str] = MODES,
) -> list[Case]:
    """The default cases of `op` (one name or several) for ranks on `device_type` (``"cpu"`` or
    ``"cuda"``), in the given `modes` (see `MODES`), grouped by op, then shape, then mode.

    `dtype` (a name of `DTYPES`) replaces every case's own dtype when given.
    Raises ValueError for an unknown op, device type, dtype or mode.
    """
    ops = (op,) if isinstance(op, str) else tuple(op)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known: {OPS}")
    bad_modes = [m for m in modes if m not in MODES]
    if bad_modes:
        raise ValueError(f"unknown modes {bad_modes}; known: {MODES}")
    if device_type not in _DEFAULTS:
        raise ValueError(f"no default cases for device type {device_type!r}; known: {tuple(_DEFAULTS)}")
    cases = [
        Case(o, m, k, n, dtype or dt, backward=mode == "fwd+bwd")
        for o in ops
        for m, k, n, dt, case_modes in _DEFAULTS[device_type]
        for mode in MODES
        if mode in case_modes and mode in modes
    ]
    return list(dict.fromkeys(cases))  # a dtype override can make two cases equal


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"MxKxN"`` -> ``(m, k, n)``, each a positive int. Raises ValueError otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3:
        raise ValueError(f"shape must be MxKxN (three positive ints joined by 'x'), got {text!r}")
    try:
        m, k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape must be MxKxN (three positive ints joined by 'x'), got {text!r}") from None
    if min(m, k, n) < 1:
        raise ValueError(f"every dim of the shape must be >= 1, got {text!r}")
    return m, k, n
