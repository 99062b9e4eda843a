#!/usr/bin/env python3
"""The GPU check's timings (``python3 -m tests.gpu.timings`` from the repository root; the GPU check,
tests/gpu/check.py, runs them after the tests; GPU only): the figures the GPU proof run records, each against what
it replaces, measured side by side in this one process (medians of Triton's ``do_bench``: CUDA events, L2 flushed
between runs).

* a device-to-device copy's bandwidth, and the cost of one stream-ordered signal (`overlap.signals`' write and
  wait, ping-pong between two streams);
* the fused all-gather GEMM (rank 0 of 8 virtual ranks, every shard flagged) against ``torch.matmul`` (cuBLAS)
  of the gathered input, on Llama-3 70B's column-parallel projections at TP=8 (`overlap.benchmarks.models`,
  the presets of ``overlap bench --shape``), the op's tile and a few others;
* the fused GEMM + reduce-scatter, and the one-shot all-reduce at a decode batch, against the GEMM alone plus
  ``torch.sum`` of the partials (Llama-3 70B's row-parallel projections);
* the MoE grouped GEMMs (rank 0 of 8, every peer's rows delivered) against one ``torch.mm`` per local expert and
  ``torch._grouped_mm`` where this torch has it (the ``mixtral-full`` and ``deepseek-v3-full`` presets of
  ``overlap bench``);
* the machine profile of the GPU (tests/gpu/profile.py: GEMM fits per dtype, the HBM rate), written into the profile
  cache, where ``overlap predict --machine`` takes it in place of the preset's GEMM numbers.

The virtual ranks are the GPU tests' (tests/gpu: `virtual`, `tp_ranks`, `moe_ranks`), so a timing launches the
kernels exactly as the tests that prove them do. ``--out PATH`` gets the results as they come; at ``--until``
(wall time) the timings stop, recording what did not run. Exit status 0 whatever was measured (a wrong result is a
FAIL in the record), 2 for no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from overlap import signals
from overlap.benchmarks.models import LLAMA3_70B, tp_problems
from overlap.benchmarks.names import MOE_PRESETS
from tests.gpu.moe_ranks import (
    Config,
    MoEGroup,
    expert_mm64,
    expert_weights,
    op_tile,
    scatter_call,
    wait_call,
    write_rows,
)
from tests.gpu.moe_ranks import launch_scatter as moe_scatter
from tests.gpu.moe_ranks import launch_wait as moe_wait
from tests.gpu.tolerance import compare, compare_bound, err_text
from tests.gpu.tp_ranks import (
    GatherGroup,
    Layout,
    ScatterGroup,
    launch_gather,
    launch_reduce,
    launch_scatter,
    new_consumer,
)
from tests.gpu.virtual import KERNEL_TIMEOUT_NS, Device, Tile

W = 8  # virtual ranks: a node of 8 GPUs
AG_TILES = (Tile(128, 128, 64, 4, 3), Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3), Tile(256, 128, 64, 8, 3))
MOE_TILES = (Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3))  # besides the op's default launch


class Timings:
    """The results, saved to `path` after each; `run` turns an exception into a FAIL and stops at `until`."""

    def __init__(self, path: Path, until: float):
        self.path, self.until = path, until
        self.results: list[dict[str, Any]] = []
        self.complete = False

    def add(self, name: str, status: str, value: str, headline: bool = False, **figures: Any) -> None:
        self.results.append({"name": name, "status": status, "value": value, "headline": headline, **figures})
        print(f"[gpu_timings] {status} {name}: {value}", flush=True)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"results": self.results, "complete": self.complete}, indent=1, default=str))
        os.replace(tmp, self.path)

    def run(self, name: str, fn: Callable[[], None]) -> None:
        if time.time() > self.until:
            self.add(name, "SKIP", "not started: the run's time is up")
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing timing must not hide the others
            traceback.print_exc()
            self.add(name, "FAIL", f"{type(exc).__name__}: {exc}"[:300])


def do_bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of `fn` (Triton's do_bench: CUDA events, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


# ==============================================================================================
# Copy and signal
# ==============================================================================================


def time_copy(t: Timings, dev: Device, nbytes: int = 1 << 30) -> None:
    """Device-to-device copy (``copy_``) bandwidth, bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, device=dev.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    same = bool(torch.equal(dst, src))
    gbps = 2 * nbytes / (ms * 1e-3) / 1e9
    t.add(f"d2d copy {nbytes >> 20} MiB", "PASS" if same else "FAIL",
          f"{ms:.3f} ms, {gbps:.0f} GB/s read+written" + ("" if same else "; copy wrong"), True, gbps=gbps, ms=ms)


def time_signal(t: Timings, dev: Device, pairs: int = 200) -> None:
    """One stream-ordered signal: a write on one stream releasing a wait on another, ping-pong, ``pairs`` round
    trips issued behind a host-released gate (the host enqueues slower than the device runs)."""
    words = torch.zeros(8, dtype=torch.int32, device=dev.device)
    a, b = dev.stream(), dev.stream()
    dev.idle("signal setup")
    gate = dev.gate()
    gate.hold(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(a)
    fa, fb = words[2].data_ptr(), words[3].data_ptr()
    for i in range(1, pairs + 1):
        signals.cuda_stream_write_value32(fa, i, a.cuda_stream)
        signals.cuda_stream_wait_value32(fa, i, b.cuda_stream)
        signals.cuda_stream_write_value32(fb, i, b.cuda_stream)
        signals.cuda_stream_wait_value32(fb, i, a.cuda_stream)
    end.record(a)
    gate.open()
    dev.settle([a, b], [words[2], words[3]], "signal ping-pong")
    us = start.elapsed_time(end) * 1e3 / pairs / 2
    t.add("stream-ordered signal", "PASS", f"{us:.2f} us per signal (a write on one stream releasing a wait on "
                                           "another)", True, us=us)


# ==============================================================================================
# Tensor-parallel kernels
# ==============================================================================================


def time_all_gather(t: Timings, dev: Device, label: str, m: int, k: int, n: int) -> None:
    """Rank 0's fused all-gather GEMM, every flag pre-set, against ``torch.matmul`` of the gathered input (bf16)."""
    dtype, epoch = torch.bfloat16, 3
    g = GatherGroup.create(dev, W, m, k, n, dtype, stale=epoch)  # flags already at the epoch
    g.fill_buffers()
    full = torch.cat(g.shards)
    ref = full.double() @ g.b.double()
    rows = W * m
    ok, max_err, rel = compare(torch.matmul(full, g.b), ref)
    t_mm = do_bench(lambda: torch.matmul(full, g.b))
    shape = f"{label} {rows}x{k}x{n}"
    t.add(f"torch.matmul {shape}", "PASS" if ok else "FAIL", f"{t_mm:.3f} ms ({err_text(max_err, rel)})",
          tflops=tflops(rows, n, k, t_mm), ms=t_mm)
    c = new_consumer(g)
    tiles: dict[str, Any] = {}
    for tile in AG_TILES:
        try:
            c.out.fill_(math.nan)
            c.err.zero_()
            launch_gather(g, 0, c, epoch, KERNEL_TIMEOUT_NS, tile)
            dev.idle(f"fused {label} {tile.describe()}")
            ok, max_err, rel = compare(c.out, ref)
            if not ok or int(c.err.item()):
                tiles[tile.describe()] = f"wrong: {err_text(max_err, rel)}, err={int(c.err.item())}"
                t.add(f"fused all-gather GEMM {shape} [{tile.describe()}]", "FAIL", tiles[tile.describe()])
                continue
            tiles[tile.describe()] = do_bench(lambda tile=tile: launch_gather(g, 0, c, epoch, KERNEL_TIMEOUT_NS, tile))
        except Exception as exc:  # noqa: BLE001 - e.g. a tile that needs more shared memory than there is
            tiles[tile.describe()] = f"{type(exc).__name__}: {exc}"[:200]
            dev.idle(f"fused {label} {tile.describe()}")
    timed = {k_: v for k_, v in tiles.items() if isinstance(v, float)}
    if not timed:
        t.add(f"fused all-gather GEMM {shape}", "FAIL", "no tile configuration ran", tiles=tiles)
        return
    best = min(timed, key=timed.get)
    ms = timed[best]
    t.add(f"fused all-gather GEMM {shape}", "PASS", f"{ms:.3f} ms [{best}], {t_mm / ms:.2f}x torch.matmul", True,
          tflops=tflops(rows, n, k, ms), ratio=t_mm / ms, ms=ms, torch_ms=t_mm, tiles=tiles)


def time_reduce(t: Timings, dev: Device, kind: str, label: str, rows: int, k: int, n: int) -> None:
    """Rank 0's scatter GEMM + reduction (bf16, the op's tiles, one chunk as on NVLink), every peer's partial
    delivered, against ``torch.mm`` of the same partial plus ``torch.sum`` of the blocks it reduces."""
    dtype, epoch = torch.bfloat16, 3
    g = ScatterGroup.create(dev, Layout(kind, W, rows), k, n, dtype, num_chunks=1, stale=epoch - 1)
    lo, hi = g.lay.block(0)
    for p in range(1, W):  # the peers have delivered their partials for rank 0, and flagged them
        region = g.region(p, 0) if kind == "ar1" else g.region(0, p)
        torch.mm(g.a[p][lo:hi], g.b[p], out=region[: hi - lo])
        g.flags[p][g.lay.flag_index(0) : g.lay.flag_index(0) + g.nch] = epoch
    dev.idle("timing setup")

    def fused() -> None:
        launch_scatter(g, 0, epoch)
        launch_reduce(g, 0, epoch, KERNEL_TIMEOUT_NS)

    fused()
    dev.idle(f"{kind} {label}")
    exact, bound = g.exact(0)
    ok, max_err, rel = compare_bound(g.outs[0], exact, bound, g.block_rtol())
    what = {"rs": "GEMM + reduce-scatter", "ar1": "GEMM + one-shot all-reduce"}[kind]
    shape = f"{label} W={W} {rows}x{k}x{n}"
    if not ok or int(g.errs[0].item()):
        t.add(f"fused {what} {shape}", "FAIL", f"wrong: max {max_err:.1e}, worst block rel {rel:.1e}, "
                                               f"err={int(g.errs[0].item())}")
        return
    t_fused = do_bench(fused)
    partial = torch.empty(rows, n, device=dev.device, dtype=dtype)
    received = torch.stack([g.region(p, 0) if kind == "ar1" else g.region(0, p) for p in range(W)])
    reduced = torch.empty(received.shape[1:], device=dev.device, dtype=dtype)

    def baseline() -> None:
        torch.mm(g.a[0], g.b[0], out=partial)
        torch.sum(received, dim=0, out=reduced)

    t_torch = do_bench(baseline)
    t_mm = do_bench(lambda: torch.mm(g.a[0], g.b[0], out=partial))
    t.add(f"fused {what} {shape}", "PASS", f"{t_fused:.3f} ms vs torch.mm+sum {t_torch:.3f} ms (the GEMM alone "
                                           f"{t_mm:.3f}): {t_torch / t_fused:.2f}x", True,
          tflops=tflops(rows, n, k, t_fused), ratio=t_torch / t_fused, ms=t_fused, torch_ms=t_torch, mm_ms=t_mm,
          max_err=max_err)


# ==============================================================================================
# MoE kernels
# ==============================================================================================


def moe_config(name: str) -> Config:
    s = MOE_PRESETS[name][0]
    return Config(W, (s.tokens,) * W, s.hidden, s.ffn, s.experts, s.top_k, torch.bfloat16, skew=0.0, empty=False)


def expert_loop(x: torch.Tensor, w: torch.Tensor, ends: list[int], out: torch.Tensor) -> Callable[[], None]:
    def loop() -> None:
        for e in range(len(ends) - 1):
            if ends[e + 1] > ends[e]:
                torch.mm(x[ends[e] : ends[e + 1]], w[e], out=out[ends[e] : ends[e + 1]])
    return loop


def time_moe_dispatch(t: Timings, dev: Device, name: str) -> None:
    """Rank 0's dispatch grouped GEMM with every flag set, against one ``torch.mm`` per local expert over the same
    rows, and ``torch._grouped_mm`` where this torch has one."""
    cfg, epoch = moe_config(name), 3
    g = MoEGroup.create(dev, cfg, stale=epoch, owners=[0])  # the flags are already at the epoch
    for s in range(cfg.world_size):
        write_rows(g, s, 0, None)
    h, L = g.routes[0], cfg.num_local_experts
    w = expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)
    dev.idle(name)
    recv = torch.cat([g.region(0, s)[h.within_source(s, e) : h.within_source(s, e) + h.recv_counts[s][e]]
                      for e in range(L) for s in range(cfg.world_size)])
    ref = expert_mm64(recv, w, torch.repeat_interleave(torch.arange(L), torch.tensor(h.tokens_per_expert)))
    rows, k, n = recv.shape[0], cfg.hidden, cfg.ffn
    shape = f"{name} W={W} rows={rows} {k}x{n} L={L}"
    out = torch.empty((rows, n), device=dev.device, dtype=cfg.dtype)
    ends = [0, *torch.tensor(h.tokens_per_expert).cumsum(0).tolist()]
    loop = expert_loop(recv, w, ends, out)
    loop()
    ok, max_err, rel = compare(out, ref)
    t_loop = do_bench(loop)
    t.add(f"torch.mm per expert {shape}", "PASS" if ok else "FAIL", f"{t_loop:.3f} ms ({err_text(max_err, rel)})",
          tflops=tflops(rows, n, k, t_loop), ms=t_loop)
    tiles: dict[str, Any] = {}
    for tile in (None, *MOE_TILES):  # the op's own launch first
        what = "op default " + "x".join(map(str, op_tile(dev, cfg.dtype))) if tile is None else tile.describe()
        try:
            c = wait_call(g, 0, w, tile)  # the table (BLOCK_M) and the grid (BLOCK_N) belong to the tile
            moe_wait(g, c, epoch, KERNEL_TIMEOUT_NS)
            dev.idle(f"{name} {what}")
            ok, max_err, rel = compare(c.out, ref)
            if not ok or int(c.err.item()) or not torch.equal(c.recv, recv):
                tiles[what] = f"wrong: {err_text(max_err, rel)}, err={int(c.err.item())}"
                t.add(f"fused MoE dispatch GEMM {shape} [{what}]", "FAIL", tiles[what])
                continue
            tiles[what] = do_bench(lambda c=c: moe_wait(g, c, epoch, KERNEL_TIMEOUT_NS))
        except Exception as exc:  # noqa: BLE001 - e.g. a tile that needs more shared memory than there is
            tiles[what] = f"{type(exc).__name__}: {exc}"[:200]
            dev.idle(f"{name} {what}")
    timed = {k_: v for k_, v in tiles.items() if isinstance(v, float)}
    if not timed:
        t.add(f"fused MoE dispatch GEMM {shape}", "FAIL", "no tile configuration ran", tiles=tiles)
    else:
        best = min(timed, key=timed.get)
        t.add(f"fused MoE dispatch GEMM {shape}", "PASS", f"{timed[best]:.3f} ms [{best}], "
                                                          f"{t_loop / timed[best]:.2f}x torch.mm per expert", True,
              tflops=tflops(rows, n, k, timed[best]), ratio=t_loop / timed[best], ms=timed[best], loop_ms=t_loop,
              tiles=tiles)
    grouped_mm = getattr(torch, "_grouped_mm", None)  # a private op whose accepted layouts differ between versions
    if grouped_mm is None:
        t.add(f"torch._grouped_mm {shape}", "SKIP", "torch._grouped_mm does not exist in this torch")
        return
    try:
        offs = torch.tensor(ends[1:], dtype=torch.int32, device=dev.device)
        ok, max_err, rel = compare(grouped_mm(recv, w, offs=offs), ref)
        ms = do_bench(lambda: grouped_mm(recv, w, offs=offs))
    except Exception as exc:  # noqa: BLE001 - e.g. a weight layout this version refuses
        t.add(f"torch._grouped_mm {shape}", "SKIP", f"{type(exc).__name__}: {exc}"[:200])
        return
    t.add(f"torch._grouped_mm {shape}", "PASS" if ok else "SKIP",
          f"{ms:.3f} ms ({err_text(max_err, rel)})" if ok else f"differs from float64: {err_text(max_err, rel)}",
          ok, tflops=tflops(rows, n, k, ms), ratio=t_loop / ms, ms=ms)


def time_moe_combine(t: Timings, dev: Device, name: str) -> None:
    """Rank 0's combine grouped GEMM (results stored into every source's region, flags released) against one
    ``torch.mm`` per local expert into one tensor. The combine GEMM is ``F -> H``."""
    cfg, epoch = moe_config(name), 3
    g = MoEGroup.create(dev, cfg, stale=epoch - 1, owners=[])
    h = g.routes[0]
    rows, k, n = h.num_recv, cfg.ffn, cfg.hidden
    y = torch.randn(rows, k, device=dev.device).to(cfg.dtype)
    w = expert_weights(cfg, k, n, dev.device)
    row_bytes = n * y.element_size()
    dests = [torch.full((g.stride // row_bytes, n), math.nan, device=dev.device, dtype=cfg.dtype) for _ in range(W)]
    c = scatter_call(g, 0, y, w, dst=[d.data_ptr() for d in dests])
    dev.idle(name)
    moe_scatter(g, c, epoch)
    dev.idle(name)
    staged = torch.cat([dests[s][: h.recv_splits[s]] for s in range(W)])  # staging order: source, expert, token
    got = staged.index_select(0, h.staging_of_expert_row)
    experts = torch.repeat_interleave(torch.arange(cfg.num_local_experts), torch.tensor(h.tokens_per_expert))
    ok, max_err, rel = compare(got, expert_mm64(y, w, experts))
    shape = f"{name} W={W} rows={rows} {k}x{n} L={cfg.num_local_experts}"
    if not ok or int(g.counters[0].abs().sum()):
        t.add(f"fused MoE combine GEMM {shape}", "FAIL", f"wrong: {err_text(max_err, rel)}, counters "
                                                         f"{g.counters[0].nonzero().flatten().tolist()}")
        return
    out = torch.empty((rows, n), device=dev.device, dtype=cfg.dtype)
    t_loop = do_bench(expert_loop(y, w, [0, *torch.tensor(h.tokens_per_expert).cumsum(0).tolist()], out))
    ms = do_bench(lambda: moe_scatter(g, c, epoch))
    t.add(f"fused MoE combine GEMM {shape}", "PASS", f"{ms:.3f} ms vs torch.mm per expert {t_loop:.3f} ms: "
                                                     f"{t_loop / ms:.2f}x", True,
          tflops=tflops(rows, n, k, ms), ratio=t_loop / ms, ms=ms, loop_ms=t_loop)


# ==============================================================================================
# Main
# ==============================================================================================


def tp_shapes() -> dict[str, list[tuple[str, tuple[int, int, int]]]]:
    """The tensor-parallel timings' shapes, per kernel: ``"ag"`` (rank 0's ``m x k x n``, every rank ``m`` rows),
    ``"rs"`` and ``"ar1"`` (the rows of every rank's ``a``, ``k``, ``n``): Llama-3 70B at TP=8, the one-shot
    all-reduce at a decode batch of 128 rows."""
    shapes: dict[str, list[tuple[str, tuple[int, int, int]]]] = {"ag": [], "rs": [], "ar1": []}
    for layer, op, (m, k, n) in tp_problems(LLAMA3_70B, W):
        label = f"llama3-70b-tp{W} {layer}"
        if op == "all_gather_matmul":
            shapes["ag"].append((label, (m, k, n)))
        elif op == "matmul_reduce_scatter":
            shapes["rs"].append((label, (W * m, k, n)))
        elif op == "matmul_all_reduce" and layer == "mlp-down":
            shapes["ar1"].append((f"{label} decode", (128, k, n)))
    return shapes


MOE_TIMED = ("mixtral-full", "deepseek-v3-full")  # the presets of `overlap bench --shape` the MoE timings use


def time_profile(t: Timings, dev: Device, nbytes: int = 1 << 30) -> None:
    """The machine profile of this GPU (tests/gpu/profile.py: square GEMMs per dtype, the HBM rate of a copy),
    written into the profile cache, where ``overlap predict --machine`` takes it for the GPU's preset."""
    from tests.gpu import profile

    src = torch.randn(nbytes // 2, device=dev.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    hbm_Bps = 2 * nbytes / (do_bench(lambda: dst.copy_(src)) * 1e-3)
    measured = profile.measure(dev.device, do_bench, hbm_Bps)
    path = profile.save(measured)
    rates = ", ".join(f"{d} {f.peak_flops / 1e12:.0f} TFLOP/s + {f.overhead_s * 1e6:.1f} us"
                      for d, f in measured.gemm.items())
    t.add("machine profile", "PASS", f"{rates}; HBM {hbm_Bps / 1e9:.0f} GB/s; wrote {path}", True,
          profile=measured.to_json(), path=str(path))


def plan() -> list[tuple[str, Callable[[Timings, Device], None]]]:
    """Every timing, in the order they run: the cheap ones first."""
    steps: list[tuple[str, Callable[[Timings, Device], None]]] = [("d2d copy", time_copy),
                                                                  ("stream-ordered signal", time_signal),
                                                                  ("machine profile", time_profile)]
    shapes = tp_shapes()
    for label, (m, k, n) in shapes["ag"]:
        steps.append((f"fused all-gather GEMM {label}", lambda t, d, a=(label, m, k, n): time_all_gather(t, d, *a)))
    for kind, what in (("rs", "GEMM + reduce-scatter"), ("ar1", "GEMM + one-shot all-reduce")):
        for label, (rows, k, n) in shapes[kind]:
            steps.append((f"fused {what} {label}",
                          lambda t, d, a=(kind, label, rows, k, n): time_reduce(t, d, *a)))
    for name in MOE_TIMED:
        steps.append((f"fused MoE dispatch GEMM {name}", lambda t, d, nm=name: time_moe_dispatch(t, d, nm)))
        steps.append((f"fused MoE combine GEMM {name}", lambda t, d, nm=name: time_moe_combine(t, d, nm)))
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu.timings", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_timings.json", help="the record, rewritten after every result")
    p.add_argument("--until", type=float, default=None, help="wall time (time.time()) past which nothing starts")
    p.add_argument("--list", action="store_true", help="print the timings' names, run nothing")
    args = p.parse_args(argv)
    steps = plan()
    if args.list:
        print("\n".join(name for name, _ in steps))
        return 0
    t = Timings(Path(args.out), args.until or math.inf)
    if not torch.cuda.is_available():
        t.add("gpu", "FAIL", "no CUDA device: the timings need a GPU")
        return 2
    dev = Device(torch.device("cuda", torch.cuda.current_device()))
    torch.manual_seed(0)
    for name, fn in steps:
        t.run(name, lambda fn=fn: fn(t, dev))
    t.complete = not any(r["status"] == "SKIP" and "time is up" in r["value"] for r in t.results)
    t.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
