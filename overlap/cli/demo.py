"""``overlap demo``: its parser (`add_parser`, registered by `overlap.cli.parser`) and what it does around
its ranks (`run`): check the arguments before any rank starts (exit 2; ``--json`` and ``--plot`` as
``overlap bench`` checks them), train on the ranks
(`overlap.demo.train.train_rank`), then print the report and write ``--json``/``--plot`` (rank 0).

The training, model and report live in `overlap.demo`, imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from typing import TYPE_CHECKING

from .argtypes import add_ranks_option, int_at_least, positive_float, timeout_seconds

if TYPE_CHECKING:
    from ..demo.config import ModelConfig

_DESCRIPTION = (
    "Train a small GPT-style model (embedding; attention and MLP blocks with sequence-parallel tensor "
    "parallelism over the ranks; an MoE block with its experts over the ranks) twice from the same seed and "
    "data: once with torch's own tensor-parallel styles (ColwiseParallel, RowwiseParallel, SequenceParallel) "
    "and plain all-to-alls for the MoE block, once with overlap's (overlap.hooks.torch_tp's styles, "
    "overlap.nn.ExpertParallelMLP) on --strategy. The data is a fixed token stream from a seeded Markov chain "
    "(nothing is downloaded). Prints every step's loss side by side with their largest relative difference, "
    "the step times (median and p25..p75 of the slowest rank's, per run; step 0 is a warm-up and not timed), the "
    "step-time ratio overlap/torch (the median and p25..p75 of the per-step ratios, which need not equal the ratio "
    "of the two medians) and the peak memory of each run. The model's heads, ffn size, experts and sequence length "
    "must divide by the number of ranks (the error names sizes that do)."
)

_EPILOG = """\
examples:
  overlap demo
  overlap demo --steps 50 --strategy pipelined --json demo.json --plot demo.png
  overlap demo --ranks 4 --seq-len 64 --batch 4
  torchrun --nproc-per-node 8 -m overlap.cli demo --heads 8 --experts 8
"""


_positive_float = positive_float()


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``demo`` to the ``overlap`` command's subparsers `sub`."""
    from ..demo.config import ModelConfig  # no torch: the defaults only

    defaults = ModelConfig()
    demo = sub.add_parser("demo", help="train a small GPT-style model with torch's tensor parallelism and with "
                          "overlap's, and compare losses, step time and memory",
                          description=textwrap.fill(_DESCRIPTION, 100), epilog=_EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    positive = int_at_least(1)
    add_ranks_option(demo)
    demo.add_argument("--steps", type=int_at_least(2), default=30, metavar="N",
                      help="training steps of each run (default: %(default)s)")
    demo.add_argument("--strategy", default="auto",
                      help="overlap's strategy: auto, reference, pipelined, symm or fused (default: %(default)s)")
    demo.add_argument("--json", default=None, metavar="PATH", help="write the losses, step times, memory and "
                      "summary there as JSON")
    demo.add_argument("--plot", default=None, metavar="PATH", help="draw the loss curves overlaid and the step "
                      "times of both runs there (format from the suffix: .png, .svg, .pdf); needs matplotlib")
    demo.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the model and the data "
                      "(default: %(default)s)")
    demo.add_argument("--lr", type=_positive_float, default=1e-2, help="AdamW's learning rate (default: %(default)s)")
    for name, what in (("hidden", "hidden size"), ("heads", "attention heads"), ("ffn", "MLP and expert ffn size"),
                       ("layers", "attention + MLP layers"), ("experts", "experts of the MoE block"),
                       ("top_k", "experts per token"), ("seq_len", "sequence length"), ("batch", "sequences per step"),
                       ("vocab", "vocabulary size")):
        demo.add_argument(f"--{name.replace('_', '-')}", type=positive, default=getattr(defaults, name), metavar="N",
                          help=f"{what} (default: %(default)s)")
    demo.add_argument("--timeout", type=timeout_seconds, default=None, metavar="S",
                      help="deadline in seconds of each wait on a peer (default: OVERLAP_TIMEOUT_S, 300)")
    demo.set_defaults(subparser=demo)
    return demo


def sizes_that_fit(model: ModelConfig, world_size: int) -> str:
    """What to run instead of a `model` (`overlap.demo.config.ModelConfig`) that does not divide over `world_size`
    ranks: the numbers of ranks it divides over, and the options of the least larger model that divides over
    `world_size` (`ModelConfig.fitted`); ``"; "`` first, or empty where there is nothing to say."""
    hints = []
    fit = [str(w) for w in model.ranks_that_fit()]
    if fit:
        ranks = f"{', '.join(fit[:-1])} or {fit[-1]}" if len(fit) > 1 else fit[0]
        hints.append(f"these sizes divide over {ranks} ranks (--ranks)")
    fitted = model.fitted(world_size)
    if fitted != model and not fitted.problems(world_size):
        changed = " ".join(f"--{name.replace('_', '-')} {getattr(fitted, name)}"
                           for name in ("heads", "hidden", "ffn", "experts", "seq_len")
                           if getattr(fitted, name) != getattr(model, name))
        hints.append(f"on {world_size} ranks, try {changed}")
    return "".join(f"; {h}" for h in hints)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``overlap demo``: exit 0, 1 (a rank failed) or 2 (arguments, checked before the ranks start)."""
    from ..demo import report
    from ..demo.config import DemoConfig, ModelConfig
    from ..demo.train import train_rank
    from ..plans import STRATEGIES
    from .bench import check_outputs
    from .config import check_config
    from .ranks import num_ranks, on_ranks

    if args.strategy not in ("auto", *STRATEGIES):
        parser.error(f"--strategy: expected auto or one of {', '.join(STRATEGIES)}, got {args.strategy!r}")
    try:  # as overlap bench checks them: folders, a format matplotlib writes (from the suffix), matplotlib
        check_outputs(args.json, args.plot, None)
    except ValueError as exc:
        parser.error(str(exc))
    model = ModelConfig(vocab=args.vocab, hidden=args.hidden, heads=args.heads, ffn=args.ffn, layers=args.layers,
                        experts=args.experts, top_k=args.top_k, seq_len=args.seq_len, batch=args.batch)
    world_size = num_ranks(args.nproc)
    problems = model.problems(world_size)
    if problems:
        parser.error(f"the model does not divide over {world_size} ranks: {'; '.join(problems)}"
                     f"{sizes_that_fit(model, world_size)}")
    config = DemoConfig(model=model, steps=args.steps, lr=args.lr, seed=args.seed, strategy=args.strategy,
                        timeout=args.timeout)
    check_config(args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="overlap-demo-") as tmp:
        out_path = os.path.join(tmp, "results.json")
        code, in_place = on_ranks("demo", train_rank, (config, out_path), args.nproc, tmp)
        if code != 0:
            return code
        if in_place is None:  # locally started ranks: rank 0 left the results in the file
            with open(out_path) as f:
                results = json.load(f)
        else:
            results = in_place
    if in_place is not None and int(os.environ.get("RANK", "0")) != 0:
        return 0
    derived = report.summary(results)
    print("\n".join(report.lines(results, derived)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "summary": derived}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(results, args.plot)
        print(f"wrote {args.plot}")
    print(f"overlap demo: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
