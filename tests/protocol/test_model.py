"""The flag protocol model-checked (`tests.protocol.model`): every interleaving of the actors of a few small
configurations holds every property, and every planted bug of `tests.protocol.spec.MUTATIONS` is found. The state
counts and times are in the run's terminal summary (tests/protocol/conftest.py)."""

from __future__ import annotations

import pytest

from tests.protocol import model, spec

#: what CI explores: two and three ranks, two and three chunks, two calls, a dead peer (in-kernel deadlines and the
#: host watchdog), epochs across the int32 and uint32 wraps; `python -m tests.protocol.mutate --full` adds larger ones
CONFIGS = [
    model.Config(ranks=2, chunks=2, tiles=2),
    model.Config(ranks=3, chunks=2, tiles=1),
    model.Config(ranks=2, chunks=3, tiles=1),
    model.Config(ranks=2, chunks=2, tiles=2, dead=1),
    model.Config(ranks=2, chunks=2, tiles=2, dead=1, stream=True),
    model.Config(ranks=2, chunks=2, tiles=2, first_epoch=2**31 - 1),
    model.Config(ranks=2, chunks=2, tiles=2, first_epoch=-1),
    model.Config(ranks=2, chunks=2, tiles=2, first_epoch=2**30, rebase=True),  # REBASE_EPOCH, then epoch 1
    model.Config(ranks=2, chunks=2, tiles=1, first_epoch=2**30, rebase=True, dead=1),
]
FULL = [model.Config(ranks=3, chunks=2, tiles=2), model.Config(ranks=3, chunks=2, tiles=2, dead=1, stream=True)]
#: the order the planted bugs are looked for in: the smallest state spaces first
SEARCH = sorted(CONFIGS, key=lambda c: (c.rebase, c.dead is None, c.ranks * c.chunks * c.tiles, c.first_epoch != 7))

#: which property each planted bug breaks
EXPECTED = {
    "the flag's release made relaxed": "early read",
    "the flag's acquire made relaxed": "early read",
    "the flag's scope narrowed to the GPU": "early read",
    "the barrier before the count removed": "early read",
    "the count made relaxed": "early read",
    "the last-tile test off by one (early)": "early read",
    "the last-tile test off by one (never)": "counter",
    "the counter never reset": "counter",
    "the data written after the flag": "early read",
    "a wait without its deadline": "hang",
    "the epoch comparison off by one": "early read",
    "the epoch comparison without the wrap": "early read",
    "the watchdog raises the flag before the error word": "early read",
    "the watchdog's raise made relaxed": "early read",
    "a passed wait not reading the error word": "early read",
    "a heap unmapped after a raising call": "released heap",
    "the re-base leaving the flags": "early read",
}

RESULTS: list[model.Result] = []  # read by the terminal summary


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
def test_every_interleaving_keeps_every_property(config):
    result = model.check(config)
    RESULTS.append(result)
    assert result.violation is None, f"{result.summary()}\n  " + "\n  ".join(result.trace)
    assert result.states > 10, result.summary()  # it explored something


@pytest.mark.parametrize("name", list(spec.MUTATIONS))
def test_every_planted_bug_is_found(name):
    """The first configuration of `SEARCH` that finds the bug, and the property it breaks."""
    found = None
    for config in SEARCH:
        result = model.check(config, spec.MUTATIONS[name])
        if result.violation is not None:
            found = result
            break
    assert found is not None, f"{name}: no configuration finds it"
    RESULTS.append(found)
    assert found.violation.startswith(EXPECTED[name]), (name, found.violation)
    assert found.trace and found.trace[-1] == "(the violating step)", found.trace


def test_every_planted_bug_has_its_expected_property():
    assert set(EXPECTED) == set(spec.MUTATIONS)


@pytest.mark.parametrize("flag, epoch, reached", [
    (7, 7, True), (6, 7, False), (8, 7, True),
    (2**31 - 1, -(2**31), False),  # the call before, across the int32 wrap
    (-(2**31), 2**31 - 1, True),
    (-1, 0, False), (0, -1, True),  # across the uint32 wrap
])
def test_epochs_compare_as_a_wrapping_difference(flag, epoch, reached):
    assert spec.PROTOCOL.reached(flag, epoch) is reached
