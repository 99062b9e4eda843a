"""Correctness before timing: which strategies of a case run, and every one of them checked on
every rank (`check_case`) before `timing` times any.

The inputs are fresh and random, seeded per rank and case (`case_data` says how they are drawn
and scaled; never zeros), so every rank can regenerate every rank's inputs: ``reference`` and
``torch`` (the op in plain torch, `baseline`) are checked against the op's result computed locally
(`case_data.Expected`), then every strategy and ``auto`` against ``reference``, with
`torch.testing.assert_close` at `tolerance`: the forward output, and in ``fwd+bwd`` also the
gradient of every input (``grad_a`` and ``grad_b``; moe: ``grad_x``,
``grad_w1``, ``grad_w2``, ``grad_topk_weights``). The verdicts of all ranks are gathered, so every
rank agrees on which strategies to time. A mismatch marks the strategy (and so its case) FAILED;
it is not timed. A wrong ``reference`` or ``torch`` is still timed, as a baseline of the others.

The labels a case runs (`strategies_for`) are the run's labels of its op (``torch`` and ``reference``
first, ``auto`` last); ``symm`` and ``fused``
only within one node, and ``fused`` under the Triton interpreter (`fused_interpreted`) only where
the case fits it (`definitions.INTERPRETED_FUSED_MAX_DIM`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import envs, world
from ..ops import fused
from ..plans import Plan
from ..plans.auto import resolve_auto
from ..progress import Progress, quiet
from ..workloads import leaf_dtype
from . import report
from .case_data import CaseData, Expected, build, strategy_fn
from .cases import BenchConfig
from .definitions import AUTO, FP8_DTYPES, TORCH, AnyCase, bench_labels, label_plan


def tolerance(dtype: torch.dtype, reduction: int, strategy: str, device_type: str) -> dict[str, float]:
    """``assert_close`` tolerances of `strategy` against ``reference`` for a tensor of order 1 whose
    entries are dot products of length `reduction`.

    bf16/fp16: ``rtol=1.6e-2, atol=1e-2`` (docs/design.md); fp8 cases (the recipe on bf16 leaves, every
    strategy multiplying the same quantized values) as bf16. fp32: ``rtol=1e-5`` and
    ``atol=1e-5 * max(1, sqrt(reduction/256))``: the rounding error of a length-``L`` fp32 dot
    product grows like ``sqrt(L)``, so docs/design.md's ``1e-5`` holds as is up to ``L = 256`` and is
    widened with the same margin beyond (2.8e-5 at ``L = 2048``). ``fused`` fp32 on a GPU runs its
    ``tl.dot`` as TF32 (docs/strategies.md) and gets ``rtol=atol=1e-2``. Forward outputs are of order 1 by
    the inputs' scaling (`case_data`); gradients can be larger (``grad_b`` sums ``W*m`` products of
    order 1), and `_tolerances` multiplies ``atol`` by a tensor's RMS where that exceeds 1.
    """
    if leaf_dtype(dtype) in (torch.bfloat16, torch.float16):
        return {"rtol": 1.6e-2, "atol": 1e-2}
    if strategy == "fused" and device_type == "cuda":
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 1e-5, "atol": 1e-5 * max(1.0, math.sqrt(reduction / 256))}


def fused_interpreted(device: torch.device) -> bool:
    """Whether ``fused`` runs under the Triton interpreter on ranks computing on `device`."""
    return device.type != "cuda" or fused.interpreted()


def _tolerances(
    case: AnyCase, expected: list[Expected], device_type: str, strategies: list[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per strategy label, per tensor (``out``, then the gradients; `case_data.Expected`): `tolerance`,
    with ``atol`` multiplied by the tensor's RMS where that exceeds 1, or for a sum over ranks by the RMS of the
    partials' summed magnitudes where larger (`Expected.magnitude`: each rank's partial, rounded in 16 bits before
    the sum, is off by a share of its own size, however much the sum cancels)."""
    scales = {e.what: (e.reduction, _scale(e)) for e in expected}
    tols: dict[str, dict[str, dict[str, float]]] = {}
    for label in strategies:
        s = report.base_strategy(case.op, label)
        tols[label] = {}
        for what, (reduction, scale) in scales.items():
            tol = tolerance(case.torch_dtype, reduction, s, device_type)
            tols[label][what] = dict(tol, atol=tol["atol"] * scale)
    return tols


def _scale(expected: Expected) -> float:
    """What `tolerance`'s ``atol`` is multiplied by for `expected`: 1, its RMS, or its terms' (`_tolerances`)."""
    return max(1.0, float(expected.value.double().pow(2).mean().sqrt()), expected.magnitude)


def _widening(expected: list[Expected]) -> list[torch.Tensor | None]:
    """Per tensor, where it has `Expected.terms`, the factor (at least 1) each element's ``atol`` grows by beyond
    the tensor's (its terms' size over the tensor's scale); None for the others."""
    return [None if e.terms is None else (e.terms.double() / _scale(e)).clamp(min=1.0) for e in expected]


def _compare(
    actual: list[torch.Tensor], expected: list[torch.Tensor], tols: dict[str, dict[str, float]], what: str,
    widening: list[torch.Tensor | None],
) -> str | None:
    """None if every tensor is close, else a one-line description of the first mismatch. Where a tensor's
    `widening` ``s`` is given, both sides are divided by it first: ``|x - e| <= atol * s + rtol * |e|``, each
    element held to its own terms' size (the message's differences are then in those units)."""
    for (name, tol), x, e, s in zip(tols.items(), actual, expected, widening, strict=True):
        if s is not None:
            x, e, name = x.double() / s, e.double() / s, f"{name}, over each element's terms"
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


def strategies_for(case: AnyCase, config: BenchConfig, info: world.GroupInfo) -> tuple[list[str], list[str]]:
    """(strategy labels to run for `case`, notes on the ones left out)."""
    run, notes = [], []
    interpreted = fused_interpreted(info.device)
    for label in config.strategies:
        if label not in bench_labels(case.op):
            continue  # a variant of another op
        s = report.base_strategy(case.op, label)
        if s in ("symm", "fused") and not info.single_node:
            notes.append(f"{label} skipped: the group spans nodes {info.node_names}")
        elif s == "fused" and interpreted and not case.fits_interpreted_fused:
            continue  # the footnote of the table says why
        else:
            run.append(label)
    return run, notes


def plan_labels(case: AnyCase, labels: list[str], info: world.GroupInfo) -> dict[str, str]:
    """The plan each row label runs, as `overlap.Plan.label` writes it for the link classes of the group
    (``auto``: the plan it resolves to for this case, as the op's own call resolves it; ``torch``: what it is)."""
    links = tuple(sorted({info.link_class(p) for p in range(info.world_size) if p != info.rank}))
    spec, W = case.problem.spec, info.world_size
    out = {}
    for label in labels:
        strategy, fields = label_plan(case.op, label)
        if label == TORCH:
            out[label] = "torch.distributed + " + ("torch._scaled_mm" if case.dtype in FP8_DTYPES else "torch.matmul")
            continue
        if strategy == AUTO:
            rows = None if spec.family == "moe" else spec.in_rows(case.problem.m, W)
            itemsize = leaf_dtype(case.torch_dtype).itemsize  # (the output's: an fp8 case's is bf16)
            out_bytes = 0 if rows is None else spec.out_rows(case.problem.m, W) * case.problem.n * itemsize
            op, dtype = case.op, case.dtype
            if spec.family == "moe":  # as the dispatch resolves it: its tokens' dtype, its problem's key (fp8's)
                op, dtype = "dispatch_grouped_matmul", str(leaf_dtype(case.torch_dtype)).removeprefix("torch.")
            plan = resolve_auto(op, f"overlap bench {case.name}", info, rows, dtype, out_bytes, case.problem)
        else:
            plan = Plan(strategy, **fields)
        out[label] = plan.label(links)
    return out


@dataclasses.dataclass
class Checked:
    """One case on this rank after its correctness check (`check_case`): what there is to time."""

    case: AnyCase
    labels: list[str]  # the row labels run for the case: torch, reference, the strategies, auto
    failed: dict[str, str]  # label -> the lowest failing rank's message (the same on every rank)
    notes: list[str]
    work: CaseData
    tols: dict[str, dict[str, dict[str, float]]]
    fns: dict[str, Callable[[], Any]]  # what is timed: the collectives alone, the GEMMs alone, the labels that passed
    slow: set[str]  # labels under the Triton interpreter: no warm-up, at most timing.INTERPRETED_ITERS repeats
    interpreted: bool  # whether fused runs under the interpreter on these ranks
    plans: dict[str, str] = dataclasses.field(default_factory=dict)  # label -> the plan it runs (`plan_labels`)

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
    progress: Progress = quiet,
) -> Checked:
    """Build one case's inputs on every rank and check every strategy against ``reference`` (and
    ``reference`` against the local oracle); every rank returns the same verdicts (one
    ``all_gather_object``). Raises whatever the ops raise: only mismatches are recorded."""
    rank, device = info.rank, info.device
    interpreted = fused_interpreted(device)
    labels, notes = strategies_for(case, config, info)
    units = len(labels) + config.warmup + config.iters
    timeout = envs.resolve_timeout(config.timeout)
    work = build(case, seed, case_index, info, pg, timeout)
    calls = {label: strategy_fn(work, case, label, config.timeout) for label in labels}
    tols = _tolerances(case, work.expected, device.type, labels)

    errors: dict[str, str] = {}
    oracle = [e.value for e in work.expected]
    widening = _widening(work.expected)
    progress(0.0, f"{case.name}: checking reference")
    y_ref = calls["reference"]()
    for label, y in (("reference", y_ref), (TORCH, calls[TORCH]() if TORCH in calls else None)):
        err = y is not None and _compare(y, oracle, tols[label], f"rank {rank}: {label} vs the local {case.op}",
                                           widening)
        if err:
            errors[label] = err
    del oracle
    work.expected.clear()
    for i, label in enumerate(labels, 1):
        if label in ("reference", TORCH):
            continue
        progress(i / units, f"{case.name}: checking {report.display_label(case.op, label, interpreted)}")
        err = _compare(calls[label](), y_ref, tols[label], f"rank {rank}: {label} vs reference", widening)
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
    # A wrong reference or torch is still a baseline of the others; a wrong strategy is not timed.
    fns.update({s: calls[s] for s in labels if s in ("reference", TORCH) or s not in failed})
    slow = {label for label in fns if label in labels and report.is_interpreted(case.op, label, interpreted)}
    return Checked(case, labels, failed, notes + work.notes, work, tols, fns, slow, interpreted,
                   plan_labels(case, labels, info))
