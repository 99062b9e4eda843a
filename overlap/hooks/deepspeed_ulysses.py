"""DeepSpeed-Ulysses attention with overlap's fused ops in place of ``DistributedAttention``'s all-to-alls.

A DeepSpeed-Ulysses model projects its sequence shard itself, hands the heads to DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention`` (q, k, v each exchanged by an all-to-all: heads scattered, the
sequence gathered; the user's local attention on the whole sequence with ``H/W`` heads; an all-to-all back) and
projects the result with its output projection::

    dist_attn = DistributedAttention(local_attn, sp_group)               # no parameters of its own
    q = q_proj(x).view(s_w, b, H, d); k = ...; v = ...                   # x [s/W, b, hidden]: this rank's shard
    y = o_proj(dist_attn(q, k, v, 1, None, *args, **kwargs).flatten(2))  # batch_dim_idx 1: [s/W, b, ...]

`UlyssesAttention` computes the same ``y`` from the same ``x`` with `overlap.matmul_all_to_all` (the three
projections and the exchange, each destination's heads sent while the next ones are multiplied) and
`overlap.all_to_all_matmul` (the exchange back and ``o_proj``, each source's block multiplied as it lands)::

    attn = UlyssesAttention.from_distributed_attention(dist_attn, q_proj, k_proj, v_proj, o_proj, heads=H, kv_heads=Hkv)
    y = attn(x, *args, **kwargs)

It adopts what the user has and keeps it theirs: the four ``nn.Linear`` (the same objects, used through their
``weight`` and ``bias``; not registered as submodules, so a model holding both sees its own parameter names,
``state_dict`` keys and optimizer state unchanged, and the adapter has no parameters, as ``DistributedAttention``
has none) and the local attention callable, called as DeepSpeed calls it: ``local_attn(q, k, v, *args, **kwargs)``
on ``[s, b, H/W, d]`` (``[b, s, H/W, d]`` batch-first; ``k``, ``v`` with ``Hkv/W`` heads), returning ``q``'s layout,
and registered as ``local_attn`` as ``DistributedAttention`` registers it (the same keys for its parameters, if any).
Rank ``r`` of the group attends with query heads ``r*H/W ...`` and key/value heads ``r*Hkv/W ...``, as with
DeepSpeed's even split.

Gradients, per rank: the input's and the four weights' and ``o_proj``'s bias are DeepSpeed's (this rank's sequence
shard's share); the q/k/v biases' are this rank's heads' share over the whole sequence (DeepSpeed's are every
head's over this rank's shard): summed over the group, as the data-parallel gradient reduction over the
sequence-and-data-parallel ranks sums them, they are the same. DeepSpeed is not imported.

Not covered: uneven head counts (DeepSpeed shards key/value heads that do not divide by ``W`` through its
``num_kv_heads`` path; overlap's ops exchange whole, equal head shards and refuse them), ``rotary_pos_emb`` (apply
rotary embeddings inside ``local_attn``, which sees the whole sequence in order), ``sp_stream``, a fused qkv
projection, and ZeRO stage 3 partitioned parameters (the weights are read directly, not through the ``Linear``'s
forward that ZeRO-3's hooks gather them for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import envs, world
from ..ops.context import describe, fail_before
from ..ops.sp.all_to_all_matmul import OP as OP_OUT
from ..ops.sp.all_to_all_matmul import all_to_all_matmul
from ..ops.sp.matmul_all_to_all import OP as OP_QKV
from ..ops.sp.matmul_all_to_all import matmul_all_to_all
from ..plans import Plan
from ..plans.auto import as_plan
from ..plans.optable import op_spec

_NAME = "overlap.hooks.deepspeed_ulysses.UlyssesAttention"
_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")


class UlyssesAttention(torch.nn.Module):
    """``o_proj(DistributedAttention(local_attn, group)(q, k, v))`` of the q/k/v projections of ``x``, on overlap's
    fused ops (see the module docstring).

    Args:
        q_proj, k_proj, v_proj: the user's ``nn.Linear(hidden, H*d)``, ``nn.Linear(hidden, Hkv*d)`` (twice), whole
            and replicated on the group's ranks as in DeepSpeed-Ulysses; with or without biases.
        o_proj: the user's ``nn.Linear(H*d, hidden_out)``.
        local_attn: the local attention given to ``DistributedAttention``: ``local_attn(q, k, v, *args, **kwargs)``,
            ``q`` ``[s, b, H/W, d]`` and ``k``, ``v`` ``[s, b, Hkv/W, d]`` (``[b, s, ..., d]`` with ``batch_first``),
            the whole sequence in order; returns the context in ``q``'s shape and layout, differentiable.
        group: the sequence-parallel group (``DistributedAttention``'s ``sequence_process_group``; default: the
            world).
        heads: ``H``, query heads; ``kv_heads``: ``Hkv`` (default ``H``; grouped-query attention: fewer, ``H``
            divides by it). Both must divide by the group's size. ``d`` is ``q_proj.out_features / H``.
        batch_first: ``x`` ``[b, s/W, hidden]`` (DeepSpeed's ``batch_dim_idx=0``) instead of ``[s/W, b, hidden]``
            (``batch_dim_idx=1``).
        strategy, plan, timeout: of `overlap.matmul_all_to_all` and `overlap.all_to_all_matmul` (the family's
            strategies in the op table: every one but ``"hierarchical"``; default ``"auto"``).

    Forward: ``attn(x, *args, **kwargs)``: ``x`` this rank's shard of the sequence; ``args`` and ``kwargs`` go to
    ``local_attn`` (as ``DistributedAttention.forward``'s after ``rotary_pos_emb``); returns this rank's shard of
    ``o_proj``'s output, ``[s/W, b, hidden_out]`` (``[b, s/W, hidden_out]`` batch-first).

    Raises:
        TypeError: a projection that is not an ``nn.Linear``, ``local_attn`` not callable; in ``forward``, ``x`` not
            a tensor.
        ValueError: before any communication: head counts that are not positive ints, that do not divide by the
            group's size (DeepSpeed's uneven path is not overlap's), ``H`` not divisible by ``Hkv``, projections whose
            shapes do not fit the head counts or each other, a strategy this family lacks, a bad plan or timeout.
            In ``forward``: ``x`` not 3-D with ``hidden`` features, ``local_attn`` returning another shape than
            ``q``'s (the peers' ops then raise `OverlapMismatchError` at once).
        NotImplementedError: ZeRO stage 3 partitioned parameters.
    """

    def __init__(self, q_proj: torch.nn.Linear, k_proj: torch.nn.Linear, v_proj: torch.nn.Linear,
                 o_proj: torch.nn.Linear, local_attn: Callable[..., torch.Tensor],
                 group: dist.ProcessGroup | None = None, *, heads: int, kv_heads: int | None = None,
                 batch_first: bool = False, strategy: str = "auto", plan: Plan | dict | None = None,
                 timeout: float | None = None):
        super().__init__()
        projs = (q_proj, k_proj, v_proj, o_proj)
        for name, proj in zip(_PROJS, projs, strict=True):
            if not isinstance(proj, torch.nn.Linear):
                raise TypeError(f"{_NAME}: {name} must be the model's torch.nn.Linear, got {type(proj).__name__}")
        if not callable(local_attn):
            raise TypeError(f"{_NAME}: local_attn must be DistributedAttention's local attention, a callable "
                            f"(q, k, v, *args, **kwargs) -> context, got {type(local_attn).__name__}")
        self.heads = _positive_int("heads", heads)
        self.kv_heads = self.heads if kv_heads is None else _positive_int("kv_heads", kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"{_NAME}: heads ({self.heads}) must divide by kv_heads ({self.kv_heads}): each "
                             "key/value head serves the same number of query heads")
        self.head_dim = _head_dim(projs, self.heads, self.kv_heads)
        self.group = world.resolve_group(group)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        for name, count in (("heads", self.heads), ("kv_heads", self.kv_heads)):
            if count % self.world_size:
                raise ValueError(
                    f"{_NAME}: {name} ({count}) must divide by the sequence-parallel group's size ({self.world_size}):"
                    " overlap's ops give every rank whole, equal head shards; DeepSpeed's DistributedAttention "
                    "shards uneven key/value heads through its num_kv_heads path, which overlap does not implement")
        chosen = as_plan(strategy, plan)  # a bad strategy or plan raises here, not at the first forward
        implemented = op_spec(OP_QKV).strategies
        if chosen is not None and chosen.strategy not in implemented:
            raise ValueError(f"{_NAME}: strategy {chosen.strategy!r} is not implemented for the sequence-parallel ops; "
                             f"use one of {['auto', *implemented]}")
        if timeout is not None:
            envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        self.batch_first = bool(batch_first)
        self._projs = projs  # a tuple: the user's modules, not registered here (their names and keys stay theirs)
        self.local_attn = local_attn  # registered if a Module, as DistributedAttention registers it

    @classmethod
    def from_distributed_attention(cls, dist_attn: torch.nn.Module, q_proj: torch.nn.Linear,
                                   k_proj: torch.nn.Linear, v_proj: torch.nn.Linear, o_proj: torch.nn.Linear, *,
                                   heads: int, kv_heads: int | None = None, batch_first: bool = False,
                                   strategy: str = "auto", plan: Plan | dict | None = None,
                                   timeout: float | None = None) -> UlyssesAttention:
        """The adapter for a built ``deepspeed.sequence.layer.DistributedAttention``: its local attention
        (``local_attn``) and group (``spg``), and its ``num_kv_heads`` when set and ``kv_heads`` is not given. Its
        ``scatter_idx`` must be 2 (the heads' dim); ``sp_stream`` is ignored (overlap's ops do their own overlap)."""
        missing = [a for a in ("local_attn", "spg", "scatter_idx") if not hasattr(dist_attn, a)]
        if missing:
            raise TypeError(f"{_NAME}: dist_attn must be a deepspeed.sequence.layer.DistributedAttention; "
                            f"{type(dist_attn).__name__} lacks {', '.join(missing)}")
        if dist_attn.scatter_idx != 2:
            raise ValueError(f"{_NAME}: DistributedAttention's scatter_idx must be 2 (q, k, v [.., .., heads, d]: "
                             f"heads scattered), got {dist_attn.scatter_idx}")
        if kv_heads is None:
            kv_heads = getattr(dist_attn, "num_kv_heads", None)
        return cls(q_proj, k_proj, v_proj, o_proj, dist_attn.local_attn, dist_attn.spg, heads=heads, kv_heads=kv_heads,
                   batch_first=batch_first, strategy=strategy, plan=plan, timeout=timeout)

    q_proj = property(lambda self: self._projs[0], doc="The user's query projection (not a submodule).")
    k_proj = property(lambda self: self._projs[1], doc="The user's key projection (not a submodule).")
    v_proj = property(lambda self: self._projs[2], doc="The user's value projection (not a submodule).")
    o_proj = property(lambda self: self._projs[3], doc="The user's output projection (not a submodule).")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """This rank's shard of the sequence -> its shard of ``o_proj``'s output (class docstring)."""
        self._check(x)
        seq_dim = 1 if self.batch_first else 0
        ops = {"seq_dim": seq_dim, "group": self.group, "strategy": self.strategy, "plan": self.plan,
               "timeout": self.timeout}
        q_proj, k_proj, v_proj, o_proj = self._projs
        qkv = matmul_all_to_all(x, [p.weight.t() for p in (q_proj, k_proj, v_proj)],
                                heads=[self.heads, self.kv_heads, self.kv_heads], **ops)
        # [s, b, n/W*d] (or [b, s, ...]): this rank's heads' columns of each bias, then DeepSpeed's [.., .., n/W, d]
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) if p.bias is None
                   else (t + p.bias.view(self.world_size, -1)[self.rank].to(t.dtype)).unflatten(-1, (-1, self.head_dim))
                   for t, p in zip(qkv, (q_proj, k_proj, v_proj), strict=True))
        ctx = self.local_attn(q, k, v, *args, **kwargs)
        if not isinstance(ctx, torch.Tensor) or ctx.shape != q.shape:
            got = describe(ctx) if isinstance(ctx, torch.Tensor) else type(ctx).__name__
            layout = "[b, s, heads/W, d]" if self.batch_first else "[s, b, heads/W, d]"
            self._fail(OP_OUT, ValueError(f"{_NAME}: local_attn must return the context in q's shape "
                                          f"{tuple(q.shape)} ({layout}), got {got}"))
        y = all_to_all_matmul(ctx.flatten(-2), o_proj.weight.t(), **ops)
        if o_proj.bias is not None:
            y = y + o_proj.bias.to(y.dtype)
        return y

    def _check(self, x: Any) -> None:
        """Local checks before the first exchange; a mistake raises here and makes the peers' projection raise."""
        error: Exception | None = None
        hidden = self._projs[0].in_features
        if not isinstance(x, torch.Tensor):
            error = TypeError(f"{_NAME}: x must be a tensor, got {type(x).__name__}")
        elif x.dim() != 3 or x.shape[-1] != hidden:
            layout = "[b, s/W, {}]" if self.batch_first else "[s/W, b, {}]"
            error = ValueError(f"{_NAME}: x must be {layout.format(hidden)} (batch_first={self.batch_first}), "
                               f"got {describe(x)}")
        else:
            zero3 = [n for n, p in zip(_PROJS, self._projs, strict=True) if hasattr(p.weight, "ds_status")]
            if zero3:
                error = NotImplementedError(f"{_NAME}: {', '.join(zero3)} hold ZeRO stage 3 partitioned parameters; "
                                            "the adapter reads the weights directly (use ZeRO stage 0-2)")
        if error is not None:
            self._fail(OP_QKV, error)

    def _fail(self, op: str, error: Exception) -> None:
        """Raise `error` here, the peers waiting in `op` told at once (`overlap.ops.context.CallContext.fail`)."""
        fail_before(op, self.group, self.timeout, error)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, SP={self.world_size}, "
                f"batch_first={self.batch_first}, strategy={self.strategy!r}")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_NAME}: {name} must be a positive int, got {value!r}")
    return value


def _head_dim(projs: tuple[torch.nn.Linear, ...], heads: int, kv_heads: int) -> int:
    """``d`` from ``q_proj``; every projection's shape checked against the head counts."""
    q, k, v, o = projs
    if q.out_features % heads:
        raise ValueError(f"{_NAME}: q_proj's {q.out_features} output features do not divide into heads ({heads})")
    d = q.out_features // heads
    for name, proj in (("k_proj", k), ("v_proj", v)):
        if proj.out_features != kv_heads * d:
            raise ValueError(f"{_NAME}: {name} must have kv_heads * head_dim = {kv_heads} * {d} output features "
                             f"(head_dim from q_proj: {q.out_features} / {heads} heads), got {proj.out_features}")
        if proj.in_features != q.in_features:
            raise ValueError(f"{_NAME}: {name} takes {proj.in_features} input features, q_proj {q.in_features}: "
                             "q, k and v project the same input")
    if o.in_features != heads * d:
        raise ValueError(f"{_NAME}: o_proj must take heads * head_dim = {heads} * {d} input features, got "
                         f"{o.in_features}")
    return d
