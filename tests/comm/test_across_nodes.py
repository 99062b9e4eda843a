"""Agreement across nodes without a collective (`overlap.ops.hierarchical.agreement`), on emulated nodes
(``OVERLAP_NODE_ID`` per rank; loopback between them): warmed ``hierarchical`` calls of every TP op make no host
rendezvous (counted), the other strategies one each; a rank whose call differs, or whose input is bad, in the middle of
a warmed run is an `OverlapMismatchError` on every other rank (its own `ValueError` on a bad input), raised long before
the deadline, wherever the difference is (this rank's node, its counterpart, a rank of neither); the group works again
on the next call; the all-reduce's network bytes are the least a two-level all-reduce moves.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import nodes
from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.tp_oracle import expect_error

M, K, N = 8, 16, 12


def _ops(group, rank, world_size, strategy, rows=M):
    """Every TP op once, forward and backward, on fresh inputs: their outputs and gradients."""
    import overlap

    torch.manual_seed(1000 + rank)
    out = []
    a = torch.randn(rows, K, requires_grad=True)
    b = torch.randn(K, N, requires_grad=True)
    y = overlap.all_gather_matmul(a, b, group=group, strategy=strategy)
    y.sum().backward()
    out += [y.detach(), a.grad, b.grad]
    a = torch.randn(world_size * rows, K, requires_grad=True)
    y = overlap.matmul_reduce_scatter(a, b, group=group, strategy=strategy)
    y.sum().backward()
    out += [y.detach(), a.grad]
    y = overlap.matmul_all_reduce(a, b, group=group, strategy=strategy)
    out.append(y)
    w = torch.randn(N, K, requires_grad=True)
    x = torch.randn(rows, K, requires_grad=True)
    y = overlap.all_gather_weight_matmul(x, w.t(), group=group, strategy=strategy)
    (y * y).sum().backward()
    out += [y.detach(), x.grad, w.grad]
    return out


def _group_calls(group, rank, world_size, strategy) -> int:
    """How many calls (handshakes) one round of `_ops` makes on `group`: counted by the group's call numbers."""
    from overlap.ops.hierarchical import agreement

    first = agreement.next_number(group)
    _ops(group, rank, world_size, strategy)
    return agreement.next_number(group) - first - 1


def steady_counts(rank, world_size):
    from overlap import symm

    group = nodes.spanning_group(rank, 2, "anode")
    try:
        got = {}
        for strategy in ("hierarchical", "pipelined"):
            _ops(group, rank, world_size, strategy)  # warm
            before = symm.host_sync_counts()["rendezvous"]
            runs = [_ops(group, rank, world_size, strategy) for _ in range(3)]
            got[strategy] = symm.host_sync_counts()["rendezvous"] - before
            got[f"{strategy} calls"] = 3 * _group_calls(group, rank, world_size, strategy)
            ref = _ops(group, rank, world_size, "reference")
            for run in runs:
                for x, z in zip(run, ref, strict=True):
                    torch.testing.assert_close(x, z, rtol=1e-4, atol=1e-4)
        return got
    finally:
        del os.environ["OVERLAP_NODE_ID"]


def test_warmed_hierarchical_calls_make_no_rendezvous(pools):
    for rank, got in enumerate(pools(4).run(steady_counts, timeout=240)):
        assert got["hierarchical"] == 0, (rank, got)
        # the other strategies across nodes: one full handshake per call (4 ops, forward and backward)
        assert got["pipelined"] == got["pipelined calls"] > 0, (rank, got)


def mismatch_mid_run(rank, world_size, culprit, how):
    """Warm, then `culprit` makes another call (`how`): every rank's error, then a good call's result."""
    import overlap

    group = nodes.spanning_group(rank, 2, "mnode")
    try:
        for _ in range(2):
            _ops(group, rank, world_size, "hierarchical")
        a = torch.randn(M, K)
        b = torch.randn(K, N)
        if rank == culprit and how == "shape":
            a = torch.randn(M + 1, K)
        if rank == culprit and how == "bad input":
            b = torch.randn(K + 1, N)
        fn = overlap.matmul_all_reduce if rank == culprit and how == "op" else overlap.all_gather_matmul
        got = expect_error(fn, a, b, group=group, strategy="hierarchical")
        after = _ops(group, rank, world_size, "hierarchical")
        ref = _ops(group, rank, world_size, "reference")
        ok = all(torch.allclose(x, z, rtol=1e-4, atol=1e-4) for x, z in zip(after, ref, strict=True))
        return got, ok
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.parametrize("how", ["shape", "bad input", "op"])
@pytest.mark.parametrize("culprit", [0, 3])
def test_a_difference_mid_run_is_a_mismatch_on_every_rank(pools, culprit, how):
    results = pools(4).run(mismatch_mid_run, culprit, how, timeout=240)
    for rank, ((kind, msg, secs), ok) in enumerate(results):
        want = "ValueError" if rank == culprit and how == "bad input" else "OverlapMismatchError"
        assert kind == want, (rank, kind, msg)
        assert secs < FALLBACK_TIMEOUT_S / 2, (rank, secs, msg)  # told, not timed out
        assert ok, f"rank {rank}: the group gave wrong results after the mismatch"


def all_reduce_bytes(rank, world_size, ranks_per_node, rows):
    """Network bytes of one hierarchical all-reduce of ``[rows, N]`` fp32 per rank, summed over the ranks later."""
    import overlap
    from overlap import comm

    group = nodes.spanning_group(rank, ranks_per_node, "bnode")
    try:
        a, b = torch.randn(rows, K), torch.randn(K, N)
        overlap.matmul_all_reduce(a, b, group=group, strategy="hierarchical")
        before = comm.network_bytes_sent()
        y = overlap.matmul_all_reduce(a, b, group=group, strategy="hierarchical")
        sent = comm.network_bytes_sent() - before
        want = overlap.matmul_all_reduce(a, b, group=group, strategy="reference")
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        return sent
    finally:
        del os.environ["OVERLAP_NODE_ID"]


@pytest.mark.parametrize("world_size, ranks_per_node", [(4, 2), (3, 1)])
def test_all_reduce_moves_the_two_level_minimum(pools, world_size, ranks_per_node):
    rows = 4 * world_size  # (a multiple of the parts: the minimum is exact)
    sent = pools(world_size).run(all_reduce_bytes, ranks_per_node, rows)
    nodes_ = world_size // ranks_per_node
    # Each node sends every other node the node's sums of that node's share of the rows, then the reduced rows of
    # its own share: 2 * (nodes - 1) / nodes of the output per node, over the node's ranks.
    per_node = 2 * (nodes_ - 1) * rows * N * 4 // nodes_
    assert sum(sent) == nodes_ * per_node, sent


def network_deadline(rank, world_size, network_s, call_s):
    """Rank 2 (node 1) never makes the call; its counterpart on node 0 (rank 0) gives up after the network's own
    deadline, the others after the call's. Returns (error kind, message, seconds) of every rank but 2."""
    import time

    import torch.distributed as dist

    import overlap

    os.environ["OVERLAP_NETWORK_TIMEOUT_S"] = str(network_s)
    group = nodes.spanning_group(rank, 2, "netnode")
    try:
        overlap.all_gather_matmul(torch.randn(M, K), torch.randn(K, N), group=group, strategy="reference")  # set up
        if rank == 2:
            time.sleep(call_s + 3)
            return None
        start = time.monotonic()
        try:
            overlap.all_gather_matmul(torch.randn(M, K), torch.randn(K, N), group=group, strategy="hierarchical",
                                      timeout=call_s)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__, str(exc), time.monotonic() - start
        return "no error", "", time.monotonic() - start
    finally:
        del os.environ["OVERLAP_NODE_ID"], os.environ["OVERLAP_NETWORK_TIMEOUT_S"]
        del dist  # (the group is broken: the pool is discarded)


def test_waits_across_nodes_have_their_own_deadline():
    """OVERLAP_NETWORK_TIMEOUT_S bounds the waits on a rank of another node, apart from the call's deadline."""
    from tests.support.harness import LATE_S, run_isolated

    network_s, call_s = 1.5, 8.0
    results = run_isolated(4, network_deadline, network_s, call_s, timeout=120)
    print(*results, sep="\n")
    # The ranks of node 0 wait only on their counterparts across the network: they give up after its deadline
    # (one of them on its own wait, the other told by its node), not the call's.
    assert any(f"waited {network_s:g} s" in r[1] for r in results if r), results
    for rank in (0, 1):
        assert results[rank][0] in ("OverlapTimeout", "OverlapError") and results[rank][2] < call_s, results[rank]
    assert results[3][0] in ("OverlapTimeout", "OverlapError") and results[3][2] < call_s + LATE_S, results[3]


def test_network_deadline_variable_is_checked(monkeypatch):
    from overlap import envs

    monkeypatch.delenv("OVERLAP_NETWORK_TIMEOUT_S", raising=False)
    assert envs.network_timeout_s(12.5) == 12.5
    monkeypatch.setenv("OVERLAP_NETWORK_TIMEOUT_S", "30")
    assert envs.network_timeout_s(12.5) == 30.0
    for bad in ("nan", "inf", "0", "-1", "1e9", "soon"):
        monkeypatch.setenv("OVERLAP_NETWORK_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="OVERLAP_NETWORK_TIMEOUT_S"):
            envs.network_timeout_s(12.5)
