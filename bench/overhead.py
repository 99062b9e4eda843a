"""Protocol overhead of one op call on local ranks: what the runtime adds around the GEMM.

For `all_gather_matmul` (default ``32x64x64`` fp32, forward, ``--strategy symm``) on ``--nproc`` ranks, the
median over ``--iters`` calls (after ``--warmup``) of:

* ``op``: the op itself;
* ``gemm``: ``torch.matmul`` on the gathered input alone (no communication);
* ``torch``: plain torch, ``all_gather_into_tensor`` then ``torch.matmul`` (no code of this project);

and, from a profiled run of the same calls (torch's profiler, the op's ``overlap.*`` ranges, mean CPU time
per call): ``preamble`` (checks, plan, signature), ``handshake`` (the cross-rank agreement and the slot),
and the rest of the op (dispatch, the copy engine's hop, the waits for peers' chunks, the GEMMs). The
protocol per call is ``op - gemm``; against plain torch, ``op - torch``. Each rank's timings are taken
between barriers; the table shows rank 0's. Results go to stdout (``--json PATH`` as well).

usage:
  python bench/overhead.py                       # 2 CPU ranks
  python bench/overhead.py --nproc 3 --shape 32x64x64 --strategy pipelined --iters 2000 --json before.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

RANGES = ("overlap.preamble", "overlap.handshake")


def _median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _rank(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import overlap

    m, k, n = args.m, args.k, args.n
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a, b = torch.randn(m, k), torch.randn(k, n)
    full = torch.empty(world * m, k)

    def op():
        overlap.all_gather_matmul(a, b, strategy=args.strategy)

    def gemm():
        torch.matmul(full, b)

    def plain():
        dist.all_gather_into_tensor(full, a)
        torch.matmul(full, b)

    out = {}
    for name, fn in (("op", op), ("gemm", gemm), ("torch", plain)):
        for _ in range(args.warmup):
            fn()
        dist.barrier()
        out[name] = _median_us(fn, args.iters)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profiled):
            op()
    totals = {e.key: e.cpu_time_total / max(e.count, 1) for e in prof.key_averages()}
    calls = {e.key: e.count for e in prof.key_averages()}
    for key in RANGES:
        out[key.removeprefix("overlap.")] = totals.get(key, 0.0) * calls.get(key, 0) / args.profiled
    out["op_profiled"] = totals.get("overlap.all_gather_matmul", 0.0)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shape", default="32x64x64", help="MxKxN: a is [M, K] per rank, b is [K, N]")
    parser.add_argument("--strategy", default="symm")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--profiled", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.m, args.k, args.n = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        parser.error(f"--shape must be MxKxN, got {args.shape!r}")
    if args.nproc < 1 or args.iters < 1 or args.profiled < 1:
        parser.error("--nproc, --iters and --profiled must be >= 1")
    from overlap.pool import RankPool

    with RankPool(args.nproc) as pool:
        r = pool.run(_rank, args)[0]
    rows = [
        ("op (median)", r["op"]), ("gemm alone (median)", r["gemm"]), ("plain torch ag+mm (median)", r["torch"]),
        ("protocol = op - gemm", r["op"] - r["gemm"]), ("op - plain torch", r["op"] - r["torch"]),
        ("  preamble (profiled mean)", r["preamble"]), ("  handshake (profiled mean)", r["handshake"]),
        ("  rest of the op (profiled mean)", r["op_profiled"] - r["preamble"] - r["handshake"]),
    ]
    print(f"all_gather_matmul {args.shape} fp32 forward, {args.strategy}, {args.nproc} ranks (rank 0, us per call)")
    for name, us in rows:
        print(f"  {name:34s} {us:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rank0_us": r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
