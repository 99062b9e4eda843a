"""How a sequence-parallel op is entered: its checks, plan and signature (`prepare`), on every rank before any data
moves (a local mistake is posted to the peers by the preamble, `overlap.ops.context.preamble`).

Both ops take a sequence-first or batch-first activation (``seq_dim``: the dim of the sequence, any but the last) and
work on its rows with the sequence dim moved first (`seq_first`): a shard of ``s/W`` positions is ``m`` contiguous
rows, ``m = s/W * (the other dims)``, and the whole sequence is ``W`` such blocks in rank order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ...plans import Plan, Problem
from ...plans.auto import as_plan, fit_plan, plan_source, resolve_auto
from .. import library
from ..context import FLOAT_DTYPES, CallContext, autocast_inputs, describe, preamble
from ..fused import check_fused_available


@dataclasses.dataclass(frozen=True)
class SpCall:
    """One call of a sequence-parallel op as its preamble takes it, tensors aside: the op, the caller's `group`,
    `strategy`, `plan`, `timeout` and `seq_dim` (as given: the preamble checks them), and `heads`, the head count of
    each weight of `overlap.matmul_all_to_all` (None for `overlap.all_to_all_matmul`)."""

    op: str
    group: Any = None
    strategy: Any = "auto"
    plan: Any = None
    timeout: Any = None
    seq_dim: Any = 0
    heads: Any = None


def seq_dim_of(op: str, seq_dim: Any, shape: torch.Size) -> int:
    """`seq_dim` as a dim of a tensor of `shape` (negative counts from the end); TypeError/ValueError where it is no
    int or names the last dim (the features) or none."""
    if not isinstance(seq_dim, int) or isinstance(seq_dim, bool):
        raise TypeError(f"overlap.{op}: seq_dim must be an int, got {type(seq_dim).__name__}")
    d = seq_dim + len(shape) if seq_dim < 0 else seq_dim
    if not 0 <= d < len(shape) - 1:
        raise ValueError(f"overlap.{op}: seq_dim={seq_dim} must name a dim of the activation other than the last "
                         f"(its features); the activation has {len(shape)} dims, {tuple(shape)}")
    return d


def fake_seq_dim(op: str, seq_dim: Any, shape: torch.Size) -> int:
    """`seq_dim_of` for a fake implementation (shapes only): 0 where it is bad (the op raises that, on every rank,
    when it runs)."""
    try:
        return seq_dim_of(op, seq_dim, shape)
    except (TypeError, ValueError):
        return 0


def seq_first(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` with its sequence dim `d` first, as contiguous rows ``[s, ..., f]`` (a view where ``d`` is 0)."""
    return (t if d == 0 else t.movedim(d, 0)).contiguous()


def from_seq_first(rows: torch.Tensor, shape: list[int], d: int) -> torch.Tensor:
    """The inverse of `seq_first`: `rows` (``[W, m, f]`` or ``[s*..., f]``) as `shape` sequence-first, then the
    sequence moved back to dim `d`, contiguous."""
    t = rows.reshape(shape)
    return t if d == 0 else t.movedim(0, d).contiguous()


def _check_tensor(op: str, name: str, t: Any, device: torch.device, activation: bool) -> None:
    """`t` a float tensor on the group's device, not empty: an activation of at least 2 dims, else a ``[k, n]``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"overlap.{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"overlap.{op}: {name}'s dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
    if t.dim() < 2 if activation else t.dim() != 2:
        want = "at least 2 dims (its sequence and features)" if activation else "2 dims"
        raise ValueError(f"overlap.{op}: {name} must have {want}, got {describe(t)}")
    if t.numel() == 0:
        raise ValueError(f"overlap.{op}: {name} is empty ({describe(t)}); empty operands are not supported")
    if t.device.type != device.type or (device.type == "cuda" and t.device.index != device.index):
        raise ValueError(f"overlap.{op}: this rank's group computes on {device} but {name} is on {t.device}")


def check_projection(op: str, x: Any, ws: list, heads: Any, d: int, info) -> list[int]:
    """`overlap.matmul_all_to_all`'s operands: ``x`` ``[..., h_in]``, each weight ``[h_in, heads_t * head_dim_t]``
    with one head count per weight (an int for one weight), each count a multiple of the world size (every rank
    gets whole heads). Returns the head counts."""
    _check_tensor(op, "x", x, info.device, True)
    if not ws:
        raise ValueError(f"overlap.{op}: w is an empty list; pass one weight or a list of weights (q, k, v)")
    counts = list(heads) if isinstance(heads, (list, tuple)) else [heads]
    if len(counts) != len(ws):
        raise ValueError(f"overlap.{op}: heads has {len(counts)} count(s) for {len(ws)} weight(s); pass one head "
                         "count per weight (an int for one weight)")
    W = info.world_size
    for i, (w, h) in enumerate(zip(ws, counts, strict=True)):
        name = "w" if len(ws) == 1 else f"w[{i}]"
        _check_tensor(op, name, w, info.device, False)
        if w.dtype != x.dtype:
            raise TypeError(f"overlap.{op}: x and {name} must have one dtype outside autocast, got {x.dtype} and "
                            f"{w.dtype}")
        if w.shape[0] != x.shape[-1]:
            raise ValueError(f"overlap.{op}: {name} must be [h_in, heads * head_dim] with h_in = x's last dim "
                             f"{x.shape[-1]} (pass a weight w[out, in] as w.t()), got {describe(w)}")
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
            raise TypeError(f"overlap.{op}: each head count must be an int >= 1, got {h!r}")
        if w.shape[1] % h:
            raise ValueError(f"overlap.{op}: {name} has {w.shape[1]} columns, not a multiple of its {h} heads")
        if h % W:
            raise ValueError(f"overlap.{op}: {name} has {h} heads, which do not divide by the world size {W}: each "
                             "rank must get whole heads (use a sequence-parallel group whose size divides every "
                             "head count, the key/value heads' of GQA included)")
    return counts


def check_output_projection(op: str, ctx: Any, w_o: Any, d: int, info) -> None:
    """`overlap.all_to_all_matmul`'s operands: ``ctx`` ``[..., s, ..., c]`` (this rank's heads, the whole sequence
    at `d`, divisible by the world size), ``w_o`` ``[W * c, h_out]``."""
    _check_tensor(op, "ctx", ctx, info.device, True)
    _check_tensor(op, "w_o", w_o, info.device, False)
    W = info.world_size
    if w_o.dtype != ctx.dtype:
        raise TypeError(f"overlap.{op}: ctx and w_o must have one dtype outside autocast, got {ctx.dtype} and "
                        f"{w_o.dtype}")
    if w_o.shape[0] != W * ctx.shape[-1]:
        raise ValueError(f"overlap.{op}: w_o must be [heads * head_dim, h_out] with heads * head_dim = world size "
                         f"{W} x ctx's last dim {ctx.shape[-1]} = {W * ctx.shape[-1]} (pass a weight w[out, in] as "
                         f"w.t()), got {describe(w_o)}")
    if ctx.shape[d] % W:
        raise ValueError(f"overlap.{op}: the sequence (dim {d} of ctx={describe(ctx)}) has {ctx.shape[d]} positions, "
                         f"which do not divide by the world size {W}; pad the sequence to a multiple of {W} (overlap "
                         "does not pad silently)")


def prepare(call: SpCall, first: Any, weights: Any, needs_grad: bool | None = None,
            cast: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], int, CallContext]:
    """The preamble of a sequence-parallel op: checks, autocast (unless `cast` is False: the custom op's caller cast
    them), plan and signature. `first` is ``x`` (`overlap.matmul_all_to_all`, ``call.heads`` set) or ``ctx``
    (`overlap.all_to_all_matmul`), `weights` a tensor or a list. Returns ``(first, weights, seq_dim, context)``."""
    op = call.op

    def decide(cc: CallContext) -> tuple[Plan, str, tuple]:
        info = cc.info
        many = isinstance(weights, (list, tuple))
        ws = list(weights) if many else [weights]
        if many and call.heads is None:
            raise TypeError(f"overlap.{op}: w_o must be a tensor, got a {type(weights).__name__}")
        t, *ws = autocast_inputs(first, *ws) if cast else (first, *ws)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"overlap.{op}: the activation must be a tensor, got {type(t).__name__}")
        d = seq_dim_of(op, call.seq_dim, t.shape)
        W = info.world_size
        if call.heads is not None:
            counts = check_projection(op, t, ws, call.heads, d, info)
            rows, k, n = math.prod(t.shape[:-1]), t.shape[-1], sum(w.shape[1] for w in ws)
            shape_sig = f"x={describe(t)}, ws={[tuple(w.shape) for w in ws]}, heads={counts}"
        else:
            check_output_projection(op, t, ws[0], d, info)
            rows, k, n = math.prod(t.shape[:-1]) // W, ws[0].shape[0], ws[0].shape[1]
            shape_sig = f"ctx={describe(t)}, w_o={tuple(ws[0].shape)}"
        shape_sig += f", seq_dim={d}"
        chosen = as_plan(call.strategy, call.plan)
        if chosen is None:
            grad = needs_grad if needs_grad is not None else (
                torch.is_grad_enabled() and any(v.requires_grad for v in (t, *ws)))
            dtype = str(t.dtype).removeprefix("torch.")
            chosen = resolve_auto(op, shape_sig, info, rows, dtype, out_bytes=rows * n * t.element_size(),
                                  problem=_problem(op, rows, k, n, dtype, bool(grad)), plan_file=plan_source(call.plan))
        chosen = fit_plan(op, chosen, info)
        if chosen.strategy == "fused":
            check_fused_available(op, t.dtype)
        return chosen, f"{op}({shape_sig}, plan={chosen.describe()}, ring={info.slowest_link})", (t, ws, d)

    cc, (t, ws, d) = preamble(op, call.group, call.timeout, decide)
    return t, ws, d, cc


def _problem(op: str, rows: int, k: int, n: int, dtype: str, backward: bool) -> Problem | None:
    """The `overlap.plans.Problem` of a call (plan files are keyed by it): ``m`` rows of this rank's sequence shard
    (its input's for the QKV side, its output's for the output side), ``k`` and ``n`` the projection's."""
    try:
        return Problem(op, rows, k, n, dtype, backward)
    except ValueError:  # a call the model does not describe: no plan file entry can match it
        return None


def context(call: SpCall, first: torch.Tensor, weights: Any, needs_grad: bool) -> tuple[list[torch.Tensor], int,
                                                                                        CallContext]:
    """Inside a custom op, whose `call` names its group and plan as text: ``(weights, seq_dim, call context)`` of the
    public call."""
    call = dataclasses.replace(call, group=library.group_of(call.group), plan=library.plan_of(call.plan))
    _t, ws, d, cc = prepare(call, first, weights, needs_grad=needs_grad, cast=False)
    return ws, d, cc
