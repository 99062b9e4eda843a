"""Drop-in torch modules whose collectives run through `overlap`'s ops (see `overlap.nn.linear`,
`overlap.nn.moe`)."""

from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ExpertParallelMLP

__all__ = ["ColumnParallelLinear", "ExpertParallelMLP", "RowParallelLinear"]
