"""Benchmarks of the fused ops: one definition of the cases (`cases`), what each op's benchmark
computes (`workloads`), one runner (`runner`).

``overlap bench`` runs them on locally started ranks (or in place under torchrun); the
top-level ``bench/`` scripts reuse the same cases.
"""

from .cases import MODES, OPS, Case, default_cases, parse_shape

__all__ = ["MODES", "OPS", "Case", "default_cases", "parse_shape"]
