"""Drop-in sequence-parallel (DeepSpeed-Ulysses) attention: each rank holds a shard of the sequence, attends over
the whole sequence with a shard of the heads, and the all-to-alls between the two layouts are overlapped with the
projections that produce and consume them.

``SequenceParallelAttention`` runs, on ``W`` ranks of a sequence-parallel group::

    q, k, v = overlap.matmul_all_to_all(x, [w_q, w_k, w_v], heads=[H, Hkv, Hkv])  # [s/W, b, hidden] -> [s, b, ...]
    ctx = attention(q, k, v, causal)                                               # this rank's heads, local
    y = overlap.all_to_all_matmul(ctx, w_o)                                        # -> [s/W, b, hidden]

    attn = overlap.nn.SequenceParallelAttention(4096, 32, kv_heads=8, group=sp_group)
    y = attn(x)  # x, y: [s/W, b, 4096], this rank's shard of the sequence (rank r: positions r*s/W ... (r+1)*s/W-1)

Legend: ``H`` heads, ``Hkv`` key/value heads (grouped-query attention: ``H / Hkv`` query heads share one key/value
head; ``Hkv = H`` is multi-head attention), ``d`` head_dim, ``W`` ranks of the group. Rank ``r`` attends with query
heads ``r*H/W ... (r+1)*H/W - 1`` and key/value heads ``r*Hkv/W ... (r+1)*Hkv/W - 1``: since both counts divide by
``W``, the local query heads are served by exactly the local key/value heads, in the global ratio ``H / Hkv``.

Parameters (the same model whatever ``W``): ``q_proj`` ``nn.Linear(hidden, H*d)``, ``k_proj`` and ``v_proj``
``nn.Linear(hidden, Hkv*d)``, ``o_proj`` ``nn.Linear(H*d, hidden)``, created in that order by ``nn.Linear``'s own
initialization, whole and replicated on every rank as in Ulysses. So a module built after ``torch.manual_seed(s)``
holds the values of four ``nn.Linear`` built after the same seed in the same order (an unparallelized attention
layer), and its ``state_dict`` (``q_proj.weight``, ...) loads one's. With ``bias=True`` each rank adds its heads'
columns of the q/k/v biases after the exchange and the whole ``o_proj`` bias to its output shard.

Gradients: each parameter's ``.grad`` is this rank's share: its sequence shard's for the weights and the ``o_proj``
bias, its heads' (over the whole sequence) for the q/k/v biases. Summed over the sequence-parallel group they are the
unparallelized layer's gradients: sum them with the data-parallel gradient reduction (as DeepSpeed-Ulysses does, the
sequence-parallel group inside the data-parallel one), or ``all_reduce`` them over ``group`` where there is none. The
input gradient is this rank's shard of the whole input gradient, with nothing left to reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import envs, world
from ..ops.context import describe, fail_before
from ..ops.sp.all_to_all_matmul import all_to_all_matmul
from ..ops.sp.matmul_all_to_all import OP as OP_QKV
from ..ops.sp.matmul_all_to_all import matmul_all_to_all
from ..plans import Plan
from ..plans.auto import as_plan
from ..plans.optable import op_spec

_NAME = "overlap.nn.SequenceParallelAttention"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The default local attention: ``torch.nn.functional.scaled_dot_product_attention`` (scale ``1/sqrt(d)``),
    each key/value head repeated for the ``q.shape[1] / k.shape[1]`` query heads it serves."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_NAME}: {name} must be a positive int, got {value!r}")
    return value


class SequenceParallelAttention(torch.nn.Module):
    """Self-attention over a sequence split across a sequence-parallel group (see the module docstring).

    Args:
        hidden: the tokens' width (``o_proj``'s output and the projections' input).
        heads: ``H``, query heads over all ranks; must divide by the group's size.
        kv_heads: ``Hkv``, key/value heads (default ``heads``); must divide by the group's size and divide ``heads``.
        head_dim: ``d`` (default ``hidden / heads``, which must then be whole).
        group: the sequence-parallel group (default: the world). Every rank of it builds the module with the same
            arguments and calls it the same number of times, with shards of one length.
        causal: whether position ``i`` attends only to positions ``<= i`` of the whole sequence.
        bias: whether the four projections have biases.
        attention: the local attention, ``attention(q, k, v, causal) -> ctx``: ``q`` ``[b, H/W, s, d]``, ``k`` and
            ``v`` ``[b, Hkv/W, s, d]`` (query head ``j`` uses key/value head ``j // (H/Hkv)``; not repeated), every
            position of the whole sequence; returns ``ctx`` of ``q``'s shape (the attention-weighted values of each
            query head), differentiable. Default: `sdpa` (``scaled_dot_product_attention``).
        seq_dim: 0 for ``[s, b, hidden]`` activations, 1 for batch-first ``[b, s, hidden]``.
        strategy, plan, timeout: of `overlap.matmul_all_to_all` and `overlap.all_to_all_matmul` (this family's
            strategies: the op table's, every one but ``"hierarchical"``; defaults ``"auto"``, none,
            ``OVERLAP_TIMEOUT_S``).
        device, dtype: of the parameters (defaults: torch's default dtype, CPU).

    Forward: ``x`` ``[s/W, b, hidden]`` (``[b, s/W, hidden]`` with ``seq_dim=1``), this rank's shard of the sequence
    (positions ``r*s/W ... (r+1)*s/W - 1`` on rank ``r``); returns this rank's shard of the output, ``x``'s shape.

    Raises:
        ValueError: in ``__init__``, before any communication: sizes that are not positive ints, ``heads`` or
            ``kv_heads`` not divisible by the group's size, ``heads`` not divisible by ``kv_heads``, ``hidden`` not
            divisible by ``heads`` without ``head_dim``, ``seq_dim`` other than 0 or 1, a strategy this family does
            not implement (``hierarchical``), a bad plan or timeout. In ``forward``: ``x`` not 3-D with
            ``hidden`` features, or ``attention`` returning another shape than ``q``'s (the peers' calls then raise
            `OverlapMismatchError` at once).
        TypeError: ``attention`` not callable, a plan of the wrong type; in ``forward``, ``x`` not a tensor.
        The ops' errors (OverlapMismatchError, OverlapTimeout) as documented in `overlap.matmul_all_to_all`.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int | None = None, head_dim: int | None = None, *,
                 group: dist.ProcessGroup | None = None, causal: bool = True, bias: bool = False,
                 attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor] | None = None,
                 seq_dim: int = 0, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden = _positive_int("hidden", hidden)
        self.heads = _positive_int("heads", heads)
        self.kv_heads = heads if kv_heads is None else _positive_int("kv_heads", kv_heads)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{_NAME}: hidden ({hidden}) must divide by heads ({heads}) when head_dim is not "
                                 "given (head_dim defaults to hidden / heads)")
            head_dim = hidden // heads
        self.head_dim = _positive_int("head_dim", head_dim)
        if heads % self.kv_heads:
            raise ValueError(f"{_NAME}: heads ({heads}) must divide by kv_heads ({self.kv_heads}): each key/value head "
                             "serves the same number of query heads")
        if attention is not None and not callable(attention):
            raise TypeError(f"{_NAME}: attention must be a callable (q, k, v, causal) -> ctx, got "
                            f"{type(attention).__name__}")
        self.attention = sdpa if attention is None else attention
        if isinstance(seq_dim, bool) or seq_dim not in (0, 1):
            raise ValueError(f"{_NAME}: seq_dim must be 0 ([s, b, hidden]) or 1 ([b, s, hidden]), got {seq_dim!r}")
        self.seq_dim = seq_dim
        self.causal = bool(causal)
        chosen = as_plan(strategy, plan)  # a bad strategy or plan raises here, not at the first forward
        implemented = op_spec(OP_QKV).strategies
        if chosen is not None and chosen.strategy not in implemented:
            raise ValueError(f"{_NAME}: strategy {chosen.strategy!r} is not implemented for the sequence-parallel ops; "
                             f"use one of {['auto', *implemented]}")
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.group = world.resolve_group(group)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        for name, count in (("heads", self.heads), ("kv_heads", self.kv_heads)):
            if count % self.world_size:
                raise ValueError(f"{_NAME}: {name} ({count}) must divide by the sequence-parallel group's size "
                                 f"({self.world_size}): each rank attends with whole heads")
        self.local_heads = self.heads // self.world_size
        self.local_kv_heads = self.kv_heads // self.world_size

        factory = {"device": device, "dtype": dtype}
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = torch.nn.Linear(hidden, q_out, bias=bias, **factory)
        self.k_proj = torch.nn.Linear(hidden, kv_out, bias=bias, **factory)
        self.v_proj = torch.nn.Linear(hidden, kv_out, bias=bias, **factory)
        self.o_proj = torch.nn.Linear(q_out, hidden, bias=bias, **factory)

    def reset_parameters(self) -> None:
        """Draw every parameter again, as ``__init__`` does (q, k, v, o in turn)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.reset_parameters()

    # -- forward ------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sequence -> its shard of the attention layer's output (module docstring)."""
        self._check_input(x)
        kwargs = {"seq_dim": self.seq_dim, "group": self.group, "strategy": self.strategy, "plan": self.plan,
                  "timeout": self.timeout}
        projs = (self.q_proj, self.k_proj, self.v_proj)
        qkv = matmul_all_to_all(x, [p.weight.t() for p in projs], heads=[self.heads, self.kv_heads, self.kv_heads],
                                **kwargs)
        if self.q_proj.bias is not None:  # this rank's heads' columns, for every position
            qkv = [t + p.bias.view(self.world_size, -1)[self.rank].to(t.dtype) for t, p in zip(qkv, projs, strict=True)]
        q, k, v = (self._to_heads(t) for t in qkv)
        ctx = self.attention(q, k, v, self.causal)
        if not isinstance(ctx, torch.Tensor) or ctx.shape != q.shape:
            got = describe(ctx) if isinstance(ctx, torch.Tensor) else type(ctx).__name__
            self._fail("all_to_all_matmul", ValueError(
                f"{_NAME}: attention must return ctx of q's shape {tuple(q.shape)} ([b, heads/W, s, head_dim]), got "
                f"{got}"))
        y = all_to_all_matmul(self._from_heads(ctx), self.o_proj.weight.t(), **kwargs)
        if self.o_proj.bias is not None:
            y = y + self.o_proj.bias.to(y.dtype)
        return y

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[s, b, n*d]`` (``[b, s, n*d]`` batch-first) -> ``[b, n, s, d]``, a view."""
        if self.seq_dim == 0:
            s, b, _ = t.shape
            return t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)
        b, s, _ = t.shape
        return t.view(b, s, -1, self.head_dim).transpose(1, 2)

    def _from_heads(self, ctx: torch.Tensor) -> torch.Tensor:
        """The inverse of `_to_heads`: ``[b, n, s, d]`` -> ``[s, b, n*d]`` (``[b, s, n*d]`` batch-first)."""
        b, n, s, d = ctx.shape
        if self.seq_dim == 0:
            return ctx.permute(2, 0, 1, 3).reshape(s, b, n * d)
        return ctx.transpose(1, 2).reshape(b, s, n * d)

    def _check_input(self, x: Any) -> None:
        """Local checks of ``x``; a mistake raises here and makes the peers' projection raise at once."""
        error = None
        if not isinstance(x, torch.Tensor):
            error = TypeError(f"{_NAME}: x must be a tensor, got {type(x).__name__}")
        elif x.dim() != 3 or x.shape[-1] != self.hidden:
            layout = "[s/W, b, {}]" if self.seq_dim == 0 else "[b, s/W, {}]"
            error = ValueError(f"{_NAME}: x must be {layout.format(self.hidden)} (seq_dim={self.seq_dim}), got "
                               f"{describe(x)}")
        if error is not None:
            self._fail(OP_QKV, error)

    def _fail(self, op: str, error: Exception) -> None:
        """Raise `error` here, the peers waiting in `op` told at once (`overlap.ops.context.CallContext.fail`)."""
        fail_before(op, self.group, self.timeout, error)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"SP={self.world_size}, local_heads={self.local_heads}, causal={self.causal}, "
                f"bias={self.q_proj.bias is not None}, seq_dim={self.seq_dim}, strategy={self.strategy!r}")
