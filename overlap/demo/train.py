"""The demo's training on the ranks: the same model, seed and data, once with torch's styles, once with overlap's.

Both runs train side by side, one step of each in turn (their order alternating every step), so the
step-time comparison sees the same machine state. A step is: forward, the mean cross-entropy of the next
token over every rank's tokens, backward, the sum over ranks of the replicated parameters' gradients
(`model.replicated_parameters`, one all-reduce of them all), an optimizer step. Its time is the slowest
rank's, between barriers. Step 0 is a warm-up (first calls set up heaps, plans and caches): it is not
timed, and on CPU ranks it is where the peak memory of each run is measured (torch's profiler: the
largest sum of live tensor bytes allocated on the rank's main thread during the step, above what was
live before it; the symmetric heap and the copy engine's thread are not counted). On GPUs the peak is
``torch.cuda.max_memory_allocated`` over every step, less what was allocated before the step.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..progress import ProgressBar
from . import data, memory
from .config import DemoConfig
from .model import build, replicated_parameters

#: the two runs, in the order they are reported
RUNS = ("torch", "overlap")


class _Run:
    """One of the two runs: its model, optimizer, losses, step times and peak memory."""

    def __init__(self, kind: str, cfg: DemoConfig, mesh):
        self.kind = kind
        self.model = build(cfg.model, kind, cfg.strategy, cfg.seed, mesh, cfg.timeout)
        self.replicated = replicated_parameters(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0, foreach=False)
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.peak_bytes = 0

    def _reduce_replicated_grads(self) -> None:
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def step(self, tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """One training step on ``[s + 1, b]`` tokens; returns this rank's share of the loss (a 0-d tensor)."""
        inputs, targets = tokens[:-1], tokens[1:].chunk(world_size, dim=0)[rank]
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        loss = loss / targets.numel() / world_size  # the mean over every rank's tokens, summed over ranks
        loss.backward()
        self._reduce_replicated_grads()
        self.opt.step()
        return loss.detach()


def _timed(run: _Run, tokens: torch.Tensor, rank: int, world_size: int, device: torch.device,
           profile: bool) -> tuple[float, float]:
    """(the step's loss over all ranks, the slowest rank's seconds) of one step of `run`."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    if profile:
        box = []
        run.peak_bytes = memory.peak_bytes(lambda: box.append(run.step(tokens, rank, world_size)))
        loss = box[0]
    else:
        loss = run.step(tokens, rank, world_size)
    if cuda:
        torch.cuda.synchronize()
        run.peak_bytes = max(run.peak_bytes, torch.cuda.max_memory_allocated() - base)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    total = loss.reshape(1).to(torch.float64)
    dist.all_reduce(total)
    return float(total), float(seconds)


def train(cfg: DemoConfig) -> dict[str, Any]:
    """Both runs on this rank (every rank of the world calls it); returns the results (the same on every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    problems = cfg.model.problems(world_size)
    if problems:
        raise ValueError("the demo's model does not fit these ranks: " + "; ".join(problems))
    mesh = DeviceMesh(device.type, list(range(world_size)))
    m = cfg.model
    tokens = data.batches(m.vocab, m.seq_len, m.batch, cfg.steps, cfg.seed).to(device)
    runs = {kind: _Run(kind, cfg, mesh) for kind in RUNS}
    bar = ProgressBar(enabled=cfg.progress and rank == 0, total=cfg.steps)
    for i in range(cfg.steps):
        order = RUNS if i % 2 == 0 else RUNS[::-1]
        for kind in order:
            loss, seconds = _timed(runs[kind], tokens[i], rank, world_size, device, profile=i == 0 and not on_gpu)
            runs[kind].losses.append(loss)
            if i > 0:
                runs[kind].step_s.append(seconds)
        r = runs
        bar.update((i + 1) / cfg.steps, f"step {i + 1}: loss torch {r['torch'].losses[-1]:.4f} "
                                        f"overlap {r['overlap'].losses[-1]:.4f}")
    bar.finish(f"{cfg.steps} steps")
    return {
        "world_size": world_size,
        "device": "cuda" if on_gpu else "cpu",
        "strategy": cfg.strategy,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "lr": cfg.lr,
        "model": dataclasses.asdict(m),
        "entropy_rate": data.entropy_rate(m.vocab, cfg.seed),
        "memory_method": ("torch.cuda.max_memory_allocated, every step" if on_gpu
                          else "torch profiler, step 0, main thread (symmetric heap not counted)"),
        "runs": {kind: {"losses": run.losses, "step_s": run.step_s, "peak_bytes": run.peak_bytes}
                 for kind, run in runs.items()},
    }


def train_rank(cfg: DemoConfig, out_path: str | None) -> dict[str, Any]:
    """`train` on this rank; rank 0 writes the results to `out_path` (for the parent of local ranks)."""
    results = train(cfg)
    if out_path and dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    return results
