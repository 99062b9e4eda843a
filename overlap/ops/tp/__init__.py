"""The tensor-parallel ops: `all_gather_matmul`, `matmul_reduce_scatter`, `matmul_all_reduce` (Megatron's column-
and row-parallel layers with sequence parallelism) and `all_gather_weight_matmul` (the weight-side gather of
FSDP), one module each (the public function, its custom op, its autograd).

What they share: `entry` (checks, plan, signature, the custom-op schema and autograd plumbing), `gather_gemm`
(the all-gather and its chunk GEMMs: `all_gather_matmul`'s forward, `matmul_reduce_scatter`'s input gradient),
`scatter_gemm` (each destination's GEMM scattered and summed: `matmul_reduce_scatter`'s forward,
`all_gather_matmul`'s input gradient, `matmul_all_reduce`'s two-shot half), `gather` (the row gathers),
`shard_ring` and `grad_ring` (the weight gather's rings), `sums` (sums in a fixed order), `operands` (a GEMM's
operands: plain, fp8 with scales, several weights), `rows` (which rows of the gathered or scattered tensor a chunk
is, any gather or scatter dim), `hierarchical_gather`, `hierarchical_reduce` and `hierarchical_weight` (the
``hierarchical`` strategy on groups that span nodes; what it shares with the MoE ops: `overlap.ops.hierarchical`),
`collectives` (the plain collectives with autograd that the linear layers use).
"""
