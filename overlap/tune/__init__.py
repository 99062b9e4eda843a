"""Tuning: probes of a machine's links, GEMM rates and interference (`probe`), cached per machine.

`overlap.tune.probe` is the function here (it shadows the module of the same name as an attribute;
``from overlap.tune.probe import ...`` still imports from the module). The search and measurement
that write plan files live beside it (DESIGN.md, "tuning" layer).
"""

from __future__ import annotations

from .cache import cache_dir, cache_path, load_cached, save_cached
from .fits import fit_gemm, fit_line, fit_link, format_profile
from .probe import probe, probe_cached

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
