"""The overlapped backward of the tensor-parallel ops, on CPU ranks.

* bitwise determinism of forward and backward, every op and strategy;
* a 2-layer Megatron MLP (column-parallel `all_gather_matmul`, GELU, row-parallel
  `matmul_reduce_scatter`) with two micro-batches, the forward of one layer running in the middle
  of another layer's backward, against the same schedule on ``reference`` and a float64 emulation;
* all three ops mixed back to back on one group, some backwards deferred behind later forwards;
* the peak memory the backward allocates, overlapped strategies against ``reference`` (printed).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.memory import peak_allocated
from tests.support.tp_oracle import (
    AGM,
    MAR,
    MRS,
    assert_bitwise,
    b_of,
    call,
    check_fp32,
    compare,
    forward_backward,
    name_of,
    oracle,
)

# ----------------------------------------------------------------------------------------------
# (a) Bitwise determinism: same inputs and plan, same bits, also after other calls on the group
# ----------------------------------------------------------------------------------------------


def plans_for(op: str) -> list:
    """Every strategy, chunked plans, and the one-shot variants of matmul_all_reduce."""
    import overlap

    plans = ["reference", "pipelined", "symm", "fused", "auto"]
    plans += [overlap.Plan("pipelined", num_chunks={"shm": 3}), overlap.Plan("symm", num_chunks={"shm": 2})]
    if op == MAR:
        plans += [overlap.Plan(s, one_shot=True) for s in ("pipelined", "symm", "fused")]
    return plans


def determinism(rank, world_size, seed, op, dtype):
    done = []
    case = (6 if op != MRS else 2, (2,), 33, 10, "weight.t()")
    other = (3, (), 8, 5, "contiguous")  # a different call in between (another epoch, heap slot, shape)
    for i, plan in enumerate(plans_for(op)):
        inputs, _ = oracle(op, seed + i, world_size, case, dtype)
        a, param, g = inputs[rank]
        first = forward_backward(op, plan, a, param, case[-1], g)
        again = forward_backward(op, plan, a, param, case[-1], g)
        between, _ = oracle(MRS, seed, world_size, other, dtype)
        forward_backward(MRS, "symm", *between[rank][:2], other[-1], between[rank][2])
        third = forward_backward(op, plan, a, param, case[-1], g)
        ctx = f"{op} rank {rank}/{world_size} {name_of(plan)} {dtype} a={tuple(a.shape)} seed={seed + i}"
        assert_bitwise(ctx + " (second run)", again, first)
        assert_bitwise(ctx + " (after another call)", third, first)
        done.append(name_of(plan))
    return done


@pytest.mark.exact
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", [AGM, MRS, MAR])
def test_bitwise_repeatable(pools, seed, op, dtype):
    results = pools(3).run(determinism, seed, op, dtype, timeout=120)
    assert all(r == results[0] and len(r) == len(results[0]) for r in results), results


# ----------------------------------------------------------------------------------------------
# (b) A 2-layer Megatron MLP, two micro-batches, a forward in the middle of a backward
# ----------------------------------------------------------------------------------------------

# Per rank: x [s, batch, hidden] (its slice of the sequence), w1 [ffn, hidden] (a column shard of
# the first weight), w2 [hidden, ffn] (a row shard of the second weight); ffn is per rank.
MLP = dict(s=4, batch=2, hidden=16, ffn=8)


def mlp_params(seed: int, rank: int, dtype):
    """This rank's leaves: micro-batch inputs x1, x2; layers A and B (w1, w2 each); output grads g1, g2."""
    s, batch, hidden, ffn = MLP["s"], MLP["batch"], MLP["hidden"], MLP["ffn"]
    gen = torch.Generator().manual_seed(seed * 1009 + rank)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return dict(
        x1=randn(s, batch, hidden),
        x2=randn(s, batch, hidden),
        w1a=randn(ffn, hidden, scale=hidden**-0.5),
        w2a=randn(hidden, ffn, scale=ffn**-0.5),
        w1b=randn(ffn, hidden, scale=hidden**-0.5),
        w2b=randn(hidden, ffn, scale=ffn**-0.5),
        g1=randn(s, batch, hidden),
        g2=randn(s, batch, hidden),
    )


def mlp_layer(x, w1, w2, plan):
    """Column-parallel GEMM on the gathered sequence, GELU, row-parallel GEMM reduce-scattered."""
    act = torch.nn.functional.gelu(call(AGM, x, w1.t(), plan))
    return call(MRS, act, w2.t(), plan), act


def mlp_schedule(p: dict, plan_a, plan_b):
    """Micro-batch 1 through layers A, B; micro-batch 2 through A; then micro-batch 1's backward,
    during which (between layer A's reduce-scatter backward and its gather backward) micro-batch 2
    runs its forward through layer B; then micro-batch 2's backward."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in p.items() if k[0] in "xw"}
    h1, act1 = mlp_layer(leaves["x1"], leaves["w1a"], leaves["w2a"], plan_a)
    out1, _ = mlp_layer(h1, leaves["w1b"], leaves["w2b"], plan_b)
    h2, _ = mlp_layer(leaves["x2"], leaves["w1a"], leaves["w2a"], plan_a)
    box = {}

    def forward_in_backward(grad):
        with torch.enable_grad():
            box["out2"], _ = mlp_layer(h2, leaves["w1b"], leaves["w2b"], plan_b)
        return grad

    act1.register_hook(forward_in_backward)
    out1.backward(p["g1"])
    assert "out2" in box, "the hook did not run during the backward"
    box["out2"].backward(p["g2"])
    result = {"out1": out1.detach(), "out2": box["out2"].detach()}
    result.update({f"grad_{k}": v.grad for k, v in leaves.items()})
    return result


def mlp_oracle(seed: int, world_size: int, dtype, rank: int) -> dict:
    """The same two micro-batches on every rank's shards at once, in float64, with plain autograd."""
    ps = [{k: v.double().requires_grad_() for k, v in mlp_params(seed, r, dtype).items()} for r in range(world_size)]
    s = MLP["s"]

    def layer(xs, w1, w2):
        x = torch.cat(xs)
        z = sum(torch.nn.functional.gelu(x @ p[w1].t()) @ p[w2].t() for p in ps)
        return [z[r * s : (r + 1) * s] for r in range(world_size)]

    outs = {}
    loss = 0
    for mb in ("1", "2"):
        h = layer([p["x" + mb] for p in ps], "w1a", "w2a")
        outs[mb] = layer(h, "w1b", "w2b")
        loss = loss + sum((o * p["g" + mb]).sum() for o, p in zip(outs[mb], ps))
    loss.backward()
    want = {"out1": outs["1"][rank].detach(), "out2": outs["2"][rank].detach()}
    want.update({f"grad_{k}": v.grad for k, v in ps[rank].items() if k[0] in "xw"})
    return want


def mlp_task(rank, world_size, seed):
    import overlap

    plans = [(p, p) for p in ("pipelined", "symm", "fused", "auto")] + [
        (overlap.Plan("pipelined", num_chunks={"shm": 3}), overlap.Plan("symm", num_chunks={"shm": 2})),
        ("symm", "pipelined"),
    ]
    p = mlp_params(seed, rank, torch.float32)
    want = mlp_oracle(seed, world_size, torch.float32, rank)
    ref = mlp_schedule(p, "reference", "reference")
    names = list(want)
    compare(
        f"mlp rank {rank}/{world_size} reference vs float64 seed={seed}",
        [ref[k] for k in names],
        [want[k] for k in names],
        torch.float32,
        labels=names,
    )
    done = []
    for plan_a, plan_b in plans:
        got = mlp_schedule(p, plan_a, plan_b)
        ctx = f"mlp rank {rank}/{world_size} A={name_of(plan_a)} B={name_of(plan_b)} seed={seed}"
        compare(ctx + " vs reference", [got[k] for k in names], [ref[k] for k in names], torch.float32, labels=names)
        compare(ctx + " vs float64", [got[k] for k in names], [want[k] for k in names], torch.float32, labels=names)
        done.append(ctx)
    return len(done)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_mlp_forward_during_backward(pools, seed, world_size):
    assert pools(world_size).run(mlp_task, seed, timeout=180) == [6] * world_size


# ----------------------------------------------------------------------------------------------
# (c) All ops mixed back to back on one group, backwards deferred behind later forwards
# ----------------------------------------------------------------------------------------------


def mixed_back_to_back(rank, world_size, seed, calls):
    rng = random.Random(seed)  # the same sequence of calls on every rank
    pending = []
    done = 0

    def finish(entry):
        ctx, y, a, param, layout, g, want, scale = entry
        y.backward(g)
        # against float64 with the rounding bound of long sums (k=100 on 4 ranks rounds past 1e-5)
        check_fp32(ctx, [y.detach(), a.grad, b_of(param.grad, layout)], want, scale, world_size)

    for i in range(calls):
        op = [AGM, MRS, MAR][i % 3]
        plan = rng.choice(plans_for(op))
        fused = name_of(plan).startswith("fused")
        rows = rng.choice([1, 2, 5] if fused else [1, 2, 5, 8, 17])
        k = rng.choice([8, 24] if fused else [8, 24, 100])
        case = (rows, rng.choice([(), (2,)]), k, rng.choice([5, 32]), rng.choice(["contiguous", "weight.t()"]))
        inputs, want = oracle(op, seed + i, world_size, case, torch.float32)
        _, scale = oracle(op, seed + i, world_size, case, torch.float32, magnitudes=True)
        a, param, g = inputs[rank]
        a, param = a.clone().requires_grad_(), param.clone().requires_grad_()
        y = call(op, a, b_of(param, case[-1]), plan)
        ctx = f"call {i}: {op} rank {rank}/{world_size} {name_of(plan)} a={tuple(a.shape)} case={case} seed={seed + i}"
        pending.append((ctx, y, a, param, case[-1], g, want[rank], scale[rank]))
        # Backwards run late and out of order: a later call's forward comes before this call's backward.
        while pending and rng.random() < 0.5:
            finish(pending.pop(rng.randrange(len(pending))))
            done += 1
    while pending:
        finish(pending.pop())
        done += 1
    return done


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_mixed_ops_back_to_back(pools, seed, world_size):
    calls = 18
    assert pools(world_size).run(mixed_back_to_back, seed, calls, timeout=240) == [calls] * world_size


# ----------------------------------------------------------------------------------------------
# (d) Peak memory allocated by the backward: overlapped strategies against reference
# ----------------------------------------------------------------------------------------------

MEMORY_CASES = {AGM: (256, (), 128, 256, "weight.t()"), MRS: (128, (), 256, 128, "weight.t()")}


def memory_task(rank, world_size, seed, op, strategies):
    case = MEMORY_CASES[op]
    inputs, want = oracle(op, seed, world_size, case, torch.float32)
    a, param, g = inputs[rank]
    figures = {}
    for strategy in strategies:
        forward_backward(op, strategy, a, param, case[-1], g)  # heap sized, first-call work done
        a_leaf, p_leaf = a.clone().requires_grad_(), param.clone().requires_grad_()
        y = call(op, a_leaf, b_of(p_leaf, case[-1]), strategy)
        peak, end = peak_allocated(lambda y=y: y.backward(g))
        ctx = f"{op} rank {rank}/{world_size} {strategy} a={tuple(a.shape)} seed={seed}"
        compare(
            ctx,
            [y.detach(), a_leaf.grad, b_of(p_leaf.grad, case[-1])],
            want[rank],
            torch.float32,
            tol=dict(rtol=1e-5, atol=1e-4),
        )
        figures[strategy] = (peak, end)
    from overlap import symm

    heap = symm.heap_for(None)  # preallocated symmetric memory, outside the allocator's figures
    figures["heap"] = (symm.NUM_SLOTS * heap.slot_bytes, 0)
    return figures


@pytest.mark.exact
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", [AGM, MRS])
def test_backward_peak_memory(pools, seed, op, world_size):
    strategies = ["reference", "pipelined", "symm"]
    results = pools(world_size).run(memory_task, seed, op, strategies, timeout=120)
    rows, mid, k, n, _ = MEMORY_CASES[op]
    print(
        f"\n[memory] {op} backward, W={world_size}, case rows={rows} k={k} n={n} fp32 "
        "(peak bytes allocated during backward, per rank; end = still held after it, the grads)"
    )
    slack = 64 * 1024
    for rank, figures in enumerate(results):
        ref_peak = figures["reference"][0]
        assert ref_peak > 0, f"rank {rank}: the profiler saw no allocation in the reference backward"
        for strategy in strategies:
            peak, end = figures[strategy]
            print(
                f"[memory]   rank {rank} {strategy:9s} peak {peak / 1024:8.1f} KiB  end {end / 1024:8.1f} KiB"
                f"  ({peak / ref_peak:.2f}x reference)"
            )
        print(
            f"[memory]   rank {rank} symmetric heap of the group (shared memory, all slots, sized by the largest "
            f"call so far; not in the figures above): {figures['heap'][0] / 1024:.1f} KiB"
        )
        for strategy in strategies[1:]:
            peak = figures[strategy][0]
            assert peak <= ref_peak * 1.1 + slack, (
                f"{op} W={world_size} rank {rank} {strategy}: backward peak {peak} B > 1.1 x reference "
                f"{ref_peak} B + {slack} B"
            )
