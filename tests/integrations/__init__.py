"""The clients: Megatron-core, torch's tensor parallelism, torchtitan, and overlap.nn's layers and modules."""
