"""What ``overlap bench`` prints and writes besides the timings: the table, the geometric means, the
footnotes, the JSON file (`runner` measures; this module says what the measurements are).

The table (`Table`) fits 120 columns, each case's name over its rows, or with ``--wide`` is one line per row.
Strategy labels are shown as the runner ran them: interpreted ``fused`` gets ``(interpreted)``
(`display_label`) and stays out of the geometric means (rows with ``in_summary`` false); the ``plan``
column is the plan each row ran (``auto``'s choice among them), written by `overlap.Plan.label`.
Speedups are over ``torch`` (the op in plain torch, `baseline`), with the speedup over ``reference``
beside them. The geometric-mean speedups (`summary`, `summary_lines`) are per mode, over all modes,
per op family (tensor-parallel, moe, sequence-parallel) where a run has several, and per op, last; they include
``reference`` and ``auto``. `auto_vs_torch` counts the cases where ``auto`` was slower than ``torch``
beyond the run's noise: by more than a tenth of ``torch``'s median or half the wider p25..p75 spread,
whichever is larger (`slower_than_torch`; the goal is none).
"""

from __future__ import annotations

import json
import math
import textwrap
from typing import Any

from .. import stages
from ..plans.planfile import write_atomic
from .definitions import (
    AUTO,
    INTERPRETED_FUSED_MAX_DIM,
    MODES,
    MOE_OPS,
    SP_OPS,
    TORCH,
    VARIANTS,
    AnyCase,
    all_bench_labels,
    bench_labels,
    label_plan,
)


def base_strategy(op: str, label: str) -> str:
    """The strategy of a label (``symm+one_shot`` -> ``symm``)."""
    return label_plan(op, label)[0]


def is_interpreted(op: str, label: str, interpreted: bool) -> bool:
    """Whether `label` of `op` runs under the Triton interpreter (`interpreted`: `checks.fused_interpreted`)."""
    return interpreted and base_strategy(op, label) == "fused"


def display_label(op: str, label: str, interpreted: bool) -> str:
    """The label as the table shows it: ``(interpreted)`` after interpreted fused ones."""
    return f"{label} (interpreted)" if is_interpreted(op, label, interpreted) else label


def geomean(values: list[float]) -> float:
    """The geometric mean of positive `values` (at least one)."""
    return math.exp(sum(math.log(v) for v in values) / len(values))


class Table:
    """The aligned text table, printed case by case (widths fixed up front from the cases and labels).

    Narrow, the default: at most `WIDTH` columns (a case name alone takes up to ~90): the header, then per case its
    name on a line of its own and its rows below it, indented, without the case column; narrower number columns
    (``ovl eff``: overlap efficiency); a plan label that does not fit is wrapped at its spaces onto lines below, in
    its column, and a long FAILED error likewise. Wide (``overlap bench --wide``): one line per row, the case name
    first, about 200 columns. The JSON file is the same either way."""

    HEADS = ("case", "strategy", "median ms", "p25..p75 ms", "TFLOP/s", "GB/s", "speedup", "vs ref", "overlap eff",
             "plan")
    #: the narrow form's heads of the columns after the strategy (the case is a line of its own)
    NARROW_HEADS = ("median ms", "p25..p75 ms", "TFLOP/s", "GB/s", "speedup", "vs ref", "ovl eff", "plan")
    #: the widths of the number columns (median ms .. overlap eff), wide and narrow
    WIDE_WIDTHS = (10, 15, 8, 7, 8, 7, 11)
    NARROW_WIDTHS = (9, 14, 7, 6, 7, 6, 7)
    #: the narrow form's width in columns
    WIDTH = 120
    #: the narrow form's indent of a row under its case
    INDENT = "  "

    def __init__(self, cases: tuple[AnyCase, ...], strategies: tuple[str, ...], interpreted: bool,
                 wide: bool = False):
        self.wide = wide
        self.w_case = max(len(self.HEADS[0]), *(len(c.name) for c in cases))
        labels = [display_label(c.op, s, interpreted) for c in cases for s in strategies if s in bench_labels(c.op)]
        self.w_strategy = max(len(self.HEADS[1]), len("(reduce_scatter alone)"), *map(len, labels))

    def line(self, case: str, strategy: str, *cols: str) -> str:
        """One wide line: the case, the strategy, the number columns, the plan (left-aligned, last)."""
        return f"{case:<{self.w_case}}  {strategy:<{self.w_strategy}} {self._tail(cols, self.WIDE_WIDTHS)}".rstrip()

    @staticmethod
    def _tail(cols: tuple[str, ...], widths: tuple[int, ...]) -> str:
        tail = " ".join(c.rjust(w) for c, w in zip(cols, widths, strict=False))
        if len(cols) > len(widths):  # the plan, left-aligned last
            tail += "  " + cols[-1]
        return tail

    def header(self) -> list[str]:
        """The header: one line (wide), or ``case`` over the indented heads of its rows (narrow)."""
        if self.wide:
            return [self.line(*self.HEADS)]
        return [self.HEADS[0], self._narrow_line(self.HEADS[1], self.NARROW_HEADS)[0]]

    def case_lines(self, case: str, rows: list[dict[str, Any]]) -> list[str]:
        """The lines of one case's `rows` (`runner.case_rows`): a line per row (wide), or the case's name, then
        a line per row (narrow; a long plan or error wraps onto more)."""
        if self.wide:
            return [self.row(r) for r in rows]
        return [*textwrap.wrap(case, self.WIDTH, break_long_words=False, break_on_hyphens=False,
                               subsequent_indent=2 * self.INDENT), *(ln for r in rows for ln in self.row_lines(r))]

    def row(self, r: dict[str, Any]) -> str:
        """The wide line of one row."""
        name = r.get("label", r["strategy"])
        if r.get("status") == "FAILED":
            return f"{r['case']:<{self.w_case}}  {name:<{self.w_strategy}} FAILED  {r['error']}"
        return self.line(r["case"], name, *self._cols(r))

    def row_lines(self, r: dict[str, Any]) -> list[str]:
        """The narrow lines of one row, under its case's name: one, or more where its plan or error is long."""
        name = r.get("label", r["strategy"])
        if r.get("status") == "FAILED":
            text = f"{self.INDENT}{name:<{self.w_strategy}} FAILED  {r['error']}"
            if len(text) <= self.WIDTH:
                return [text]
            return textwrap.wrap(text, self.WIDTH, break_long_words=False, break_on_hyphens=False,
                                 subsequent_indent=" " * (len(self.INDENT) + self.w_strategy + 1))
        return self._narrow_line(name, self._cols(r))

    def _narrow_line(self, name: str, cols: tuple[str, ...]) -> list[str]:
        """The narrow line of a strategy and its columns; a plan past `WIDTH` wrapped below, in its column (or
        below the row, indented, where its column has too little room left): no line is longer than `WIDTH`."""
        has_plan = len(cols) > len(self.NARROW_WIDTHS)
        number_cols = cols[:-1] if has_plan else cols
        text = f"{self.INDENT}{name:<{self.w_strategy}} {self._tail(number_cols, self.NARROW_WIDTHS)}".rstrip()
        plan = cols[-1] if has_plan else ""
        if not plan:
            return [text]
        start = len(text) + 2
        if start + len(plan) <= self.WIDTH:
            return [f"{text}  {plan}"]
        room = self.WIDTH - start
        pieces = textwrap.wrap(plan, room, break_long_words=False, break_on_hyphens=False) if room >= 16 else []
        if pieces and max(map(len, pieces)) <= room:  # the plan's own column, wrapped at its spaces
            return [f"{text}  {pieces[0]}", *(" " * start + piece for piece in pieces[1:])]
        indent = 2 * self.INDENT  # no room in its column: below the row
        return [text, *textwrap.wrap(plan, self.WIDTH, break_on_hyphens=False, initial_indent=indent,
                                     subsequent_indent=indent)]

    @staticmethod
    def _cols(r: dict[str, Any]) -> tuple[str, ...]:
        """The columns after the strategy of a row that ran: median, spread, rates, speedups, efficiency, plan."""
        spread = f"{r['p25_ms']:.2f}..{r['p75_ms']:.2f}"
        dash = "-"
        if r.get("context") == "comm":
            return (f"{r['median_ms']:.3f}", spread, dash, f"{r['comm_gbps']:.3g}", dash, dash, dash)
        if r.get("context") == "compute":
            return (f"{r['median_ms']:.3f}", spread, f"{r['compute_tflops']:.3g}", dash, dash, dash, dash)
        return (
            f"{r['median_ms']:.3f}",
            spread,
            f"{r['tflops']:.3g}",
            dash,
            f"{r['speedup']:.2f}x",
            f"{r['speedup_vs_reference']:.2f}x",
            f"{r['efficiency']:+.2f}",
            r.get("plan", ""),
        )


_ORDER = all_bench_labels()


def family(op: str) -> str:
    """``"moe"``, ``"sequence-parallel"`` or ``"tensor-parallel"``: the op families the summary also reports apart."""
    return "moe" if op in MOE_OPS else "sequence-parallel" if op in SP_OPS else "tensor-parallel"


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Geometric-mean speedup over ``torch`` per row label (``reference`` and ``auto`` included) over the
    cases where it passed (interpreted fused left out): over all cases, per mode (``by_mode``), per op
    family (``by_family``, `family`) and per op (``by_op``); over all cases also the geometric mean of
    the speedups over ``reference`` (``geomean_speedup_vs_reference``)."""
    per: dict[str, dict[str, dict[str, list[float]]]] = {}
    vs_ref: dict[str, list[float]] = {}
    for r in rows:
        if r.get("in_summary") and r["strategy"] != TORCH and "speedup" in r:
            scopes = per.setdefault(r["strategy"], {"by_mode": {}, "by_family": {}, "by_op": {}})
            for scope, key in (("by_mode", r["mode"]), ("by_family", family(r["op"])), ("by_op", r["op"])):
                scopes[scope].setdefault(key, []).append(r["speedup"])
            vs_ref.setdefault(r["strategy"], []).append(r["speedup_vs_reference"])
    out = {}
    for s, scopes in sorted(per.items(), key=lambda kv: _ORDER.index(kv[0]) if kv[0] in _ORDER else len(_ORDER)):
        every = [v for mode in MODES for v in scopes["by_mode"].get(mode, [])]
        out[s] = {"geomean_speedup": geomean(every), "cases": len(every),
                  "geomean_speedup_vs_reference": geomean(vs_ref[s])}
        for scope, groups in scopes.items():
            out[s][scope] = {key: {"geomean_speedup": geomean(v), "cases": len(v)} for key, v in groups.items()}
    return out


def summary_lines(
    results: dict[str, dict[str, Any]], modes: tuple[str, ...], families: tuple[str, ...], ops: tuple[str, ...]
) -> list[str]:
    """The geometric means: per mode, over all modes, per op family where a run has several, per op last."""
    lines = []
    scopes = [(m, lambda s, m=m: results[s]["by_mode"].get(m)) for m in modes]
    if len(modes) > 1:
        scopes.append(("all", lambda s: results[s]))
    if len(families) > 1:
        scopes += [(f"{f}, all modes", lambda s, f=f: results[s]["by_family"].get(f)) for f in families]
    every_mode = "all modes" if len(modes) > 1 else modes[0] if modes else ""
    scopes += [(f"op {op}, {every_mode}", lambda s, op=op: results[s]["by_op"].get(op)) for op in ops]
    for scope, get in scopes:
        parts = [f"{s} {v['geomean_speedup']:.2f}x ({v['cases']})" for s in results if (v := get(s))]
        if parts:
            lines.append(f"geomean speedup over torch, {scope}: " + ", ".join(parts))
    return lines


#: `auto_vs_torch`: ``auto``'s median may exceed ``torch``'s by this share of it (or by half the wider spread)
SLOWER_MARGIN = 0.10


def slower_than_torch(auto: dict[str, Any], torch_row: dict[str, Any]) -> bool:
    """Whether ``auto``'s median exceeds ``torch``'s by more than the larger of `SLOWER_MARGIN` of ``torch``'s median
    and half the wider of their p25..p75 spreads (what one run can tell apart from noise)."""
    spread = max(auto["p75_ms"] - auto["p25_ms"], torch_row["p75_ms"] - torch_row["p25_ms"])
    return auto["median_ms"] - torch_row["median_ms"] > max(SLOWER_MARGIN * torch_row["median_ms"], spread / 2)


def auto_vs_torch(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The cases where ``auto`` was slower than ``torch`` beyond the noise of the run (`slower_than_torch`).
    ``{"slower": count, "compared": cases with both timed, "cases": [names]}``; the goal is none."""
    timed = {(r["case"], r["strategy"]): r for r in rows if "p25_ms" in r and "context" not in r}
    cases = list(dict.fromkeys(case for case, label in timed if label == AUTO and (case, TORCH) in timed))
    slower = [c for c in cases if slower_than_torch(timed[(c, AUTO)], timed[(c, TORCH)])]
    return {"slower": len(slower), "compared": len(cases), "cases": slower}


def auto_vs_torch_line(result: dict[str, Any]) -> str:
    """One line of `auto_vs_torch`'s result."""
    text = (f"auto slower than torch beyond max({SLOWER_MARGIN:.0%}, half the wider p25..p75 spread) in "
            f"{result['slower']} of {result['compared']} case(s)")
    return text + (": " + "; ".join(result["cases"]) if result["cases"] else " (goal: none)")


def counts_line(counts: dict[str, int]) -> str:
    """The run's last line: how many cases ran of how many were asked (`counts`: ``ran``, ``asked``)."""
    ran, asked = counts["ran"], counts["asked"]
    if ran == asked:
        return f"cases: all {asked} ran"
    return f"cases: {ran} of {asked} ran; {asked - ran} left out on these ranks (the notes above say why)"


def notes(config: Any, interpreted: bool, interpreted_iters: int) -> list[str]:
    """The footnotes that apply to a run of `config` (a `cases.BenchConfig`; `interpreted`: whether
    fused runs under the Triton interpreter there, timed in at most `interpreted_iters` repeats)."""
    lines = [
        "torch = the op in plain torch (torch.distributed collectives and torch.matmul, no code of overlap on "
        "its timed path), the baseline of 'speedup'; 'vs ref' = the speedup over reference; auto = the default "
        "strategy, its plan in the plan column"
    ]
    ops = {c.op for c in config.cases}
    if any(c.backward for c in config.cases):
        lines.append(
            "fwd+bwd: forward, then backward of the fresh output with a fixed random grad_out; "
            "(comm alone) = the plain collectives of the unfused forward and backward back to back, "
            "(GEMMs alone) = its 3 GEMMs (moe: 6 grouped GEMMs)"
        )
    if ops & set(MOE_OPS):
        lines.append(
            "moe: one MoE layer's experts, dispatch_grouped_matmul -> gelu -> grouped_matmul_combine, with a "
            "fixed uneven routing per case (shape T,H,F,E,K: tokens per rank, hidden, expert FFN, experts, top-k); "
            "(all_to_alls alone) = all_to_all_single of the counts and of the rows both ways; (GEMMs alone) = the "
            "grouped GEMMs on this rank's received rows; TFLOP/s and GB/s count the mean rows per rank"
        )
    if ops & set(SP_OPS):
        lines.append(
            "matmul_all_to_all, all_to_all_matmul: sequence parallelism (DeepSpeed-Ulysses attention's projections), "
            "shape m x k x n: m rows of this rank's sequence shard, the projection [k, n] (matmul_all_to_all: "
            "out [W*m, n/W], this rank's heads; all_to_all_matmul: ctx [W*m, k/W] in, out [m, n]); torch = the "
            "projection and all_to_all_single with the layout copies around it; (all_to_all alone) = that "
            "all_to_all_single"
        )
    if "fused" in config.strategies and interpreted:
        lines.append(
            f"fused runs under the Triton interpreter, only for cases with every dim <= "
            f"{INTERPRETED_FUSED_MAX_DIM}, timed in at most {interpreted_iters} repeats without "
            "warm-up; its timings are not in the summary"
        )
    for op, variants in VARIANTS.items():
        if op in ops and any(v in config.strategies for v in variants):
            lines.append(
                f"{op}: +one_shot = the one-shot all-reduce (every rank sums every rank's whole "
                "partial); the plain labels are two-shot (reduce-scatter, then all-gather)"
            )
    return lines


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically (`overlap.plans.planfile.write_atomic`: a new temporary file, never
    one or a link someone put there, renamed over it; the umask's mode)."""
    write_atomic(path, json.dumps(payload, indent=2) + "\n")


#: the stages of `overlap.stages` in the order a call meets them (`profile_lines`); others follow, then ``outside``
STAGE_ORDER = ("preamble", "handshake", "route", "counts", "fp8 cast", "send", "wait", "gemm", "activation", "receive",
               "sum")


def profile_lines(rows: list[dict[str, Any]], width: int = Table.WIDTH) -> list[str]:
    """``overlap bench --profile``'s lines of one case: per row with a profile (``profile_ms``,
    `timing.profile_case`), its time per call and that time by stage, in the order a call meets them (`STAGE_ORDER`),
    then a helper thread's (beside the call); wrapped at `width`."""
    shown = [r for r in rows if r.get("profile_ms")]
    if not shown:
        return []
    lines = [f"{Table.INDENT}host time per stage, ms per call (mean over ranks; 'outside': the call's time outside "
             "overlap's stages)"]
    w = max(len(r.get("label", r["strategy"])) for r in shown)
    rank = {name: i for i, name in enumerate(STAGE_ORDER)}
    for r in shown:
        prof = dict(r["profile_ms"])
        total, outside = prof.pop("total"), prof.pop("outside", 0.0)
        helper = {k.removesuffix(stages.HELPER): v for k, v in prof.items() if k.endswith(stages.HELPER)}
        own = {k: v for k, v in prof.items() if not k.endswith(stages.HELPER)}
        parts = [f"{k} {v:.3f}" for k, v in sorted(own.items(), key=lambda kv: rank.get(kv[0], len(rank)))]
        text = f"{r.get('label', r['strategy']):<{w}}  {total:.3f} = " + " + ".join([*parts, f"outside {outside:.3f}"])
        if helper:
            text += "; helper thread: " + ", ".join(f"{k} {v:.3f}" for k, v in helper.items())
        lines += textwrap.wrap(text, width, initial_indent=2 * Table.INDENT, subsequent_indent=2 * Table.INDENT
                               + " " * (w + 2), break_long_words=False, break_on_hyphens=False)
    return lines
