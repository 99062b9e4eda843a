"""Shared fixtures: rank pools per world size, a check that /dev/shm is left clean, the hypothesis profile."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, settings

from tests.support.harness import RankPool

# No property test depends on the machine's speed: hypothesis's per-example deadline and its "too slow"
# health check are timings taken during the test, so they are off for every test (a test's own settings
# inherit this profile).
settings.register_profile("overlap", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("overlap")

_POOLS: dict[int, RankPool] = {}

# What decides which CPU kernels torch runs: a failure report names them (CI's second pass of the `exact` tests
# sets all three to AVX2).
_ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def pytest_report_header(config) -> str:
    import torch

    settings = ", ".join(f"{name}={os.environ[name]}" for name in _ISA_SETTINGS if name in os.environ) or "none set"
    return (f"torch {torch.__version__}: CPU kernels {torch.backends.cpu.get_cpu_capability()} "
            f"(ISA settings: {settings})")


@pytest.fixture(scope="session")
def pools():
    """``pools(world_size)`` -> a live `RankPool`, reused across tests, replaced when broken."""

    def get(world_size: int) -> RankPool:
        pool = _POOLS.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = _POOLS[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(scope="session")
def aot_report() -> list[dict]:
    """overlap's Triton kernels compiled ahead of time for sm_90, as their launchers launch them: one compile run (a
    subprocess: TRITON_INTERPRET=0 before the kernels are defined) for the whole session
    (`tests.support.aot_compile`; used by tests/gpu/cpu/test_kernels_aot.py and tests/protocol)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.support.aot_compile"], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test, printed so a failure can be replayed (OVERLAP_TEST_SEED fixes it)."""
    value = int(os.environ.get("OVERLAP_TEST_SEED", random.randrange(2**31)))
    print(f"[seed] {request.node.nodeid}: OVERLAP_TEST_SEED={value}")
    return value


def _our_segments() -> list[str]:
    from overlap.shm import segment_names

    return sorted(str(n) for n in segment_names())


@pytest.fixture(scope="session", autouse=True)
def shm_left_clean(pools):
    """After the suite (pools closed, killed ranks included), /dev/shm holds no segment of ours."""
    before = set(_our_segments())
    yield
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    left = sorted(set(_our_segments()) - before)
    if left:  # clean up for the next run, but still fail: nothing may be left behind
        from overlap.shm import remove_stale_segments

        remove_stale_segments(min_age_s=0)
    assert not left, f"shared-memory segments left behind: {left}"
