"""overlap: communication/compute overlap for tensor- and expert-parallel training.

Public API (docs/design.md): `all_gather_matmul`, `matmul_reduce_scatter`, `matmul_all_reduce`,
`all_gather_weight_matmul` (the weight-side gather of FSDP), `Plan`,
`PlanFile`, `reserve`, `release`, `OverlapTimeout`, `OverlapMismatchError`; `overlap.moe` (`dispatch`, `combine`,
`dispatch_grouped_matmul`, `grouped_matmul_combine`) for expert parallelism. No init call: a
group's symmetric heap is created by its first call.

Where no GPU exists and the user has not set ``TRITON_INTERPRET``, importing `overlap` sets it to
1 so that the ``fused`` strategy's Triton kernels run interpreted on CPU ranks. Triton reads the
variable when a kernel is defined, so this affects Triton kernels defined after this import.
"""

from __future__ import annotations

import logging as _logging
import os as _os

from . import envs as _envs
from .version import __version__ as __version__


def _set_triton_interpret() -> None:
    if _envs.triton_interpret_set_by_user():
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"
        _envs.TRITON_INTERPRET_SET_BY_OVERLAP = True


_set_triton_interpret()

_log = _logging.getLogger("overlap")
if not _log.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[overlap %(levelname)s] %(message)s"))
    _log.addHandler(_handler)
_log.setLevel(getattr(_logging, _envs.log_level(), _logging.WARNING))

from . import moe  # noqa: E402  (overlap.moe: the MoE ops)
from .errors import OverlapError, OverlapMismatchError, OverlapTimeout  # noqa: E402
from .ops.all_gather_matmul import all_gather_matmul  # noqa: E402
from .ops.all_gather_weight_matmul import all_gather_weight_matmul  # noqa: E402
from .ops.matmul_all_reduce import matmul_all_reduce  # noqa: E402
from .ops.matmul_reduce_scatter import matmul_reduce_scatter  # noqa: E402
from .plans import STRATEGIES, Plan, PlanFile  # noqa: E402
from .symm import release, reserve  # noqa: E402

__all__ = [
    "STRATEGIES",
    "OverlapError",
    "OverlapMismatchError",
    "OverlapTimeout",
    "Plan",
    "PlanFile",
    "all_gather_matmul",
    "all_gather_weight_matmul",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "moe",
    "release",
    "reserve",
]
