"""Drop-in torch modules whose collectives run through `overlap`'s ops (see `overlap.nn.linear`)."""

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
