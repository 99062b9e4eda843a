"""The ``overlap`` command line: its parser (`build_parser`), help texts and argument types.

`overlap.cli` parses with it and runs the commands; `selection` reads a repeatable list option back.
It imports no torch (nor anything that does): ``overlap --help``, ``--version`` and argument errors
answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import re
import sys

from ..benchmarks.models import SP_PRESETS, TP_PRESETS, parse_sp_preset, parse_tp_preset
from ..benchmarks.names import (
    BENCH_OPS,
    DEFAULT_OPS,
    DTYPE_NAMES,
    MODES,
    MOE_PRESETS,
    MoEShape,
    all_bench_labels,
    parse_moe_shape,
    parse_shape,
)
from ..version import __version__
from .argtypes import add_ranks_option, int_at_least, timeout_seconds

_DESCRIPTION = "overlap: hide tensor-, expert- and sequence-parallel communication behind the GEMMs around it."

_EPILOG = """\
Ranks: under torchrun the commands run on torchrun's ranks (--ranks is ignored); otherwise they
start --ranks local ranks (default: one per GPU, else 2 CPU ranks on gloo). --nproc is another name
of --ranks that torchrun's own parser rejects: under torchrun, leave it out or write --ranks.

examples:
  overlap info
  overlap info --probe
  overlap bench
  overlap bench --op matmul_all_reduce --mode fwd
  overlap bench --ranks 4 --shape 1024x1024x1024 --dtype bfloat16 --json results.json
  overlap bench --op moe
  overlap bench --op matmul_all_to_all,all_to_all_matmul --shape llama3-8b-128k
  overlap bench --dtype mxfp8 --op all_gather_matmul,all_gather_weight_matmul
  overlap bench --shape mixtral 256,128,256,8,2 --mode fwd+bwd
  overlap bench --shape llama3-8b --json now.json --plot now.png --compare before.json
  .venv/bin/torchrun --nproc-per-node 8 -m overlap.cli bench --strategies reference,symm,fused
  overlap tune --shape all_gather_matmul:256x1024x1024 --shape moe:512x128x448:8:2 --out plans.json
  overlap tune --shape all_gather_matmul:256x1024x1024:mxfp8 --out plans.json
  overlap tune --shape matmul_all_to_all:512x256x384 --shape all_to_all_matmul:512x256x256 --out plans.json
  overlap tune --model hidden=4096,ffn=14336,tokens=4096,heads=32,kv_heads=8,gated=1,dtype=bfloat16 --out plans.json
  overlap tune --machine h100-sxm --model hidden=8192,ffn=28672,tokens=8192,heads=64,kv_heads=8,gated=1,dtype=bfloat16
  overlap predict --machine h100-sxm --shape llama3-70b-full --dtype bfloat16
  OVERLAP_PLAN=plans.json python train.py
"""


# ----------------------------------------------------------------------------------------------
# Argument types (each raises argparse.ArgumentTypeError, which argparse turns into exit code 2)
# ----------------------------------------------------------------------------------------------


_positive_int = int_at_least(1, "a positive integer")
_non_negative_int = int_at_least(0, "an integer >= 0")


def _shape(text: str) -> tuple[int, int, int] | tuple[MoEShape, str] | tuple[str, str]:
    """``MxKxN`` (the tensor-parallel ops; the sequence-parallel ones where --op names them) -> ``(m, k, n)``; a
    tensor-parallel or sequence-parallel preset name -> ``("preset", name)``; ``T,H,F,E,K`` or a preset name (moe) ->
    ``(MoEShape, preset name or "")``."""
    if "," in text or text.strip().lower() in MOE_PRESETS:
        try:
            return parse_moe_shape(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    preset = parse_tp_preset(text) or parse_sp_preset(text)
    if preset:
        return ("preset", preset)
    try:
        return parse_shape(text)
    except ValueError as exc:
        if re.fullmatch(r"\s*[-+]?\d+(\s*x\s*[-+]?\d+){2}\s*", text.lower()):  # MxKxN, a dim < 1: no list of presets
            raise argparse.ArgumentTypeError(str(exc)) from None
        raise argparse.ArgumentTypeError(
            f"{exc}; or a preset among {', '.join((*TP_PRESETS, *SP_PRESETS))}; for moe: T,H,F,E,K or a preset among "
            f"{', '.join(MOE_PRESETS)}"
        ) from None


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


_strategies = _names(all_bench_labels(), "strategies among")
_ops = _names(BENCH_OPS, "ops among")
_modes = _names(MODES, "modes among")


# ----------------------------------------------------------------------------------------------
# The parser
# ----------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse's parser, with two differences a user sees (the commands' parsers are of this class too, as
    ``add_subparsers`` makes them of their parent's):

    - a value that starts with ``-`` and a digit is a value, not an option: ``--shape -5x64x64`` reaches the
      shape's own check ("every dim of the shape must be >= 1") instead of argparse's "expected at least one
      argument" (argparse before Python 3.13 takes only ``-5`` and ``-1.5`` for values; 3.13's, as here, any
      ``-`` and a digit);
    - an unknown option after a command is that command's usage error (``overlap bench --bogus``: bench's usage
      and ``overlap bench: error: unrecognized arguments: --bogus``), not the top-level one's.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")  # what argparse reads as a value, not an option

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            command = getattr(parsed, "subparser", None)
            after_command = command is not None and argv.index(parsed.command) < argv.index(extras[0])
            (command if after_command else self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``overlap``: commands info, tune, bench, demo and predict; each command's parser is its
    namespace's ``subparser`` (for `parser.error` after parsing)."""
    parser = Parser(
        prog="overlap",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"overlap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser(
        "info",
        help="versions, build, ranks and the link class of every rank pair",
        description="Start the ranks and print what overlap sees: versions of overlap, torch and Triton, "
        "whether overlap._C has CUDA, the Triton interpreter state, the backend, every rank "
        "(pid, node, device) and the link class (shm, nvlink, pcie, network) of every pair of ranks.",
    )
    add_ranks_option(info)
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
        "matmul_all_reduce, all_gather_weight_matmul; the per-rank GEMM is [W*m, k] @ [k, n] as in overlap "
        "bench, all_gather_weight_matmul's [m, k] @ [k, W*n]; OP matmul_all_to_all or all_to_all_matmul, the "
        "sequence-parallel ops: m rows of this rank's sequence shard, the projection [k, n], n (matmul_all_to_all) "
        "or k (all_to_all_matmul) dividing by the ranks, as in overlap bench) or "
        "moe:TxHxF:EXPERTS:TOPK[:DTYPE][:fwd|fwd+bwd]. A model: hidden=H,ffn=F,tokens=S[,heads=A,kv_heads=B]"
        "[,experts=E,topk=K][,gated=1][,dtype=D], one transformer layer with TP = the number of ranks and "
        "sequence parallelism. DTYPE float32, bfloat16, float16, float8_e4m3fn (the op's fp8='rowwise' recipe on "
        "bfloat16 leaves) or mxfp8 (its fp8='mxfp8' recipe: MX blocks of 32 along K, which must divide by 32; moe: "
        "the dispatch's fp8=, blocks along H); plans are keyed by it: an fp8 call's plan-file entry has dtype "
        "float8_e4m3fn (rowwise or tensorwise scales) or mxfp8 (MX block scales).",
    )
    add_ranks_option(tune)
    tune.add_argument("--shape", action="append", default=[], metavar="SPEC", help="a problem (repeatable)")
    tune.add_argument("--model", default=None, metavar="DESC", help="a model description (see above)")
    tune.add_argument("--out", default="overlap-plan.json", metavar="PATH",
                      help="the plan file to write; where it exists, the new plans are merged into it (its entries "
                      "of other problems kept, those of the problems tuned now replaced); a file there that is no "
                      "plan file or holds another topology is an error, left as it is (default: %(default)s)")
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
    tune.add_argument("--timeout", type=timeout_seconds, default=None, metavar="S",
                      help="deadline in seconds of each wait on a peer (default: OVERLAP_TIMEOUT_S, 300)")
    tune.add_argument("--routing", default=None, metavar="SHARES",
                      help="the MoE problems' routing, which picks the expert-migration candidates and draws the "
                      "measured calls' tokens: E comma-separated shares of the routed pairs per expert (a skew, "
                      "e.g. 6,1,1,1,6,1,1,1), or @FILE, a JSON list of E shares or of E lists of one share per node "
                      "(a router's measured loads, overlap.plans.measured_loads) (default: the model assumes "
                      "balanced routing, the measured calls draw an uneven router-like one)")
    tune.set_defaults(subparser=tune)

    bench = sub.add_parser(
        "bench",
        help="check every strategy of the ops, then time them against the ops in plain torch",
        description="Benchmark the ops on the ranks: for each case (op, shape, dtype, mode), check "
        "'reference' and 'torch' (the op in plain torch: torch.distributed collectives and torch.matmul, no code of "
        "overlap on its timed path) against the op's result computed locally, and every strategy and 'auto' (the "
        "default strategy) against 'reference' (the output, and in fwd+bwd the gradients of every input; a mismatch "
        "fails the command), warm up, then time interleaved repeats between barriers. Prints a table in 120 columns "
        "(--wide: one line per row), each case's name over one line per row (median ms, p25..p75, TFLOP/s, speedup "
        "over torch, speedup over reference, overlap efficiency ('ovl eff') = "
        "(T_ref - T) / min(T_comm, T_compute), the plan it ran: auto's choice), the plain collectives and the GEMMs "
        "alone for context, the geometric-mean speedup over torch per strategy and mode, then per op (reference "
        "and auto included), and a line counting the cases where auto was slower than torch by more than 10% or "
        "half the wider p25..p75 spread, whichever is larger (also in --json). Default cases that do not fit the "
        "ranks are left out with a note, and the last line says how many cases ran of how many were asked; given "
        "shapes that do not fit the ranks are an error before any rank starts. A progress bar on stderr names the "
        "case and strategy being checked or timed. --plot draws the results, --compare sets them against an "
        "earlier --json file. matmul_all_reduce "
        "also runs each strategy's one-shot variant (label '+one_shot'). Op 'moe' is one MoE layer's experts on the "
        "expert-parallel group (overlap.moe.dispatch_grouped_matmul, gelu, overlap.moe.grouped_matmul_combine) "
        "with a fixed, uneven routing; its gradients of x, w1, w2 and topk_weights are checked. matmul_all_to_all "
        "and all_to_all_matmul are sequence parallelism's projections with their all-to-alls (DeepSpeed-Ulysses "
        "attention); they run the strategies they implement. Interpreted "
        "'fused' (CPU ranks) runs only where every dim <= 128 and is left out of the summary and the plot.",
    )
    add_ranks_option(bench)
    bench.add_argument(
        "--op",
        type=_ops,
        action="append",
        default=None,
        metavar="LIST",
        help=f"comma-separated ops among {','.join(BENCH_OPS)}, or the option repeated (default: "
        f"{','.join(DEFAULT_OPS)}: the sequence-parallel ops {','.join(o for o in BENCH_OPS if o not in DEFAULT_OPS)} "
        "run on request, by --op or a preset of theirs in --shape; with --shape, the ops its shapes are for)",
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
        "[W*M, K] (K: this rank's slice) and their outputs [M, N] and [W*M, N]; all_gather_weight_matmul's a is "
        "[M, K] per rank, its weight shard [K, N] and its output [M, W*N] (the GEMM [M, K] @ [K, W*N]). "
        "T,H,F,E,K or a preset name, for moe: T tokens per rank, hidden H, expert FFN width F, E experts "
        "(E must divide by the number of ranks), top-K; presets: "
        + "; ".join(f"{name} = {shape.spec} ({about})" for name, (shape, about) in MOE_PRESETS.items())
        + ". A model preset, for the tensor-parallel ops: one layer's projections at tensor-parallel size W with "
        "sequence parallelism (qkv and mlp-up for all_gather_matmul, attn-out and mlp-down for "
        "matmul_reduce_scatter and matmul_all_reduce), and all four with their weights sharded over the W ranks "
        "(FSDP) for all_gather_weight_matmul; presets: "
        + "; ".join(f"{name} ({about})" for name, (_, about) in TP_PRESETS.items())
        + ". For the sequence-parallel ops (DeepSpeed-Ulysses attention; MxKxN only where --op names them, in their "
        "own convention: M rows of this rank's sequence shard, the projection [K, N]; matmul_all_to_all's output "
        "[W*M, N/W], all_to_all_matmul's input [W*M, K/W]) a long-context preset: its qkv projection for "
        "matmul_all_to_all, its attention output for all_to_all_matmul, at sequence-parallel size W; presets: "
        + "; ".join(f"{name} ({about})" for name, (_, about) in SP_PRESETS.items()),
    )
    bench.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="dtype of the cases (default: float32 for --shape, presets included, else each built-in case's own); "
        "float8_e4m3fn: the fp8='rowwise' recipe on bfloat16 leaves, mxfp8: the fp8='mxfp8' recipe (MX blocks of 32 "
        "along K, which must divide by 32), for the tensor-parallel ops, the weight gather included (the torch row "
        "casts, runs the collectives of the fp8 bytes and of the scales and torch._scaled_mm; GB/s counts both), and "
        "for moe the dispatch's fp8= (tokens quantized on their owner and dispatched as packed fp8 rows with their "
        "scales, the first grouped GEMM in fp8, the rest bf16; mxfp8: H a multiple of 32; GB/s counts the packed "
        "rows)",
    )
    bench.add_argument(
        "--strategies",
        type=_strategies,
        default=None,
        metavar="LIST",
        help=f"comma-separated strategies (default: those of {', '.join(all_bench_labels())} that apply to the "
        "ops selected), each run for the ops it applies to (the +one_shot ones: matmul_all_reduce); torch (the "
        "plain torch.distributed collective and torch.matmul, the baseline of the speedups) and reference (the "
        "project's plain strategy, the correctness baseline) always run; auto is the default strategy",
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
        help="write a figure of the results there (format from the suffix: .png, .svg, .pdf, ...; checked before "
        "anything starts): median time per row and case, and the speedup over torch per row and case (a linear "
        "axis; auto's plan under each case); needs matplotlib",
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
        type=timeout_seconds,
        default=None,
        metavar="S",
        help="deadline in seconds of each wait on a peer (default: OVERLAP_TIMEOUT_S, 300)",
    )
    bench.add_argument(
        "--seed", type=_non_negative_int, default=None, help="seed of the random inputs (default: a fresh one, printed)"
    )
    bench.add_argument(
        "--wide",
        action="store_true",
        help="print the table one line per row, the case first (about 200 columns); default: at most 120 columns, "
        "each case's name on a line of its own over its rows, long plans wrapped (--json is the same either way)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="after each case's timings, run each row a few more times and print where its host time goes, per "
        "stage of overlap's ops (preamble, handshake, route, counts, send, wait, gemm, receive, sum, fp8 cast: "
        "each its own time, ms per call, mean over ranks), the rest of the call as 'outside' (Python glue, "
        "autograd, allocation), a helper thread's stages apart; also in --json. Host time: on a GPU the kernels' "
        "own time is a CUDA profiler's to measure",
    )
    bench.set_defaults(subparser=bench)
    info.set_defaults(subparser=info)
    from .demo import add_parser as add_demo_parser  # overlap demo: its options live in overlap/cli/demo.py

    add_demo_parser(sub)
    from .predict import add_parser as add_predict_parser  # overlap predict: its options in overlap/cli/predict.py

    add_predict_parser(sub, _shape, _ops, _modes)
    add_machine_options_to_tune(tune)
    return parser


def add_machine_options_to_tune(tune: argparse.ArgumentParser) -> None:
    """``overlap tune --machine NAME``: a plan file for a described cluster, predicted, nothing run."""
    from .predict import add_machine_options

    group = tune.add_argument_group(
        "a described cluster (nothing runs)",
        "With --machine, tune starts no rank: it writes the cost model's best plan for each problem on the cluster "
        "that --machine, --gpus-per-node and --nodes describe (never one predicted slower than reference), marked "
        "as predicted (no measured time), a starting point until tune runs there; --measure, --repeats, --warmup, "
        "--probe, --timeout and --routing do not apply.")
    add_machine_options(group, required=False)
