"""fp8 in overlap.hooks.megatron (its layers, patch, specs) against the real megatron-core, on CPU ranks.

* **Which recipe.** Megatron's ``config.fp8``/``config.fp8_recipe`` map to the layers' recipe (``tensorwise`` ->
  ``"tensorwise"``, ``mxfp8`` -> ``"mxfp8"``, with a warning that the backward stays in the parameters' dtype);
  ``delayed``, ``blockwise``, ``fp8_param`` and ``fp4`` are refused with one line naming what to use; the layers'
  ``fp8=`` keyword overrides the config (None turns fp8 off); a bad keyword or an ``"mxfp8"`` GEMM whose k is not
  a multiple of 32 raises in ``__init__`` on every rank.
* **The op-level recipe.** Every mode of both layers (column: sequence parallel, all-reduced input gradient,
  ``gather_output``; row: sequence parallel, all-reduce, ``input_is_parallel=False``) at tensor-parallel sizes 2
  and 3, recipes from the config and from the keyword: output and gradients bitwise those of the op the mode stands
  for with the same recipe (as in test_nn_fp8.py; the row layer's sequence-parallel bias gradient is this rank's
  part, Megatron's ``finalize_model_grads`` sums it).
* **patch and specs.** ``patch`` of a Megatron MLP stack gives every layer its config's recipe (the same numbers as
  ``patch(model, fp8=...)`` of the same model without fp8 in its config), and ``fp8=None`` gives the numbers of no
  fp8; a refused config or keyword leaves the model as it was; ``replace_in_spec(spec, fp8=...)`` builds layers
  with that recipe. MoE layers quantize their tokens before the dispatch (keyword ``rowwise``, config ``blockwise`` as
  ``block128``, ``mxfp8``), within fp8's rounding of the same layer without fp8; ``tensorwise`` is refused there.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import megatron_groups

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]')")

from tests.integrations.test_megatron import Stack  # noqa: E402  (Megatron MLP blocks with residuals)

S, B, H = 6, 2, 64  # sequence (divides by 2 and 3), batch, hidden (the column GEMM's k: a multiple of 32)
LAYERS = 2


def _ffn(world_size: int) -> int:
    return 32 * world_size  # the row GEMM's k per rank: 32


def _config(world_size: int, sequence_parallel: bool = False, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    warnings.filterwarnings("ignore")
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=H, ffn_hidden_size=_ffn(world_size), num_attention_heads=world_size,
        tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel, use_cpu_initialization=True,
        add_bias_linear=True, bias_activation_fusion=False, gradient_accumulation_fusion=False, **extra)


def _megatron(world_size: int):
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == world_size \
                and parallel_state.get_expert_model_parallel_world_size() == 1:
            return parallel_state
        megatron_groups.reset(parallel_state)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    return parallel_state


def _attempt(make):
    """``(error type, message)`` of `make()`, or what it returned."""
    try:
        return make()
    except (TypeError, ValueError, NotImplementedError) as exc:
        return type(exc).__name__, str(exc)


# ----------------------------------------------------------------------------------------------
# Which recipe
# ----------------------------------------------------------------------------------------------


def recipes_task(rank, world_size) -> dict:
    import overlap.hooks.megatron as om
    from overlap import Fp8Recipe

    _megatron(world_size)
    F = _ffn(world_size)

    def column(config, **kw):
        return om.ColumnParallelLinear(H, F, config=config, init_method=torch.nn.init.normal_, **kw)

    def row(config, input_size=F, **kw):
        return om.RowParallelLinear(input_size, H, config=config, init_method=torch.nn.init.normal_, bias=True,
                                    input_is_parallel=True, skip_bias_add=False, **kw)

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["tensorwise"] = (column(_config(world_size, fp8="hybrid", fp8_recipe="tensorwise")).fp8,
                             row(_config(world_size, fp8="hybrid", fp8_recipe="tensorwise")).fp8)
    out["warned"] = [str(w.message) for w in caught if "backward GEMMs" in str(w.message)]
    out["mxfp8"] = (column(_config(world_size, fp8="e4m3", fp8_recipe="mxfp8")).fp8,
                    row(_config(world_size, fp8="e4m3", fp8_recipe="mxfp8")).fp8)
    out["none"] = column(_config(world_size)).fp8, column(_config(world_size, fp8_recipe="tensorwise")).fp8
    delayed = _config(world_size, fp8="e4m3")  # Megatron's default recipe: delayed
    out["delayed"] = _attempt(lambda: column(delayed))
    out["blockwise"] = _attempt(lambda: row(_config(world_size, fp8="e4m3", fp8_recipe="blockwise")))
    out["fp8_param"] = _attempt(lambda: column(_config(world_size, fp8="e4m3", fp8_recipe="tensorwise",
                                                       fp8_param=True)))
    fp4 = _config(world_size)
    fp4.fp4 = "nvfp4"  # TransformerConfig itself wants Transformer Engine for fp4
    out["fp4"] = _attempt(lambda: row(fp4))
    out["keyword over config"] = (column(delayed, fp8="rowwise").fp8, row(delayed, fp8=None).fp8,
                                  column(_config(world_size), fp8=Fp8Recipe("mxfp8", grads=True)).fp8)
    out["bad keyword"] = _attempt(lambda: column(_config(world_size), fp8="e5m2"))
    out["mxfp8 row k"] = _attempt(lambda: row(_config(world_size), input_size=48 * world_size, fp8="mxfp8"))
    out["mxfp8 config row k"] = _attempt(lambda: row(_config(world_size, fp8="e4m3", fp8_recipe="mxfp8"),
                                                     input_size=48 * world_size))
    out["repr"] = repr(column(_config(world_size), fp8="tensorwise"))
    return out


def test_config_recipes_map_keyword_overrides_and_refusals_are_one_line(pools):
    from overlap import Fp8Recipe

    for res in pools(2).run(recipes_task, timeout=120):
        assert res["tensorwise"] == (Fp8Recipe("tensorwise"),) * 2, res
        assert len(res["warned"]) <= 1 and all("grads=True" in m for m in res["warned"]), res
        assert res["mxfp8"] == (Fp8Recipe("mxfp8"),) * 2, res
        assert res["none"] == (None, None), res
        for name, named, use in (("delayed", "'delayed'", "'tensorwise'"), ("blockwise", "'blockwise'", "'mxfp8'"),
                                 ("fp8_param", "fp8_param", "fp8="), ("fp4", "fp4", "fp8=")):
            kind, message = res[name]
            assert kind == "NotImplementedError" and named in message and use in message, (name, res[name])
            assert "\n" not in message and "overlap.hooks.megatron.".lower() in message.lower(), (name, message)
        assert res["keyword over config"] == (Fp8Recipe("rowwise"), None, Fp8Recipe("mxfp8", grads=True)), res
        assert res["bad keyword"][0] == "ValueError" and "'e5m2'" in res["bad keyword"][1], res
        for name in ("mxfp8 row k", "mxfp8 config row k"):
            assert res[name][0] == "ValueError" and "input_size/tp=48" in res[name][1], res
        assert "fp8='tensorwise'" in res["repr"], res


# ----------------------------------------------------------------------------------------------
# The op-level recipe
# ----------------------------------------------------------------------------------------------

# (name, config's fp8 fields, the layers' fp8 keyword); "config" takes the config's
RECIPES = [("config tensorwise", dict(fp8="hybrid", fp8_recipe="tensorwise"), "config"),
           ("config mxfp8", dict(fp8="e4m3", fp8_recipe="mxfp8"), "config"),
           ("keyword rowwise", dict(fp8="e4m3"), "rowwise"),
           ("keyword rowwise+grads", {}, "rowwise+grads")]
COLUMN_MODES = [dict(sequence_parallel=True), dict(sequence_parallel=False),
                dict(sequence_parallel=False, gather_output=True)]
ROW_MODES = [dict(sequence_parallel=True), dict(sequence_parallel=False),
             dict(sequence_parallel=False, input_is_parallel=False)]
STRATEGIES = ("reference", "symm", "auto")


def _split(n, rank, world_size):
    return slice(rank * n // world_size, (rank + 1) * n // world_size)


def _gather(t, dim):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _summed(t):
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def _check(ctx, got, want):
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), \
            f"{ctx}: {name} is not the op's: {(a - b).abs().max().item() if a.shape == b.shape else a.shape}"


def layer_case(rank, world_size, seed, layer_kind, mode, recipe, strategy):
    import overlap.hooks.megatron as om
    from overlap import all_gather_matmul, fp8_matmul, matmul_all_reduce, matmul_reduce_scatter

    name, config_fields, keyword = recipe
    mode = dict(mode)
    sp = mode.pop("sequence_parallel")
    config = _config(world_size, sp, **config_fields)
    F = _ffn(world_size)
    ctx = f"{layer_kind} rank {rank}/{world_size} {name} sp={sp} {mode} {strategy}"
    gen = torch.Generator().manual_seed(seed)
    rows = _split(S, rank, world_size)
    cols = _split(F, rank, world_size)
    torch.manual_seed(seed)
    if layer_kind == "column":
        layer = om.ColumnParallelLinear(H, F, config=config, init_method=torch.nn.init.normal_, strategy=strategy,
                                        fp8=keyword, **mode)
        x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, F, generator=gen)
        x_in, g_out = (x[rows] if sp else x), g[..., cols]
        g_in = g if mode.get("gather_output") else g_out
    else:
        layer = om.RowParallelLinear(F, H, config=config, init_method=torch.nn.init.normal_, bias=True,
                                     input_is_parallel=mode.get("input_is_parallel", True), skip_bias_add=False,
                                     strategy=strategy, fp8=keyword)
        x, g = torch.randn(S, B, F, generator=gen), torch.randn(S, B, H, generator=gen)
        x_in = x[..., cols] if mode.get("input_is_parallel", True) else x
        g_in = g[rows] if sp else g
    with torch.no_grad():
        layer.bias.normal_(generator=gen)  # Megatron starts biases at zero: a wrong bias path would not show
    assert layer.fp8 is not None, ctx
    xi = x_in.clone().requires_grad_()
    y, bias = layer(xi)
    assert bias is None, ctx
    y.backward(g_in)
    got = [y.detach(), xi.grad, layer.weight.grad, layer.bias.grad]

    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    kwargs = dict(strategy=strategy, fp8=layer.fp8)
    if layer_kind == "column":
        xo = x_in.clone().requires_grad_()
        yo = (all_gather_matmul(xo, w.t(), **kwargs) if sp else fp8_matmul(xo, w.t(), layer.fp8)) + b
        yo.backward(g_out)
        gx = xo.grad if sp else _summed(xo.grad)
        yo = _gather(yo.detach(), -1) if mode.get("gather_output") else yo.detach()
    else:
        xo = x[..., cols].clone().requires_grad_()
        yo = (matmul_reduce_scatter if sp else matmul_all_reduce)(xo, w.t(), **kwargs) + b
        yo.backward(g_in)
        gx = xo.grad if mode.get("input_is_parallel", True) else _gather(xo.grad, -1)
        yo = yo.detach()
    _check(ctx, got, [yo, gx, w.grad, b.grad])


def every_layer_case(rank, world_size, seed) -> int:
    _megatron(world_size)  # the layers' default group: Megatron's tensor-parallel group
    done = 0
    for s, strategy in enumerate(STRATEGIES):
        for r, recipe in enumerate(RECIPES):
            for kind, modes in (("column", COLUMN_MODES), ("row", ROW_MODES)):
                for m, mode in enumerate(modes):
                    if (r + m + s) % len(STRATEGIES) and not mode["sequence_parallel"]:
                        continue  # the modes without sequence parallelism: each strategy once per recipe
                    layer_case(rank, world_size, seed + done, kind, mode, recipe, strategy)
                    done += 1
    return done


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_layers_are_the_ops_recipe(pools, seed, world_size):
    done = pools(world_size).run(every_layer_case, seed, timeout=300)
    assert len(set(done)) == 1 and done[0] > 0, done


# ----------------------------------------------------------------------------------------------
# patch and specs
# ----------------------------------------------------------------------------------------------


def _stack(world_size, seed, sequence_parallel, spec_fn=None, **fields):
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec

    spec = get_mlp_module_spec(use_te=False)
    if spec_fn is not None:
        spec = spec_fn(spec)
    torch.manual_seed(seed)
    return Stack(_config(world_size, sequence_parallel, **fields), spec.submodules)


def _step(model, x, g):
    xi = x.clone().requires_grad_()
    y = model(xi)
    y.backward(g)
    return [y.detach(), xi.grad, *(p.grad for p in model.parameters())]


def patch_task(rank, world_size, seed, sequence_parallel) -> dict:
    import overlap.hooks.megatron as om
    from overlap import Fp8Recipe

    _megatron(world_size)
    gen = torch.Generator().manual_seed(seed + 1)
    x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    if sequence_parallel:
        rows = _split(S, rank, world_size)
        x, g = x[rows], g[rows]
    out = {}
    from_config = _stack(world_size, seed, sequence_parallel, fp8="hybrid", fp8_recipe="tensorwise")
    replaced = om.patch(from_config)
    out["config recipes"] = sorted({str(r.replacement.fp8) for r in replaced})
    keyword = _stack(world_size, seed, sequence_parallel)
    om.patch(keyword, fp8="tensorwise")
    plain = _stack(world_size, seed, sequence_parallel)
    om.patch(plain)
    turned_off = _stack(world_size, seed, sequence_parallel, fp8="hybrid", fp8_recipe="tensorwise")
    om.patch(turned_off, fp8=None)
    a, k, p, off = (_step(m, x, g) for m in (from_config, keyword, plain, turned_off))
    out["config == keyword"] = all(torch.equal(u, v) for u, v in zip(a, k, strict=True))
    out["off == plain"] = all(torch.equal(u, v) for u, v in zip(off, p, strict=True))
    out["fp8 != plain"] = not torch.equal(a[0], p[0])
    for name, make, kw in (("delayed", lambda: _stack(world_size, seed, sequence_parallel, fp8="e4m3"), {}),
                           ("bad keyword", lambda: _stack(world_size, seed, sequence_parallel), {"fp8": "fp8"})):
        model = make()
        before = dict(model.named_modules())
        out[name] = _attempt(lambda model=model, kw=kw: om.patch(model, **kw))
        out[f"{name} untouched"] = dict(model.named_modules()) == before
    spec_built = _stack(world_size, seed, sequence_parallel, spec_fn=lambda s: om.replace_in_spec(s, fp8="mxfp8"))
    layers = [m for m in spec_built.modules() if isinstance(m, (om.ColumnParallelLinear, om.RowParallelLinear))]
    out["spec recipes"] = (len(layers), {m.fp8 for m in layers} == {Fp8Recipe("mxfp8")})
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_patch_and_specs_pass_the_recipe(pools, seed, sequence_parallel):
    for res in pools(2).run(patch_task, seed, sequence_parallel, timeout=180):
        assert res["config recipes"] == ["Fp8Recipe(granularity='tensorwise', grads=False)"], res
        assert res["config == keyword"] and res["off == plain"] and res["fp8 != plain"], res
        assert res["delayed"][0] == "NotImplementedError" and "'delayed'" in res["delayed"][1], res
        assert res["bad keyword"][0] == "ValueError" and "'fp8'" in res["bad keyword"][1], res
        assert res["delayed untouched"] and res["bad keyword untouched"], res
        assert res["spec recipes"] == (2 * LAYERS, True), res


def _moe_model(world_size: int, seed: int, fp8_field=None, fp8_recipe=None):
    from tests.integrations.test_megatron_moe import Holder
    from tests.support.megatron_moe import moe_config, moe_layer

    config = moe_config(1, world_size, hidden_size=32, num_attention_heads=4)
    model = Holder(moe_layer(config, seed))
    config.fp8 = fp8_field  # (set after the build: TransformerConfig wants Transformer Engine for MoE with fp8)
    if fp8_recipe is not None:
        config.fp8_recipe = fp8_recipe
    return model


def moe_task(rank, world_size, seed) -> dict:
    import overlap.hooks.megatron as om
    from overlap import Fp8Recipe
    from tests.integrations.test_megatron_moe import _inputs, _run
    from tests.support.megatron_moe import cuda_plumbing, parallel_state

    out = {}
    with cuda_plumbing():
        parallel_state(1, world_size)
        for name, field, recipe, kw in (("config tensorwise", "e4m3", "tensorwise", {}),
                                        ("keyword tensorwise", None, None, {"fp8": "tensorwise"}),
                                        ("config delayed", "e4m3", "delayed", {})):
            model = _moe_model(world_size, 0, field, recipe)
            before = dict(model.named_modules())
            out[name] = _attempt(lambda model=model, kw=kw: om.patch(model, **kw))
            out[f"{name} untouched"] = dict(model.named_modules()) == before
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.spec_utils import build_module

        spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
        out["spec tensorwise"] = _attempt(lambda: om.replace_in_spec(spec, fp8="tensorwise"))
        built = build_module(om.replace_in_spec(spec, fp8="mxfp8"), config=_moe_model(world_size, 0).moe.config)
        out["spec mxfp8"] = built.overlap_settings.fp8.granularity

        x, g = _inputs(rank, seed, 32)
        plain = _moe_model(world_size, seed)
        om.patch(plain, fp8=None)
        y0, gx0, _ = _run(plain, x, g)
        for name, field, recipe, kw in (("keyword rowwise", None, None, {"fp8": "rowwise"}),
                                        ("config blockwise", "e4m3", "blockwise", {}),
                                        ("config mxfp8", "e4m3", "mxfp8", {}),
                                        ("keyword block128+grads", None, None,
                                         {"fp8": Fp8Recipe("block128", grads=True)})):
            model = _moe_model(world_size, seed, field, recipe)
            om.patch(model, **kw)
            y, gx, grads = _run(model, x, g)
            err, scale = float((y - y0).abs().max()), float(y0.abs().max())
            gerr, gscale = float((gx - gx0).abs().max()), float(gx0.abs().max())
            finite = all(bool(t.isfinite().all()) for t in grads.values())
            out[name] = (model.moe.overlap_settings.fp8.text, err / scale, gerr / gscale, finite)
    return out


def test_moe_layers_quantize_before_the_dispatch(pools, seed):
    """Megatron's MoE layer patched with fp8 (keyword, or config ``blockwise``/``mxfp8``; a recipe with fp8
    gradients): its recipe reaches the dispatch, the outputs move by fp8's rounding from the same layer without fp8
    (and do move: the recipe ran), the gradients are finite; ``tensorwise`` and ``delayed`` are refused, leaving the
    model untouched."""
    for res in pools(2).run(moe_task, seed, timeout=180):
        assert res["config tensorwise"][0] == "NotImplementedError", res
        assert "'tensorwise'" in res["config tensorwise"][1] and "'blockwise'" in res["config tensorwise"][1], res
        assert res["keyword tensorwise"][0] == "ValueError" and "per token or per block" in res["keyword tensorwise"][1]
        assert res["config delayed"][0] == "NotImplementedError", res
        assert all(res[f"{n} untouched"] for n in ("config tensorwise", "keyword tensorwise", "config delayed")), res
        assert res["spec tensorwise"][0] == "ValueError", res
        assert res["spec mxfp8"] == "mxfp8", res
        for name, granularity in (("keyword rowwise", "rowwise"), ("config blockwise", "block128"),
                                  ("config mxfp8", "mxfp8"), ("keyword block128+grads", "block128+grads")):
            got, rel, grad_rel, finite = res[name]
            assert got == granularity, res
            # e4m3 keeps 3 mantissa bits: each product is within 2^-3 of its size, the layer's outputs well within
            assert 0 < rel < 0.1 and 0 < grad_rel < 0.1 and finite, (name, res[name])
