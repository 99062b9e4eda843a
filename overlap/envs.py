"""Every environment variable `overlap` reads, in one place.

The README's environment table lists the same names (`tests/cli/test_facts.py` compares them); the build-time
ones are read by ``setup.py``, torchrun's (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ...) by `overlap.world`.
Values are read when asked for (not at import), so tests and launchers can set them late.
"""

from __future__ import annotations

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
    "TRITON_INTERPRET": ("", "set to 1 by overlap before its kernels are imported when no GPU exists"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("", "read, never set, by overlap: GPU ranks warn once where it is not 1"),
}


def _get(name: str) -> str:
    value = os.environ.get(name, "")
    return value if value != "" else VARIABLES[name][0]


def _seconds_ok(value: float) -> bool:
    return math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S


def timeout_s() -> float:
    """OVERLAP_TIMEOUT_S in seconds (default 300); ValueError naming it for anything but a finite number in
    (0, `MAX_TIMEOUT_S`]."""
    raw = _get("OVERLAP_TIMEOUT_S")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"OVERLAP_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if not _seconds_ok(value):
        raise ValueError(f"OVERLAP_TIMEOUT_S must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:g} "
                         f"(7 days), got {raw!r}")
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
        raise ValueError(f"OVERLAP_NETWORK_TIMEOUT_S must be a finite number of seconds > 0 and at most "
                         f"{MAX_TIMEOUT_S:g} (7 days), got {raw!r}")
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
    raise ValueError(f"{name} must be one of {', '.join(TRUE_WORDS)} (on) or {', '.join(FALSE_WORDS)} (off), any "
                     f"case, got {raw!r}")


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


def check_every_call() -> bool:
    """OVERLAP_CHECK_EVERY_CALL on (`TRUE_WORDS`): no steady state; every call's signature is agreed by a full
    handshake. ValueError naming the variable for a value neither on nor off."""
    return _flag("OVERLAP_CHECK_EVERY_CALL")


def shm_dir() -> str:
    return _get("OVERLAP_SHM_DIR")


def triton_interpret_set_by_user() -> bool:
    return "TRITON_INTERPRET" in os.environ


def triton_interpret() -> bool:
    """Whether Triton kernels defined from now on run in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no")


def set_triton_interpret() -> None:
    """Set TRITON_INTERPRET=1 where torch sees no GPU and the user has not set it (imports torch: call it
    where torch is needed anyway). `overlap` calls it before any of its Triton kernels is defined: on
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
