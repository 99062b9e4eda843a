"""The GPU check's machine profile (tests/gpu/profile.py) without a GPU: built from measured samples, written where
the profile cache keeps one GPU's, and taken by ``overlap predict --machine`` in place of the preset's GEMM numbers
(the preset's links kept). The measurement itself runs in the GPU check's timings (GPU only)."""

from __future__ import annotations

import pytest

from overlap.plans import Plan, Problem, predict, presets
from tests.gpu import profile, timings


def test_the_timings_measure_the_profile():
    assert "machine profile" in [name for name, _ in timings.plan()]


def test_a_profile_built_from_samples_replaces_the_presets_gemms(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    h100 = presets.machine("h100-sxm")
    peak, launch = 700e12, 9e-6  # what the GPU ran at
    samples = {"bfloat16": [(2.0 * s**3, launch + 2.0 * s**3 / peak) for s in profile.SIDES],
               "float32": [(2.0 * s**3, launch + 2.0 * s**3 / 50e12) for s in profile.SIDES]}
    built = profile.build(h100.device_names[0], samples, hbm_Bps=2.9e12)
    fit = built.gemm["bfloat16"]
    assert fit.peak_flops == pytest.approx(peak, rel=1e-6) and fit.overhead_s == pytest.approx(launch, rel=1e-6)
    assert fit.memory_Bps == 2.9e12 and not built.links and built.device == h100.device_names[0]
    path = profile.save(built)
    assert path.parent == tmp_path and path.name.startswith("profile-") and path.name.endswith("-w1-none.json")

    described = presets.cluster("h100-sxm", cache=tmp_path)
    assert described.measured == str(path), described
    preset = presets.profile_of(h100)
    assert described.profile.gemm["bfloat16"] == fit and described.profile.links == preset.links
    assert described.profile.gemm["float8_e4m3fn"] == preset.gemm["float8_e4m3fn"]  # not measured: the preset's
    p = Problem("all_gather_matmul", 1024, 8192, 3584, "bfloat16")
    slower = predict(p, Plan("reference"), described.topology, described.profile).compute_s
    assert slower > predict(p, Plan("reference"), described.topology, preset).compute_s  # 700 < 771 TFLOP/s
