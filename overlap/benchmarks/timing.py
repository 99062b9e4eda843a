"""Timing a checked case: warm-up, then interleaved timed repeats of every label (`time_case`), each
call timed on every rank between barriers (`timed_call`), and the repeats reduced to a median and
spread (`summarize`).

After the correctness check (`checks.check_case`), `iters` interleaved repeats: the plain
collectives alone, the GEMMs alone, ``reference``, then each strategy that passed, and again, so
that drift (clocks, other load) hits every label alike. A ``fwd`` call is the op's forward; a
``fwd+bwd`` call is the forward, then the backward of that fresh output with a fixed random
``grad_out`` (``torch.autograd.grad``, so nothing accumulates; `case_data.strategy_fn`). Each timing
sits between ``dist.barrier()`` calls, measured on the host with `time.perf_counter` (after
``torch.cuda.synchronize()`` on GPUs). One ``all_gather_object`` per case collects the timings; the
time of a repeat is the maximum over ranks (a collective op is as slow as its slowest rank), and a
label's time is the median over repeats, with p25..p75 as the spread. Interpreted ``fused`` is
timed without warm-up in at most `INTERPRETED_ITERS` of the repeats (a call costs 0.1-1 s).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import stages, world
from ..progress import Progress, quiet
from . import report
from .cases import BenchConfig
from .checks import Checked

#: timed repeats of interpreted fused at most (no warm-up): ~0.1-1 s a call, and out of the summaries
INTERPRETED_ITERS = 3


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
    checked: Checked, config: BenchConfig, info: world.GroupInfo, pg: dist.ProcessGroup, progress: Progress = quiet
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


#: calls per label of a profile (`profile_case`), and of interpreted fused (a call costs 0.1-1 s)
PROFILE_CALLS, PROFILE_INTERPRETED_CALLS = 5, 1


def profile_case(
    checked: Checked, config: BenchConfig, info: world.GroupInfo, pg: dist.ProcessGroup, progress: Progress = quiet
) -> dict[str, dict[str, float]]:
    """Where each label's host time goes (``overlap bench --profile``): `PROFILE_CALLS` more calls of every label,
    each between barriers as timed, with `overlap.stages` collecting. Returns per label the milliseconds per call,
    mean over ranks: ``total``, each stage's own time, ``outside`` (the call's time outside every stage of the
    calling thread) and a helper thread's stages (their names end ``(helper thread)``: beside the call, not in
    it). The same on every rank (one ``all_gather_object``)."""
    mine: dict[str, dict[str, float]] = {}
    for label, fn in checked.fns.items():
        calls = PROFILE_INTERPRETED_CALLS if label in checked.slow else PROFILE_CALLS
        progress(1.0, f"{checked.case.name}: profiling {label}")
        total, spent = 0.0, {}
        for _ in range(calls):
            with stages.collecting() as got:
                total += timed_call(fn, info.device, pg)
            for name, s in got.items():
                spent[name] = spent.get(name, 0.0) + s
        inside = sum(s for name, s in spent.items() if not name.endswith(stages.HELPER))
        mine[label] = {"total": total, **spent, "outside": max(0.0, total - inside)}
        mine[label] = {name: s * 1e3 / calls for name, s in mine[label].items()}
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, mine, group=pg)
    out: dict[str, dict[str, float]] = {}
    for label in checked.fns:
        names = dict.fromkeys(name for r in every for name in r[label])
        out[label] = {name: sum(r[label].get(name, 0.0) for r in every) / len(every) for name in names}
    return out
