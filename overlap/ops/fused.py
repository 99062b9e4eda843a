"""The host side of the ``fused`` strategy that the ops share: importing the Triton kernels, tiles.

The kernels' launchers (argument checks, grids, the interpreter's watchdog) are the kernels' own
(`overlap.kernels`); this module imports them lazily, so that a missing Triton fails only the calls that
need it. Where no GPU exists the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``import overlap``).
"""

from __future__ import annotations

import functools

import torch

from .. import envs

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET``)."""
    return envs.triton_interpret()


@functools.cache
def kernels():
    """`overlap.kernels` (the kernels and their launchers), imported on first use.

    Raises:
        RuntimeError: Triton does not import here.
    """
    try:
        from .. import kernels as k
    except ImportError as exc:
        raise RuntimeError(f"overlap: the 'fused' strategy needs Triton, which failed to import: {exc}") from exc
    return k


def fused_tiles(block_m: int, block_n: int, block_k: int, interpreted: bool,
                dtype: torch.dtype) -> tuple[int, int, int]:
    """Tile shape of a fused GEMM kernel: the plan's, else a default per dtype (small when interpreted)."""
    if block_m:
        return block_m, block_n or block_m, block_k or 32
    if interpreted:
        return 32, 32, 32
    return (128, 128, 64) if dtype != torch.float32 else (128, 64, 32)


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints."""
    return (x + y - 1) // y


def check_fused_available(op: str, dtype: torch.dtype) -> None:
    """Raise (before the handshake) where the fused strategy cannot run: dtype, or Triton missing."""
    if dtype not in FUSED_DTYPES:
        raise TypeError(f"overlap.{op}: the fused kernel supports {FUSED_DTYPES}, got {dtype}")
    try:
        kernels()  # import (and define) the Triton kernels before the handshake
    except RuntimeError as exc:
        raise ValueError(f"overlap.{op}: strategy 'fused' is unavailable here: {exc}") from exc
