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
