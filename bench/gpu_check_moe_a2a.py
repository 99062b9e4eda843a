"""h. overlap.signals' MoE all-to-all kernels (csrc/cuda/moe_a2a.cu) on virtual ranks, with the ops' slot layout
(`gpu_check_moe_group.MoEGroup`); run by `gpu_check_moe.run_a2a_checks` on GPUs only (the kernels need one)."""

from __future__ import annotations

import torch
from gpu_check_common import Report
from gpu_check_moe_group import Config, MoEGroup, staged_rows
from gpu_check_virtual import Device
from overlap.kernels import slots

from overlap import signals
from overlap.ops.moe import cuda as moe_cuda
from overlap.ops.moe import layout


def check_a2a_kernels(rep: Report, dev: Device, cfg: Config) -> None:
    """Racing: each source's one dispatch launch on its own stream with `moe_cuda`'s tables, held by a gate;
    then every receiver's bounded waits (Call.wait_ready on GPUs); then the gate opens. Regions bitwise
    against index_select, each flag at the epoch exactly where its block has rows, counters back at 0, no wait
    timed out. Then each rank's combine launch over its regions against `layout.weighted_sum` of the same rows."""
    name = f"h.moe a2a kernels {cfg.describe()}"
    epoch = 9
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    W, F, H, d = cfg.world_size, g.flags_per_peer, cfg.hidden, dev.device
    row_bytes = H * g.xs[0].element_size()
    # ---- tables (made on the current stream, before any launch on the ranks' streams) ----
    launches = []
    for s in range(W):
        h = g.handles[s]
        blocks = moe_cuda.dispatch_blocks(h)
        if blocks[-1] == 0:
            continue
        per_chunk = moe_cuda.rows_per_chunk(row_bytes)
        chunks = moe_cuda.chunk_offsets(blocks, per_chunk)
        flags = [g.flag(s, i).data_ptr() for i in moe_cuda.block_flags(h)]
        table = torch.tensor(blocks + chunks + flags, dtype=torch.int64, device=d)
        dst = torch.tensor([g.region(r, s).data_ptr() for r in range(W)], dtype=torch.int64, device=d)
        launches.append((s, h, table, dst, len(blocks), blocks[-1], chunks[-1], per_chunk))
    err = torch.zeros(W, dtype=torch.int32, device=d)
    if dev.spin_guard(rep, name, 2 * W, 2 * W):  # a gate per source, a bounded wait per receiver
        return
    waiters = [dev.stream() for _ in range(W)]
    dev.idle(name)
    G = slots.expert_groups(cfg.num_local_experts, W)

    def dispatch(launch: tuple, value: int, stream: int) -> None:
        s, h, table, dst, n, num_sends, num_chunks, per_chunk = launch
        signals.moe_dispatch_rows(g.xs[s].data_ptr(), h.token_of.data_ptr(), num_sends, row_bytes,
                                  dst.data_ptr(), table.data_ptr(), table.data_ptr() + 8 * n, W * G, G, num_chunks,
                                  per_chunk, g.counters[s].data_ptr(), table.data_ptr() + 16 * n, value, stream)

    if launches:  # the kernel loaded before any gate (`Device.warm`): at the stale epoch, its rows poisoned again
        dev.warm(name, lambda: dispatch(launches[0], epoch - 1, torch.cuda.current_stream().cuda_stream))
        g.poison_regions()
    # The producers first, in host order (each source's launch held by a gate until every wait is issued), then
    # the receivers' bounded waits (gpu_check_virtual's docstring: no wait queued in front of its producer).
    gate = dev.gate()
    for launch in launches:
        gate.hold(g.streams[launch[0]])
        dispatch(launch, epoch, g.streams[launch[0]].cuda_stream if dev.cuda else 0)
    if dev.cuda:
        for r in range(W):
            for s in range(W):
                for i in g.group_flags(s, r, r * F):
                    dev.wait_flag(g.flag(s, i), epoch, waiters[r], err[r : r + 1])
    gate.open()
    dev.settle([*g.streams, *waiters], g.dispatch_flags(), name)
    problems = []
    if err.any():
        problems.append(f"bounded waits timed out on ranks {err.nonzero().flatten().tolist()}")
    for s in range(W):
        due = {i for r in range(W) for i in g.group_flags(s, r, r * F)}
        pad = g.pads[s].tolist()
        wrong = [(i, v) for i, v in enumerate(pad) if v != (epoch if i in due else epoch - 1)]
        if wrong:
            problems.append(f"source {s}: flags (index, value) {wrong[:6]} (epoch {epoch})")
        if g.counters[s].any():
            problems.append(f"source {s}: counters not back at 0: {g.counters[s].nonzero().flatten().tolist()}")
        for r in range(W):
            n = g.handles[s].send_splits[r]
            if not torch.equal(g.region(r, s)[:n], staged_rows(g, s, r)):
                problems.append(f"rows {s}->{r} differ")
    # ---- combine: each rank sums its K rows per token from its regions ----
    worst, exact = 0.0, True
    for r in range(W):
        h = g.handles[r]
        T, K = h.num_tokens, h.top_k
        for s in range(W):  # what rank s "computed" for r's rows, in r's send order
            n = h.send_splits[s]
            g.region(r, s)[:n].copy_(torch.randn(n, H, device=d).to(cfg.dtype))
        weights = torch.rand(T, K, device=d)
        out = torch.full((T, H), float("nan"), device=d).to(cfg.dtype)
        back_table = torch.tensor([g.region(r, s).data_ptr() for s in range(W)], dtype=torch.int64, device=d)
        offsets = torch.tensor([*h.send_offsets, T * K], dtype=torch.int64, device=d)
        pos = h.inv_order
        dev.idle(name)
        if T:
            signals.moe_combine_rows(back_table.data_ptr(), offsets.data_ptr(), W, pos.data_ptr(), weights.data_ptr(),
                                out.data_ptr(), T, K, H, moe_cuda.DTYPE_CODES[cfg.dtype],
                                g.streams[r].cuda_stream if dev.cuda else 0)
        dev.settle(g.streams, [], name)
        back = torch.cat([g.region(r, s)[: h.send_splits[s]] for s in range(W)])
        ref = layout.weighted_sum(back.index_select(0, h.inv_order), weights, cfg.dtype)
        exact = exact and torch.equal(out, ref)
        if T:
            diff = (out.float() - ref.float()).abs().max().item()
            worst = max(worst, diff)
            tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}[cfg.dtype]
            if not torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol):
                problems.append(f"combine rank {r}: max |out - weighted_sum| = {diff:.3g}")
    value = f"dispatch bitwise, flags and counters right; combine {'bitwise' if exact else f'max diff {worst:.3g}'}"
    rep.add(name, "FAIL" if problems else "PASS", "; ".join(problems) or value)
