"""What every mode of bench/gpu_check.py shares: the log, the results of one process (`Result`, `Report`: run a
section, record what it found, hand the record to a sink after every section, skip what `--only`, the clock or
an unusable process rules out, the tests' hooks) and the numbers (tolerances, comparison, timing, benchmark
shapes). Imports torch only, never overlap: the entry point imports this module before its self-install."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

STARTED = time.time()  # --time-limit counts from here (the install included; kept across the re-exec)
# rtol, atol (docs/design.md). fp32 is CPU only: on GPUs the kernel's fp32 dot is TF32.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1.6e-2, 1e-2)}
# Exit codes of a group's process (gpu_check_groups.run_group) besides 0 (every section of the group ran):
EXIT_RESTART = 75  # a section left the process unusable (a sticky CUDA error, a stuck queue): rerun the rest elsewhere
EXIT_DEADLINE = 124  # the process stopped itself at its deadline (its running section is recorded as a FAIL)
# The texts of errors after which a CUDA context is unusable (every later call fails the same way).
STICKY_ERRORS = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
                 "device-side assert", "CUDA error: an illegal", "cudaErrorIllegalAddress", "cudaErrorLaunchFailure",
                 "context is destroyed", "uncorrectable ECC")
_log_file: TextIO | None = None


def log(msg: str, started: float | None = None) -> None:
    """One progress line on stdout, and in the log file where this process keeps one (`set_log_file`)."""
    elapsed = "" if started is None else f" {time.time() - started:6.1f}s"
    line = f"[gpu_check{elapsed}] {msg}"
    print(line, flush=True)
    if _log_file is not None:
        _log_file.write(line + "\n")
        _log_file.flush()


def set_log_file(path: str | os.PathLike | None, append: bool = True) -> TextIO | None:
    """Copy every later `log` line (and `log_text`) into `path` (None: stop); returns the open file."""
    global _log_file
    if _log_file is not None:
        _log_file.close()
    _log_file = None if path is None else open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
    return _log_file


def log_text(text: str, stream: TextIO | None = None) -> None:
    """Raw text (a traceback; the closing table) on `stream` (default stderr) and in the log file."""
    print(text, file=stream or sys.stderr, end="" if text.endswith("\n") else "\n", flush=True)
    if _log_file is not None:
        _log_file.write(text if text.endswith("\n") else text + "\n")
        _log_file.flush()


def deadline_margin(time_limit: float) -> float:
    """Seconds before --time-limit at which a process stops itself: time to write the record and exit."""
    return min(8.0, 0.1 * time_limit)


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
    section: str | None = None  # the section that recorded it (`--only` with this name reruns it)


class Report:
    """The results of one process, the clock, and the rule that one section's failure hides no other.

    A *section* is one `run` call: a name and a function that checks or times something and records
    `Result`s with `add`. `run` skips a section (recording a SKIP) that `--only` leaves out, that would
    start past the deadline, or that comes after a section which left the process unusable (`poisoned`: a
    sticky CUDA error, a device queue that did not drain); in a group's process (`stop_when_poisoned`) it
    records nothing then, and the runner reruns the rest of the group in a fresh process. After every
    section (and before it: `running`) it calls `sink(self)`, which writes the record to disk. With `dry`
    set (a list) it runs nothing and lists ``(section, skip reason or None)`` there instead.
    """

    def __init__(self, args: argparse.Namespace, rank: int = 0):
        self.args = args
        self.results: list[Result] = []
        self.started = args.started_at or STARTED
        self.time_limit = args.time_limit
        self.only: list[str] = list(args.only or [])
        self.rank = rank
        self.stuck: str | None = None  # set when a device queue could not be drained
        self.poisoned: str | None = None  # set when this process cannot run another section soundly
        self.stop_when_poisoned = False
        self.selected_names: set[str] | None = None  # where set: exactly these sections run
        self.done: set[str] = set()  # sections an earlier process of this run already ran
        self.group = ""  # the group of sections this process runs (recorded with each section)
        self.sections: list[dict[str, Any]] = []  # {name, group, status, seconds} of every section run here
        self.running: str | None = None
        self.running_since = 0.0
        self.sink: Callable[[Report], None] | None = None
        self.lock = threading.RLock()  # the sink and the deadline timer write the record one at a time
        self.dry: list[tuple[str, str | None]] | None = None

    def log(self, msg: str) -> None:
        if self.rank == 0:
            log(msg, self.started)

    def add(self, name: str, status: str, value: str = "", *, tflops: float | None = None,
            ratio: float | None = None, **data: Any) -> Result:
        result = Result(name, status, value, tflops, ratio, data, self.running or name)
        self.results.append(result)
        if self.rank == 0 or status == "FAIL":
            extra = f"  {fmt_rate(tflops)} TFLOP/s" if tflops else ""
            log(f"{'' if self.rank == 0 else f'rank {self.rank}: '}{status} {name}: {value}{extra}", self.started)
        return result

    def selected(self, section: str) -> bool:
        """Whether `section` runs: the runner's resolved list where it gave one, else every section whose name
        equals or starts with one of ``--only``'s words (all without --only)."""
        if self.selected_names is not None:
            return section in self.selected_names
        return not self.only or any(section.startswith(s) for s in self.only)

    @property
    def deadline(self) -> float:
        """When this process stops itself (wall clock): --time-limit less `deadline_margin`."""
        return self.started + self.time_limit - deadline_margin(self.time_limit)

    def over_time(self) -> bool:
        return time.time() > self.deadline

    def _record(self) -> None:
        if self.sink is not None:
            with self.lock:
                self.sink(self)

    def _finish(self, section: str, status: str, seconds: float) -> None:
        with self.lock:
            self.sections.append({"name": section, "group": self.group, "status": status,
                                  "seconds": round(seconds, 2)})
            self.running = None
            self._record()

    def run(self, section: str, fn: Callable[[], None], skip: str | None = None, check_time: bool = True) -> bool:
        """Run one section; an exception becomes a FAIL of that section (returns True), and the run goes on."""
        if self.dry is not None:
            self.dry.append((section, skip))
            return False
        if not self.selected(section) or section in self.done:
            return False
        if self.poisoned and self.stop_when_poisoned:
            return False  # the runner reruns the rest of the group in a fresh process
        if skip is None and self.poisoned:
            skip = f"this process is unusable since: {self.poisoned}"
        if skip is None and check_time and self.over_time():
            skip = f"over --time-limit {self.time_limit:.0f} s"
        if skip is not None:
            self.add(section, "SKIP", skip)
            self._finish(section, "SKIP", 0.0)
            return False
        self.log(f"-- {section}")
        with self.lock:
            self.running, self.running_since = section, time.time()
            self._record()
        failed = False
        try:
            run_test_hooks(section, self)
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            tb = traceback.format_exc()
            log_text(tb)
            text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
            self.add(section, "FAIL", text[:300], traceback=tb[-4000:])
            if any(s in text for s in STICKY_ERRORS):
                self.poisoned = f"{section}: {text[:200]}"
            failed = True
        if self.stuck and not self.poisoned:
            self.poisoned = f"the device is stuck since: {self.stuck}"
        self._finish(section, "FAIL" if failed else "ran", time.time() - self.running_since)
        return failed

    def expire(self) -> None:
        """At the deadline (a timer thread): the running section becomes a FAIL, the record is written, and
        the process ends with EXIT_DEADLINE (a section can run on in code no exception reaches)."""
        with self.lock:
            section = self.running
            if section is not None:
                spent = time.time() - self.running_since
                self.add(section, "FAIL", f"--time-limit {self.time_limit:.0f} s reached {spent:.0f} s into this "
                                          "section; the process stopped itself")
                self.sections.append({"name": section, "group": self.group, "status": "FAIL",
                                      "seconds": round(spent, 2)})
                self.running = None
            self.log(f"--time-limit {self.time_limit:.0f} s reached: stopping")
            self._record()
        sys.stdout.flush()
        os._exit(EXIT_DEADLINE)

    def arm_deadline(self) -> threading.Timer:
        """Start the timer that calls `expire` at `deadline` (a daemon thread)."""
        timer = threading.Timer(max(0.0, self.deadline - time.time()), self.expire)
        timer.daemon = True
        timer.start()
        self.deadline_timer = timer
        return timer

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.results)


# ==============================================================================================
# The tests' hooks: GPU_CHECK_TEST_HOOK="ACTION:ARG:SECTION-PREFIX[;...]", applied as a section starts
# ==============================================================================================


def run_test_hooks(section: str, rep: Report) -> None:
    """What tests/test_gpu_check.py makes a section do on CPU, to prove the runner's handling of it:
    ``sleep:S`` (a slow section), ``stall:S`` (one that also ignores its own deadline timer), ``exit:N``
    (the process dies with exit code N), ``raise`` (an exception),
    ``fault`` (a sticky CUDA error: the process becomes unusable), ``snapshot:DIR`` (copy the record and the
    log, as they are when this section starts, into DIR). Unset in real runs."""
    spec = os.environ.get("GPU_CHECK_TEST_HOOK", "")
    for hook in filter(None, spec.split(";")):
        action, arg, prefix = (hook.split(":", 2) + ["", ""])[:3]
        if not section.startswith(prefix):
            continue
        if action == "sleep":
            time.sleep(float(arg))
        elif action == "stall":
            timer = getattr(rep, "deadline_timer", None)
            if timer is not None:
                timer.cancel()
            time.sleep(float(arg))
        elif action == "exit":
            sys.stdout.flush()
            os._exit(int(arg))
        elif action == "raise":
            raise RuntimeError(f"test hook: {section} raised")
        elif action == "fault":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test hook)")
        elif action == "snapshot":
            _snapshot(section, rep, Path(arg))
        else:
            raise ValueError(f"GPU_CHECK_TEST_HOOK: unknown action {action!r} in {hook!r}")


def _snapshot(section: str, rep: Report, into: Path) -> None:
    """Copy the run's record and log into `into`, once the log shows this section's start (the runner copies
    a group's output into the log as it comes: once that line is there, every earlier one is)."""
    out = Path(rep.args.out)
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        log_path = out / "gpu_check.log"
        if log_path.exists() and f"-- {section}" in log_path.read_text(errors="replace"):
            break
        time.sleep(0.05)
    into.mkdir(parents=True, exist_ok=True)
    for name in ("gpu_check.json", "gpu_check.log"):
        if (out / name).exists():
            (into / name).write_bytes((out / name).read_bytes())


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
