"""The fused operations, one module each (see each module's docstring)."""

from .all_gather_matmul import all_gather_matmul

__all__ = ["all_gather_matmul"]
