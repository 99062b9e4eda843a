"""The ``symm`` pipelines' stream-ordered waits on host words, under each hardware-queue setting.

The ``symm`` pipelines wait with ``cuStreamWaitValue32`` (``overlap.signals.cuda_stream_wait_value32``: the GPU's
front end polls the word, no SM) on control-pad words in host shared memory registered for the device
(``cuda_host_register``), publish with ``cuda_stream_write_value32``, and bound every wait with the host watchdog
(``watchdog_arm``, a C++ thread that at the deadline sets the error word, the abort word to peer + 1 and then the
word itself, which releases the stream); docs/protocol.md. The GPU check runs these tests under its default
``CUDA_DEVICE_MAX_CONNECTIONS=32`` and again under 1 (every stream in one hardware queue, as Megatron-LM requires
with sequence parallelism); each test notes the setting it ran under.

* A wait on a registered host word behind its publish: a page of ``/dev/shm`` (an mmap of a temp file, like the
  control pads) registered; a GEMM then the publish on stream B issued before the wait on stream A, then a copy of
  the GEMM's result and a marker on A; the copy must equal the result, the marker must land, the watchdog must not
  fire; then unregistered.
* The watchdog releasing a wait nobody publishes: armed with a 0.5 s deadline, more work queued on another stream,
  then ``torch.cuda.synchronize`` in a thread the host joins with a deadline (past it the host stores the word
  itself and the test fails; if even that does not drain the device the process is unusable: `DeviceStuck`). It
  must return, with the error word 1, the abort word peer + 1 and the word at its value. Under one queue this
  proves that a host write frees a blocked queue and everything behind it. Its host half (the same watchdog on a
  /dev/shm page, no stream) runs on the CPU too.
* No starvation: a kernel whose blocks fill every SM's block slots (over-subscribed grid, each block spinning on a
  pinned host word with a clock limit) on one stream; once the host sees the resident count stable and below the
  grid (no slot free), a side stream's wait, copy to pinned memory and marker are issued and the wait is released
  by a host store: the marker must land while the spinning kernel still holds every SM. Where the hardware makes
  that race impossible (one hardware queue; a grid that never fills every block slot) it skips saying why.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading
import time

import pytest
import torch
import triton
import triton.language as tl

from overlap import signals
from tests.gpu.tolerance import verdict
from tests.gpu.virtual import SETTLE_TIMEOUT_S, Device, DeviceStuck

pytestmark = pytest.mark.one_queue

FLAG, MARK, MARK2, ERR, ABORT = 0, 1, 2, 3, 4  # words of the host page
WAIT_TIMEOUT_S = 10.0  # the watchdog deadline of the waits meant to pass (< SETTLE_TIMEOUT_S)
RELEASE_TIMEOUT_S = 0.5  # the deadline of the wait meant to be released by the watchdog
SYNC_TIMEOUT_S = 20.0  # how long the host waits for torch.cuda.synchronize to return
OCCUPY_TIMEOUT_NS = 15_000_000_000  # the spinning kernel's own clock limit
OCCUPY_POLL_NS: tl.constexpr = tl.constexpr(1_000_000)  # how often a spinning block reads the release word
BLOCKS_PER_SM = 64  # the spinning grid per SM: more than any GPU keeps resident (32 blocks per SM on sm_90)
PEER = 2
VALUE = 5


def _connections() -> str | None:
    """The hardware-queue setting this process runs under (the GPU check's run decides it)."""
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")


class HostPage:
    """One page of host shared memory (an mmap of a file in /dev/shm, as the control pads are), optionally
    registered for the device. Its int32 words are read and written through their addresses."""

    def __init__(self):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="gpu-test-host-waits-", dir=folder)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            self.mm = mmap.mmap(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)
        self.buf = (ctypes.c_int32 * (mmap.PAGESIZE // 4)).from_buffer(self.mm)
        self.base = ctypes.addressof(self.buf)
        self.device_base: int | None = None

    def addr(self, word: int) -> int:
        return self.base + 4 * word

    def dev(self, word: int) -> int:
        assert self.device_base is not None, "register the page first"
        return self.device_base + 4 * word

    def __getitem__(self, word: int) -> int:
        return self.buf[word]

    def register(self, device: torch.device) -> int:
        self.device_base = signals.cuda_host_register(self.base, mmap.PAGESIZE, device.index or 0)
        return self.device_base

    def arm(self, word: int, value: int, timeout_s: float, peer: int = PEER) -> None:
        signals.watchdog_arm(self.addr(word), value, timeout_s, self.addr(ERR), self.addr(ABORT), peer)

    def __enter__(self) -> HostPage:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        os.unlink(self.path)
        if exc_type is not None:
            return  # the device may still use the page (a stuck queue): keep it mapped, armed and registered
        signals.watchdog_cancel(self.base, mmap.PAGESIZE)
        if self.device_base is not None:
            signals.cuda_host_unregister(self.base)
        del self.buf
        self.mm.close()


@triton.jit
def _occupy(release_ptr, started_ptr, timeout_ns):
    """Each block marks itself started, then spins until ``*release_ptr`` is non-zero or `timeout_ns` passed.

    Both words are pinned host memory: the mark is a plain store (a system-scope atomic over PCIe is not atomic
    with respect to the host), and the release word is read once every `OCCUPY_POLL_NS` per block, not every
    iteration (thousands of spinning blocks would flood the bus the test's own transfers cross)."""
    tl.store(started_ptr + tl.program_id(0), 1)
    start = tl.extra.cuda.globaltimer()
    go = tl.load(release_ptr, volatile=True)
    now = start
    next_poll = start + OCCUPY_POLL_NS
    while (go == 0) & (now - start < timeout_ns):
        now = tl.extra.cuda.globaltimer()
        poll = now >= next_poll
        go = tl.load(release_ptr, mask=poll, other=0, volatile=True)
        next_poll = tl.where(poll, now + OCCUPY_POLL_NS, next_poll)


def _until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _gemm_inputs(dev: Device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev.device).manual_seed(17)
    x = torch.randn(2048, 2048, device=dev.device, generator=g)
    y = torch.randn(2048, 2048, device=dev.device, generator=g)
    return x, y, torch.empty_like(x)


def _bounded_synchronize(dev: Device, timeout_s: float) -> tuple[bool, BaseException | None]:
    """torch.cuda.synchronize in a thread joined with a deadline: (returned in time, its exception)."""
    caught: list[BaseException] = []

    def sync() -> None:
        try:
            torch.cuda.synchronize(dev.device)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            caught.append(exc)

    thread = threading.Thread(target=sync, daemon=True, name="gpu tests synchronize")
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), (caught[0] if caught else None)


# ==============================================================================================
# The checks
# ==============================================================================================


def check_register_and_wait(dev: Device) -> None:
    """The publish (after a GEMM on B) issued before the wait on A; the copy behind the wait."""
    with HostPage() as page:
        page.register(dev.device)
        a, b = dev.stream(), dev.stream()
        x, y, out = _gemm_inputs(dev)
        copy = torch.full_like(out, float("nan"))
        dev.idle("the register+wait set-up")
        dev.warm("register+wait", lambda: torch.mm(x, y, out=out))  # cuBLAS's kernel loaded before the gate
        gate = dev.gate()  # hold B until everything is issued: with queues of their own A waits first
        gate.hold(b)
        with dev.on(b):
            torch.mm(x, y, out=out)
        signals.cuda_stream_write_value32(page.dev(FLAG), 1, b.cuda_stream)  # the publish, before the wait
        page.arm(FLAG, 1, WAIT_TIMEOUT_S)
        signals.cuda_stream_wait_value32(page.dev(FLAG), 1, a.cuda_stream)
        with dev.on(a):
            copy.copy_(out)
        signals.cuda_stream_write_value32(page.dev(MARK), 9, a.cuda_stream)
        done = torch.cuda.Event()
        done.record(a)
        time.sleep(0.05)
        held = not done.query()
        gate.open()
        dev.settle([a, b], [], "the wait on a registered host word")
        problems = [] if held else ["stream A was not held by the wait"]
        if page[MARK] != 9:
            problems.append(f"marker {page[MARK]} after the wait, expected 9")
        if page[ERR] or page[ABORT]:
            problems.append(f"the watchdog fired (err={page[ERR]}, abort={page[ABORT]}): the publish never landed")
        if not torch.equal(copy, out):
            problems.append("the copy behind the wait differs from the GEMM published before it")
    verdict(problems, "registered /dev/shm page: GEMM + write on B released the wait on A, copy equal",
            connections=_connections())


def check_watchdog_release(dev: Device) -> None:
    """A wait nobody publishes, released by the host watchdog at its 0.5 s deadline."""
    with HostPage() as page:
        page.register(dev.device)
        a, b = dev.stream(), dev.stream()
        x, y, out = _gemm_inputs(dev)
        dev.idle("the watchdog release set-up")
        dev.warm("watchdog release", lambda: torch.mm(x, y, out=out))  # loaded now, not behind the blocked wait
        fired = signals.watchdog_fired()
        signals.cuda_stream_wait_value32(page.dev(FLAG), VALUE, a.cuda_stream)
        signals.cuda_stream_write_value32(page.dev(MARK), 9, a.cuda_stream)
        start = time.monotonic()
        page.arm(FLAG, VALUE, RELEASE_TIMEOUT_S)
        with dev.on(b):  # more work, on another stream: under one queue it sits behind the blocked wait
            torch.mm(x, y, out=out)
        signals.cuda_stream_write_value32(page.dev(MARK2), 7, b.cuda_stream)
        returned, error = _bounded_synchronize(dev, SYNC_TIMEOUT_S)
        waited = time.monotonic() - start
        if not returned:  # the host releases the word itself, then gives the device one more chance
            signals.signal_store(page.addr(FLAG), VALUE)
            if not _bounded_synchronize(dev, SETTLE_TIMEOUT_S)[0]:
                raise DeviceStuck("the watchdog release: the device did not drain even after the host stored the "
                                  "word")
            raise AssertionError(f"torch.cuda.synchronize did not return within {SYNC_TIMEOUT_S:.0f} s: the "
                                 "watchdog did not release the wait (the host's own store did)")
        if error is not None:
            raise error
        got = {"flag": page[FLAG], "err": page[ERR], "abort": page[ABORT], "A": page[MARK], "B": page[MARK2]}
        want = {"flag": VALUE, "err": 1, "abort": PEER + 1, "A": 9, "B": 7}
        problems = [f"{k}={got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
        if signals.watchdog_fired() < fired + 1:
            problems.append("watchdog_fired did not count the release")
        if waited < 0.8 * RELEASE_TIMEOUT_S:
            problems.append(f"synchronize returned after {waited:.3f} s, before the wait's deadline")
    verdict(problems, f"synchronize returned after {waited:.2f} s: err=1, abort=peer+1, flag={VALUE}, both streams "
                      "drained", waited_s=waited, connections=_connections())


def check_watchdog_release_host() -> None:
    """The watchdog's host half: the same watchdog on a /dev/shm page, no stream."""
    with HostPage() as page:
        fired = signals.watchdog_fired()
        start = time.monotonic()
        page.arm(FLAG, VALUE, RELEASE_TIMEOUT_S)
        if not _until(lambda: page[FLAG] == VALUE, WAIT_TIMEOUT_S):
            raise AssertionError(f"the watchdog did not release the word within {WAIT_TIMEOUT_S:.0f} s")
        waited = time.monotonic() - start
        got = (page[ERR], page[ABORT])
        problems = [] if got == (1, PEER + 1) else [f"err, abort = {got}, expected (1, {PEER + 1})"]
        if signals.watchdog_fired() < fired + 1:
            problems.append("watchdog_fired did not count the release")
        if waited < 0.8 * RELEASE_TIMEOUT_S:
            problems.append(f"released after {waited:.3f} s, before its deadline")
    verdict(problems, f"host only, no stream: released after {waited:.2f} s with err=1, abort=peer+1, flag={VALUE}",
            waited_s=waited, connections=_connections())


def check_no_starvation(dev: Device) -> None:
    """A side stream's wait, copy and marker complete while a kernel holds every SM. Where the hardware makes that
    race impossible the test says so (a skip with the reason, in the record) instead of failing: under one hardware
    queue (the side stream's work waits behind the spinning kernel by construction), or where the spinning grid
    never fills every SM's block slots (nothing is starved)."""
    if _connections() == "1":
        pytest.skip("no race to prove under CUDA_DEVICE_MAX_CONNECTIONS=1: the side stream shares the spinning "
                    "kernel's one hardware queue, so its wait runs only after that kernel ends")
    grid = dev.sm_count * BLOCKS_PER_SM
    started = torch.zeros(grid, dtype=torch.int32, pin_memory=True)
    release = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    src = torch.arange(1 << 20, device=dev.device, dtype=torch.int32)
    dst = torch.full((1 << 20,), -1, dtype=torch.int32, pin_memory=True)
    with HostPage() as page:
        page.register(dev.device)
        main, side = dev.stream(), dev.stream()
        dev.idle("the no-starvation set-up")
        end = torch.cuda.Event()
        full = passed = still_full = False
        try:
            with dev.on(main):
                _occupy[(grid,)](release, started, OCCUPY_TIMEOUT_NS, num_warps=1)
            end.record(main)
            resident = [-1]

            def stable() -> bool:  # the resident count no longer grows: every slot that can hold a block does
                now = int(started.sum())
                was, resident[0] = resident[0], now
                time.sleep(0.05)
                return now == was and now >= dev.sm_count

            full = _until(stable, 10.0) and resident[0] < grid
            if full:
                page.arm(FLAG, 1, WAIT_TIMEOUT_S)
                signals.cuda_stream_wait_value32(page.dev(FLAG), 1, side.cuda_stream)
                with dev.on(side):
                    dst.copy_(src, non_blocking=True)
                signals.cuda_stream_write_value32(page.dev(MARK), 9, side.cuda_stream)
                signals.signal_store(page.addr(FLAG), 1)  # the release: a host store, no queue
                passed = _until(lambda: page[MARK] == 9, 5.0)
                still_full = not end.query() and int(started.sum()) == resident[0]
        finally:
            signals.signal_store(release.data_ptr(), 1)
        dev.settle([main, side], [], "the wait beside a kernel holding every SM")  # (the kernel's words still ours)
        if not full:
            pytest.skip(f"no race to prove: {resident[0]} of {grid} spinning blocks resident, so the grid did not "
                        f"hold every block slot of the {dev.sm_count} SMs")
        problems = [] if passed else ["the side stream's marker did not land within 5 s of the release"]
        if passed and not still_full:
            problems.append("the spinning kernel had ended or moved when the marker landed: not proven starved")
        if not torch.equal(dst, src.cpu()):
            problems.append("the copy behind the wait is wrong")
        if page[ERR]:
            problems.append("the watchdog fired")
    verdict(problems, f"wait + copy + marker done while {resident[0]} spinning blocks held all {dev.sm_count} SMs",
            resident_blocks=resident[0], sm_count=dev.sm_count, connections=_connections())


# ==============================================================================================
# The tests
# ==============================================================================================


@pytest.mark.cuda
def test_a_wait_on_a_registered_host_word_passes_once_its_publish_lands(dev):
    check_register_and_wait(dev)


@pytest.mark.cuda
def test_the_host_watchdog_releases_a_stream_wait_nobody_publishes(dev):
    check_watchdog_release(dev)


def test_the_host_watchdog_releases_a_host_word_nobody_publishes():
    check_watchdog_release_host()


@pytest.mark.cuda
def test_a_stream_wait_passes_while_a_kernel_holds_every_sm(dev):
    check_no_starvation(dev)
