"""``overlap predict`` and ``overlap tune --machine``: the cost model on a described GPU cluster, no rank started.

In process (`overlap.cli.main`): every preset and op family, the JSON, the errors (exit 2, one line), and a predicted
plan file that ``auto`` takes on a group of that topology."""

from __future__ import annotations

import json
import math

import pytest
import torch

from overlap import world
from overlap.cli import main
from overlap.plans import Plan, PlanFile, presets
from overlap.plans.auto import resolve_auto


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", tuple(presets.PRESETS))
def test_predict_every_preset_and_op_family(capsys, name, monkeypatch, tmp_path):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))  # no measured profile replaces the preset
    code, out, err = run(capsys, "predict", "--machine", name, "--json", "-", "--mode", "fwd,fwd+bwd")
    assert code == 0, err
    data = json.loads(out)
    assert data["machine"] == name and data["measured_profile"] is None and data["topology"].startswith("cuda:")
    ops = {p["problem"].split(":")[0] for p in data["predictions"]}
    assert ops == {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul",
                   "moe"}, ops
    for p in data["predictions"]:
        assert p["unfused_s"] > 0 and p["gemm_alone_s"] > 0 and p["comm_alone_s"] > 0, p
        assert p["auto"]["predicted_s"] <= p["unfused_s"] * (1 + 1e-9), p  # never slower than unfused
        strategies = {s["strategy"]: s for s in p["strategies"]}
        assert strategies["reference"]["speedup"] == pytest.approx(1.0), p
        assert {"pipelined", "symm"} <= set(strategies), p
        assert p["verdict"], p
        for s in strategies.values():
            assert (s["predicted_s"] is None) == (s["why_not"] is not None), s


def test_predict_text_shapes_fp8_and_nodes(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    code, out, err = run(capsys, "predict", "--machine", "h100-sxm", "--gpus-per-node", "8", "--nodes", "2",
                         "--op", "all_gather_matmul", "--shape", "1024x8192x3584", "2x8192x3584",
                         "--dtype", "float8_e4m3fn", "--mode", "fwd")
    assert code == 0, err
    assert "2 node(s) x 8 GPU(s)" in out and "network*8" in out and "float8_e4m3fn" in out, out
    assert "needs the ranks of one node" in out and "auto chooses" in out, out
    assert out.count("all_gather_matmul:") == 2 and "overlap does not pay" in out, out  # the 2-row shape
    path = tmp_path / "p.json"
    code, out, err = run(capsys, "predict", "--machine", "b200", "--op", "moe", "--shape", "4096,7168,2048,256,8",
                         "--mode", "fwd", "--json", str(path))
    assert code == 0 and f"wrote {path}" in out, err
    (moe,) = json.loads(path.read_text())["predictions"]
    assert moe["problem"].startswith("moe:4096x7168x2048") and "experts=256" in moe["problem"], moe


def test_predict_uses_a_measured_profile_of_that_gpu(capsys, tmp_path, monkeypatch):
    preset = presets.profile_of(presets.machine("h200"))
    measured = json.loads(json.dumps(preset.to_json()))
    measured["machine"] = "probed on the cluster"
    measured["links"]["nvlink"]["copy"]["bandwidth_Bps"] = 1e11
    (tmp_path / "profile-node1-NVIDIA_H200-w8-nvlink.json").write_text(json.dumps(measured))
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    argv = ("predict", "--machine", "h200", "--op", "all_gather_matmul", "--shape", "1024x8192x3584", "--json", "-")
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    data = json.loads(out)
    assert data["measured_profile"].endswith("profile-node1-NVIDIA_H200-w8-nvlink.json"), data
    assert data["profile"] == "probed on the cluster"

    def symm_s(payload):
        (p,) = [p for p in payload["predictions"] if p["problem"].endswith(":fwd")]
        return next(s["predicted_s"] for s in p["strategies"] if s["strategy"] == "symm")

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path / "empty"))
    code, out, err = run(capsys, *argv)
    assert code == 0 and json.loads(out)["measured_profile"] is None, err
    assert symm_s(data) > 1.2 * symm_s(json.loads(out))  # the measured copies (100 GB/s) are slower: symm is too
    own = tmp_path / "mine.json"
    own.write_text(json.dumps(preset.to_json()))
    code, out, err = run(capsys, "predict", "--machine", "h200", "--profile", str(own), "--op", "all_gather_matmul",
                         "--shape", "1024x8192x3584", "--json", "-")
    assert code == 0 and json.loads(out)["measured_profile"] == str(own), err


@pytest.mark.parametrize("argv, message", [
    (("predict", "--machine", "h900"), "unknown machine 'h900'; presets: h100-sxm"),
    (("predict",), "--machine"),
    (("predict", "--machine", "h100-sxm", "--nodes", "0"), "expected an integer >= 1"),
    (("predict", "--machine", "h100-sxm", "--gpus-per-node", "3", "--op", "moe", "--shape", "mixtral-full"),
     "experts do not split evenly over 3 ranks"),
    (("predict", "--machine", "h100-sxm", "--profile", "/no/such/profile.json"), "--profile: cannot read"),
    (("predict", "--machine", "h100-sxm", "--json", "/no/such/folder/x.json"), "--json: folder"),
    (("tune", "--shape", "all_gather_matmul:8x8x8", "--nodes", "2"), "go with --machine"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err, (code, out, err)


def test_unwritable_outputs_exit_1_with_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    code, out, err = run(capsys, "tune", "--machine", "h100-sxm", "--shape", "all_gather_matmul:64x64x64",
                         "--out", "/proc/overlap-plan.json")
    assert code == 1 and err.startswith("overlap tune: cannot write /proc/overlap-plan.json") and \
        "Traceback" not in err, err


def test_tune_machine_writes_a_predicted_plan_file_that_auto_takes(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    out_path = tmp_path / "plans.json"
    code, out, err = run(capsys, "tune", "--machine", "h100-sxm", "--model",
                         "hidden=4096,ffn=14336,tokens=4096,heads=32,kv_heads=8,gated=1,dtype=bfloat16",
                         "--shape", "moe:4096x4096x1536:64:8:bfloat16", "--shape", "all_gather_matmul:2x8192x3584:"
                         "bfloat16:fwd", "--out", str(out_path))
    assert code == 0, err
    assert "nothing was run or measured" in out and f"wrote {out_path}" in out, out
    pf = PlanFile.load(out_path)
    assert pf.topology == "cuda:nodes=1:ranks=8:links=nvlink*7" and pf.profile is not None
    assert "preset h100-sxm" in pf.profile.machine and len(pf.entries) == 6, pf.entries.keys()
    for entry in pf.entries.values():
        assert entry.measured_s is None and entry.reference_s is None and math.isfinite(entry.predicted_s), entry
    decode = pf.entries["all_gather_matmul:2x8192x3584:bfloat16:fwd"]
    assert decode.plan == Plan("reference"), decode  # overlap does not pay there
    # auto on a group of that topology (eight GPU ranks of one node) takes the file's entries
    info = world.GroupInfo(rank=0, world_size=8, global_ranks=tuple(range(8)), nodes=("n",) * 8, pids=tuple(range(8)),
                           backend="nccl", device=torch.device("cuda", 0), peer_access=(True,) * 8)
    differs = 0
    for entry in pf.entries.values():
        p = entry.problem
        if p.spec.family != "tp":
            continue
        rows = p.spec.in_rows(p.m, 8)
        chosen = resolve_auto(p.op, p.key, info, rows, p.dtype, problem=p, plan_file=str(out_path))
        assert chosen == entry.plan, (p.key, chosen, entry.plan)
        differs += chosen != resolve_auto(p.op, p.key, info, rows, p.dtype, problem=p)  # without the file
    assert differs, "every entry is what auto chooses without the file: the test proves nothing"
    # merged into: a second machine's file of another topology is refused, the first kept
    code, out, err = run(capsys, "tune", "--machine", "h100-sxm", "--nodes", "2", "--shape",
                         "all_gather_matmul:64x1024x1024", "--out", str(out_path))
    assert code == 2 and "topology" in err, err
    assert len(PlanFile.load(out_path).entries) == 6
