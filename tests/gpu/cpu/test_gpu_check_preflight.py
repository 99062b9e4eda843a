"""The GPU check's preflight (tests/gpu/preflight.py) without a GPU: nvidia-smi's facts and the compute
mode, where nvcc is and whether CMake would find it, Python's headers, a writable install target; and that a
GPU machine whose ``overlap._C`` lacks CUDA is one clear FAIL after the install (``--no-install``)."""

import json
import os
import stat
from pathlib import Path

from tests.gpu import check as gpu_check
from tests.gpu import preflight as pf

SMI = "NVIDIA H200, 580.65.06, Default\n"


def _nvcc(root: Path) -> Path:
    path = root / "bin" / "nvcc"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _preflight(tmp_path, env, smi=SMI, which=lambda name: None, headers=True, target=None, gpu=True,
               access=os.access):
    header = tmp_path / "include" / "Python.h"
    if headers:
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text("")
    return pf.preflight(env, gpu=gpu, root=tmp_path, run=lambda cmd: smi, which=which, headers=header,
                        target=target or tmp_path, access=access, tools=({}, []))


def test_facts_of_the_gpu_and_its_compute_mode():
    assert pf.gpu_facts(lambda cmd: SMI) == [{"name": "NVIDIA H200", "driver": "580.65.06", "compute_mode": "Default"}]
    assert pf.gpu_facts(lambda cmd: None) == []
    assert pf.compute_mode_problem(pf.gpu_facts(lambda cmd: SMI)) is None
    why = pf.compute_mode_problem(pf.gpu_facts(lambda cmd: SMI.replace("Default", "Exclusive_Process")))
    assert why and "Exclusive_Process" in why and "one process at a time" in why


def test_nvcc_where_cmake_looks_and_where_it_does_not(tmp_path):
    nvcc = _nvcc(tmp_path / "cuda")
    assert pf.find_nvcc({"CUDACXX": "/opt/x/nvcc"}) == ("/opt/x/nvcc", True)
    assert pf.find_nvcc({}, which=lambda name: "/usr/bin/nvcc") == ("/usr/bin/nvcc", True)
    assert pf.find_nvcc({"CUDA_PATH": str(tmp_path / "cuda")}, which=lambda n: None) == (str(nvcc), True)
    assert pf.find_nvcc({"CUDA_HOME": str(tmp_path / "cuda")}, which=lambda n: None) == (str(nvcc), False)
    # only CUDA_HOME: the install's environment names it for CMake
    got = _preflight(tmp_path, {"CUDA_HOME": str(tmp_path / "cuda")})
    assert got.problems == [] and got.env == {"CUDACXX": str(nvcc)}, got
    assert any("CUDACXX set for the install" in f for f in got.facts), got.facts


def test_no_nvcc_on_a_gpu_machine_stops_the_run_before_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(pf, "NVCC_FALLBACK", str(tmp_path / "nowhere"))
    got = _preflight(tmp_path, {})
    assert len(got.problems) == 1 and "nvcc not found" in got.problems[0] and "CUDACXX" in got.problems[0]
    cpu = _preflight(tmp_path, {}, gpu=False)  # the CPU smoke builds without CUDA on purpose: a fact only
    assert cpu.problems == [] and any("nvcc not found" in f for f in cpu.facts)


def test_missing_headers_and_an_unwritable_target_are_problems(tmp_path):
    got = _preflight(tmp_path, {"CUDACXX": "/opt/x/nvcc"}, headers=False)
    assert len(got.problems) == 1 and "Python's headers are missing" in got.problems[0]
    locked = tmp_path / "site"  # (a permission the test sets would not hold for root: access is given instead)
    locked.mkdir()
    got = _preflight(tmp_path, {"CUDACXX": "/opt/x/nvcc"}, target=locked / "site-packages",
                     access=lambda path, mode: path != locked)
    assert len(got.problems) == 1 and "install target" in got.problems[0] and str(locked) in got.problems[0], \
        got.problems


def test_a_compute_mode_other_than_default_is_said(tmp_path):
    got = _preflight(tmp_path, {"CUDACXX": "/opt/x/nvcc"}, smi=SMI.replace("Default", "Prohibited"))
    assert got.problems == [] and got.compute_modes == ["Prohibited"]
    assert any("two-process ops tests will skip" in f for f in got.facts), got.facts


def test_a_gpu_with_a_c_extension_without_cuda_fails_after_the_install(monkeypatch, tmp_path, capsys):
    import torch

    from overlap import signals

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(signals, "has_cuda", False)
    code = gpu_check.main(["--no-install", "--out", str(tmp_path), "--time-limit", "60"])
    out = capsys.readouterr().out
    assert code == 2, out[-3000:]
    assert "overlap._C was built without its CUDA half" in out, out[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "without its CUDA half" in record["stages"]["setup"]["problem"], record


def _toolchain(tmp_path, modules=("pybind11", "setuptools"), tools=("cmake", "ninja", "c++"), cmake="3.28.3",
               env=None):
    (tmp_path / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.26)\nproject(x)\n")
    return pf.toolchain(env or {}, tmp_path, which=lambda name: f"/usr/bin/{name}" if name in tools else None,
                        has_module=lambda name: name in modules,
                        version=lambda cmd: f"cmake version {cmake}\n" if cmd[0].endswith("cmake") else None)


def test_the_builds_toolchain_is_a_fact_each_and_what_is_missing_a_problem(tmp_path, monkeypatch):
    monkeypatch.setattr(pf, "_pip_tool", lambda module, attr, name, which: which(name))  # not this venv's tools
    assert pf.cmake_minimum(gpu_check.ROOT) >= (3, 0)  # the project's CMakeLists.txt says it
    facts, problems = _toolchain(tmp_path)
    assert problems == [] and all(f["ok"] for f in facts.values()), facts
    assert facts["cmake"] == {"found": "/usr/bin/cmake", "version": "3.28.3", "needs": "3.26", "ok": True}
    facts, problems = _toolchain(tmp_path, cmake="3.25.1")  # older than CMakeLists.txt asks
    assert not facts["cmake"]["ok"] and problems == ["the build of overlap._C needs CMake >= 3.26 (found 3.25.1): "
                                                     "pip install 'cmake>=3.26'"], problems
    facts, problems = _toolchain(tmp_path, modules=("setuptools",), tools=("cmake",), env={"CXX": "/opt/cxx"})
    assert facts["c++"] == {"found": "/opt/cxx", "ok": True} and not facts["pybind11"]["ok"], facts
    assert [p.split(":")[0] for p in problems] == ["the build of overlap._C needs pybind11",
                                                   "the build of overlap._C needs ninja"], problems
    # in the preflight: every tool a fact (nvcc and Python.h too), each missing one a problem
    got = _preflight(tmp_path, {"CUDACXX": "/opt/x/nvcc"})
    got = pf.preflight({"CUDACXX": "/opt/x/nvcc"}, gpu=False, root=tmp_path, headers=tmp_path / "include" / "Python.h",
                       target=tmp_path, tools=(facts, problems))
    assert set(got.toolchain) == {"pybind11", "setuptools", "cmake", "ninja", "c++", "nvcc", "Python.h"}
    assert got.toolchain["nvcc"] == {"found": "/opt/x/nvcc", "ok": True} and got.toolchain["Python.h"]["ok"]
    assert problems == [p for p in got.problems if "needs" in p] and any(f.startswith("ninja: not found")
                                                                        for f in got.facts), got
