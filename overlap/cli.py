"""The ``overlap`` command: ``overlap info``, ``overlap bench``, ``overlap tune``, ``overlap --version``.

The commands need ranks. Started by torchrun (``torchrun --nproc-per-node 4 -m overlap.cli
bench``) they run in place on the ranks torchrun made; started plainly they start ``--nproc``
local ranks with `overlap.world.launch` (default: every GPU, else 2 CPU ranks on gloo).

Exit codes: 0 success; 1 a rank failed (its traceback goes to stderr), a benchmark result did
not match ``reference``, or tuning failed (the reason on stderr); 2 bad command-line arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import overlap

from . import envs, world
from .benchmarks.cases import (
    BENCH_OPS,
    DTYPES,
    MODES,
    MOE_PRESETS,
    MoEShape,
    all_strategy_labels,
    parse_moe_shape,
    parse_shape,
    strategy_labels,
)
from .benchmarks.models import TP_PRESETS, parse_tp_preset

_DESCRIPTION = "overlap: hide tensor- and expert-parallel communication behind the GEMMs around it."

_EPILOG = """\
Ranks: under torchrun the commands run on torchrun's ranks (--nproc is ignored); otherwise they
start --nproc local ranks (default: one per GPU, else 2 CPU ranks on gloo).

examples:
  overlap info
  overlap info --probe
  overlap bench
  overlap bench --op matmul_all_reduce --mode fwd
  overlap bench --nproc 4 --shape 1024x1024x1024 --dtype bfloat16 --json results.json
  overlap bench --op moe
  overlap bench --shape mixtral 256,128,256,8,2 --mode fwd+bwd
  overlap bench --shape llama3-8b --json now.json --plot now.png --compare before.json
  torchrun --nproc-per-node 8 -m overlap.cli bench --strategies reference,symm,fused
  overlap tune --shape all_gather_matmul:256x1024x1024 --shape moe:512x128x448:8:2 --out plans.json
  overlap tune --model hidden=4096,ffn=14336,tokens=4096,heads=32,kv_heads=8,gated=1,dtype=bfloat16 --out plans.json
  OVERLAP_PLAN=plans.json python train.py
"""


# ----------------------------------------------------------------------------------------------
# Argument types (each raises argparse.ArgumentTypeError, which argparse turns into exit code 2)
# ----------------------------------------------------------------------------------------------


def _int_at_least(lowest: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return value


def _shape(text: str) -> tuple[int, int, int] | tuple[MoEShape, str] | tuple[str, str]:
    """``MxKxN`` (the tensor-parallel ops) -> ``(m, k, n)``; a tensor-parallel preset name ->
    ``("preset", name)``; ``T,H,F,E,K`` or a preset name (moe) -> ``(MoEShape, preset name or "")``."""
    if "," in text or text.strip().lower() in MOE_PRESETS:
        try:
            return parse_moe_shape(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    preset = parse_tp_preset(text)
    if preset:
        return ("preset", preset)
    try:
        return parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}; or a preset among {', '.join(TP_PRESETS)}; for moe: T,H,F,E,K or a preset among "
            f"{', '.join(MOE_PRESETS)}"
        ) from None


def _world_size(nproc: int | None) -> int:
    """The number of ranks the command will run on (see `_on_ranks`): torchrun's, else `nproc`, else the default."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return nproc if nproc is not None else world.default_nproc()


def _names(known: tuple[str, ...], what: str):
    """A parser of one comma-separated selection of `known` names."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s.strip() for s in text.split(",") if s.strip())
        unknown = [s for s in names if s not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {what} {', '.join(known)}; got {text!r}"
            )
        return names

    return parse


_strategies = _names(all_strategy_labels(), "strategies among")
_ops = _names(BENCH_OPS, "ops among")
_modes = _names(MODES, "modes among")


def _selection(values: list[tuple[str, ...]] | None, known: tuple[str, ...]) -> tuple[str, ...]:
    """The union of a repeatable comma-separated option's values, in the order of `known` (None: all)."""
    return tuple(k for k in known if any(k in group for group in values)) if values else known


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overlap",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"overlap {overlap.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    nproc_help = "local ranks to start when not under torchrun (default: one per GPU, else 2 CPU ranks)"

    info = sub.add_parser(
        "info",
        help="versions, build, ranks and the link class of every rank pair",
        description="Start the ranks and print what overlap sees: versions of overlap, torch and Triton, "
        "whether overlap._C has CUDA, the Triton interpreter state, the backend, every rank "
        "(pid, node, device) and the link class (shm, nvlink, pcie, network) of every pair of ranks.",
    )
    info.add_argument("--nproc", type=_positive_int, default=None, metavar="N", help=nproc_help)
    info.add_argument("--probe", action="store_true",
                      help="also print the machine profile the cost model uses (link latency and bandwidth per "
                      "link class, GEMM rates, interference, per-chunk cost), measured once and cached in "
                      "OVERLAP_CACHE_DIR")
    info.add_argument("--refresh", action="store_true", help="with --probe: measure again instead of the cache")
    info.add_argument("--quick", action="store_true", help="with --probe: a short, rougher probe (not cached)")

    tune = sub.add_parser(
        "tune",
        help="measure the best plans for given shapes or a model, and write a plan file",
        description="Tune the plans of 'auto' for the given problems on these ranks: probe the machine (cached), "
        "rank every candidate plan (strategy x chunks per link class) with the cost model, measure reference and "
        "the best-predicted few on every rank (interleaved, the slowest rank's medians), let rank 0 pick the "
        "fastest (never one slower than reference) and write a plan file. Use it with OVERLAP_PLAN=FILE or "
        "plan='FILE'. Shapes: OP:MxKxN[:DTYPE][:fwd|fwd+bwd] (OP all_gather_matmul, matmul_reduce_scatter, "
        "matmul_all_reduce; the per-rank GEMM is [W*m, k] @ [k, n] as in overlap bench) or "
        "moe:TxHxF:EXPERTS:TOPK[:DTYPE][:fwd|fwd+bwd]. A model: hidden=H,ffn=F,tokens=S[,heads=A,kv_heads=B]"
        "[,experts=E,topk=K][,gated=1][,dtype=D], one transformer layer with TP = the number of ranks and "
        "sequence parallelism.",
    )
    tune.add_argument("--nproc", type=_positive_int, default=None, metavar="N", help=nproc_help)
    tune.add_argument("--shape", action="append", default=[], metavar="SPEC", help="a problem (repeatable)")
    tune.add_argument("--model", default=None, metavar="DESC", help="a model description (see above)")
    tune.add_argument("--out", default="overlap-plan.json", metavar="PATH",
                      help="the plan file to write (default: %(default)s)")
    tune.add_argument("--forward-only", action="store_true", help="tune the forward alone (default: fwd+bwd)")
    tune.add_argument("--measure", type=_positive_int, default=3, metavar="N",
                      help="plans measured besides reference, the model's best (default: %(default)s)")
    tune.add_argument("--repeats", type=_positive_int, default=5, metavar="R",
                      help="timed calls per plan, interleaved (default: %(default)s)")
    tune.add_argument("--warmup", type=_non_negative_int, default=2, metavar="W",
                      help="untimed calls per plan first (default: %(default)s)")
    tune.add_argument("--probe", choices=("cached", "refresh", "quick", "none"), default="cached",
                      help="machine profile for the model: the cached probe (measured if absent), a new one, a "
                      "quick uncached one, or the built-in defaults (default: %(default)s)")
    tune.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                      help="deadline in seconds of each wait on a peer (default: OVERLAP_TIMEOUT_S, 300)")
    tune.set_defaults(subparser=tune)

    bench = sub.add_parser(
        "bench",
        help="check and time every strategy of the ops against reference",
        description="Benchmark the ops on the ranks: for each case (op, shape, dtype, mode), check every "
        "strategy against 'reference' (the output, and in fwd+bwd the gradients of every input; a mismatch "
        "fails the command), warm up, then time interleaved repeats between barriers. Prints one line per "
        "strategy and case (median ms, p25..p75, TFLOP/s, speedup over reference, overlap efficiency = "
        "(T_ref - T) / min(T_comm, T_compute)), the plain collectives and the GEMMs alone for context, and "
        "the geometric-mean speedup per strategy and mode, then per op. A progress bar on stderr names the case "
        "and strategy being checked or timed. --plot draws the results, --compare sets them against an earlier "
        "--json file. matmul_all_reduce also runs each strategy's "
        "one-shot variant (label '+one_shot'). Op 'moe' is one MoE layer's experts on the expert-parallel "
        "group (overlap.moe.dispatch_grouped_matmul, gelu, overlap.moe.grouped_matmul_combine) with a fixed, "
        "uneven routing; its gradients of x, w1, w2 and topk_weights are checked. Interpreted 'fused' (CPU "
        "ranks) runs only where every dim <= 128 and is left out of the summary.",
    )
    bench.add_argument("--nproc", type=_positive_int, default=None, metavar="N", help=nproc_help)
    bench.add_argument(
        "--op",
        type=_ops,
        action="append",
        default=None,
        metavar="LIST",
        help=f"comma-separated ops, or the option repeated (default: all: {','.join(BENCH_OPS)}; with --shape, "
        "the ops its shapes are for)",
    )
    bench.add_argument(
        "--mode",
        type=_modes,
        action="append",
        default=None,
        metavar="LIST",
        help="comma-separated modes, or the option repeated: fwd (forward), fwd+bwd (forward, then backward "
        "of the fresh output) (default: fwd,fwd+bwd)",
    )
    bench.add_argument(
        "--shape",
        type=_shape,
        nargs="+",
        default=None,
        metavar="SHAPE",
        help="cases, for every mode selected (default: the built-in cases of the ops for the ranks' device). "
        "MxKxN, for every tensor-parallel op selected: the GEMM of each rank is [W*M, K] @ [K, N] (W ranks); "
        "all_gather_matmul's a is [M, K] per rank, matmul_reduce_scatter's and matmul_all_reduce's a is "
        "[W*M, K] (K: this rank's slice) and their outputs [M, N] and [W*M, N]. "
        "T,H,F,E,K or a preset name, for moe: T tokens per rank, hidden H, expert FFN width F, E experts "
        "(E must divide by the number of ranks), top-K; presets: "
        + "; ".join(f"{name} = {shape.spec} ({about})" for name, (shape, about) in MOE_PRESETS.items())
        + ". A model preset, for the tensor-parallel ops: one layer's projections at tensor-parallel size W with "
        "sequence parallelism (qkv and mlp-up for all_gather_matmul, attn-out and mlp-down for "
        "matmul_reduce_scatter and matmul_all_reduce); presets: "
        + "; ".join(f"{name} ({about})" for name, (_, about) in TP_PRESETS.items()),
    )
    bench.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="dtype of the cases (default: float32 for --shape, presets included, else each built-in case's own)",
    )
    bench.add_argument(
        "--strategies",
        type=_strategies,
        default=None,
        metavar="LIST",
        help=f"comma-separated strategies (default: those of {','.join(all_strategy_labels())} that apply to the "
        "ops selected), each run for the ops it applies to (the +one_shot ones: matmul_all_reduce); reference, "
        "the baseline, always runs",
    )
    bench.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=3,
        metavar="W",
        help="warm-up calls per timed label (default: %(default)s)",
    )
    bench.add_argument(
        "--iters", type=_positive_int, default=10, metavar="I", help="timed repeats per label (default: %(default)s)"
    )
    bench.add_argument("--json", default=None, metavar="PATH", help="rank 0 writes the results there as JSON")
    bench.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a figure of the results there (format from the suffix: .png, .svg, .pdf): time per strategy "
        "per case and overlap efficiency per strategy; needs matplotlib",
    )
    bench.add_argument(
        "--compare",
        default=None,
        metavar="EARLIER.json",
        help="after the table, compare every case and strategy timed in both runs with an earlier --json file: "
        "both medians and the change, marked faster/slower where the p25..p75 spreads do not overlap; warns "
        "about cases in one run only",
    )
    bench.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="deadline in seconds of each wait on a peer (default: OVERLAP_TIMEOUT_S, 300)",
    )
    bench.add_argument(
        "--seed", type=_non_negative_int, default=None, help="seed of the random inputs (default: a fresh one, printed)"
    )
    bench.set_defaults(subparser=bench)
    info.set_defaults(subparser=info)
    return parser


# ----------------------------------------------------------------------------------------------
# Running a function on the ranks
# ----------------------------------------------------------------------------------------------


def _on_ranks(command: str, fn: Callable, args: tuple, nproc: int | None) -> tuple[int, Any]:
    """Run ``fn(*args)`` on torchrun's ranks in place, or on `nproc` freshly started local ranks.

    Returns (exit code, what `fn` returned in place or None): the code is 0, or 1 after printing
    the failing rank's traceback to stderr.
    """
    import torch.distributed as dist

    owned = not dist.is_initialized()
    try:
        in_place = world.init_from_env()
    except Exception:  # noqa: BLE001 - a broken torchrun environment is reported like a rank failure
        print(f"overlap {command}: could not join torchrun's ranks:\n{traceback.format_exc()}", file=sys.stderr)
        return 1, None
    if in_place:
        if nproc is not None and nproc != dist.get_world_size():
            print(
                f"overlap {command}: running on the {dist.get_world_size()} ranks of torchrun; --nproc {nproc} "
                "is ignored",
                file=sys.stderr,
            )
        try:
            value = fn(*args)
        except Exception:  # noqa: BLE001 - reported, exit code 1
            print(f"overlap {command}: rank {dist.get_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr)
            return 1, None
        finally:
            if owned and dist.is_initialized():
                dist.destroy_process_group()
        return 0, value
    try:
        world.launch(fn, nproc, args=args)
    except RuntimeError as exc:
        print(f"overlap {command}: {exc}", file=sys.stderr)
        return 1, None
    return 0, None


# ----------------------------------------------------------------------------------------------
# overlap info
# ----------------------------------------------------------------------------------------------


def _software_lines() -> list[str]:
    import torch

    from .benchmarks.runner import triton_version

    lines = [f"overlap {overlap.__version__} ({os.path.dirname(overlap.__file__)})", f"torch {torch.__version__}"]
    tv = triton_version()
    lines.append("triton: not installed (the 'fused' strategy is unavailable)" if tv is None else f"triton {tv}")
    interp = envs.triton_interpret()
    how = " (set by overlap: no GPU)" if envs.TRITON_INTERPRET_SET_BY_OVERLAP else ""
    lines.append(f"TRITON_INTERPRET: {'on: Triton kernels run in the interpreter' + how if interp else 'off'}")
    try:
        from . import _C

        count: Any
        try:
            count = _C.cuda_device_count()
        except Exception as exc:  # noqa: BLE001 - no driver: say why
            count = f"unavailable ({exc})"
        lines.append(f"overlap._C: built with CUDA: {'yes' if _C.has_cuda else 'no'}; CUDA devices: {count}")
    except ImportError as exc:
        lines.append(f"overlap._C: not importable ({exc})")
    return lines


def _info_rank() -> None:
    import torch
    import torch.distributed as dist

    info = world.group_info()
    device = str(info.device)
    if info.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(info.device)})"
    mine = {
        "rank": info.rank,
        "pid": os.getpid(),
        "node": info.nodes[info.rank],
        "device": device,
        "threads": torch.get_num_threads(),
        "links": ["-" if p == info.rank else info.link_class(p) for p in range(info.world_size)],
    }
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, mine)
    if info.rank == 0:
        _print_info(info, every)
    dist.barrier()  # no rank tears its connections down while rank 0 still works


def _print_info(info: world.GroupInfo, every: list[dict[str, Any]]) -> None:
    lines = _software_lines()
    lines.append(
        f"backend: {info.backend}, {info.world_size} rank(s) on {len(info.node_names)} node(s): "
        f"{', '.join(info.node_names)}"
    )
    lines.append("")
    rows = [("rank", "pid", "node", "device", "threads")]
    rows += [(str(r["rank"]), str(r["pid"]), r["node"], r["device"], str(r["threads"])) for r in every]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append("")
    lines.append("link classes (row: rank, column: peer)")
    cells = [[""] + [str(p) for p in range(info.world_size)]]
    cells += [[str(r["rank"])] + r["links"] for r in every]
    width = max(len(c) for row in cells for c in row)
    lines += [" ".join(c.rjust(width) for c in row) for row in cells]
    print("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------------------------
# overlap bench
# ----------------------------------------------------------------------------------------------


def _bench_rank(config: Any, status_path: str) -> tuple[int, list[str]]:
    """Run the benchmark on this rank; returns (rank, the failed (case, strategy) pairs). Rank 0
    also writes the pairs to `status_path` for the parent of locally started ranks."""
    import torch.distributed as dist

    from .benchmarks import runner

    rows = runner.run(config)
    dist.barrier()  # no rank tears its connections down while another still communicates
    failed = [f"{r['case']} {r['strategy']}" for r in rows if r.get("status") == "FAILED"]
    if dist.get_rank() == 0:
        with open(status_path, "w") as f:
            json.dump({"failed": failed}, f)
    return dist.get_rank(), failed


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .benchmarks import command
    from .benchmarks.runner import BenchConfig

    modes = _selection(args.mode, MODES)
    try:
        earlier = command.check_outputs(args.json, args.plot, args.compare)
        ops, cases = command.cases_of(_selection(args.op, BENCH_OPS) if args.op else None, modes, args.shape,
                                      args.dtype, _world_size(args.nproc))
    except ValueError as exc:
        parser.error(str(exc))
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
                or tuple(s for s in all_strategy_labels() if any(s in strategy_labels(op) for op in ops)),
                warmup=args.warmup,
                iters=args.iters,
                timeout=args.timeout,
                json_path=json_path,
                seed=args.seed,
            )
        except ValueError as exc:  # e.g. --strategies symm+one_shot for an op that has no such variant
            parser.error(str(exc))
        status_path = os.path.join(tmp, "status.json")
        code, in_place = _on_ranks("bench", _self()._bench_rank, (config, status_path), args.nproc)
        if code != 0:
            return code
        if in_place is None:  # locally started ranks: rank 0 left the verdict in the file
            rank = 0
            with open(status_path) as f:
                failed = json.load(f)["failed"]
        else:
            rank, failed = in_place
        if rank == 0 and json_path and (args.plot or args.compare):
            lines, error = command.after_run(json_path, earlier, args.compare, args.plot)
            if lines:
                print("\n".join(lines), flush=True)
            if error:
                print(f"overlap bench: {error}", file=sys.stderr)
                code = 1
    if failed and rank == 0:
        print(f"overlap bench: {len(failed)} result(s) did not match reference: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else code


# ----------------------------------------------------------------------------------------------
# overlap tune, overlap info --probe
# ----------------------------------------------------------------------------------------------


def _tune_rank(config: Any, status_path: str) -> None:
    """Tune on this rank (every rank); rank 0 prints the report, or the reason and writes it to `status_path`."""
    import torch.distributed as dist

    from .tune.command import tune_rank

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
    from .tune.command import TuneConfig, parse_shape

    if not args.shape and not args.model:
        parser.error("give --shape (one or more) or --model")
    for spec in args.shape:
        try:
            parse_shape(spec, True)
        except ValueError as exc:
            parser.error(str(exc))
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        parser.error(f"--out: folder {folder} does not exist")
    config = TuneConfig(args.shape, args.model, args.out, args.forward_only, args.measure, args.repeats,
                        args.warmup, args.probe, args.timeout)
    with tempfile.TemporaryDirectory(prefix="overlap-tune-") as tmp:
        status_path = os.path.join(tmp, "status.txt")
        code, _ = _on_ranks("tune", _self()._tune_rank, (config, status_path), args.nproc)
        if code == 0 and os.path.exists(status_path):
            with open(status_path) as f:
                print(f"overlap tune: {f.read()}", file=sys.stderr)
            return 1
    return code


def _probe_rank(refresh: bool, quick: bool) -> None:
    import torch.distributed as dist

    from .tune.command import probe_rank

    lines = probe_rank(refresh, quick)
    if dist.get_rank() == 0:
        print("\n".join(line for line in lines if line), flush=True)


def _info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (args.refresh or args.quick) and not args.probe:
        parser.error("--refresh and --quick go with --probe")
    code = _on_ranks("info", _self()._info_rank, (), args.nproc)[0]
    if code == 0 and args.probe:
        code = _on_ranks("info --probe", _self()._probe_rank, (args.refresh, args.quick), args.nproc)[0]
    return code


def _self():
    """This module under its importable name, so that spawned ranks can unpickle its functions.

    (Run as ``python -m overlap.cli`` this file is ``__main__``, which spawned children import under
    another name.)
    """
    import importlib

    return importlib.import_module("overlap.cli")


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
    except KeyboardInterrupt:
        print(f"overlap {args.command}: interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
