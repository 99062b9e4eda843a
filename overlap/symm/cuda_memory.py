"""The CUDA backing of the symmetric heap: torch's symmetric memory for the data slots and the fused kernels'
device flag words. Compiled and imported everywhere, run only on GPUs (`overlap.symm.heap.SymmHeap` creates
them with its first data heap on a GPU rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import envs, rendezvous, world
from .layout import CTRL_WORDS


def cuda_data(group: dist.ProcessGroup, nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's view of `nbytes` of symmetric memory on `device` (a rendezvous over `group`)."""
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(local, group)
    rank = dist.get_rank(group)
    return [local if p == rank else handle.get_buffer(p, (nbytes,), torch.uint8)
            for p in range(dist.get_world_size(group))]


class CudaFlags:
    """Device flag words (same layout as the control pad's slot area) in symmetric memory."""

    def __init__(self, group: dist.ProcessGroup, world_size: int):
        self.tensors = cuda_data(group, CTRL_WORDS * 4, world.group_device(group))
        self.tensors[dist.get_rank(group)].zero_()
        torch.cuda.synchronize()
        rendezvous.exchange(group, "cuda-flags", None, envs.timeout_s())

    def addrs(self, word: int) -> list[int]:
        return [t.data_ptr() + 4 * word for t in self.tensors]
