"""Tuning: probes of a machine's links, GEMM rates and interference (`probe`: the package `probing`, its measuring
steps in `probing.steps`), fitted (`fits`) and cached per machine (`cache`). The search and measurement that write
plan files live beside them (`search`; each candidate's trial call is its workload's: `overlap.workloads.trial`).
"""

from __future__ import annotations

from .cache import cache_dir, cache_path, load_cached, save_cached
from .fits import fit_gemm, fit_line, fit_link, format_profile
from .probing import probe, probe_cached

__all__ = [
    "cache_dir",
    "cache_path",
    "fit_gemm",
    "fit_line",
    "fit_link",
    "format_profile",
    "load_cached",
    "probe",
    "probe_cached",
    "save_cached",
]
