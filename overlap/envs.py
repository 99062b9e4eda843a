"""Every environment variable `overlap` reads, in one place.

The README's environment table lists the same names (`tests/cli/test_facts.py` compares them); the build-time
ones are read by ``setup.py``, torchrun's (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ...) by `overlap.world`.
Values are read when asked for (not at import), so tests and launchers can set them late.
"""

from __future__ import annotations

import errno
import math
import os

#: the longest deadline `timeout_s` and `resolve_timeout` accept, in seconds (7 days): a wait longer than a
#: week is no deadline, and larger numbers overflow the waits' timers
MAX_TIMEOUT_S = 7 * 24 * 3600.0

#: the levels OVERLAP_LOG takes (any case); another value warns once and leaves the default, warning
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: the words of a yes/no variable (any case, blanks around them ignored; empty: the variable's default)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

#: the values Triton reads as on in TRITON_INTERPRET, in any case, with no blanks around them; any other value
#: (``0``, ``off``, ``banana``, empty) is off. Triton 3.9's rule (`triton.knobs.env_bool`: ``getenv_bool`` of
#: ``triton._C.libtriton``). `triton_interpret` asks the installed Triton's reader itself, so that what
#: `overlap info` says is what Triton does; this rule where Triton is not installed.
TRITON_TRUE_WORDS = ("1", "true", "on", "yes", "y")

#: name -> (default, meaning): every variable the user may set; the README's table has one row per name.
VARIABLES: dict[str, tuple[str, str]] = {
    "OVERLAP_TIMEOUT_S": ("300", "deadline in seconds of every wait on a peer, at most 7 days (per-call `timeout=` "
                                 "wins)"),
    "OVERLAP_LOG": ("warning", "log level of the `overlap` logger: debug, info (plans and fallbacks), warning, error, "
                               "critical; another value warns once and leaves warning"),
    "OVERLAP_NETWORK_TIMEOUT_S": ("", "deadline in seconds of the waits on a peer on another node (`hierarchical`'s "
                                      "messages), at most 7 days; empty: the call's deadline"),
    "OVERLAP_NODE_ID": ("", "node identity of this rank; overrides torchrun's GROUP_RANK and the hostname"),
    "OVERLAP_PLAN": ("", "path of a plan file written by `overlap tune`; `auto` looks calls up in it"),
    "OVERLAP_CACHE_DIR": ("$XDG_CACHE_HOME/overlap, else ~/.cache/overlap",
                          "where `overlap info --probe` / `overlap tune` cache machine profiles (XDG_CACHE_HOME "
                          "counts where it is an absolute path)"),
    "OVERLAP_CHECK_EVERY_CALL": ("0", "1 (or true, yes, on): every call runs the full cross-rank handshake (no steady "
                                      "state, no reference call going ahead); 0, false, no, off: not"),
    "OVERLAP_SHM_DIR": ("/dev/shm", "where CPU symmetric memory segments are created, in a private folder "
                                    "overlap-<uid> (then unlinked at once)"),
    "OVERLAP_BUILD_CUDA": ("1", "build time: 0 skips the CUDA half of overlap._C even where nvcc exists"),
    "MAX_JOBS": ("2", "build time: parallel compile jobs of overlap._C"),
    "CMAKE_ARGS": ("", "build time: extra arguments for CMake's configure step"),
    "TRITON_INTERPRET": ("", "set to 1 by overlap before its kernels are imported when no GPU exists and it is unset "
                             "or empty; Triton reads 1, true, on, yes, y (any case) as on, anything else as off"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("", "read, never set, by overlap: GPU ranks warn once where it is not 1"),
}


def _get(name: str) -> str:
    value = os.environ.get(name, "")
    return value if value != "" else VARIABLES[name][0]


def _seconds_ok(value: float) -> bool:
    return math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S


def _bad(name: str, raw: str, what: str, fix: str) -> str:
    """The message of a bad variable: ``NAME='raw': what is wrong; the fix`` (one line: the command line prints it
    as it is, after ``overlap <command>: ``)."""
    return f"{name}={raw!r}: {what}; {fix}"


def timeout_s() -> float:
    """OVERLAP_TIMEOUT_S in seconds (default 300); ValueError naming it for anything but a finite number in
    (0, `MAX_TIMEOUT_S`]."""
    raw = _get("OVERLAP_TIMEOUT_S")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not _seconds_ok(value):
        raise ValueError(_bad("OVERLAP_TIMEOUT_S", raw, f"not a finite number of seconds > 0 and at most "
                              f"{MAX_TIMEOUT_S:g} (7 days)", "set one, or unset it for the default (300)"))
    return value


def resolve_timeout(timeout: float | None) -> float:
    """The deadline of a call in seconds: `timeout` (a finite number > 0, at most `MAX_TIMEOUT_S`: 7 days) or,
    where None, OVERLAP_TIMEOUT_S.

    Raises ValueError for anything else (a bool, a string, zero, a negative number, nan, inf, more than 7 days)
    or a bad variable."""
    if timeout is None:
        return timeout_s()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not _seconds_ok(timeout):
        raise ValueError(f"timeout must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:g} (7 days), "
                         f"or None, got {timeout!r}")
    return float(timeout)


def network_timeout_s(call_timeout: float) -> float:
    """The deadline of a wait on a peer on another node: OVERLAP_NETWORK_TIMEOUT_S where set (a network may stall
    longer, or should be given up on sooner, than a peer of the node), else `call_timeout`. ValueError naming the
    variable for anything but a finite number in (0, `MAX_TIMEOUT_S`]."""
    raw = os.environ.get("OVERLAP_NETWORK_TIMEOUT_S", "").strip()
    if not raw:
        return call_timeout
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not _seconds_ok(value):
        raise ValueError(_bad("OVERLAP_NETWORK_TIMEOUT_S", raw, f"not a finite number of seconds > 0 and at most "
                              f"{MAX_TIMEOUT_S:g} (7 days)", "set one, or unset it (then a call's own deadline)"))
    return value


def log_level() -> str:
    """OVERLAP_LOG as a `logging` level name (``WARNING`` by default); ValueError naming the variable and the
    accepted values (`LOG_LEVELS`) for another value (`overlap.logs.configure` warns and keeps the default)."""
    raw = _get("OVERLAP_LOG")
    value = raw.strip().lower() or VARIABLES["OVERLAP_LOG"][0]
    if value not in LOG_LEVELS:
        raise ValueError(f"OVERLAP_LOG must be one of {', '.join(LOG_LEVELS)} (any case), got {raw!r}")
    return value.upper()


def _flag(name: str) -> bool:
    """A yes/no variable: `TRUE_WORDS` or `FALSE_WORDS` (any case; empty or blank: its default); ValueError
    naming the variable for another value."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or VARIABLES[name][0]
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError(_bad(name, raw, f"neither on ({', '.join(TRUE_WORDS)}) nor off ({', '.join(FALSE_WORDS)}), "
                          "in any case", f"set one of those, or unset it for the default ({VARIABLES[name][0]})"))


def node_id() -> str:
    return os.environ.get("OVERLAP_NODE_ID", "")


def plan_path() -> str | None:
    """The plan file `auto` reads (OVERLAP_PLAN, ``~`` expanded), or None when unset."""
    value = os.environ.get("OVERLAP_PLAN", "").strip()
    return os.path.expanduser(value) if value else None


def cache_dir() -> str:
    """Where machine profiles are cached: OVERLAP_CACHE_DIR (``~`` expanded) where set, else
    ``$XDG_CACHE_HOME/overlap`` where XDG_CACHE_HOME is an absolute path (the XDG base directory spec ignores a
    relative one), else ``~/.cache/overlap``."""
    value = os.environ.get("OVERLAP_CACHE_DIR", "")
    if value:
        return os.path.expanduser(value)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "overlap")
    return os.path.join(os.path.expanduser("~"), ".cache", "overlap")


def checked_cache_dir(writable: bool = True) -> str:
    """`cache_dir`, checked before anything is measured for it: a folder, or missing where it can be created (its
    nearest existing parent a folder), and with `writable` one this user can write (or create). Raises OSError
    naming OVERLAP_CACHE_DIR (errno ENOTDIR or EACCES) otherwise: a profile probed for seconds that could then not
    be saved fails now, not after the probe."""
    path = cache_dir()
    problem = _folder_problem(path, create=True)
    if problem is not None and (writable or problem[0] != errno.EACCES):
        raise OSError(problem[0], _bad_folder("OVERLAP_CACHE_DIR", path, problem[1],
                                              "point OVERLAP_CACHE_DIR at a folder you can write"))
    return path


def check_every_call() -> bool:
    """OVERLAP_CHECK_EVERY_CALL on (`TRUE_WORDS`): no steady state; every call's signature is agreed by a full
    handshake. ValueError naming the variable for a value neither on nor off."""
    return _flag("OVERLAP_CHECK_EVERY_CALL")


def shm_dir() -> str:
    """OVERLAP_SHM_DIR, else ``/dev/shm``, as it is (`checked_shm_dir` checks it)."""
    return _get("OVERLAP_SHM_DIR")


def checked_shm_dir() -> str:
    """`shm_dir`, checked: an existing folder this user can write (or where this user's private folder
    ``overlap-<uid>`` exists already). Raises OSError naming OVERLAP_SHM_DIR (errno ENOENT, ENOTDIR or EACCES)
    otherwise, before any segment is made."""
    path = shm_dir()
    problem = _folder_problem(path, create=False)
    if problem is not None and not (problem[0] == errno.EACCES
                                    and os.path.isdir(os.path.join(path, f"overlap-{os.geteuid()}"))):
        raise OSError(problem[0], _bad_folder("OVERLAP_SHM_DIR", path, problem[1], "point OVERLAP_SHM_DIR at a folder "
                                              "of this host's tmpfs that you can write"))
    return path


def _folder_problem(path: str, create: bool) -> tuple[int, str] | None:
    """What keeps this user from using `path` as a folder, as (errno, words), or None. `create`: a missing folder
    will be made, so it only needs a nearest existing parent that is a folder this user can write."""
    if os.path.isdir(path):
        return None if os.access(path, os.W_OK | os.X_OK) else (errno.EACCES, "a folder you cannot write")
    if os.path.lexists(path):
        return errno.ENOTDIR, "not a folder"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):  # (the root exists)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return errno.ENOTDIR, f"not a folder ({parent} is a file)"
    if not create:
        return errno.ENOENT, "no such folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return errno.EACCES, f"missing, and {parent} is a folder you cannot write"
    return None


def _bad_folder(name: str, path: str, what: str, fix: str) -> str:
    """`_bad` for a folder variable: the folder it names, or its default where it is unset."""
    if os.environ.get(name, ""):
        return _bad(name, os.environ[name], what, fix)
    return f"{path} ({name} unset: the default): {what}; {fix}"


def check() -> None:
    """Read every variable that has a rule as the runtime reads it later, and raise the first error (one line
    naming the variable and the fix): ValueError for OVERLAP_TIMEOUT_S, OVERLAP_NETWORK_TIMEOUT_S and
    OVERLAP_CHECK_EVERY_CALL, OSError for OVERLAP_SHM_DIR (`checked_shm_dir`) and an OVERLAP_CACHE_DIR that is no
    folder (`checked_cache_dir`, writable or not). The command line calls it before any rank starts (exit 2).
    OVERLAP_LOG warns instead (`overlap.logs.configure`); OVERLAP_PLAN's file is checked where it is read
    (`overlap.plans.PlanFile.load`); TRITON_INTERPRET is Triton's (`triton_interpret`)."""
    timeout_s()
    network_timeout_s(1.0)
    check_every_call()
    checked_shm_dir()
    checked_cache_dir(writable=False)


def triton_interpret_set_by_user() -> bool:
    """Whether TRITON_INTERPRET holds a value (unset and empty are not: `set_triton_interpret` sets those to 1
    where no GPU exists)."""
    return os.environ.get("TRITON_INTERPRET", "") != ""


def triton_interpret() -> bool:
    """Whether Triton kernels defined from now on run in the interpreter: TRITON_INTERPRET read by the installed
    Triton's own ``getenv_bool``; without one, by its rule (`TRITON_TRUE_WORDS` in any case, nothing stripped: on;
    anything else, unset or empty: off)."""
    raw = os.environ.get("TRITON_INTERPRET", "")
    if raw == "":
        return False
    try:  # the installed Triton's own reader (3.6 and 3.9 alike), where it has one
        from triton._C.libtriton import getenv_bool
    except ImportError:
        return raw.isascii() and raw.lower() in TRITON_TRUE_WORDS
    return bool(getenv_bool("TRITON_INTERPRET", False))


def triton_interpret_off() -> str | None:
    """Where the user has set TRITON_INTERPRET to a value Triton reads as off (``0``, ``off``, ``banana``): why
    strategy ``fused`` cannot run without a GPU, as one line naming the value and the fix; else None."""
    raw = os.environ.get("TRITON_INTERPRET", "")
    if raw == "" or triton_interpret():
        return None
    return _bad("TRITON_INTERPRET", raw, f"Triton reads it as off (on: {', '.join(TRITON_TRUE_WORDS)}, any case), "
                "and strategy 'fused' runs in Triton's interpreter where no GPU exists",
                "unset it or set it to 1 for 'fused', or choose another strategy")


def set_triton_interpret() -> None:
    """Set TRITON_INTERPRET=1 where torch sees no GPU and the user has not set it (unset or empty; imports torch:
    call it where torch is needed anyway). `overlap` calls it before any of its Triton kernels is defined: on
    ``import overlap`` where torch is already imported, on first use of an op or module, and in
    ``overlap.kernels``' own import."""
    global TRITON_INTERPRET_SET_BY_OVERLAP
    if triton_interpret_set_by_user():
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        TRITON_INTERPRET_SET_BY_OVERLAP = True


def cuda_device_max_connections() -> int | None:
    """CUDA_DEVICE_MAX_CONNECTIONS as an int; None when unset or not an integer (the driver's default then)."""
    raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    try:
        return int(raw)
    except ValueError:
        return None


#: True when overlap (`set_triton_interpret`) set TRITON_INTERPRET itself (no GPU, not set by the user).
TRITON_INTERPRET_SET_BY_OVERLAP = False
