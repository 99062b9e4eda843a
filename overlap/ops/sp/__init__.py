"""The sequence-parallel ops (DeepSpeed-Ulysses style attention): the two all-to-alls that swap a sequence shard for
a shard of the heads around attention, each fused with the projection that produces or consumes it.

* `matmul_all_to_all`: ``x @ w`` (the QKV projections) of this rank's sequence shard, each destination's heads sent
  while the next destination's are computed; returns this rank's heads for the whole sequence;
* `all_to_all_matmul`: ``all_to_all(ctx) @ w_o`` (the output projection), each peer's block of the sequence
  multiplied by its rows of ``w_o`` as it lands.

What both share: the call's checks, plan and signature (`entry`) and the per-destination transfers with their GEMMs
(`heads`). The family imports neither of the others (``ops/tp``, ``ops/moe``).
"""
