"""Where a command of ``overlap`` runs: on torchrun's ranks in place, or on ``--ranks`` local ranks it
starts with `overlap.world.launch` (default: every GPU, else 2 CPU ranks on gloo).
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
        if nproc is not None and nproc != dist.get_world_size():
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
