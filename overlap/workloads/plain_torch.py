"""Every op written with torch alone: the ``torch`` row of the benchmarks, the baseline of every speedup.

No code of this project runs inside these: plain ``torch.distributed`` collectives (under the installed
torch's names: ``all_gather_single``/``reduce_scatter_single`` where present, else
``all_gather_into_tensor``/``reduce_scatter_tensor``; no handshake, no deadlined waits, no comm wrappers;
their bound is the process group's own timeout) and ``torch.matmul``, as a user would write the op without
`overlap`. Forward and backward follow Megatron's conventions. Each op's workload
(`overlap.workloads.Workload.plain_torch`) is ``(group, routing, num_experts) -> fn(*leaves)``, the leaves as
its inputs order them (TP ``(a, b)``, moe ``(x, w1, w2, topk_weights)``):

* ``all_gather_matmul``: ``all_gather_into_tensor(a)``, then ``full @ b``; backward gathers ``a`` again,
  ``grad_a = reduce_scatter_tensor(g @ b.T)``, ``grad_b = full.T @ g``.
* ``matmul_reduce_scatter``: ``a @ b``, then ``reduce_scatter_tensor``; backward
  ``all_gather_into_tensor(g)``, ``grad_a = full_g @ b.T``, ``grad_b = a.T @ full_g``.
* ``matmul_all_reduce``: ``a @ b``, then ``all_reduce``; backward ``g @ b.T`` and ``a.T @ g`` (the output is
  replicated: no communication).
* ``all_gather_weight_matmul``: ``all_gather_into_tensor`` of the weight shards (``b_shard.T`` rows), then
  ``a @ full``; backward gathers the weight again, ``grad_a = g @ full.T``, ``grad_b_shard`` this rank's block
  of ``reduce_scatter_tensor(a.T @ g)`` (over the blocks of columns, as rows of the transpose).
* ``moe``: the counts per expert by ``all_to_all_single``, the rows (sorted by expert) by
  ``all_to_all_single``, one ``torch.matmul`` per local expert and gelu between, the results back by
  ``all_to_all_single`` (the combine direction), the weighted sum over each token's experts in fp32. Its
  backward is autograd through these plain ops, each all-to-all's backward the reverse all-to-all.

The TP ops take the benchmark's 2-D operands (``a [rows, k]``, ``b [k, n]``). Their backward collectives are
explicit in an autograd `Function`, since torch's collectives have no autograd of their own.

fp8 (the factories' ``fp8="rowwise" | "tensorwise" | "mxfp8"``, as the ops' recipe): the forward written the way a
user would with torch alone: each operand cast to ``float8_e4m3fn`` on its owner (amax scales: per row, per tensor,
or MX: per block of 32 along ``k``, the scale a power of two stored as ``float8_e8m0fnu``), the plain collective of
the fp8 bytes and, beside it, of the scales (the all-gather of ``a``, or of the weight's shards as rows: each
column with its scales), and ``torch._scaled_mm`` (MX scales in the tiled layout cuBLAS reads; where it does not
take those operands on that device: the dequantized ``torch.matmul``); the reductions' partials in float32. The
backward is the plain one above, in the leaves' dtype (the recipe's convention). ``moe`` (``fp8="rowwise" |
"mxfp8"``, the dispatch's recipe): each row to send cast on its owner (per row, or per block of 32 along ``H`` with
e8m0 scales), its fp8 bytes and its scales' bytes side by side in one ``uint8`` row, one ``all_to_all_single`` of
those rows, and per expert ``torch._scaled_mm`` of the rows that arrived and ``w1[e]`` cast along ``H`` (dequantized
where it does not take them); gelu, the second GEMM and the combine as without fp8. Its backward, in the leaves'
dtype: the rows' gradient ``grad_h @ w1[e].T`` back by the reverse all-to-all (the cast's derivative taken as 1),
``w1[e]``'s from the dequantized rows that arrived.

Batch-first and several-weight cases (`torch_all_gather_matmul_on`, `torch_matmul_reduce_scatter_on`): torch's
collectives gather and scatter dim 0, so a user of another dim moves it, as DTensor's redistribution does:
the gathered ``[W, ...]`` is concatenated along the dim (a copy), the partial's chunks along the dim stacked
into ``[W, ...]`` (a copy) before the reduce-scatter; one gather feeds every weight (one ``torch.matmul`` each)
and backward sums their input gradients before its one reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# torch 2.12+ renamed the two (the old names warn): the installed torch's own name.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    full = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(full, x.contiguous(), group=group)
    return full


def _scatter_rows(partial: torch.Tensor, group) -> torch.Tensor:
    out = partial.new_empty((partial.shape[0] // dist.get_world_size(group), *partial.shape[1:]))
    _REDUCE_SCATTER(out, partial.contiguous(), group=group)
    return out


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return torch.matmul(_gather_rows(a, group), b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        full = _gather_rows(a, ctx.group)  # only the shard was saved: gathered again, as Megatron does
        grad_a = _scatter_rows(torch.matmul(g, b.t()), ctx.group)
        return grad_a, torch.matmul(full.t(), g), None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return _scatter_rows(torch.matmul(a, b), group)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        full_g = _gather_rows(g, ctx.group)
        return torch.matmul(full_g, b.t()), torch.matmul(a.t(), full_g), None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group):
        ctx.save_for_backward(a, b)
        out = torch.matmul(a, b)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return torch.matmul(g, b.t()), torch.matmul(a.t(), g), None


_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max
_E8M0 = torch.float8_e8m0fnu
#: the MX block: elements along ``k`` sharing one power-of-two scale
_MX = 32
#: ``(device type, out dtype, a's scales, b's scales, dims multiples of 16)`` -> whether ``torch._scaled_mm`` took them
_SCALED_MM: dict[tuple, bool] = {}


def _to_fp8(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)``, ``x ~= x_fp8 * scale``: amax over each row (``[rows, 1]``), the tensor (one element), or
    each block of 32 along the rows (mxfp8: ``[rows, k/32]`` e8m0, the amax's scale rounded up to a power of two)."""
    if granularity == "mxfp8":
        blocks = x.float().unflatten(-1, (-1, _MX))
        amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126 * _FP8_MAX)
        scale = torch.exp2(torch.ceil(torch.log2(amax / _FP8_MAX)).clamp(-127, 127))
        return (blocks / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).flatten(-2), scale.squeeze(-1).to(_E8M0)
    amax = x.abs().amax(dim=-1, keepdim=True) if granularity == "rowwise" else x.abs().amax()
    scale = (amax.float() / _FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale


def _weight_to_fp8(b: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[k, n]`` cast column-major (``torch._scaled_mm``'s layout); rowwise: a scale per column
    ``[1, n]``; mxfp8: ``[k/32, n]``."""
    bt, scale = _to_fp8(b.t(), granularity)
    return bt.t(), scale.t() if scale.dim() else scale


def _swizzled(scale: torch.Tensor) -> torch.Tensor:
    """MX scales ``[rows, k/32]`` as cuBLAS reads them: padded to 128 rows and 4 columns, each 128 x 4 tile stored as
    32 x 16 (row ``r`` of a tile at ``(r % 32, (r // 32) * 4 + c)``), tiles row-block major, flattened."""
    rows, cols = scale.shape
    padded = scale.new_zeros((-(-rows // 128) * 128, -(-cols // 4) * 4))
    padded[:rows, :cols] = scale
    tiles = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1).contiguous()


def _dequantized(x8: torch.Tensor, scale: torch.Tensor, blocks_along: int) -> torch.Tensor:
    if scale.dtype == _E8M0:  # MX: each scale over its block of 32 along k
        return x8.float() * scale.float().repeat_interleave(_MX, dim=blocks_along)
    return x8.float() * scale


def _scaled_mm(a8, a_scale, b8, b_scale, out_dtype: torch.dtype) -> torch.Tensor:
    mx = a_scale.dtype == _E8M0
    key = (a8.device.type, out_dtype, "mx" if mx else a_scale.numel() > 1, b_scale.numel() > 1,
           all(d % 16 == 0 for d in (*a8.shape, b8.shape[1])))
    if _SCALED_MM.get(key, True):
        scales = (_swizzled(a_scale), _swizzled(b_scale.t())) if mx else (a_scale, b_scale)
        try:
            out = torch._scaled_mm(a8, b8, scale_a=scales[0], scale_b=scales[1], out_dtype=out_dtype)
            _SCALED_MM[key] = True
            return out
        except (RuntimeError, NotImplementedError, ValueError):  # (ValueError: torch 2.13 on a CPU, MX scales)
            _SCALED_MM[key] = False
    return torch.matmul(_dequantized(a8, a_scale, -1), _dequantized(b8, b_scale, 0)).to(out_dtype)


def _scaled_partial(a: torch.Tensor, b: torch.Tensor, granularity: str) -> torch.Tensor:
    """``a @ b`` of both cast to fp8 on this rank, in float32 (a reduction's partial)."""
    return _scaled_mm(*_to_fp8(a, granularity), *_weight_to_fp8(b, granularity), torch.float32)


def _gather_fp8(a: torch.Tensor, granularity: str, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``a`` cast on its owner: the fp8 bytes gathered, then the scales (per row of the gathered rows;
    MX: the rows' block scales, as bytes)."""
    a8, scale = _to_fp8(a, granularity)
    full8 = _gather_rows(a8.view(torch.uint8), group).view(_FP8)
    if granularity == "mxfp8":
        return full8, _gather_rows(scale.view(torch.uint8), group).view(_E8M0)
    scales = _gather_rows(scale.reshape(-1, 1), group)
    if granularity != "rowwise":  # one scale per rank: per row of its block
        scales = scales.repeat_interleave(a.shape[0], dim=0)
    return full8, scales


def _fp8_backward(plain: type[torch.autograd.Function]) -> staticmethod:
    """The backward of an fp8 recipe's Function: `plain`'s (the recipe's backward runs in the operands' dtype), and
    no gradient for the granularity argument."""
    return staticmethod(lambda ctx, g: (*plain.backward(ctx, g), None))


class _AllGatherMatmulFp8(_AllGatherMatmul):
    @staticmethod
    def forward(ctx, a, b, group, granularity):
        ctx.save_for_backward(a, b)
        ctx.group = group
        full8, scales = _gather_fp8(a, granularity, group)
        return _scaled_mm(full8, scales, *_weight_to_fp8(b, granularity), a.dtype)

    backward = _fp8_backward(_AllGatherMatmul)


class _MatmulReduceScatterFp8(_MatmulReduceScatter):
    @staticmethod
    def forward(ctx, a, b, group, granularity):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return _scatter_rows(_scaled_partial(a, b, granularity), group).to(a.dtype)

    backward = _fp8_backward(_MatmulReduceScatter)


class _MatmulAllReduceFp8(_MatmulAllReduce):
    @staticmethod
    def forward(ctx, a, b, group, granularity):
        ctx.save_for_backward(a, b)
        out = _scaled_partial(a, b, granularity)
        dist.all_reduce(out, group=group)
        return out.to(a.dtype)

    backward = _fp8_backward(_MatmulAllReduce)


class _AllGatherWeightMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return torch.matmul(a, _gather_rows(b.t(), group).t())

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        full_t = _gather_rows(b.t(), ctx.group)  # [W*n, k]: only the shard was saved, gathered again
        grad_b = _scatter_rows(torch.matmul(g.t(), a), ctx.group).t()  # rows of (a.T @ g).T, this rank's block
        return torch.matmul(g, full_t), grad_b, None


class _AllGatherWeightMatmulFp8(_AllGatherWeightMatmul):
    """The weight gather in fp8: the shard's columns cast on their owner (as rows of ``b_shard.T``: a scale per
    column, or per block of 32 along ``k``) and gathered with their scales; ``a`` cast on this rank."""

    @staticmethod
    def forward(ctx, a, b, group, granularity):
        ctx.save_for_backward(a, b)
        ctx.group = group
        full8, scales = _gather_fp8(b.t(), granularity, group)  # [W*n, k]: every rank's columns as rows
        return _scaled_mm(*_to_fp8(a, granularity), full8.t(), scales.t(), a.dtype)

    backward = _fp8_backward(_AllGatherWeightMatmul)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with split sizes; its backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        back = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(back, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _Fp8ToExperts(torch.autograd.Function):
    """An fp8 dispatch and the first GEMM per expert (module docstring): ``x`` the rows to send (by destination),
    `recv` and `send` the all-to-all's split sizes, `by_expert` the received rows' order by local expert, `sizes` the
    rows per local expert; ``h`` in expert order, in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, w1, recv, send, by_expert, sizes, group, granularity):
        H = x.shape[1]
        x8, scale = _to_fp8(x, granularity)
        scale = scale.reshape(x.shape[0], H // _MX if granularity == "mxfp8" else 1).contiguous()
        packed = torch.cat([x8.view(torch.uint8), scale.view(torch.uint8)], 1)
        got = packed.new_empty((sum(recv), packed.shape[1]))
        dist.all_to_all_single(got, packed, recv, send, group=group)
        got = got.index_select(0, by_expert)
        rows8 = got[:, :H].contiguous().view(_FP8)
        scales = got[:, H:].contiguous().view(_E8M0 if granularity == "mxfp8" else torch.float32)
        outs, at = [], 0
        for e, n in enumerate(sizes):
            if n:
                outs.append(_scaled_mm(rows8[at : at + n], scales[at : at + n], *_weight_to_fp8(w1[e], granularity),
                                       x.dtype))
            at += n
        ctx.save_for_backward(w1, rows8, scales, by_expert)
        ctx.splits, ctx.sizes, ctx.group = (recv, send), sizes, group
        return torch.cat(outs) if outs else x.new_empty((0, w1.shape[2]))

    @staticmethod
    def backward(ctx, grad_h):
        w1, rows8, scales, by_expert = ctx.saved_tensors
        recv, send = ctx.splits
        grad_rows = grad_h.new_empty((grad_h.shape[0], w1.shape[1]))
        grad_w1 = torch.zeros_like(w1)
        at = 0
        for e, n in enumerate(ctx.sizes):
            if n:
                g = grad_h[at : at + n]
                grad_rows[at : at + n] = torch.matmul(g, w1[e].t())
                grad_w1[e] = torch.matmul(_dequantized(rows8[at : at + n], scales[at : at + n], -1).to(g.dtype).t(), g)
            at += n
        back = grad_rows.new_empty((sum(send), grad_rows.shape[1]))
        dist.all_to_all_single(back, grad_rows.index_select(0, torch.argsort(by_expert)), send, recv, group=ctx.group)
        return back, grad_w1, None, None, None, None, None, None


def _moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, routing: torch.Tensor,
         num_experts: int, group, fp8: str = "") -> torch.Tensor:
    W = dist.get_world_size(group)
    L = num_experts // W
    T, K = routing.shape
    flat = routing.reshape(-1)  # pair t*K + k
    order = torch.argsort(flat, stable=True)  # pairs by expert: by destination rank, then local expert
    counts = torch.bincount(flat, minlength=num_experts)
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)  # [source rank, local expert] rows coming
    send = counts.view(W, L).sum(1).tolist()
    blocks = counts_in.view(W, L)
    recv = blocks.sum(1).tolist()
    sent = x.index_select(0, torch.div(order, K, rounding_mode="floor"))
    # Received rows are grouped by source, then local expert: regrouped by expert, one GEMM per expert.
    expert_of_row = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(W), blocks.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    sizes = blocks.sum(0).tolist()
    if fp8:
        hs = torch.split(_Fp8ToExperts.apply(sent, w1, recv, send, by_expert, sizes, group, fp8), sizes)
    else:
        rows = _AllToAll.apply(sent, recv, send, group)
        hs = [torch.matmul(r, w1[e]) for e, r in enumerate(torch.split(rows.index_select(0, by_expert), sizes))]
    outs = [torch.matmul(torch.nn.functional.gelu(h), w2[e]) for e, h in enumerate(hs) if h.numel()]
    y_recv = torch.cat(outs) if outs else x.new_empty((0, w2.shape[-1]))
    y_recv = y_recv.index_select(0, torch.argsort(by_expert))  # back to source order for the combine direction
    back = _AllToAll.apply(y_recv, send, recv, group)  # this rank's pairs, in expert order
    pairs = back.index_select(0, torch.argsort(order))  # pair order t*K + k
    wide = torch.promote_types(x.dtype, torch.float32)
    return (pairs.view(T, K, -1).to(wide) * weights.to(wide).unsqueeze(-1)).sum(1).to(x.dtype)


def _gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    full = _gather_rows(x, group)  # [W * x.shape[0], ...]: rank-major
    return torch.cat(full.chunk(dist.get_world_size(group)), dim=dim) if dim else full


def _scatter_dim(partial: torch.Tensor, dim: int, group) -> torch.Tensor:
    W = dist.get_world_size(group)
    return _scatter_rows(torch.cat(partial.chunk(W, dim=dim)) if dim else partial, group)


class _AllGatherMatmulOn(torch.autograd.Function):
    """`_AllGatherMatmul` on any dim, the gathered rows feeding every weight of `bs`."""

    @staticmethod
    def forward(ctx, a, dim, group, *bs):
        ctx.save_for_backward(a, *bs)
        ctx.dim, ctx.group = dim, group
        full = _gather_dim(a, dim, group)
        return tuple(torch.matmul(full, b) for b in bs)

    @staticmethod
    def backward(ctx, *gs):
        a, *bs = ctx.saved_tensors
        full = _gather_dim(a, ctx.dim, ctx.group)  # gathered again, as Megatron does
        partial = sum(torch.matmul(g, b.t()) for g, b in zip(gs, bs, strict=True))
        flat = full.reshape(-1, full.shape[-1])
        grads_b = [torch.matmul(flat.t(), g.reshape(-1, g.shape[-1])) for g in gs]
        return (_scatter_dim(partial, ctx.dim, ctx.group), None, None, *grads_b)


class _MatmulReduceScatterOn(torch.autograd.Function):
    """`_MatmulReduceScatter` on any dim."""

    @staticmethod
    def forward(ctx, a, b, dim, group):
        ctx.save_for_backward(a, b)
        ctx.dim, ctx.group = dim, group
        return _scatter_dim(torch.matmul(a, b), dim, group)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        full_g = _gather_dim(g, ctx.dim, ctx.group)
        flat = full_g.reshape(-1, full_g.shape[-1])
        return torch.matmul(full_g, b.t()), torch.matmul(a.reshape(-1, a.shape[-1]).t(), flat), None, None


def torch_all_gather_matmul_on(group, dim: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn(a, *bs) -> (y_1, ...)``: ``all_gather(a, dim) @ b_i`` in plain torch, one gather for every weight."""
    return lambda a, *bs: _AllGatherMatmulOn.apply(a, dim, group, *bs)


def torch_matmul_reduce_scatter_on(group, dim: int) -> Callable[..., torch.Tensor]:
    """``fn(a, b)``: ``reduce_scatter(a @ b, dim)`` in plain torch."""
    return lambda a, b: _MatmulReduceScatterOn.apply(a, b, dim, group)


def torch_all_gather_matmul(group, routing=None, num_experts: int = 0, fp8: str = "") -> Callable[..., torch.Tensor]:
    if fp8:
        return lambda a, b: _AllGatherMatmulFp8.apply(a, b, group, fp8)
    return lambda a, b: _AllGatherMatmul.apply(a, b, group)


def torch_matmul_reduce_scatter(group, routing=None, num_experts: int = 0, fp8: str = ""
                                ) -> Callable[..., torch.Tensor]:
    if fp8:
        return lambda a, b: _MatmulReduceScatterFp8.apply(a, b, group, fp8)
    return lambda a, b: _MatmulReduceScatter.apply(a, b, group)


def torch_matmul_all_reduce(group, routing=None, num_experts: int = 0, fp8: str = "") -> Callable[..., torch.Tensor]:
    if fp8:
        return lambda a, b: _MatmulAllReduceFp8.apply(a, b, group, fp8)
    return lambda a, b: _MatmulAllReduce.apply(a, b, group)


def torch_all_gather_weight_matmul(group, routing=None, num_experts: int = 0, fp8: str = ""
                                   ) -> Callable[..., torch.Tensor]:
    if fp8:
        return lambda a, b: _AllGatherWeightMatmulFp8.apply(a, b, group, fp8)
    return lambda a, b: _AllGatherWeightMatmul.apply(a, b, group)


def torch_moe(group, routing=None, num_experts: int = 0, fp8: str = "") -> Callable[..., torch.Tensor]:
    return lambda x, w1, w2, weights: _moe(x, w1, w2, weights, routing, num_experts, group, fp8)
