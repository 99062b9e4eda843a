"""What the cost model expects of one call on a described cluster, and why: ``overlap predict``'s rows.

`forecast` scores every strategy that can run the `Problem` on the `Topology` (each at its best chunk counts per
link, `costmodel.rank_candidates`), the plain collectives and GEMMs (``reference``, whose parts are the
communication alone and the GEMMs alone), ``auto``'s choice (`auto.described_plan`), and says where overlap does not
pay and why (`Forecast.verdict`). Pure: no ranks, no torch tensors.
"""

from __future__ import annotations

import dataclasses
import math

from .auto import described_plan
from .costmodel import Prediction, Profile, Topology, predict, rank_candidates
from .optable import Problem
from .plan import Plan

#: an overlapped plan that saves less than this share of ``reference`` is marginal (the model's error is larger)
MARGINAL = 0.05


@dataclasses.dataclass(frozen=True)
class Row:
    """One strategy at its best plan: `label` (the strategy, ``+one_shot`` for that variant), the plan, its
    prediction."""

    label: str
    plan: Plan
    prediction: Prediction

    @property
    def seconds(self) -> float:
        return self.prediction.total_s


@dataclasses.dataclass(frozen=True)
class Forecast:
    """The model's view of one call: `reference` (its ``comm_s`` is the communication alone, ``compute_s`` the
    GEMMs alone), `rows` (every strategy at its best plan; ``inf`` where it cannot run, with the reason in its
    ``detail``), `auto` (its plan, seconds and how it was chosen), `links` (the topology's link classes)."""

    problem: Problem
    topology: Topology
    reference: Prediction
    rows: tuple[Row, ...]
    auto: Row
    auto_how: str
    links: tuple[str, ...]

    @property
    def best(self) -> Row | None:
        """The fastest overlapped strategy (not ``reference``), None where none can run."""
        runnable = [r for r in self.rows if r.label != "reference" and math.isfinite(r.seconds)]
        return min(runnable, key=lambda r: r.seconds, default=None)

    def hidden(self, row: Row) -> float:
        """The share of the communication `row` hides: ``(T_reference - T) / T_comm``, from 0 (it hides none) to 1 (a
        plan that saves more than the communication saves launches or interference of the plain path too)."""
        comm = self.reference.comm_s
        if comm <= 0 or not math.isfinite(row.seconds):
            return 0.0
        return min(1.0, max(0.0, self.reference.total_s - row.seconds) / comm)

    def speedup(self, row: Row) -> float:
        return self.reference.total_s / row.seconds if row.seconds > 0 else math.inf

    @property
    def verdict(self) -> str:
        """Whether overlap pays here and why, in one sentence."""
        ref, best = self.reference, self.best
        comm, gemm = ref.comm_s, ref.compute_s
        if best is None:
            return "no overlapped strategy runs here: reference only"
        bound = min(comm, gemm)  # what perfect overlap could hide
        saved = ref.total_s - best.seconds
        why = _why_small(self.problem, comm, gemm)
        if saved <= 0:
            extra = best.seconds - (ref.total_s - bound)
            return (f"overlap does not pay: at most {_us(bound)} could be hidden (the smaller of communication "
                    f"{_us(comm)} and GEMMs {_us(gemm)}), and the best overlapped plan ({best.label}) adds "
                    f"{_us(extra)} of its own (fixed per-call and per-chunk costs, interference, chunked GEMMs that "
                    f"read their weight again){why}")
        if saved < MARGINAL * ref.total_s:
            return (f"marginal: {best.label} saves {_us(saved)} of {_us(ref.total_s)} ({saved / ref.total_s:.0%}, "
                    f"within the model's error){why}")
        return (f"overlap pays: {best.label} hides {self.hidden(best):.0%} of the communication, "
                f"{ref.total_s / best.seconds:.2f}x reference")

    def to_json(self) -> dict:
        def row(r: Row) -> dict:
            finite = math.isfinite(r.seconds)
            return {"strategy": r.label, "plan": r.plan.label(self.links) if finite else None,
                    "chunks": dict((c, r.plan.chunks_for(c)) for c in self.links) if finite and r.label != "reference"
                    else {}, "predicted_s": r.seconds if finite else None,
                    "speedup": self.speedup(r) if finite else None,
                    "hidden": self.hidden(r) if finite else None,
                    "why_not": None if finite else r.prediction.detail}

        return {"problem": self.problem.key, "topology": self.topology.signature,
                "unfused_s": self.reference.total_s, "gemm_alone_s": self.reference.compute_s,
                "comm_alone_s": self.reference.comm_s, "strategies": [row(r) for r in self.rows],
                "auto": {**row(self.auto), "how": self.auto_how}, "verdict": self.verdict}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def _why_small(problem: Problem, comm: float, gemm: float) -> str:
    """The shape's reason overlap has little to win, where one stands out (a clause to append, or empty)."""
    if problem.spec.family == "tp" and problem.m < 64:
        return f"; {problem.m} rows per rank is a decode-sized call: launches and latencies dominate"
    if comm < 0.1 * gemm:
        return "; the communication is under a tenth of the GEMMs: there is little to hide"
    if gemm < 0.1 * comm:
        return "; the GEMMs are under a tenth of the communication: they hide little of it"
    return ""


def forecast(problem: Problem, topology: Topology, profile: Profile) -> Forecast:
    """The model's `Forecast` of `problem` on `topology` with `profile` (see the module docstring). Raises
    ValueError where the problem does not fit the topology (MoE experts that do not divide over the ranks)."""
    ranked = rank_candidates(problem, topology, profile)
    best: dict[str, Row] = {}
    for plan, pred in ranked:  # fastest first: the first plan of each label is its best
        label = plan.strategy + ("+one_shot" if plan.one_shot else "")
        best.setdefault(label, Row(label, plan, pred))
    reference = best["reference"].prediction
    # the strategies the candidates leave out here (fused on CPU ranks, symm and fused across nodes, hierarchical on
    # GPUs across nodes): inf, with the model's reason; hierarchical on one node runs as symm (no row of its own)
    for strategy in problem.spec.strategies:
        if strategy in best or (strategy == "hierarchical" and topology.num_nodes == 1):
            continue
        pred = predict(problem, Plan(strategy), topology, profile) if topology.world_size > 1 else None
        if pred is None or math.isfinite(pred.total_s):
            pred = Prediction(math.inf, math.inf, math.inf, f"{strategy}: not a candidate on this group")
        best[strategy] = Row(strategy, Plan(strategy), pred)
    plan, how = described_plan(problem, topology, profile)
    auto = Row("auto", plan, predict(problem, plan, topology, profile))
    order = {s: i for i, s in enumerate(problem.spec.strategies)}
    rows = tuple(sorted(best.values(), key=lambda r: (order.get(r.label.split("+")[0], 99), r.label)))
    return Forecast(problem, topology, reference, rows, auto, how, tuple(c for c, _ in topology.links))


__all__ = ["MARGINAL", "Forecast", "Row", "forecast"]
