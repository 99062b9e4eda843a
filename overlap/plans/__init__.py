"""The plans layer: how a call runs, what it costs, and what was tuned.

* `Plan` (`plan`): strategy, chunks per link class, tiles, variants; part of every call signature.
* the op table (`optable`): one `OpSpec` per op (`OPS`, `op_spec`): family, rows, FLOPs, bytes per link,
  chunked links, cost, strategies; `Problem` of a call, the bytes its transfers move (`wire_sizes`: fp8 calls'
  differ from their dtype's size) (what an op needs to run on made-up data is its
  workload: `overlap.workloads`);
* the cost model (`costmodel`): `Profile` of a machine, `Topology` of a group (both in `machine`), `predict`,
  `candidates`, `rank_candidates`, `default_profile`; expert migration (`migration`): `expected_loads`,
  `measured_loads`, `choose_migration`;
* plan files (`planfile`): `PlanFile`, what `overlap tune` chose per topology;
* ``strategy="auto"`` (`auto`): a plan file's entry, the model's choice, or the default heuristic.
"""

from __future__ import annotations

from .costmodel import (
    CHUNK_CHOICES,
    MODEL_OPS,
    PROFILE_VERSION,
    GemmFit,
    LinkFit,
    Prediction,
    Profile,
    Topology,
    candidates,
    default_profile,
    predict,
    rank_candidates,
    topology_of,
)
from .migration import MIGRATE_OPS, choose_migration, expected_loads, measured_loads
from .optable import FP8_DTYPES, FP8_LEAVES, OPS, OpSpec, Problem, op_spec, ops_of, wire_sizes
from .plan import DEFAULT_CHUNKS, STRATEGIES, Plan
from .planfile import PLAN_FILE_VERSION, Entry, PlanFile

__all__ = [
    "CHUNK_CHOICES",
    "DEFAULT_CHUNKS",
    "FP8_DTYPES",
    "FP8_LEAVES",
    "MIGRATE_OPS",
    "MODEL_OPS",
    "OPS",
    "PLAN_FILE_VERSION",
    "PROFILE_VERSION",
    "STRATEGIES",
    "Entry",
    "GemmFit",
    "LinkFit",
    "OpSpec",
    "Plan",
    "PlanFile",
    "Prediction",
    "Problem",
    "Profile",
    "Topology",
    "candidates",
    "choose_migration",
    "default_profile",
    "expected_loads",
    "measured_loads",
    "op_spec",
    "wire_sizes",
    "ops_of",
    "predict",
    "rank_candidates",
    "topology_of",
]
