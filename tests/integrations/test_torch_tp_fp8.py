"""overlap.hooks.torch_tp's styles with ``fp8=`` on plain ``nn.Linear`` layers, on CPU ranks.

Every path a style runs (the gather of a sequence-sharded input on dim 0 and on dim 1, the replicated column-wise
input, a column-wise ``Replicate()`` output, a feature-sharded column-wise input, the reduce-scatter on dim 0 and on
dim 1, the all-reduce, a replicated row-wise input), with each recipe (rowwise, tensorwise, mxfp8, each also with
fp8 gradients), at world sizes 1 to 4, is checked three ways:

* against the op-level recipe, where the path is one op (`overlap.all_gather_matmul`, `overlap.matmul_reduce_scatter`,
  `overlap.matmul_all_reduce`) or, for the replicated column-wise input, `overlap.fp8_matmul`: the same local
  tensors, recipe and strategy (each path its own of auto, reference, pipelined, symm) through the op directly:
  output and every gradient within float32 rounding (DESIGN's ``1e-5``, scaled);
* against the same style without ``fp8``: the forward within the fp8 bound ``(2*2^-4 + 2^-8) * (|x| @ |W|^T)``
  elementwise (two e4m3 roundings, docs/fp8.md), plus ``1e-4`` of its largest element for e4m3's subnormals, and
  off by more than ``1e-3`` of the output's largest element somewhere (the recipe was applied: fp8's roundings are
  ~1e-2 of it). ``|x| @ |W|^T`` comes from the style itself, run without fp8 on ``|x|`` with ``|W|`` and no bias,
  so every layout gets its own. Backward: with high-precision gradients (the default) the input, weight and bias
  gradients equal the plain style's within float32 rounding (the recipe's backward is the plain one); with fp8
  gradients (``+grads``) within the same kind of bound, ``(2u + u^2)`` per GEMM with e4m3's ``u = 2^-4`` or e5m2's
  ``2^-3`` (tensorwise), the plain style's backward run on ``|g|`` giving ``|g| @ |W|`` and ``|g|^T @ |x|``;
* the shardings and placements are torch's (the plain style's).

Then `PrepareModuleInput` in front of column-wise layers trained in fp8 (they multiply the gathered input with
`overlap.fp8_matmul`; a plain layer beside them is still fused into the gather), ``"mxfp8"`` meeting features that
are not a multiple of 32, an ``nn.Linear`` torch's own style runs (not trained in fp8, warned), and the recipe
passed through `use_overlap_styles`. Bad recipes raise when the style is made.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import overlap  # noqa: F401  (before any DTensor op: see test_torch_tp.py)
from tests.support.tp_oracle import scaled

FP32 = dict(rtol=1e-5, atol=1e-5)
RECIPES = ["rowwise", "tensorwise", "mxfp8", "rowwise+grads", "tensorwise+grads", "mxfp8+grads"]
STRATEGIES = ["auto", "reference", "pipelined", "symm"]  # (cycled over the paths; `fused` is the ops' tests')
E4M3_U, E5M2_U = 2.0**-4, 2.0**-3  # unit roundoffs: 3 and 2 mantissa bits


def _gemm_eps(u: float) -> float:
    """Relative error bound of one product of two operands each rounded with unit roundoff `u`."""
    return 2 * u + u * u


def _mesh(world_size):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(world_size)))


def _cases(W):
    """(name, kind, style kwargs, this rank's input of the whole, op-level reference or None)."""
    from torch.distributed.tensor import Replicate, Shard

    def seq(dim):
        return lambda r, x: x.chunk(W, dim)[r]

    def feat(r, x):
        return x.chunk(W, -1)[r]

    whole = lambda r, x: x  # noqa: E731
    return [
        ("col Shard(0) seq-first", "col", dict(input_layouts=Shard(0)), seq(0), ("gather", 0)),
        ("col Shard(1) batch-first", "col", dict(input_layouts=Shard(1)), seq(1), ("gather", 1)),
        ("col replicated", "col", {}, whole, ("local", None)),
        ("col Shard(1) -> Replicate (LM head)", "col", dict(input_layouts=Shard(1), output_layouts=Replicate()),
         seq(1), None),
        ("col features sharded in", "col", dict(input_layouts=Shard(2)), feat, None),
        ("row Shard(0) seq-first", "row", dict(output_layouts=Shard(0)), feat, ("scatter", 0)),
        ("row Shard(1) batch-first", "row", dict(output_layouts=Shard(1)), feat, ("scatter", 1)),
        ("row replicated", "row", {}, feat, ("all_reduce", None)),
        ("row replicated in, Shard(1) out", "row", dict(input_layouts=Replicate(), output_layouts=Shard(1)), whole,
         None),
    ]


def _run(module, mesh, style, x, g):
    """Parallelize a copy of `module` with `style`, forward `x` (this rank's), backward ``sum(y * g)`` (`g` a tensor,
    or a function of the output's shape giving one)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    m = parallelize_module(copy.deepcopy(module), mesh, style)
    xi = x.clone().requires_grad_()
    y = m(xi)
    assert not isinstance(y, DTensor), type(y)
    (y * (g if isinstance(g, torch.Tensor) else g(y.shape))).sum().backward()
    grads = {n: (p.grad.to_local(), tuple(p.grad.placements)) for n, p in m.named_parameters()}
    return y.detach(), xi.grad, grads


def _op_reference(kind, dim, module, x, g, recipe, strategy, rank, W, pg):
    """The path's op called directly on this rank's tensors: ``(y, x.grad, {name: grad})``."""
    from overlap.ops.fp8_matmul import fp8_matmul

    col = kind in ("gather", "local")
    w = module.weight.detach().chunk(W, 0 if col else 1)[rank].clone().requires_grad_()
    b = module.bias.detach()
    b = (b.chunk(W)[rank] if col else b).clone().requires_grad_()
    xi = x.clone().requires_grad_()
    kw = dict(group=pg, strategy=strategy, fp8=recipe)
    if kind == "gather":
        y = overlap.all_gather_matmul(xi, w.t(), gather_dim=dim, **kw)
    elif kind == "local":
        y = fp8_matmul(xi, w.t(), recipe)
    elif kind == "scatter":
        y = overlap.matmul_reduce_scatter(xi, w.t(), scatter_dim=dim, **kw)
    else:
        y = overlap.matmul_all_reduce(xi, w.t(), **kw)
    y = y + b
    (y * g).sum().backward()
    dx, db = xi.grad, b.grad
    if kind == "local":  # the replicated input's gradient: every rank's columns' contributions summed
        torch.distributed.all_reduce(dx, group=pg)
    if kind == "scatter":  # the bias of this rank's rows: its gradient summed over the ranks
        torch.distributed.all_reduce(db, group=pg)
    return y.detach(), dx, {"weight": w.grad, "bias": db}


def _close(got, want, what):
    torch.testing.assert_close(got, want, **scaled(FP32, want), msg=lambda m: f"{what}: {m}")


def _within(got, want, bound, what):
    """``|got - want| <= bound`` elementwise (plus ``1e-4`` of the bound's largest element: e4m3's subnormals)."""
    slack = 1e-4 * bound.abs().max().item() + 1e-6
    excess = (got.double() - want.double()).abs() - bound.double() - slack
    worst = excess.max().item()
    assert worst <= 0, f"{what}: past the fp8 bound by {worst:.3g} (bound max {bound.abs().max().item():.3g})"


def paths_task(rank, world_size, seed, recipes):
    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel
    from overlap.ops.fp8_recipe import recipe_of

    W = world_size
    K = 32 * W  # in and out features: a rank's share of the row-wise input (K / W) is one MX block
    mesh = _mesh(W)
    pg = mesh.get_group()
    gen = torch.Generator().manual_seed(seed)
    done = []
    for i, (name, kind, kwargs, local_of, core) in enumerate(_cases(W)):
        strategy = STRATEGIES[i % len(STRATEGIES)]
        torch.manual_seed(seed)
        module = nn.Linear(K, K, bias="LM head" not in name)
        mod_abs = copy.deepcopy(module)
        with torch.no_grad():
            mod_abs.weight.abs_()
            if mod_abs.bias is not None:
                mod_abs.bias.zero_()
        x = torch.randn(2 * W, 2 * W, K, generator=gen)  # (dims 0 and 1 both split over the ranks)
        xl = local_of(rank, x)
        make = ColwiseParallel if kind == "col" else RowwiseParallel
        # g: the same on every rank (a replicated output needs it), of the output's shape, which the plain run tells.
        made = []

        def g_of(shape, made=made):
            made.append(torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)))
            return made[0]

        y_plain, dx_plain, g_plain = _run(module, mesh, make(**kwargs), xl, g_of)
        g = made[0]
        y_abs, dx_abs, g_abs = _run(mod_abs, mesh, make(**kwargs), xl.abs(), g.abs())
        for text in recipes:
            recipe = recipe_of("test", text)
            ctx = f"rank {rank}/{W} {name} fp8={text} strategy={strategy}"
            style = make(fp8=text, strategy=strategy, **kwargs)
            y, dx, grads = _run(module, mesh, style, xl, g)
            assert style.fused is True and style.fp8 == recipe, (ctx, style)

            # The recipe was applied: within its bound of the plain layer, and not equal to it.
            _within(y, y_plain, _gemm_eps(E4M3_U) * y_abs, f"{ctx}: output vs the plain style's")
            moved = (y - y_plain).abs().max().item()
            assert moved > 1e-3 * y_plain.abs().max().item(), f"{ctx}: output equals the plain one ({moved:.3g})"
            # Backward: the plain one (high-precision gradients), or within the fp8 gradients' bound.
            grads_eps = _gemm_eps(E5M2_U if recipe.granularity == "tensorwise" else E4M3_U)
            for what, got, want, bound in (("input grad", dx, dx_plain, dx_abs),
                                           *((f"{n}.grad", got[0], g_plain[n][0], g_abs[n][0])
                                             for n, got in grads.items())):
                if recipe.grads and not what.startswith("bias"):
                    _within(got, want, grads_eps * bound, f"{ctx}: {what} vs the plain style's")
                else:
                    _close(got, want, f"{ctx}: {what} vs the plain style's")
            for n, (_, placements) in grads.items():
                assert placements == g_plain[n][1], (ctx, n, placements, g_plain[n][1])

            if core is not None:  # the path's op with the same recipe, called directly
                y_op, dx_op, grads_op = _op_reference(*core, module, xl, g, recipe, strategy, rank, W, pg)
                _close(y, y_op, f"{ctx}: output vs the op-level recipe")
                _close(dx, dx_op, f"{ctx}: input grad vs the op-level recipe")
                for n, want in grads_op.items():
                    _close(grads[n][0], want, f"{ctx}: {n}.grad vs the op-level recipe")
            done.append(f"{name} {text}")
    return done


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_path_trains_with_the_recipe(pools, seed, world_size):
    for rank, done in enumerate(pools(world_size).run(paths_task, seed, RECIPES, timeout=300)):
        assert len(done) == len(_cases(world_size)) * len(RECIPES), (rank, done)


# ----------------------------------------------------------------------------------------------
# PrepareModuleInput in front of layers trained in fp8; what the recipe cannot run on
# ----------------------------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """``w1`` and ``w3`` behind one input (torchtitan's feed-forward without its activation and ``w2``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden), nn.Linear(dim, hidden)

    def forward(self, x):
        return self.w1(x) * self.w3(x)


def prepare_task(rank, world_size, seed, dim):
    """Every rank: `GatedMLP` behind overlap's PrepareModuleInput (``Shard(dim)`` -> ``Replicate()``), ``w1`` in fp8
    and ``w3`` in fp8 or not, against the gathered input multiplied by `overlap.fp8_matmul` (or ``F.linear``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import errors
    from overlap.hooks.torch_tp import ColwiseParallel, PrepareModuleInput
    from overlap.ops import library
    from overlap.ops.fp8_matmul import fp8_matmul

    W = world_size
    mesh = _mesh(W)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * W, 2 * W, 32, generator=gen)
    g = torch.randn(*x.shape[:-1], 8, generator=gen)  # (the output: all of the sequence, this rank's 8 columns)
    torch.manual_seed(seed)
    block = GatedMLP(32, 8 * W)
    out = {}
    for w3_fp8 in ("tensorwise", None):
        ctx = f"rank {rank}/{W} dim={dim} w3 fp8={w3_fp8}"
        errors._WARNED.difference_update({k for k in errors._WARNED if k.startswith("torch_tp.")})
        m = parallelize_module(copy.deepcopy(block), mesh, {
            "w1": ColwiseParallel(fp8="rowwise"), "w3": ColwiseParallel(fp8=w3_fp8)})
        parallelize_module(m, mesh, PrepareModuleInput(input_layouts=(Shard(dim),),
                                                       desired_input_layouts=(Replicate(),), use_local_output=True))
        xi = x.chunk(W, dim)[rank].clone().requires_grad_()
        before = library.CALLS["all_gather_matmul"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = m(xi)
        fused = library.CALLS["all_gather_matmul"] - before
        (y * g).sum().backward()

        # The reference: the whole input (what the gather gives), each layer's local GEMM on it.
        xf = x.clone().requires_grad_()
        ws = {n: (getattr(block, n).weight.detach().chunk(W)[rank].clone().requires_grad_(),
                  getattr(block, n).bias.detach().chunk(W)[rank].clone().requires_grad_()) for n in ("w1", "w3")}
        y1 = fp8_matmul(xf, ws["w1"][0].t(), "rowwise") + ws["w1"][1]
        y3 = (fp8_matmul(xf, ws["w3"][0].t(), w3_fp8) + ws["w3"][1] if w3_fp8
              else F.linear(xf, *ws["w3"]))
        y_ref = y1 * y3
        (y_ref * g).sum().backward()
        dx_ref = xf.grad.clone()
        torch.distributed.all_reduce(dx_ref, group=mesh.get_group())  # every rank's columns' share of the input's
        _close(y.detach(), y_ref.detach(), f"{ctx}: output")
        _close(xi.grad, dx_ref.chunk(W, dim)[rank], f"{ctx}: input grad")
        for n, (w, b) in ws.items():
            _close(getattr(m, n).weight.grad.to_local(), w.grad, f"{ctx}: {n}.weight.grad")
            _close(getattr(m, n).bias.grad.to_local(), b.grad, f"{ctx}: {n}.bias.grad")
        out[w3_fp8] = (fused, any("PrepareModuleInput" in str(w.message) and "fp8" in str(w.message)
                                  for w in caught))
    return out


@pytest.mark.parametrize("world_size, dim", [(2, 0), (3, 1)])
def test_prepare_module_input_before_fp8_layers(pools, seed, world_size, dim):
    for rank, out in enumerate(pools(world_size).run(prepare_task, seed, dim, timeout=120)):
        # Both layers in fp8: torch's gather, each layer its own fp8 GEMM (warned). One in fp8: the plain one is still
        # computed by the fused gather.
        assert out == {"tensorwise": (0, True), None: (1, True)}, (rank, out)


def unfit_task(rank, world_size):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import errors
    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel
    from tests.support.tp_oracle import expect_error

    mesh = _mesh(world_size)
    out = {
        # MX blocks of 32 along k: a column-wise layer's k is its input features, a row-wise one's this rank's share.
        "col mx k=48": expect_error(parallelize_module, nn.Linear(48, 2 * world_size), mesh,
                                    ColwiseParallel(fp8="mxfp8")),
        "row mx k=32/W": expect_error(parallelize_module, nn.Linear(32, 4), mesh, RowwiseParallel(fp8="mxfp8")),
        "row mx k=32": expect_error(parallelize_module, nn.Linear(32 * world_size, 4), mesh,
                                    RowwiseParallel(output_layouts=Shard(0), fp8="mxfp8")),
    }
    # Features torch shards unevenly: torch's own style runs the layer, which is then not trained in fp8 (warned).
    errors._WARNED.difference_update({k for k in errors._WARNED if k.startswith("torch_tp.")})
    style = ColwiseParallel(fp8="rowwise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(nn.Linear(8, 2 * world_size + 1), mesh, style)
        parallelize_module(nn.Embedding(4, 2 * world_size), mesh, ColwiseParallel(fp8="rowwise"))  # (no GEMM: quiet)
    out["uneven"] = (style.fused, [str(w.message) for w in caught if "fp8" in str(w.message)])
    return out


def test_recipe_on_what_it_cannot_run(pools):
    for rank, out in enumerate(pools(2).run(unfit_task, timeout=60)):
        for case in ("col mx k=48", "row mx k=32/W"):
            kind, msg, _ = out[case]
            assert kind == "ValueError" and "multiple of 32" in msg, (rank, case, out[case])
        assert out["row mx k=32"][0] is None, (rank, out["row mx k=32"])
        fused, warned = out["uneven"]
        assert fused is False and len(warned) == 1 and "not trained in fp8" in warned[0], (rank, out["uneven"])


# ----------------------------------------------------------------------------------------------
# Construction: the recipe checked at once; use_overlap_styles passes it on
# ----------------------------------------------------------------------------------------------


def test_styles_take_recipes_and_refuse_bad_ones_when_made():
    from torch.distributed.tensor import Shard

    from overlap import Fp8Recipe
    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel

    for make in (ColwiseParallel, RowwiseParallel):
        assert make().fp8 is None
        for fp8, want in (("rowwise", Fp8Recipe("rowwise")), ("tensorwise", Fp8Recipe("tensorwise")),
                          ("mxfp8", Fp8Recipe("mxfp8")), ("rowwise+grads", Fp8Recipe("rowwise", grads=True)),
                          (Fp8Recipe("tensorwise", grads=True), Fp8Recipe("tensorwise", grads=True))):
            style = make(fp8=fp8)
            assert style.fp8 == want, (make, fp8, style.fp8)
            assert f"fp8={want!r}" in repr(style), repr(style)
        for bad, error in (("columnwise", ValueError), ("e4m3", ValueError),
                           (8, TypeError), (torch.float8_e4m3fn, TypeError), (True, TypeError)):
            with pytest.raises(error, match=f"hooks.torch_tp.{make.__name__}: fp8 must be"):
                make(fp8=bad)
        with pytest.raises(ValueError, match=f"hooks.torch_tp.{make.__name__}: fp8='block128' .* MoE dispatch's"):
            make(fp8="block128")
    with pytest.raises(ValueError, match="granularity"):
        RowwiseParallel(output_layouts=Shard(0), fp8=Fp8Recipe("columnwise"))


def test_use_overlap_styles_passes_the_recipe():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as torch_tp

    from overlap import Fp8Recipe
    from overlap.hooks.torch_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, use_overlap_styles

    client = types.ModuleType("client")
    client.ColwiseParallel, client.RowwiseParallel = torch_tp.ColwiseParallel, torch_tp.RowwiseParallel
    client.PrepareModuleInput = torch_tp.PrepareModuleInput
    with use_overlap_styles(client, fp8="rowwise+grads"):
        col, row = client.ColwiseParallel(input_layouts=Shard(1)), client.RowwiseParallel(fp8="tensorwise")
        assert isinstance(col, ColwiseParallel) and isinstance(row, RowwiseParallel), (col, row)
        assert col.fp8 == Fp8Recipe("rowwise", grads=True) and col.input_layouts == (Shard(1),), col
        assert row.fp8 == Fp8Recipe("tensorwise"), row  # (a style's own fp8 wins)
        assert client.PrepareModuleInput is PrepareModuleInput
    assert client.ColwiseParallel is torch_tp.ColwiseParallel and client.RowwiseParallel is torch_tp.RowwiseParallel
    with use_overlap_styles(client):
        assert client.ColwiseParallel is ColwiseParallel and client.ColwiseParallel().fp8 is None
    with pytest.raises(ValueError, match="use_overlap_styles: fp8 must be"), use_overlap_styles(client, fp8="fp4"):
        pass
    assert client.ColwiseParallel is torch_tp.ColwiseParallel  # (refused before anything was swapped)
