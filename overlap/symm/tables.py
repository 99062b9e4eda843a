"""`AddressTables`: the int64 address tables and counters that the Triton kernels of a group's calls take, made from
its `overlap.symm.heap.SymmHeap` (every peer's slot, consecutive regions of a peer's slot, a flag word in every peer's
pad) and cached per heap: a warmed call makes none. The heap drops them where its memory changes (growth, close).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .layout import MAX_FLAGS

if TYPE_CHECKING:  # (the heap makes its tables)
    from .heap import SymmHeap

#: cached address tables per heap (`AddressTables._table`)
MAX_TABLES = 256


class AddressTables:
    """The address tables of one heap (see the module docstring)."""

    def __init__(self, heap: SymmHeap):
        self.heap = heap
        self._tables: dict[tuple[int, Any], torch.Tensor] = {}
        self._counters: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget the addresses (the heap's memory moved); the counters stay (zero between calls)."""
        self._tables.clear()

    def ptr_table(self, slot: int, offset: int = 0) -> torch.Tensor:
        """int64 ``[world]`` tensor of every peer's slot address (+offset) in this process."""
        heap = self.heap
        return self._table((slot, offset), lambda: [t.data_ptr() + slot * heap.slot_bytes + offset for t in heap.data])

    def _table(self, key: Any, addresses: Any) -> torch.Tensor:
        """The cached int64 device tensor of `key`, made from ``addresses()`` on first use.

        Bounded: keys depend on shapes (region sizes, offsets), so a run of ever-changing shapes
        would grow the cache without end; past `MAX_TABLES` it starts over (tables are tiny and
        cheap to rebuild; a dropped one still in use by a queued kernel stays alive through the
        allocator's stream semantics)."""
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= MAX_TABLES:
                self._tables.clear()
            table = torch.tensor(addresses(), dtype=torch.int64, device=self.heap.device)
            self._tables[key] = table
        return table

    def region_table(self, slot: int, peer: int, region_bytes: int, count: int, offset: int = 0) -> torch.Tensor:
        """int64 ``[count]`` tensor of the addresses of `count` consecutive regions of `peer`'s slot,
        the first `offset` bytes in."""
        assert region_bytes % 16 == 0 and offset + count * region_bytes <= self.heap.slot_bytes, (region_bytes, count)
        base = self.heap.data[peer].data_ptr() + slot * self.heap.slot_bytes + offset
        return self._table((slot, f"regions{peer},{region_bytes},{count},{offset}"),
                           lambda: [base + i * region_bytes for i in range(count)])

    def counters(self, slot: int) -> torch.Tensor:
        """This rank's `MAX_FLAGS` int32 chunk counters of `slot` (zero between calls: kernels reset them)."""
        table = self._counters.get(slot)
        if table is None:
            table = torch.zeros(MAX_FLAGS, dtype=torch.int32, device=self.heap.device)
            self._counters[slot] = table
        return table

    def flag_table(self, slot: int, index: int) -> torch.Tensor:
        """int64 ``[world]`` tensor of the address of ``ready[slot][index]`` in every peer's pad."""
        word = self.heap.ready_word(slot, index)

        def addresses() -> list[int]:
            if self.heap.device.type == "cuda":
                return self.heap._cuda_flags.addrs(word)
            return [self.heap.ctrl_addr(p, word) for p in range(self.heap.world_size)]

        return self._table((slot, f"ready{index}"), addresses)
