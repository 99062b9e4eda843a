"""``overlap predict``: what the cost model expects of the ops on a described GPU cluster, before any GPU hour.

No ranks start: the cluster is ``--machine NAME --gpus-per-node G --nodes N`` (`overlap.plans.presets`; a measured
profile of the machine's GPU in the profile cache, or ``--profile FILE``, replaces the preset's numbers) and the
cases are ``overlap bench``'s (``--op``, ``--shape``, ``--dtype``, ``--mode``; default: its GPU cases for that many
ranks). For each case: the unfused time (the plain collectives, then the GEMMs: ``reference``), the GEMMs alone,
the communication alone, every strategy at its best chunk counts per link with its speedup over unfused and the
share of the communication it hides, ``auto``'s choice under this profile (`overlap.plans.auto.described_plan`;
the runtime makes it on GPUs of that preset, and for MoE calls with a plan file of ``overlap tune --machine``), and
whether overlap pays there and why
(`overlap.plans.forecast`). ``--json PATH`` (``-``: standard output) writes the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from ..benchmarks.names import BENCH_OPS, DEFAULT_OPS, DTYPE_NAMES, MODES
from .argtypes import int_at_least

_at_least_one = int_at_least(1)

EXAMPLES = """\
examples:
  overlap predict --machine h100-sxm
  overlap predict --machine h800 --shape llama3-70b-full --dtype bfloat16 --mode fwd+bwd
  overlap predict --machine h100-sxm --gpus-per-node 8 --nodes 2 --op all_gather_matmul --shape 1024x8192x3584
  overlap predict --machine mi300x --op moe --shape deepseek-v3-full --json -
"""


def add_machine_options(parser: argparse.ArgumentParser, required: bool) -> None:
    """``--machine``, ``--gpus-per-node``, ``--nodes`` and ``--profile`` (predict's, and tune's without ranks)."""
    from ..plans.presets import PRESETS

    parser.add_argument("--machine", required=required, type=_machine_name, metavar="NAME",
                        help=f"the GPU of the cluster, a preset: {', '.join(PRESETS)} (vendor peaks times documented "
                        "efficiencies; a profile measured on that GPU in the profile cache replaces them)")
    parser.add_argument("--gpus-per-node", type=_at_least_one, default=None, metavar="G",
                        help="GPUs per node, linked by the machine's fabric (default: the preset's node, 8)")
    parser.add_argument("--nodes", type=_at_least_one, default=1, metavar="N",
                        help="nodes, one NIC per GPU between them; the group is every GPU (default: %(default)s)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="a machine profile (JSON, as overlap info --probe caches it) to use instead of the "
                        "preset's numbers and the cache")


def _machine_name(text: str) -> str:
    from ..plans.presets import machine

    try:
        return machine(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any, shape_type: Any, ops_type: Any, modes_type: Any) -> None:
    """The ``predict`` command's parser; its ``--shape``, ``--op`` and ``--mode`` types are ``overlap bench``'s
    (`overlap.cli.parser` passes them)."""
    p = sub.add_parser(
        "predict",
        help="what the cost model expects of every strategy on a described GPU cluster (runs nothing)",
        description="Predict, without running anything, each op's time on a described cluster: the unfused time "
        "(plain collectives, then GEMMs), the GEMMs alone, the communication alone, every strategy at its best "
        "chunk counts per link (speedup over unfused, share of the communication hidden), the plan auto would "
        "choose (never one the model predicts slower than unfused), and whether overlap pays there and why. "
        "Shapes, ops, dtypes and modes as overlap bench takes them (default: its GPU cases for G x N ranks).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_options(p, required=True)
    p.add_argument("--op", type=ops_type, action="append", default=None, metavar="LIST",
                   help=f"comma-separated ops among {','.join(BENCH_OPS)}, or the option repeated (default: "
                   f"{','.join(DEFAULT_OPS)}, as overlap bench; with --shape, the ops its shapes are for)")
    p.add_argument("--shape", type=shape_type, nargs="+", default=None, metavar="SHAPE",
                   help="cases as overlap bench --shape takes them: MxKxN (the per-rank GEMM [W*M, K] @ [K, N]), a "
                   "model preset (llama3-8b-full, ...), T,H,F,E,K or an MoE preset for moe")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="dtype of the cases (default: bfloat16 for --shape, else each default case's own); "
                   "float8_e4m3fn: the fp8='rowwise' recipe, at the machine's FP8 GEMM rate; mxfp8: the fp8='mxfp8' "
                   "recipe (MX blocks of 32 along K), at the FP8 rate where the GPU multiplies MX blocks (Blackwell), "
                   "else the FP32 rate (dequantized); both count the fp8 bytes and the scales the gathers move")
    p.add_argument("--mode", type=modes_type, action="append", default=None, metavar="LIST",
                   help="comma-separated modes: fwd, fwd+bwd (default: both)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the predictions there as JSON (- : stdout)")
    p.set_defaults(subparser=p)


def described_cluster(args: argparse.Namespace):
    """The `overlap.plans.presets.Cluster` of ``--machine``, ``--gpus-per-node``, ``--nodes``, ``--profile``;
    ValueError naming the option that is wrong."""
    from .. import envs
    from ..plans import Profile
    from ..plans.presets import cluster

    profile = None
    if args.profile is not None:
        try:
            with open(args.profile) as f:
                profile = Profile.from_json(json.load(f), where=f"profile {args.profile}")
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--profile: cannot read {args.profile}: {exc}") from None
    c = cluster(args.machine, args.gpus_per_node, args.nodes, profile=profile, cache=envs.cache_dir())
    if profile is not None:
        c = dataclasses.replace(c, measured=args.profile)
    return c


def cases(args: argparse.Namespace, world_size: int) -> list[tuple[Any, str]]:
    """``(Problem, label)`` of every case of the command line for `world_size` ranks, each problem once."""
    from ..benchmarks.cases import default_cases
    from . import bench
    from .argtypes import selection

    modes = selection(args.mode, MODES)
    ops = selection(args.op, BENCH_OPS) if args.op else None
    if args.shape:
        _, chosen = bench.cases_of(ops, modes, args.shape, args.dtype or "bfloat16", world_size)
    else:
        chosen = default_cases(ops or DEFAULT_OPS, "cuda", args.dtype, modes, world_size)
        chosen = [c for c in chosen if not c.world_problem(world_size)]
        if not chosen:
            raise ValueError(f"no default GPU case runs on {world_size} ranks: give --shape")
    out: dict[Any, str] = {}
    for case in chosen:
        labels = [getattr(case, "preset", ""), getattr(case, "layer", "")]
        out.setdefault(case.problem, " ".join(s for s in labels if s))
    return list(out.items())


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``overlap predict``: exit 0, or 2 (one line) for arguments that do not describe a cluster or cases."""
    from ..plans.forecast import forecast

    if args.json not in (None, "-"):
        from .bench import check_output_path

        try:
            check_output_path("--json", args.json)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        c = described_cluster(args)
        problems = cases(args, c.topology.world_size)
        forecasts = [(forecast(p, c.topology, c.profile), label) for p, label in problems]
    except ValueError as exc:
        parser.error(str(exc))
    if args.json == "-":
        print(json.dumps(payload(c, forecasts), indent=1))
        return 0
    print("\n".join(report(c, forecasts)), flush=True)
    if args.json:
        from ..plans.planfile import write_atomic

        try:
            write_atomic(args.json, json.dumps(payload(c, forecasts), indent=1) + "\n")
        except OSError as exc:
            print(f"overlap predict: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0


def payload(c, forecasts) -> dict:
    return {"machine": c.machine.name, "about": c.about, "profile": c.profile.machine,
            "measured_profile": c.measured or None, "topology": c.topology.signature,
            "predictions": [{**f.to_json(), "label": label} for f, label in forecasts]}


def _time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.3f} ms"


def report(c, forecasts) -> list[str]:
    """The text table: a header for the cluster, then a block per case."""
    t = c.topology
    lines = [f"{c.about}; {t.world_size} ranks ({', '.join(f'{k}*{n}' for k, n in t.links) or 'one rank'})",
             f"profile: {c.profile.machine}",
             "predicted by the cost model (docs/cost-model.md), not measured; unfused = the plain collectives, then "
             "the GEMMs"]
    for f, label in forecasts:
        ref = f.reference
        lines += ["", f"{f.problem.key}{f' ({label})' if label else ''}: unfused {_time(ref.total_s)} = "
                  f"communication {_time(ref.comm_s)} + GEMMs {_time(ref.compute_s)}"]
        head = f"  {'strategy':<20} {'plan':<34} {'predicted':>11} {'speedup':>8} {'hidden':>7}"
        lines.append(head)
        for r in f.rows:
            if math.isfinite(r.seconds):
                lines.append(f"  {r.label:<20} {r.plan.label(f.links):<34} {_time(r.seconds):>11} "
                             f"{f.speedup(r):>7.2f}x {f.hidden(r):>7.0%}")
            else:
                lines.append(f"  {r.label:<20} {'does not run here':<34} {'-':>11}   ({_reason(r)})")
        a = f.auto
        lines.append(f"  auto chooses {a.plan.label(f.links)}: {_time(a.seconds)}, {f.speedup(a):.2f}x ({f.auto_how})")
        lines.append(f"  {f.verdict}")
    return lines


def _reason(row) -> str:
    detail = row.prediction.detail
    return detail.split(": ", 1)[1] if ": " in detail else detail
