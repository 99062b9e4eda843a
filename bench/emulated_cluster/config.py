"""What one run of `bench.emulated_cluster` does (`Config`: rates, ranks per node, repeats, problems, timeouts,
recorded profiles) and its default problems. The parent builds it from the command line; each rank rebuilds
it from the run's spec file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.emulated_cluster.link import parse_rate
from overlap.plans import OPS

#: problems as `overlap.plans.Problem` fields, for 2 ranks per node on 2 CPU cores: a call takes ~10-30 ms
#: and its GEMMs and transfers are comparable somewhere between 100 Mbit/s and 2 Gbit/s. At 100 Mbit/s
#: (~12 MB/s per direction, shared by the 4 rank pairs that cross it) the gather of ``all_gather_matmul``
#: (48 KiB per block, 4 blocks per direction) takes about as long as its GEMMs (~0.14 GFLOP per block);
#: ``matmul_reduce_scatter`` (64 KiB partials) and ``moe`` (dispatch and combine, 32 KiB per peer each)
#: are bound by the link there and balanced nearer 2 Gbit/s.
DEFAULT_PROBLEMS: tuple[dict[str, Any], ...] = (
    {"op": "all_gather_matmul", "m": 64, "k": 192, "n": 5632},
    {"op": "matmul_reduce_scatter", "m": 16, "k": 1024, "n": 1024},
    {"op": "moe", "m": 128, "k": 128, "n": 1024, "experts": 8, "top_k": 2},
)
QUICK_PROBLEMS: tuple[dict[str, Any], ...] = DEFAULT_PROBLEMS[:1]


@dataclasses.dataclass
class Config:
    """One run: every rate in `rates`, the whole comparison each."""

    rates: tuple[str, ...] = ("100mbit", "2gbit")
    ranks_per_node: int = 2
    repeats: int = 3  # interleaved tuner/grid comparisons per problem
    measure: int = 3  # plans the tuner measures besides reference (`tune(measure=...)`)
    tune_repeats: int = 5  # timed calls per plan, tuner and grid alike
    warmup: int = 1
    probe: str = "quick"  # "quick" or "full" (`overlap.tune.probe(quick=...)`)
    problems: tuple[dict[str, Any], ...] = DEFAULT_PROBLEMS
    timeout_s: float = 0.0  # OVERLAP_TIMEOUT_S and the process group's timeout (0: 60 s, 300 s for a full probe)
    deadline_s: float = 900.0  # per rate: the ranks are killed past it
    symm_check: bool = True
    figures: bool = False  # the hierarchical strategy's figures (`figures`) instead of the comparison
    moe_figures: bool = False  # the MoE layer's figures (`moe`) instead of the comparison
    verbose: bool = True  # rank 0's progress lines on stderr
    #: rate -> a recorded `overlap.plans.Profile` (its JSON): that rate's ranks take it instead of probing, so
    #: the model's ranking, and so the plans the tuner measures, are a function of the inputs alone
    profiles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rates = tuple(self.rates)
        for rate in self.rates:
            parse_rate(rate)
        if not self.rates:
            raise ValueError("at least one rate is needed")
        for name in ("ranks_per_node", "repeats", "measure", "tune_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.figures and self.moe_figures:
            raise ValueError("figures and moe_figures are two runs: one at a time")
        if (self.figures or self.moe_figures) and self.ranks_per_node < 2:
            raise ValueError(f"figures need 2 ranks per node at least (hierarchical forwards within a node), "
                             f"got {self.ranks_per_node}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.probe not in ("quick", "full"):
            raise ValueError(f"probe must be 'quick' or 'full', got {self.probe!r}")
        self.problems = tuple(dict(p) for p in self.problems)
        world_size = 2 * self.ranks_per_node
        for p in self.problems:
            if p.get("op") in OPS and OPS[p["op"]].family == "moe" and p.get("experts", 0) % world_size:
                raise ValueError(f"problem {p}: {p.get('experts')} experts do not divide over {world_size} ranks")
        if not self.timeout_s:
            # A full probe ping-pongs 16 MiB messages: at 100 Mbit/s the other ranks wait ~90 s for a pair.
            self.timeout_s = 300.0 if self.probe == "full" else 60.0
        self.profiles = {rate: dict(profile) for rate, profile in self.profiles.items()}
        if set(self.profiles) - set(self.rates):
            raise ValueError(f"profiles for rates {sorted(set(self.profiles) - set(self.rates))} that are not run")
        if self.timeout_s < 0 or self.deadline_s <= 0:
            raise ValueError(f"timeout_s and deadline_s must be > 0, got {self.timeout_s}, {self.deadline_s}")
