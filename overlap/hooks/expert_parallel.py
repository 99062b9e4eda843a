"""``ExpertParallel``: a torch ``ParallelStyle`` for grouped experts in torchtitan's contract, run by overlap's MoE ops.

torchtitan shards an MoE layer's experts (``GroupedExperts``: ``w1``, ``w3`` ``[E, ffn, dim]``, ``w2``
``[E, dim, ffn]``, SwiGLU: ``(silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T``) with
``parallelize_module(moe.experts, ep_mesh, ExpertParallel())``; the module is then called with the routed rows
(this rank's tokens, one row per (token, expert) pair, sorted by expert) and the rows per expert, and returns
one output row per routed row, in the same order. This style keeps that contract and the parameters' form
(``Shard(0)`` DTensors over the mesh: FSDP, gradient clipping and checkpoints see the same tensors as with
torchtitan's style) and runs the layer as `overlap.dispatch_grouped_matmul` (the rows sent to their experts'
ranks, ``x @ [w1; w3].T`` multiplied block by block as they land), SwiGLU, and `overlap.grouped_matmul_combine`
(``@ w2.T``, each source's rows sent back as they are multiplied), in place of torchtitan's two all-to-alls around
the experts' GEMMs. `overlap.hooks.torch_tp.use_overlap_styles` swaps it in where torchtitan's parallelize module
names ``ExpertParallel``.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .. import envs
from ..ops.moe.combine import grouped_matmul_combine
from ..ops.moe.dispatch import dispatch_grouped_matmul
from ..plans import Plan
from ..plans.auto import as_plan

WEIGHTS = ("w1", "w2", "w3")


class ExpertParallel(ParallelStyle):
    """Experts sharded over a 1-D mesh (``E / W`` per rank, in order), their layer run by overlap's MoE ops.

    Args:
        strategy, plan, timeout: passed to `overlap.dispatch_grouped_matmul` and `overlap.grouped_matmul_combine`
            (default ``"auto"``).

    The module must hold ``w1``, ``w2``, ``w3`` as torchtitan's ``GroupedExperts`` does (checked at
    ``parallelize_module``: ValueError naming what differs) and be called as ``module(x, num_tokens_per_expert)``
    with ``x`` ``[N, dim]`` sorted by expert and ``num_tokens_per_expert`` ``[E]`` summing to ``N``.
    """

    def __init__(self, *, strategy: str = "auto", plan: Plan | dict | None = None, timeout: float | None = None):
        super().__init__()
        as_plan(strategy, plan)  # raises on a bad strategy or plan now, not at the first forward
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy!r}, plan={self.plan!r}, timeout={self.timeout!r})"

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"overlap's ExpertParallel takes a 1-D mesh (the experts' ranks), got {device_mesh.ndim} "
                             "dims: for experts also sharded by tensor parallelism use ExpertTensorParallel")
        return self._shard(module, device_mesh, device_mesh, None)

    def _shard(self, module: torch.nn.Module, mesh: DeviceMesh, ep_mesh: DeviceMesh,
               etp_mesh: DeviceMesh | None) -> torch.nn.Module:
        """Shard the experts over `ep_mesh` (and their ffn columns over `etp_mesh`; `mesh` is the one of both) and
        set the layer's forward."""
        num_experts, hidden, ffn = _experts_shape(module)
        W, T = ep_mesh.size(), 1 if etp_mesh is None else etp_mesh.size()
        if num_experts % W:
            raise ValueError(f"overlap's {type(self).__name__}: {num_experts} experts do not divide over {W} ranks")
        if ffn % T:
            raise ValueError(f"overlap's {type(self).__name__}: the experts' {ffn} ffn columns do not divide over "
                             f"{T} tensor-parallel ranks")
        if any(isinstance(getattr(module, name), DTensor) for name in WEIGHTS):
            raise ValueError(f"overlap's {type(self).__name__}: {type(module).__name__}'s weights are DTensors "
                             "already (parallelize a module once)")
        for name in WEIGHTS:
            param = getattr(module, name)
            placements = [Shard(0)]
            if etp_mesh is not None:  # w1, w3 [E, ffn, dim] column-wise, w2 [E, dim, ffn] row-wise
                placements.append(Shard(2 if name == "w2" else 1))
            module.register_parameter(name, torch.nn.Parameter(distribute_tensor(param, mesh, placements)))
        forward = _layer(self, ep_mesh.get_group(), num_experts, ffn // T, etp_mesh)
        module.forward = types.MethodType(forward, module)
        return module


class ExpertTensorParallel(ExpertParallel):
    """`ExpertParallel` over a 2-D mesh ``[ep, etp]`` (torchtitan's ``ExpertTensorParallel``): the experts over
    ``ep``, each expert's ffn columns over ``etp`` (``w1``, ``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``). The routed
    rows are the same on the ``etp`` ranks (their gradient summed over them); each ``etp`` rank dispatches them
    over ``ep`` to its column shard of the experts and returns its partial sum of the output, which the caller
    reduces over ``etp`` (torchtitan's MoE plan: a ``Partial`` output). The mesh's dims are named ``ep`` and ``etp``."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if device_mesh.ndim != 2:
            raise ValueError(f"overlap's ExpertTensorParallel takes a 2-D mesh [ep, etp], got {device_mesh.ndim} dims")
        names = device_mesh.mesh_dim_names or ()
        if set(names) != {"ep", "etp"}:
            raise ValueError(f"overlap's ExpertTensorParallel takes a mesh with dims named 'ep' and 'etp' "
                             f"(torchtitan's names), got {names or 'unnamed dims'}")
        return self._shard(module, device_mesh, device_mesh["ep"], device_mesh["etp"])


def _experts_shape(module: torch.nn.Module) -> tuple[int, int, int]:
    """``(E, dim, ffn)`` of torchtitan-style experts (``w1``, ``w3`` ``[E, ffn, dim]``, ``w2`` ``[E, dim, ffn]``)."""
    missing = [n for n in WEIGHTS if not isinstance(getattr(module, n, None), torch.nn.Parameter)]
    if missing:
        raise ValueError(f"overlap's ExpertParallel takes experts holding w1, w2, w3 as parameters (torchtitan's "
                         f"GroupedExperts); {type(module).__name__} lacks {', '.join(missing)}")
    w1, w2, w3 = (getattr(module, n) for n in WEIGHTS)
    if w1.dim() != 3 or w1.shape != w3.shape or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
        raise ValueError(f"overlap's ExpertParallel: w1 and w3 must be [E, ffn, dim] and w2 [E, dim, ffn], got "
                         f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}")
    return w1.shape[0], w1.shape[2], w1.shape[1]


def _layer(style: ExpertParallel, group, num_experts: int, ffn: int, etp_mesh: DeviceMesh | None):
    """The experts' forward under `style`: ``(module, x, num_tokens_per_expert) -> out`` (with `etp_mesh`, this
    rank's partial sum over the experts' ffn columns it holds)."""
    ops = dict(strategy=style.strategy, plan=style.plan, timeout=style.timeout)

    def forward(module: torch.nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.detach().to(torch.int64)
        if counts.shape != (num_experts,):
            raise ValueError(f"overlap's {type(style).__name__}: num_tokens_per_expert must be [{num_experts}], got "
                             f"{tuple(num_tokens_per_expert.shape)}")
        total = int(counts.sum())
        if x.dim() != 2 or x.shape[0] != total:
            raise ValueError(f"overlap's {type(style).__name__}: the routed input must be [{total}, dim] (the rows "
                             f"per expert sum to {total}), got {tuple(x.shape)}")
        if etp_mesh is not None:  # the same rows on every etp rank: their gradients summed over them in backward
            x = DTensor.from_local(x, etp_mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
        experts = torch.arange(num_experts, device=x.device)
        idx = torch.repeat_interleave(experts, counts.to(x.device)).unsqueeze(1)  # each row its own token, top-1
        w1, w2, w3 = (getattr(module, n).to_local() for n in WEIGHTS)
        w13 = torch.cat([w1, w3], dim=1).transpose(1, 2)  # [L, dim, 2 ffn]: x @ [w1; w3].T in one GEMM
        h, handle = dispatch_grouped_matmul(x, idx, w13, num_experts, group=group, **ops)
        a = torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]
        ones = torch.ones((total, 1), dtype=torch.float32, device=x.device)
        return grouped_matmul_combine(a, w2.transpose(1, 2), ones, handle, **ops)

    return forward
