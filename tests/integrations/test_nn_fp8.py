"""fp8 as a training mode of overlap.nn's ColumnParallelLinear/RowParallelLinear (``fp8=``), on CPU ranks.

* **The op-level recipe.** Every mode of both layers (column: sequence parallel or not, ``gather_output``; row:
  sequence parallel or not, ``input_is_parallel=False``), world sizes 1-4, every strategy, both layouts the layers
  take (``[s, b, h]`` and ``[tokens, h]``), each recipe (``"rowwise"``, ``"tensorwise"``, ``"mxfp8"``, and an
  ``overlap.Fp8Recipe`` with fp8 gradients): the layer's output, input gradient and parameter gradients are bitwise
  those of the op the mode stands for, called with the same recipe on the same leaves (a sequence-parallel column
  layer: ``all_gather_matmul(x, w.t(), fp8=r) + b``; a replicated input or one rank: ``fp8_matmul(x, w.t(), r) +
  b``, its input gradient summed over the group; a row layer: ``matmul_reduce_scatter``/``matmul_all_reduce``);
  ``gather_output`` and ``input_is_parallel=False`` are checked against plain all-gathers of the op's results.
  With high-precision gradients (``grads=False``) the gradients are also those of the layer without fp8 (the
  backward convention, fp32 tolerance) while the output is not bitwise the layer's without fp8 (fp8 is on).
* **Training.** Column, GELU, row (with biases; sequence parallel and not) trained 5 SGD steps with each recipe
  beside the same model without fp8 (fp32): at every step the loss is within the bound below and not bitwise the
  fp32 loss.
* **Errors.** A bad ``fp8=`` raises in ``__init__`` on every rank; ``ExpertParallelMLP`` refuses fp8.

The training bound (`_bounds`) comes from the standard model of probabilistic rounding-error analysis (Higham and
Mary, SIAM J. Sci. Comput. 2019): each rounding error is independent, mean zero and bounded. Quantizing a value
``q`` of a tensor to e4m3 with amax scaling (any granularity) errs by at most ``u |q| + v amax``: ``u = 2^-4``
(3 mantissa bits, round to nearest) and ``v amax`` half of the subnormal step ``2^-9`` times the largest scale any
granularity gives (``2 amax / 448``: an MX scale is ``amax / 448`` rounded up to a power of two, and a row's,
block's or rank's amax is at most the tensor's); e5m2 gradients: ``u = 2^-3``, step ``2^-16``, top 57344. The
model replaces every quantization of the fp8 run by ``q + e``, ``e`` uniform in ``+-(u |q| + v amax)``: at least the
variance of rounding to nearest, whose error is uniform within half a spacing that is at most ``u |q|``. The
quantized operands are those of the recipe (both operands of each forward GEMM; with fp8 gradients also the
output gradient and the operand it meets in each backward GEMM), the rest of the step exact. Its losses are
computed in float64 on one process: the same model, data and SGD steps without noise (the fp32 run, to 1e-5), and
32 draws of the noise. The bound at each step is ``|mean(draws) - exact| + 6 std(draws)`` (the std enlarged by
its estimate's own 3-sigma error) ``+ 1e-5 exact`` (float32 against float64): six standard deviations of a sum
of many independent errors. It is about 1% of the loss (the test checks that it stays under 5%): an error of a
scale's size falls far outside it; the rounding itself is pinned by the equality tests above.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.tp_oracle import scaled

B, H = 2, 64  # batch; the column layer's in (its GEMM's k: a multiple of 32 for mxfp8)
FP32 = dict(rtol=1e-5, atol=1e-5)
STRATEGIES = ("reference", "pipelined", "symm", "fused", "hierarchical", "auto")
RECIPES = ("rowwise", "tensorwise", "mxfp8", "tensorwise+grads")  # "+grads": passed as an overlap.Fp8Recipe
LAYOUTS = ("sbh", "tokens")
COLUMN_MODES = [dict(sequence_parallel=sp, gather_output=go) for sp in (False, True) for go in (False, True)]
ROW_MODES = [dict(sequence_parallel=False, input_is_parallel=True), dict(sequence_parallel=True),
             dict(sequence_parallel=False, input_is_parallel=False)]


def _sizes(world_size: int) -> tuple[int, int]:
    """``(S, F)``: the sequence divides by W; the row layer's k = F / W = 32 (mxfp8's block)."""
    return 2 * world_size + 1 if world_size == 1 else 2 * world_size, 32 * world_size


def _recipe(text: str):
    from overlap import Fp8Recipe

    return Fp8Recipe(text.removesuffix("+grads"), grads=True) if text.endswith("+grads") else text


def _split(n: int, rank: int, world_size: int) -> slice:
    return slice(rank * n // world_size, (rank + 1) * n // world_size)


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's `t` concatenated along `dim` (plain gloo, no autograd)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _summed(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def _inputs(seed: int, shape_in: tuple, shape_out: tuple, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(shape_in, generator=gen), torch.randn(shape_out, generator=gen)
    if layout == "tokens":
        return x.flatten(0, 1), g.flatten(0, 1)
    return x, g


def _run(layer, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient, weight and bias gradients of one forward and backward."""
    xi = x.clone().requires_grad_()
    y = layer(xi)
    y.backward(g)
    return [y.detach(), xi.grad, layer.weight.grad, layer.bias.grad]


def _leaves(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()


def _compare(got: list, want: list, plain: list | None, ctx: str) -> None:
    names = ("output", "input grad", "weight.grad", "bias.grad")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), \
            f"{ctx}: {name} is not the op's: max error {(a - b).abs().max().item() if a.shape == b.shape else a.shape}"
    if plain is None:
        return
    assert not torch.equal(got[0], plain[0]), f"{ctx}: the output is bitwise the layer's without fp8"
    for name, a, b in list(zip(names, got, plain, strict=True))[1:]:  # the backward convention
        torch.testing.assert_close(a, b, **scaled(FP32, b), msg=lambda m, name=name: f"{ctx}: {name} vs no fp8: {m}")


def column_case(rank, world_size, seed, strategy, text, mode, layout) -> None:
    from overlap import all_gather_matmul, fp8_matmul
    from overlap.nn import ColumnParallelLinear

    S, F = _sizes(world_size)
    fp8 = _recipe(text)
    sp = mode["sequence_parallel"] and world_size > 1
    ctx = f"column rank {rank}/{world_size} {strategy} fp8={text} {mode} {layout}"
    x, g = _inputs(seed, (S, B, H), (S, B, F), layout)
    rows, cols = _split(x.shape[0], rank, world_size), _split(F, rank, world_size)
    x_in = x[rows] if sp else x
    g_out = g[..., cols]  # this rank's columns; with gather_output the whole g comes in, its slice goes back
    g_in = g if mode["gather_output"] else g_out
    torch.manual_seed(seed)
    layer = ColumnParallelLinear(H, F, strategy=strategy, fp8=fp8, **mode)
    got = _run(layer, x_in, g_in)

    w, b = _leaves(layer)
    xo = x_in.clone().requires_grad_()
    y = (all_gather_matmul(xo, w.t(), strategy=strategy, fp8=fp8) if sp else fp8_matmul(xo, w.t(), fp8)) + b
    y.backward(g_out)
    y, gx = y.detach(), xo.grad
    if world_size > 1 and not sp:
        gx = _summed(gx)  # a replicated input: its gradient summed over the group
    if world_size > 1 and mode["gather_output"]:
        y = _gather(y, -1)
    plain = None
    if not fp8_grads(fp8):
        torch.manual_seed(seed)
        plain = _run(ColumnParallelLinear(H, F, strategy=strategy, **mode), x_in, g_in)
    _compare(got, [y, gx, w.grad, b.grad], plain, ctx)


def row_case(rank, world_size, seed, strategy, text, mode, layout) -> None:
    from overlap import fp8_matmul, matmul_all_reduce, matmul_reduce_scatter
    from overlap.nn import RowParallelLinear

    S, F = _sizes(world_size)
    fp8 = _recipe(text)
    sp = mode["sequence_parallel"] and world_size > 1
    parallel_input = mode.get("input_is_parallel", True)
    ctx = f"row rank {rank}/{world_size} {strategy} fp8={text} {mode} {layout}"
    x, g = _inputs(seed, (S, B, F), (S, B, H), layout)
    rows, cols = _split(x.shape[0], rank, world_size), _split(F, rank, world_size)
    g_in = g[rows] if sp else g
    torch.manual_seed(seed)
    layer = RowParallelLinear(F, H, strategy=strategy, fp8=fp8, **mode)
    x_in = x[..., cols] if parallel_input else x
    got = _run(layer, x_in, g_in)

    w, b = _leaves(layer)
    xo = x[..., cols].clone().requires_grad_()
    if world_size == 1:
        y = fp8_matmul(xo, w.t(), fp8)
    else:
        y = (matmul_reduce_scatter if sp else matmul_all_reduce)(xo, w.t(), strategy=strategy, fp8=fp8)
    y = y + b
    y.backward(g_in)
    gx, gb = xo.grad, b.grad
    if sp:
        gb = _summed(gb)  # each rank added the bias to its own rows
    if world_size > 1 and not parallel_input:
        gx = _gather(gx, -1)
    plain = None
    if not fp8_grads(fp8):
        torch.manual_seed(seed)
        plain = _run(RowParallelLinear(F, H, strategy=strategy, **mode), x_in, g_in)
    _compare(got, [y.detach(), gx, w.grad, gb], plain, ctx)


def fp8_grads(fp8) -> bool:
    return not isinstance(fp8, str) and fp8.grads


def _cases(world_size: int) -> list[tuple]:
    """``(layer, strategy, recipe, mode, layout)`` of every case: every strategy, recipe and mode of both layers,
    the layout alternating so that each mode and each strategy meets both. A replicated input and a group of one
    run no op, so one strategy covers them; interpreted ``fused`` (slow) runs a covering subset: at two ranks each
    recipe once, on a different op, and one of those cases at three and four ranks."""
    if world_size == 1:
        return [(layer, "auto", text, mode, LAYOUTS[(r + m) % 2]) for r, text in enumerate(RECIPES)
                for m, (layer, mode) in enumerate([*(("column", c) for c in COLUMN_MODES), ("row", ROW_MODES[0])])]
    cases = []
    for s, strategy in enumerate(s for s in STRATEGIES if s != "fused"):
        for r, text in enumerate(RECIPES):
            for m, mode in enumerate(COLUMN_MODES):
                if mode["sequence_parallel"] or not s:
                    cases.append(("column", strategy, text, mode, LAYOUTS[(s + r + m) % 2]))
            for m, mode in enumerate(ROW_MODES):
                cases.append(("row", strategy, text, mode, LAYOUTS[(s + r + m + 1) % 2]))
    ops = [("column", COLUMN_MODES[2]), ("row", ROW_MODES[1]), ("row", ROW_MODES[0]), ("column", COLUMN_MODES[3])]
    fused = [(layer, "fused", text, mode, LAYOUTS[i % 2])
             for i, (text, (layer, mode)) in enumerate(zip(RECIPES, ops, strict=True))]
    return cases + (fused if world_size == 2 else fused[world_size - 2 : world_size - 1])


def every_case(rank, world_size, seed) -> int:
    for i, (layer, *case) in enumerate(_cases(world_size)):
        (column_case if layer == "column" else row_case)(rank, world_size, seed + i, *case)
    return len(_cases(world_size))


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layers_are_the_ops_recipe(pools, seed, world_size):
    done = pools(world_size).run(every_case, seed, timeout=300)
    assert done == [len(_cases(world_size))] * world_size, done


# ----------------------------------------------------------------------------------------------
# Training: the loss within the recipe's bound (the module docstring)
# ----------------------------------------------------------------------------------------------

STEPS, LR = 5, 0.5
DRAWS, SIGMAS = 32, 6.0  # the noise model's draws; the bound's width in its standard deviations


def _data(seed: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[S * B, H]`` and a linear teacher's targets (so that the loss can fall)."""
    S, _ = _sizes(world_size)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S * B, H, generator=gen)
    return x, x @ torch.randn(H, H, generator=gen) / math.sqrt(H)


def _mlp(world_size, seed, sp, fp8):
    from overlap.nn import ColumnParallelLinear, RowParallelLinear

    _, F = _sizes(world_size)
    torch.manual_seed(seed)
    up = ColumnParallelLinear(H, F, sequence_parallel=sp, fp8=fp8)
    down = RowParallelLinear(F, H, sequence_parallel=sp, fp8=fp8)
    return up, down


def training_task(rank, world_size, seed, sp, text) -> list[tuple[float, float]]:
    """``(fp8 loss, fp32 loss)`` per step, in float64 from the gathered outputs."""
    x, t = _data(seed, world_size)
    rows = _split(x.shape[0], rank, world_size)
    x_in, t_in = (x[rows], t[rows]) if sp else (x, t)
    models = {"fp8": _mlp(world_size, seed, sp, _recipe(text)), "fp32": _mlp(world_size, seed, sp, None)}
    out = []
    for _ in range(STEPS):
        losses = {}
        for name, (up, down) in models.items():
            y = down(torch.nn.functional.gelu(up(x_in)))
            ((y - t_in) ** 2).sum().div(t.numel()).backward()  # sequence parallel: this rank's share of the loss
            y_all = _gather(y.detach(), 0) if sp else y.detach()
            losses[name] = float(((y_all.double() - t.double()) ** 2).sum().item() / t.numel())
        out.append((losses["fp8"], losses["fp32"]))
        with torch.no_grad():
            for up, down in models.values():
                for p in (*up.parameters(), *down.parameters()):
                    p -= LR * p.grad
                    p.grad = None
    return out


class _Noise:
    """The noise model of one fp8 format: ``q + e`` with ``e`` uniform in ``+-(u |q| + v amax(q))`` (the module
    docstring), drawn from `gen`; None: no noise (the fp32 run)."""

    def __init__(self, dtype: torch.dtype | None, gen: torch.Generator | None):
        self.gen = gen
        u, half_subnormal, top = (2.0**-3, 2.0**-17, 57344.0) if dtype == torch.float8_e5m2 else \
            (2.0**-4, 2.0**-10, 448.0)
        self.u, self.v = u, half_subnormal * 2 / top

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if self.gen is None:
            return q
        width = self.u * q.abs() + self.v * q.abs().max()
        return q + (2 * torch.rand(q.shape, generator=self.gen, dtype=q.dtype) - 1) * width


class _NoisyMatmul(torch.autograd.Function):
    """``a @ b`` as the recipe runs it, in the noise model: the forward's operands quantized; the backward on the
    leaves, or (fp8 gradients) the gradient and the operand it meets quantized again."""

    @staticmethod
    def forward(ctx, a, b, forward_noise: _Noise, grad_noise: _Noise | None):
        ctx.save_for_backward(a, b)
        ctx.grad_noise = grad_noise
        return forward_noise(a) @ forward_noise(b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        q = ctx.grad_noise or (lambda v: v)
        return q(g) @ q(b).t(), q(a).t() @ q(g), None, None


def _modelled_losses(seed: int, world_size: int, text: str, draw: int | None) -> list[float]:
    """The losses of the 5 steps in float64 on one process: the fp32 model (`draw` None) or one draw of the fp8
    run's noise model."""
    from overlap.ops.fp8_recipe import recipe_of

    recipe = recipe_of("test", text)
    _, F = _sizes(world_size)
    x, t = (v.double() for v in _data(seed, world_size))
    torch.manual_seed(seed)  # the layers are slices of these nn.Linear (test_nn_linear.py)
    up, down = torch.nn.Linear(H, F).double(), torch.nn.Linear(F, H).double()
    params = [up.weight, up.bias, down.weight, down.bias]
    gen = None if draw is None else torch.Generator().manual_seed(seed * 7919 + draw)
    noise = _Noise(torch.float8_e4m3fn, gen)
    grad_noise = _Noise(recipe.grad_dtype, gen) if recipe.grads and gen is not None else None
    losses = []
    for _ in range(STEPS):
        z = _NoisyMatmul.apply(x, up.weight.t(), noise, grad_noise) + up.bias
        y = _NoisyMatmul.apply(torch.nn.functional.gelu(z), down.weight.t(), noise, grad_noise) + down.bias
        loss = ((y - t) ** 2).sum() / t.numel()
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= LR * g
    return losses


def _bounds(seed: int, world_size: int, text: str) -> tuple[list[float], list[float]]:
    """Per step: the bound on ``|fp8 loss - fp32 loss|`` (the module docstring) and the fp32 model's loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: threads only add their overhead (16x on a busy machine)
    try:
        exact = torch.tensor(_modelled_losses(seed, world_size, text, None), dtype=torch.float64)
        draws = torch.tensor([_modelled_losses(seed, world_size, text, d) for d in range(DRAWS)],
                             dtype=torch.float64)
    finally:
        torch.set_num_threads(threads)
    spread = draws.std(dim=0) * (1 + 3 / math.sqrt(2 * (DRAWS - 1)))  # the estimate's own 3-sigma error added
    bound = (draws.mean(dim=0) - exact).abs() + SIGMAS * spread + 1e-5 * exact
    return bound.tolist(), exact.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence-parallel"])
def test_training_loss_within_the_recipes_bound(pools, seed, world_size, sp):
    for text in RECIPES:
        results = pools(world_size).run(training_task, seed, sp, text, timeout=120)
        steps = results[0]
        assert all(r == steps for r in results), f"fp8={text}: the ranks disagree: {results}"
        bounds, modelled = _bounds(seed, world_size, text)
        for i, ((fp8, fp32), bound, exact) in enumerate(zip(steps, bounds, modelled, strict=True)):
            ctx = f"fp8={text} step {i}: fp8 loss {fp8}, fp32 loss {fp32}, bound {bound:.3g}"
            assert fp8 != fp32, f"{ctx}: the loss is bitwise the fp32 loss: fp8 is off"
            assert abs(fp32 - exact) <= 1e-5 * exact, f"{ctx}: the fp32 run is not the modelled one ({exact})"
            assert abs(fp8 - fp32) <= bound, f"{ctx}: outside the bound"
            assert bound <= 0.05 * exact, f"{ctx}: the bound is too loose to test anything"
        assert steps[-1][1] < 0.9 * steps[0][1], f"fp8={text}: the model did not learn: {steps}"


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def construction_task(rank, world_size) -> dict:
    """Bad recipes (raised in __init__, before any communication) and the repr."""
    from overlap import Fp8Recipe
    from overlap.nn import ColumnParallelLinear, ExpertParallelMLP, RowParallelLinear

    out = {}
    bad = {
        "unknown": lambda: ColumnParallelLinear(H, 32, fp8="e4m3"),
        "type": lambda: RowParallelLinear(64, H, fp8=8),
        "mxfp8 column k": lambda: ColumnParallelLinear(48, 32, fp8="mxfp8"),
        "mxfp8 row k": lambda: RowParallelLinear(48 * world_size, H, fp8=Fp8Recipe("mxfp8")),
        "float64": lambda: ColumnParallelLinear(H, 32, fp8="rowwise", dtype=torch.float64),
        "moe": lambda: ExpertParallelMLP(H, 32, 2 * world_size, 1, fp8="tensorwise"),
        "moe grads": lambda: ExpertParallelMLP(H, 48, 2 * world_size, 1, fp8="mxfp8+grads"),
        "moe mxfp8 hidden": lambda: ExpertParallelMLP(48, 32, 2 * world_size, 1, fp8="mxfp8"),
        "moe unknown": lambda: ExpertParallelMLP(H, 32, 2 * world_size, 1, fp8="bogus"),
    }
    for name, make in bad.items():
        try:
            make()
            out[name] = None
        except (TypeError, ValueError, NotImplementedError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    out["repr"] = (repr(ColumnParallelLinear(H, 32, fp8=Fp8Recipe("tensorwise", grads=True))),
                   repr(RowParallelLinear(64, H)))
    out["mxfp8 ok"] = RowParallelLinear(32 * world_size, H, fp8="mxfp8").fp8 == Fp8Recipe("mxfp8")
    return out


def test_bad_recipes_raise_in_init_on_every_rank(pools):
    for res in pools(2).run(construction_task, timeout=60):
        assert res["unknown"][0] == "ValueError" and "overlap.nn.ColumnParallelLinear" in res["unknown"][1], res
        assert "'e4m3'" in res["unknown"][1], res
        assert res["type"][0] == "TypeError" and "int" in res["type"][1], res
        assert res["mxfp8 column k"][0] == "ValueError" and "in_features=48" in res["mxfp8 column k"][1], res
        assert res["mxfp8 row k"][0] == "ValueError" and "in_features/W=48" in res["mxfp8 row k"][1], res
        assert res["float64"][0] == "TypeError" and "float64" in res["float64"][1], res
        assert res["moe"][0] == "ValueError" and "'tensorwise'" in res["moe"][1], res
        assert "per token or per block" in res["moe"][1], res
        assert res["moe grads"][0] == "ValueError" and "48" in res["moe grads"][1], res  # (mxfp8: w1's width)
        assert res["moe mxfp8 hidden"][0] == "ValueError" and "48" in res["moe mxfp8 hidden"][1], res
        assert res["moe unknown"][0] == "ValueError" and "'bogus'" in res["moe unknown"][1], res
        assert "fp8='tensorwise+grads'" in res["repr"][0] and "fp8=None" in res["repr"][1], res
        assert res["mxfp8 ok"], res
