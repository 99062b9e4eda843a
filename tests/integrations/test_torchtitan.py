"""torchtitan 0.2.x as a client: its own Llama 3 and its own ``parallelize_llama``, with overlap's styles swapped in.

A tiny Llama 3 (torchtitan's ``Transformer`` at a debug size, random init, nothing downloaded; torchtitan's device
type set to CPU) is parallelized by torchtitan's ``parallelize_llama`` twice from the same weights, once as it is
(torch's styles) and once inside `overlap.hooks.torch_tp.use_overlap_styles` on its module, and trained a few SGD
steps on CPU ranks beside the unparallelized model in float64, with replicated logits and with loss parallel
(``Shard(-1)`` DTensor logits through torch's ``loss_parallel()``): losses, gradient norms, gradients and final
parameters within ``1e-5`` of torch's styles and ``1e-4`` of the float64 run at every step; the parameters'
shardings equal torch's; overlap's gathers and scatters counted. Needs the ``torchtitan`` extra
(``pip install -e ".[torchtitan]"``; CI installs it); skipped without it.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import overlap  # noqa: F401  (before any DTensor op: see test_torch_tp.py)
from tests.support.train_compare import compare, train

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed: pip install -e '.[torchtitan]'", allow_module_level=True)

STEPS, BATCH, SEQ, VOCAB, LAYERS, LR = 3, 2, 16, 256, 2, 0.05








def titan_task(rank, world_size, seed, heads, kv_heads, loss_parallel):
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = titan_dims.device_type = "cpu"  # (torchtitan picks "cuda" where no device is found)
    import torchtitan.models.llama3.infra.parallelize as llama_tp
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    from overlap.hooks.torch_tp import use_overlap_styles
    from overlap.ops import library

    args = TransformerModelArgs(dim=64, n_layers=LAYERS, n_heads=heads, n_kv_heads=kv_heads, vocab_size=VOCAB,
                                multiple_of=16, max_seq_len=SEQ)
    torch.manual_seed(seed)
    model = Transformer(args)
    job = JobConfig()
    job.training.seq_len = SEQ
    job.parallelism.tensor_parallel_degree = world_size
    job.parallelism.disable_loss_parallel = not loss_parallel  # else replicated logits: the loss is every rank's
    job.activation_checkpoint.mode = "none"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, etp=1, world_size=world_size)
    dims.build_mesh()
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)) for _ in range(STEPS)]

    exact = train(copy.deepcopy(model).double(), batches, LR)
    theirs = llama_tp.parallelize_llama(copy.deepcopy(model), dims, job)
    ops = ("all_gather_matmul", "matmul_reduce_scatter")
    with use_overlap_styles(llama_tp):
        ours = llama_tp.parallelize_llama(copy.deepcopy(model), dims, job)
    shardings = {n: tuple(getattr(p, "placements", ())) for n, p in ours.named_parameters()}
    assert shardings == {n: tuple(getattr(p, "placements", ())) for n, p in theirs.named_parameters()}, shardings
    theirs_run = train(theirs, batches, LR)
    before = {op: library.CALLS[op] for op in ops}
    ours_run = train(ours, batches, LR)
    ran = {op: library.CALLS[op] - before[op] for op in ops}
    compare(ours_run, theirs_run, exact, f"rank {rank}/{world_size}")
    return ran


@pytest.mark.parametrize("loss_parallel", [False, True], ids=["replicated logits", "loss parallel"])
@pytest.mark.parametrize("world_size,heads,kv_heads", [(2, 4, 2), (4, 8, 4)])  # (whole KV heads per rank)
def test_parallelize_llama_with_overlap_styles_trains_as_with_torchs(pools, seed, world_size, heads, kv_heads,
                                                                     loss_parallel):
    for rank, ran in enumerate(pools(world_size).run(titan_task, seed, heads, kv_heads, loss_parallel, timeout=600)):
        # Per step and block: one gather for wq/wk/wv and one for w1/w3, the scatters of wo and w2; per step, the
        # LM head's gather.
        assert ran == {"all_gather_matmul": (2 * LAYERS + 1) * STEPS,
                       "matmul_reduce_scatter": 2 * LAYERS * STEPS}, (rank, ran)
