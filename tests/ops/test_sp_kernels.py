"""The sequence-parallel kernels (`overlap.kernels.matmul_all_to_all`, `overlap.kernels.all_to_all_matmul`) on virtual
ranks in one process, interpreted on CPU tensors at tiny sizes, through the launchers `fused` calls.

``W`` virtual ranks, each with a slot of ``W`` regions of ``[m, C]`` laid out as `overlap.kernels.slots` says (one
byte tensor, NaN until written), a flag pad (int32 ``[MAX_FLAGS]``, starting at the previous call's epoch) and chunk
counters; the address tables are int64 tensors of their ``data_ptr()``. What is checked, against float64:

* `launch_matmul_all_to_all` then `launch_gather_blocks` on every rank: rank ``d`` receives block ``d`` of every
  source's product, for two calls on the same slots (the second's inputs fresh, its epoch the next: the flags and data
  the first left must not pass); counters back at 0, every flag at the epoch; odd ``m``, ``C``, ``k`` (masked tiles)
  and several chunks; 0 rows.
* `launch_all_to_all_matmul`: ``sum_s region_s @ b[s*C:(s+1)*C]`` in rank order, with the regions in place first, and
  with a thread playing the senders chunk by chunk (host copies, then the flag, as `all_to_all_matmul`'s producer
  does) while the kernel spins: no tile reads a chunk before its flag (the regions are NaN until then).
* a source whose flag never comes: both consumers give up within their timeout and record it (``s + 1``).
* the launchers refuse bad arguments with their values.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

pytest.importorskip("triton")

from overlap.kernels import all_to_all_matmul as a2a_mm  # noqa: E402
from overlap.kernels import host, slots  # noqa: E402
from overlap.kernels import matmul_all_to_all as mm_a2a  # noqa: E402

from overlap import signals, symm  # noqa: E402

pytestmark = pytest.mark.skipif(not host.interpreted(), reason="interpreted kernels on CPU tensors (no GPU here)")

FP32, BF16 = torch.float32, torch.bfloat16
TILE = (16, 16, 16)  # BLOCK_M, BLOCK_N, BLOCK_K: several row tiles (chunks) at tiny sizes
TIMEOUT_NS = 10_000_000_000  # waits that must not time out
SHORT_TIMEOUT_NS = 200_000_000  # waits meant to time out


class SpGroup:
    """``W`` virtual ranks' slots, flag pads and counters for one ``m x C`` block shape."""

    def __init__(self, world_size: int, m: int, c: int, dtype: torch.dtype, chunks: int, stale: int):
        self.W, self.m, self.c, self.dtype = world_size, m, c, dtype
        self.F = slots.flags_per_peer(world_size)
        self.nch = mm_a2a.chunk_count(chunks, self.F, m, TILE[0])
        self.rb = slots.region_bytes(m, c, dtype)
        nbytes = slots.sp_slot_bytes(m, c, dtype, world_size)
        self.slots = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(world_size)]
        self.poison()
        self.pads = [torch.full((symm.MAX_FLAGS,), stale, dtype=torch.int32) for _ in range(world_size)]
        self.counters = [torch.zeros(world_size * self.nch, dtype=torch.int32) for _ in range(world_size)]
        self.flag_bases = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64)
        self.errs = [torch.zeros(1, dtype=torch.int32) for _ in range(world_size)]

    def poison(self) -> None:
        for s in self.slots:
            s.view(self.dtype).fill_(math.nan)

    def region(self, rank: int, src: int) -> torch.Tensor:
        """Region `src` of `rank`'s slot as ``[m, C]``."""
        raw = self.slots[rank][src * self.rb : (src + 1) * self.rb]
        return raw.view(self.dtype)[: self.m * self.c].view(self.m, self.c)

    def dst_table(self, rank: int) -> torch.Tensor:
        """Where `rank` sends block ``d``: its region in ``d``'s slot."""
        return torch.tensor([self.slots[d].data_ptr() + rank * self.rb for d in range(self.W)], dtype=torch.int64)

    def src_table(self, rank: int) -> torch.Tensor:
        return torch.tensor([self.slots[rank].data_ptr() + s * self.rb for s in range(self.W)], dtype=torch.int64)

    def flag_table(self, rank: int) -> torch.Tensor:
        """Source ``s``'s flag of chunk 0 for `rank`: its flag ``rank * F``."""
        return torch.tensor([self.pads[s].data_ptr() + 4 * rank * self.F for s in range(self.W)], dtype=torch.int64)

    def flags_for(self, rank: int) -> torch.Tensor:
        """Every source's chunk flags for `rank`, ``[W, NCH]``."""
        lo = rank * self.F
        return torch.stack([p[lo : lo + self.nch] for p in self.pads])

    def produce(self, rank: int, a: torch.Tensor, b: torch.Tensor, epoch: int) -> None:
        mm_a2a.launch_matmul_all_to_all(a, b, self.dst_table(rank), self.counters[rank], self.flag_bases,
                                        num_chunks=self.nch, flag_stride=self.F, epoch=host.epoch_word(epoch, "cpu"),
                                        rank=rank, block=TILE)

    def gather(self, rank: int, epoch: int, timeout_ns: int = TIMEOUT_NS) -> torch.Tensor:
        out = torch.full((self.W, self.m, self.c), math.nan, dtype=self.dtype)
        mm_a2a.launch_gather_blocks(out, self.src_table(rank), self.flag_table(rank), num_chunks=self.nch,
                                    epoch=host.epoch_word(epoch, "cpu"), err=self.errs[rank], timeout_ns=timeout_ns,
                                    block=TILE[:2])
        return out

    def matmul(self, rank: int, b: torch.Tensor, epoch: int, timeout_ns: int = TIMEOUT_NS,
               watchdog: bool = True, abort: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.full((self.m, b.shape[1]), math.nan, dtype=self.dtype)
        a2a_mm.launch_all_to_all_matmul(out, self.src_table(rank), self.flag_table(rank), b, num_chunks=self.nch,
                                        epoch=host.epoch_word(epoch, "cpu"), err=self.errs[rank],
                                        timeout_ns=timeout_ns, block=TILE, abort=abort, watchdog=watchdog)
        return out


def bound(dtype: torch.dtype, k: int) -> float:
    """An absolute bound for a product of unit-scale entries with a `k`-long inner dim, rounded once to `dtype`."""
    return (2 ** -7 if dtype == BF16 else 1e-5) * 4 + k * 1e-6


def rand(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1] if len(shape) > 1 else 1)).to(dtype)


@pytest.mark.parametrize("world_size, m, k, c, dtype, chunks", [
    (2, 37, 24, 20, FP32, 2), (3, 33, 40, 19, BF16, 3), (3, 21, 16, 16, FP32, 1), (2, 0, 16, 8, FP32, 1),
], ids=["W2-fp32-37x24x20-2ch", "W3-bf16-33x40x19-3ch", "W3-fp32-21x16x16-1ch", "W2-fp32-0-rows"])
def test_matmul_all_to_all_delivers_every_sources_block_over_two_calls(world_size, m, k, c, dtype, chunks):
    W = world_size
    g = SpGroup(W, m, c, dtype, chunks, stale=6)
    gen = torch.Generator().manual_seed(W * 1000 + m)
    for epoch in (7, 8):
        a = [rand(m, k, dtype=dtype, gen=gen) for _ in range(W)]
        # rank 1's weight transposed (nn.Linear's w.t()): any strides
        b = [rand(k, W * c, dtype=dtype, gen=gen) if r != 1 else rand(W * c, k, dtype=dtype, gen=gen).t()
             for r in range(W)]
        for r in range(W):
            g.produce(r, a[r], b[r], epoch)
        for d in range(W):
            out = g.gather(d, epoch)
            ref = torch.stack([a[s].double() @ b[s][:, d * c : (d + 1) * c].double() for s in range(W)])
            err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
            assert err <= bound(dtype, k), f"call at epoch {epoch}, rank {d}: max error {err}"
            assert int(g.errs[d]) == 0, f"rank {d}'s error word {int(g.errs[d])}"
            assert bool((g.flags_for(d) == epoch).all()), g.flags_for(d)
        assert all(bool((cnt == 0).all()) for cnt in g.counters), [cnt.tolist() for cnt in g.counters]
    assert g.nch == min(chunks, max(1, -(-m // TILE[0])))


@pytest.mark.parametrize("world_size, m, c, n, dtype, chunks", [
    (3, 37, 20, 19, FP32, 3), (2, 33, 24, 40, BF16, 2), (2, 0, 16, 8, FP32, 1),
], ids=["W3-fp32-37x20x19-3ch", "W2-bf16-33x24x40-2ch", "W2-fp32-0-rows"])
def test_all_to_all_matmul_sums_every_source_in_rank_order(world_size, m, c, n, dtype, chunks):
    W = world_size
    g = SpGroup(W, m, c, dtype, chunks, stale=6)
    gen = torch.Generator().manual_seed(W * 100 + n)
    epoch = 7
    for r in range(W):  # every source's block in place and flagged (the host producer's copies and flags)
        for s in range(W):
            g.region(r, s).copy_(rand(m, c, dtype=dtype, gen=gen))
    for p in g.pads:
        p.fill_(epoch)
    b = rand(n, W * c, dtype=dtype, gen=gen).t()  # [W*C, n], column-major (w.t())
    for r in range(W):
        out = g.matmul(r, b, epoch)
        ref = sum(g.region(r, s).double() @ b[s * c : (s + 1) * c].double() for s in range(W))
        err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        assert err <= bound(dtype, W * c), f"rank {r}: max error {err}"
        assert int(g.errs[r]) == 0
        again = g.matmul(r, b, epoch)
        assert torch.equal(out, again), f"rank {r}: not bitwise repeatable"


def test_all_to_all_matmul_waits_for_chunks_copied_while_it_spins():
    """A thread plays rank 0's senders: for every source (the last first), chunk by chunk, it copies the chunk's rows
    into rank 0's region (`slots.sp_chunk_rows`) and then publishes that chunk's flag; source 0's last chunk comes 50 ms
    after the others. The regions are NaN until copied, so a tile that read a chunk before its flag gives NaN; a launch
    at the previous epoch first (nothing to wait for) keeps the interpreter's set-up out of the race."""
    W, m, c, n, dtype, epoch = 3, 40, 16, 16, FP32, 9
    g = SpGroup(W, m, c, dtype, chunks=3, stale=epoch - 1)
    gen = torch.Generator().manual_seed(5)
    blocks = [rand(m, c, dtype=dtype, gen=gen) for _ in range(W)]
    b = rand(W * c, n, dtype=dtype, gen=gen)
    last_due: list[float] = []

    def senders() -> None:
        time.sleep(0.02)
        for s in reversed(range(W)):
            for ch in range(g.nch):
                time.sleep(0.05 if (s, ch) == (0, g.nch - 1) else 0.002)
                rows = slots.sp_chunk_rows(m, TILE[0], g.nch, ch)
                g.region(0, s)[rows.start : rows.stop].copy_(blocks[s][rows.start : rows.stop])
                if (s, ch) == (0, g.nch - 1):
                    last_due.append(time.perf_counter())
                signals.signal_store(g.pads[s][ch:].data_ptr(), epoch)  # rank 0's flags: s's flag 0 * F + ch

    assert g.nch == 3
    g.matmul(0, b, epoch - 1)  # the flags hold epoch - 1: no wait; the interpreter's first launch costs its set-up
    thread = threading.Thread(target=senders, daemon=True)
    thread.start()
    out = g.matmul(0, b, epoch)
    ended = time.perf_counter()
    thread.join(timeout=5.0)
    assert last_due and ended > last_due[0], "the kernel ended before source 0's last chunk was flagged"
    ref = sum(blocks[s].double() @ b[s * c : (s + 1) * c].double() for s in range(W))
    err = (out.double() - ref).abs().max().item()
    assert err <= bound(dtype, W * c), f"max error {err} (NaN: a chunk read before its flag)"
    assert int(g.errs[0]) == 0


def test_consumers_give_up_on_a_source_that_never_sends_and_name_it():
    """Source 1's flags stay at the previous epoch: each consumer returns after about its timeout with ``err == 2``."""
    W, m, c, dtype, epoch = 3, 20, 16, FP32, 5
    g = SpGroup(W, m, c, dtype, chunks=2, stale=epoch - 1)
    for s in (0, 2):
        g.pads[s].fill_(epoch)
    timeout_s = SHORT_TIMEOUT_NS / 1e9
    for name, run in (("gather_blocks", lambda: g.gather(0, epoch, SHORT_TIMEOUT_NS)),
                      ("all_to_all_matmul", lambda: g.matmul(0, torch.randn(W * c, 16), epoch, SHORT_TIMEOUT_NS))):
        g.errs[0].zero_()
        t0 = time.perf_counter()
        run()
        waited = time.perf_counter() - t0
        assert int(g.errs[0]) == 2, f"{name}: err word {int(g.errs[0])}, expected 2 (source 1 + 1)"
        assert 0.5 * timeout_s <= waited <= 20 * timeout_s, f"{name}: returned after {waited:.3f} s"


def _bad(case: str) -> None:
    i64, i32 = torch.int64, torch.int32
    t2, t3, word, epoch = torch.zeros(2, dtype=i64), torch.zeros(3, dtype=i64), torch.zeros(1, dtype=i32), \
        torch.ones(1, dtype=i32)
    a, counters = torch.randn(8, 32), torch.zeros(16, dtype=i32)
    if case == "columns not split":
        mm_a2a.launch_matmul_all_to_all(a, torch.randn(32, 15), t2, counters, t2, num_chunks=1, flag_stride=4,
                                        epoch=epoch, rank=0, block=(16, 16, 16))
    elif case == "tables of two sizes":
        mm_a2a.launch_matmul_all_to_all(a, torch.randn(32, 16), t2, counters, t3, num_chunks=1, flag_stride=4,
                                        epoch=epoch, rank=0, block=(16, 16, 16))
    elif case == "flags overlap":
        mm_a2a.launch_matmul_all_to_all(torch.randn(64, 32), torch.randn(32, 16), t2, counters, t2, num_chunks=2,
                                        flag_stride=1, epoch=epoch, rank=0, block=(16, 16, 16))
    elif case == "too many chunks":
        mm_a2a.launch_matmul_all_to_all(a, torch.randn(32, 16), t2, counters, t2, num_chunks=2, flag_stride=4,
                                        epoch=epoch, rank=0, block=(16, 16, 16))
    elif case == "weight of another dtype":
        mm_a2a.launch_matmul_all_to_all(a, torch.randn(32, 16, dtype=torch.bfloat16), t2, counters, t2, num_chunks=1,
                                        flag_stride=4, epoch=epoch, rank=0, block=(16, 16, 16))
    elif case == "few counters":
        mm_a2a.launch_matmul_all_to_all(torch.randn(64, 32), torch.randn(32, 16), t2, torch.zeros(3, dtype=i32), t2,
                                        num_chunks=2, flag_stride=4, epoch=epoch, rank=1, block=(16, 16, 16))
    elif case == "gather out of 2 dims":
        mm_a2a.launch_gather_blocks(torch.empty(8, 16), t2, t2, num_chunks=1, epoch=epoch, err=word, timeout_ns=1,
                                    block=(16, 16))
    elif case == "gather out for 3 sources":
        mm_a2a.launch_gather_blocks(torch.empty(3, 8, 16), t2, t2, num_chunks=1, epoch=epoch, err=word, timeout_ns=1,
                                    block=(16, 16))
    elif case == "epoch as an int":
        a2a_mm.launch_all_to_all_matmul(torch.empty(8, 16), t2, t2, torch.randn(32, 16), num_chunks=1, epoch=3,
                                        err=word, timeout_ns=1, block=(16, 16, 16))
    elif case == "weight rows not split":
        a2a_mm.launch_all_to_all_matmul(torch.empty(8, 16), t2, t2, torch.randn(33, 16), num_chunks=1, epoch=epoch,
                                        err=word, timeout_ns=1, block=(16, 16, 16))
    elif case == "out of another width":
        a2a_mm.launch_all_to_all_matmul(torch.empty(8, 15), t2, t2, torch.randn(32, 16), num_chunks=1, epoch=epoch,
                                        err=word, timeout_ns=1, block=(16, 16, 16))
    elif case == "tile not a power of two":
        a2a_mm.launch_all_to_all_matmul(torch.empty(8, 16), t2, t2, torch.randn(32, 16), num_chunks=1, epoch=epoch,
                                        err=word, timeout_ns=1, block=(16, 24, 16))


@pytest.mark.parametrize("case, message", [
    ("columns not split", "b's 15 columns do not split into 2 blocks"),
    ("tables of two sizes", r"flag_table must be torch.int64 \[2\], got torch.int64 \[3\]"),
    ("flags overlap", "flag_stride 1 < num_chunks 2"),
    ("too many chunks", r"num_chunks must be an int in \[1, 2\), got 2"),
    ("weight of another dtype", "b must be torch.float32, got torch.bfloat16"),
    ("few counters", r"counters must be int32 of at least 4 words on cpu, got torch.int32 \[3\]"),
    ("gather out of 2 dims", r"out must be a \[W, m, C\] tensor"),
    ("gather out for 3 sources", r"src_table must be torch.int64 \[3\], got torch.int64 \[2\]"),
    ("epoch as an int", "epoch must be an int32 word on cpu"),
    ("weight rows not split", "b's 33 rows do not split into 2 blocks"),
    ("out of another width", r"out must be \[m, 16\] on cpu, got \[8, 15\]"),
    ("tile not a power of two", "BLOCK_N must be a power of two >= 16, got 24"),
])
def test_sp_launchers_refuse_bad_arguments_with_their_values(case, message):
    with pytest.raises(ValueError, match=message):
        _bad(case)


@pytest.mark.parametrize("m, block_m, num_chunks", [(37, 16, 2), (33, 16, 3), (16, 16, 1), (0, 16, 1), (100, 32, 4)])
def test_sp_chunk_rows_cover_the_rows_in_order_as_the_kernels_map_them(m, block_m, num_chunks):
    tiles_m = -(-max(m, 1) // block_m)
    got = [slots.sp_chunk_rows(m, block_m, num_chunks, c) for c in range(num_chunks)]
    assert [r for rows in got for r in rows] == list(range(m))
    for c, rows in enumerate(got):
        assert all(t * num_chunks // tiles_m == c for t in {r // block_m for r in rows}), (c, rows)
