"""Every environment variable `overlap` reads, in one place.

The README's environment table lists the same names (`tests/cli/test_facts.py` compares them); the build-time
ones are read by ``setup.py``, torchrun's (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ...) by `overlap.world`.
Values are read when asked for (not at import), so tests and launchers can set them late.
"""

from __future__ import annotations

import os

#: name -> (default, meaning): every variable the user may set; the README's table has one row per name.
VARIABLES: dict[str, tuple[str, str]] = {
    "OVERLAP_TIMEOUT_S": ("300", "deadline in seconds of every wait on a peer (per-call `timeout=` wins)"),
    "OVERLAP_LOG": ("warning", "log level of the `overlap` logger: debug, info (plans and fallbacks), warning"),
    "OVERLAP_NODE_ID": ("", "node identity of this rank; overrides torchrun's GROUP_RANK and the hostname"),
    "OVERLAP_PLAN": ("", "path of a plan file written by `overlap tune`; `auto` looks calls up in it"),
    "OVERLAP_CACHE_DIR": ("~/.cache/overlap", "where `overlap info --probe` / `overlap tune` cache machine profiles"),
    "OVERLAP_CHECK_EVERY_CALL": ("0", "1: every call runs the full cross-rank handshake (no steady state, no "
                                      "reference call going ahead)"),
    "OVERLAP_SHM_DIR": ("/dev/shm", "where CPU symmetric memory segments are created (then unlinked at once)"),
    "OVERLAP_BUILD_CUDA": ("1", "build time: 0 skips the CUDA half of overlap._C even where nvcc exists"),
    "MAX_JOBS": ("2", "build time: parallel compile jobs of overlap._C"),
    "CMAKE_ARGS": ("", "build time: extra arguments for CMake's configure step"),
    "TRITON_INTERPRET": ("", "set to 1 by overlap before its kernels are imported when no GPU exists"),
    "CUDA_DEVICE_MAX_CONNECTIONS": ("", "read, never set, by overlap: GPU ranks warn once where it is not 1"),
}


def _get(name: str) -> str:
    value = os.environ.get(name, "")
    return value if value != "" else VARIABLES[name][0]


def timeout_s() -> float:
    raw = _get("OVERLAP_TIMEOUT_S")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"OVERLAP_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"OVERLAP_TIMEOUT_S must be > 0, got {value}")
    return value


def resolve_timeout(timeout: float | None) -> float:
    """The deadline of a call in seconds: `timeout` (a positive number) or, where None, OVERLAP_TIMEOUT_S.

    Raises ValueError for anything else (a bool, a string, zero, a negative number) or a bad variable."""
    if timeout is None:
        return timeout_s()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def log_level() -> str:
    return _get("OVERLAP_LOG").upper()


def node_id() -> str:
    return os.environ.get("OVERLAP_NODE_ID", "")


def plan_path() -> str | None:
    """The plan file `auto` reads (OVERLAP_PLAN, ``~`` expanded), or None when unset."""
    value = os.environ.get("OVERLAP_PLAN", "").strip()
    return os.path.expanduser(value) if value else None


def cache_dir() -> str:
    """Where machine profiles are cached (OVERLAP_CACHE_DIR, ``~`` expanded)."""
    return os.path.expanduser(_get("OVERLAP_CACHE_DIR"))


def check_every_call() -> bool:
    """OVERLAP_CHECK_EVERY_CALL=1: no steady state; every call's signature is agreed by a full handshake."""
    return _get("OVERLAP_CHECK_EVERY_CALL").strip() not in ("", "0")


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
