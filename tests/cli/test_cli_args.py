"""The ``overlap`` command line before any rank starts: start-up, help, version and argument errors (exit
code 2), run as a user runs them (in a subprocess, with a deadline) or through `overlap.cli.main` in process.
The commands on ranks are `test_cli.py`'s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


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
    assert re.search(r"^\s+tune\s", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\s+predict\s", proc.stdout, re.M), proc.stdout


def test_console_script_next_to_interpreter():
    script = os.path.join(os.path.dirname(sys.executable), "overlap")
    if not os.path.exists(script):
        pytest.skip(f"no console script at {script} (overlap not installed in this environment)")
    proc = subprocess.run([script, "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    options = ("--nproc", "--op", "--mode", "--shape", "--dtype", "--strategies", "--warmup", "--iters", "--json")
    moe = ("moe", "T,H,F,E,K", "mixtral = 512,128,448,8,2", "deepseek-v3 = 512,224,64,32,8", "tiny")
    # argparse wraps the text at the terminal's width (lines also break after a hyphen): read it unwrapped
    text = re.sub(r"-\s+", "-", " ".join(proc.stdout.split()))
    for option in (*options, "--timeout", "fwd+bwd", "symm+one_shot", *OPS, *moe):
        assert option in text, f"{option} missing from bench --help:\n{proc.stdout}"


_NO_TORCH = textwrap.dedent("""\
    import sys
    from overlap.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
    sys.exit(code)
""")


@pytest.mark.parametrize(
    "args, code",
    [
        (("--help",), 0),
        (("--version",), 0),
        (("bench", "--help"), 0),
        (("tune", "--help"), 0),
        (("info", "--help"), 0),
        (("predict", "--help"), 0),
        (("predict", "--machine", "h900"), 2),
        (("tune", "--shape", "moe:8x8x8:4:2", "--nodes", "2"), 2),
        (("bench", "--shape", "3x4"), 2),
        (("bench", "--plot", "x.bmpx"), 2),
        (("bench", "--json", "/no/such/folder/x.json"), 2),
        (("bench", "--strategies", "reference,warp"), 2),
        (("info", "--nproc", "0"), 2),
    ],
)
def test_help_version_and_argument_errors_do_not_import_torch(args, code):
    """``overlap --help``, ``--version`` and argument errors answer without loading torch (quick start-up)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "torch imported: False" in proc.stderr, proc.stderr


def test_plot_format_and_unwritable_folder_exit_2(tmp_path):
    from overlap.cli import bench

    with pytest.raises(ValueError, match="--plot: the suffix"):
        bench.check_outputs(None, str(tmp_path / "x.bmpx"), None)
    with pytest.raises(ValueError, match="is a folder"):
        bench.check_outputs(str(tmp_path), None, None)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere
        pytest.skip("running as root: no folder is unwritable")
    with pytest.raises(ValueError, match="--json: .* is not writable"):
        bench.check_outputs(str(locked / "x.json"), None, None)


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
        ("bench", "--op", "all_gather_matmul,matmul_transpose"),
        ("bench", "--op", ","),
        ("bench", "--mode", "bwd"),
        ("bench", "--op", "all_gather_matmul", "--mode", "fwd", "--mode", "fwd+bwd+fwd"),
        ("bench", "--op", "all_gather_matmul", "--op", "matmul_reduce_scatter", "--strategies", "symm+one_shot"),
        ("bench", "--dtype", "float64"),
        ("bench", "--shape", "8,8,8,4"),
        ("bench", "--shape", "8,8,8,4,5"),  # top-k beyond the experts
        ("bench", "--shape", "8,8,8,0,1"),
        ("bench", "--shape", "mixtral-8x7b"),  # not a preset
        ("bench", "--op", "moe", "--shape", "8x8x8"),  # no MoE shape for moe
        ("bench", "--op", "moe,all_gather_matmul", "--shape", "mixtral"),  # no MxKxN for all_gather_matmul
        ("bench", "--op", "moe", "--strategies", "symm+one_shot"),
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


@pytest.mark.parametrize(
    "args, message",
    [
        # shapes that do not fit the ranks: a one-line error before any rank starts, as overlap demo's model
        (("bench", "--op", "moe", "--shape", "32,32,64,3,2"),
         "--shape: cannot run on 2 ranks: moe 32,32,64,3,2 float32: 3 experts do not split evenly over 2 ranks"),
        (("bench", "--ranks", "3", "--op", "moe"), "no default case of moe runs on 3 ranks"),
        (("bench", "--ranks", "3", "--shape", "llama3-8b"), "--shape llama3-8b does not apply to 3 ranks"),
        (("tune", "--shape", "moe:32x32x64:3:2"), "3 experts do not split evenly over 2 ranks"),
        (("tune", "--ranks", "2", "--model", "hidden=63,ffn=128,tokens=64"),
         "hidden (63) must divide by the tensor-parallel size 2"),
        (("tune", "--ranks", "4", "--model", "hidden=64,ffn=128,tokens=64,experts=6,topk=2"),
         "experts (6) must divide by the expert-parallel size 4"),
    ],
)
def test_problems_that_do_not_fit_the_ranks_exit_2_before_they_start(args, message, capsys, monkeypatch):
    from overlap import world
    from overlap.cli import main

    monkeypatch.setattr(world, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert message in err and err.strip().splitlines()[-1].startswith(f"overlap {args[0]}: error: "), err
    assert "Traceback" not in err, err


def test_torchrun_passes_every_option_of_ours_through():
    """torchrun's own parser reads the script's arguments too, and rejects one that abbreviates two of its
    options: ``--nproc`` (``--nproc-per-node``, ``--nproc_per_node``). Every other option of every command,
    ``--ranks`` included, reaches overlap as written."""
    from torch.distributed.run import get_args_parser

    from overlap.cli import build_parser

    torchrun = get_args_parser()
    commands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps its subparsers there
    for command, parser in commands.items():
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        if command == "predict":  # starts no rank: nothing of torchrun's applies
            assert "--ranks" not in options, options
            continue
        assert "--ranks" in options and "--nproc" in options, (command, options)
        for option in sorted(options - {"--nproc"}):
            argv = [command, option, "2"]
            try:
                parsed = torchrun.parse_args(["--nproc-per-node", "2", "-m", "overlap.cli", *argv])
            except SystemExit:
                pytest.fail(f"torchrun's parser rejects overlap {command} {option}")
            assert parsed.training_script_args == argv, (option, parsed)
    with pytest.raises(SystemExit):  # why --ranks exists: torchrun: error: ambiguous option: --nproc could match
        torchrun.parse_args(["--nproc-per-node", "2", "-m", "overlap.cli", "demo", "--nproc", "2"])


@pytest.mark.parametrize(
    "args, message",
    [
        (("--shape", "all_gather_matmul:64x128"), "needs"),
        (("--shape", "conv2d:1x2x3"), "unknown op"),
        (("--shape", "moe:8x8x8:4:2:int8"), "neither a dtype"),
        (("--nproc", "2"), "give --shape"),
        (("--shape", "moe:8x8x8:4:2", "--routing", "1,1,1"), "gives 3 experts' shares, moe:8x8x8"),
        (("--shape", "moe:8x8x8:4:2", "--routing", "1,x,1,1"), "--routing '1,x,1,1'"),
        (("--shape", "moe:8x8x8:4:2", "--routing", "1,-1,1,1"), "numbers >= 0"),
        (("--shape", "moe:8x8x8:4:2", "--routing", "@/nonexistent/loads.json"), "No such file"),
        (("--shape", "all_gather_matmul:8x8x8", "--routing", "1,1"), "the MoE problems' routing"),
    ],
)
def test_tune_bad_arguments_exit_2(args, message, capsys):
    from overlap.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["tune", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
