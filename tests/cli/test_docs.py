"""The README and `docs/`: the front page stays short, every relative link resolves, every README command and
script works as written.

The README is the front page (at most `README_MAX_LINES` lines); the reference is the pages of `docs/`, the
measured figures `docs/results/`. A relative link must name a file of the repository (never one outside it)
and, where it has a fragment, a heading of that file (GitHub's anchors). The quick start is two commands, the
second of which `.ci/run` runs verbatim; the first check after it works after the first command alone (it
installs the test tools it runs), and `.ci/run` runs both in a fresh clone, reading them here (`quick_start`,
`quick_check`). Every ```` ```python ```` block of the README is a complete script, run as the README says
(``.venv/bin/torchrun --nproc-per-node 2 script.py``) on 2 CPU ranks, each rank printing what it checked. The
environment-variable table is checked against `overlap.envs` in ``test_facts.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 250
CI_RUN = ROOT / ".ci" / "run"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a link inside code is not a link)."""
    return _FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The fragment ids GitHub gives the headings of a Markdown file (duplicates get ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for title in _HEADING.findall(prose(text)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_anchor_rules():
    """The slug rules on headings like the docs' own."""
    text = ("# A\n## `overlap tune` and plan files\n## Fully sharded weights (FSDP): `all_gather_weight_matmul`\n"
            "## 7. Testing tiers and the CI budget\n## torch.compile\n## torch's API\n## Notes\n## Notes\n"
            "```\n## not a heading\n```\n")
    assert anchors(text) == {"a", "overlap-tune-and-plan-files", "fully-sharded-weights-fsdp-all_gather_weight_matmul",
                             "7-testing-tiers-and-the-ci-budget", "torchcompile", "torchs-api", "notes", "notes-1"}


def test_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move text to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_reached_from_the_readme():
    """Every page of docs/ is linked from the README or from a page the README reaches."""
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in relative_links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in reached:
                reached.add(dest)
                todo.append(dest)
    assert not [p for p in PAGES if p not in reached], [str(p.relative_to(ROOT)) for p in PAGES if p not in reached]


# ----------------------------------------------------------------------------------------------
# The quick start and the first check
# ----------------------------------------------------------------------------------------------


def _quick_start_blocks() -> list[list[str]]:
    """The ```` ```bash ```` blocks of the README's "Quick start" section, each as its command lines."""
    section = README.read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return [block.strip().splitlines() for block in re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)]


def quick_start() -> list[str]:
    """The README's two quick-start commands: install and benchmark; install the test tools and run the tests."""
    return _quick_start_blocks()[0]


def quick_check() -> str:
    """The README's first check, the one command of the section's second block (`.ci/run` runs it)."""
    (command,) = _quick_start_blocks()[1]
    return command


def test_quick_start_is_two_commands_and_ci_runs_the_second_verbatim():
    blocks = _quick_start_blocks()
    assert [len(b) for b in blocks] == [2, 1], blocks
    first, second = quick_start()
    assert first.startswith("python3 -m venv .venv && ") and first.endswith(" && .venv/bin/overlap bench"), first
    assert second.startswith("python3 -m venv .venv && ") and second.endswith(" && .venv/bin/python -m pytest tests")
    assert second in CI_RUN.read_text().splitlines(), f".ci/run does not run the README's test command {second!r}"


def test_quick_check_installs_what_it_runs():
    """The first command installs overlap without the test tools (no pytest) and not editable (the clone then has
    no built `_C`, and the tests import overlap from the clone): the check installs both itself, then runs pytest.
    `.ci/run` runs the first command and then the check, both read from the README, in a fresh clone."""
    first, _ = quick_start()
    assert "[test]" not in first and " -e " not in first, first
    install, run = quick_check().split(" && ")
    assert shlex.split(install) == [".venv/bin/pip", "install", "-e", ".[test]"], install
    assert shlex.split(run)[:3] == [".venv/bin/python", "-m", "pytest"], run
    ci = CI_RUN.read_text()
    for step in ("git clone", "quick_start()[0]", "quick_check()"):
        assert step in ci, f".ci/run does not run the README's first command and first check in a fresh clone: {step}"


def test_quick_check_selects_every_op_and_no_interpreted_fused():
    """The check selects the oracle tests of the four tensor-parallel ops and of the MoE layer, none of the
    interpreted `fused` (`-k "not fused"` would drop `test_matches_unfused` too), and about as many as the README
    says (pytest's collection only)."""
    args = shlex.split(quick_check().split(" && ")[1])[3:]  # after ".venv/bin/python -m pytest"
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    files = {i.partition("::")[0] for i in ids}
    ops = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul")
    missing = [f for f in (*(f"tests/ops/test_{op}.py" for op in ops), "tests/moe/test_moe.py") if f not in files]
    assert not missing, f"the first check selects no test of {missing}"
    assert not [i for i in ids if "interpreted" in i], [i for i in ids if "interpreted" in i]
    said = int(re.search(r"less the interpreted `fused` \(about (\d+)\)", " ".join(README.read_text().split()))[1])
    assert abs(len(ids) - said) <= said // 5, f"the first check selects {len(ids)} tests; the README says about {said}"


# ----------------------------------------------------------------------------------------------
# The three scripts
# ----------------------------------------------------------------------------------------------

SCRIPT_CHECKS = {  # what each README script prints (rank 0, once every rank has passed its checks) on 2 ranks
    "ops": "all_gather_matmul, then matmul_reduce_scatter, on 2 ranks: equal to x @ w_up.T @ w_down.T",
    "nn": "ColumnParallelLinear, then RowParallelLinear, on 2 ranks: output and weight gradients as nn.Linear's",
    "hooks": "overlap's styles on 2 ranks: output and every gradient equal to the unparallelized model's",
}


def readme_scripts() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)


def readme_script_command() -> str:
    """The command the README gives for its scripts."""
    (command,) = re.findall(r"`([^`\n]*torchrun [^`\n]*script\.py)`", prose(README.read_text()))
    return command


def test_readme_has_the_three_ways_in():
    scripts = readme_scripts()
    assert len(scripts) == 3, [s.splitlines()[:3] for s in scripts]
    assert "overlap.all_gather_matmul" in scripts[0] and "overlap.nn." in scripts[1]
    assert "overlap.hooks.torch_tp" in scripts[2]


def test_readme_runs_scripts_with_the_venvs_torchrun():
    """The quick start never activates the venv, so `torchrun` is on no PATH: the README says `.venv/bin/torchrun`
    wherever it gives a torchrun command."""
    assert readme_script_command() == ".venv/bin/torchrun --nproc-per-node 2 script.py"
    bare = re.findall(r"(?:^|[\s`(])(torchrun --[^`\n]*)", prose(README.read_text()))
    assert not bare, f"README: a torchrun command without .venv/bin/: {bare}"


@pytest.mark.parametrize("index, name", list(enumerate(SCRIPT_CHECKS)), ids=list(SCRIPT_CHECKS))
def test_readme_script_runs(tmp_path, index, name):
    """The README's script, as written, run by the README's command (its ``.venv/bin/`` being this interpreter's
    folder) on 2 CPU ranks: rank 0 prints what was checked, and nothing else goes to stdout."""
    (tmp_path / "script.py").write_text(readme_scripts()[index])
    command = shlex.split(readme_script_command())
    torchrun = Path(sys.executable).parent / Path(command[0]).name
    assert command[0].startswith(".venv/bin/") and torchrun.exists(), (command, torchrun)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), *command[1:]], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines() == [SCRIPT_CHECKS[name]], proc.stdout
