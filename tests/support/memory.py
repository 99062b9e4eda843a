"""Peak CPU memory of a piece of code on the calling thread, as torch's profiler reports it.

`peak_allocated` (and `profile`, which also gives the largest single allocation) runs a function under
``torch.profiler.profile(profile_memory=True)`` with the op's CPU copy engine replaced by one that runs its
copies on the calling thread (so they count), and sums the profiler's ``[memory]`` events, less the
temporaries a GEMM library makes and frees inside one call (`op_allocations`: they depend on the CPU, not
on the op). The symmetric heap (POSIX shared memory mapped by the ranks) is not an allocation of torch's and
never appears in these figures: tests report it beside them (`HeapUse`: the bytes of its slot each call touched).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from overlap.demo.memory import memory_events

from .gemms import GEMM_KERNELS


class _LazyFuture(Future):
    """Runs its task on the thread that asks for its result (so the profiler sees its allocations)."""

    def __init__(self, fn, args, kwargs):
        super().__init__()
        self._task = (fn, args, kwargs)

    def _run(self):
        if self._task is not None:
            fn, args, kwargs = self._task
            self._task = None
            try:
                self.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - kept in the future like an executor does
                self.set_exception(exc)

    def result(self, timeout=None):
        self._run()
        return super().result(timeout)

    def exception(self, timeout=None):
        self._run()
        return super().exception(timeout)


class _CallingThreadEngine:
    def submit(self, fn, *args, **kwargs):
        return _LazyFuture(fn, args, kwargs)


def peak_allocated(fn) -> tuple[int, int]:
    """(peak, end) bytes allocated by `fn` on this thread above what was allocated before it (`profile`)."""
    peak, end, _largest = profile(fn)
    return peak, end


def profile(fn) -> tuple[int, int, int]:
    """(peak, end, largest): bytes allocated by `fn` on this thread above what was allocated before it, at the
    peak and at the end, and the largest single allocation.

    torch's profiler reports every CPU allocation and free made while profiling on the profiling
    thread (``[memory]`` events: "Bytes", negative for a free); the op's CPU copy engine is replaced by one
    that runs its copies on this thread, so they count too. Allocations of gloo's own worker threads do not
    count, nor do a GEMM library's temporaries (`op_allocations`)."""
    from overlap import comm
    from overlap.demo.memory import trace_events

    engine = comm.copy_engine
    comm.copy_engine = _CallingThreadEngine
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        comm.copy_engine = engine
    running, peak, largest = 0, 0, 0
    for e in op_allocations(trace_events(prof)):
        running += e["args"]["Bytes"]
        peak = max(peak, running)
        largest = max(largest, e["args"]["Bytes"])
    # (The allocator's "Total Allocated" is not compared with the running sum: gloo's worker threads allocate
    # too, a collective's flat buffer for a moment, and the total counts them whenever they overlap an event.)
    return peak, running, largest


def op_allocations(events: list[dict]) -> list[dict]:
    """The ``[memory]`` events of a profile's `events`, in time order, less a GEMM library's temporaries: a
    block allocated and freed on one thread within one call of a GEMM kernel (`tests.support.gemms.GEMM_KERNELS`:
    ``aten::mm``, ...; not the composites around them, ``aten::matmul``, whose own copies count).

    What a GEMM allocates inside a call and frees before it returns (oneDNN's scratchpad, packed or
    upcast copies of its operands) depends on the CPU's ISA and the BLAS path it picks (a bf16 GEMM of the
    weight-gather memory test allocated 70 KiB inside one call on a CPU with AMX, less elsewhere), not on the
    op; the GEMM's output, which outlives the call, and anything the op allocates outside its GEMMs still
    count."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in GEMM_KERNELS:
            spans.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    memory = memory_events(events)
    live: dict[tuple, int] = {}
    temporary: set[int] = set()
    for i, e in enumerate(memory):
        key = (e["tid"], e["args"]["Addr"])
        if e["args"]["Bytes"] > 0:
            live[key] = i
        elif key in live:
            j = live.pop(key)
            born = memory[j]["ts"]
            if any(lo <= born and e["ts"] <= hi for lo, hi in spans.get(e["tid"], ())):
                temporary.update((i, j))
    return [e for i, e in enumerate(memory) if i not in temporary]


class HeapUse:
    """The bytes of its heap slot each call touched on this rank, recorded while in a ``with`` block.

    Every strategy reaches the heap through `overlap.symm.Call.buffer` (a view of a peer's or its own
    slot at an offset; the fused kernels read the same regions through address tables): the end of the
    furthest view a call took is the part of its slot it uses. `calls` lists ``(op, bytes)`` per call, in
    call order."""

    def __init__(self):
        self._extent: dict[int, list] = {}

    def __enter__(self) -> HeapUse:
        from overlap import symm

        self._buffer = buffer = symm.Call.buffer
        extent = self._extent

        def recording(call, peer, dtype, shape, offset=0):
            view = buffer(call, peer, dtype, shape, offset)
            entry = extent.setdefault(call.epoch, [call.op, 0])
            entry[1] = max(entry[1], offset + view.numel() * view.element_size())
            return view

        symm.Call.buffer = recording
        return self

    def __exit__(self, *exc) -> None:
        from overlap import symm

        symm.Call.buffer = self._buffer

    @property
    def calls(self) -> list[tuple[str, int]]:
        return [(op, nbytes) for _epoch, (op, nbytes) in sorted(self._extent.items())]
