"""The sequence-parallel ops (`overlap.matmul_all_to_all`, `overlap.all_to_all_matmul`) on CPU ranks: every strategy
against the unparallelized layer in float64, forward and backward, sequence-first and batch-first, one weight and
GQA's three; bad inputs raising on every rank before any data moves. The oracle: `tests.support.sp_oracle`."""

from __future__ import annotations

import pytest
import torch

from tests.support import sp_oracle


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "auto"])
def test_matches_float64(pools, seed, world_size, dtype, strategy):
    done = pools(world_size).run(sp_oracle.check_cases, strategy, dtype, seed)
    assert done == [sp_oracle.count_cases()] * world_size
