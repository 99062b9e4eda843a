"""Running the project's scripts (``python -m tests.gpu.check`` and its kin) as subprocesses in tests: a clean
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


def run_module(module: str, args: list[str], timeout: float, cwd: Path = ROOT,
               **env_extra: str) -> subprocess.CompletedProcess:
    """``python -m module *args`` as `run_script` runs a script, the repository's root on ``PYTHONPATH`` (so that
    `module`, e.g. ``tests.gpu.check``, imports from any `cwd`)."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), env_extra.pop("PYTHONPATH", os.environ.get("PYTHONPATH", "")))
                                 if p)
    return run_script(["-m", module, *args], timeout, cwd=cwd, PYTHONPATH=pythonpath, **env_extra)
