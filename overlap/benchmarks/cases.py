"""The benchmark cases: one definition, used by ``overlap bench`` and by the ``bench/`` scripts.

A `Case` is one op at one shape and dtype. For ``all_gather_matmul`` the shape ``m x k x n``
means: every rank holds ``a_MK`` (``m`` rows of the gathered dim per rank) and ``b_KN``; the
output of every rank is ``[world_size * m, n]``.

Default CPU cases (2 gloo ranks on a 2-core machine, one torch thread per rank): the GEMMs
are large enough that a call takes tens of milliseconds, far above timer and barrier noise
(~0.1 ms), and the whole default ``overlap bench`` runs in about half a minute including rank
start-up. The last case is small enough (every dim <= `INTERPRETED_FUSED_MAX_DIM`) for the
interpreted ``fused`` kernel, whose timings are labelled and left out of the summaries.
"""

from __future__ import annotations

import dataclasses

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ops the runner knows how to benchmark
OPS = ("all_gather_matmul",)

#: the Triton interpreter runs a GEMM tile by tile in numpy: only tiny shapes finish in time
INTERPRETED_FUSED_MAX_DIM = 128


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: `op` at per-rank shape ``m x k x n`` in `dtype` (a name of `DTYPES`)."""

    op: str
    m: int
    k: int
    n: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {OPS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        for name in ("m", "k", "n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k}x{self.n}"

    @property
    def name(self) -> str:
        return f"{self.op} {self.shape} {self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def flops(self, world_size: int) -> int:
        """Floating-point operations of one call on one rank: ``2 * W*m * k * n``."""
        return 2 * world_size * self.m * self.k * self.n

    def gathered_bytes(self, world_size: int) -> int:
        """Bytes one rank receives from its peers in one call: ``(W-1) * m * k`` elements."""
        return (world_size - 1) * self.m * self.k * self.torch_dtype.itemsize

    @property
    def fits_interpreted_fused(self) -> bool:
        return max(self.m, self.k, self.n) <= INTERPRETED_FUSED_MAX_DIM


# (m, k, n, dtype) per op and device type
_DEFAULTS: dict[str, dict[str, list[tuple[int, int, int, str]]]] = {
    "all_gather_matmul": {
        "cpu": [
            (512, 1024, 1024, "float32"),
            (1024, 1024, 2048, "float32"),
            (1024, 2048, 512, "float32"),  # a wide a and a narrow shard of b: the transfer weighs more
            (1024, 1024, 1024, "bfloat16"),
            (64, 128, 128, "float32"),  # small enough for interpreted fused
        ],
        # Column-parallel projections of 8k-hidden models (per-rank sequence slice x hidden x shard).
        # Not yet measured on a GPU.
        "cuda": [
            (1024, 8192, 8192, "bfloat16"),
            (2048, 8192, 3584, "bfloat16"),
            (4096, 8192, 8192, "bfloat16"),
            (4096, 8192, 8192, "float16"),
        ],
    },
}


def default_cases(op: str = "all_gather_matmul", device_type: str = "cpu", dtype: str | None = None) -> list[Case]:
    """The default cases of `op` for ranks on `device_type` (``"cpu"`` or ``"cuda"``).

    `dtype` (a name of `DTYPES`) replaces every case's own dtype when given.
    Raises ValueError for an unknown op, device type or dtype.
    """
    if op not in _DEFAULTS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if device_type not in _DEFAULTS[op]:
        raise ValueError(f"no default cases for device type {device_type!r}; known: {tuple(_DEFAULTS[op])}")
    cases = [Case(op, m, k, n, dtype or dt) for m, k, n, dt in _DEFAULTS[op][device_type]]
    return list(dict.fromkeys(cases))  # a dtype override can make two cases equal


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"MxKxN"`` -> ``(m, k, n)``, each a positive int. Raises ValueError otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3:
        raise ValueError(f"shape must be MxKxN (three positive ints joined by 'x'), got {text!r}")
    try:
        m, k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape must be MxKxN (three positive ints joined by 'x'), got {text!r}") from None
    if min(m, k, n) < 1:
        raise ValueError(f"every dim of the shape must be >= 1, got {text!r}")
    return m, k, n
