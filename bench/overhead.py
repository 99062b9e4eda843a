"""Protocol overhead of one op call on local ranks: what the runtime adds around the GEMM.

For `all_gather_matmul` (default ``32x64x64`` fp32, forward, ``--strategy symm``) on ``--nproc`` ranks, the
median (and p25..p75) over ``--iters`` calls (after ``--warmup``) of:

* ``op``: the op itself;
* ``gemm``: ``torch.matmul`` on the gathered input alone (no communication);
* ``torch``: plain torch, ``all_gather_into_tensor`` then ``torch.matmul`` (no code of this project);

then, from a second run of the same calls under torch's profiler (the op's ``overlap.*`` ranges; mean wall
time per call, which the profiler inflates), the op broken down into: ``preamble`` (checks, plan,
signature), ``handshake`` (the agreement and the slot: a full rendezvous on a first call, a post in the
steady state), ``waits`` (wall time inside the flag waits for peers: `overlap.symm.handshake.wait_checked`,
wrapped for that run), ``copy-engine hop`` (waits for the copy engine's thread; 0 where a small gather is
pulled inline), ``dispatch`` (torch's custom-op dispatch, autograd wrapper, the op's Python outside its
ranges) and the rest (copies and GEMMs, the strategy's Python). Also the host synchronizations per call
(`overlap.symm.host_sync_counts`). The protocol per call is ``op - gemm``; against plain torch,
``op - torch``. Calls run back to back (the steady state of a training loop), or with ``--barrier`` each
after a ``dist.barrier()``, as `overlap bench` times them (a call then starts with its peers, and with the
barrier's last messages still in flight: the case where the slow half of small calls came from). Each
rank's timings are taken between barriers; the table shows rank 0's. Results go to stdout (``--json PATH``
as well).

usage:
  python bench/overhead.py                       # 2 CPU ranks
  python bench/overhead.py --nproc 3 --shape 32x64x64 --strategy pipelined --iters 2000 --json before.json
  python bench/overhead.py --barrier               # every call after a barrier, as overlap bench times it
  OVERLAP_CHECK_EVERY_CALL=1 python bench/overhead.py   # every call a full handshake (no steady state)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

RANGES = ("overlap.preamble", "overlap.handshake", "overlap.all_gather_matmul", "bench.call")


def _quartiles_us(fn, iters: int, barrier) -> tuple[float, float, float]:
    """p25, median, p75 of `iters` calls of `fn` in microseconds (`barrier` called before each, untimed)."""
    times = []
    for _ in range(iters):
        barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    q1, q2, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return q1 * 1e6, q2 * 1e6, q3 * 1e6


class _Timed:
    """Wall time spent inside `fn` (a wrapper installed on a module attribute for the profiled run)."""

    def __init__(self, module, name: str):
        self.module, self.name, self.total = module, name, 0.0
        self.inner = getattr(module, name)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t

    def __enter__(self):
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.inner)


def _rank(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import overlap
    from overlap import comm, symm
    from overlap.symm import handshake

    m, k, n = args.m, args.k, args.n
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a, b = torch.randn(m, k), torch.randn(k, n)
    full = torch.zeros(world * m, k)  # (not empty: stale denormals would make the GEMM alone ~50x slower)
    barrier = dist.barrier if args.barrier else (lambda: None)

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
        if name == "op":
            before = symm.host_sync_counts()
        out[f"{name}_p25"], out[name], out[f"{name}_p75"] = _quartiles_us(fn, args.iters, barrier)
        if name == "op":
            after = symm.host_sync_counts()
            out["rendezvous_per_call"] = (after["rendezvous"] - before["rendezvous"]) / args.iters
            out["steady_per_call"] = (after["steady"] - before["steady"]) / args.iters
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof, _Timed(handshake, "wait_checked") as waits, \
            _Timed(comm, "result") as hop:
        for _ in range(args.profiled):
            barrier()
            with record_function("bench.call"):
                op()
    totals = {e.key: e.cpu_time_total for e in prof.key_averages()}
    for key in RANGES:
        out[key.removeprefix("overlap.").removeprefix("bench.")] = totals.get(key, 0.0) / args.profiled
    out["waits"] = waits.total * 1e6 / args.profiled
    out["hop"] = hop.total * 1e6 / args.profiled
    out["op_profiled"] = out.pop("call")
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
    parser.add_argument("--barrier", action="store_true",
                        help="each call after a dist.barrier(), as overlap bench times it")
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
    inner = r["all_gather_matmul"]  # the op's range: handshake, waits, hop, copies and GEMMs

    def spread(name: str) -> str:
        return f"  ({r[name + '_p25']:.0f}..{r[name + '_p75']:.0f})"

    rows = [
        ("op (median)", r["op"], spread("op")), ("gemm alone (median)", r["gemm"], spread("gemm")),
        ("plain torch ag+mm (median)", r["torch"], spread("torch")),
        ("protocol = op - gemm", r["op"] - r["gemm"]), ("op - plain torch", r["op"] - r["torch"]),
        ("profiled call (mean)", r["op_profiled"]),
        ("  preamble", r["preamble"]), ("  handshake", r["handshake"]), ("  waits for peers", r["waits"]),
        ("  copy-engine hop", r["hop"]),
        ("  dispatch", r["op_profiled"] - r["preamble"] - inner),
        ("  copies, GEMMs, the rest", inner - r["handshake"] - r["waits"] - r["hop"]),
        ("host rendezvous per call", r["rendezvous_per_call"]), ("steady-state calls per call", r["steady_per_call"]),
    ]
    timing = "each call after a barrier" if args.barrier else "calls back to back"
    print(f"all_gather_matmul {args.shape} fp32 forward, {args.strategy}, {args.nproc} ranks, {timing} "
          "(rank 0, us per call; p25..p75)")
    for name, us, *extra in rows:
        print(f"  {name:34s} {us:9.1f}{''.join(extra)}" if "per call" not in name else f"  {name:34s} {us:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rank0_us": r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
