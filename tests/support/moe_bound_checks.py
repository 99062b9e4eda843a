"""What `moe_oracle.check_moe` checks beyond the oracle when the MoE ops run with ``max_tokens_per_rank``.

A bounded dispatch returns ``[W * B * min(K, L), cols]`` rows: the received rows at the front, in the
unbounded order, then zero padding; the handle carries its layout as device tensors. The padding rows are
given nonzero values before the combine (an expert function with a bias), which must change no result, and
must get a zero gradient. Without a bound every check here is a no-op.
"""

from __future__ import annotations

import torch


class Bounded:
    """One case's bound (None: the case runs without one) and the checks of its padding."""

    def __init__(self, case, slack: int | None, world_size: int, rank: int, ids: list[int], ctx: str):
        tokens = [case.tokens[r % len(case.tokens)] for r in range(world_size)]
        self.bound = None if slack is None else max(1, max(tokens) + slack)
        self.kwargs = {} if self.bound is None else {"max_tokens_per_rank": self.bound}
        L = case.experts // world_size
        self.capacity = 0 if self.bound is None else world_size * self.bound * min(case.top_k, L)
        self.experts, self.rank, self.L, self.ids, self.ctx = case.experts, rank, L, ids, ctx

    @property
    def n(self) -> int:
        return len(self.ids)

    def rows(self, out: torch.Tensor, handle) -> torch.Tensor:
        """The received rows of a dispatch's output, after checking its padding and the handle's tensors."""
        if self.bound is None:
            return out
        ctx, n = self.ctx, self.n
        assert out.shape[0] == self.capacity, f"{ctx}: {tuple(out.shape)} rows, want {self.capacity}"
        assert not torch.count_nonzero(out[n:]), f"{ctx}: padding rows are not zero"
        counts = [self.ids.count(e) for e in range(self.rank * self.L, (self.rank + 1) * self.L)]
        tpe, offsets, num_recv = handle.tokens_per_expert, handle.expert_offsets, handle.num_recv
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in (tpe, offsets, num_recv)), ctx
        assert tpe.tolist() == counts, f"{ctx}: tokens_per_expert {tpe.tolist()}, want {counts}"
        assert offsets.tolist() == handle.layout.expert_offsets, ctx
        assert num_recv.dim() == 0 and int(num_recv) == n == handle.layout.num_recv, ctx
        if out.requires_grad:
            out.retain_grad()
        return out[:n]

    def host(self, handle):
        """Where the host lists are: the handle itself without a bound, its layout with one."""
        return handle if self.bound is None else handle.layout

    def expert_ids(self) -> torch.Tensor:
        """Expert ids of the rows for `moe_oracle.expert_fn`; padding rows get an id whose bias is nonzero."""
        return torch.tensor(self.ids + [self.experts + 3] * (self.capacity - self.n), dtype=torch.int64)

    def junk(self, h: torch.Tensor):
        """A leaf to add to the expert rows: nonzero on the padding rows only (0.0 without a bound)."""
        if self.bound is None:
            return 0.0
        t = torch.zeros(h.shape, dtype=h.dtype)
        t[self.n :] = 1.0 + torch.arange(t[self.n :].numel(), dtype=h.dtype).view(t[self.n :].shape) % 7
        return t.requires_grad_(True)

    def zero_grad_on_padding(self, *tensors) -> None:
        """Every tensor's gradient is zero on the padding rows (after the backward)."""
        if self.bound is None:
            return
        for t in tensors:
            assert t.grad is not None and t.grad.shape[0] == self.capacity, f"{self.ctx}: no padded gradient"
            assert not torch.count_nonzero(t.grad[self.n :]), f"{self.ctx}: padding rows got a nonzero gradient"
