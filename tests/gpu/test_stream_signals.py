"""``overlap.signals``' stream-ordered primitives on a GPU, which the virtual ranks and the ops' GPU pipelines are
built on: the bounded flag-wait kernel (`cuda_wait_flag_bounded`: times out and says so, or returns once flagged)
and a stream-ordered wait released by a stream-ordered write from another stream. CUDA only."""

from __future__ import annotations

import time

import pytest
import torch

from overlap import signals
from tests.gpu.tolerance import verdict
from tests.gpu.virtual import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device

pytestmark = pytest.mark.cuda  # racing: under one hardware queue they would skip (Device.spin_guard)


def check_flag_wait_kernel(dev: Device) -> None:
    """The timeout path sets the error word after ~0.2 s; the release path returns ~5 ms after a later flag."""
    dev.spin_guard(3, 3)
    words = torch.zeros(8, dtype=torch.int32, device=dev.device)  # [0] flag, [1] err; [2] flag, [3] err
    s, s2, other = dev.stream(), dev.stream(), dev.stream()
    dev.idle("setup")
    # The release path's producer first (held by a gate): 5 ms after the gate opens it flags words[2].
    gate = dev.gate()
    gate.hold(other)
    dev.delay(other, 5_000_000)
    dev.publish(words[2], 5, other)
    # The timeout path: a flag nobody sets.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(s)
    signals.cuda_wait_flag_bounded(words[0].data_ptr(), 1, SHORT_TIMEOUT_NS, words[1].data_ptr(), s.cuda_stream)
    end.record(s)
    # The release path's waiter, concurrently on another stream.
    start2, end2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start2.record(s2)
    signals.cuda_wait_flag_bounded(words[2].data_ptr(), 5, KERNEL_TIMEOUT_NS, words[3].data_ptr(), s2.cuda_stream)
    end2.record(s2)
    gate.open()
    dev.settle([s, s2, other], [words[0], words[2]], "the bounded flag wait")
    waited, released = start.elapsed_time(end) / 1e3, start2.elapsed_time(end2) / 1e3
    w = words.tolist()
    problems = []
    if w[1] != 1 or not 0.1 <= waited <= 2.0:
        problems.append(f"timeout path: err={w[1]} (expected 1) after {waited:.3f} s (expected ~0.2)")
    if w[3] != 0 or not 0.002 <= released <= 1.0:
        problems.append(f"release path: err={w[3]} (expected 0) after {released:.4f} s (expected ~0.005)")
    verdict(problems, f"bounded wait fired after {waited:.3f} s (err=1); released after {released * 1e3:.1f} ms",
            waited_s=waited, released_s=released)


def check_stream_wait(dev: Device) -> None:
    """`cuda_stream_wait_value32` holds its stream until `cuda_stream_write_value32` from another stream.

    The write is issued first (held by a gate), then the wait: the wait can never sit in a hardware queue in
    front of the write that releases it."""
    dev.spin_guard(1, 2)
    words = torch.zeros(4, dtype=torch.int32, device=dev.device)  # [0] flag, [1] marker
    a, b = dev.stream(), dev.stream()
    dev.idle("setup")
    gate = dev.gate()
    gate.hold(b)
    dev.publish(words[0], 3, b)
    signals.cuda_stream_wait_value32(words[0].data_ptr(), 3, a.cuda_stream)
    dev.publish(words[1], 9, a)  # runs only once the wait is released
    done = torch.cuda.Event()
    done.record(a)
    time.sleep(0.05)
    held = not done.query()
    gate.open()
    dev.settle([a, b], [words[0]], "the stream wait")
    marker = int(words[1].item())
    problems = [] if held else ["the stream was not held by the wait"]
    if marker != 9:
        problems.append(f"marker {marker} after the release, expected 9")
    verdict(problems, "held 50 ms, released by a write from another stream")


def test_the_bounded_flag_wait_times_out_and_returns_once_flagged(dev):
    check_flag_wait_kernel(dev)


def test_a_stream_wait_holds_its_stream_until_another_stream_writes(dev):
    check_stream_wait(dev)
