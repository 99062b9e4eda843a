"""Runs the ops' GPU ``symm`` pipelines on CPU and records the host order of their flag operations.

A GPU rank's flag operations are stream-ordered calls into ``overlap.signals`` (`Call` on a heap whose device
is CUDA); `Recorder` stands in for that module and records them, classified by the control-pad word they
touch. The pipelines' CUDA branches see tensors that say they are on a GPU (`CudaTensor`: CPU storage,
``is_cuda`` True) and streams, events and stream contexts that do nothing (`fake_cuda`); the data they compute
is meaningless (no wait waits), only the order is checked (tests/gpu/cpu/test_symm_stream_order.py).
"""

from __future__ import annotations

import contextlib
import types

import torch

from overlap import signals, symm
from overlap.symm import layout
from overlap.symm.tables import AddressTables

KERNEL_BASE = 1 << 60  # fake device addresses of the fused kernels' flag words (never dereferenced; no host address)


class CudaTensor(torch.Tensor):
    """A CPU tensor that the pipelines take for a GPU tensor (results of ops on it are CudaTensors too)."""

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        pass


def on_gpu(t: torch.Tensor) -> CudaTensor:
    return t.as_subclass(CudaTensor)


class FakeStream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class FakeEvent:
    def record(self, stream=None):
        pass


@contextlib.contextmanager
def fake_cuda(monkeypatch):
    """Streams, events and stream contexts that do nothing, for the pipelines' CUDA branches."""
    from overlap import comm

    main, side = FakeStream(), FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(comm, "side_stream", lambda device: side)
    monkeypatch.setattr(symm.call, "stream_handle", lambda stream: 0)
    yield


def gpu_heap(world_size: int, rank: int, slot_bytes: int) -> symm.SymmHeap:
    """A `SymmHeap` of a GPU rank over memory of this process: control pads (their device addresses are their
    host addresses here), data buffers, and fake addresses for the fused kernels' flag words."""
    heap = object.__new__(symm.SymmHeap)
    heap.rank, heap.world_size, heap.device = rank, world_size, torch.device("cuda")
    heap.ctrl = [torch.zeros(layout.CTRL_WORDS, dtype=torch.int32) for _ in range(world_size)]
    heap._ctrl_np = [t.numpy() for t in heap.ctrl]
    heap._ctrl_addr = [t.data_ptr() for t in heap.ctrl]
    heap._pad_dev = list(heap._ctrl_addr)
    bases = [KERNEL_BASE + (p << 20) for p in range(world_size)]
    heap._cuda_flags = types.SimpleNamespace(addrs=lambda word: [b + 4 * word for b in bases])
    heap.async_errors = torch.zeros(symm.MAX_PEERS + 1, dtype=torch.int32)
    heap.slot_bytes = (slot_bytes + 4095) // 4096 * 4096
    heap.data = [torch.zeros(symm.NUM_SLOTS * heap.slot_bytes, dtype=torch.uint8) for _ in range(world_size)]
    heap.tables = AddressTables(heap)
    heap.tables._counters = {slot: torch.zeros(symm.MAX_FLAGS, dtype=torch.int32) for slot in range(symm.NUM_SLOTS)}
    heap.tables._table = lambda key, addresses: torch.tensor(addresses(), dtype=torch.int64)  # (host tables)
    heap.in_flight, heap.closed, heap.epoch = 1, False, 0
    return heap


def gpu_call(heap: symm.SymmHeap, epoch: int = 6, prev_data_epoch: int = 2) -> symm.Call:
    return symm.Call(heap, "test", epoch, 5.0, prev_data_epoch=prev_data_epoch, need=heap.slot_bytes)


class Recorder:
    """`overlap.signals` for a GPU rank: records stream-ordered writes and waits as
    ``(kind, what, owner, index)`` — kind "write"/"wait", what "ready"/"done"/"kernel" — and never waits."""

    def __init__(self, heap: symm.SymmHeap, slot: int):
        self.heap, self.slot, self.ops = heap, slot, []

    def _classify(self, addr: int) -> tuple[str, int, int]:
        if addr >= KERNEL_BASE:
            return "kernel", (addr - KERNEL_BASE) >> 20, -1
        for owner, base in enumerate(self.heap._pad_dev):
            word = (addr - base) // 4
            if 0 <= word < layout.CTRL_WORDS:
                rel = word - layout.SLOT_BASE - self.slot * layout.SLOT_STRIDE
                assert 0 <= rel < layout.SLOT_STRIDE, f"a flag outside the call's slot: word {word}"
                if rel < layout.MAX_FLAGS:
                    return "ready", owner, rel
                return "done", owner, rel - layout.MAX_FLAGS
        raise AssertionError(f"address {addr:#x} is no flag of the heap")

    def cuda_stream_write_value32(self, addr, value, stream):
        self.ops.append(("write", *self._classify(addr)))

    def cuda_stream_wait_value32(self, addr, value, stream):
        self.ops.append(("wait", *self._classify(addr)))

    def watchdog_arm(self, *args):
        pass  # (tests/comm/test_watchdog.py tests the watchdog)

    def __getattr__(self, name):
        return getattr(signals, name)


def check_order(ops: list[tuple], phase=lambda index: 1) -> None:
    """The ordering rule of docs/protocol.md ("Waits on GPUs"), on one rank's recorded operations:

    * the slot waits (``done`` words, the previous call on the slot) come before any publish or data wait;
    * every publish (ready write) of phase ``p`` comes before every wait on a ready flag of phase ``>= p``
      (a phase's publishes may depend only on data of earlier phases: all-reduce's reduced chunks);
    * the done writes (this rank has finished with the slot) come after every wait.
    """
    kinds = [(kind, what) for kind, what, *_ in ops]
    first = {k: kinds.index(k) for k in set(kinds)}
    last = {k: len(kinds) - 1 - kinds[::-1].index(k) for k in set(kinds)}
    if ("wait", "done") in kinds:
        assert last[("wait", "done")] < min(first.get(("write", "ready"), len(ops)),
                                            first.get(("wait", "ready"), len(ops))), ops
    if ("write", "done") in kinds:
        assert first[("write", "done")] > max(last.get(("wait", "ready"), -1), last.get(("wait", "done"), -1)), ops
    for i, (kind, what, _owner, index) in enumerate(ops):
        if (kind, what) != ("write", "ready"):
            continue
        early = [op for op in ops[:i] if op[:2] == ("wait", "ready") and phase(op[3]) >= phase(index)]
        assert not early, f"publish {ops[i]} (phase {phase(index)}) is issued after the waits {early}"
