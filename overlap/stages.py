"""Where an op's host time goes, stage by stage: the ``--profile`` of ``overlap bench``.

The ops mark their stages (`stage`): the preamble (checks, plan, signature, handshake), the routing and the
counts of an MoE call, posting rows, waiting for a peer, the GEMMs, the fp8 casts, the weighted sum. While
`collecting` is on, each stage's exclusive time (its own, its inner stages' taken out) adds to a total per stage
name, on the thread that ran it (a helper thread's, such as the CPU ranks' copy engine, apart: its time runs beside
the caller's); the time of a call outside every stage is the caller's to work out (the call's whole time less the
stages': Python glue, autograd, allocation, the custom ops' dispatch). Off, as always outside a profile, a stage
costs one global read.

Host time only: on a GPU a stage ends when its work is queued, except a wait, which ends when the host saw the
peer (GPU work is what a CUDA profiler measures).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["HELPER", "collecting", "stage", "timed"]

#: the end of a stage's name when a helper thread ran it (the CPU ranks' copy engine)
HELPER = " (helper thread)"

_F = TypeVar("_F", bound=Callable[..., Any])

_on = False
_lock = threading.Lock()
_totals: dict[str, float] = {}
_local = threading.local()


class _Stage:
    __slots__ = ("name", "began", "inner")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> _Stage:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        self.inner = 0.0
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        took = time.perf_counter() - self.began
        stack = _local.stack
        stack.pop()
        if stack:
            stack[-1].inner += took
        name = self.name if threading.current_thread() is threading.main_thread() else self.name + HELPER
        with _lock:
            _totals[name] = _totals.get(name, 0.0) + took - self.inner


_OFF = contextlib.nullcontext()


def stage(name: str) -> contextlib.AbstractContextManager:
    """A stage of an op named `name` (``"wait"``, ``"gemm"``, ...): timed while `collecting`, else nothing."""
    return _Stage(name) if _on else _OFF


def timed(name: str) -> Callable[[_F], _F]:
    """A function whose every call is the stage `name` (`stage`)."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not _on:
                return fn(*args, **kwargs)
            with _Stage(name):
                return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


@contextlib.contextmanager
def collecting() -> Iterator[dict[str, float]]:
    """Collect the stages' exclusive seconds, per name, into the dict this yields (complete once the block ends).
    Not reentrant."""
    global _on
    with _lock:
        _totals.clear()
    out: dict[str, float] = {}
    _on = True
    try:
        yield out
    finally:
        _on = False
        with _lock:
            out.update(_totals)
            _totals.clear()
