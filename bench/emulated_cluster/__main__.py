"""Emulated two-node cluster: the tuner's pick against an exhaustive grid, over a rate-limited link.

The command line (`bench.emulated_cluster`, the package's docstring, says how the emulation works).

usage (from the repository's root):
  sudo .venv/bin/python -m bench.emulated_cluster                       # 100mbit and 2gbit, 2 ranks per node
  sudo .venv/bin/python -m bench.emulated_cluster --rate 100mbit --repeats 5 --json out.json
  sudo .venv/bin/python -m bench.emulated_cluster --quick --ranks-per-node 1
  sudo .venv/bin/python -m bench.emulated_cluster --figures           # hierarchical's figures (docs/results/)
  sudo .venv/bin/python -m bench.emulated_cluster --moe-figures       # the MoE layer's figures, with migration

Also the ranks' entry (``--rank-entry SPEC``: what `run` starts in each namespace). Exit code 0; 1 when a run fails
(the failing rank's log on stderr); 2 on bad arguments or where the emulation cannot run here; 130 on
SIGINT/SIGTERM. The table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.emulated_cluster.config import DEFAULT_PROBLEMS, QUICK_PROBLEMS, Config
from bench.emulated_cluster.figures import FIGURE_RATES, figure_problems, format_figures
from bench.emulated_cluster.link import EmulationUnavailable
from bench.emulated_cluster.moe import MOE_RATES, format_moe_figures, moe_problems
from bench.emulated_cluster.ranks import rank_entry
from bench.emulated_cluster.report import format_table
from bench.emulated_cluster.run import run


def _parse(argv: list[str] | None) -> tuple[Config, str | None, str | None, str | None]:
    """``(config, --json path, --rank-entry spec, --plans folder)``; exits 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="python -m bench.emulated_cluster", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", action="append", help="link rate in tc's syntax (repeatable; default 100mbit and 2gbit)")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved tuner/grid comparisons per problem")
    ap.add_argument("--measure", type=int, default=3, help="plans the tuner measures besides reference")
    ap.add_argument("--tune-repeats", type=int, default=5, help="timed calls per plan (tuner and grid)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--probe", choices=("quick", "full"), default="quick",
                    help="probe depth (full takes ~2 min at 100mbit: 16 MiB messages)")
    ap.add_argument("--quick", action="store_true", help="one problem, 2 repeats (a smoke run)")
    ap.add_argument("--timeout", type=float, default=0.0,
                    help="OVERLAP_TIMEOUT_S and the process group timeout (default 60 s, 300 s with --probe full)")
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds per rate before the ranks are killed")
    ap.add_argument("--profiles", help="a JSON file {rate: profile} (as --json records them under raw.profile): "
                                       "those rates use it instead of probing")
    ap.add_argument("--figures", action="store_true",
                    help="the hierarchical strategy's figures instead of the tuner/grid comparison: 2 nodes x 2 ranks "
                         f"at {', '.join(FIGURE_RATES)} (unless --rate), every TP op with a hierarchical strategy, "
                         "fwd and fwd+bwd: reference, pipelined, hierarchical, the tuner's pick; bytes per call")
    ap.add_argument("--moe-figures", action="store_true",
                    help="the MoE layer's figures instead of the tuner/grid comparison: 2 nodes x 2 ranks at "
                         f"{', '.join(MOE_RATES)} (unless --rate), a balanced and a skewed routing, fwd and fwd+bwd: "
                         "reference, pipelined, hierarchical, hierarchical with the hot experts migrated, the "
                         "model's migration, the tuner's pick; bytes per call")
    ap.add_argument("--plans", help="with --figures or --moe-figures: a folder where each rate's plan file (the "
                                    "tuner's picks, as `overlap tune` writes them) is saved as plans-<rate>.json")
    ap.add_argument("--json", help="write the raw results and summaries here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--rank-entry", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_entry:
        return Config(), None, args.rank_entry, None
    if args.plans and not (args.figures or args.moe_figures):
        ap.error("--plans goes with --figures or --moe-figures")
    try:
        profiles = json.loads(Path(args.profiles).read_text()) if args.profiles else {}
        problems = (tuple(figure_problems()) if args.figures else tuple(moe_problems()) if args.moe_figures
                    else QUICK_PROBLEMS if args.quick else DEFAULT_PROBLEMS)
        rates = tuple(args.rate or (FIGURE_RATES if args.figures else MOE_RATES if args.moe_figures else Config.rates))
        cfg = Config(rates=rates, profiles=profiles, ranks_per_node=args.ranks_per_node,
                     repeats=2 if args.quick and args.repeats == 3 else args.repeats, measure=args.measure,
                     tune_repeats=args.tune_repeats, warmup=args.warmup, probe=args.probe,
                     problems=problems, timeout_s=args.timeout, figures=args.figures, moe_figures=args.moe_figures,
                     deadline_s=args.deadline, verbose=not args.quiet)
    except (ValueError, OSError) as exc:  # json.JSONDecodeError is a ValueError
        ap.error(str(exc))
    return cfg, args.json, None, args.plans


def main(argv: list[str] | None = None) -> int:
    cfg, json_path, rank_spec, plans_dir = _parse(argv)
    if rank_spec is not None:
        rank_entry(rank_spec)
        return 0
    start = time.monotonic()
    try:
        results = run(cfg)
    except EmulationUnavailable as exc:
        print(f"emulated_cluster: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"emulated_cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"emulated_cluster: interrupted ({exc or 'SIGINT'}); ranks stopped, link torn down", file=sys.stderr)
        return 130
    raws = [r["raw"] for r in results]
    print(format_figures(raws) if cfg.figures else format_moe_figures(raws) if cfg.moe_figures
          else format_table([r["summary"] for r in results]))
    print(f"total {time.monotonic() - start:.0f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    for r in results if plans_dir else ():
        Path(plans_dir).mkdir(parents=True, exist_ok=True)
        Path(plans_dir, f"plans-{r['raw']['rate']}.json").write_text(json.dumps(r["raw"]["plan_file"], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
