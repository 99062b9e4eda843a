"""Where a command of ``overlap`` runs: on torchrun's ranks in place, or on ``--ranks`` local ranks it
starts with `overlap.world.launch` (default: every GPU, else 2 CPU ranks on gloo).

More local CPU ranks than cores (`cpu_cores`) run, but take turns on the cores: the command says so before they
start (`oversubscribed`), as every step then runs slower and a progress bar may sit on one step a while.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .. import world


def on_ranks(command: str, fn: Callable, args: tuple, nproc: int | None, scratch: str | None = None
             ) -> tuple[int, Any]:
    """Run ``fn(*args)`` on torchrun's ranks in place, or on `nproc` freshly started local ranks.

    Returns (exit code, what `fn` returned in place or None): the code is 0, or 1 after printing
    the failing rank's traceback to stderr. `scratch`: the command's scratch folder, which local ranks
    remove if this process is killed before it can (`overlap.world.launch`'s ``leftovers``).
    """
    import torch.distributed as dist

    owned = not dist.is_initialized()
    try:
        in_place = world.init_from_env()
    except Exception:  # noqa: BLE001 - a broken torchrun environment is reported like a rank failure
        print(f"overlap {command}: could not join torchrun's ranks:\n{traceback.format_exc()}", file=sys.stderr)
        return 1, None
    if in_place:
        if nproc is not None and nproc != dist.get_world_size() and dist.get_rank() == 0:  # once, not once per rank
            print(
                f"overlap {command}: running on the {dist.get_world_size()} ranks of torchrun; --ranks {nproc} "
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
    warning = oversubscribed(command, nproc if nproc is not None else world.default_nproc())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        world.launch(fn, nproc, args=args, leftovers=(scratch,) if scratch else ())
    except RuntimeError as exc:
        print(f"overlap {command}: {exc}", file=sys.stderr)
        return 1, None
    return 0, None


def num_ranks(nproc: int | None) -> int:
    """The number of ranks the command will run on (see `on_ranks`): torchrun's, else `nproc`, else the default."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return nproc if nproc is not None else world.default_nproc()


def cpu_cores() -> int:
    """The CPU cores this process may run on: its affinity mask's (a container's or ``taskset``'s limit) where the
    system has one, else `os.cpu_count`."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks (macOS)
        return os.cpu_count() or 1


def oversubscribed(command: str, nproc: int) -> str | None:
    """The one-line warning that `nproc` local ranks will share fewer CPU cores (`cpu_cores`), or None: where they
    compute on CPUs (`overlap.world.ranks_device_type`) and outnumber the cores. They run (each on one thread), but
    start up and step slower, and a rank waiting for a descheduled peer looks stuck."""
    cores = cpu_cores()
    if nproc <= cores or world.ranks_device_type(nproc) != "cpu":
        return None
    plural = "s" if cores != 1 else ""
    return (f"overlap {command}: warning: {nproc} CPU ranks on {cores} core{plural}: oversubscribed, "
            "the ranks take turns on the cores, so start-up and every step run slower (each wait on a descheduled "
            f"peer too) and the progress may sit on one step a while; --ranks {cores} or fewer runs at full speed")
