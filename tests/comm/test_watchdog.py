"""The host watchdog that bounds the GPU ranks' stream-ordered waits (``overlap.signals.watchdog_*``), on plain
host memory, and what `SymmHeap` / `Call` do with it (no GPU: the watchdog is host code in every build).

Each test waits for the watchdog with a deadline (never a fixed sleep) and asserts only what it wrote: the
order in which deadlines are served is the watchdog's contract (earliest first), so a sentinel entry that has
fired proves every earlier deadline was served.
"""

import ctypes
import time

import pytest
import torch

from overlap import signals, symm
from overlap.errors import OverlapTimeout
from overlap.symm import layout
from tests.support.gpu_order import gpu_heap

WAIT_S = 30.0  # how long a test waits for the watchdog to act (it acts within milliseconds)


class Words:
    """int32 words in host memory of this process."""

    def __init__(self, n: int = 8):
        self.t = torch.zeros(n, dtype=torch.int32)

    def addr(self, i: int) -> int:
        return self.t.data_ptr() + 4 * i

    def __getitem__(self, i: int) -> int:
        return ctypes.c_int32.from_address(self.addr(i)).value

    def __setitem__(self, i: int, value: int) -> None:
        signals.signal_store(self.addr(i), value)

    def cancel(self) -> None:
        signals.watchdog_cancel(self.addr(0), 4 * self.t.numel())


WORD, ERR, ABORT = 0, 1, 2


def _arm(w: Words, value: int, timeout: float, peer: int, word: int = WORD) -> None:
    signals.watchdog_arm(w.addr(word), value, timeout, w.addr(ERR), w.addr(ABORT), peer)


def _until(predicate, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < end, f"the watchdog did not act within {WAIT_S} s: {what}"
        time.sleep(0.001)


def test_a_missed_deadline_reports_then_releases_the_word():
    w = Words()
    fired = signals.watchdog_fired()
    _arm(w, 7, 0.01, peer=3)
    _until(lambda: w[WORD] == 7, "release")
    assert (w[ERR], w[ABORT]) == (1, 4), "error word 1 and abort word peer + 1 before the release"
    assert signals.watchdog_fired() >= fired + 1


def test_an_arrived_word_is_left_alone_and_only_the_first_report_is_kept():
    w, sentinel = Words(), Words()
    w[WORD] = 9  # the producer published (a later epoch than the wait's 5) before the deadline
    _arm(w, 5, 0.01, peer=0)
    w2 = Words()
    w2[ABORT] = 2  # an earlier release on this rank: its report stays
    _arm(w2, 3, 0.01, peer=6)
    _arm(sentinel, 1, 0.05, peer=1)  # a later deadline: once it fired, both above were served
    _until(lambda: sentinel[WORD] == 1, "sentinel")
    assert (w[WORD], w[ERR], w[ABORT]) == (9, 0, 0), "a word that arrived is neither lowered nor reported"
    assert (w2[WORD], w2[ERR], w2[ABORT]) == (3, 1, 2)


def test_cancel_drops_entries_of_memory_about_to_go():
    w, sentinel = Words(), Words()
    _arm(w, 4, 0.01, peer=0)
    _arm(w, 5, 0.01, peer=1, word=5)
    assert signals.watchdog_cancel(w.addr(0), 4 * w.t.numel()) == 2
    _arm(sentinel, 1, 0.05, peer=1)
    _until(lambda: sentinel[WORD] == 1, "sentinel")
    assert w.t.tolist() == [0] * 8, "a cancelled entry wrote to its memory"


def test_pending_counts_only_words_not_yet_arrived():
    w = Words()
    before = signals.watchdog_pending()
    _arm(w, 2, 600.0, peer=0)
    _arm(w, 2, 600.0, peer=0, word=5)
    assert signals.watchdog_pending() == before + 2
    w[5] = 2
    assert signals.watchdog_pending() == before + 1
    w.cancel()
    assert signals.watchdog_pending() == before


@pytest.mark.parametrize("bad", [
    dict(word_addr=0), dict(word_addr=6), dict(err_addr=0), dict(abort_addr=2),
    dict(timeout_s=float("inf")), dict(timeout_s=-1.0), dict(value=2**31), dict(peer=-1),
])
def test_arm_checks_its_arguments(bad):
    w = Words()
    args = dict(word_addr=w.addr(WORD), value=1, timeout_s=1.0, err_addr=w.addr(ERR), abort_addr=w.addr(ABORT), peer=0)
    args.update(bad)
    with pytest.raises(ValueError):
        signals.watchdog_arm(**args)
    w.cancel()


# ---- what the heap and its calls do with it -----------------------------------------------------------


def _heap(world_size: int = 3, rank: int = 1) -> symm.SymmHeap:
    """A `SymmHeap` over control pads in this process's memory, as a GPU rank sees it (`tests.support.gpu_order`)."""
    return gpu_heap(world_size, rank, slot_bytes=4096)


class Recorder:
    """`overlap.signals` for a GPU rank without a GPU: records the stream-ordered operations; the watchdog and
    the host flags are the real ones."""

    def __init__(self):
        self.ops = []

    def cuda_stream_write_value32(self, addr, value, stream):
        self.ops.append(("write", addr, value))

    def cuda_stream_wait_value32(self, addr, value, stream):
        self.ops.append(("wait", addr, value))

    def __getattr__(self, name):
        return getattr(signals, name)


def test_a_gpu_wait_is_stream_ordered_on_the_pad_and_armed(monkeypatch):
    heap = _heap()
    rec = Recorder()
    monkeypatch.setattr(symm.call, "signals", lambda: rec)
    monkeypatch.setattr(symm.call, "stream_handle", lambda stream: 0)
    call = symm.Call(heap, "test", 6, 0.01, prev_data_epoch=2)
    call.wait_slot_free()
    call.wait_ready(2, index=4)
    word = heap.ready_word(call.slot, 4)
    done = [heap.done_word(call.slot, q) for q in range(3)]
    assert rec.ops == [("wait", heap.ctrl_addr(1, d), 2) for d in done] + [("wait", heap.ctrl_addr(2, word), 6)]
    # Nobody publishes: the watchdog reports (this rank's error word of the peer, its pad's abort word) and
    # releases every word, so the device queue would move on; the next call on the group raises.
    _until(lambda: heap._ctrl_np[2][word] == 6, "release of the ready word")
    assert int(heap.async_errors[2]) == 1 and int(heap._ctrl_np[1][layout.W_ASYNC_ERR]) in (1, 2, 3)
    assert [int(heap._ctrl_np[1][d]) for d in done] == [2, 2, 2]
    with pytest.raises(OverlapTimeout):
        heap.check_async_errors("next", 1.0)


def test_a_gpu_publish_writes_the_pad_and_the_kernels_word(monkeypatch):
    heap = _heap()
    rec = Recorder()
    monkeypatch.setattr(symm.call, "signals", lambda: rec)
    monkeypatch.setattr(symm.call, "stream_handle", lambda stream: 0)
    call = symm.Call(heap, "test", 6, 1.0)
    call.signal_ready(3)
    call.finish()
    word = heap.ready_word(call.slot, 3)
    assert rec.ops[:2] == [("write", heap.ctrl_addr(1, word), 6), ("write", heap.kernel_flag_addr(1, word), 6)]
    assert rec.ops[2:] == [("write", heap.ctrl_addr(q, heap.done_word(call.slot, 1)), 6) for q in range(3)]


def test_a_peers_release_fails_every_ranks_next_call():
    heap = _heap(rank=0)
    heap.check_async_errors("ok", 1.0)  # nothing reported
    heap._ctrl_np[2][layout.W_ASYNC_ERR] = 2  # rank 2's watchdog released a wait on rank 1
    with pytest.raises(OverlapTimeout, match="watchdog of rank 2") as info:
        heap.check_async_errors("next", 1.0)
    assert info.value.peer == 1
