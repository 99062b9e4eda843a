"""``overlap bench --compare EARLIER.json``: this run's medians against an earlier run's, per case and strategy.

Both files are what ``overlap bench --json`` writes (`runner.run`). Rows are matched by case name
(op, shape, dtype, mode) and strategy label, the context rows (the collectives alone, the GEMMs
alone) included, so drift of the machine itself shows too. A change counts only beyond the spreads:
``faster`` when this run's p75 is below the earlier p25, ``slower`` when its p25 is above the
earlier p75; otherwise the two interquartile ranges overlap and the line is unmarked. Cases in one
run only, and runs on other machines or numbers of ranks, are warned about.
"""

from __future__ import annotations

import json
import os
from typing import Any


def load(path: str) -> dict[str, Any]:
    """The payload of an ``overlap bench --json`` file. Raises ValueError (with the path) when the file
    is missing, is not JSON, or holds no results."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file of overlap bench ({exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise ValueError(f"{path}: not written by overlap bench --json (no 'results' list)")
    return payload


def _timed(payload: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(case, strategy label) -> row, for rows with a time."""
    return {(r["case"], r.get("label", r["strategy"])): r for r in payload["results"] if "median_ms" in r}


def verdict(earlier: dict[str, Any], now: dict[str, Any]) -> str:
    """``"faster"``, ``"slower"`` or ``""`` (interquartile ranges overlap) of row `now` against `earlier`."""
    if now["p75_ms"] < earlier["p25_ms"]:
        return "faster"
    if now["p25_ms"] > earlier["p75_ms"]:
        return "slower"
    return ""


def compare(earlier: dict[str, Any], current: dict[str, Any], earlier_name: str = "earlier",
            wide: bool = False) -> list[str]:
    """Lines comparing `current`'s medians with `earlier`'s (payloads of ``overlap bench --json``): a table of the
    timings in both, as ``overlap bench``'s own (`report.Table`): each case's name on a line of its own over its
    strategies (about 100 columns), or with `wide` one line per case and strategy, the case first."""
    lines = [f"compared with {earlier_name}:"]
    m0, m1 = earlier.get("machine", {}), current.get("machine", {})
    if m0.get("description") != m1.get("description"):
        lines.append(f"  earlier: {m0.get('description', 'unknown machine')}")
        lines.append(f"  now:     {m1.get('description', 'unknown machine')}")
    for key, what in (("world_size", "ranks"), ("device_type", "device type")):
        if m0.get(key) != m1.get(key):
            lines.append(f"warning: the runs differ in {what} ({m0.get(key)} then {m1.get(key)}): "
                         "the numbers are not comparable")
    before, after = _timed(earlier), _timed(current)
    common = [key for key in after if key in before]
    if common:
        w_label = max(len("strategy"), *(len(s) for _, s in common))
        w_time = max(len("earlier ms [p25..p75]"), *(len(_time(r[key])) for key in common for r in (before, after)))
        heads = (f"{'strategy':<{w_label}}  {'earlier ms [p25..p75]':>{w_time}}  {'now ms [p25..p75]':>{w_time}}  "
                 f"{'change':>8}")
        w_case = max(len("case"), *(len(c) for c, _ in common))
        lines += [f"{'case':<{w_case}}  {heads}"] if wide else ["case", f"  {heads}"]
        counts = {"faster": 0, "slower": 0, "": 0}
        case = None
        for key in common:
            r0, r1 = before[key], after[key]
            mark = verdict(r0, r1)
            counts[mark] += 1
            change = r1["median_ms"] / r0["median_ms"] - 1
            cells = (f"{key[1]:<{w_label}}  {_time(r0):>{w_time}}  {_time(r1):>{w_time}}  {change:>+8.1%}"
                     + (f"  {mark}" if mark else ""))
            if wide:
                lines.append(f"{key[0]:<{w_case}}  {cells}")
                continue
            if key[0] != case:  # narrow: each case's name on a line of its own, over its strategies
                case = key[0]
                lines.append(case)
            lines.append(f"  {cells}")
        lines.append(f"{len(common)} timings in both runs: {counts['faster']} faster, {counts['slower']} slower, "
                     f"{counts['']} within the spreads (p25..p75 overlap)")
    else:
        lines.append("no case and strategy timed in both runs")
    cases0 = dict.fromkeys(c for c, _ in before)
    cases1 = dict.fromkeys(c for c, _ in after)
    for missing, where in (([c for c in cases0 if c not in cases1], "the earlier run only"),
                           ([c for c in cases1 if c not in cases0], "this run only")):
        if missing:
            lines.append(f"warning: {len(missing)} case(s) in {where}: {', '.join(missing)}")
    untimed = [f"{c} {s}" for c, s in before if c in cases1 and (c, s) not in after]
    untimed += [f"{c} {s}" for c, s in after if c in cases0 and (c, s) not in before]
    if untimed:
        lines.append(f"warning: {len(untimed)} strategy timing(s) of common cases in one run only "
                     f"(not run, or FAILED): {', '.join(untimed)}")
    return lines


def _time(row: dict[str, Any]) -> str:
    return f"{row['median_ms']:.3f} [{row['p25_ms']:.2f}..{row['p75_ms']:.2f}]"
