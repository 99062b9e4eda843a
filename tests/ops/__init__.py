"""The tensor-parallel ops on CPU ranks: every strategy, fp8, batch-first, autocast, compile, backward overlap,
hierarchical groups, the steady state."""
