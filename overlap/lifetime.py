"""No local rank outlives the process that started it.

`overlap.world.launch` and `overlap.pool.RankPool` start rank processes. Whatever ends their parent, its
ranks end within about a second and leave nothing of theirs behind (shared-memory segments, the rendezvous
folder, the paths the parent named):

* **SIGINT, SIGTERM or SIGHUP to the parent** (Ctrl-C; an IDE's stop button; SLURM, Kubernetes and systemd
  send SIGTERM; a closed terminal SIGHUP). In the parent's main thread SIGINT raises KeyboardInterrupt as
  always, and while its ranks run (`raising_on_signals`) SIGTERM and SIGHUP raise `overlap.errors.Terminated`,
  where their handlers are the defaults: the parent's ``finally`` then ends its ranks with `stop` (SIGTERM;
  SIGKILL for a rank still there after `STOP_GRACE_S`; the segments the ranks created removed).
* **The parent's death, SIGKILL included.** Each rank watches its parent (`watch_parent`): on Linux the
  kernel sends the rank SIGTERM when the parent dies (``prctl(PR_SET_PDEATHSIG)``); everywhere a thread
  polls ``os.getppid()`` every `POLL_S`, which also covers a parent that died before the rank set its death
  signal. (The death signal follows the parent *thread* that started the rank: ranks are started from the
  thread that waits for them, which lives as long as they do.)
* **SIGTERM to a rank** (from `stop`, or the death signal): the rank unlinks the segments it created and the
  paths it was given, then exits at once with status 143. This runs on the watching thread, woken through
  `signal.set_wakeup_fd`, so a main thread blocked in a C call (a gloo wait) does not delay it; the
  Python-level handler does the same where the main thread gets there first. Buffered output is not
  flushed: another thread may hold the stream's lock.
* A rank ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the parent decides.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from . import shm
from .errors import Terminated

#: seconds between two looks at the parent pid by a rank's watching thread
POLL_S = 0.1
#: seconds `stop` leaves ranks to end after SIGTERM before it kills them
STOP_GRACE_S = 1.0
#: seconds `stop` waits for a killed rank to be reaped
_KILL_WAIT_S = 5.0

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# ----------------------------------------------------------------------------------------------
# In a rank
# ----------------------------------------------------------------------------------------------

_ending = threading.Lock()
_leftovers: list[str] = []


def _end(signum: int) -> None:
    """Unlink what this rank created and the leftover paths, then exit with ``128 + signum`` (never returns)."""
    _ending.acquire()  # the first caller ends the process; a second (the other thread) waits for it
    shm.unlink_created()
    for path in _leftovers:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    os._exit(128 + signum)


def _set_death_signal(signum: int) -> bool:
    """Ask Linux to send this process `signum` when its parent dies; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int, wakeup_fd: int) -> None:
    """The watching thread of a rank: end it when its parent is gone or SIGTERM arrives."""
    while True:
        if os.getppid() != parent_pid:  # reparented: the parent is gone
            _end(signal.SIGTERM)
        ready, _, _ = select.select([wakeup_fd], [], [], POLL_S)
        if ready and int(signal.SIGTERM) in os.read(wakeup_fd, 512):
            _end(signal.SIGTERM)


def watch_parent(parent_pid: int, leftovers: Iterable[str] = ()) -> None:
    """In a rank started by process `parent_pid`: end this process when SIGTERM arrives or the parent dies,
    after unlinking the segments it created and removing `leftovers` (files or folders); ignore SIGINT (see
    the module docstring). Call it from the rank's main thread, before anything else."""
    _leftovers[:] = list(leftovers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: _end(signum))
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _set_death_signal(signal.SIGTERM)
    threading.Thread(target=_watch, args=(parent_pid, read_fd), name="overlap-parent-watch", daemon=True).start()


def _poll_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    _end(signal.SIGTERM)


def end_with_parent(parent_pid: int) -> None:
    """In a rank of `overlap.pool.RankPool`, started by process `parent_pid`: when the parent is gone (killed,
    SIGKILL included), unlink the segments this rank created and exit, from a watching thread. Unlike
    `watch_parent` it leaves SIGTERM and SIGINT as they are (`overlap.shm` chains SIGTERM's cleanup)."""
    threading.Thread(target=_poll_parent, args=(parent_pid,), name="overlap-parent-watch", daemon=True).start()


# ----------------------------------------------------------------------------------------------
# In the parent
# ----------------------------------------------------------------------------------------------

_ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def raising_on_signals() -> Iterator[None]:
    """While the block runs: SIGTERM and SIGHUP raise `overlap.errors.Terminated` in the main thread, where
    their handlers are the defaults (which would end the process with no ``finally``, orphaning its ranks);
    the handlers are restored after. Outside the main thread nothing changes (handlers belong to it)."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _ENDING_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                installed[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block is over (main thread only), then are raised again:
    a second Ctrl-C does not interrupt `stop` half-way (it lasts at most a few seconds)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.signal(signum, lambda s, f: arrived.append(s))
                for signum in (signal.SIGINT, *_ENDING_SIGNALS)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def stop(procs: Sequence[Any], grace_s: float = STOP_GRACE_S) -> None:
    """End the ranks `procs` (`multiprocessing` processes; those never started are skipped) and return once
    every one has ended: SIGTERM, then SIGKILL for those still there after `grace_s` seconds; then remove
    the segments they created (a killed rank unlinks nothing). A no-op but for that removal where every rank
    has ended already."""
    started = [p for p in procs if p.pid is not None]
    with _signals_held():
        for p in started:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in started:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.exitcode is None:
                p.kill()
        for p in started:
            p.join(_KILL_WAIT_S)
        shm.remove_segments_of([p.pid for p in started])
