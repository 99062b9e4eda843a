"""Tests of overlap._C's signals: host flags across processes, deadlines, the GIL, and the
CUDA half's behaviour without a GPU plus a compile check of its device code for sm_90a.

Every wait has a short deadline and every child process a join timeout: no test hangs.
"""

import ctypes
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from overlap import _C
from tests.support.cuda_tools import cuobjdump
from tests.support.harness import LATE_S

ROOT = Path(__file__).resolve().parents[2]
SHM_BYTES = 4096
JOIN_TIMEOUT_S = 60.0  # spawned children import overlap (and so torch) first


class ShmFlags:
    """A file in /dev/shm mapped here; flags are int32 words at 4-byte offsets."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), SHM_BYTES)
        self.words = (ctypes.c_int32 * (SHM_BYTES // 4)).from_buffer(self.mm)
        self.base = ctypes.addressof(self.words)

    def addr(self, index: int) -> int:
        return self.base + 4 * index


@pytest.fixture
def shm():
    shm_dir = (
        Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    )
    path = shm_dir / f"overlap-test-signals-{os.getpid()}-{uuid.uuid4().hex}"
    path.write_bytes(b"\0" * SHM_BYTES)
    try:
        yield ShmFlags(path)
    finally:
        path.unlink()


def _map_in_child(path: str) -> ShmFlags:
    return ShmFlags(Path(path))


# ---- children (module level, so the spawn context can pickle them) ----


def _child_store_later(path: str, index: int, value: int, delay_s: float) -> None:
    flags = _map_in_child(path)
    time.sleep(delay_s)
    _C.signal_store(flags.addr(index), value)


def _child_store_after_go(path: str, go: int, index: int, value: int, delay_s: float) -> None:
    flags = _map_in_child(path)
    if not _C.signal_wait(flags.addr(go), 1, 30.0):
        raise SystemExit(2)
    time.sleep(delay_s)
    _C.signal_store(flags.addr(index), value)


def _child_add_many(path: str, count: int) -> None:
    flags = _map_in_child(path)
    _C.signal_store(flags.addr(1), 1)  # ready
    if not _C.signal_wait(flags.addr(2), 1, 30.0):  # go
        raise SystemExit(2)
    for _ in range(count):
        _C.signal_add(flags.addr(0), 1)


def _start(target, *args) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _join(proc: mp.Process) -> None:
    proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"child {proc.pid} still running after {JOIN_TIMEOUT_S} s")
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"


# ---- host flags ----


def test_store_load_add_round_trip_through_torch_shared_file(shm):
    torch = pytest.importorskip("torch")
    t = torch.from_file(
        str(shm.path), shared=True, size=SHM_BYTES // 4, dtype=torch.int32
    )
    addr = t.data_ptr() + 4 * 3
    _C.signal_store(addr, 41)
    assert _C.signal_load(addr) == 41
    assert _C.signal_add(addr, 2) == 41  # returns the old value
    assert _C.signal_load(addr) == 43
    assert _C.signal_add(addr, -50) == 43
    assert int(t[3]) == -7, "torch's view of the file disagrees"
    assert shm.words[3] == -7, "a second mapping of the same file disagrees"
    t[5] = 12345
    assert _C.signal_load(shm.addr(5)) == 12345


def test_wait_compares_signed(shm):
    _C.signal_store(shm.addr(0), -5)
    assert _C.signal_wait(shm.addr(0), -10, 0.0)
    assert _C.signal_wait(shm.addr(0), -5, 0.0)
    assert not _C.signal_wait(shm.addr(0), 0, 0.0)


def test_wait_returns_when_another_process_sets_the_flag(shm):
    # The child stores only after "go" (word 8): the flag is unset until then, whatever the load, and the
    # wait that follows "go" can only succeed through the child's store (no timing is asserted).
    proc = _start(_child_store_after_go, str(shm.path), 8, 7, 3, 0.2)
    try:
        assert _C.signal_load(shm.addr(7)) == 0
        _C.signal_store(shm.addr(8), 1)
        assert _C.signal_wait(shm.addr(7), 3, 30.0), "the child's store was not seen"
    finally:
        _join(proc)
    assert _C.signal_load(shm.addr(7)) == 3


def test_add_is_atomic_across_processes(shm):
    count = 20_000
    proc = _start(_child_add_many, str(shm.path), count)
    try:
        assert _C.signal_wait(shm.addr(1), 1, 30.0), "child never became ready"
        _C.signal_store(shm.addr(2), 1)
        for _ in range(count):
            _C.signal_add(shm.addr(0), 1)
    finally:
        _join(proc)
    assert _C.signal_load(shm.addr(0)) == 2 * count


def test_wait_times_out(shm):
    timeout_s = 1.0
    start = time.monotonic()
    assert not _C.signal_wait(shm.addr(0), 1, timeout_s)
    elapsed = time.monotonic() - start
    # Never early; late only by scheduling (LATE_S: a loaded 2-core machine), never unbounded.
    assert 0.9 * timeout_s <= elapsed <= timeout_s + LATE_S, f"elapsed {elapsed:.3f} s"


def test_wait_releases_the_gil(shm):
    # The flag is set by Python code on another thread of this process, which can only run while the
    # waiting thread has released the GIL (a C call that holds it is never preempted): a wait that held
    # it would time out instead. Word 1 tells that thread the wait is about to start.
    def set_flag():
        while _C.signal_load(shm.addr(1)) != 1:
            time.sleep(0.001)
        _C.signal_store(shm.addr(0), 1)

    thread = threading.Thread(target=set_flag, daemon=True)
    thread.start()
    try:
        _C.signal_store(shm.addr(1), 1)
        assert _C.signal_wait(shm.addr(0), 1, 30.0), "the other thread never ran during the wait"
    finally:
        _C.signal_store(shm.addr(1), 1)
        thread.join(30.0)


def test_wait_can_be_interrupted_by_a_signal_handler(shm):
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        start = time.monotonic()
        with pytest.raises(Interrupted):
            _C.signal_wait(shm.addr(0), 1, 120.0)
        elapsed = time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # An uninterruptible wait would raise only after its 120 s deadline.
    assert elapsed < 60.0, f"the handler ran only after {elapsed:.3f} s"


def test_wait_all_returns_index_of_missing_peer(shm):
    addrs = [shm.addr(i) for i in range(5)]
    for i in (0, 2, 4):
        _C.signal_store(addrs[i], 9)
    assert _C.signal_wait_all(addrs, 9, 0.2) == 1
    _C.signal_store(addrs[1], 10)
    assert _C.signal_wait_all(addrs, 9, 0.2) == 3
    _C.signal_store(addrs[3], 9)
    start = time.monotonic()
    assert _C.signal_wait_all(addrs, 9, 120.0) == -1
    assert time.monotonic() - start < 60.0  # did not wait for the deadline
    assert _C.signal_wait_all([], 9, 0.0) == -1


def test_wait_all_sees_a_late_peer(shm):
    proc = _start(_child_store_later, str(shm.path), 2, 4, 0.2)
    try:
        _C.signal_store(shm.addr(0), 4)
        _C.signal_store(shm.addr(1), 4)
        assert _C.signal_wait_all([shm.addr(i) for i in range(3)], 4, 30.0) == -1
    finally:
        _join(proc)


@pytest.mark.parametrize(
    "call",
    [
        lambda a: _C.signal_store(a, 1),
        lambda a: _C.signal_load(a),
        lambda a: _C.signal_add(a, 1),
        lambda a: _C.signal_wait(a, 1, 0.0),
        lambda a: _C.signal_wait_all([a], 1, 0.0),
    ],
    ids=["store", "load", "add", "wait", "wait_all"],
)
def test_bad_address_raises_value_error(shm, call):
    with pytest.raises(ValueError, match="null address"):
        call(0)
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        call(shm.addr(1) + 2)


def test_bad_values_raise_value_error(shm):
    with pytest.raises(ValueError, match="int32 range"):
        _C.signal_store(shm.addr(0), 2**31)
    with pytest.raises(ValueError, match="timeout_s"):
        _C.signal_wait(shm.addr(0), 1, -1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        _C.signal_wait(shm.addr(0), 1, float("inf"))
    with pytest.raises(ValueError, match=r"addrs\[1\]"):
        _C.signal_wait_all([shm.addr(0), 0], 1, 0.0)


# ---- CUDA half ----

CUDA_CALLS = {
    "write": lambda a: _C.cuda_stream_write_value32(a, 1, 0),
    "wait": lambda a: _C.cuda_stream_wait_value32(a, 1, 0),
    "bounded_wait": lambda a: _C.cuda_wait_flag_bounded(a, 1, 1000, a + 4, 0),
    "host_register": lambda a: _C.cuda_host_register(a, 4096, 0),
    "host_unregister": lambda a: _C.cuda_host_unregister(a),
}


@pytest.mark.parametrize("name", sorted(CUDA_CALLS))
def test_cuda_calls_fail_clearly_without_a_gpu(shm, name):
    if _C.has_cuda and _C.cuda_device_count() > 0:
        pytest.skip("a CUDA device is usable here")
    pattern = "no usable CUDA device" if _C.has_cuda else "built without CUDA"
    with pytest.raises(RuntimeError, match=pattern):
        CUDA_CALLS[name](shm.addr(0))
    if not _C.has_cuda:
        assert _C.cuda_device_count() == 0


def test_cuda_half_compiles_for_sm90a(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    if not _C.has_cuda:
        with pytest.raises(RuntimeError) as info:
            _C.cuda_stream_write_value32(4, 1, 0)
        if "OVERLAP_BUILD_CUDA=0" in str(info.value):
            pytest.skip("_C was built with OVERLAP_BUILD_CUDA=0")
        pytest.fail(f"nvcc is at {nvcc} but _C has no CUDA half: {info.value}")
    cubin = tmp_path / "signal_cuda.cubin"
    source = ROOT / "csrc" / "cuda" / "signal_cuda.cu"
    include = ROOT / "csrc" / "include"
    cmd = [
        nvcc,
        "-arch=sm_90a",
        "-cubin",
        "-I",
        str(include),
        str(source),
        "-o",
        str(cubin),
    ]
    result = subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr}"
    assert cubin.stat().st_size > 0
    tool = cuobjdump()
    if tool is None:
        return
    sass = subprocess.run(
        [tool, "-sass", str(cubin)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sass.returncode == 0, sass.stderr
    assert "wait_flag_bounded_kernel" in sass.stdout, sass.stdout[:2000]
    assert "NANOSLEEP" in sass.stdout, "the device wait lost its back-off"


# ---- CUDA half on a GPU (skipped without one) ----


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not (_C.has_cuda and torch.cuda.is_available() and _C.cuda_device_count() > 0):
        pytest.skip("needs _C's CUDA half and a usable GPU")
    return torch


def test_gpu_bounded_wait_times_out_then_sees_a_stream_write():
    torch = _cuda_torch()
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    _C.cuda_wait_flag_bounded(flag.data_ptr(), 1, 2_000_000, err.data_ptr(), stream)
    torch.cuda.synchronize()
    assert int(err[0]) == 1, "the bounded wait did not record its timeout"
    _C.cuda_stream_write_value32(flag.data_ptr() + 4, 5, stream)
    _C.cuda_wait_flag_bounded(
        flag.data_ptr() + 4, 5, 1_000_000_000, err.data_ptr() + 4, stream
    )
    torch.cuda.synchronize()
    assert int(flag[1]) == 5 and int(err[1]) == 0


def test_gpu_stream_wait_holds_work_until_the_flag_is_written():
    torch = _cuda_torch()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.zeros(1024, device="cuda")
    waiter, writer = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    _C.cuda_stream_wait_value32(flag.data_ptr(), 2, waiter.cuda_stream)
    with torch.cuda.stream(waiter):
        x.add_(1)
    time.sleep(0.2)
    assert not waiter.query(), (
        "work after the stream wait ran before the flag was written"
    )
    _C.cuda_stream_write_value32(flag.data_ptr(), 2, writer.cuda_stream)
    deadline = time.monotonic() + 10.0
    while not waiter.query():
        assert time.monotonic() < deadline, "the stream wait was never released"
        time.sleep(0.01)
    assert float(x.sum()) == 1024.0


def test_wait_compares_modulo_2_32(shm):
    """Epochs wrap: a flag that passed 2^31 still counts as reaching a value just below it."""
    flag = shm.addr(0)
    _C.signal_store(flag, -(2**31))  # epoch 2^31, wrapped
    assert _C.signal_wait(flag, 2**31 - 1, 0.05)  # epoch 2^31 - 1 was reached
    assert not _C.signal_wait(flag, -(2**31) + 1, 0.05)  # epoch 2^31 + 1 was not
    assert _C.signal_wait_all([flag], 2**31 - 3, 0.05) == -1
