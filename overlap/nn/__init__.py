"""Drop-in torch modules whose collectives run through `overlap`'s ops.

* `ColumnParallelLinear`, `RowParallelLinear` (`overlap.nn.linear`): tensor-parallel linear layers in
  plain torch (``nn.Linear``'s arguments plus ``group``, ``sequence_parallel``, ...), returning a tensor.
  The Megatron-core-compatible layers of the same names are `overlap.hooks.megatron`'s. ``fp8="rowwise" |
  "tensorwise" | "mxfp8"`` (or an `overlap.Fp8Recipe`) trains them with that fp8 recipe on every path
  (`overlap.nn.fp8_linear`).
* `ExpertParallelMLP` (`overlap.nn.moe`): a top-k routed MoE MLP with its experts over an expert-parallel group
  (its experts in fp8: not yet).
* `ShardedLinear` (`overlap.nn.sharded`): an ``nn.Linear`` whose weight and bias are sharded by rows over a
  data-parallel group (FSDP / ZeRO-3), gathered behind the GEMM by `overlap.all_gather_weight_matmul`.
* `SequenceParallelAttention` (`overlap.nn.attention`): DeepSpeed-Ulysses attention over a sequence-parallel group
  (q/k/v/o projections, GQA, causal or not), its all-to-alls overlapped with the projections by
  `overlap.matmul_all_to_all` and `overlap.all_to_all_matmul`.
"""

from .attention import SequenceParallelAttention
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ExpertParallelMLP
from .sharded import ShardedLinear

__all__ = ["ColumnParallelLinear", "ExpertParallelMLP", "RowParallelLinear", "SequenceParallelAttention",
           "ShardedLinear"]
