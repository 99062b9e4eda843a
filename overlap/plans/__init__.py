"""The plans layer: how a call runs, what it costs, and what was tuned.

* `Plan` (`plan`): strategy, chunks per link class, tiles, variants; part of every call signature.
* the op table (`optable`): one `OpSpec` per op (`OPS`, `op_spec`): family, rows, FLOPs, bytes per link,
  chunked links, cost, strategies; `Problem` of a call, the bytes its transfers move (`wire_sizes`,
  `gathered_row_bytes`, the MoE dispatch's `moe_row_bytes` and `dispatch_row_bytes`: fp8 calls' differ from their
  dtype's size; an MX call's dtype is `MX_DTYPE`, `fp8_dtype`)
  (what an op needs to run on made-up data is its workload: `overlap.workloads`);
* the cost model (`costmodel`): `Profile` of a machine, `Topology` of a group (both in `machine`), `predict`,
  `candidates`, `rank_candidates`, `default_profile`; expert migration (`migration`): `expected_loads`,
  `measured_loads`, `choose_migration`;
* plan files (`planfile`): `PlanFile`, what `overlap tune` chose per topology;
* ``strategy="auto"`` (`auto`): a plan file's entry, the model's choice, or the default heuristic.

The names below are imported on first use (PEP 562), so that the op table (`optable`) and `Plan` (`plan`), which
import no torch, serve the command line before torch loads; the cost model and plan files import it.
"""

from .. import lazy as _lazy

#: public name -> the submodule defining it
_LAZY = {
    **dict.fromkeys(("CHUNK_CHOICES", "MODEL_OPS", "PROFILE_VERSION", "GemmFit", "LinkFit", "Prediction", "Profile",
                     "Topology", "candidates", "default_profile", "predict", "rank_candidates", "topology_of"),
                    "costmodel"),
    **dict.fromkeys(("MIGRATE_OPS", "choose_migration", "expected_loads", "measured_loads"), "migration"),
    **dict.fromkeys(("FP8_DTYPES", "FP8_LEAVES", "MX_DTYPE", "OPS", "OpSpec", "Problem", "dispatch_row_bytes",
                     "fp8_dtype", "fp8_granularity", "gathered_row_bytes", "moe_row_bytes", "op_spec", "ops_of",
                     "wire_sizes"), "optable"),
    **dict.fromkeys(("DEFAULT_CHUNKS", "STRATEGIES", "Plan"), "plan"),
    **dict.fromkeys(("PLAN_FILE_VERSION", "Entry", "PlanFile"), "planfile"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
