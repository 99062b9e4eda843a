"""The ``overlap`` command: ``overlap info``, ``overlap bench``, ``overlap tune``, ``overlap demo``,
``overlap predict``, ``overlap --version``.

The commands need ranks. Started by torchrun (``torchrun --nproc-per-node 4 -m overlap.cli
bench``) they run in place on the ranks torchrun made; started plainly they start ``--ranks``
(or ``--nproc``) local ranks with `overlap.world.launch` (default: every GPU, else 2 CPU ranks on gloo).

Exit codes: 0 success; 1 a rank failed (its traceback goes to stderr), a benchmark result did
not match ``reference``, or tuning failed (the reason on stderr); 2 bad command-line arguments, shapes or
a model that do not fit the ranks (one line, before any rank starts); 130 after SIGINT, 143 after SIGTERM
(129 after SIGHUP), every rank ended first (`overlap.lifetime`).

This module is the entry point (`main`) and what each command does around its ranks. The parser is
`overlap.cli.parser`, running on the ranks `overlap.cli.ranks`; what each command does before and after its
ranks: `overlap.cli.bench`, `overlap.cli.tune`, `overlap.cli.demo`, `overlap.cli.info` (what ``overlap info``
prints); ``overlap predict`` (`overlap.cli.predict`) and ``overlap tune --machine`` start no rank. The commands
share one progress bar (`overlap.progress`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from typing import Any

from ..benchmarks.names import BENCH_OPS, MODES, all_bench_labels, bench_labels
from ..errors import Terminated
from .argtypes import selection
from .config import check_config
from .parser import build_parser

# Nothing here imports torch before a command runs: the ranks (`ranks`), `info` and the benchmark's
# modules are imported by the command that needs them, so --help, --version and argument errors are quick.

# ----------------------------------------------------------------------------------------------
# overlap bench
# ----------------------------------------------------------------------------------------------


def _bench_rank(config: Any, status_path: str) -> tuple[int, list[str]]:
    """Run the benchmark on this rank; returns (rank, the failed (case, strategy) pairs). Rank 0
    also writes the pairs to `status_path` for the parent of locally started ranks."""
    import torch.distributed as dist

    from ..benchmarks import runner

    rows = runner.run(config)
    dist.barrier()  # no rank tears its connections down while another still communicates
    failed = [f"{r['case']} {r['strategy']}" for r in rows if r.get("status") == "FAILED"]
    if dist.get_rank() == 0:
        with open(status_path, "w") as f:
            json.dump({"failed": failed}, f)
    return dist.get_rank(), failed


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import bench

    modes = selection(args.mode, MODES)
    try:
        earlier = bench.check_outputs(args.json, args.plot, args.compare)  # before torch is even imported
    except ValueError as exc:
        parser.error(str(exc))
    from .. import world
    from ..benchmarks.cases import BenchConfig
    from .ranks import num_ranks, on_ranks

    world_size = num_ranks(args.nproc)
    try:  # the cases must fit the ranks before any starts (exit 2), as demo's model and tune's shapes
        ops, cases = bench.cases_of(selection(args.op, BENCH_OPS) if args.op else None, modes, args.shape,
                                      args.dtype, world_size)
        if not cases:
            bench.check_defaults(ops, modes, args.dtype, world.ranks_device_type(world_size), world_size)
    except ValueError as exc:
        parser.error(str(exc))
    check_config(args)
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        # --plot and --compare read rank 0's results back from a JSON file (--json's, or one of ours)
        json_path = args.json or (os.path.join(tmp, "results.json") if args.plot or args.compare else None)
        try:
            config = BenchConfig(
                ops=ops,
                modes=modes,
                cases=cases,
                dtype=args.dtype,
                strategies=args.strategies
                or tuple(s for s in all_bench_labels() if any(s in bench_labels(op) for op in ops)),
                warmup=args.warmup,
                iters=args.iters,
                timeout=args.timeout,
                json_path=json_path,
                seed=args.seed,
                wide=args.wide,
                profile=args.profile,
            )
        except ValueError as exc:  # e.g. --strategies symm+one_shot for an op that has no such variant
            parser.error(str(exc))
        status_path = os.path.join(tmp, "status.json")
        code, in_place = on_ranks("bench", _bench_rank, (config, status_path), args.nproc, tmp)
        if code != 0:
            return code
        if in_place is None:  # locally started ranks: rank 0 left the verdict in the file
            rank = 0
            with open(status_path) as f:
                failed = json.load(f)["failed"]
        else:
            rank, failed = in_place
        if rank == 0 and args.json:
            print(f"wrote {args.json}", flush=True)
        if rank == 0 and json_path and (args.plot or args.compare):
            lines, error = bench.after_run(json_path, earlier, args.compare, args.plot, wide=args.wide)
            if lines:
                print("\n".join(lines), flush=True)
            if error:
                print(f"overlap bench: {error}", file=sys.stderr)
                code = 1
    if failed and rank == 0:
        print(f"overlap bench: {len(failed)} result(s) did not match reference: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else code


# ----------------------------------------------------------------------------------------------
# overlap tune
# ----------------------------------------------------------------------------------------------


def _tune_rank(config: Any, status_path: str) -> None:
    """Tune on this rank (every rank); rank 0 prints the report, or the reason and writes it to `status_path`."""
    import torch.distributed as dist

    from .tune import tune_rank

    try:
        lines = tune_rank(config)
    except ValueError as exc:  # a problem that does not fit these ranks (the same on every rank)
        if dist.get_rank() == 0:
            with open(status_path, "w") as f:
                f.write(str(exc))
        return
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.shape and not args.model:
        parser.error("give --shape (one or more) or --model")
    if args.machine is None and (args.gpus_per_node is not None or args.nodes != 1 or args.profile is not None):
        parser.error("--gpus-per-node, --nodes and --profile describe a cluster: they go with --machine")
    from .ranks import num_ranks, on_ranks
    from .tune import TuneConfig, parse_shape, problems_of
    for spec in args.shape:
        try:
            parse_shape(spec, True)
        except ValueError as exc:
            parser.error(str(exc))
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        parser.error(f"--out: folder {folder} does not exist")
    if os.path.lexists(args.out):  # merged into (the ranks check its topology): it must be a plan file
        from ..plans import PlanFile

        try:
            PlanFile.load(args.out)
        except ValueError as exc:
            parser.error(f"--out: {exc} (the new plans are merged into it; give another file or remove it)")
    config = TuneConfig(args.shape, args.model, args.out, args.forward_only, args.measure, args.repeats,
                        args.warmup, args.probe, args.timeout, args.routing)
    if args.machine is not None:  # a described cluster: predicted plans, no rank
        from .predict import described_cluster
        from .tune import predicted_plans

        try:
            c = described_cluster(args)
            lines = predicted_plans(config, c)
        except ValueError as exc:
            parser.error(str(exc))
        except OSError as exc:  # the plan file cannot be written
            print(f"overlap tune: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print("\n".join(lines), flush=True)
        return 0
    try:  # the problems must fit the ranks before any starts (exit 2), as bench's cases and demo's model
        problems_of(config, num_ranks(args.nproc))
    except ValueError as exc:
        parser.error(str(exc))
    check_config(args)
    with tempfile.TemporaryDirectory(prefix="overlap-tune-") as tmp:
        status_path = os.path.join(tmp, "status.txt")
        code, _ = on_ranks("tune", _tune_rank, (config, status_path), args.nproc, tmp)
        if code == 0 and os.path.exists(status_path):
            with open(status_path) as f:
                print(f"overlap tune: {f.read()}", file=sys.stderr)
            return 1
    return code


# ----------------------------------------------------------------------------------------------
# overlap info (what the ranks print: `overlap.info`)
# ----------------------------------------------------------------------------------------------


def _info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (args.refresh or args.quick) and not args.probe:
        parser.error("--refresh and --quick go with --probe")
    from . import info
    from .ranks import on_ranks

    check_config(args)
    code = on_ranks("info", info.info_rank, (), args.nproc)[0]
    if code == 0 and args.probe:
        code = on_ranks("info --probe", info.probe_rank, (args.refresh, args.quick), args.nproc)[0]
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``overlap`` console script. Returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "info":
            return _info(args, args.subparser)
        if args.command == "tune":
            return _tune(args, args.subparser)
        if args.command == "bench":
            return _bench(args, args.subparser)
        if args.command == "predict":
            from .predict import run as run_predict

            return run_predict(args, args.subparser)
        if args.command == "demo":
            from .demo import run as run_demo

            return run_demo(args, args.subparser)
    except KeyboardInterrupt:  # SIGINT: the ranks have been ended (`overlap.lifetime`)
        print(f"overlap {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:  # SIGTERM or SIGHUP, the same
        print(f"overlap {args.command}: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    raise AssertionError(f"unhandled command {args.command!r}")
