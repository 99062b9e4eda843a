"""A standing pool of local ranks: N spawned processes in one process group, running tasks until closed.

Starting ranks and initializing the group costs seconds, so the benchmark session (`overlap.benchmarks.
session`) and the test suite keep one pool and run many tasks on it. A task is a module-level function
(pickled by name); ``pool.run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank and returns
the results in rank order. A task that fails on any rank, a rank that dies, or a task that outlives its
deadline leaves the ranks out of step: the pool is killed (never reused) and `RankPoolError` raised with
every rank's traceback and what the other ranks returned. No wait is unbounded.

Ranks meet through a file store (`overlap.world.init_rank`): no TCP port to pick in advance and race for.
A rank ends itself when its parent is gone (`overlap.lifetime.end_with_parent`); `RankPool.kill` removes the
segments its ranks created (a rank killed by SIGKILL unlinks nothing).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import lifetime, shm, world


class RankPoolError(RuntimeError):
    """A task failed on some rank (or a rank died, or the task ran out of time); the pool is killed.

    ``results`` holds what the other ranks returned (None where a rank returned nothing)."""

    def __init__(self, message: str, results: list[Any] | None = None):
        super().__init__(message)
        self.results = results or []


def _serve(rank: int, world_size: int, init_file: str, conn: Any, env: dict[str, str], backend: str | None,
           pg_timeout_s: float, parent_pid: int) -> None:
    """A rank of `RankPool`: join the group, then run each task until told to stop (or the parent is gone)."""
    lifetime.end_with_parent(parent_pid)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world.init_rank(rank, world_size, init_file, timeout_s=pg_timeout_s, backend=backend)
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
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent, which fails the task
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a dead peer can make teardown fail
        pass


class RankPool:
    """`nproc` spawned local ranks in one default group (see the module docstring).

    env: variables set in every rank before it joins; backend: ``"gloo"`` to force CPU ranks (default:
    as `overlap.world.init_rank`, NCCL where there is a GPU per rank); pg_timeout_s: the process group's
    own timeout. Raises RuntimeError where the ranks do not start within `start_timeout_s`.
    """

    def __init__(self, nproc: int, *, env: dict[str, str] | None = None, backend: str | None = None,
                 start_timeout_s: float = 120.0, pg_timeout_s: float = 300.0):
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        self.nproc = self.world_size = nproc
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="overlap-pool-")
        init_file = os.path.join(self._dir, "store")
        self.conns, self.procs = [], []
        for r in range(nproc):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, nproc, init_file, child, dict(env or {}), backend, pg_timeout_s,
                                                   os.getpid()),
                            daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.broken = False
        try:
            self.pids = RankPool.collect(self, start_timeout_s, "start")  # (a start is no task of a subclass)
        except RankPoolError as exc:
            raise RuntimeError(f"the {nproc} ranks of a pool did not start: {exc}") from None

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; their results in rank order. Raises `RankPoolError` (the
        pool is killed) if a rank fails, dies or does not finish within `timeout_s`."""
        if self.broken:
            raise RuntimeError("this rank pool is broken (a task failed, or a rank died or hung); start a new one")
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self.collect(timeout_s, getattr(fn, "__name__", "task"))

    def collect(self, timeout_s: float, name: str = "task") -> list[Any]:
        """Every rank's answer to the task sent last (waiting at most `timeout_s`), in rank order."""
        results: list[Any] = [None] * self.nproc
        pending = set(range(self.nproc))
        errors = []
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                errors.append(f"ranks {sorted(pending)} did not finish {name} within {timeout_s} s (pool killed)")
                break
            for r in sorted(pending):
                conn = self.conns[r]
                try:
                    ready = conn.poll(0.02)
                except (EOFError, OSError):
                    ready = True
                if not ready:
                    if not self.procs[r].is_alive():
                        errors.append(f"rank {r} died (exit code {self.procs[r].exitcode}) during {name}")
                        pending.discard(r)
                    continue
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    errors.append(f"rank {r} died (exit code {self.procs[r].exitcode}) during {name}")
                    pending.discard(r)
                    continue
                pending.discard(r)
                if status == "err":
                    errors.append(f"rank {r} raised {value}")
                else:
                    results[r] = value
        if errors:
            self.kill()  # the ranks are out of step with each other: never reuse them
            raise RankPoolError(f"{name} failed:\n" + "\n".join(errors), results)
        return results

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        shm.remove_segments_of([p.pid for p in self.procs if p.pid is not None])  # (a killed rank unlinks nothing)
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        """Stop the ranks (politely where the pool is healthy) and remove the rendezvous file."""
        if not self.broken:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for p in self.procs:
                p.join(timeout=30)
        self.kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
