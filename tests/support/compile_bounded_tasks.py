"""Rank tasks of the torch.compile tests of the MoE ops with a token bound (`max_tokens_per_rank`): static
shapes, no unbacked size, one graph; eager against compiled as in `tests.support.compile_tasks`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .compile_tasks import _draw, eager_vs_compiled, module_eager_vs_compiled, moe_inputs, opcheck_all


def _static_shapes(fn: Callable, inputs: tuple) -> dict[str, Any]:
    """All WITHOUT ``capture_dynamic_output_shape_ops``: the graph breaks `torch._dynamo.explain` counts; the
    symbolic sizes in the graph captured with ``fullgraph=True`` (none: every tensor has a static shape);
    the graphs and ops captured without ``fullgraph`` (a data-dependent size there is a graph break that
    explain does not count in torch 2.13, but the first graph then holds fewer ops)."""
    import torch._dynamo

    full, partial = [], []

    def keeper(into: list) -> Callable:
        def keep(gm, example_inputs):
            into.append(gm)
            return gm.forward

        return keep

    def ops(graphs: list) -> int:
        return sum(node.op == "call_function" for gm in graphs for node in gm.graph.nodes)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False):
        breaks = torch._dynamo.explain(fn)(*inputs).graph_break_count
        torch._dynamo.reset()
        torch.compile(fn, backend=keeper(full), fullgraph=True)(*inputs)
        torch._dynamo.reset()
        torch.compile(fn, backend=keeper(partial))(*inputs)
    torch._dynamo.reset()
    values = [(node, node.meta.get("example_value")) for gm in full for node in gm.graph.nodes]
    tensors = [(node, v) for node, v in values if isinstance(v, torch.Tensor)]
    symbolic = [str(node) for node, v in tensors if not all(isinstance(d, int) for d in v.shape)]
    return {"static_breaks": breaks, "symbolic": symbolic, "graphs": len(full), "tensors": len(tensors),
            "ops": ops(full), "graphs_without_fullgraph": len(partial), "ops_without_fullgraph": ops(partial)}


def _dynamic_control(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    """`_static_shapes` of the unbounded layer: its data-dependent row count shows as symbolic sizes (the
    check can tell the difference; explain's break count alone cannot: a custom op's dynamic size needs no
    ``capture_dynamic_output_shape_ops``)."""
    import overlap

    x, idx, w1, w2, tw, E = moe_inputs(rank, world_size, seed)

    def layer(x, w1, w2, tw):
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy="symm")
        return overlap.moe.grouped_matmul_combine(h, w2, tw, handle, strategy="symm")

    return _static_shapes(layer, (x, w1, w2, tw))


def moe_bounded(rank: int, world_size: int, seed: int, strategies: tuple[str, ...], backend: str = "aot_eager") -> list:
    """The MoE layer with ``max_tokens_per_rank`` (a bias on every expert row: the padding rows turn nonzero
    and must not count; the handle's count tensors read in the graph): static shapes, compiled against eager.
    One rank has 0 tokens at W=3."""
    import torch.nn.functional as Fn

    import overlap

    out = []
    for strategy in strategies:
        x, idx, w1, w2, tw, E = moe_inputs(rank, world_size, seed, tokens=0 if rank == 2 else None)
        bias = torch.randn(w1.shape[2], generator=_draw(seed + 1, rank)).requires_grad_()
        plain = "symm" if strategy == "fused" else strategy
        bound = 3 + 2 * world_size

        def layer(x, w1, w2, tw, bias, idx=idx, E=E, strategy=strategy, plain=plain, bound=bound):
            h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy=strategy,
                                                            max_tokens_per_rank=bound)
            y = overlap.moe.grouped_matmul_combine(Fn.gelu(h) + bias, w2, tw, handle, strategy=strategy)
            rows, handle2 = overlap.moe.dispatch(x, idx, E, strategy=plain, max_tokens_per_rank=bound)
            same = handle.tokens_per_expert.sum() == handle2.num_recv  # the count tensors, in the graph
            return y * same + overlap.moe.combine(rows * 2.0 + 1.0, tw, handle2, strategy=plain)

        inputs = (x, w1, w2, tw, bias)
        result = eager_vs_compiled(layer, inputs, seed, backend=backend, explain=False)
        if backend == "aot_eager":
            result.update(_static_shapes(layer, inputs))
        out.append((strategy, result))
    if backend == "aot_eager":
        out.append(("unbounded control", _dynamic_control(rank, world_size, seed)))
    return out


def moe_module_bounded(rank: int, world_size: int, seed: int, strategy: str) -> dict[str, Any]:
    """`overlap.nn.ExpertParallelMLP(max_tokens_per_rank=...)` compiled whole, static shapes, against eager."""
    from overlap.nn import ExpertParallelMLP

    torch.manual_seed(seed)
    mlp = ExpertParallelMLP(hidden_size=8, ffn_hidden_size=6, num_experts=2 * world_size, top_k=2,
                            activation="silu_glu", strategy=strategy, max_tokens_per_rank=2 * (3 + world_size))
    x = torch.randn(3 + rank, 2, 8, generator=_draw(seed, rank))
    result = module_eager_vs_compiled(mlp, x, seed)
    result.update(_static_shapes(mlp, (x,)))
    return result


def moe_bounded_order(rank: int, world_size: int, seed: int, backend: str) -> dict[str, Any]:
    """A bounded dispatch whose result is unused, then a TP op: compiled, both run, in the program's order
    (the bounded dispatch is an ordered effect; the unbounded one is not)."""
    import torch._dynamo
    from torch._higher_order_ops.effects import _get_effect

    import overlap
    from overlap.ops import library

    x, idx, w1, _, _, E = moe_inputs(rank, world_size, seed)
    x = x.detach()
    b = torch.randn(8, 5, generator=_draw(seed, rank))

    def two_calls(x, b):
        overlap.moe.dispatch(x, idx, E, strategy="symm", max_tokens_per_rank=8)  # unused: still runs, first
        return overlap.matmul_all_reduce(x[:3], b, strategy="pipelined")  # (3 rows on every rank)

    torch._dynamo.reset()
    library.RECENT.clear()
    want = two_calls(x, b)
    eager = list(library.RECENT)
    compiled_fn = torch.compile(two_calls, backend=backend, fullgraph=True)
    compiled_fn(x, b)
    library.RECENT.clear()
    got = compiled_fn(x, b)
    torch._dynamo.reset()
    effects = [_get_effect(torch.ops.overlap.moe_dispatch_bounded.default) is not None,
               _get_effect(torch.ops.overlap.moe_dispatch.default) is not None]
    return {"eager": eager, "compiled": list(library.RECENT), "bitwise": torch.equal(got, want), "effects": effects}


def bounded_opchecks(rank: int, world_size: int, seed: int) -> dict[str, str]:
    """`torch.library.opcheck` (schema, fake against real, autograd registration) on the bounded dispatch, both
    forms, and on the combine of its padded rows."""
    from overlap.ops.moe import combine, dispatch  # noqa: F401  (each module defines its custom ops)

    ops = torch.ops.overlap
    x, idx, w1, w2, tw, E = moe_inputs(rank, world_size, seed)
    bound = 3 + 2 * world_size
    cases = {
        "grouped": (ops.moe_dispatch_bounded.default, (x, idx, w1, E, bound, "", "symm", "", None, "11", "")),
        "grouped fp8": (ops.moe_dispatch_bounded.default, (x, idx, w1, E, bound, "", "symm", "", None, "11",
                                                           "rowwise")),
        "plain": (ops.moe_dispatch_bounded.default, (x, idx, None, E, bound, "", "pipelined", "", None, "1", "")),
    }
    h, _, key, *_ = ops.moe_dispatch_bounded(x.detach(), idx, w1.detach(), E, bound, "", "symm", "", None, "00", "")
    cases["combine"] = (ops.moe_combine.default, (h.detach().requires_grad_(), w2, tw, key, "symm", "", None, "111"))
    return opcheck_all(cases)
