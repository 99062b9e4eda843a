"""What ``overlap demo`` prints and draws from the results of `overlap.demo.train.train`.

`summary` adds the derived figures (largest relative loss difference, step-time ratio with its spread: the
median and quartiles of the per-step ratios overlap/torch, which need not equal the ratio of the two runs' medians);
`lines` is the printed report; `plot` draws the loss curves overlaid and the step times (matplotlib).
"""

from __future__ import annotations

import statistics
from typing import Any


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75) of `values` (all three the value itself for one value)."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def relative_difference(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)`` (0 where both are 0)."""
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The derived figures: ``max_rel_loss_diff``, per run ``step_ms`` (p25, median, p75), and
    ``step_ratio`` (overlap / torch per step: p25, median, p75)."""
    torch_run, ours = results["runs"]["torch"], results["runs"]["overlap"]
    diffs = [relative_difference(a, b) for a, b in zip(torch_run["losses"], ours["losses"], strict=True)]
    ratios = [b / a for a, b in zip(torch_run["step_s"], ours["step_s"], strict=True) if a > 0]
    return {
        "max_rel_loss_diff": max(diffs) if diffs else 0.0,
        "step_ms": {kind: [1e3 * v for v in _quantiles(run["step_s"])] for kind, run in results["runs"].items()},
        "step_ratio": list(_quantiles(ratios)),
    }


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def lines(results: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """The report: the set-up, per-step losses side by side, the largest difference, step times, memory."""
    m = results["model"]
    torch_run, ours = results["runs"]["torch"], results["runs"]["overlap"]
    out = [
        f"overlap demo: {results['world_size']} {results['device'].upper()} ranks; GPT: vocab {m['vocab']}, hidden "
        f"{m['hidden']}, {m['heads']} heads, ffn {m['ffn']}, {m['layers']} layers + MoE ({m['experts']} experts, "
        f"top-{m['top_k']}); sequence {m['seq_len']} x batch {m['batch']}; {results['steps']} steps, AdamW lr "
        f"{results['lr']}, seed {results['seed']}",
        "  torch:   torch's ColwiseParallel/RowwiseParallel/SequenceParallel, MoE on plain all-to-alls (reference)",
        f"  overlap: overlap.hooks.torch_tp's styles and ExpertParallelMLP, strategy {results['strategy']!r}",
        f"  data: a seeded Markov chain; its entropy rate (the lowest reachable loss) is "
        f"{results['entropy_rate']:.4f}",
        "",
        f"{'step':>4}  {'loss torch':>12}  {'loss overlap':>12}  {'rel. diff':>9}",
    ]
    for i, (a, b) in enumerate(zip(torch_run["losses"], ours["losses"], strict=True)):
        out.append(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {relative_difference(a, b):>9.1e}")
    p25, med, p75 = derived["step_ratio"]
    t, o = derived["step_ms"]["torch"], derived["step_ms"]["overlap"]
    out += [
        "",
        f"largest relative loss difference: {derived['max_rel_loss_diff']:.2e}",
        f"step time (slowest rank, steps 1-{results['steps'] - 1}, median and p25..p75): torch {t[1]:.1f} ms "
        f"({t[0]:.1f}..{t[2]:.1f}), overlap {o[1]:.1f} ms ({o[0]:.1f}..{o[2]:.1f})",
        # the median of the per-step ratios, not the ratio of the two medians above: said so, or a reader divides them
        f"step-time ratio overlap/torch, median of the per-step ratios: {med:.3f} (p25..p75 {p25:.3f}..{p75:.3f}; "
        "below 1 is faster)",
        f"peak memory ({results['memory_method']}), rank 0: torch {_mib(torch_run['peak_bytes'])}, "
        f"overlap {_mib(ours['peak_bytes'])}",
    ]
    return out


def require_matplotlib() -> None:
    """Raise ImportError naming what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("--plot needs matplotlib, which is not installed: pip install matplotlib (or install "
                          "overlap with its plot extra: pip install \".[plot]\" in overlap's source folder)") from None


def plot(results: dict[str, Any], path: str) -> None:
    """Two panels to `path` (format from its suffix): the loss curves overlaid, the step time per step of each run."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    loss_ax, time_ax = fig.subplots(1, 2)
    styles = {"torch": dict(color="C0", linestyle="-", marker="o"), "overlap": dict(color="C1", linestyle="--",
                                                                                     marker="x")}
    for kind, run in results["runs"].items():
        label = kind if kind == "torch" else f"overlap ({results['strategy']})"
        loss_ax.plot(range(len(run["losses"])), run["losses"], label=label, markersize=4, **styles[kind])
        time_ax.plot(range(1, len(run["step_s"]) + 1), [1e3 * s for s in run["step_s"]], label=label, markersize=4,
                     **styles[kind])
    loss_ax.axhline(results["entropy_rate"], color="gray", linewidth=0.8, linestyle=":", label="entropy rate")
    loss_ax.set(title="training loss", xlabel="step", ylabel="cross-entropy (nats)")
    time_ax.set(title="step time (slowest rank)", xlabel="step", ylabel="ms")
    time_ax.set_ylim(bottom=0)
    for ax in (loss_ax, time_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"overlap demo, {results['world_size']} {results['device']} ranks")
    fig.savefig(path)
