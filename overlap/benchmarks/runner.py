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
(`cases.VARIANTS`), a label of its own. The geometric means are per mode over every op, per op
family (tensor-parallel, moe) where a run has both, and per op, last. Default cases that do not
fit the ranks (MoE experts that do not split evenly, a Llama-3 layer whose heads do not) are left
out with a note; given ones raise ValueError.

The table, the geometric means, the footnotes and the JSON file are `report`'s. The pieces of a
case (`check_case`, `time_case`, `case_rows`; `timed_call` for one call) are also
what `session` runs one call at a time for the pytest-benchmark wrappers. Rank 0 shows a progress
bar on stderr (`progress.ProgressBar`): a line per case, and the case and strategy being checked,
warmed up or timed, redrawn on a terminal and a line every few seconds in a log.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import overlap

from .. import world
from ..ops import _common
from . import report
from .cases import (
    BENCH_OPS,
    DTYPES,
    MODES,
    AnyCase,
    all_strategy_labels,
    default_cases,
    label_plan,
    strategy_labels,
)
from .progress import ProgressBar
from .workloads import Expected, Workload, build, strategy_fn

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
        s = report.base_strategy(case.op, label)
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


def _strategies_for(case: AnyCase, config: BenchConfig, info: world.GroupInfo) -> tuple[list[str], list[str]]:
    """(strategy labels to run for `case`, notes on the ones left out)."""
    run, notes = [], []
    interpreted = fused_interpreted(info.device)
    for label in config.strategies:
        if label not in strategy_labels(case.op):
            continue  # a variant of another op
        s = report.base_strategy(case.op, label)
        if s in ("symm", "fused") and not info.single_node:
            notes.append(f"{label} skipped: the group spans nodes {info.node_names}")
        elif s == "fused" and interpreted and not case.fits_interpreted_fused:
            continue  # the footnote of the table says why
        else:
            run.append(label)
    return run, notes


#: progress(fraction of the case done, what runs now): rank 0's view of a case (`ProgressBar`)
Progress = Callable[[float, str], None]


def _quiet(fraction: float, text: str) -> None:
    pass


@dataclasses.dataclass
class Checked:
    """One case on this rank after its correctness check (`check_case`): what there is to time."""

    case: AnyCase
    labels: list[str]  # the strategy labels run for the case, reference first
    failed: dict[str, str]  # label -> the lowest failing rank's message (the same on every rank)
    notes: list[str]
    work: Workload
    tols: dict[str, dict[str, dict[str, float]]]
    fns: dict[str, Callable[[], Any]]  # what is timed: the collectives alone, the GEMMs alone, the labels that passed
    slow: set[str]  # labels under the Triton interpreter: no warm-up, at most INTERPRETED_ITERS repeats
    interpreted: bool  # whether fused runs under the interpreter on these ranks

    def units(self, config: BenchConfig) -> int:
        """Steps of the case for a progress bar: one per label checked, per warm-up round, per repeat."""
        return len(self.labels) + config.warmup + config.iters


def check_case(
    case: AnyCase,
    case_index: int,
    config: BenchConfig,
    seed: int,
    info: world.GroupInfo,
    pg: dist.ProcessGroup,
    progress: Progress = _quiet,
) -> Checked:
    """Build one case's inputs on every rank and check every strategy against ``reference`` (and
    ``reference`` against the local oracle); every rank returns the same verdicts (one
    ``all_gather_object``). Raises whatever the ops raise: only mismatches are recorded."""
    rank, device = info.rank, info.device
    interpreted = fused_interpreted(device)
    labels, notes = _strategies_for(case, config, info)
    units = len(labels) + config.warmup + config.iters
    timeout = _common.resolve_timeout(config.timeout)
    work = build(case, seed, case_index, info, pg, timeout)
    calls = {label: strategy_fn(work, case, label, config.timeout) for label in labels}
    tols = _tolerances(case, work.expected, device.type, labels)

    errors: dict[str, str] = {}
    progress(0.0, f"{case.name}: checking reference")
    y_ref = calls["reference"]()
    err = _compare(
        y_ref, [e.value for e in work.expected], tols["reference"], f"rank {rank}: reference vs the local {case.op}"
    )
    if err:
        errors["reference"] = err
    work.expected.clear()
    for i, label in enumerate(labels[1:], 1):
        progress(i / units, f"{case.name}: checking {report.display_label(case.op, label, interpreted)}")
        err = _compare(calls[label](), y_ref, tols[label], f"rank {rank}: {label} vs reference")
        if err:
            errors[label] = err
    del y_ref
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, errors, group=pg)
    failed: dict[str, str] = {}
    for rank_errors in every:
        for s, text in rank_errors.items():
            failed.setdefault(s, text)  # the lowest failing rank's message

    fns: dict[str, Callable[[], Any]] = {work.comm_label: work.comm, work.compute_label: work.compute}
    # A wrong reference is still the baseline of the others; a wrong strategy is not timed.
    fns.update({s: calls[s] for s in labels if s == "reference" or s not in failed})
    slow = {label for label in fns if label in labels and report.is_interpreted(case.op, label, interpreted)}
    return Checked(case, labels, failed, notes + work.notes, work, tols, fns, slow, interpreted)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def timed_call(fn: Callable[[], Any], device: torch.device, pg: dist.ProcessGroup) -> float:
    """Seconds of one call of `fn` on this rank, started together with the other ranks (a barrier)."""
    sync = _sync(device)
    dist.barrier(group=pg)  # start together: each timing is of one collective call
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def time_case(
    checked: Checked, config: BenchConfig, info: world.GroupInfo, pg: dist.ProcessGroup, progress: Progress = _quiet
) -> dict[str, dict[str, Any]]:
    """Warm up, then time `config.iters` interleaved repeats of every label of `checked.fns`; returns
    per label `summarize` of the per-repeat maxima over ranks (one ``all_gather_object``)."""
    fns, slow, name, op = checked.fns, checked.slow, checked.case.name, checked.case.op
    done, units = len(checked.labels), checked.units(config)
    # Interpreted fused: no warm-up (its correctness call was the first) and at most
    # INTERPRETED_ITERS repeats; its timings are labelled and left out of the summaries anyway.
    repeats = {label: min(config.iters, INTERPRETED_ITERS) if label in slow else config.iters for label in fns}
    for w in range(config.warmup):
        progress((done + w) / units, f"{name}: warming up ({w + 1}/{config.warmup})")
        for label, fn in fns.items():
            if label not in slow:
                fn()
    done += config.warmup
    times: dict[str, list[float]] = {label: [] for label in fns}
    for i in range(config.iters):
        for label, fn in fns.items():
            if i >= repeats[label]:
                continue
            shown = report.display_label(op, label, checked.interpreted) if label in checked.labels else label
            progress((done + i) / units, f"{name}: timing {shown} ({i + 1}/{config.iters})")
            times[label].append(timed_call(fn, info.device, pg))
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, times, group=pg)
    return {label: summarize([max(r[label][i] for r in every) for i in range(repeats[label])]) for label in fns}


def case_rows(checked: Checked, stats: dict[str, dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """One row per strategy label of the case, then its two context rows (see `run`)."""
    case, work, W = checked.case, checked.work, world_size
    comm_label, compute_label = work.comm_label, work.compute_label
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
    for s in checked.labels:
        is_interp = report.is_interpreted(case.op, s, checked.interpreted)
        row = dict(
            base,
            strategy=s,
            plan_fields=label_plan(case.op, s)[1],
            label=report.display_label(case.op, s, checked.interpreted),
            interpreted=is_interp,
            status="FAILED" if s in checked.failed else "ok",
            error=checked.failed.get(s),
            tolerance=checked.tols[s],
            in_summary=s not in checked.failed and not is_interp,
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
    return rows


def run_case(
    case: AnyCase,
    case_index: int,
    config: BenchConfig,
    seed: int,
    info: world.GroupInfo,
    pg: dist.ProcessGroup,
    progress: Progress = _quiet,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Check and time one case on every rank; returns (one row per strategy, notes).

    Every rank returns the same rows. Raises whatever the ops raise (timeouts, dead peers):
    only numerical mismatches are recorded as FAILED rows.
    """
    checked = check_case(case, case_index, config, seed, info, pg, progress)
    stats = time_case(checked, config, info, pg, progress)
    return case_rows(checked, stats, info.world_size), checked.notes


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------


def _agree_seed(seed: int | None, pg: dist.ProcessGroup) -> int:
    box = [seed if seed is not None else random.SystemRandom().randrange(2**31)]
    dist.broadcast_object_list(box, src=world.group_info(pg).global_ranks[0], group=pg)
    return int(box[0])


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
    left_out: list[str] = []
    if not config.cases:
        cases = default_cases(config.ops, info.device.type, config.dtype, config.modes, info.world_size, left_out)
        left_out += [p for c in cases if (p := c.world_problem(info.world_size))]
        cases = [c for c in cases if not c.world_problem(info.world_size)]
        if not cases:
            raise ValueError(f"no default case of {config.ops} runs on {info.world_size} ranks: {'; '.join(left_out)}")
        config = dataclasses.replace(config, cases=tuple(cases))
    seed = _agree_seed(config.seed, pg)
    machine = machine_info(info)
    table = report.Table(config.cases, config.strategies, fused_interpreted(info.device))
    bar = ProgressBar(lead and config.progress, total=len(config.cases))

    def out(text: str = "") -> None:
        if lead:
            bar.clear()  # a terminal's bar line is not the table's
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
        running = ", ".join(_strategies_for(case, config, info)[0])
        bar.line(f"[{i + 1}/{len(config.cases)}] {case.name}: {running} ({bar.elapsed():.1f} s)")

        def progress(fraction: float, text: str, i: int = i) -> None:
            bar.update((i + fraction) / len(config.cases), text)

        rows_i, notes = run_case(case, i, config, seed, info, pg, progress if lead else _quiet)
        rows.extend(rows_i)
        all_notes.extend(n for n in notes if n not in all_notes)
        for r in rows_i:
            out(table.row(r))

    results = report.summary(rows)
    out()
    modes = tuple(m for m in MODES if any(c.mode == m for c in config.cases))
    families = tuple(dict.fromkeys(report.family(c.op) for c in config.cases))
    ops = tuple(dict.fromkeys(c.op for c in config.cases))
    for line in report.summary_lines(results, modes, families, ops):
        out(line)
    failed = [r for r in rows if r.get("status") == "FAILED"]
    if failed:
        out(f"FAILED: {len(failed)} strategy/case pair(s) did not match reference")
    for note in report.notes(config, fused_interpreted(info.device), min(config.iters, INTERPRETED_ITERS)) + all_notes:
        out(f"note: {note}")
    bar.finish(f"done in {bar.elapsed():.1f} s")
    if lead and config.json_path:
        report.write_json(
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
