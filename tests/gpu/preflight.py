"""What the GPU check makes sure of before it installs anything: the machine's facts, and what would make the
install fail or build `overlap._C` without its CUDA half.

* **The GPU** (`gpu_facts`, tests/gpu/machine.py): ``nvidia-smi``'s name, driver and compute mode of each GPU. A
  compute mode other than ``Default`` refuses a second process on the device, so the two-process ops tests skip
  with that reason.
* **nvcc** (`find_nvcc`): CMake finds it only through ``CUDACXX``, ``PATH`` or ``CUDA_PATH``; one in
  ``CUDA_HOME`` or ``/usr/local/cuda`` alone would be missed and ``_C`` would build without CUDA, silently. The
  install's environment then names it in ``CUDACXX``; none at all on a GPU machine is a problem.
* **Python's headers** (``Python.h``, which the build of ``_C`` needs) and **a writable install target** (the
  editable install writes into the interpreter's site-packages, and the build into the checkout's ``build/``).

`preflight` returns the facts to log and the problems that stop the run before the install (exit status 2).
Imports nothing of overlap (it runs before the install).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

from tests.gpu.machine import compute_mode_problem, gpu_facts  # the GPU tests' facts of the machine

NVCC_PLACES = ("CUDA_HOME", "CUDA_PATH")  # environment variables naming a toolkit's root
NVCC_FALLBACK = "/usr/local/cuda"


@dataclasses.dataclass
class Preflight:
    facts: list[str]  # to log, one line each
    problems: list[str]  # each stops the run before the install
    env: dict[str, str]  # what the install's environment needs besides the run's (e.g. CUDACXX)
    compute_modes: list[str]  # per GPU, as nvidia-smi says it (empty without nvidia-smi)


def find_nvcc(env: dict[str, str], which: Callable[[str], str | None] = shutil.which) -> tuple[str | None, bool]:
    """``(path of nvcc or None, whether CMake finds it by itself)``: ``CUDACXX``, then ``PATH``, then
    ``CUDA_PATH`` are CMake's own ways; ``CUDA_HOME`` and ``/usr/local/cuda`` are not."""
    if env.get("CUDACXX"):
        return env["CUDACXX"], True
    on_path = which("nvcc")
    if on_path:
        return on_path, True
    for var in NVCC_PLACES:
        if env.get(var) and Path(env[var], "bin", "nvcc").is_file():
            return str(Path(env[var], "bin", "nvcc")), var == "CUDA_PATH"
    fallback = Path(NVCC_FALLBACK, "bin", "nvcc")
    return (str(fallback), False) if fallback.is_file() else (None, False)


def python_headers() -> Path:
    return Path(sysconfig.get_paths()["include"], "Python.h")


def install_target() -> Path:
    """Where the editable install writes (its finder and ``.pth`` file): the interpreter's site-packages."""
    return Path(sysconfig.get_paths()["purelib"])


def writable(path: Path, access: Callable[[Path, int], bool] = os.access) -> bool:
    """Whether `path`, or the nearest folder above it that exists, can be written."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return access(path, os.W_OK)


def preflight(env: dict[str, str], gpu: bool, root: Path, run: Callable[[list[str]], str | None] | None = None,
              which: Callable[[str], str | None] = shutil.which, headers: Path | None = None,
              target: Path | None = None, access: Callable[[Path, int], bool] = os.access) -> Preflight:
    """The checks above for a run on a GPU (`gpu`) or the CPU, from the checkout `root`."""
    facts, problems, extra = [], [], {}
    gpus = gpu_facts(run) if gpu else []
    for i, g in enumerate(gpus):
        facts.append(f"GPU {i}: {g['name']}, driver {g['driver']}, compute mode {g['compute_mode']}")
    if gpu and not gpus:
        facts.append("nvidia-smi gave no GPU facts (not found, or it failed)")
    if (why := compute_mode_problem(gpus)) is not None:
        facts.append(f"note: {why}; the two-process ops tests will skip")
    nvcc, found_by_cmake = find_nvcc(env, which)
    if nvcc is None:
        (problems if gpu else facts).append(
            "nvcc not found (CUDACXX, PATH, CUDA_PATH, CUDA_HOME, /usr/local/cuda): overlap._C would build without "
            "its CUDA half" + ("; set CUDACXX to the toolkit's nvcc" if gpu else ""))
    else:
        facts.append(f"nvcc: {nvcc}" + ("" if found_by_cmake else " (not where CMake looks: CUDACXX set for the "
                                                                  "install)"))
        if not found_by_cmake:
            extra["CUDACXX"] = nvcc
    headers = headers or python_headers()
    if not headers.is_file():
        problems.append(f"Python's headers are missing ({headers}): the build of overlap._C needs them (install "
                        "the python3-dev package of this Python)")
    target = target or install_target()
    for what, path in (("the install target (site-packages)", target), ("the build folder", root / "build")):
        if not writable(path, access):
            problems.append(f"{what} {path} is not writable: run from a virtual environment or a writable checkout")
    return Preflight(facts, problems, extra, [g["compute_mode"] for g in gpus])
