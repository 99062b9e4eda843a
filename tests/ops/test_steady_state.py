"""The steady state (`overlap.symm.handshake`): warmed `symm` calls skip the host rendezvous, and agreement
still holds, checked in the data.

* After warm-up, 100 calls of each TP op make no full handshake and no ``.item()``/``.tolist()``/``.cpu()``
  (counted by wrapping torch's methods on every rank), and still compute the float64 oracle's result.
* "First call of a signature" is a per-rank fact: ranks that repeat a warmed signature while one rank makes
  a new call (or a call with bad input, or another warmed call) all raise `OverlapMismatchError` (the bad
  input: its own error on that rank), within seconds, never `OverlapTimeout`; the group then computes right.
* A silent peer in the steady state is an `OverlapTimeout` naming it; ``OVERLAP_CHECK_EVERY_CALL=1`` makes
  every call a full handshake.
Every assertion is on counts, error kinds and numbers; the only clock is the generous "within seconds".
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.tp_oracle import AGM, MAR, MRS, call, compare, expect_error, oracle

CASE = (2, (), 8, 6, "contiguous")
OTHER = (2, (), 8, 5, "contiguous")  # another signature (n differs)


def _inputs(op, seed, world_size, rank, case):
    inputs, want = oracle(op, seed, world_size, case, torch.float32)
    a, b, _ = inputs[rank]
    return a, b, want[rank][:1]


class _Counting:
    """Counts calls of torch.Tensor's host-copy methods while active (this process)."""

    NAMES = ("item", "tolist", "cpu")

    def __enter__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)
        self._saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name, method in self._saved.items():
            def counted(t, *args, _name=name, _method=method, **kwargs):
                self.counts[_name] += 1
                return _method(t, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)


def steady_task(rank, world_size, seed, op):
    from overlap import symm

    a, b, want = _inputs(op, seed, world_size, rank, CASE)
    leaf_a, leaf_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    for _ in range(3):  # warm-up: the first call of each signature (forward, backward's) is a full handshake
        call(op, a, b, "symm")
        call(op, leaf_a, leaf_b, "symm").sum().backward()
    counts = []
    for backward in (False, True):
        before = symm.host_sync_counts()
        with _Counting() as counting:
            for _ in range(100 if not backward else 20):
                if backward:
                    call(op, leaf_a, leaf_b, "symm").sum().backward()
                else:
                    out = call(op, a, b, "symm")
        after = symm.host_sync_counts()
        counts.append(({k: after[k] - before[k] for k in after}, counting.counts))
    compare(f"{op} steady, rank {rank}", [out], want, torch.float32)
    with mock.patch.dict(os.environ, {"OVERLAP_CHECK_EVERY_CALL": "1"}):
        for _ in range(5):
            call(op, a, b, "symm")
    checked = symm.host_sync_counts()
    return counts, checked["rendezvous"] - after["rendezvous"]


@pytest.mark.parametrize("op", [AGM, MRS, MAR])
def test_warmed_calls_make_no_rendezvous_and_no_host_copy(pools, seed, op):
    for rank, (counts, checked) in enumerate(pools(2).run(steady_task, seed, op, timeout=180)):
        (forward, copies), (both, copies_both) = counts
        assert forward["rendezvous"] == 0 and forward["steady"] == 100, (rank, forward)
        assert copies == {"item": 0, "tolist": 0, "cpu": 0}, (rank, copies)
        # forward + backward: the backward's transfers are steady calls too (matmul_all_reduce's backward
        # communicates nothing)
        assert both["rendezvous"] == 0 and both["steady"] >= 20, (rank, both)
        assert copies_both == {"item": 0, "tolist": 0, "cpu": 0}, (rank, copies_both)
        assert checked == 5, (rank, checked)


def _case_for(kind: str, rank: int, who: int):
    return OTHER if kind in ("new", "other warmed") and rank == who else CASE


def mismatch_task(rank, world_size, seed, op, who):
    """Per kind: warm CASE (and OTHER for "other warmed"), then rank `who` disagrees while the others repeat
    CASE; twice. Then the group computes right."""
    results = {}
    for kind in ("new", "other warmed", "bad input"):
        a, b, _ = _inputs(op, seed, world_size, rank, CASE)
        for _ in range(2):
            call(op, a, b, "symm")
        if kind == "other warmed":
            a2, b2, _ = _inputs(op, seed, world_size, rank, OTHER)
            for _ in range(2):
                call(op, a2, b2, "symm")
        for attempt in range(2):
            a, b, _ = _inputs(op, seed, world_size, rank, _case_for(kind, rank, who))
            if kind == "bad input" and rank == who:
                b = b[:-1]  # inner dims differ: this rank's own ValueError
            results[f"{kind} #{attempt}"] = expect_error(call, op, a, b, "symm", timeout=20)
    for _ in range(3):  # the group still works, and computes the right thing (steady again after one)
        a, b, want = _inputs(op, seed + 1, world_size, rank, CASE)
        compare(f"{op} after the disagreements, rank {rank}", [call(op, a, b, "symm")], want, torch.float32)
    return results


@pytest.mark.parametrize("op", [AGM, MRS, MAR])
@pytest.mark.parametrize("world_size,who", [(2, 1), (3, 0)])
def test_a_new_call_among_warmed_ones_raises_mismatch_everywhere(pools, seed, op, world_size, who):
    results = pools(world_size).run(mismatch_task, seed, op, who, timeout=240)
    for rank, res in enumerate(results):
        for key, (kind, msg, secs) in res.items():
            ctx = f"{op}, W={world_size}, {key}, rank {rank}: {kind}: {msg}"
            want = "ValueError" if key.startswith("bad input") and rank == who else "OverlapMismatchError"
            assert kind == want, ctx
            assert secs < FALLBACK_TIMEOUT_S, ctx
            if kind == "OverlapMismatchError":
                assert "disagree" in msg and op in msg, ctx


def silent_task(rank, world_size, seed, op, strategy):
    a, b, _ = _inputs(op, seed, world_size, rank, CASE)
    for _ in range(3):
        call(op, a, b, strategy)
    if rank == 1:
        return None  # makes no further call: a silent peer
    return expect_error(call, op, a, b, strategy, timeout=2)


@pytest.mark.parametrize("strategy,op", [("symm", AGM), ("symm", MRS), ("pipelined", AGM), ("pipelined", MRS),
                                         ("pipelined", MAR)])
def test_a_silent_peer_in_the_steady_state_times_out_naming_it(seed, strategy, op):
    from tests.support.harness import RankPool

    pool = RankPool(2)  # (its own pool: the silent rank leaves the group one call behind)
    try:
        kind, msg, secs = pool.run(silent_task, seed, op, strategy, timeout=120)[0]
    finally:
        pool.close()
    assert kind == "OverlapTimeout", msg
    assert "for peer 1" in msg, msg


def capture_task(rank, world_size, seed):
    """Under a (patched) CUDA graph capture every call raises before its handshake, naming what to do."""

    import overlap
    from overlap import symm

    def capturing():
        return mock.patch("torch.cuda.is_initialized", return_value=True), mock.patch(
            "torch.cuda.is_current_stream_capturing", return_value=True)

    a, b, want = _inputs(AGM, seed, world_size, rank, (5, (), 12, 7, "contiguous"))  # (a signature of its own)
    overlap.reserve(None, 1 << 16)  # (the first call's bytes fit: it fails for being first)
    seen = {}
    first, second = capturing()
    with first, second:
        seen["first"] = expect_error(call, AGM, a, b, "symm")
    call(AGM, a, b, "symm")  # the warm-up, outside the capture
    rows = symm.heap_if_open().slot_bytes // (4 * a.shape[1]) + 1
    first, second = capturing()
    with first, second:
        seen["warmed"] = expect_error(call, AGM, a, b, "symm")
        seen["growth"] = expect_error(call, AGM, torch.randn(rows, a.shape[1]), b, "symm")
    compare(f"after the capture errors, rank {rank}", [call(AGM, a, b, "symm")], want, torch.float32)
    return seen


def test_calls_under_cuda_graph_capture_raise_naming_what_to_do(pools, seed):
    for rank, seen in enumerate(pools(2).run(capture_task, seed, timeout=120)):
        for key, want in (("first", "warm-up call"), ("warmed", "epochs advanced on the device"),
                          ("growth", "overlap.reserve(group,")):
            kind, msg, _ = seen[key]
            assert kind == "RuntimeError" and "CUDA graph" in msg and want in msg, (rank, key, kind, msg)


def weight_steady_task(rank, world_size, seed, strategy):
    """all_gather_weight_matmul (forward, the weight's re-gather, the gradient's ring): warmed calls make no
    rendezvous and still match the float64 oracle; then a rank with another shape raises mismatch everywhere."""
    from overlap import symm
    from tests.support import weight_oracle

    case = (4, (), 8, 6, "weight.t()")
    inputs, want = weight_oracle.oracle(seed, world_size, case, torch.float32)
    a, w, g = inputs[rank]
    for _ in range(2):
        weight_oracle.forward_backward(strategy, a, w, "weight.t()", g)
    before = symm.host_sync_counts()
    for _ in range(10):
        got = weight_oracle.forward_backward(strategy, a, w, "weight.t()", g)
    after = symm.host_sync_counts()
    compare(f"all_gather_weight_matmul {strategy} steady, rank {rank}", got, want[rank], torch.float32,
            dict(rtol=1e-4, atol=1e-4))
    other = w[:-1] if rank == 1 else w  # rank 1: a shard of another shape
    error = expect_error(weight_oracle.forward_backward, strategy, a, other, "weight.t()", g[..., :-world_size]
                         if rank == 1 else g)
    return {k: after[k] - before[k] for k in after}, error


@pytest.mark.parametrize("strategy", ["symm", "fused"])
def test_weight_gather_steady_state(pools, seed, strategy):
    for rank, (delta, (kind, msg, secs)) in enumerate(pools(2).run(weight_steady_task, seed, strategy,
                                                                    timeout=180)):
        # symm: forward, re-gather and ring are steady; fused: its forward kernel keeps the full handshake
        steady_per_step = 3 if strategy == "symm" else 2
        assert delta["rendezvous"] == (0 if strategy == "symm" else 10), (rank, delta)
        assert delta["steady"] == 10 * steady_per_step, (rank, delta)
        assert kind in ("OverlapMismatchError", "ValueError"), (rank, kind, msg)
        assert secs < FALLBACK_TIMEOUT_S, (rank, secs)


def every_signature_task(rank, world_size, seed, op):
    """Rank 0 repeats a warmed call, every other rank makes a new call of its own: each message lists every
    rank whose signature differs from the receiver's, also on rank 0 (the steady state's message)."""
    a, b, _ = _inputs(op, seed, world_size, rank, CASE)
    for _ in range(2):
        call(op, a, b, "symm")
    case = CASE if rank == 0 else (2, (), 8, 8 + rank, "contiguous")
    a, b, _ = _inputs(op, seed, world_size, rank, case)
    return expect_error(call, op, a, b, "symm", timeout=20)


@pytest.mark.parametrize("op", [AGM, MRS])
def test_a_steady_mismatch_lists_every_differing_signature(pools, seed, op):
    for rank, (kind, msg, secs) in enumerate(pools(3).run(every_signature_task, seed, op, timeout=120)):
        assert kind == "OverlapMismatchError" and secs < FALLBACK_TIMEOUT_S, (rank, kind, msg)
        for peer in range(3):
            assert f"rank {peer}:" in msg, (rank, peer, msg)
