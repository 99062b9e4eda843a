"""Plain calls without a rendezvous (`overlap.symm.plain`): a ``reference`` call of a TP op whose signature the
group's recent calls predict issues its collectives at once, on CPU ranks of one node.

* The prediction (`Agreement`): from a window of agreed epochs only, the same on every rank that has them all.
* After `WINDOW` agreed calls, forward calls and forward+backward calls of every TP op make no rendezvous and
  compute the float64 oracle's result on fresh random inputs.
* A rank that disagrees while its peers go ahead (a new shape, another warmed `reference` signature, a warmed
  `symm` signature, its own bad input) gets its error, the peers `OverlapMismatchError`, within seconds (the
  disagreeing rank answers the peers' collectives with zeros: no abort, no timeout, no result returned), and
  the group computes right afterwards, going ahead again once the window is agreed again.
* ``OVERLAP_CHECK_EVERY_CALL=1`` makes every call a full handshake.
Every assertion is on counts, error kinds and numbers; the only clock is the generous "within seconds".
"""

from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import torch

from overlap.symm.plain import WINDOW, Agreement
from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.steady_cases import AGWM, TOL, case_of, fb
from tests.support.steady_cases import inputs as _inputs
from tests.support.tp_oracle import AGM, MAR, MRS, call, compare, expect_error

R = "reference"
OPS = [AGM, MRS, MAR, AGWM]


# -- the prediction ----------------------------------------------------------------------------------------


def _agreed(keys, start=1):
    agreement = Agreement()
    for i, key in enumerate(keys):
        if key is not None:
            agreement.add(start + i, key)
    return agreement, start + len(keys)


def test_the_prediction_repeats_the_window_period():
    a, b, c = (1, 1), (2, 2), (3, 3)
    agreement, nxt = _agreed([a, b, c] * 6)
    assert agreement.predict(nxt) == a
    agreement.add(nxt, a)
    assert agreement.predict(nxt + 1) == b
    same, nxt = _agreed([a] * WINDOW)
    assert same.predict(nxt) == a


def test_no_prediction_without_a_whole_agreed_window():
    a, b = (1, 1), (2, 2)
    short, nxt = _agreed([a] * (WINDOW - 1))
    assert short.predict(nxt) is None  # too few agreed calls
    hole, nxt = _agreed([a] * 5 + [None] + [a] * WINDOW)
    assert hole.predict(nxt) == a  # the hole is older than the window
    hole, nxt = _agreed([a] * WINDOW + [None] + [a] * 5)
    assert hole.predict(nxt) is None  # an epoch of the window is not agreed (a mismatch, a pending check)
    new, nxt = _agreed([a] * (WINDOW - 1) + [b])
    assert new.predict(nxt) is None  # the last signature never came before in the window
    cleared, nxt = _agreed([a] * 2 * WINDOW)
    cleared.clear()
    assert cleared.predict(nxt) is None


class _Pads:
    """A heap's control pads only (`overlap.symm.handshake` reads nothing else of it), in one process."""

    def __init__(self, world_size: int, rank: int = 0):
        import numpy as np

        from overlap.symm.layout import CTRL_WORDS

        self.world_size, self.rank = world_size, rank
        self._pads = [np.zeros(CTRL_WORDS, dtype=np.int32) for _ in range(world_size)]

    def pad(self, peer: int):
        return self._pads[peer]

    def post(self, peer: int, epoch: int, key: tuple[int, int], signature: str) -> None:
        from overlap.symm import handshake
        from overlap.symm.layout import W_HS_EPOCH

        entry = handshake.entry_word(epoch)
        pad = self._pads[peer]
        pad[entry + 1 : entry + 3] = key
        pad[entry + 6 : entry + 6 + len(handshake._text_words(signature))] = handshake._text_words(signature)
        pad[entry] = epoch
        pad[W_HS_EPOCH] = epoch


def test_a_peer_that_posts_while_its_entry_is_looked_for_is_compared(monkeypatch):
    """A call that went ahead compares a peer that has not posted yet at a later look: a peer that posts between
    the look's reads (its epoch, its entry) is compared then or later, never taken for one that moved on past the
    ring (which leaves the call unable to return its result)."""
    from overlap.symm import handshake

    key, epoch, sig = (11, 22), 9, "op(x)"
    pads = _Pads(3)
    pads.post(2, epoch, key, sig)
    check = handshake.SignatureCheck(pads, "op", epoch, *key, sig, timeout=1.0)
    real = handshake.entry_of

    def racing(heap, peer, e):  # rank 1 posts right after its entry was read (as not there yet)
        got = real(heap, peer, e)
        if peer == 1 and got is None:
            pads.post(1, epoch, key, sig)
        return got

    monkeypatch.setattr(handshake, "entry_of", racing)
    check.resolve()
    monkeypatch.setattr(handshake, "entry_of", real)
    assert 1 in check.unverified and check.compared == {2}, (check.unverified, check.compared)
    check.verify(1)  # (the call's end, after its collectives)
    assert check.agreed


# -- on ranks ----------------------------------------------------------------------------------------------


def _fb(op, a, b, g):
    return fb(op, R, a, b, g)


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


def ahead_task(rank, world_size, seed, op):
    from overlap import symm

    a, b, g, _ = _inputs(op, seed, world_size, rank)
    for _ in range(WINDOW + 2):  # the window of agreed calls: full handshakes
        call(op, a, b, R)
    before = symm.host_sync_counts()
    for i in range(30):  # fresh random inputs every call, the same shapes
        a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank)
        compare(f"{op} call {i} ahead, rank {rank}", [call(op, a, b, R)], want[:1], torch.float32, TOL)
    forward = symm.host_sync_counts()
    for _ in range(WINDOW + 2):  # forward and backward alternate: a new period to agree on
        _fb(op, a, b, g)
    start = symm.host_sync_counts()
    for i in range(8):
        a, b, g, want = _inputs(op, seed + 100 + i, world_size, rank)
        compare(f"{op} forward+backward {i} ahead, rank {rank}", _fb(op, a, b, g), want, torch.float32, TOL)
    both = symm.host_sync_counts()
    with mock.patch.dict(os.environ, {"OVERLAP_CHECK_EVERY_CALL": "1"}):
        checked = symm.host_sync_counts()["rendezvous"]
        for _ in range(5):
            call(op, a, b, R)
        checked = symm.host_sync_counts()["rendezvous"] - checked
    return _delta(before, forward), _delta(start, both), checked


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_predicted_reference_calls_go_ahead_without_rendezvous(pools, seed, op, world_size):
    for rank, (forward, both, checked) in enumerate(pools(world_size).run(ahead_task, seed, op, timeout=300)):
        assert forward["rendezvous"] == 0 and forward["steady"] == 30, (rank, forward)
        # the backward's calls go ahead too (matmul_all_reduce's backward communicates nothing)
        assert both["rendezvous"] == 0 and both["steady"] >= (8 if op == MAR else 16), (rank, both)
        assert checked == 5, (rank, checked)


KINDS = ("new", "other warmed", "symm warmed", "bad input")


def mismatch_task(rank, world_size, seed, op, who):
    """Per kind: warm up (the other rank's signature too where it is a warmed one), agree on a window of the
    common call, then rank `who` disagrees while the others go ahead; the group computes right afterwards."""
    from overlap import symm

    results = {}
    base = case_of(op, False)
    for kind in KINDS:
        a2, b2, _, _ = _inputs(op, seed, world_size, rank, case_of(op, True))
        if kind == "other warmed":
            call(op, a2, b2, R)
        if kind == "symm warmed":
            for _ in range(2):
                call(op, a2, b2, "symm")
        a, b, _, _ = _inputs(op, seed, world_size, rank, base)
        for _ in range(WINDOW + 1):
            call(op, a, b, R)
        strategy = "symm" if kind == "symm warmed" and rank == who else R
        if rank == who:
            a, b = (a2, b2) if kind != "bad input" else (a, b[:-1])  # (bad input: inner dims differ)
        before = symm.host_sync_counts()
        kind_msg = expect_error(call, op, a, b, strategy, timeout=20)
        results[kind] = (*kind_msg, _delta(before, symm.host_sync_counts()))
        for i in range(WINDOW + 3):  # the group computes right, and goes ahead again once agreed again
            a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank, base)
            compare(f"{op} after '{kind}', rank {rank}", [call(op, a, b, R)], want[:1], torch.float32, TOL)
        before = symm.host_sync_counts()
        call(op, a, b, R)
        results[kind + " then"] = _delta(before, symm.host_sync_counts())
    return results


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size,who", [(2, 1), (3, 0)])
def test_a_rank_that_disagrees_with_peers_gone_ahead_gets_no_data_and_no_hang(pools, seed, op, world_size, who):
    results = pools(world_size).run(mismatch_task, seed, op, who, timeout=300)
    for rank, res in enumerate(results):
        for kind in KINDS:
            name, msg, secs, counts = res[kind]
            ctx = f"{op}, W={world_size}, {kind}, rank {rank}: {name}: {msg}"
            want = "ValueError" if kind == "bad input" and rank == who else "OverlapMismatchError"
            assert name == want, ctx
            assert secs < FALLBACK_TIMEOUT_S, ctx
            if name == "OverlapMismatchError":
                assert "disagree" in msg and op in msg, ctx
            if rank != who:  # the peers did go ahead: the disagreeing rank answered their collectives
                assert counts["steady"] == 1 and counts["rendezvous"] == 0, (ctx, counts)
            after = res[kind + " then"]
            assert after["steady"] == 1 and after["rendezvous"] == 0, (ctx, after)


def late_task(rank, world_size, seed, op):
    """Rank 1's input is bad and it arrives first; rank 0 goes ahead 2.5 s later (past the 2 s a mismatch waits to
    list every signature): rank 1 still answers its collectives, then the group computes right."""
    a, b, _, _ = _inputs(op, seed, world_size, rank)
    for _ in range(WINDOW + 1):
        call(op, a, b, R)
    if rank == 0:
        time.sleep(2.5)
    got = expect_error(call, op, a, b[:-1] if rank == 1 else b, R, timeout=30)
    for i in range(3):
        a, b, _, want = _inputs(op, seed + 1 + i, world_size, rank)
        compare(f"{op} after a late peer, rank {rank}", [call(op, a, b, R)], want[:1], torch.float32, TOL)
    return got


def test_a_peer_that_goes_ahead_late_is_still_answered(pools, seed):
    results = pools(2).run(late_task, seed, AGM, timeout=120)
    assert results[0][0] == "OverlapMismatchError" and results[1][0] == "ValueError", results


def unanswered_task(rank, world_size, seed, op):
    """Rank 1 disagrees while rank 0 goes ahead, but has lost the record of the collectives to answer: rank 1's
    later calls raise that the group is unusable (never pair with rank 0's stale collective), rank 0 times out."""
    from overlap import symm

    a, b, _, _ = _inputs(op, seed, world_size, rank)
    for _ in range(WINDOW + 1):
        call(op, a, b, R)
    if rank == 1:
        symm.heap_for(None).plain.recipes = {(0, 0): []}  # (a plain call recorded, not the one to answer)
    a2, b2, _, _ = _inputs(op, seed, world_size, rank, case_of(op, True))
    first = expect_error(call, op, *((a2, b2) if rank == 1 else (a, b)), R, timeout=5)
    then = expect_error(call, op, a, b, R, timeout=5)
    return first, then


def test_a_collective_that_cannot_be_answered_makes_the_group_unusable_not_wrong(seed):
    from tests.support.harness import run_isolated

    (first0, then0), (first1, then1) = run_isolated(2, unanswered_task, seed, AGM, timeout=120)
    assert first1[0] == "OverlapMismatchError", first1
    assert then1[0] == "OverlapError" and "unusable" in then1[1] and "could not answer" in then1[1], then1
    assert first0[0] in ("OverlapTimeout", "OverlapMismatchError"), first0  # (never a result)
    assert then0[0] is not None, then0
