"""torchtitan 0.2.x as a client: its own Llama 3 and its own ``parallelize_llama``, with overlap's styles swapped in.

A tiny Llama 3 (torchtitan's ``Transformer`` at a debug size, random init, nothing downloaded; torchtitan's device
type set to CPU) is parallelized by torchtitan's ``parallelize_llama`` twice from the same weights, once as it is
(torch's styles) and once inside `overlap.hooks.torch_tp.use_overlap_styles` on its module, and trained a few SGD
steps on CPU ranks beside the unparallelized model in float64, with replicated logits and with loss parallel
(``Shard(-1)`` DTensor logits through torch's ``loss_parallel()``): losses, gradient norms, gradients and final
parameters within ``1e-5`` of torch's styles and ``1e-4`` of the float64 run at every step; the parameters'
shardings equal torch's; overlap's gathers and scatters counted. Then FSDP2 x TP on the 2 x 2 mesh, eager and with
torchtitan's per-block compile, each data rank on its half of the batch (`fsdp_tp_task`). Needs the ``torchtitan`` extra
(``pip install -e ".[torchtitan]"``; CI installs it); skipped without it.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import overlap  # noqa: F401  (before any DTensor op: see test_torch_tp.py)
from tests.support.train_compare import compare, train, train_sharded_data

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed: pip install -e '.[torchtitan]'", allow_module_level=True)

STEPS, BATCH, SEQ, VOCAB, LAYERS, LR = 3, 2, 16, 256, 2, 0.05








def _titan(seed, heads, kv_heads, tp, loss_parallel, dp_shard=1, compiled=False):
    """torchtitan's tiny Llama 3 (random weights from `seed`), its job config and parallel dims (``dp_shard`` x
    ``tp`` ranks), and the batches: ``(model, dims, job, batches)``."""
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = titan_dims.device_type = "cpu"  # (torchtitan picks "cuda" where no device is found)
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(dim=64, n_layers=LAYERS, n_heads=heads, n_kv_heads=kv_heads, vocab_size=VOCAB,
                                multiple_of=16, max_seq_len=SEQ)
    torch.manual_seed(seed)
    model = Transformer(args)
    job = JobConfig()
    job.training.seq_len = SEQ
    job.training.mixed_precision_param = "float32"  # CPU ranks compute in fp32 (FSDP2's default is bf16)
    job.parallelism.tensor_parallel_degree = tp
    job.parallelism.data_parallel_shard_degree = dp_shard
    job.parallelism.disable_loss_parallel = not loss_parallel  # else replicated logits: the loss is every rank's
    job.activation_checkpoint.mode = "none"
    job.compile.enable, job.compile.components, job.compile.backend = compiled, ["model"], "aot_eager"
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, etp=1,
                        world_size=dp_shard * tp)
    dims.build_mesh()
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, VOCAB, (BATCH * dp_shard, SEQ), generator=gen),
                torch.randint(0, VOCAB, (BATCH * dp_shard, SEQ), generator=gen)) for _ in range(STEPS)]
    return model, dims, job, batches


def _parallelized(model, dims, job):
    """``(torch's, overlap's)``: torchtitan's ``parallelize_llama`` on copies of `model`, as it is and inside
    `use_overlap_styles`; their parameters' shardings equal."""
    import torchtitan.models.llama3.infra.parallelize as llama_tp

    from overlap.hooks.torch_tp import use_overlap_styles

    theirs = llama_tp.parallelize_llama(copy.deepcopy(model), dims, job)
    with use_overlap_styles(llama_tp):
        ours = llama_tp.parallelize_llama(copy.deepcopy(model), dims, job)
    shardings = {n: tuple(getattr(p, "placements", ())) for n, p in ours.named_parameters()}
    assert shardings == {n: tuple(getattr(p, "placements", ())) for n, p in theirs.named_parameters()}, shardings
    return theirs, ours


def _counted(run):
    """``(run(), {op: calls})``: how often overlap's TP ops ran in `run`."""
    from overlap.ops import library

    before = {op: library.CALLS[op] for op in OPS}
    out = run()
    return out, {op: library.CALLS[op] - before[op] for op in OPS}


OPS = ("all_gather_matmul", "matmul_reduce_scatter")


def titan_task(rank, world_size, seed, heads, kv_heads, loss_parallel):
    model, dims, job, batches = _titan(seed, heads, kv_heads, world_size, loss_parallel)
    exact = train(copy.deepcopy(model).double(), batches, LR)
    theirs, ours = _parallelized(model, dims, job)
    theirs_run = train(theirs, batches, LR)
    ours_run, ran = _counted(lambda: train(ours, batches, LR))
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


def fsdp_tp_task(rank, world_size, seed, compiled):
    """FSDP2 x TP on torchtitan's 2 x 2 mesh (dp_shard=2, tp=2) as a torchtitan user configures it, each data rank
    training on its half of every batch, with the two CPU-only settings: FSDP2 reducing with a plain sum (gloo
    refuses the ``PREMUL_SUM`` torchtitan's gradient divide factor of 1 asks for) and, compiled, a clone of the
    embedding's output (torch 2.13's per-block compile otherwise drops its gradient into the first block)."""
    from torch.distributed.fsdp import FSDPModule

    model, dims, job, batches = _titan(seed, 4, 2, 2, True, dp_shard=2, compiled=compiled)
    if compiled:
        model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    exact = train(copy.deepcopy(model).double(), batches, LR)
    theirs, ours = _parallelized(model, dims, job)
    for parallel in (theirs, ours):
        assert isinstance(parallel, FSDPModule)
        for module in parallel.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    mesh = dims.get_mesh("fsdp")
    dp = (mesh.get_group(), mesh.get_local_rank(), mesh.size())
    theirs_run = train_sharded_data(theirs, batches, LR, *dp)
    ours_run, ran = _counted(lambda: train_sharded_data(ours, batches, LR, *dp))
    compare(ours_run, theirs_run, exact, f"rank {rank}/{world_size} dp_shard=2 x tp=2{' compiled' if compiled else ''}")
    return ran


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fsdp2_by_tp_trains_with_overlap_styles_as_with_torchs(pools, seed, compiled):
    """torchtitan's ``parallelize_llama`` with FSDP2 on the data half of a 2 x 2 mesh and TP on the other, eager and
    with its per-block compile (``fullgraph=True``): overlap's styles train as torch's do, step by step, and as the
    unparallelized model in float64 on the whole batch; overlap's ops run in every block."""
    for rank, ran in enumerate(pools(4).run(fsdp_tp_task, seed, compiled, timeout=600)):
        assert ran == {"all_gather_matmul": (2 * LAYERS + 1) * STEPS,
                       "matmul_reduce_scatter": 2 * LAYERS * STEPS}, (rank, ran)


def float8_task(rank, world_size, seed):
    """torchtitan's float8 converter (torchao's ``Float8Linear``, tensorwise, ``emulate`` without an SM89 GPU) and its
    float8 tensor parallelism, with overlap's styles in place of torch's and torchao's: ``(layer types after
    parallelizing, dtypes overlap's gathers moved, per step (loss, grad norm, largest relative gradient error) of
    torchao's single-process run and overlap's)``."""
    import warnings

    import torchao.float8.float8_tensor_parallel as float8_tp
    import torchtitan.models.llama3.infra.parallelize as llama_tp
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    from overlap.hooks.torch_tp import use_overlap_styles
    from overlap.ops.tp import gather

    model, dims, job, batches = _titan(seed, 4, 2, world_size, False)
    job.model.converters = ["float8"]
    job.quantize.linear.float8.emulate = True
    Float8LinearConverter(job, dims).convert(model)
    alone = train(copy.deepcopy(model), batches, LR)
    with use_overlap_styles(llama_tp, float8_tp), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ours = llama_tp.parallelize_llama(copy.deepcopy(model), dims, job)
    kinds = {n: type(m).__name__ for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)}
    moved, start = [], gather.start

    def counting(kind, call, x2, cc, **kw):
        moved.append(x2.dtype)
        return start(kind, call, x2, cc, **kw)

    gather.start = counting
    try:
        run, ran = _counted(lambda: train(ours, batches, LR))
    finally:
        gather.start = start
    steps = [(float(la), float(lo), float(na), float(no), max(float((go[k] - ga[k]).norm() / ga[k].norm()) for k in ga))
             for (la, na, ga), (lo, no, go) in zip(alone[0], run[0], strict=True)]
    return kinds, moved, steps, ran, [str(w.message) for w in said if "left to torch" in str(w.message)]


def test_torchtitans_float8_converter_trains_in_float8_with_overlap_styles(pools, seed):
    """Every linear layer torchtitan's float8 converter made stays torchao's ``Float8Linear`` under overlap's styles
    (none left to torch's style, none trained without float8), overlap's ops run, some gathers move e4m3 rows, and
    training follows torchao's own single-process float8 run within fp8's reach: each step's loss within 2e-3
    relative, the gradient norm within 1e-2, every gradient within half its norm (a missing shard or reduction is
    about all of it)."""
    for rank, (kinds, moved, steps, ran, left) in enumerate(pools(2).run(float8_task, seed, timeout=600)):
        assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 7 * LAYERS + 1, (rank, kinds)
        assert not left, (rank, left)
        assert ran["all_gather_matmul"] > 0 and torch.uint8 in moved, (rank, ran, moved)
        for i, (loss_ao, loss, norm_ao, norm, worst) in enumerate(steps):
            assert abs(loss - loss_ao) <= 2e-3 * abs(loss_ao), (rank, i, loss, loss_ao)
            assert abs(norm - norm_ao) <= 1e-2 * norm_ao, (rank, i, norm, norm_ao)
            assert worst < 0.5, (rank, i, worst)
