"""The host side of the ``fused`` strategy that the ops share: importing the Triton kernels.

The kernels' launchers (argument checks, grids, the interpreter's watchdog), default tiles (`fused_tiles`) and
tile tables are the kernels' own (`overlap.kernels`); this module imports the kernel modules lazily, so that a
missing Triton fails only the calls that need it (`overlap.kernels.slots`, the slot layouts, needs no Triton).
Where no GPU exists the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``import overlap``
where it is unset); a user who turned the interpreter off there (``TRITON_INTERPRET=0``, as Triton reads it:
`overlap.envs.triton_interpret`) gets one ValueError saying so before the handshake, not Triton's "0 active
drivers" from inside a launch.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import torch

from .. import envs
from ..kernels.host import cdiv, fused_tiles  # noqa: F401 - the ops call them as fused.*

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET``)."""
    return envs.triton_interpret()


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernel modules of `overlap.kernels`, one per op with a fused form (each holds its kernels, their
    launchers and the tile tables they take)."""

    all_gather_matmul: types.ModuleType
    all_gather_weight_matmul: types.ModuleType
    matmul_reduce_scatter: types.ModuleType
    dispatch_grouped_matmul: types.ModuleType
    grouped_matmul_combine: types.ModuleType
    matmul_all_to_all: types.ModuleType
    all_to_all_matmul: types.ModuleType


@functools.cache
def kernels() -> Kernels:
    """The Triton kernel modules (`Kernels`), imported (and their kernels defined) on first use.

    Raises:
        RuntimeError: Triton does not import here.
    """
    try:
        from ..kernels import (
            all_gather_matmul,
            all_gather_weight_matmul,
            all_to_all_matmul,
            dispatch_grouped_matmul,
            grouped_matmul_combine,
            matmul_all_to_all,
            matmul_reduce_scatter,
        )
    except ImportError as exc:
        raise RuntimeError(f"overlap: the 'fused' strategy needs Triton, which failed to import: {exc}") from exc
    return Kernels(all_gather_matmul, all_gather_weight_matmul, matmul_reduce_scatter, dispatch_grouped_matmul,
                   grouped_matmul_combine, matmul_all_to_all, all_to_all_matmul)


def unavailable_reason() -> str | None:
    """Why the fused kernels cannot run in this process as far as the environment says, or None: where no GPU
    exists, they run in Triton's interpreter, which the user may have turned off (`envs.triton_interpret_off`).
    One line naming TRITON_INTERPRET and the fix."""
    off = envs.triton_interpret_off()
    if off is None or torch.cuda.is_available():
        return None
    return off


def check_fused_available(op: str, dtype: torch.dtype) -> None:
    """Raise (before the handshake) where the fused strategy cannot run: TypeError for the dtype, ValueError where
    Triton is missing or its interpreter is turned off where no GPU exists (`unavailable_reason`)."""
    if dtype not in FUSED_DTYPES:
        raise TypeError(f"overlap.{op}: the fused kernel supports {FUSED_DTYPES}, got {dtype}")
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"overlap.{op}: strategy 'fused' is unavailable here: {reason}")
    try:
        kernels()  # import (and define) the Triton kernels before the handshake
    except RuntimeError as exc:
        raise ValueError(f"overlap.{op}: strategy 'fused' is unavailable here: {exc}") from None
