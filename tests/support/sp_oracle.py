"""The sequence-parallel ops' float64 oracle and the rank tasks that check them (tests/ops/test_sequence_parallel.py).

Every rank draws its own sequence shard (and output gradients) from ``(seed, name, rank)`` and the shared weights
from ``(seed, name)``, so any rank rebuilds the whole sequence: the oracle is the unparallelized layer in float64.

* ``matmul_all_to_all``: rank ``r`` gets ``(X @ w_t)[:, heads of r]`` for each weight ``t`` (``X`` every shard in
  rank order along the sequence); its input gradient is ``G_t[shard r] @ w_t.T`` summed over ``t`` (``G_t`` every
  rank's output gradient placed at its heads), its weight gradient ``x_r.T @ G_t[shard r]``.
* ``all_to_all_matmul``: rank ``r`` gets ``C[shard r] @ w_o`` (``C`` every rank's ``ctx`` placed at its heads); its
  ``ctx`` gradient is ``g_q @ w_o[rows of r].T`` at shard ``q``, its weight gradient ``C[shard r].T @ g_r``.

The magnitudes ``S`` behind each element (the rounding bound of `tp_oracle.check_fp32`) are the same products of
the inputs' absolute values.
"""

from __future__ import annotations

import zlib

import torch

from tests.support.tp_oracle import check_fp32, check_low_precision

MA2A, A2AM = "matmul_all_to_all", "all_to_all_matmul"


def _draw(seed: int, name: str, rank: int, shape, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 131 + rank + 7) % 2**63)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _at(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` with its sequence dim `d` first (float64 oracle tensors: any layout)."""
    return t.movedim(d, 0)


def _back(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.movedim(0, d)


def shard_shape(case: dict, W: int, d: int, features: int, whole: bool) -> list[int]:
    """The activation's shape: ``[s/W (or s), b, f]`` with the sequence moved to `d`."""
    s = case["s_per"] * (W if whole else 1)
    shape = [s, *case["batch"], features]
    return list(_back(torch.empty(shape), d).shape)


def inputs_ma2a(seed: int, W: int, case: dict, d: int):
    """Every rank's ``x``, the shared weights and every rank's output gradients (float64)."""
    h, heads, hd = case["h"], [n * W for n in case["heads"]], case["head_dim"]
    xs = [_draw(seed, "x", q, shard_shape(case, W, d, h, False)) for q in range(W)]
    ws = [_draw(seed, f"w{t}", 0, (h, n * e), h**-0.5) for t, (n, e) in enumerate(zip(heads, hd, strict=True))]
    gs = [[_draw(seed, f"g{t}", q, shard_shape(case, W, d, n * e // W, True)) for t, (n, e) in
           enumerate(zip(heads, hd, strict=True))] for q in range(W)]
    return xs, ws, gs


def oracle_ma2a(xs, ws, gs, r: int, d: int):
    """``(outs, grad_x, grad_ws)`` of rank `r`."""
    W = len(xs)
    X = torch.cat([_at(x, d) for x in xs])  # [s, b..., h]
    m = _at(xs[0], d).shape[0]
    shard = slice(r * m, (r + 1) * m)
    outs, grad_x, grad_ws = [], 0, []
    for t, w in enumerate(ws):
        c = w.shape[1] // W
        outs.append(_back((X @ w)[..., r * c : (r + 1) * c], d))
        G = torch.cat([_at(g[t], d) for g in gs], dim=-1)  # [s, b..., N]: rank q's gradient at its heads
        grad_x = grad_x + G[shard] @ w.t()
        x_r = _at(xs[r], d).reshape(-1, w.shape[0])
        grad_ws.append(x_r.t() @ G[shard].reshape(-1, w.shape[1]))
    return outs, _back(grad_x, d), grad_ws


def inputs_a2am(seed: int, W: int, case: dict, d: int):
    """Every rank's ``ctx``, the shared ``w_o`` and every rank's output gradient (float64)."""
    c, n = case["c"], case["n"]
    cs = [_draw(seed, "ctx", q, shard_shape(case, W, d, c, True)) for q in range(W)]
    w_o = _draw(seed, "w_o", 0, (W * c, n), (W * c) ** -0.5)
    gs = [_draw(seed, "g", q, shard_shape(case, W, d, n, False)) for q in range(W)]
    return cs, w_o, gs


def oracle_a2am(cs, w_o, gs, r: int, d: int):
    """``([out], grad_ctx, [grad_w_o])`` of rank `r`."""
    W = len(cs)
    C = torch.cat([_at(ctx, d) for ctx in cs], dim=-1)  # [s, b..., W*c]: every rank's heads
    m = C.shape[0] // W
    shard = slice(r * m, (r + 1) * m)
    c = cs[0].shape[-1]
    out = _back(C[shard] @ w_o, d)
    grad_ctx = torch.cat([_at(g, d) @ w_o[r * c : (r + 1) * c].t() for g in gs])  # shard q from rank q's g
    g_r = _at(gs[r], d)
    grad_w = C[shard].reshape(-1, W * c).t() @ g_r.reshape(-1, w_o.shape[1])
    return [out], _back(grad_ctx, d), [grad_w]


def _rounded(ts: list[torch.Tensor], dtype) -> list[torch.Tensor]:
    """The float64 values of `ts` as the op sees them: rounded to `dtype` (the oracle multiplies those exactly)."""
    return [t.to(dtype).double() for t in ts]


def _flat(outs, grad_x, grad_ws) -> list[torch.Tensor]:
    return [*outs, grad_x, *grad_ws]


def run_ma2a(x, ws, gs, heads, d, strategy, group=None):
    """One forward and backward of `overlap.matmul_all_to_all` on leaves made from `x` and `ws`: outputs, grads."""
    import overlap

    x = x.detach().clone().requires_grad_(True)
    ws = [w.detach().clone().requires_grad_(True) for w in ws]
    one = len(ws) == 1
    ys = overlap.matmul_all_to_all(x, ws[0] if one else ws, heads=heads[0] if one else heads, seq_dim=d,
                                   group=group, strategy=strategy)
    ys = [ys] if one else ys
    torch.autograd.backward(ys, gs)
    return [y.detach() for y in ys], x.grad, [w.grad for w in ws]


def run_a2am(ctx, w_o, g, d, strategy, group=None):
    import overlap

    ctx = ctx.detach().clone().requires_grad_(True)
    w_o = w_o.detach().clone().requires_grad_(True)
    y = overlap.all_to_all_matmul(ctx, w_o, seq_dim=d, group=group, strategy=strategy)
    y.backward(g)
    return [y.detach()], ctx.grad, [w_o.grad]


def check_case(rank: int, world_size: int, op: str, strategy: str, dtype, seed: int, case: dict, d: int) -> None:
    """One case on this rank: `strategy` against the float64 oracle (fp32: `check_fp32`; 16-bit: with
    ``reference`` within the rounding bound, `check_low_precision`), forward and every gradient."""
    W, r = world_size, rank
    if op == MA2A:
        xs, ws, gs = inputs_ma2a(seed, W, case, d)
        xs, ws, gs = _rounded(xs, dtype), _rounded(ws, dtype), [_rounded(g, dtype) for g in gs]
        want = _flat(*oracle_ma2a(xs, ws, gs, r, d))
        scale = _flat(*oracle_ma2a([x.abs() for x in xs], [w.abs() for w in ws], [[g.abs() for g in q] for q in gs],
                                   r, d))

        def run(strat):
            return _flat(*run_ma2a(xs[r].to(dtype), [w.to(dtype) for w in ws], [g.to(dtype) for g in gs[r]],
                                   [n * W for n in case["heads"]], d, strat))
        labels = [f"out{t}" for t in range(len(ws))] + ["grad_x"] + [f"grad_w{t}" for t in range(len(ws))]
    else:
        cs, w_o, gs = inputs_a2am(seed, W, case, d)
        cs, w_o, gs = _rounded(cs, dtype), _rounded([w_o], dtype)[0], _rounded(gs, dtype)
        want = _flat(*oracle_a2am(cs, w_o, gs, r, d))
        scale = _flat(*oracle_a2am([c.abs() for c in cs], w_o.abs(), [g.abs() for g in gs], r, d))

        def run(strat):
            return _flat(*run_a2am(cs[r].to(dtype), w_o.to(dtype), gs[r].to(dtype), d, strat))
        labels = ["out", "grad_ctx", "grad_w_o"]
    got = run(strategy)
    where = f"{op} {strategy} {dtype} W={W} rank {r} case {case} seq_dim={d} seed {seed}"
    if dtype == torch.float32:
        check_fp32(where, got, want, scale, W, labels=labels)
    elif dtype == torch.float64:
        for label, x, y in zip(labels, got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=f"{where}: {label}")
    else:
        check_low_precision(where, got, run("reference"), want, scale, dtype, W, labels=labels)


#: (op, case): shards of 1-3 positions, 2-D and 3-D activations, one weight and GQA's three (head counts are
#: multiples of the world size: ``heads`` times W), odd widths
CASES = [
    (MA2A, {"s_per": 3, "batch": (2,), "h": 10, "heads": (2,), "head_dim": (3,)}),
    (MA2A, {"s_per": 2, "batch": (), "h": 8, "heads": (4, 1, 1), "head_dim": (4, 4, 6)}),
    (MA2A, {"s_per": 1, "batch": (3,), "h": 16, "heads": (2, 1, 1), "head_dim": (5, 5, 5)}),
    (A2AM, {"s_per": 3, "batch": (2,), "c": 6, "n": 10}),
    (A2AM, {"s_per": 1, "batch": (), "c": 4, "n": 7}),
    (A2AM, {"s_per": 2, "batch": (3,), "c": 5, "n": 9}),
]


def check_cases(rank: int, world_size: int, strategy: str, dtype, seed: int) -> int:
    """Every case of `CASES` on this rank, sequence first and (3-D ones) batch-first; returns how many ran."""
    done = 0
    for i, (op, case) in enumerate(CASES):
        for d in (0, 1) if case["batch"] else (0,):
            check_case(rank, world_size, op, strategy, dtype, seed + i, case, d)
            done += 1
    return done


def count_cases() -> int:
    return sum(2 if case["batch"] else 1 for _, case in CASES)


def bad_inputs(rank: int, world_size: int) -> list[tuple[str, str]]:
    """Bad calls: rank 1 alone with a wrong activation (it raises ValueError, its peers OverlapMismatchError at once),
    then every rank with heads not dividing the world size, a sequence not dividing it, ``hierarchical`` forced (not
    implemented for this family). Returns ``(exception type, message)`` per call."""
    import overlap
    from tests.support.tp_oracle import expect_error

    W = world_size
    x, w = torch.randn(2, 3, 8), torch.randn(8, 4 * W)
    wrong = torch.randn(2, 3, 9) if rank == 1 else x
    seen = [expect_error(overlap.matmul_all_to_all, wrong, w, heads=W, strategy="pipelined", timeout=60)]
    seen.append(expect_error(overlap.matmul_all_to_all, x, torch.randn(8, 2 * (W + 1)), heads=W + 1, timeout=60))
    seen.append(expect_error(overlap.all_to_all_matmul, torch.randn(W + 1, 2, 3), torch.randn(3 * W, 5), timeout=60))
    seen.append(expect_error(overlap.all_to_all_matmul, torch.randn(W, 2, 3), torch.randn(3 * W, 5),
                             strategy="hierarchical", timeout=60))
    seen.append(expect_error(overlap.matmul_all_to_all, x, [w, w], heads=W, timeout=60))
    return [(kind, message, secs) for kind, message, secs in seen]


def workload_rows(rank: int, world_size: int, seed: int) -> int:
    """Each sequence-parallel op's workload (`overlap.workloads`): its call on every strategy and its plain-torch row
    against its oracle, forward and backward."""
    import dataclasses

    from overlap.plans import OPS, Problem
    from overlap.workloads import SeededDraw, workload

    done = 0
    for op in (n for n, spec in OPS.items() if spec.family == "sp"):
        work = workload(op)
        p = Problem(op, 3, 4 * world_size, 2 * world_size, "float64", True)
        draw = SeededDraw(seed, rank, "cpu", torch.float64)
        every = [work.inputs(p, world_size, draw.for_rank(q)) for q in range(world_size)]
        want = [e.value for e in work.oracle(p, every, rank)]
        runs = [*(s for s in OPS[op].strategies if s != "fused"), "torch"]  # (fused takes no float64)
        for how in runs:
            leaves = tuple(t.clone().requires_grad_(True) for t in every[rank].leaves)
            if how == "torch":
                out = work.plain_torch(None)(*leaves)
            else:
                out = work.call(dataclasses.replace(every[rank], leaves=leaves), None, strategy=how)
            out.backward(every[rank].grad_out)
            for label, got, exp in zip(("out", "grad_a", "grad_b"), (out, *(t.grad for t in leaves)), want,
                                       strict=True):
                torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10, msg=f"{op} rank {rank}: {label}")
            done += 1
    return done


def compiled_layer(rank: int, world_size: int, seed: int) -> bool:
    """Both ops in one function compiled whole (``fullgraph=True``, aot_eager: their fakes and registered autograd)
    give eager's output and input gradient, bitwise (the same calls in the same plan)."""
    import overlap

    W = world_size
    x = _draw(seed, "x", rank, (3, 2, 8)).float().requires_grad_(True)
    wq, wk = (_draw(seed, n, 0, (8, 4 * W)).float().requires_grad_(True) for n in ("wq", "wk"))
    wo = _draw(seed, "wo", 0, (4 * W, 6)).float().requires_grad_(True)

    def layer(x):
        q, k = overlap.matmul_all_to_all(x, [wq, wk], heads=[2 * W, W], strategy="pipelined")
        return overlap.all_to_all_matmul(q * k, wo, strategy="pipelined")

    want = layer(x)
    want.sum().backward()
    grads = [t.grad.clone() for t in (x, wq, wk, wo)]
    for t in (x, wq, wk, wo):
        t.grad = None
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    got.sum().backward()
    return torch.equal(got, want) and all(torch.equal(t.grad, g) for t, g in zip((x, wq, wk, wo), grads, strict=True))


def silent_peer(rank: int, world_size: int, op: str, strategy: str):
    """A healthy call of `op`, then rank 1 stays in its calls but sends nothing: the others' waits end at the
    call's deadline (2 s) with `OverlapTimeout`. Returns ``(exception type, message, seconds)``."""
    import time

    import overlap
    from tests.support.tp_oracle import expect_error, silence

    W = world_size
    if op == MA2A:
        args, kwargs = (torch.randn(2, 3, 8), torch.randn(8, 2 * W)), {"heads": W}
    else:
        args, kwargs = (torch.randn(2 * W, 3, 4), torch.randn(4 * W, 5)), {}
    fn = getattr(overlap, op)
    fn(*args, strategy=strategy, **kwargs)  # the heap exists, everyone healthy
    silence(1, rank)
    result = expect_error(fn, *args, strategy=strategy, timeout=2.0, **kwargs)
    if rank == 1:
        time.sleep(3.0)  # stay alive until the others have timed out
    return result


def varying_lengths(rank: int, world_size: int, strategy: str) -> list[int]:
    """Calls of both ops with sequence shards of 6, 2, 4 and 6 positions (a long-context batch's varying lengths):
    each matches the float64 layer; returns the heap's slot size after each call (growth to the longest, no
    re-allocation after)."""
    import overlap
    from overlap import symm

    W, sizes = world_size, []
    w, w_o = _draw(1, "w", 0, (8, 4 * W)), _draw(1, "w_o", 0, (4 * W, 5))  # (the same on every rank)
    for s_per in (6, 2, 4, 6):
        xs = [_draw(s_per, "x", q, (s_per, 2, 8)) for q in range(W)]
        q = overlap.matmul_all_to_all(xs[rank].float(), w.float(), heads=W, strategy=strategy)
        full = torch.cat(xs) @ w  # every rank's heads of every position
        torch.testing.assert_close(q.double(), full[..., rank * 4 : (rank + 1) * 4], rtol=1e-4, atol=1e-4)
        y = overlap.all_to_all_matmul(full[..., rank * 4 : (rank + 1) * 4].float(), w_o.float(), strategy=strategy)
        torch.testing.assert_close(y.double(), full[rank * s_per : (rank + 1) * s_per] @ w_o, rtol=1e-4, atol=1e-4)
        sizes.append(symm.heap_if_open().slot_bytes)
    return sizes
