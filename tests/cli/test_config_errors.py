"""Configuration errors: one line, exit 2, before any rank starts (the command line); one exception, never a
chained duplicate (the API). And TRITON_INTERPRET read as Triton reads it, with ``fused`` on a CPU whose
interpreter the user turned off refused in one line.

The command line checks every variable of `overlap.envs` that has a rule (`overlap.envs.check`), the plan file
OVERLAP_PLAN names, the profile cache where the command may probe, and TRITON_INTERPRET where it runs ``fused`` on
CPU ranks (`overlap.cli.config.config_error`): ``overlap <command>: NAME='value': what is wrong; the fix``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from overlap import envs
from overlap.cli.config import config_error
from overlap.cli.parser import build_parser

NO_GPU = not torch.cuda.is_available()


def overlap_env(tmp_path, **env: str) -> dict[str, str]:
    """The environment of a run: this one, one torch thread, none of the variables under test but `env`, and a
    profile cache of its own (a probe is never cached where the user keeps theirs)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OVERLAP_") and k != "TRITON_INTERPRET"}
    return {**base, "OMP_NUM_THREADS": "1", "OVERLAP_CACHE_DIR": str(tmp_path / "cache"), **env}


def run_overlap(tmp_path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """The ``overlap`` console script beside this interpreter (else ``python -m overlap.cli``), as a user runs it."""
    script = os.path.join(os.path.dirname(sys.executable), "overlap")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "overlap.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=overlap_env(tmp_path, **env),
                          cwd=tmp_path)


def one_line(proc: subprocess.CompletedProcess, command: str, name: str) -> str:
    """The one stderr line of a configuration error of `command` naming the variable `name`, after checking exit 2
    and that nothing else was printed (no rank started: no rank writes a word, no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert len(lines) == 1 and proc.stdout == "", (proc.stdout, proc.stderr[-3000:])
    assert lines[0].startswith(f"overlap {command}: {name}"), lines[0]
    assert "Traceback" not in proc.stderr and "rank" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


# ----------------------------------------------------------------------------------------------
# The command line: one line, exit 2, before any rank starts (the cases of the issue, as a user runs them)
# ----------------------------------------------------------------------------------------------


def test_corrupt_plan_file_under_demo(tmp_path):
    """A corrupt OVERLAP_PLAN printed 145 lines (a chained traceback per rank)."""
    plans = tmp_path / "plans.json"
    plans.write_text("garbage{")
    line = one_line(run_overlap(tmp_path, ["demo", "--steps", "2"], OVERLAP_PLAN=str(plans)), "demo", "OVERLAP_PLAN")
    assert f"plan file {plans} is not valid JSON" in line and "re-run overlap tune" in line, line


@pytest.mark.parametrize("command, raw", [("bench", "abc"), ("info", "-1"), ("info", "0")])
def test_bad_timeout_variable(tmp_path, command, raw):
    """OVERLAP_TIMEOUT_S=abc was 17 lines of traceback; -1 and 0 printed the error twice."""
    line = one_line(run_overlap(tmp_path, [command], OVERLAP_TIMEOUT_S=raw), command, "OVERLAP_TIMEOUT_S")
    assert line.startswith(f"overlap {command}: OVERLAP_TIMEOUT_S={raw!r}: not a finite number of seconds > 0"), line
    assert "set one, or unset it" in line, line


def test_shm_dir_that_does_not_exist(tmp_path):
    """A raw FileNotFoundError that did not name the variable."""
    missing = tmp_path / "missing"
    line = one_line(run_overlap(tmp_path, ["demo"], OVERLAP_SHM_DIR=str(missing)), "demo", "OVERLAP_SHM_DIR")
    assert f"OVERLAP_SHM_DIR={str(missing)!r}: no such folder; point OVERLAP_SHM_DIR at" in line, line


def test_shm_dir_that_is_a_file(tmp_path, a_file):
    """A raw NotADirectoryError (and an atexit traceback)."""
    proc = run_overlap(tmp_path, ["bench"], OVERLAP_SHM_DIR=str(a_file))
    assert f"OVERLAP_SHM_DIR={str(a_file)!r}: not a folder" in one_line(proc, "bench", "OVERLAP_SHM_DIR")
    assert "atexit" not in proc.stderr, proc.stderr


def test_cache_dir_that_is_a_file_before_the_probe(tmp_path, a_file):
    """A bad OVERLAP_CACHE_DIR was found only after the probe (10-17 s)."""
    line = one_line(run_overlap(tmp_path, ["info", "--probe"], OVERLAP_CACHE_DIR=str(a_file)), "info",
                    "OVERLAP_CACHE_DIR")
    assert f"OVERLAP_CACHE_DIR={str(a_file)!r}: not a folder; point OVERLAP_CACHE_DIR at a folder" in line, line


@pytest.mark.skipif(not NO_GPU, reason="fused needs the interpreter only where no GPU exists")
@pytest.mark.parametrize("raw", ["0", "off", "banana"])
def test_fused_on_cpu_with_the_interpreter_off(tmp_path, raw):
    """`fused` on CPU died in Triton's "0 active drivers" with no hint."""
    proc = run_overlap(tmp_path, ["demo", "--strategy", "fused"], TRITON_INTERPRET=raw)
    line = one_line(proc, "demo", "TRITON_INTERPRET")
    assert f"TRITON_INTERPRET={raw!r}: Triton reads it as off" in line and "set it to 1" in line, line
    assert "active drivers" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------------
# The command line's check, without running a command: every variable with a rule, and where it applies
# ----------------------------------------------------------------------------------------------


def check(argv: list[str]) -> str | None:
    return config_error(build_parser().parse_args(argv))


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("OVERLAP_") or name == "TRITON_INTERPRET":
            monkeypatch.delenv(name)
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path / "cache"))
    return monkeypatch


@pytest.mark.parametrize("name, raw, says", [
    ("OVERLAP_TIMEOUT_S", "1e9", "not a finite number of seconds > 0 and at most 604800 (7 days); set one"),
    ("OVERLAP_TIMEOUT_S", "nan", "not a finite number of seconds"),
    ("OVERLAP_NETWORK_TIMEOUT_S", "inf", "not a finite number of seconds > 0"),
    ("OVERLAP_CHECK_EVERY_CALL", "maybe", "neither on (1, true, yes, on) nor off (0, false, no, off)"),
    ("OVERLAP_PLAN", "missing.json", "cannot be read: No such file or directory (or unset OVERLAP_PLAN)"),
])
@pytest.mark.parametrize("command", [["info"], ["bench"], ["demo"], ["tune", "--shape", "64x64x64"]])
def test_every_rank_command_checks_the_variables(clean_env, tmp_path, name, raw, says, command):
    clean_env.chdir(tmp_path)
    clean_env.setenv(name, raw)
    problem = check(command)
    assert problem is not None and problem.startswith(f"{name}={raw!r}: ") and says in problem, problem
    assert "\n" not in problem


def test_a_good_environment_passes(clean_env, tmp_path):
    plans = tmp_path / "plans.json"
    from overlap.plans import PlanFile

    PlanFile(topology="cpu:nodes=1:ranks=2:links=shm*1", world_size=2).save(plans)
    for name, raw in (("OVERLAP_TIMEOUT_S", " 2.5 "), ("OVERLAP_NETWORK_TIMEOUT_S", "30"),
                      ("OVERLAP_CHECK_EVERY_CALL", "Yes"), ("OVERLAP_SHM_DIR", str(tmp_path)),
                      ("OVERLAP_PLAN", str(plans)), ("TRITON_INTERPRET", "1")):
        clean_env.setenv(name, raw)
    for argv in (["info", "--probe"], ["bench"], ["demo", "--strategy", "fused"], ["tune", "--shape", "64x64x64"]):
        assert check(argv) is None, argv


def test_predict_reads_no_rank_variable(clean_env):
    """``overlap predict`` starts no rank and takes no deadline: a bad deadline does not stop it."""
    clean_env.setenv("OVERLAP_TIMEOUT_S", "abc")
    assert check(["predict", "--machine", "h100-sxm"]) is None


def test_cache_dir_must_be_writable_only_where_a_probe_may_save(clean_env, tmp_path, a_file):
    clean_env.setenv("OVERLAP_CACHE_DIR", str(a_file / "sub"))  # below a file: no folder, whoever runs it
    for argv in (["info", "--probe"], ["info", "--probe", "--refresh"], ["tune", "--shape", "64x64x64"], ["info"],
                 ["bench"]):
        problem = check(argv)
        assert problem is not None and problem.startswith("OVERLAP_CACHE_DIR="), (argv, problem)
        assert f"not a folder ({a_file} is a file)" in problem, problem
    if os.geteuid() == 0:
        return  # (root writes anywhere: the rest needs a folder this user cannot write)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    clean_env.setenv("OVERLAP_CACHE_DIR", str(locked / "overlap"))
    assert "a folder you cannot write" in check(["info", "--probe"])
    assert check(["info", "--probe", "--quick"]) is None  # a quick probe is never cached
    assert check(["tune", "--shape", "64x64x64", "--probe", "none"]) is None
    assert check(["bench"]) is None  # reads the cache at most


@pytest.mark.skipif(not NO_GPU, reason="fused needs the interpreter only where no GPU exists")
def test_fused_needs_the_interpreter_on_cpu_ranks(clean_env):
    clean_env.setenv("TRITON_INTERPRET", "false")
    for argv in (["demo", "--strategy", "fused"], ["bench"], ["bench", "--strategies", "symm,fused"]):
        problem = check(argv)
        assert problem is not None and problem.startswith("TRITON_INTERPRET='false': Triton reads it as off"), argv
    for argv in (["demo"], ["bench", "--strategies", "reference,symm"], ["info"]):
        assert check(argv) is None, argv  # auto never picks fused on CPU ranks
    clean_env.setenv("TRITON_INTERPRET", "ON")
    assert check(["demo", "--strategy", "fused"]) is None


# ----------------------------------------------------------------------------------------------
# TRITON_INTERPRET as Triton reads it
# ----------------------------------------------------------------------------------------------

INTERPRET_VALUES = [("0", False), ("off", False), ("banana", False), ("false", False), ("no", False), ("2", False),
                    (" 1", False), ("1 ", False), ("", False), ("1", True), ("true", True), ("TRUE", True),
                    ("on", True), ("Yes", True), ("y", True)]


@pytest.mark.parametrize("raw, on", INTERPRET_VALUES)
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, raw, on):
    """With Triton installed, its own reader decides (3.6 and 3.9 alike); its 3.9 rule otherwise."""
    monkeypatch.setenv("TRITON_INTERPRET", raw)
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip(f"Triton {triton.__version__} has no knobs")
    assert envs.triton_interpret() is bool(knobs.runtime.interpret), (raw, triton.__version__)
    if triton.__version__.startswith("3.9"):
        assert envs.triton_interpret() is on, raw
    assert (envs.triton_interpret_off() is None) is (envs.triton_interpret() or raw == ""), envs.triton_interpret_off()


@pytest.mark.parametrize("raw, on", INTERPRET_VALUES)
def test_triton_interpret_without_triton_reads_its_rule(monkeypatch, raw, on):
    monkeypatch.setenv("TRITON_INTERPRET", raw)
    monkeypatch.setitem(sys.modules, "triton._C.libtriton", None)  # as if not installed: ImportError
    assert envs.triton_interpret() is on
    assert (envs.triton_interpret_off() is None) is (on or raw == ""), envs.triton_interpret_off()


def test_triton_interpret_unset_or_empty_is_set_by_overlap_where_no_gpu_exists(monkeypatch):
    monkeypatch.setattr(envs, "TRITON_INTERPRET_SET_BY_OVERLAP", False)
    for raw in (None, ""):
        if raw is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", raw)
        assert not envs.triton_interpret_set_by_user()
        envs.set_triton_interpret()
        assert os.environ.get("TRITON_INTERPRET") == ("1" if NO_GPU else raw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the user's: left as it is
    envs.set_triton_interpret()
    assert os.environ["TRITON_INTERPRET"] == "0"


@pytest.mark.skipif(not NO_GPU, reason="fused needs the interpreter only where no GPU exists")
@pytest.mark.parametrize("raw", ["0", "off", "banana"])
def test_fused_refuses_in_one_line_where_the_interpreter_is_off(monkeypatch, raw):
    from overlap.cli.info import _software_lines
    from overlap.ops.fused import check_fused_available

    monkeypatch.setenv("TRITON_INTERPRET", raw)
    with pytest.raises(ValueError) as exc:
        check_fused_available("all_gather_matmul", torch.float32)
    text = str(exc.value)
    assert text.startswith("overlap.all_gather_matmul: strategy 'fused' is unavailable here: "
                           f"TRITON_INTERPRET={raw!r}: Triton reads it as off"), text
    assert "\n" not in text and "set it to 1" in text, text
    said = [ln for ln in _software_lines() if ln.startswith("TRITON_INTERPRET")]
    assert said == [f"TRITON_INTERPRET: off ({raw!r}, as Triton reads it): strategy 'fused' needs Triton's "
                    "interpreter where no GPU exists; unset TRITON_INTERPRET or set it to 1 to run it"], said
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_fused_available("all_gather_matmul", torch.float32)
    said = [ln for ln in _software_lines() if ln.startswith("TRITON_INTERPRET")]
    assert len(said) == 1 and said[0].startswith("TRITON_INTERPRET: on: Triton kernels run in the interpreter"), said


def test_auto_never_picks_fused_on_cpu_ranks():
    from overlap.plans.auto import heuristic_plan

    for dtype in ("float32", "bfloat16", "float16"):
        for rows in (None, 1, 128, 4096):
            assert heuristic_plan("all_gather_matmul", 2, True, "cpu", rows, dtype).strategy != "fused"


# ----------------------------------------------------------------------------------------------
# The API: one exception, no chained duplicate
# ----------------------------------------------------------------------------------------------


def unchained(exc: BaseException) -> None:
    """No other exception is shown with `exc` ("During handling of the above exception", "The above exception
    was the direct cause")."""
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__), (
        repr(exc), repr(exc.__cause__), repr(exc.__context__))


@pytest.mark.parametrize("content, says", [("garbage{", "is not valid JSON"), ("[]", "holds a JSON list"),
                                           ('{"version": 1}', "lacks the fields"), (None, "cannot be read")])
def test_plan_file_errors_are_one_exception(clean_env, tmp_path, content, says):
    from overlap.plans import PlanFile
    from overlap.plans.auto import env_plan_file

    plans = tmp_path / "plans.json"
    if content is not None:
        plans.write_text(content)
    with pytest.raises(ValueError, match=says) as exc:
        PlanFile.load(plans)
    unchained(exc.value)
    clean_env.setenv("OVERLAP_PLAN", str(plans))
    with pytest.raises(ValueError) as exc:
        env_plan_file()
    unchained(exc.value)
    assert str(exc.value).startswith(f"OVERLAP_PLAN={str(plans)!r}: plan file {plans}") and says in str(exc.value)


@pytest.mark.parametrize("raw", ["abc", "-1", "0", "inf"])
def test_timeout_variable_is_one_exception(monkeypatch, raw):
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", raw)
    for call in (envs.timeout_s, lambda: envs.resolve_timeout(None)):
        with pytest.raises(ValueError, match=rf"^OVERLAP_TIMEOUT_S={raw!r}: ") as exc:
            call()
        unchained(exc.value)


@pytest.mark.parametrize("value", ["symm", "fused", "pipelined", "auto", "symm+one_shot"])
def test_a_strategy_name_as_plan_says_where_it_goes(tmp_path, monkeypatch, value):
    from overlap.plans.auto import as_plan

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as exc:
        as_plan("auto", value)
    name = value.split("+")[0]
    assert str(exc.value).startswith(f"plan={value!r} names a strategy, but plan= takes a plan file"), exc.value
    assert f"pass strategy={name!r}, or plan=overlap.Plan({name!r}" in str(exc.value), exc.value
    (tmp_path / value).write_text("{}")  # a file of that name is a path, as before
    assert as_plan("auto", value) is None


_ONE_RANK = """
    import os, sys, traceback
    import torch, torch.distributed as dist
    import overlap, overlap.tune

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    said = []  # what a probe said it measured
    try:
        {call}
    except Exception as exc:
        print(type(exc).__name__, isinstance(exc, OSError), exc.__cause__ is None,
              exc.__context__ is None or exc.__suppress_context__, sep="|")
        print(str(exc))
        traceback.print_exc()
    print("said", said)
    dist.destroy_process_group()
"""


def run_one_rank(tmp_path, call: str, **env: str) -> tuple[list[str], str]:
    """`call` on a group of one CPU rank in a fresh interpreter: (the exception's facts and text, stderr)."""
    script = tmp_path / "one_rank.py"
    script.write_text(textwrap.dedent(_ONE_RANK).replace("{call}", call))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=240, env=overlap_env(tmp_path, **env), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines(), proc.stderr


@pytest.mark.parametrize("where", ["missing", "a-file"])
def test_shm_dir_is_an_os_error_naming_the_variable(tmp_path, a_file, where):
    folder = tmp_path / "missing" if where == "missing" else a_file
    out, err = run_one_rank(tmp_path, "overlap.reserve(None, 1024)", OVERLAP_SHM_DIR=str(folder))
    kind, is_os_error, no_cause, no_context = out[0].split("|")
    assert is_os_error == no_cause == no_context == "True", out
    assert out[1].startswith(f"[Errno {20 if where == 'a-file' else 2}] OVERLAP_SHM_DIR={str(folder)!r}: "), out
    assert "During handling" not in err and "direct cause" not in err, err
    assert "atexit" not in err and "Exception ignored" not in err, err  # nothing more at exit


def test_a_bad_call_timeout_and_a_bad_variable_are_one_exception(tmp_path):
    """`timeout=-1` with OVERLAP_TIMEOUT_S=-1: the variable's error once (it was raised while handling the
    argument's, and both were printed)."""
    call = "overlap.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 8), strategy='reference', timeout=-1)"
    out, err = run_one_rank(tmp_path, call, OVERLAP_TIMEOUT_S="-1")
    assert out[0] == "ValueError|False|True|True", out
    assert out[1].startswith("OVERLAP_TIMEOUT_S='-1': not a finite number of seconds"), out
    assert "During handling" not in err and err.count("Traceback") == err.count("ValueError: ") == 1, err


def test_probe_cached_refuses_an_unusable_cache_before_probing(tmp_path, a_file):
    call = "overlap.tune.probe_cached(quick=True, timeout=60, progress=said.append)"
    out, err = run_one_rank(tmp_path, call, OVERLAP_CACHE_DIR=str(a_file))
    kind, is_os_error, no_cause, no_context = out[0].split("|")
    assert is_os_error == no_cause == no_context == "True", out
    assert f"OVERLAP_CACHE_DIR={str(a_file)!r}: not a folder" in out[1], out
    assert out[-1] == "said []", out  # raised before any measurement
