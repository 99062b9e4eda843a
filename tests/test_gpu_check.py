"""Tests of bench/gpu_check.py without a GPU: its --help, and its --cpu-smoke mode, which runs the
virtual-rank checks under the Triton interpreter (a process per group: the all-gather kernel, checks a-c, the
reduce-scatter kernels, checks f, and the MoE grouped-GEMM kernels, checks g; the GPU-only groups recorded as
skipped from their listing) and every op x strategy over gloo (two ranks under torchrun); and the layout of
bench/: its modules import one another one way only (no cycle), and the GPU check's modules stay under 500
lines. The runner's own behaviour (--only, the deadline, crashes, the record, the summary) is
tests/test_gpu_check_runner.py's. Every run is a subprocess with a timeout: no test hangs.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.scripts import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


_run = run_script


def _check_table_and_json(proc: subprocess.CompletedProcess, path: Path) -> dict:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    tail = proc.stdout.rstrip().splitlines()
    assert tail[-1].endswith(" s") and " passed, 0 failed" in tail[-1], out[-3000:]
    assert any(line.startswith("check ") and "status" in line for line in tail), out[-3000:]
    doc = json.loads(path.read_text())
    assert doc["ok"] is True and doc["complete"] is True and doc["torch"] and "date" in doc
    assert doc["running"] is None
    return doc


def test_help():
    proc = _run([str(SCRIPT), "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--cpu-smoke", "--no-install", "--install", "--json", "--time-limit", "--out", "--only", "--list"):
        assert option in proc.stdout


def status_of(doc: dict) -> dict[str, str]:
    return {r["name"]: r["status"] for r in doc["results"]}


@pytest.mark.exact
def test_cpu_smoke_virtual_ranks(tmp_path):
    out = tmp_path / "out"
    path = tmp_path / "copy.json"
    proc = _run([str(SCRIPT), "--cpu-smoke", "--no-install", "--out", str(out), "--json", str(path)], timeout=150)
    doc = _check_table_and_json(proc, out / "gpu_check.json")
    assert json.loads(path.read_text())["results"] == doc["results"]  # --json: a copy of the record
    assert doc["mode"] == "cpu-smoke"
    # a process per group with sections to run on CPU; the GPU-only groups recorded from their listing
    assert [(p["group"], p["exit"]) for p in doc["processes"]] == [("ag", 0), ("rs", 0), ("moe", 0), ("ops", 0),
                                                                   ("queues", 0), ("queues1", 0)], doc["processes"]
    # section i, the ops through their public API: two ranks, then one, every case passing; its one-queue run
    # (a GPU's queue setting) skipped without a process
    ops = {n: s for n, s in status_of(doc).items() if n.startswith("i.ops") and not n.startswith("i.ops 1-queue")}
    assert any(n.startswith("i.ops W=2") for n in ops) and any(n.startswith("i.ops W=1") for n in ops), ops
    assert set(ops.values()) == {"PASS"}, ops
    assert status_of(doc)["i.ops 1-queue"] == "SKIP"
    # checks j: on CPU only the host half of the watchdog release runs (the real C++ watchdog on a /dev/shm
    # page), in each queue setting's process; every device check is skipped for want of CUDA
    queues = {n: s for n, s in status_of(doc).items() if n.startswith("j.")}
    assert queues == {f"j.{q}-queue {c}": "PASS" if c == "watchdog release" else "SKIP"
                      for q in ("32", "1") for c in ("register+wait", "watchdog release", "no starvation")}, queues
    for q in ("32", "1"):
        release = next(r for r in doc["results"] if r["name"] == f"j.{q}-queue watchdog release")
        assert f"CUDA_DEVICE_MAX_CONNECTIONS={q}:" in release["value"], release
        assert "err=1, abort=peer+1" in release["value"], release
    log = (out / "gpu_check.log").read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in log and "PASS c.timeout" in log
    # every correctness section before any timing
    names = [r["name"] for r in doc["results"]]
    timings = [i for i, n in enumerate(names) if n.startswith("time ")]
    assert timings and min(timings) > max(i for i, n in enumerate(names) if not n.startswith("time ")), names
    # every result belongs to a section of the record
    sections = {s["name"] for s in doc["sections"]}
    assert all(r["section"] in sections for r in doc["results"]), (sections, doc["results"])
    status = {r["name"]: r["status"] for r in doc["results"]}
    ordered = [n for n in status if n.startswith("a.ordered")]
    # fp32 and bf16, W=2 and 4, two shapes each
    assert len(ordered) == 8 and all(status[n] == "PASS" for n in ordered), status
    for prefix in ("b.racing", "c.timeout"):
        assert [s for n, s in status.items() if n.startswith(prefix)] == ["PASS"], status
    timeout = next(r for r in doc["results"] if r["name"].startswith("c.timeout"))
    assert "bounded wait fired" in timeout["value"] and "err=2" in timeout["value"]
    # the fused reduce-scatter kernels: reduce-scatter, two-shot and one-shot all-reduce layouts
    fused = {n: s for n, s in status.items() if n.startswith("f.")}
    for prefix, count in (("f.rs ordered", 2), ("f.ar2 ordered", 1), ("f.ar1 ordered", 1), ("f.rs racing", 1),
                          ("f.ar1 racing", 1), ("f.rs timeout", 1)):
        assert [s for n, s in fused.items() if n.startswith(prefix)] == ["PASS"] * count, fused
    timeout = next(r for r in doc["results"] if r["name"].startswith("f.rs timeout"))
    assert "bounded wait fired" in timeout["value"] and "err=2" in timeout["value"]
    # the MoE kernels: dispatch (wait kernel) and combine (scatter kernel) directions
    moe = {n: s for n, s in status.items() if n.startswith("g.moe ")}
    for prefix, count in (("g.moe dispatch ordered", 3), ("g.moe dispatch racing", 1), ("g.moe dispatch timeout", 1),
                          ("g.moe combine ordered", 3), ("g.moe combine racing", 1)):
        assert [s for n, s in moe.items() if n.startswith(prefix)] == ["PASS"] * count, moe
    assert len(moe) == 9, moe
    timeout = next(r for r in doc["results"] if r["name"].startswith("g.moe dispatch timeout"))
    assert "bounded wait fired" in timeout["value"] and "err=2" in timeout["value"]
    gpu_only = [n for n in status if n.startswith(("d.", "e.", "time "))]
    assert gpu_only and all(status[n] == "SKIP" for n in gpu_only), status
    for timing in ("time fused rs", "time fused ar1", "time moe fused dispatch", "time moe fused combine"):
        assert any(n.startswith(timing) for n in gpu_only), status
    assert "FAIL" not in status.values()


@pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks over /dev/shm")
def test_cpu_smoke_torchrun_two_ranks(tmp_path):
    path = tmp_path / "gpu_check.json"
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(SCRIPT), "--cpu-smoke", "--no-install", "--out", str(tmp_path)]
    proc = _run(args, timeout=90)
    doc = _check_table_and_json(proc, path)
    assert doc["mode"] == "cpu-smoke-distributed"
    checks = {r["name"]: r["status"] for r in doc["results"] if "fwd+bwd" in r["name"]}
    everything = ("reference", "pipelined", "symm", "fused")
    ops = {op: everything for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                                     "matmul_all_reduce[one_shot]", "moe.dispatch_grouped_matmul",
                                     "moe.dispatch_grouped_matmul+grouped_matmul_combine")}
    ops.update({op: everything[:3] for op in ("moe.dispatch", "moe.dispatch+combine")})  # no fused form
    for op, strategies in ops.items():
        for strategy in strategies:
            assert [s for n, s in checks.items() if n.startswith(f"{op} {strategy} ")] == ["PASS"], checks
    assert len(checks) == sum(map(len, ops.values())), checks
    timed = [r for r in doc["results"] if r["name"].startswith("time ") and r["status"] == "PASS"]
    for op, strategies in ops.items():
        assert len([r for r in timed if r["name"].startswith(f"time {op} ")]) == len(strategies), doc["results"]
    assert len(timed) == len(checks) and all(r["data"]["ms"] > 0 for r in timed), doc["results"]
    names = [r["name"] for r in doc["results"]]
    assert max(names.index(n) for n in checks) < min(names.index(r["name"]) for r in timed), names  # checks first


# ----------------------------------------------------------------------------------------------
# bench/'s modules: imports one way, small files
# ----------------------------------------------------------------------------------------------


def _bench_imports(bench: Path) -> dict[str, list[str]]:
    """Module -> the modules of `bench` it imports (scripts import their siblings by name), lazy imports too."""
    modules = {p.stem for p in bench.glob("*.py")}
    graph = {}
    for path in sorted(bench.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        graph[path.stem] = sorted((found & modules) - {path.stem})
    return graph


def _cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle of `graph` (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in graph.get(v, []):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_bench_modules_import_one_way():
    graph = _bench_imports(ROOT / "bench")
    assert "gpu_check_common" in graph["gpu_check"], graph  # the walk reads the scripts' sibling imports
    assert _cycle(graph) is None, f"import cycle among bench/ modules: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")  # a lazy import closes the loop
    (tmp_path / "c.py").write_text("from a import x\nimport torch\n")
    graph = _bench_imports(tmp_path)
    assert graph == {"a": ["b"], "b": ["c"], "c": ["a"]}, graph
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_gpu_check_modules_are_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "bench").glob("gpu_check*.py")}
    assert sizes and all(n < 500 for n in sizes.values()), sizes
