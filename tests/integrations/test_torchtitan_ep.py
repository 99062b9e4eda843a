"""torchtitan's expert parallelism with overlap's ``ExpertParallel`` (`overlap.hooks.expert_parallel`) in its place.

torchtitan's own MoE layer (``torchtitan.models.moe.MoE``: router, reorderer, ``GroupedExperts`` with SwiGLU experts;
the for-loop experts, as torchtitan runs them without a grouped-GEMM GPU) is parallelized by torchtitan's own
``apply_moe_ep_tp`` on an EP mesh twice from the same weights: as it is (torchtitan's ``ExpertParallel``: two
all-to-alls around the experts) and inside ``use_overlap_styles`` on torchtitan's llama4 parallelize module, which
makes that function build overlap's style. Each rank feeds its own tokens (a different count per rank), then
backward with a random output gradient: outputs, the tokens' and the router's gradients and every expert weight's
gradient (whole) within ``1e-5`` of torchtitan's, at EP 2 and 4, on every MoE strategy; the experts' parameters are
``Shard(0)`` DTensors as torchtitan's are. Then EP x TP (``ExpertTensorParallel``) on a 2 x 2 ``[ep, etp]`` mesh
inside torchtitan's TP plan for the layer (`etp_task`); and torchtitan's DeepSeek-V3 (small) parallelized by its
own ``parallelize_deepseekv3`` with FSDP2 and EP 2 and 4, trained against its own EP and float64 (`deepseek_task`).
Needs the ``torchtitan`` extra; skipped without it. CPU ranks only: ``torch.histc`` refuses int64 expert ids on CPU,
which torchtitan's router passes it, so the tasks count them with ``bincount`` for the duration (torchtitan's own run
needs it as much as overlap's).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util

import pytest
import torch

import overlap  # noqa: F401  (before any DTensor op: see test_torch_tp.py)

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed: pip install -e '.[torchtitan]'", allow_module_level=True)

DIM, FFN = 32, 48


@contextlib.contextmanager
def _histc_of_ids():
    """``torch.histc`` of integer ids as ``bincount`` (CPU's histc takes floating tensors only), restored after."""
    histc = torch.histc

    def counting(t, bins=100, min=0, max=0):  # noqa: A002 (torch's names)
        if t.is_floating_point():
            return histc(t, bins=bins, min=min, max=max)
        return torch.bincount(t, minlength=bins)  # in the ids' dtype, as CUDA's histc of integers

    torch.histc = counting
    try:
        yield
    finally:
        torch.histc = histc


class _Block(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe, self.moe_enabled = moe, True


class _Model(torch.nn.Module):
    """What ``apply_moe_ep_tp`` walks: ``layers`` of blocks with an ``moe``."""

    def __init__(self, moe):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": _Block(moe)})


def ep_task(rank, world_size, seed, strategy, score_before):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.models.llama4.infra import parallelize as titan_parallelize
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from overlap.hooks.expert_parallel import ExpertParallel
    from overlap.hooks.torch_tp import use_overlap_styles

    E = 2 * world_size
    args = MoEArgs(num_experts=E, num_shared_experts=1, top_k=2, use_grouped_mm=False, score_func="softmax",
                   score_before_experts=score_before, load_balance_coeff=None)
    torch.manual_seed(seed)
    moe = MoE(args, dim=DIM, hidden_dim=FFN)
    with torch.no_grad():  # (as torchtitan initializes: under no_grad)
        moe.init_weights(0.1, torch.device("cpu"))
    mesh = DeviceMesh("cpu", list(range(world_size)), mesh_dim_names=("ep",))

    def parallelized(ours: bool) -> MoE:
        """torchtitan's ``apply_moe_ep_tp`` on a copy, building torchtitan's style, or overlap's where `ours`
        (through ``use_overlap_styles`` for ``auto``; else overlap's style with the strategy, as a user passes it)."""
        model = _Model(copy.deepcopy(moe))
        if ours and strategy != "auto":
            parallelize_module(model.layers["0"].moe.experts, mesh, ExpertParallel(strategy=strategy))
            return model.layers["0"].moe
        with use_overlap_styles(titan_parallelize) if ours else contextlib.nullcontext():
            titan_parallelize.apply_moe_ep_tp(model, None, mesh, None, None)
        return model.layers["0"].moe

    theirs, ours = parallelized(False), parallelized(True)
    assert "forward" in vars(ours.experts) and "forward" not in vars(theirs.experts)  # overlap's layer, torchtitan's
    for layer in (theirs, ours):
        for name in ("w1", "w2", "w3"):
            w = getattr(layer.experts, name)
            assert isinstance(w, DTensor) and w.placements == (Shard(0),), (name, w)
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    tokens = 1 + rank % 3  # a different batch per rank
    x = torch.randn(tokens, 8, DIM, generator=gen)
    grad = torch.randn(tokens, 8, DIM, generator=gen)

    return _same_layer(theirs, ours, x, grad, f"rank {rank}/{world_size} {strategy}")


def _same_layer(theirs, ours, x, grad, ctx: str) -> dict[str, int]:
    """Forward and backward of the two parallelized MoE layers on this rank's `x` with output gradient `grad`:
    outputs, the tokens' gradient and every parameter's (whole) within 1e-5 of each other. Returns how often
    overlap's MoE ops ran in `ours`' run."""
    from torch.distributed.tensor import DTensor

    def run(layer):
        xi = x.clone().requires_grad_(True)
        with _histc_of_ids():
            out = layer(xi)
            out = out.to_local() if isinstance(out, DTensor) else out
            out.backward(grad)
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in layer.named_parameters()}
        return out.detach(), xi.grad, grads

    out_t, gx_t, grads_t = run(theirs)
    before = calls()
    out_o, gx_o, grads_o = run(ours)
    ran = {op: n - before[op] for op, n in calls().items()}
    torch.testing.assert_close(out_o, out_t, rtol=1e-5, atol=1e-5, msg=lambda m: f"{ctx} out: {m}")
    torch.testing.assert_close(gx_o, gx_t, rtol=1e-5, atol=1e-5, msg=lambda m: f"{ctx} grad x: {m}")
    assert grads_o.keys() == grads_t.keys()
    for name, g in grads_o.items():
        torch.testing.assert_close(g, grads_t[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{ctx} {n}: {m}")
    return ran


def calls():
    from overlap.ops import library

    return {op: library.CALLS[op] for op in ("moe_dispatch", "moe_combine")}


@pytest.mark.parametrize("score_before", [True, False], ids=["scores before", "scores after"])
@pytest.mark.parametrize("strategy", ["auto", "reference", "pipelined", "symm", "fused"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_torchtitans_moe_trains_with_overlaps_expert_parallel_as_with_its_own(pools, seed, world_size, strategy,
                                                                              score_before):
    if world_size == 4 and strategy == "fused":
        pytest.skip("fused is interpreted on CPU ranks: EP 2 covers it")
    for rank, ran in enumerate(pools(world_size).run(ep_task, seed, strategy, score_before, timeout=600)):
        assert ran == {"moe_dispatch": 1, "moe_combine": 1}, (rank, ran)  # one layer, one forward


def refusals_task(rank, world_size):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.models.moe.moe import GroupedExperts

    from overlap.hooks.expert_parallel import ExpertParallel

    mesh = DeviceMesh("cpu", list(range(world_size)))
    said = []
    lacking = torch.nn.Module()
    lacking.w1 = torch.nn.Parameter(torch.zeros(2, FFN, DIM))
    cases = [(lacking, mesh), (GroupedExperts(DIM, FFN, 3, False), mesh)]
    twice = parallelize_module(GroupedExperts(DIM, FFN, 2, False), mesh, ExpertParallel())
    cases.append((twice, mesh))
    for module, on in cases:
        with pytest.raises(ValueError) as err:
            parallelize_module(module, on, ExpertParallel())
        said.append(str(err.value))
    with pytest.raises(ValueError) as err:  # the rows per expert do not sum to the rows: raised before any transfer
        twice(torch.zeros(5, DIM), torch.tensor([2, 2]))
    said.append(str(err.value))
    return said


def test_expert_parallel_refuses_what_it_cannot_take_on_every_rank(pools):
    from overlap.hooks.expert_parallel import ExpertParallel

    with pytest.raises(ValueError, match="strategy"):
        ExpertParallel(strategy="bogus")
    for said in pools(2).run(refusals_task, timeout=120):
        assert "lacks w2, w3" in said[0], said
        assert "3 experts do not divide over 2 ranks" in said[1], said
        assert "DTensors already" in said[2], said
        assert "must be [4, dim]" in said[3] and "got (5, 32)" in said[3], said


def etp_task(rank, world_size, seed, strategy):
    """EP x TP on a 2 x 2 mesh [ep, etp], through torchtitan's ``apply_moe_ep_tp`` with its TP mesh the ``etp`` one (its
    MoE plan: each rank's sequence shard gathered over TP, the experts' output a ``Partial`` reduce-scattered back):
    torchtitan's ``ExpertTensorParallel`` against overlap's (swapped in by ``use_overlap_styles``, which also puts
    overlap's TP styles on the shared expert; or made by hand with `strategy`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.models.llama4.infra import parallelize as titan_parallelize
    from torchtitan.models.moe.moe import MoE, MoEArgs

    from overlap.hooks.expert_parallel import ExpertTensorParallel
    from overlap.hooks.torch_tp import use_overlap_styles

    E = 4
    args = MoEArgs(num_experts=E, num_shared_experts=1, top_k=2, use_grouped_mm=False, score_func="softmax",
                   load_balance_coeff=None)
    torch.manual_seed(seed)
    moe = MoE(args, dim=DIM, hidden_dim=FFN)
    with torch.no_grad():
        moe.init_weights(0.1, torch.device("cpu"))
    mesh = DeviceMesh("cpu", torch.arange(world_size).view(2, world_size // 2), mesh_dim_names=("ep", "etp"))
    tp, ep = mesh["etp"], mesh["ep"]

    def parallelized(ours: bool) -> MoE:
        model = _Model(copy.deepcopy(moe))
        with use_overlap_styles(titan_parallelize) if ours else contextlib.nullcontext():
            if ours and strategy != "auto":  # overlap's style with a strategy (the name restored on exit)
                titan_parallelize.ExpertTensorParallel = functools.partial(ExpertTensorParallel, strategy=strategy)
            titan_parallelize.apply_moe_ep_tp(model, tp, ep, tp, mesh)
        return model.layers["0"].moe

    theirs, ours = parallelized(False), parallelized(True)
    assert "forward" in vars(ours.experts) and "forward" not in vars(theirs.experts)
    for layer in (theirs, ours):
        for name in ("w1", "w2", "w3"):
            w = getattr(layer.experts, name)
            assert isinstance(w, DTensor) and w.placements == (Shard(0), Shard(2 if name == "w2" else 1)), (name, w)
    gen = torch.Generator().manual_seed(seed * 100 + rank // tp.size())  # a batch per ep rank, its sequence split
    x = torch.randn(2, 8, DIM, generator=gen).chunk(tp.size(), dim=1)[tp.get_local_rank()].contiguous()
    grad = torch.randn(2, 8, DIM, generator=gen).chunk(tp.size(), dim=1)[tp.get_local_rank()].contiguous()

    return _same_layer(theirs, ours, x, grad, f"rank {rank}/{world_size} ep x etp {strategy}")


@pytest.mark.parametrize("strategy", ["auto", "pipelined"])
def test_expert_tensor_parallel_trains_as_torchtitans(pools, seed, strategy):
    for rank, ran in enumerate(pools(4).run(etp_task, seed, strategy, timeout=600)):
        assert ran == {"moe_dispatch": 1, "moe_combine": 1}, (rank, ran)


def deepseek_task(rank, world_size, seed):
    """torchtitan's DeepSeek-V3 (its debug shape, smaller) parallelized by its own ``parallelize_deepseekv3`` with
    EP over both ranks (borrowed from FSDP's data ranks, as torchtitan arranges it), trained 2 SGD steps, each data
    rank on its half of the batch: torchtitan's ``ExpertParallel`` against overlap's (``use_overlap_styles`` on the
    llama4 module its parallelize calls into) and the unsharded model in float64. FSDP2 reduces with a plain sum on
    gloo (tests/integrations/test_torchtitan.py says why)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = titan_dims.device_type = "cpu"
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.llama4.infra import parallelize as titan_parallelize
    from torchtitan.models.moe.moe import MoEArgs

    from overlap.hooks.torch_tp import use_overlap_styles
    from tests.support.train_compare import compare, train, train_sharded_data

    seq, vocab, steps = 16, 256, 2
    args = DeepSeekV3ModelArgs(vocab_size=vocab, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=1,
                               n_heads=4, max_seq_len=seq, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16,
                               moe_args=MoEArgs(num_experts=2 * world_size, num_shared_experts=1, top_k=2,
                                                score_func="softmax", use_grouped_mm=False, load_balance_coeff=None))
    job = JobConfig()
    job.training.seq_len = seq
    job.training.mixed_precision_param = "float32"
    job.parallelism.data_parallel_shard_degree = world_size
    job.parallelism.expert_parallel_degree = world_size
    job.activation_checkpoint.mode = "none"
    args.update_from_config(job)  # (as torchtitan's trainer does)
    torch.manual_seed(seed)
    model = DeepSeekV3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=world_size, etp=1,
                        world_size=world_size)
    dims.build_mesh()
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, vocab, (2 * world_size, seq), generator=gen),
                torch.randint(0, vocab, (2 * world_size, seq), generator=gen)) for _ in range(steps)]
    with _histc_of_ids():
        exact = train(copy.deepcopy(model).double(), batches, 0.05)
        runs, ran = [], None
        for ours in (False, True):
            with use_overlap_styles(titan_parallelize) if ours else contextlib.nullcontext():
                parallel = parallelize_deepseekv3(copy.deepcopy(model), dims, job)
            for module in parallel.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
            mesh = dims.get_mesh("fsdp")
            before = calls()
            runs.append(train_sharded_data(parallel, batches, 0.05, mesh.get_group(), mesh.get_local_rank(),
                                           mesh.size()))
            ran = {op: n - before[op] for op, n in calls().items()}
    compare(runs[1], runs[0], exact, f"rank {rank}/{world_size} DeepSeek-V3 EP")
    return ran


@pytest.mark.parametrize("world_size", [2, 4])
def test_deepseek_v3_trains_with_overlaps_expert_parallel_as_with_torchtitans(pools, seed, world_size):
    for rank, ran in enumerate(pools(world_size).run(deepseek_task, seed, timeout=600)):
        assert ran == {"moe_dispatch": 2, "moe_combine": 2}, (rank, ran)  # one MoE layer, 2 steps
