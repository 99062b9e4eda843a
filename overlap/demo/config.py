"""The demo's settings: the model's sizes (`ModelConfig`) and the run's (`DemoConfig`). No torch here, so the
command line reads the defaults without loading it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo's model (the defaults train 2 CPU ranks in seconds per run)."""

    vocab: int = 64
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    seq_len: int = 32
    batch: int = 8

    def problems(self, world_size: int) -> list[str]:
        """What does not divide by `world_size` ranks (empty: the model fits)."""
        out = []
        if self.hidden % self.heads:
            out.append(f"hidden size {self.hidden} does not divide by {self.heads} heads")
        for what, size in (("attention heads", self.heads), ("ffn size", self.ffn), ("experts", self.experts),
                           ("sequence length", self.seq_len)):
            if size % world_size:
                out.append(f"{what} ({size}) do not divide by {world_size} ranks" if what.endswith("s")
                           else f"{what} ({size}) does not divide by {world_size} ranks")
        if not 1 <= self.top_k <= self.experts:
            out.append(f"top-k {self.top_k} is not between 1 and the {self.experts} experts")
        return out

    def ranks_that_fit(self, most: int = 8) -> list[int]:
        """The numbers of ranks, up to `most`, the model divides over (`problems`)."""
        return [w for w in range(1, most + 1) if not self.problems(w)]

    def fitted(self, world_size: int) -> ModelConfig:
        """The model with the least larger sizes that divide over `world_size` ranks: heads, ffn size, experts and
        sequence length rounded up to multiples of `world_size`, the hidden size up to a multiple of the heads (the
        top-k as it is: `problems` may still name it)."""

        def up(size: int, multiple: int) -> int:
            return -(-size // multiple) * multiple

        heads = up(self.heads, world_size)
        return dataclasses.replace(self, heads=heads, hidden=up(self.hidden, heads), ffn=up(self.ffn, world_size),
                                   experts=up(self.experts, world_size), seq_len=up(self.seq_len, world_size))


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """One ``overlap demo``: the model, the training and overlap's strategy."""

    model: ModelConfig = ModelConfig()
    steps: int = 30
    lr: float = 1e-2
    seed: int = 0
    strategy: str = "auto"
    timeout: float | None = None
    progress: bool = True
