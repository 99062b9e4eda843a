"""Options and the session-wide ranks of the pytest-benchmark wrappers (``pytest bench/ --benchmark-only``).

The cases are defined once, in `overlap.benchmarks.cases` (`suite_cases`); ``--overlap-suite``
picks a named selection of them, ``--overlap-op`` narrows it to some ops. The ranks are started
once per session (the ``overlap_session`` fixture of ``test_bench_cases.py``) and stopped after the
last test.
"""

from __future__ import annotations

import pytest

from overlap.benchmarks.cases import BENCH_OPS, SUITES


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("overlap", "overlap benchmark cases (bench/)")
    group.addoption("--overlap-suite", default="quick", choices=tuple(SUITES),
                    help="which cases: " + "; ".join(f"{k}: {v}" for k, v in SUITES.items()) + " (default: quick)")
    group.addoption("--overlap-op", default=None, metavar="LIST",
                    help=f"comma-separated ops to keep, among {', '.join(BENCH_OPS)} (default: all)")
    group.addoption("--overlap-nproc", type=int, default=2, metavar="N", help="local ranks (default: 2)")
    group.addoption("--overlap-rounds", type=int, default=10, metavar="R",
                    help="timed calls per case and strategy (default: 10; interpreted fused: at most 3)")
    group.addoption("--overlap-warmup", type=int, default=3, metavar="W",
                    help="untimed calls first (default: 3; interpreted fused: none)")
    group.addoption("--overlap-emulated", default=None, metavar="RATES",
                    help="also run the emulated two-node cluster (python -m bench.emulated_cluster; root) at these "
                    "comma-separated link rates, e.g. 100mbit,2gbit: tuner against the exhaustive grid")
    group.addoption("--overlap-seed", type=int, default=None, metavar="S",
                    help="seed of the inputs (default: a fresh one, in every result's extra_info)")
