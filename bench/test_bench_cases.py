"""pytest-benchmark wrappers of the benchmark cases: ``pytest bench/ --benchmark-only``.

The same cases as ``overlap bench`` (`overlap.benchmarks.cases.suite_cases`; ``--overlap-suite``:
``quick`` by default, ``default`` for all of ``overlap bench``'s, ``tiny`` for a smoke test), one test
per case and label: ``torch`` (the op in plain torch), ``reference``, every strategy, ``auto``, and the
plain collectives and the GEMMs alone (``comm-alone``, ``compute-alone``). The timing happens inside the
ranks: each round is one call timed on every rank between barriers, the slowest rank's time counts, and
the benchmarks' timer is a `RankClock` that reads exactly those times (`overlap.benchmarks.session`), so
pytest-benchmark's min/median/mean are the ranks' own. ``extra_info`` adds the ranks' median and
p25..p75, TFLOP/s or GB/s, and the speedup over ``torch`` (and over ``reference``) and the overlap
efficiency where the case's torch, reference and context labels ran earlier in the session (they run
first). Each case is checked against ``reference`` before its first timing; a strategy that does not
match fails its test.

Not collected by ``pytest`` or ``pytest tests`` (``testpaths`` is ``tests``). Without
``--benchmark-only`` the tests run the same way; with ``--benchmark-disable`` each runs one
unmeasured call; with ``--benchmark-skip`` they are skipped.

Examples::

    pytest bench/ --benchmark-only
    pytest bench/ --benchmark-only --overlap-suite default --benchmark-json out.json
    pytest bench/ --benchmark-only --overlap-suite tiny --overlap-op all_gather_matmul --overlap-rounds 3
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("pytest_benchmark", reason="pip install pytest-benchmark (or overlap[test])")

from overlap.benchmarks.cases import BENCH_OPS, suite_cases  # noqa: E402
from overlap.benchmarks.session import BenchSession, RankClock, case_labels, device_type_for  # noqa: E402

#: the timer of every benchmark here: the ranks' measured time (see the module docstring)
CLOCK = RankClock()


def _cases(config: pytest.Config) -> list[tuple[object, str]]:
    nproc = config.getoption("--overlap-nproc")
    device_type = device_type_for(nproc)
    cases = suite_cases(config.getoption("--overlap-suite"), device_type, nproc)
    ops = config.getoption("--overlap-op")
    if ops:
        keep = [o.strip() for o in ops.split(",") if o.strip()]
        unknown = [o for o in keep if o not in BENCH_OPS]
        if unknown:
            raise pytest.UsageError(f"--overlap-op: unknown ops {unknown}; known: {', '.join(BENCH_OPS)}")
        cases = [c for c in cases if c.op in keep]
    return [(case, label) for case in cases for label in case_labels(case, device_type)]


def _id(value: object) -> str:
    if isinstance(value, str):  # a label
        return value
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "-", f"{value.op} {value.shape} {value.dtype} {value.mode}")  # a case


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames and "label" in metafunc.fixturenames:
        params = _cases(metafunc.config)
        metafunc.parametrize(("case", "label"), params, ids=[f"{_id(c)}-{_id(label)}" for c, label in params])


@pytest.fixture(scope="session")
def overlap_session(request: pytest.FixtureRequest):
    """The session's ranks (started on first use, stopped after the last test)."""
    opt = request.config.getoption
    session = BenchSession(opt("--overlap-nproc"), seed=opt("--overlap-seed"), clock=CLOCK)
    yield session
    session.close()


@pytest.mark.benchmark(timer=CLOCK)
def test_case(benchmark, overlap_session: BenchSession, case, label: str, request: pytest.FixtureRequest) -> None:
    state = overlap_session.check(case)  # correctness first: once per case, on every rank
    name = overlap_session.label(case, label)
    if name in state.check["failed"]:
        pytest.fail(f"{case.name} {name} does not match reference: {state.check['failed'][name]}")
    if name not in state.check["timed"]:
        pytest.skip(f"{case.name}: {name} does not run on these ranks")
    rounds, warmup = overlap_session.rounds(
        case, label, request.config.getoption("--overlap-rounds"), request.config.getoption("--overlap-warmup")
    )
    benchmark.group = case.name
    benchmark.pedantic(overlap_session.call, args=(case, label), rounds=rounds, warmup_rounds=warmup, iterations=1)
    if benchmark.enabled:
        overlap_session.record(case, label, rounds)
    benchmark.extra_info.update(overlap_session.extra_info(case, label))
