"""The two transfers of sequence parallelism, each meeting its GEMMs: what the forward and backward of both ops run.

* `scatter_heads(cc, a, b)`: ``a`` ``[m, k]`` this rank's rows (its sequence shard), ``b`` ``[k, W*C]`` whose column
  block ``d`` is what destination ``d`` gets (its heads); returns ``[W, m, C]``: block ``s`` is source ``s``'s rows
  times our columns, i.e. our heads for the whole sequence in rank order. `overlap.matmul_all_to_all`'s forward
  (``b`` the packed QKV weights) and `overlap.all_to_all_matmul`'s input gradient (``b = w_o.T``) run it.
* `gather_heads(cc, sends, b)`: ``sends`` ``[W, m, C]`` (block ``d`` for destination ``d``: its sequence shard of our
  heads), ``b`` ``[W*C, n]`` whose row block ``s`` multiplies what source ``s`` sends; returns ``(out, gathered)``:
  ``out`` ``[m, n]`` = the gathered ``[m, W*C]`` times ``b`` and ``gathered`` ``[W, m, C]``.
  `overlap.all_to_all_matmul`'s forward (``b = w_o``) and `overlap.matmul_all_to_all`'s input gradient (``b`` the
  packed weights, transposed) run it.

Strategies (same results up to rounding; ``reference`` is the unfused layer):

* ``reference``: one GEMM and one ``all_to_all_single`` (scatter: GEMM, then the exchange; gather: the exchange,
  then one GEMM over the gathered rows).
* ``pipelined``: pairwise steps. At step ``i`` rank ``r`` sends to ``r + i`` and receives from ``r - i`` (every
  send meets its receive at the same step), each transfer cut into ``num_chunks[link]`` pieces. Scatter: the GEMM
  of the next destination's columns runs while the previous block travels, our own block last. Gather: every
  block is posted at once, our own block is multiplied first, then each source's chunks as they land (sources in
  step order); the ``W`` partial products are summed in rank order (16-bit partials in fp32, rounded once), so
  the result never depends on the order of arrival. On CPU ranks of one node the messages carry the call's
  agreement (`overlap.symm.p2p`: a warmed signature skips the rendezvous); elsewhere they are
  `overlap.comm.exchange_chunked`'s steps.

* ``symm``: through the symmetric heap, each block straight into its destination's slot, flagged per chunk of rows
  (`overlap.ops.sp.shared`).

* ``fused``: the same slots, the kernels of `overlap.kernels.matmul_all_to_all` (a GEMM whose tiles store each
  destination's columns in its slot and flag them per chunk; a copy kernel that takes each source's rows out as
  their flags arrive) and `overlap.kernels.all_to_all_matmul` (blocks copied into their destinations' slots and
  flagged per chunk of the kernel's rows; one GEMM kernel whose tiles wait for each source's chunk, sources in rank
  order into one fp32 accumulator). Interpreted on CPU ranks; not yet run on a GPU.
"""

from __future__ import annotations

import torch

from ... import comm
from ...symm import p2p
from ..context import CallContext
from ..sums import sum_in_order
from . import shared


def _begin(cc: CallContext, m: int, C: int, dtype: torch.dtype):
    """The handshake of a call moving ``[m, C]`` blocks: the slot ``symm`` needs, the steady state of ``pipelined``
    and ``symm``, the plain path of ``reference``."""
    strategy = cc.plan.strategy
    need = shared.slot_bytes(m, C, dtype, cc.world_size) if strategy in ("symm", "fused") else 0
    return cc.begin(need, steady=strategy in ("pipelined", "symm"), plain=strategy == "reference")


def scatter_heads(cc: CallContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[W, m, C]``: block ``s`` = source ``s``'s ``a @ b[:, r*C:(r+1)*C]`` (module docstring)."""
    W = cc.world_size
    m, C = a.shape[0], b.shape[1] // W
    call = _begin(cc, m, C, a.dtype)
    try:
        if cc.plan.strategy in ("symm", "fused"):
            return (shared.scatter if cc.plan.strategy == "symm" else shared.scatter_fused)(cc, call, a, b)
        recv = torch.empty((W, m, C), dtype=a.dtype, device=a.device)
        if cc.plan.strategy == "reference":
            sends = torch.mm(a, b).view(m, W, C).transpose(0, 1).contiguous()
            cc.wait(comm.all_to_all_async(recv, sends, cc.pg), "any", "all_to_all")
            return recv
        steps = Steps(cc, call, recv)
        try:
            r = cc.rank
            for i in range(1, W):  # the next destination's GEMM runs while this block travels
                d = (r + i) % W
                steps.post(i, torch.mm(a, b[:, d * C : (d + 1) * C]))
            torch.mm(a, b[:, r * C : (r + 1) * C], out=recv[r])
            for i in range(1, W):
                for _ in steps.arrivals((r - i) % W):
                    pass
            steps.close()
        except BaseException as exc:
            steps.abandon(exc)
            raise
        return recv
    finally:
        call.finish()


def gather_heads(cc: CallContext, sends: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [m, n], gathered [W, m, C])`` (module docstring)."""
    W, (_, m, C) = cc.world_size, sends.shape
    call = _begin(cc, m, C, sends.dtype)
    try:
        if cc.plan.strategy in ("symm", "fused"):
            return (shared.gather if cc.plan.strategy == "symm" else shared.gather_fused)(cc, call, sends, b)
        recv = torch.empty_like(sends)
        if cc.plan.strategy == "reference":
            cc.wait(comm.all_to_all_async(recv, sends, cc.pg), "any", "all_to_all")
            return torch.mm(recv.transpose(0, 1).reshape(m, W * C), b), recv
        r = cc.rank
        steps = Steps(cc, call, recv)
        parts = torch.empty((W, m, b.shape[1]), dtype=sends.dtype, device=sends.device)
        try:
            for i in range(1, W):
                steps.post(i, sends[(r + i) % W])
            recv[r].copy_(sends[r])
            torch.mm(recv[r], b[r * C : (r + 1) * C], out=parts[r])
            for i in range(1, W):  # each source's rows multiplied by its rows of b as they land
                s = (r - i) % W
                for lo, hi in steps.arrivals(s):
                    torch.mm(recv[s, lo:hi], b[s * C : (s + 1) * C], out=parts[s, lo:hi])
            steps.close()
        except BaseException as exc:
            steps.abandon(exc)
            raise
        out = torch.empty((m, b.shape[1]), dtype=sends.dtype, device=sends.device)
        sum_in_order(list(parts.unbind(0)), out, 0, m)  # rank order, one rounding
        return out, recv
    finally:
        call.finish()


class Steps:
    """The ``W - 1`` pairwise steps of one ``pipelined`` call: at step ``i`` this rank sends a block to ``r + i`` and
    receives ``recv[r - i]`` (``[W, m, C]``, its rows cut for the link), through `overlap.symm.p2p.Exchange` on CPU
    ranks of one node (`p2p.tagged`), else `overlap.comm.exchange_chunked`. Every wait is deadlined and names its
    peer and chunk."""

    def __init__(self, cc: CallContext, call, recv: torch.Tensor):
        self.cc, self.recv, self.sent = cc, recv, []
        self.ex = p2p.Exchange(call, cc) if p2p.tagged(call) else None
        self.posted: dict[int, list] = {}  # src -> exchange_chunked's (j, rows, [(work, peer)]) of its step
        self.waited: set[int] = set()
        W, r = cc.world_size, cc.rank
        if self.ex is not None:
            for i in range(1, W):
                self.ex.expect(recv[(r - i) % W], (r - i) % W)

    def post(self, i: int, block: torch.Tensor) -> None:
        """Step `i`'s send: `block` (contiguous ``[m, C]``, kept alive until sent) to ``r + i``."""
        cc = self.cc
        W, r = cc.world_size, cc.rank
        dst, src = (r + i) % W, (r - i) % W
        self.sent.append(block)
        if self.ex is not None:
            self.ex.send(block, dst)
            self.ex.arm(block=False)
            return
        self.posted[src] = comm.exchange_chunked(block, dst, self.recv[src], src, cc.plan.chunks_for, cc.info, cc.pg,
                                                 cc.op)

    def arrivals(self, src: int):
        """Yield ``(lo, hi)``, the rows of each chunk of `src`'s block once it has landed."""
        if self.ex is not None:
            for _j, bounds in self.ex.arrivals(src):
                yield bounds
            return
        for j, rows, works in self.posted[src]:
            if rows is None:
                continue
            work, peer = works[0]  # (the receive is posted first in its pair)
            self.waited.add(id(work))
            self.cc.wait(work, peer, j)
            yield rows

    def close(self) -> None:
        """The success path: every send waited for (its buffer must outlive it)."""
        if self.ex is not None:
            self.ex.close()
            return
        for pairs in self.posted.values():
            for j, _rows, works in pairs:
                for work, peer in works:
                    if id(work) not in self.waited:
                        self.waited.add(id(work))
                        self.cc.wait(work, peer, j)

    def abandon(self, exc: BaseException) -> None:
        """An error path: leave no message of this call half-way (`overlap.symm.p2p.Exchange.abandon`)."""
        if self.ex is not None:
            self.ex.abandon(exc)
