"""The fp8 recipe on one rank: `overlap.Fp8Recipe` and its text, `overlap.fp8_matmul` (forward: the scaled GEMM of the
operands quantized along k, against a float64 oracle of the dequantized values; backward: the leaves' dtype, or fp8
gradients within fp8's bound), and the tiled MX scale layout `torch._scaled_mm` reads on CUDA.

The bound of an fp8-gradient GEMM ``x @ y``: each operand rounds once to the gradient format (relative ``u``: 2^-4
for e4m3, 2^-3 for e5m2; MX scales are powers of two, so the same), so elementwise
``|x8 @ y8 - x @ y| <= (2u + u^2) * (|x| @ |y|)`` (plus subnormal steps, covered by the values drawn here).
"""

from __future__ import annotations

import pytest
import torch

import overlap
from overlap.ops import fp8 as fp8s
from overlap.ops.fp8_matmul import grad_gemm
from overlap.ops.fp8_recipe import Fp8Recipe, recipe_of

RECIPES = ["rowwise", "tensorwise", "mxfp8"]


def _unit(dtype: torch.dtype) -> float:
    return 2.0 ** -4 if dtype == torch.float8_e4m3fn else 2.0 ** -3


def _out_unit(dtype: torch.dtype) -> float:
    """Relative rounding of one store to ``dtype``."""
    return torch.finfo(dtype).eps


def test_recipe_text_round_trips_and_bad_recipes_raise():
    for g in RECIPES:
        for grads in (False, True):
            r = Fp8Recipe(g, grads)
            assert recipe_of("op", r.text) == r and recipe_of("op", r) is r
        assert recipe_of("op", g) == Fp8Recipe(g)
    assert recipe_of("op", None) is None
    assert Fp8Recipe("tensorwise", True).grad_dtype == torch.float8_e5m2
    assert Fp8Recipe("rowwise", True).grad_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="granularity"):
        Fp8Recipe("columnwise")
    with pytest.raises(TypeError, match="grads"):
        Fp8Recipe("rowwise", grads=1)
    with pytest.raises(ValueError, match="overlap.op: fp8 must be"):
        recipe_of("op", "rowwise+grad")
    with pytest.raises(TypeError, match="overlap.op: fp8 must be"):
        recipe_of("op", 8)


@pytest.mark.parametrize("granularity", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matmul_forward_is_the_scaled_gemm_backward_the_leaves(seed, granularity, dtype):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn((3, 5, 64), generator=gen) * torch.logspace(-2, 2, 64)).to(dtype).requires_grad_()
    b = torch.randn((64, 24), generator=gen).to(dtype).requires_grad_()
    y = overlap.fp8_matmul(a, b, granularity)
    assert y.dtype == dtype and y.shape == (3, 5, 24)
    a8, sa = overlap.quantize_fp8(a.detach().reshape(-1, 64), granularity)
    b8, sb = fp8s.quantize_weight(b.detach(), granularity)
    a64, b64 = fp8s.dequantize(a8, sa, -1).double(), fp8s.dequantize(b8, sb, 0).double()
    want = (a64 @ b64).view(3, 5, 24)
    # float32 accumulation over k (a BLAS's order and blocking vary by CPU: bounded by k ulps of |a| @ |b|), then
    # one rounding to the output dtype
    bound = 64 * 2.0 ** -23 * (a64.abs() @ b64.abs()).view(3, 5, 24) + _out_unit(dtype) * want.abs()
    assert ((y.double() - want).abs() <= bound).all(), ((y.double() - want).abs() / bound).max()
    assert not torch.equal(y, a.detach() @ b.detach())  # quantized, really
    g = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(g)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (a2 @ b2).backward(g)
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)


@pytest.mark.parametrize("granularity", RECIPES)
def test_fp8_gradients_within_the_bound(seed, granularity):
    gen = torch.Generator().manual_seed(seed)
    recipe = Fp8Recipe(granularity, grads=True)
    a = torch.randn((64, 32), generator=gen).requires_grad_()
    b = torch.randn((32, 96), generator=gen).requires_grad_()
    g = torch.randn((64, 96), generator=gen)
    overlap.fp8_matmul(a, b, recipe).backward(g)
    u = _unit(recipe.grad_dtype)
    for got, x, y in ((a.grad, g, b.detach().t()), (b.grad, a.detach().t(), g)):
        exact = x.double() @ y.double()
        bound = (2 * u + u * u) * (x.double().abs() @ y.double().abs()) + 1e-6
        assert bool(((got.double() - exact).abs() <= bound).all())
        assert not torch.allclose(got.double(), exact, rtol=0, atol=1e-9)  # fp8, really


def test_grad_gemm_mx_with_a_reduction_off_the_block_is_float32(seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn((8, 33), generator=gen), torch.randn((33, 4), generator=gen)
    assert torch.equal(grad_gemm(x, y, Fp8Recipe("mxfp8", True)), x @ y)


def test_fp8_matmul_refuses_bad_input():
    a, b = torch.randn(4, 48), torch.randn(48, 8)
    with pytest.raises(ValueError, match="multiple of 32"):
        overlap.fp8_matmul(a, b, "mxfp8")
    with pytest.raises(TypeError, match="dtype"):
        overlap.fp8_matmul(a.double(), b.double(), "rowwise")
    with pytest.raises(ValueError, match=r"\[k, n\]"):
        overlap.fp8_matmul(a, b.t(), "rowwise")
    with pytest.raises(ValueError, match="fp8 must be"):
        overlap.fp8_matmul(a, b, "blockwise")


def test_blocked_scale_layout_places_each_scale_in_its_tile(seed):
    """cuBLAS's MX scale layout: 128 x 4 tiles, row ``r`` col ``c`` of a tile at ``(r % 32) * 16 + (r // 32) * 4 +
    c``, tiles row-block major; padded rows and columns hold zeros."""
    rows, cols = 200, 6
    values = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    flat = fp8s.to_blocked(values)
    n_col_tiles = 2
    assert flat.numel() == 256 * 8
    for r, c in ((0, 0), (31, 3), (32, 0), (127, 3), (128, 4), (199, 5), (77, 2)):
        tile = (r // 128) * n_col_tiles + c // 4
        rr, cc = r % 128, c % 4
        assert flat[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc].item() == values[r, c].item()
    assert flat.sum().item() == values.sum().item()  # every value once, the padding zeros


def test_fp8_matmul_compiles_without_a_graph_break(seed):
    """torch.compile(fullgraph=True) traces the recipe's GEMM, forward and fp8 backward, with the numbers of eager
    (up to float32 rounding: a trace dequantizes where eager may run torch._scaled_mm)."""
    gen = torch.Generator().manual_seed(seed)
    recipe = Fp8Recipe("rowwise", grads=True)
    a0, b0 = torch.randn((32, 64), generator=gen), torch.randn((64, 48), generator=gen)
    g = torch.randn((32, 48), generator=gen)
    results = []
    for fn in (torch.compile(lambda a, b: overlap.fp8_matmul(a, b, recipe), fullgraph=True),
               lambda a, b: overlap.fp8_matmul(a, b, recipe)):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = fn(a, b)
        y.backward(g)
        results.append((y.detach(), a.grad, b.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", ["x", "y"])
def test_grad_gemm_casts_the_output_gradient_to_the_gradient_format_the_other_operand_to_e4m3(seed, grad):
    """torchao's tensorwise convention: e5m2 for the output gradient only; the weight or saved input it meets e4m3."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn((16, 64), generator=gen), torch.randn((64, 8), generator=gen)
    recipe = Fp8Recipe("tensorwise", grads=True)
    dx = torch.float8_e5m2 if grad == "x" else torch.float8_e4m3fn
    dy = torch.float8_e5m2 if grad == "y" else torch.float8_e4m3fn
    x8, sx = overlap.quantize_fp8(x, "tensorwise", dx)
    y8, sy = overlap.quantize_fp8(y, "tensorwise", dy)
    want = x8.double() * sx.double() @ (y8.double() * sy.double())
    torch.testing.assert_close(grad_gemm(x, y, recipe, grad=grad).double(), want, rtol=1e-5, atol=1e-5)


def test_block128_is_the_moe_dispatchs_alone():
    """``block128`` names a recipe (the MoE dispatch takes it); the TP ops, their layers and `fp8_matmul` refuse it
    with one line saying whose it is."""
    from overlap.ops.fp8_recipe import check_recipe

    assert overlap.Fp8Recipe("block128").text == "block128"
    a, b = torch.randn(4, 32), torch.randn(32, 8)
    with pytest.raises(ValueError, match="fp8='block128' is not taken here .*MoE dispatch's"):
        overlap.fp8_matmul(a, b, "block128")
    with pytest.raises(ValueError, match="all_gather_matmul: fp8=.block128. .*.rowwise., .tensorwise., .mxfp8."):
        check_recipe("all_gather_matmul", "block128", a)
