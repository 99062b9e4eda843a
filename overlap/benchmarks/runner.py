"""The benchmark runner: correctness first, then interleaved timed repeats, then one table.

`run` executes on every rank of the default group (all ranks call it; rank 0 prints). For each
`Case`:

1. Fresh random inputs, seeded per rank and case (rank 0 draws the run's seed unless one is given
   and broadcasts it; the seed is printed so a run can be repeated). ``a`` is standard normal,
   ``b`` standard normal scaled by ``1/sqrt(k)`` like an initialized weight, so outputs are of
   order 1 whatever ``k`` is and absolute tolerances keep their meaning. Never zeros.
2. Correctness: ``reference`` against the same gather and GEMM computed locally (every rank can
   regenerate every rank's ``a`` from the seed), then every strategy against ``reference`` with
   `torch.testing.assert_close` at `tolerance`. The verdicts of all ranks are gathered, so every
   rank agrees on which strategies to time. A mismatch marks the strategy (and so its case)
   FAILED; it is not timed.
3. Warm-up, then `iters` interleaved repeats: the transfer alone (``all_gather`` of ``a``), the
   compute alone (the full ``[W*m, k] @ [k, n]`` GEMM on every rank), ``reference``, then each
   strategy, and again, so that drift (clocks, other load) hits every label alike. Each timing
   sits between ``dist.barrier()`` calls, measured on the host with `time.perf_counter` (after
   ``torch.cuda.synchronize()`` on GPUs). One ``all_gather_object`` per case collects the timings;
   the time of a repeat is the maximum over ranks (a collective op is as slow as its slowest
   rank), and a label's time is the median over repeats, with p25..p75 as the spread.

Reported per strategy (DESIGN.md "Measuring"): TFLOP/s ``= 2*W*m*k*n / t``, speedup
``= T_ref / T_strategy`` and overlap efficiency ``= (T_ref - T_strategy) / min(T_comm, T_compute)``,
the share of the smaller of the two costs that was hidden (1.0 is the limit). Interpreted
``fused`` runs only where every dim is at most `cases.INTERPRETED_FUSED_MAX_DIM`, is labelled
``fused (interpreted)`` and is left out of the geometric means.
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import overlap

from .. import world
from ..ops import _common
from ..plan import STRATEGIES
from .cases import DTYPES, INTERPRETED_FUSED_MAX_DIM, OPS, Case, default_cases

COMM_LABEL = "(all_gather alone)"
COMPUTE_LABEL = "(GEMM alone)"


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run` measures. `strategies` always gets ``reference`` (the baseline) put first."""

    op: str = "all_gather_matmul"
    cases: tuple[Case, ...] = ()  # empty: `cases.default_cases` of `op` for the ranks' device type
    dtype: str | None = None  # overrides the dtype of the default cases
    strategies: tuple[str, ...] = STRATEGIES
    warmup: int = 3
    iters: int = 10
    timeout: float | None = None  # per-call deadline of the ops (None: OVERLAP_TIMEOUT_S)
    json_path: str | None = None  # rank 0 writes the results there
    seed: int | None = None  # None: rank 0 draws one
    progress: bool = True  # progress lines on rank 0's stderr

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {OPS}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)} or None, got {self.dtype!r}")
        wrong = [c.name for c in self.cases if c.op != self.op]
        if wrong:
            raise ValueError(f"cases {wrong} are not of op {self.op!r}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; known: {STRATEGIES}")
        strategies = ("reference", *dict.fromkeys(s for s in self.strategies if s != "reference"))
        object.__setattr__(self, "strategies", strategies)
        object.__setattr__(self, "cases", tuple(self.cases))
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={self.warmup}, iters={self.iters}")


def tolerance(dtype: torch.dtype, k: int, strategy: str, device_type: str) -> dict[str, float]:
    """``assert_close`` tolerances of `strategy` against ``reference``.

    bf16/fp16: ``rtol=1.6e-2, atol=1e-2`` (DESIGN.md). fp32: ``rtol=1e-5`` and
    ``atol=1e-5 * max(1, sqrt(k/256))``: outputs are of order 1 (see the module docstring) and the
    rounding error of a length-``k`` fp32 dot product grows like ``sqrt(k)``, so DESIGN.md's
    ``1e-5`` holds as is up to ``k = 256`` and is widened with the same margin beyond (2.8e-5 at
    ``k = 2048``). On CPU the strategies are in fact bitwise equal to ``reference`` today.
    ``fused`` fp32 on a GPU runs its ``tl.dot`` as TF32 (DESIGN.md) and gets ``rtol=atol=1e-2``.
    """
    if dtype in (torch.bfloat16, torch.float16):
        return {"rtol": 1.6e-2, "atol": 1e-2}
    if strategy == "fused" and device_type == "cuda":
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 1e-5, "atol": 1e-5 * max(1.0, math.sqrt(k / 256))}


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


def _generator(device: torch.device, seed: int, case_index: int, tensor_id: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + case_index * 10_007 + tensor_id) % (2**63))
    return gen


def _check(actual: torch.Tensor, expected: torch.Tensor, tol: dict[str, float], what: str) -> str | None:
    """None if close, else a one-line description of the mismatch."""
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"{what}: " + "; ".join(lines[1:] or lines) + f" (rtol={tol['rtol']:.3g}, atol={tol['atol']:.3g})"
    return None


def _strategies_for(case: Case, config: BenchConfig, info: world.GroupInfo) -> tuple[list[str], list[str]]:
    """(strategies to run for `case`, notes on the ones left out)."""
    run, notes = [], []
    interpreted = fused_interpreted(info.device)
    for s in config.strategies:
        if s in ("symm", "fused") and not info.single_node:
            notes.append(f"{s} skipped: the group spans nodes {info.node_names}")
        elif s == "fused" and interpreted and not case.fits_interpreted_fused:
            continue  # the footnote of the table says why
        else:
            run.append(s)
    return run, notes


def _label(strategy: str, interpreted: bool) -> str:
    return f"{strategy} (interpreted)" if strategy == "fused" and interpreted else strategy


def run_case(
    case: Case, case_index: int, config: BenchConfig, seed: int, info: world.GroupInfo, pg: dist.ProcessGroup
) -> tuple[list[dict[str, Any]], list[str]]:
    """Check and time one case on every rank; returns (one row per strategy, notes).

    Every rank returns the same rows. Raises whatever the ops raise (timeouts, dead peers):
    only numerical mismatches are recorded as FAILED rows.
    """
    if case.op != "all_gather_matmul":
        raise ValueError(f"the runner has no benchmark for op {case.op!r}")
    W, rank, device = info.world_size, info.rank, info.device
    dtype, interpreted = case.torch_dtype, fused_interpreted(device)
    strategies, notes = _strategies_for(case, config, info)
    timeout = _common.resolve_timeout(config.timeout)

    # Inputs: every rank's a (to recompute the gathered GEMM locally) and this rank's b.
    a_all = [
        torch.randn(case.m, case.k, generator=_generator(device, seed, case_index, r), device=device).to(dtype)
        for r in range(W)
    ]
    gen_b = _generator(device, seed, case_index, W + rank)
    b = (torch.randn(case.k, case.n, generator=gen_b, device=device) / math.sqrt(case.k)).to(dtype)
    a, full_local = a_all[rank], torch.cat(a_all)
    del a_all
    gathered = torch.empty_like(full_local)

    def comm_alone() -> None:
        work = _common.all_gather_async(gathered, a, pg)
        _common.wait_work(work, "bench all_gather", rank, "any", "all", timeout)

    def compute_alone() -> torch.Tensor:
        return torch.mm(full_local, b)

    def strategy_fn(s: str) -> Callable[[], torch.Tensor]:
        return lambda: overlap.all_gather_matmul(a, b, strategy=s, timeout=config.timeout)

    # ---- correctness, before any timing -------------------------------------------------------
    errors: dict[str, str] = {}
    expected = compute_alone()
    y_ref = strategy_fn("reference")()
    err = _check(
        y_ref,
        expected,
        tolerance(dtype, case.k, "reference", device.type),
        f"rank {rank}: reference vs local all_gather + GEMM",
    )
    if err:
        errors["reference"] = err
    for s in strategies[1:]:
        tol = tolerance(dtype, case.k, s, device.type)
        err = _check(strategy_fn(s)(), y_ref, tol, f"rank {rank}: {s} vs reference")
        if err:
            errors[s] = err
    del expected, y_ref
    every: list[Any] = [None] * W
    dist.all_gather_object(every, errors, group=pg)
    failed: dict[str, str] = {}
    for rank_errors in every:
        for s, text in rank_errors.items():
            failed.setdefault(s, text)  # the lowest failing rank's message

    # ---- warm-up, then interleaved repeats ----------------------------------------------------
    fns: dict[str, Callable[[], Any]] = {COMM_LABEL: comm_alone, COMPUTE_LABEL: compute_alone}
    # A wrong reference is still the baseline of the others; a wrong strategy is not timed.
    fns.update({s: strategy_fn(s) for s in strategies if s == "reference" or s not in failed})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(config.warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(config.iters):
        for label, fn in fns.items():
            dist.barrier(group=pg)  # start together: each timing is of one collective call
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[label].append(time.perf_counter() - t0)
    every = [None] * W
    dist.all_gather_object(every, times, group=pg)
    stats = {label: summarize([max(r[label][i] for r in every) for i in range(config.iters)]) for label in fns}

    t_comm, t_compute = stats[COMM_LABEL]["median_ms"], stats[COMPUTE_LABEL]["median_ms"]
    t_ref = stats["reference"]["median_ms"]
    base = {
        "op": case.op,
        "case": case.name,
        "m": case.m,
        "k": case.k,
        "n": case.n,
        "dtype": case.dtype,
        "world_size": W,
        "t_comm_ms": t_comm,
        "t_compute_ms": t_compute,
        "comm_gbps": case.gathered_bytes(W) / (t_comm * 1e-3) / 1e9,
        "compute_tflops": case.flops(W) / (t_compute * 1e-3) / 1e12,
    }
    rows = []
    for s in strategies:
        is_interp = s == "fused" and interpreted
        row = dict(
            base,
            strategy=s,
            label=_label(s, interpreted),
            interpreted=is_interp,
            status="FAILED" if s in failed else "ok",
            error=failed.get(s),
            tolerance=tolerance(dtype, case.k, s, device.type),
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
    rows.append(dict(base, strategy=COMM_LABEL, **stats[COMM_LABEL]))
    rows.append(dict(base, strategy=COMPUTE_LABEL, **stats[COMPUTE_LABEL]))
    return rows, notes


# ----------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------


class _Table:
    """Aligned text table printed row by row (widths fixed up front from the case names)."""

    HEADS = ("case", "strategy", "median ms", "p25..p75 ms", "TFLOP/s", "GB/s", "speedup", "overlap eff")

    def __init__(self, cases: tuple[Case, ...]):
        self.w_case = max(len(self.HEADS[0]), *(len(c.name) for c in cases))
        self.w_strategy = max(len(self.HEADS[1]), len("fused (interpreted)"), len(COMM_LABEL))

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
        if r["strategy"] == COMM_LABEL:
            cols = (f"{r['median_ms']:.3f}", spread, dash, f"{r['comm_gbps']:.3g}", dash, dash)
        elif r["strategy"] == COMPUTE_LABEL:
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


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Geometric-mean speedup per strategy over the cases where it passed (interpreted fused left out)."""
    per: dict[str, list[float]] = {}
    for r in rows:
        if r.get("in_summary") and r["strategy"] != "reference" and "speedup" in r:
            per.setdefault(r["strategy"], []).append(r["speedup"])
    return {s: {"geomean_speedup": geomean(v), "cases": len(v)} for s, v in per.items()}


def run(config: BenchConfig, group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Benchmark `config.cases` on every rank of `group` (collective); rank 0 prints the table.

    Without cases in `config`, the default cases of `config.op` for the group's device type run.

    Returns, on every rank, one dict per (case, strategy) with ``status`` ``"ok"`` or
    ``"FAILED"``, timings in ms, ``tflops``, ``speedup``, ``efficiency`` and context, followed per
    case by two context rows (the transfer alone, the GEMM alone). Rank 0 writes
    ``{"machine", "config", "seed", "results", "summary"}`` to `config.json_path` if set.
    Raises RuntimeError if torch.distributed is not initialized, and whatever the ops raise.
    """
    pg = world.resolve_group(group)
    info = world.group_info(pg)
    lead = info.rank == 0
    if not config.cases:
        config = dataclasses.replace(config, cases=tuple(default_cases(config.op, info.device.type, config.dtype)))
    seed = _agree_seed(config.seed, pg)
    machine = machine_info(info)
    table = _Table(config.cases)
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
    all_notes: list[str] = []
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
    if results:
        out(
            "geomean speedup over reference: "
            + ", ".join(f"{s} {v['geomean_speedup']:.2f}x ({v['cases']} case(s))" for s, v in results.items())
        )
    failed = [r for r in rows if r.get("status") == "FAILED"]
    if failed:
        out(f"FAILED: {len(failed)} strategy/case pair(s) did not match reference")
    if "fused" in config.strategies and fused_interpreted(info.device):
        out(
            f"note: fused runs under the Triton interpreter, only for cases with every dim <= "
            f"{INTERPRETED_FUSED_MAX_DIM}; its timings are not in the summary"
        )
    for note in all_notes:
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
