"""torch.compile: every op traced with no graph break, compiled results bitwise eager's, collective order kept.

Each op is a `torch.library` custom op (`overlap.ops.library`); the tasks (`support.compile_tasks`) compile
functions with ``fullgraph=True`` (a graph break raises), so a passing task also proves there is none;
`torch._dynamo.explain` counts them besides. Most use the ``aot_eager`` backend (AOTAutograd's graphs, run
eagerly: the op implementations see the same inputs, so results are bitwise eager's); one test per family
compiles with inductor (CPU), whose fused code around the ops rounds differently (checked to tolerance).
"""

from __future__ import annotations

import pytest
from support import compile_tasks

STRATEGIES = ("reference", "pipelined", "symm")


@pytest.mark.parametrize("world_size", [2, 3])
def test_tp_ops_compile_bitwise(pools, seed, world_size):
    results = pools(world_size).run(compile_tasks.tp_ops, seed, STRATEGIES, "symm", timeout=300)
    for rank, cases in enumerate(results):
        assert len(cases) == 3 * len(STRATEGIES)
        for op, strategy, r in cases:
            assert r["bitwise"], f"rank {rank} {op} {strategy}: compiled differs from eager by {r['max_diff']}"
            if strategy == "symm":
                assert r["breaks"] == 0, f"rank {rank} {op}: {r['breaks']} graph breaks"


@pytest.mark.parametrize("world_size", [2, 3])
def test_weight_gather_compiles_bitwise(pools, seed, world_size):
    """all_gather_weight_matmul: no graph break, compiled (aot_eager) results and gradients bitwise eager's."""
    for rank, cases in enumerate(pools(world_size).run(compile_tasks.weight_gather, seed, STRATEGIES, timeout=300)):
        assert [s for s, _ in cases] == list(STRATEGIES)
        for strategy, r in cases:
            assert r["bitwise"], f"rank {rank} {strategy}: compiled differs from eager by {r['max_diff']}"
            assert r["breaks"] == 0, f"rank {rank} {strategy}: {r['breaks']} graph breaks"


def test_weight_gather_fused_interpreted_compiles(pools, seed):
    for rank, cases in enumerate(pools(2).run(compile_tasks.weight_gather, seed, ("fused",), timeout=600)):
        for strategy, r in cases:
            assert r["bitwise"] and r["breaks"] == 0, f"rank {rank} {strategy}: {r}"


def test_tp_fused_interpreted_compiles(pools, seed):
    results = pools(2).run(compile_tasks.tp_ops, seed, ("fused",), "fused", timeout=600)
    for rank, cases in enumerate(results):
        for op, _, r in cases:
            assert r["bitwise"] and r["breaks"] == 0, f"rank {rank} {op} fused: {r}"


def test_tp_inductor_within_tolerance(pools, seed):
    for rank, r in enumerate(pools(2).run(compile_tasks.tp_inductor, seed, timeout=600)):
        assert r["max_diff"] <= 1e-4, f"rank {rank}: inductor differs from eager by {r['max_diff']}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_collective_order_kept(pools, seed, backend):
    """Two independent calls, the first result unused: compiled, every rank runs both, in the program's order."""
    results = pools(2).run(compile_tasks.order, seed, backend, timeout=600)
    for rank, r in enumerate(results):
        assert r["eager"] == ["matmul_all_reduce", "all_gather_matmul"], f"rank {rank} eager ran {r['eager']}"
        assert r["compiled"] == r["eager"], f"rank {rank}: compiled ran {r['compiled']}, eager {r['eager']}"
        assert r["bitwise"], f"rank {rank}: compiled result differs from eager"


def test_dynamic_sequence_length_compiles_once(pools, seed):
    for rank, r in enumerate(pools(2).run(compile_tasks.dynamic_rows, seed, timeout=300)):
        assert r["frames"] == 1, f"rank {rank}: {r['frames']} compilations for 3 sequence lengths"
        assert all(r["bitwise"]), f"rank {rank}: per-length bitwise results {r['bitwise']}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_ops_compile_bitwise(pools, seed, world_size):
    results = pools(world_size).run(compile_tasks.moe_ops, seed, STRATEGIES, timeout=300)
    for rank, cases in enumerate(results):
        assert [s for s, _ in cases] == list(STRATEGIES)
        for strategy, r in cases:
            assert r["bitwise"], f"rank {rank} moe {strategy}: compiled differs from eager by {r['max_diff']}"
            assert r["breaks"] == 0, f"rank {rank} moe {strategy}: {r['breaks']} graph breaks"


def test_moe_fused_interpreted_compiles(pools, seed):
    for rank, cases in enumerate(pools(2).run(compile_tasks.moe_ops, seed, ("fused",), timeout=600)):
        for strategy, r in cases:
            assert r["bitwise"] and r["breaks"] == 0, f"rank {rank} moe {strategy}: {r}"


def test_moe_inductor_within_tolerance(pools, seed):
    for rank, cases in enumerate(pools(2).run(compile_tasks.moe_ops, seed, ("symm",), "inductor", timeout=600)):
        for strategy, r in cases:
            assert r["max_diff"] <= 1e-4, f"rank {rank} moe {strategy}: inductor differs by {r['max_diff']}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_expert_parallel_mlp_compiles(pools, seed, world_size):
    for rank, r in enumerate(pools(world_size).run(compile_tasks.moe_module, seed, "symm", timeout=300)):
        assert r["breaks"] == 0, f"rank {rank}: graph breaks {r['reasons']}"
        assert r["max_diff"] <= 1e-5, f"rank {rank}: compiled module differs from eager by {r['max_diff']}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("task", [compile_tasks.nn_layers, compile_tasks.torch_tp_styles, compile_tasks.sharded_layers],
                         ids=["nn", "torch_tp", "sharded"])
def test_layers_compile(pools, seed, world_size, task):
    strategy = "symm" if world_size == 2 else "pipelined"
    for rank, modes in enumerate(pools(world_size).run(task, seed, strategy, timeout=300)):
        for mode, r in modes.items():
            assert r["breaks"] == 0, f"rank {rank} {mode}: graph breaks {r['reasons']}"
            assert r["max_diff"] <= 1e-5, f"rank {rank} {mode}: compiled differs from eager by {r['max_diff']}"
