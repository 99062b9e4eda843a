"""Rank tasks of the torch.compile tests (`tests/ops/test_compile.py`): eager against compiled on fresh inputs.

Every task builds this rank's inputs from a seed, runs a function eagerly (outputs and gradients), compiles it
with ``fullgraph=True`` (a graph break raises) and runs it again on the same inputs; it returns what the test
asserts: whether the compiled run is bitwise eager's, the graph breaks `torch._dynamo.explain` reports, and
the custom ops that ran, in order (`overlap.ops.library.RECENT`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TP_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def _draw(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1009 + rank)


def tp_inputs(op: str, world_size: int, g: torch.Generator, dtype=torch.float32, rows: int = 3):
    """``(a, w)`` of `op` on one rank: ``a`` 3-D with grad, ``w`` a weight ``[n, k]`` passed as ``w.t()``."""
    k, n = 8, 6
    m = rows * world_size if op == "matmul_reduce_scatter" else rows
    a = torch.randn(m, 2, k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(n, k, generator=g).to(dtype).requires_grad_()
    return a, w


def _grads(fn: Callable, inputs: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, list]:
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(out.dtype)
    out.backward(g)
    grads = [t.grad.clone() if t.grad is not None else None for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), grads


def eager_vs_compiled(fn: Callable, inputs: tuple[torch.Tensor, ...], seed: int, backend: str = "aot_eager",
                      explain: bool = True) -> dict[str, Any]:
    """Run `fn` eagerly and compiled (``fullgraph=True``) on `inputs`, forward and backward."""
    import torch._dynamo

    torch._dynamo.reset()
    want, want_grads = _grads(fn, inputs, seed)
    breaks = torch._dynamo.explain(fn)(*inputs).graph_break_count if explain else None
    torch._dynamo.reset()
    got, got_grads = _grads(torch.compile(fn, backend=backend, fullgraph=True), inputs, seed)
    torch._dynamo.reset()
    same = torch.equal(got, want) and all((a is None and b is None) or torch.equal(a, b)
                                          for a, b in zip(got_grads, want_grads))
    diff = max([(got.double() - want.double()).abs().max().item() if got.numel() else 0.0]
               + [(a.double() - b.double()).abs().max().item() for a, b in zip(got_grads, want_grads)
                  if a is not None and b is not None and a.numel()])
    return {"bitwise": same, "max_diff": diff, "breaks": breaks}


def tp_ops(rank: int, world_size: int, seed: int, strategies: tuple[str, ...], explain_strategy: str) -> list:
    """Every TP op x strategy: compiled against eager. Returns ``[(op, strategy, result), ...]``."""
    import overlap

    out = []
    for op in TP_OPS:
        fn_op = getattr(overlap, op)
        for strategy in strategies:
            a, w = tp_inputs(op, world_size, _draw(seed, rank))

            def fn(a, w, fn_op=fn_op, strategy=strategy):
                return fn_op(a, w.t(), strategy=strategy)

            out.append((op, strategy, eager_vs_compiled(fn, (a, w), seed, explain=strategy == explain_strategy)))
    return out


def weight_gather(rank: int, world_size: int, seed: int, strategies: tuple[str, ...]) -> list:
    """``all_gather_weight_matmul`` (a weight shard ``[n, k]`` passed as ``w.t()``) x strategy, compiled against
    eager, forward and backward. Returns ``[(strategy, result), ...]``."""
    import overlap

    out = []
    for strategy in strategies:
        a, w = tp_inputs("all_gather_weight_matmul", world_size, _draw(seed, rank))

        def fn(a, w, strategy=strategy):
            return overlap.all_gather_weight_matmul(a, w.t(), strategy=strategy)

        out.append((strategy, eager_vs_compiled(fn, (a, w), seed)))
    return out


def tp_inductor(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """One TP block (gather-GEMM, GELU, GEMM-scatter) with the inductor backend: within tolerance of eager."""
    import torch.nn.functional as F

    import overlap

    g = _draw(seed, rank)
    a = torch.randn(3, 2, 8, generator=g).requires_grad_()
    w1 = torch.randn(12, 8, generator=g).requires_grad_()
    w2 = torch.randn(8, 12, generator=g).requires_grad_()

    def block(a, w1, w2):
        h = F.gelu(overlap.all_gather_matmul(a, w1.t(), strategy="symm"))
        return overlap.matmul_reduce_scatter(h * 0.5 + 1.0, w2.t(), strategy="symm")

    return eager_vs_compiled(block, (a, w1, w2), seed, backend="inductor", explain=False)


def order(rank: int, world_size: int, seed: int, backend: str) -> dict[str, Any]:
    """Two independent calls, the first one's result unused: the ops that ran, eager then compiled."""
    import torch._dynamo

    import overlap
    from overlap.ops import library

    g = _draw(seed, rank)
    x = torch.randn(4, 8, generator=g)
    y = torch.randn(2, 8, generator=g)
    b = torch.randn(8, 5, generator=g)

    def two_calls(x, y, b):
        overlap.matmul_all_reduce(x, b, strategy="symm")  # result unused: must still run, first
        return overlap.all_gather_matmul(y, b, strategy="pipelined")

    torch._dynamo.reset()
    library.RECENT.clear()
    want = two_calls(x, y, b)
    eager = list(library.RECENT)
    compiled_fn = torch.compile(two_calls, backend=backend, fullgraph=True)
    compiled_fn(x, y, b)  # compiles and runs
    library.RECENT.clear()
    got = compiled_fn(x, y, b)
    torch._dynamo.reset()
    return {"eager": eager, "compiled": list(library.RECENT), "bitwise": torch.equal(got, want)}


def dynamic_rows(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """A sequence length marked dynamic: one graph for several lengths, each matching eager."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import overlap

    counter = CompileCounterWithBackend("aot_eager")
    w = torch.randn(6, 8, generator=_draw(seed, rank)).requires_grad_()

    def fn(a, w):
        return overlap.matmul_reduce_scatter(overlap.all_gather_matmul(a, w.t(), strategy="symm"), w,
                                             strategy="symm")

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    same = []
    for rows in (2, 3, 5):
        a = torch.randn(rows, 2, 8, generator=_draw(seed + rows, rank)).requires_grad_()
        torch._dynamo.mark_dynamic(a, 0)
        want, want_grads = _grads(fn, (a, w), seed)
        got, got_grads = _grads(compiled, (a, w), seed)
        same.append(torch.equal(got, want) and all(torch.equal(p, q) for p, q in zip(got_grads, want_grads)))
    torch._dynamo.reset()
    return {"frames": counter.frame_count, "bitwise": same}


def moe_inputs(rank: int, world_size: int, seed: int, tokens: int | None = None):
    """``(x, topk_idx, w1, w2, topk_weights, num_experts)`` of one rank: token counts differ between ranks."""
    g = _draw(seed, rank)
    E, K, H, F = 2 * world_size, 2, 8, 6
    L = E // world_size
    T = 3 + 2 * rank if tokens is None else tokens
    x = torch.randn(T, H, generator=g).requires_grad_()
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(T)]
    idx = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    w1 = torch.randn(L, H, F, generator=g).requires_grad_()
    w2 = torch.randn(L, F, H, generator=g).requires_grad_()
    tw = torch.rand(T, K, generator=g).requires_grad_()
    return x, idx, w1, w2, tw, E


def moe_ops(rank: int, world_size: int, seed: int, strategies: tuple[str, ...], backend: str = "aot_eager") -> list:
    """The four MoE ops in one layer (grouped-matmul pair, then the plain pair): compiled against eager."""
    import torch._dynamo
    import torch.nn.functional as Fn

    import overlap

    out = []
    for strategy in strategies:
        x, idx, w1, w2, tw, E = moe_inputs(rank, world_size, seed)
        plain = "symm" if strategy == "fused" else strategy  # plain dispatch/combine have no fused form

        def layer(x, w1, w2, tw, idx=idx, E=E, strategy=strategy, plain=plain):
            h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy=strategy)
            y = overlap.moe.grouped_matmul_combine(Fn.gelu(h), w2, tw, handle, strategy=strategy)
            rows, handle2 = overlap.moe.dispatch(x, idx, E, strategy=plain)
            return y + overlap.moe.combine(rows * 2.0, tw, handle2, strategy=plain)

        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):  # for explain (not fullgraph)
            out.append((strategy, eager_vs_compiled(layer, (x, w1, w2, tw), seed, backend=backend,
                                                    explain=backend == "aot_eager")))
    return out


def module_eager_vs_compiled(model: torch.nn.Module, x: torch.Tensor, seed: int, backend: str = "aot_eager",
                             explain_config: dict | None = None) -> dict[str, Any]:
    """`model` eagerly and compiled whole (``fullgraph=True``): the output, the input's and every parameter's
    gradient (DTensor gradients compared by their local shards), with the largest difference."""
    import torch._dynamo

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def run(fn):
        xi = x.detach().clone().requires_grad_()
        y = local(fn(xi))
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
        y.backward(g)
        grads = [xi.grad] + [local(p.grad).clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return y.detach(), grads

    torch._dynamo.reset()
    want, want_grads = run(model)
    with torch._dynamo.config.patch(**(explain_config or {})):
        explained = torch._dynamo.explain(model)(x)
    torch._dynamo.reset()
    got, got_grads = run(torch.compile(model, backend=backend, fullgraph=True))
    torch._dynamo.reset()
    diff = max([(got - want).abs().max().item()]
               + [(a - b).abs().max().item() for a, b in zip(got_grads, want_grads, strict=True)])
    return {"breaks": explained.graph_break_count, "max_diff": diff,
            "reasons": [str(r.reason).splitlines()[0] for r in explained.break_reasons]}


def moe_module(rank: int, world_size: int, seed: int, strategy: str) -> dict[str, Any]:
    """`overlap.nn.ExpertParallelMLP` compiled whole: outputs and every parameter's gradient against eager."""
    from overlap.nn import ExpertParallelMLP

    torch.manual_seed(seed)  # the router: replicated, equal on every rank
    mlp = ExpertParallelMLP(hidden_size=8, ffn_hidden_size=6, num_experts=2 * world_size, top_k=2,
                            activation="silu_glu", strategy=strategy)
    x = torch.randn(3 + rank, 2, 8, generator=_draw(seed, rank))
    # (explain traces without fullgraph: it needs the flag fullgraph implies for the dispatch's row count)
    return module_eager_vs_compiled(mlp, x, seed, explain_config={"capture_dynamic_output_shape_ops": True})


def nn_layers(rank: int, world_size: int, seed: int, strategy: str) -> dict[str, dict[str, Any]]:
    """`overlap.nn`'s column and row layers in an MLP, in each mode, compiled whole against eager."""
    from torch import nn

    from overlap.nn import ColumnParallelLinear, RowParallelLinear

    modes = {
        "sequence_parallel": (dict(sequence_parallel=True), dict(sequence_parallel=True), 2),
        "replicated": ({}, {}, 2 * world_size),
        "gather_output": (dict(gather_output=True), dict(input_is_parallel=False), 2 * world_size),
    }
    out = {}
    for name, (col_kw, row_kw, rows) in modes.items():
        torch.manual_seed(seed)
        model = nn.Sequential(ColumnParallelLinear(8, 6 * world_size, strategy=strategy, **col_kw), nn.GELU(),
                              RowParallelLinear(6 * world_size, 8, strategy=strategy, **row_kw))
        x = torch.randn(rows, 2, 8, generator=_draw(seed, rank))
        out[name] = module_eager_vs_compiled(model, x, seed)
    return out


def sharded_layers(rank: int, world_size: int, seed: int, strategy: str) -> dict[str, dict[str, Any]]:
    """`overlap.nn.ShardedLinear` (FSDP: weights and biases sharded by rows) in an MLP, compiled whole."""
    from torch import nn

    from overlap.nn import ShardedLinear

    torch.manual_seed(seed)
    model = nn.Sequential(ShardedLinear(8, 6 * world_size, strategy=strategy), nn.GELU(),
                          ShardedLinear(6 * world_size, 4 * world_size, strategy=strategy))
    x = torch.randn(3, 2, 8, generator=_draw(seed, rank))  # every rank its own batch
    return {"fsdp": module_eager_vs_compiled(model, x, seed)}


def torch_tp_styles(rank: int, world_size: int, seed: int, strategy: str) -> dict[str, dict[str, Any]]:
    """`overlap.hooks.torch_tp`'s styles on an MLP (sequence-parallel and replicated), compiled whole."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel

    mesh = DeviceMesh("cpu", list(range(world_size)))
    plans = {
        "sequence_parallel": ({"0": ColwiseParallel(input_layouts=Shard(0), strategy=strategy),
                               "2": RowwiseParallel(output_layouts=Shard(0), strategy=strategy)}, 2),
        "replicated": ({"0": ColwiseParallel(strategy=strategy), "2": RowwiseParallel(strategy=strategy)},
                       2 * world_size),
    }
    out = {}
    for name, (plan, rows) in plans.items():
        torch.manual_seed(seed)
        model = parallelize_module(nn.Sequential(nn.Linear(8, 6 * world_size), nn.GELU(),
                                                 nn.Linear(6 * world_size, 8)), mesh, plan)
        x = torch.randn(rows, 2, 8, generator=_draw(seed, rank))
        out[name] = module_eager_vs_compiled(model, x, seed)
    return out


def opchecks(rank: int, world_size: int, seed: int) -> dict[str, str]:
    """`torch.library.opcheck` on every custom op (schema, fake against real, autograd registration, AOT
    dispatch), each on this rank's inputs. Every rank runs the same checks, so the calls meet."""
    from overlap.ops import library  # noqa: F401
    from overlap.ops.fp8 import quantize_fp8
    from overlap.ops.moe import combine, dispatch  # noqa: F401  (each module defines its custom ops)
    from overlap.ops.tp import (  # noqa: F401
        all_gather_matmul,
        all_gather_weight_matmul,
        collectives,
        matmul_all_reduce,
        matmul_reduce_scatter,
    )
    from overlap.ops.tp.all_gather_weight_matmul import quantize_shard
    from overlap.ops.tp.operands import quantize_weight

    g = _draw(seed, rank)
    ops = torch.ops.overlap
    a3 = torch.randn(2 * world_size, 2, 8, generator=g, requires_grad=True)
    b = torch.randn(8, 6, generator=g, requires_grad=True)
    b2 = torch.randn(8, 3, generator=g, requires_grad=True)
    plain = (None, None, None, "")  # the fp8 arguments of a call without fp8: no scales, no out_dtype, no recipe
    tp = ("", "symm", "", None, True)
    fwd = ("", "symm", "", None, False)
    a8, a_scale = quantize_fp8(a3.detach(), "rowwise")
    b8, b_scale = quantize_weight(b.detach(), "rowwise")
    # MX (1x32 blocks along k): k = 32, the scales e8m0 ([..., k/32] and [k/32, n])
    a32 = torch.randn(2 * world_size, 2, 32, generator=g, requires_grad=True)
    b32 = torch.randn(32, 6, generator=g, requires_grad=True)
    a8_mx, a_scale_mx = quantize_fp8(a32.detach(), "mxfp8")
    b8_mx, b_scale_mx = quantize_weight(b32.detach(), "mxfp8")
    x, idx, w1, w2, tw, E = moe_inputs(rank, world_size, seed)
    cases = {
        "all_gather_matmul": (ops.all_gather_matmul.default, (a3, [b], 0, False, *tp, None, None, None, "")),
        # batch-first: gather dim 1, two weights, the gathered input returned
        "all_gather_matmul dim 1": (ops.all_gather_matmul.default, (a3, [b, b2], 1, True, *tp, *plain)),
        # fp8: the recipe (trainable), fp8 operands with their scales (forward only)
        "all_gather_matmul fp8": (ops.all_gather_matmul.default, (a3, [b], 1, False, *tp, None, None, None,
                                                                  "rowwise")),
        "all_gather_matmul fp8 operands": (ops.all_gather_matmul.default, (a8, [b8], 0, False, *fwd, a_scale,
                                                                           [b_scale], torch.bfloat16, "")),
        "all_gather_matmul mxfp8": (ops.all_gather_matmul.default, (a32, [b32], 1, False, *tp, None, None, None,
                                                                    "mxfp8")),
        "all_gather_matmul mxfp8 operands": (ops.all_gather_matmul.default, (a8_mx, [b8_mx], 0, False, *fwd,
                                                                             a_scale_mx, [b_scale_mx],
                                                                             torch.float32, "")),
        "matmul_reduce_scatter": (ops.matmul_reduce_scatter.default, (a3, b, 0, *tp, *plain)),
        "matmul_reduce_scatter dim 1": (ops.matmul_reduce_scatter.default, (a3, b, 1, *tp, *plain)),
        "matmul_reduce_scatter fp8": (ops.matmul_reduce_scatter.default, (a3, b, 0, *tp, None, None, None,
                                                                          "tensorwise")),
        "matmul_all_reduce": (ops.matmul_all_reduce.default, (a3, b, *tp, *plain)),
        "matmul_all_reduce fp8 operands": (ops.matmul_all_reduce.default, (a8, b8, *fwd, a_scale, b_scale,
                                                                           torch.float32, "")),
        "matmul_reduce_scatter mxfp8 operands": (ops.matmul_reduce_scatter.default, (a8_mx, b8_mx, 1, *fwd,
                                                                                     a_scale_mx, b_scale_mx,
                                                                                     torch.bfloat16, "")),
        "matmul_all_reduce mxfp8": (ops.matmul_all_reduce.default, (a32, b32, *tp, None, None, None, "mxfp8")),
        "all_gather_weight_matmul": (ops.all_gather_weight_matmul.default, (a3, b, *tp)),
        "all_gather_weight_matmul fp8": (ops.all_gather_weight_matmul.default, (a3, b, *tp, None, "rowwise")),
        "all_gather_weight_matmul fp8 grads": (ops.all_gather_weight_matmul.default,
                                               (a3, b, *tp, None, "tensorwise+grads")),
        "all_gather_weight_matmul b_fp8": (ops.all_gather_weight_matmul.default,
                                           (a3, b, *tp, quantize_shard(b.detach(), "rowwise"), "rowwise")),
        "all_reduce": (ops.all_reduce.default, (a3, "", None, "opcheck")),
        "all_gather_last_dim": (ops.all_gather_last_dim.default, (a3, "", None, "opcheck")),
        "moe_dispatch": (ops.moe_dispatch.default, (x, idx, w1, E, "", "symm", "", None, "11", "")),
        "moe_dispatch fp8": (ops.moe_dispatch.default, (x, idx, w1, E, "", "symm", "", None, "11", "rowwise")),
    }
    h, _, key = ops.moe_dispatch(x.detach(), idx, w1.detach(), E, "", "symm", "", None, "00", "")
    h = h.detach().requires_grad_()
    cases["moe_combine"] = (ops.moe_combine.default, (h, w2, tw, key, "symm", "", None, "111"))
    out = opcheck_all(cases)
    library.RECENT.clear()
    return out


def opcheck_all(cases: dict[str, tuple]) -> dict[str, str]:
    """``torch.library.opcheck`` (schema, autograd registration, fake) of each ``name: (op, args)``: "ok" or the
    error, per op. With fp8 inputs the schema check is left out: its mutation check multiplies the inputs, which
    torch does not do for fp8 on CPU (``mul_cpu_reduced_float``), whatever the op."""
    out = {}
    for name, (op, args) in cases.items():
        fp8 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn
                  for x in args for t in (x if isinstance(x, list) else [x]))
        try:
            torch.library.opcheck(op, args, test_utils=(*(() if fp8 else ("test_schema",)),
                                                        "test_autograd_registration", "test_faketensor"))
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per op
            out[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


# ----------------------------------------------------------------------------------------------
# MoE with a fixed bound (max_tokens_per_rank): static shapes, no data-dependent size anywhere
# ----------------------------------------------------------------------------------------------
