"""DeepSpeed-Ulysses with overlap swapped in (`overlap.hooks.deepspeed_ulysses.UlyssesAttention`), against DeepSpeed's
own ``deepspeed.sequence.layer.DistributedAttention`` on CPU ranks (gloo).

Each rank builds a user's four ``nn.Linear`` (q, k, v, o; replicated, the same seed on every rank) and local
attention (causal or not SDPA on DeepSpeed's ``[s, b, h, d]`` or batch-first layout, GQA through ``enable_gqa``, a
positional and a keyword argument passed through), then runs its sequence shard through the projections around
DeepSpeed's layer and through the adapter holding the very same ``Linear`` objects (built from the
``DistributedAttention`` or by its constructor): outputs, input-shard gradients and every weight's and ``o_proj``
bias's gradient per rank (both are this rank's share: nothing reduced), the q/k/v biases' summed over the group
(each rank's share differs; the sums are equal), fp32 within 1e-5 (bf16: relative norm < 2e-2); the adapter holds
no parameters and the local attention sees the same shapes and arguments. MHA and GQA (2 and 4 query heads per
key/value head), seq-first and batch-first, with and without biases, at world size 2 and 4 (and two
sequence-parallel groups of 2 inside 4 ranks), strategies ``reference``, ``pipelined`` and ``auto``
(`tests.support.deepspeed_ulysses_tasks`). Also the refusals (uneven heads, which DeepSpeed shards and overlap
does not, mismatched shapes, a bad input on one rank with its peers told at once) and that no DeepSpeed op was
JIT-built. Needs the ``deepspeed`` extra (``pip install -e '.[deepspeed]'``); skipped without it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from tests.support import deepspeed_ulysses_tasks as tasks  # noqa: E402
from tests.support.harness import FALLBACK_TIMEOUT_S, RankPool  # noqa: E402


@pytest.fixture(scope="module")
def ds_pools(tmp_path_factory):
    """``ds_pools(world_size)``: rank pools of this module's own (DeepSpeed's global state stays out of the suite's
    shared pools), with the CPU accelerator and a fresh ``TORCH_EXTENSIONS_DIR`` (nothing built into the user's)."""
    ext = tmp_path_factory.mktemp("torch_extensions")
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ext)}
    made: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = made.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = made[world_size] = RankPool(world_size, env=env)
        return pool

    get.extensions_dir = ext
    yield get
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "auto"])
def test_matches_deepspeed_distributed_attention(ds_pools, seed, world_size, strategy):
    done = ds_pools(world_size).run(tasks.run_cases, strategy, seed)
    want = [c.name for c in tasks.CASES if c.sp is None or (c.sp < world_size and world_size % c.sp == 0)]
    assert done == [want] * world_size


def test_refusals(ds_pools):
    results = ds_pools(2).run(tasks.refusals)
    value_errors = {
        "uneven_kv": "kv_heads (3) must divide by the sequence-parallel group's size (2)",
        "uneven_heads": "heads (3) must divide by the sequence-parallel group's size (2)",
        "kv_from_dist_attn": "kv_heads (3) must divide by the sequence-parallel group's size (2)",
        "heads_by_kv": "heads (6) must divide by kv_heads (4)",
        "k_features": "k_proj must have kv_heads * head_dim = 2 * 4 output features",
        "o_features": "o_proj must take heads * head_dim = 4 * 4 input features, got 12",
        "q_by_heads": "q_proj's 18 output features do not divide into heads (4)",
        "hierarchical": "strategy 'hierarchical' is not implemented",
        "scatter_idx": "scatter_idx must be 2",
    }
    for rank, res in enumerate(results):
        for key, text in value_errors.items():
            kind, msg, secs = res[key]
            assert kind == "ValueError" and text in msg and secs < 1.0, (rank, key, res[key])
        assert "num_kv_heads path" in res["uneven_kv"][1], res["uneven_kv"]
        kind, msg, secs = res["local_attn_shape"]  # after the first exchange, on every rank
        assert kind == "ValueError" and "local_attn must return the context in q's shape" in msg, (rank, kind, msg)
        assert secs < FALLBACK_TIMEOUT_S, (rank, secs)
        for key, text in (("not_linear", "v_proj must be the model's torch.nn.Linear"),
                          ("not_callable", "local_attn must be DistributedAttention's local attention")):
            kind, msg, _ = res[key]
            assert kind == "TypeError" and text in msg, (rank, key, res[key])
        kind, msg, secs = res["x_hidden_on_rank_0"]
        want = "ValueError" if rank == 0 else "OverlapMismatchError"
        assert kind == want and secs < FALLBACK_TIMEOUT_S, (rank, res["x_hidden_on_rank_0"])
        if rank == 0:
            assert "x must be [s/W, b, 8]" in msg, msg
        assert res["then_ok"] == (None, "", res["then_ok"][2]), (rank, res["then_ok"])


def test_deepspeed_built_nothing(ds_pools):
    """Last: every rank ran DeepSpeed 0.19.8 on the CPU accelerator over torch's gloo group, without its
    shared-memory op, and nothing was JIT-built into the test's TORCH_EXTENSIONS_DIR (nor anywhere else)."""
    for world_size in (2, 4):
        for rank, facts in enumerate(ds_pools(world_size).run(tasks.facts)):
            assert facts["version"] == "0.19.8" and facts["accelerator"] == "cpu", (rank, facts)
            assert facts["cdb"] == "TorchBackend" and facts["shm_op"] is None, (rank, facts)
            assert facts["extensions_dir"] == str(ds_pools.extensions_dir) and facts["built"] == [], (rank, facts)
    assert list(ds_pools.extensions_dir.iterdir()) == []
