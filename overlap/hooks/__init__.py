"""Ways into existing models, without changing their numbers.

* `overlap.hooks.megatron`: Megatron-core-compatible ``ColumnParallelLinear`` and ``RowParallelLinear``
  (`overlap.hooks.megatron_linear`); ``patch(model)`` swaps every Megatron-core layer of those names in a
  built model for them (same parameter tensors), ``unpatch`` restores them; a layer-spec helper builds
  new Megatron-core models with them. Megatron-core is imported when patching or building specs.
* `overlap.hooks.torch_tp`: parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``
  whose linear layers run through the fused ops, in fp8 with ``fp8=`` (a recipe) or as torchao's float8 layers.
* `overlap.hooks.torchao_float8`: the recipe a layer converted by torchao's float8 training
  (``torchao.float8.convert_to_float8_training``) trains with under those styles; torchao is not imported.
* `overlap.hooks.deepspeed_ulysses`: ``UlyssesAttention``, DeepSpeed-Ulysses attention (a model's own q/k/v/o
  ``nn.Linear`` and the local attention it gives ``deepspeed.sequence.layer.DistributedAttention``) run by
  `overlap.matmul_all_to_all` and `overlap.all_to_all_matmul`; DeepSpeed is not imported.

Submodules are imported on use (``import overlap.hooks.megatron``): neither Megatron-core nor torch's
tensor-parallel API is needed to import `overlap`.
"""
