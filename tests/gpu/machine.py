"""The GPU machine's facts from ``nvidia-smi``: each GPU's name, driver and compute mode (`gpu_facts`), and why two
processes cannot share the first GPU (`compute_mode_problem`: a compute mode other than ``Default`` takes one
process at a time, so the tests that run the ops in two processes on one GPU skip, saying so).

Imports nothing of overlap or torch: the GPU check's preflight reads these facts before it installs anything.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

DEFAULT_COMPUTE_MODE = "Default"


def gpu_facts(run: Callable[[list[str]], str | None] | None = None) -> list[dict[str, str]]:
    """``[{"name", "driver", "compute_mode"}]`` per GPU from ``nvidia-smi`` (empty where it is missing or fails)."""
    run = run or _run
    out = run(["nvidia-smi", "--query-gpu=name,driver_version,compute_mode", "--format=csv,noheader"])
    gpus = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append(dict(zip(("name", "driver", "compute_mode"), parts)))
    return gpus


def compute_mode_problem(gpus: list[dict[str, str]]) -> str | None:
    """Why two processes cannot share the first GPU (its compute mode), or None."""
    if gpus and gpus[0]["compute_mode"] != DEFAULT_COMPUTE_MODE:
        return (f"the GPU's compute mode is {gpus[0]['compute_mode']} (not {DEFAULT_COMPUTE_MODE}): it takes one "
                "process at a time (nvidia-smi -c DEFAULT, as root, allows the two-process checks)")
    return None


def _run(cmd: list[str]) -> str | None:
    """`cmd`'s standard output, or None where it cannot start, fails or takes over 30 s."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None
