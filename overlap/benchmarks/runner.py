"""The benchmark runner: correctness first, then interleaved timed repeats, then one table.

`run` executes on every rank of the default group (all ranks call it; rank 0 prints). For each
case (`cases.Case`: a tensor-parallel op, a shape, a dtype, a mode; `cases.MoECase`: the MoE
layer, ``T,H,F,E,K``, a dtype, a mode; `cases.SpCase`: a sequence-parallel op, its ``m x k x n``, a dtype, a mode),
`run_case`:

1. Fresh random inputs, seeded per rank and case (rank 0 draws the run's seed unless one is given
   and broadcasts it; the seed is printed so a run can be repeated); `case_data` says how they are
   drawn and scaled. Never zeros.
2. Correctness (`checks`): ``reference`` against the op's result computed locally, then every
   strategy against ``reference``, the forward output and in ``fwd+bwd`` the gradient of every
   input, all ranks agreeing on the verdicts. A mismatch marks the strategy (and so its case)
   FAILED; it is not timed.
3. Timing (`timing`): warm-up, then `iters` interleaved repeats of the plain collectives alone, the
   GEMMs alone, ``reference`` and each strategy, every call between barriers; the time of a repeat
   is the maximum over ranks, a label's time the median over repeats, with p25..p75 as the spread.
4. One row per label (``torch``: the op in plain torch, `baseline`; ``reference``; each strategy;
   ``auto``, the default strategy), then the case's two context rows (`case_rows`).

Reported per row (docs/measuring.md): TFLOP/s (`Case.flops`: 1 GEMM forward, 3 in
``fwd+bwd``; `MoECase.flops`: the mean over ranks of the grouped GEMMs), speedup
``= T_torch / T_strategy`` and beside it ``T_ref / T_strategy``, the plan it ran (`checks.plan_labels`:
``auto``'s choice), and overlap efficiency ``= (T_ref - T_strategy) / min(T_comm, T_compute)``,
the share of the smaller of the two costs that was hidden (1.0 is the limit). ``T_comm`` and
``T_compute`` are the plain collectives alone and the GEMMs alone of the same mode (`case_data`): in
``fwd+bwd`` every collective and every GEMM of the unfused forward and backward, so the efficiency
there is that of the whole training step of the op. Interpreted ``fused`` runs only where every dim
is at most `cases.INTERPRETED_FUSED_MAX_DIM`, is labelled ``(interpreted)``, is timed without warm-up
in at most `timing.INTERPRETED_ITERS` of the repeats (a call costs 0.1-1 s) and is left out of the
geometric means. ``matmul_all_reduce`` also runs the ``+one_shot`` variant of each strategy
(`cases.VARIANTS`), a label of its own. The geometric means (over ``torch``) are per mode over every
op, per op family (tensor-parallel, moe, sequence-parallel) where a run has several, and per op, last; then one line
(and ``auto_vs_torch`` in the JSON) counts the cases where ``auto`` was slower than ``torch`` beyond
the spreads (`report.auto_vs_torch`). Default cases that do not
fit the ranks (MoE experts that do not split evenly, a Llama-3 layer whose heads do not) are left
out with a note, and the last line says how many cases ran of how many were asked (``cases`` in the JSON);
given ones raise ValueError (the command line checks both before any rank starts).

The table, the geometric means, the footnotes and the JSON file are `report`'s. `session` runs the
same check (`checks.check_case`) and times one call at a time (`timing.timed_call`) for the
pytest-benchmark wrappers. Rank 0 shows a progress bar on stderr (`overlap.progress.ProgressBar`): a line
per case, and the case and strategy being checked, warmed up or timed, redrawn on a terminal and a
line every few seconds in a log.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import socket
from typing import Any

import torch
import torch.distributed as dist

from .. import world
from ..progress import Progress, ProgressBar, quiet
from ..version import __version__
from . import report
from .cases import BenchConfig, default_cases
from .checks import Checked, check_case, fused_interpreted, strategies_for
from .definitions import MODES, TORCH, AnyCase, label_plan
from .timing import INTERPRETED_ITERS, profile_case, time_case

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
        f"torch {torch.__version__}{extra}, triton {triton_text}, overlap {__version__}"
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
        "overlap": __version__,
    }


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


def case_rows(checked: Checked, stats: dict[str, dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """One row per strategy label of the case, then its two context rows (see `run`)."""
    case, work, W = checked.case, checked.work, world_size
    comm_label, compute_label = work.comm_label, work.compute_label
    t_comm, t_compute = stats[comm_label]["median_ms"], stats[compute_label]["median_ms"]
    t_ref, t_torch = stats["reference"]["median_ms"], stats[TORCH]["median_ms"]
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
            plan=checked.plans.get(s, ""),
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
                speedup=t_torch / t,
                speedup_vs_reference=t_ref / t,
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
    progress: Progress = quiet,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Check and time one case on every rank; returns (one row per strategy, notes).

    Every rank returns the same rows. Raises whatever the ops raise (timeouts, dead peers):
    only numerical mismatches are recorded as FAILED rows.
    """
    checked = check_case(case, case_index, config, seed, info, pg, progress)
    stats = time_case(checked, config, info, pg, progress)
    rows = case_rows(checked, stats, info.world_size)
    if config.profile:
        profiles = profile_case(checked, config, info, pg, progress)
        for row in rows:
            if row.get("status") != "FAILED" and row["strategy"] in profiles:
                row["profile_ms"] = profiles[row["strategy"]]
    return rows, checked.notes


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
    asked = len(config.cases)
    if not config.cases:
        cases = default_cases(config.ops, info.device.type, config.dtype, config.modes, info.world_size, left_out)
        left_out += [p for c in cases if (p := c.world_problem(info.world_size))]
        cases = [c for c in cases if not c.world_problem(info.world_size)]
        if not cases:
            raise ValueError(f"no default case of {config.ops} runs on {info.world_size} ranks: {'; '.join(left_out)}")
        config = dataclasses.replace(config, cases=tuple(cases))
        # a preset's layers count whether or not they split over these ranks: one rank splits every one
        asked = len(default_cases(config.ops, info.device.type, config.dtype, config.modes, 1))
    counts = {"ran": len(config.cases), "asked": asked}
    seed = _agree_seed(config.seed, pg)
    machine = machine_info(info)
    table = report.Table(config.cases, config.strategies, fused_interpreted(info.device), wide=config.wide)
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
    for line in table.header():
        out(line)
    rows: list[dict[str, Any]] = []
    all_notes = [f"left out: {p}" for p in left_out]
    for i, case in enumerate(config.cases):
        running = ", ".join(strategies_for(case, config, info)[0])
        bar.line(f"[{i + 1}/{len(config.cases)}] {case.name}: {running} ({bar.elapsed():.1f} s)")

        def progress(fraction: float, text: str, i: int = i) -> None:
            bar.update((i + fraction) / len(config.cases), text)

        rows_i, notes = run_case(case, i, config, seed, info, pg, progress if lead else quiet)
        rows.extend(rows_i)
        all_notes.extend(n for n in notes if n not in all_notes)
        for line in table.case_lines(case.name, rows_i):
            out(line)
        for line in report.profile_lines(rows_i):
            out(line)

    results = report.summary(rows)
    out()
    modes = tuple(m for m in MODES if any(c.mode == m for c in config.cases))
    families = tuple(dict.fromkeys(report.family(c.op) for c in config.cases))
    ops = tuple(dict.fromkeys(c.op for c in config.cases))
    for line in report.summary_lines(results, modes, families, ops):
        out(line)
    slower = report.auto_vs_torch(rows)
    out(report.auto_vs_torch_line(slower))
    failed = [r for r in rows if r.get("status") == "FAILED"]
    if failed:
        out(f"FAILED: {len(failed)} strategy/case pair(s) did not match reference")
    for note in report.notes(config, fused_interpreted(info.device), min(config.iters, INTERPRETED_ITERS)) + all_notes:
        out(f"note: {note}")
    out(report.counts_line(counts))
    bar.finish(f"done in {bar.elapsed():.1f} s")
    if lead and config.json_path:
        report.write_json(
            config.json_path,
            {
                "machine": machine,
                "config": {**{k: v for k, v in dataclasses.asdict(config).items() if k != "wide"},  # how it printed
                           "cases": [c.record() for c in config.cases]},
                "seed": seed,
                "results": rows,
                "summary": results,
                "auto_vs_torch": slower,
                "cases": counts,
            },
        )
    return rows
