"""The MoE layer's grouped GEMMs: one op per grouped GEMM, whatever the number of experts.

* `grouped.block_mm` and `grouped.grouped_weight_grad` equal one GEMM per block on fresh random inputs (empty
  blocks, every dtype, operands `torch._grouped_mm` takes and operands it does not: the loop then).
* On CPU ranks, a ``reference`` MoE layer forward and backward (dispatch_grouped_matmul, combine) runs the same
  number of GEMM calls with 2 and with 8 experts per rank (counted).
"""

from __future__ import annotations

import pytest
import torch

from overlap.ops.moe import grouped, layout

# (hidden, out, dtype): 16-byte strides (grouped) and not (the loop)
_OPERANDS = [(32, 24, torch.float32), (12, 20, torch.float32), (16, 8, torch.bfloat16), (6, 10, torch.float16),
             (8, 4, torch.float64)]


def _tol(dtype: torch.dtype) -> dict:
    """The same products, perhaps summed in another order by another kernel: never compared bitwise."""
    return {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-5}}.get(
        dtype, {"rtol": 2e-2, "atol": 2e-2})


def _blocks(seed: int, experts: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (experts,), generator=g).tolist()
    counts[experts // 2] = 0  # an empty block in the middle
    return counts


@pytest.mark.parametrize("hidden,out,dtype", _OPERANDS)
def test_block_mm_equals_a_gemm_per_block(seed, hidden, out, dtype):
    counts = _blocks(seed, 5)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    w = torch.randn(5, out, hidden, generator=g).to(dtype).transpose(1, 2)  # (any strides)
    want = torch.cat([x[a : a + c] @ w[e] for e, (a, c) in enumerate(zip(layout.prefix_sums(counts), counts))])
    torch.testing.assert_close(grouped.block_mm(x, w, counts), want, **_tol(dtype))


class _Counts:
    def __init__(self, counts):
        self.tokens_per_expert = counts


@pytest.mark.parametrize("hidden,out,dtype", _OPERANDS)
def test_grouped_weight_grad_equals_a_gemm_per_block(seed, hidden, out, dtype):
    counts = _blocks(seed, 4)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    grad = torch.randn(sum(counts), out, generator=g).to(dtype)
    like = torch.empty(4, hidden, out, dtype=dtype)
    got = grouped.grouped_weight_grad(x, grad, _Counts(counts), like)
    starts = layout.prefix_sums(counts)
    want = torch.stack([x[a : a + c].t() @ grad[a : a + c] for a, c in zip(starts, counts)])
    assert got.shape == like.shape and got.dtype == dtype
    assert not got[len(counts) // 2].any()  # an expert without rows: zeros
    torch.testing.assert_close(got, want, **_tol(dtype))


def gemm_calls(rank, world_size, seed, local_experts):
    """GEMM calls of one reference MoE layer, forward and backward, with `local_experts` experts per rank."""
    import overlap

    calls = {"mm": 0, "_grouped_mm": 0}
    real = {name: getattr(torch, name) for name in calls}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return call

    E, T, H, F, K = local_experts * world_size, 24, 16, 32, 2
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g, requires_grad=True)
    w1 = torch.randn(local_experts, H, F, generator=g, requires_grad=True)
    w2 = torch.randn(local_experts, F, H, generator=g, requires_grad=True)
    for name in calls:
        setattr(torch, name, counted(name))
    try:
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy="reference")
        y = overlap.moe.grouped_matmul_combine(torch.relu(h), w2, wts, handle, strategy="reference")
        y.square().sum().backward()
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)
    assert all(t.grad is not None for t in (x, wts, w1, w2))
    return calls


def test_reference_layer_gemm_calls_do_not_grow_with_the_experts(pools, seed):
    few, many = (pools(2).run(gemm_calls, seed, L) for L in (2, 8))
    for rank, (a, b) in enumerate(zip(few, many)):
        # forward: dispatch, combine; backward: each one's data gradient and weight gradient
        assert a == b == {"mm": 0, "_grouped_mm": 6}, (rank, a, b)
