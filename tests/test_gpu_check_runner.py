"""Tests of the GPU check's runner without a GPU (bench/gpu_check.py, gpu_check_runner, gpu_check_groups,
gpu_check_report), on its --cpu-smoke sections made to misbehave by the test hooks
(``GPU_CHECK_TEST_HOOK``, `gpu_check_common.run_test_hooks`):

* ``--only`` selects groups, exact section names and prefixes, refuses a word that names nothing; ``--list``;
* a section that crashes its process (an exit code) or leaves it unusable (a sticky CUDA error) is a FAIL, the
  rest of its group runs in a fresh process and later groups run; the record on disk (``--out``) holds each
  section's results by the time the next section starts, with tracebacks in the record and the log;
* the self-deadline: a section that outlives ``--time-limit`` is recorded as a FAIL, the rest as SKIPs, and
  the run exits non-zero in time, both where the process stops itself and where the runner has to kill it;
* ``CUDA_DEVICE_MAX_CONNECTIONS`` is 32 in every process of the run when torch is imported, and logged;
* the summary's shape; the install's plan (``MAX_JOBS``, its deadline).

Every run is a subprocess with a timeout: no test hangs. Deadlines are asserted as deadlines: the run ends by
its --time-limit plus `LATE_S`.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.harness import LATE_S
from support.scripts import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
SMOKE = [str(SCRIPT), "--cpu-smoke", "--no-install"]


_run = run_script


def _status(doc: dict) -> dict[str, str]:
    return {r["section"]: r["status"] for r in doc["results"]}


@pytest.fixture
def bench_modules(monkeypatch):
    """bench/ on sys.path, for the modules that import no overlap at import time (report, groups)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))


# ----------------------------------------------------------------------------------------------
# --only and --list
# ----------------------------------------------------------------------------------------------


def test_only_runs_the_selected_sections_alone(tmp_path):
    exact, prefix = "a.ordered W=2 float32 16x32x24", "f.rs ordered"
    proc = _run([*SMOKE, "--out", str(tmp_path), "--only", exact, prefix, "c.timeout"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    # the exact name selects that section alone (not "a.ordered W=2 float32 24x40x64"); the prefix both f.rs ordered
    want = [exact, "c.timeout", "f.rs ordered W=2 float32 80x32x24", "f.rs ordered W=3 bfloat16 72x40x40"]
    assert doc["selected"] == [exact, "f.rs ordered W=2 float32 80x32x24", "f.rs ordered W=3 bfloat16 72x40x40",
                               "c.timeout"]
    assert [s["name"] for s in doc["sections"]] == want, doc["sections"]
    assert set(_status(doc).values()) == {"PASS"} and doc["complete"], doc["results"]
    assert [p["group"] for p in doc["processes"]] == ["ag", "rs"]  # no process for a group with nothing selected


def test_only_refuses_a_word_that_names_nothing_and_list_names_everything(tmp_path):
    proc = _run([*SMOKE, "--out", str(tmp_path), "--only", "no-such-section"], timeout=60)
    assert proc.returncode == 2 and "--only 'no-such-section' names no group or section" in proc.stdout, proc.stdout
    proc = _run([*SMOKE, "--list"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for line in ("ag: a-c", "streams: d, e", "rs: f", "moe: g", "a2a: h", "time_moe: MoE", "    c.timeout",
                 "    d.cuda_wait_flag_bounded    [SKIP: GPU only]"):
        assert line in proc.stdout, proc.stdout


def test_resolve_only(bench_modules):
    from gpu_check_groups import resolve_only

    listing = {"ag": [("a.x W=2", None), ("a.x W=24", None), ("b.y", None)], "rs": [("f.z", None)]}
    assert resolve_only([], listing) is None
    assert resolve_only(["a.x W=2"], listing) == ["a.x W=2"]  # exact first: not "a.x W=24"
    assert resolve_only(["a.x"], listing) == ["a.x W=2", "a.x W=24"]
    assert resolve_only(["rs", "b.y", "a.x W=2"], listing) == ["f.z", "b.y", "a.x W=2"]
    with pytest.raises(ValueError, match="names no group or section"):
        resolve_only(["c."], listing)


def test_every_group_lists_distinct_sections_and_correctness_before_timing(bench_modules):
    from gpu_check_groups import GROUPS, ordered_groups

    names = [g.name for g in ordered_groups()]
    assert len(set(names)) == len(GROUPS) and not any(g.timing for g in ordered_groups()[: names.index("time_ag")])
    assert all(g.timing for g in ordered_groups() if g.name.startswith("time_"))


# ----------------------------------------------------------------------------------------------
# A process per group: crashes and sticky faults stay in their process; the record after every section
# ----------------------------------------------------------------------------------------------


def test_crashes_and_sticky_faults_stay_in_their_process(tmp_path):
    out, snap = tmp_path / "out", tmp_path / "snapshot"
    hooks = f"fault::b.racing W=2;snapshot:{snap}:c.timeout;exit:9:f.rs racing;raise::g.moe dispatch timeout"
    only = ["b.racing W=2", "c.timeout", "f.rs racing", "f.ar1 racing", "f.rs timeout", "g.moe dispatch timeout",
            "g.moe combine racing"]
    proc = _run([*SMOKE, "--out", str(out), "--only", *only], timeout=180, GPU_CHECK_TEST_HOOK=hooks)
    assert proc.returncode == 1, proc.stdout[-4000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    status = _status(doc)
    assert status == {"b.racing W=2": "FAIL", "c.timeout": "PASS", "f.rs racing W=2": "FAIL",
                      "f.ar1 racing W=2": "PASS", "f.rs timeout": "PASS",
                      "g.moe dispatch timeout W=2 E=4 top2 T=12/9 32x32 float32 w=stacked": "FAIL",
                      "g.moe combine racing W=2 E=4 top2 T=12/9 32x32 float32 w=stacked": "PASS"}, doc["results"]
    by_name = {r["section"]: r for r in doc["results"]}
    assert "illegal memory access" in by_name["b.racing W=2"]["value"]
    assert "exited with code 9 during this section" in by_name["f.rs racing W=2"]["value"]
    # the sticky fault: a fresh process for the rest of "ag"; the crash: one for the rest of "rs"; a plain
    # exception stays in its process
    assert [(p["group"], p["exit"]) for p in doc["processes"]] == [("ag", 75), ("ag", 0), ("rs", 9), ("rs", 0),
                                                                     ("moe", 0)], doc["processes"]
    # tracebacks in the record and the log
    moe_fail = by_name["g.moe dispatch timeout W=2 E=4 top2 T=12/9 32x32 float32 w=stacked"]
    assert "Traceback" in moe_fail["data"]["traceback"] and "test hook" in moe_fail["data"]["traceback"]
    log = (out / "gpu_check.log").read_text()
    assert log.count("Traceback (most recent call last)") >= 2 and "RuntimeError: test hook" in log
    # the record as the next section started: the earlier section's result in it, this one running
    seen = json.loads((snap / "gpu_check.json").read_text())
    assert seen["running"] == "c.timeout" and _status(seen) == {"b.racing W=2": "FAIL"}, seen
    assert "FAIL b.racing W=2" in (snap / "gpu_check.log").read_text()


# ----------------------------------------------------------------------------------------------
# The self-deadline
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["sleep", "stall"])
def test_a_section_past_the_time_limit_ends_the_run_with_a_record(tmp_path, hook):
    """sleep: the group's process stops itself at its deadline; stall: it ignores it and the runner kills it."""
    limit = 40.0  # the process stops itself 4 s before it, the runner kills 1 s before: 3 s to write its record
    t0 = time.monotonic()
    proc = _run([*SMOKE, "--out", str(tmp_path), "--time-limit", str(limit), "--only", "c.timeout", "f.rs timeout"],
                timeout=limit + 60, GPU_CHECK_TEST_HOOK=f"{hook}:600:c.timeout")
    took = time.monotonic() - t0
    assert took <= limit + LATE_S, f"the run took {took:.1f} s with --time-limit {limit:.0f}"
    assert proc.returncode == 1, proc.stdout[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["complete"] is False and doc["ok"] is False and doc["running"] is None
    status = _status(doc)
    assert status == {"c.timeout": "FAIL", "f.rs timeout": "SKIP"}, doc["results"]
    failed = next(r for r in doc["results"] if r["section"] == "c.timeout")
    want = "the process stopped itself" if hook == "sleep" else "killed by the runner at --time-limit"
    assert want in failed["value"], failed
    assert [p["exit"] for p in doc["processes"]] == [124 if hook == "sleep" else None]
    assert "INCOMPLETE" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("0 passed, 1 failed")


# ----------------------------------------------------------------------------------------------
# CUDA_DEVICE_MAX_CONNECTIONS before torch
# ----------------------------------------------------------------------------------------------

PROBE = """
import os, sys

class _TorchImportProbe:
    # Records, in every process of the run, the environment at the moment torch is first imported.
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            with open(os.environ["PROBE_FILE"], "a") as f:
                f.write(repr((os.getpid(), os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), sys.argv)) + "\\n")
        return None

sys.meta_path.insert(0, _TorchImportProbe())
"""


def test_connections_are_32_when_torch_is_imported_in_every_process(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    probe = tmp_path / "probe.txt"
    env = {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PROBE_FILE": str(probe), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    control = _run(["-c", "import torch"], timeout=60, **env)  # the probe itself works: it sees the 1
    assert control.returncode == 0 and "'1'" in probe.read_text(), (control.stderr, probe.read_text())
    probe.unlink()
    proc = _run([*SMOKE, "--out", str(tmp_path / "out"), "--only", "c.timeout"], timeout=120, **env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    seen = [eval(line) for line in probe.read_text().splitlines()]  # noqa: S307 - written by the probe above
    assert len(seen) == 2 and any("--group" in argv for _, _, argv in seen), seen  # the runner and the group's
    assert all(value == "32" for _, value, _ in seen), seen
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32 set before torch was imported (it was 1)" in log, log[:2000]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32 when torch was imported" in log


def test_a_group_runs_under_its_own_connection_count(tmp_path):
    """The one-queue group (`Group.env`) imports torch with CUDA_DEVICE_MAX_CONNECTIONS=1 whatever the run has
    (the runner keeps 32), and its section checks the setting it names."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    probe = tmp_path / "probe.txt"
    env = {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PROBE_FILE": str(probe)}
    proc = _run([*SMOKE, "--out", str(tmp_path / "out"), "--only", "j.1-queue watchdog release"], timeout=120, **env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    seen = [eval(line) for line in probe.read_text().splitlines()]  # noqa: S307 - written by the probe above
    group = [value for _, value, argv in seen if "--group" in argv]
    runner = [value for _, value, argv in seen if "--group" not in argv]
    assert group == ["1"] and runner == ["32"], seen
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert _status(doc) == {"j.1-queue watchdog release": "PASS"}, doc["results"]


# ----------------------------------------------------------------------------------------------
# The summary; the install's plan
# ----------------------------------------------------------------------------------------------


def test_the_summary_ends_the_output_with_only_fails_skips_and_headlines(bench_modules):
    from gpu_check_report import SUMMARY_MARK, new_doc, summary

    doc = new_doc("gpu", 7, 480.0, time.time() - 100)
    doc["complete"], doc["elapsed_s"] = False, 100.0

    def result(name, status, value="", ratio=None, tflops=None, section=None, **data):
        doc["results"].append({"name": name, "status": status, "value": value, "tflops": tflops, "ratio": ratio,
                               "data": data, "section": section or name})

    for i in range(40):
        result(f"a.ordered W=2 case {i} 64x64x64", "PASS", "max 1e-3", section=f"a.ordered W=2 case {i}")
    for i in range(20):
        result(f"f.rs racing W={i}", "FAIL", "rank 1 finished early " * 20)
    for i in range(30):
        result(f"time moe fused dispatch s{i}", "SKIP", "over --time-limit 480 s (not started)")
    result("h.moe a2a kernels W=4", "SKIP", "GPU only")
    result("time fused rs o_proj W=8", "PASS", "1 ms", ratio=1.2, tflops=500.0)
    result("time fused rs down W=8", "PASS", "1 ms", ratio=0.8, tflops=600.0)
    result("time fused 8192^3 65536x8192x8192", "PASS", "1 ms", ratio=0.9, tflops=700.0)
    result("time signal ping-pong", "PASS", "2 us", us=2.5)
    text = summary(doc, "gpu_check_out")
    lines = text.splitlines()
    assert lines[0].startswith(SUMMARY_MARK) and len(lines) <= 26, text
    assert not any(line.startswith("PASS") or "a.ordered" in line for line in lines), text
    fails = [line for line in lines if line.startswith("FAIL f.rs racing")]
    assert len(fails) == 12 and all("[rerun: --only 'f.rs racing W=" in line for line in fails), text
    assert "FAIL ... and 8 more" in text
    assert "time moe fused dispatch s0, time moe fused dispatch s1, time moe fused dispatch s2, ... (30 in all)" in text
    assert "SKIP (GPU only): h.moe a2a kernels W=4" in text
    assert "HEADLINE fused GEMM+reduce-scatter vs torch mm+sum: 0.98x geomean over 2 (0.80-1.20x)" in text
    assert "HEADLINE fused all-gather GEMM (best tile) vs cuBLAS: 0.90x" in text
    assert "HEADLINE stream-ordered signal: 2.50 us" in text and "INCOMPLETE" in text
    assert lines[-1] == "44 passed, 20 failed, 31 skipped in 100 s"


def test_the_install_uses_every_core_and_ends_before_the_time_limit(tmp_path):
    code = ("import sys; sys.path.insert(0, 'bench'); import gpu_check as g; "
            "print(g.install_env()['MAX_JOBS'], g.machine_cores(), g.install_deadline(1000.0, 480.0))")
    env = {k: v for k, v in os.environ.items() if k != "MAX_JOBS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jobs, cores, until = proc.stdout.split()
    assert jobs == cores and int(cores) == len(os.sched_getaffinity(0))
    assert float(until) == 1000.0 + 480.0 - 30.0  # leaves time to write the record and exit
