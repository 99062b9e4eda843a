"""The steady state of `pipelined` (`overlap.symm.p2p`): warmed calls of the TP ops on CPU ranks of one node skip
the host rendezvous; their point-to-point messages carry per-call tags and a header with the call's signature.

* After warm-up, 100 forward calls (and forward+backward calls) make no full handshake and compute the float64
  oracle's result on fresh random inputs every call (and `reference`'s, within rounding).
* "First call of a signature" is a per-rank fact: ranks that repeat a warmed signature while one rank makes a new
  call (or another warmed call, or a call with bad input) all raise `OverlapMismatchError` (the bad input: its
  own error on that rank), within seconds, never `OverlapTimeout`; the group then computes right: the sends left
  pending by the abandoned calls are never matched by a later call's receive (tags per call).
* A header of another call is an `OverlapMismatchError`, never data; ``OVERLAP_CHECK_EVERY_CALL=1`` makes every
  call a full handshake. (A silent peer of a steady call, `symm` or `pipelined`: tests/ops/test_steady_state.py.)
Every assertion is on counts, error kinds and numbers; the only clock is the generous "within seconds".
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.steady_cases import AGWM, CASE, TOL, case_of, fb
from tests.support.steady_cases import inputs as _inputs
from tests.support.tp_oracle import AGM, MAR, MRS, call, compare, expect_error

P = "pipelined"


def _fb(op, a, b, g):
    return fb(op, P, a, b, g)


def steady_task(rank, world_size, seed, op):
    from overlap import symm

    a, b, g, _ = _inputs(op, seed, world_size, rank)
    for _ in range(3):  # warm-up: the first call of each signature (forward, the backward's) is a full handshake
        call(op, a, b, P)
        _fb(op, a, b, g)
    before = symm.host_sync_counts()
    for i in range(100):  # fresh random inputs every call, the same shapes: the same warmed signature
        a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank)
        compare(f"{op} steady call {i}, rank {rank}", [call(op, a, b, P)], want[:1], torch.float32, TOL)
    forward = symm.host_sync_counts()
    for i in range(10):
        a, b, g, want = _inputs(op, seed + 200 + i, world_size, rank)
        compare(f"{op} steady forward+backward {i}, rank {rank}", _fb(op, a, b, g), want, torch.float32, TOL)
    both = symm.host_sync_counts()
    ref = call(op, a, b, "reference")
    torch.testing.assert_close(call(op, a, b, P), ref, rtol=1e-5, atol=1e-5)
    with mock.patch.dict(os.environ, {"OVERLAP_CHECK_EVERY_CALL": "1"}):
        start = symm.host_sync_counts()["rendezvous"]
        for _ in range(5):
            call(op, a, b, P)
        checked = symm.host_sync_counts()["rendezvous"] - start
    return ({k: forward[k] - before[k] for k in before}, {k: both[k] - forward[k] for k in before}, checked)


STEADY_OPS = [AGM, MRS, MAR, AGWM]


@pytest.mark.parametrize("op", STEADY_OPS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_warmed_pipelined_calls_make_no_rendezvous(pools, seed, op, world_size):
    for rank, (forward, both, checked) in enumerate(pools(world_size).run(steady_task, seed, op, timeout=300)):
        assert forward["rendezvous"] == 0 and forward["steady"] == 100, (rank, forward)
        # forward + backward: every transfer of the backward is a steady call too (matmul_all_reduce's backward
        # communicates nothing)
        assert both["rendezvous"] == 0 and both["steady"] >= (10 if op == MAR else 20), (rank, both)
        assert checked == 5, (rank, checked)


def _case_for(op, kind: str, rank: int, who: int):
    return case_of(op, kind in ("new", "other warmed") and rank == who)


def mismatch_task(rank, world_size, seed, op, who):
    """Per kind: warm the common case (and the other one for "other warmed"), then rank `who` disagrees while
    the others repeat the warmed call; twice. Then the group computes right (fresh inputs, several calls)."""
    results = {}
    base = _case_for(op, "", rank, who)
    for kind in ("new", "other warmed", "bad input"):
        a, b, _, _ = _inputs(op, seed, world_size, rank, base)
        for _ in range(2):
            call(op, a, b, P)
        if kind == "other warmed":
            a2, b2, _, _ = _inputs(op, seed, world_size, rank, case_of(op, True))
            for _ in range(2):
                call(op, a2, b2, P)
        for attempt in range(2):
            a, b, _, _ = _inputs(op, seed, world_size, rank, _case_for(op, kind, rank, who))
            if kind == "bad input" and rank == who:
                b = b[:-1]  # inner dims differ: this rank's own ValueError
            results[f"{kind} #{attempt}"] = expect_error(call, op, a, b, P, timeout=20)
    for i in range(4):  # the group still works and computes the right thing (steady again after one call)
        a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank, base)
        compare(f"{op} after the disagreements, rank {rank}", [call(op, a, b, P)], want[:1], torch.float32, TOL)
    return results


@pytest.mark.parametrize("op", STEADY_OPS)
@pytest.mark.parametrize("world_size,who", [(2, 1), (3, 0)])
def test_a_new_pipelined_call_among_warmed_ones_raises_mismatch_everywhere(pools, seed, op, world_size, who):
    results = pools(world_size).run(mismatch_task, seed, op, who, timeout=300)
    for rank, res in enumerate(results):
        for key, (kind, msg, secs) in res.items():
            ctx = f"{op}, W={world_size}, {key}, rank {rank}: {kind}: {msg}"
            want = "ValueError" if key.startswith("bad input") and rank == who else "OverlapMismatchError"
            assert kind == want, ctx
            assert secs < FALLBACK_TIMEOUT_S, ctx
            if kind == "OverlapMismatchError":
                assert "disagree" in msg and op in msg, ctx


def every_signature_task(rank, world_size, seed, op):
    """Rank 0 repeats a warmed call, every other rank makes a new call of its own: each message lists every rank
    whose signature differs from the receiver's."""
    a, b, _, _ = _inputs(op, seed, world_size, rank)
    for _ in range(2):
        call(op, a, b, P)
    case = CASE if rank == 0 else (2, (), 8, 8 + rank, "contiguous")
    a, b, _, _ = _inputs(op, seed, world_size, rank, case)
    return expect_error(call, op, a, b, P, timeout=20)


@pytest.mark.parametrize("op", [AGM, MRS, MAR])
def test_a_steady_pipelined_mismatch_lists_every_differing_signature(pools, seed, op):
    for rank, (kind, msg, secs) in enumerate(pools(3).run(every_signature_task, seed, op, timeout=120)):
        assert kind == "OverlapMismatchError" and secs < FALLBACK_TIMEOUT_S, (rank, kind, msg)
        for peer in range(3):
            assert f"rank {peer}:" in msg, (rank, peer, msg)


def large_task(rank, world_size, seed, op):
    """First chunks larger than `PACK_MAX_BYTES`: the header travels alone before the data; warmed calls are
    steady and right."""
    from overlap import symm
    from overlap.symm import p2p

    case = (64, (), 128, 8, "contiguous")  # a's rows per peer: 64 x 128 fp32 = 32 KiB
    assert 64 * 128 * 4 > p2p.PACK_MAX_BYTES
    a, b, _, _ = _inputs(op, seed, world_size, rank, case)
    call(op, a, b, P)
    before = symm.host_sync_counts()
    for i in range(5):
        a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank, case)
        compare(f"{op} large steady call {i}, rank {rank}", [call(op, a, b, P)], want[:1], torch.float32, TOL)
    after = symm.host_sync_counts()
    return {k: after[k] - before[k] for k in before}


@pytest.mark.parametrize("op", [AGM, MRS, MAR])
def test_large_first_chunks_send_the_header_alone(pools, seed, op):
    for rank, delta in enumerate(pools(3).run(large_task, seed, op, timeout=120)):
        assert delta["rendezvous"] == 0 and delta["steady"] == 5, (rank, delta)


def header_task(rank, world_size, seed, op, case=None):
    """A header of another call (its number changed on rank 1's side only) is a mismatch on the receiver, never
    data; the group computes right afterwards."""

    from overlap.symm import p2p

    a, b, _, want = _inputs(op, seed, world_size, rank, case)
    for _ in range(2):
        call(op, a, b, P)
    real = p2p.call_number

    def shifted(c):
        return real(c) + (7 if rank == 1 else 0)

    with mock.patch.object(p2p, "call_number", shifted):
        # (rank 1's tags move too: its messages would never meet; pin the tags to the true number)
        real_init = p2p.Exchange.__init__

        def init(self, c, cc):
            real_init(self, c, cc)
            n = real(c) % p2p.TAG_SPAN
            self.header_tag, self.data_tag = p2p.TAG_BASE + n, p2p.TAG_BASE + p2p.TAG_SPAN + n

        with mock.patch.object(p2p.Exchange, "__init__", init):
            error = expect_error(call, op, a, b, P, timeout=20)
    for i in range(3):
        a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank, case)
        compare(f"{op} after a bad header, rank {rank}", [call(op, a, b, P)], want[:1], torch.float32, TOL)
    return error


@pytest.mark.parametrize("case", [CASE, (64, (), 128, 8, "contiguous")], ids=["packed", "alone"])
def test_a_header_of_another_call_raises_mismatch(pools, seed, case):
    results = pools(2).run(header_task, seed, AGM, case, timeout=120)
    kind, msg, secs = results[0]  # rank 0 received rank 1's shifted header
    assert kind == "OverlapMismatchError" and "rank 1:" in msg, (kind, msg)
    assert secs < FALLBACK_TIMEOUT_S


def one_shot_task(rank, world_size, seed):
    """matmul_all_reduce's one-shot pipelined (every piece to every rank) in the steady state, bitwise the same on
    every rank."""
    from overlap import Plan, symm

    plan = Plan(strategy=P, one_shot=True)
    a, b, _, _ = _inputs(MAR, seed, world_size, rank)
    call(MAR, a, b, plan)
    before = symm.host_sync_counts()
    for i in range(20):
        a, b, _, want = _inputs(MAR, seed + 1 + i, world_size, rank)
        out = call(MAR, a, b, plan)
        compare(f"{MAR} one-shot steady call {i}, rank {rank}", [out], want[:1], torch.float32, TOL)
    after = symm.host_sync_counts()
    return {k: after[k] - before[k] for k in before}, out


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_matmul_all_reduce_one_shot_pipelined_steady(pools, seed, world_size):
    results = pools(world_size).run(one_shot_task, seed, timeout=120)
    for rank, (delta, out) in enumerate(results):
        assert delta["rendezvous"] == 0 and delta["steady"] == 20, (rank, delta)
        assert torch.equal(out, results[0][1]), rank
