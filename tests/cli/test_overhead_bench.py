"""bench/overhead.py runs and reports every row (no timing is asserted: the machine may be busy)."""

from __future__ import annotations

import json

import pytest

from tests.support.scripts import run_script


@pytest.mark.parametrize("barrier", [False, True], ids=["back-to-back", "barrier"])
def test_overhead_script_reports_every_row(tmp_path, barrier):
    out = tmp_path / "o.json"
    done = run_script(["bench/overhead.py", "--iters", "5", "--warmup", "1", "--profiled", "5", "--json", str(out)]
                      + ["--barrier"] * barrier, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("each call after a barrier" if barrier else "calls back to back") in done.stdout, done.stdout
    for row in ("op (median)", "gemm alone", "plain torch ag+mm", "protocol = op - gemm", "preamble", "handshake",
                "waits for peers", "copy-engine hop", "dispatch", "host rendezvous per call"):
        assert row in done.stdout, (row, done.stdout)
    record = json.loads(out.read_text())["rank0_us"]
    want = {"op", "gemm", "torch", "preamble", "handshake", "waits", "hop", "op_profiled", "rendezvous_per_call"}
    assert want <= record.keys(), record
    for name in ("op", "gemm", "torch"):  # the quartiles of each timed row
        assert record[f"{name}_p25"] <= record[name] <= record[f"{name}_p75"], record
    assert record["rendezvous_per_call"] == 0 and record["steady_per_call"] == 1, record  # warmed symm calls
    assert record["preamble"] > 0 and record["handshake"] > 0, record  # the op's ranges were seen


def test_overhead_script_rejects_a_bad_shape():
    done = run_script(["bench/overhead.py", "--shape", "32x64"], timeout=120)
    assert done.returncode == 2 and "MxKxN" in done.stderr, done.stderr
