"""overlap.nn.SequenceParallelAttention (DeepSpeed-Ulysses attention on `overlap.matmul_all_to_all` and
`overlap.all_to_all_matmul`) on CPU ranks, against the unparallelized attention layer in float64.

Every rank builds the module and a plain layer (four ``nn.Linear`` around attention written out) after the same
seed: the parameters must be equal, each rank's shard of the output and of the input gradient the plain layer's,
and every parameter's gradient summed over the ranks the plain layer's (`tests.support.sp_attention_tasks`). Cases:
multi-head and grouped-query (2, 3 and 4 query heads per key/value head), causal and not, with and without biases,
sequence-first and batch-first, the default ``scaled_dot_product_attention`` and an ``attention=`` callable; world
sizes 1-4, strategies ``reference``, ``pipelined`` and ``auto``, fp32 (rtol = atol = 1e-5, atol scaled to the
tensor's RMS) and bf16 (relative norm of the error < 2e-2). Also: argument errors at construction, input errors on
the rank that made them (its peers raising at once), then a good call on the same group.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import sp_attention_tasks
from tests.support.harness import FALLBACK_TIMEOUT_S


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "auto"])
def test_matches_unparallelized_layer(pools, seed, world_size, dtype, strategy):
    done = pools(world_size).run(sp_attention_tasks.check_cases, strategy, dtype, seed)
    assert done == [len(sp_attention_tasks.CASES)] * world_size


def test_bad_arguments_raise(pools):
    world_size = 2
    results = pools(world_size).run(sp_attention_tasks.bad_args_task)
    construction = {
        "heads_not_divisible": "heads (3) must divide by the sequence-parallel group's size (2)",
        "kv_heads_not_divisible": "kv_heads (3) must divide by the sequence-parallel group's size (2)",
        "heads_by_kv_heads": "heads (6) must divide by kv_heads (4)",
        "hidden_by_heads": "hidden (9) must divide by heads (4)",
        "heads_zero": "heads must be a positive int, got 0",
        "hidden_bool": "hidden must be a positive int, got True",
        "seq_dim": "seq_dim must be 0",
        "hierarchical": "strategy 'hierarchical' is not implemented",
        "unknown_strategy": "'fastest'",
    }
    for rank, res in enumerate(results):
        for key, text in construction.items():
            kind, msg, secs = res[key]
            assert kind == "ValueError" and text in msg and secs < 1.0, (rank, key, res[key])
        kind, msg, _ = res["attention_not_callable"]
        assert kind == "TypeError" and "attention must be a callable" in msg, (rank, res["attention_not_callable"])
        for key, text in (("x_hidden_on_rank_0", "[s/W, b, 16]"), ("x_two_dims_on_rank_0", "[s/W, b, 16]")):
            kind, msg, secs = res[key]
            want = "ValueError" if rank == 0 else "OverlapMismatchError"
            assert kind == want and secs < FALLBACK_TIMEOUT_S, (rank, key, res[key])
            if rank == 0:
                assert text in msg, (rank, key, msg)
        kind, msg, secs = res["attention_shape"]
        assert kind == "ValueError" and "attention must return ctx of q's shape" in msg, (rank, res["attention_shape"])
        assert res["then_ok"][1] == "(2, 3, 16)", (rank, res["then_ok"])
