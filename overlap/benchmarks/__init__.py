"""Benchmarks of the fused ops: one definition of the cases (`cases`: the tensor-parallel ops at
``m x k x n`` or a real model's layer, `models`: the Llama-3 presets; the MoE layer at ``T,H,F,E,K``
with presets of real models' proportions; what a case is: `definitions`), what each op's benchmark
computes (`workloads`), one runner (`runner`: each case checked by `checks`, then timed by
`timing`), and its outputs: the table and JSON (`report`), a progress bar (`progress`),
``--compare`` (`compare`) and ``--plot`` (`plot`, matplotlib).

``overlap bench`` runs them on locally started ranks (or in place under torchrun); the
pytest-benchmark wrappers in the top-level ``bench/`` run the same cases on a standing pool of
ranks (`session`), and the other ``bench/`` scripts reuse them too.
"""

from .cases import (
    BENCH_OPS,
    MODES,
    MOE_OPS,
    MOE_PRESETS,
    OPS,
    SUITES,
    Case,
    MoECase,
    MoEShape,
    default_cases,
    parse_moe_shape,
    parse_shape,
    preset_cases,
    suite_cases,
)
from .models import TP_PRESETS, DenseModel, tp_problems

__all__ = [
    "BENCH_OPS",
    "MODES",
    "MOE_OPS",
    "MOE_PRESETS",
    "OPS",
    "SUITES",
    "TP_PRESETS",
    "Case",
    "DenseModel",
    "MoECase",
    "MoEShape",
    "default_cases",
    "parse_moe_shape",
    "parse_shape",
    "preset_cases",
    "suite_cases",
    "tp_problems",
]
