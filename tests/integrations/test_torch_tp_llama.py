"""A batch-first Llama as a client would parallelize it with torch's styles, swapped for overlap's.

The model (token embedding, blocks of RMSNorm, grouped-query attention with separate ``wq``/``wk``/``wv``/``wo``,
a SwiGLU feed-forward ``w1``/``w3``/``w2``, a final norm and the LM head) runs on ``[b, s, h]`` with the sequence
sharded on dim 1, and is parallelized by a plan written against torch's names, the arrangement torchtitan's
``parallelize_llama`` uses: the embedding row-wise (``Replicate()`` in, ``Shard(1)`` out), the norms
``SequenceParallel()``, the attention and feed-forward inputs gathered by ``PrepareModuleInput`` to
``Replicate()``, the column-wise projections behind them, ``wo`` and ``w2`` row-wise with ``Shard(1)`` outputs,
the LM head column-wise from ``Shard(1)`` to ``Replicate()`` logits; the attention takes a second, replicated
input (``None`` layouts), as torchtitan's takes its rotary frequencies. `use_overlap_styles` swaps the styles
(``PrepareModuleInput`` too: its gather is fused into the projections behind it) while the plan runs. A few SGD
steps on CPU ranks: losses, gradient norms, gradients and parameters against torch's styles (``1e-5``) and an
unsharded float64 run (``1e-4``) at every step, and overlap's ops counted: per layer one gather for q/k/v and one
for w1/w3.

Then `PrepareModuleInput` where it cannot fuse everything: a layer behind it called with another input, and one
with no overlap layer behind it, against torch's.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import overlap  # noqa: F401  (before any DTensor op: see test_torch_tp.py)
from tests.support.train_compare import close, compare, full, train

STEPS, BATCH, SEQ, VOCAB, LAYERS, LR = 3, 2, 8, 32, 2, 0.1


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        q = (self.wq(x).view(b, s, -1, self.head_dim) + freqs[:s, None]).transpose(1, 2)  # this rank's heads
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads, kv_heads), FeedForward(dim, hidden)

    def forward(self, x, freqs):
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, layers: int = LAYERS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads, hidden) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        # a second input of the attention, replicated (rotary frequencies in a real Llama; here added to q)
        self.register_buffer("freqs", torch.linspace(-0.5, 0.5, SEQ * (dim // heads)).view(SEQ, dim // heads))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.output(self.norm(h))


def _client() -> types.ModuleType:
    """A parallelizing module as a client writes one: torch's styles imported under their names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp

    client = types.ModuleType("client")
    client.ColwiseParallel, client.RowwiseParallel = tp.ColwiseParallel, tp.RowwiseParallel
    client.SequenceParallel, client.PrepareModuleInput = tp.SequenceParallel, tp.PrepareModuleInput

    def parallelize(model: Llama, mesh) -> Llama:
        c = client
        tp.parallelize_module(model, mesh, {
            "tok_embeddings": c.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": c.SequenceParallel(),
            "output": c.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
        for block in model.layers.values():
            tp.parallelize_module(block, mesh, {
                "attention_norm": c.SequenceParallel(),
                "attention": c.PrepareModuleInput(input_layouts=(Shard(1), None),
                                                  desired_input_layouts=(Replicate(), None)),
                "attention.wq": c.ColwiseParallel(),
                "attention.wk": c.ColwiseParallel(),
                "attention.wv": c.ColwiseParallel(),
                "attention.wo": c.RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": c.SequenceParallel(),
                "feed_forward": c.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": c.ColwiseParallel(),
                "feed_forward.w2": c.RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": c.ColwiseParallel(),
            })
        return model

    client.parallelize = parallelize
    return client






def llama_task(rank, world_size, seed, heads, kv_heads):
    from torch.distributed.device_mesh import DeviceMesh

    from overlap.hooks.torch_tp import use_overlap_styles
    from overlap.ops import library

    mesh = DeviceMesh("cpu", list(range(world_size)))
    torch.manual_seed(seed)
    model = Llama(dim=4 * heads, heads=heads, kv_heads=kv_heads, hidden=8 * heads)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ),
                                                                                   generator=gen))
               for _ in range(STEPS)]
    client = _client()
    exact = train(copy.deepcopy(model).double(), batches, LR)
    theirs = train(client.parallelize(copy.deepcopy(model), mesh), batches, LR)
    ops = ("all_gather_matmul", "matmul_reduce_scatter")
    before = {op: library.CALLS[op] for op in ops}
    with use_overlap_styles(client):
        ours = client.parallelize(copy.deepcopy(model), mesh)
    ours_run = train(ours, batches, LR)
    ran = {op: library.CALLS[op] - before[op] for op in ops}
    compare(ours_run, theirs, exact, f"rank {rank}/{world_size}")
    return ran




@pytest.mark.parametrize("world_size,heads,kv_heads", [(2, 4, 2), (4, 8, 4)])
def test_batch_first_llama_with_swapped_styles_trains_as_torchs(pools, seed, world_size, heads, kv_heads):
    for rank, ran in enumerate(pools(world_size).run(llama_task, seed, heads, kv_heads, timeout=600)):
        # Per step and layer, one gather for q/k/v and one for w1/w3 (the gathers of PrepareModuleInput, fused into
        # the projections behind them), and wo's and w2's scatters; per step, the LM head's gather.
        assert ran == {"all_gather_matmul": (2 * LAYERS + 1) * STEPS,
                       "matmul_reduce_scatter": 2 * LAYERS * STEPS}, (rank, ran)


class TwoPaths(nn.Module):
    """``a`` reads the module's input, ``b`` another tensor made from it: a gather in front may compute ``a``'s
    output but not ``b``'s."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, x):
        return self.a(x) * self.b(x * 2)


def fallback_task(rank, world_size, seed):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp

    from overlap.hooks import torch_tp as ours
    from overlap.ops import library

    mesh = DeviceMesh("cpu", list(range(world_size)))
    torch.manual_seed(seed)
    model = TwoPaths()
    x = torch.randn(2, 2 * world_size, 6).chunk(world_size, 1)[rank]
    g = torch.randn(2, 2 * world_size, 4)
    results = {}
    for name, cols, prep in (("torch", tp.ColwiseParallel, tp.PrepareModuleInput),
                             ("overlap", ours.ColwiseParallel, ours.PrepareModuleInput),
                             ("overlap prepare, torch layers", tp.ColwiseParallel, ours.PrepareModuleInput)):
        m = tp.parallelize_module(copy.deepcopy(model), mesh, {
            "": prep(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
            "a": cols(output_layouts=Replicate()), "b": cols(output_layouts=Replicate())})
        xi = x.clone().requires_grad_()
        before = library.CALLS["all_gather_matmul"]
        y = m(xi)
        (y * g).sum().backward()
        results[name] = (y.detach(), xi.grad, {n: full(p.grad) for n, p in m.named_parameters()},
                         library.CALLS["all_gather_matmul"] - before)
    want = results.pop("torch")
    for name, (y, dx, grads, gathers) in results.items():
        close(y, want[0], want[0].double(), f"rank {rank} {name}: output")
        close(dx, want[1], want[1].double(), f"rank {rank} {name}: input grad")
        for pname, grad in grads.items():
            close(grad, want[2][pname], want[2][pname].double(), f"rank {rank} {name}: {pname}.grad")
        # one gather computing a's output (b's computed anew), or none where no overlap layer is behind it
        assert gathers == (1 if name == "overlap" else 0), (name, gathers)
    return True


def test_prepare_module_input_where_it_cannot_fuse_everything(pools, seed):
    assert pools(2).run(fallback_task, seed, timeout=120) == [True, True]
