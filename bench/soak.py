"""Soak: many calls of every op x strategy, forward and backward, watching for leaks.

Runs each selected (op, strategy) `--iters` times (forward, then backward of the output) on CPU ranks
and samples on every rank, before the first call, after the warm-up, every `--iters`/10 calls and
at the end:

* ``shm``: segments in this user's folder of ``OVERLAP_SHM_DIR`` (default ``/dev/shm``) created by the ranks
  of this run (the creator pid is in the name, so other jobs sharing the folder do not count);
* ``maps``: mappings of ``overlap-*`` segments in ``/proc/self/maps`` (a heap that grows must unmap
  the buffers it replaced);
* ``fds``: open file descriptors (``/proc/self/fd``); ``rss``: VmRSS of ``/proc/self/status``;
* ``heap``: bytes of the group's symmetric data heap (all slots), and ``threads``.

After the warm-up nothing may grow: shm entries, mappings, fds or the heap by one is a failure, RSS by
more than 5% + 8 MiB. Each case's last result is also checked against ``reference``. At the end every
rank calls ``overlap.release`` and the group's mappings must be gone; once locally started ranks have
exited, no segment of theirs may be left in the directory. Exit code 0, or 1 on any of those (2: bad
arguments). The table goes to stdout, progress lines to stderr.

usage:
  python bench/soak.py                        # 1000 iterations, 2 CPU ranks, reference/pipelined/symm
  python bench/soak.py --iters 200 --ops matmul_all_reduce --strategies symm,symm+one_shot --json soak.json
  python bench/soak.py --fused                # also interpreted fused, at 8x16x16 and --fused-iters calls
  torchrun --nproc-per-node 3 bench/soak.py --iters 300   # in place on torchrun's ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import overlap
from overlap import envs, shm, symm, world
from overlap.benchmarks.cases import OPS, label_plan, strategy_labels
from overlap.plans import Problem
from overlap.workloads import OpInputs, SeededDraw, workload

DEFAULT_STRATEGIES = ("reference", "pipelined", "symm", "pipelined+one_shot", "symm+one_shot")
RSS_SLACK_FRACTION, RSS_SLACK_KIB = 0.05, 8 * 1024
COUNTED = ("shm", "maps", "fds", "heap")  # after the warm-up, any growth of these is a leak
ABOUT = {
    "fds": "open file descriptors",
    "maps": "mappings of overlap segments",
    "heap": "heap bytes",
    "shm": "overlap-* entries in the shm directory",
}


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    iters: int = 1000
    warmup: int = 0  # 0: max(5, iters // 20)
    ops: tuple[str, ...] = OPS
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    shape: tuple[int, int, int] = (64, 256, 256)  # m x k x n per rank, as in overlap.benchmarks.cases
    fused_iters: int = 30
    fused_shape: tuple[int, int, int] = (8, 16, 16)
    timeout: float = 60.0
    seed: int = 1234
    verbose: bool = True

    def cases(self) -> list[tuple[str, str]]:
        return [(op, label) for op in self.ops for label in strategy_labels(op) if label in self.strategies]


# ----------------------------------------------------------------------------------------------
# Samples
# ----------------------------------------------------------------------------------------------


def shm_entries(pids: tuple[int, ...] | None = None) -> list[str]:
    """Segments in this user's folder of the shm directory (`overlap.shm`); with `pids`, only those created by
    these processes."""
    return sorted(str(n) for n in shm.segment_names() if pids is None or n.pid in pids)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _overlap_maps() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split(None, 5)[-1].strip() for line in f if "/overlap-" in line})


def heap_bytes(group: Any = None) -> int:
    """Bytes of `group`'s symmetric data heap in this process (0 before its first call or after release)."""
    heap = symm.heap_if_open(group)
    return 0 if heap is None else heap.data_bytes


def sample(pids: tuple[int, ...], group: Any = None) -> dict[str, int]:
    return {
        "shm": len(shm_entries(pids)),
        "maps": _overlap_maps(),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": _status("VmRSS"),
        "threads": _status("Threads"),
        "heap": heap_bytes(group),
    }


# ----------------------------------------------------------------------------------------------
# The soak on one rank
# ----------------------------------------------------------------------------------------------


def _inputs(op: str, shape: tuple[int, int, int], world_size: int, rank: int, seed: int):
    """This rank's ``(a, w, grad_out)`` of the op's workload inputs for `shape`, the weight ``w`` ``[n, k]``
    (passed as ``w.t()``, the way Megatron does)."""
    problem = Problem(op, *shape, backward=True)
    inputs = workload(op).inputs(problem, world_size, SeededDraw(seed, rank, "cpu", torch.float32))
    a, b = inputs.leaves
    return a, b.t().contiguous(), inputs.grad_out


def _step(fn, a0, w0, g, **kwargs):
    a, w = a0.detach().requires_grad_(), w0.detach().requires_grad_()
    y = fn(a, w.t(), **kwargs)
    y.backward(g)
    return y.detach(), a.grad, w.grad


def soak_case(
    op: str, label: str, cfg: SoakConfig, pids: tuple[int, ...], group: Any = None, progress=None
) -> dict[str, Any]:
    """Run one (op, strategy label) warm-up + `iters` times; its samples, timings and final check."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    strategy, fields = label_plan(op, label)
    fused = strategy == "fused"
    iters, shape = (cfg.fused_iters, cfg.fused_shape) if fused else (cfg.iters, cfg.shape)
    warmup = cfg.warmup or max(5, iters // 20)
    every = max(1, iters // 10)
    call = workload(op).call

    def fn(a, b, group=None, **kwargs):  # the workload's call of `op`
        return call(OpInputs((a, b), None), group, **kwargs)

    plan = overlap.Plan(strategy, **fields)
    a0, w0, g = _inputs(op, shape, world_size, rank, cfg.seed)
    samples = [("start", 0, sample(pids, group))]
    want = _step(fn, a0, w0, g, group=group, strategy="reference", timeout=cfg.timeout)
    for _ in range(warmup):
        _step(fn, a0, w0, g, group=group, plan=plan, timeout=cfg.timeout)
    samples.append(("warm", 0, sample(pids, group)))
    times, got = [], want
    for i in range(1, iters + 1):
        t0 = time.perf_counter()
        got = _step(fn, a0, w0, g, group=group, plan=plan, timeout=cfg.timeout)
        times.append(time.perf_counter() - t0)
        if i % every == 0 or i == iters:
            samples.append(("end" if i == iters else "iter", i, sample(pids, group)))
            if progress is not None:
                progress(op, label, i, iters, statistics.median(times), samples[-1][2])
    tol = dict(rtol=1e-5, atol=1e-4)  # fp32 on CPU; a little looser than DESIGN's for k = 256 sums
    mismatch = [name for name, x, y in zip(("out", "grad_a", "grad_w"), got, want) if not torch.allclose(x, y, **tol)]
    return dict(
        op=op,
        strategy=label,
        rank=rank,
        iters=iters,
        warmup=warmup,
        shape="x".join(map(str, shape)),
        ms_median=1e3 * statistics.median(times),
        mismatch=mismatch,
        samples=samples,
    )


def _progress(op, label, i, iters, median_s, s) -> None:
    print(
        f"[soak] {op} {label} {i}/{iters}: {1e3 * median_s:.2f} ms/iter, shm {s['shm']}, maps {s['maps']}, "
        f"fds {s['fds']}, rss {s['rss_kib'] / 1024:.1f} MiB, heap {s['heap']} B",
        file=sys.stderr,
        flush=True,
    )


def soak_rank(cfg: SoakConfig, group: Any = None) -> dict[str, Any]:
    """Every case of `cfg` on this rank (every rank of `group` calls it); then `overlap.release`.

    Returns ``{"rank", "pids", "before", "cases", "released"}``: ``before`` is sampled before this
    run's first call, ``released`` after the release.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, os.getpid(), group=group)
    pids = tuple(every)
    before = sample(pids, group)
    progress = _progress if cfg.verbose and rank == 0 else None
    cases = [soak_case(op, label, cfg, pids, group, progress) for op, label in cfg.cases()]
    dist.barrier(group=group)  # nobody releases while a peer still reads its buffers
    overlap.release(group)
    return {"rank": rank, "pids": pids, "before": before, "cases": cases, "released": sample(pids, group)}


# ----------------------------------------------------------------------------------------------
# Verdict and table
# ----------------------------------------------------------------------------------------------


def problems(records: list[dict[str, Any]], after_exit: list[str] | None = None) -> list[str]:
    """What grew after a warm-up or was left behind, over every rank's record of `soak_rank`."""
    found = []
    for rec in records:
        for case in rec["cases"]:
            where = f"rank {rec['rank']} {case['op']} {case['strategy']}"
            if case["mismatch"]:
                found.append(f"{where}: after {case['iters']} calls {case['mismatch']} differ from reference")
            warm = next(s for phase, _, s in case["samples"] if phase == "warm")
            end = case["samples"][-1][2]
            after = [(i, s) for phase, i, s in case["samples"] if phase not in ("start", "warm")]
            for key in COUNTED:
                grew = [i for i, s in after if s[key] > warm[key]]
                if grew:
                    found.append(
                        f"{where}: {ABOUT[key]} grew after the warm-up: {warm[key]} -> {end[key]} at the "
                        f"end (first seen at call {grew[0]})"
                    )
            limit = warm["rss_kib"] * (1 + RSS_SLACK_FRACTION) + RSS_SLACK_KIB
            if end["rss_kib"] > limit:
                found.append(
                    f"{where}: RSS grew after the warm-up: {warm['rss_kib'] / 1024:.1f} -> "
                    f"{end['rss_kib'] / 1024:.1f} MiB (allowed: 5% + 8 MiB)"
                )
        rel, before = rec["released"], rec["before"]
        if rel["shm"] or rel["maps"] > before["maps"] or rel["heap"]:
            found.append(
                f"rank {rec['rank']}: after overlap.release: {rel['shm']} segment(s) in the shm "
                f"directory, {rel['maps']} mapping(s) (before: {before['maps']}), heap {rel['heap']} B"
            )
    if after_exit:
        found.append(f"segments left after the ranks exited: {after_exit}")
    return found


def _span(cases: list[dict[str, Any]], key: str, first: str = "start", scale: int = 1) -> str:
    """``a->b`` (phase `first` -> end) of `key` on the rank where it grew most."""
    spans = [(next(s for phase, _, s in c["samples"] if phase == first)[key], c["samples"][-1][2][key]) for c in cases]
    x, y = max(spans, key=lambda xy: xy[1] - xy[0])
    return f"{x / scale:.1f}->{y / scale:.1f}" if scale != 1 else f"{x}->{y}"


def table(records: list[dict[str, Any]]) -> str:
    """One row per case: ms/iter is the slowest rank's median, each span the rank that grew most."""
    rows = [("op", "strategy", "shape", "iters", "ms/iter", "shm", "maps", "fds", "RSS MiB warm->end", "heap KiB", "")]
    for case in records[0]["cases"]:
        on_ranks = [
            c for rec in records for c in rec["cases"] if (c["op"], c["strategy"]) == (case["op"], case["strategy"])
        ]
        ms = max(c["ms_median"] for c in on_ranks)
        check = "MISMATCH" if any(c["mismatch"] for c in on_ranks) else "ok"
        spans = [_span(on_ranks, key) for key in ("shm", "maps", "fds")]
        spans += [_span(on_ranks, "rss_kib", "warm", 1024), _span(on_ranks, "heap", scale=1024)]
        rows.append((case["op"], case["strategy"], case["shape"], str(case["iters"]), f"{ms:.2f}", *spans, check))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    rel = [f"rank {r['rank']}: shm {r['released']['shm']}, maps {r['released']['maps']}" for r in records]
    return "\n".join([*lines, "after overlap.release: " + "; ".join(rel)])


def report(cfg: SoakConfig, records: list[dict[str, Any]], after_exit: list[str] | None, json_path: str | None) -> int:
    found = problems(records, after_exit)
    print(
        f"soak: {len(records)} rank(s), fp32, forward+backward per iteration (shape: m x k x n per rank; shm: this "
        f"run's entries in {envs.shm_dir()}; spans: start->end of the rank that grew most)"
    )
    print(table(records))
    if after_exit is not None:
        print(f"after exit: {len(after_exit)} segment(s) of this run left in {envs.shm_dir()}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "ranks": records, "problems": found}, f, indent=1)
    for line in found:
        print(f"soak: FAIL: {line}", file=sys.stderr)
    print("soak: " + ("FAILED" if found else "no growth after warm-up, nothing left behind"), flush=True)
    return 1 if found else 0


# ----------------------------------------------------------------------------------------------
# Ranks: in place under torchrun, else started locally
# ----------------------------------------------------------------------------------------------


def _launched_rank(cfg: SoakConfig, out_dir: str) -> None:
    torch.set_num_threads(1)
    rec = soak_rank(cfg)
    with open(os.path.join(out_dir, f"rank{rec['rank']}.json"), "w") as f:
        json.dump(rec, f)


def _parse(argv: list[str] | None) -> tuple[SoakConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__[__doc__.index("usage:") :],
    )
    p.add_argument("--iters", type=int, default=1000, help="calls per case after the warm-up (default 1000)")
    p.add_argument("--warmup", type=int, default=0, help="warm-up calls per case (default: max(5, iters/20))")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all)")
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated strategy labels, each run for the ops it applies to "
        f"(default: {','.join(DEFAULT_STRATEGIES)})",
    )
    p.add_argument("--fused", action="store_true", help="add interpreted fused (and fused+one_shot) cases")
    p.add_argument("--fused-iters", type=int, default=30, help="calls per fused case (default 30)")
    p.add_argument("--shape", default="64x256x256", help="m x k x n per rank (default 64x256x256)")
    p.add_argument("--nproc", type=int, default=2, help="local CPU ranks when not under torchrun (default 2)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every sample of every rank there")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    ops = tuple(s for s in args.ops.split(",") if s)
    labels = tuple(s for s in args.strategies.split(",") if s) + (("fused", "fused+one_shot") if args.fused else ())
    known = {lab for op in OPS for lab in strategy_labels(op)}
    if not ops or set(ops) - set(OPS):
        p.error(f"--ops: expected some of {','.join(OPS)}, got {args.ops!r}")
    if not labels or set(labels) - known:
        p.error(f"--strategies: expected some of {','.join(sorted(known))}, got {args.strategies!r}")
    try:
        shape = tuple(int(x) for x in args.shape.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        p.error(f"--shape: expected MxKxN with positive sizes, got {args.shape!r}")
    if min(args.iters, args.nproc, args.fused_iters) < 1 or args.warmup < 0:
        p.error("--iters, --nproc and --fused-iters must be >= 1, --warmup >= 0")
    cfg = SoakConfig(
        iters=args.iters,
        warmup=args.warmup,
        ops=ops,
        strategies=labels,
        shape=shape,
        fused_iters=args.fused_iters,
        verbose=not args.quiet,
    )
    if not cfg.cases():
        p.error("no (op, strategy) case selected")
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = _parse(argv)
    if world.init_from_env():  # torchrun: every rank runs the soak, rank 0 reports
        torch.set_num_threads(1)
        rec = soak_rank(cfg)
        records: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(records, rec)
        code = report(cfg, records, None, args.json) if rec["rank"] == 0 else 0
        verdict = torch.tensor([code])
        dist.broadcast(verdict, 0)
        dist.destroy_process_group()
        return int(verdict.item())
    with tempfile.TemporaryDirectory(prefix="overlap-soak-") as out_dir:
        try:
            world.launch(_launched_rank, args.nproc, args=(cfg, out_dir))
        except RuntimeError as exc:
            print(f"soak: {exc}", file=sys.stderr)
            return 1
        records = []
        for r in range(args.nproc):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                records.append(json.load(f))
    after_exit = shm_entries(tuple(records[0]["pids"]))  # the ranks have exited: nothing of theirs is left
    return report(cfg, records, after_exit, args.json)


if __name__ == "__main__":
    sys.exit(main())
