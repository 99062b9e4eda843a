"""Multi-rank CPU test harness: a reusable pool of gloo ranks per world size (`overlap.pool.RankPool`).

Starting ranks and initializing gloo costs seconds, so tests share one pool per world size
(docs/testing.md's CI budget). A task is a module-level function (importable by the workers); it runs
on every rank with ``(rank, world_size, *args)`` and its return values come back as a list. An
exception on any rank fails the task with that rank's traceback. A task that outlives its
deadline kills the pool (the next task gets a fresh one) and fails: a hang is a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from overlap import pool

#: OVERLAP_TIMEOUT_S of every pooled or isolated rank: the deadline a call waits for when it is given none.
#: An error that reached a rank "at once" (a peer's bad input, a mismatch) arrives before it; one that
#: waited for a deadline cannot. Tests of fast failures assert ``seconds < FALLBACK_TIMEOUT_S``. It is also
#: the deadline of every wait in a healthy test, so it must outlast the longest stretch a rank can spend
#: between two waits on a loaded machine: 20 s ran out in CI while a peer ran interpreted Triton kernels
#: (4 ranks on 2 shared cores beside another job).
FALLBACK_TIMEOUT_S = 60.0

#: Seconds past its deadline that a call failing by that deadline may take to raise: the waiter's wake-up,
#: building the error, the result's trip through a pipe, all on 2 shared cores at load 10 and more (CI runs
#: beside other jobs). Below ``FALLBACK_TIMEOUT_S - deadline`` for the short deadlines (2-3 s) the failure tests
#: give, so a wait that ignored its deadline and fell back to the default still fails them.
LATE_S = 15.0

#: Factor on every task's deadline, and the seconds a pool may take to start. A harness deadline only catches a
#: hang (a test asserts on the times it measures inside its task): CI's 2 shared cores, with another job beside
#: them, made a 90 s task and a 60 s start run out (every rank importing torch at once).
HANG_SLACK = 3.0
START_S = 180.0


def raised_by_deadline(secs: float, deadline: float) -> bool:
    """True where a timeout after `secs` s honoured `deadline`: not before it, not long after it."""
    return deadline * 0.95 <= secs <= deadline + LATE_S


class RankError(AssertionError):
    """A task failed on some rank; ``results`` holds what the other ranks returned."""

    def __init__(self, message: str, results: list[Any] | None = None):
        super().__init__(message)
        self.results = results or []


def _with_rank(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """On a rank: ``fn(rank, world_size, *args, **kwargs)`` (the harness's task convention)."""
    import torch.distributed as dist

    return fn(dist.get_rank(), dist.get_world_size(), *args, **kwargs)


class RankPool(pool.RankPool):
    """`world_size` spawned gloo ranks (`overlap.pool.RankPool`) running the tests' tasks until closed.

    A task is called as ``fn(rank, world_size, *args, **kwargs)``; a failure raises `RankError` (an
    AssertionError, with the other ranks' results) instead of `overlap.pool.RankPoolError`."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None, start_timeout: float = START_S):
        base_env = {"OVERLAP_TIMEOUT_S": str(FALLBACK_TIMEOUT_S), **(env or {})}
        super().__init__(world_size, env=base_env, backend="gloo", start_timeout_s=start_timeout, pg_timeout_s=60.0)

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return every rank's result (errors
        name `fn`, not the wrapper that passes the rank)."""
        if self.broken:
            raise RuntimeError("this pool is broken (a rank died or hung); take a fresh one")
        self.send(fn, *args, **kwargs)
        return self.collect(timeout, fn.__name__)

    def send(self, fn: Callable, *args: Any, **kwargs: Any) -> None:
        """Start ``fn(rank, world_size, *args, **kwargs)`` on every rank; `collect` its results."""
        for conn in self.conns:
            conn.send((_with_rank, (fn, args, kwargs), {}))

    def collect(self, timeout: float, name: str = "task") -> list[Any]:
        try:
            return super().collect(timeout * HANG_SLACK, name)
        except pool.RankPoolError as exc:
            raise RankError(str(exc), exc.results) from None


def run_isolated(world_size: int, fn: Callable, *args: Any, timeout: float = 60.0, env: dict | None = None,
                 **kwargs: Any) -> list[Any]:
    """Run one task on a fresh pool that is discarded afterwards (for tests that break a group)."""
    pool = RankPool(world_size, env=env)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()
