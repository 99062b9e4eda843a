"""What a GPU test (tests/gpu) compares and how it reports: the dtypes' tolerances and rounding bounds
(`compare`, `compare_bound`, `block_rel_err`), and `verdict`: a test fails with every problem it found, or notes its
figures (max error, time waited), which tests/gpu/conftest.py hands to the record (``record_property``). Imports torch
only: the GPU check's timings use it too."""

from __future__ import annotations

import math
from typing import Any

import torch

# rtol, atol (docs/design.md). fp32 is CPU only: on GPUs the kernel's fp32 dot is TF32.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1.6e-2, 1e-2)}


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
    """(within the dtype's tolerance and all finite, max |out - ref|, ||out - ref|| / ||ref||)."""
    rtol, atol = TOLERANCES[out.dtype]
    got = out.to(ref.dtype)
    if not bool(torch.isfinite(got).all()):
        return False, math.nan, math.nan
    diff = (got - ref).abs()
    ok = bool((diff <= atol + rtol * ref.abs()).all())
    return ok, float(diff.max()), float(diff.norm() / ref.norm().clamp_min(1e-30))


# Checks of sums of rounded terms (reductions across ranks, and every output against a float64 exact
# result): the unit roundoff of a stored value, a float32 accumulation's per-term roundoff, and the
# worst relative error (by norm) a 64x64 block of the output may have. TF32 (a fp32 tl.dot on Hopper)
# keeps 10 mantissa bits of each input; the tensor cores truncate, so an input is off by up to 2^-10.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
TF32_ROUNDOFF = 2.0**-10
TF32_BLOCK_RTOL = 1e-2
FP32_ACCUMULATE = 2.0**-24
BLOCK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
BLOCK = 64


def block_rel_err(err: torch.Tensor, exact: torch.Tensor, block: int = BLOCK) -> float:
    """Worst ``||err|| / ||exact||`` over the ``block x block`` blocks of a matrix (``[..., n]`` flattened
    to 2-D). A whole-tensor norm would hide one wrong tile of a large output; a block cannot."""
    e2, x2 = err.reshape(-1, err.shape[-1]).double() ** 2, exact.reshape(-1, exact.shape[-1]).double() ** 2
    rows, cols = e2.shape
    if rows == 0 or cols == 0:
        return 0.0
    pad = (0, (-cols) % block, 0, (-rows) % block)
    e2, x2 = torch.nn.functional.pad(e2, pad), torch.nn.functional.pad(x2, pad)
    r, c = e2.shape[0] // block, e2.shape[1] // block
    num = e2.view(r, block, c, block).sum(dim=(1, 3))
    den = x2.view(r, block, c, block).sum(dim=(1, 3))
    return float((num / den.clamp_min(1e-300)).sqrt().max())


def compare_bound(
    out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, block_rtol: float
) -> tuple[bool, float, float]:
    """(every element finite and within `bound` of `exact`, and every 64x64 block within `block_rtol`
    of it by norm; max |out - exact|; the worst block's relative error).

    `bound` is a rigorous rounding bound (e.g. ``u * sum of the rounded terms' magnitudes``): it lets a
    sum that rounds at a different place pass wherever terms cancel, where a tolerance relative to the
    result would not, and it alone is loose where many terms add up; the block norm then catches a
    missing, stale or doubled partial, which is off by a whole term on every element of its tile."""
    got = out.double()
    if got.shape != exact.shape:
        return False, math.inf, math.inf
    if not bool(torch.isfinite(got).all()):
        return False, math.nan, math.nan
    err = (got - exact).abs()
    rel = block_rel_err(err, exact)
    ok = bool((err <= bound).all()) and rel <= block_rtol
    return ok, float(err.max()) if err.numel() else 0.0, rel


def err_text(max_err: float, rel: float) -> str:
    return f"max {max_err:.1e}, rel {rel:.1e}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_notes: list[tuple[str, Any]] = []  # what the running test noted (conftest.py takes them after each test)


def note(summary: str, **figures: Any) -> None:
    """Keep `summary` and `figures` (numbers) of the running test for the record."""
    _notes.append(("summary", summary))
    _notes.extend(figures.items())


def take_notes() -> list[tuple[str, Any]]:
    """What the running test noted, emptied."""
    taken = list(_notes)
    _notes.clear()
    return taken


def verdict(problems: list[str], summary: str, **figures: Any) -> None:
    """Fail the running test with every problem found; else note `summary` and `figures` for the record."""
    if problems:
        raise AssertionError("; ".join(problems))
    note(summary, **figures)
