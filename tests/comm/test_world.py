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


def test_stale_segments_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """Only this user's segments of this pid namespace whose creator is dead and that are old enough go."""
    import os
    import subprocess
    import sys
    import time

    monkeypatch.setenv("OVERLAP_SHM_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid, ns, run = int(dead.stdout), shm.pid_namespace(), shm.new_run_id()
    folder = shm.private_dir()
    stale = shm.segment_name(run, ns, pid, "g1", 0)
    fresh = shm.segment_name(run, ns, pid, "g1", 1)  # dead pid, but too young: it may be being set up
    live = shm.segment_name(run, ns, os.getpid(), "g1", 2)
    other_ns = shm.segment_name(run, ns + 1, pid, "g1", 3)  # another container's: its pids mean nothing here
    for name in (stale, fresh, live, other_ns):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x")
    old = time.time() - 3600
    for name in (stale, live, other_ns):
        os.utime(os.path.join(folder, name), (old, old))
    assert shm.remove_stale_segments() == [stale]
    assert shm.remove_stale_segments(min_age_s=0) == [fresh]
    assert sorted(os.listdir(folder)) == sorted([live, other_ns])


def test_shared_memory_shortage_is_a_clear_error(tmp_path, monkeypatch):
    import errno
    import os

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("OVERLAP_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    name = shm.segment_name(shm.new_run_id(), shm.pid_namespace(), os.getpid(), "g1", 0)
    with pytest.raises(OSError, match="OVERLAP_SHM_DIR"):
        shm.create_segment(name, 1 << 20)
    assert os.listdir(shm.private_dir()) == [] and name not in shm.CREATED
