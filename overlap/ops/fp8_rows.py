"""fp8 rows with their scales in the same row of bytes (`Packed`), so that one transfer moves both: the TP ops'
fp8 gathers (a row of ``a``, or of a weight shard) and the MoE dispatch's fp8 tokens (`overlap.ops.moe.fp8`) travel
so, each transport moving them as it moves any rows.

A packed row, ``uint8``:

* rowwise or tensorwise: the row's ``k`` e4m3 bytes, zeros up to a multiple of 4, its float32 scale (4 bytes; a
  tensorwise scale is repeated on each row: rowwise scales cost the same);
* blocks of `block` columns (the MoE dispatch's ``block128``): the ``k`` bytes, zeros up to a multiple of 4, one
  float32 scale per block (the last block may be partial);
* MX (``k`` a multiple of 32): the row's ``k`` bytes, then its ``k / 32`` e8m0 block scales (one byte each).

On GPUs zeros follow, up to a multiple of 16 bytes (16-byte row loads: the fused kernels, `torch._scaled_mm`, the
MoE dispatch kernel).
"""

from __future__ import annotations

import torch

from .fp8 import MX_BLOCK, MX_SCALE_DTYPE, OPERAND_DTYPE

#: the bytes of one float32 scale
SCALE_BYTES = 4


class Packed:
    """fp8 rows and their scales as rows of bytes ``[m, width]`` (module docstring): the row's ``k`` fp8 bytes, then
    its scales from byte `scale_offset` (float32: zeros up to ``k`` rounded up to 4, then one scale, or one per
    `block` columns; `mx`: right after the data, ``k / 32`` e8m0 bytes), and on GPUs zeros up to a multiple of 16
    bytes (16-byte row loads)."""

    def __init__(self, k: int, device: torch.device | None = None, mx: bool = False, block: int | None = None):
        self.k, self.mx = k, mx
        if mx:
            assert k % MX_BLOCK == 0, k  # (the ops' checks refuse such a call first)
            self.scales = k // MX_BLOCK
            self.scale_offset, self.scale_bytes = k, self.scales
        else:
            self.scales = 1 if block is None else -(-k // block)
            self.scale_offset, self.scale_bytes = -(-k // 4) * 4, SCALE_BYTES * self.scales
        align = 16 if device is not None and device.type == "cuda" else 1
        self.width = -(-(self.scale_offset + self.scale_bytes) // align) * align

    def pack(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`x` ``[m, k]`` fp8 and its scale (``[m, 1]`` or one element; blocks ``[m, scales]``; `mx`: ``[m, k/32]``
        e8m0) as ``[m, width]`` uint8."""
        m = x.shape[0]
        out = torch.empty((m, self.width), dtype=torch.uint8, device=x.device)
        out[:, : self.k].copy_(x.view(torch.uint8))
        lo, hi = self.scale_offset, self.scale_offset + self.scale_bytes
        if lo > self.k:
            out[:, self.k : lo].zero_()
        if self.width > hi:
            out[:, hi:].zero_()
        if self.mx:
            out[:, lo:hi].copy_(scale.reshape(m, self.scale_bytes).view(torch.uint8))
        else:
            s = scale.float()
            s = s.reshape(1, 1).expand(m, 1) if s.numel() == 1 else s.reshape(m, self.scales)
            out[:, lo:hi].copy_(s.contiguous().view(torch.uint8))
        return out

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x [r, k] fp8, scale)`` of packed `rows` (a view of the data, a copy of the scales): the scale is
        ``[r, scales]`` float32 (``[r, 1]`` rowwise), or with `mx` ``[r, k/32]`` e8m0."""
        x = rows[:, : self.k].view(OPERAND_DTYPE)
        s = rows[:, self.scale_offset : self.scale_offset + self.scale_bytes].contiguous()
        return x, s.view(MX_SCALE_DTYPE if self.mx else torch.float32)
