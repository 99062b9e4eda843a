"""Timings of the fused MoE kernels on one GPU (virtual ranks): the part of `gpu_check_moe` that needs a GPU.

Rank 0 of W = 8 virtual ranks with every peer's rows delivered: the wait kernel with every flag set
against one ``torch.mm`` per local expert over the same rows (and torch's ``_grouped_mm`` where it runs),
and the scatter kernel against the same loop (bf16, `moe_shapes`). The virtual ranks are
`gpu_check_moe_group`'s, and so are the kernels' calls (the ops' tile tables and launchers).

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import math

import torch
from gpu_check_common import Report, compare, do_bench, err_text, matmul_tflops
from gpu_check_moe_group import (
    Config,
    MoEGroup,
    expert_mm64,
    expert_weights,
    launch_scatter,
    launch_wait,
    op_tile,
    scatter_call,
    wait_call,
    write_rows,
)
from gpu_check_virtual import KERNEL_TIMEOUT_NS, Device, Tile

# ==============================================================================================
# Timings (one GPU): rank 0 of W = 8, every peer's rows delivered
# ==============================================================================================

TILES = (Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3))  # besides the op's default launch


def timing_config(shape: dict[str, int], ep: int) -> Config:
    return Config(ep, (shape["t"],), shape["h"], shape["f"], shape["e"], shape["k"], torch.bfloat16, skew=0.0,
                  empty=False)


def time_dispatch(rep: Report, dev: Device, label: str, cfg: Config) -> None:
    """Rank 0's wait kernel with every flag set vs one ``torch.mm`` per local expert over the same rows."""
    epoch = 3
    g = MoEGroup.create(dev, cfg, stale=epoch, owners=[0])  # the flags are already at the epoch
    for s in range(cfg.world_size):
        write_rows(g, s, 0, None)
    h, L = g.handles[0], cfg.num_local_experts
    w = expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)
    dev.idle(label)
    recv = torch.cat([g.region(0, s)[h.within_source(s, e) : h.within_source(s, e) + h.recv_counts[s][e]]
                      for e in range(L) for s in range(cfg.world_size)])
    ref = expert_mm64(recv, w, torch.repeat_interleave(torch.arange(L), torch.tensor(h.tokens_per_expert)))
    rows, k, n = recv.shape[0], cfg.hidden, cfg.ffn
    shape = f"{label} rows={rows} {k}x{n} L={L}"
    out = torch.empty((rows, n), device=dev.device, dtype=cfg.dtype)
    ends = [0, *torch.tensor(h.tokens_per_expert).cumsum(0).tolist()]

    def loop() -> None:
        for e in range(L):
            if ends[e + 1] > ends[e]:
                torch.mm(recv[ends[e] : ends[e + 1]], w[e], out=out[ends[e] : ends[e + 1]])

    loop()
    ok, max_err, rel = compare(out, ref)
    t_loop = do_bench(loop)
    rep.add(f"time moe torch.mm loop {shape}", "PASS" if ok else "FAIL", f"{t_loop:.3f} ms ({err_text(max_err, rel)})",
            tflops=matmul_tflops(rows, n, k, t_loop), ms=t_loop)
    data: dict[str, object] = {"loop_ms": t_loop}
    best: tuple[float, str] | None = None
    for tile in (None, *TILES):  # the op's own launch first
        what = "op default " + "x".join(map(str, op_tile(dev, cfg.dtype))) if tile is None else tile.describe()
        try:
            c = wait_call(g, 0, w, tile)  # the table (BLOCK_M) and the grid (BLOCK_N) belong to the tile
            launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS)
            dev.idle(f"{label} {what}")
            ok, max_err, rel = compare(c.out, ref)
            if not ok or int(c.err.item()) or not torch.equal(c.recv, recv):
                data[what] = f"wrong: {err_text(max_err, rel)}, err={int(c.err.item())}"
                rep.add(f"time moe fused dispatch {shape} [{what}]", "FAIL", data[what])
                continue
            t = do_bench(lambda c=c: launch_wait(g, c, epoch, KERNEL_TIMEOUT_NS))
        except Exception as exc:  # noqa: BLE001 - e.g. a tile that needs more shared memory than there is
            data[what] = f"{type(exc).__name__}: {exc}"[:200]
            rep.log(f"tile {what} failed: {data[what]}")
            dev.idle(f"{label} {what}")
            continue
        data[what] = t
        rep.log(f"moe fused dispatch {label} [{what}]: {t:.3f} ms, {matmul_tflops(rows, n, k, t):.0f} TFLOP/s")
        if best is None or t < best[0]:
            best = (t, what)
        if tile is None:
            rep.add(f"time moe fused dispatch {shape}", "PASS", f"{t:.3f} ms [{what}] vs torch.mm loop {t_loop:.3f} ms",
                    tflops=matmul_tflops(rows, n, k, t), ratio=t_loop / t, ms=t, loop_ms=t_loop)
    if best is None:
        rep.add(f"time moe fused dispatch {shape}", "FAIL", "no tile configuration ran", tiles=data)
    else:
        rep.add(f"time moe fused dispatch best {shape}", "PASS", f"{best[0]:.3f} ms [{best[1]}]",
                tflops=matmul_tflops(rows, n, k, best[0]), ratio=t_loop / best[0], ms=best[0], tiles=data)
    # torch's own grouped GEMM, last: a private op whose accepted layouts differ between versions
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        rep.add(f"time moe torch._grouped_mm {shape}", "SKIP", "torch._grouped_mm does not exist in this torch")
        return
    try:
        offs = torch.tensor(ends[1:], dtype=torch.int32, device=dev.device)
        ok, max_err, rel = compare(grouped_mm(recv, w, offs=offs), ref)
        t = do_bench(lambda: grouped_mm(recv, w, offs=offs))
    except Exception as exc:  # noqa: BLE001 - e.g. a weight layout this version refuses
        rep.add(f"time moe torch._grouped_mm {shape}", "SKIP", f"{type(exc).__name__}: {exc}"[:200])
        return
    if not ok:
        rep.add(f"time moe torch._grouped_mm {shape}", "SKIP", f"differs from float64: {err_text(max_err, rel)}")
        return
    rep.add(f"time moe torch._grouped_mm {shape}", "PASS", f"{t:.3f} ms ({err_text(max_err, rel)})",
            tflops=matmul_tflops(rows, n, k, t), ratio=t_loop / t, ms=t)


def time_combine(rep: Report, dev: Device, label: str, cfg: Config) -> None:
    """Rank 0's scatter kernel (results stored into every source's region, flags released) vs one
    ``torch.mm`` per local expert into one tensor. The combine GEMM is ``F -> H``."""
    epoch = 3
    g = MoEGroup.create(dev, cfg, stale=epoch - 1, owners=[])
    h, W = g.handles[0], cfg.world_size
    rows, k, n = h.num_recv, cfg.ffn, cfg.hidden
    y = torch.randn(rows, k, device=dev.device).to(cfg.dtype)
    w = expert_weights(cfg, k, n, dev.device)
    row_bytes = n * y.element_size()
    dests = [torch.full((g.stride // row_bytes, n), math.nan, device=dev.device, dtype=cfg.dtype) for _ in range(W)]
    c = scatter_call(g, 0, y, w, dst=[t.data_ptr() for t in dests])
    dev.idle(label)
    launch_scatter(g, c, epoch)
    dev.idle(label)
    staged = torch.cat([dests[s][: h.recv_splits[s]] for s in range(W)])  # staging order: source, expert, token
    got = staged.index_select(0, h.staging_of_expert_row)
    experts = torch.repeat_interleave(torch.arange(cfg.num_local_experts), torch.tensor(h.tokens_per_expert))
    ok, max_err, rel = compare(got, expert_mm64(y, w, experts))
    shape = f"{label} rows={rows} {k}x{n} L={cfg.num_local_experts}"
    if not ok or int(g.counters[0].abs().sum()):
        rep.add(f"time moe fused combine {shape}", "FAIL", f"wrong: {err_text(max_err, rel)}, counters "
                                                            f"{g.counters[0].nonzero().flatten().tolist()}")
        return
    out = torch.empty((rows, n), device=dev.device, dtype=cfg.dtype)
    ends = [0, *torch.tensor(h.tokens_per_expert).cumsum(0).tolist()]

    def loop() -> None:
        for e in range(cfg.num_local_experts):
            if ends[e + 1] > ends[e]:
                torch.mm(y[ends[e] : ends[e + 1]], w[e], out=out[ends[e] : ends[e + 1]])

    t_loop = do_bench(loop)
    t = do_bench(lambda: launch_scatter(g, c, epoch))
    rep.add(f"time moe fused combine {shape}", "PASS",
            f"{t:.3f} ms [op default] vs torch.mm loop {t_loop:.3f} ms ({err_text(max_err, rel)})",
            tflops=matmul_tflops(rows, n, k, t), ratio=t_loop / t, ms=t, loop_ms=t_loop)
