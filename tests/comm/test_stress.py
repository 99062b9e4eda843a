"""The buffer protocol under stress, on CPU ranks.

* many calls in flight on one group (forwards whose backwards come later and out of order, more of
  them than the heap has slots), sizes that force growth, ranks that fall behind at random;
* a slow consumer: one rank signals "done with the slot" late (its first done-flag store is held until a
  peer has found that slot busy, the later ones are delayed on a timer), so the others must wait for the
  slot before they reuse it, and the results stay right;
* slots exhausted for good: the done signal never comes, and every rank raises `OverlapTimeout` naming
  the slot and the peer, past the deadline by no more than scheduling delays.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tests.support.harness import raised_by_deadline
from tests.support.tp_oracle import AGM, MAR, MRS, b_of, call, compare, name_of, oracle

# ----------------------------------------------------------------------------------------------
# Many calls in flight, growth, ranks out of step
# ----------------------------------------------------------------------------------------------


def in_flight_with_growth(rank, world_size, seed, calls, max_pending):
    import overlap

    rng = random.Random(seed)  # the same calls, in the same order, on every rank
    pending = []
    done = 0
    peak = 0

    def finish(entry):
        ctx, y, a, param, layout, g, want, length = entry
        y.backward(g)
        tol = dict(rtol=1e-5, atol=2e-5 * max(1.0, length / 128) ** 0.5)  # fp32 error grows with the sums
        compare(ctx, [y.detach(), a.grad, b_of(param.grad, layout)], want, torch.float32, tol)

    for i in range(calls):
        op = rng.choice([AGM, MRS, MAR])
        strategy = rng.choice(["symm", "symm", "pipelined", "fused", overlap.Plan("symm", num_chunks={"shm": 3})])
        if op == MAR and rng.random() < 0.4:
            strategy = overlap.Plan(name_of(strategy).split("(")[0] if isinstance(strategy, str) else "symm",
                                    one_shot=True)
        fused = name_of(strategy).startswith("fused")
        # Sizes grow in phases: every few calls the heap has to grow (between calls, as it must).
        scale = 1 + i // 6
        rows = rng.choice([1, 2, 3]) if fused else rng.randint(1, 4 * scale)
        k = rng.choice([8, 16]) if fused else rng.choice([8, 24, 40 * scale])
        case = (rows, rng.choice([(), (2,)]), k, rng.choice([5, 16]), rng.choice(["contiguous", "weight.t()"]))
        laggard, lag = rng.randrange(world_size), rng.uniform(0.01, 0.05)  # drawn on every rank alike
        if rng.random() < 0.3 and rank == laggard:
            time.sleep(lag)  # this rank falls behind
        inputs, want = oracle(op, seed + i, world_size, case, torch.float32)
        a, param, g = inputs[rank]
        a, param = a.clone().requires_grad_(), param.clone().requires_grad_()
        y = call(op, a, b_of(param, case[-1]), strategy)
        ctx = f"call {i}: {op} rank {rank}/{world_size} {name_of(strategy)} case={case} seed={seed + i}"
        length = world_size * max(k, case[-2], rows * 2 * world_size)  # longest sum behind any result
        pending.append((ctx, y, a, param, case[-1], g, want[rank], length))
        peak = max(peak, len(pending))
        # Backwards come late, out of order, with up to max_pending forwards alive.
        while pending and (len(pending) >= max_pending or rng.random() < 0.25):
            finish(pending.pop(rng.randrange(len(pending))))
            done += 1
    while pending:
        finish(pending.pop())
        done += 1
    return done, peak


def test_many_calls_in_flight_with_growth(pools, seed):
    from overlap.symm import NUM_SLOTS

    results = pools(3).run(in_flight_with_growth, seed, 24, NUM_SLOTS + 4, timeout=300)
    for rank, (done, peak) in enumerate(results):
        assert done == 24, (rank, done)
        assert peak > NUM_SLOTS, (rank, peak)  # more forwards alive than the heap has slots


# ----------------------------------------------------------------------------------------------
# A slow consumer: one rank's "done with the slot" signals arrive late
# ----------------------------------------------------------------------------------------------


class Marker:
    """One int32 flag in a file every rank maps: a peer that found a slot busy says so here."""

    def __init__(self, path: str):
        self.flag = torch.from_file(path, shared=True, size=1, dtype=torch.int32)

    def set(self) -> None:
        from overlap import _C

        _C.signal_store(self.flag.data_ptr(), 1)

    def wait(self, timeout: float) -> bool:
        from overlap import _C

        return _C.signal_wait(self.flag.data_ptr(), 1, timeout)


def _delay_done_signals(delay: float | None, timers: list, gate: Marker | None) -> None:
    """On this rank, make every call's end-of-slot signal reach the peers late.

    The first call's signal waits for `gate` (a peer found the slot busy), the later ones `delay` s; with
    `delay` None none is ever sent. The call's own bookkeeping stays synchronous; only the flag stores
    move to a thread. The heap must not grow or be released while a store is pending (it holds the
    heap's addresses)."""
    from overlap import _C, symm

    def finish(self, stream=None):
        if self._finished or not self.uses_heap:
            return
        self._finished = True
        self.heap.in_flight -= 1
        h = self.heap
        stores = [(self._flag_addr(q, h.done_word(self.slot, self.rank)), self.word) for q in range(self.world_size)]
        first = not timers

        def late():
            if first and gate is not None:
                assert gate.wait(60.0), "no peer ever found the held slot busy"
            for addr, word in stores:
                _C.signal_store(addr, word)

        if delay is None:
            timers.append(None)  # never sent
            return
        timer = threading.Timer(0.0 if first and gate is not None else delay, late)
        timer.start()
        timers.append(timer)

    symm.Call.finish = finish


def slow_consumer(rank, world_size, seed, delay, timeout, calls, marker_path=None):
    import overlap
    from overlap import symm
    from overlap.errors import OverlapTimeout

    overlap.reserve(None, 1 << 20)  # no growth while late stores are pending
    original = symm.Call.finish
    busy = []  # (call index, slot) of every wait that found its slot still in use
    wait_slot_free = symm.Call.wait_slot_free
    marker = Marker(marker_path) if marker_path else None
    index = [0]

    def checked_wait(self, stream=None):
        # A zero-deadline look first: is the slot still in use by the previous call on some rank?
        patience, self.timeout = self.timeout, 0.0
        try:
            wait_slot_free(self, stream)
        except OverlapTimeout:
            busy.append((index[0], self.slot))
            if marker is not None and rank != 1:
                marker.set()
        finally:
            self.timeout = patience
        wait_slot_free(self, stream)

    symm.Call.wait_slot_free = checked_wait
    timers: list = []
    if rank == 1:
        _delay_done_signals(delay, timers, marker)
    outcome = None
    # The calls before the first reuse of a slot must go through, however busy the machine: they get a long
    # deadline (a fresh pool's first call once took rank 1 over 1.5 s to reach on the CI machine), the later
    # ones `timeout`.
    from overlap.symm import NUM_SLOTS

    patient = max(timeout, 30.0)
    try:
        for i in range(calls):
            index[0] = i
            op = [AGM, MRS, MAR][i % 3]
            case = (2, (), 16, 8, "contiguous")
            inputs, want = oracle(op, seed + i, world_size, case, torch.float32)
            a, param, _ = inputs[rank]
            t0 = time.perf_counter()
            try:
                y = call(op, a, param, "symm", timeout=timeout if i >= NUM_SLOTS else patient)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                outcome = (i, type(exc).__name__, str(exc), time.perf_counter() - t0)
                break
            compare(f"call {i} {op} rank {rank}", [y], want[rank][:1], torch.float32)
    finally:
        for timer in timers:
            if timer is not None:
                timer.join()  # every late store lands before the heap can go
        symm.Call.finish, symm.Call.wait_slot_free = original, wait_slot_free
    return outcome, busy


def test_slow_consumer_is_waited_for_and_results_stay_right(pools, seed, tmp_path):
    """Rank 1 holds its first call's "done" signal until a peer has found that slot busy (a later call
    reusing it had to wait), then sends its signals 0.05 s late: every call completes, right."""
    from overlap.symm import NUM_SLOTS

    marker = tmp_path / "busy"
    marker.write_bytes(bytes(4))
    calls = 3 * NUM_SLOTS
    results = pools(3).run(slow_consumer, seed, 0.05, 30.0, calls, str(marker), timeout=120)
    for rank, (outcome, _) in enumerate(results):
        assert outcome is None, (rank, outcome)
    # The held slot was found busy where it was reused, by rank 0 or 2: only that released the hold.
    assert results[0][1] or results[2][1], [busy for _, busy in results]
    # The heap is only safe to reuse in later tests once everyone's late stores have landed (joined).


@pytest.mark.parametrize("timeout", [1.5])
def test_exhausted_slots_time_out_cleanly(timeout, seed):
    """Rank 1 never sends "done": the first call that reuses one of its slots times out on every rank."""
    from overlap.symm import NUM_SLOTS
    from tests.support.harness import run_isolated

    results = run_isolated(3, slow_consumer, seed, None, timeout, 2 * NUM_SLOTS, timeout=90)
    indices = set()
    for rank, (outcome, _) in enumerate(results):
        assert outcome is not None, (rank, "no call timed out")
        index, kind, msg, secs = outcome
        indices.add(index)
        # The first call that reuses the slot of one of rank 1's calls waits for it, then gives
        # up: after NUM_SLOTS calls (one more when the reserve call's slot comes first).
        assert NUM_SLOTS <= index <= NUM_SLOTS + 1, (rank, outcome)
        assert kind == "OverlapTimeout", (rank, outcome)
        assert "slot" in msg and "peer 1" in msg, (rank, msg)
        assert raised_by_deadline(secs, timeout), (rank, secs)
    assert len(indices) == 1, indices  # every rank gives up on the same call
