"""The POSIX shared-memory segments of one heap on CPU ranks: the run they belong to, their names, their set-up.

At a heap's creation every rank posts, through the store, its pid namespace and what it was built from (the
layout's numbers and the ``overlap._C`` file's hash: `layout.build_digest`); rank 0 adds the run id (128 random
bits). Ranks built differently raise `OverlapError` on every rank there, before any segment exists. A segment's
name is ``<run>-<pid namespace>-<creator pid>-<kind>-r<rank>`` in this user's private folder (`overlap.shm`).

Set-up of a segment kind (`Segments.map_all`): create this rank's, rendezvous, map every peer's, rendezvous,
unlink this rank's. A rank that cannot create posts why, and its peers raise at once; a peer whose process is
gone ends the wait at once, and its segments are removed (by the survivors' error path, or by their SIGTERM
handler where the job is torn down first: `shm.watching`). Growth (`SymmHeap._grow`) meets on the control pads
instead, and uses the same names and clean-up.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from .. import rendezvous, shm, world
from ..errors import OverlapError
from .layout import build_digest


class Segments:
    """Names and set-up of one heap's segments (CPU ranks)."""

    def __init__(self, group: dist.ProcessGroup, info: world.GroupInfo, timeout: float):
        self.group, self.info, self.rank = group, info, info.rank
        self.run, self.pid_ns = _agree(group, info.rank, timeout)

    def name(self, kind: str, rank: int) -> str:
        return shm.segment_name(self.run, self.pid_ns[rank], self.info.pids[rank], kind, rank)

    def dead(self, peer: int) -> bool:
        """Whether `peer`'s process is gone (only where its pids mean the same as ours: same pid namespace)."""
        return self.pid_ns[peer] == self.pid_ns[self.rank] and self.info.gone(peer)

    def remove_dead(self, kind: str) -> list[str]:
        """Remove the segments `kind` of the peers whose processes are gone; returns their names."""
        return shm.remove_segments([self.name(kind, p) for p in range(self.info.world_size)
                                    if p != self.rank and self.dead(p)])

    def watching(self, kind: str) -> AbstractContextManager[None]:
        """While the block runs, an ending signal to this process also removes the segments `kind` of peers that
        died (`shm.watching`)."""
        same_ns = [p for p in range(self.info.world_size)
                   if p != self.rank and self.pid_ns[p] == self.pid_ns[self.rank]]
        return shm.watching({self.name(kind, p): self.info.pids[p] for p in same_ns})

    def map_all(self, kind: str, nbytes: int, timeout: float) -> list[torch.Tensor]:
        """Create this rank's segment `kind` of `nbytes` bytes, map every peer's, then unlink this rank's (once
        every peer has mapped it, or the set-up failed: never left behind)."""
        name = self.name(kind, self.rank)
        try:
            with self.watching(kind):
                try:
                    own = shm.create_segment(name, nbytes)
                except (OSError, OverlapError) as exc:
                    rendezvous.exchange(self.group, f"{kind}-created", None, timeout, failed=exc)
                rendezvous.exchange(self.group, f"{kind}-created", None, timeout, gone=self.dead)
                mapped = [own if p == self.rank else shm.attach_segment(self.name(kind, p), nbytes)
                          for p in range(self.info.world_size)]
                rendezvous.exchange(self.group, f"{kind}-mapped", None, timeout, gone=self.dead)
                return mapped
        except BaseException:
            self.remove_dead(kind)
            raise
        finally:
            shm.unlink(name)


def _agree(group: dist.ProcessGroup, rank: int, timeout: float) -> tuple[str, list[int]]:
    """The run id (rank 0's) and every rank's pid namespace, after checking that every rank runs the same layout
    and ``overlap._C`` build (else `OverlapError` on every rank)."""
    mine = {"run": shm.new_run_id() if rank == 0 else "", "pid_ns": shm.pid_namespace(), **build_digest()}
    posted = rendezvous.exchange(group, "heap", mine, timeout)
    if not all(isinstance(v, dict) for v in posted):
        raise OverlapError(f"overlap: the heap's set-up received values that are not overlap's: {posted!r}")
    builds = [{k: v.get(k) for k in ("layout", "_C")} for v in posted]
    if any(b != builds[rank] for b in builds):
        lines = "\n".join(f"  rank {r}: {b}" for r, b in enumerate(builds))
        raise OverlapError(f"overlap: the ranks of a group run different builds of overlap (this is rank {rank}; "
                           f"the heap layout's numbers or the overlap._C extension differ):\n{lines}\n"
                           "install the same build on every rank")
    run = posted[0].get("run")
    pid_ns = [v.get("pid_ns") for v in posted]
    if not (isinstance(run, str) and shm.RUN_ID_RE.match(run)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**64 for n in pid_ns):
        raise OverlapError(f"overlap: the heap's set-up received values that are not overlap's: {posted!r}")
    return run, pid_ns
