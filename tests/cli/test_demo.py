"""``overlap demo``: the command on 2 CPU ranks (a subprocess, as a user runs it), its argument errors, the
training on 3 pooled ranks, and its data.

What is asserted is deterministic: the two runs' losses agree (fp32, relative 1e-5), the loss falls, the
report and the files are there. Step times and memory are printed by the command, never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def overlap_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "overlap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_demo_two_ranks_losses_match(tmp_path):
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    proc = overlap_cmd("demo", "--nproc", "2", "--steps", "5", "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out_json.read_text())
    torch_run, ours = results["runs"]["torch"], results["runs"]["overlap"]
    assert len(torch_run["losses"]) == len(ours["losses"]) == 5, results
    assert len(torch_run["step_s"]) == len(ours["step_s"]) == 4, results  # step 0 is the warm-up
    assert results["summary"]["max_rel_loss_diff"] <= 1e-5, results["summary"]
    for a, b in zip(torch_run["losses"], ours["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    assert torch_run["losses"][-1] < torch_run["losses"][0], torch_run["losses"]  # it learns
    assert results["world_size"] == 2 and results["strategy"] == "auto", results
    assert "largest relative loss difference" in proc.stdout and "step-time ratio overlap/torch" in proc.stdout
    assert "peak memory" in proc.stdout, proc.stdout
    assert out_png.stat().st_size > 0
    assert "step 5" in proc.stderr or "5 steps" in proc.stderr, proc.stderr  # the progress bar


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "3"], "does not divide over 3 ranks"),  # 4 heads, 4 experts, 128 ffn: not over 3
        (["--nproc", "2", "--heads", "3", "--hidden", "64"], "hidden size 64 does not divide by 3 heads"),
        (["--nproc", "2", "--top-k", "5"], "top-k 5"),
        (["--nproc", "2", "--strategy", "bogus"], "--strategy"),
        (["--nproc", "2", "--steps", "1"], "--steps"),
        (["--nproc", "2", "--json", "/no/such/folder/x.json"], "does not exist"),
        (["--ranks", "2", "--plot", "out.xyz"], "--plot: the suffix gives the format"),  # as overlap bench
        (["--ranks", "2", "--plot", "out"], "--plot: the suffix gives the format"),  # matplotlib would add .png
    ],
)
def test_demo_bad_arguments_exit_2_before_ranks(args, message, capsys):
    from overlap.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "overlap demo" in err, err


def test_help_lists_demo():
    from overlap.cli import build_parser

    text = build_parser().format_help()
    assert "demo" in text, text


def demo_task(rank, world_size, strategy):
    from overlap.demo.config import DemoConfig, ModelConfig
    from overlap.demo.train import train

    model = ModelConfig(vocab=32, hidden=48, heads=6, ffn=96, layers=1, experts=6, top_k=2, seq_len=12, batch=2)
    return train(DemoConfig(model=model, steps=3, strategy=strategy, progress=False))


@pytest.mark.exact
@pytest.mark.parametrize("strategy", ["pipelined", "symm"])
def test_demo_training_three_ranks(pools, strategy):
    results = pools(3).run(demo_task, strategy, timeout=180)
    runs = results[0]["runs"]
    assert all(r["runs"]["torch"]["losses"] == runs["torch"]["losses"] for r in results)  # the same on every rank
    for a, b in zip(runs["torch"]["losses"], runs["overlap"]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (strategy, runs)


@pytest.mark.exact
def test_data_is_fixed_and_prefix_stable():
    from overlap.demo import data

    a = data.batches(16, 8, 3, 4, seed=5)
    b = data.batches(16, 8, 3, 2, seed=5)
    assert a.shape == (4, 9, 3) and a.dtype == torch.int64
    assert torch.equal(a[:2], b)  # fewer steps are a prefix of more
    assert torch.equal(a, data.batches(16, 8, 3, 4, seed=5))
    assert not torch.equal(a, data.batches(16, 8, 3, 4, seed=6))
    assert 0 < data.entropy_rate(16, 5) < torch.log(torch.tensor(16.0)).item()


def test_model_config_problems():
    from overlap.demo.config import ModelConfig

    assert ModelConfig().problems(2) == [] and ModelConfig().problems(4) == []
    problems = ModelConfig().problems(3)
    assert any("heads (4)" in p for p in problems) and any("experts (4)" in p for p in problems), problems
