"""The benchmark runner: correctness first, then interleaved timed repeats, then one table.

`run` executes on every rank of the default group (all ranks call it; rank 0 prints). For each
case (`cases.Case`: a tensor-parallel op, a shape, a dtype, a mode; `cases.MoECase`: the MoE
layer, ``T,H,F,E,K``, a dtype, a mode):

1. Fresh random inputs, seeded per rank and case (rank 0 draws the run's seed unless one is given
   and broadcasts it; the seed is printed so a run can be repeated); `workloads` says how they are
   drawn and scaled. Never zeros.
2. Correctness: ``reference`` against the op's result computed locally (every rank can regenerate
   every rank's inputs from the seed), then every strategy against ``reference``, with
   `torch.testing.assert_close` at `tolerance`: the forward output, and in ``fwd+bwd`` also the
   gradient of every input (``grad_a`` and ``grad_b``; moe: ``grad_x``, ``grad_w1``, ``grad_w2``,
   ``grad_topk_weights``). The verdicts of all ranks are gathered, so every rank agrees on which
   strategies to time. A mismatch marks the strategy (and so its case) FAILED; it is not timed.
3. Warm-up, then `iters` interleaved repeats: the plain collectives alone, the GEMMs alone,
   ``reference``, then each strategy, and again, so that drift (clocks, other load) hits every
   label alike. A ``fwd`` call is the op's forward; a ``fwd+bwd`` call is the forward, then the
   backward of that fresh output with a fixed random ``grad_out`` (``torch.autograd.grad``, so
   nothing accumulates). Each timing sits between ``dist.barrier()`` calls, measured on the host
   with `time.perf_counter` (after ``torch.cuda.synchronize()`` on GPUs). One
   ``all_gather_object`` per case collects the timings; the time of a repeat is the maximum over
   ranks (a collective op is as slow as its slowest rank), and a label's time is the median over
   repeats, with p25..p75 as the spread.

Reported per strategy (DESIGN.md "Measuring"): TFLOP/s (`Case.flops`: 1 GEMM forward, 3 in
``fwd+bwd``; `MoECase.flops`: the mean over ranks of the grouped GEMMs), speedup
``= T_ref / T_strategy`` and overlap efficiency ``= (T_ref - T_strategy) / min(T_comm, T_compute)``,
the share of the smaller of the two costs that was hidden (1.0 is the limit). ``T_comm`` and
``T_compute`` are the plain collectives alone and the GEMMs alone of the same mode (`workloads`): in
``fwd+bwd`` every collective and every GEMM of the unfused forward and backward, so the efficiency
there is that of the whole training step of the op. Interpreted ``fused`` runs only where every dim
is at most `cases.INTERPRETED_FUSED_MAX_DIM`, is labelled ``(interpreted)``, is timed without warm-up
in at most `INTERPRETED_ITERS` of the repeats (a call costs 0.1-1 s) and is left out of the
geometric means. ``matmul_all_reduce`` also runs the ``+one_shot`` variant of each strategy
(`cases.VARIANTS`), a label of its own. The geometric means are per mode over every op, and per op
family (tensor-parallel, moe) where a run has both. Default MoE cases whose experts do not split
evenly over the ranks are left out with a note; given ones raise ValueError.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import overlap

from .. import world
from ..ops import _common
from .cases import (
    BENCH_OPS,
    DTYPES,
    INTERPRETED_FUSED_MAX_DIM,
    MODES,
    MOE_OPS,
    VARIANTS,
    AnyCase,
    all_strategy_labels,
    default_cases,
    label_plan,
    strategy_labels,
)
from .workloads import Expected, build, strategy_fn

#: timed repeats of interpreted fused at most (no warm-up): ~0.1-1 s a call, and out of the summaries
INTERPRETED_ITERS = 3


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run` measures. `strategies` always gets ``reference`` (the baseline) put first.

    Without `cases`, the default cases (`cases.default_cases`) of `ops` in `modes` run; given
    cases must be of those ops and modes. Each strategy label runs for the ops it applies to
    (``symm+one_shot``: ``matmul_all_reduce`` only) and must apply to at least one of them.
    Raises ValueError for anything unknown or inconsistent.
    """

    ops: tuple[str, ...] = BENCH_OPS
    modes: tuple[str, ...] = MODES
    cases: tuple[AnyCase, ...] = ()  # empty: the default cases of `ops` x `modes` for the ranks' device type
    dtype: str | None = None  # overrides the dtype of the default cases
    strategies: tuple[str, ...] = all_strategy_labels()
    warmup: int = 3
    iters: int = 10
    timeout: float | None = None  # per-call deadline of the ops (None: OVERLAP_TIMEOUT_S)
    json_path: str | None = None  # rank 0 writes the results there
    seed: int | None = None  # None: rank 0 draws one
    progress: bool = True  # progress lines on rank 0's stderr

    def __post_init__(self) -> None:
        for name, known in (("ops", BENCH_OPS), ("modes", MODES)):
            values = tuple(dict.fromkeys(getattr(self, name)))
            unknown = [v for v in values if v not in known]
            if not values or unknown:
                raise ValueError(f"{name} must be a non-empty selection of {known}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, values)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)} or None, got {self.dtype!r}")
        wrong = [c.name for c in self.cases if c.op not in self.ops or c.mode not in self.modes]
        if wrong:
            raise ValueError(f"cases {wrong} are not of ops {self.ops} in modes {self.modes}")
        ops = {c.op for c in self.cases} or set(self.ops)
        known = all_strategy_labels()
        unknown = [s for s in self.strategies if s not in known]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; known: {known}")
        idle = [s for s in self.strategies if not any(s in strategy_labels(op) for op in ops)]
        if idle:
            raise ValueError(f"strategies {idle} apply to none of the ops benchmarked ({', '.join(sorted(ops))})")
        strategies = ("reference", *dict.fromkeys(s for s in self.strategies if s != "reference"))
        object.__setattr__(self, "strategies", strategies)
        object.__setattr__(self, "cases", tuple(self.cases))
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={self.warmup}, iters={self.iters}")


def tolerance(dtype: torch.dtype, reduction: int, strategy: str, device_type: str) -> dict[str, float]:
    """``assert_close`` tolerances of `strategy` against ``reference`` for a tensor of order 1 whose
    entries are dot products of length `reduction`.

    bf16/fp16: ``rtol=1.6e-2, atol=1e-2`` (DESIGN.md). fp32: ``rtol=1e-5`` and
    ``atol=1e-5 * max(1, sqrt(reduction/256))``: the rounding error of a length-``L`` fp32 dot
    product grows like ``sqrt(L)``, so DESIGN.md's ``1e-5`` holds as is up to ``L = 256`` and is
    widened with the same margin beyond (2.8e-5 at ``L = 2048``). ``fused`` fp32 on a GPU runs its
    ``tl.dot`` as TF32 (DESIGN.md) and gets ``rtol=atol=1e-2``. Forward outputs are of order 1 by
    the inputs' scaling (`workloads`); gradients can be larger (``grad_b`` sums ``W*m`` products of
    order 1), and `_tolerances` multiplies ``atol`` by a tensor's RMS where that exceeds 1.
    """
    if dtype in (torch.bfloat16, torch.float16):
        return {"rtol": 1.6e-2, "atol": 1e-2}
    if strategy == "fused" and device_type == "cuda":
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 1e-5, "atol": 1e-5 * max(1.0, math.sqrt(reduction / 256))}


# ----------------------------------------------------------------------------------------------
# Facts about the machine and the software
# ----------------------------------------------------------------------------------------------


def triton_version() -> str | None:
    """Triton's version, or None where it is not importable."""
    try:
        import triton
    except Exception:  # noqa: BLE001 - any import failure means "no usable Triton"
        return None
    return str(getattr(triton, "__version__", "unknown"))


def fused_interpreted(device: torch.device) -> bool:
    """Whether ``fused`` runs under the Triton interpreter on ranks computing on `device`."""
    return device.type != "cuda" or _common.interpreted()


def machine_info(info: world.GroupInfo) -> dict[str, Any]:
    """What the numbers were measured on (collective-free: uses only `info` and local facts)."""
    links = sorted({info.link_class(p) for p in range(info.world_size) if p != info.rank}) or ["none"]
    tv = triton_version()
    triton_text = "not installed" if tv is None else tv + (" (interpreted)" if fused_interpreted(info.device) else "")
    nodes = len(set(info.nodes))
    if info.device.type == "cuda":
        gpu = torch.cuda.get_device_name(info.device)
        hw = f"{info.world_size}x {gpu}"
        extra = f", CUDA {torch.version.cuda}"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = torch.get_num_threads()
        hw = f"CPU ({platform.machine()}, {cores} cores), {info.world_size} ranks x {threads} torch thread(s)"
        extra = ""
    description = (
        f"{hw}, {info.backend} on {nodes} node(s), links {'/'.join(links)}, "
        f"torch {torch.__version__}{extra}, triton {triton_text}, overlap {overlap.__version__}"
    )
    return {
        "description": description,
        "device_type": info.device.type,
        "device_name": torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else platform.machine(),
        "world_size": info.world_size,
        "backend": info.backend,
        "nodes": nodes,
        "link_classes": links,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": tv,
        "fused_interpreted": fused_interpreted(info.device),
        "overlap": overlap.__version__,
    }


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list (q in [0, 1])."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(times_s: list[float]) -> dict[str, Any]:
    """Median, p25, p75, min, max (ms) of a list of per-repeat times in seconds."""
    ms = sorted(t * 1e3 for t in times_s)
    return {
        "median_ms": _quantile(ms, 0.5),
        "p25_ms": _quantile(ms, 0.25),
        "p75_ms": _quantile(ms, 0.75),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "times_ms": [t * 1e3 for t in times_s],
    }


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


def _tolerances(
    case: AnyCase, expected: list[Expected], device_type: str, strategies: list[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per strategy label, per tensor (``out``, then the gradients; `workloads.Expected`): `tolerance`,
    with ``atol`` multiplied by the tensor's RMS where that exceeds 1."""
    scales = {e.what: (e.reduction, max(1.0, float(e.value.double().pow(2).mean().sqrt()))) for e in expected}
    tols: dict[str, dict[str, dict[str, float]]] = {}
    for label in strategies:
        s = _base_strategy(case.op, label)
        tols[label] = {}
        for what, (reduction, scale) in scales.items():
            tol = tolerance(case.torch_dtype, reduction, s, device_type)
            tols[label][what] = dict(tol, atol=tol["atol"] * scale)
    return tols


def _compare(
    actual: list[torch.Tensor], expected: list[torch.Tensor], tols: dict[str, dict[str, float]], what: str
) -> str | None:
    """None if every tensor is close, else a one-line description of the first mismatch."""
    for (name, tol), x, e in zip(tols.items(), actual, expected, strict=True):
        try:
            torch.testing.assert_close(x, e, **tol)
        except AssertionError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            return (
                f"{what} ({name}): "
                + "; ".join(lines[1:] or lines)
                + f" (rtol={tol['rtol']:.3g}, atol={tol['atol']:.3g})"
            )
    return None


def _base_strategy(op: str, label: str) -> str:
    return label_plan(op, label)[0]


def _strategies_for(case: AnyCase, config: BenchConfig, info: world.GroupInfo) -> tuple[list[str], list[str]]:
    """(strategy labels to run for `case`, notes on the ones left out)."""
    run, notes = [], []
    interpreted = fused_interpreted(info.device)
    for label in config.strategies:
        if label not in strategy_labels(case.op):
            continue  # a variant of another op
        s = _base_strategy(case.op, label)
        if s in ("symm", "fused") and not info.single_node:
            notes.append(f"{label} skipped: the group spans nodes {info.node_names}")
        elif s == "fused" and interpreted and not case.fits_interpreted_fused:
            continue  # the footnote of the table says why
        else:
            run.append(label)
    return run, notes


def _is_interpreted(op: str, label: str, interpreted: bool) -> bool:
    """Whether `label` of `op` runs under the Triton interpreter (`interpreted`: `fused_interpreted`)."""
    return interpreted and _base_strategy(op, label) == "fused"


def _display(op: str, label: str, interpreted: bool) -> str:
    return f"{label} (interpreted)" if _is_interpreted(op, label, interpreted) else label


def run_case(
    case: AnyCase, case_index: int, config: BenchConfig, seed: int, info: world.GroupInfo, pg: dist.ProcessGroup
) -> tuple[list[dict[str, Any]], list[str]]:
    """Check and time one case on every rank; returns (one row per strategy, notes).

    Every rank returns the same rows. Raises whatever the ops raise (timeouts, dead peers):
    only numerical mismatches are recorded as FAILED rows.
    """
    W, rank, device = info.world_size, info.rank, info.device
    interpreted = fused_interpreted(device)
    labels, notes = _strategies_for(case, config, info)
    timeout = _common.resolve_timeout(config.timeout)
    work = build(case, seed, case_index, info, pg, timeout)
    calls = {label: strategy_fn(work, case, label, config.timeout) for label in labels}
    tols = _tolerances(case, work.expected, device.type, labels)

    # ---- correctness, before any timing -------------------------------------------------------
    errors: dict[str, str] = {}
    y_ref = calls["reference"]()
    err = _compare(
        y_ref, [e.value for e in work.expected], tols["reference"], f"rank {rank}: reference vs the local {case.op}"
    )
    if err:
        errors["reference"] = err
    work.expected.clear()
    for label in labels[1:]:
        err = _compare(calls[label](), y_ref, tols[label], f"rank {rank}: {label} vs reference")
        if err:
            errors[label] = err
    del y_ref
    every: list[Any] = [None] * W
    dist.all_gather_object(every, errors, group=pg)
    failed: dict[str, str] = {}
    for rank_errors in every:
        for s, text in rank_errors.items():
            failed.setdefault(s, text)  # the lowest failing rank's message

    # ---- warm-up, then interleaved repeats ----------------------------------------------------
    comm_label, compute_label = work.comm_label, work.compute_label
    fns: dict[str, Any] = {comm_label: work.comm, compute_label: work.compute}
    # A wrong reference is still the baseline of the others; a wrong strategy is not timed.
    fns.update({s: calls[s] for s in labels if s == "reference" or s not in failed})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Interpreted fused: no warm-up (its correctness call was the first) and at most
    # INTERPRETED_ITERS repeats; its timings are labelled and left out of the summaries anyway.
    slow = {label for label in fns if label in labels and _is_interpreted(case.op, label, interpreted)}
    repeats = {label: min(config.iters, INTERPRETED_ITERS) if label in slow else config.iters for label in fns}
    for _ in range(config.warmup):
        for label, fn in fns.items():
            if label not in slow:
                fn()
    times: dict[str, list[float]] = {label: [] for label in fns}
    for i in range(config.iters):
        for label, fn in fns.items():
            if i >= repeats[label]:
                continue
            dist.barrier(group=pg)  # start together: each timing is of one collective call
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[label].append(time.perf_counter() - t0)
    every = [None] * W
    dist.all_gather_object(every, times, group=pg)
    stats = {label: summarize([max(r[label][i] for r in every) for i in range(repeats[label])]) for label in fns}

    t_comm, t_compute = stats[comm_label]["median_ms"], stats[compute_label]["median_ms"]
    t_ref = stats["reference"]["median_ms"]
    base = {
        "op": case.op,
        "mode": case.mode,
        "backward": case.backward,
        "case": case.name,
        **case.shape_fields(),
        "dtype": case.dtype,
        "world_size": W,
        "t_comm_ms": t_comm,
        "t_compute_ms": t_compute,
        "comm_gbps": work.comm_bytes / (t_comm * 1e-3) / 1e9,
        "compute_tflops": case.flops(W) / (t_compute * 1e-3) / 1e12,
    }
    rows = []
    for s in labels:
        is_interp = _is_interpreted(case.op, s, interpreted)
        row = dict(
            base,
            strategy=s,
            plan_fields=label_plan(case.op, s)[1],
            label=_display(case.op, s, interpreted),
            interpreted=is_interp,
            status="FAILED" if s in failed else "ok",
            error=failed.get(s),
            tolerance=tols[s],
            in_summary=s not in failed and not is_interp,
        )
        if s in stats:
            t = stats[s]["median_ms"]
            row.update(stats[s])
            row.update(
                tflops=case.flops(W) / (t * 1e-3) / 1e12,
                speedup=t_ref / t,
                efficiency=(t_ref - t) / min(t_comm, t_compute),
            )
        rows.append(row)
    rows.append(dict(base, strategy=comm_label, context="comm", **stats[comm_label]))
    rows.append(dict(base, strategy=compute_label, context="compute", **stats[compute_label]))
    return rows, notes + work.notes


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------


class _Table:
    """Aligned text table printed row by row (widths fixed up front from the cases and labels)."""

    HEADS = ("case", "strategy", "median ms", "p25..p75 ms", "TFLOP/s", "GB/s", "speedup", "overlap eff")

    def __init__(self, cases: tuple[AnyCase, ...], strategies: tuple[str, ...], interpreted: bool):
        self.w_case = max(len(self.HEADS[0]), *(len(c.name) for c in cases))
        labels = [_display(c.op, s, interpreted) for c in cases for s in strategies if s in strategy_labels(c.op)]
        self.w_strategy = max(len(self.HEADS[1]), len("(reduce_scatter alone)"), *map(len, labels))

    def line(self, case: str, strategy: str, *cols: str) -> str:
        widths = (10, 15, 8, 7, 8, 11)
        tail = " ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))
        return f"{case:<{self.w_case}}  {strategy:<{self.w_strategy}} {tail}".rstrip()

    def header(self) -> str:
        return self.line(*self.HEADS)

    def row(self, r: dict[str, Any]) -> str:
        name = r.get("label", r["strategy"])
        if r.get("status") == "FAILED":
            return f"{r['case']:<{self.w_case}}  {name:<{self.w_strategy}} FAILED  {r['error']}"
        spread = f"{r['p25_ms']:.2f}..{r['p75_ms']:.2f}"
        dash = "-"
        if r.get("context") == "comm":
            cols = (f"{r['median_ms']:.3f}", spread, dash, f"{r['comm_gbps']:.3g}", dash, dash)
        elif r.get("context") == "compute":
            cols = (f"{r['median_ms']:.3f}", spread, f"{r['compute_tflops']:.3g}", dash, dash, dash)
        else:
            cols = (
                f"{r['median_ms']:.3f}",
                spread,
                f"{r['tflops']:.3g}",
                dash,
                f"{r['speedup']:.2f}x",
                f"{r['efficiency']:+.2f}",
            )
        return self.line(r["case"], name, *cols)


def _agree_seed(seed: int | None, pg: dist.ProcessGroup) -> int:
    box = [seed if seed is not None else random.SystemRandom().randrange(2**31)]
    dist.broadcast_object_list(box, src=world.group_info(pg).global_ranks[0], group=pg)
    return int(box[0])


def family(op: str) -> str:
    """``"moe"`` or ``"tensor-parallel"``: the op families the summary also reports apart."""
    return "moe" if op in MOE_OPS else "tensor-parallel"


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Geometric-mean speedup per strategy label over the cases where it passed (interpreted fused
    left out): over all cases, per mode (``by_mode``) and per op family (``by_family``, `family`)."""
    per: dict[str, dict[str, list[float]]] = {}
    per_family: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r.get("in_summary") and r["strategy"] != "reference" and "speedup" in r:
            per.setdefault(r["strategy"], {}).setdefault(r["mode"], []).append(r["speedup"])
            per_family.setdefault(r["strategy"], {}).setdefault(family(r["op"]), []).append(r["speedup"])
    out = {}
    for s, by_mode in per.items():
        every = [v for mode in MODES for v in by_mode.get(mode, [])]
        out[s] = {
            "geomean_speedup": geomean(every),
            "cases": len(every),
            "by_mode": {m: {"geomean_speedup": geomean(v), "cases": len(v)} for m, v in by_mode.items()},
            "by_family": {f: {"geomean_speedup": geomean(v), "cases": len(v)} for f, v in per_family[s].items()},
        }
    return out


def _summary_lines(results: dict[str, dict[str, Any]], modes: tuple[str, ...], families: tuple[str, ...]) -> list[str]:
    lines = []
    scopes = [(m, lambda s, m=m: results[s]["by_mode"].get(m)) for m in modes]
    if len(modes) > 1:
        scopes.append(("all", lambda s: results[s]))
    if len(families) > 1:
        scopes += [(f"{f}, all modes", lambda s, f=f: results[s]["by_family"].get(f)) for f in families]
    for scope, get in scopes:
        parts = [f"{s} {v['geomean_speedup']:.2f}x ({v['cases']})" for s in results if (v := get(s))]
        if parts:
            lines.append(f"geomean speedup over reference, {scope}: " + ", ".join(parts))
    return lines


def _notes(config: BenchConfig, info: world.GroupInfo) -> list[str]:
    """The footnotes that apply to this run."""
    notes = []
    ops = {c.op for c in config.cases}
    if any(c.backward for c in config.cases):
        notes.append(
            "fwd+bwd: forward, then backward of the fresh output with a fixed random grad_out; "
            "(comm alone) = the plain collectives of the unfused forward and backward back to back, "
            "(GEMMs alone) = its 3 GEMMs (moe: 6 grouped GEMMs)"
        )
    if ops & set(MOE_OPS):
        notes.append(
            "moe: one MoE layer's experts, dispatch_grouped_matmul -> gelu -> grouped_matmul_combine, with a "
            "fixed uneven routing per case (shape T,H,F,E,K: tokens per rank, hidden, expert FFN, experts, top-k); "
            "(all_to_alls alone) = all_to_all_single of the counts and of the rows both ways; (GEMMs alone) = the "
            "grouped GEMMs on this rank's received rows; TFLOP/s and GB/s count the mean rows per rank"
        )
    if "fused" in config.strategies and fused_interpreted(info.device):
        notes.append(
            f"fused runs under the Triton interpreter, only for cases with every dim <= "
            f"{INTERPRETED_FUSED_MAX_DIM}, timed in at most {min(config.iters, INTERPRETED_ITERS)} repeats without "
            "warm-up; its timings are not in the summary"
        )
    for op, variants in VARIANTS.items():
        if op in ops and any(v in config.strategies for v in variants):
            notes.append(
                f"{op}: +one_shot = the one-shot all-reduce (every rank sums every rank's whole "
                "partial); the plain labels are two-shot (reduce-scatter, then all-gather)"
            )
    return notes


def run(config: BenchConfig, group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Benchmark `config.cases` on every rank of `group` (collective); rank 0 prints the table.

    Without cases in `config`, the default cases of `config.ops` in `config.modes` for the
    group's device type run.

    Returns, on every rank, one dict per (case, strategy label) with ``status`` ``"ok"`` or
    ``"FAILED"``, timings in ms, ``tflops``, ``speedup``, ``efficiency`` and context, followed per
    case by two context rows (``context``: ``"comm"``, the collectives alone; ``"compute"``, the
    GEMMs alone). Rank 0 writes ``{"machine", "config", "seed", "results", "summary"}`` to
    `config.json_path` if set. Raises RuntimeError if torch.distributed is not initialized,
    ValueError for a given MoE case whose experts do not split evenly over the ranks, and whatever
    the ops raise.
    """
    pg = world.resolve_group(group)
    info = world.group_info(pg)
    lead = info.rank == 0
    problems = [p for c in config.cases if (p := c.world_problem(info.world_size))]
    if problems:
        raise ValueError(f"cases that cannot run on {info.world_size} ranks: {'; '.join(problems)}")
    left_out = []
    if not config.cases:
        cases = default_cases(config.ops, info.device.type, config.dtype, config.modes)
        left_out = [p for c in cases if (p := c.world_problem(info.world_size))]
        cases = [c for c in cases if not c.world_problem(info.world_size)]
        if not cases:
            raise ValueError(f"no default case of {config.ops} runs on {info.world_size} ranks: {'; '.join(left_out)}")
        config = dataclasses.replace(config, cases=tuple(cases))
    seed = _agree_seed(config.seed, pg)
    machine = machine_info(info)
    table = _Table(config.cases, config.strategies, fused_interpreted(info.device))
    start = time.perf_counter()

    def out(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    out(f"machine: {machine['description']}")
    out(
        f"seed {seed}, {config.warmup} warm-up + {config.iters} timed repeats per case, "
        "time = max over ranks per repeat, median over repeats"
    )
    out()
    out(table.header())
    rows: list[dict[str, Any]] = []
    all_notes = [f"left out: {p}" for p in left_out]
    for i, case in enumerate(config.cases):
        if lead and config.progress:
            running = ", ".join(_strategies_for(case, config, info)[0])
            print(
                f"[{i + 1}/{len(config.cases)}] {case.name}: {running} ({time.perf_counter() - start:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        case_rows, notes = run_case(case, i, config, seed, info, pg)
        rows.extend(case_rows)
        all_notes.extend(n for n in notes if n not in all_notes)
        for r in case_rows:
            out(table.row(r))

    results = summary(rows)
    out()
    modes = tuple(m for m in MODES if any(c.mode == m for c in config.cases))
    families = tuple(dict.fromkeys(family(c.op) for c in config.cases))
    for line in _summary_lines(results, modes, families):
        out(line)
    failed = [r for r in rows if r.get("status") == "FAILED"]
    if failed:
        out(f"FAILED: {len(failed)} strategy/case pair(s) did not match reference")
    for note in _notes(config, info) + all_notes:
        out(f"note: {note}")
    if lead and config.progress:
        print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if lead and config.json_path:
        write_json(
            config.json_path,
            {
                "machine": machine,
                "config": {**dataclasses.asdict(config), "cases": [dataclasses.asdict(c) for c in config.cases]},
                "seed": seed,
                "results": rows,
                "summary": results,
            },
        )
    return rows


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically (a temporary file renamed over it)."""
    tmp = f"{path}.{os.getpid()}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
