"""The machine profile the GPU check measures on its one GPU (a step of tests/gpu/timings.py): GEMM fits per dtype
(square GEMMs, Triton's ``do_bench``) and the HBM rate of a device-to-device copy, written into the profile cache
(``OVERLAP_CACHE_DIR``) under the GPU's name. ``overlap predict --machine`` and ``overlap tune --machine`` then take
its numbers for that GPU's preset, the links, interference and per-call costs staying the preset's (one GPU
measures no link: `overlap.plans.presets.completed`). The record carries the profile too, so it comes back from
the GPU machine with the timings.

`build` (from measured samples) and `save` run anywhere; `measure` needs the GPU.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from overlap.plans import Profile
from overlap.tune.cache import profile_path, save_profile
from overlap.tune.fits import fit_gemm

#: the square GEMM sides measured per dtype (the fit needs a spread of sizes: launch-bound to peak-bound)
SIDES = (1024, 2048, 4096, 8192)
#: the dtypes measured (fp8 where this torch's ``_scaled_mm`` runs on the GPU)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


def build(device: str, samples: Mapping[str, Sequence[tuple[float, float]]], hbm_Bps: float) -> Profile:
    """The profile of one GPU named `device` from ``samples[dtype] = [(flops, seconds), ...]`` and the HBM rate
    (bytes read plus written per second): a `GemmFit` per dtype with that memory rate, no link."""
    gemm = {d: dataclasses.replace(fit_gemm([f for f, _ in xs], [t for _, t in xs]), memory_Bps=hbm_Bps)
            for d, xs in samples.items() if xs}
    return Profile(links={}, gemm=gemm, device=device,
                   machine=f"{socket.gethostname()}: the GPU check's timings on one GPU (GEMMs and HBM measured; "
                   "links, interference and per-call costs not: its preset's)")


def save(profile: Profile) -> Path:
    """Write `profile` where the profile cache keeps one GPU's (`overlap.tune.cache.profile_path`)."""
    path = profile_path(profile.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_profile(profile, path)


def _gemm(dtype: str, side: int, device: torch.device) -> Callable[[], object] | None:
    """One square GEMM of `dtype` as a call (fp8: ``torch._scaled_mm`` with unit scales), None where it cannot run."""
    if dtype == "float8_e4m3fn":
        if not hasattr(torch, "_scaled_mm"):
            return None
        a = torch.randn(side, side, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(side, side, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
        one = torch.ones((), device=device)
        try:
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        except (RuntimeError, TypeError):
            return None
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    a = torch.randn(side, side, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(side, side, device=device, dtype=getattr(torch, dtype))
    return lambda: torch.matmul(a, b)


def measure(device: torch.device, bench: Callable[[Callable[[], object]], float], hbm_Bps: float) -> Profile:
    """Time the square GEMMs of `DTYPES` at `SIDES` on `device` with `bench` (median milliseconds of a call) and
    build the profile (GPU only)."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for dtype in DTYPES:
        for side in SIDES:
            call = _gemm(dtype, side, device)
            if call is None:
                break
            samples.setdefault(dtype, []).append((2.0 * side**3, bench(call) * 1e-3))
    return build(torch.cuda.get_device_name(device), samples, hbm_Bps)
