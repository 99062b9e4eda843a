"""What a workload (`overlap.workloads.Workload`) builds for a shape: seeded inputs, the expected results,
the op's plain collectives and GEMMs alone.

* `SeededDraw`: standard normal tensors, each ``(name, rank)`` its own seeded stream, so that any rank
  can draw any rank's inputs (the benchmark's oracle needs every rank's) and ``shared`` tensors are
  the same on every rank (a replicated output's gradient, the routers' expert popularity);
* `OpInputs`: one rank's inputs of one call: the differentiable leaves in the call's order, the
  output gradient of a backward, and for MoE the routing;
* `Expected`: one tensor the op must produce and the length of the dot products behind it;
* `Plain`: the op's plain collectives alone and its GEMMs alone (``T_comm`` and ``T_compute`` of the
  benchmark's overlap efficiency) with the bytes one rank receives in them.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import torch

from ..plans import FP8_DTYPES, FP8_LEAVES


class SeededDraw:
    """Seeded tensors of rank `rank` for one case: tensor `name` of rank ``q`` is drawn from a generator
    seeded by ``(seed, name, q)``; ``shared=True`` uses one stream for every rank. Values are standard
    normal fp32 (`fp32`), or scaled and cast to `dtype` (`normal`; an fp8 dtype draws `leaf_dtype`'s; never
    zeros), or uniform in [0, 1) (`uniform`)."""

    def __init__(self, seed: int, rank: int, device: torch.device | str, dtype: torch.dtype):
        self.seed, self.rank, self.device, self.dtype = seed, rank, torch.device(device), leaf_dtype(dtype)

    def for_rank(self, rank: int) -> SeededDraw:
        """The same draw for another rank (to regenerate that rank's inputs)."""
        return SeededDraw(self.seed, rank, self.device, self.dtype)

    def _generator(self, name: str, shared: bool) -> torch.Generator:
        stream = zlib.crc32(name.encode()) * 10_007 + (0 if shared else self.rank + 1)
        return torch.Generator(device=self.device).manual_seed((self.seed * 1_000_003 + stream) % 2**63)

    def fp32(self, name: str, *shape: int, shared: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=self._generator(name, shared), device=self.device)

    def uniform(self, name: str, *shape: int, shared: bool = False) -> torch.Tensor:
        """Uniform fp32 values in [0, 1)."""
        return torch.rand(*shape, generator=self._generator(name, shared), device=self.device)

    def normal(self, name: str, *shape: int, scale: float = 1.0, shared: bool = False) -> torch.Tensor:
        x = self.fp32(name, *shape, shared=shared)
        return (x * scale if scale != 1.0 else x).to(self.dtype)


def leaf_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a problem's leaves: its own, but an fp8 problem's are `overlap.plans.FP8_LEAVES` (the ``fp8=``
    recipe quantizes high-precision leaves inside the call; the output and the backward are in their dtype)."""
    return getattr(torch, FP8_LEAVES) if str(dtype).removeprefix("torch.") in FP8_DTYPES else dtype


@dataclasses.dataclass
class OpInputs:
    """One rank's inputs of one call. `leaves`: the differentiable inputs in the call's order (TP ops
    ``(a, b)``; moe ``(x, w1, w2, topk_weights)``); `grad_out`: the output gradient of a backward (None
    for a forward); moe: `routing` (``topk_idx`` ``[T, K]``) and `num_experts`; `options`: keywords of the
    op's call that the problem sets (an fp8 problem's ``fp8="rowwise"`` or ``fp8="mxfp8"``), taken by its plain-torch
    row too."""

    leaves: tuple[torch.Tensor, ...]
    grad_out: torch.Tensor | None
    routing: torch.Tensor | None = None
    num_experts: int = 0
    options: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Expected:
    """One tensor the op must produce: `what` (``out``, ``grad_a``, ``grad_b``; moe: ``out``, ``grad_x``,
    ``grad_w1``, ``grad_w2``, ``grad_topk_weights``), its oracle value, and the length of the dot
    products behind it (a tolerance grows with it; chained GEMMs add their lengths)."""

    what: str
    value: torch.Tensor
    reduction: int
    #: a sum over ranks of their partials (`summed`): the RMS of the sum of the partials' magnitudes, which bounds
    #: the rounding of partials computed in 16 bits where the sum cancels; 0 for anything else
    magnitude: float = 0.0
    #: per element, the summed magnitudes of its terms where a strategy's other rounding of an intermediate moves
    #: each term by a share of its size (MoE's weights' and top-k weights' gradients); the check widens ``atol``
    #: there to this element's own size where it exceeds the tensor's scale (`magnitude` is its RMS)
    terms: torch.Tensor | None = None


@dataclasses.dataclass
class Plain:
    """The op's plain collectives alone (`comm`) and its GEMMs alone (`compute`) on one rank, with their
    labels, the bytes one rank receives in those collectives, and facts about the inputs worth a note."""

    comm: Callable[[], None]
    compute: Callable[[], None]
    comm_label: str
    compute_label: str
    comm_bytes: int
    notes: list[str] = dataclasses.field(default_factory=list)


def summed(what: str, parts, dtype: torch.dtype, reduction: int) -> Expected:
    """The oracle of a tensor summed over ranks (a reduce-scatter's or all-reduce's result): `parts` accumulated in
    fp32 or wider (float64 parts stay float64), rounded to `dtype`, with the magnitude of what is added
    (`Expected.magnitude`)."""
    total = absolute = None
    for p in parts:
        p = p.to(torch.promote_types(p.dtype, torch.float32))
        absolute = p.abs() if absolute is None else absolute.add_(p.abs())
        total = p if total is None else total.add_(p)
    return Expected(what, total.to(dtype), reduction, float(absolute.double().pow(2).mean().sqrt()))
