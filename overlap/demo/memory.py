"""Peak CPU memory of a piece of code, as torch's profiler reports it (the demo's figure; the memory tests
read the same events).

torch's profiler reports every CPU allocation and free made while profiling on the profiling thread as a
``[memory]`` event ("Bytes", negative for a free; "Total Allocated", the allocator's running total).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable

import torch


def trace_events(prof: torch.profiler.profile) -> list[dict]:
    """Every event of a finished profile, as its exported Chrome trace lists them (ops: ``"ph": "X"`` with
    ``ts``, ``dur``, ``tid``; allocations and frees: `memory_events`)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.remove(path)


def memory_events(events: list[dict]) -> list[dict]:
    """The ``[memory]`` events among a profile's `trace_events`, in time order."""
    return sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors allocated by `fn` on this thread and alive at once."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    running = peak = 0
    for e in memory_events(trace_events(prof)):
        running += e["args"]["Bytes"]
        peak = max(peak, running)
    return peak


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: the profiler's C++ side logs every start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
