"""overlap.hooks.megatron (its layers, patch, specs) against the real megatron-core (pinned in the test extras).

Models are stacks of Megatron-core MLP blocks (``ColumnParallelLinear`` fc1, GELU,
``RowParallelLinear`` fc2, with biases) built from Megatron's own spec on CPU ranks. Megatron-core
cannot run sequence parallelism on CPU (it calls ``torch.cuda``), so a patched sequence-parallel
model is compared with the unpatched model without it, after Megatron's reduction of the gradients
of sequence-parallel parameters (the all-reduce of ``finalize_model_grads``, done here by hand).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import megatron_groups

# The test extras pin megatron-core; a machine without it (the GPU machine's stack) skips this module.
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]')")

S, B, H, F = 6, 2, 12, 24  # sequence, batch, hidden, ffn: every dim divides by 2 and 3
LAYERS = 2


def _megatron(world_size: int):
    """Megatron's parallel state with tensor parallelism over the whole (gloo) world."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == world_size:
            return parallel_state
        megatron_groups.reset(parallel_state)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    return parallel_state


def _config(world_size: int, sequence_parallel: bool, dtype=torch.float32, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=H, ffn_hidden_size=F, num_attention_heads=world_size,
        tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, add_bias_linear=True, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, params_dtype=dtype, **extra,
    )


class Stack(torch.nn.Module):
    """Megatron MLP blocks with residuals: ``x = x + fc2(gelu(fc1(x)))``."""

    def __init__(self, config, submodules):
        super().__init__()
        from megatron.core.transformer.mlp import MLP

        self.blocks = torch.nn.ModuleList(MLP(config, submodules) for _ in range(LAYERS))

    def forward(self, x):
        for block in self.blocks:
            y, bias = block(x)
            x = x + (y + bias if bias is not None else y)
        return x


def _build(world_size, seed, sequence_parallel, spec_fn=None, **extra):
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec

    spec = get_mlp_module_spec(use_te=False)
    if spec_fn is not None:
        spec = spec_fn(spec)
    torch.manual_seed(seed)  # Megatron's CPU init draws the whole master weight on every rank
    return Stack(_config(world_size, sequence_parallel, **extra), spec.submodules)


def _reduce_sequence_parallel_grads(model, group):
    """What Megatron's finalize_model_grads does for sequence-parallel parameters."""
    import torch.distributed as dist

    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _step(model, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.backward(grad_out)
    return out.detach(), x.grad


def patched_vs_unpatched(rank, world_size, seed, sequence_parallel, strategy):
    import overlap.hooks.megatron as om

    ps = _megatron(world_size)
    group = ps.get_tensor_model_parallel_group()
    ref = _build(world_size, seed, False)
    model = _build(world_size, seed, sequence_parallel)
    replaced = om.patch(model, strategy=strategy)
    kinds = sorted(type(r.replacement).__name__ for r in replaced)
    assert kinds == ["ColumnParallelLinear"] * LAYERS + ["RowParallelLinear"] * LAYERS, kinds
    assert all(isinstance(m, (om.ColumnParallelLinear, om.RowParallelLinear))
               for b in model.blocks for m in (b.linear_fc1, b.linear_fc2))
    # The very same parameter tensors, and Megatron's attributes on them.
    for r in replaced:
        assert r.replacement.weight is r.original.weight and r.replacement.bias is r.original.bias
    fc1, fc2 = model.blocks[0].linear_fc1, model.blocks[0].linear_fc2
    assert (fc1.weight.tensor_model_parallel, fc1.weight.partition_dim) == (True, 0)
    assert (fc2.weight.tensor_model_parallel, fc2.weight.partition_dim) == (True, 1)
    assert fc2.bias.sequence_parallel == sequence_parallel

    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(S, B, H, generator=gen)
    g = torch.randn(S, B, H, generator=gen)
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    y_ref, gx_ref = _step(ref, x, g)
    if sequence_parallel:
        y, gx = _step(model, x[rows], g[rows])
        y_ref, gx_ref = y_ref[rows], gx_ref[rows]
        _reduce_sequence_parallel_grads(model, group)
    else:
        y, gx = _step(model, x, g)
    errors = {"out": (y - y_ref).abs().max().item(), "grad_x": (gx - gx_ref).abs().max().item()}
    for (name, p), (name_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == name_ref, (name, name_ref)
        assert p.grad is not None, name
        errors[f"grad {name}"] = (p.grad - p_ref.grad).abs().max().item()
    for m in (model, ref):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        opt.step()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        errors[f"after step {name}"] = (p - p_ref).abs().max().item()
    om.unpatch(model, replaced)
    assert type(model.blocks[0].linear_fc1).__module__.startswith("megatron.core"), type(model.blocks[0].linear_fc1)
    assert model.blocks[0].linear_fc1.weight is replaced[0].original.weight
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("strategy", ["reference", "pipelined", "symm"])
def test_patched_matches_megatron(pools, seed, world_size, sequence_parallel, strategy):
    results = pools(world_size).run(patched_vs_unpatched, seed, sequence_parallel, strategy, timeout=120)
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_patched_fused_matches_megatron(pools, seed):
    results = pools(2).run(patched_vs_unpatched, seed, True, "fused", timeout=180)
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def built_from_spec(rank, world_size, seed, sequence_parallel):
    """A model built with overlap's layers through the spec: Megatron's parameters, names and init."""
    from overlap.hooks.megatron import OverlapSpecProvider, replace_in_spec

    _megatron(world_size)
    ref = _build(world_size, seed, False)
    ours = _build(world_size, seed, sequence_parallel, spec_fn=replace_in_spec)
    assert type(ours.blocks[0].linear_fc1).__module__ == "overlap.hooks.megatron_linear"
    assert OverlapSpecProvider().column_parallel_linear().__module__ == "overlap.hooks.megatron_linear"
    sd_ref, sd = ref.state_dict(), ours.state_dict()
    assert list(sd) == list(sd_ref), (list(sd), list(sd_ref))
    for key in sd:
        if isinstance(sd[key], torch.Tensor):
            assert torch.equal(sd[key], sd_ref[key]), key  # the same draws as Megatron's init
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters(), strict=True):
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce"):
            assert getattr(p, attr, None) == getattr(p_ref, attr, None), (name, attr)
    # Checkpoints load both ways (strict): perturb, save from one, load into the other.
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p))
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters(), strict=True))
    fresh = _build(world_size, seed + 7, sequence_parallel, spec_fn=replace_in_spec)
    fresh.load_state_dict(ref.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), fresh.parameters(), strict=True))
    # Megatron's distributed checkpoint: the same sharded keys, shapes and offsets.
    meta = {"dp_cp_group": None}
    keys_ref = _sharded(ref.blocks[0].linear_fc1, meta) | _sharded(ref.blocks[0].linear_fc2, meta)
    keys = _sharded(ours.blocks[0].linear_fc1, meta) | _sharded(ours.blocks[0].linear_fc2, meta)
    assert keys == keys_ref, (keys, keys_ref)
    return True


def _sharded(module, metadata):
    from megatron.core import parallel_state

    metadata = dict(metadata, dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    out = module.sharded_state_dict(prefix="fc.", metadata=metadata)
    return {(k, type(v).__name__, tuple(getattr(v, "local_shape", ())), tuple(getattr(v, "global_shape", ())),
             tuple(getattr(v, "global_offset", ()))) for k, v in out.items()}


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_spec_built_model_matches_megatron_parameters_and_checkpoints(pools, seed, world_size):
    assert all(pools(world_size).run(built_from_spec, seed, True, timeout=120))


def gather_output_and_main_grad(rank, world_size, seed):
    """gather_output=True, input_is_parallel=False, skip_bias_add=False, and gradient accumulation into
    main_grad (Megatron's protocol), against the unsharded layers built from the master weights
    (Megatron-core's own gather/scatter of the last dim call torch.cuda on CPU)."""
    from overlap.hooks import megatron as om

    _megatron(world_size)
    config = _config(world_size, False)
    init = torch.nn.init.xavier_normal_
    torch.manual_seed(seed)
    col = om.ColumnParallelLinear(H, F, config=config, init_method=init, bias=True, gather_output=True,
                                   keep_master_weight_for_test=True)
    row = om.RowParallelLinear(F, H, config=config, init_method=init, bias=True, input_is_parallel=False,
                                skip_bias_add=False, keep_master_weight_for_test=True)
    with torch.no_grad():  # non-zero biases, the same on every rank
        gen = torch.Generator().manual_seed(seed + 2)
        bias_c, bias_r = torch.randn(F, generator=gen), torch.randn(H, generator=gen)
        fs = slice(rank * F // world_size, (rank + 1) * F // world_size)
        col.bias.copy_(bias_c[fs])
        row.bias.copy_(bias_r)
    # main_grad on both weights: fp32 buffers holding an earlier micro-batch's gradient.
    col.gradient_accumulation_fusion = row.gradient_accumulation_fusion = True
    earlier = {}
    for name, layer in (("col", col), ("row", row)):
        earlier[name] = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(seed + 3))
        layer.weight.main_grad = earlier[name].clone()
        layer.weight.grad_added_to_main_grad = False
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(S, B, H, generator=gen)
    g = torch.randn(S, B, H, generator=gen)

    xi = x.clone().requires_grad_(True)
    h, bias = col(xi)
    assert bias is None and h.shape == (S, B, F), h.shape  # gathered along the last dim
    y, bias = row(torch.nn.functional.gelu(h))
    assert bias is None and y.shape == (S, B, H)
    y.backward(g)

    wc = col.master_weight.double().requires_grad_(True)
    wr = row.master_weight.double().requires_grad_(True)
    bc, br = bias_c.double().requires_grad_(True), bias_r.double().requires_grad_(True)
    xr = x.double().requires_grad_(True)
    y_ref = torch.nn.functional.gelu(xr @ wc.t() + bc) @ wr.t() + br
    y_ref.backward(g.double())
    errors = {
        "out": (y - y_ref).abs().max().item(),
        "grad_x": (xi.grad - xr.grad).abs().max().item(),
        "col main_grad": (col.weight.main_grad - earlier["col"] - wc.grad[fs]).abs().max().item(),
        "row main_grad": (row.weight.main_grad - earlier["row"] - wr.grad[:, fs]).abs().max().item(),
        "col bias grad": (col.bias.grad - bc.grad[fs]).abs().max().item(),
        "row bias grad": (row.bias.grad - br.grad).abs().max().item(),
    }
    assert col.weight.grad_added_to_main_grad and row.weight.grad_added_to_main_grad
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_output_scatter_input_and_main_grad(pools, seed, world_size):
    for rank, errors in enumerate(pools(world_size).run(gather_output_and_main_grad, seed, timeout=120)):
        bad = {k: v for k, v in errors.items() if not v <= 1e-4}
        assert not bad, f"rank {rank}: {bad}"


def unsupported_arguments(rank, world_size):
    from overlap.hooks import megatron as om

    _megatron(world_size)
    init = torch.nn.init.xavier_normal_
    raised = {}
    for what, kwargs in (("is_expert", {"is_expert": True}),):
        try:
            om.ColumnParallelLinear(H, F, config=_config(world_size, False), init_method=init, **kwargs)
        except NotImplementedError as exc:
            raised[what] = str(exc)
    try:
        config = _config(world_size, False)
        config.defer_embedding_wgrad_compute = True  # (Megatron's config refuses it without pipelining)
        om.ColumnParallelLinear(H, F, config=config, init_method=init)
    except NotImplementedError as exc:
        raised["defer_embedding_wgrad_compute"] = str(exc)
    try:
        om.ColumnParallelLinear(H, F + 1, config=_config(world_size, False), init_method=init)
    except ValueError as exc:
        raised["indivisible"] = str(exc)
    return raised


def test_unsupported_arguments_raise_naming_them(pools):
    for raised in pools(2).run(unsupported_arguments, timeout=60):
        assert "is_expert" in raised["is_expert"], raised
        assert "defer_embedding_wgrad_compute" in raised["defer_embedding_wgrad_compute"], raised
        assert "output_size=25" in raised["indivisible"], raised


class _NoFork:
    def fork(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


class _CPUBuffer:
    def get_tensor(self, shape, dtype, name, *args, **kwargs):
        return torch.empty(tuple(shape), dtype=dtype)


def attention_layer(rank, world_size, seed, sequence_parallel):
    """A whole Megatron-core transformer layer (attention + MLP) from its local spec, patched against unpatched."""

    ps = _megatron(world_size)
    from megatron.core import tensor_parallel

    saved = ps.get_global_memory_buffer, tensor_parallel.get_cuda_rng_tracker
    # Megatron's core attention takes its scratch buffer from a CUDA-only pool and forks a CUDA RNG
    # for its dropout (0 here): CPU stand-ins (test shims; the layers under test, linear_qkv and
    # linear_proj, are not touched by them).
    ps.get_global_memory_buffer = lambda: _CPUBuffer()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoFork()
    try:
        return _attention_layer(rank, world_size, seed, sequence_parallel)
    finally:
        ps.get_global_memory_buffer, tensor_parallel.get_cuda_rng_tracker = saved


def _attention_layer(rank, world_size, seed, sequence_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    import overlap.hooks.megatron as om

    layers = []
    for sp in (False, sequence_parallel):
        config = _config(world_size, sp)
        config.attention_dropout = config.hidden_dropout = 0.0
        torch.manual_seed(seed)
        layers.append(build_module(get_gpt_layer_local_spec(), config=config, layer_number=1))
    ref, model = layers
    replaced = om.patch(model)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(S, B, H, generator=gen)
    g = torch.randn(S, B, H, generator=gen)
    causal = torch.triu(torch.ones(S, S), diagonal=1).bool()[None, None]  # True: masked out
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size) if sequence_parallel else slice(None)
    outs = []
    for m, xs, gs in ((ref, x, g), (model, x[rows], g[rows])):
        xi = xs.clone().requires_grad_(True)
        out, _ = m(xi, attention_mask=causal)  # (Megatron's default mask is built on CUDA)
        out.backward(gs)
        outs.append((out.detach(), xi.grad))
    if sequence_parallel:  # Megatron's finalize_model_grads: layer norms and row biases
        _reduce_sequence_parallel_grads(model, _megatron(world_size).get_tensor_model_parallel_group())
    errors = {"out": (outs[0][0][rows] - outs[1][0]).abs().max().item(),
              "grad_x": (outs[0][1][rows] - outs[1][1]).abs().max().item(), "replaced": len(replaced)}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        errors[f"grad {name}"] = (p.grad - p_ref.grad).abs().max().item()
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_transformer_layer_with_attention(pools, seed, world_size):
    """Megatron's attention block runs on CPU with two stand-ins (see attention_layer). Not with
    sequence parallelism: without apex, Megatron-core's layer norm refuses it at construction."""
    args = (seed, False)
    for rank, errors in enumerate(pools(world_size).run(attention_layer, *args, timeout=120)):
        assert errors.pop("replaced") == 4, errors  # qkv, proj, fc1, fc2
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


# ----------------------------------------------------------------------------------------------
# torch.compile: no graph break inside overlap's code
# ----------------------------------------------------------------------------------------------


def compiled_patched(rank, world_size, seed, sequence_parallel):
    """A patched Megatron stack: the graph breaks torch._dynamo.explain reports (each with the file it broke
    in), and the compiled model against eager (outputs and every gradient)."""
    import torch._dynamo

    import overlap.hooks.megatron as om

    _megatron(world_size)
    model = _build(world_size, seed, sequence_parallel)
    om.patch(model, strategy="symm")
    rows = S // world_size if sequence_parallel else S
    x = torch.randn(rows, B, H, generator=torch.Generator().manual_seed(seed + rank))
    g = torch.randn(rows, B, H, generator=torch.Generator().manual_seed(seed + 7))

    def run(fn):
        y, gx = _step(fn, x, g)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [y, gx, *grads]

    torch._dynamo.reset()
    eager = run(model)
    explained = torch._dynamo.explain(model)(x)
    torch._dynamo.reset()
    compiled = run(torch.compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    breaks = [(str(r.reason).splitlines()[0], r.user_stack[-1].filename if r.user_stack else "")
              for r in explained.break_reasons]
    return {"breaks": breaks, "max_diff": max((a - b).abs().max().item() for a, b in zip(compiled, eager, strict=True))}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_patched_model_compiles_without_breaks_in_overlap(pools, seed, sequence_parallel):
    import overlap

    package = str(__import__("pathlib").Path(overlap.__file__).parent)
    for rank, r in enumerate(pools(2).run(compiled_patched, seed, sequence_parallel, timeout=300)):
        ours = [b for b in r["breaks"] if b[1].startswith(package)]
        assert not ours, f"rank {rank}: graph breaks in overlap's code: {ours}"
        assert r["max_diff"] <= 1e-5, f"rank {rank}: compiled patched model differs from eager by {r['max_diff']}"


def compiled_attention_layer(rank, world_size, seed):
    """A patched Megatron-core transformer layer (attention + MLP, the CPU stand-ins of `attention_layer`):
    the graph breaks torch._dynamo.explain reports, each with the file it broke in."""
    import torch._dynamo
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    import overlap.hooks.megatron as om

    ps = _megatron(world_size)
    saved = ps.get_global_memory_buffer, tensor_parallel.get_cuda_rng_tracker
    ps.get_global_memory_buffer = lambda: _CPUBuffer()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoFork()
    try:
        config = _config(world_size, False)
        config.attention_dropout = config.hidden_dropout = 0.0
        torch.manual_seed(seed)
        layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
        om.patch(layer, strategy="symm")
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed))
        causal = torch.triu(torch.ones(S, S), diagonal=1).bool()[None, None]
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(x, attention_mask=causal)
        torch._dynamo.reset()
    finally:
        ps.get_global_memory_buffer, tensor_parallel.get_cuda_rng_tracker = saved
    return [(str(r.reason).splitlines()[0], r.user_stack[-1].filename if r.user_stack else "")
            for r in explained.break_reasons]


def test_patched_transformer_layer_breaks_only_in_megatron(pools, seed):
    import overlap

    package = str(__import__("pathlib").Path(overlap.__file__).parent)
    for rank, breaks in enumerate(pools(2).run(compiled_attention_layer, seed, timeout=300)):
        ours = [b for b in breaks if b[1].startswith(package)]
        assert not ours, f"rank {rank}: graph breaks in overlap's code: {ours}"
