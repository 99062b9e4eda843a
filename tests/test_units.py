"""Tier 1: single-process units (plans, topology, environment, chunking, signatures)."""

from __future__ import annotations

import pytest
import torch

import overlap
from overlap import comm, envs, plans, shm, symm, world
from overlap.plans import auto


def test_plan_validates_and_describes():
    p = overlap.Plan("symm", num_chunks={"shm": 3, "network": 2})
    assert p.chunks_for("shm") == 3 and p.chunks_for("nvlink") == plans.DEFAULT_CHUNKS["nvlink"]
    assert p.describe() == "symm[network=2,shm=3]"
    assert hash(p) == hash(overlap.Plan("symm", num_chunks={"network": 2, "shm": 3}))
    with pytest.raises(ValueError, match="strategy"):
        overlap.Plan("magic")
    with pytest.raises(ValueError, match="link class"):
        overlap.Plan("symm", num_chunks={"infiniband": 2})
    with pytest.raises(ValueError, match=">= 1"):
        overlap.Plan("pipelined", num_chunks={"shm": 0})
    with pytest.raises(ValueError, match="power of two"):
        overlap.Plan("fused", block_m=48)


def test_as_plan_rules():
    assert auto.as_plan("auto", None) is None
    assert auto.as_plan("symm", None) == overlap.Plan("symm")
    assert auto.as_plan("auto", {"strategy": "fused", "block_m": 32}).block_m == 32
    with pytest.raises(ValueError, match="contradicts"):
        auto.as_plan("symm", overlap.Plan("pipelined"))
    with pytest.raises(TypeError):
        auto.as_plan("auto", 3)


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


def test_auto_heuristic_is_documented_and_never_fused_on_cpu(monkeypatch):
    sig = "a=(8, 16):float32, b=(16, 4)"
    assert auto.resolve_auto("op", sig, info(["a"]), 8, "float32").strategy == "reference"
    assert auto.resolve_auto("op", sig, info(["a", "a"]), 4096, "bfloat16").strategy == "symm"
    assert auto.resolve_auto("op", sig, info(["a", "b"]), 8, "float32").strategy == "pipelined"
    gpu = info(["a", "a"], device="cuda", peer_access=[True, True])
    monkeypatch.setattr(auto, "gpu_symmetric_memory", lambda: True)
    assert auto.resolve_auto("op", sig, gpu, 4096, "bfloat16").strategy == "fused"
    assert auto.resolve_auto("op", sig, gpu, 64, "bfloat16").strategy == "symm"
    monkeypatch.setattr(auto, "gpu_symmetric_memory", lambda: False)
    with pytest.warns(UserWarning, match="falls back to 'pipelined'"):
        assert auto.resolve_auto("op", sig + "x", gpu, 4096, "bfloat16").strategy == "pipelined"
    with pytest.raises(ValueError, match="spans nodes"):
        auto.check_plan_fits("op", overlap.Plan("fused"), info(["a", "b"]))


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


def test_environment(monkeypatch):
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", "2.5")
    assert envs.timeout_s() == 2.5
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="OVERLAP_TIMEOUT_S"):
        envs.timeout_s()
    monkeypatch.delenv("OVERLAP_TIMEOUT_S")
    assert envs.timeout_s() == 300.0
    with pytest.raises(ValueError, match="timeout"):
        envs.resolve_timeout(0)


@pytest.mark.parametrize("rows,chunks", [(1, 4), (7, 3), (12, 4), (5, 1), (3, 7)])
def test_chunk_bounds_cover_rows_exactly(rows, chunks):
    bounds = comm.chunk_bounds(rows, chunks)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len(bounds) == min(rows, chunks)
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_signature_hash_separates_signatures():
    a = symm.signature_hash("all_gather_matmul(a=(4, 8):float32, b=(8, 5), plan=symm[])")
    b = symm.signature_hash("all_gather_matmul(a=(5, 8):float32, b=(8, 5), plan=symm[])")
    assert a != b and a == symm.signature_hash("all_gather_matmul(a=(4, 8):float32, b=(8, 5), plan=symm[])")


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


def test_ops_need_an_initialized_group():
    a = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        overlap.all_gather_matmul(a, torch.randn(3, 2))


def test_triton_runs_interpreted_where_no_gpu():
    import os

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
