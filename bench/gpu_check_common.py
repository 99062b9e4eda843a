"""What both modes of bench/gpu_check.py share: the log, the results (Result, Report) and the numbers
(tolerances, comparison, timing, benchmark shapes). Imports torch only, never overlap: the entry point
imports this module before its self-install."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STARTED = time.time()  # --time-limit counts from here (the install included; kept across the re-exec)
# rtol, atol (docs/design.md). fp32 is CPU only: on GPUs the kernel's fp32 dot is TF32.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1.6e-2, 1e-2)}


def log(msg: str, started: float | None = None) -> None:
    elapsed = "" if started is None else f" {time.time() - started:6.1f}s"
    print(f"[gpu_check{elapsed}] {msg}", flush=True)


# ==============================================================================================
# Results
# ==============================================================================================


@dataclasses.dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    value: str = ""  # max error, a time, or the reason for a SKIP/FAIL
    tflops: float | None = None
    ratio: float | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


class Report:
    """The results of one run, the clock, and the rule that one section's failure hides no other."""

    def __init__(self, args: argparse.Namespace, rank: int = 0):
        self.results: list[Result] = []
        self.started = args.started_at or STARTED
        self.time_limit = args.time_limit
        self.only = [s for s in args.only.split(",") if s]
        self.rank = rank
        self.stuck: str | None = None  # set when a device queue could not be drained: later sections skip

    def log(self, msg: str) -> None:
        if self.rank == 0:
            log(msg, self.started)

    def add(self, name: str, status: str, value: str = "", *, tflops: float | None = None,
            ratio: float | None = None, **data: Any) -> Result:
        result = Result(name, status, value, tflops, ratio, data)
        self.results.append(result)
        if self.rank == 0 or status == "FAIL":
            extra = f"  {fmt_rate(tflops)} TFLOP/s" if tflops else ""
            log(f"{'' if self.rank == 0 else f'rank {self.rank}: '}{status} {name}: {value}{extra}", self.started)
        return result

    def selected(self, section: str) -> bool:
        return not self.only or any(s in section for s in self.only)

    def over_time(self) -> bool:
        return time.time() - self.started > self.time_limit

    def run(self, section: str, fn: Callable[[], None], skip: str | None = None, check_time: bool = True) -> bool:
        """Run one section; an exception becomes a FAIL of that section (returns True), and the run goes on."""
        if not self.selected(section):
            return False
        if skip is None and self.stuck:
            skip = f"the device is stuck since: {self.stuck}"
        if skip is None and check_time and self.over_time():
            skip = f"over --time-limit {self.time_limit:.0f} s"
        if skip is not None:
            self.add(section, "SKIP", skip)
            return False
        self.log(f"-- {section}")
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            traceback.print_exc()
            self.add(section, "FAIL", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300])
            return True
        return False

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.results)

    def table(self) -> str:
        rows = [("check", "status", "max err / time", "TFLOP/s", "ratio")]
        for r in self.results:
            rows.append((r.name, r.status, r.value[:72], fmt_rate(r.tflops) if r.tflops else "",
                         f"{r.ratio:.2f}" if r.ratio else ""))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        counts = {s: sum(r.status == s for r in self.results) for s in ("PASS", "FAIL", "SKIP")}
        lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
                     f"in {time.time() - self.started:.0f} s")
        return "\n".join(lines)

    def write_json(self, path: str, mode: str, seed: int) -> None:
        from overlap import signals  # imported by main() before any result is written
        cuda = torch.cuda.is_available() and not mode.startswith("cpu-smoke")
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        doc = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode,
            "argv": sys.argv,
            "seed": seed,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
            "torch": torch.__version__,
            "triton": triton_version,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "overlap_C_has_cuda": bool(getattr(signals, "has_cuda", False)),
            "elapsed_s": round(time.time() - self.started, 1),
            "ok": not self.failed,
            "results": [dataclasses.asdict(r) for r in self.results],
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_finite(doc), indent=1, default=str))


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
# Numbers: tolerances, comparison, timing
# ==============================================================================================


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
    """(within the dtype's tolerance and all finite, max |out - ref|, ||out - ref|| / ||ref||)."""
    rtol, atol = TOLERANCES[out.dtype]
    got = out.to(ref.dtype)
    if not bool(torch.isfinite(got).all()):
        return False, math.nan, math.nan
    diff = (got - ref).abs()
    ok = bool((diff <= atol + rtol * ref.abs()).all())
    return ok, float(diff.max()), float(diff.norm() / ref.norm().clamp_min(1e-30))


# Checks of sums of rounded terms (reductions across ranks, and every output against a float64 exact
# result): the unit roundoff of a stored value, a float32 accumulation's per-term roundoff, and the
# worst relative error (by norm) a 64x64 block of the output may have. TF32 (a fp32 tl.dot on Hopper)
# keeps 10 mantissa bits of each input; the tensor cores truncate, so an input is off by up to 2^-10.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
TF32_ROUNDOFF = 2.0**-10
TF32_BLOCK_RTOL = 1e-2
FP32_ACCUMULATE = 2.0**-24
BLOCK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
BLOCK = 64


def block_rel_err(err: torch.Tensor, exact: torch.Tensor, block: int = BLOCK) -> float:
    """Worst ``||err|| / ||exact||`` over the ``block x block`` blocks of a matrix (``[..., n]`` flattened
    to 2-D). A whole-tensor norm would hide one wrong tile of a large output; a block cannot."""
    e2, x2 = err.reshape(-1, err.shape[-1]).double() ** 2, exact.reshape(-1, exact.shape[-1]).double() ** 2
    rows, cols = e2.shape
    if rows == 0 or cols == 0:
        return 0.0
    pad = (0, (-cols) % block, 0, (-rows) % block)
    e2, x2 = torch.nn.functional.pad(e2, pad), torch.nn.functional.pad(x2, pad)
    r, c = e2.shape[0] // block, e2.shape[1] // block
    num = e2.view(r, block, c, block).sum(dim=(1, 3))
    den = x2.view(r, block, c, block).sum(dim=(1, 3))
    return float((num / den.clamp_min(1e-300)).sqrt().max())


def compare_bound(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor,
                  block_rtol: float) -> tuple[bool, float, float]:
    """(every element finite and within `bound` of `exact`, and every 64x64 block within `block_rtol`
    of it by norm; max |out - exact|; the worst block's relative error).

    `bound` is a rigorous rounding bound (e.g. ``u * sum of the rounded terms' magnitudes``): it lets a
    sum that rounds at a different place pass wherever terms cancel, where a tolerance relative to the
    result would not, and it alone is loose where many terms add up; the block norm then catches a
    missing, stale or doubled partial, which is off by a whole term on every element of its tile."""
    got = out.double()
    if got.shape != exact.shape:
        return False, math.inf, math.inf
    if not bool(torch.isfinite(got).all()):
        return False, math.nan, math.nan
    err = (got - exact).abs()
    rel = block_rel_err(err, exact)
    ok = bool((err <= bound).all()) and rel <= block_rtol
    return ok, float(err.max()) if err.numel() else 0.0, rel


def fmt_rate(tflops: float) -> str:
    return f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}"


def fmt_shape(shape: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def err_text(max_err: float, rel: float) -> str:
    return f"max {max_err:.1e}, rel {rel:.1e}"


def matmul_tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def poll(events: list[torch.cuda.Event], timeout_s: float) -> bool:
    """Wait for CUDA events from the host, at most `timeout_s` (never an unbounded synchronize)."""
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(2e-4)
    return True


def do_bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of `fn` (Triton's do_bench: CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ==============================================================================================
# Benchmark shapes (one GPU's timings and the torchrun timings)
# ==============================================================================================


def bench_shapes(tp: int) -> list[tuple[str, dict[str, int]]]:
    """All-gather+GEMM shapes over `tp` ranks, 8192 tokens: 8192^3 and Llama-3-70B's column-parallel
    projections (hidden 8192, ffn 28672, 64 query / 8 key-value heads of dim 128). ``m`` is per rank."""
    tokens, hidden, ffn, q_heads, kv_heads, head_dim = 8192, 8192, 28672, 64, 8, 128
    m = tokens // tp
    return [
        ("8192^3", {"m": m, "k": 8192, "n": 8192}),
        (f"llama3-70b-tp{tp} qkv", {"m": m, "k": hidden, "n": (q_heads + 2 * kv_heads) * head_dim // tp}),
        (f"llama3-70b-tp{tp} gate+up", {"m": m, "k": hidden, "n": 2 * ffn // tp}),
    ]


def row_parallel_shapes(tp: int) -> list[tuple[str, dict[str, int]]]:
    """GEMM + reduce-scatter shapes over `tp` ranks, 8192 tokens: Llama-3-70B's row-parallel
    projections (o_proj: k = 64 heads * 128 / tp, down_proj: k = ffn / tp; n = hidden). ``m`` is the
    rows of one rank's output block (every rank's ``a`` holds ``tp * m`` rows)."""
    tokens, hidden, ffn, q_heads, head_dim = 8192, 8192, 28672, 64, 128
    return [
        (f"llama3-70b-tp{tp} o_proj", {"m": tokens // tp, "k": q_heads * head_dim // tp, "n": hidden}),
        (f"llama3-70b-tp{tp} down", {"m": tokens // tp, "k": ffn // tp, "n": hidden}),
    ]


def all_reduce_shapes(tp: int, one_shot: bool) -> list[tuple[str, dict[str, int]]]:
    """GEMM + all-reduce shapes (Llama-3-70B's down_proj over `tp` ranks, no sequence parallelism):
    a decode-sized batch for the one-shot variant, 8192 tokens for the two-shot one. ``m`` is the rows."""
    hidden, ffn = 8192, 28672
    if one_shot:
        return [(f"llama3-70b-tp{tp} down decode", {"m": 128, "k": ffn // tp, "n": hidden})]
    return [(f"llama3-70b-tp{tp} down prefill", {"m": 8192, "k": ffn // tp, "n": hidden})]


def moe_shapes(ep: int) -> list[tuple[str, dict[str, int]]]:
    """Expert-parallel MoE shapes over `ep` ranks, 4096 tokens per rank (``t``): Mixtral-8x7B (hidden 4096,
    ffn 14336, 8 experts, top-2) and DeepSeek-V3 (hidden 7168, expert ffn 2048, 256 routed experts, top-8).
    ``h`` hidden, ``f`` the expert ffn, ``e`` the experts, ``k`` top-k; only shapes whose experts divide by `ep`."""
    shapes = [(f"mixtral-8x7b-ep{ep}", {"t": 4096, "h": 4096, "f": 14336, "e": 8, "k": 2}),
              (f"deepseek-v3-ep{ep}", {"t": 4096, "h": 7168, "f": 2048, "e": 256, "k": 8})]
    return [(label, s) for label, s in shapes if s["e"] % ep == 0]
