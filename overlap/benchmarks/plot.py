"""``overlap bench --plot out.png``: the run's results as a figure (matplotlib, an optional dependency).

Two panels, one group of bars per case (its ``auto`` plan under its name):

* the median time of every row (``torch``, ``reference``, the strategies, ``auto``) with its p25..p75 as an
  error bar (a log axis where the times span more than `LOG_SPAN`); interpreted ``fused`` is left off:
  it is not a measurement of overlap (docs/measuring.md), and its seconds would flatten the others;
* the speedup over ``torch`` of every other row on a linear axis, with a line at 1 (as fast as plain
  torch); speedups above `SPEEDUP_CEILING` are drawn at the limit and labelled with their value.

Sized to be read at its default size: a figure about as wide as the cases need (`FIG_WIDTH`), fonts
of 8 points and more.
"""

from __future__ import annotations

import textwrap
from typing import Any

from ..plans import OPS

#: times spanning more than this factor get a log axis
LOG_SPAN = 20.0
#: speedups above are clipped to it (and labelled)
SPEEDUP_CEILING = 4.0
#: the figure's width in inches: per case, least, most
FIG_WIDTH = (0.9, 9.0, 24.0)


def _shown(row: dict[str, Any]) -> bool:
    """Whether a row is drawn: a strategy row that was timed, not interpreted fused."""
    return "median_ms" in row and "context" not in row and not row.get("interpreted")


#: what --plot says without matplotlib (``overlap demo`` too): what to install
MISSING_MATPLOTLIB = ("--plot needs matplotlib, which is not installed: pip install matplotlib (or install overlap "
                      "with its plot extra: pip install \".[plot]\" in overlap's source folder)")


def require_matplotlib() -> None:
    """Raise ImportError with what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING_MATPLOTLIB) from None


def _case_label(case: str, auto_plan: str) -> str:
    """``op shape dtype mode`` on two lines, the op shortened, and ``auto``'s plan on a third (turned upright
    under the axis: three short columns per case, which never run into the next case's)."""
    op, shape, dtype, mode = case.split(" ")
    text = f"{OPS[op].label if op in OPS else op} {shape}\n{dtype} {mode}"
    return f"{text}\nauto: {auto_plan}" if auto_plan else text


def plot(payload: dict[str, Any], path: str) -> None:
    """Write the figure of `payload` (what ``overlap bench --json`` writes) to `path` (its format from
    the suffix, e.g. ``.png``, ``.svg``, ``.pdf``). Raises ImportError without matplotlib, ValueError
    when nothing was timed."""
    require_matplotlib()
    from matplotlib.figure import Figure

    rows = [r for r in payload["results"] if _shown(r)]
    if not rows:
        raise ValueError("nothing to plot: no strategy was timed")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    labels = list(dict.fromkeys(r["strategy"] for r in rows))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    auto = {r["case"]: r.get("plan", "") for r in rows if r["strategy"] == "auto"}

    per_case, least, most = FIG_WIDTH
    fig = Figure(figsize=(min(most, max(least, per_case * len(cases) + 3)), 10.0), layout="constrained")
    ax_t, ax_s = fig.subplots(2, 1, sharex=True)
    legend: dict[str, Any] = {}
    top = 1.2
    for i, case in enumerate(cases):
        here = [r for r in rows if r["case"] == case]  # the rows this case timed, in label order
        width = 0.8 / len(here)
        for j, r in enumerate(here):
            x = i - 0.4 + (j + 0.5) * width
            label = r["strategy"]
            err = [[r["median_ms"] - r["p25_ms"]], [r["p75_ms"] - r["median_ms"]]]
            (bar,) = ax_t.bar([x], [r["median_ms"]], width, yerr=err, color=colors[label], capsize=2)
            legend.setdefault(label, bar)
            if label == "torch" or "speedup" not in r:
                continue
            value = r["speedup"]
            shown = min(SPEEDUP_CEILING, value)
            top = max(top, shown)
            ax_s.bar([x], [shown], width, color=colors[label])
            if shown != value:  # clipped: say by how much
                ax_s.annotate(f"{value:.1f}x", (x, shown), ha="center", va="top", fontsize=8, rotation=90)

    times = [r["median_ms"] for r in rows]
    if max(times) / max(min(times), 1e-9) > LOG_SPAN:
        ax_t.set_yscale("log")
    machine = textwrap.fill(payload.get("machine", {}).get("description", ""), width=int(11 * fig.get_figwidth()))
    ax_t.set_title(f"overlap bench: median time per call (p25..p75){chr(10) + machine if machine else ''}",
                   fontsize=9)
    ax_t.set_ylabel("ms per call (max over ranks)", fontsize=9)
    ax_t.legend(legend.values(), legend.keys(), fontsize=8, ncols=min(len(labels), 6), loc="upper left")
    if any(r.get("interpreted") for r in payload["results"]):
        ax_t.text(1.0, 1.0, "fused under the Triton interpreter: left off", transform=ax_t.transAxes, fontsize=8,
                  ha="right", va="bottom")
    ax_s.axhline(1.0, color="black", linewidth=0.8)
    ax_s.set_ylim(0.0, top * 1.08)
    ax_s.set_ylabel("speedup over torch\n(T_torch / T)", fontsize=9)
    ax_s.set_title("speedup over torch (plain torch.distributed + torch.matmul); above 1: faster", fontsize=9)
    ax_s.set_xticks(range(len(cases)), [_case_label(c, auto.get(c, "")) for c in cases], rotation=90, fontsize=8)
    for ax in (ax_t, ax_s):
        ax.tick_params(axis="y", labelsize=8)
    fig.savefig(path, dpi=120)
