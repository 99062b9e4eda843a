"""``overlap.signals``' MoE all-to-all kernels (csrc/cuda/moe_a2a.cu: `moe_dispatch_rows`, `moe_combine_rows`),
which the ``symm`` and ``fused`` MoE strategies run on GPUs, on virtual ranks with the MoE slot layout
(`moe_ranks.MoEGroup`). CUDA only: the kernels need a GPU.

The dispatch kernel copies each source's rows into its region of every destination's slot and releases each
(destination, expert group) block's flag once the block's rows are in; the receivers wait on those flags with the
ops' bounded stream-ordered waits, racing the copies. Then the combine kernel sums each token's ``K`` rows from a
rank's regions with their routing weights, in fp32.

The kernels' tables (blocks, chunks, flag indices, dtype codes) come from `overlap.kernels.all_to_all`, the
kernels' launch data the ops use too. `signals` is looked up in this module at each call, so that
tests/gpu/cpu/test_gpu_check_order.py can stand in for it.
"""

from __future__ import annotations

import pytest
import torch
from overlap.kernels import all_to_all, slots

from overlap import signals
from tests.gpu.moe_ranks import Config, MoEGroup, ordered_cases, ordered_config, staged_rows
from tests.gpu.tolerance import verdict
from tests.gpu.virtual import Device

pytestmark = pytest.mark.cuda


def weighted_sum(back: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * back[t * K + k]`` in fp32, ``k`` in order, cast to `dtype`: what the
    combine kernel computes."""
    T, K = weights.shape
    rows = back.view(T, K, back.shape[-1]).float()
    acc = torch.zeros((T, back.shape[-1]), dtype=torch.float32, device=back.device)
    for k in range(K):
        acc += rows[:, k] * weights[:, k : k + 1].float()
    return acc.to(dtype)


def check_a2a_kernels(dev: Device, cfg: Config) -> None:
    """Racing: each source's one dispatch launch on its own stream, held by a gate; then every receiver's
    bounded waits (as the ops wait on GPUs); then the gate opens. Regions bitwise against ``index_select``, each
    flag at the epoch exactly where its block has rows, counters back at 0, no wait timed out. Then each rank's
    combine launch over its regions against `weighted_sum` of the same rows."""
    what = f"MoE all-to-all kernels {cfg.describe()}"
    epoch = 9
    g = MoEGroup.create(dev, cfg, stale=epoch - 1)
    W, F, H, d = cfg.world_size, g.flags_per_peer, cfg.hidden, dev.device
    row_bytes = H * g.xs[0].element_size()
    # ---- tables (made on the current stream, before any launch on the ranks' streams) ----
    launches = []
    for s in range(W):
        h = g.routes[s]
        blocks = all_to_all.dispatch_blocks(h)
        if blocks[-1] == 0:
            continue
        per_chunk = all_to_all.rows_per_chunk(row_bytes)
        chunks = all_to_all.chunk_offsets(blocks, per_chunk)
        flags = [g.flag(s, i).data_ptr() for i in all_to_all.block_flags(h)]
        table = torch.tensor(blocks + chunks + flags, dtype=torch.int64, device=d)
        dst = torch.tensor([g.region(r, s).data_ptr() for r in range(W)], dtype=torch.int64, device=d)
        assert h.token_of.numel() == blocks[-1]  # made here, before the idle below: the dispatch reads it elsewhere
        launches.append((s, h, table, dst, len(blocks), blocks[-1], chunks[-1], per_chunk))
    err = torch.zeros(W, dtype=torch.int32, device=d)
    dev.spin_guard(2 * W, 2 * W)  # a gate per source, a bounded wait per receiver
    waiters = [dev.stream() for _ in range(W)]
    dev.idle(what)
    G = slots.expert_groups(cfg.num_local_experts, W)

    def dispatch(launch: tuple, value: int, stream: int) -> None:
        s, h, table, dst, n, num_sends, num_chunks, per_chunk = launch
        signals.moe_dispatch_rows(g.xs[s].data_ptr(), h.token_of.data_ptr(), num_sends, row_bytes,
                                  dst.data_ptr(), table.data_ptr(), table.data_ptr() + 8 * n, W * G, G, num_chunks,
                                  per_chunk, g.counters[s].data_ptr(), table.data_ptr() + 16 * n, value, stream)

    if launches:  # the kernel loaded before any gate (`Device.warm`): at the stale epoch, its rows poisoned again
        dev.warm(what, lambda: dispatch(launches[0], epoch - 1, torch.cuda.current_stream().cuda_stream))
        g.poison_regions()
    # The producers first, in host order (each source's launch held by a gate until every wait is issued), then
    # the receivers' bounded waits (tests/gpu/virtual.py: no wait queued in front of its producer).
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
    dev.settle([*g.streams, *waiters], g.dispatch_flags(), what)
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
            n = g.routes[s].send_splits[r]
            if not torch.equal(g.region(r, s)[:n], staged_rows(g, s, r)):
                problems.append(f"rows {s}->{r} differ")
    # ---- combine: each rank sums its K rows per token from its regions ----
    worst, exact = 0.0, True
    for r in range(W):
        h = g.routes[r]
        T, K = h.num_tokens, h.top_k
        for s in range(W):  # what rank s "computed" for r's rows, in r's send order
            n = h.send_splits[s]
            g.region(r, s)[:n].copy_(torch.randn(n, H, device=d).to(cfg.dtype))
        weights = torch.rand(T, K, device=d)
        out = torch.full((T, H), float("nan"), device=d).to(cfg.dtype)
        back_table = torch.tensor([g.region(r, s).data_ptr() for s in range(W)], dtype=torch.int64, device=d)
        offsets = torch.tensor([*h.send_offsets, T * K], dtype=torch.int64, device=d)
        pos = h.inv_order
        dev.idle(what)
        if T:
            signals.moe_combine_rows(back_table.data_ptr(), offsets.data_ptr(), W, pos.data_ptr(), weights.data_ptr(),
                                     out.data_ptr(), T, K, H, all_to_all.DTYPE_CODES[cfg.dtype],
                                     g.streams[r].cuda_stream if dev.cuda else 0)
        dev.settle(g.streams, [], what)
        back = torch.cat([g.region(r, s)[: h.send_splits[s]] for s in range(W)])
        ref = weighted_sum(back.index_select(0, h.inv_order), weights, cfg.dtype)
        exact = exact and torch.equal(out, ref)
        if T:
            diff = (out.float() - ref.float()).abs().max().item()
            worst = max(worst, diff)
            tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}[cfg.dtype]
            if not torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol):
                problems.append(f"combine rank {r}: max |out - weighted_sum| = {diff:.3g}")
    summary = f"dispatch bitwise, flags and counters right; combine {'bitwise' if exact else f'max diff {worst:.3g}'}"
    verdict(problems, f"{cfg.describe()}: {summary}", combine_max_diff=worst, combine_bitwise=exact)


@pytest.mark.parametrize("case", ordered_cases())
def test_all_to_all_kernels_deliver_rows_bitwise_and_sum_them_per_token(dev, case):
    check_a2a_kernels(dev, ordered_config(dev, case))
