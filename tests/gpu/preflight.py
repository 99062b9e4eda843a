"""What the GPU check makes sure of before it installs anything: the machine's facts, and what would make the
install fail or build `overlap._C` without its CUDA half.

* **The GPU** (`gpu_facts`, tests/gpu/machine.py): ``nvidia-smi``'s name, driver and compute mode of each GPU. A
  compute mode other than ``Default`` refuses a second process on the device, so the two-process ops tests skip
  with that reason.
* **nvcc** (`find_nvcc`): CMake finds it only through ``CUDACXX``, ``PATH`` or ``CUDA_PATH``; one in
  ``CUDA_HOME`` or ``/usr/local/cuda`` alone would be missed and ``_C`` would build without CUDA, silently. The
  install's environment then names it in ``CUDACXX``; none at all on a GPU machine is a problem.
* **Python's headers** (``Python.h``, which the build of ``_C`` needs: ``_C`` is nothing but the Python module, so
  without them there is nothing to build, one clear problem) and **a writable install target** (the editable
  install writes into the interpreter's site-packages, and the build into the checkout's ``build/``).
* **The build's toolchain** (`toolchain`): pybind11, CMake at least the version ``CMakeLists.txt`` asks
  (``cmake_minimum_required``), ninja, setuptools, a C++ compiler, each found where setup.py looks (the pip-installed
  tool, else ``PATH``), each a fact in the record (``stages.preflight.toolchain``) and a problem where it is missing.

`preflight` returns the facts to log and the problems that stop the run before the install (exit status 2).
Imports nothing of overlap (it runs before the install).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
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
    toolchain: dict[str, dict] = dataclasses.field(default_factory=dict)  # tool -> {"found": ..., "ok": bool}


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


def cmake_minimum(root: Path) -> tuple[int, ...]:
    """The version ``CMakeLists.txt``'s ``cmake_minimum_required`` asks for, e.g. ``(3, 26)``."""
    found = re.search(r"cmake_minimum_required\s*\(\s*VERSION\s+([0-9.]+)", (root / "CMakeLists.txt").read_text())
    return tuple(int(x) for x in found.group(1).split(".")) if found else (0,)


def version_of(text: str | None) -> tuple[int, ...] | None:
    """The first ``X.Y[.Z]`` in a tool's ``--version`` output."""
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x) for x in found.groups() if x is not None) if found else None


def _version(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _pip_tool(module: str, attr: str, name: str, which: Callable[[str], str | None]) -> str | None:
    """Where setup.py finds a build tool: the pip-installed one (`module`'s `attr` folder), else one on PATH."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        try:
            folder = getattr(__import__(module), attr, None)
        except Exception:  # noqa: BLE001 - a broken install of the tool is no tool
            folder = None
        if folder and Path(folder, name).exists():
            return str(Path(folder, name))
    return which(name)


def toolchain(env: dict[str, str], root: Path, which: Callable[[str], str | None] = shutil.which,
              has_module: Callable[[str], bool] | None = None,
              version: Callable[[list[str]], str | None] = _version) -> tuple[dict[str, dict], list[str]]:
    """``({tool: {"found": path or version or None, "ok": bool}}, problems)`` of the build of ``_C`` (setup.py,
    CMakeLists.txt): pybind11, CMake (at least `cmake_minimum`), ninja, setuptools, a C++ compiler."""
    has_module = has_module or (lambda name: importlib.util.find_spec(name) is not None)
    facts: dict[str, dict] = {}
    for module in ("pybind11", "setuptools"):
        facts[module] = {"found": "importable" if has_module(module) else None}
        facts[module]["ok"] = facts[module]["found"] is not None
    least = cmake_minimum(root)
    cmake = _pip_tool("cmake", "CMAKE_BIN_DIR", "cmake", which)
    got = version_of(version([cmake, "--version"])) if cmake else None
    facts["cmake"] = {"found": cmake, "version": ".".join(map(str, got)) if got else None,
                      "needs": ".".join(map(str, least)), "ok": got is not None and got >= least}
    ninja = _pip_tool("ninja", "BIN_DIR", "ninja", which)
    facts["ninja"] = {"found": ninja, "ok": ninja is not None}
    cxx = env.get("CXX") or next((found for name in ("c++", "g++", "clang++") if (found := which(name))), None)
    facts["c++"] = {"found": cxx, "ok": cxx is not None}
    fixes = {"pybind11": "pip install 'pybind11>=2.12'", "setuptools": "pip install 'setuptools>=64'",
             "cmake": f"pip install 'cmake>={facts['cmake']['needs']}'", "ninja": "pip install ninja",
             "c++": "install g++ or set CXX"}
    problems = []
    for tool, fact in facts.items():
        if not fact["ok"]:
            what = f"CMake >= {fact['needs']} (found {fact['version'] or 'none'})" if tool == "cmake" else tool
            problems.append(f"the build of overlap._C needs {what}: {fixes[tool]}")
    return facts, problems


def preflight(env: dict[str, str], gpu: bool, root: Path, run: Callable[[list[str]], str | None] | None = None,
              which: Callable[[str], str | None] = shutil.which, headers: Path | None = None,
              target: Path | None = None, access: Callable[[Path, int], bool] = os.access,
              tools: tuple[dict[str, dict], list[str]] | None = None) -> Preflight:
    """The checks above for a run on a GPU (`gpu`) or the CPU, from the checkout `root` (`tools`: what
    `toolchain` found, computed here where not given)."""
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
    tool_facts, tool_problems = tools if tools is not None else toolchain(env, root, which)
    tool_facts = {**tool_facts, "nvcc": {"found": nvcc, "ok": nvcc is not None}}
    for tool, fact in tool_facts.items():
        if tool == "nvcc":
            continue  # (said above)
        facts.append(f"{tool}: {fact['found'] or 'not found'}" + (f" (version {fact['version']}, needs >= "
                                                                  f"{fact['needs']})" if tool == "cmake" else ""))
    problems += tool_problems
    headers = headers or python_headers()
    tool_facts["Python.h"] = {"found": str(headers) if headers.is_file() else None, "ok": headers.is_file()}
    if not headers.is_file():
        problems.append(f"Python's headers are missing ({headers}): the build of overlap._C needs them (install "
                        "the python3-dev package of this Python)")
    target = target or install_target()
    for what, path in (("the install target (site-packages)", target), ("the build folder", root / "build")):
        if not writable(path, access):
            problems.append(f"{what} {path} is not writable: run from a virtual environment or a writable checkout")
    return Preflight(facts, problems, extra, [g["compute_mode"] for g in gpus], tool_facts)
