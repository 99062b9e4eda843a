"""Megatron's parallel state torn down with its process groups (`reset`).

``parallel_state.destroy_model_parallel()`` forgets Megatron's groups but destroys only a few of its gloo groups.
The test ranks are pooled and live through the whole suite, and every ``initialize_model_parallel`` makes a dozen
groups, each with gloo's threads and sockets: left alive, they pile up over the Megatron tests (over a thousand
threads a rank), gloo's loops spin, and a 2-core machine stalls.
"""

from __future__ import annotations

from typing import Any


def reset(ps: Any) -> None:
    """Destroy Megatron's parallel state `ps` (``megatron.core.parallel_state``) and every group it made on this rank
    (its overlap heaps released first). A no-op where it is not initialized."""
    import torch.distributed as dist

    import overlap

    groups = [g for g in (getattr(ps, "_global_process_group_list", None) or []) if g is not None]
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # (destroys some of its gloo groups itself)
    for group in groups:
        overlap.release(group)
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # destroyed already
            pass
