"""Virtual ranks on one device, for the GPU tests (tests/gpu) and the GPU check's timings: `Device` (a GPU with its
streams and stream-ordered flag writes, or the CPU under the Triton interpreter), the bounded drain every test ends
with (`Device.settle`), the host-released gates (`Gate`) and the guard of the tests that spin (`Device.spin_guard`),
the kernels' tile configurations (`Tile`) and the timeouts every virtual-rank test shares.

NCCL refuses two ranks of one communicator on one GPU, so W virtual ranks live in one process, each with its own
stream (`Device.stream`), its own symmetric buffer (a plain device tensor) and its own flag words; one address space,
so a peer-pointer table is an int64 tensor of the buffers' ``data_ptr()``. Nothing a test enqueues is waited for
unbounded.

How a test that races producers against waiters avoids deadlocking itself through the device's hardware queues (streams
share them: ``CUDA_DEVICE_MAX_CONNECTIONS`` of them, 8 by default; tests/gpu/conftest.py sets 32). A queue runs its
commands in the order they were issued, so a wait issued before the producer it waits for, on a stream that shares the
producer's queue, holds the producer for ever. So every test issues its producers first, in host order, each behind a
host-released gate (`Device.gate`: a one-thread bounded wait on a pinned host word that the host opens with a plain
store, so no queue is needed to open it); then the waiters (kernels that spin, bounded waits), then their end events;
then the host opens the gate. Where the streams have queues of their own the producers are held until every waiter spins
(the race); where they share one the producers run first (no race, no deadlock). Spinning CTAs must also all be resident
at once with an SM to spare for the producers (`Device.spin_guard`), every kernel a test races must have been launched
once before its gate closes (`Device.warm`: CUDA's lazy loading), and the waits are the bounded ones the ops use
(`Device.wait_flag`). tests/gpu/cpu/test_gpu_check_order.py replays every test's device work on a model of the queues to
prove these orders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

import pytest
import torch
from overlap.kernels.host import epoch_word

from overlap import signals

KERNEL_TIMEOUT_NS = 10_000_000_000  # in-kernel waits of the checks that must not time out
SETTLE_TIMEOUT_S = 30.0  # host deadline for a device queue to drain
SHORT_TIMEOUT_NS = 200_000_000  # the waits that are meant to time out (the timeout tests)
GATE_TIMEOUT_NS = 20_000_000_000  # a gate opens by itself after this (its error word says so); < SETTLE_TIMEOUT_S
RELEASE_VALUE = 1 << 30  # what a watchdog writes into flags to release stuck waits


class DeviceStuck(RuntimeError):
    """The device did not drain within its deadline, even after a watchdog released every flag: nothing more can
    run soundly in this process (tests/gpu/conftest.py ends the worker; xdist starts a fresh one)."""


def poll(events: list, timeout_s: float) -> bool:
    """Wait for CUDA events from the host, at most `timeout_s` (never an unbounded synchronize)."""
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(2e-4)
    return True


class EpochWords:
    """The int32 epoch words a group's launches read (`overlap.kernels.epoch_word`), one per epoch from `stale` to
    ``stale + SPAN - 1`` (every test's calls and warm-ups), made with the group: before any gate closes, since an
    allocation and its fill inside a gated window could wait on the device the gate holds. ``words(epoch)`` refuses
    an epoch it has no word for rather than make one late."""

    SPAN = 3

    def __init__(self, stale: int, device: torch.device):
        self.stale = stale
        self.words = {e: epoch_word(e, device) for e in range(stale, stale + self.SPAN)}

    def __call__(self, epoch: int) -> torch.Tensor:
        if epoch not in self.words:
            raise AssertionError(f"epoch {epoch} has no word: a group made with stale={self.stale} has words for "
                                 f"{sorted(self.words)} only (make the group with a stale epoch nearer its calls)")
        return self.words[epoch]


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


# `_fused`'s default tiles: 128x128x64 for 16-bit types on GPUs (Triton's default warps and stages), 32x32x32
# interpreted
GPU_TILE = Tile(128, 128, 64)
INTERPRETED_TILE = Tile(32, 32, 32)


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

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.streams: list[torch.cuda.Stream] = []  # every stream made here, drained by settle()
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if self.cuda else 0
        self.tile = GPU_TILE if self.cuda else INTERPRETED_TILE
        self._delay_words = torch.zeros(2, dtype=torch.int32, device=device)
        # Every gate made here, kept for the process's life (a held kernel may read its pinned words until its
        # stream drains): settle() opens any a test left closed.
        self.gates: list[Gate] = []

    def stream(self) -> torch.cuda.Stream | None:
        """A new stream (None on the CPU). torch hands streams out round robin from a pool of 32 per
        priority, so the few streams one test makes are distinct (`distinct` asserts it)."""
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

    def wait_flag(
        self,
        flag: torch.Tensor,
        value: int,
        stream: torch.cuda.Stream | None,
        err: torch.Tensor,
        timeout_ns: int = KERNEL_TIMEOUT_NS,
    ) -> None:
        """The bounded stream-ordered wait the ops use on GPUs (`overlap.symm.call.Call.wait_ready`): a one-thread
        kernel on `stream` that spins until ``flag[0] >= value`` and past `timeout_ns` sets ``err[0]`` (if 0) and
        lets the stream go on."""
        signals.cuda_wait_flag_bounded(flag.data_ptr(), value, timeout_ns, err.data_ptr(), stream.cuda_stream)

    def spin_guard(self, spinning: int, streams: int) -> None:
        """Skip the calling test where it cannot race soundly here: its `spinning` CTAs plus an SM for the
        producers do not fit the device's SMs at one CTA each (a spinning grid could keep a producer from
        starting), or its `streams` streams do not get a hardware queue each. Nothing on the CPU."""
        if not self.cuda:
            return
        if spinning + 1 > self.sm_count:
            pytest.skip(f"{spinning} spinning CTAs leave no SM for the producers ({self.sm_count} SMs)")
        connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if connections is not None and int(connections) < streams:
            pytest.skip(
                f"CUDA_DEVICE_MAX_CONNECTIONS={connections} < {streams} streams: they share hardware "
                "queues, so the producers would run before the waiters (no race)"
            )

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
            raise DeviceStuck(
                f"{what}: the device did not drain within {2 * SETTLE_TIMEOUT_S:.0f} s even after "
                "a watchdog released the flags"
            )
        raise RuntimeError(
            f"{what}: the device drained only after a watchdog released the flags ({SETTLE_TIMEOUT_S:.0f} s deadline)"
        )

    def idle(self, what: str) -> None:
        """Bounded wait for everything this test enqueued, on every stream made here."""
        self.settle(self.streams, [], what)

    def timed(self, stream: torch.cuda.Stream, launch: Callable[[], None]) -> Callable[[], float]:
        """Issue `launch` on `stream` between two timing events; once the stream has drained (`settle`), the returned
        function gives the seconds the device took. A first launch compiles its kernel on the host first, the device
        idle meanwhile: that host time is taken off."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self.on(stream):
            start.record()
            began = time.perf_counter()
            launch()
            host = time.perf_counter() - began
            end.record()
        return lambda: start.elapsed_time(end) / 1e3 - host

    def warm(self, what: str, launch: Callable[[], None]) -> None:
        """Run `launch` (the kernels a test is about to race) once, ungated, and wait for it.

        CUDA loads a kernel's code at its first launch (lazy loading, the default since CUDA 12.2) and waits for
        the device to drain first. Behind a closed gate the device drains only once the host opens the gate,
        which the host, blocked in that launch, never reaches: a 20 s stall and a false FAIL. So a test launches
        every kernel it races once here, before it closes a gate, on data whose flags are already set (the
        same variant: same dtype, tile and layout); `tests/gpu/cpu/test_gpu_check_order.py`'s model catches a test that
        does not. Interpreted kernels load nothing: a no-op on the CPU."""
        if not self.cuda:
            return
        launch()
        self.idle(f"{what} (warm-up)")
