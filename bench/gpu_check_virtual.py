"""Virtual ranks on one device (bench/gpu_check.py): `Device` (a GPU with its streams and stream-ordered flag
writes, or the CPU under the Triton interpreter), the bounded drain every check ends with, the host-released gates
and the guards of the checks that spin, the kernels' tile configurations (`Tile`), the timeouts every virtual-rank
section shares; and the checks d and timings of the stream-ordered signals (`overlap.signals`) the virtual ranks and
the ops' GPU pipelines are built on: the bounded flag-wait kernel (`cuda_wait_flag_bounded`), stream-ordered waits
and writes (`cuda_stream_wait_value32`, `cuda_stream_write_value32`), the cost of a signal, and device-to-device
copy bandwidth (GPU only).

NCCL refuses two ranks of one communicator on one GPU, so W virtual ranks live in one process, each with
its own stream (`Device.stream`); nothing a check enqueues is waited for unbounded (`Device.settle`). The
sections built on them: gpu_check_tp_ag, gpu_check_tp_rs (their ranks: gpu_check_tp_group) and gpu_check_moe
(gpu_check_moe_group).

How a check that races producers against waiters avoids deadlocking itself through the device's hardware
queues (streams share them: CUDA_DEVICE_MAX_CONNECTIONS of them, 8 by default; the entry point sets 32). A queue
runs its commands in the order they were issued, so a wait issued before the producer it waits for, on a stream
that shares the producer's queue, holds the producer for ever. So every check issues its producers first, in host
order, each behind a host-released gate (`Device.gate`: a one-thread bounded wait on a pinned host word that the
host opens with a plain store, so no queue is needed to open it); then the waiters (kernels that spin, bounded
waits), then their end events; then the host opens the gate. Where the streams have queues of their own the
producers are held until every waiter spins (the race); where they share one the producers run first (no race,
no deadlock). Spinning CTAs must also all be resident at once with an SM to spare for the producers
(`Device.spin_guard`), and the waits of the checks are the bounded ones the ops use (`Device.wait_flag`).

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

import torch
from gpu_check_common import Report, do_bench, poll

from overlap import signals

KERNEL_TIMEOUT_NS = 10_000_000_000  # in-kernel waits of the checks that must not time out
SETTLE_TIMEOUT_S = 30.0  # host deadline for a device queue to drain
SHORT_TIMEOUT_NS = 200_000_000  # the waits that are meant to time out (checks c and d)
GATE_TIMEOUT_NS = 20_000_000_000  # a gate opens by itself after this (its error word says so); < SETTLE_TIMEOUT_S
RELEASE_VALUE = 1 << 30  # what a watchdog writes into flags to release stuck waits


# ==============================================================================================
# Virtual ranks on one device
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class Tile:
    """A tile configuration of the fused kernel (num_warps/num_stages only matter on GPUs)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


class Gate:
    """A host-released stream wait: `hold` enqueues a one-thread bounded wait (overlap.signals'
    `cuda_wait_flag_bounded`) on a pinned host word, `open` stores 1 there from the host. Opening needs no
    device queue, so a gate at the head of a queue that a waiter shares never deadlocks; past GATE_TIMEOUT_NS
    a held stream goes on by itself and `timed_out` says so. A no-op on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.opened = cuda, False
        # [0] the gate, [1] its error word: pinned host memory, which the device reads and the host writes
        self.words = torch.zeros(2, dtype=torch.int32, pin_memory=cuda and torch.cuda.is_available())
        self.held, self.reported = 0, False

    def hold(self, stream: torch.cuda.Stream | None) -> None:
        """Everything enqueued on `stream` after this waits until the gate opens."""
        if self.cuda:
            assert not self.opened, "a gate holds streams only before it opens"
            w = self.words
            signals.cuda_wait_flag_bounded(w[0].data_ptr(), 1, GATE_TIMEOUT_NS, w[1].data_ptr(), stream.cuda_stream)
            self.held += 1

    def open(self) -> None:
        if not self.opened:
            self.opened = True
            signals.signal_store(self.words[0].data_ptr(), 1)

    @property
    def timed_out(self) -> bool:
        return self.cuda and int(self.words[1]) != 0


class Device:
    """Where the virtual ranks run: a GPU (streams, stream-ordered flags) or the CPU (interpreter)."""

    def __init__(self, device: torch.device, report: Report):
        self.device, self.report = device, report
        self.cuda = device.type == "cuda"
        self.streams: list[torch.cuda.Stream] = []  # every stream made here, drained by settle()
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if self.cuda else 0
        # `_fused`'s default tiles: 128x128x64 for 16-bit types on GPUs (Triton's default warps and
        # stages), 32x32x32 interpreted.
        self.tile = Tile(128, 128, 64) if self.cuda else Tile(32, 32, 32)
        self._delay_words = torch.zeros(2, dtype=torch.int32, device=device)
        # Every gate made here, kept for the process's life (a held kernel may read its pinned words until its
        # stream drains): settle() opens any a check left closed.
        self.gates: list[Gate] = []

    def stream(self) -> torch.cuda.Stream | None:
        """A new stream (None on the CPU). torch hands streams out round robin from a pool of 32 per
        priority, so the few streams one check makes are distinct (`distinct` asserts it)."""
        if not self.cuda:
            return None
        s = torch.cuda.Stream(device=self.device)
        self.streams.append(s)
        return s

    @staticmethod
    def distinct(streams: list[torch.cuda.Stream | None]) -> None:
        handles = [s.cuda_stream for s in streams if s is not None]
        assert len(set(handles)) == len(handles), f"streams shared between virtual ranks: {handles}"

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def publish(self, flag: torch.Tensor, value: int, stream: torch.cuda.Stream | None) -> None:
        """Release-store `value` into a flag word: stream-ordered on a GPU, at once on the CPU."""
        if self.cuda:
            signals.cuda_stream_write_value32(flag.data_ptr(), value, stream.cuda_stream)
        else:
            signals.signal_store(flag.data_ptr(), value)

    def delay(self, stream: torch.cuda.Stream, ns: int) -> None:
        """Hold `stream` for about `ns`: overlap.signals' one-thread bounded wait on a flag nobody sets."""
        w = self._delay_words
        signals.cuda_wait_flag_bounded(w[0].data_ptr(), 1, ns, w[1].data_ptr(), stream.cuda_stream)

    def gate(self) -> Gate:
        """A closed gate (see `Gate`): hold the producers on it, issue the waiters, then open it."""
        g = Gate(self.cuda)
        self.gates.append(g)
        return g

    def wait_flag(self, flag: torch.Tensor, value: int, stream: torch.cuda.Stream | None, err: torch.Tensor,
                  timeout_ns: int = KERNEL_TIMEOUT_NS) -> None:
        """The bounded stream-ordered wait the ops use on GPUs (`overlap.symm.call.Call.wait_ready`): a one-thread
        kernel on `stream` that spins until ``flag[0] >= value`` and past `timeout_ns` sets ``err[0]`` (if 0) and
        lets the stream go on."""
        signals.cuda_wait_flag_bounded(flag.data_ptr(), value, timeout_ns, err.data_ptr(), stream.cuda_stream)

    def spin_guard(self, rep: Report, name: str, spinning: int, streams: int) -> bool:
        """True (and a SKIP of `name` recorded) where a check cannot race soundly here: its `spinning` CTAs plus
        an SM for the producers do not fit the device's SMs at one CTA each (a spinning grid could keep a
        producer from starting), or its `streams` streams do not get a hardware queue each."""
        if not self.cuda:
            return False
        if spinning + 1 > self.sm_count:
            rep.add(name, "SKIP", f"{spinning} spinning CTAs leave no SM for the producers ({self.sm_count} SMs)")
            return True
        connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if connections is not None and int(connections) < streams:
            rep.add(name, "SKIP", f"CUDA_DEVICE_MAX_CONNECTIONS={connections} < {streams} streams: they share "
                                  "hardware queues, so the producers would run before the waiters (no race)")
            return True
        return False

    def settle(self, streams: list[torch.cuda.Stream | None], flags: list[torch.Tensor], what: str) -> None:
        """Open every gate still closed, then wait (bounded) until `streams` drain. If they do not, write every
        flag in `flags` from a watchdog stream to release stream-ordered waits, wait again, and raise either way.
        Raises too where a gate opened only by its own timeout (the host's store never reached the device)."""
        if not self.cuda:
            return
        for g in self.gates:
            g.open()
        events = []
        for s in [*[s for s in streams if s is not None], torch.cuda.current_stream(self.device)]:
            ev = torch.cuda.Event()
            ev.record(s)
            events.append(ev)
        if poll(events, SETTLE_TIMEOUT_S):
            late = [g for g in self.gates if not g.reported and g.timed_out]
            for g in late:
                g.reported = True
            if late:
                raise RuntimeError(f"{what}: {len(late)} gate(s) opened by their own timeout, not by the host")
            return
        # High priority: another pool than the streams made here, so never one of the stuck streams.
        watchdog = torch.cuda.Stream(device=self.device, priority=-1)
        for f in flags:
            signals.cuda_stream_write_value32(f.data_ptr(), RELEASE_VALUE, watchdog.cuda_stream)
        if not poll(events, SETTLE_TIMEOUT_S):
            self.report.stuck = what
            raise RuntimeError(f"{what}: the device did not drain within {2 * SETTLE_TIMEOUT_S:.0f} s even after "
                               "a watchdog released the flags; the rest of the group runs in a fresh process")
        raise RuntimeError(f"{what}: the device drained only after a watchdog released the flags "
                           f"({SETTLE_TIMEOUT_S:.0f} s deadline)")

    def idle(self, what: str) -> None:
        """Bounded wait for everything this check enqueued, on every stream made here."""
        self.settle(self.streams, [], what)

    def warm(self, what: str, launch: Callable[[], None]) -> None:
        """Run `launch` (the kernels a check is about to race) once, ungated, and wait for it.

        CUDA loads a kernel's code at its first launch (lazy loading, the default since CUDA 12.2) and waits for
        the device to drain first. Behind a closed gate the device drains only once the host opens the gate,
        which the host, blocked in that launch, never reaches: a 20 s stall and a false FAIL. So a check launches
        every kernel it races once here, before it closes a gate, on data whose flags are already set (the
        same variant: same dtype, tile and layout); `tests/test_gpu_check_order.py`'s model catches a check that
        does not. Interpreted kernels load nothing: a no-op on the CPU."""
        if not self.cuda:
            return
        launch()
        self.idle(f"{what} (warm-up)")


# ==============================================================================================
# Checks d
# ==============================================================================================


def check_flag_wait_kernel(rep: Report, dev: Device) -> None:
    """d. overlap.signals.cuda_wait_flag_bounded: times out and sets *err = 1; returns early once flagged."""
    name = "d.cuda_wait_flag_bounded"
    if dev.spin_guard(rep, name, 3, 3):
        return
    words = torch.zeros(8, dtype=torch.int32, device=dev.device)  # [0] flag, [1] err; [2] flag, [3] err
    s, s2, other = dev.stream(), dev.stream(), dev.stream()
    dev.idle("d setup")
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
    dev.settle([s, s2, other], [words[0], words[2]], name)
    waited, released = start.elapsed_time(end) / 1e3, start2.elapsed_time(end2) / 1e3
    w = words.tolist()
    problems = []
    if w[1] != 1 or not 0.1 <= waited <= 2.0:
        problems.append(f"timeout path: err={w[1]} (expected 1) after {waited:.3f} s (expected ~0.2)")
    if w[3] != 0 or not 0.002 <= released <= 1.0:
        problems.append(f"release path: err={w[3]} (expected 0) after {released:.4f} s (expected ~0.005)")
    value = f"bounded wait fired after {waited:.3f} s (err=1); released after {released * 1e3:.1f} ms"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value)


def check_stream_wait(rep: Report, dev: Device) -> None:
    """d. cuda_stream_wait_value32 holds its stream until cuda_stream_write_value32 from another stream.

    The write is issued first (held by a gate), then the wait: the wait can never sit in a hardware queue in
    front of the write that releases it."""
    name = "d.cuda_stream_wait_value32"
    if dev.spin_guard(rep, name, 1, 2):
        return
    words = torch.zeros(4, dtype=torch.int32, device=dev.device)  # [0] flag, [1] marker
    a, b = dev.stream(), dev.stream()
    dev.idle("d setup")
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
    dev.settle([a, b], [words[0]], name)
    marker = int(words[1].item())
    problems = [] if held else ["the stream was not held by the wait"]
    if marker != 9:
        problems.append(f"marker {marker} after the release, expected 9")
    rep.add(name, "FAIL" if problems else "PASS",
            "; ".join(problems) or "held 50 ms, released by a write from another stream")


# ==============================================================================================
# Timings (one GPU)
# ==============================================================================================


def time_signals(rep: Report, dev: Device, pairs: int = 200) -> None:
    """Cost of stream-ordered signals: ping-pong between two streams, and write+wait pairs on one.

    Stream ``a`` is held by a host-released gate until every op is enqueued (host enqueue is slower than
    the device); within each pair the write is issued before the wait that needs it.
    """
    for kind in ("ping-pong", "same-stream"):
        words = torch.zeros(8, dtype=torch.int32, device=dev.device)  # [2] fa [3] fb
        a, b = dev.stream(), dev.stream()
        dev.idle("signal setup")
        gate = dev.gate()
        gate.hold(a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(a)
        fa, fb = words[2].data_ptr(), words[3].data_ptr()
        for i in range(1, pairs + 1):
            if kind == "ping-pong":  # a -> b -> a: one round trip is two signals
                signals.cuda_stream_write_value32(fa, i, a.cuda_stream)
                signals.cuda_stream_wait_value32(fa, i, b.cuda_stream)
                signals.cuda_stream_write_value32(fb, i, b.cuda_stream)
                signals.cuda_stream_wait_value32(fb, i, a.cuda_stream)
            else:
                signals.cuda_stream_write_value32(fa, i, a.cuda_stream)
                signals.cuda_stream_wait_value32(fa, i, a.cuda_stream)
        end.record(a)
        gate.open()
        dev.settle([a, b], [words[2], words[3]], f"time.signal {kind}")
        per_us = start.elapsed_time(end) * 1e3 / pairs / (2 if kind == "ping-pong" else 1)
        what = "per signal (write on one stream -> wait released on the other)" if kind == "ping-pong" \
            else "per write+wait pair on one stream"
        rep.add(f"time signal {kind}", "PASS", f"{per_us:.2f} us {what}", us=per_us)


def time_copy(rep: Report, dev: Device, nbytes: int = 1 << 30) -> None:
    """Device-to-device copy (cudaMemcpyAsync via copy_) bandwidth, bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, device=dev.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src))
    same = bool(torch.equal(dst, src))
    gbps = 2 * nbytes / (t * 1e-3) / 1e9
    rep.add(f"time d2d copy {nbytes >> 20} MiB", "PASS" if same else "FAIL",
            f"{t:.3f} ms, {gbps:.0f} GB/s read+written" + ("" if same else "; copy wrong"), gbps=gbps, ms=t)
