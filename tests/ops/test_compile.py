"""torch.compile: every op traced with no graph break, compiled results bitwise eager's, collective order kept.

Each op is a `torch.library` custom op (`overlap.ops.library`); the tasks (`tests.support.compile_tasks`) compile
functions with ``fullgraph=True`` (a graph break raises), so a passing task also proves there is none;
`torch._dynamo.explain` counts them besides. Most use the ``aot_eager`` backend (AOTAutograd's graphs, run
eagerly: the op implementations see the same inputs, so results are bitwise eager's); one test per family
compiles with inductor (CPU), whose fused code around the ops rounds differently (checked to tolerance).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import compile_bounded_tasks, compile_tasks

STRATEGIES = ("reference", "pipelined", "symm")


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_tp_ops_compile_bitwise(pools, seed, world_size):
    results = pools(world_size).run(compile_tasks.tp_ops, seed, STRATEGIES, "symm", timeout=300)
    for rank, cases in enumerate(results):
        assert len(cases) == 3 * len(STRATEGIES)
        for op, strategy, r in cases:
            assert r["bitwise"], f"rank {rank} {op} {strategy}: compiled differs from eager by {r['max_diff']}"
            if strategy == "symm":
                assert r["breaks"] == 0, f"rank {rank} {op}: {r['breaks']} graph breaks"


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_weight_gather_compiles_bitwise(pools, seed, world_size):
    """all_gather_weight_matmul: no graph break, compiled (aot_eager) results and gradients bitwise eager's."""
    for rank, cases in enumerate(pools(world_size).run(compile_tasks.weight_gather, seed, STRATEGIES, timeout=300)):
        assert [s for s, _ in cases] == list(STRATEGIES)
        for strategy, r in cases:
            assert r["bitwise"], f"rank {rank} {strategy}: compiled differs from eager by {r['max_diff']}"
            assert r["breaks"] == 0, f"rank {rank} {strategy}: {r['breaks']} graph breaks"


@pytest.mark.exact
def test_weight_gather_fused_interpreted_compiles(pools, seed):
    for rank, cases in enumerate(pools(2).run(compile_tasks.weight_gather, seed, ("fused",), timeout=600)):
        for strategy, r in cases:
            assert r["bitwise"] and r["breaks"] == 0, f"rank {rank} {strategy}: {r}"


@pytest.mark.exact
def test_tp_fused_interpreted_compiles(pools, seed):
    results = pools(2).run(compile_tasks.tp_ops, seed, ("fused",), "fused", timeout=600)
    for rank, cases in enumerate(results):
        for op, _, r in cases:
            assert r["bitwise"] and r["breaks"] == 0, f"rank {rank} {op} fused: {r}"


def test_tp_inductor_within_tolerance(pools, seed):
    for rank, r in enumerate(pools(2).run(compile_tasks.tp_inductor, seed, timeout=600)):
        assert r["max_diff"] <= 1e-4, f"rank {rank}: inductor differs from eager by {r['max_diff']}"


@pytest.mark.exact
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_collective_order_kept(pools, seed, backend):
    """Two independent calls, the first result unused: compiled, every rank runs both, in the program's order."""
    results = pools(2).run(compile_tasks.order, seed, backend, timeout=600)
    for rank, r in enumerate(results):
        assert r["eager"] == ["matmul_all_reduce", "all_gather_matmul"], f"rank {rank} eager ran {r['eager']}"
        assert r["compiled"] == r["eager"], f"rank {rank}: compiled ran {r['compiled']}, eager {r['eager']}"
        assert r["bitwise"], f"rank {rank}: compiled result differs from eager"


@pytest.mark.exact
def test_dynamic_sequence_length_compiles_once(pools, seed):
    for rank, r in enumerate(pools(2).run(compile_tasks.dynamic_rows, seed, timeout=300)):
        assert r["frames"] == 1, f"rank {rank}: {r['frames']} compilations for 3 sequence lengths"
        assert all(r["bitwise"]), f"rank {rank}: per-length bitwise results {r['bitwise']}"


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_ops_compile_bitwise(pools, seed, world_size):
    results = pools(world_size).run(compile_tasks.moe_ops, seed, STRATEGIES, timeout=300)
    for rank, cases in enumerate(results):
        assert [s for s, _ in cases] == list(STRATEGIES)
        for strategy, r in cases:
            assert r["bitwise"], f"rank {rank} moe {strategy}: compiled differs from eager by {r['max_diff']}"
            assert r["breaks"] == 0, f"rank {rank} moe {strategy}: {r['breaks']} graph breaks"


@pytest.mark.exact
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


def test_opcheck(pools, seed):
    """torch's own checks of a custom op: its schema, its fake implementation against the real one (shapes,
    strides, dtypes, no aliasing), its autograd registration."""
    for rank, results in enumerate(pools(2).run(compile_tasks.opchecks, seed, timeout=300)):
        bad = {name: r for name, r in results.items() if r != "ok"}
        assert not bad, f"rank {rank}: {bad}"


# ----------------------------------------------------------------------------------------------
# MoE with max_tokens_per_rank: static shapes (no data-dependent size), no graph break without
# capture_dynamic_output_shape_ops, bitwise eager
# ----------------------------------------------------------------------------------------------


def _assert_static(rank: int, what: str, r: dict) -> None:
    assert r["static_breaks"] == 0, f"rank {rank} {what}: {r['static_breaks']} graph breaks"
    assert r["graphs"] == 1 and r["tensors"] > 0, f"rank {rank} {what}: {r}"
    assert not r["symbolic"], f"rank {rank} {what}: symbolic sizes at {r['symbolic']}"
    assert (r["graphs_without_fullgraph"], r["ops_without_fullgraph"]) == (1, r["ops"]), f"rank {rank} {what}: {r}"


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_bounded_compiles_static_bitwise(pools, seed, world_size):
    results = pools(world_size).run(compile_bounded_tasks.moe_bounded, seed, STRATEGIES, timeout=300)
    for rank, cases in enumerate(results):
        assert [s for s, _ in cases] == [*STRATEGIES, "unbounded control"]
        for strategy, r in cases[:-1]:
            assert r["bitwise"], f"rank {rank} moe {strategy}: compiled differs from eager by {r['max_diff']}"
            _assert_static(rank, f"bounded moe {strategy}", r)
        control = cases[-1][1]  # without the bound the checks see the data-dependent row count
        assert control["symbolic"], f"rank {rank}: the unbounded layer shows no symbolic size: {control}"
        assert control["ops_without_fullgraph"] < control["ops"], f"rank {rank}: unbounded layer {control}"


@pytest.mark.exact
def test_moe_bounded_fused_interpreted_compiles(pools, seed):
    for rank, cases in enumerate(pools(2).run(compile_bounded_tasks.moe_bounded, seed, ("fused",), timeout=600)):
        r = cases[0][1]
        assert r["bitwise"], f"rank {rank} moe fused: {r}"
        _assert_static(rank, "bounded moe fused", r)


def test_moe_bounded_inductor_within_tolerance(pools, seed):
    results = pools(2).run(compile_bounded_tasks.moe_bounded, seed, ("symm",), "inductor", timeout=600)
    for rank, cases in enumerate(results):
        for strategy, r in cases:
            assert r["max_diff"] <= 1e-4, f"rank {rank} moe {strategy}: inductor differs by {r['max_diff']}"


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_expert_parallel_mlp_bounded_compiles_static(pools, seed, world_size):
    results = pools(world_size).run(compile_bounded_tasks.moe_module_bounded, seed, "symm", timeout=300)
    for rank, r in enumerate(results):
        assert r["breaks"] == 0, f"rank {rank}: graph breaks {r['reasons']}"
        assert r["max_diff"] == 0.0, f"rank {rank}: compiled module differs from eager by {r['max_diff']}"
        _assert_static(rank, "ExpertParallelMLP(max_tokens_per_rank=...)", r)


@pytest.mark.exact
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_moe_bounded_dispatch_is_ordered(pools, seed, backend):
    for rank, r in enumerate(pools(2).run(compile_bounded_tasks.moe_bounded_order, seed, backend, timeout=600)):
        assert r["effects"] == [True, False], f"rank {rank}: ordered effects (bounded, unbounded) {r['effects']}"
        assert r["eager"] == ["moe_dispatch_bounded", "matmul_all_reduce"], f"rank {rank}: eager ran {r['eager']}"
        assert r["compiled"] == r["eager"], f"rank {rank}: compiled ran {r['compiled']}, eager {r['eager']}"
        assert r["bitwise"], f"rank {rank}: compiled result differs from eager"


def test_moe_bounded_opcheck(pools, seed):
    """torch's own checks of the bounded dispatch (its fake's static row count against the real output)."""
    for rank, results in enumerate(pools(2).run(compile_bounded_tasks.bounded_opchecks, seed, timeout=300)):
        want = {"grouped": "ok", "grouped fp8": "ok", "plain": "ok", "combine": "ok"}
        assert results == want, f"rank {rank}: {results}"


def test_every_op_is_an_ordered_effect_but_the_unbounded_dispatch():
    """Order under compile rests on the effect registration: a torch whose effect API moved would lose it
    silently (`overlap.ops.library` falls back to plain side effects), so it is checked here."""
    from torch._higher_order_ops.effects import _EffectType, _get_effect

    from overlap.ops.moe import combine, dispatch  # noqa: F401  (each module defines its custom ops)
    from overlap.ops.tp import (  # noqa: F401
        all_gather_matmul,
        collectives,
        matmul_all_reduce,
        matmul_reduce_scatter,
    )

    ns = torch.ops.overlap
    names = [n for n in dir(ns) if isinstance(getattr(ns, n), torch._ops.OpOverloadPacket)]
    assert {"all_gather_matmul", "moe_combine", "moe_dispatch", "all_reduce"} <= set(names), names
    for name in names:
        effect = _get_effect(getattr(torch.ops.overlap, name).default)
        want = None if name == "moe_dispatch" else _EffectType.ORDERED
        assert effect == want, f"overlap::{name}: effect {effect}, want {want}"
