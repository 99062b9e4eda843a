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
