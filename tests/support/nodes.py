"""Groups spanning emulated nodes on the pooled CPU ranks, and the check that a rank killed on the other node
is named by every survivor (tests of `hierarchical`, the hierarchical MoE ops, expert migration)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .harness import LATE_S, RankError


def spanning_group(rank: int, ranks_per_node: int, prefix: str):
    """A new group of every rank whose node is ``<prefix><rank // ranks_per_node>`` (``OVERLAP_NODE_ID``, read
    at the group's first call; the caller deletes it when done)."""
    import torch.distributed as dist

    os.environ["OVERLAP_NODE_ID"] = f"{prefix}{rank // ranks_per_node}"
    return dist.new_group(list(range(dist.get_world_size())))


@contextlib.contextmanager
def spanning(rank: int, ranks_per_node: int, prefix: str) -> Iterator:
    """`spanning_group` for a ``with`` block, deleted after it: its heap released and the group destroyed (a
    pooled rank lives through the whole run: every group left behind keeps gloo's threads and sockets), and
    ``OVERLAP_NODE_ID`` unset."""
    import torch.distributed as dist

    import overlap

    group = spanning_group(rank, ranks_per_node, prefix)
    try:
        yield group
        overlap.release(group)
    finally:
        del os.environ["OVERLAP_NODE_ID"]
        dist.destroy_process_group(group)


def assert_dead_named(failed: RankError, victim: int, deadline: float) -> None:
    """The victim's death failed the task; every survivor returned ``(error kind, message, seconds)`` of an
    overlap error naming it, raised within the call's `deadline` (a survivor may wait that long)."""
    assert f"rank {victim} died" in str(failed) and "raised" not in str(failed), failed
    print(*failed.results, sep="\n")
    for rank, res in enumerate(failed.results):
        if rank == victim:
            continue
        kind, msg, secs = res
        assert kind in ("OverlapError", "OverlapTimeout"), (rank, res)
        assert f"rank {victim}" in msg or f"peer {victim}" in msg, (rank, res)
        assert secs < deadline + LATE_S, (rank, res)
