"""One GPU: checks d and the timings of overlap._C's stream-ordered primitives, which the pipelines of
bench/gpu_check.py's other sections are built on: the bounded flag-wait kernel (`cuda_wait_flag_bounded`),
stream-ordered waits and writes (`cuda_stream_wait_value32`, `cuda_stream_write_value32`), the cost of a
signal, and device-to-device copy bandwidth. GPU only (`gpu_check_virtual.run_virtual` skips them on the CPU).

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import time

import torch
from gpu_check_common import Report, do_bench
from gpu_check_device import KERNEL_TIMEOUT_NS, SHORT_TIMEOUT_NS, Device

from overlap import _C

# ==============================================================================================
# Checks d
# ==============================================================================================


def check_flag_wait_kernel(rep: Report, dev: Device) -> None:
    """d. overlap._C.cuda_wait_flag_bounded: times out and sets *err = 1; returns early once flagged."""
    words = torch.zeros(8, dtype=torch.int32, device=dev.device)  # [0] flag, [1] err; [2] flag, [3] err
    s, s2, other = dev.stream(), dev.stream(), dev.stream()
    dev.idle("d setup")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(s)
    _C.cuda_wait_flag_bounded(words[0].data_ptr(), 1, SHORT_TIMEOUT_NS, words[1].data_ptr(), s.cuda_stream)
    end.record(s)
    # Release path, concurrently on another stream: flagged 5 ms later from a third stream.
    start2, end2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start2.record(s2)
    _C.cuda_wait_flag_bounded(words[2].data_ptr(), 5, KERNEL_TIMEOUT_NS, words[3].data_ptr(), s2.cuda_stream)
    end2.record(s2)
    dev.delay(other, 5_000_000)
    dev.publish(words[2], 5, other)
    dev.settle([s, s2, other], [words[0], words[2]], "d.flag-wait")
    waited, released = start.elapsed_time(end) / 1e3, start2.elapsed_time(end2) / 1e3
    w = words.tolist()
    problems = []
    if w[1] != 1 or not 0.1 <= waited <= 2.0:
        problems.append(f"timeout path: err={w[1]} (expected 1) after {waited:.3f} s (expected ~0.2)")
    if w[3] != 0 or not 0.002 <= released <= 1.0:
        problems.append(f"release path: err={w[3]} (expected 0) after {released:.4f} s (expected ~0.005)")
    value = f"bounded wait fired after {waited:.3f} s (err=1); released after {released * 1e3:.1f} ms"
    rep.add("d.cuda_wait_flag_bounded", "FAIL" if problems else "PASS", "; ".join(problems) or value)


def check_stream_wait(rep: Report, dev: Device) -> None:
    """d. cuda_stream_wait_value32 holds its stream until cuda_stream_write_value32 from another stream."""
    words = torch.zeros(4, dtype=torch.int32, device=dev.device)  # [0] flag, [1] marker
    a, b = dev.stream(), dev.stream()
    dev.idle("d setup")
    _C.cuda_stream_wait_value32(words[0].data_ptr(), 3, a.cuda_stream)
    dev.publish(words[1], 9, a)  # runs only once the wait is released
    done = torch.cuda.Event()
    done.record(a)
    time.sleep(0.05)
    held = not done.query()
    dev.publish(words[0], 3, b)
    dev.settle([a, b], [words[0]], "d.stream-wait")
    marker = int(words[1].item())
    problems = [] if held else ["the stream was not held by the wait"]
    if marker != 9:
        problems.append(f"marker {marker} after the release, expected 9")
    rep.add("d.cuda_stream_wait_value32", "FAIL" if problems else "PASS",
            "; ".join(problems) or "held 50 ms, released by a write from another stream")


# ==============================================================================================
# Timings (one GPU)
# ==============================================================================================


def time_signals(rep: Report, dev: Device, pairs: int = 200) -> None:
    """Cost of stream-ordered signals: ping-pong between two streams, and write+wait pairs on one.

    Each stream is first held by a bounded gate kernel so that every op is enqueued before the
    device starts on them (host enqueue is slower than the device); the gate opens from a third stream.
    """
    for kind in ("ping-pong", "same-stream"):
        words = torch.zeros(8, dtype=torch.int32, device=dev.device)  # [0] gate [1] gate err [2] fa [3] fb
        a, b, opener = dev.stream(), dev.stream(), dev.stream()
        dev.idle("signal setup")
        _C.cuda_wait_flag_bounded(words[0].data_ptr(), 1, 5_000_000_000, words[1].data_ptr(), a.cuda_stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(a)
        fa, fb = words[2].data_ptr(), words[3].data_ptr()
        for i in range(1, pairs + 1):
            if kind == "ping-pong":  # a -> b -> a: one round trip is two signals
                _C.cuda_stream_write_value32(fa, i, a.cuda_stream)
                _C.cuda_stream_wait_value32(fa, i, b.cuda_stream)
                _C.cuda_stream_write_value32(fb, i, b.cuda_stream)
                _C.cuda_stream_wait_value32(fb, i, a.cuda_stream)
            else:
                _C.cuda_stream_write_value32(fa, i, a.cuda_stream)
                _C.cuda_stream_wait_value32(fa, i, a.cuda_stream)
        end.record(a)
        _C.cuda_stream_write_value32(words[0].data_ptr(), 1, opener.cuda_stream)
        dev.settle([a, b, opener], [words[2], words[3]], f"time.signal {kind}")
        per_us = start.elapsed_time(end) * 1e3 / pairs / (2 if kind == "ping-pong" else 1)
        gate_timed_out = int(words[1].item()) != 0
        what = "per signal (write on one stream -> wait released on the other)" if kind == "ping-pong" \
            else "per write+wait pair on one stream"
        note = "; gate timed out, enqueue-bound" if gate_timed_out else ""
        rep.add(f"time signal {kind}", "PASS", f"{per_us:.2f} us {what}{note}", us=per_us)


def time_copy(rep: Report, dev: Device, nbytes: int = 1 << 30) -> None:
    """Device-to-device copy (cudaMemcpyAsync via copy_) bandwidth, bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, device=dev.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src))
    same = bool(torch.equal(dst, src))
    gbps = 2 * nbytes / (t * 1e-3) / 1e9
    rep.add(f"time d2d copy {nbytes >> 20} MiB", "PASS" if same else "FAIL",
            f"{t:.3f} ms, {gbps:.0f} GB/s read+written" + ("" if same else "; copy wrong"), gbps=gbps, ms=t)
