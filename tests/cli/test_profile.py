"""``overlap bench --profile``: `overlap.stages` (each stage's own time, inner stages taken out, a helper thread's
apart, nothing collected outside a profile), and the MoE ops' stages as the benchmark reports them: every stage a
strategy runs is there, the parts add up to the call, the plain rows have none. Timings are never compared with
a threshold: the clock is a fake one where the numbers matter."""

from __future__ import annotations

import threading

import pytest

from overlap import stages


class _Clock:
    """`time.perf_counter` stand-in: advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stage_counts_its_own_time_inner_stages_taken_out(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(stages.time, "perf_counter", clock)

    @stages.timed("gemm")
    def gemm():
        clock.now += 2.0
        return "done"

    with stages.collecting() as got:
        with stages.stage("send"):
            clock.now += 1.0
            with stages.stage("wait"):
                clock.now += 4.0
            assert gemm() == "done"
            clock.now += 0.5
        with stages.stage("wait"):  # a stage met twice adds up
            clock.now += 3.0
        thread = threading.Thread(target=lambda: stages.stage("send").__enter__().__exit__())
        thread.start()
        thread.join()
    assert got == {"send": 1.5, "wait": 7.0, "gemm": 2.0, "send" + stages.HELPER: 0.0}, got
    with stages.collecting() as again:  # a fresh collection
        with stages.stage("route"):
            clock.now += 1.0
    assert again == {"route": 1.0}


def test_nothing_is_collected_outside_a_profile():
    assert stages.stage("wait") is stages.stage("gemm")  # one shared no-op context, off
    with stages.stage("wait"):
        pass
    assert stages.timed("gemm")(lambda x: x + 1)(1) == 2
    with stages.collecting() as got:
        pass
    assert got == {}


def profile_task(rank, world_size, seed):
    """A small MoE case (fwd+bwd) checked and profiled as ``overlap bench --profile`` does."""
    import torch.distributed as dist

    from overlap import world
    from overlap.benchmarks.cases import BenchConfig
    from overlap.benchmarks.checks import check_case
    from overlap.benchmarks.definitions import MoECase, MoEShape
    from overlap.benchmarks.report import profile_lines
    from overlap.benchmarks.timing import profile_case

    pg = dist.group.WORLD
    info = world.group_info(pg, 60.0)
    case = MoECase.of(MoEShape(tokens=16, hidden=8, ffn=12, experts=2 * world_size, top_k=2), backward=True)
    config = BenchConfig(ops=("moe",), cases=(case,), strategies=("reference", "pipelined", "symm"), timeout=60.0,
                         progress=False, profile=True)
    checked = check_case(case, 0, config, seed, info, pg)
    profiles = profile_case(checked, config, info, pg)
    rows = [dict(case=case.name, strategy=label, profile_ms=p) for label, p in profiles.items()]
    return profiles, profile_lines(rows)


def test_bench_profile_splits_each_strategy_by_stage(pools, seed):
    for profiles, lines in pools(2).run(profile_task, seed, timeout=180):
        for label in ("reference", "pipelined", "symm"):
            p = profiles[label]
            parts = sum(v for k, v in p.items() if k != "total" and not k.endswith(stages.HELPER))
            assert parts == pytest.approx(p["total"], rel=1e-6, abs=1e-9) or p["outside"] == 0.0, (label, p)
            for name in ("preamble", "route", "wait", "gemm", "receive", "sum"):
                assert p.get(name, 0.0) > 0.0, (label, name, p)
        assert "counts" in profiles["reference"] and "counts" in profiles["pipelined"], profiles
        assert set(profiles["torch"]) == {"total", "outside"}, profiles["torch"]  # plain torch: no stage of ours
        assert lines[0].strip().startswith("host time per stage"), lines
        assert any(line.strip().startswith("symm") and "gemm" in line for line in lines), lines
        assert all(len(line) <= 120 for line in lines), lines


def test_bench_takes_profile():
    from overlap.cli.parser import build_parser

    assert build_parser().parse_args(["bench", "--profile"]).profile is True
    assert build_parser().parse_args(["bench"]).profile is False
