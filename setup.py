"""Build overlap: the Python packages plus the native extension overlap._C (CMake + Ninja).

Build-time environment:
    OVERLAP_BUILD_CUDA=0   skip the CUDA half of _C even where nvcc is found
    MAX_JOBS=N             parallel compile jobs (default 2)
    CMAKE_ARGS="..."       extra arguments for the CMake configure step
Torch is not a build requirement: csrc/ includes no libtorch headers.
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension built by the CMakeLists.txt in `sourcedir`, not by setuptools."""

    def __init__(self, name: str, sourcedir: Path = ROOT) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = Path(sourcedir).resolve()


def _tool(module: str, attr: str, name: str) -> str:
    """The pip-installed tool (a build requirement) if importable, else one on PATH.

    With --no-build-isolation the venv's bin/ is often not on PATH, and a system cmake
    may be older than the one pyproject.toml requires.
    """
    try:
        mod = __import__(module)
        path = Path(getattr(mod, attr)) / name
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"overlap: building _C needs {name} (pip install {module})")
    return found


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        import pybind11

        # get_ext_fullpath knows where setuptools wants the module: build/lib... for a
        # wheel, the source tree for an in-place (editable) build.
        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)

        cuda = os.environ.get("OVERLAP_BUILD_CUDA", "1").strip().lower()
        cuda_on = cuda not in ("0", "off", "false", "no")
        jobs = os.environ.get("MAX_JOBS", "2")
        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        configure = [
            cmake,
            str(ext.sourcedir),
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={_tool('ninja', 'BIN_DIR', 'ninja')}",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DOVERLAP_BUILD_CUDA={'ON' if cuda_on else 'OFF'}",
            *shlex.split(os.environ.get("CMAKE_ARGS", "")),
        ]
        subprocess.run(configure, cwd=build_temp, check=True)
        subprocess.run([cmake, "--build", ".", "-j", jobs], cwd=build_temp, check=True)


setup(
    # kernels/ (Triton device code) is installed as overlap.kernels.
    packages=[
        *find_packages(include=["overlap", "overlap.*"]),
        "overlap.kernels",
        *(f"overlap.kernels.{p}" for p in find_packages(where="kernels")),
    ],
    package_dir={"overlap.kernels": "kernels"},
    ext_modules=[CMakeExtension("overlap._C")],
    cmdclass={"build_ext": CMakeBuild},
)
