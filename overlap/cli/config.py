"""The environment a command's ranks will read, checked in the parent once the arguments are (`check_config`):
a mistake in it is one line naming the variable or the file and the fix, exit status 2, before any rank starts,
not a traceback per rank after they did. Loads torch only where it must (a plan file, the probe cache, which
device the ranks get), so that an argument error still answers without it."""

from __future__ import annotations

import argparse
import sys

from ..benchmarks.names import all_bench_labels


def config_error(args: argparse.Namespace) -> str | None:
    """What in the environment would fail the ranks of `args.command`, as one line naming the variable or the
    file and the fix (`overlap.envs.check`: the deadlines, the yes/no variables, OVERLAP_SHM_DIR, OVERLAP_CACHE_DIR;
    the plan file OVERLAP_PLAN names; TRITON_INTERPRET turned off on CPU ranks for a command that runs
    ``fused``), or None. Read as the ranks will read it, so that a mistake is one line and exit 2, not a
    traceback per rank after they started."""
    if args.command not in ("info", "bench", "tune", "demo"):
        return None
    from .. import envs

    try:
        envs.check()
        probes = (args.command == "info" and args.probe and not args.quick) or (
            args.command == "tune" and args.machine is None and args.probe in ("cached", "refresh"))
        if probes:
            from ..tune.cache import check_cache_dir, may_probe

            if may_probe(refresh=args.refresh if args.command == "info" else args.probe == "refresh"):
                check_cache_dir()
        if envs.plan_path() is not None:  # (plans.auto loads torch: not for an argument error)
            from ..plans.auto import env_plan_file

            env_plan_file()
    except OSError as exc:
        return exc.strerror or str(exc)
    except ValueError as exc:
        return str(exc)
    off = envs.triton_interpret_off()
    if off is not None and args.command in ("bench", "demo"):
        from .. import world
        from .ranks import num_ranks

        if args.command == "bench":
            labels = args.strategies or all_bench_labels()
            fused, option = any(label.split("+")[0] == "fused" for label in labels), "--strategies without fused"
        else:
            fused, option = args.strategy == "fused", "--strategy"
        if fused and world.ranks_device_type(num_ranks(args.nproc)) == "cpu":
            return f"{off} ({option})"
    return None


def check_config(args: argparse.Namespace) -> None:
    """Exit 2 with `config_error`'s line where the environment would fail the ranks of `args.command`."""
    problem = config_error(args)
    if problem is not None:
        print(f"overlap {args.command}: {problem}", file=sys.stderr)
        sys.exit(2)
