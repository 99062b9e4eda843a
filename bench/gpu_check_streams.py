"""Checks j: the `symm` pipelines' stream-ordered waits under each hardware-queue setting (issue 17, finding 6).

The `symm` pipelines wait with ``cuStreamWaitValue32`` (``overlap.signals.cuda_stream_wait_value32``: the GPU's
front end polls the word, no SM) on control-pad words in host shared memory registered for the device
(``cuda_host_register``), publish with ``cuda_stream_write_value32``, and bound every wait with the host watchdog
(``watchdog_arm``, a C++ thread that at the deadline sets the error word, the abort word to peer + 1 and then the
word itself, which releases the stream); docs/design.md section 4. Each group of this module runs the same three
checks in a process of its own, one under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (every stream in one hardware queue,
as Megatron-LM requires with sequence parallelism) and one under the check's default (32):

* ``register+wait``: a page of ``/dev/shm`` (an mmap of a temp file, like the control pads) registered; a GEMM
  then the publish on stream B issued before the wait on stream A, then a copy of the GEMM's result and a marker
  on A; the copy must equal the result, the marker must land, the watchdog must not fire; then unregistered.
* ``watchdog release``: a wait on a word nobody writes, armed with a 0.5 s deadline, more work queued on another
  stream, then ``torch.cuda.synchronize`` in a thread the host joins with a deadline (past it the host stores the
  word itself and the section FAILs; if even that does not drain the device the process is marked stuck). It
  must return, with the error word 1, the abort word peer + 1 and the word at its value. Under one queue this
  proves that a host write frees a blocked queue and everything behind it.
* ``no starvation``: a kernel whose blocks fill every SM's block slots (over-subscribed grid, each block spinning
  on a pinned host word with a clock limit) on one stream; once the host sees the resident count stable and below
  the grid (no slot free), a side stream's wait, copy to pinned memory and marker are issued and the wait is
  released by a host store: the marker must land while the spinning kernel still holds every SM.

On the CPU (``--cpu-smoke``) there is no CUDA: the device checks SKIP, and each group runs the host half of the
watchdog release on a /dev/shm page (the same C++ watchdog, no stream) after checking that its process has the
setting it names (so CI proves the group's environment reaches it). Section names do not depend on the
environment (the parent lists them in its own process); every section FAILs in a process with another setting.

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading
import time

import torch
import triton
import triton.language as tl
from gpu_check_common import Report
from gpu_check_virtual import SETTLE_TIMEOUT_S, Device

from overlap import signals

FLAG, MARK, MARK2, ERR, ABORT = 0, 1, 2, 3, 4  # words of the host page
WAIT_TIMEOUT_S = 10.0  # the watchdog deadline of the waits meant to pass (< SETTLE_TIMEOUT_S)
RELEASE_TIMEOUT_S = 0.5  # the deadline of the wait meant to be released by the watchdog
SYNC_TIMEOUT_S = 20.0  # how long the host waits for torch.cuda.synchronize to return
OCCUPY_TIMEOUT_NS = 15_000_000_000  # the spinning kernel's own clock limit
OCCUPY_POLL_NS: tl.constexpr = tl.constexpr(1_000_000)  # how often a spinning block reads the release word
BLOCKS_PER_SM = 64  # the spinning grid per SM: more than any GPU keeps resident (32 blocks per SM on sm_90)
PEER = 2
VALUE = 5


class HostPage:
    """One page of host shared memory (an mmap of a file in /dev/shm, as the control pads are), optionally
    registered for the device. Its int32 words are read and written through their addresses."""

    def __init__(self):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="gpu_check_streams-", dir=folder)
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
    iteration (thousands of spinning blocks would flood the bus the check's own transfers cross)."""
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


def _wrong_connections(rep: Report, name: str, expected: str) -> bool:
    """True (and a FAIL of `name` recorded) where this process's queue setting is not the one the section names."""
    got = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if got != expected:
        rep.add(name, "FAIL", f"CUDA_DEVICE_MAX_CONNECTIONS={got} in this process, expected {expected}: the "
                              "section would not test the setting it names")
        return True
    return False


def _gemm_inputs(dev: Device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev.device).manual_seed(17)
    x = torch.randn(2048, 2048, device=dev.device, generator=g)
    y = torch.randn(2048, 2048, device=dev.device, generator=g)
    return x, y, torch.empty_like(x)


def check_register_and_wait(rep: Report, dev: Device, name: str, expected: str) -> None:
    """j. register+wait: the publish (after a GEMM on B) issued before the wait on A; the copy behind the wait."""
    if _wrong_connections(rep, name, expected):
        return
    with HostPage() as page:
        page.register(dev.device)
        a, b = dev.stream(), dev.stream()
        x, y, out = _gemm_inputs(dev)
        copy = torch.full_like(out, float("nan"))
        dev.idle(f"{name} setup")
        dev.warm(name, lambda: torch.mm(x, y, out=out))  # cuBLAS's kernel loaded before the gate (`Device.warm`)
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
        dev.settle([a, b], [], name)
        problems = [] if held else ["stream A was not held by the wait"]
        if page[MARK] != 9:
            problems.append(f"marker {page[MARK]} after the wait, expected 9")
        if page[ERR] or page[ABORT]:
            problems.append(f"the watchdog fired (err={page[ERR]}, abort={page[ABORT]}): the publish never landed")
        if not torch.equal(copy, out):
            problems.append("the copy behind the wait differs from the GEMM published before it")
    rep.add(name, "FAIL" if problems else "PASS",
            "; ".join(problems) or "registered /dev/shm page: GEMM + write on B released the wait on A, copy equal")


def _bounded_synchronize(dev: Device, timeout_s: float) -> tuple[bool, BaseException | None]:
    """torch.cuda.synchronize in a thread joined with a deadline: (returned in time, its exception)."""
    caught: list[BaseException] = []

    def sync() -> None:
        try:
            torch.cuda.synchronize(dev.device)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            caught.append(exc)

    thread = threading.Thread(target=sync, daemon=True, name="gpu_check synchronize")
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive(), (caught[0] if caught else None)


def check_watchdog_release(rep: Report, dev: Device, name: str, expected: str) -> None:
    """j. watchdog release: a wait nobody publishes, released by the host watchdog at its 0.5 s deadline."""
    if _wrong_connections(rep, name, expected):
        return
    with HostPage() as page:
        page.register(dev.device)
        a, b = dev.stream(), dev.stream()
        x, y, out = _gemm_inputs(dev)
        dev.idle(f"{name} setup")
        dev.warm(name, lambda: torch.mm(x, y, out=out))  # loaded now, not behind the blocked wait (`Device.warm`)
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
                rep.stuck = name
                raise RuntimeError(f"{name}: the device did not drain even after the host stored the word")
            rep.add(name, "FAIL", f"torch.cuda.synchronize did not return within {SYNC_TIMEOUT_S:.0f} s: the "
                                  "watchdog did not release the wait (the host's own store did)")
            return
        if error is not None:
            raise error
        got = {"flag": page[FLAG], "err": page[ERR], "abort": page[ABORT], "A": page[MARK], "B": page[MARK2]}
        want = {"flag": VALUE, "err": 1, "abort": PEER + 1, "A": 9, "B": 7}
        problems = [f"{k}={got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
        if signals.watchdog_fired() < fired + 1:
            problems.append("watchdog_fired did not count the release")
        if waited < 0.8 * RELEASE_TIMEOUT_S:
            problems.append(f"synchronize returned after {waited:.3f} s, before the wait's deadline")
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or
            f"synchronize returned after {waited:.2f} s: err=1, abort=peer+1, flag={VALUE}, both streams drained")


def check_watchdog_release_host(rep: Report, name: str, expected: str) -> None:
    """j. watchdog release, host half (CPU): the same watchdog on a /dev/shm page, no stream, in the group's
    process (whose queue setting is checked: the GPU sections of the group rely on it)."""
    if _wrong_connections(rep, name, expected):
        return
    with HostPage() as page:
        fired = signals.watchdog_fired()
        start = time.monotonic()
        page.arm(FLAG, VALUE, RELEASE_TIMEOUT_S)
        if not _until(lambda: page[FLAG] == VALUE, WAIT_TIMEOUT_S):
            rep.add(name, "FAIL", f"the watchdog did not release the word within {WAIT_TIMEOUT_S:.0f} s")
            return
        waited = time.monotonic() - start
        got = (page[ERR], page[ABORT])
        problems = [] if got == (1, PEER + 1) else [f"err, abort = {got}, expected (1, {PEER + 1})"]
        if signals.watchdog_fired() < fired + 1:
            problems.append("watchdog_fired did not count the release")
        if waited < 0.8 * RELEASE_TIMEOUT_S:
            problems.append(f"released after {waited:.3f} s, before its deadline")
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or
            f"host only (no CUDA), CUDA_DEVICE_MAX_CONNECTIONS={expected}: released after {waited:.2f} s with "
            f"err=1, abort=peer+1, flag={VALUE}")


def check_no_starvation(rep: Report, dev: Device, name: str, expected: str) -> None:
    """j. no starvation: a side stream's wait, copy and marker complete while a kernel holds every SM."""
    if _wrong_connections(rep, name, expected):
        return
    grid = dev.sm_count * BLOCKS_PER_SM
    started = torch.zeros(grid, dtype=torch.int32, pin_memory=True)
    release = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    src = torch.arange(1 << 20, device=dev.device, dtype=torch.int32)
    dst = torch.full((1 << 20,), -1, dtype=torch.int32, pin_memory=True)
    with HostPage() as page:
        page.register(dev.device)
        main, side = dev.stream(), dev.stream()
        dev.idle(f"{name} setup")
        end = torch.cuda.Event()
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

            if not _until(stable, 10.0) or resident[0] >= grid:
                rep.add(name, "FAIL", f"{resident[0]} of {grid} spinning blocks resident: not every SM was full")
                return
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
        dev.settle([main, side], [], name)
        problems = [] if passed else ["the side stream's marker did not land within 5 s of the release"]
        if passed and not still_full:
            problems.append("the spinning kernel had ended or moved when the marker landed: not proven starved")
        if not torch.equal(dst, src.cpu()):
            problems.append("the copy behind the wait is wrong")
        if page[ERR]:
            problems.append("the watchdog fired")
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or
            f"wait + copy + marker done while {resident[0]} spinning blocks held all {dev.sm_count} SMs")


def run_queue_checks(rep: Report, dev: Device, connections: str, label: str) -> None:
    """The three checks under `connections` (this process's CUDA_DEVICE_MAX_CONNECTIONS), named by `label`; on
    the CPU only the host half of the watchdog release (in this group's process: its setting is checked too)."""
    no_cuda = None if dev.cuda else "no CUDA: needs a GPU's stream memory operations"
    rep.run(f"j.{label} register+wait", lambda: check_register_and_wait(rep, dev, f"j.{label} register+wait",
                                                                        connections), skip=no_cuda)
    release = f"j.{label} watchdog release"
    if dev.cuda:
        rep.run(release, lambda: check_watchdog_release(rep, dev, release, connections))
    else:
        rep.run(release, lambda: check_watchdog_release_host(rep, release, connections))
    rep.run(f"j.{label} no starvation", lambda: check_no_starvation(rep, dev, f"j.{label} no starvation",
                                                                    connections), skip=no_cuda)


def run_queue_checks_default(rep: Report, dev: Device) -> None:
    """Group "queues": checks j under the check's default CUDA_DEVICE_MAX_CONNECTIONS=32."""
    run_queue_checks(rep, dev, "32", "32-queue")


def run_queue_checks_one_queue(rep: Report, dev: Device) -> None:
    """Group "queues1": checks j under CUDA_DEVICE_MAX_CONNECTIONS=1 (the group's environment)."""
    run_queue_checks(rep, dev, "1", "1-queue")
