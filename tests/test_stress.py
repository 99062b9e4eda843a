"""The buffer protocol under stress, on CPU ranks.

* many calls in flight on one group (forwards whose backwards come later and out of order, more of
  them than the heap has slots), sizes that force growth, ranks that fall behind at random;
* a slow consumer: one rank signals "done with the slot" late (its done-flag stores are delayed on a
  timer), so the others must wait for the slot before they reuse it, and the results stay right;
* slots exhausted for good: the late signal comes after the deadline, and every rank raises
  `OverlapTimeout` naming the slot and the peer, within the deadline plus seconds.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from tp_oracle import AGM, MAR, MRS, b_of, call, compare, name_of, oracle

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


def _delay_done_signals(delay: float, timers: list) -> None:
    """On this rank, make every call's end-of-slot signal reach the peers `delay` seconds late.

    The call's own bookkeeping stays synchronous; only the flag stores move to a timer thread. The
    heap must not grow or be released while a timer is pending (the stores hold its addresses)."""
    from overlap import symm

    def finish(self, stream=None):
        if self._finished or not self.uses_heap:
            return
        self._finished = True
        self.heap.in_flight -= 1
        h = self.heap
        stores = [(self._flag_addr(q, h.done_word(self.slot, self.rank)), self.word) for q in range(self.world_size)]

        def late():
            for addr, word in stores:
                symm._c().signal_store(addr, word)

        timer = threading.Timer(delay, late)
        timer.start()
        timers.append(timer)

    symm.Call.finish = finish


def slow_consumer(rank, world_size, seed, delay, timeout, calls):
    import overlap
    from overlap import symm

    overlap.reserve(None, 1 << 20)  # no growth while late stores are pending
    original = symm.Call.finish
    waited = []
    wait_slot_free = symm.Call.wait_slot_free

    def timed_wait(self, stream=None):
        t0 = time.perf_counter()
        try:
            wait_slot_free(self, stream)
        finally:
            waited.append(time.perf_counter() - t0)

    symm.Call.wait_slot_free = timed_wait
    timers: list = []
    if rank == 1:
        _delay_done_signals(delay, timers)
    outcome = None
    try:
        for i in range(calls):
            op = [AGM, MRS, MAR][i % 3]
            case = (2, (), 16, 8, "contiguous")
            inputs, want = oracle(op, seed + i, world_size, case, torch.float32)
            a, param, _ = inputs[rank]
            t0 = time.perf_counter()
            try:
                y = call(op, a, param, "symm", timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                outcome = (i, type(exc).__name__, str(exc), time.perf_counter() - t0)
                break
            compare(f"call {i} {op} rank {rank}", [y], want[rank][:1], torch.float32)
    finally:
        for timer in timers:
            timer.join()  # every late store lands before the heap can go
        symm.Call.finish, symm.Call.wait_slot_free = original, wait_slot_free
    return outcome, max(waited)


def test_slow_consumer_is_waited_for_and_results_stay_right(pools, seed):
    from overlap.symm import NUM_SLOTS

    calls = 3 * NUM_SLOTS
    results = pools(3).run(slow_consumer, seed, 0.3, 30.0, calls, timeout=120)
    for rank, (outcome, longest_wait) in enumerate(results):
        assert outcome is None, (rank, outcome)
        # Slot reuse had to wait for rank 1's late signal (0.3 s after its call ended).
        assert longest_wait > 0.1, (rank, longest_wait)
    # The heap is only safe to reuse in later tests once everyone's late stores have landed (joined).


@pytest.mark.parametrize("timeout", [1.5])
def test_exhausted_slots_time_out_cleanly(timeout, seed):
    from harness import run_isolated

    from overlap.symm import NUM_SLOTS

    delay = timeout + 3.0  # the late signals come after the deadline
    results = run_isolated(3, slow_consumer, seed, delay, timeout, 2 * NUM_SLOTS, timeout=90)
    indices = set()
    for rank, (outcome, _) in enumerate(results):
        assert outcome is not None, (rank, "no call timed out")
        index, kind, msg, secs = outcome
        indices.add(index)
        # The first call that reuses the slot of one of rank 1's late calls waits for it, then gives
        # up: after NUM_SLOTS calls (one more when the reserve call's slot comes first).
        assert NUM_SLOTS <= index <= NUM_SLOTS + 1, (rank, outcome)
        assert kind == "OverlapTimeout", (rank, outcome)
        assert "slot" in msg and "peer 1" in msg, (rank, msg)
        assert timeout - 0.1 < secs < timeout + 4.0, (rank, secs)
    assert len(indices) == 1, indices  # every rank gives up on the same call
