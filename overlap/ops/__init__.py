"""The fused operations, by family: the tensor-parallel ops in `overlap.ops.tp`, the MoE ops in `overlap.ops.moe`
(re-exported by `overlap.moe`); each op's module docstring states its problem, strategies, autograd and
concurrency rules. Import the functions from `overlap` (``overlap.all_gather_matmul``) or `overlap.moe`.

What every op shares sits here: the call context and its handshake (`context`), the custom-op plumbing
(`library`), the Triton kernels' import (`fused`), and the layout and failure rules of groups that span nodes
(`nodes`). The families never import each other.
"""
