"""overlap.nn.ShardedLinear (FSDP-style, weight and bias sharded by rows) against a single-process nn.Linear:
initialization, forward, gradients (the sum over ranks), the local state_dict and the full checkpoint."""

from __future__ import annotations

import pytest
import torch


def sharded_task(rank, world_size, seed, strategy, bias, dtype):
    import overlap.nn

    torch.manual_seed(seed)
    layer = overlap.nn.ShardedLinear(12, 3 * world_size, bias=bias, strategy=strategy,
                                     dtype=dtype)
    torch.manual_seed(seed)
    full = torch.nn.Linear(12, layer.out_features, bias=bias, dtype=dtype)
    rows = slice(rank * layer.out_features_per_shard, (rank + 1) * layer.out_features_per_shard)
    assert torch.equal(layer.weight, full.weight[rows])
    assert not bias or torch.equal(layer.bias, full.bias[rows])
    assert set(layer.state_dict()) == ({"weight", "bias"} if bias else {"weight"})
    assert layer.state_dict()["weight"].shape == (layer.out_features_per_shard, 12)
    # Every rank its own input (3-D) and output gradient; the sum over ranks of the full layer's gradients.
    xs = [torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(seed + q), dtype=dtype)
          for q in range(world_size)]
    gs = [torch.randn(3, 2, layer.out_features, generator=torch.Generator().manual_seed(seed + 100 + q), dtype=dtype)
          for q in range(world_size)]
    y = layer(xs[rank])
    y.backward(gs[rank])
    want = full(xs[rank])
    for x, g in zip(xs, gs):
        full(x).backward(g)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, want.detach(), **tol)
    torch.testing.assert_close(layer.weight.grad, full.weight.grad[rows], **tol)
    if bias:
        torch.testing.assert_close(layer.bias.grad, full.bias.grad[rows], **tol)
    # The full checkpoint: gathered equals nn.Linear's; loaded into a layer built from another seed.
    ckpt = layer.full_state_dict()
    assert ckpt.keys() == full.state_dict().keys()
    assert all(torch.equal(ckpt[k], full.state_dict()[k]) for k in ckpt)
    torch.manual_seed(seed + 1)
    other = overlap.nn.ShardedLinear(12, layer.out_features, bias=bias, strategy=strategy, dtype=dtype)
    other.load_full_state_dict(full.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), layer.state_dict().values()))
    with pytest.raises(ValueError, match="weight must be"):
        other.load_full_state_dict({"weight": torch.zeros(3, 3), "bias": full.bias})
    return True


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm"])
def test_matches_nn_linear(pools, seed, world_size, strategy):
    assert all(pools(world_size).run(sharded_task, seed, strategy, True, torch.float32))


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_float64_without_bias(pools, seed, world_size):
    assert all(pools(world_size).run(sharded_task, seed, "auto", False, torch.float64))


def bad_sizes(rank, world_size):
    import overlap.nn

    with pytest.raises(ValueError, match="out_features=7 must divide"):
        overlap.nn.ShardedLinear(4, 7)
    with pytest.raises(ValueError, match="positive int"):
        overlap.nn.ShardedLinear(0, 6)
    with pytest.raises(ValueError, match="fastest"):
        overlap.nn.ShardedLinear(4, 6, strategy="fastest")
    return True


def test_bad_sizes_raise(pools):
    assert all(pools(2).run(bad_sizes))
