"""Benchmarks of the fused ops: one definition of the cases (`cases`: the tensor-parallel ops at
``m x k x n``, the MoE layer at ``T,H,F,E,K`` with presets of real models' proportions), what each
op's benchmark computes (`workloads`), one runner (`runner`).

``overlap bench`` runs them on locally started ranks (or in place under torchrun); the
top-level ``bench/`` scripts reuse the same cases.
"""

from .cases import (
    BENCH_OPS,
    MODES,
    MOE_OPS,
    MOE_PRESETS,
    OPS,
    Case,
    MoECase,
    MoEShape,
    default_cases,
    parse_moe_shape,
    parse_shape,
)

__all__ = [
    "BENCH_OPS",
    "MODES",
    "MOE_OPS",
    "MOE_PRESETS",
    "OPS",
    "Case",
    "MoECase",
    "MoEShape",
    "default_cases",
    "parse_moe_shape",
    "parse_shape",
]
