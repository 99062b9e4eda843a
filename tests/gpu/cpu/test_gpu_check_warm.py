"""The GPU check's warm stage (`tests.gpu.warm`) on the CPU: every GPU-sized case of the kernel tests and every timing
is enumerated, each distinct variant compiles ahead of time for sm_90 into the Triton cache it is given, and a fresh
process compiling one of them again finds it there (the cache key does not depend on the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import moe_ranks, test_all_gather_kernels, test_reduce_scatter_kernels, timings
from tests.gpu.tp_ranks import GPU

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
KERNELS = {"all_gather_matmul_kernel", "all_gather_weight_matmul_kernel", "matmul_scatter_kernel",
           "reduce_chunks_kernel", "grouped_matmul_wait_kernel", "grouped_matmul_scatter_kernel", "_occupy"}


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), TRITON_DEFAULT_FP_FUSION="1", CUDA_VISIBLE_DEVICES="")
    return env


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> tuple[dict, Path]:
    """One warm stage, no deadline, two processes, into a cache of its own."""
    tmp = tmp_path_factory.mktemp("warm")
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.warm", "--out", str(tmp / "warm.json"), "--jobs", "2"],
                          cwd=ROOT, env=_env(tmp / "cache"), capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((tmp / "warm.json").read_text()), tmp / "cache"


def _gpu_cases(cases) -> int:
    return sum(1 for c in cases if c[0] == GPU)


def test_every_gpu_case_and_timing_is_enumerated(warmed):
    doc, _ = warmed
    labels = doc["launches"]
    count = {prefix: sum(label.startswith(prefix) for label in labels) for prefix in (
        "all-gather ordered", "all-gather runs", "weight all-gather", "all-gather racing", "timing: all-gather",
        "timing: MoE dispatch", "timing: MoE combine")}
    ag = test_all_gather_kernels
    assert count["all-gather ordered"] == _gpu_cases(ag.ORDERED) and count["all-gather runs"] == _gpu_cases(ag.RUNS)
    assert count["weight all-gather"] == _gpu_cases(ag.WEIGHT_ORDERED) and \
        count["all-gather racing"] == _gpu_cases(ag.RACING)
    rs = test_reduce_scatter_kernels
    for cases, what in ((rs.ORDERED, "ordered"), (rs.RUNS, "runs"), (rs.RACING, "racing")):
        assert sum(f" {what} " in label and label.split()[0] in ("rs", "ar1", "ar2") for label in labels) == \
            _gpu_cases(cases), what
    moe = len(moe_ranks.ORDERED) + 2  # the ordered routings, the racing one and the timeout one
    assert sum(label.startswith("MoE ") and " dispatch " in label for label in labels) == moe
    assert sum(label.startswith("MoE ") and " combine " in label for label in labels) == moe
    shapes = timings.tp_shapes()
    assert count["timing: all-gather"] == len(shapes["ag"])
    assert count["timing: MoE dispatch"] == count["timing: MoE combine"] == len(timings.MOE_TIMED)
    used = {label for v in doc["variants"] for label in v["used_by"]}
    assert used == set(labels), set(labels) ^ used  # every launch recorded a variant


def test_every_variant_compiles_ahead_of_time_for_sm90_once(warmed):
    doc, cache = warmed
    assert doc["arch"] == "sm_90" and not doc["native"] and doc["complete"], {k: v for k, v in doc.items()
                                                                                if k != "variants"}
    assert {v["kernel"] for v in doc["variants"]} == KERNELS
    assert [v["status"] for v in doc["variants"]] == ["compiled"] * len(doc["variants"]), doc["variants"]
    keys = [(v["kernel"], v["key"]) for v in doc["variants"]]
    assert len(set(keys)) == len(keys), keys  # one compile per key
    # the timings' tiles are variants of their own (a tile is a compile-time constant)
    ag = {(v["tile"]["BLOCK_M"], v["tile"]["BLOCK_N"], v["num_warps"]) for v in doc["variants"]
          if v["kernel"] == "all_gather_matmul_kernel"}
    assert {(t.block_m, t.block_n, t.num_warps) for t in timings.AG_TILES} <= ag, ag
    assert len(list(cache.iterdir())) == len(doc["variants"]), sorted(p.name for p in cache.iterdir())


def test_a_fresh_process_finds_a_warmed_variant_in_the_cache(warmed):
    """Compiling the first variant again in a new process writes nothing new: its cache key is the warm stage's."""
    doc, cache = warmed
    before = sorted(p.name for p in cache.iterdir())
    code = ("from tests.gpu import warm\n"
            "from triton.backends.nvidia.compiler import CUDABackend\n"
            "v, _ = next(warm.variants(CUDABackend(warm.TARGET)))\n"
            "status, _ = warm.compile_variant(v, warm.TARGET)\n"
            "print(v.kernel, v.key, status)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(cache), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernel, key, status = proc.stdout.split()[-3:]
    assert (kernel, key, status) == (doc["variants"][0]["kernel"], doc["variants"][0]["key"], "compiled")
    assert sorted(p.name for p in cache.iterdir()) == before
