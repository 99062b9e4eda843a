"""POSIX shared-memory segments for CPU symmetric memory: create, map, unlink, clean up, on a shared host.

Segments live in a private folder of this user, ``<OVERLAP_SHM_DIR>/overlap-<uid>`` (mode 0700, owned by this
user, never a symlink: `private_dir` checks it and refuses anything else), named
``<run id>-<pid namespace>-<creator pid>-<kind>-r<rank>``. The run id is 128 random bits agreed through the
store (`overlap.symm.heap`), so no other job can foresee a name, and no other user can create, open or remove one.
`overlap.symm` creates one segment per rank, every peer maps it, then its creator unlinks it at once: the
mappings live on, the folder holds nothing.

Creating and attaching go through file descriptors: a create is exclusive (``O_EXCL | O_NOFOLLOW``) and records
the file's (device, inode); an attach never creates, never follows a symlink, and maps the descriptor only after
`fstat` shows a regular file of this user, mode 0600 and exactly the expected size. An unlink removes a name only
while it is still the file this process created (same device and inode).

A segment survives only if its creator dies inside the create-to-unlink window. Then: SIGTERM or SIGHUP to a
process that created segments unlinks them before the previous handler runs (`install_signal_handlers`, chained);
a peer seen dead during set-up has its segments removed (`remove_segments`; by the signal handler too where the
job is torn down first: `watching`); the parent of killed local ranks
removes theirs (`remove_segments_of`); `remove_stale_segments` removes, at the next heap creation, segments of
this user whose creator is provably dead (same pid namespace, pid gone, older than a minute).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import mmap
import os
import re
import signal
import stat
import threading
import time

import torch

from . import envs
from .errors import OverlapError

log = logging.getLogger("overlap")

_NAME_RE = re.compile(r"^(?P<run>[0-9a-f]{32})-(?P<ns>\d{1,20})-(?P<pid>\d{1,10})-(?P<kind>[a-z0-9]{1,16})"
                      r"-r(?P<rank>\d{1,6})$")
#: a run id: 128 random bits, as lower-case hex (`new_run_id`)
RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """The parts of a segment's name."""

    run: str
    pid_ns: int
    pid: int
    kind: str
    rank: int

    def __str__(self) -> str:
        return f"{self.run}-{self.pid_ns}-{self.pid}-{self.kind}-r{self.rank}"

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        m = _NAME_RE.match(name)
        if m is None:
            return None
        return cls(m["run"], int(m["ns"]), int(m["pid"]), m["kind"], int(m["rank"]))


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(16)


def pid_namespace() -> int:
    """An identity of this process's pid namespace (the inode of ``/proc/self/ns/pid``; 0 where unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(run: str, pid_ns: int, pid: int, kind: str, rank: int) -> str:
    """The name of a segment; raises ValueError where a part would not make a well-formed name (the parts come
    from peers, through the store: nothing unchecked enters a path)."""
    name = str(SegmentName(run, pid_ns, pid, kind, rank))
    if _NAME_RE.match(name) is None or not (0 <= pid_ns < 2**64 and 0 < pid < 2**31 and 0 <= rank < 10**6):
        raise ValueError(f"overlap: not a valid segment name: {name!r}")
    return name


# ----------------------------------------------------------------------------------------------
# The private folder
# ----------------------------------------------------------------------------------------------


def private_dir(base: str | None = None) -> str:
    """``<base>/overlap-<uid>`` (base: OVERLAP_SHM_DIR), created mode 0700 where missing. Raises OSError naming
    OVERLAP_SHM_DIR where that is no folder this user can write (`envs.checked_shm_dir`), `OverlapError` where the
    private folder is not a real folder owned by this user (a symlink, a file, another user's)."""
    path = _dir_path(base or envs.checked_shm_dir())
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = _open_dir(path)
    os.close(fd)
    return path


def _dir_path(base: str | None = None) -> str:
    return os.path.join(base or envs.shm_dir(), f"overlap-{os.geteuid()}")


def _open_dir(path: str) -> int:
    """A descriptor of the private folder `path`, after checking it (see `private_dir`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        kind = "a symlink or not a folder" if os.path.islink(path) or os.path.exists(path) else "missing"
        raise OverlapError(f"overlap: the shared-memory folder {path} is {kind} ({exc.strerror}); remove it, or "
                           "point OVERLAP_SHM_DIR at a folder of this host's tmpfs that you can write") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise OverlapError(f"overlap: the shared-memory folder {path} belongs to user {st.st_uid}, not to this "
                           f"user ({os.geteuid()}): someone else created it; remove it, or set OVERLAP_SHM_DIR")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # ours, but created with a strange umask: nobody else may enter it
    return fd


# ----------------------------------------------------------------------------------------------
# Create, attach, unlink
# ----------------------------------------------------------------------------------------------

#: name -> (device, inode) of each segment this process created and has not unlinked yet
CREATED: dict[str, tuple[int, int]] = {}
_CREATED_LOCK = threading.Lock()


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a shared mapping of `fd`'s first `nbytes` bytes (the mapping outlives `fd`)."""
    return torch.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                            dtype=torch.uint8)


def create_segment(name: str, nbytes: int) -> torch.Tensor:
    """Create segment `name` of `nbytes` bytes in the private folder (exclusively: an existing name is an error)
    and map it. The name is recorded for `unlink` with its device and inode once the create succeeded."""
    install_signal_handlers()
    directory = private_dir()
    dfd = _open_dir(directory)
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    except FileExistsError:
        raise OverlapError(f"overlap: shared memory segment {name} exists already in {directory}; another job "
                           "created it (run ids are random: this is no accident)") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        with _CREATED_LOCK:
            CREATED[name] = (st.st_dev, st.st_ino)
        os.fchmod(fd, 0o600)  # (whatever the umask)
        try:
            # Reserve the pages now: on tmpfs a sparse file "succeeds" and the first write past the free space
            # kills the process with SIGBUS instead.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            unlink(name)
            raise OSError(exc.errno, f"overlap: cannot reserve {nbytes} bytes of shared memory in {directory} "
                          f"({exc.strerror}); free space there, point OVERLAP_SHM_DIR at a larger tmpfs, or give "
                          "the container a larger /dev/shm") from None
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def attach_segment(name: str, nbytes: int) -> torch.Tensor:
    """Map a peer's segment `name`, which must be a regular file of this user, mode 0600, of exactly `nbytes`
    bytes (never created, never followed through a symlink, never extended)."""
    directory = _dir_path()
    if not os.path.isdir(directory):
        raise _missing(name)
    dfd = _open_dir(directory)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise _missing(name) from None
    except OSError as exc:
        raise OverlapError(f"overlap: cannot open the shared memory segment {name} of a peer in {directory} "
                           f"({exc.strerror}): not a file of this job") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        problems = []
        if not stat.S_ISREG(st.st_mode):
            problems.append("not a regular file")
        if st.st_uid != os.geteuid():
            problems.append(f"owned by user {st.st_uid}, not {os.geteuid()}")
        if stat.S_IMODE(st.st_mode) != 0o600:
            problems.append(f"mode {stat.S_IMODE(st.st_mode):o}, not 600")
        if st.st_size != nbytes:
            problems.append(f"{st.st_size} bytes, not {nbytes}")
        if problems:
            raise OverlapError(f"overlap: refusing the shared memory segment {name} in {directory}: "
                               f"{', '.join(problems)}; it is not the segment a peer of this job created")
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def _missing(name: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"overlap: shared memory segment {name} of a peer is missing; ranks of one group must share "
        f"{envs.shm_dir()} and run as one user (set OVERLAP_NODE_ID per node if two nodes share a hostname)")


def unlink(name: str) -> None:
    """Unlink segment `name` if it is still the file this process created (same device and inode); forget it.
    Never raises: it runs in signal handlers and the threads that end a process."""
    with _CREATED_LOCK:
        ident = CREATED.pop(name, None)
    if ident is None:
        return
    try:
        directory = _dir_path()
        st = os.lstat(os.path.join(directory, name))
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(os.path.join(directory, name))
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - never kill the thread or handler that ends the process
        with contextlib.suppress(Exception):
            log.debug("overlap: could not unlink segment %s: %s", name, exc)


@atexit.register
def unlink_created() -> None:
    """Unlink every segment this process created and has not unlinked yet (at exit, on SIGTERM or SIGHUP, or
    when a rank is ended: `overlap.lifetime`). Never raises."""
    for name in list(CREATED):
        unlink(name)


# ----------------------------------------------------------------------------------------------
# Cleaning up after others of this job
# ----------------------------------------------------------------------------------------------


def segment_names(base: str | None = None) -> list[SegmentName]:
    """The segments in this user's private folder under `base` (default OVERLAP_SHM_DIR), parsed; names of
    another form are left out."""
    try:
        names = os.listdir(_dir_path(base))
    except OSError:
        return []
    return [n for n in map(SegmentName.parse, names) if n is not None]


def _remove(base: str | None, wanted) -> list[str]:
    """Unlink the segments of this user's private folder for which `wanted(SegmentName)` holds (regular files of
    this user only); returns the removed names."""
    directory = _dir_path(base)
    removed = []
    for seg in segment_names(base):
        if not wanted(seg):
            continue
        path = os.path.join(directory, str(seg))
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(str(seg))
        except OSError:
            pass
    return removed


def remove_segments(names, base: str | None = None) -> list[str]:
    """Unlink the segments `names` of this job's run (a peer that died during set-up left them)."""
    wanted = set(names)
    return _remove(base, lambda seg: str(seg) in wanted)


def remove_segments_of(pids, base: str | None = None) -> list[str]:
    """Remove the segments created by the processes `pids` of this pid namespace (local ranks that ended: a
    rank killed by SIGKILL leaves the segments it had not unlinked yet). Returns the removed names."""
    wanted, ns = {int(p) for p in pids}, pid_namespace()
    return _remove(base, lambda seg: seg.pid in wanted and seg.pid_ns == ns)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_segments(base: str | None = None, min_age_s: float = 60.0) -> list[str]:
    """Remove segments of this user whose creator is provably dead: created in this pid namespace, its pid gone,
    and older than `min_age_s` (a segment lives for a moment only). Called at every heap creation; returns the
    removed names. A segment of another pid namespace (another container sharing the folder) is never touched."""
    ns, now, directory = pid_namespace(), time.time(), _dir_path(base)

    def stale(seg: SegmentName) -> bool:
        if seg.pid_ns != ns or ns == 0 or _pid_alive(seg.pid):
            return False
        try:
            return now - os.lstat(os.path.join(directory, str(seg))).st_mtime >= min_age_s
        except OSError:
            return False

    return _remove(base, stale)


#: name -> creator pid of peers' segments this process is setting up with (`watching`)
_WATCHED: dict[str, int] = {}


@contextlib.contextmanager
def watching(peers: dict[str, int]):
    """While the block runs, an ending signal to this process (SIGTERM, SIGHUP) also removes those of the peers'
    segments `peers` (name -> creator pid, of this pid namespace) whose creator is gone: a job torn down because
    one rank died in a heap's set-up (torchrun ends the others with SIGTERM) leaves nothing behind."""
    _WATCHED.update(peers)
    try:
        yield
    finally:
        for name in peers:
            _WATCHED.pop(name, None)


def remove_dead_watched() -> list[str]:
    """Remove the watched segments whose creator is gone (`watching`). Never raises."""
    try:
        dead = {name for name, pid in list(_WATCHED.items()) if not _pid_alive(pid)}
        return remove_segments(dead) if dead else []
    except Exception:  # noqa: BLE001 - it runs in signal handlers
        return []


# ----------------------------------------------------------------------------------------------
# SIGTERM and SIGHUP
# ----------------------------------------------------------------------------------------------

_ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
_PREVIOUS: dict[int, object] = {}


def _on_ending_signal(signum: int, frame) -> None:
    """Unlink this process's segments (and the watched ones of dead peers), then do what the previous handler did
    (default: end by the signal)."""
    unlink_created()
    remove_dead_watched()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP unlink this process's segments, then go on to the handlers they had (chained; once
    per process; main thread only: elsewhere `atexit` and the parent's cleanup remain)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _ENDING_SIGNALS:
        current = signal.getsignal(signum)
        if current is _on_ending_signal:
            continue
        _PREVIOUS[signum] = current if current is not None else signal.SIG_DFL
        signal.signal(signum, _on_ending_signal)
