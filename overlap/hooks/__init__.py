"""Ways into existing models, without changing their numbers.

* `overlap.hooks.megatron`: ``patch(model)`` swaps every Megatron-core ``ColumnParallelLinear`` and
  ``RowParallelLinear`` of a built model for `overlap.nn`'s (same parameter tensors), ``unpatch``
  restores them; a layer-spec helper builds new Megatron-core models with them.
* `overlap.hooks.torch_tp`: parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``
  whose linear layers run through the fused ops.

Submodules are imported on use (``import overlap.hooks.megatron``): neither Megatron-core nor torch's
tensor-parallel API is needed to import `overlap`.
"""
