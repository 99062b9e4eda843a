"""The fused operations, by family: the tensor-parallel ops in `overlap.ops.tp`, the MoE ops in `overlap.ops.moe`
(re-exported by `overlap.moe`); each op's module docstring states its problem, strategies, autograd and
concurrency rules. Import the functions from `overlap` (``overlap.all_gather_matmul``) or `overlap.moe`.

What every op shares sits here:

* `context`: the call context (`CallContext`: group, facts, plan, deadline, op, signature) and its handshake;
* `library`: the custom-op plumbing (``torch.library`` registration, keys of what a forward keeps for its backward);
* `fused`: the Triton kernels' import and the check that ``fused`` can run here;
* `fp8`: quantizing (`quantize_fp8`), the checks of an op's scales, the scaled GEMM;
* `hierarchical`: groups that span nodes, for every family: the group's nodes (`hierarchical.nodes`), the agreement
  across nodes (`hierarchical.agreement`: every strategy's handshake there), and the ``hierarchical`` strategy's
  call on each node's heap (`hierarchical.node_call`).

The families never import each other.
"""
