"""POSIX shared-memory segments for CPU symmetric memory: create, map, unlink, clean up.

A segment is a file in ``OVERLAP_SHM_DIR`` (default ``/dev/shm``) named
``overlap-<run id>-<creator pid>-<kind>-r<rank>``. `overlap.symm` creates one per rank, every peer
maps it, then its creator unlinks it at once: the mappings live on, the directory holds nothing.
A segment survives only if its creator dies inside that window: a rank ended by SIGTERM unlinks the
segments it created (`unlink_created`, `overlap.lifetime`), the parent of a killed rank removes its segments
(`remove_segments_of`), and `remove_stale_segments` removes any other at the next heap creation (the creator
pid in the name proves it dead).
"""

from __future__ import annotations

import atexit
import os
import re
import time

import torch

from . import envs

_NAME_RE = re.compile(r"^overlap-[0-9a-f]+-(\d+)-")


def create_segment(path: str, nbytes: int) -> torch.Tensor:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: on tmpfs a sparse file "succeeds" and the first write past the
        # free space kills the process with SIGBUS instead.
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        unlink(path)
        raise OSError(exc.errno, f"overlap: cannot reserve {nbytes} bytes of shared memory in "
                      f"{os.path.dirname(path)} ({exc.strerror}); free space there, point OVERLAP_SHM_DIR "
                      "at a larger tmpfs, or give the container a larger /dev/shm") from None
    else:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def attach_segment(path: str, nbytes: int) -> torch.Tensor:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"overlap: shared memory segment {path} of a peer is missing; ranks of one group must share "
            f"{envs.shm_dir()} (set OVERLAP_NODE_ID per node if two nodes share a hostname)"
        )
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(directory: str | None = None, min_age_s: float = 60.0) -> list[str]:
    """Remove segments left by processes that are provably dead (their creator pid is gone).

    Segments are normally unlinked right after every rank has mapped them; one survives only if a
    rank died inside that window. Called at every heap creation; returns the removed names. Only
    segments older than `min_age_s` go: a job in another pid namespace sharing this directory
    (``--ipc=host``) may hold a live segment whose pid means nothing here, for a moment.
    """

    directory = directory or envs.shm_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        path = os.path.join(directory, name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                if time.time() - os.stat(path).st_mtime < min_age_s:
                    continue
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
    return removed


def remove_segments_of(pids, directory: str | None = None) -> list[str]:
    """Remove the segments created by the processes `pids` (ranks that ended: a rank killed by SIGKILL leaves
    the segments it had not unlinked yet). Returns the removed names."""
    wanted = {str(pid) for pid in pids}
    directory = directory or envs.shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _NAME_RE.match(name)
        if m and m.group(1) in wanted:
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed


CREATED: set[str] = set()  # paths this process created and has not unlinked yet


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    CREATED.discard(path)


@atexit.register
def unlink_created() -> None:
    """Unlink every segment this process created and has not unlinked yet (at exit, or when a rank is ended:
    `overlap.lifetime`)."""
    for path in list(CREATED):
        unlink(path)
