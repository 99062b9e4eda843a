"""Multi-rank CPU test harness: a reusable pool of gloo ranks per world size.

Starting ranks and initializing gloo costs seconds, so tests share one pool per world size
(DESIGN.md's CI budget). A task is a module-level function (importable by the workers); it runs
on every rank with ``(rank, world_size, *args)`` and its return values come back as a list. An
exception on any rank fails the task with that rank's traceback. A task that outlives its
deadline kills the pool (the next task gets a fresh one) and fails: a hang is a bug.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

#: OVERLAP_TIMEOUT_S of every pooled or isolated rank: the deadline a call waits for when it is given none.
#: An error that reached a rank "at once" (a peer's bad input, a mismatch) arrives before it; one that
#: waited for a deadline cannot. Tests of fast failures assert ``seconds < FALLBACK_TIMEOUT_S``.
FALLBACK_TIMEOUT_S = 20.0

#: Seconds past its deadline that a call failing by that deadline may take to raise: the waiter's wake-up,
#: building the error, the result's trip through a pipe, all on 2 shared cores at load 10 and more (CI runs
#: beside other jobs). Below ``FALLBACK_TIMEOUT_S - deadline`` for the short deadlines (2-3 s) the failure tests
#: give, so a wait that ignored its deadline and fell back to the default still fails them.
LATE_S = 15.0


def raised_by_deadline(secs: float, deadline: float) -> bool:
    """True where a timeout after `secs` s honoured `deadline`: not before it, not long after it."""
    return deadline * 0.95 <= secs <= deadline + LATE_S


class RankError(AssertionError):
    """A task failed on some rank; ``results`` holds what the other ranks returned."""

    def __init__(self, message: str, results: list[Any] | None = None):
        super().__init__(message)
        self.results = results or []


def _worker(rank: int, world_size: int, init_file: str, conn, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file store: no TCP port to pick in advance (and to race for with other test runs).
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """`world_size` spawned ranks on one gloo group, running tasks until closed."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None, start_timeout: float = 60.0):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="overlap-test-")
        init_file = os.path.join(self._store_dir, "store")
        self.conns, self.procs = [], []
        base_env = {"OVERLAP_TIMEOUT_S": str(FALLBACK_TIMEOUT_S), **(env or {})}
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world_size, init_file, child, base_env), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.pids = []
        deadline = time.monotonic() + start_timeout
        for r, conn in enumerate(self.conns):
            if not conn.poll(max(0.1, deadline - time.monotonic())):
                self.kill()
                raise RuntimeError(f"rank {r} of a {world_size}-rank pool did not start within {start_timeout} s")
            self.pids.append(conn.recv()[1])
        self.broken = False

    def run(self, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return every rank's result."""
        if self.broken:
            raise RuntimeError("this pool is broken (a rank died or hung); take a fresh one")
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self.collect(timeout, fn.__name__)

    def collect(self, timeout: float, name: str = "task") -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors = []
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                self.kill()
                raise RankError(f"{name}: ranks {sorted(pending)} did not finish within {timeout} s (pool killed)")
            for r in sorted(pending):
                conn = self.conns[r]
                try:
                    ready = conn.poll(0.02)
                except (EOFError, OSError):
                    ready = True
                if not ready:
                    if not self.procs[r].is_alive():
                        self.broken = True
                        errors.append(f"rank {r} died (exit code {self.procs[r].exitcode})")
                        pending.discard(r)
                    continue
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self.broken = True
                    errors.append(f"rank {r} died (exit code {self.procs[r].exitcode})")
                    pending.discard(r)
                    continue
                pending.discard(r)
                if status == "ok":
                    results[r] = value
                else:
                    errors.append(f"rank {r} raised {value}")
        if errors:
            # Ranks that failed left the group out of step with the others: never reuse it.
            self.kill()
            raise RankError(f"{name} failed:\n" + "\n".join(errors), results)
        return results

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def close(self) -> None:
        if not self.broken:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for p in self.procs:
                p.join(timeout=10)
        self.kill()


def run_isolated(world_size: int, fn: Callable, *args: Any, timeout: float = 60.0, env: dict | None = None,
                 **kwargs: Any) -> list[Any]:
    """Run one task on a fresh pool that is discarded afterwards (for tests that break a group)."""
    pool = RankPool(world_size, env=env)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()
