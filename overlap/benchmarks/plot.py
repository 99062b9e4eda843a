"""``overlap bench --plot out.png``: the run's results as a figure (matplotlib, an optional dependency).

Two panels, one group of bars per case: the median time of every strategy with its p25..p75 as an
error bar (a log axis where the times span more than `LOG_SPAN`), and the overlap efficiency of
every strategy but ``reference`` (0 by definition), with lines at 0 (no gain) and 1 (the whole
smaller cost hidden). Interpreted ``fused`` timings are hatched and have no efficiency bar: they are
not measurements of overlap (docs/design.md). Efficiencies outside `EFFICIENCY_FLOOR` ..
`EFFICIENCY_CEILING` (tiny cases, where fixed costs dwarf the collective and the GEMM) are drawn at
the limit and labelled with their value.
"""

from __future__ import annotations

import textwrap
from typing import Any

from ..plans import OPS

#: times spanning more than this factor get a log axis
LOG_SPAN = 20.0
#: efficiencies below are clipped to it (and labelled)
EFFICIENCY_FLOOR = -2.0
#: ... and above this
EFFICIENCY_CEILING = 2.0


def _has_efficiency(row: dict[str, Any]) -> bool:
    """Whether the row's efficiency is drawn: not reference (0 by definition), not interpreted fused."""
    return row["strategy"] != "reference" and not row.get("interpreted") and "efficiency" in row


def require_matplotlib() -> None:
    """Raise ImportError with what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or pip install 'overlap[test]')"
        ) from None


def _case_label(case: str) -> str:
    """``op shape dtype mode`` on two lines, the op shortened."""
    op, shape, dtype, mode = case.split(" ")
    return f"{OPS[op].label if op in OPS else op} {shape}\n{dtype} {mode}"


def plot(payload: dict[str, Any], path: str) -> None:
    """Write the figure of `payload` (what ``overlap bench --json`` writes) to `path` (its format from
    the suffix, e.g. ``.png``, ``.svg``, ``.pdf``). Raises ImportError without matplotlib, ValueError
    when nothing was timed."""
    require_matplotlib()
    from matplotlib.figure import Figure

    rows = [r for r in payload["results"] if "median_ms" in r and "context" not in r]
    if not rows:
        raise ValueError("nothing to plot: no strategy was timed")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    labels = list(dict.fromkeys(r["strategy"] for r in rows))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    most = max(sum(1 for r in rows if r["case"] == c) for c in cases)

    fig = Figure(figsize=(min(30.0, max(8.0, 0.3 * len(cases) * (2 + most))), 9.0), layout="constrained")
    ax_t, ax_e = fig.subplots(2, 1, sharex=True)
    effs = [r["efficiency"] for r in rows if _has_efficiency(r)]
    ceiling = max(1.2, min(EFFICIENCY_CEILING, max(effs, default=1.0)) + 0.1)
    floor = max(EFFICIENCY_FLOOR, min([0.0, *effs]))
    legend: dict[str, Any] = {}
    for i, case in enumerate(cases):
        here = [r for r in rows if r["case"] == case]  # the strategies this case ran, in label order
        width = 0.8 / len(here)
        for j, r in enumerate(here):
            x = i - 0.4 + (j + 0.5) * width
            label, interp = r["strategy"], bool(r.get("interpreted"))
            err = [[r["median_ms"] - r["p25_ms"]], [r["p75_ms"] - r["median_ms"]]]
            (bar,) = ax_t.bar([x], [r["median_ms"]], width, yerr=err, color=colors[label], capsize=2,
                              hatch="//" if interp else None, alpha=0.5 if interp else 1.0)
            legend.setdefault(label, bar)
            if not _has_efficiency(r):
                continue
            value = r["efficiency"]
            shown = min(ceiling, max(floor, value))
            ax_e.bar([x], [shown], width, color=colors[label])
            if shown != value:  # clipped: say by how much
                ax_e.annotate(f"{value:+.1f}", (x, shown), ha="center", va="bottom" if value < 0 else "top",
                              fontsize=6, rotation=90)

    times = [r["median_ms"] for r in rows]
    if max(times) / max(min(times), 1e-9) > LOG_SPAN:
        ax_t.set_yscale("log")
    machine = textwrap.fill(payload.get("machine", {}).get("description", ""), width=int(12 * fig.get_figwidth()))
    ax_t.set_title(f"overlap bench: median time per call (p25..p75){chr(10) + machine if machine else ''}",
                   fontsize=9)
    ax_t.set_ylabel("ms per call (max over ranks)")
    ax_t.legend(legend.values(), legend.keys(), fontsize=7, ncols=min(len(labels), 4))
    if any(r.get("interpreted") for r in rows):
        ax_t.text(0.0, 1.0, "hatched: fused under the Triton interpreter (not in summaries)",
                  transform=ax_t.transAxes, fontsize=7, va="bottom")
    ax_e.axhline(0.0, color="black", linewidth=0.8)
    ax_e.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax_e.set_ylim(floor - 0.1, ceiling + 0.1)
    ax_e.set_ylabel("overlap efficiency\n(T_ref - T) / min(T_comm, T_compute)")
    ax_e.set_title("overlap efficiency per strategy (1 = the smaller cost hidden)", fontsize=9)
    ax_e.set_xticks(range(len(cases)), [_case_label(c) for c in cases], rotation=60, ha="right", fontsize=6)
    fig.savefig(path, dpi=120)
