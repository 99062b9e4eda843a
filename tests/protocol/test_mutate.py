"""The mutation command's planted bugs still apply to the sources (a refactor that moves a line must move its
mutation too), and each names tests that exist. The run itself (minutes) is `python -m tests.protocol.mutate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.protocol import mutate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("m", mutate.MUTATIONS, ids=lambda m: m.name)
def test_every_planted_bug_applies_and_names_existing_tests(m):
    original = (ROOT / m.path).read_text()
    mutated = m.apply(original)
    assert mutated is not None and mutated != original, f"{m.name}: {m.path} no longer has the text it changes"
    files = [t for t in m.tests if t.endswith(".py")]
    assert files and all((ROOT / f).is_file() for f in files), m.tests


def test_the_list_covers_each_implementation():
    assert {m.name.split(":")[0] for m in mutate.MUTATIONS} == {"Triton", "C++", "CUDA", "Python"}
    assert len({m.name for m in mutate.MUTATIONS}) == len(mutate.MUTATIONS)
