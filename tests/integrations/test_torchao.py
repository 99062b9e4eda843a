"""torchao's float8 training under overlap's torch TP styles, on CPU ranks (torchao 0.18; skipped without torchao).

A 2-layer MLP (``Linear(H, F)``, GELU, ``Linear(F, H)``) is converted by ``torchao.float8.convert_to_float8_training``
(recipes ``tensorwise`` and ``rowwise``) and parallelized with overlap's ``ColwiseParallel(input_layouts=Shard(d))``
and ``RowwiseParallel(output_layouts=Shard(d))`` where torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel``
would go, the sequence sharded on dim 0 (``[s, b, h]``) or dim 1 (``[b, s, h]``), at world sizes 1 to 4, and trained
5 SGD steps on a mean-squared-error loss beside torchao's own runs of the same model from the same weights:

* torchao's single-process ``Float8Linear`` model (the oracle of what torchao computes);
* torchao's layers under torch's own ``ColwiseParallel``/``RowwiseParallel`` (torchao's tensor parallelism as it runs
  on CPU ranks: torchtitan's arrangement for rowwise; torchao's ``Float8ColwiseParallel`` all-gathers float8 tensors,
  which gloo refuses: `test_torchao_own_float8_styles_on_gloo` finds out and compares where it runs).

The bound. Every run is compared at every step with the exact computation (float64) at that run's own parameters,
with the standard probabilistic model of rounding (Higham and Mary's): each fp8 operand of a GEMM is its value times
``1 + d``, the ``d`` independent, mean zero, ``|d| <= u`` (e4m3: ``u = 2^-4``, 3 mantissa bits; e5m2: ``2^-3``). The
forward's four operands (the input and weight of each layer) round with e4m3's ``u``; the backward's (the output
gradient and the operand it meets, in both backward GEMMs) with the recipe's (torchao ``tensorwise``: e5m2 output
gradients, so ``2^-3`` for all of them; ``rowwise``: ``2^-4``); a high-precision backward rounds none and carries the
forward's errors. `_fp8_spread` draws the model ``d ~ U(-u, u)`` (the largest spread the model allows: rounding to
nearest is off by at most ``u`` relative, less on average) 32 times in float64 at the run's parameters: a run's loss
must lie within the draws' mean offset plus 6 standard deviations of the exact loss (their scalar offsets are near
normal), every gradient within 3 times the draws' root-mean-square norm of the gradient's offset (norms of many
elements' errors concentrate). So a run's loss may be ``B`` off the exact one at its parameters, and two runs'
losses differ by at most ``|L_ov - L_ao| <= B_ov + B_ao + |L(p_ov) - L(p_ao)|``, every term computed; as each run's
gradients are checked at every step against the exact ones at its own parameters, a wrong backward fails there
before its parameters drift (a gradient off by one rank's share, or a missing reduction, is tens of times past
it). The runs sit at about a third of it (measured: torchao's own single-process runs at up to 0.33 of the loss
bound and 0.34 of the gradient bounds over 4 seeds x 5 steps); the recipes' own differences (power-of-two scales
against ``amax / 448``, one scale per shard against one per tensor) are far below it. A worst-case bound (every
rounding aligned) was tried first: at ``k = 96`` it is larger than the loss itself, so it tests nothing.

And the gather moved fp8 bytes: every forward's gather of overlap's column-wise layer is one of ``uint8`` rows of
``H + 4`` bytes (``H`` e4m3 values and a float32 scale), ``m (H + 4)`` bytes for this rank's ``m`` rows, where the
layer's float32 leaves would move ``4 m H`` (counted at `overlap.ops.tp.gather.start`, as tests/ops/test_fp8.py
does). Each layer trains with the recipe its config names (`overlap.hooks.torchao_float8`).

Also: the recipe read from torchao's configs (the three named recipes, refusals, the warning of
``rowwise_with_gw_hp``), a conflict with the style's own ``fp8``, `PrepareModuleInput` in front of torchao layers
(where torchao users put ``PrepareFloat8ModuleInput``), and `use_overlap_styles` swapping torchao's style names.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import overlap  # noqa: F401  (before any DTensor op, and before torchao imports Triton: see test_torch_tp.py)

# (ImportError too: a torchao built for another torch fails to import rather than being absent)
pytest.importorskip("torchao.float8", reason="torchao is not importable (pip install -e '.[test]' brings torchao 0.18)",
                    exc_type=ImportError)

H, F_DIM, SEQ, BATCH, STEPS, LR = 32, 96, 12, 2, 5, 2.0  # (F_DIM and SEQ divide by 1, 2, 3 and 4)
U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3  # unit roundoffs: 3 and 2 mantissa bits
SAMPLES, LOSS_SIGMAS, GRAD_RMS = 32, 6.0, 3.0  # the noise model's draws, and how far past its spread a run may be
#: unit roundoff of the backward GEMMs' fp8 operands for each recipe torchao names
GRAD_U = {"tensorwise": U_E5M2, "rowwise": U_E4M3, "rowwise_with_gw_hp": U_E4M3}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, F_DIM), nn.Linear(F_DIM, H)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _mesh(world_size):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(world_size)))


def _float8(model, recipe):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig.from_recipe_name(recipe))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------------------------
# The exact computation and the fp8 bound at given parameters
# ----------------------------------------------------------------------------------------------


def _noisy_step(x, t, params, u_fwd, u_grad, eps):
    """The loss and gradients of `MLP` at `params` (float64) with every GEMM operand multiplied by ``1 + u e`` (``e``
    drawn by `eps` of the operand's shape, ``u`` the forward's or the backward's unit roundoff): the rounding model of
    the module docstring; ``eps`` giving zeros is the exact computation. The backward is the recipe's: the output
    gradient, the weight and the input rounded where ``u_grad`` > 0, the saved high-precision leaves otherwise."""
    W1, b1, W2, b2 = params["up.weight"], params["up.bias"], params["down.weight"], params["down.bias"]

    def q(v, u):
        return v * (1 + u * eps(v.shape[-2:])) if u else v  # (one draw per sample: [SAMPLES, rows, cols])

    h = q(x, u_fwd) @ q(W1, u_fwd).transpose(-1, -2) + b1
    a = F.gelu(h)
    y = q(a, u_fwd) @ q(W2, u_fwd).transpose(-1, -2) + b2
    r = y - t
    n = t.numel()
    loss = (r * r).sum((-1, -2)) / n
    dy = 2 * r / n
    dh = (q(dy, u_grad) @ q(W2, u_grad)) * (torch.special.ndtr(h) + h * torch.exp(-h * h / 2) / (2 * torch.pi) ** 0.5)
    grads = {"up.weight": q(dh, u_grad).transpose(-1, -2) @ q(x, u_grad), "up.bias": dh.sum(-2),
             "down.weight": q(dy, u_grad).transpose(-1, -2) @ q(a, u_grad), "down.bias": dy.sum(-2)}
    return loss, grads


def _fp8_spread(x, t, params, u_fwd, u_grad, seed=0):
    """The exact loss and gradients at `params` (full tensors by name) on ``x -> t`` (``[N, H]``), and how far an fp8
    run may be from them: ``(loss, allowed), {name: (grad, allowed norm of the difference)}`` (module docstring)."""
    p = {n: v.double() for n, v in params.items()}
    x, t = x.double(), t.double()
    loss, grads = _noisy_step(x, t, p, u_fwd, u_grad, lambda shape: 0.0)
    if not u_fwd:  # (no fp8: float32 rounding only)
        return (loss.item(), 0.0), {name: (g, 0.0) for name, g in grads.items()}
    gen = torch.Generator().manual_seed(seed)
    draws = _noisy_step(x, t, p, u_fwd, u_grad,
                        lambda shape: 2 * torch.rand((SAMPLES, *shape), generator=gen, dtype=torch.float64) - 1)
    d_loss = draws[0] - loss
    allowed = d_loss.mean().abs() + LOSS_SIGMAS * d_loss.std()
    spread = {name: GRAD_RMS * (g - grads[name]).flatten(1).norm(dim=1).pow(2).mean().sqrt()
              for name, g in draws[1].items()}
    return (loss.item(), allowed.item()), {name: (grads[name], spread[name].item()) for name in grads}


def _check_step(ctx, step, x, t, u_fwd, u_grad):
    """One recorded step of a run against the exact computation at its parameters; returns ``(exact loss, allowed)``."""
    (loss, allowed), grads = _fp8_spread(x, t, step["params"], u_fwd, u_grad)
    allowed += 1e-6 * loss  # (float32 rounding of the loss's sum)
    off = abs(step["loss"] - loss)
    assert off <= allowed, f"{ctx}: loss {step['loss']:.6g} off the exact {loss:.6g} by {off:.3g} > {allowed:.3g}"
    for name, (exact, spread) in grads.items():
        off = (step["grads"][name].double() - exact).norm().item()
        assert off <= spread + 1e-5 * exact.norm().item(), \
            f"{ctx}: {name}.grad off the exact one by {off:.3g} (norm), the noise model's allows {spread:.3g}"
    return loss, allowed


# ----------------------------------------------------------------------------------------------
# Training runs
# ----------------------------------------------------------------------------------------------


def _train(model, x, t, mine, group=None, forward=None):
    """`STEPS` SGD steps on ``mean((model(x) - t)^2)`` over the whole batch, `mine` cutting this rank's part of a
    whole tensor (the identity on one process); per step the loss, the parameters before the step and their
    gradients, whole tensors."""
    n = t.numel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for _ in range(STEPS):
        opt.zero_grad()
        params = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
        y = model(mine(x)) if forward is None else forward(model, mine(x))
        loss = ((y - mine(t)) ** 2).sum() / n  # this rank's rows' share of the mean
        loss.backward()
        total = loss.detach().clone()
        if group is not None:
            torch.distributed.all_reduce(total, group=group)
        steps.append({"loss": total.item(), "params": params,
                      "grads": {name: _full(p.grad).detach().clone() for name, p in model.named_parameters()}})
        opt.step()
    return steps


def _counted_forward(moved):
    """A forward that records what overlap's gathers move while it runs (`overlap.ops.tp.gather.start`)."""
    from overlap.ops.tp import gather

    def forward(model, x):
        start = gather.start

        def counting(kind, call, x2, cc, **kw):
            moved.append((x2.dtype, tuple(x2.shape), x2.numel() * x2.element_size()))
            return start(kind, call, x2, cc, **kw)

        gather.start = counting
        try:
            return model(x)
        finally:
            gather.start = start

    return forward


LAYOUTS = {"seq-first": (0, "auto"), "batch-first": (1, "symm")}  # sequence dim, overlap's strategy


def train_task(rank, world_size, seed, recipes, layouts):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as torch_tp
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import Fp8Recipe
    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel

    W = world_size
    mesh = _mesh(W)
    pg = mesh.get_group()
    report = {}
    for recipe in recipes:
        for layout in layouts:
            dim, strategy = LAYOUTS[layout]
            ctx = f"rank {rank}/{W} {recipe} {layout} strategy={strategy}"
            gen = torch.Generator().manual_seed(seed)
            shape = (SEQ, BATCH, H) if dim == 0 else (BATCH, SEQ, H)
            x, t = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            torch.manual_seed(seed)
            model = MLP()

            def mine(v, dim=dim):
                return v.chunk(W, dim)[rank]

            fp32 = _train(copy.deepcopy(model), x, t, lambda v: v)  # (no fp8: the trajectory fp8 departs from)
            runs = {"torchao": _train(_float8(model, recipe), x, t, lambda v: v)}
            torchs = parallelize_module(_float8(model, recipe), mesh, {
                "up": torch_tp.ColwiseParallel(input_layouts=Shard(dim)),
                "down": torch_tp.RowwiseParallel(output_layouts=Shard(dim))})
            runs["torchao under torch's styles"] = _train(torchs, x, t, mine, pg)
            styles = {"up": ColwiseParallel(input_layouts=Shard(dim), strategy=strategy),
                      "down": RowwiseParallel(output_layouts=Shard(dim), strategy=strategy)}
            ours = parallelize_module(_float8(model, recipe), mesh, styles)
            want = Fp8Recipe("tensorwise" if recipe == "tensorwise" else "rowwise", grads=True)
            assert ours.up._overlap_fp8 == ours.down._overlap_fp8 == want, (ctx, ours.up._overlap_fp8)
            moved = []
            runs["overlap"] = _train(ours, x, t, mine, pg, _counted_forward(moved))

            # Every run at every step within the fp8 bound of the exact computation at its own parameters.
            x2, t2 = x.reshape(-1, H), t.reshape(-1, H)
            exact = {name: [_check_step(f"{ctx} {name} step {i}", s, x2, t2, U_E4M3, GRAD_U[recipe])
                            for i, s in enumerate(steps)] for name, steps in runs.items()}
            for i, s in enumerate(fp32):  # (the oracle's own check: float32 rounding only)
                _check_step(f"{ctx} float32 step {i}", s, x2, t2, 0.0, 0.0)
            # overlap's losses against torchao's, step by step: the sum of both bounds and the exact losses' gap.
            used = 0.0
            for theirs in ("torchao", "torchao under torch's styles"):
                for i, (o, th) in enumerate(zip(runs["overlap"], runs[theirs], strict=True)):
                    (l_o, b_o), (l_t, b_t) = exact["overlap"][i], exact[theirs][i]
                    allowed = b_o + b_t + abs(l_o - l_t) + 1e-6 * l_t
                    off = abs(o["loss"] - th["loss"])
                    assert off <= allowed, f"{ctx} step {i}: loss {o['loss']:.6g} vs {theirs}'s {th['loss']:.6g}"
                    used = max(used, off / allowed)
            losses = [s["loss"] for s in runs["overlap"]]
            assert losses[-1] < losses[0], (ctx, losses)  # (it trains)

            # The gather moved fp8 rows: H e4m3 bytes and a float32 scale each.
            m = x.numel() // H // W
            want_moved = [(torch.uint8, (m, H + 4), m * (H + 4))] * STEPS  # (one rank too: the same call)
            assert moved == want_moved, (ctx, moved[:2], want_moved[:1])
            report[f"{recipe} {layout}"] = {name: [round(s["loss"], 6) for s in steps]
                                             for name, steps in (("float32", fp32), *runs.items())}
            report[f"{recipe} {layout}"]["share of the bound used"] = round(used, 3)
    return report


@pytest.mark.parametrize("world_size, recipes, layouts", [
    (2, ["tensorwise", "rowwise"], list(LAYOUTS)), (4, ["tensorwise", "rowwise"], list(LAYOUTS)),
    (1, ["rowwise"], ["seq-first"]), (3, ["tensorwise"], ["batch-first"])])
def test_float8_model_trains_with_overlap_styles_as_with_torchaos(seed, world_size, recipes, layouts):
    from tests.support.harness import run_isolated

    # (A pool of its own: torchao's modules on ranks whose shared pool holds every earlier test's gloo groups ran
    # many times slower in a whole-suite run.)
    reports = run_isolated(world_size, train_task, seed, recipes, layouts, timeout=300)
    assert reports[0] and all(r == reports[0] for r in reports), reports  # (every rank saw the same losses)
    print(reports[0])


def own_styles_task(rank, world_size, seed):
    """torchao's own float8 styles (tensorwise), or the error gloo gives them; overlap's beside them."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel

    mesh = _mesh(world_size)
    gen = torch.Generator().manual_seed(seed)
    x, t = torch.randn(SEQ, BATCH, H, generator=gen), torch.randn(SEQ, BATCH, H, generator=gen)
    torch.manual_seed(seed)
    model = MLP()

    def mine(v):
        return v.chunk(world_size)[rank]

    runs = {}
    for name, (col, row) in (("overlap", (ColwiseParallel, RowwiseParallel)),
                             ("torchao", (Float8ColwiseParallel, Float8RowwiseParallel))):
        m = parallelize_module(_float8(model, "tensorwise"), mesh, {"up": col(input_layouts=Shard(0)),
                                                                    "down": row(output_layouts=Shard(0))})
        try:
            runs[name] = _train(m, x, t, mine, mesh.get_group())
        except RuntimeError as exc:
            if name == "overlap":
                raise
            return f"{type(exc).__name__}: {exc}"
    x2, t2 = x.reshape(-1, H), t.reshape(-1, H)
    for i, (o, th) in enumerate(zip(runs["overlap"], runs["torchao"], strict=True)):
        l_o, b_o = _check_step(f"rank {rank} overlap step {i}", o, x2, t2, U_E4M3, U_E5M2)
        l_t, b_t = _check_step(f"rank {rank} torchao's styles step {i}", th, x2, t2, U_E4M3, U_E5M2)
        assert abs(o["loss"] - th["loss"]) <= b_o + b_t + abs(l_o - l_t) + 1e-6 * l_t, (i, o["loss"], th["loss"])
    return None


def test_torchao_own_float8_styles_on_gloo(seed):
    from tests.support.harness import run_isolated

    # (A pool of its own: a collective that gloo refuses must not leave a shared pool's group behind it.)
    errors = run_isolated(2, own_styles_task, seed, timeout=180)
    if any(errors):
        pytest.skip(f"torchao's Float8ColwiseParallel does not run on gloo here (torch {torch.__version__}): it "
                    f"all-gathers float8 tensors, which gloo refuses: {errors[0]}")


# ----------------------------------------------------------------------------------------------
# The recipe read from torchao's configs
# ----------------------------------------------------------------------------------------------


def test_recipes_read_from_torchaos_configs():
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType

    from overlap import Fp8Recipe, errors
    from overlap.hooks.torchao_float8 import float8_linear_recipe, is_float8_linear

    def layer(config):
        from torchao.float8 import convert_to_float8_training

        return convert_to_float8_training(nn.Sequential(nn.Linear(32, 16)), config=config)[0]

    assert not is_float8_linear(nn.Linear(4, 4))
    named = {name: layer(Float8LinearConfig.from_recipe_name(name))
             for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    assert all(is_float8_linear(m) for m in named.values())
    errors._WARNED.difference_update({k for k in errors._WARNED if k.startswith("torchao_float8:")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float8_linear_recipe(named["tensorwise"], "S") == Fp8Recipe("tensorwise", grads=True)
        assert float8_linear_recipe(named["rowwise"], "S") == Fp8Recipe("rowwise", grads=True)
        assert not caught, [str(w.message) for w in caught]
        assert float8_linear_recipe(named["rowwise_with_gw_hp"], "S") == Fp8Recipe("rowwise")
    assert len(caught) == 1 and "closest recipe" in str(caught[0].message), [str(w.message) for w in caught]
    assert "output gradient (input gradient's GEMM)" in str(caught[0].message)

    axis, e5m2 = ScalingGranularity.AXISWISE, torch.float8_e5m2
    for config, match in (
        (Float8LinearConfig(**{f"cast_config_{what}": CastConfig(scaling_type=ScalingType.DISABLED)
                               for what in ("input", "weight", "grad_output")}), "does not cast"),
        (Float8LinearConfig(cast_config_input=CastConfig(scaling_granularity=axis)), "one granularity"),
        (Float8LinearConfig(cast_config_input=CastConfig(target_dtype=e5m2)), "float8_e4m3fn"),
        (Float8LinearConfig(enable_fsdp_float8_all_gather=True), "enable_fsdp_float8_all_gather"),
    ):
        with pytest.raises(ValueError, match=match):
            float8_linear_recipe(layer(config), "S")
    broken = named["tensorwise"]
    broken.config = types.SimpleNamespace(cast_config_input=None)  # (another torchao's config)
    with pytest.raises(ValueError, match="not a CastConfig"):
        float8_linear_recipe(broken, "S")


def layers_task(rank, world_size, seed):
    """A style's fp8 that differs from the layer's config; PrepareModuleInput in front of torchao layers."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap import Fp8Recipe
    from overlap.hooks.torch_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from overlap.ops.fp8_matmul import fp8_matmul
    from tests.support.tp_oracle import expect_error, scaled

    W = world_size
    mesh = _mesh(W)
    out = {"conflict": expect_error(parallelize_module, _float8(MLP(), "rowwise"), mesh,
                                    {"up": ColwiseParallel(fp8="tensorwise")}),
           "agree": expect_error(parallelize_module, _float8(MLP(), "rowwise"), mesh,
                                 {"up": ColwiseParallel(fp8=Fp8Recipe("rowwise", grads=True)),
                                  "down": RowwiseParallel()})}
    # torchtitan's feed-forward input: gathered in front of the module, its layers column-wise from Replicate().
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, H, generator=gen)
    torch.manual_seed(seed)
    model = _float8(MLP(), "rowwise")
    m = parallelize_module(copy.deepcopy(model), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    parallelize_module(m, mesh, PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the gather moves float32: warned once)
        y = m(x.chunk(W, 1)[rank])
    recipe = Fp8Recipe("rowwise", grads=True)
    w1, b1 = model.up.weight.detach().chunk(W)[rank], model.up.bias.detach().chunk(W)[rank]
    w2, b2 = model.down.weight.detach().chunk(W, 1)[rank], model.down.bias.detach()
    part = fp8_matmul(F.gelu(fp8_matmul(x, w1.t(), recipe) + b1), w2.t(), recipe)
    torch.distributed.all_reduce(part, group=mesh.get_group())  # (the reference's plain all-reduce)
    want = part + b2
    torch.testing.assert_close(y.detach(), want, **scaled(dict(rtol=1e-5, atol=1e-5), want))
    out["recipes"] = (m.up._overlap_fp8, m.down._overlap_fp8)
    return out


def test_layer_recipe_meets_styles(pools, seed):
    from overlap import Fp8Recipe

    for rank, out in enumerate(pools(2).run(layers_task, seed, timeout=120)):
        kind, msg, _ = out["conflict"]
        assert kind == "ValueError" and "Float8Linear" in msg and "leave the style's fp8 out" in msg, (rank, msg)
        assert out["agree"][0] is None, (rank, out["agree"])
        assert out["recipes"] == (Fp8Recipe("rowwise", grads=True),) * 2, (rank, out["recipes"])


def test_use_overlap_styles_swaps_torchaos_style_names():
    import torchao.float8.float8_tensor_parallel as ao_tp
    from torch.distributed.tensor import Replicate, Shard

    from overlap.hooks.torch_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, use_overlap_styles

    theirs = (ao_tp.Float8ColwiseParallel, ao_tp.Float8RowwiseParallel, ao_tp.PrepareFloat8ModuleInput)
    with use_overlap_styles(ao_tp):
        col = ao_tp.Float8ColwiseParallel(input_layouts=Shard(1))
        row = ao_tp.Float8RowwiseParallel(output_layouts=Shard(1))
        prep = ao_tp.PrepareFloat8ModuleInput(input_layouts=(Shard(1), None),
                                              desired_input_layouts=(Replicate(), None),
                                              float8_dtype=torch.float8_e4m3fn, fwd_config_submodule_fqn="w1")
        assert isinstance(col, ColwiseParallel) and isinstance(row, RowwiseParallel), (col, row)
        assert isinstance(prep, PrepareModuleInput), prep
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            ao_tp.PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           float8_dtype=torch.float8_e5m2)
    assert (ao_tp.Float8ColwiseParallel, ao_tp.Float8RowwiseParallel, ao_tp.PrepareFloat8ModuleInput) == theirs
