"""The GPU check's record of a run (bench/gpu_check.py): the JSON document in ``--out`` (written after every section
and atomically, so a run cut short by a crash or its deadline still leaves a readable file), what a process of the
run adds to it, the table of every result and the closing summary: the FAIL and SKIP lines only, a few headline
figures and the count line, short enough to read at the end of the output.

The document: the run's facts (``date``, ``mode``, ``argv``, ``seed``, ``time_limit``, versions, the GPU),
``results`` (every `gpu_check_common.Result`), ``sections`` (``{name, group, status, seconds}`` of every section
that ran or was skipped), ``running`` (the section in progress, null between sections), ``selected`` (the
sections `--only` chose, null for all), ``processes`` (``{group, pid, exit, seconds}`` of each process the runner
started), ``complete`` (every selected section ran) and ``ok`` (no FAIL).

Imports torch only, never overlap at import time (the entry point imports this module before its self-install).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_common import Report, fmt_rate

DOC_NAME, LOG_NAME = "gpu_check.json", "gpu_check.log"
SUMMARY_MARK = "== gpu_check summary =="
# Headline families: (result name prefix, what it compares); the first prefix that matches a timing result
# with a ratio (baseline time / ours) decides its family.
HEADLINES = (
    ("time fused rs ", "fused GEMM+reduce-scatter vs torch mm+sum"),
    ("time fused ar1 ", "fused GEMM+one-shot all-reduce vs torch mm+sum"),
    ("time fused ", "fused all-gather GEMM (best tile) vs cuBLAS"),
    ("time moe fused dispatch best ", "MoE dispatch grouped GEMM (best tile) vs torch.mm loop"),
    ("time moe fused combine ", "MoE combine grouped GEMM vs torch.mm loop"),
)
STRATEGIES = ("pipelined", "symm", "fused")  # the torchrun timings: "time <op> <shape> <strategy>" vs reference


# ==============================================================================================
# The document
# ==============================================================================================


def new_doc(mode: str, seed: int, time_limit: float, started: float) -> dict[str, Any]:
    """A run's document before any result: its facts, no results."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "argv": sys.argv,
        "seed": seed,
        "time_limit": time_limit,
        "started": started,
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        **versions(),
        "gpu": None,
        "sm_count": None,
        "elapsed_s": 0.0,
        "ok": True,
        "complete": False,
        "running": None,
        "selected": None,
        "processes": [],
        "sections": [],
        "results": [],
    }


def versions() -> dict[str, Any]:
    """torch, Triton, CUDA, Python and whether overlap._C has its CUDA half (where overlap imports)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        from overlap import signals

        has_cuda: bool | None = bool(signals.has_cuda)
    except ImportError:
        has_cuda = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version(), "overlap_C_has_cuda": has_cuda}


def device_facts(doc: dict[str, Any], cuda: bool) -> None:
    """The GPU's name and SM count (a process that uses the GPU fills them in)."""
    if cuda:
        doc["gpu"] = torch.cuda.get_device_name()
        doc["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count


def load_doc(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def save_doc(doc: dict[str, Any], paths: list[str | os.PathLike]) -> None:
    """Write `doc` to every path, each atomically (a reader never sees half a file)."""
    doc["elapsed_s"] = round(time.time() - doc["started"], 1)
    doc["ok"] = not any(r["status"] == "FAIL" for r in doc["results"])
    text = json.dumps(_finite(doc), indent=1, default=str)
    for path in paths:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def report_sink(doc: dict[str, Any], paths: list[str | os.PathLike]):
    """A `Report.sink` that writes `doc` (the results and sections of earlier processes) plus the report's own."""
    base_results, base_sections = list(doc["results"]), list(doc["sections"])

    def sink(rep: Report) -> None:
        doc["results"] = base_results + [dataclasses.asdict(r) for r in rep.results]
        doc["sections"] = base_sections + list(rep.sections)
        doc["running"] = rep.running
        save_doc(doc, paths)

    return sink


def _finite(x: Any) -> Any:
    """Strict JSON: NaN and infinities (a poisoned output left unwritten) become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# ==============================================================================================
# The table and the summary
# ==============================================================================================


def table(results: list[dict[str, Any]]) -> str:
    """Every result, one line each."""
    rows = [("check", "status", "max err / time", "TFLOP/s", "ratio")]
    for r in results:
        rows.append((r["name"], r["status"], r["value"][:72], fmt_rate(r["tflops"]) if r["tflops"] else "",
                     f"{r['ratio']:.2f}" if r["ratio"] else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def count_line(doc: dict[str, Any]) -> str:
    """``N passed, M failed, K skipped in T s`` (the last line of the output)."""
    counts = {s: sum(r["status"] == s for r in doc["results"]) for s in ("PASS", "FAIL", "SKIP")}
    return f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {doc['elapsed_s']:.0f} s"


def summary(doc: dict[str, Any], out_dir: str, max_lines: int = 24) -> str:
    """The closing lines: every FAIL (with the command line that reruns its section), the SKIPs folded by
    reason, headline figures, where the record and the log are, and the count line last."""
    lines = [SUMMARY_MARK + f" mode {doc['mode']}, seed {doc['seed']}, GPU {doc['gpu'] or '-'}"]
    fails = [r for r in doc["results"] if r["status"] == "FAIL"]
    for r in fails[:max_lines // 2]:
        rerun = r.get("section")
        hint = f"  [rerun: --only {_quote(rerun)}]" if rerun else ""
        lines.append(f"FAIL {r['name']}: {r['value'][:160]}{hint}")
    if len(fails) > max_lines // 2:
        lines.append(f"FAIL ... and {len(fails) - max_lines // 2} more (the JSON has them all)")
    by_reason: dict[str, list[str]] = {}
    for r in doc["results"]:
        if r["status"] == "SKIP":
            by_reason.setdefault(r["value"][:100], []).append(r["name"])
    for reason, names in list(by_reason.items())[:6]:
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        lines.append(f"SKIP ({reason}): {shown}")
    if len(by_reason) > 6:
        lines.append(f"SKIP ... and {len(by_reason) - 6} more reasons (the JSON has them all)")
    lines += headlines(doc["results"])
    if not doc.get("complete", True):
        lines.append("INCOMPLETE: some selected sections did not run (see the SKIP/FAIL lines)")
    lines.append(f"record: {os.path.join(out_dir, DOC_NAME)}, log: {os.path.join(out_dir, LOG_NAME)}")
    lines.append(count_line(doc))
    return "\n".join(lines)


def _quote(text: str) -> str:
    return text if text.replace(".", "").replace("_", "").replace("-", "").isalnum() else "'" + text + "'"


def headlines(results: list[dict[str, Any]]) -> list[str]:
    """A few figures: per family the geometric mean of baseline/ours over its shapes, the signal cost, the copy
    bandwidth, and under torchrun each strategy's speedup over `reference`."""
    families: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["status"] != "PASS" or not r["ratio"] or not r["name"].startswith("time "):
            continue
        label = next((what for prefix, what in HEADLINES if r["name"].startswith(prefix)), None)
        if label is None and r["name"].split(" ")[-1] in STRATEGIES:
            label = f"{r['name'].split(' ')[-1]} vs reference (torchrun)"
        if label is not None:
            families.setdefault(label, []).append(r)
    lines = []
    for label, rs in families.items():
        ratios = [r["ratio"] for r in rs]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        peak = max((r["tflops"] or 0.0) for r in rs)
        tf = f", up to {fmt_rate(peak)} TFLOP/s" if peak else ""
        lines.append(f"HEADLINE {label}: {geo:.2f}x geomean over {len(rs)} ({min(ratios):.2f}-{max(ratios):.2f}x){tf}")
    for r in results:
        if r["status"] == "PASS" and r["name"].startswith("time signal ping-pong"):
            lines.append(f"HEADLINE stream-ordered signal: {r['data'].get('us', 0):.2f} us")
        if r["status"] == "PASS" and r["name"].startswith("time d2d copy"):
            lines.append(f"HEADLINE device copy: {r['data'].get('gbps', 0):.0f} GB/s read+written")
    return lines
