"""A shared host: segments nobody else can touch, nothing leaked, different installs refused (`overlap.shm`,
`overlap.rendezvous`, the heap's set-up).

Another user is a dropped uid (65534) where the suite runs as root; those tests skip with the reason elsewhere.
Each bad case must fail on every rank within `FAST_S` seconds (no deadline waited out).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from overlap import rendezvous, shm, world
from overlap.errors import OverlapError, OverlapTimeout

FAST_S = 2.0  # every rank raises within this (the groups' deadline is 20 s)
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="another user needs a dropped uid: the suite is not root")


@pytest.fixture
def shm_base(tmp_path, monkeypatch):
    """OVERLAP_SHM_DIR of this test: a folder like /dev/shm (mode 1777: every user creates, owners remove), in
    /dev/shm where it can write (every user can reach it there), removed after."""
    import pathlib
    import shutil
    import tempfile

    on_tmpfs = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    base = pathlib.Path(tempfile.mkdtemp(prefix="overlap_test_host_", dir="/dev/shm" if on_tmpfs else tmp_path))
    base.chmod(0o1777)
    monkeypatch.setenv("OVERLAP_SHM_DIR", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _name(kind="g1", rank=0, pid=None):
    return shm.segment_name(shm.new_run_id(), shm.pid_namespace(), pid or os.getpid(), kind, rank)


def _as_nobody(fn) -> str:
    """``fn()`` (plain os calls, returning a string) in a forked child that has become user 65534; its result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python beyond os calls, then _exit
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = f"child failed: {exc!r}"
        os.write(write_fd, out.encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


# ----------------------------------------------------------------------------------------------
# Attach: through a descriptor, after fstat
# ----------------------------------------------------------------------------------------------


def test_attach_never_creates_follows_or_extends(shm_base):
    folder = shm.private_dir()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.stat(folder).st_uid == os.geteuid()
    missing = _name()
    with pytest.raises(FileNotFoundError, match="missing"):
        shm.attach_segment(missing, 8192)
    assert not os.path.exists(os.path.join(folder, missing))  # no O_CREAT

    short = _name(rank=1)
    fd = os.open(os.path.join(folder, short), os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"x" * 64)
    os.close(fd)
    with pytest.raises(OverlapError, match="64 bytes, not 8192"):
        shm.attach_segment(short, 8192)
    assert os.path.getsize(os.path.join(folder, short)) == 64  # not grown

    target = shm_base / "elsewhere"
    target.write_bytes(b"\0" * 8192)
    link = _name(rank=2)
    os.symlink(target, os.path.join(folder, link))
    with pytest.raises(OverlapError, match="not a file of this job"):
        shm.attach_segment(link, 8192)

    loose = _name(rank=3)
    fd = os.open(os.path.join(folder, loose), os.O_CREAT | os.O_WRONLY, 0o600)
    os.ftruncate(fd, 8192)
    os.fchmod(fd, 0o644)
    os.close(fd)
    with pytest.raises(OverlapError, match="mode 644"):
        shm.attach_segment(loose, 8192)


def test_create_then_attach_round_trip_and_mode_whatever_the_umask(shm_base):
    name = _name()
    old = os.umask(0o277)  # would give a create mode of 0400
    try:
        mine = shm.create_segment(name, 4096)
    finally:
        os.umask(old)
    path = os.path.join(shm.private_dir(), name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == 4096
    mine[:4] = 7
    peer = shm.attach_segment(name, 4096)
    assert peer[:4].tolist() == [7, 7, 7, 7]
    with pytest.raises(OverlapError, match="exists already"):
        shm.create_segment(name, 4096)  # exclusive
    shm.unlink(name)
    assert not os.path.exists(path) and name not in shm.CREATED
    peer[4] = 9
    assert int(mine[4]) == 9  # the mappings outlive the name


def test_unlink_removes_only_the_file_it_created(shm_base):
    name = _name()
    shm.create_segment(name, 4096)
    path = os.path.join(shm.private_dir(), name)
    os.unlink(path)
    with open(path, "wb") as f:  # another file under the same name (not ours: another inode)
        f.write(b"y")
    shm.unlink(name)
    assert os.path.exists(path), "unlink removed a file this process did not create"


def test_names_are_checked_before_they_enter_a_path():
    run = shm.new_run_id()
    assert shm.RUN_ID_RE.match(run) and run != shm.new_run_id()
    for bad in [("../" + run[3:], 1, 5), (run, 1, 0), (run, 1, -3), (run, -1, 5)]:
        with pytest.raises(ValueError, match="not a valid segment name"):
            shm.segment_name(bad[0], bad[1], bad[2], "g1", 0)
    with pytest.raises(OverlapError, match="not an overlap rank's"):
        world._peer_facts(1, {"node": "n", "pid": "../../etc", "device": -1, "version": "0.1.0"})
    with pytest.raises(OverlapError, match="not an overlap rank's"):
        world._peer_facts(1, {"node": "n", "pid": 7, "device": -1})


def test_remove_segments_of_spares_other_pid_namespaces(shm_base):
    folder = shm.private_dir()
    run, ns = shm.new_run_id(), shm.pid_namespace()
    ours = shm.segment_name(run, ns, 4242, "ctrl", 0)
    theirs = shm.segment_name(run, ns + 1, 4242, "ctrl", 0)  # same pid, another container
    for name in (ours, theirs):
        open(os.path.join(folder, name), "wb").close()
    assert shm.remove_segments_of([4242]) == [ours]
    assert os.listdir(folder) == [theirs]


# ----------------------------------------------------------------------------------------------
# Another user
# ----------------------------------------------------------------------------------------------


@as_root
def test_another_user_cannot_enter_or_foresee_our_folder(shm_base):
    folder = shm.private_dir()
    name = _name()
    shm.create_segment(name, 4096)
    try:
        def attempt() -> str:
            os.close(os.open(str(shm_base / "nobody-was-here"), os.O_CREAT | os.O_RDWR, 0o600))  # (reachable)
            said = []
            for path in (os.path.join(folder, "x"), os.path.join(folder, name)):
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o666))
                    said.append(f"opened {path}")
                except PermissionError:
                    said.append("refused")
            return " ".join(said)

        assert _as_nobody(attempt) == "refused refused"
    finally:
        shm.unlink(name)


@as_root
def test_a_folder_of_another_user_is_refused(shm_base):
    planted = shm_base / f"overlap-{os.geteuid()}"
    assert _as_nobody(lambda: os.mkdir(planted, 0o777) or "made") == "made"
    with pytest.raises(OverlapError, match=f"belongs to user {NOBODY}"):
        shm.create_segment(_name(), 4096)
    assert os.listdir(planted) == []


def test_a_symlinked_folder_is_refused(shm_base, tmp_path):
    decoy = tmp_path / "decoy"
    decoy.mkdir(mode=0o700)
    os.symlink(decoy, shm_base / f"overlap-{os.geteuid()}")
    with pytest.raises(OverlapError, match="symlink or not a folder"):
        shm.create_segment(_name(), 4096)
    assert os.listdir(decoy) == []


def test_own_folder_with_a_loose_mode_is_closed(shm_base):
    folder = shm_base / f"overlap-{os.geteuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    shm.private_dir()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


# ----------------------------------------------------------------------------------------------
# Signals: a process that created segments unlinks them on SIGTERM and SIGHUP, then goes on as before
# ----------------------------------------------------------------------------------------------

_HOLDER = """
import os, signal, sys, time
from overlap import shm
if sys.argv[1] == "handler":
    signal.signal(signal.SIGTERM, lambda s, f: (print("previous handler ran", flush=True), sys.exit(3)))
name = shm.segment_name(shm.new_run_id(), shm.pid_namespace(), os.getpid(), "ctrl", 0)
shm.create_segment(name, 4096)
print(name, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig,previous", [(signal.SIGTERM, "default"), (signal.SIGHUP, "default"),
                                          (signal.SIGTERM, "handler")])
def test_ending_signal_unlinks_then_chains(shm_base, sig, previous):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, previous], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        name = proc.stdout.readline().strip()
        assert name and os.path.exists(os.path.join(shm.private_dir(), name))
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert not os.path.exists(os.path.join(shm.private_dir(), name)), "the segment outlived the signal"
    if previous == "default":
        assert code == -sig, code  # ended by the signal, as without overlap
    else:
        assert code == 3 and "previous handler ran" in proc.stdout.read()


# ----------------------------------------------------------------------------------------------
# The store: JSON, local errors, a peer's error at once
# ----------------------------------------------------------------------------------------------


class _FailingStore:
    """A store whose connection is lost: its wait raises at once (not after the slice)."""

    def wait(self, keys, timeout):
        raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        return False


def test_a_failing_store_is_reported_as_such_not_as_a_peer_timeout():
    with pytest.raises(OverlapError, match="store failed on rank 0") as info:
        rendezvous._wait(_FailingStore(), ["k/0", "k/1"], "k/error", 0, "info", "setup", 20.0, None)
    assert not isinstance(info.value, OverlapTimeout)


def test_no_pickle_in_what_ranks_exchange():
    import inspect
    import re

    from overlap.symm import segments

    for module in (world, rendezvous, segments):
        assert not re.search(r"import pickle|pickle\.", inspect.getsource(module)), module.__name__


def _timed(fn, *args):
    start = time.monotonic()
    try:
        fn(*args)
        return None, time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def create_fails_on_rank_1(rank, world_size):
    """Rank 1 cannot create its control pad; rank 0 must hear the reason at once."""
    import torch.distributed as dist

    import overlap
    from overlap.symm import heap as symm_heap

    group = dist.new_group(list(range(world_size)))
    if rank == 1:
        def no_room(name, nbytes):
            raise OSError(28, f"overlap: cannot reserve {nbytes} bytes (test)")

        symm_heap.shm.create_segment, real = no_room, symm_heap.shm.create_segment
    try:
        return _timed(overlap.reserve, group, 1024, 20.0)
    finally:
        if rank == 1:
            symm_heap.shm.create_segment = real
        dist.barrier()


def test_a_failed_create_fails_every_rank_at_once(pools):
    results = pools(2).run(create_fails_on_rank_1)
    (err0, s0), (err1, s1) = results
    assert err1 and "cannot reserve" in err1, results
    assert err0 and err0.startswith("PeerFailed") and "rank 1" in err0 and "cannot reserve" in err0, results
    assert s0 < FAST_S and s1 < FAST_S, results


def other_install_on_rank_1(rank, world_size, what):
    """Rank 1 runs another version of overlap (`version`) or another layout or _C build (`build`)."""
    import torch.distributed as dist

    import overlap
    from overlap import shm
    from overlap.symm import segments as symm_segments

    group = dist.new_group(list(range(world_size)))
    before = len(shm.segment_names())
    patched = []
    if rank == 1 and what == "version":
        patched.append((world, "__version__", world.__version__))
        world.__version__ = "0.0.0+patched"
    if rank == 1 and what == "build":
        patched.append((symm_segments, "build_digest", symm_segments.build_digest))
        symm_segments.build_digest = lambda: {"layout": "0" * 16, "_C": "f" * 16}
    try:
        err, secs = _timed(overlap.reserve, group, 1024, 20.0)
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
    created = len(shm.segment_names()) - before  # (none: checked before any segment exists)
    dist.barrier()
    return err, secs, created


@pytest.mark.parametrize("what", ["version", "build"])
def test_ranks_of_different_installs_refuse_before_any_segment(pools, what):
    results = pools(2).run(other_install_on_rank_1, what)
    for rank, (err, secs, created) in enumerate(results):
        want = "different versions" if what == "version" else "different builds"
        assert err and "OverlapError" in err and want in err, (rank, err)
        assert secs < FAST_S and created == 0, (rank, secs, created)


def reserve_too_much(rank, world_size, bad_ranks):
    import torch.distributed as dist

    import overlap

    group = dist.new_group(list(range(world_size)))
    result = _timed(overlap.reserve, group, 2**62 if rank in bad_ranks else 1024, 20.0)
    dist.barrier()
    return result


@pytest.mark.parametrize("bad_ranks", [(0, 1), (1,)])
def test_reserve_of_an_absurd_size_fails_every_rank_at_once(pools, bad_ranks):
    results = pools(2).run(reserve_too_much, bad_ranks)
    for rank, (err, secs) in enumerate(results):
        assert err is not None and secs < FAST_S, (rank, err, secs)
        if rank in bad_ranks:
            assert err.startswith("ValueError") and "from 0 to" in err, (rank, err)
        else:
            assert "OverlapMismatchError" in err and "invalid input on rank 1" in err, (rank, err)


# ----------------------------------------------------------------------------------------------
# Killed jobs leave nothing
# ----------------------------------------------------------------------------------------------

_TORCHRUN_RANK = """
import os, signal
import torch.distributed as dist
import overlap
from overlap import shm
from overlap.symm import heap

dist.init_process_group("gloo")
if dist.get_rank() == 1:  # killed right after creating its control pad, before any peer maps it
    real = heap.shm.create_segment
    def create_then_die(name, nbytes):
        real(name, nbytes)
        os.kill(os.getpid(), signal.SIGKILL)
    heap.shm.create_segment = create_then_die
overlap.reserve(None, 1024, timeout=20)
"""


def test_a_torchrun_job_killed_during_set_up_leaves_nothing(shm_base, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_RANK)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{world.free_port()}",
                           str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd(),
                                   OVERLAP_TIMEOUT_S="20"))
    took = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert shm.segment_names(str(shm_base)) == [], [str(n) for n in shm.segment_names(str(shm_base))]
    assert took < 60, f"the job took {took:.0f} s to end (its deadline was 20 s)"


_POOL_PARENT = """
import os, sys, time
from overlap.pool import RankPool
from tests.comm.test_shared_host import hold_a_segment
pool = RankPool(2, backend="gloo")
print(" ".join(str(p) for p in pool.pids), flush=True)
print(" ".join(pool.run(hold_a_segment)), flush=True)
time.sleep(120)
"""


def hold_a_segment() -> str:
    from overlap import shm

    name = shm.segment_name(shm.new_run_id(), shm.pid_namespace(), os.getpid(), "g1", 0)
    shm.create_segment(name, 4096)
    return name


def test_pool_ranks_end_with_their_killed_parent_and_leave_nothing(shm_base):
    parent = subprocess.Popen([sys.executable, "-c", _POOL_PARENT], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd()))
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        names = parent.stdout.readline().split()
        assert len(pids) == 2 and len(names) == 2
        assert sorted(str(n) for n in shm.segment_names()) == sorted(names)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "pool ranks outlived their parent"
        assert shm.segment_names() == [], [str(n) for n in shm.segment_names()]
    finally:
        parent.kill()
        shm.remove_segments_of(pids if "pids" in locals() else [])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
