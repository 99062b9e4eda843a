"""Ranks, nodes and links: who the peers of a group are and how each pair is connected.

A group is a ``torch.distributed`` process group (``None`` is the default group). `GroupInfo`
adds what `overlap` needs on top: the node of every rank (from torchrun's environment,
``OVERLAP_NODE_ID`` or the hostname, in that order of precedence as the README's environment table says), the link
class of every peer pair, and the device the group computes on.

Link classes: ``"shm"`` (CPU ranks of one node: POSIX shared memory), ``"nvlink"`` and ``"pcie"``
(GPU ranks of one node, told apart by peer access), ``"network"`` (ranks on different nodes).

`launch` starts N local ranks when the program was not started by torchrun: gloo on CPU,
NCCL with one rank per GPU where GPUs exist. No rank outlives its caller, whether the caller is
interrupted, terminated or killed (`overlap.lifetime`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import envs, lifetime
from .errors import OverlapError
from .links import LINK_CLASSES
from .rendezvous import exchange
from .version import __version__

# Every module of overlap that uses torch (and so may reach Triton) imports this one first: where no GPU
# exists, TRITON_INTERPRET is set here, before anything can import Triton (`envs.set_triton_interpret`).
envs.set_triton_interpret()


def node_identity() -> str:
    """This process's node: OVERLAP_NODE_ID, else torchrun's GROUP_RANK, else the hostname."""
    explicit = envs.node_id()
    if explicit:
        return explicit
    if os.environ.get("GROUP_RANK", "") != "" and os.environ.get("LOCAL_WORLD_SIZE", "") != "":
        return f"torchrun-node{os.environ['GROUP_RANK']}"
    return socket.gethostname()


def resolve_group(group: Any) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "overlap needs torch.distributed to be initialized: start the program with torchrun, "
            "or with overlap.world.launch(fn, nproc), or call torch.distributed.init_process_group"
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """Static facts about one group, gathered once per group with one collective."""

    rank: int
    world_size: int
    global_ranks: tuple[int, ...]
    nodes: tuple[str, ...]  # node identity of each group rank
    pids: tuple[int, ...]
    backend: str
    device: torch.device
    peer_access: tuple[bool, ...]  # GPU peer access from this rank to each group rank

    @property
    def single_node(self) -> bool:
        return len(set(self.nodes)) == 1

    @property
    def node_names(self) -> list[str]:
        return sorted(set(self.nodes))

    def link_class(self, peer: int) -> str:
        """Link class between this rank and group rank `peer`."""
        if self.nodes[peer] != self.nodes[self.rank]:
            return "network"
        if self.device.type != "cuda":
            return "shm"
        return "nvlink" if self.peer_access[peer] else "pcie"

    @property
    def slowest_link(self) -> str:
        """The slowest link class of the group as this rank sees it (rings and uniform chunking use it).

        Ranks of one node could in principle see different classes (PCIe islands): every op puts
        this value in its call signature, so a disagreement raises instead of mismatching chunks.
        """
        if self.world_size == 1:
            return "shm" if self.device.type != "cuda" else "nvlink"
        return max((self.link_class(p) for p in range(self.world_size) if p != self.rank), key=LINK_CLASSES.index)

    def gone(self, peer: int) -> bool:
        """Whether group rank `peer` runs on this node and its process has exited (or is a zombie).

        Only a hint for error messages: False whenever it cannot tell (another node, no /proc)."""
        if peer == self.rank or self.nodes[peer] != self.nodes[self.rank]:
            return False
        pid = self.pids[peer]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return False

    def gone_peers(self) -> list[int]:
        """Group ranks of this node whose processes have exited (see `gone`)."""
        return [p for p in range(self.world_size) if self.gone(p)]

    def link_classes(self) -> dict[int, str]:
        return {p: self.link_class(p) for p in range(self.world_size) if p != self.rank}


_INFOS: dict[int, tuple[dist.ProcessGroup, GroupInfo]] = {}


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph (False where CUDA was never
    initialized in this process: no query, no initialization)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def group_device(group: dist.ProcessGroup) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_info(group: Any = None, timeout: float | None = None) -> GroupInfo:
    """`GroupInfo` of `group` (a bounded rendezvous on first use per group, cached afterwards)."""
    pg = resolve_group(group)
    cached = _INFOS.get(id(pg))
    if cached is not None and cached[0] is pg:
        return cached[1]
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    device = group_device(pg)
    node = node_identity()
    device_index = device.index if device.type == "cuda" else -1
    timeout = envs.timeout_s() if timeout is None else timeout
    gathered = [_peer_facts(r, v) for r, v in enumerate(exchange(
        pg, "info", {"node": node, "pid": os.getpid(), "device": device_index, "version": __version__}, timeout))]
    _check_versions(rank, [g[3] for g in gathered])
    peer_access = []
    for peer_node, _pid, peer_dev, _version in gathered:
        same_gpu_node = device.type == "cuda" and peer_node == node and peer_dev >= 0
        ok = same_gpu_node and (peer_dev == device_index or torch.cuda.can_device_access_peer(device_index, peer_dev))
        peer_access.append(bool(ok))
    info = GroupInfo(
        rank=rank,
        world_size=world,
        global_ranks=tuple(dist.get_global_rank(pg, r) for r in range(world)) if pg is not dist.group.WORLD
        else tuple(range(world)),
        nodes=tuple(g[0] for g in gathered),
        pids=tuple(g[1] for g in gathered),
        backend=str(dist.get_backend(pg)),
        device=device,
        peer_access=tuple(peer_access),
    )
    _INFOS[id(pg)] = (pg, info)
    return info


def _peer_facts(rank: int, value: Any) -> tuple[str, int, int, str]:
    """(node, pid, device index, version) of group rank `rank`, from what it posted; raises `OverlapError` where
    any is not what an overlap rank posts (pids and nodes go into paths and messages: nothing unchecked does)."""
    try:
        node, pid, device, version = value["node"], value["pid"], value["device"], value["version"]
        ok = (isinstance(node, str) and 0 < len(node) <= 255 and node.isprintable()
              and all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, device))
              and 0 < pid < 2**31 and -1 <= device < 2**16 and isinstance(version, str) and len(version) <= 64)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise OverlapError(f"overlap: group rank {rank} posted facts that are not an overlap rank's: {value!r}")
    return node, pid, device, version


def _check_versions(rank: int, versions: list[str]) -> None:
    """Raise on every rank where the ranks of one group run different versions of overlap (each rank has every
    rank's version, so each raises the same error before anything is shared)."""
    if len(set(versions)) > 1:
        lines = "\n".join(f"  rank {r}: overlap {v}" for r, v in enumerate(versions))
        raise OverlapError(f"overlap: the ranks of a group run different versions of overlap (this is rank {rank}):"
                           f"\n{lines}\ninstall one version on every node")


def forget_group(group: dist.ProcessGroup) -> None:
    _INFOS.pop(id(group), None)


# ----------------------------------------------------------------------------------------------
# Starting local ranks
# ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_nproc() -> int:
    """Default rank count of `launch`: every GPU where GPUs exist, else 2 CPU ranks."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def ranks_device_type(world_size: int) -> str:
    """The device type ranks compute on: torchrun's (`init_from_env`: CUDA wherever torch sees a GPU), or
    `world_size` local ranks' (`init_rank`: CUDA where there is a GPU per rank)."""
    if not torch.cuda.is_available():
        return "cpu"
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    return "cuda" if under_torchrun or torch.cuda.device_count() >= world_size else "cpu"


def init_rank(rank: int, world_size: int, init_file: str, timeout_s: float = 300.0, backend: str | None = None) -> None:
    """Initialize torch.distributed for one locally started rank (gloo on CPU, NCCL on GPUs; ``backend="gloo"``
    keeps CPU ranks where there are GPUs).

    Ranks meet through a file store (`init_file`, a path that does not exist yet), so no TCP port
    has to be picked in advance and raced for.
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    use_cuda = backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": torch.device("cuda", rank)} if use_cuda else {}),
    )


def init_from_env() -> bool:
    """Initialize from torchrun's environment if it is there and nothing is initialized yet."""
    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return True


def _rank_main(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, report: Any,
               parent_pid: int, leftovers: tuple[str, ...]) -> None:
    lifetime.watch_parent(parent_pid, leftovers)  # first: no rank outlives its parent
    torch.set_num_threads(1)
    try:
        init_rank(rank, world_size, init_file)
        fn(*args)
        # Every rank is done before any tears down, so no rank loses a peer mid-teardown.
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which exits non-zero
        try:
            report.send(traceback.format_exc())
        except OSError:  # the parent is gone: nobody to tell
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer can make teardown fail; the error is reported
                pass
    exit_after_teardown(0)


def exit_after_teardown(code: int) -> None:
    """End a rank process that has torn down its process group, without the interpreter's own teardown.

    Rarely (seen twice in this project's test runs on a loaded machine: once in `overlap bench`'s ranks,
    once in the GPU check's torchrun smoke; not reproduced on demand) a rank that had finished, printed its
    results and destroyed its group aborted in the interpreter's teardown with "terminate called without
    an active exception" (a C++ thread being destroyed unjoined; overlap's own code starts none). Nothing
    is left to do at that point (shared-memory segments are unlinked as soon as every rank has mapped
    them), so the rank flushes its output and exits directly."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def launch(fn: Callable, nproc: int | None = None, args: tuple = (), timeout_s: float | None = None,
           leftovers: Sequence[str] = ()) -> None:
    """Run ``fn(*args)`` on `nproc` freshly started local ranks and wait for all of them.

    `fn` must be importable (defined at module level). Raises ``RuntimeError`` with the first
    failing rank's traceback; the other ranks are then stopped, so one failure never hangs the rest.

    No rank outlives this call (`overlap.lifetime`): when it ends by an exception (KeyboardInterrupt on
    SIGINT; `overlap.errors.Terminated` on SIGTERM or SIGHUP, while it runs in the main thread) the ranks get
    SIGTERM, then SIGKILL after a second; when the caller dies (SIGKILL included) they end by themselves.
    Ranks ended either way remove the shared-memory segments they created, the rendezvous folder and
    `leftovers` (the caller's scratch files or folders, which its own cleanup never reaches if it is killed).
    """
    import multiprocessing as mp
    import shutil
    import tempfile

    nproc = default_nproc() if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = mp.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="overlap-launch-")
    init_file = os.path.join(store_dir, "store")
    # One one-way pipe per rank for its traceback: no semaphore (a multiprocessing queue's), nothing in /dev/shm.
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
    leave = (store_dir, *leftovers)
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, init_file, fn, args, pipes[r][1], os.getpid(), leave))
             for r in range(nproc)]
    failure = None
    try:
        with lifetime.raising_on_signals():
            try:
                for p in procs:
                    p.start()
                for _, sender in pipes:
                    sender.close()  # the ranks hold their ends: a rank that exits closes its pipe
                failure = _await_ranks(procs, [receiver for receiver, _ in pipes], timeout_s)
            finally:
                lifetime.stop(procs)
    finally:
        for receiver, sender in pipes:
            receiver.close()
            sender.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    if failure is not None:
        rank, text = failure
        raise RuntimeError(f"rank {rank} failed:\n{text}")


def _await_ranks(procs: list, receivers: list, timeout_s: float | None) -> tuple[int, str] | None:
    """Wait until every rank has ended; (rank, traceback or exit code) of the first one that failed (rank -1:
    past `timeout_s`), at once, or None."""
    import time
    from multiprocessing import connection

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    running = dict(enumerate(procs))
    listening = dict(enumerate(receivers))
    while running:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return -1, f"ranks did not finish within {timeout_s} s"
        ready = connection.wait([*listening.values(), *(p.sentinel for p in running.values())], left)
        for r, receiver in list(listening.items()):
            if receiver in ready:
                try:
                    return r, receiver.recv()
                except EOFError:  # the rank ended without a word: its exit code tells
                    del listening[r]
        for r, p in list(running.items()):
            if p.sentinel in ready:
                p.join()
                if p.exitcode != 0:
                    return r, f"rank {r} exited with code {p.exitcode}"
                del running[r]
    return None
