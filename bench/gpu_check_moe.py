"""One GPU, virtual ranks: checks g and timings of the fused MoE kernels (`overlap.kernels.dispatch_grouped_matmul`,
`overlap.kernels.grouped_matmul_combine`), launched as
`dispatch_grouped_matmul`'s fused strategy launches `grouped_matmul_wait_kernel` and `grouped_matmul_combine`'s
launches `grouped_matmul_scatter_kernel`: the ops' own tile tables (`overlap.ops.moe.tiles.dispatch_tile_table`,
`combine_tile_table`) and launchers (`overlap.kernels.launch_grouped_matmul_wait`, `launch_grouped_matmul_scatter`).

The virtual ranks, the slot layout and the kernels' calls are `gpu_check_moe_group`'s; the sections (this module's
entries run them, as the groups "moe", "a2a" and "time_moe"): `gpu_check_moe_dispatch` (the wait kernel),
`gpu_check_moe_combine` (the scatter kernel), `gpu_check_moe_a2a` (overlap.signals' all-to-all kernels, GPU only),
`gpu_check_moe_timing` (GPU only). The racing checks issue their producers before their waiters, behind a
host-released gate (`gpu_check_virtual`'s docstring says why).

Checks (outputs and received rows NaN-poisoned; GEMMs against float64, received rows bitwise):
g. dispatch ordered: every source writes its counts and its rows into every receiver's regions
   (``index_select`` as the op's producer does) and flags them; then each receiver reads its header, builds its
   tile table and runs the wait kernel.
g. dispatch racing: the wait kernels spin; the rows are copied in and flagged 20 ms later
   from another stream, rank 0's last (GPU: plain copies and stream-ordered flag writes; the spinning grids leave
   SMs free; CPU: a thread).
g. dispatch timeout: rank 1's rows are in place but never flagged: rank 0's kernel gives up after its
   timeout with ``err == 2``, its own rows right.
g. combine ordered: every expert rank's scatter kernel, then every source collects its rows (send order,
   then pair order) against float64; twice (epochs 7 and 8: fresh inputs, the same regions and counters).
   After each call every flag of a group with rows is at the epoch, every other flag untouched, every
   counter back at 0.
g. combine racing: the sources wait and copy (GPU: stream-ordered one-thread bounded waits, as
   `Call.wait_ready` does on GPUs; CPU: host waits in threads); the scatter kernels run 20 ms later, rank 0's
   last.
Timings (GPU, bf16, W=8, 4096 tokens per rank, `moe_shapes`): rank 0's wait kernel with every flag set,
against one ``torch.mm`` per local expert over the same rows (and torch's ``_grouped_mm`` where it runs);
rank 0's scatter kernel against the same loop.

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import torch
from gpu_check_common import Report, moe_shapes
from gpu_check_moe_a2a import check_a2a_kernels
from gpu_check_moe_combine import check_combine_ordered, check_combine_racing
from gpu_check_moe_dispatch import check_dispatch_ordered, check_dispatch_racing, check_dispatch_timeout
from gpu_check_moe_group import Config
from gpu_check_moe_timing import time_combine, time_dispatch, timing_config
from gpu_check_virtual import Device

# ==============================================================================================
# Entries (gpu_check_groups.GROUPS): the groups "moe", "a2a" and "time_moe"
# ==============================================================================================


def configs(dev: Device) -> tuple[list[Config], Config, Config]:
    """The ordered checks' configurations, the racing one, the timeout one (GPU sizes, or interpreted ones)."""
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    if dev.cuda:
        ordered = [Config(4, (200, 96, 333, 150), 512, 384, 8, 2, bf16),
                   Config(8, (256, 100, 180, 77), 256, 512, 8, 2, bf16, "transposed"),  # L = 1: rank 1 gets nothing
                   Config(8, (64, 40, 100, 23), 256, 128, 256, 8, bf16, hot=2.0),  # L = 32 > 31 groups
                   Config(4, (90, 130, 17, 60), 200, 136, 16, 4, f16, "transposed")]  # odd widths
        return ordered, Config(4, (64, 48, 80, 32), 256, 256, 8, 2, bf16), Config(2, (64, 48), 256, 128, 4, 2, bf16)
    ordered = [Config(2, (20, 13), 32, 24, 4, 2, f32),  # interpreted, 32x32x32 tiles
               Config(3, (17, 0, 9), 40, 24, 6, 2, bf16, "transposed"),  # a rank without tokens
               Config(4, (8, 5, 11, 6), 32, 16, 256, 4, f32, hot=2.0)]  # L = 64 > 63 expert groups
    return ordered, Config(2, (12, 9), 32, 32, 4, 2, f32), Config(2, (12, 9), 32, 32, 4, 2, f32)


def run_moe_checks(rep: Report, dev: Device) -> None:
    """Group "moe": the sections g (both grouped-GEMM kernels), in order."""
    ordered, racing, timeout = configs(dev)
    for cfg in ordered:
        rep.run(f"g.moe dispatch ordered {cfg.describe()}", lambda c=cfg: check_dispatch_ordered(rep, dev, c))
    rep.run(f"g.moe dispatch racing {racing.describe()}", lambda: check_dispatch_racing(rep, dev, racing))
    rep.run(f"g.moe dispatch timeout {timeout.describe()}", lambda: check_dispatch_timeout(rep, dev, timeout))
    for cfg in ordered:
        rep.run(f"g.moe combine ordered {cfg.describe()}", lambda c=cfg: check_combine_ordered(rep, dev, c))
    rep.run(f"g.moe combine racing {racing.describe()}", lambda: check_combine_racing(rep, dev, racing))


def run_a2a_checks(rep: Report, dev: Device) -> None:
    """Group "a2a": the sections h (overlap.signals' MoE all-to-all kernels); GPU only."""
    gpu_only = None if dev.cuda else "GPU only"
    for cfg in configs(dev)[0]:
        rep.run(f"h.moe a2a kernels {cfg.describe()}", lambda c=cfg: check_a2a_kernels(rep, dev, c), skip=gpu_only)


def run_moe_timings(rep: Report, dev: Device) -> None:
    """Group "time_moe": both grouped GEMMs against torch on W = 8 virtual ranks; GPU only."""
    gpu_only = None if dev.cuda else "GPU only"
    for label, shape in moe_shapes(8):
        cfg = timing_config(shape, 8)
        rep.run(f"time moe fused dispatch {label}", lambda a=(label, cfg): time_dispatch(rep, dev, *a), skip=gpu_only)
        rep.run(f"time moe fused combine {label}", lambda a=(label, cfg): time_combine(rep, dev, *a), skip=gpu_only)
