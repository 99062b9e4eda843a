"""Running the project's scripts (``bench/gpu_check.py`` and its kin) as subprocesses in tests: a clean
environment (no ``OUT``, ``TRITON_INTERPRET`` or ``OVERLAP_GPU_TEST_HOOK`` leaking in from the caller), always
with a timeout, so a script that hangs fails its test instead of the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(args: list[str], timeout: float, cwd: Path = ROOT, **env_extra: str) -> subprocess.CompletedProcess:
    """``python *args`` from `cwd` (default: the repository's root) with `env_extra` set; raises TimeoutExpired past
    `timeout`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET", "OVERLAP_GPU_TEST_HOOK",
                                                                 "OVERLAP_GPU_RECORD")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(env_extra)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
