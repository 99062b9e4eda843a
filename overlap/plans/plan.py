"""`Plan`: how one call is executed (strategy, chunking per link class, tile shape, variants).

A `Plan` is a small immutable value; its text (`Plan.describe`) is part of every call signature, so
ranks that run different plans raise on every rank instead of hanging. ``strategy="auto"`` resolves one
(`overlap.plans.auto`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..links import LINK_CLASSES

STRATEGIES = ("reference", "pipelined", "symm", "fused", "hierarchical")
DEFAULT_CHUNKS = {"shm": 1, "nvlink": 1, "pcie": 2, "network": 2}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to run one op.

    strategy: one of `STRATEGIES`.
    num_chunks: chunks per peer transfer, per link class (``"shm"``, ``"nvlink"``, ``"pcie"``,
        ``"network"``); a ring is chunked for its slowest link, pairwise transfers per peer link.
        Missing classes take `DEFAULT_CHUNKS`.
    block_m, block_n, block_k: tile shape of the ``fused`` kernel (0 = the kernel's default).
    one_shot: all-reduce variant flag (used by ``matmul_all_reduce``).
    migrate: expert migration (the MoE grouped-matmul ops across nodes, `overlap.ops.moe.migration`): pairs
        ``(expert, node)`` (global expert id, node index of the group: nodes ordered by their lowest rank)
        whose tokens on that node are computed there with a copy of the expert's weights, which travel
        instead of the tokens (their gradients travel back). Kept sorted; empty: every token travels.
    """

    strategy: str
    num_chunks: tuple[tuple[str, int], ...] = ()
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    one_shot: bool = False
    migrate: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES} or 'auto', got {self.strategy!r}")
        chunks = self.num_chunks
        if isinstance(chunks, Mapping):
            chunks = tuple(sorted(chunks.items()))
            object.__setattr__(self, "num_chunks", chunks)
        for link, n in chunks:
            if link not in LINK_CLASSES:
                raise ValueError(f"num_chunks: unknown link class {link!r}; known: {LINK_CLASSES}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"num_chunks[{link!r}] must be an int >= 1, got {n!r}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (v and (v < 16 or v & (v - 1))):
                raise ValueError(f"{name} must be 0 (default) or a power of two >= 16, got {v!r}")
        pairs = []
        for pair in self.migrate:
            if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                    or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in pair)):
                raise ValueError(f"migrate: pairs (expert, node) of ints >= 0, got {pair!r}")
            pairs.append((pair[0], pair[1]))
        if len(set(pairs)) != len(pairs):
            raise ValueError(f"migrate: a pair (expert, node) is listed twice in {self.migrate!r}")
        object.__setattr__(self, "migrate", tuple(sorted(pairs)))

    def chunks_for(self, link_class: str) -> int:
        return dict(self.num_chunks).get(link_class, DEFAULT_CHUNKS[link_class])

    def encode(self) -> str:
        """Every field as text, for the string arguments of the ops' custom ops (`decode` reverses it).
        Plain string formatting, so that torch.compile traces it at a call site."""
        chunks = ",".join(f"{k}={v}" for k, v in self.num_chunks)
        return (f"{self.strategy};{chunks};{self.block_m};{self.block_n};{self.block_k};{int(self.one_shot)};"
                f"{_pairs_text(self.migrate)}")

    @classmethod
    def decode(cls, text: str) -> Plan:
        """The plan `encode` wrote."""
        strategy, chunks, bm, bn, bk, one_shot, migrate = text.split(";")
        pairs = tuple((link, int(n)) for link, _, n in (c.partition("=") for c in chunks.split(",") if c))
        return cls(strategy, pairs, int(bm), int(bn), int(bk), one_shot == "1", parse_pairs(migrate))

    def label(self, links: tuple[str, ...] = ()) -> str:
        """Readable text of the plan for people (tables, plots, logs), e.g. ``symm (shm x2)``,
        ``pipelined (shm x4, network x2)``, ``fused (tile 128x128x64, one-shot)``: the chunks per link
        class of `links` (the classes the call's transfers use, default chunks included) and of any class
        set in `num_chunks`. Not part of any signature (`describe` is)."""
        chunks = dict(self.num_chunks)
        classes = [c for c in LINK_CLASSES if c in links or c in chunks]
        parts = [f"{c} x{self.chunks_for(c)}" for c in classes] if self.strategy != "reference" else []
        if self.block_m:
            parts.append(f"tile {self.block_m}x{self.block_n}x{self.block_k}")
        if self.one_shot:
            parts.append("one-shot")
        if self.migrate:
            parts.append(f"migrate {_pairs_text(self.migrate)}")
        return f"{self.strategy} ({', '.join(parts)})" if parts else self.strategy

    def describe(self) -> str:
        """Canonical text of the plan (part of every call signature)."""
        chunks = ",".join(f"{k}={v}" for k, v in self.num_chunks)
        tiles = f",tile={self.block_m}x{self.block_n}x{self.block_k}" if self.block_m else ""
        migrate = f",migrate={_pairs_text(self.migrate)}" if self.migrate else ""
        return f"{self.strategy}[{chunks}{tiles}{',one_shot' if self.one_shot else ''}{migrate}]"


def _pairs_text(pairs: tuple[tuple[int, int], ...]) -> str:
    """``expert@node`` joined by ``+`` (`parse_pairs` reverses it): ``3@1+5@1``."""
    return "+".join(f"{e}@{n}" for e, n in pairs)


def parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """The migration pairs of `_pairs_text` (or of a plan file's ``"3@1+5@1"``); ValueError on bad text."""
    pairs = []
    for item in filter(None, text.split("+")):
        expert, at, node = item.partition("@")
        if not at or not expert.isdigit() or not node.isdigit():
            raise ValueError(f"migrate: expected 'expert@node' items joined by '+', got {text!r}")
        pairs.append((int(expert), int(node)))
    return tuple(pairs)
