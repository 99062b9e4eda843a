"""A few training steps of a model parallelized two ways and unparallelized in float64, compared step by step
(tests/integrations/test_torch_tp_llama.py, tests/integrations/test_torchtitan.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def full(t):
    """A ``DTensor``'s whole tensor; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _name(name: str) -> str:
    """A parameter's name as the uncompiled model has it (``torch.compile`` wraps a module as ``_orig_mod``)."""
    return name.replace("_orig_mod.", "")


def train(model, batches, lr: float):
    """SGD steps on ``(tokens, targets)`` batches: per step ``(loss, grad norm, {name: grad})``, then ``{name:
    parameter}`` (whole tensors). ``DTensor`` logits (loss parallel) go through torch's ``loss_parallel()``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    steps = []
    for tokens, targets in batches:
        opt.zero_grad()
        logits = model(tokens)
        with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
        grads = {_name(n): full(p.grad).detach().clone() for n, p in model.named_parameters()}
        norm = torch.stack([g.double().norm() for g in grads.values()]).norm()
        steps.append((full(loss).detach().double(), norm, grads))
        opt.step()
    return steps, {_name(n): full(p.detach()).clone() for n, p in model.named_parameters()}


def train_sharded_data(model, batches, lr: float, dp_group, dp_rank: int, dp_size: int):
    """`train` as torchtitan's trainer runs data parallelism under FSDP2 (which sums the gradients over the data
    ranks): each data rank takes its share of every batch's rows and divides its summed loss by the batch's tokens,
    so the gradients are the whole batch's mean loss's; the loss reported is that mean (summed over the data ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    steps = []
    for tokens, targets in batches:
        opt.zero_grad()
        mine = slice(dp_rank * tokens.shape[0] // dp_size, (dp_rank + 1) * tokens.shape[0] // dp_size)
        logits = model(tokens[mine])
        with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[mine].flatten(), reduction="sum")
            loss = loss / targets.numel()
            loss.backward()
        grads = {_name(n): full(p.grad).detach().clone() for n, p in model.named_parameters()}
        norm = torch.stack([g.double().norm() for g in grads.values()]).norm()
        total = full(loss).detach().double().clone()
        dist.all_reduce(total, group=dp_group)
        steps.append((total, norm, grads))
        opt.step()
    return steps, {_name(n): full(p.detach()).clone() for n, p in model.named_parameters()}


def close(ours, torchs, exact, what: str) -> None:
    """Within 1e-5 of torch's styles and 1e-4 of the unparallelized float64 run."""
    for want, tol, whose in ((torchs, 1e-5, "torch's styles"), (exact, 1e-4, "the float64 run")):
        err = (ours.double() - want.double()).abs().max().item()
        torch.testing.assert_close(ours.double(), want.double(), rtol=tol, atol=tol,
                                   msg=f"{what} vs {whose}: max abs err {err:.3g}")


def compare(ours, theirs, exact, ctx: str) -> None:
    """`train`'s results of overlap's run against torch's and the float64 one: every step's loss, gradient norm and
    gradients, then the parameters."""
    (o_steps, o_params), (t_steps, t_params), (e_steps, e_params) = ours, theirs, exact
    for i, ((lo, no, go), (lt, nt, gt), (le, ne, ge)) in enumerate(zip(o_steps, t_steps, e_steps, strict=True)):
        for what, o, t, e in (("loss", lo, lt, le), ("grad norm", no, nt, ne),
                              *((f"{name}.grad", g, gt[name], ge[name]) for name, g in go.items())):
            close(o, t, e, f"{ctx} step {i}: {what}")
    for name, p in o_params.items():
        close(p, t_params[name], e_params[name], f"{ctx}: {name} after the steps")
