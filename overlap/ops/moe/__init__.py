"""The MoE ops (re-exported by `overlap.moe`): `dispatch` and `dispatch_grouped_matmul` (tokens to their
experts' ranks, optionally times the experts' first weight) in `dispatch`; `combine` and `grouped_matmul_combine`
(expert results back to their tokens, weighted and summed, optionally times the second weight) in `combine`.

What they share: the two directions' transfers, `to_experts` (dispatch's forward, combine's backward) and
`to_sources` (combine's forward, dispatch's backward); `layout` (the routing's layout, the row orders, the heap
slot's regions); `entry` (the checks, routing, plan, signatures and the counts' exchange); `grouped` (the grouped
GEMMs on the host); `handle` (the handle a dispatch returns); `bound` (``max_tokens_per_rank``: static shapes);
`migration` (expert migration across nodes; which experts: `overlap.plans.migration`); `hierarchical` (groups
that span nodes); `fp8` (the dispatch's fp8 tokens, packed with their scales, and the experts' scaled GEMMs);
`cuda` (the CUDA all-to-all kernels' tables). The fused grouped GEMMs' tile tables are beside
their launchers (`overlap.kernels.dispatch_grouped_matmul`, `overlap.kernels.grouped_matmul_combine`).
"""
