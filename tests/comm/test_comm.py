"""Tier 1, the comm layer without ranks: how a chunked exchange splits rows (`overlap.comm.chunk_bounds`), how a
wait ends (`overlap.comm.wait_work`, `PolledWork`)."""

from __future__ import annotations

import pytest

from overlap import comm


@pytest.mark.parametrize("rows,chunks", [(1, 4), (7, 3), (12, 4), (5, 1), (3, 7)])
def test_chunk_bounds_cover_rows_exactly(rows, chunks):
    bounds = comm.chunk_bounds(rows, chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len(bounds) == min(rows, chunks)
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


class _FakeWork:
    """A work whose blocking ``wait()`` returns once `release` is set (or raises `error`), recording its thread."""

    def __init__(self, error: Exception | None = None):
        import threading

        self.release, self.error, self.threads = threading.Event(), error, []

    def wait(self):
        import threading

        self.threads.append(threading.current_thread())
        if not self.release.wait(30):
            raise AssertionError("never released")
        if self.error is not None:
            raise self.error


def test_polled_waits_share_one_waiter_thread_and_a_stuck_one_is_replaced():
    """`PolledWork` (gloo's reduce-scatter) waits on the process's waiter thread: one thread for every wait, not one
    per wait; a wait past its deadline returns False and leaves that thread to it, and the next wait gets another."""
    works = [_FakeWork() for _ in range(3)]
    for w in works:
        w.release.set()
        assert comm.PolledWork(w).wait() is True
    assert works[0].threads[0] is works[1].threads[0] is works[2].threads[0]  # one waiter thread
    stuck = _FakeWork()
    import datetime

    assert comm.PolledWork(stuck).wait(timeout=datetime.timedelta(seconds=0.05)) is False
    fresh = _FakeWork()
    fresh.release.set()
    assert comm.PolledWork(fresh).wait() is True
    assert fresh.threads[0] is not stuck.threads[0]  # the stuck thread still holds the old wait
    stuck.release.set()
    failing = _FakeWork(RuntimeError("connection closed by peer"))
    failing.release.set()
    with pytest.raises(RuntimeError, match="connection closed"):  # the wait's error, on the caller's thread
        comm.PolledWork(failing).wait()


class _ClosedWork:
    """A gloo work whose ``wait(timeout=)`` fails as a closed connection does, after `after` seconds."""

    def __init__(self, after: float):
        self.after = after

    def wait(self, timeout=None):
        import time

        time.sleep(self.after)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")


@pytest.mark.parametrize(("after", "timeout", "kind"), [
    (0.0, 60.0, "OverlapError"),  # closed long before the deadline: the peer died
    (0.2, 0.2, "OverlapTimeout"),  # closed at the deadline by a live peer: its own deadline fired first
])
def test_a_closed_connection_is_a_death_before_the_deadline_and_a_timeout_at_it(after, timeout, kind):
    from overlap.errors import OverlapError

    with pytest.raises(OverlapError) as raised:
        comm.wait_work(_ClosedWork(after), "op", 0, 1, 3, timeout)
    assert type(raised.value).__name__ == kind, raised.value
    assert "peer 1" in str(raised.value) and "chunk 3" in str(raised.value), raised.value
