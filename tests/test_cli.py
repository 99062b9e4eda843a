"""The ``overlap`` command, run as a user runs it: in a subprocess, with a deadline on each run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from overlap import world

STRATEGY_LABELS = ("reference", "pipelined", "symm", "fused (interpreted)")


def overlap_cmd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m overlap.cli ARGS`` with this interpreter, one torch thread, a deadline."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_version():
    import overlap

    proc = overlap_cmd("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"overlap {overlap.__version__}"


def test_help_lists_commands():
    proc = overlap_cmd("--help")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\s+info\s", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\s+bench\s", proc.stdout, re.M), proc.stdout
    assert "tune" not in proc.stdout  # not implemented yet: not advertised


def test_console_script_next_to_interpreter():
    script = os.path.join(os.path.dirname(sys.executable), "overlap")
    if not os.path.exists(script):
        pytest.skip(f"no console script at {script} (overlap not installed in this environment)")
    proc = subprocess.run([script, "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--nproc", "--shape", "--dtype", "--strategies", "--warmup", "--iters", "--json", "--timeout"):
        assert option in proc.stdout, f"{option} missing from bench --help:\n{proc.stdout}"


def test_bad_shape_exits_2():
    proc = overlap_cmd("bench", "--shape", "3x4")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "MxKxN" in proc.stderr and "'3x4'" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("bench", "--shape", "0x4x4"),
        ("bench", "--shape", "8x8x8", "3x4x"),
        ("bench", "--strategies", "reference,warp"),
        ("bench", "--dtype", "float64"),
        ("bench", "--iters", "0"),
        ("bench", "--timeout", "-1"),
        ("info", "--nproc", "0"),
        ("tune",),
    ],
)
def test_bad_arguments_exit_2_in_process(args, capsys):
    """The same argparse path, in process (no ranks are started before the arguments are checked)."""
    from overlap.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 2, args
    assert "error" in capsys.readouterr().err


def test_info_two_ranks():
    proc = overlap_cmd("info", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "torch " in out and "triton" in out and "overlap._C" in out and "TRITON_INTERPRET" in out, out
    assert "backend: gloo" in out, out
    rank_rows = [line.split() for line in out.splitlines() if re.match(r"^[01]\s+\d+\s", line)]
    assert sorted(row[0] for row in rank_rows) == ["0", "1"], out
    assert len({row[1] for row in rank_rows}) == 2, f"two ranks need two pids:\n{out}"
    # The link matrix: 0 -> 1 and 1 -> 0 are both shared memory on CPU ranks of one node.
    matrix = [line.split() for line in out.splitlines() if re.match(r"^\s*[01]\s+(-|shm)\s+(-|shm)\s*$", line)]
    assert matrix == [["0", "-", "shm"], ["1", "shm", "-"]], out


def test_bench_small_case_with_json(tmp_path):
    path = tmp_path / "bench.json"
    proc = overlap_cmd(
        "bench",
        "--nproc",
        "2",
        "--shape",
        "64x48x40",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
        str(path),
        "--timeout",
        "60",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in STRATEGY_LABELS:
        lines = [ln for ln in proc.stdout.splitlines() if re.search(rf"64x48x40 float32\s+{re.escape(label)}\s+\d", ln)]
        assert len(lines) == 1, f"want one line for {label}:\n{proc.stdout}"
    assert "geomean speedup" in proc.stdout and "machine: CPU" in proc.stdout, proc.stdout
    assert "[1/1] all_gather_matmul 64x48x40" in proc.stderr, proc.stderr

    data = json.loads(path.read_text())
    assert data["machine"]["world_size"] == 2 and data["machine"]["backend"] == "gloo"
    rows = {r["strategy"]: r for r in data["results"]}
    for s in ("reference", "pipelined", "symm", "fused"):
        assert rows[s]["status"] == "ok", rows[s]
        assert rows[s]["speedup"] > 0 and rows[s]["median_ms"] > 0, rows[s]
        assert len(rows[s]["times_ms"]) == 3, rows[s]
        assert (rows[s]["m"], rows[s]["k"], rows[s]["n"]) == (64, 48, 40)
    assert rows["reference"]["speedup"] == 1.0
    assert rows["fused"]["interpreted"] and not rows["fused"]["in_summary"]
    assert set(data["summary"]) == {"pipelined", "symm"}  # interpreted fused is left out
    assert rows["(all_gather alone)"]["median_ms"] > 0 and rows["(GEMM alone)"]["median_ms"] > 0


def test_bench_rank_error_exits_1():
    """An exception on the ranks reaches stderr with its traceback, and the exit code is 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OVERLAP_TIMEOUT_S="not-a-number")
    proc = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "bench", "--nproc", "2", "--shape", "8x8x8", "--iters", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "overlap bench: rank" in proc.stderr and "Traceback" in proc.stderr, proc.stderr
    assert "OVERLAP_TIMEOUT_S must be a number of seconds" in proc.stderr, proc.stderr


def test_bench_json_folder_missing_exits_2(tmp_path):
    proc = overlap_cmd("bench", "--json", str(tmp_path / "missing" / "out.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
    assert "overlap bench" in proc.stderr, proc.stderr  # the usage of the subcommand


_WRONG_SYMM = """
    import sys
    import importlib
    from overlap.cli import main

    agm = importlib.import_module("overlap.ops.all_gather_matmul")  # the package attribute is the function

    right = agm.STRATEGIES["symm"]

    def wrong(call, a2, b, pg, info, *rest):
        out = right(call, a2, b, pg, info, *rest)
        if info.rank == 1:  # wrong on one rank only: every rank must still agree not to time it
            out[0, 0] += 1.0
        return out

    agm.STRATEGIES["symm"] = wrong
    sys.exit(main(["bench", "--shape", "16x8x8", "--strategies", "reference,symm,pipelined",
                   "--warmup", "0", "--iters", "2", "--timeout", "30"]))
"""


def test_bench_mismatch_under_torchrun_fails(tmp_path):
    """A wrong strategy is reported FAILED and the command exits 1 (ranks started by torchrun, in place)."""
    script = tmp_path / "wrong_symm.py"
    script.write_text(textwrap.dedent(_WRONG_SYMM))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(world.free_port())  # torchrun's --master-port 0 hangs its workers' rendezvous
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert re.search(r"16x8x8 float32\s+symm\s+FAILED\s+rank 1: symm vs reference", proc.stdout), proc.stdout
    assert re.search(r"16x8x8 float32\s+pipelined\s+\d", proc.stdout), proc.stdout
    assert "did not match reference" in proc.stderr, proc.stderr
