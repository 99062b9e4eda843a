"""Tier 1, the facts layer: environment variables read when asked for, the one timeout resolver
(`overlap.envs`)."""

from __future__ import annotations

import pytest

from overlap import envs


def test_environment(monkeypatch):
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", "2.5")
    assert envs.timeout_s() == 2.5
    monkeypatch.setenv("OVERLAP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="OVERLAP_TIMEOUT_S"):
        envs.timeout_s()
    monkeypatch.delenv("OVERLAP_TIMEOUT_S")
    assert envs.timeout_s() == 300.0
    with pytest.raises(ValueError, match="timeout"):
        envs.resolve_timeout(0)


def readme_env_table() -> list[str]:
    """The variables of the README's "Environment variables" table, in order."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z_0-9]+)` \|", section, re.M)


def test_readme_environment_table_is_envs_table():
    names = readme_env_table()
    assert len(names) == len(set(names)), f"a variable listed twice: {names}"
    assert set(names) == set(envs.VARIABLES), (
        f"README only: {sorted(set(names) - set(envs.VARIABLES))}; envs.VARIABLES only: "
        f"{sorted(set(envs.VARIABLES) - set(names))}"
    )
