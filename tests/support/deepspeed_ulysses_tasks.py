"""Rank tasks of tests/integrations/test_deepspeed_ulysses.py: DeepSpeed's own ``DistributedAttention`` between a
user's projections against `overlap.hooks.deepspeed_ulysses.UlyssesAttention` adopting the same ``nn.Linear``.

The ranks run in pools of their own, with ``DS_ACCELERATOR=cpu`` and a ``TORCH_EXTENSIONS_DIR`` of the test's: every
task first calls `setup`, which wraps the pool's gloo group in DeepSpeed's communication backend
(``deepspeed.init_distributed``) with DeepSpeed's shared-memory op build (a g++ JIT build of ``deepspeed_shm_comm``,
which Ulysses does not use) turned off. DeepSpeed is real, never mocked.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.support.tp_oracle import expect_error

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16_REL = 2e-2  # relative norm of the error
SCALE = 0.3  # a softmax scale given to the local attention as a keyword, through both layers


def setup() -> None:
    """DeepSpeed's communication backend over the pool's process group (once per rank process), without the JIT
    build of its shared-memory all-reduce op."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    if ds_comm.cdb is not None:
        return
    # ``import deepspeed.comm.torch`` would bind the real torch (deepspeed.comm has an attribute ``torch``)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def facts(rank: int, world_size: int) -> dict:
    """What the rank's DeepSpeed is and built: version, accelerator, backend, whether a shm op exists, and what
    lies in ``TORCH_EXTENSIONS_DIR``."""
    setup()
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    ext = os.environ["TORCH_EXTENSIONS_DIR"]
    return {"version": deepspeed.__version__, "accelerator": get_accelerator()._name,
            "cdb": type(ds_comm.cdb).__name__, "shm_op": getattr(ds_comm.cdb, "shm_comm_op", "absent"),
            "extensions_dir": ext, "built": sorted(os.listdir(ext)) if os.path.isdir(ext) else []}


class CoreAttention(torch.nn.Module):
    """A DeepSpeed-Ulysses user's local attention, as given to ``DistributedAttention``: ``q`` ``[s, b, h, d]`` (or
    batch-first ``[b, s, h, d]``), ``k``, ``v`` with fewer heads under GQA, causal SDPA with ``enable_gqa``; records
    the shapes and arguments of each call."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.calls: list[tuple] = []

    def forward(self, q, k, v, causal=True, *, scale=None):
        self.calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), causal, scale))
        to, back = ((0, 2, 1, 3), (0, 2, 1, 3)) if self.batch_first else ((1, 2, 0, 3), (2, 0, 1, 3))
        q, k, v = (t.permute(to) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return ctx.permute(back)


@dataclasses.dataclass(frozen=True)
class Case:
    """Head counts per rank of the sequence-parallel group (``sp`` ranks, or the world when None)."""

    name: str
    heads_per: int
    kv_per: int
    head_dim: int
    hidden: int
    bias: bool
    batch_first: bool
    causal: bool = True
    s_per: int = 3
    batch: int = 2
    dtype: torch.dtype = torch.float32
    sp: int | None = None
    constructor: bool = False  # UlyssesAttention(...) instead of from_distributed_attention


CASES = [
    Case("mha-seq-bias", 2, 2, 4, 12, bias=True, batch_first=False),
    Case("gqa2-batchfirst", 2, 1, 3, 10, bias=False, batch_first=True, s_per=4, constructor=True),
    Case("gqa4-seq", 4, 1, 4, 8, bias=True, batch_first=False, causal=False),
    Case("mha-batchfirst-bias", 1, 1, 5, 8, bias=True, batch_first=True, batch=3),
    Case("gqa2-seq-bf16", 2, 1, 4, 16, bias=True, batch_first=False, dtype=torch.bfloat16),
    Case("gqa2-seq-sp2", 2, 1, 4, 12, bias=True, batch_first=False, sp=2),  # two groups of 2 at world size 4
]

_GROUPS: dict[tuple[int, int], list] = {}


def _group(rank: int, world_size: int, sp: int | None) -> tuple[object, int, int]:
    """``(group, index of this rank's group, its size)``: the world, or consecutive groups of `sp` ranks (made once,
    on every rank in the same order)."""
    if sp is None or sp == world_size:
        return dist.group.WORLD, 0, world_size
    key = (world_size, sp)
    if key not in _GROUPS:
        _GROUPS[key] = [dist.new_group(list(range(i, i + sp))) for i in range(0, world_size, sp)]
    return _GROUPS[key][rank // sp], rank // sp, sp


def run_cases(rank: int, world_size: int, strategy: str, seed: int) -> list[str]:
    """Every case that fits the world size: outputs and gradients of the two layers compared on this rank."""
    setup()
    done = []
    for case in CASES:
        if case.sp is not None and (case.sp >= world_size or world_size % case.sp):
            continue
        _compare(rank, world_size, case, strategy, seed)
        done.append(case.name)
    return done


def _compare(rank: int, world_size: int, case: Case, strategy: str, seed: int) -> None:
    from deepspeed.sequence.layer import DistributedAttention

    from overlap.hooks.deepspeed_ulysses import UlyssesAttention

    group, index, W = _group(rank, world_size, case.sp)
    sp_rank = dist.get_rank(group)
    H, Hkv, d = case.heads_per * W, case.kv_per * W, case.head_dim
    torch.manual_seed(seed)  # the same projections on every rank (replicated, as in Ulysses)
    q_proj, k_proj, v_proj, o_proj = projs = (
        torch.nn.Linear(case.hidden, H * d, bias=case.bias, dtype=case.dtype),
        torch.nn.Linear(case.hidden, Hkv * d, bias=case.bias, dtype=case.dtype),
        torch.nn.Linear(case.hidden, Hkv * d, bias=case.bias, dtype=case.dtype),
        torch.nn.Linear(H * d, case.hidden + 1, bias=case.bias, dtype=case.dtype))
    gen = torch.Generator().manual_seed(seed * 7 + index)  # one whole sequence per sequence-parallel group
    s = case.s_per * W
    x_full = torch.randn(s, case.batch, case.hidden, generator=gen).to(case.dtype)
    g_full = torch.randn(s, case.batch, case.hidden + 1, generator=gen).to(case.dtype)
    rows = slice(sp_rank * case.s_per, (sp_rank + 1) * case.s_per)
    x, g = x_full[rows], g_full[rows]
    if case.batch_first:
        x, g = x.transpose(0, 1).contiguous(), g.transpose(0, 1).contiguous()

    core = CoreAttention(case.batch_first)
    dist_attn = DistributedAttention(core, group, scatter_idx=2, gather_idx=1 if case.batch_first else 0)
    batch_dim_idx = 0 if case.batch_first else 1

    def deepspeed_layer(x):  # the user's model: projections around DeepSpeed's layer
        q = q_proj(x).unflatten(-1, (H, d))
        k, v = (p(x).unflatten(-1, (Hkv, d)) for p in (k_proj, v_proj))
        return o_proj(dist_attn(q, k, v, batch_dim_idx, None, case.causal, scale=SCALE).flatten(-2))

    ops = dict(heads=H, kv_heads=Hkv, batch_first=case.batch_first, strategy=strategy)
    if case.constructor:
        ours = UlyssesAttention(q_proj, k_proj, v_proj, o_proj, core, group, **ops)
    else:
        ours = UlyssesAttention.from_distributed_attention(dist_attn, q_proj, k_proj, v_proj, o_proj, **ops)
    ctx = f"{case.name} rank {rank}/{world_size} SP {W} {strategy}"
    # the user's parameters stay theirs: the same modules, nothing registered in the adapter but the local attention
    assert all(a is b for a, b in zip((ours.q_proj, ours.k_proj, ours.v_proj, ours.o_proj), projs, strict=True)), ctx
    assert list(ours.parameters()) == [] and ours.state_dict() == {}, ctx
    assert ours.local_attn is core and dict(ours.named_children()) == {"local_attn": core}, ctx

    results = []
    for layer in (deepspeed_layer, ours):
        xi = x.clone().requires_grad_(True)
        y = layer(xi) if layer is deepspeed_layer else layer(xi, case.causal, scale=SCALE)
        y.backward(g)
        grads = {f"{n}.{p}": getattr(m, p).grad for n, m in zip(("q", "k", "v", "o"), projs, strict=True)
                 for p in ("weight", "bias") if getattr(m, p) is not None}
        results.append((y.detach(), xi.grad, grads))
        for m in projs:
            m.zero_grad(set_to_none=True)
    assert core.calls[0] == core.calls[1], (ctx, core.calls)  # the local attention saw the same shapes and arguments
    (y_ds, gx_ds, grads_ds), (y_ov, gx_ov, grads_ov) = results
    assert y_ov.shape == x.shape[:2] + (case.hidden + 1,) and y_ov.dtype == case.dtype, (ctx, y_ov.shape, y_ov.dtype)
    _close(y_ov, y_ds, f"{ctx} output")
    _close(gx_ov, gx_ds, f"{ctx} input gradient")
    for name, want in grads_ds.items():
        got = grads_ov[name]
        if name in ("q.bias", "k.bias", "v.bias"):  # per rank, another share: the same sum over the group
            got, want = got.clone(), want.clone()
            dist.all_reduce(got, group=group)
            dist.all_reduce(want, group=group)
        # k's bias adds q.b_k to every key's score of a query: softmax cancels it, its gradient is rounding noise,
        # measured against the value bias's gradient
        scale = grads_ds["v.bias"].double().norm() if name == "k.bias" else None
        _close(got, want, f"{ctx} {name} gradient", scale)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, scale: torch.Tensor | None = None) -> None:
    """fp32: within `FP32`; bf16: relative norm of the error below `BF16_REL` (relative to `scale` when given)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32, msg=lambda m: f"{what}: {m}")
        return
    err = (got.double() - want.double()).norm() / (want.double().norm() if scale is None else scale).clamp_min(1e-12)
    assert err < BF16_REL, (what, float(err))


def refusals(rank: int, world_size: int) -> dict:
    """``expect_error`` of each wrong construction and call, then a good call on the same group."""
    setup()
    from deepspeed.sequence.layer import DistributedAttention

    from overlap.hooks.deepspeed_ulysses import UlyssesAttention

    def lin(i, o):
        return torch.nn.Linear(i, o, bias=False)

    def build(H, Hkv, d=4, hidden=8, **kw):
        projs = kw.pop("projs", None) or (lin(hidden, H * d), lin(hidden, Hkv * d), lin(hidden, Hkv * d),
                                          lin(H * d, hidden))
        return UlyssesAttention(*projs, kw.pop("local_attn", CoreAttention(False)), heads=H, kv_heads=Hkv, **kw)

    out = {
        "uneven_kv": expect_error(build, 6, 3),
        "uneven_heads": expect_error(build, 3, 1),
        "kv_from_dist_attn": expect_error(
            UlyssesAttention.from_distributed_attention,
            DistributedAttention(CoreAttention(False), dist.group.WORLD, num_kv_heads=3),
            lin(8, 24), lin(8, 12), lin(8, 12), lin(24, 8), heads=6),
        "heads_by_kv": expect_error(build, 6, 4),
        "k_features": expect_error(build, 4, 2, projs=(lin(8, 16), lin(8, 12), lin(8, 8), lin(16, 8))),
        "o_features": expect_error(build, 4, 2, projs=(lin(8, 16), lin(8, 8), lin(8, 8), lin(12, 8))),
        "q_by_heads": expect_error(build, 4, 2, projs=(lin(8, 18), lin(8, 8), lin(8, 8), lin(18, 8))),
        "not_linear": expect_error(build, 4, 2, projs=(lin(8, 16), lin(8, 8), torch.nn.Identity(), lin(16, 8))),
        "not_callable": expect_error(build, 4, 2, local_attn=3),
        "hierarchical": expect_error(build, 4, 2, strategy="hierarchical"),
        "scatter_idx": expect_error(
            UlyssesAttention.from_distributed_attention,
            DistributedAttention(CoreAttention(False), dist.group.WORLD, scatter_idx=1),
            lin(8, 16), lin(8, 8), lin(8, 8), lin(16, 8), heads=4, kv_heads=2),
    }
    torch.manual_seed(0)
    attn = build(4, 2)
    bad = torch.randn(3, 2, 9 if rank == 0 else 8)  # a wrong hidden on rank 0 only: its peers told at once
    out["x_hidden_on_rank_0"] = expect_error(attn, bad)
    wrong = build(4, 2, local_attn=lambda q, k, v: q[:-1])
    out["local_attn_shape"] = expect_error(wrong, torch.randn(3, 2, 8))

    def good():
        y = attn(torch.randn(3, 2, 8))
        assert y.shape == (3, 2, 8), y.shape

    out["then_ok"] = expect_error(good)
    return out
