"""Several GPUs under torchrun (WORLD_SIZE > 1): every strategy of every op in `build_ops`
(`all_gather_matmul`, `matmul_reduce_scatter`, `matmul_all_reduce` two-shot and one-shot; the MoE ops:
``dispatch`` alone, ``dispatch`` + ``combine``, ``dispatch_grouped_matmul`` alone and followed by
``grouped_matmul_combine``, each MoE pair with one strategy) against ``reference``, forward and backward,
then timings of each strategy and of torch's own ``symm_mem.fused_all_gather_matmul`` where it exists.
With ``--cpu-smoke`` the same runs over gloo on the CPU at tiny sizes.

A check runs the op with `reference` once more in float64, and once in float64 on the inputs' absolute
values: the exact result and, for every output element, the sum of the magnitudes of the terms it adds
up. Both the strategy's and `reference`'s results must lie within the rounding bound that sum gives
(`gpu_check_common.compare_bound`): reductions round at different places in different strategies (NCCL
and gloo add 16-bit partials in 16 bits, the overlapped strategies in fp32), so a tolerance relative to
`reference` alone would fail where terms cancel. Every op is multilinear in its floating inputs (the MoE
cases apply no activation); integer inputs (``topk_idx``) are passed through as they are.

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_check_common import (
    BLOCK_RTOL,
    FP32_ACCUMULATE,
    UNIT_ROUNDOFF,
    Report,
    all_reduce_shapes,
    bench_shapes,
    compare,
    compare_bound,
    dtype_name,
    fmt_shape,
    moe_shapes,
    poll,
    row_parallel_shapes,
)

import overlap
from overlap import comm

# ==============================================================================================
# Several GPUs under torchrun: every op x strategy against `reference`, then timings
# ==============================================================================================


#: the strategies the GPU check runs: every one but ``hierarchical`` (groups spanning nodes; ``symm`` on one node)
STRATEGIES = tuple(s for s in overlap.STRATEGIES if s != "hierarchical")


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One fused op as the distributed checks see it. A new op is one more entry in `build_ops`."""

    fn: Callable[..., torch.Tensor]  # overlap.<op>(*inputs, strategy=..., timeout=...)
    inputs: Callable[[dict[str, int], torch.dtype, torch.device, int], tuple[torch.Tensor, ...]]  # + world size
    flops: Callable[[dict[str, int], int], float]  # (shape, world size) -> flops per rank
    check_shapes: tuple[dict[str, int], ...]
    smoke_shapes: tuple[dict[str, int], ...]  # CPU (gloo, interpreted fused): tiny
    bench_shapes: Callable[[int], list[tuple[str, dict[str, int]]]]  # world size -> labelled shapes
    native: Callable[[tuple[torch.Tensor, ...], Any], Callable[[], torch.Tensor] | str] | None = None
    strategies: tuple[str, ...] = STRATEGIES  # the plain MoE ops have no fused form


def _ag_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device,
               world_size: int) -> tuple[torch.Tensor, ...]:
    """all_gather_matmul and matmul_all_reduce: ``a`` is ``[m, k]``."""
    m, k, n = shape["m"], shape["k"], shape["n"]
    a = torch.randn(m, k, device=device, dtype=dtype) / math.sqrt(k)
    return a, torch.randn(n, k, device=device, dtype=dtype).t()  # b = w.t(), as a Megatron weight


def _rs_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device,
               world_size: int) -> tuple[torch.Tensor, ...]:
    """matmul_reduce_scatter: ``m`` is the rows of one rank's output, so ``a`` is ``[world_size * m, k]``."""
    return _ag_inputs({**shape, "m": world_size * shape["m"]}, dtype, device, world_size)


def _one_shot_all_reduce(a: torch.Tensor, b: torch.Tensor, strategy: str, timeout: float) -> torch.Tensor:
    """matmul_all_reduce's one-shot variant under `strategy` (``reference`` ignores the flag)."""
    return overlap.matmul_all_reduce(a, b, plan=overlap.Plan(strategy, one_shot=True), timeout=timeout)


def _torch_fused_all_gather_matmul(inputs: tuple[torch.Tensor, ...], group: Any) -> Callable[[], torch.Tensor] | str:
    """torch's own ``symm_mem.fused_all_gather_matmul`` on the same inputs, or why it cannot run."""
    import inspect

    a, b = inputs
    if a.device.type != "cuda":
        return "needs CUDA"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem.*
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory does not import: {exc}"
    op = getattr(torch.ops.symm_mem, "fused_all_gather_matmul", None)
    if op is None:
        return "torch.ops.symm_mem.fused_all_gather_matmul does not exist in this torch"
    py_fn = getattr(symm_mem, "_fused_all_gather_matmul", None)
    schema = op.default._schema
    signature = str(inspect.signature(py_fn)) if py_fn is not None else str(schema)
    known = {"A": a, "A_shard": a, "Bs": [b], "gather_dim": 0, "group_name": group.group_name, "return_A": False}
    args, kwargs = [], {}
    for arg in schema.arguments:
        if arg.name not in known:
            if arg.has_default_value():
                continue
            return f"unknown argument {arg.name!r} in {signature}"
        if arg.kwarg_only:
            kwargs[arg.name] = known[arg.name]
        else:
            args.append(known[arg.name])
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated in newer torch, still needed in older
            enable(group.group_name)
    return lambda: op(*args, **kwargs)[1][0]


def _moe_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device,
                world_size: int) -> dict[str, torch.Tensor]:
    """The MoE ops' inputs: ``x [T, H], topk_idx [T, K], scale [L], w1 [L, H, F], w2 [L, F, H],
    topk_weights [T, K]``.

    ``t`` tokens plus ``5 * (rank % 3)`` (uneven between ranks), ``h`` hidden, ``f`` the expert ffn, ``e``
    experts (rounded up to a multiple of the world size), top-``k``. With ``skew``: a ramp on the routing
    logits (uneven loads) and expert 1 never picked; else uniform random routing. ``w2`` is a transposed view
    (any strides are allowed); ``scale`` is a per-expert factor standing in for the plain ops' experts."""
    import torch.distributed as dist

    T, H, F, K = shape["t"] + 5 * (dist.get_rank() % 3), shape["h"], shape["f"], shape["k"]
    E = -(-shape["e"] // world_size) * world_size
    L = E // world_size
    logits = torch.randn(T, E, device=device)
    if shape.get("skew"):
        logits += torch.linspace(2.0, 0.0, E, device=device)
        logits[:, 1] = -math.inf
    topk_idx = torch.topk(logits, K, dim=1).indices
    x = torch.randn(T, H, device=device, dtype=dtype)
    scale = (torch.rand(L, device=device) + 0.5).to(dtype)
    w1 = (torch.randn(L, H, F, device=device) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(L, H, F, device=device) / math.sqrt(F)).to(dtype).transpose(1, 2)
    topk_weights = torch.softmax(torch.randn(T, K, device=device), dim=1).to(dtype)
    return {"x": x, "topk_idx": topk_idx, "scale": scale, "w1": w1, "w2": w2, "topk_weights": topk_weights}


def _num_experts(local: torch.Tensor) -> int:
    import torch.distributed as dist

    return local.shape[0] * dist.get_world_size()


def _per_row(scale: torch.Tensor, handle: Any) -> torch.Tensor:
    """``scale[e]`` for every row of local expert ``e`` (expert order), as a column."""
    counts = torch.tensor(handle.tokens_per_expert, device=scale.device)
    return scale.repeat_interleave(counts).unsqueeze(1)


def _moe_dispatch(x, topk_idx, scale, strategy: str, timeout: float) -> torch.Tensor:
    x_recv, handle = overlap.moe.dispatch(x, topk_idx, _num_experts(scale), strategy=strategy, timeout=timeout)
    return x_recv * _per_row(scale, handle)


def _moe_combine(x, topk_idx, scale, topk_weights, strategy: str, timeout: float) -> torch.Tensor:
    """dispatch, a per-expert scale, combine: both with `strategy`."""
    x_recv, handle = overlap.moe.dispatch(x, topk_idx, _num_experts(scale), strategy=strategy, timeout=timeout)
    return overlap.moe.combine(x_recv * _per_row(scale, handle), topk_weights, handle, strategy=strategy,
                               timeout=timeout)


def _moe_dispatch_mm(x, topk_idx, w1, strategy: str, timeout: float) -> torch.Tensor:
    return overlap.moe.dispatch_grouped_matmul(x, topk_idx, w1, _num_experts(w1), strategy=strategy,
                                               timeout=timeout)[0]


def _moe_mlp(x, topk_idx, w1, w2, topk_weights, strategy: str, timeout: float) -> torch.Tensor:
    """dispatch_grouped_matmul, then grouped_matmul_combine (no activation): both with `strategy`."""
    h, handle = overlap.moe.dispatch_grouped_matmul(x, topk_idx, w1, _num_experts(w1), strategy=strategy,
                                                    timeout=timeout)
    return overlap.moe.grouped_matmul_combine(h, w2, topk_weights, handle, strategy=strategy, timeout=timeout)


def _moe_case(fn: Callable[..., torch.Tensor], names: tuple[str, ...], gemms: int, fused: bool) -> OpCase:
    """A MoE op of the inputs `names` (of `_moe_inputs`); `gemms` expert GEMMs per routed pair (flops:
    ``2 * t * k * h * f`` each)."""
    return OpCase(
        fn=fn,
        inputs=lambda *args: tuple(_moe_inputs(*args)[n] for n in names),
        flops=lambda s, w: 2.0 * gemms * s["t"] * s["k"] * s["h"] * s["f"],
        check_shapes=({"t": 512, "h": 1024, "f": 768, "e": 16, "k": 2, "skew": 1},
                      {"t": 300, "h": 1000, "f": 300, "e": 8, "k": 3, "skew": 1}),
        smoke_shapes=({"t": 8, "h": 32, "f": 24, "e": 4, "k": 2, "skew": 1},),
        bench_shapes=moe_shapes,
        strategies=STRATEGIES if fused else tuple(s for s in STRATEGIES if s != "fused"),
    )


def build_ops() -> dict[str, OpCase]:
    return {
        "all_gather_matmul": OpCase(
            fn=overlap.all_gather_matmul,
            inputs=_ag_inputs,
            flops=lambda s, w: 2.0 * w * s["m"] * s["k"] * s["n"],
            check_shapes=({"m": 256, "k": 1024, "n": 768}, {"m": 100, "k": 1000, "n": 300}),
            smoke_shapes=({"m": 8, "k": 32, "n": 24},),
            bench_shapes=bench_shapes,
            native=_torch_fused_all_gather_matmul,
        ),
        "matmul_reduce_scatter": OpCase(
            fn=overlap.matmul_reduce_scatter,
            inputs=_rs_inputs,
            flops=lambda s, w: 2.0 * w * s["m"] * s["k"] * s["n"],
            check_shapes=({"m": 256, "k": 1024, "n": 768}, {"m": 100, "k": 1000, "n": 300}),
            smoke_shapes=({"m": 8, "k": 32, "n": 24},),
            bench_shapes=row_parallel_shapes,
        ),
        "matmul_all_reduce": OpCase(  # two-shot; rows that do not divide by the world size
            fn=overlap.matmul_all_reduce,
            inputs=_ag_inputs,
            flops=lambda s, w: 2.0 * s["m"] * s["k"] * s["n"],
            check_shapes=({"m": 1000, "k": 1024, "n": 768}, {"m": 100, "k": 1000, "n": 300}),
            smoke_shapes=({"m": 9, "k": 32, "n": 24},),
            bench_shapes=lambda tp: all_reduce_shapes(tp, one_shot=False),
        ),
        "matmul_all_reduce[one_shot]": OpCase(
            fn=_one_shot_all_reduce,
            inputs=_ag_inputs,
            flops=lambda s, w: 2.0 * s["m"] * s["k"] * s["n"],
            check_shapes=({"m": 128, "k": 1024, "n": 768}, {"m": 9, "k": 1000, "n": 300}),
            smoke_shapes=({"m": 9, "k": 32, "n": 24},),
            bench_shapes=lambda tp: all_reduce_shapes(tp, one_shot=True),
        ),
        "moe.dispatch": _moe_case(_moe_dispatch, ("x", "topk_idx", "scale"), gemms=0, fused=False),
        "moe.dispatch+combine": _moe_case(_moe_combine, ("x", "topk_idx", "scale", "topk_weights"), gemms=0,
                                          fused=False),
        "moe.dispatch_grouped_matmul": _moe_case(_moe_dispatch_mm, ("x", "topk_idx", "w1"), gemms=1, fused=True),
        "moe.dispatch_grouped_matmul+grouped_matmul_combine": _moe_case(
            _moe_mlp, ("x", "topk_idx", "w1", "w2", "topk_weights"), gemms=2, fused=True),
    }


class Dist:
    """This rank's view of the torchrun world, with bounded collectives for the checks' bookkeeping."""

    def __init__(self, rep: Report, timeout: float):
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.info = overlap.world.group_info(self.group)
        self.device = self.info.device
        self.cuda = self.device.type == "cuda"
        self.rep, self.timeout = rep, timeout
        self.broken = False  # after a failed call the group may be unusable: later sections skip

    def wait(self, work: Any, what: str) -> None:
        comm.wait_work(work, "gpu_check", self.rank, "any", what, self.timeout)

    def barrier(self) -> None:
        self.wait(self.dist.barrier(group=self.group, async_op=True), "barrier")

    def agree(self, ok: bool, err: float) -> tuple[bool, float]:
        """Every rank's verdict and worst error, so all ranks report the same thing."""
        t = torch.tensor([0.0 if ok else 1.0, err if math.isfinite(err) else math.inf], dtype=torch.float64,
                         device=self.device)
        self.wait(self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group, async_op=True), "agree")
        return t[0].item() == 0.0, t[1].item()

    def slowest(self, value: float) -> float:
        return self.agree(True, value)[1]

    def run(self, section: str, fn: Callable[[], None]) -> None:
        """Report.run, with the ranks agreeing on whether to run: a section one rank skips alone would
        leave the others waiting in its collectives."""
        if not self.rep.selected(section):
            return
        skip = "an earlier distributed failure may have left the group unusable" if self.broken else None
        if skip is None:
            try:
                if self.slowest(float(self.rep.over_time())) > 0:
                    skip = f"over --time-limit {self.rep.time_limit:.0f} s on some rank"
            except Exception as exc:  # noqa: BLE001 - a peer is gone
                self.broken, skip = True, f"ranks could not agree to start ({type(exc).__name__}: {exc})"
        if skip is not None:
            self.rep.run(section, fn, skip=skip)
        elif self.rep.run(section, fn, check_time=False):
            self.broken = True  # an exception escaped the section: peers may be stuck in its collectives

    def time_calls(self, fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
        """Median ms of `fn` over a fixed number of calls (do_bench picks its own count, which would
        differ between ranks and deadlock a collective)."""
        for _ in range(warmup):
            fn()
        self.barrier()
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        if not poll([pairs[-1][1]], self.timeout):
            raise RuntimeError(f"timed calls did not finish within {self.timeout} s")
        return statistics.median(s.elapsed_time(e) for s, e in pairs)


def dist_check(d: Dist, name: str, case: OpCase, shape: dict[str, int], strategy: str, dtype: torch.dtype) -> None:
    """`strategy` and `reference` against the float64 result on fresh inputs: the output and the gradients
    of every input, each within its rounding bound (see the module docstring)."""
    inputs = case.inputs(shape, dtype, d.device, d.world_size)
    floating = [i for i, t in enumerate(inputs) if t.is_floating_point()]  # topk_idx is passed as it is

    def forward_backward(strat: str, xs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in xs]
        y = case.fn(*leaves, strategy=strat, timeout=d.timeout)
        y.backward(grad)
        return (y.detach(), *[leaves[i].grad for i in floating])

    def as_double(xs: tuple[torch.Tensor, ...], magnitude: bool) -> tuple[torch.Tensor, ...]:
        return tuple((t.double().abs() if magnitude else t.double()) if t.is_floating_point() else t for t in xs)

    with torch.no_grad():
        grad = torch.randn_like(case.fn(*inputs, strategy="reference", timeout=d.timeout))
    got = forward_backward(strategy, inputs, grad)
    ref = forward_backward("reference", inputs, grad)
    # The op is multilinear in (inputs, grad): in float64 on the absolute values it sums every term's magnitude.
    exact = forward_backward("reference", as_double(inputs, False), grad.double())
    terms = forward_backward("reference", as_double(inputs, True), grad.double().abs())
    # Each result is a sum of products over an inner dim of at most `depth` terms (fp32 accumulation) and
    # rounds at most world_size + 1 times across ranks (a partial stored, each reduction step, the result).
    depth = max(max(t.shape) for t in inputs) * d.world_size
    per_term = (d.world_size + 2) * UNIT_ROUNDOFF[dtype] + 2 * (depth + 2) * FP32_ACCUMULATE
    ok, worst, worst_ref, parts = True, 0.0, 0.0, []
    for label, g, r, x, s in zip(("out", *[f"grad{i}" for i in floating]), got, ref, exact, terms, strict=True):
        bound = per_term * s * 1.01 + 1e-30
        good, max_err, rel = compare_bound(g, x, bound, BLOCK_RTOL[dtype])
        good_ref, max_ref, _ = compare_bound(r, x, bound, BLOCK_RTOL[dtype])
        if not good_ref:
            parts.append(f"{label}: reference itself off ({max_ref:.1e})")
        vs_ref = compare(g, r.double())[1] if g.numel() else 0.0  # (a rank whose experts got no rows)
        ok = ok and good and good_ref
        worst = max(worst, max_err if math.isfinite(max_err) else math.inf)
        worst_ref = max(worst_ref, vs_ref if math.isfinite(vs_ref) else math.inf)
        parts.append(f"{label} {max_err:.1e} (block rel {rel:.1e})")
    ok, worst = d.agree(ok, worst)
    worst_ref = d.slowest(worst_ref)
    d.rep.add(name, "PASS" if ok else "FAIL",
              f"max {worst:.1e} from float64, {worst_ref:.1e} from reference, over ranks ({', '.join(parts)} here)",
              max_err=worst, max_diff_reference=worst_ref)


def dist_time(d: Dist, label: str, case: OpCase, shape: dict[str, int], dtype: torch.dtype, iters: int) -> None:
    """Each strategy vs `reference` on one shape, then torch's own fused op where it exists."""
    inputs = case.inputs(shape, dtype, d.device, d.world_size)
    flops = case.flops(shape, d.world_size)
    times: dict[str, float] = {}
    for strategy in case.strategies:
        with torch.no_grad():
            t = d.time_calls(lambda s=strategy: case.fn(*inputs, strategy=s, timeout=d.timeout), iters)
        t = max(d.slowest(t), 1e-9)  # the slowest rank's median
        times[strategy] = t
        interpreted = " (interpreted: not a GPU number)" if strategy == "fused" and not d.cuda else ""
        d.rep.add(f"time {label} {strategy}", "PASS", f"{t:.3f} ms{interpreted}", tflops=flops / (t * 1e-3) / 1e12,
                  ratio=times["reference"] / t, ms=t)
    if case.native is None:
        return
    native = case.native(inputs, d.group)
    if isinstance(native, str):
        d.rep.add(f"time {label} torch symm_mem", "SKIP", native)
        return
    with torch.no_grad():
        ok, max_err, rel = compare(native(), case.fn(*inputs, strategy="reference", timeout=d.timeout).double())
        ok, max_err = d.agree(ok, max_err)
        if not ok:
            d.rep.add(f"time {label} torch symm_mem", "FAIL", f"differs from reference: max {max_err:.1e}")
            return
        t = max(d.slowest(d.time_calls(native, iters)), 1e-9)
    d.rep.add(f"time {label} torch symm_mem", "PASS", f"{t:.3f} ms", tflops=flops / (t * 1e-3) / 1e12,
              ratio=times["reference"] / t, ms=t)


def run_distributed(rep: Report, cpu_smoke: bool) -> Dist:
    overlap.world.init_from_env()
    d = Dist(rep, timeout=30.0)
    dtype = torch.float32 if not d.cuda else torch.bfloat16
    rep.log(f"{d.world_size} ranks on {d.device.type}, {dtype_name(dtype)}")
    ops = build_ops()
    for op_name, case in ops.items():  # every check before any timing
        for shape in case.smoke_shapes if cpu_smoke else case.check_shapes:
            for strategy in case.strategies:
                name = f"{op_name} {strategy} fwd+bwd W={d.world_size} {fmt_shape(shape)}"
                d.run(name, lambda n=name, c=case, s=shape, st=strategy: dist_check(d, n, c, s, st, dtype))
    for op_name, case in ops.items():
        bench = [("tiny", case.smoke_shapes[0])] if cpu_smoke else case.bench_shapes(d.world_size)
        for label, shape in bench:
            name = f"{op_name} {label} {fmt_shape(shape)}"
            d.run(f"time {name}", lambda n=name, c=case, s=shape: dist_time(d, n, c, s, dtype, 3 if cpu_smoke else 20))
    return d
