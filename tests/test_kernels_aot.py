"""Tier 3: the Triton kernels compile ahead of time for Hopper (sm_90) with no GPU, GEMMs on wgmma."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_ag_matmul_compiles_for_sm90_with_wgmma():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("aot_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert {r["dtype"] for r in report} == {"bf16", "fp16", "fp32"}
    for r in report:
        assert r["wgmma"], f"no wgmma in the PTX of {r}"
        assert r["globaltimer"], f"the bounded wait does not read %globaltimer: {r}"
        assert r["acquire"] and r["sys_scope"], f"the flag load is not a system-scope acquire: {r}"
        assert r["cubin_bytes"] > 0, r
