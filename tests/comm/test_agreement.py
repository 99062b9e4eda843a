"""Agreement across ranks: ranks that make different calls raise on every rank, on every call.

For every op, one rank at a time disagrees with the others on the shape, the dtype, the strategy or
the plan (chunk counts; one-shot for matmul_all_reduce), twice in a row: every rank raises within
seconds (`OverlapMismatchError` naming the signatures, or the disagreeing rank's own `ValueError`
where its call is invalid on its own), nobody computes anything, and afterwards the group still
computes the right result.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.tp_oracle import AGM, MAR, MRS, call, compare, expect_error, oracle

CASE = (2, (), 8, 6, "contiguous")


def disagreements(op: str, world_size: int):
    """(name, rank that disagrees, its strategy-or-plan, its dtype, its n) per kind of disagreement;
    everyone else calls with ("symm", float32, n=6)."""
    import overlap

    kinds = [
        ("shape", 2, "symm", torch.float32, 7),
        ("dtype", 1, "symm", torch.bfloat16, 6),
        ("strategy", 0, "pipelined", torch.float32, 6),
        ("strategy vs reference", 1, "reference", torch.float32, 6),
        ("chunks", 2, overlap.Plan("symm", num_chunks={"shm": 2}), torch.float32, 6),
    ]
    if op == MAR:
        kinds.append(("one_shot", 1, overlap.Plan("symm", one_shot=True), torch.float32, 6))
    return kinds


def disagree_task(rank, world_size, seed, op):
    results = {}
    for name, who, plan, dtype, n in disagreements(op, world_size):
        for attempt in range(2):  # on every call, not only the first
            inputs, _ = oracle(op, seed, world_size, CASE[:3] + (n if rank == who else 6,) + CASE[4:], torch.float32)
            a, b, _ = inputs[rank]
            mine = plan if rank == who else "symm"
            dt = dtype if rank == who else torch.float32
            results[f"{name} #{attempt}"] = expect_error(call, op, a.to(dt), b.to(dt), mine, timeout=20)
    # The group still works, and computes the right thing.
    inputs, want = oracle(op, seed + 1, world_size, CASE, torch.float32)
    a, b, _ = inputs[rank]
    compare(f"{op} after the disagreements, rank {rank}", [call(op, a, b, "symm")], want[rank][:1], torch.float32)
    return results


@pytest.mark.parametrize("op", [AGM, MRS, MAR])
def test_disagreeing_ranks_raise_on_every_rank_every_call(pools, seed, op):
    results = pools(3).run(disagree_task, seed, op, timeout=180)
    for rank, res in enumerate(results):
        for key, (kind, msg, secs) in res.items():
            ctx = f"{op}, {key}, rank {rank}: {kind}: {msg}"
            assert kind in ("OverlapMismatchError", "ValueError", "TypeError"), ctx
            assert secs < FALLBACK_TIMEOUT_S, ctx
            if kind == "OverlapMismatchError":
                assert "disagree" in msg and op in msg, ctx
