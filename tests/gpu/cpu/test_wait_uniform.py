"""Tier 3: the CUDA kernels of ``csrc/`` (``overlap._C``), read as nvcc's PTX for sm_90a without a GPU, have no
branch that could take different warps past different barriers (a loop's exit, a wait that gives up: the
analysis of `tests.support.ptx_flow`, which tests/gpu/cpu/test_kernels_aot.py runs on the Triton kernels), and the one
per-thread wait primitive (``overlap::cuda::wait_flag_geq_bounded``: each caller's own clock and load decide)
runs in one thread only. A kernel that calls it from every thread of a CTA, around a barrier, is what the
analysis finds."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.ptx_flow import divergent_barriers

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
PER_THREAD_WAIT = "wait_flag_geq_bounded"

# Every thread waits for its own flag, then all meet at a barrier: a thread whose wait gives up leaves the
# loop while the others wait at __syncthreads (a hang, or undefined behaviour).
PER_THREAD_SAMPLE = r"""
#include "overlap/cuda_signal.cuh"
__global__ void per_thread_waits(const int32_t* flags, int32_t* err, int32_t* out) {
  __shared__ int32_t seen[256];
  for (int i = 0; i < 8; ++i) {
    if (!overlap::cuda::wait_flag_geq_bounded(flags + i, i, 1000000, err)) break;
    seen[threadIdx.x] = i;
    __syncthreads();
    out[threadIdx.x] += seen[(threadIdx.x + 1) % blockDim.x];
    __syncthreads();
  }
}
"""


def _ptx(tmp_path: Path, source: Path) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    out = tmp_path / (source.stem + ".ptx")
    cmd = [nvcc, "-arch=sm_90a", "-ptx", "-I", str(ROOT / "csrc" / "include"), "-I", str(ROOT / "csrc"),
           str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out.read_text()


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_no_cuda_kernel_branches_around_a_barrier_per_thread(tmp_path, source):
    found = divergent_barriers(_ptx(tmp_path, source))
    assert not found, f"{source.name}: branches around a barrier on a per-thread predicate: {found}"


def test_the_analysis_finds_per_thread_waits_around_a_barrier(tmp_path):
    sample = tmp_path / "per_thread_waits.cu"
    sample.write_text(PER_THREAD_SAMPLE)
    found = divergent_barriers(_ptx(tmp_path, sample))
    assert {"%globaltimer", "ld.acquire.sys.global"} <= {s for d in found for s in d.sources}, found


def test_the_per_thread_wait_runs_in_one_thread():
    """Every kernel that calls the per-thread wait is launched with one block of one thread."""
    callers = set()
    for path in sorted((ROOT / "csrc").rglob("*.cu")):
        text = path.read_text()
        for kernel in re.findall(r"__global__\s+void\s+(\w+)\s*\(", text):
            body = text[text.index(kernel):]
            body = body[: body.find("\n}") + 2]
            if f"{PER_THREAD_WAIT}(" in body:
                callers.add((path, kernel))
    assert callers, f"no kernel calls {PER_THREAD_WAIT}: update this test"
    for path, kernel in callers:
        launches = re.findall(rf"{kernel}\s*<<<(.*?)>>>", path.read_text(), re.DOTALL)
        assert launches, f"{path.name}: {kernel} is never launched here"
        for config in launches:
            grid, block = (part.strip() for part in config.split(",")[:2])
            assert (grid, block) == ("1", "1"), f"{path.name}: {kernel}<<<{config}>>> runs the wait in many threads"
