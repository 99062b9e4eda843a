"""Batch-first and several-weight benchmark cases (`overlap.benchmarks.layouts`): their data laid out as the calls
take it, checked like every case (``reference`` and the ``torch`` row against the oracle, every strategy against
``reference``), and the default cases that use them."""

from __future__ import annotations

import pytest

from overlap.benchmarks.cases import OPS, Case, default_cases

CASES = [
    Case.of("all_gather_matmul", 8, 12, 10, backward=True, batch=2, split=(6, 2, 2)),
    Case.of("all_gather_matmul", 9, 12, 10, batch=3),
    Case.of("all_gather_matmul", 6, 12, 10, backward=True, split=(4, 6)),
    Case.of("matmul_reduce_scatter", 6, 12, 10, backward=True, batch=2),
    Case.of("matmul_reduce_scatter", 5, 16, 8, batch=5),
]


def check_cases(rank, world_size, seed):
    import torch.distributed as dist

    from overlap import world
    from overlap.benchmarks.cases import BenchConfig
    from overlap.benchmarks.checks import check_case

    pg = dist.group.WORLD
    info = world.group_info(pg, 60.0)
    config = BenchConfig(ops=("all_gather_matmul", "matmul_reduce_scatter"), cases=tuple(CASES),
                         strategies=("reference", "pipelined", "symm", "auto"), timeout=60.0, progress=False)
    verdicts = []
    for i, case in enumerate(CASES):
        checked = check_case(case, i, config, seed, info, pg)
        assert checked.labels == ["torch", "reference", "pipelined", "symm", "auto"], checked.labels
        verdicts.append((case.name, checked.failed))
    return verdicts


@pytest.mark.parametrize("world_size", [2, 3])
def test_layout_cases_pass_their_checks(pools, seed, world_size):
    for verdicts in pools(world_size).run(check_cases, seed, timeout=300):
        assert all(not failed for _, failed in verdicts), verdicts


def test_layout_cases_are_named_and_checked():
    assert CASES[0].name == "all_gather_matmul 8x12x10/bsh2/split6+2+2 float32 fwd+bwd"
    assert CASES[0].shape_fields()["split"] == [6, 2, 2] and CASES[3].shape_fields()["batch"] == 2
    assert Case.of("all_gather_matmul", 8, 12, 10, split=[6, 4]).split == (6, 4)  # a list is kept as a tuple
    for kwargs, word in ((dict(op="all_gather_weight_matmul", batch=2), "batch"),
                         (dict(op="matmul_all_reduce", batch=2), "batch"), (dict(batch=3), "batch"),
                         (dict(split=(6, 3)), "split"), (dict(op="matmul_reduce_scatter", split=(5, 5)), "split"),
                         (dict(split=(10, 0)), "split"), (dict(batch=True), "batch")):
        kwargs = {"op": "all_gather_matmul", **kwargs}
        with pytest.raises(ValueError, match=word):
            Case.of(kwargs.pop("op"), 8, 12, 10, **kwargs)


def test_default_cases_include_batch_first_projections():
    cases = [c for c in default_cases(OPS, "cpu", world_size=2) if c.batch]
    assert [c.name for c in cases] == [
        f"{op} llama3-8b/{layer} float32 {mode}" for op, layer in (
            ("all_gather_matmul", "qkv:512x256x192/bsh2/split128+32+32"),
            ("all_gather_matmul", "mlp-up:512x256x896/bsh2/split448+448"),
            ("matmul_reduce_scatter", "attn-out:512x128x256/bsh2")) for mode in ("fwd", "fwd+bwd")]
    assert not [c for c in default_cases(OPS, "cpu", world_size=3) if c.batch]  # llama3-8b does not fit 3 ranks
    gpu = [c for c in default_cases(OPS, "cuda", world_size=8) if c.batch]
    assert {c.preset for c in gpu} == {"llama3-8b-full"} and gpu[0].split == (512, 128, 128), gpu
