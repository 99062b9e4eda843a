"""The MoE all-to-all on GPUs: launches of ``overlap._C.moe_dispatch_rows`` and ``moe_combine_rows``
(``csrc/cuda/moe_a2a.cu``) for the ``symm`` and ``fused`` strategies, and the tables they take.

Legend and layout as in `overlap.ops.moe.layout` (``W`` ranks, ``L`` local experts, ``G`` expert groups per
peer, ``F`` flags per peer, ``T`` tokens, ``K`` experts per token, ``P = T*K`` pairs, send order).
This rank's send positions split into ``W*G`` contiguous **blocks**, block ``i = d*G + g`` holding the rows
for destination ``d`` and its expert group ``g``; block ``i`` is flagged with ready flag ``d*F + 1 + g``.

* dispatch (`dispatch_rows`): one kernel copies every send position's row into this rank's region of its
  destination's buffer (16-byte vectors, one CTA per chunk of a block) and the last CTA of each block
  releases the block's flag at system scope. It replaces ``torch.index_select`` per (destination, expert
  group) plus a stream-ordered flag write, on the current stream.
* combine (`combine_rows`): after the stream-ordered bounded waits on every flag of this rank's rows
  (``moe_combine._collect``), one kernel gathers each token's ``K`` rows from this rank's regions and sums
  them with their routing weights in fp32, ``k`` in order (`moe_layout.weighted_sum`'s operations). It runs
  where no gradient is needed (the weights' gradient needs the pair rows, which this path never forms).

The tables (`dispatch_blocks`, `chunk_offsets`, `block_flags`: `overlap.kernels.all_to_all`, beside the other
kernels' launch data; `combine_positions`) are index math on a handle, tested on CPU. The launches are compiled
for sm_80 and sm_90a but **not yet run on a GPU**.
"""

from __future__ import annotations

import torch

from ...errors import warn_once
from ...kernels import slots
from ...kernels.all_to_all import (  # noqa: F401 - the tables, used here as cuda.*
    CHUNK_BYTES,
    DTYPE_CODES,
    MAX_TOP_K,
    ROW_ALIGN,
    block_flags,
    chunk_offsets,
    dispatch_blocks,
    rows_per_chunk,
)
from . import layout


def combine_positions(h: layout.MoELayout) -> tuple[torch.Tensor, list[int]]:
    """``(pos, send_offsets)``: ``pos`` ``[P]`` (int64, on the tokens' device) is the send position of
    pair ``t*K + k``, ``send_offsets`` ``[W + 1]`` the first send position of each destination, then ``P``.
    The pair's row is row ``pos - send_offsets[d]`` of region ``d`` of this rank's buffer, ``d`` the last
    destination with ``send_offsets[d] <= pos`` (what ``_collect`` then ``index_select(inv_order)`` read)."""
    return h.inv_order, [*h.send_offsets, sum(h.send_splits)]


def _device_table(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of `values` on `device`. On GPUs: from pinned memory without blocking the host (the
    caching host allocator keeps the pinned block until the copy has run)."""
    table = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


# ----------------------------------------------------------------------------------------------
# Launches (GPU only)
# ----------------------------------------------------------------------------------------------


def _c():
    from ... import signals

    return signals


def _stream(device: torch.device) -> int:
    """The current stream's handle (0 for CPU tensors: the tests drive these launches with an emulated `_C`)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def dispatch_rows(call, h: layout.MoELayout, rows: torch.Tensor, row_of_send: torch.Tensor) -> bool:
    """Write ``rows[row_of_send[i]]`` into this rank's region of every destination's buffer in this call's
    slot and release each block's flag, with one kernel on the current stream. Rows are ``[N, H]``, any
    dtype; ``row_of_send`` int64 ``[P]``. Returns False (after warning once) where the kernel cannot take
    the rows: the caller then writes them with torch ops."""
    if not _c().has_cuda:
        warn_once("overlap.moe: overlap._C was built without its CUDA half: dispatch writes rows with "
                  "torch.index_select", RuntimeWarning)
        return False
    rows = rows.contiguous()
    row_bytes = rows.shape[1] * rows.element_size()
    if row_bytes % ROW_ALIGN or rows.data_ptr() % ROW_ALIGN:
        warn_once(f"overlap.moe: dispatch kernel needs rows of a multiple of {ROW_ALIGN} bytes at a {ROW_ALIGN}-byte "
                  f"aligned address (got {row_bytes} bytes per row at {rows.data_ptr() % ROW_ALIGN} past alignment): "
                  "those rows are written with torch.index_select", RuntimeWarning)
        return False
    blocks = dispatch_blocks(h)
    if blocks[-1] == 0:
        return True  # nothing to send: no block has rows, so no flag is due
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    G = slots.expert_groups(L, W)
    per_chunk = rows_per_chunk(row_bytes)
    chunks = chunk_offsets(blocks, per_chunk)
    heap = call.heap
    # This rank's own ready flags as the fused kernels see them (consumers read them through their peer mappings).
    flag_index = block_flags(h)
    flags = [heap.kernel_flag_addr(r, heap.ready_word(call.slot, i)) for i in flag_index]
    table = _device_table(blocks + chunks + flags, rows.device)
    n = len(blocks)
    dst = heap.tables.ptr_table(call.slot, slots.header_bytes(W, L) + r * slots.region_stride(call.need, W, L))
    counters = heap.tables.counters(call.slot)  # zero between calls; the kernel leaves them at zero
    row_of_send = row_of_send.contiguous()
    assert row_of_send.dtype == torch.int64 and row_of_send.numel() == blocks[-1], row_of_send.shape
    _c().moe_dispatch_rows(
        rows.data_ptr(), row_of_send.data_ptr(), blocks[-1], row_bytes,
        dst.data_ptr(), table.data_ptr(), table.data_ptr() + 8 * n, W * G, G, chunks[-1], per_chunk,
        counters.data_ptr(), table.data_ptr() + 16 * n, call.word, _stream(rows.device),
    )
    # The same flags in the control pads, for the symm consumers' stream-ordered waits (`Call.wait_ready`:
    # host memory, so that the host watchdog can bound them), in stream order after the kernel: a block's
    # flag is due only where the block has rows, as in the kernel.
    for i, index in enumerate(flag_index):
        if blocks[i + 1] > blocks[i]:
            _c().cuda_stream_write_value32(heap.pad_device_addr(r, heap.ready_word(call.slot, index)), call.word,
                                           _stream(rows.device))
    return True


def sums_on_device(y: torch.Tensor, topk_weights: torch.Tensor, chosen, needs_grad: bool) -> bool:
    """Whether a combine returns through `combine_rows`: GPU rows, ``symm`` or ``fused``, and no gradient
    needed (`needs_grad`: for `topk_weights`, the expert rows or the weights). Warns once where only the
    dtype or the build stands in the way."""
    if not y.is_cuda or chosen.strategy not in ("symm", "fused"):
        return False
    if needs_grad:
        return False  # autograd needs the pair rows (weights' gradient): the torch path forms them
    reason = None
    if not _c().has_cuda:
        reason = "overlap._C was built without its CUDA half"
    elif y.dtype not in DTYPE_CODES or topk_weights.dtype == torch.float64:
        reason = f"the combine kernel sums {tuple(DTYPE_CODES)} rows with fp32 weights, got {y.dtype} and " \
                 f"{topk_weights.dtype}"
    elif topk_weights.shape[1] > MAX_TOP_K:
        reason = f"the combine kernel takes top_k <= {MAX_TOP_K}, got {topk_weights.shape[1]}"
    if reason is not None:
        warn_once(f"overlap.moe: {reason}: combine sums with torch ops", RuntimeWarning)
        return False
    return True


def combine_rows(call, h: layout.MoELayout, dtype: torch.dtype, cols: int, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * row(t, k)`` ``[T, cols]`` in `dtype`, the rows read from this
    rank's regions of this call's slot, on the current stream. The caller has enqueued the waits on every
    flag of this rank's rows before it."""
    W, r, L = h.info.world_size, h.info.rank, h.num_local_experts
    T, K = h.num_tokens, h.top_k
    out = torch.empty((T, cols), dtype=dtype, device=h.info.device)
    if T == 0:
        return out
    pos, offsets = combine_positions(h)
    stride = slots.region_stride(call.need, W, L)
    back = call.heap.tables.region_table(call.slot, r, stride, W, slots.header_bytes(W, L))
    send_offsets = _device_table(offsets, out.device)
    weights = topk_weights.to(torch.float32).contiguous()
    _c().moe_combine_rows(
        back.data_ptr(), send_offsets.data_ptr(), W, pos.data_ptr(), weights.data_ptr(), out.data_ptr(),
        T, K, cols, DTYPE_CODES[dtype], _stream(out.device),
    )
    return out
