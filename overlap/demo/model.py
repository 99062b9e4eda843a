"""The demo's model: a small GPT-style decoder with tensor-parallel attention and MLP blocks and an MoE block.

``[s, b]`` tokens -> embedding (replicated) -> this rank's slice of the sequence ``[s/W, b, h]`` ->
``layers`` x (pre-norm causal attention, pre-norm MLP) -> a pre-norm MoE block
(`overlap.nn.ExpertParallelMLP`, experts over the ranks) -> final norm -> output projection: this rank's
logits ``[s/W, b, vocab]``. Between blocks activations are sequence-sharded (Megatron's sequence
parallelism): `parallelize` gives the attention and MLP blocks torch's ``SequenceParallel`` norms and
column-/row-wise linear layers, either torch's own styles (``kind="torch"``) or
`overlap.hooks.torch_tp`'s (``kind="overlap"``), with the same arguments. torch has no expert-parallel
style, so the torch run's MoE block runs the plain all-to-alls (``strategy="reference"``).

Parameters the styles do not shard are replicated plain tensors (embedding, the MoE block's norm and
router, the final norm and the output projection): each rank computes only its rows' share of their
gradient, so `replicated_parameters` lists them for the training loop's all-reduce (the ``SequenceParallel``
norms' gradients are summed by ``DTensor`` itself, the experts' own gradients are whole on their rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import ExpertParallelMLP
from .config import ModelConfig


class Attention(nn.Module):
    """Pre-norm causal self-attention over ``[s, b, h]``. The qkv projection's outputs are ordered
    ``[head, (q, k, v), head_dim]``, so a column shard holds whole heads and attention runs per rank on
    the whole sequence that the column-wise layer gathered."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.norm = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm(x))  # [s, b, 3 h / W]: the whole sequence, this rank's heads
        s, b, _ = qkv.shape
        q, k, v = qkv.reshape(s, b, -1, 3, self.head_dim).unbind(3)
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return x + self.out(torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, -1))


class MLP(nn.Module):
    """Pre-norm GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.up = nn.Linear(cfg.hidden, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MoE(nn.Module):
    """Pre-norm mixture of experts on this rank's own tokens (`overlap.nn.ExpertParallelMLP`)."""

    def __init__(self, cfg: ModelConfig, strategy: str, timeout: float | None):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.experts = ExpertParallelMLP(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, strategy=strategy,
                                         timeout=timeout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.norm(x))


class GPT(nn.Module):
    """The demo's model (see the module docstring). ``forward(tokens [s, b])`` -> this rank's logits."""

    def __init__(self, cfg: ModelConfig, rank: int, world_size: int, moe_strategy: str, timeout: float | None):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(m for _ in range(cfg.layers) for m in (Attention(cfg), MLP(cfg)))
        self.moe = MoE(cfg, moe_strategy, timeout)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).chunk(self.world_size, dim=0)[self.rank]  # this rank's rows: no communication
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(self.moe(x)))


def parallel_plan(model: GPT, kind: str, strategy: str, timeout: float | None) -> dict:
    """``parallelize_module``'s plan of `model`'s attention and MLP blocks with torch's styles or overlap's."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if kind == "torch":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        extra = {}
    else:
        from ..hooks.torch_tp import ColwiseParallel, RowwiseParallel

        extra = {"strategy": strategy, "timeout": timeout}
    plan = {}
    for i, block in enumerate(model.blocks):
        first, second = ("qkv", "out") if isinstance(block, Attention) else ("up", "down")
        plan[f"blocks.{i}.norm"] = SequenceParallel(sequence_dim=0)
        plan[f"blocks.{i}.{first}"] = ColwiseParallel(input_layouts=Shard(0), **extra)
        plan[f"blocks.{i}.{second}"] = RowwiseParallel(output_layouts=Shard(0), **extra)
    return plan


def build(cfg: ModelConfig, kind: str, strategy: str, seed: int, mesh, timeout: float | None = None) -> GPT:
    """The demo's model from `seed` (the same initial numbers for either `kind`), parallelized over `mesh`.

    ``kind="torch"``: torch's styles and the MoE block on ``reference``; ``"overlap"``: overlap's styles and
    the MoE block on `strategy`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    moe_strategy = "reference" if kind == "torch" else strategy
    model = GPT(cfg, mesh.get_local_rank(), mesh.size(), moe_strategy, timeout).to(mesh.device_type)
    return parallelize_module(model, mesh, parallel_plan(model, kind, strategy, timeout))


def replicated_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    """The parameters whose gradient each rank holds only its share of: plain tensors (not ``DTensor``),
    other than the experts' (marked ``allreduce = False``)."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters()
            if p.requires_grad and not isinstance(p, DTensor) and getattr(p, "allreduce", True)]
