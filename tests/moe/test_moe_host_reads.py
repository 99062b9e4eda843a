"""What a MoE dispatch costs the host: device-to-host reads and torch ops, counted on CPU ranks.

* A ``reference`` or ``pipelined`` dispatch reads the device once (its own route and the received counts
  together, after the counts' all-to-all), with any number of experts; its rows equal the float64 oracle's.
* A rank with expert ids out of range: it raises ValueError, its peers OverlapMismatchError naming it, at
  once (before any row moves), and the group is usable afterwards.
* A ``reference`` dispatch runs as many torch ops with 2 experts per rank as with 8 (counted).

Not yet: ``symm`` and ``fused`` read their route before the handshake (their heap slot is sized from it) and the
received counts from the heap (2 reads); ``pipelined`` and ``symm`` still run a GEMM per (source, expert) block.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.support import moe_oracle
from tests.support.harness import FALLBACK_TIMEOUT_S

#: The tensor methods that bring a device value to the host (``numpy`` is left out: it only views host memory,
#: as the handshake's shared-memory pad, and raises on a device tensor).
_HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu")


class _HostReads:
    """Counts calls of `_HOST_READS` on any tensor while entered (on this rank's threads)."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self._real = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def __enter__(self):
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._counted(name, real))
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)

    def _counted(self, name, real):
        def call(t, *args, **kwargs):
            self.calls[name] += 1
            return real(t, *args, **kwargs)
        return call


def _inputs(rank, world_size, seed, local_experts, tokens):
    case = moe_oracle.Case(tokens, 16, 12, local_experts * world_size, 2, "random")
    xs, idxs, _, _, w1, _ = moe_oracle.make_inputs(case, seed, world_size, torch.float32)
    L = local_experts
    return xs, idxs, w1[rank * L : (rank + 1) * L], case.experts


def host_reads_task(rank, world_size, strategy, seed, local_experts):
    """Host reads of a warmed dispatch_grouped_matmul (forward, with the gradients' rows kept) and its rows."""
    import overlap

    xs, idxs, w1, E = _inputs(rank, world_size, seed, local_experts, (9, 0, 14))  # (rank 1: no tokens)
    x = xs[rank].clone().requires_grad_(True)
    overlap.moe.dispatch_grouped_matmul(x, idxs[rank], w1, E, strategy=strategy)  # (heaps, groups: set up)
    with _HostReads() as reads:
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idxs[rank], w1, E, strategy=strategy)
    rows, ids = moe_oracle.expected_rows(xs, idxs, rank, local_experts)
    want = torch.zeros(len(ids), w1.shape[2], dtype=torch.float64)
    for i, e in enumerate(ids):
        want[i] = rows[i].double() @ w1[e - rank * local_experts].double()
    moe_oracle.close("h", h, want, torch.float32, f"{strategy} rank {rank}")
    return dict(reads.calls)


@pytest.mark.parametrize("strategy", ["reference", "pipelined"])
@pytest.mark.parametrize("local_experts", [1, 4])
def test_a_flat_dispatch_reads_the_device_once(pools, seed, strategy, local_experts):
    for rank, calls in enumerate(pools(3).run(host_reads_task, strategy, seed, local_experts, timeout=120)):
        assert sum(calls.values()) == 1, f"rank {rank}: host reads {calls} in one {strategy} dispatch"


def bad_ids_task(rank, world_size, strategy, seed):
    """Rank 1 routes to an expert that does not exist; then every rank makes a good call."""
    import overlap
    from overlap import OverlapMismatchError

    xs, idxs, w1, E = _inputs(rank, world_size, seed, 2, (7, 5, 0))
    idx = idxs[rank].clone()
    if rank == 1:
        idx[2, 1] = E + 3
    start = time.monotonic()
    want = ValueError if rank == 1 else OverlapMismatchError
    try:
        overlap.moe.dispatch_grouped_matmul(xs[rank], idx, w1, E, strategy=strategy)
        raise AssertionError(f"rank {rank}: the call returned")
    except want as exc:
        text, seconds = str(exc), time.monotonic() - start
    h, _ = overlap.moe.dispatch_grouped_matmul(xs[rank], idxs[rank], w1, E, strategy=strategy)
    h_ref, _ = overlap.moe.dispatch_grouped_matmul(xs[rank], idxs[rank], w1, E, strategy="reference")
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)  # (other GEMM shapes: never bitwise)
    return text, seconds, E


@pytest.mark.parametrize("strategy", ["reference", "pipelined"])
def test_bad_expert_ids_fail_every_rank_at_once_and_the_group_recovers(pools, seed, strategy):
    results = pools(3).run(bad_ids_task, strategy, seed, timeout=120)
    for rank, (text, seconds, E) in enumerate(results):
        assert seconds < FALLBACK_TIMEOUT_S, f"rank {rank} waited {seconds:.1f} s for a peer's bad input"
        assert f"expert ids must be in [0, {E}), got values from" in text and f"to {E + 3}" in text, (rank, text)
        assert ("invalid input on rank 1" in text) == (rank != 1), (rank, text)


class _TorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def op_count_task(rank, world_size, seed, local_experts):
    """Torch calls of a warmed reference dispatch's body (`overlap.ops.moe.dispatch.forward`: inside the custom
    op a mode would not see them), every expert with rows."""
    from overlap.ops import library
    from overlap.ops.moe import dispatch

    E, T = local_experts * world_size, 32
    g = torch.Generator().manual_seed(seed + rank)
    x, w1 = torch.randn(T, 16), torch.randn(local_experts, 16, 8)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    idx[: E // 2] = torch.arange(E).view(-1, 2)  # (every expert has rows from every rank)
    args = library.call_args(None, "reference", None, None)
    dispatch.forward(x, idx, w1, E, *args, "01")
    with _TorchCalls() as mode:
        dispatch.forward(x, idx, w1, E, *args, "01")
    return mode.count


def test_a_reference_dispatch_runs_as_many_torch_ops_with_any_number_of_experts(pools, seed):
    few, many = (pools(2).run(op_count_task, seed, L, timeout=120) for L in (2, 8))
    assert few == many, f"torch calls per rank with 2 experts per rank {few}, with 8 {many}"
