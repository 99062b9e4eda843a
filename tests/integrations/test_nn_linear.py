"""overlap.nn's plain-torch ColumnParallelLinear/RowParallelLinear on CPU ranks, against a single-process nn.Linear.

Every rank builds the parallel layer and a whole ``nn.Linear`` after the same ``torch.manual_seed``: the
layer's parameters must be the matching slice of the ``nn.Linear``'s, its output the matching part of the
``nn.Linear``'s output, and after backward (each rank back-propagating its part of the same upstream
gradient) the input gradient and every parameter's ``.grad`` the matching slices of the ``nn.Linear``'s,
with no reduction left to the caller. Modes: sequence parallelism on and off, ``gather_output``,
``input_is_parallel=False``; world sizes 2 and 3; strategies ``reference``, ``pipelined`` and ``auto``.
Also: the deprecated ``config=`` path, argument errors, that neither ``overlap.nn`` nor the Megatron
layers' module imports megatron-core. (The README's script runs in ``test_docs.py``.)
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings

import pytest
import torch

from tests.support.tp_oracle import scaled

S, B, H, F = 6, 2, 12, 18  # sequence, batch, in, out: every split dim divides by 2 and 3
FP32 = dict(rtol=1e-5, atol=1e-5)
STRATEGIES = ("reference", "pipelined", "auto")

COLUMN_MODES = [dict(sequence_parallel=sp, gather_output=go) for sp in (False, True) for go in (False, True)]
ROW_MODES = [dict(sequence_parallel=False, input_is_parallel=True), dict(sequence_parallel=True),
             dict(sequence_parallel=False, input_is_parallel=False)]


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **scaled(FP32, expected), msg=lambda m: f"{what}: {m}")


def _reference(seed, in_features, out_features, x, g):
    """The single-process nn.Linear after `seed`: (layer, output, input gradient)."""
    torch.manual_seed(seed)
    ref = torch.nn.Linear(in_features, out_features)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    y.backward(g)
    return ref, y.detach(), xr.grad


def _run(layer, x, g):
    xi = x.clone().requires_grad_()
    y = layer(xi)
    assert type(y) is torch.Tensor, type(y)
    y.backward(g)
    return y.detach(), xi.grad


def column_task(rank, world_size, seed, mode, strategy):
    from overlap.nn import ColumnParallelLinear

    gen = torch.Generator().manual_seed(seed + 1)
    x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, F, generator=gen)
    ref, y_ref, gx_ref = _reference(seed, H, F, x, g)
    torch.manual_seed(seed)
    layer = ColumnParallelLinear(H, F, strategy=strategy, **mode)
    ctx = f"column rank {rank}/{world_size} {mode} {strategy}"
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    cols = slice(rank * F // world_size, (rank + 1) * F // world_size)
    assert torch.equal(layer.weight, ref.weight[cols]) and torch.equal(layer.bias, ref.bias[cols]), ctx
    x_in = x[rows] if mode["sequence_parallel"] else x
    if mode["gather_output"]:  # replicated output and loss: every rank back-propagates the whole g
        y_want, g_in = y_ref, g
    else:
        y_want, g_in = y_ref[..., cols], g[..., cols]
    y, gx = _run(layer, x_in, g_in)
    _close(y, y_want, f"{ctx}: output")
    _close(gx, gx_ref[rows] if mode["sequence_parallel"] else gx_ref, f"{ctx}: input grad")
    _close(layer.weight.grad, ref.weight.grad[cols], f"{ctx}: weight.grad")
    _close(layer.bias.grad, ref.bias.grad[cols], f"{ctx}: bias.grad")
    return True


def row_task(rank, world_size, seed, mode, strategy):
    from overlap.nn import RowParallelLinear

    gen = torch.Generator().manual_seed(seed + 2)
    x, g = torch.randn(S, B, F, generator=gen), torch.randn(S, B, H, generator=gen)
    ref, y_ref, gx_ref = _reference(seed, F, H, x, g)
    torch.manual_seed(seed)
    layer = RowParallelLinear(F, H, strategy=strategy, **mode)
    ctx = f"row rank {rank}/{world_size} {mode} {strategy}"
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    cols = slice(rank * F // world_size, (rank + 1) * F // world_size)
    assert torch.equal(layer.weight, ref.weight[:, cols]) and torch.equal(layer.bias, ref.bias), ctx
    parallel_input = mode.get("input_is_parallel", True)
    sp = mode["sequence_parallel"]
    y, gx = _run(layer, x[..., cols] if parallel_input else x, g[rows] if sp else g)
    _close(y, y_ref[rows] if sp else y_ref, f"{ctx}: output")
    _close(gx, gx_ref[..., cols] if parallel_input else gx_ref, f"{ctx}: input grad")
    _close(layer.weight.grad, ref.weight.grad[:, cols], f"{ctx}: weight.grad")
    _close(layer.bias.grad, ref.bias.grad, f"{ctx}: bias.grad")
    return True


def every_mode(rank, world_size, seed):
    done = []
    for strategy in STRATEGIES:
        for mode in COLUMN_MODES:
            done.append(column_task(rank, world_size, seed, mode, strategy))
        for mode in ROW_MODES:
            done.append(row_task(rank, world_size, seed, mode, strategy))
    return len(done)


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 3])
def test_layers_match_single_process_linear(pools, seed, world_size):
    want = len(STRATEGIES) * (len(COLUMN_MODES) + len(ROW_MODES))
    assert pools(world_size).run(every_mode, seed, timeout=180) == [want] * world_size


def mlp_task(rank, world_size, seed):
    """Column then row, sequence parallel, no bias: the tensor-parallel MLP of the module docstring."""
    from overlap.nn import ColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(seed + 3)
    x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    torch.manual_seed(seed)
    up_ref, down_ref = torch.nn.Linear(H, F, bias=False), torch.nn.Linear(F, H, bias=False)
    torch.manual_seed(seed)
    up = ColumnParallelLinear(H, F, bias=False, sequence_parallel=True)
    down = RowParallelLinear(F, H, bias=False, sequence_parallel=True)
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    cols = slice(rank * F // world_size, (rank + 1) * F // world_size)
    xr = x.clone().requires_grad_()
    y_ref = down_ref(torch.nn.functional.gelu(up_ref(xr)))
    y_ref.backward(g)
    xi = x[rows].clone().requires_grad_()
    y = down(torch.nn.functional.gelu(up(xi)))
    y.backward(g[rows])
    _close(y.detach(), y_ref.detach()[rows], "mlp output")
    _close(xi.grad, xr.grad[rows], "mlp input grad")
    _close(up.weight.grad, up_ref.weight.grad[cols], "up.weight.grad")
    _close(down.weight.grad, down_ref.weight.grad[:, cols], "down.weight.grad")
    assert up.bias is None and down.bias is None
    return True


def test_sequence_parallel_mlp_without_bias(pools, seed):
    assert all(pools(2).run(mlp_task, seed, timeout=60))


def construction_task(rank, world_size):
    """Argument errors (raised before any communication) and the deprecated config= path."""
    import torch.distributed as dist

    from overlap.hooks import megatron as om
    from overlap.nn import ColumnParallelLinear, RowParallelLinear

    out = {}
    for name, make in (("uneven column", lambda: ColumnParallelLinear(H, 2 * world_size + 1)),
                       ("uneven row", lambda: RowParallelLinear(2 * world_size + 1, H)),
                       ("sp without parallel input",
                        lambda: RowParallelLinear(F, H, sequence_parallel=True, input_is_parallel=False)),
                       ("bad strategy", lambda: ColumnParallelLinear(H, F, strategy="bogus")),
                       ("zero size", lambda: ColumnParallelLinear(0, F))):
        try:
            make()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    config = types.SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        col = ColumnParallelLinear(H, F, config=config, init_method=torch.nn.init.normal_, tp_group=dist.group.WORLD)
        row = RowParallelLinear(F, H, config=config, init_method=torch.nn.init.normal_, bias=True,
                                input_is_parallel=True, skip_bias_add=False, tp_group=dist.group.WORLD)
    out["deprecated"] = [(w.category.__name__, str(w.message)) for w in caught]
    out["types"] = (type(col) is om.ColumnParallelLinear, type(row) is om.RowParallelLinear)
    y, bias = row(col(torch.randn(S, B, H))[0])
    out["megatron_output"] = (tuple(y.shape), bias)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ColumnParallelLinear(H, F)
    out["plain_warnings"] = [str(w.message) for w in caught]
    return out


def test_construction_errors_and_deprecated_config(pools):
    for res in pools(2).run(construction_task, timeout=60):
        assert "out_features=5" in res["uneven column"] and "divide" in res["uneven column"], res
        assert "in_features=5" in res["uneven row"], res
        assert "input_is_parallel" in res["sp without parallel input"], res
        assert "strategy" in res["bad strategy"], res
        assert "in_features" in res["zero size"], res
        deprecated = res["deprecated"]
        assert [c for c, _ in deprecated] == ["DeprecationWarning"] * 2, deprecated
        assert all("overlap.hooks.megatron" in m for _, m in deprecated), deprecated
        assert res["types"] == (True, True), res
        assert res["megatron_output"] == ((S, B, H), None), res
        assert res["plain_warnings"] == [], res


def test_plain_layers_import_no_megatron():
    """Importing overlap.nn and the Megatron layers' module loads no megatron-core (whose import warns)."""
    code = ("import sys, warnings; warnings.simplefilter('error'); import overlap.nn, overlap.hooks.megatron as om; "
            "om.ColumnParallelLinear; "
            "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
            "assert not bad, bad; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
