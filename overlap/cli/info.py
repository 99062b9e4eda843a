"""What ``overlap info`` prints, run on every rank (the command line, `overlap.cli`, starts the ranks):
versions of overlap, torch and Triton, the build of overlap._C, the Triton interpreter state, the
backend, every rank (pid, node, device, threads) and the link class of every pair of ranks; with
``--probe``, the machine profile (`overlap.cli.tune.probe_rank`).
"""

from __future__ import annotations

import os
from typing import Any

import overlap  # (what `overlap info` reports is the installed package itself)

from .. import envs, world


def _software_lines() -> list[str]:
    import torch

    from ..benchmarks.runner import triton_version

    lines = [f"overlap {overlap.__version__} ({os.path.dirname(overlap.__file__)})", f"torch {torch.__version__}"]
    tv = triton_version()
    lines.append("triton: not installed (the 'fused' strategy is unavailable)" if tv is None else f"triton {tv}")
    # as Triton reads it (`envs.triton_interpret`): what this line says is what Triton does
    if envs.triton_interpret():
        how = " (set by overlap: no GPU)" if envs.TRITON_INTERPRET_SET_BY_OVERLAP else ""
        lines.append(f"TRITON_INTERPRET: on: Triton kernels run in the interpreter{how}")
    elif not torch.cuda.is_available() and envs.triton_interpret_set_by_user():  # turned off where no GPU is
        raw = os.environ["TRITON_INTERPRET"]
        lines.append(f"TRITON_INTERPRET: off ({raw!r}, as Triton reads it): strategy 'fused' needs Triton's "
                     "interpreter where no GPU exists; unset TRITON_INTERPRET or set it to 1 to run it")
    else:
        lines.append("TRITON_INTERPRET: off: Triton compiles its kernels")
    try:
        from .. import signals as _C

        count: Any
        try:
            count = _C.cuda_device_count()
        except Exception as exc:  # noqa: BLE001 - no driver: say why
            count = f"unavailable ({exc})"
        lines.append(f"overlap._C: built with CUDA: {'yes' if _C.has_cuda else 'no'}; CUDA devices: {count}")
    except ImportError as exc:
        lines.append(f"overlap._C: not importable ({exc})")
    return lines


def info_rank() -> None:
    """``overlap info`` on every rank: every rank's facts gathered, printed by rank 0."""
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


def probe_rank(refresh: bool, quick: bool) -> None:
    """``overlap info --probe`` on every rank: the machine profile, printed by rank 0."""
    import torch.distributed as dist

    from . import tune

    lines = tune.probe_rank(refresh, quick)
    if dist.get_rank() == 0:
        print("\n".join(line for line in lines if line), flush=True)
