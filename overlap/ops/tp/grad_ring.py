"""A weight gradient reduce-scattered through a ring of two chunk regions (`all_gather_weight_matmul`'s
``symm`` and ``fused`` backward).

Problem. Rank ``d`` needs ``grad_b_shard`` = rows ``d*n ... (d+1)*n`` of ``grad_w = sum over ranks r of
g_r.T @ a_r`` (``[W*n, k]``, rows of the weight ``w``; ``g_r`` ``[M, W*n]`` and ``a_r`` ``[M, k]`` differ per
rank). A reduce-scatter that gives every destination a region of its own (`matmul_reduce_scatter`'s
``symm``) holds ``W`` shards in every owner's heap; this ring holds two chunks.

Algorithm (shape legend: ``n`` rows of a block, ``k`` columns, ``C`` chunks of rows per block, ``W`` ranks).
Block ``d``'s accumulator starts at rank ``d+1`` and travels ``d+1 -> d+2 -> ... -> d``, each rank adding
its own partial, so block ``d`` is summed in one fixed order, the same on every run::

    ((P_{d+1} + P_{d+2}) + ... + P_{d-1}) + P_d          P_r = g_r[:, block d].T @ a_r

The ring runs chunk by chunk (rows ``lo:hi`` of every block), and for each chunk ``j`` in steps
``s = 0 ... W-1``: rank ``r`` takes block ``d = r - 1 - s`` and computes its partial of the chunk (the GEMM
runs before the wait for the predecessor's accumulator, which is in flight meanwhile); from ``s = 1`` on it
adds what its predecessor sent; before the last step it writes the sum into its successor's heap (send
``t = j*(W-1) + s``, region ``t % 2``), at the last step (``d = r``) into its own ``grad_b_shard``. CPU ranks
write the GEMM straight into the successor's shared memory; 16-bit dtypes round each partial once (the
GEMM's output) and add in fp32 regions, rounding once at the end, as the other reduce-scatters do.

Heap (one slot of the call): two regions of ``ceil(n/C) x k`` of the accumulator dtype, written by the
predecessor, read by this rank. ``C`` is the plan's chunk count for the ring's slowest link, at least 2
(4 for 16-bit dtypes: fp32 regions) so that the pair holds no more than one shard's bytes plus a row per
region, and at most ``MAX_FLAGS / (2 (W-1))``.

Flags (ready words of the call's slot in the writer's pad, value: the call's epoch; ``T = C*(W-1)``):
``data[t] = t``: "send ``t`` is in your region ``t % 2``", set by the sender after its stores;
``free[t] = T + t``: "I have read your send ``t``: its region is yours again", set by the receiver. A rank
writes send ``t`` only after its successor's ``free[t-2]``.

No deadlock: an operation ``(j, s)`` waits only for operations earlier in ``(j, s)`` order (its
predecessor's ``(j, s-1)``; the successor's read of send ``t-2``, at its operation for send ``t-1``), and
every rank runs its operations in that order.

Deadlines and blame: every wait is bounded by the call's timeout. In a ring a stalled rank stalls its
successors too, so a timed-out wait names the rank the ring is stuck on at its source: following the
missing flags upstream (`_Ring.culprit`) from the peer waited for to the first rank whose own inputs are
all there (CPU ranks; on GPUs the stream-ordered wait names the peer waited for). GPU ranks run the same
schedule on the current stream with stream-ordered flag waits (not yet run on a GPU).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import comm, symm
from ...errors import OverlapTimeout
from ...plans import Plan
from ..context import CallContext


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """The ring's chunks (row bounds within a block), accumulator dtype and region size in bytes."""

    bounds: tuple[tuple[int, int], ...]
    acc: torch.dtype
    region_bytes: int


def layout(chosen: Plan, info, n: int, k: int, dtype: torch.dtype) -> RingLayout:
    """The ring of a block of `n` rows of `k` columns of `dtype` for `chosen`'s chunks on `info`'s ring."""
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc_size = torch.empty((), dtype=acc).element_size()
    least = 2 * acc_size // torch.empty((), dtype=dtype).element_size()  # the pair holds at most one shard
    most = max(1, symm.MAX_FLAGS // (2 * max(1, info.world_size - 1)))  # 2 flags per send
    bounds = tuple(comm.chunk_bounds(n, min(max(chosen.chunks_for(info.slowest_link), least), most)))
    rows = bounds[0][1] - bounds[0][0]  # the largest chunk (chunk_bounds puts the longer ones first)
    return RingLayout(bounds, acc, (rows * k * acc_size + 15) // 16 * 16)


def heap_bytes(lay: RingLayout, world_size: int) -> int:
    """Bytes of the ring's slot: two chunk regions (none on one rank)."""
    return 2 * lay.region_bytes if world_size > 1 else 0


def reduce_scatter(cc: CallContext, call, g2: torch.Tensor, a2: torch.Tensor, n: int, lay: RingLayout) -> torch.Tensor:
    """This rank's ``[n, k]`` block of ``sum over ranks of g2.T @ a2`` (``g2`` ``[M, W*n]``, ``a2`` ``[M, k]``)
    through the ring. `call` is the ring's own call (its handshake sized by `heap_bytes`); the caller
    finishes it."""
    out = a2.new_empty((n, a2.shape[1]))
    if cc.world_size == 1:
        return torch.mm(g2.t(), a2, out=out)
    _Ring(cc, call, lay, a2.shape[1]).run(g2, a2, n, out)
    return out


class _Ring:
    def __init__(self, cc: CallContext, call, lay: RingLayout, k: int):
        self.cc, self.call, self.lay, self.k = cc, call, lay, k
        W, r = cc.world_size, cc.rank
        self.W, self.rank, self.succ, self.pred = W, r, (r + 1) % W, (r - 1) % W
        self.sends = len(lay.bounds) * (W - 1)  # T: sends per rank; free flags follow the data flags

    def region(self, owner: int, t: int, rows: int) -> torch.Tensor:
        return self.call.buffer(owner, self.lay.acc, (rows, self.k), offset=(t % 2) * self.lay.region_bytes)

    def run(self, g2: torch.Tensor, a2: torch.Tensor, n: int, out: torch.Tensor) -> None:
        W, r, call = self.W, self.rank, self.call
        low = self.lay.acc != a2.dtype
        call.wait_slot_free()
        for j, (lo, hi) in enumerate(self.lay.bounds):
            for s in range(W):
                d = (r - 1 - s) % W
                t = j * (W - 1) + s  # this step's send (none at the last step: its own block)
                last = s == W - 1
                if not last and t >= 2:
                    self.wait(self.succ, self.sends + t - 2, j, "the successor never freed a region")
                dst = out[lo:hi] if last else self.region(self.succ, t, hi - lo)
                lhs = g2[:, d * n + lo : d * n + hi].t()  # a strided view: no copy of g
                part = torch.mm(lhs, a2) if low else torch.mm(lhs, a2, out=dst)
                if s == 0:
                    if low:
                        dst.copy_(part)
                else:
                    self.wait(self.pred, t - 1, j, "the predecessor's accumulator never arrived")
                    got = self.region(r, t - 1, hi - lo)
                    if low:
                        torch.add(got, part, out=dst)  # fp32 sum, rounded once where dst is the output
                    else:
                        dst += got
                    call.signal_ready(self.sends + t - 1)  # its region is free again
                if not last:
                    call.signal_ready(t)

    def wait(self, peer: int, index: int, chunk: int, what: str) -> None:
        try:
            self.call.wait_ready(peer, index, chunk=chunk)
        except OverlapTimeout as exc:
            culprit = self.culprit(peer)
            blame = what if culprit == peer else f"{what}: rank {peer} is itself stuck behind rank {culprit}"
            raise OverlapTimeout(
                self.cc.op, self.rank, culprit, f"{chunk} of the weight gradient's ring", self.cc.timeout, blame
            ) from exc

    # -- blame ----------------------------------------------------------------------------------
    def _published(self, peer: int, index: int) -> bool:
        from ... import signals  # (the compiled extension: imported on this error path only)

        heap = self.call.heap
        addr = heap.ctrl_addr(peer, heap.ready_word(self.call.slot, index))
        return signals.signal_load(addr) - self.call.word >= 0

    def _steps(self):
        """Every rank's operations in order: ``(t, s, outputs)``, outputs the flags it sets."""
        W = self.W
        for j in range(len(self.lay.bounds)):
            for s in range(W):
                t = j * (W - 1) + s
                yield t, s, ([self.sends + t - 1] if s else []) + ([t] if s < W - 1 else [])

    def _inputs(self, q: int, t: int, s: int) -> list[tuple[int, int]]:
        W = self.W
        waits = [((q + 1) % W, self.sends + t - 2)] if s < W - 1 and t >= 2 else []
        return waits + ([((q - 1) % W, t - 1)] if s else [])

    def culprit(self, peer: int) -> int:
        """The rank the ring is stuck on, seen from a wait on `peer`: from `peer`'s first operation with a
        flag not yet set, follow a missing input upstream until a rank whose inputs are all there (CPU ranks,
        whose pads this process reads; elsewhere, `peer`)."""
        if self.call.heap.device.type == "cuda":
            return peer
        q = peer
        for _ in range(self.sends * self.W + self.W):  # every hop goes to an earlier operation
            stuck = next(((t, s) for t, s, outs in self._steps() if not all(self._published(q, i) for i in outs)), None)
            if stuck is None:
                return peer
            missing = [p for p, i in self._inputs(q, *stuck) if not self._published(p, i)]
            if not missing:
                return q if q != self.rank else peer
            q = missing[0]
        return peer
