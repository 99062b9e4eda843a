"""Files on a shared host: written files take the umask's mode and are never world-writable (`write_atomic`: plan
files, cached profiles), ``overlap tune --out`` merges into an existing plan file (and refuses one it cannot
read), the profile cache follows ``XDG_CACHE_HOME``, ``--timeout`` refuses what ``timeout=`` refuses.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from overlap import envs
from overlap.plans import Entry, Plan, PlanFile, Problem, Topology, default_profile
from overlap.plans.planfile import merge_into, write_atomic

# ---- modes ---------------------------------------------------------------------------------------


def _with_umask(mask: int, fn):
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600), (0o027, 0o640),
                                         (0o000, 0o664)])
def test_written_files_take_the_umask_never_world_writable(tmp_path, umask, mode):
    """mkstemp then rename left every plan file and cached profile 0600 whatever the umask; now open()'s
    0o666 less the umask, less write for others."""
    path = tmp_path / "sub" / "plans.json"
    _with_umask(umask, lambda: write_atomic(path, "{}\n"))
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in path.parent.iterdir()] == ["plans.json"]  # no temporary file left
    path.chmod(0o600)
    _with_umask(umask, lambda: write_atomic(path, "[]\n"))  # over an existing file: the new file's mode
    assert stat.S_IMODE(path.stat().st_mode) == mode and path.read_text() == "[]\n"


def test_plan_files_and_cached_profiles_take_the_umask(tmp_path, monkeypatch):
    import torch

    from overlap.tune.cache import save_cached
    from overlap.world import GroupInfo

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path / "cache"))
    info = GroupInfo(rank=0, world_size=1, global_ranks=(0,), nodes=("n0",), pids=(0,), backend="gloo",
                     device=torch.device("cpu"), peer_access=(False,))
    pf = PlanFile.new(Topology("cpu", 1, 1, 1), 1)
    for umask, mode in ((0o022, 0o644), (0o002, 0o664)):
        plan_path = tmp_path / f"plans-{umask:o}.json"
        _with_umask(umask, lambda p=plan_path: pf.save(p))
        profile_path = _with_umask(umask, lambda: save_cached(default_profile("cpu"), info))
        for path in (plan_path, profile_path):
            got = stat.S_IMODE(os.stat(path).st_mode)
            assert got == mode and not got & stat.S_IWOTH, (path, oct(got))


def test_write_atomic_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """The temporary file is a new one (O_EXCL): a link planted at the temporary name is never followed, another
    name is taken."""
    target = tmp_path / "victim"
    target.write_text("keep")
    path = tmp_path / "plans.json"
    names = iter([b"\0" * 6, b"\1" * 6])
    monkeypatch.setattr(os, "urandom", lambda n: next(names))
    planted = tmp_path / f".plans.json.{'00' * 6}.tmp"
    planted.symlink_to(target)
    write_atomic(path, "new\n")
    assert target.read_text() == "keep" and path.read_text() == "new\n" and not path.is_symlink()
    assert planted.is_symlink()


# ---- the profile cache's folder --------------------------------------------------------------------


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("OVERLAP_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_dir() == str(tmp_path / "xdg" / "overlap")
    from overlap.tune.cache import cache_dir

    assert cache_dir() == tmp_path / "xdg" / "overlap"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: a relative path is ignored
    assert envs.cache_dir() == str(tmp_path / "home" / ".cache" / "overlap")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert envs.cache_dir() == str(tmp_path / "home" / ".cache" / "overlap")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.cache_dir() == str(tmp_path / "home" / ".cache" / "overlap")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("OVERLAP_CACHE_DIR", "~/mine")  # the variable wins
    assert envs.cache_dir() == str(tmp_path / "home" / "mine")


def test_variables_say_where_the_cache_is():
    default, meaning = envs.VARIABLES["OVERLAP_CACHE_DIR"]
    assert "XDG_CACHE_HOME" in default and "~/.cache/overlap" in default, default


# ---- overlap tune --out merges -------------------------------------------------------------------

TOPO2 = "cpu:nodes=1:ranks=2:links=shm*1"
OLD = Problem("matmul_reduce_scatter", 8, 16, 16)
BOTH = Problem("all_gather_matmul", 8, 16, 16)
NEW = Problem("matmul_all_reduce", 8, 16, 16)


def _file(topology: str, entries: list[Entry], world_size: int = 2) -> PlanFile:
    pf = PlanFile(topology=topology, world_size=world_size, profile=default_profile("cpu"))
    for e in entries:
        pf.add(e)
    return pf


def test_merge_into_keeps_other_entries_and_replaces_the_same(tmp_path):
    path = tmp_path / "plans.json"
    new = _file(TOPO2, [Entry(BOTH, Plan("symm"), 1.0, 2.0), Entry(NEW, Plan("pipelined"), 1.0, 2.0)])
    assert merge_into(path, new) is new  # no file: the new one as it is
    _file(TOPO2, [Entry(OLD, Plan("symm"), 1.0, 2.0), Entry(BOTH, Plan("reference"), 3.0, 3.0)]).save(path)
    merged = merge_into(path, new)
    assert set(merged.entries) == {OLD.key, BOTH.key, NEW.key}
    assert merged.entries[BOTH.key].plan == Plan("symm") and merged.entries[OLD.key].plan == Plan("symm")
    assert merged.created == new.created and merged.profile == new.profile


@pytest.mark.parametrize("content, says", [("{truncated", "is not valid JSON"), ("[]", "holds a JSON list"),
                                           (None, "holds plans of topology")])
def test_merge_into_refuses_a_file_it_cannot_merge(tmp_path, content, says):
    path = tmp_path / "plans.json"
    if content is None:
        _file("cpu:nodes=1:ranks=4:links=shm*3", [Entry(OLD, Plan("symm"))], world_size=4).save(path)
        content = path.read_text()
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"plan file {path} .*{says}"):
        merge_into(path, _file(TOPO2, [Entry(NEW, Plan("symm"))]))
    assert path.read_text() == content


def tune_rank_task(rank, world_size, path, existing):
    """`overlap.cli.tune.tune_rank` with a stand-in search (the plans of NEW and BOTH): what rank 0 writes to
    `path`, which holds `existing` (JSON text) or nothing, or the ValueError every rank raises."""
    import overlap.tune.search as search
    from overlap import world
    from overlap.cli.tune import TuneConfig, tune_rank
    from overlap.plans import topology_of

    if rank == 0 and existing is not None:
        with open(path, "w") as f:
            f.write(existing)
    import torch.distributed as dist

    dist.barrier()  # (the file is there before any rank looks)
    searched = []

    def fake_tune(problems, **kwargs):
        searched.append([p.key for p in problems])
        topology = topology_of(world.group_info())
        pf = PlanFile.new(topology, profile=default_profile("cpu"))
        pf.add(Entry(BOTH, Plan("symm"), 1.0, 2.0))
        pf.add(Entry(NEW, Plan("pipelined"), 1.0, 2.0))
        return pf, []

    real = search.tune
    search.tune = fake_tune
    try:
        config = TuneConfig([f"{BOTH.op}:8x16x16:fwd", f"{NEW.op}:8x16x16:fwd"], None, path, probe="none")
        try:
            lines = tune_rank(config)
        except ValueError as exc:
            return "error", str(exc), searched
        return "ok", lines, searched
    finally:
        search.tune = real


def test_tune_merges_into_the_out_file(pools, tmp_path):
    """``overlap tune --out FILE`` overwrote FILE: the plans tuned before for other shapes were lost."""
    path = str(tmp_path / "plans.json")
    existing = json.dumps(_file(TOPO2, [Entry(OLD, Plan("symm"), 1.0, 2.0),
                                        Entry(BOTH, Plan("reference"), 3.0, 3.0)]).to_json())
    results = pools(2).run(tune_rank_task, path, existing)
    assert [r[0] for r in results] == ["ok", "ok"], results
    assert any("3 entries, 1 of them kept from the file" in ln for ln in results[0][1]), results[0][1]
    merged = PlanFile.load(path)
    assert set(merged.entries) == {OLD.key, BOTH.key, NEW.key}
    assert merged.entries[BOTH.key].plan == Plan("symm")  # replaced by the new plan
    assert merged.entries[OLD.key].plan == Plan("symm") and merged.entries[OLD.key].measured_s == 1.0  # kept


@pytest.mark.parametrize("kind", ["not json", "another topology"])
def test_tune_refuses_an_out_file_it_cannot_merge_on_every_rank_before_tuning(pools, tmp_path, kind):
    path = str(tmp_path / "plans.json")
    if kind == "not json":
        existing = "{ this is no plan file"
    else:
        existing = json.dumps(_file("cpu:nodes=1:ranks=4:links=shm*3", [Entry(OLD, Plan("symm"))], 4).to_json())
    results = pools(2).run(tune_rank_task, path, existing)
    for status, text, searched in results:
        assert status == "error" and f"plan file {path}" in text and searched == [], results
    with open(path) as f:
        assert f.read() == existing  # left as it was


def test_tune_out_that_is_no_plan_file_exits_2_before_any_rank_starts(tmp_path):
    out = tmp_path / "plans.json"
    out.write_text("not a plan file")
    proc = subprocess.run([sys.executable, "-m", "overlap.cli", "tune", "--nproc", "2", "--shape",
                           "all_gather_matmul:8x16x16", "--probe", "none", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"overlap tune: error: --out: plan file {out} is not valid JSON"), last
    assert out.read_text() == "not a plan file"


def test_tune_help_says_out_merges(capsys):
    from overlap.cli.parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--help"])
    assert "the new plans are merged into it" in " ".join(capsys.readouterr().out.split())


# ---- --timeout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["tune", "--shape", "all_gather_matmul:8x8x8"], ["bench"]])
@pytest.mark.parametrize("value", ["inf", "nan", "1e9", "0"])
def test_timeout_option_refuses_what_timeout_refuses(command, value, capsys):
    from overlap.cli.parser import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--timeout", value])
    assert exc.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_timeout_option_takes_a_week():
    from overlap.cli.parser import build_parser

    assert build_parser().parse_args(["bench", "--timeout", "604800"]).timeout == 604800.0
