"""The README and `docs/`: the front page stays short, every relative link resolves, every README script runs.

The README is the front page (at most `README_MAX_LINES` lines); the reference is the pages of `docs/`, the
measured figures `docs/results/`. A relative link must name a file of the repository (never one outside it)
and, where it has a fragment, a heading of that file (GitHub's anchors). Every ```` ```python ```` block of
the README is a complete script, run as written under torchrun on 2 CPU ranks. The environment-variable
table is checked against `overlap.envs` in ``test_facts.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 250
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


def readme_scripts() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)


def test_readme_has_the_three_ways_in():
    scripts = readme_scripts()
    assert len(scripts) == 3, [s.splitlines()[:3] for s in scripts]
    assert "overlap.all_gather_matmul" in scripts[0] and "overlap.nn." in scripts[1]
    assert "overlap.hooks.torch_tp" in scripts[2]


@pytest.mark.parametrize("index", range(3), ids=["ops", "nn", "hooks"])
def test_readme_script_runs(tmp_path, index):
    """The README's script, as written, under torchrun on 2 CPU ranks (each ends in destroy_process_group)."""
    script = readme_scripts()[index]
    assert script.rstrip().endswith("dist.destroy_process_group()"), script
    path = tmp_path / "script.py"
    path.write_text(script.replace("dist.destroy_process_group()",
                                   "print('finished', flush=True)\ndist.destroy_process_group()"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(path)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("finished") == 2, proc.stdout
