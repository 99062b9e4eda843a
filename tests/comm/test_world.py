"""Tier 1, the world layer without ranks: link classes from a group's nodes and devices, the node
identity's precedence (`overlap.world`); stale shared-memory segments and a full /dev/shm (`overlap.shm`)."""

from __future__ import annotations

import pytest
import torch

from overlap import shm, world


def info(nodes, device="cpu", rank=0, peer_access=None):
    n = len(nodes)
    return world.GroupInfo(rank=rank, world_size=n, global_ranks=tuple(range(n)), nodes=tuple(nodes),
                           pids=tuple(range(n)), backend="gloo", device=torch.device(device),
                           peer_access=tuple(peer_access or [False] * n))


def test_link_classes():
    i = info(["a", "a", "b"])
    assert i.link_classes() == {1: "shm", 2: "network"} and not i.single_node
    g = info(["a", "a", "a"], device="cuda", peer_access=[True, True, False])
    assert g.link_classes() == {1: "nvlink", 2: "pcie"}


def test_node_identity_precedence(monkeypatch):
    monkeypatch.delenv("OVERLAP_NODE_ID", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    import socket

    assert world.node_identity() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert world.node_identity() == "torchrun-node3"
    monkeypatch.setenv("OVERLAP_NODE_ID", "rack1-host7")
    assert world.node_identity() == "rack1-host7"


def test_stale_segments_of_dead_processes_are_removed(tmp_path):
    import os
    import subprocess
    import sys
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = int(dead.stdout)
    stale = tmp_path / f"overlap-abc123-{pid}-g1-r0"
    fresh = tmp_path / f"overlap-abc124-{pid}-g1-r1"  # dead pid, but too young to be sure (other pid namespace)
    live = tmp_path / f"overlap-abc123-{os.getpid()}-g1-r0"
    for f in (stale, fresh, live):
        f.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(live, (old, old))
    assert shm.remove_stale_segments(str(tmp_path)) == [stale.name]
    assert live.exists() and fresh.exists() and not stale.exists()
    assert shm.remove_stale_segments(str(tmp_path), min_age_s=0) == [fresh.name]


def test_shared_memory_shortage_is_a_clear_error(tmp_path, monkeypatch):
    import errno
    import os

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    path = str(tmp_path / "overlap-seg")
    with pytest.raises(OSError, match="OVERLAP_SHM_DIR"):
        shm.create_segment(path, 1 << 20)
    assert not os.path.exists(path)
